//! Panics the library catches: at the C boundary and in its own threads. They are turned into
//! statuses and never printed on the program's stderr; a panic anywhere else goes to whatever
//! hook was installed before (Rust's default prints it as usual).

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::sync::Once;

thread_local! {
    /// The message of the last panic caught on this thread.
    static MESSAGE: RefCell<String> = const { RefCell::new(String::new()) };
}

/// How deep this thread is inside [`catch`]: panics there are the library's to report. Every
/// call of the C surface counts in and out, so on x86-64 Linux the counter is a thread-local
/// reached through a TLS descriptor (a call that returns its offset from the thread pointer:
/// two instructions while the library's thread-locals sit in the static TLS block, as they do
/// for a library loaded at startup), not a Rust `thread_local!`, which a shared library reaches
/// through `__tls_get_addr`. Unlike the initial-exec model, a descriptor does not mark the
/// library as needing static TLS, so a `dlopen` of it still works anywhere.
#[cfg(all(target_arch = "x86_64", target_os = "linux", not(loom)))]
mod depth {
    /// The counter's symbol: global, for the library's other object files, but hidden, so no
    /// program or other library sees it; named after the crate's version, so that two
    /// versions linked into one program keep one each.
    macro_rules! depth_symbol {
        () => {
            concat!("rdmabridge_catch_depth_", env!("CARGO_PKG_VERSION"))
        };
    }

    // A 4-byte thread-local, zero in every thread.
    std::arch::global_asm!(
        ".pushsection .tbss,\"awT\",@nobits",
        ".p2align 2",
        concat!(".globl ", depth_symbol!()),
        concat!(".hidden ", depth_symbol!()),
        concat!(".type ", depth_symbol!(), ",@object"),
        concat!(".size ", depth_symbol!(), ",4"),
        concat!(depth_symbol!(), ":"),
        ".zero 4",
        ".popsection",
    );

    /// The descriptor call: its two instructions, as one template string.
    macro_rules! tlsdesc_call {
        () => {
            concat!(
                "lea rax, [rip + ",
                depth_symbol!(),
                "@TLSDESC]\n",
                "call qword ptr [rax + ",
                depth_symbol!(),
                "@TLSCALL]",
            )
        };
    }

    /// `asm!` of a TLS descriptor call (the x86-64 TLSDESC sequence, which returns in rax the
    /// counter's offset from the thread pointer) and what follows it. The resolver keeps every
    /// other register on its fast path, but the first call on a thread of a library loaded
    /// with `dlopen` allocates, and glibc before 2.40 does not save vector registers there: so
    /// those are declared clobbered - the sixteen of the baseline instruction set (which
    /// overlap the wider ones), or, in a build for AVX-512 with its extra vector and mask
    /// registers, everything the C calling convention lets a call clobber.
    #[cfg(not(target_feature = "avx512f"))]
    macro_rules! tlsdesc_asm {
        ($($args:tt)*) => {
            std::arch::asm!(
                tlsdesc_call!(),
                $($args)*
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
                out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
                out("xmm12") _, out("xmm13") _, out("xmm14") _, out("xmm15") _,
            )
        };
    }
    #[cfg(target_feature = "avx512f")]
    macro_rules! tlsdesc_asm {
        ($($args:tt)*) => {
            std::arch::asm!(tlsdesc_call!(), $($args)* clobber_abi("C"))
        };
    }

    /// This thread's counter.
    #[inline(always)]
    pub(super) fn get() -> u32 {
        let v: u64;
        // SAFETY: the descriptor call gives the counter's offset from the thread pointer (see
        // `tlsdesc_asm`), then this thread's 4 bytes there are loaded. The call pushes a
        // return address, so the asm uses the stack (no `nostack`: on entry the stack is
        // aligned for a call).
        unsafe { tlsdesc_asm!("mov eax, dword ptr fs:[rax]", out("rax") v,) };
        v as u32
    }

    /// Where this thread's counter is, from the thread pointer: valid for the thread's life.
    #[derive(Clone, Copy)]
    pub(super) struct Slot(u64);

    /// Counts this thread in; returns where its counter is, for [`leave`]: one descriptor call
    /// for both.
    #[inline(always)]
    pub(super) fn enter() -> Slot {
        let at: u64;
        // SAFETY: as in `get`; the counter is this thread's alone.
        unsafe { tlsdesc_asm!("add dword ptr fs:[rax], 1", out("rax") at,) };
        Slot(at)
    }

    /// Counts this thread out of what [`enter`] counted it into.
    #[inline(always)]
    pub(super) fn leave(at: Slot) {
        // SAFETY: `at` is this thread's counter's offset from its thread pointer (from `enter`
        // on this thread: the value is the thread's whole life the same); the counter is this
        // thread's alone.
        unsafe {
            std::arch::asm!(
                "sub dword ptr fs:[{at}], 1",
                at = in(reg) at.0,
                options(nostack),
            )
        };
    }
}

/// Elsewhere: a Rust thread-local.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(loom))))]
mod depth {
    use std::cell::Cell;

    thread_local! {
        static DEPTH: Cell<u32> = const { Cell::new(0) };
    }

    pub(super) fn get() -> u32 {
        DEPTH.with(Cell::get)
    }

    pub(super) struct Slot;

    pub(super) fn enter() -> Slot {
        DEPTH.with(|c| c.set(c.get() + 1));
        Slot
    }

    pub(super) fn leave(_: Slot) {
        DEPTH.with(|c| c.set(c.get() - 1));
    }
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
            if depth::get() > 0 {
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
    let at = depth::enter();
    let r = std::panic::catch_unwind(AssertUnwindSafe(f));
    depth::leave(at);
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
