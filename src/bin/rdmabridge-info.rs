//! rdmabridge-info: the first thing to run when a connect or a registration fails. Prints the
//! transports this build has, the RDMA devices with their ports (state, MTU, link layer,
//! GIDs), the memory-lock limit and whether a registration of a given size works on each
//! device, which transport and device each ADDRESS given would use and why, and a hint in
//! plain words for each problem found.
//!
//!     rdmabridge-info [--register SIZE] [ADDRESS...]
//!
//! SIZE is in bytes, or with a K, M or G suffix (default 1M). Exits 0 when it could look at
//! everything (problems found are reported, not failures), 2 on bad arguments.

use std::process::ExitCode;

use rdmabridge::Transport;
use rdmabridge::diag::{self, Choice};

fn parse_size(s: &str) -> Option<usize> {
    let (num, shift) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    num.parse::<usize>().ok()?.checked_mul(1 << shift)
}

fn name(t: Transport) -> &'static str {
    match t {
        Transport::Shm => "shm",
        Transport::Verbs => "verbs",
        _ => "other",
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut register = 1 << 20;
    let mut addrs = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--register" => match args.next().as_deref().and_then(parse_size) {
                Some(n) if n > 0 => register = n,
                _ => {
                    eprintln!("rdmabridge-info: --register needs a size such as 4096 or 1M");
                    return ExitCode::from(2);
                }
            },
            "-h" | "--help" => {
                println!("usage: rdmabridge-info [--register SIZE] [ADDRESS...]");
                return ExitCode::SUCCESS;
            }
            _ => addrs.push(a),
        }
    }

    println!("rdmabridge {}", env!("CARGO_PKG_VERSION"));
    let transports: Vec<_> = diag::transports().into_iter().map(name).collect();
    println!("transports: {}", transports.join(", "));

    let kernel = diag::kernel_devices();
    let devices = diag::devices().unwrap_or_default();
    println!("RDMA devices: {}", devices.len());
    for d in &devices {
        println!("  {}", d.name);
        for p in &d.ports {
            let netdev = p
                .netdev
                .as_deref()
                .map(|n| format!(", netdev {n}"))
                .unwrap_or_default();
            println!(
                "    port {}: {}, MTU {}, link layer {}{netdev}",
                p.number, p.state, p.active_mtu, p.link_layer
            );
            for g in &p.gids {
                let kind = g
                    .kind
                    .as_deref()
                    .map(|k| format!(" ({k})"))
                    .unwrap_or_default();
                println!("      GID[{}] {}{kind}", g.index, g.gid);
            }
        }
    }
    if devices.is_empty() && !kernel.is_empty() {
        println!("  (the kernel has: {})", kernel.join(", "));
    }

    let memlock = diag::memlock();
    let show = |v: Option<u64>| v.map_or("unlimited".to_owned(), diag::size);
    println!(
        "memlock limit (ulimit -l): {} (hard {})",
        show(memlock.soft),
        show(memlock.hard)
    );
    for d in &devices {
        match diag::probe_registration(&d.name, register) {
            Ok(()) => println!(
                "  registration of {} on {}: ok",
                diag::size(register as u64),
                d.name
            ),
            Err(e) => println!(
                "  registration of {} on {}: FAILED: {e}",
                diag::size(register as u64),
                d.name
            ),
        }
    }

    for a in &addrs {
        match diag::choose(a) {
            Ok(Choice {
                transport,
                why,
                target,
                device,
                problem,
            }) => {
                println!("address {a}: {} to {target} ({why})", name(transport));
                if let Some((dev, port)) = device {
                    println!("  device {dev}, port {port}");
                }
                if let Some(p) = problem {
                    println!("  problem: {p}");
                }
            }
            Err(e) => println!("address {a}: invalid: {e}"),
        }
    }

    let hints = diag::hints(&devices, &kernel, &memlock);
    for h in &hints {
        println!("hint: {h}");
    }
    ExitCode::SUCCESS
}
