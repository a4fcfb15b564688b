//! Fault tests for both transports (docs/faults.md): a server process killed and started again
//! on the same address while its clients reconnect. Run over shm by tests/shm.rs and over
//! verbs in the VM by tests/verbs.rs; each of those files also defines the child test that
//! this one starts as the server process (`faults_echo_server_child`).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Connection, Context, Error, Opcode, SendFlags, WcStatus,
};

use super::{Net, next, pattern};

/// The environment variable that makes `faults_echo_server_child` serve (its address).
pub const SERVER_ADDR_ENV: &str = "RBR_TEST_FAULTS_SERVER_ADDR";
/// Message size of the echo exchanges.
const SIZE: usize = 256;
/// Receives each side keeps posted.
const SLOTS: usize = 8;
/// How long after the server is killed its clients must have their RBR_OP_DISCONNECTED: it
/// takes milliseconds; the ceiling is for a loaded machine (as
/// `peer_killed_mid_stream_is_reported_at_once`).
const DISCONNECT_BOUND: Duration = Duration::from_secs(5);

/// The server process: accepts every connection on the address in its environment and echoes
/// every message back, until it is killed. Returns at once when the variable is unset (so a
/// plain `--ignored` run passes over it).
pub fn echo_server_child() {
    let Ok(addr) = std::env::var(SERVER_ADDR_ENV) else {
        return;
    };
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let l = ctx.listen(&addr, 16).unwrap();
    println!("listening on {addr}");
    let mut conns: HashMap<u64, (Connection, Arc<rdmabridge::MemoryRegion>)> = HashMap::new();
    loop {
        while let Some(req) = l.try_get_request().unwrap() {
            let Ok(conn) = req.accept(&cq, &ConnOptions::default()) else {
                continue;
            };
            let mr = ctx.alloc_mr(SLOTS * SIZE, Access::LOCAL_WRITE).unwrap();
            for s in 0..SLOTS {
                conn.post_recv(&mr, s * SIZE, SIZE, s as u64).unwrap();
            }
            conns.insert(conn.id(), (conn, mr));
        }
        while let Some(c) = cq.poll() {
            let Some((conn, mr)) = conns.get(&c.conn_id) else {
                continue;
            };
            match (c.opcode, c.status) {
                // Echo from the receive's slot; repost the slot once the echo is sent.
                (Opcode::Recv, WcStatus::Success) => {
                    let slot = c.wr_id as usize;
                    let _ = conn.post_send(
                        mr,
                        slot * SIZE,
                        c.byte_len as usize,
                        c.wr_id,
                        SendFlags::SIGNALED,
                    );
                }
                (Opcode::Send, WcStatus::Success) => {
                    let slot = c.wr_id as usize;
                    let _ = conn.post_recv(mr, slot * SIZE, SIZE, c.wr_id);
                }
                (Opcode::Disconnected, _) => {
                    conns.remove(&c.conn_id);
                }
                _ => {}
            }
        }
        let _ = cq.wait(Some(Duration::from_millis(20)));
    }
}

/// The server process, killed when dropped (also when the test fails half-way).
struct Server(Child);

impl Server {
    /// SIGKILL, and reap it.
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts the test binary `exe` (this one) as the echo server on `addr` and waits until it listens.
fn start_server(exe: &std::path::Path, child_test: &str, addr: &str) -> Server {
    let mut child = Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            child_test,
            "--test-threads=1",
            "--nocapture",
        ])
        .env(SERVER_ADDR_ENV, addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Its first line says it listens.
    use std::io::BufRead;
    let out = child.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(out).lines();
    let want = format!("listening on {addr}");
    let found = lines
        .by_ref()
        .take(50)
        .any(|l| l.is_ok_and(|l| l.contains(&want)));
    assert!(found, "the server process did not listen on {addr}");
    // Keep draining its output in the background, so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server(child)
}

/// A client connection and its region: SLOTS receive slots, then one send slot.
struct Client {
    conn: Connection,
    cq: Arc<CompletionQueue>,
    mr: Arc<rdmabridge::MemoryRegion>,
    /// Messages sent so far, for the pattern.
    sent: u64,
}

impl Client {
    /// Connects once (timeout `timeout`), posting SLOTS receives.
    fn connect(ctx: &Context, addr: &str, timeout: Duration) -> Result<Client, Error> {
        let cq = CompletionQueue::new().unwrap();
        let opts = ConnOptions {
            timeout: Some(timeout),
            ..Default::default()
        };
        let conn = ctx.connect(addr, &cq, &opts)?;
        let mr = ctx
            .alloc_mr((SLOTS + 1) * SIZE, Access::LOCAL_WRITE)
            .unwrap();
        for s in 0..SLOTS {
            conn.post_recv(&mr, s * SIZE, SIZE, s as u64).unwrap();
        }
        Ok(Client {
            conn,
            cq,
            mr,
            sent: 0,
        })
    }

