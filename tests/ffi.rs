//! The C surface, driven from Rust: every check a C caller relies on.

mod common;

use std::ffi::{CStr, c_void};
use std::ptr::{null, null_mut};

use common::unique_addr;
use rdmabridge::ffi::conn::*;
use rdmabridge::ffi::cq::*;
use rdmabridge::ffi::ctx::*;
use rdmabridge::ffi::error::*;
use rdmabridge::ffi::listener::*;
use rdmabridge::ffi::mr::*;

fn cstr(p: *const std::ffi::c_char) -> String {
    // SAFETY: the library returns NUL-terminated strings that outlive this call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[test]
fn header_is_fresh() {
    let generated = include_str!(concat!(env!("OUT_DIR"), "/rdmabridge.h"));
    let committed =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/rdmabridge.h"))
            .unwrap();
    assert!(
        generated == committed,
        "include/rdmabridge.h is stale: run scripts/regen-header.sh"
    );
    for banned in ["ibv_", "rdma_cm", "struct rdma_"] {
        assert!(!committed.contains(banned), "header mentions {banned}");
    }
    // Every name the header defines is the library's own (RBR_ / rbr_), so it cannot clash
    // with a program's names.
    for line in committed.lines() {
        let name = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["#define", name, ..] => name,
            ["typedef", "struct", name, ..] => name,
            _ => continue,
        };
        assert!(
            name.starts_with("RBR_") || name.starts_with("rbr_") || name == "RDMABRIDGE_H",
            "the header defines {name}"
        );
    }
}

#[test]
fn every_status_has_a_distinct_name() {
    let mut names = std::collections::HashSet::new();
    for s in -23..=2 {
        let n = cstr(rbr_status_str(s));
        assert!(n.starts_with("RBR_"), "{s}: {n}");
        assert!(names.insert(n));
    }
    assert_eq!(cstr(rbr_status_str(-999)), "unknown status");
    assert_eq!(
        cstr(rbr_status_str(RBR_ERR_TIMEOUT)),
        "RBR_ERR_TIMEOUT: timed out"
    );
}

#[test]
fn null_arguments_return_rbr_err_null_and_write_nothing() {
    // SAFETY: every pointer passed is NULL or valid; the functions must reject the NULLs.
    unsafe {
        assert_eq!(rbr_ctx_create(null_mut()), RBR_ERR_NULL);
        assert!(cstr(rbr_last_error()).contains("NULL"));
        assert_eq!(rbr_cq_create(null_mut()), RBR_ERR_NULL);
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let mut cq = null_mut();
        assert_eq!(rbr_cq_create(&mut cq), RBR_OK);
        let sentinel: *mut rbr_listener = std::ptr::dangling_mut();
        let mut l = sentinel; // must stay untouched
        assert_eq!(rbr_listen(ctx, null(), 4, &mut l), RBR_ERR_NULL);
        assert_eq!(
            rbr_listen(null_mut(), c"shm://x".as_ptr(), 4, &mut l),
            RBR_ERR_NULL
        );
        assert_eq!(l, sentinel, "out-parameter written on failure");
        let mut conn: *mut rbr_conn = null_mut();
        assert_eq!(
            rbr_connect(ctx, c"shm://x".as_ptr(), null_mut(), null(), &mut conn),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_post_send(null_mut(), null(), 0, 0, 0, 0),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_post_recv(null_mut(), null(), 0, 0, 0),
            RBR_ERR_NULL
        );
        assert_eq!(rbr_cq_wait(null_mut(), 0), RBR_ERR_NULL);
        let mut n = 0usize;
        assert_eq!(rbr_cq_poll(cq, null_mut(), 1, &mut n), RBR_ERR_NULL);
        let mut mr = null_mut();
        assert_eq!(
            rbr_mr_register(ctx, null_mut(), 10, 0, &mut mr),
            RBR_ERR_NULL
        );
        assert!(mr.is_null());
        assert!(rbr_mr_addr(null()).is_null());
        assert_eq!(rbr_mr_len(null()), 0);
        assert_eq!(rbr_conn_id(null()), 0);
        // Destroying NULL is fine.
        rbr_conn_destroy(null_mut());
        rbr_mr_destroy(null_mut());
        rbr_request_destroy(null_mut());
        rbr_listener_destroy(null_mut());
        rbr_cq_destroy(cq);
        rbr_ctx_destroy(ctx);
    }
}

