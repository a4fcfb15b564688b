//! rdmabridge-info on this machine: it names the transports, routes each address form as the
//! library would, and explains what is missing. (In the soft-RoCE VM, scripts/vm-guest-suite.sh
//! checks it again: the device, its port and GIDs, the device an rdma:// address takes, and
//! the memory-lock limit named as the cause of a failed registration.)

use std::process::Command;

fn info(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_rdmabridge-info"))
        .args(args)
        .env_remove("RBR_TRANSPORT")
        .output()
        .expect("rdmabridge-info runs");
    assert!(out.status.success(), "exit {:?}", out.status);
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn has_line(out: &str, want: &str) -> bool {
    out.lines().any(|l| l.starts_with(want))
}

#[test]
fn names_the_transports_and_routes_every_address_form() {
    let out = info(&["shm://diag", "127.0.0.1:7000", "localhost:9", "tcp://x:1"]);
    let transports = if cfg!(feature = "verbs") {
        "transports: shm, verbs"
    } else {
        "transports: shm"
    };
    assert!(has_line(&out, transports), "{out}");
    assert!(
        has_line(&out, "address shm://diag: shm to diag (the shm:// form"),
        "{out}"
    );
    assert!(
        has_line(
            &out,
            "address 127.0.0.1:7000: shm to port-7000 (a loopback address"
        ),
        "{out}"
    );
    assert!(
        has_line(&out, "address localhost:9: shm to port-9"),
        "{out}"
    );
    assert!(
        has_line(
            &out,
            "address tcp://x:1: invalid: bad address \"tcp://x:1\": unknown scheme"
        ),
        "{out}"
    );
    assert!(has_line(&out, "memlock limit (ulimit -l): "), "{out}");
}

#[test]
fn without_a_device_an_rdma_address_says_what_fails_and_how_to_get_one() {
    let out = info(&["rdma://192.0.2.1:7471"]);
    if std::path::Path::new("/sys/class/infiniband").exists() {
        // The kernel has RDMA devices: libibverbs lists them, or the hint says why not. (The
        // VM suite checks a machine with a device in full.)
        assert!(
            !has_line(&out, "RDMA devices: 0") || out.contains("hint: the kernel has RDMA devices"),
            "{out}"
        );
        return;
    }
    assert!(has_line(&out, "RDMA devices: 0"), "{out}");
    assert!(
        has_line(
            &out,
            "address rdma://192.0.2.1:7471: verbs to 192.0.2.1:7471 (the rdma:// form"
        ),
        "{out}"
    );
    if cfg!(feature = "verbs") {
        assert!(
            has_line(
                &out,
                "  problem: no RDMA device here: listen and connect fail with RBR_ERR_NO_DEVICE"
            ),
            "{out}"
        );
        assert!(
            has_line(&out, "hint: no RDMA device: the kernel has none"),
            "{out}"
        );
        assert!(out.contains("modprobe rdma_rxe"), "{out}");
    }
}

#[test]
fn bad_arguments_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_rdmabridge-info"))
        .args(["--register", "lots"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--register needs a size"));
}
