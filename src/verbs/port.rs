//! Ports and GID tables, typed: what `ibv_query_port` and `ibv_query_gid_ex` report for an open
//! [`VerbsContext`].
//!
//! ```no_run
//! use rdma_cm::VerbsContext;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let ctx = VerbsContext::open("rxe0")?;
//! for p in ctx.ports()? {
//!     println!("port {}: {:?}, MTU {}", p.port, p.state, p.active_mtu);
//!     for g in ctx.gid_table(p.port)? {
//!         println!("  GID index {}: {:?} {:?} on {:?}", g.index, g.gid_type, g.gid.ipv4(), g.netdev);
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! On RoCE every IP address of the netdev under a port appears in the port's GID table, once
//! per GID type (RoCE v1 and v2); the *index* of an entry is what tools such as perftest take
//! as `-x`, and what an address handle names. [`VerbsContext::gid_table`] lists the valid
//! entries with their type and the netdev they belong to, so a program can pick "the RoCE v2
//! GID of 10.0.0.1" rather than guess an index.

use std::fmt;
use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr};

use rdma_sys as ffi;

use crate::error::{check_ibv, Error, Result};
use crate::verbs::device::VerbsContext;

/// A port's logical state (`enum ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PortState {
    /// The link is down (cable, peer, or `ip link set ... down` under RoCE).
    Down,
    /// Physical link up, waiting for the subnet manager (InfiniBand).
    Init,
    /// Configured by the subnet manager, not yet active (InfiniBand).
    Armed,
    /// Ready for traffic.
    Active,
    /// Active, with a deferred transition.
    ActiveDefer,
    /// A value this crate does not know.
    Other(u32),
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortState::Down => f.write_str("DOWN"),
            PortState::Init => f.write_str("INIT"),
            PortState::Armed => f.write_str("ARMED"),
            PortState::Active => f.write_str("ACTIVE"),
            PortState::ActiveDefer => f.write_str("ACTIVE_DEFER"),
            PortState::Other(n) => write!(f, "state {n}"),
        }
    }
}

/// A port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID, with a subnet manager.
    InfiniBand,
    /// Ethernet: RoCE (or iWARP), addressed by GIDs made from IP addresses.
    Ethernet,
    /// Not reported (old drivers report 0 for InfiniBand).
    Unspecified,
    /// A value this crate does not know.
    Other(u8),
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkLayer::InfiniBand => f.write_str("InfiniBand"),
            LinkLayer::Ethernet => f.write_str("Ethernet"),
            LinkLayer::Unspecified => f.write_str("unspecified"),
            LinkLayer::Other(n) => write!(f, "link layer {n}"),
        }
    }
}

/// A port's attributes (`ibv_query_port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortInfo {
    /// The port number (from 1).
    pub port: u8,
    /// Logical state.
    pub state: PortState,
    /// Physical state (`phys_state`: 5 is LinkUp, 3 Disabled, 2 Polling).
    pub phys_state: u8,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Largest MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// MTU in use, in bytes (on RoCE: the largest IB MTU that fits the netdev's MTU).
    pub active_mtu: u32,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Size of the GID table (valid entries are fewer: [`VerbsContext::gid_table`]).
    pub gid_table_len: u32,
    /// Largest message, in bytes.
    pub max_msg_size: u32,
}

/// A GID's type (`enum ibv_gid_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet frames, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable): what rdma_cm uses on RoCE.
    RoceV2,
    /// A value this crate does not know.
    Other(u32),
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GidType::Ib => f.write_str("IB"),
            GidType::RoceV1 => f.write_str("RoCE v1"),
            GidType::RoceV2 => f.write_str("RoCE v2"),
            GidType::Other(n) => write!(f, "GID type {n}"),
        }
    }
}

