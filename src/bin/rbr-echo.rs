//! rbr-echo: the Rust counterpart of the C examples, and the peer program of the
//! multi-process tests.
//!
//!     rbr-echo server ADDR COUNT SIZE   accept one connection, verify and echo COUNT messages
//!     rbr-echo client ADDR COUNT SIZE   send COUNT messages (window 32), verify every echo
//!     rbr-echo flood  ADDR SIZE         connect, keep sending with receives posted, never stop
//!
//! Byte `i` of message `k` (counted per direction) is `k * 131 + i * 7 + 1` (mod 256).
//! Exits 0 only when every message verified.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmabridge::{
    Access, Completion, CompletionQueue, ConnOptions, Connection, Context, MemoryRegion, Opcode,
    SendFlags, WcStatus,
};

const WINDOW: usize = 32;
/// The server keeps twice the client's window of receives, so however its echoes are delayed
/// at least WINDOW receives stay posted and a client send never waits on the peer (over verbs a
/// send that finds no receive is retried by the hardware after a receiver-not-ready delay).
const SERVER_SLOTS: usize = 2 * WINDOW;
const SEND_BIT: u64 = 1 << 63;
const TIMEOUT: Duration = Duration::from_secs(30);

fn pattern(k: u64, size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| (k.wrapping_mul(131) as usize + i * 7 + 1) as u8)
        .collect()
}

