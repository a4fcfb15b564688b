//! The state a context shares with everything made from it: its options, the verbs
//! protection domains, the progress driver of its shm connections. A leaf: connections,
//! regions and the transports hold it without depending on the public handles.

/// Settings of a [`Context`](crate::Context).
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    /// Let shared-memory peers running as another user connect (default: same user only).
    pub shm_allow_any_uid: bool,
}

#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) opts: ContextOptions,
    /// Verbs protection domains, one per device, made on first use.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) verbs: crate::verbs::Domain,
    /// The thread that runs the background work of the context's shm connections, started
    /// with the first one; stopped when the context goes (no connection is left then).
    pub(crate) driver: crate::driver::Lazy,
}
