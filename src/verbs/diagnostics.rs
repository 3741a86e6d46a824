//! Environment checks: what `cargo run --example doctor` prints, as a library.
//!
//! ```no_run
//! use rdma_cm::verbs::diagnostics::diagnose;
//!
//! let report = diagnose(1 << 20); // the checks, for a program that registers 1 MiB
//! print!("{report}"); // each check, and the fix of each one that failed
//! if report.healthy() {
//!     println!("addresses to use: {:?}", report.usable_addrs());
//! }
//! ```
//!
//! Most RDMA trouble is environment trouble. [`diagnose`] asks each device through verbs
//! (`ibv_query_port`, `ibv_query_gid_ex`) and falls back to sysfs where a device cannot be
//! opened, reads procfs and the process limits, and returns a [`Report`] of checks, each with
//! the fix when it fails:
//!
//! - the kernel side: `/sys/class/infiniband`, and the uverbs/rdma_cm modules;
//! - each device and port: state, physical state, link layer, netdev and its MTU;
//! - the GID table, with the IPv4 address behind each RoCE v2 GID;
//! - which IPv4 addresses can be given to `-a`;
//! - the locked-memory limit against a buffer size;
//! - access to `/dev/infiniband/rdma_cm` and `uverbs*`.

use std::fmt;
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use crate::verbs::device::{Transport, VerbsContext};
use crate::verbs::port::{GidEntry, PortInfo, PortState};

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but worth a look.
    Warn,
    /// Blocks RDMA.
    Fail,
}

/// One finding.
#[derive(Debug, Clone)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// How it came out.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// How to fix it, for warnings and failures.
    pub fix: Option<String>,
}

/// A GID table entry that carries an IPv4 address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ipv4Gid {
    /// Device name (e.g. `rxe0`).
    pub device: String,
    /// Port number.
    pub port: u32,
    /// GID index (what perftest's `-x` takes).
    pub index: u32,
    /// `RoCE v2` or `IB/RoCE v1`; `iWARP` for an address of an iWARP port's netdev (an
    /// iWARP GID is the netdev's MAC, not an IP address).
    pub gid_type: String,
    /// The netdev the GID belongs to.
    pub netdev: String,
    /// The address.
    pub addr: Ipv4Addr,
}

/// Everything [`diagnose`] found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The checks, in order.
    pub checks: Vec<Check>,
    /// GIDs with an IPv4 address, on ACTIVE ports.
    pub ipv4_gids: Vec<Ipv4Gid>,
}

impl Report {
    /// Whether nothing failed.
    pub fn healthy(&self) -> bool {
        self.checks.iter().all(|c| c.status != Status::Fail)
    }

    /// The IPv4 addresses usable with the examples' `-a` (RoCE v2 GIDs on ACTIVE ports, and
    /// the addresses of an iWARP port's netdev).
    pub fn usable_addrs(&self) -> Vec<Ipv4Addr> {
        let mut v: Vec<Ipv4Addr> = self.ipv4_gids.iter().filter(|g| usable(g)).map(|g| g.addr).collect();
        v.sort();
        v.dedup();
        v
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.checks {
            let tag = match c.status {
                Status::Ok => " ok ",
                Status::Warn => "warn",
                Status::Fail => "FAIL",
            };
            writeln!(f, "[{tag}] {}: {}", c.name, c.detail)?;
            if let Some(fix) = &c.fix {
                writeln!(f, "       fix: {fix}")?;
            }
        }
        let addrs = self.usable_addrs();
        if !addrs.is_empty() {
            let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
            writeln!(f, "usable with -a: {}", list.join(", "))?;
        }
        if self.healthy() {
            write!(f, "verdict: healthy")
        } else {
            let n = self.checks.iter().filter(|c| c.status == Status::Fail).count();
            write!(f, "verdict: {n} problem(s); apply the fixes above in order")
        }
    }
}

/// Where the checks look; tests point it at a fake tree.
#[derive(Debug, Clone)]
pub struct Roots {
    /// Normally `/sys`.
    pub sys: PathBuf,
    /// Normally `/proc`.
    pub proc_: PathBuf,
    /// Normally `/dev`.
    pub dev: PathBuf,
}