    /// Sends one message and checks its echo byte for byte.
    fn echo(&mut self) {
        let k = self.sent;
        self.sent += 1;
        let msg = pattern(k, SIZE);
        // SAFETY: the previous message's send has completed (below): nothing uses the send slot.
        unsafe { self.mr.write(SLOTS * SIZE, &msg) }.unwrap();
        self.conn
            .post_send(&self.mr, SLOTS * SIZE, SIZE, 1000 + k, SendFlags::SIGNALED)
            .unwrap();
        let (mut got_send, mut got_recv) = (false, false);
        while !(got_send && got_recv) {
            let c = next(&self.cq);
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            match c.opcode {
                Opcode::Send => got_send = true,
                Opcode::Recv => {
                    assert_eq!(c.byte_len as usize, SIZE);
                    let mut buf = vec![0u8; SIZE];
                    // SAFETY: this slot's receive has completed; it is reposted only below.
                    unsafe { self.mr.read(c.wr_id as usize * SIZE, &mut buf) }.unwrap();
                    assert_eq!(buf, msg, "echo of message {k}");
                    self.conn
                        .post_recv(&self.mr, c.wr_id as usize * SIZE, SIZE, c.wr_id)
                        .unwrap();
                    got_recv = true;
                }
                other => panic!("unexpected {other:?} in {c:?}"),
            }
        }
    }
}

/// Connects in a loop until the server answers, as a client of a restarting server does. A
/// failed attempt must be one of the statuses of a server that is not there (refused over
/// shm; over verbs refused, or unreachable or timed out while the port is not yet bound);
/// returns the client and how many attempts failed.
fn reconnect(ctx: &Context, addr: &str, deadline: Instant) -> (Client, u32) {
    let mut failed = 0;
    loop {
        match Client::connect(ctx, addr, Duration::from_millis(500)) {
            Ok(c) => return (c, failed),
            Err(Error::Refused(_) | Error::Timeout(_) | Error::Unreachable(_)) => {
                failed += 1;
                assert!(
                    Instant::now() < deadline,
                    "no connection after {failed} attempts"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("a reconnect failed with an unexpected status: {e:?}"),
        }
    }
}

/// A server process is SIGKILLed and started again on the same address while its clients
/// reconnect in a loop. The clients connected before the kill each get their outstanding
/// receives flushed and RBR_OP_DISCONNECTED at once, and every post after it is refused
/// as disconnected; the reconnecting clients fail with a "nobody there" status while the
/// server is down (over shm the address is still bound to the dead process's socket file:
/// the new server must be able to take it over), and every one gets through, with verified
/// echoes, once it is back.
pub fn server_restarted_while_clients_reconnect(net: &Net, child_test: &str) {
    let exe = std::env::current_exe().unwrap();
    const CLIENTS: usize = 3;
    let ctx = Context::new().unwrap();
    let addr = net.addr("restart");
    let mut server = start_server(&exe, child_test, &addr);
    let mut before: Vec<Client> = (0..CLIENTS)
        .map(|_| {
            let deadline = Instant::now() + Duration::from_secs(20);
            let (mut c, _) = reconnect(&ctx, &addr, deadline);
            c.echo();
            c.echo();
            c
        })
        .collect();

    server.kill();
    let killed = Instant::now();
    for (i, c) in before.iter_mut().enumerate() {
        let mut flushed = 0;
        loop {
            let r = next(&c.cq);
            match (r.opcode, r.status) {
                (Opcode::Recv, WcStatus::Flushed) => flushed += 1,
                (Opcode::Disconnected, s) => {
                    // As in peer_killed_mid_stream: shm sees the peer vanish; over verbs the
                    // dead process's kernel closes the connection in order.
                    let want = match net {
                        Net::Shm => WcStatus::Transport,
                        Net::Verbs(_) => WcStatus::Success,
                    };
                    assert_eq!(s, want, "client {i}");
                    break;
                }
                other => panic!("client {i}: unexpected {other:?}"),
            }
        }
        assert!(
            killed.elapsed() < DISCONNECT_BOUND,
            "client {i}: disconnect took {:?}",
            killed.elapsed()
        );
        assert_eq!(
            flushed, SLOTS,
            "client {i}: every posted receive is flushed"
        );
        assert!(
            c.cq.poll().is_none(),
            "client {i}: nothing after the disconnect"
        );
        assert!(matches!(
            c.conn
                .post_send(&c.mr, SLOTS * SIZE, SIZE, 1, SendFlags::SIGNALED),
            Err(Error::Disconnected)
        ));
    }
    drop(before);

    // Clients reconnect in a loop while the server is down; it comes back after a while.
    let down_for = Duration::from_millis(700);
    let restarted = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                s.spawn(|| {
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let (mut c, failed) = reconnect(&ctx, &addr, deadline);
                    c.echo();
                    c.echo();
                    c.conn.disconnect();
                    loop {
                        let r = next(&c.cq);
                        if r.opcode == Opcode::Disconnected {
                            assert_eq!(r.status, WcStatus::Success);
                            break;
                        }
                        assert_eq!((r.opcode, r.status), (Opcode::Recv, WcStatus::Flushed));
                    }
                    failed
                })
            })
            .collect();
        std::thread::sleep(down_for);
        let server = start_server(&exe, child_test, &addr);
        let failed: Vec<u32> = clients.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            failed.iter().all(|&f| f > 0),
            "every client found the server down at first: {failed:?}"
        );
        server
    });
    drop(restarted);
}
