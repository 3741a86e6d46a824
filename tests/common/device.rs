//! Finding the RDMA device's IPv4 address, shared by the device tests and the benches.

use std::net::{IpAddr, Ipv4Addr};

/// The IPv4 address of the netdev behind the first ACTIVE port of an RDMA device (or
/// `RDMA_VM_ADDR`/`RDMA_CM_TEST_ADDR`). Panics, with the fix, when there is none.
pub fn device_addr() -> IpAddr {
    if let Some(a) = std::env::var("RDMA_VM_ADDR").ok().or_else(|| std::env::var("RDMA_CM_TEST_ADDR").ok()) {
        return a.parse().expect("RDMA_VM_ADDR/RDMA_CM_TEST_ADDR is not an IP address");
    }
    let devices: Vec<_> = std::fs::read_dir("/sys/class/infiniband").map(|d| d.flatten().collect()).unwrap_or_default();
    for dev in devices {
        let ports: Vec<_> =
            std::fs::read_dir(dev.path().join("ports")).map(|d| d.flatten().collect()).unwrap_or_default();
        for port in ports {
            let state = std::fs::read_to_string(port.path().join("state")).unwrap_or_default();
            let netdev = std::fs::read_to_string(port.path().join("gid_attrs/ndevs/0")).unwrap_or_default();
            if state.contains("ACTIVE") {
                if let Some(ip) = ipv4_of(netdev.trim()) {
                    return IpAddr::V4(ip);
                }
            }
        }
    }
    panic!(
        "no RDMA device with an IPv4 address on this machine: this is a device test. Run it with \
         `cargo test` (cargo's runner, harness/runner, starts a Soft-RoCE guest) or `harness/test`; \
         on real hardware check `rdma link` and `ip addr`"
    );
}

/// The netdev under port `port` of RDMA device `device`, as `rdma link` names it.
pub fn netdev_of(device: &str, port: u8) -> Option<String> {
    let out = std::process::Command::new("rdma").args(["link", "show", &format!("{device}/{port}")]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    words.find(|w| *w == "netdev")?;
    words.next().map(str::to_string)
}

/// The first global or unique-local (not link-local) IPv6 address of netdev `ifname`.
pub fn ipv6_of(ifname: &str) -> Option<std::net::Ipv6Addr> {
    addrs_of(ifname, libc::AF_INET6).into_iter().find_map(|a| match a {
        IpAddr::V6(v) if (v.segments()[0] & 0xffc0) != 0xfe80 => Some(v),
        _ => None,
    })
}

/// The IPv4 address of netdev `ifname`.
pub fn ipv4_of(ifname: &str) -> Option<Ipv4Addr> {
    addrs_of(ifname, libc::AF_INET).into_iter().find_map(|a| match a {
        IpAddr::V4(v) => Some(v),
        IpAddr::V6(_) => None,
    })
}

/// The addresses of family `family` (AF_INET or AF_INET6) on netdev `ifname`.
fn addrs_of(ifname: &str, family: i32) -> Vec<IpAddr> {
    let mut found = vec![];
    if ifname.is_empty() {
        return found;
    }
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return found;
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: p walks the list getifaddrs returned; fields are valid until freeifaddrs.
        let ifa = unsafe { &*p };
        // SAFETY: ifa_name is a NUL-terminated string.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy();
        // SAFETY: ifa_addr, when non-null, points to a sockaddr whose family says its layout.
        if name == ifname && !ifa.ifa_addr.is_null() && unsafe { (*ifa.ifa_addr).sa_family } as i32 == family {
            if family == libc::AF_INET {
                // SAFETY: AF_INET means the sockaddr is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                found.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
            } else {
                // SAFETY: AF_INET6 means the sockaddr is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                found.push(IpAddr::V6(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: head came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}