impl Default for Roots {
    fn default() -> Self {
        Roots { sys: "/sys".into(), proc_: "/proc".into(), dev: "/dev".into() }
    }
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn entries(p: impl AsRef<Path>) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(p)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort_by_key(|s| (s.parse::<u64>().unwrap_or(u64::MAX), s.clone()));
    v
}

const SOFT_ROCE: &str =
    "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <netdev> (needs a kernel with CONFIG_RDMA_RXE); \
    without RDMA support in this kernel, use a VM with one (this project's harness/demo boots one)";

/// Runs every check, with `buffer` the size of the memory you mean to register.
pub fn diagnose(buffer: u64) -> Report {
    diagnose_in(&Roots::default(), buffer)
}

/// [`diagnose`] against other roots.
pub fn diagnose_in(roots: &Roots, buffer: u64) -> Report {
    let mut checks = Vec::new();
    let mut gids = Vec::new();
    let ib = roots.sys.join("class/infiniband");
    let devices = entries(&ib);
    let modules = read(roots.proc_.join("modules")).unwrap_or_default();
    let loaded = |m: &str| modules.lines().any(|l| l.split_whitespace().next() == Some(m));
    let mods: Vec<&str> =
        ["ib_uverbs", "rdma_ucm", "rdma_cm", "rdma_rxe", "siw"].into_iter().filter(|m| loaded(m)).collect();
    if devices.is_empty() {
        checks.push(Check {
            name: "RDMA devices".into(),
            status: Status::Fail,
            detail: format!(
                "none: {} is {}; RDMA modules loaded: {}",
                ib.display(),
                if ib.exists() { "empty" } else { "missing (the kernel has no RDMA core, or it is not loaded)" },
                if mods.is_empty() { "none".to_string() } else { mods.join(", ") }
            ),
            fix: Some(format!("load your NIC's RDMA driver (mlx5_ib, irdma, …), or Soft-RoCE: {SOFT_ROCE}")),
        });
    } else {
        checks.push(Check {
            name: "RDMA devices".into(),
            status: Status::Ok,
            detail: format!(
                "{} (modules: {})",
                devices.join(", "),
                if mods.is_empty() { "built in".into() } else { mods.join(", ") }
            ),
            fix: None,
        });
    }
    for dev in &devices {
        // Verbs first (the device's own answer); sysfs when the device cannot be opened here
        // (no access to /dev/infiniband, a provider library missing) or for a fake tree.
        let from_verbs = if roots.sys == Path::new("/sys") { verbs_ports(dev) } else { None };
        match from_verbs {
            Some((transport, ports)) => verbs_port_checks(roots, dev, transport, &ports, &mut checks, &mut gids),
            None => sysfs_port_checks(roots, &ib, dev, &mut checks, &mut gids),
        }
    }
    if !devices.is_empty() {
        let list: Vec<String> = gids
            .iter()
            .map(|g| {
                format!("{} port {} index {} ({}, {}) = {}", g.device, g.port, g.index, g.gid_type, g.netdev, g.addr)
            })
            .collect();
        let has_v2 = gids.iter().any(usable);
        checks.push(Check {
            name: "GID table (IPv4)".into(),
            status: if has_v2 { Status::Ok } else { Status::Fail },
            detail: if list.is_empty() { "no IPv4 GID on an ACTIVE port".into() } else { list.join("; ") },
            fix: (!has_v2).then(|| {
                "give the RDMA netdev an IPv4 address (`ip addr add A.B.C.D/24 dev <netdev>`): RoCE v2 GIDs follow the netdev's addresses, and an iWARP device is reached at them".into()
            }),
        });
    }
    checks.push(memlock_check(buffer));
    let cm = roots.dev.join("infiniband/rdma_cm");
    let mut dev_files = vec![cm.clone()];
    dev_files.extend(
        entries(roots.dev.join("infiniband"))
            .into_iter()
            .filter(|n| n.starts_with("uverbs"))
            .map(|n| roots.dev.join("infiniband").join(n)),
    );
    let bad: Vec<String> = dev_files.iter().filter(|p| !accessible(p)).map(|p| p.display().to_string()).collect();
    checks.push(Check {
        name: "device files".into(),
        status: if bad.is_empty() { Status::Ok } else { Status::Fail },
        detail: if bad.is_empty() {
            format!("{} readable and writable", dev_files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))
        } else {
            format!("not accessible: {}", bad.join(", "))
        },
        fix: (!bad.is_empty()).then(|| {
            "load rdma_ucm and ib_uverbs (`modprobe rdma_ucm ib_uverbs`); if they exist, grant access (udev rule, or `chmod 666 /dev/infiniband/*` for a test box)".into()
        }),
    });
    Report { checks, ipv4_gids: gids }
}

