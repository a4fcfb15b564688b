//! Verbs resources, each owning its raw pointer and holding an `Arc` of its parent so drop
//! order cannot be wrong: protection domains (one per device per context) and the
//! memory-region registrations made in them, and the device's port events (read by one driver turn per context and
//! device, see `domain.rs`).

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rdma_sys as sys;

use crate::error::{Error, Result};
use crate::mr::{Access, Keys, Registrar, Registration};
use crate::verbs::cm::cm_err;

/// A protection domain on one device.
pub(crate) struct Pd {
    pub(crate) raw: *mut sys::ibv_pd,
    pub(crate) device: *mut sys::ibv_context,
}

// SAFETY: a PD is an immutable handle to a kernel object; verbs calls taking it are thread-safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every registration and QP holds an Arc of this PD, so none is left; the
        // device context is kept open by librdmacm for the life of the process.
        unsafe { sys::ibv_dealloc_pd(self.raw) };
    }
}

/// A memory region's registration in a protection domain.
struct Mr {
    raw: *mut sys::ibv_mr,
    _pd: Arc<Pd>,
}

// SAFETY: the raw MR is only read (keys) and deregistered once, on drop.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Registration for Mr {
    fn keys(&self) -> Keys {
        // SAFETY: live registration.
        unsafe {
            Keys {
                lkey: (*self.raw).lkey,
                rkey: (*self.raw).rkey,
            }
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once; no posted work uses it any more
        // (work requests hold the region alive until they complete).
        unsafe { sys::ibv_dereg_mr(self.raw) };
    }
}

impl Registrar for Pd {
    unsafe fn register(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn Registration>> {
        let mut flags = 0;
        if access.contains(Access::LOCAL_WRITE) {
            flags |= sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        }
        if access.contains(Access::REMOTE_WRITE) {
            flags |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if access.contains(Access::REMOTE_READ) {
            flags |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        if access.contains(Access::REMOTE_ATOMIC) {
            flags |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        }
        // SAFETY: the memory is valid for `len` bytes until the registration is dropped (the
        // caller's contract).
        let raw = unsafe { sys::ibv_reg_mr(pd.raw, addr.cast(), len, flags as i32) };
        if raw.is_null() {
            return Err(registration_error(io::Error::last_os_error(), len));
        }
        Ok(Box::new(Mr {
            raw,
            _pd: pd.clone(),
        }))
    }
}

/// The error of a failed registration of `len` bytes. ENOMEM and EPERM from ibv_reg_mr mostly
/// mean the pinned memory would pass the locked-memory limit: say which limit, and its value.
pub(crate) fn registration_error(e: io::Error, len: usize) -> Error {
    if !matches!(e.raw_os_error(), Some(libc::ENOMEM) | Some(libc::EPERM)) {
        return Error::MemoryRegion(e);
    }
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the live `rl`.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } == 0 {
        let show = |v: libc::rlim_t| {
            if v == libc::RLIM_INFINITY {
                "unlimited".to_owned()
            } else {
                format!("{v} bytes")
            }
        };
        format!("{}, hard limit {}", show(rl.rlim_cur), show(rl.rlim_max))
    } else {
        format!("an unknown value ({})", io::Error::last_os_error())
    };
    Error::MemoryLock {
        len,
        limit,
        source: e,
    }
}

/// Most RDMA reads and atomics a connection keeps in flight toward its peer, and accepts from
/// it at once (each side's device may allow fewer).
const RD_ATOM_MAX: u8 = 16;

/// What a device allows one-sided operations on a queue pair.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Most RDMA reads and atomics in flight that the queue pair may accept from its peer
    /// (the device's `max_qp_rd_atom`, at most [`RD_ATOM_MAX`]).
    pub(crate) responder_resources: u8,
    /// Most it may issue toward its peer (the device's `max_qp_init_rd_atom`, at most
    /// [`RD_ATOM_MAX`]); the peer's responder resources bound it further.
    pub(crate) initiator_depth: u8,
    /// Whether the device runs atomic operations.
    pub(crate) atomics: bool,
    /// Scatter/gather entries a send-queue work request may carry: what one-sided operations
    /// need, as far as the device allows.
    pub(crate) send_sge: u32,
}

impl Limits {
    fn of(device: *mut sys::ibv_context) -> Result<Limits> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid start.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live device context; `attr` is written on success. Returns the errno value.
        let r = unsafe { sys::ibv_query_device(device, &mut attr) };
        if r != 0 {
            return Err(cm_err("ibv_query_device")(io::Error::from_raw_os_error(r)));
        }
        let cap = |v: i32| v.clamp(0, i32::from(RD_ATOM_MAX)) as u8;
        Ok(Limits {
            responder_resources: cap(attr.max_qp_rd_atom),
            initiator_depth: cap(attr.max_qp_init_rd_atom),
            atomics: attr.atomic_cap != sys::ibv_atomic_cap::IBV_ATOMIC_NONE,
            send_sge: (crate::conn::SGE_MAX as i32).min(attr.max_sge).max(1) as u32,
        })
    }
}