#[test]
fn bad_values_are_invalid() {
    // SAFETY: all pointers are valid or NULL as each call allows.
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let mut cq = null_mut();
        assert_eq!(rbr_cq_create(&mut cq), RBR_OK);
        assert_eq!(rbr_cq_wait(cq, -2), RBR_ERR_INVALID);
        assert_eq!(rbr_cq_wait(cq, 0), RBR_ERR_TIMEOUT);
        let mut c = std::mem::zeroed::<rbr_completion>();
        let mut n = 7usize;
        assert_eq!(rbr_cq_poll(cq, &mut c, 1, &mut n), RBR_EMPTY);
        assert_eq!(n, 0);
        assert_eq!(rbr_cq_poll(cq, &mut c, 0, &mut n), RBR_ERR_INVALID);
        // Completion-queue options: each bad field is refused and nothing is created.
        let mut co = std::mem::zeroed::<rbr_cq_options>();
        rbr_cq_options_init(&mut co);
        assert_eq!((co.progress, co.spin_us), (RBR_PROGRESS_DEFAULT, 50));
        rbr_cq_options_init(null_mut());
        let sentinel = std::ptr::dangling_mut::<rbr_cq>();
        for bad in [
            rbr_cq_options { progress: 3, ..co },
            rbr_cq_options {
                spin_us: 1_000_001,
                ..co
            },
            rbr_cq_options {
                struct_size: 4,
                ..co
            },
        ] {
            let mut out = sentinel;
            assert_eq!(rbr_cq_create_ex(&bad, &mut out), RBR_ERR_INVALID);
            assert_eq!(out, sentinel, "written on failure");
        }
        for good in [
            rbr_cq_options {
                progress: RBR_PROGRESS_THREAD,
                spin_us: 0,
                ..co
            },
            rbr_cq_options {
                progress: RBR_PROGRESS_CALLER,
                spin_us: 1_000_000,
                ..co
            },
        ] {
            let mut q = null_mut();
            assert_eq!(rbr_cq_create_ex(&good, &mut q), RBR_OK);
            rbr_cq_destroy(q);
        }
        let mut q = null_mut();
        assert_eq!(rbr_cq_create_ex(null(), &mut q), RBR_OK);
        rbr_cq_destroy(q);
        assert_eq!(rbr_cq_create_ex(&co, null_mut()), RBR_ERR_NULL);
        let mut l = null_mut();
        assert_eq!(
            rbr_listen(ctx, c"tcp://h:1".as_ptr(), 4, &mut l),
            RBR_ERR_ADDRESS
        );
        assert_eq!(
            rbr_listen(ctx, c"shm://".as_ptr(), 4, &mut l),
            RBR_ERR_ADDRESS
        );
        let mut opts = std::mem::zeroed::<rbr_conn_options>();
        rbr_conn_options_init(&mut opts);
        assert_eq!(opts.send_queue_depth, 128);
        assert_eq!(opts.keepalive_ms, 1000);
        let mut conn = null_mut();
        let addr = std::ffi::CString::new(unique_addr("ffi-bad")).unwrap();
        for bad in [
            rbr_conn_options {
                struct_size: 4,
                ..opts
            },
            rbr_conn_options {
                send_queue_depth: 0,
                ..opts
            },
            rbr_conn_options {
                recv_queue_depth: 20000,
                ..opts
            },
            rbr_conn_options {
                timeout_ms: -7,
                ..opts
            },
            rbr_conn_options {
                timeout_ms: 0,
                ..opts
            },
            rbr_conn_options {
                rnr_retry_count: 8,
                ..opts
            },
            rbr_conn_options {
                keepalive_ms: 3_600_001,
                ..opts
            },
            rbr_conn_options {
                shm_ring_size: 8192,
                ..opts
            },
            rbr_conn_options {
                shm_ring_size: 20000,
                ..opts
            },
            rbr_conn_options {
                shm_ring_size: (1 << 30) + 4096,
                ..opts
            },
            rbr_conn_options {
                private_data_len: 49,
                private_data: [0u8; 49].as_ptr().cast(),
                ..opts
            },
        ] {
            assert_eq!(
                rbr_connect(ctx, addr.as_ptr(), cq, &bad, &mut conn),
                RBR_ERR_INVALID
            );
        }
        let nulldata = rbr_conn_options {
            private_data_len: 3,
            ..opts
        };
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), cq, &nulldata, &mut conn),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), cq, &opts, &mut conn),
            RBR_ERR_REFUSED
        );
        // A program built against the header before `shm_ring_size` passes the struct's size
        // then: its options are read (a bad one is still refused), the missing field is 0.
        let before = std::mem::offset_of!(rbr_conn_options, shm_ring_size) as u32;
        let older = rbr_conn_options {
            struct_size: before,
            shm_ring_size: 4,
            ..opts
        };
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), cq, &older, &mut conn),
            RBR_ERR_REFUSED
        );
        let older_bad = rbr_conn_options {
            send_queue_depth: 0,
            ..older
        };
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), cq, &older_bad, &mut conn),
            RBR_ERR_INVALID
        );
        let older_short = rbr_conn_options {
            struct_size: before - 4,
            ..older
        };
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), cq, &older_short, &mut conn),
            RBR_ERR_INVALID
        );
        assert!(conn.is_null());
        let mut mr = null_mut();
        assert_eq!(
            rbr_mr_alloc(ctx, 0, RBR_ACCESS_LOCAL_WRITE, &mut mr),
            RBR_ERR_INVALID
        );
        assert_eq!(rbr_mr_alloc(ctx, 16, 0x100, &mut mr), RBR_ERR_INVALID);
        assert_eq!(
            rbr_mr_alloc(ctx, 16, RBR_ACCESS_REMOTE_WRITE, &mut mr),
            RBR_ERR_INVALID
        );
        assert!(mr.is_null());
        let mut buf = [0u8; 32];
        assert_eq!(
            rbr_mr_register(
                ctx,
                buf.as_mut_ptr().cast(),
                32,
                RBR_ACCESS_LOCAL_WRITE,
                &mut mr
            ),
            RBR_OK
        );
        assert_eq!(rbr_mr_addr(mr), buf.as_mut_ptr().cast::<c_void>());
        assert_eq!(rbr_mr_len(mr), 32);
        rbr_mr_destroy(mr);
        rbr_cq_destroy(cq);
        rbr_ctx_destroy(ctx);
    }
}