/// Whether `-a` can use the address: a RoCE v2 GID's, or an iWARP port's netdev's.
fn usable(g: &Ipv4Gid) -> bool {
    g.gid_type.contains("v2") || g.gid_type == IWARP
}

/// [`Ipv4Gid::gid_type`] of an iWARP port's netdev address.
const IWARP: &str = "iWARP";

/// The netdev whose MAC is `mac` (`/sys/class/net/*/address`), as an iWARP port's GID names it.
fn netdev_of_mac(roots: &Roots, mac: &[u8]) -> Option<String> {
    let want: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
    let want = want.join(":");
    let net = roots.sys.join("class/net");
    entries(&net).into_iter().find(|n| read(net.join(n).join("address")).is_some_and(|a| a.trim() == want))
}

/// The IPv4 addresses of `netdev` (`getifaddrs`).
fn ipv4_addrs_of(netdev: &str) -> Vec<Ipv4Addr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `list` is a valid out-pointer; on success the list is freed below, once.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        // SAFETY: ifa_name is a NUL-terminated string of the same list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr, when set, points at a sockaddr of the list; its family says which
        // kind, and AF_INET means it is a sockaddr_in.
        let v4 = unsafe {
            (!ifa.ifa_addr.is_null() && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET)
                .then(|| (*(ifa.ifa_addr as *const libc::sockaddr_in)).sin_addr.s_addr)
        };
        if let (Some(a), true) = (v4, name.to_bytes() == netdev.as_bytes()) {
            out.push(Ipv4Addr::from(u32::from_be(a)));
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list came from getifaddrs and no reference into it outlives this call.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// The port and GID checks of `dev` from sysfs.
fn sysfs_port_checks(roots: &Roots, ib: &Path, dev: &str, checks: &mut Vec<Check>, gids: &mut Vec<Ipv4Gid>) {
    for port in entries(ib.join(dev).join("ports")) {
        let p = ib.join(dev).join("ports").join(&port);
        let state = read(p.join("state")).unwrap_or_default();
        let phys = read(p.join("phys_state")).unwrap_or_default();
        let ll = read(p.join("link_layer")).unwrap_or_default();
        let netdev = read(p.join("gid_attrs/ndevs/0")).unwrap_or_default();
        let mtu = read(roots.sys.join("class/net").join(&netdev).join("mtu")).unwrap_or_default();
        let active = state.contains("ACTIVE");
        let detail = format!("state {state}, physical {phys}, link layer {ll}{}", netdev_mtu(&netdev, &mtu));
        checks.push(port_check(format!("{dev} port {port}"), active, detail, &netdev));
        for idx in entries(p.join("gids")) {
            let Some(gid) = read(p.join("gids").join(&idx)) else { continue };
            let Some(addr) = ipv4_of_gid(&gid) else { continue };
            if !active {
                continue;
            }
            gids.push(Ipv4Gid {
                device: dev.to_string(),
                port: port.parse().unwrap_or(0),
                index: idx.parse().unwrap_or(0),
                gid_type: read(p.join("gid_attrs/types").join(&idx)).unwrap_or_default(),
                netdev: read(p.join("gid_attrs/ndevs").join(&idx)).unwrap_or_default(),
                addr,
            });
        }
    }
}

fn netdev_mtu(netdev: &str, mtu: &str) -> String {
    if netdev.is_empty() {
        String::new()
    } else {
        format!(", netdev {netdev} (MTU {mtu})")
    }
}

/// A port's check: failed unless active, with the fix that brings the link up.
fn port_check(name: String, active: bool, detail: String, netdev: &str) -> Check {
    Check {
        name,
        status: if active { Status::Ok } else { Status::Fail },
        detail,
        fix: (!active).then(|| {
            format!(
                "bring the link up: `ip link set {} up`; check cabling/switch; `rdma link` shows the state",
                if netdev.is_empty() { "<netdev>" } else { netdev }
            )
        }),
    }
}

/// Each port with its valid GIDs.
type Ports = Vec<(PortInfo, Vec<GidEntry>)>;

/// The ports of `dev` with each one's valid GIDs, and its transport, through verbs; `None` when the device cannot
/// be opened or queried.
fn verbs_ports(dev: &str) -> Option<(Transport, Ports)> {
    let ctx = VerbsContext::open(dev).ok()?;
    let ports = ctx.ports().ok()?.into_iter().map(|p| Some((p, ctx.gid_table(p.port).ok()?))).collect::<Option<_>>()?;
    Some((ctx.transport(), ports))
}

/// The port and GID checks of `dev` from `ibv_query_port` and `ibv_query_gid_ex`, in the same
/// words as the sysfs ones (the netdev's MTU still comes from sysfs).
fn verbs_port_checks(
    roots: &Roots,
    dev: &str,
    transport: Transport,
    ports: &[(PortInfo, Vec<GidEntry>)],
    checks: &mut Vec<Check>,
    gids: &mut Vec<Ipv4Gid>,
) {
    for (p, table) in ports {
        let code = match p.state {
            PortState::Down => 1,
            PortState::Init => 2,
            PortState::Armed => 3,
            PortState::Active => 4,
            PortState::ActiveDefer => 5,
            PortState::Other(n) => n,
        };
        let phys = match p.phys_state {
            1 => "Sleep",
            2 => "Polling",
            3 => "Disabled",
            4 => "PortConfigurationTraining",
            5 => "LinkUp",
            6 => "LinkErrorRecovery",
            7 => "Phy Test",
            _ => "?",
        };
        // An iWARP GID is the netdev's MAC (and its netdev is not named): find it by that.
        let iwarp_netdev = (transport == Transport::Iwarp)
            .then(|| table.first().and_then(|g| netdev_of_mac(roots, &g.gid.0[..6])))
            .flatten();
        let netdev = iwarp_netdev.clone().or_else(|| table.iter().find_map(|g| g.netdev.clone())).unwrap_or_default();
        let mtu = read(roots.sys.join("class/net").join(&netdev).join("mtu")).unwrap_or_default();
        let active = p.state == PortState::Active;
        let detail = format!(
            "state {code}: {}, physical {}: {phys}, link layer {}{}, active MTU {} (ibv_query_port)",
            p.state,
            p.phys_state,
            p.link_layer,
            netdev_mtu(&netdev, &mtu),
            p.active_mtu
        );
        checks.push(port_check(format!("{dev} port {}", p.port), active, detail, &netdev));
        if !active {
            continue;
        }
        if let Some(nd) = &iwarp_netdev {
            for addr in ipv4_addrs_of(nd) {
                let (device, port) = (dev.to_string(), u32::from(p.port));
                gids.push(Ipv4Gid { device, port, index: 0, gid_type: IWARP.into(), netdev: nd.clone(), addr });
            }
            continue;
        }
        for g in table {
            let Some(addr) = g.gid.ipv4() else { continue };
            gids.push(Ipv4Gid {
                device: dev.to_string(),
                port: u32::from(p.port),
                index: g.index,
                gid_type: g.gid_type.to_string(),
                netdev: g.netdev.clone().unwrap_or_default(),
                addr,
            });
        }
    }
}

fn accessible(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    unsafe { libc::access(c.as_ptr(), libc::R_OK | libc::W_OK) == 0 }
}

fn memlock_check(buffer: u64) -> Check {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: rl is a valid out-pointer.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } == 0;
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let (status, detail) = if !ok {
        (Status::Warn, "could not read RLIMIT_MEMLOCK".to_string())
    } else if rl.rlim_cur == libc::RLIM_INFINITY {
        (Status::Ok, format!("unlimited (enough for {buffer} bytes)"))
    } else if rl.rlim_cur >= buffer || root {
        let why = if rl.rlim_cur >= buffer { "enough" } else { "root is exempt" };
        (Status::Ok, format!("{} KiB for {buffer} bytes: {why}", rl.rlim_cur / 1024))
    } else {
        (Status::Fail, format!("{} KiB, less than the {buffer} bytes to register", rl.rlim_cur / 1024))
    };
    Check {
        name: "locked-memory limit (ulimit -l)".into(),
        status,
        detail,
        fix: (status == Status::Fail).then(|| {
            "`ulimit -l unlimited` in this shell, or `* - memlock unlimited` in /etc/security/limits.conf".into()
        }),
    }
}

