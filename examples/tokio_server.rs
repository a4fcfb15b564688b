//! An echo server on tokio: a task per client, one completion queue for all of them, and no
//! `wr_id`s - every receive and send is a future that resolves with its buffer.
//!
//!     cargo run --features tokio --example tokio_server -- [ADDRESS]
//!
//! (default shm://rdmabridge-tokio-example). Pair it with `--example tokio_client`.

use rdmabridge::ops::{Buf, Op};
use rdmabridge::tokio::{Listener, Queue};
use rdmabridge::{Completion, ConnOptions, ConnRequest, Context, Opcode};
use std::collections::VecDeque;

/// Largest message the server takes.
const MAX: usize = 4096;
/// Receives kept posted per client: how far a client may send ahead of the echoes.
const SLOTS: usize = 16;

#[tokio::main(flavor = "current_thread")]
async fn main() -> rdmabridge::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "shm://rdmabridge-tokio-example".into());
    let ctx = Context::new()?;
    let queue = Queue::new()?;
    let listener = Listener::bind(&ctx, &addr, 128)?;
    println!("listening on {addr}");
    loop {
        tokio::select! {
            // Each client in a task of its own, from its accept on: a client slow to confirm
            // holds up nobody.
            req = listener.accept() => {
                tokio::spawn(serve(ctx.clone(), queue.clone(), req?));
            }
            // Records no future waits for: here, connection events.
            c = queue.next() => report(c),
        }
    }
}

/// Accepts `req`, then sends every message of the connection back until it ends.
async fn serve(ctx: Context, queue: Queue, req: ConnRequest) -> rdmabridge::Result<()> {
    let conn = queue.accept(req, &ConnOptions::default()).await?;
    println!("client {} connected", conn.id());
    let mut recvs: VecDeque<Op<_>> = Buf::alloc_many(&ctx, SLOTS, MAX)?
        .into_iter()
        .map(|b| conn.recv(b))
        .collect();
    while let Some(recv) = recvs.pop_front() {
        let (r, buf) = recv.await;
        if r.is_err() {
            break; // the connection ended (its receives are flushed)
        }
        // The message goes back from the buffer it came in; then the buffer receives again.
        let (r, buf) = conn.send(buf).await;
        r?;
        recvs.push_back(conn.recv(buf));
    }
    Ok(())
}

fn report(c: Completion) {
    if c.opcode == Opcode::Disconnected {
        println!("client {} left ({:?})", c.conn_id, c.status);
    }
}