/// A full exchange through the C functions: reject with private data, then accept, send,
/// receive, disconnect; the request can be answered once only.
#[test]
fn c_surface_round_trip() {
    // SAFETY: all pointers are valid handles or live locals.
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let (mut scq, mut ccq) = (null_mut(), null_mut());
        assert_eq!(rbr_cq_create(&mut scq), RBR_OK);
        assert_eq!(rbr_cq_create(&mut ccq), RBR_OK);
        let addr = std::ffi::CString::new(unique_addr("ffi")).unwrap();
        let mut l = null_mut();
        assert_eq!(rbr_listen(ctx, addr.as_ptr(), 4, &mut l), RBR_OK);
        let mut lfd = -1;
        assert_eq!(rbr_listener_fd(l, &mut lfd), RBR_OK);
        assert!(lfd >= 0);
        let (ctx_u, l_u, scq_u) = (ctx as usize, l as usize, scq as usize);

        let server = std::thread::spawn(move || {
            let (ctx, l, scq) = (
                ctx_u as *mut rbr_ctx,
                l_u as *mut rbr_listener,
                scq_u as *mut rbr_cq,
            );
            let mut r = null_mut();
            assert_eq!(rbr_listener_get_request(l, 10_000, &mut r), RBR_OK);
            let mut n = 0usize;
            assert_eq!(rbr_request_private_data(r, null_mut(), 0, &mut n), RBR_OK);
            assert_eq!(n, 5, "the length alone");
            let mut d = [0u8; RBR_PRIVATE_DATA_RECV_MAX];
            assert_eq!(
                rbr_request_private_data(r, d.as_mut_ptr().cast(), 3, &mut n),
                RBR_OK
            );
            assert_eq!(
                (&d[..4], n),
                (&b"fir\0"[..], 5),
                "cut at the buffer's length"
            );
            assert_eq!(
                rbr_request_private_data(r, d.as_mut_ptr().cast(), d.len(), &mut n),
                RBR_OK
            );
            assert_eq!(&d[..n], b"first");
            assert_eq!(
                rbr_request_private_data(r, null_mut(), 1, &mut n),
                RBR_ERR_NULL
            );
            assert_eq!(rbr_request_reject(r, b"go away".as_ptr().cast(), 7), RBR_OK);
            assert_eq!(rbr_request_reject(r, null(), 0), RBR_ERR_STATE);
            rbr_request_destroy(r);

            let mut r = null_mut();
            assert_eq!(rbr_listener_get_request(l, 10_000, &mut r), RBR_OK);
            let mut opts = std::mem::zeroed();
            rbr_conn_options_init(&mut opts);
            opts.private_data = b"ok".as_ptr().cast();
            opts.private_data_len = 2;
            opts.context = 0x5eed as *mut c_void;
            let mut conn = null_mut();
            let bad = rbr_conn_options {
                max_inline: 5000,
                ..opts
            };
            assert_eq!(rbr_request_accept(r, scq, &bad, &mut conn), RBR_ERR_INVALID);
            assert_eq!(
                rbr_request_accept(r, scq, &opts, &mut conn),
                RBR_OK,
                "bad options left the request usable"
            );
            let mut again = null_mut();
            assert_eq!(rbr_request_accept(r, scq, &opts, &mut again), RBR_ERR_STATE);
            rbr_request_destroy(r);
            let mut mr = null_mut();
            assert_eq!(
                rbr_mr_alloc(ctx, 64, RBR_ACCESS_LOCAL_WRITE, &mut mr),
                RBR_OK
            );
            assert_eq!(rbr_conn_post_recv(conn, mr, 0, 64, 42), RBR_OK);
            let mut c = std::mem::zeroed::<rbr_completion>();
            let mut n = 0;
            assert_eq!(rbr_cq_wait(scq, 10_000), RBR_OK);
            assert_eq!(rbr_cq_poll(scq, &mut c, 1, &mut n), RBR_OK);
            assert_eq!(
                (n, c.opcode, c.status, c.wr_id, c.byte_len),
                (1, RBR_OP_RECV, RBR_WC_SUCCESS, 42, 5)
            );
            assert_eq!(c.conn_context as usize, 0x5eed);
            assert_eq!(c.conn_id, rbr_conn_id(conn));
            assert_eq!(
                std::slice::from_raw_parts(rbr_mr_addr(mr).cast::<u8>(), 5),
                b"hello"
            );
            assert_eq!(rbr_cq_wait(scq, 10_000), RBR_OK);
            assert_eq!(rbr_cq_poll(scq, &mut c, 1, &mut n), RBR_OK);
            assert_eq!((c.opcode, c.status), (RBR_OP_DISCONNECTED, RBR_WC_SUCCESS));
            rbr_mr_destroy(mr);
            rbr_conn_destroy(conn);
        });

        let mut opts = std::mem::zeroed();
        rbr_conn_options_init(&mut opts);
        opts.private_data = b"first".as_ptr().cast();
        opts.private_data_len = 5;
        let mut conn = null_mut();
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), ccq, &opts, &mut conn),
            RBR_ERR_REJECTED
        );
        let mut len = 0;
        assert_eq!(rbr_last_reject_data(null_mut(), 0, &mut len), RBR_OK);
        assert_eq!(len, 7);
        let mut buf = [0u8; 16];
        assert_eq!(
            rbr_last_reject_data(buf.as_mut_ptr().cast(), buf.len(), &mut len),
            RBR_OK
        );
        assert_eq!(&buf[..len], b"go away");

        opts.private_data_len = 0;
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), ccq, &opts, &mut conn),
            RBR_OK
        );
        let (mut d, mut n) = ([0u8; RBR_PRIVATE_DATA_RECV_MAX], 0usize);
        assert_eq!(
            rbr_conn_private_data(conn, d.as_mut_ptr().cast(), d.len(), &mut n),
            RBR_OK
        );
        assert_eq!(&d[..n], b"ok");
        let mut info = std::mem::zeroed::<rbr_conn_info>();
        assert_eq!(
            rbr_conn_get_info(conn, &mut info),
            RBR_ERR_INVALID,
            "struct_size unset"
        );
        info.struct_size = std::mem::size_of::<rbr_conn_info>() as u32;
        assert_eq!(rbr_conn_get_info(conn, &mut info), RBR_OK);
        assert_eq!(
            (info.transport, info.send_queue_depth, info.max_inline),
            (RBR_TRANSPORT_SHM, 128, 64)
        );
        assert_eq!(
            rbr_conn_post_send_inline(conn, b"hello".as_ptr().cast(), 5, 1, RBR_SEND_SIGNALED),
            RBR_OK
        );
        let mut c = std::mem::zeroed::<rbr_completion>();
        assert_eq!(rbr_cq_wait(ccq, 10_000), RBR_OK);
        let mut got = 0;
        assert_eq!(rbr_cq_poll(ccq, &mut c, 1, &mut got), RBR_OK);
        assert_eq!(
            (c.opcode, c.status, c.wr_id),
            (RBR_OP_SEND, RBR_WC_SUCCESS, 1)
        );
        assert_eq!(rbr_conn_disconnect(conn), RBR_OK);
        assert_eq!(rbr_conn_disconnect(conn), RBR_OK);
        server.join().unwrap();
        rbr_conn_destroy(conn);
        rbr_listener_destroy(l);
        rbr_cq_destroy(scq);
        rbr_cq_destroy(ccq);
        rbr_ctx_destroy(ctx);
    }
}

