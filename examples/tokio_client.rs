//! A tokio client of the echo server: opens CONNECTIONS connections at once, sends COUNT
//! messages on each (a few ahead of the echoes), and checks every echo.
//!
//!     cargo run --features tokio --example tokio_client -- [ADDRESS [COUNT [CONNECTIONS [IDLE]]]]
//!
//! (defaults shm://rdmabridge-tokio-example, 1000, 1, 0). Prints "N echoes verified over C
//! connections" when all came back intact, then keeps the connections open and idle for IDLE
//! seconds, and exits 0.

use rdmabridge::ops::{AsyncConnection, Buf};
use rdmabridge::tokio::Queue;
use rdmabridge::{ConnOptions, Context, Error};
use std::collections::VecDeque;

/// Messages in flight per connection (fewer than the server's receives per client).
const AHEAD: usize = 4;

#[tokio::main(flavor = "current_thread")]
async fn main() -> rdmabridge::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .unwrap_or_else(|| "shm://rdmabridge-tokio-example".into());
    let count: u64 = args.next().map_or(Ok(1000), |s| s.parse()).expect("COUNT");
    let conns: usize = args
        .next()
        .map_or(Ok(1), |s| s.parse())
        .expect("CONNECTIONS");
    let idle: u64 = args.next().map_or(Ok(0), |s| s.parse()).expect("IDLE");
    let ctx = Context::new()?;
    let queue = Queue::new()?;
    let mut tasks = Vec::new();
    // Every connection at once, each in its task from its connect on.
    for _ in 0..conns {
        let (ctx, queue, addr) = (ctx.clone(), queue.clone(), addr.clone());
        tasks.push(tokio::spawn(async move {
            let conn = queue.connect(&ctx, &addr, &ConnOptions::default()).await?;
            talk(ctx, conn, count).await
        }));
    }
    let mut open = Vec::new();
    for t in tasks {
        open.push(t.await.expect("the connection's task")?);
    }
    println!(
        "{} echoes verified over {conns} connections",
        count * conns as u64
    );
    tokio::time::sleep(std::time::Duration::from_secs(idle)).await;
    drop(open);
    Ok(())
}

/// The bytes of message `k`: its number, then a pattern of it, 8 to 1000 bytes in all.
fn message(k: u64) -> Vec<u8> {
    let len = 8 + (k as usize * 37) % 993;
    let mut m = k.to_le_bytes().to_vec();
    m.extend((8..len).map(|i| (k as usize * 131 + i * 7) as u8));
    m
}

/// Sends `count` messages on `conn`, `AHEAD` at a time, and checks their echoes in order.
/// Gives the connection back, for the caller to keep open or close.
async fn talk(
    ctx: Context,
    conn: AsyncConnection,
    count: u64,
) -> rdmabridge::Result<AsyncConnection> {
    let mut bufs = Buf::alloc_many(&ctx, 2 * AHEAD, 1024)?;
    let mut echoes = VecDeque::new();
    let (mut sent, mut checked) = (0, 0);
    while checked < count {
        // Keep AHEAD messages in flight, each with its echo's receive posted first.
        while sent < count && echoes.len() < AHEAD {
            let (mut out, back) = (bufs.pop().expect("a buffer"), bufs.pop().expect("a buffer"));
            echoes.push_back((sent, conn.recv(back)));
            out.fill(&message(sent))?;
            let (r, out) = conn.send(out).await;
            r?;
            bufs.push(out);
            sent += 1;
        }
        let (k, echo) = echoes.pop_front().expect("an echo awaited");
        let (r, back) = echo.await;
        r?;
        if back[..] != message(k)[..] {
            return Err(Error::Protocol(format!(
                "echo {k} differs from what was sent"
            )));
        }
        bufs.push(back);
        checked += 1;
    }
    Ok(conn)
}
