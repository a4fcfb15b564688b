//! The verbs state of a context: its protection domains, the device CQs its connections share,
//! and the devices whose port events its driver reads. Above the resources it holds (`res.rs`,
//! `devcq.rs`), which know nothing of it.

use std::io;
use std::sync::{Arc, Mutex};

use rdma_sys as sys;

use crate::driver::{Driver, Handler, Next, Ready};
use crate::error::{Error, Result};
use crate::verbs::devcq;
use crate::verbs::res::{DeviceEvents, Pd, device_events};

/// The verbs state of a context: one protection domain per device, made on first use; the
/// device CQs its connections share (one per completion queue and device); the devices whose
/// port events its driver watches.
#[derive(Default)]
pub(crate) struct Domain {
    pds: Mutex<Vec<Arc<Pd>>>,
    pub(crate) devcqs: devcq::Table,
    watched: Mutex<Vec<usize>>,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("verbs::Domain")
    }
}

impl Domain {
    pub(crate) fn pd(&self, device: *mut sys::ibv_context) -> Result<Arc<Pd>> {
        let mut pds = self.pds.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pd) = pds.iter().find(|p| p.device == device) {
            return Ok(pd.clone());
        }
        // SAFETY: `device` is a live device context from a CM id.
        let raw = unsafe { sys::ibv_alloc_pd(device) };
        if raw.is_null() {
            return Err(Error::MemoryRegion(io::Error::last_os_error()));
        }
        let pd = Arc::new(Pd { raw, device });
        pds.push(pd.clone());
        Ok(pd)
    }

    /// Has the context's driver read `device`'s port events (from now on, for as long as the
    /// driver runs), unless it already does.
    pub(crate) fn watch_ports(&self, device: *mut sys::ibv_context, driver: &Driver) -> Result<()> {
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        if watched.contains(&(device as usize)) {
            return Ok(());
        }
        let dev = device_events(device)?;
        let fd = dev.fd();
        let reg = driver.registration();
        driver
            .register(&reg, &[fd], Box::new(PortWatch(dev)))
            .map_err(Error::Thread)?;
        watched.push(device as usize);
        Ok(())
    }
}

/// A driver turn that reads a device's port events whenever its descriptor is readable; each
/// connection's turn then looks at its own port ([`DeviceEvents::down_since`]).
struct PortWatch(Arc<DeviceEvents>);

impl Handler for PortWatch {
    fn run(&mut self, _: &Ready) -> Next {
        self.0.drain();
        Next::Wait(None)
    }
}
