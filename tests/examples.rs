//! The crate's examples run as a user runs them: the echo server, and two clients one after
//! the other against it, every echo verified by the client.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where cargo put the example binaries: `examples/` next to this test's `deps/` (a plain
/// `cargo test` builds them; with `--test examples` alone, build them first: `--examples`).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps")
        .join("examples")
        .join(name)
}

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

/// Idle CPU time (user + system) of process `pid` so far, in clock ticks.
#[cfg(feature = "tokio")]
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process's stat");
    // After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
    let rest = &stat[stat.rfind(')').expect("stat's command") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// The tokio echo server serves 64 clients at once (one client process, a connection and a
/// task each), every echo verified, then sits on the open, idle connections using no CPU to
/// speak of (measured over 10 s).
#[cfg(feature = "tokio")]
#[test]
fn tokio_server_serves_64_clients_at_once_and_idles_without_cpu() {
    let addr = format!("shm://rbr-examples-tokio-{}", std::process::id());
    let mut server = Command::new(example("tokio_server"))
        .arg(&addr)
        .stdout(Stdio::null())
        .spawn()
        .expect("examples/tokio_server runs (cargo test --features tokio builds it)");
    let deadline = Instant::now() + Duration::from_secs(10);
    let idle = 10;
    let mut client = loop {
        let mut c = Command::new(example("tokio_client"))
            .args([&addr, "200", "64", &(idle + 2).to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("examples/tokio_client runs");
        // Gone at once: the server was not up yet.
        std::thread::sleep(Duration::from_millis(200));
        match c.try_wait().unwrap() {
            Some(_) if Instant::now() < deadline => continue,
            Some(s) => panic!("client failed: {s}"),
            None => break c,
        }
    };
    // Wait for the verdict, then measure both processes while the connections idle.
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(client.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.starts_with("12800 echoes verified over 64 connections"),
        "{line}"
    );
    let (s0, c0) = (cpu_ticks(server.id()), cpu_ticks(client.id()));
    std::thread::sleep(Duration::from_secs(idle));
    let (s1, c1) = (cpu_ticks(server.id()), cpu_ticks(client.id()));
    assert!(client.wait().unwrap().success());
    let _ = server.kill();
    let _ = server.wait();
    let tick_ms = 1000 / 100; // USER_HZ is 100 on Linux
    println!(
        "CPU time over {idle} idle seconds with 64 connections open: server {} ms, client {} ms",
        (s1 - s0) * tick_ms,
        (c1 - c0) * tick_ms
    );
    // Less than 1% of a core.
    assert!((s1 - s0) * tick_ms < idle * 10, "server busy while idle");
    assert!((c1 - c0) * tick_ms < idle * 10, "client busy while idle");
}