thread_local! {
    /// When the last successful completion arrived, to say how long a failure took to surface.
    static LAST_OK: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

fn next(cq: &CompletionQueue) -> Result<Completion, String> {
    loop {
        if let Some(c) = cq.poll() {
            if c.status == WcStatus::Success && c.opcode != Opcode::Disconnected {
                LAST_OK.with(|t| t.set(Some(Instant::now())));
            }
            return Ok(c);
        }
        if !cq.wait(Some(TIMEOUT)).map_err(|e| e.to_string())? {
            return Err("no completion within 30 s".into());
        }
    }
}

fn ok(c: &Completion) -> Result<(), String> {
    if c.status != WcStatus::Success || c.opcode == Opcode::Disconnected {
        let quiet = LAST_OK
            .with(|t| t.get())
            .map_or(0, |t| t.elapsed().as_millis());
        return Err(format!(
            "unexpected completion {c:?}, {quiet} ms after the last successful one"
        ));
    }
    Ok(())
}

/// A post refused (the connection went down, say): how long after the last successful
/// completion, as for an error completion, since either may be the first sign of a loss.
/// Before any completion succeeded there is no such time, and none is claimed.
fn post_failed(e: rdmabridge::Error) -> String {
    match LAST_OK.with(|t| t.get()) {
        Some(t) => format!(
            "{e}, {} ms after the last successful one",
            t.elapsed().as_millis()
        ),
        None => e.to_string(),
    }
}

fn slot_mr(ctx: &Context, slots: usize, size: usize) -> Result<Arc<MemoryRegion>, String> {
    ctx.alloc_mr((slots * size).max(1), Access::LOCAL_WRITE)
        .map_err(|e| e.to_string())
}

fn verify(
    mr: &MemoryRegion,
    off: usize,
    c: &Completion,
    k: u64,
    size: usize,
) -> Result<(), String> {
    if c.byte_len as usize != size {
        return Err(format!("message {k}: {} bytes, want {size}", c.byte_len));
    }
    let mut got = vec![0u8; size];
    // SAFETY: called for a receive that has completed; its slot is reposted only afterwards.
    unsafe { mr.read(off, &mut got) }.map_err(|e| e.to_string())?;
    if got != pattern(k, size) {
        return Err(format!("message {k}: content differs"));
    }
    Ok(())
}

fn opts() -> ConnOptions {
    ConnOptions {
        private_data: b"rbr-echo".to_vec(),
        ..ConnOptions::default()
    }
}

fn server(addr: &str, count: u64, size: usize) -> Result<(), String> {
    let ctx = Context::new().map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new().map_err(|e| e.to_string())?;
    let l = ctx.listen(addr, 8).map_err(|e| e.to_string())?;
    let conn = l
        .get_request(Some(TIMEOUT))
        .map_err(|e| e.to_string())?
        .accept(&cq, &opts())
        .map_err(|e| e.to_string())?;
    let mr = slot_mr(&ctx, SERVER_SLOTS, size)?;
    for s in 0..SERVER_SLOTS {
        conn.post_recv(&mr, s * size, size, s as u64)
            .map_err(post_failed)?;
    }
    let (mut received, mut echoed) = (0u64, 0u64);
    while echoed < count {
        let c = next(&cq)?;
        ok(&c)?;
        let slot = (c.wr_id & !SEND_BIT) as usize;
        match c.opcode {
            Opcode::Recv => {
                verify(&mr, slot * size, &c, received, size)?;
                received += 1;
                conn.post_send(
                    &mr,
                    slot * size,
                    size,
                    slot as u64 | SEND_BIT,
                    SendFlags::SIGNALED,
                )
                .map_err(post_failed)?;
            }
            _ => {
                echoed += 1;
                if received < count {
                    conn.post_recv(&mr, slot * size, size, slot as u64)
                        .map_err(post_failed)?;
                }
            }
        }
    }
    // The client disconnects; our receives are flushed, then the event arrives.
    loop {
        let c = next(&cq)?;
        if c.opcode == Opcode::Disconnected {
            return if c.status == WcStatus::Success {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            };
        }
        if c.status != WcStatus::Flushed {
            return Err(format!("after the last echo: {c:?}"));
        }
    }
}

fn connect(ctx: &Context, cq: &Arc<CompletionQueue>, addr: &str) -> Result<Connection, String> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match ctx.connect(addr, cq, &opts()) {
            Ok(c) => return Ok(c),
            // The peer may still be starting (or, across hosts, still booting).
            Err(
                rdmabridge::Error::Refused(_)
                | rdmabridge::Error::Unreachable(_)
                | rdmabridge::Error::Timeout(_),
            ) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn client(addr: &str, count: u64, size: usize) -> Result<(), String> {
    let ctx = Context::new().map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new().map_err(|e| e.to_string())?;
    let conn = connect(&ctx, &cq, addr)?;
    let rmr = slot_mr(&ctx, WINDOW, size)?;
    let smr = slot_mr(&ctx, WINDOW, size)?;
    for s in 0..WINDOW {
        conn.post_recv(&rmr, s * size, size, s as u64)
            .map_err(post_failed)?;
    }
    let start = Instant::now();
    let (mut sent, mut send_done, mut echoed) = (0u64, 0u64, 0u64);
    while echoed < count {
        while sent < count && sent - send_done < WINDOW as u64 && sent - echoed < WINDOW as u64 {
            let slot = (sent % WINDOW as u64) as usize;
            // SAFETY: the window keeps at most WINDOW sends outstanding, so the send that last
            // used this slot has completed.
            unsafe { smr.write(slot * size, &pattern(sent, size)) }.map_err(|e| e.to_string())?;
            conn.post_send(
                &smr,
                slot * size,
                size,
                slot as u64 | SEND_BIT,
                SendFlags::SIGNALED,
            )
            .map_err(post_failed)?;
            sent += 1;
        }
        let c = next(&cq)?;
        ok(&c)?;
        match c.opcode {
            Opcode::Recv => {
                let slot = c.wr_id as usize;
                verify(&rmr, slot * size, &c, echoed, size)?;
                echoed += 1;
                conn.post_recv(&rmr, slot * size, size, slot as u64)
                    .map_err(post_failed)?;
            }
            _ => send_done += 1,
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "rbr-echo: {count} messages of {size} B echoed and verified: {:.0} msg/s, {:.1} MB/s each way",
        count as f64 / secs,
        count as f64 * size as f64 / secs / 1e6
    );
    conn.disconnect();
    loop {
        let c = next(&cq)?;
        if c.opcode == Opcode::Disconnected {
            return Ok(());
        }
    }
}

/// Sends forever (the multi-process tests kill it mid-stream).
fn flood(addr: &str, size: usize) -> Result<(), String> {
    let ctx = Context::new().map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new().map_err(|e| e.to_string())?;
    let conn = connect(&ctx, &cq, addr)?;
    let mr = slot_mr(&ctx, WINDOW, size)?;
    for s in 0..WINDOW {
        conn.post_recv(&mr, s * size, size, s as u64)
            .map_err(post_failed)?;
    }
    let mut k = 0u64;
    loop {
        match conn.post_send(&mr, 0, size, k | SEND_BIT, SendFlags::SIGNALED) {
            Ok(()) => k += 1,
            Err(rdmabridge::Error::QueueFull(_)) => {
                let c = next(&cq)?;
                if c.opcode == Opcode::Disconnected {
                    return Err("peer went away".into());
                }
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let num = |i: usize| args.get(i).and_then(|s| s.parse::<u64>().ok());
    let r = match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("server"), Some(a)) if num(3).is_some() && num(4).is_some() => {
            server(a, num(3).unwrap(), num(4).unwrap() as usize)
        }
        (Some("client"), Some(a)) if num(3).is_some() && num(4).is_some() => {
            client(a, num(3).unwrap(), num(4).unwrap() as usize)
        }
        (Some("flood"), Some(a)) if num(3).is_some() => flood(a, num(3).unwrap() as usize),
        _ => Err("usage: rbr-echo server|client ADDR COUNT SIZE | flood ADDR SIZE".into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rbr-echo: {e}");
            ExitCode::FAILURE
        }
    }
}
