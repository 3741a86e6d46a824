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

fn ipv4_of(ifname: &str) -> Option<Ipv4Addr> {
    if ifname.is_empty() {
        return None;
    }
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut p = head;
    while !p.is_null() {
        // SAFETY: p walks the list getifaddrs returned; fields are valid until freeifaddrs.
        let ifa = unsafe { &*p };
        // SAFETY: ifa_name is a NUL-terminated string.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy();
        // SAFETY: ifa_addr, when non-null, points to a sockaddr whose family says its layout.
        if name == ifname && !ifa.ifa_addr.is_null() && unsafe { (*ifa.ifa_addr).sa_family } as i32 == libc::AF_INET {
            // SAFETY: AF_INET means the sockaddr is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            break;
        }
        p = ifa.ifa_next;
    }
    // SAFETY: head came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}
