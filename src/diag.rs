//! Diagnostics: what this machine offers the library, which transport an address takes and
//! why, and the limits that make RDMA calls fail, with a hint in plain words for each problem.
//! The `rdmabridge-info` program prints all of it; it is the first thing to run when a connect
//! or a registration fails.

use std::net::Ipv6Addr;

use crate::addr::{self, Endpoint};
use crate::conn::Transport;
use crate::error::Result;

/// An RDMA device as libibverbs lists it.
#[derive(Debug, Clone)]
pub struct Device {
    /// The device's name (`mlx5_0`, `rxe0`, ...).
    pub name: String,
    /// Its ports, numbered from 1.
    pub ports: Vec<Port>,
}

/// One port of a device.
#[derive(Debug, Clone)]
pub struct Port {
    /// The port number.
    pub number: u8,
    /// `ACTIVE`, `DOWN`, `INIT`, `ARMED` or `ACTIVE_DEFER`.
    pub state: &'static str,
    /// The active MTU in bytes (256 to 4096).
    pub active_mtu: u32,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: &'static str,
    /// The network interface of a RoCE port, when the kernel names one.
    pub netdev: Option<String>,
    /// Its GIDs that are set (zero entries are left out).
    pub gids: Vec<Gid>,
}

/// One GID table entry.
#[derive(Debug, Clone)]
pub struct Gid {
    /// Its index in the port's table.
    pub index: u32,
    /// The GID, written as an IPv6 address.
    pub gid: Ipv6Addr,
    /// `IB/RoCE v1` or `RoCE v2`, when the kernel says.
    pub kind: Option<String>,
}

/// Which transport an address takes, and why.
#[derive(Debug, Clone)]
pub struct Choice {
    /// The transport.
    pub transport: Transport,
    /// The reason, in plain words.
    pub why: String,
    /// The shared-memory name (shm), or `HOST:PORT` (verbs).
    pub target: String,
    /// Verbs: the device and port the RDMA CM picked for the address.
    pub device: Option<(String, u8)>,
    /// What stands in the way, if anything (no device, no route), in plain words.
    pub problem: Option<String>,
}

/// The memory-lock limit (`ulimit -l`), which bounds how much memory a process may register
/// with an RDMA device. `None` is unlimited.
#[derive(Debug, Clone, Copy)]
pub struct Memlock {
    /// The limit in force.
    pub soft: Option<u64>,
    /// The most the process may raise it to.
    pub hard: Option<u64>,
}

/// The transports this build of the library has.
pub fn transports() -> Vec<Transport> {
    let mut t = vec![Transport::Shm];
    if cfg!(feature = "verbs") {
        t.push(Transport::Verbs);
    }
    t
}

/// The RDMA devices the kernel has (`/sys/class/infiniband`), whether or not libibverbs can
/// open them.
pub fn kernel_devices() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The RDMA devices libibverbs lists, with their ports (none without the verbs feature).
pub fn devices() -> Result<Vec<Device>> {
    #[cfg(feature = "verbs")]
    {
        verbs::devices()
    }
    #[cfg(not(feature = "verbs"))]
    {
        Ok(Vec::new())
    }
}

/// The memory-lock limit of this process.
pub fn memlock() -> Memlock {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the live `rl`.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
        return Memlock {
            soft: None,
            hard: None,
        };
    }
    let limit = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    Memlock {
        soft: limit(rl.rlim_cur),
        hard: limit(rl.rlim_max),
    }
}

/// Which transport `addr` takes and why; for verbs, the device the RDMA CM picks for it (it
/// binds to a local address, or resolves a remote one, waiting at most 2 s).
pub fn choose(addr: &str) -> Result<Choice> {
    let (endpoint, why) = addr::explain(addr)?;
    Ok(match endpoint {
        Endpoint::Shm { name } => Choice {
            transport: Transport::Shm,
            why,
            target: name,
            device: None,
            problem: None,
        },
        Endpoint::Verbs { host, port } => {
            let (device, problem) = verbs_device(&host, port);
            Choice {
                transport: Transport::Verbs,
                why,
                target: format!("{host}:{port}"),
                device,
                problem,
            }
        }
    })
}