/// The IPv4 address inside an IPv4-mapped GID (`0000:0000:0000:0000:0000:ffff:0a4d:0001`).
pub fn ipv4_of_gid(gid: &str) -> Option<Ipv4Addr> {
    let groups: Vec<u16> = gid.split(':').map(|g| u16::from_str_radix(g, 16)).collect::<Result<_, _>>().ok()?;
    if groups.len() != 8 || groups[..5].iter().any(|&g| g != 0) || groups[5] != 0xffff {
        return None;
    }
    let [a, b] = groups[6].to_be_bytes();
    let [c, d] = groups[7].to_be_bytes();
    Some(Ipv4Addr::new(a, b, c, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapped_gids() {
        assert_eq!(ipv4_of_gid("0000:0000:0000:0000:0000:ffff:0a4d:0001"), Some(Ipv4Addr::new(10, 77, 0, 1)));
        assert_eq!(ipv4_of_gid("fe80:0000:0000:0000:d871:b0ff:fe9f:7070"), None);
        assert_eq!(ipv4_of_gid("0000:0000:0000:0000:0000:0000:0000:0000"), None);
        assert_eq!(ipv4_of_gid("garbage"), None);
    }

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }

    #[test]
    fn fake_tree_without_rdma_fails_with_the_soft_roce_fix() {
        let dir = std::env::temp_dir().join(format!("rdma-cm-diag-none-{}", std::process::id()));
        let roots = Roots { sys: dir.join("sys"), proc_: dir.join("proc"), dev: dir.join("dev") };
        write(&dir, "proc/modules", "ext4 1 0 - Live 0x0\n");
        let r = diagnose_in(&roots, 4096);
        assert!(!r.healthy());
        let text = r.to_string();
        assert!(text.contains("[FAIL] RDMA devices: none") && text.contains("rdma_rxe"), "{text}");
        assert!(text.contains("[FAIL] device files"), "{text}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fake_tree_with_a_healthy_rxe_port() {
        let dir = std::env::temp_dir().join(format!("rdma-cm-diag-rxe-{}", std::process::id()));
        let roots = Roots { sys: dir.join("sys"), proc_: dir.join("proc"), dev: dir.join("dev") };
        let port = "sys/class/infiniband/rxe0/ports/1";
        write(&dir, &format!("{port}/state"), "4: ACTIVE");
        write(&dir, &format!("{port}/phys_state"), "5: LinkUp");
        write(&dir, &format!("{port}/link_layer"), "Ethernet");
        write(&dir, &format!("{port}/gids/0"), "fe80:0000:0000:0000:d871:b0ff:fe9f:7070");
        write(&dir, &format!("{port}/gids/1"), "0000:0000:0000:0000:0000:ffff:0a4d:0001");
        write(&dir, &format!("{port}/gid_attrs/types/1"), "RoCE v2");
        write(&dir, &format!("{port}/gid_attrs/ndevs/0"), "rdma0");
        write(&dir, &format!("{port}/gid_attrs/ndevs/1"), "rdma0");
        write(&dir, "sys/class/net/rdma0/mtu", "9000");
        write(&dir, "proc/modules", "rdma_rxe 1 0 - Live 0x0\nib_uverbs 1 0 - Live 0x0\n");
        write(&dir, "dev/infiniband/rdma_cm", "");
        write(&dir, "dev/infiniband/uverbs0", "");
        let r = diagnose_in(&roots, 4096);
        let text = r.to_string();
        assert!(r.healthy(), "{text}");
        assert_eq!(r.usable_addrs(), vec![Ipv4Addr::new(10, 77, 0, 1)]);
        assert!(text.contains("rxe0 port 1: state 4: ACTIVE") && text.contains("netdev rdma0 (MTU 9000)"), "{text}");
        assert!(text.contains("index 1 (RoCE v2, rdma0) = 10.77.0.1") && text.ends_with("verdict: healthy"), "{text}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
