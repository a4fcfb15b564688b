//! tokio_lat: one-way latency through the `tokio` feature, both sides sleeping between
//! messages - the tokio twin of `rbr_bench -E` (an event loop on the queue's descriptor).
//!
//! One program, two roles, each a single task on a current-thread runtime: its queue is a
//! `rdmabridge::tokio::Queue` (a task waiting on the queue's descriptor with `AsyncFd`), every
//! message a send future and every answer a receive future. The server (-r server) listens
//! on ADDR, takes one client and echoes each message it receives (its next receive posted
//! before the echo) until the client disconnects. The client (-r client) connects and, for
//! every size in the list, sends one message and waits for its echo: WARMUP round trips
//! (a tenth of ITERS, at least 100), then ITERS timed ones, the next receive posted before
//! each send. Nobody polls in a loop: between messages both runtimes sleep in `epoll_wait`.
//!
//! Output, as rbr_bench's (one-way latency is half the round trip, timed with
//! `std::time::Instant`; p50 by nearest rank):
//!   RESULT lat SIZE p50_us=X p99_us=X avg_us=X iters=N
//!
//! Usage: tokio_lat -r server|client [-a ADDR] [-s SIZES] [-n ITERS] [-T SECS]
//!   -a ADDR   address (default shm://rbr-tokio-lat)
//!   -s SIZES  comma list of sizes in bytes (default 2,64,4096)
//!   -n ITERS  timed round trips per size (default 10000)
//!   -T SECS   give up (exit status 1) when a wait takes longer (default 30)
//!
//! Built by `cargo build --release --features tokio --example tokio_lat`; benchmarks/shm.sh
//! --event runs it beside rbr_bench -E, rbr_bench -W -S 0 and `ucx_perftest -E sleep`.

use std::future::Future;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdmabridge::ops::Buf;
use rdmabridge::tokio::{Listener, Queue};
use rdmabridge::{ConnOptions, Context, Error, Result};

struct Opts {
    server: bool,
    addr: String,
    sizes: Vec<usize>,
    iters: usize,
    limit: Duration,
}

fn usage(why: &str) -> ! {
    eprintln!("tokio_lat: {why}");
    eprintln!("usage: tokio_lat -r server|client [-a ADDR] [-s SIZES] [-n ITERS] [-T SECS]");
    std::process::exit(2);
}

fn parse() -> Opts {
    let mut o = Opts {
        server: false,
        addr: "shm://rbr-tokio-lat".into(),
        sizes: vec![2, 64, 4096],
        iters: 10_000,
        limit: Duration::from_secs(30),
    };
    let mut role = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        let number = |v: &str| -> usize {
            v.parse()
                .unwrap_or_else(|_| usage(&format!("{flag}: not a number: {v}")))
        };
        match flag.as_str() {
            "-r" => role = Some(value),
            "-a" => o.addr = value,
            "-s" => o.sizes = value.split(',').map(number).collect(),
            "-n" => o.iters = number(&value),
            "-T" => o.limit = Duration::from_secs(number(&value) as u64),
            _ => usage(&format!("unknown option {flag}")),
        }
    }
    match role.as_deref() {
        Some("server") => o.server = true,
        Some("client") => {}
        _ => usage("-r server or -r client"),
    }
    if o.iters == 0 || o.sizes.is_empty() || o.sizes.contains(&0) {
        usage("sizes and ITERS must be at least 1");
    }
    o
}

fn main() -> ExitCode {
    let o = parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let r = rt.block_on(async {
        if o.server {
            serve(&o).await
        } else {
            measure(&o).await
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tokio_lat: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `f`, or a timeout error once `limit` passed.
async fn within<T>(limit: Duration, f: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| Error::State("no completion within the time limit (-T)"))
}

/// Takes one client, whose private data is its largest size, and echoes every message.
async fn serve(o: &Opts) -> Result<()> {
    let ctx = Context::new()?;
    let listener = Listener::bind(&ctx, &o.addr, 1)?;
    println!("listening on {}", o.addr);
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let req = within(o.limit, listener.accept()).await??;
    let largest = <[u8; 8]>::try_from(req.private_data())
        .map(u64::from_le_bytes)
        .map_err(|_| Error::State("the client's private data is not its largest size"))?;
    let queue = Queue::new()?;
    let mut bufs = Buf::alloc_many(&ctx, 2, largest as usize)?;
    let conn = within(o.limit, queue.accept(req, &ConnOptions::default())).await??;
    let mut next = conn.recv(bufs.pop().expect("two buffers"));
    let mut spare = bufs.pop().expect("two buffers");
    loop {
        // No time limit here: the client may take long to start its next size.
        let (r, got) = next.await;
        if r.is_err() {
            // The client's disconnect flushes the receive: done.
            return Ok(());
        }
        next = conn.recv(spare);
        let (r, sent) = within(o.limit, conn.send(got)).await?;
        r?;
        spare = sent;
    }
}

/// The ping-pong at every size; prints a RESULT line for each.
async fn measure(o: &Opts) -> Result<()> {
    let ctx = Context::new()?;
    let queue = Queue::new()?;
    let largest = *o.sizes.iter().max().expect("a size");
    let opts = ConnOptions {
        private_data: (largest as u64).to_le_bytes().to_vec(),
        ..Default::default()
    };
    let conn = within(o.limit, queue.connect(&ctx, &o.addr, &opts)).await??;
    let mut bufs = Buf::alloc_many(&ctx, 2, largest)?;
    let mut out = bufs.pop().expect("two buffers");
    let mut echo = conn.recv(bufs.pop().expect("two buffers"));
    let warm = (o.iters / 10).max(100);
    let mut rtt = vec![Duration::ZERO; o.iters];
    for &size in &o.sizes {
        out.set_len(size)?;
        for i in 0..warm + o.iters {
            let t0 = Instant::now();
            let sent = conn.send(out);
            let (r, back) = within(o.limit, echo).await?;
            let t1 = Instant::now();
            r?;
            if back.len() != size {
                return Err(Error::State("an echo of another size"));
            }
            echo = conn.recv(back);
            let (r, b) = within(o.limit, sent).await?;
            r?;
            out = b;
            if i >= warm {
                rtt[i - warm] = t1 - t0;
            }
        }
        rtt.sort_unstable();
        let one_way = |d: Duration| d.as_secs_f64() * 1e6 / 2.0;
        let rank = |p: usize| rtt[(o.iters * p).div_ceil(100).max(1) - 1];
        let mean = rtt.iter().map(|d| one_way(*d)).sum::<f64>() / o.iters as f64;
        println!(
            "RESULT lat {size} p50_us={:.3} p99_us={:.3} avg_us={mean:.3} iters={}",
            one_way(rank(50)),
            one_way(rank(99)),
            o.iters
        );
    }
    Ok(())
}
