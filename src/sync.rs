//! The synchronisation primitives of the lock-free code that the model checks run: std's,
//! or in `loom` builds (`RUSTFLAGS="--cfg loom"`, the checks' only use) loom's, which the
//! model sees. Outside those builds these are std's types themselves, so the code is the same.

#[cfg(not(loom))]
pub(crate) use std::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize};

#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize};