#[cfg(feature = "verbs")]
fn verbs_device(host: &str, port: u16) -> (Option<(String, u8)>, Option<String>) {
    if !crate::verbs::device_present() {
        return (
            None,
            Some("no RDMA device here: listen and connect fail with RBR_ERR_NO_DEVICE".into()),
        );
    }
    match verbs::device_for(host, port) {
        Ok(d) => (Some(d), None),
        Err(why) => (None, Some(why)),
    }
}

#[cfg(not(feature = "verbs"))]
fn verbs_device(_: &str, _: u16) -> (Option<(String, u8)>, Option<String>) {
    (
        None,
        Some("this build has no verbs transport (built without the verbs feature)".into()),
    )
}

/// Tries to register `len` bytes with `device`, as the first post of a region that size
/// would; the error says why it failed (naming the memory-lock limit when that is the likely
/// cause).
pub fn probe_registration(device: &str, len: usize) -> Result<()> {
    #[cfg(feature = "verbs")]
    {
        verbs::probe_registration(device, len)
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = (device, len);
        Err(crate::Error::Unsupported(
            "built without the verbs feature".into(),
        ))
    }
}

/// What looks wrong, in plain words, with what to do about it.
pub fn hints(devices: &[Device], kernel: &[String], memlock: &Memlock) -> Vec<String> {
    let mut out = Vec::new();
    if cfg!(feature = "verbs") {
        if kernel.is_empty() && devices.is_empty() {
            out.push(
                "no RDMA device: the kernel has none (/sys/class/infiniband is empty). shm:// \
                 and loopback addresses need none; for soft-RoCE on an Ethernet interface: \
                 `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev IFACE`"
                    .into(),
            );
        } else if devices.is_empty() {
            out.push(format!(
                "the kernel has RDMA devices ({}) but libibverbs opens none: its provider \
                 library for them is missing (Debian: `apt install ibverbs-providers`)",
                kernel.join(", ")
            ));
        } else if !devices
            .iter()
            .any(|d| d.ports.iter().any(|p| p.state == "ACTIVE"))
        {
            out.push(
                "no port is ACTIVE: connections cannot come up until a link does (`rdma link`, \
                 `ip link`)"
                    .into(),
            );
        }
    }
    if let Some(soft) = memlock.soft
        && !devices.is_empty()
    {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        out.push(format!(
            "memlock limit (ulimit -l) is {}: registering more memory than that fails with \
             RBR_ERR_NO_MEMORY{}; raise it with `ulimit -l unlimited` or a memlock line in \
             /etc/security/limits.conf",
            size(soft),
            if root {
                " (root with CAP_IPC_LOCK is exempt)"
            } else {
                ""
            }
        ));
    }
    out
}

/// A byte count as people write it: `64 KiB`, `8 MiB`, `1000 bytes`.
pub fn size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{} {name}", bytes / unit);
        }
    }
    format!("{bytes} bytes")
}

#[cfg(feature = "verbs")]
mod verbs {
    //! The verbs half: devices, ports and GIDs from libibverbs, the RDMA CM's choice of
    //! device, and a registration probe.

    use std::ffi::CStr;
    use std::io;
    use std::net::{Ipv6Addr, SocketAddr};
    use std::time::Duration;

    use rdma_sys as sys;

    use super::{Device, Gid, Port};
    use crate::error::{Error, Result};

    /// `IBV_LINK_LAYER_ETHERNET` of verbs.h (an anonymous enum the bindings leave out).
    const LINK_LAYER_ETHERNET: u8 = 2;

    /// An open device; closed on drop.
    struct Open(*mut sys::ibv_context);

