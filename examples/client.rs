//! A client for `examples/server.rs`: sends COUNT messages, one at a time, and checks that each
//! comes back unchanged.
//!
//!     cargo run --example client -- [ADDRESS [COUNT]]   (default shm://rdmabridge-example 1000)

use std::time::{Duration, Instant};

use rdmabridge::{Access, Completion, CompletionQueue, ConnOptions, Context, Opcode, SendFlags};

fn next(cq: &CompletionQueue) -> Result<Completion, Box<dyn std::error::Error>> {
    loop {
        if let Some(c) = cq.poll() {
            return Ok(c);
        }
        if !cq.wait(Some(Duration::from_secs(5)))? {
            return Err("no completion within 5 s".into());
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .unwrap_or_else(|| "shm://rdmabridge-example".into());
    let count: u64 = args.next().map_or(Ok(1000), |s| s.parse())?;
    let ctx = Context::new()?;
    let cq = CompletionQueue::new()?;
    let conn = ctx.connect(&addr, &cq, &ConnOptions::default())?;
    // The first half of the region is sent from, the second received into.
    let mr = ctx.alloc_mr(2 * 4096, Access::LOCAL_WRITE)?;
    let start = Instant::now();
    for i in 0..count {
        let msg = format!("message {i} from client {}", conn.id());
        // SAFETY: the previous message's send has completed (below): no work request uses
        // the send half.
        unsafe { mr.write(0, msg.as_bytes()) }?;
        conn.post_recv(&mr, 4096, 4096, i)?;
        conn.post_send(&mr, 0, msg.len(), i, SendFlags::SIGNALED)?;
        // The send's completion and the echo come in either order.
        let (mut sent, mut echoed) = (false, false);
        while !(sent && echoed) {
            let c = next(&cq)?;
            if c.status != rdmabridge::WcStatus::Success {
                return Err(format!("{:?} failed: {:?}", c.opcode, c.status).into());
            }
            match c.opcode {
                Opcode::Send => sent = true,
                Opcode::Recv => {
                    let mut back = vec![0; c.byte_len as usize];
                    // SAFETY: the receive into the second half has completed, and no other is
                    // posted there.
                    unsafe { mr.read(4096, &mut back) }?;
                    if back != msg.as_bytes() {
                        return Err(format!("echo {i} differs").into());
                    }
                    echoed = true;
                }
                _ => {}
            }
        }
    }
    let took = start.elapsed();
    println!(
        "{count} echoes verified in {took:?} ({:.1} us per round trip)",
        took.as_secs_f64() * 1e6 / count.max(1) as f64
    );
    Ok(())
}