#[test]
fn verbs_address_without_device_is_a_clear_status() {
    // SAFETY: valid handles and strings.
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let mut l = null_mut();
        let s = rbr_listen(ctx, c"rdma://198.18.0.1:7471".as_ptr(), 4, &mut l);
        assert!(
            s == RBR_ERR_NO_DEVICE || s == RBR_ERR_UNSUPPORTED,
            "{}",
            cstr(rbr_status_str(s))
        );
        assert!(l.is_null());
        rbr_ctx_destroy(ctx);
    }
}

/// Hostile lengths and sizes: every length is checked before a byte is read, the status is
/// RBR_ERR_INVALID (never a panic), nothing is created or answered, and out-parameters stay
/// untouched. (Run under ASan, `tests/c/bad_input.c` checks that no byte past the caller's
/// buffer is read.)
#[test]
fn hostile_lengths_and_sizes_are_invalid_and_change_nothing() {
    // SAFETY: every pointer is valid for what each call reads of it once its lengths are
    // checked (which is what this test proves), or NULL where allowed.
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let mut cq = null_mut();
        assert_eq!(rbr_cq_create(&mut cq), RBR_OK);
        let addr = unique_addr("ffi-hostile");
        let caddr = std::ffi::CString::new(addr.clone()).unwrap();
        let mut l = null_mut();
        assert_eq!(rbr_listen(ctx, caddr.as_ptr(), 4, &mut l), RBR_OK);
        let pd = [7u8; 48];
        let mut opts = std::mem::zeroed::<rbr_conn_options>();
        rbr_conn_options_init(&mut opts);
        let sentinel = std::ptr::dangling_mut::<rbr_conn>();
        for len in [49, 4096, usize::MAX] {
            let bad = rbr_conn_options {
                private_data: pd.as_ptr().cast(),
                private_data_len: len,
                ..opts
            };
            let mut conn = sentinel;
            assert_eq!(
                rbr_connect(ctx, caddr.as_ptr(), cq, &bad, &mut conn),
                RBR_ERR_INVALID,
                "connect, private_data_len {len}"
            );
            assert_eq!(conn, sentinel);
            assert!(
                cstr(rbr_last_error()).contains("private data"),
                "{}",
                cstr(rbr_last_error())
            );
        }
        // struct_size: too large to be a struct, or naming fields this library does not know.
        #[repr(C)]
        struct Newer {
            o: rbr_conn_options,
            extra: u64,
        }
        for (size, extra, want) in [
            (u32::MAX, 0, RBR_ERR_INVALID),
            (std::mem::size_of::<Newer>() as u32, 1, RBR_ERR_INVALID),
            (std::mem::size_of::<Newer>() as u32, 0, RBR_ERR_REFUSED), // valid: nobody there
        ] {
            let newer = Newer {
                o: rbr_conn_options {
                    struct_size: size,
                    ..opts
                },
                extra,
            };
            let mut conn = sentinel;
            let nobody = std::ffi::CString::new(unique_addr("ffi-nobody")).unwrap();
            // With u32::MAX the library must refuse the size before reading past `newer`.
            let r = rbr_connect(ctx, nobody.as_ptr(), cq, &newer.o, &mut conn);
            assert_eq!(r, want, "struct_size {size}, extra {extra}");
            assert_eq!(conn, sentinel);
        }
        // Accept and reject: a client waits while the server tries the hostile options.
        let ctx_u = ctx as usize;
        let client = std::thread::spawn(move || {
            let ctx = ctx_u as *mut rbr_ctx;
            let mut ccq = null_mut();
            assert_eq!(rbr_cq_create(&mut ccq), RBR_OK);
            let mut conn = null_mut();
            let c = std::ffi::CString::new(addr).unwrap();
            let r = rbr_connect(ctx, c.as_ptr(), ccq, null(), &mut conn);
            rbr_conn_destroy(conn);
            rbr_cq_destroy(ccq);
            r
        });
        let mut r = null_mut();
        assert_eq!(rbr_listener_get_request(l, 10_000, &mut r), RBR_OK);
        for len in [49, 4096, usize::MAX] {
            assert_eq!(
                rbr_request_reject(r, pd.as_ptr().cast(), len),
                RBR_ERR_INVALID
            );
            let bad = rbr_conn_options {
                private_data: pd.as_ptr().cast(),
                private_data_len: len,
                ..opts
            };
            let mut conn = sentinel;
            assert_eq!(rbr_request_accept(r, cq, &bad, &mut conn), RBR_ERR_INVALID);
            assert_eq!(conn, sentinel);
        }
        let bad = rbr_conn_options {
            timeout_ms: -77,
            ..opts
        };
        let mut conn = sentinel;
        assert_eq!(rbr_request_accept(r, cq, &bad, &mut conn), RBR_ERR_INVALID);
        // Nothing was answered: the request is still there to accept.
        let mut conn = null_mut();
        assert_eq!(rbr_request_accept(r, cq, &opts, &mut conn), RBR_OK);
        rbr_request_destroy(r);
        assert_eq!(client.join().unwrap(), RBR_OK);
        rbr_conn_destroy(conn);
        // Memory ranges that wrap or exceed the address space.
        let mut buf = [0u8; 32];
        let sentinel = std::ptr::dangling_mut::<rbr_mr>();
        for (p, len) in [
            (buf.as_mut_ptr(), usize::MAX),
            (buf.as_mut_ptr(), isize::MAX as usize + 1),
            ((usize::MAX - 15) as *mut u8, 32),
        ] {
            let mut mr = sentinel;
            assert_eq!(
                rbr_mr_register(ctx, p.cast(), len, RBR_ACCESS_LOCAL_WRITE, &mut mr),
                RBR_ERR_INVALID,
                "{p:p} + {len}"
            );
            assert_eq!(mr, sentinel);
        }
        let mut mr = sentinel;
        assert_eq!(
            rbr_mr_alloc(ctx, usize::MAX, RBR_ACCESS_LOCAL_WRITE, &mut mr),
            RBR_ERR_INVALID
        );
        assert_eq!(mr, sentinel);
        rbr_listener_destroy(l);
        rbr_cq_destroy(cq);
        rbr_ctx_destroy(ctx);
    }
}

