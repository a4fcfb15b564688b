//! How a completion queue makes progress and how long its waits poll.

use std::time::Duration;

#[cfg(doc)]
use super::CompletionQueue;

/// Who moves a connection's finished work from the device into the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Progress {
    /// The thread that polls or waits on the queue takes verbs completions straight from the
    /// device, and moves shm messages between the shared rings and the posted receives (a post
    /// writes its message into the ring itself when it can): no thread hand-off and no system
    /// call on the busy path. A library thread still handles connection events, keepalives and
    /// teardown (one per context, for all its connections), and moves work only while a caller sleeps in [`CompletionQueue::wait`] or
    /// watches [`CompletionQueue::fd`] (and, over shm, for sends that wait for ring space,
    /// and when nobody has polled for 10 ms). The default (it measured faster; see
    /// docs/performance.md).
    Caller,
    /// A library thread moves each connection's work and every completion into the queue
    /// (the context's one thread for all its connections: verbs on the device's completion
    /// events; shm between the rings and the posted buffers, taking turns among the busy
    /// ones); callers only take completions from there.
    Thread,
}

impl Progress {
    /// `RBR_PROGRESS=caller|thread` when set to one of those, else [`Progress::Caller`].
    pub fn from_env() -> Progress {
        match std::env::var("RBR_PROGRESS").as_deref() {
            Ok("thread") => Progress::Thread,
            _ => Progress::Caller,
        }
    }
}

/// How a completion queue makes progress and waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqOptions {
    /// Who takes verbs completions from the device. Default: [`Progress::from_env`].
    pub progress: Progress,
    /// How long [`CompletionQueue::wait`] keeps polling before it sleeps, at the least.
    /// With [`Progress::Caller`], while completions keep coming soon after waits start, a wait
    /// polls longer: up to four times the longest recent wait (a figure that shrinks by an
    /// eighth with every wait that is shorter), and at least twice the longest recent wait
    /// that slept and was woken within 1 ms (a figure that shrinks by a 16384th with every
    /// wait that did not sleep: waking up cost more than polling on would have), never past
    /// 1 ms, so that a steady exchange whose round trip is near `spin`, or that is held up
    /// now and then, does not fall into the sleeping path. After a
    /// wait longer than 1 ms (the queue went idle, or waking up took that long),
    /// waits poll for `spin` again, except the first and every 16th of a run of such waits,
    /// which poll for 1 ms to find out whether completions come soon again.
    /// (With [`Progress::Thread`] the wait polls for `spin` exactly: longer polling would take
    /// the CPU from the threads that fill the queue.) Zero never polls: every wait sleeps at
    /// once. Default 50 µs; at most 1 s.
    /// On a thread that may run on one CPU only, a wait that polls yields that CPU
    /// (`sched_yield`) every 20 µs, so that the library's thread, which shares it, is not held
    /// up for a scheduler slice.
    pub spin: Duration,
}

impl Default for CqOptions {
    fn default() -> Self {
        CqOptions {
            progress: Progress::from_env(),
            spin: DEFAULT_SPIN,
        }
    }
}

/// The default of [`CqOptions::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Longest [`CqOptions::spin`].
pub const SPIN_MAX: Duration = Duration::from_secs(1);
/// Longest that [`CompletionQueue::wait`] extends its polling to, beyond [`CqOptions::spin`],
/// while completions keep coming soon after waits start.
pub const SPIN_ADAPT_MAX: Duration = Duration::from_millis(1);
