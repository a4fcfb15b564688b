//! The verbs transport: real RDMA through librdmacm and libibverbs (InfiniBand, RoCE,
//! soft-RoCE), on reliable-connected queue pairs.

#[cfg(feature = "verbs")]
mod cm;
#[cfg(feature = "verbs")]
mod conn;
#[cfg(feature = "verbs")]
mod credit;
#[cfg(feature = "verbs")]
mod devcq;
#[cfg(feature = "verbs")]
mod dispatch;
#[cfg(feature = "verbs")]
mod domain;
#[cfg(feature = "verbs")]
mod engine;
#[cfg(feature = "verbs")]
mod handshake;
#[cfg(feature = "verbs")]
mod preamble;
#[cfg(feature = "verbs")]
mod res;
#[cfg(feature = "verbs")]
mod srq;

#[cfg(feature = "verbs")]
pub(crate) use cm::sockaddr;
#[cfg(feature = "verbs")]
#[cfg(feature = "verbs")]
pub(crate) use handshake::{Listener, start_connect};
#[cfg(feature = "verbs")]
pub(crate) use res::registration_error;

/// Whether this machine has at least one RDMA device. Once one has been seen the answer is
/// kept: listing the devices opens a netlink socket and takes a dozen system calls under
/// libibverbs' lock, which every connect would otherwise pay. A connect that then fails
/// before it reaches the peer asks again ([`devices_listed`]), so a device that went away
/// still shows as `NoDevice`.
#[cfg(feature = "verbs")]
pub(crate) fn device_present() -> bool {
    SEEN_DEVICE.load(std::sync::atomic::Ordering::Relaxed) || devices_listed()
}

#[cfg(feature = "verbs")]
static SEEN_DEVICE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether libibverbs lists an RDMA device now (and [`device_present`] keeps the answer).
#[cfg(feature = "verbs")]
pub(crate) fn devices_listed() -> bool {
    let mut n: libc::c_int = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a list (or NULL on failure) that
    // must be released with ibv_free_device_list, which is done at once.
    unsafe {
        let list = rdma_sys::ibv_get_device_list(&mut n);
        if list.is_null() {
            n = 0;
        } else {
            rdma_sys::ibv_free_device_list(list);
        }
    }
    SEEN_DEVICE.store(n > 0, std::sync::atomic::Ordering::Relaxed);
    n > 0
}

/// Whether this machine has at least one RDMA device (never, without the `verbs` feature).
#[cfg(not(feature = "verbs"))]
pub(crate) fn device_present() -> bool {
    false
}