/// With timeout 0 `rbr_listener_get_request` says RBR_EMPTY when nothing is there: not an
/// error, so the thread's last error is left as it was.
#[test]
fn get_request_with_timeout_zero_is_empty_not_an_error() {
    // SAFETY: valid pointers throughout.
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let c = std::ffi::CString::new(unique_addr("ffi-empty")).unwrap();
        let mut l = null_mut();
        assert_eq!(rbr_listen(ctx, c.as_ptr(), 4, &mut l), RBR_OK);
        let mut cq = null_mut();
        assert_eq!(rbr_cq_create(&mut cq), RBR_OK);
        assert_eq!(rbr_cq_wait(cq, -5), RBR_ERR_INVALID);
        let before = cstr(rbr_last_error());
        let sentinel = std::ptr::dangling_mut::<rbr_request>();
        let mut r = sentinel;
        let t = std::time::Instant::now();
        assert_eq!(rbr_listener_get_request(l, 0, &mut r), RBR_EMPTY);
        // Does not wait (a ceiling for a loaded machine: 0 read as "forever" would hang).
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        assert_eq!(r, sentinel);
        assert_eq!(cstr(rbr_last_error()), before);
        assert_eq!(rbr_listener_get_request(l, 10, &mut r), RBR_ERR_TIMEOUT);
        rbr_cq_destroy(cq);
        rbr_listener_destroy(l);
        rbr_ctx_destroy(ctx);
    }
}

