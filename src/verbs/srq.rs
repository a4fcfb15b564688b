//! A shared receive queue's receives on the device: one `ibv_srq` per pool, in the protection
//! domain of the device its first verbs connection uses (a pool serves one device), shared by
//! the queue pairs of every connection accepted with the pool.
//!
//! Each receive posted to it gets a slot here that keeps its region alive and its `wr_id`
//! until its completion comes, on the queue pair that took it, through the device CQ
//! (`dispatch.rs`: a work-request id with the bits `conn::POOL_WR` set names the slot, not a
//! connection's ledger). Toward its peers a connection with a pool speaks no receive
//! credits: like any verbs SRQ, a message that finds the pool empty is retried by the peer's
//! device (receiver-not-ready, with the peer's `rnr_retry_count`; 7, the default, retries
//! without limit on conforming devices).

use std::io;
use std::sync::{Arc, Mutex};

use rdma_sys as sys;

use crate::conn::{PoolDevice, PooledRecv, SrqInner};
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::verbs::res::{Pd, post_error};

/// A pool's receives on one device.
pub(crate) struct DevicePool {
    pub(super) raw: *mut sys::ibv_srq,
    pd: Arc<Pd>,
    /// The bits every receive's work-request id carries, beside its slot.
    wr_base: u64,
    /// The receives on the device, by slot: the caller's `wr_id` and the region, held until
    /// the receive's completion.
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    taken: Vec<Option<(u64, Arc<MemoryRegion>)>>,
    free: Vec<u32>,
}

// SAFETY: the SRQ is a kernel object handle; posting to it is thread-safe in libibverbs, and it
// is destroyed once, on drop, after every queue pair using it (each holds this pool).
unsafe impl Send for DevicePool {}
// SAFETY: as above.
unsafe impl Sync for DevicePool {}

impl DevicePool {
    /// The device queue of `pool` in `pd`, holding `posted` (the receives posted so far), for
    /// at most `depth` receives.
    fn new(
        pd: &Arc<Pd>,
        posted: Vec<PooledRecv>,
        depth: usize,
        wr_base: u64,
    ) -> Result<DevicePool> {
        // SAFETY: plain data; zero is a valid start.
        let mut attr: sys::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = depth as u32;
        attr.attr.max_sge = 1;
        // SAFETY: live PD and attribute struct.
        let raw = unsafe { sys::ibv_create_srq(pd.raw, &mut attr) };
        if raw.is_null() {
            let e = io::Error::last_os_error();
            return Err(Error::invalid(format!(
                "the device refused a shared receive queue of {depth} receives: {e}"
            )));
        }
        let pool = DevicePool {
            raw,
            pd: pd.clone(),
            wr_base,
            slots: Mutex::new(Slots::default()),
        };
        for r in posted {
            pool.post(r)?;
        }
        Ok(pool)
    }

    /// Takes the slot of a completed receive: its caller's `wr_id` (its region let go).
    pub(super) fn take(&self, wr_id: u64) -> Option<u64> {
        let slot = (wr_id & !self.wr_base) as usize;
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let (id, mr) = s.taken.get_mut(slot)?.take()?;
        s.free.push(slot as u32);
        drop(s);
        drop(mr);
        Some(id)
    }
}

impl PoolDevice for DevicePool {
    fn post(&self, r: PooledRecv) -> Result<()> {
        let lkey = r.mr.lkey_in(&self.pd)?;
        let ptr = r.mr.slice_ptr(r.offset, r.len)?;
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = match s.free.pop() {
            Some(k) => k as usize,
            None => {
                s.taken.push(None);
                s.taken.len() - 1
            }
        };
        let mut sge = sys::ibv_sge {
            addr: ptr as u64,
            length: r.len as u32,
            lkey,
        };
        let mut wr = sys::ibv_recv_wr {
            wr_id: self.wr_base | slot as u64,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: if r.len == 0 { 0 } else { 1 },
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: live SRQ; the work request and its segment are live locals; the buffer stays
        // valid until the receive completes (its region is held in the slot).
        let rc = unsafe { sys::ibv_post_srq_recv(self.raw, &mut wr, &mut bad) };
        if rc != 0 {
            s.free.push(slot as u32);
            return Err(post_error(rc, "receive"));
        }
        s.taken[slot] = Some((r.wr_id, r.mr));
        Ok(())
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // SAFETY: made in `new`, destroyed once; every queue pair that used it is gone (each
        // connection holds the pool until its teardown destroyed its queue pair).
        unsafe { sys::ibv_destroy_srq(self.raw) };
    }
}

/// The device queue of the shared receive queue `pool` in `pd` (made on first use; a pool
/// serves one device), its receives' work-request ids carrying `wr_base`.
pub(super) fn bind(pool: &SrqInner, pd: &Arc<Pd>, wr_base: u64) -> Result<Arc<DevicePool>> {
    pool.bind_device(pd.raw as usize, |posted, depth| {
        DevicePool::new(pd, posted, depth, wr_base)
    })?
    .downcast::<DevicePool>()
    .map_err(|_| Error::invalid("the shared receive queue is bound to another transport"))
}
