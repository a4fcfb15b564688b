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

/// Whether this machine has at least one RDMA device.
#[cfg(feature = "verbs")]
pub(crate) fn device_present() -> bool {
    let mut n: libc::c_int = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a list (or NULL on failure) that
    // must be released with ibv_free_device_list, which is done at once.
    unsafe {
        let list = rdma_sys::ibv_get_device_list(&mut n);
        if list.is_null() {
            return false;
        }
        rdma_sys::ibv_free_device_list(list);
    }
    n > 0
}

/// Whether this machine has at least one RDMA device (never, without the `verbs` feature).
#[cfg(not(feature = "verbs"))]
pub(crate) fn device_present() -> bool {
    false
}