/// Every exported function runs its body inside the panic boundary (`ffi_body!` or
/// `ffi_body_or!`), so no panic can unwind into C. Read from the sources of src/ffi/.
#[test]
fn every_export_runs_inside_the_panic_boundary() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/ffi");
    let (mut exports, mut outside) = (0, Vec::new());
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        let starts: Vec<usize> = src
            .match_indices("extern \"C\" fn ")
            .map(|(i, _)| i)
            .collect();
        for (k, &at) in starts.iter().enumerate() {
            let end = starts.get(k + 1).copied().unwrap_or(src.len());
            let body = &src[at..end];
            let name = body["extern \"C\" fn ".len()..].split('(').next().unwrap();
            if !(body.contains("ffi_body!(") || body.contains("ffi_body_or!(")) {
                outside.push(name.to_owned());
            }
            exports += 1;
        }
    }
    assert!(
        outside.is_empty(),
        "outside the panic boundary: {outside:?}"
    );
    assert!(exports >= 40, "only {exports} exports found");
}

/// The functions `null_arguments_return_rbr_err_null_and_write_nothing` does not reach, each
/// with NULL in every pointer it requires, in turn (the others valid): RBR_ERR_NULL, and no
/// out-parameter written. (tests/c/bad_matrix.c walks the same matrix, and more, from C.)
#[test]
fn every_other_export_refuses_null_and_writes_nothing() {
    use rdmabridge::ffi::rdma::*;
    // SAFETY: every pointer passed is NULL or valid; the functions must reject the NULLs
    // before they use any other argument.
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let mut cq = null_mut();
        assert_eq!(rbr_cq_create(&mut cq), RBR_OK);
        let mut mr = null_mut();
        assert_eq!(
            rbr_mr_alloc(ctx, 64, RBR_ACCESS_LOCAL_WRITE, &mut mr),
            RBR_OK
        );

        let dangling = std::ptr::dangling_mut::<rbr_ctx>();
        let mut out_ctx = dangling;
        let copts = rbr_ctx_options {
            struct_size: std::mem::size_of::<rbr_ctx_options>() as u32,
            flags: 0,
        };
        assert_eq!(rbr_ctx_create_ex(&copts, null_mut()), RBR_ERR_NULL);
        assert_eq!(
            rbr_ctx_create_ex(
                &rbr_ctx_options {
                    flags: 0x8000_0000,
                    ..copts
                },
                &mut out_ctx
            ),
            RBR_ERR_INVALID
        );
        assert_eq!(out_ctx, dangling, "written on failure");

        let mut out_mr = std::ptr::dangling_mut::<rbr_mr>();
        assert_eq!(rbr_mr_alloc(null_mut(), 64, 0, &mut out_mr), RBR_ERR_NULL);
        assert_eq!(rbr_mr_alloc(ctx, 64, 0, null_mut()), RBR_ERR_NULL);
        assert_eq!(out_mr, std::ptr::dangling_mut(), "written on failure");

        let mut fd = -77;
        assert_eq!(rbr_cq_fd(null(), &mut fd), RBR_ERR_NULL);
        assert_eq!(rbr_cq_fd(cq, null_mut()), RBR_ERR_NULL);
        assert_eq!(rbr_listener_fd(null(), &mut fd), RBR_ERR_NULL);
        assert_eq!(fd, -77, "written on failure");
        let mut n = 0x5a5a_usize;
        assert_eq!(rbr_cq_poll(null_mut(), null_mut(), 1, &mut n), RBR_ERR_NULL);
        assert_eq!(rbr_cq_poll(cq, null_mut(), 1, null_mut()), RBR_ERR_NULL);
        assert_eq!(n, 0x5a5a, "written on failure");

        let mut req = std::ptr::dangling_mut::<rbr_request>();
        assert_eq!(
            rbr_listener_get_request(null_mut(), 0, &mut req),
            RBR_ERR_NULL
        );
        assert_eq!(req, std::ptr::dangling_mut(), "written on failure");
        assert_eq!(
            rbr_request_private_data(null(), null_mut(), 0, &mut n),
            RBR_ERR_NULL
        );
        let mut conn = std::ptr::dangling_mut::<rbr_conn>();
        assert_eq!(
            rbr_request_accept(null_mut(), cq, null(), &mut conn),
            RBR_ERR_NULL
        );
        assert_eq!(rbr_request_reject(null_mut(), null(), 0), RBR_ERR_NULL);
        assert_eq!(conn, std::ptr::dangling_mut(), "written on failure");
        assert_eq!(
            rbr_last_reject_data(null_mut(), 0, null_mut()),
            RBR_ERR_NULL
        );
        assert_eq!(rbr_last_reject_data(null_mut(), 4, &mut n), RBR_ERR_NULL);
        assert_eq!(n, 0x5a5a, "written on failure");

        // Every connection function, on a NULL connection.
        assert_eq!(
            rbr_conn_post_send_inline(null_mut(), null(), 0, 1, 0),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_private_data(null(), null_mut(), 0, &mut n),
            RBR_ERR_NULL
        );
        let mut info = std::mem::zeroed::<rbr_conn_info>();
        assert_eq!(rbr_conn_get_info(null(), &mut info), RBR_ERR_NULL);
        assert_eq!(info.struct_size, 0, "written on failure");
        assert_eq!(rbr_conn_disconnect(null_mut()), RBR_ERR_NULL);
        let mut desc = [0x5au8; RBR_REMOTE_DESC_LEN];
        assert_eq!(
            rbr_conn_pack_region(null_mut(), mr, desc.as_mut_ptr()),
            RBR_ERR_NULL
        );
        assert_eq!(desc, [0x5a; RBR_REMOTE_DESC_LEN], "written on failure");
        let mut rem = std::mem::zeroed::<rbr_remote>();
        rem.addr = 0x5a;
        assert_eq!(
            rbr_conn_unpack_remote(null(), desc.as_ptr().cast(), desc.len(), &mut rem),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_remote_from_raw(null(), 1, 2, 3, &mut rem),
            RBR_ERR_NULL
        );
        assert_eq!(rem.addr, 0x5a, "written on failure");
        let sge = rbr_sge {
            mr,
            offset: 0,
            len: 8,
        };
        assert_eq!(
            rbr_conn_post_write(null_mut(), &sge, 1, &rem, 0, 1, 0),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_post_write_imm(null_mut(), &sge, 1, &rem, 0, 7, 1, 0),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_post_read(null_mut(), &sge, 1, &rem, 0, 1, 0),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_post_fetch_add(null_mut(), mr, 0, &rem, 0, 1, 1, 0),
            RBR_ERR_NULL
        );
        assert_eq!(
            rbr_conn_post_cmp_swap(null_mut(), mr, 0, &rem, 0, 1, 2, 1, 0),
            RBR_ERR_NULL
        );
        rbr_mr_destroy(mr);
        rbr_cq_destroy(cq);
        rbr_ctx_destroy(ctx);
    }
}

