//! An echo server: accepts connections one after another and sends every message back.
//!
//!     cargo run --example server -- [ADDRESS]        (default shm://rdmabridge-example)
//!
//! Pair it with `cargo run --example client`. One completion queue serves every connection;
//! each completion names its connection, so the server needs no thread per client.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Connection, Context, MemoryRegion, Opcode, SendFlags,
    WcStatus,
};

/// Largest message the server takes.
const MAX: usize = 4096;
/// Receives kept posted per connection.
const SLOTS: usize = 16;

struct Client {
    conn: Connection,
    /// SLOTS receive slots, then SLOTS send slots: slot `i` echoes from `SLOTS + i`.
    mr: Arc<MemoryRegion>,
}

fn main() -> rdmabridge::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "shm://rdmabridge-example".into());
    let ctx = Context::new()?;
    let cq = CompletionQueue::new()?;
    let listener = ctx.listen(&addr, 16)?;
    println!("listening on {addr}");
    let mut clients: HashMap<u64, Client> = HashMap::new();
    loop {
        // New clients first, without waiting.
        while let Some(req) = listener.try_get_request()? {
            let conn = req.accept(&cq, &ConnOptions::default())?;
            let mr = ctx.alloc_mr(2 * SLOTS * MAX, Access::LOCAL_WRITE)?;
            for slot in 0..SLOTS {
                conn.post_recv(&mr, slot * MAX, MAX, slot as u64)?;
            }
            println!("client {} connected", conn.id());
            clients.insert(conn.id(), Client { conn, mr });
        }
        // Then whatever finished, waiting a little when nothing did.
        let Some(c) = cq.poll() else {
            cq.wait(Some(Duration::from_millis(100)))?;
            continue;
        };
        match c.opcode {
            Opcode::Recv if c.status == WcStatus::Success => {
                let Some(client) = clients.get(&c.conn_id) else {
                    continue;
                };
                let slot = c.wr_id as usize;
                let len = c.byte_len as usize;
                // Copy the message to the slot's send half, echo it, and repost the receive.
                let mut msg = vec![0; len];
                // SAFETY: the slot's receive has completed and is reposted only below; the
                // slot's previous echo was taken by the client before it sent this message
                // (it sends one at a time and waits for each echo), so no work request reads
                // the send half any more.
                unsafe { client.mr.read(slot * MAX, &mut msg) }?;
                // SAFETY: as above.
                unsafe { client.mr.write((SLOTS + slot) * MAX, &msg) }?;
                client.conn.post_send(
                    &client.mr,
                    (SLOTS + slot) * MAX,
                    len,
                    slot as u64,
                    SendFlags::SIGNALED,
                )?;
                client
                    .conn
                    .post_recv(&client.mr, slot * MAX, MAX, slot as u64)?;
            }
            Opcode::Disconnected => {
                // The last record of a connection: its resources can go.
                clients.remove(&c.conn_id);
                println!("client {} gone ({:?})", c.conn_id, c.status);
            }
            // Echoes are signaled (a send queue frees its slots as sends complete); their
            // completions need nothing more. A failure is followed by the connection's
            // Disconnected record.
            _ if c.status != WcStatus::Success && c.status != WcStatus::Flushed => {
                println!(
                    "client {}: {:?} failed: {:?}",
                    c.conn_id, c.opcode, c.status
                );
            }
            _ => {}
        }
    }
}
