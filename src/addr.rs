//! Address parsing and transport choice.
//!
//! - `shm://NAME`: shared memory, for peers on this host.
//! - `rdma://HOST:PORT`: the verbs transport.
//! - `HOST:PORT`: chosen automatically: shared memory for loopback and `localhost`, and for
//!   other addresses of this machine when it has no RDMA device; verbs otherwise.
//!   `RBR_TRANSPORT=shm|verbs|auto` overrides the choice.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};

/// Longest shared-memory name (the abstract Unix socket path holds the rest).
pub(crate) const SHM_NAME_MAX: usize = 96;

/// Where a listener or connection goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Shm { name: String },
    Verbs { host: String, port: u16 },
}

fn bad(addr: &str, reason: impl Into<String>) -> Error {
    Error::Address {
        addr: addr.to_owned(),
        reason: reason.into(),
    }
}

/// Parses `addr` and picks its transport.
pub(crate) fn resolve(addr: &str) -> Result<Endpoint> {
    resolve_with(addr, std::env::var("RBR_TRANSPORT").ok().as_deref())
}

pub(crate) fn resolve_with(addr: &str, forced: Option<&str>) -> Result<Endpoint> {
    explain_with(addr, forced).map(|(e, _)| e)
}

/// As [`resolve`], with the reason for the choice in plain words (for diagnostics).
pub(crate) fn explain(addr: &str) -> Result<(Endpoint, String)> {
    explain_with(addr, std::env::var("RBR_TRANSPORT").ok().as_deref())
}

fn explain_with(addr: &str, forced: Option<&str>) -> Result<(Endpoint, String)> {
    if let Some(name) = addr.strip_prefix("shm://") {
        let name = shm_name(addr, name)?;
        return Ok((
            Endpoint::Shm { name },
            "the shm:// form names shared memory".into(),
        ));
    }
    if let Some(rest) = addr.strip_prefix("rdma://") {
        let (host, port) = host_port(addr, rest)?;
        return Ok((
            Endpoint::Verbs { host, port },
            "the rdma:// form names verbs".into(),
        ));
    }
    if addr.contains("://") {
        return Err(bad(
            addr,
            "unknown scheme (use shm://NAME, rdma://HOST:PORT or HOST:PORT)",
        ));
    }
    let (host, port) = host_port(addr, addr)?;
    let shm = Endpoint::Shm {
        name: format!("port-{port}"),
    };
    let mode = forced.unwrap_or("auto");
    let auto = matches!(mode, "auto" | "").then(|| locality(&host));
    let verbs = Endpoint::Verbs { host, port };
    let (endpoint, why) = match (mode, auto) {
        ("shm", _) => (shm, "RBR_TRANSPORT=shm"),
        ("verbs", _) => (verbs, "RBR_TRANSPORT=verbs"),
        (_, Some(locality)) => match locality {
            Locality::Loopback => (shm, "a loopback address, which no RDMA device reaches"),
            Locality::ThisMachine if !crate::verbs::device_present() => {
                (shm, "an address of this machine, which has no RDMA device")
            }
            Locality::ThisMachine => (
                verbs,
                "an address of this machine, which has an RDMA device",
            ),
            Locality::Elsewhere => (verbs, "not an address of this machine"),
        },
        (other, None) => {
            return Err(bad(
                addr,
                format!("RBR_TRANSPORT={other:?} is not shm, verbs or auto"),
            ));
        }
    };
    Ok((endpoint, why.into()))
}

fn shm_name(addr: &str, name: &str) -> Result<String> {
    if name.is_empty() {
        return Err(bad(addr, "empty shared-memory name"));
    }
    if name.len() > SHM_NAME_MAX {
        return Err(bad(
            addr,
            format!("shared-memory name longer than {SHM_NAME_MAX} bytes"),
        ));
    }
    if name.bytes().any(|b| b == 0 || b == b'/') {
        return Err(bad(addr, "shared-memory name contains NUL or '/'"));
    }
    Ok(name.to_owned())
}

fn host_port(addr: &str, s: &str) -> Result<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest
            .split_once("]:")
            .ok_or_else(|| bad(addr, "expected [IPv6]:PORT"))?;
        (h, p)
    } else {
        s.rsplit_once(':')
            .ok_or_else(|| bad(addr, "expected HOST:PORT"))?
    };
    if host.is_empty() {
        return Err(bad(addr, "empty host"));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| bad(addr, format!("bad port {port:?}")))?;
    if port == 0 {
        return Err(bad(addr, "port 0"));
    }
    Ok((host.to_owned(), port))
}

enum Locality {
    /// Loopback, `localhost` or the unspecified address: no RDMA device reaches it.
    Loopback,
    /// An address of one of this machine's interfaces.
    ThisMachine,
    Elsewhere,
}

fn locality(host: &str) -> Locality {
    if host.eq_ignore_ascii_case("localhost") {
        return Locality::Loopback;
    }
    let Ok(ip) = host.parse::<IpAddr>() else {
        return Locality::Elsewhere;
    };
    if ip.is_loopback() || ip.is_unspecified() {
        Locality::Loopback
    } else if interface_addrs().contains(&ip) {
        Locality::ThisMachine
    } else {
        Locality::Elsewhere
    }
}

fn interface_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned and is not yet freed.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr whose family field is always readable.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: family AF_INET means the storage is a sockaddr_in.
                let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))));
            } else if family == libc::AF_INET6 {
                // SAFETY: family AF_INET6 means the storage is a sockaddr_in6.
                let sin6 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(
            resolve_with("shm://a", None).unwrap(),
            Endpoint::Shm { name: "a".into() }
        );
        assert_eq!(
            resolve_with("rdma://10.0.0.1:7471", None).unwrap(),
            Endpoint::Verbs {
                host: "10.0.0.1".into(),
                port: 7471
            }
        );
        assert_eq!(
            resolve_with("127.0.0.1:7471", None).unwrap(),
            Endpoint::Shm {
                name: "port-7471".into()
            }
        );
        assert_eq!(
            resolve_with("[::1]:9", Some("verbs")).unwrap(),
            Endpoint::Verbs {
                host: "::1".into(),
                port: 9
            }
        );
        assert_eq!(
            resolve_with("localhost:9", Some("auto")).unwrap(),
            Endpoint::Shm {
                name: "port-9".into()
            }
        );
    }

    #[test]
    fn rejects() {
        for a in [
            "",
            "shm://",
            "tcp://x:1",
            "host",
            "host:0",
            "host:99999",
            ":5",
            "[::1]5",
        ] {
            assert!(
                matches!(resolve_with(a, None), Err(Error::Address { .. })),
                "{a:?}"
            );
        }
        let long = format!("shm://{}", "x".repeat(SHM_NAME_MAX + 1));
        assert!(resolve_with(&long, None).is_err());
        assert!(resolve_with("h:1", Some("carrier-pigeon")).is_err());
    }
}
