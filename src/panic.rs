//! Panics the library catches: at the C boundary and in its own threads. They are turned into
//! statuses and never printed on the program's stderr; a panic anywhere else goes to whatever
//! hook was installed before (Rust's default prints it as usual).

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::sync::Once;

thread_local! {
    /// The message of the last panic caught on this thread.
    static MESSAGE: RefCell<String> = const { RefCell::new(String::new()) };
    /// How deep this thread is inside [`catch`]: panics there are the library's to report.
    /// `const`-initialised and without a destructor, so reaching it never fails, even while
    /// the thread exits.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
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
    // One look-up of the counter for both counting in and out.
    let r = DEPTH.with(|depth| {
        depth.set(depth.get() + 1);
        let r = std::panic::catch_unwind(AssertUnwindSafe(f));
        depth.set(depth.get() - 1);
        r
    });
    r.map_err(|_| MESSAGE.with(|s| std::mem::take(&mut *s.borrow_mut())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn deep(n: u32) -> u32 {
        if n == 0 {
            panic!("deep down");
        }
        deep(n - 1) + 1
    }

    #[test]
    fn a_panic_inside_is_caught_with_its_message() {
        let r: Result<(), String> = catch(|| panic!("boom {}", 7));
        let m = r.expect_err("the panic comes back as an error");
        assert!(m.starts_with("boom 7 at "), "{m}");
        assert!(m.contains("panic.rs"), "{m}");
        // Frames between the panic and the boundary do not hide it.
        let m = catch(|| deep(20)).expect_err("caught");
        assert!(m.starts_with("deep down at "), "{m}");
        // Nested boundaries: the inner one catches it, the outer call goes on.
        let r = catch(|| catch(|| -> u32 { panic!("inner") }).unwrap_err());
        assert!(r.expect("outer call returns").starts_with("inner at "));
    }

    #[test]
    fn a_call_that_does_not_panic_returns_its_value() {
        assert_eq!(catch(|| 41 + 1), Ok(42));
        let s = String::from("kept");
        assert_eq!(catch(move || s), Ok("kept".to_owned()));
    }

    #[test]
    fn a_panic_outside_goes_to_the_previous_hook() {
        install();
        // Caught by the test, not by the library: the hook must leave it to the previous hook
        // (which prints it) and record nothing.
        MESSAGE.with(|s| s.borrow_mut().clear());
        let r = std::panic::catch_unwind(|| deep(3));
        assert!(r.is_err());
        assert!(
            MESSAGE.with(|s| s.borrow().is_empty()),
            "recorded as the library's: {:?}",
            MESSAGE.with(|s| s.borrow().clone())
        );
        // The same on a thread of its own.
        std::thread::spawn(|| {
            let r = std::panic::catch_unwind(|| deep(2));
            assert!(r.is_err());
            assert!(MESSAGE.with(|s| s.borrow().is_empty()));
            // And on that thread, inside the boundary, it is the library's.
            assert!(catch(|| deep(1)).unwrap_err().starts_with("deep down"));
        })
        .join()
        .unwrap();
    }
}