/// A 128-bit GID, in network order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The GID as an IPv6 address (RoCE GIDs are IP addresses; IPv4 ones are IPv4-mapped).
    pub fn to_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`), which is how RoCE lists
    /// the netdev's IPv4 addresses.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        self.to_ipv6().to_ipv4_mapped()
    }

    /// Whether every byte is zero (an unused entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for Gid {
    /// Eight groups of four hex digits, as sysfs and `ibv_devinfo -v` print GIDs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// A valid entry of a port's GID table (`ibv_query_gid_ex`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GidEntry {
    /// The port.
    pub port: u8,
    /// The index (perftest's `-x`, an address handle's `sgid_index`).
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// The netdev it belongs to (RoCE), by name; `None` on InfiniBand.
    pub netdev: Option<String>,
}

/// An `enum ibv_mtu` value in bytes (`IBV_MTU_256` = 1 … `IBV_MTU_4096` = 5); 0 for none.
pub(crate) fn mtu_bytes(m: ffi::ibv_mtu::Type) -> u32 {
    if (1..=5).contains(&m) {
        128 << m
    } else {
        0
    }
}

fn netdev_name(ifindex: u32) -> Option<String> {
    if ifindex == 0 {
        return None;
    }
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has the IF_NAMESIZE bytes if_indextoname may write (name and NUL).
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success `buf` holds a NUL-terminated name.
    Some(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

impl VerbsContext {
    /// How many ports the device has (`phys_port_cnt`); they are numbered from 1.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_query_device` fails.
    pub fn port_count(&self) -> Result<u8> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut a: ffi::ibv_device_attr = unsafe { mem::zeroed() };
        // SAFETY: context open; `a` is a valid out-pointer of the right type.
        check_ibv(unsafe { ffi::ibv_query_device(self.as_raw(), &mut a) }, "ibv_query_device")?;
        Ok(a.phys_port_cnt)
    }

    /// Queries port `port` (`ibv_query_port`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a port the device does not have (naming how many it
    /// has); [`Error::Call`] when `ibv_query_port` fails.
    pub fn port(&self, port: u8) -> Result<PortInfo> {
        let count = self.port_count()?;
        if port == 0 || port > count {
            return Err(Error::InvalidArgument(format!(
                "{} has no port {port}: its ports are 1..={count}",
                self.device_name()
            )));
        }
        // SAFETY: ibv_port_attr is plain old data; all-zero is a valid value.
        let mut a: ffi::ibv_port_attr = unsafe { mem::zeroed() };
        // SAFETY: context open, port in range; `a` is a valid out-pointer of the size
        // ___ibv_query_port passes to the provider.
        check_ibv(unsafe { ffi::___ibv_query_port(self.as_raw(), port, &mut a) }, "ibv_query_port")?;
        use ffi::ibv_port_state as s;
        Ok(PortInfo {
            port,
            state: match a.state {
                s::IBV_PORT_DOWN => PortState::Down,
                s::IBV_PORT_INIT => PortState::Init,
                s::IBV_PORT_ARMED => PortState::Armed,
                s::IBV_PORT_ACTIVE => PortState::Active,
                s::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
                other => PortState::Other(other),
            },
            phys_state: a.phys_state,
            link_layer: match a.link_layer {
                0 => LinkLayer::Unspecified,
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                other => LinkLayer::Other(other),
            },
            max_mtu: mtu_bytes(a.max_mtu),
            active_mtu: mtu_bytes(a.active_mtu),
            lid: a.lid,
            gid_table_len: a.gid_tbl_len.max(0) as u32,
            max_msg_size: a.max_msg_sz,
        })
    }

    /// Every port of the device.
    ///
    /// # Errors
    /// As for [`VerbsContext::port`].
    pub fn ports(&self) -> Result<Vec<PortInfo>> {
        (1..=self.port_count()?).map(|p| self.port(p)).collect()
    }

    /// The valid entries of port `port`'s GID table, in index order, with their types and
    /// netdevs (`ibv_query_gid_ex`; empty slots are skipped).
    ///
    /// # Errors
    /// As for [`VerbsContext::port`]; [`Error::Call`] when `ibv_query_gid_ex` fails with
    /// anything but "no entry here" (`ENODATA`, `EINVAL`).
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let info = self.port(port)?;
        let mut out = Vec::new();
        for index in 0..info.gid_table_len {
            if let Some(e) = self.gid_entry(port, index)? {
                out.push(e);
            }
        }
        Ok(out)
    }

    /// Entry `index` of port `port`'s GID table, or `None` when it is empty (or past the
    /// table's end).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_query_gid_ex` fails with anything but "no entry here"
    /// (`ENODATA`, `EINVAL`).
    pub fn gid_entry(&self, port: u8, index: u32) -> Result<Option<GidEntry>> {
        // SAFETY: ibv_gid_entry is plain old data; all-zero is a valid value.
        let mut e: ffi::ibv_gid_entry = unsafe { mem::zeroed() };
        // SAFETY: the context is open; `e` is a valid out-pointer and its size is passed, so
        // the library writes no more than that (a port or index out of range is an error).
        let ret =
            unsafe { ffi::_ibv_query_gid_ex(self.as_raw(), u32::from(port), index, &mut e, 0, mem::size_of_val(&e)) };
        match ret {
            0 => {}
            libc::ENODATA | libc::EINVAL => return Ok(None),
            e => return Err(Error::call("ibv_query_gid_ex", e, None)),
        }
        // SAFETY: `raw` is the 16-byte view of union ibv_gid; every bit pattern is valid.
        let gid = Gid(unsafe { e.gid.raw });
        if gid.is_zero() {
            return Ok(None);
        }
        Ok(Some(GidEntry {
            port,
            index,
            gid,
            gid_type: match e.gid_type {
                ffi::IBV_GID_TYPE_IB => GidType::Ib,
                ffi::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
                ffi::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
                other => GidType::Other(other),
            },
            netdev: netdev_name(e.ndev_ifindex),
        }))
    }
}
