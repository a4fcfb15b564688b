//! The verbs transport (librdmacm + libibverbs). This release only probes for devices; the
//! connection flow comes next.

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