    impl Drop for Open {
        fn drop(&mut self) {
            // SAFETY: opened by ibv_open_device and closed once.
            unsafe { sys::ibv_close_device(self.0) };
        }
    }

    /// The device list; freed on drop.
    struct List(*mut *mut sys::ibv_device, usize);

    impl List {
        fn get() -> Result<List> {
            let mut n = 0;
            // SAFETY: writes the count; NULL with errno on failure.
            let list = unsafe { sys::ibv_get_device_list(&mut n) };
            if list.is_null() {
                return Err(Error::NoDevice);
            }
            Ok(List(list, n.max(0) as usize))
        }

        fn iter(&self) -> impl Iterator<Item = *mut sys::ibv_device> + '_ {
            // SAFETY: the list holds `self.1` device pointers while it lives.
            (0..self.1).map(|i| unsafe { *self.0.add(i) })
        }
    }

    impl Drop for List {
        fn drop(&mut self) {
            // SAFETY: from ibv_get_device_list, freed once.
            unsafe { sys::ibv_free_device_list(self.0) };
        }
    }

    fn name(dev: *mut sys::ibv_device) -> String {
        // SAFETY: a listed device has a NUL-terminated name for as long as the list lives.
        unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned()
    }

    fn open(dev: *mut sys::ibv_device) -> Result<Open> {
        // SAFETY: a listed device; NULL with errno on failure.
        let ctx = unsafe { sys::ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(Error::MemoryRegion(io::Error::last_os_error()));
        }
        Ok(Open(ctx))
    }

    pub(super) fn devices() -> Result<Vec<Device>> {
        let list = match List::get() {
            Ok(l) => l,
            Err(_) => return Ok(Vec::new()),
        };
        let mut out = Vec::new();
        for dev in list.iter() {
            let name = name(dev);
            let ports = match open(dev) {
                Ok(ctx) => ports(&ctx, &name),
                Err(_) => Vec::new(),
            };
            out.push(Device { name, ports });
        }
        Ok(out)
    }

    fn ports(ctx: &Open, dev: &str) -> Vec<Port> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid start.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: an open device; `attr` is written on success.
        if unsafe { sys::ibv_query_device(ctx.0, &mut attr) } != 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for number in 1..=attr.phys_port_cnt {
            // SAFETY: ibv_port_attr is plain data; zero is a valid start.
            let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
            // SAFETY: an open device, a port it has, a live attribute struct.
            if unsafe { sys::___ibv_query_port(ctx.0, number, &mut pa) } != 0 {
                continue;
            }
            let mut gids = Vec::new();
            for index in 0..pa.gid_tbl_len.max(0) as u32 {
                // SAFETY: ibv_gid is plain data.
                let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
                // SAFETY: an open device and port; `index` is inside its table.
                if unsafe { sys::ibv_query_gid(ctx.0, number, index as i32, &mut gid) } != 0 {
                    continue;
                }
                // SAFETY: the union's raw view is always valid.
                let raw = unsafe { gid.raw };
                if raw == [0; 16] {
                    continue;
                }
                let kind = sysfs(dev, number, &format!("gid_attrs/types/{index}"));
                gids.push(Gid {
                    index,
                    gid: Ipv6Addr::from(raw),
                    kind,
                });
            }
            out.push(Port {
                number,
                state: match pa.state {
                    sys::ibv_port_state::IBV_PORT_DOWN => "DOWN",
                    sys::ibv_port_state::IBV_PORT_INIT => "INIT",
                    sys::ibv_port_state::IBV_PORT_ARMED => "ARMED",
                    sys::ibv_port_state::IBV_PORT_ACTIVE => "ACTIVE",
                    sys::ibv_port_state::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
                    _ => "UNKNOWN",
                },
                active_mtu: 128 << pa.active_mtu.min(5),
                link_layer: if pa.link_layer == LINK_LAYER_ETHERNET {
                    "Ethernet"
                } else {
                    "InfiniBand"
                },
                netdev: sysfs(dev, number, "gid_attrs/ndevs/0").or_else(|| parent_netdev(dev)),
                gids,
            });
        }
        out
    }

    /// A port attribute file of the kernel's, trimmed; None when absent or unreadable.
    fn sysfs(dev: &str, port: u8, what: &str) -> Option<String> {
        let path = format!("/sys/class/infiniband/{dev}/ports/{port}/{what}");
        let s = std::fs::read_to_string(path).ok()?;
        let s = s.trim();
        (!s.is_empty()).then(|| s.to_owned())
    }

    /// The network interface a soft-RoCE device sits on.
    fn parent_netdev(dev: &str) -> Option<String> {
        let s = std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/parent")).ok()?;
        let s = s.trim();
        (!s.is_empty()).then(|| s.to_owned())
    }

    /// The device and port the RDMA CM picks for `host:port`: bound to it when it is an
    /// address of this machine, resolved when not. Err says why none.
    pub(super) fn device_for(host: &str, port: u16) -> std::result::Result<(String, u8), String> {
        let (mut st, sa) = crate::verbs::sockaddr(host, port).map_err(|e| e.to_string())?;
        let local = std::net::UdpSocket::bind(SocketAddr::new(sa.ip(), 0)).is_ok();
        // SAFETY: plain constructor; NULL on failure.
        let ch = unsafe { sys::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(format!("RDMA CM: {}", io::Error::last_os_error()));
        }
        let mut id = std::ptr::null_mut();
        // SAFETY: a live channel; `id` is written on success.
        let r = unsafe {
            sys::rdma_create_id(
                ch,
                &mut id,
                std::ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        };
        let result = if r != 0 {
            Err(format!("RDMA CM: {}", io::Error::last_os_error()))
        } else {
            let sa_ptr = (&raw mut st).cast::<libc::sockaddr>();
            let found = if local {
                // SAFETY: a live id and a sockaddr of the right family.
                if unsafe { sys::rdma_bind_addr(id, sa_ptr) } != 0 {
                    Err(format!(
                        "binding to it failed: {}",
                        io::Error::last_os_error()
                    ))
                } else {
                    Ok(())
                }
            } else {
                resolve(ch, id, sa_ptr)
            };
            // SAFETY: the id is live; `verbs` and `port_num` are set once bound or resolved.
            let found = found.and_then(|()| unsafe {
                let ctx = (*id).verbs;
                if ctx.is_null() {
                    Err(
                        "no RDMA device serves this address (it is on an interface without \
                         one)"
                            .to_owned(),
                    )
                } else {
                    Ok((name((*ctx).device), (*id).port_num))
                }
            });
            // SAFETY: every event of the id was acked; destroyed once.
            unsafe { sys::rdma_destroy_id(id) };
            found
        };
        // SAFETY: its only id is gone; destroyed once.
        unsafe { sys::rdma_destroy_event_channel(ch) };
        result
    }

    /// Resolves a remote address on `id`, waiting for the answer for at most 3 s.
    fn resolve(
        ch: *mut sys::rdma_event_channel,
        id: *mut sys::rdma_cm_id,
        sa: *mut libc::sockaddr,
    ) -> std::result::Result<(), String> {
        // SAFETY: live id; the address is read during the call.
        if unsafe { sys::rdma_resolve_addr(id, std::ptr::null_mut(), sa, 2000) } != 0 {
            return Err(format!(
                "resolving it failed: {}",
                io::Error::last_os_error()
            ));
        }
        // SAFETY: the channel is live.
        let fd = unsafe { (*ch).fd };
        if !crate::sys::poll_one(fd, libc::POLLIN, Some(Duration::from_secs(3)))
            .map_err(|e| e.to_string())?
        {
            return Err("no answer from the RDMA CM in 3 s".into());
        }
        let mut ev = std::ptr::null_mut();
        // SAFETY: live channel with an event ready.
        if unsafe { sys::rdma_get_cm_event(ch, &mut ev) } != 0 {
            return Err(format!("RDMA CM: {}", io::Error::last_os_error()));
        }
        // SAFETY: a live event, read then acked once.
        let (kind, status) = unsafe { ((*ev).event, (*ev).status) };
        // SAFETY: as above.
        unsafe { sys::rdma_ack_cm_event(ev) };
        if kind == sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED {
            Ok(())
        } else {
            Err(format!(
                "no RDMA device reaches it (address resolution failed: {})",
                io::Error::from_raw_os_error(-status)
            ))
        }
    }

    pub(super) fn probe_registration(device: &str, len: usize) -> Result<()> {
        let list = List::get()?;
        let dev = list
            .iter()
            .find(|&d| name(d) == device)
            .ok_or_else(|| Error::invalid(format!("no RDMA device named {device:?}")))?;
        let ctx = open(dev)?;
        // SAFETY: an open device; NULL on failure.
        let pd = unsafe { sys::ibv_alloc_pd(ctx.0) };
        if pd.is_null() {
            return Err(Error::MemoryRegion(io::Error::last_os_error()));
        }
        let mut buf = vec![0u8; len.max(1)];
        // SAFETY: a live PD and a live buffer of that length, deregistered below before it
        // is freed.
        let mr = unsafe {
            sys::ibv_reg_mr(
                pd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
            )
        };
        let result = if mr.is_null() {
            Err(crate::verbs::registration_error(
                io::Error::last_os_error(),
                buf.len(),
            ))
        } else {
            // SAFETY: registered just above, deregistered once.
            unsafe { sys::ibv_dereg_mr(mr) };
            Ok(())
        };
        // SAFETY: its only registration is gone; freed once.
        unsafe { sys::ibv_dealloc_pd(pd) };
        drop(buf);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(size(64 << 10), "64 KiB");
        assert_eq!(size(8 << 20), "8 MiB");
        assert_eq!(size(3 << 30), "3 GiB");
        assert_eq!(size(1000), "1000 bytes");
        assert_eq!(size((64 << 10) + 1), "65537 bytes");
    }

    #[test]
    fn choices_give_their_reason() {
        let c = choose("shm://x").unwrap();
        assert_eq!((c.transport, c.target.as_str()), (Transport::Shm, "x"));
        assert!(c.why.contains("shm://"), "{}", c.why);
        let c = choose("127.0.0.1:7000").unwrap();
        assert_eq!(
            (c.transport, c.target.as_str()),
            (Transport::Shm, "port-7000")
        );
        assert!(c.why.contains("loopback"), "{}", c.why);
        assert!(choose("tcp://x:1").is_err());
    }

    #[test]
    fn a_machine_without_devices_is_told_how_to_get_one() {
        let none = Memlock {
            soft: Some(64 << 10),
            hard: Some(64 << 10),
        };
        let h = hints(&[], &[], &none);
        if cfg!(feature = "verbs") {
            assert!(h.iter().any(|s| s.contains("rdma_rxe")), "{h:?}");
            let h = hints(&[], &["mlx5_0".into()], &none);
            assert!(h.iter().any(|s| s.contains("ibv")), "{h:?}");
        }
        // No device, no registration: the memlock limit is not what bites.
        assert!(!hints(&[], &[], &none).iter().any(|s| s.contains("memlock")));
        let dev = Device {
            name: "d".into(),
            ports: vec![],
        };
        let h = hints(std::slice::from_ref(&dev), &["d".into()], &none);
        assert!(
            h.iter()
                .any(|s| s.contains("memlock limit (ulimit -l) is 64 KiB")),
            "{h:?}"
        );
        if cfg!(feature = "verbs") {
            assert!(h.iter().any(|s| s.contains("no port is ACTIVE")), "{h:?}");
        }
    }
}