/// What a device's asynchronous events say about its ports: one per device per process (the
/// device's event descriptor is), shared by every connection on the device. Each context's driver reads the events (whichever
/// finds the descriptor readable first), and each connection's turn checks whether its own
/// port is down. It also keeps what the device allows, asked once: a query per connection
/// is a system call that answers the same every time.
pub(crate) struct DeviceEvents {
    device: *mut sys::ibv_context,
    pub(crate) limits: Limits,
    /// (port, since when) for each port that is down; port 0 stands for the whole device after
    /// a fatal error.
    down: Mutex<Vec<(u8, Instant)>>,
}

// SAFETY: the device context is kept open by librdmacm for the life of the process; reading
// its events is thread-safe (the descriptor is non-blocking).
unsafe impl Send for DeviceEvents {}
// SAFETY: as above.
unsafe impl Sync for DeviceEvents {}

static DEVICES: Mutex<Vec<Arc<DeviceEvents>>> = Mutex::new(Vec::new());

/// The event state of `device`, made on first use (which makes its event descriptor
/// non-blocking, so that no driver can block reading an event another took).
pub(crate) fn device_events(device: *mut sys::ibv_context) -> Result<Arc<DeviceEvents>> {
    let mut devs = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devs.iter().find(|d| d.device == device) {
        return Ok(d.clone());
    }
    // SAFETY: live device context from a CM id.
    crate::verbs::cm::set_nonblocking(unsafe { (*device).async_fd })?;
    let d = Arc::new(DeviceEvents {
        device,
        limits: Limits::of(device)?,
        down: Mutex::new(Vec::new()),
    });
    devs.push(d.clone());
    Ok(d)
}

impl DeviceEvents {
    /// The device's event descriptor, readable while events wait.
    pub(crate) fn fd(&self) -> i32 {
        // SAFETY: live device context.
        unsafe { (*self.device).async_fd }
    }

    /// Takes and acknowledges every waiting event, noting ports that go down or come back.
    pub(crate) fn drain(&self) {
        use sys::ibv_event_type::*;
        loop {
            let mut ev = std::mem::MaybeUninit::<sys::ibv_async_event>::uninit();
            // SAFETY: live device context; the descriptor is non-blocking, so this fails with
            // EAGAIN when no event waits.
            if unsafe { sys::ibv_get_async_event(self.device, ev.as_mut_ptr()) } != 0 {
                return;
            }
            // SAFETY: filled by ibv_get_async_event. The type is read as the raw C integer, as
            // a newer kernel may report a type this build does not know.
            let kind = unsafe { (&raw const (*ev.as_ptr()).event_type).cast::<u32>().read() };
            // SAFETY: for port events the element is the port number.
            let port = unsafe { (*ev.as_ptr()).element.port_num } as u8;
            {
                let mut down = self.down.lock().unwrap_or_else(|p| p.into_inner());
                if kind == IBV_EVENT_PORT_ERR as u32 {
                    if !down.iter().any(|&(p, _)| p == port) {
                        down.push((port, Instant::now()));
                    }
                } else if kind == IBV_EVENT_PORT_ACTIVE as u32 {
                    down.retain(|&(p, _)| p != port);
                } else if kind == IBV_EVENT_DEVICE_FATAL as u32 {
                    down.push((0, Instant::now()));
                }
            }
            // SAFETY: acknowledges the event just taken, once.
            unsafe { sys::ibv_ack_async_event(ev.as_mut_ptr()) };
        }
    }

    /// Since when `port` (or the whole device) has been down, if it is.
    pub(crate) fn down_since(&self, port: u8) -> Option<Instant> {
        let down = self.down.lock().unwrap_or_else(|p| p.into_inner());
        down.iter()
            .filter(|&&(p, _)| p == port || p == 0)
            .map(|&(_, t)| t)
            .min()
    }
}

/// ibv_post_* return the errno itself (they do not set errno).
pub(super) fn post_error(r: i32, which: &'static str) -> Error {
    if r == libc::ENOMEM {
        Error::QueueFull(which)
    } else {
        Error::Connect(io::Error::from_raw_os_error(r))
    }
}
