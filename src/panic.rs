//! Panics the library catches: at the C boundary and in its own threads. They are turned into
//! statuses and never printed on the program's stderr; a panic anywhere else goes to whatever
//! hook was installed before (Rust's default prints it as usual).

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::sync::Once;

thread_local! {
    /// How deep this thread is inside [`catch`]: panics there are the library's to report.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The message of the last panic caught on this thread.
    static MESSAGE: RefCell<String> = const { RefCell::new(String::new()) };
}

static HOOK: Once = Once::new();

fn describe(info: &PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    match info.location() {
        Some(l) => format!("{what} at {}:{}", l.file(), l.line()),
        None => what.to_owned(),
    }
}

/// Puts the library's hook in front of the one installed now (once per process).
fn install() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if DEPTH.with(Cell::get) > 0 {
                let m = describe(info);
                MESSAGE.with(|s| *s.borrow_mut() = m);
            } else {
                previous(info);
            }
        }));
    });
}

/// Runs `f`, turning a panic into `Err` with its message, silently.
pub(crate) fn catch<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    install();
    // One look-up of the thread-local (not free in a shared library) for both changes.
    let depth: *const Cell<u32> = DEPTH.with(|d| d as *const _);
    // SAFETY: this thread's own cell, which lives as long as the thread, so across this call.
    let depth = unsafe { &*depth };
    depth.set(depth.get() + 1);
    let r = std::panic::catch_unwind(AssertUnwindSafe(f));
    depth.set(depth.get() - 1);
    r.map_err(|_| MESSAGE.with(|s| std::mem::take(&mut *s.borrow_mut())))
}
