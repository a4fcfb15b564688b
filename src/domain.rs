//! The state a context shares with everything made from it: its options, the state each
//! transport keeps per context, the progress driver of its connections. A leaf: connections,
//! regions and the transports hold it without depending on the public handles, and it names
//! no transport.

use std::any::Any;
use std::sync::{Arc, Mutex};

/// Settings of a [`Context`](crate::Context).
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    /// Let shared-memory peers running as another user connect (default: same user only).
    pub shm_allow_any_uid: bool,
}

#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) opts: ContextOptions,
    /// What each transport keeps per context (verbs: its protection domains and shared device
    /// CQs; shm: what it knows of its peers), made on its first use. Dropped before the driver, which may still run their turns.
    pub(crate) transports: TransportStates,
    /// The thread that runs the background work of the context's connections, started with
    /// the first one that needs it; stopped when the context goes (no connection is left then).
    pub(crate) driver: crate::driver::Lazy,
}

impl ContextInner {
    pub(crate) fn new(opts: ContextOptions) -> ContextInner {
        ContextInner {
            opts,
            transports: TransportStates::default(),
            driver: Default::default(),
        }
    }
}

/// Per-context state of the transports, one value per type, each made on first use. The
/// context holds them without knowing what they are, so a transport adds its own without
/// changing the core.
#[derive(Default)]
pub(crate) struct TransportStates(Mutex<Vec<Arc<dyn Any + Send + Sync>>>);

impl TransportStates {
    /// The context's `T`, made with `T::default()` on first use. Only connection setup asks,
    /// never a post or a poll.
    pub(crate) fn get<T: Any + Send + Sync + Default>(&self) -> Arc<T> {
        let mut states = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = states.iter().find_map(|s| s.clone().downcast::<T>().ok()) {
            return s;
        }
        let s = Arc::new(T::default());
        states.push(s.clone());
        s
    }
}

impl std::fmt::Debug for TransportStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |s| s.len());
        write!(f, "TransportStates({n})")
    }
}
