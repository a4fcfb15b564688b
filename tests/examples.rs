//! The crate's examples run as a user runs them: the echo server, and two clients one after
//! the other against it, every echo verified by the client; and the tokio pair.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::example;

#[test]
fn server_echoes_to_clients_one_after_another() {
    let addr = format!("shm://rbr-examples-{}", std::process::id());
    let mut server = Command::new(example("server"))
        .arg(&addr)
        .stdout(Stdio::null())
        .spawn()
        .expect("examples/server runs (cargo builds examples for tests)");
    // The server is up once a client gets through; retry its first connect for a while.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut runs = Vec::new();
    for count in ["300", "50"] {
        loop {
            let out = Command::new(example("client"))
                .args([&addr, count])
                .output()
                .expect("examples/client runs");
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() {
                runs.push(stdout);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "client failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    assert!(runs[0].starts_with("300 echoes verified"), "{}", runs[0]);
    assert!(runs[1].starts_with("50 echoes verified"), "{}", runs[1]);
}

#[test]
fn rbr_log_tells_connection_events_and_is_silent_by_default() {
    let addr = format!("shm://rbr-examples-log-{}", std::process::id());
    // Nobody listens: the connect fails, and with RBR_LOG=info the library says so, naming the
    // address; without RBR_LOG it prints nothing (the client's own message aside).
    let quiet = Command::new(example("client"))
        .args([&addr, "1"])
        .env_remove("RBR_LOG")
        .output()
        .expect("client runs");
    assert!(!quiet.status.success());
    let stderr = String::from_utf8_lossy(&quiet.stderr);
    assert!(!stderr.contains("rdmabridge["), "{stderr}");
    let loud = Command::new(example("client"))
        .args([&addr, "1"])
        .env("RBR_LOG", "info")
        .output()
        .expect("client runs");
    let stderr = String::from_utf8_lossy(&loud.stderr);
    assert!(
        stderr.contains(&format!("] warn: connecting to {addr} failed: ")),
        "{stderr}"
    );

    let mut server = Command::new(example("server"))
        .arg(&addr)
        .env("RBR_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("server runs");
    let deadline = Instant::now() + Duration::from_secs(10);
    let (client, client_pid) = loop {
        let child = Command::new(example("client"))
            .args([&addr, "3"])
            .env("RBR_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("client runs");
        let pid = child.id();
        let out = child.wait_with_output().expect("client output");
        if out.status.success() || Instant::now() > deadline {
            break (out, pid);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let server_pid = server.id();
    let _ = server.kill();
    let server_out = server.wait_with_output().expect("server output");
    assert!(client.status.success());
    let stderr = String::from_utf8_lossy(&client.stderr);
    assert!(
        stderr.contains(&format!("] info: connection 1 to {addr} established (Shm)")),
        "{stderr}"
    );
    // The client closed in order (its drop waits for the connection's last record), and the
    // message names the peer: the server's process.
    assert!(
        stderr.contains(&format!(
            "] info: connection 1 with process {server_pid} disconnected (orderly close)"
        )),
        "{stderr}"
    );
    let stderr = String::from_utf8_lossy(&server_out.stderr);
    assert!(
        stderr.contains(&format!("] info: listening on {addr}")),
        "{stderr}"
    );
    // The server names the client that it accepted.
    assert!(
        stderr.contains(&format!(
            "] info: connection 1 from process {client_pid} accepted (Shm)"
        )),
        "{stderr}"
    );
}

/// The tokio echo server serves 64 clients at once over shm (one client process, a connection
/// and a task each), every echo verified, then sits on the open, idle connections using no CPU
/// to speak of: less than 1% of a core over 10 s, as its client.
#[cfg(feature = "tokio")]
#[test]
fn tokio_server_serves_64_clients_at_once_and_idles_without_cpu() {
    let addr = format!("shm://rbr-examples-tokio-{}", std::process::id());
    let (server_ms, client_ms) = common::asyncs::examples_serve_many(&addr, 64, 10);
    assert!(server_ms < 100, "server busy while idle");
    assert!(client_ms < 100, "client busy while idle");
}