/// Posts on a connection that is closed, through the C functions: every kind of post is
/// RBR_ERR_DISCONNECTED (after its arguments pass), nothing reaches the completion queue
/// after the disconnect record, and disconnecting again is a no-op.
#[test]
fn every_post_on_a_closed_connection_is_disconnected() {
    use rdmabridge::ffi::rdma::*;
    // SAFETY: all pointers are valid handles or live locals; the handles cross threads as
    // integers, each used by one thread at a time.
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let (mut scq, mut ccq) = (null_mut(), null_mut());
        assert_eq!(rbr_cq_create(&mut scq), RBR_OK);
        assert_eq!(rbr_cq_create(&mut ccq), RBR_OK);
        let addr = std::ffi::CString::new(unique_addr("ffi-closed")).unwrap();
        let mut l = null_mut();
        assert_eq!(rbr_listen(ctx, addr.as_ptr(), 4, &mut l), RBR_OK);
        let (l_u, scq_u) = (l as usize, scq as usize);
        let server = std::thread::spawn(move || {
            let mut r = null_mut();
            assert_eq!(
                rbr_listener_get_request(l_u as *mut rbr_listener, 10_000, &mut r),
                RBR_OK
            );
            let mut s = null_mut();
            assert_eq!(
                rbr_request_accept(r, scq_u as *mut rbr_cq, null(), &mut s),
                RBR_OK
            );
            rbr_request_destroy(r);
            s as usize
        });
        let mut c = null_mut();
        assert_eq!(rbr_connect(ctx, addr.as_ptr(), ccq, null(), &mut c), RBR_OK);
        let s = server.join().unwrap() as *mut rbr_conn;
        let mut tmr = null_mut();
        let all = RBR_ACCESS_LOCAL_WRITE
            | RBR_ACCESS_REMOTE_WRITE
            | RBR_ACCESS_REMOTE_READ
            | RBR_ACCESS_REMOTE_ATOMIC;
        assert_eq!(rbr_mr_alloc(ctx, 4096, all, &mut tmr), RBR_OK);
        let mut desc = [0u8; RBR_REMOTE_DESC_LEN];
        assert_eq!(rbr_conn_pack_region(s, tmr, desc.as_mut_ptr()), RBR_OK);
        let mut rem = std::mem::zeroed::<rbr_remote>();
        assert_eq!(
            rbr_conn_unpack_remote(c, desc.as_ptr().cast(), desc.len(), &mut rem),
            RBR_OK
        );
        let mut mr = null_mut();
        assert_eq!(
            rbr_mr_alloc(ctx, 64, RBR_ACCESS_LOCAL_WRITE, &mut mr),
            RBR_OK
        );

        assert_eq!(rbr_conn_disconnect(c), RBR_OK);
        let mut rec = std::mem::zeroed::<rbr_completion>();
        let mut n = 0usize;
        loop {
            assert_eq!(rbr_cq_wait(ccq, 10_000), RBR_OK, "no disconnect record");
            assert_eq!(rbr_cq_poll(ccq, &mut rec, 1, &mut n), RBR_OK);
            if rec.opcode == RBR_OP_DISCONNECTED {
                break;
            }
        }
        let sge = rbr_sge {
            mr,
            offset: 0,
            len: 8,
        };
        for (what, st) in [
            ("send", rbr_conn_post_send(c, mr, 0, 8, 1, 0)),
            (
                "send_inline",
                rbr_conn_post_send_inline(c, b"x".as_ptr().cast(), 1, 1, 0),
            ),
            ("recv", rbr_conn_post_recv(c, mr, 0, 8, 1)),
            ("write", rbr_conn_post_write(c, &sge, 1, &rem, 0, 1, 0)),
            (
                "write_imm",
                rbr_conn_post_write_imm(c, &sge, 1, &rem, 0, 7, 1, 0),
            ),
            ("read", rbr_conn_post_read(c, &sge, 1, &rem, 0, 1, 0)),
            (
                "fetch_add",
                rbr_conn_post_fetch_add(c, mr, 0, &rem, 0, 1, 1, 0),
            ),
            (
                "cmp_swap",
                rbr_conn_post_cmp_swap(c, mr, 0, &rem, 0, 1, 2, 1, 0),
            ),
        ] {
            assert_eq!(
                st, RBR_ERR_DISCONNECTED,
                "post_{what} on a closed connection"
            );
        }
        assert_eq!(rbr_conn_disconnect(c), RBR_OK, "disconnecting again");
        assert_eq!(
            rbr_cq_poll(ccq, &mut rec, 1, &mut n),
            RBR_EMPTY,
            "a record after the end"
        );
        rbr_conn_destroy(c);
        rbr_conn_destroy(s);
        rbr_mr_destroy(mr);
        rbr_mr_destroy(tmr);
        rbr_listener_destroy(l);
        rbr_cq_destroy(ccq);
        rbr_cq_destroy(scq);
        rbr_ctx_destroy(ctx);
    }
}
