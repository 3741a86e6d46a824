//! [`AddressHandle`]: an owned `ibv_ah`, the address a UD send goes to; [`AhAttr`], what it is
//! made of; [`UdParam`], the `ud` parameters of a connection-manager event (the peer's address,
//! QP number and QKey); and [`Grh`], the 40-byte header in front of every UD receive.
//!
//! ```no_run
//! use rdma_cm::{ProtectionDomain, VerbsContext};
//! use rdma_cm::verbs::ah::{AddressHandle, AhAttr};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let ctx = VerbsContext::open("rxe0")?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let peer = ctx.gid_table(1)?[0].gid; // in practice: the peer's GID, learnt out of band
//! let ah = AddressHandle::new(&pd, &AhAttr::global(peer, 1, 1))?; // source GID index 1, port 1
//! println!("to {:?} through port {}", ah.attr().dgid(), ah.attr().port_num());
//! // With the CM, `UdEndpoint::connect` and multicast joins make the handle themselves.
//! # Ok(()) }
//! ```
//!
//! An address handle is made from:
//!
//! - the `ud` parameters of a UD `ESTABLISHED` event (the answer to a UD "connect") or of a
//!   multicast `JOIN` event: [`UdParam`], through [`UdDest::from_ud_param`](crate::verbs::ud::UdDest::from_ud_param);
//! - a received datagram, to answer its sender ([`AddressHandle::reply_to`], `ibv_create_ah_from_wc`);
//! - raw attributes ([`AddressHandle::new`]).
//!
//! It holds its protection domain. Every UD send that names it holds it in the QP's send slot
//! until the completion retires that slot, so dropping the last handle the caller has while a
//! send is posted only postpones `ibv_destroy_ah` until the device is done.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{errno, Error, Result};
use crate::verbs::lane::completion::Wc;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::port::Gid;

/// Bytes the device writes in front of every UD receive: the Global Routing Header (or, on
/// RoCE v2 over IPv4, 20 unused bytes and the IPv4 header). Every UD receive buffer needs this
/// much room before the payload, whether or not the sender's packet carried a GRH.
pub const GRH_LEN: usize = 40;

/// Address-handle attributes (`struct ibv_ah_attr`).
#[derive(Clone, Copy)]
pub struct AhAttr {
    pub(crate) raw: ffi::ibv_ah_attr,
}

impl AhAttr {
    /// A global (routed) address: destination GID `dgid`, sent from the local GID table entry
    /// `sgid_index` of port `port_num`, hop limit 64. This is what a RoCE address is.
    pub fn global(dgid: Gid, sgid_index: u8, port_num: u8) -> AhAttr {
        // SAFETY: ibv_ah_attr is plain old data (integers and a GID union); zero is valid.
        let mut raw: ffi::ibv_ah_attr = unsafe { std::mem::zeroed() };
        raw.is_global = 1;
        raw.port_num = port_num;
        raw.grh.dgid = ffi::ibv_gid { raw: dgid.0 };
        raw.grh.sgid_index = sgid_index;
        raw.grh.hop_limit = 64;
        AhAttr { raw }
    }

    /// Wraps raw attributes.
    pub fn from_raw(raw: ffi::ibv_ah_attr) -> AhAttr {
        AhAttr { raw }
    }

    /// The raw attributes.
    pub fn as_raw(&self) -> &ffi::ibv_ah_attr {
        &self.raw
    }

    /// Whether the address is global (carries a GRH: always on RoCE).
    pub fn is_global(&self) -> bool {
        self.raw.is_global != 0
    }

    /// The destination GID (meaningful when [`AhAttr::is_global`]).
    pub fn dgid(&self) -> Gid {
        // SAFETY: every bit pattern of the GID union is a valid [u8; 16].
        Gid(unsafe { self.raw.grh.dgid.raw })
    }

    /// The local GID table index the packets are sent from.
    pub fn sgid_index(&self) -> u8 {
        self.raw.grh.sgid_index
    }

    /// The hop limit (IPv6) or TTL (IPv4).
    pub fn hop_limit(&self) -> u8 {
        self.raw.grh.hop_limit
    }

    /// The traffic class (the TOS byte on RoCE v2 over IPv4).
    pub fn traffic_class(&self) -> u8 {
        self.raw.grh.traffic_class
    }

    /// The destination LID (InfiniBand; 0 on RoCE).
    pub fn dlid(&self) -> u16 {
        self.raw.dlid
    }

    /// The service level.
    pub fn sl(&self) -> u8 {
        self.raw.sl
    }

    /// The local port the packets leave from.
    pub fn port_num(&self) -> u8 {
        self.raw.port_num
    }
}

impl fmt::Debug for AhAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AhAttr")
            .field("is_global", &self.is_global())
            .field("dgid", &self.dgid())
            .field("sgid_index", &self.sgid_index())
            .field("hop_limit", &self.hop_limit())
            .field("traffic_class", &self.traffic_class())
            .field("dlid", &self.dlid())
            .field("sl", &self.sl())
            .field("port_num", &self.port_num())
            .finish()
    }
}

/// The `ud` parameters of a connection-manager event on a UD id (`struct rdma_ud_param`): the
/// address of the peer (or of the multicast group), its QP number and QKey. A UD `ESTABLISHED`
/// event carries them ([`UdEndpoint::connect`](crate::cm::ud_cm::UdEndpoint::connect) returns them as a
/// [`UdDest`]), and so does a multicast `JOIN` event.
#[derive(Clone, Copy, Debug)]
pub struct UdParam {
    pub(crate) ah_attr: AhAttr,
    pub(crate) qp_num: u32,
    pub(crate) qkey: u32,
}

impl UdParam {
    /// Copies the parameters out of a raw event's union.
    pub(crate) fn from_raw(ud: &ffi::rdma_ud_param) -> UdParam {
        UdParam { ah_attr: AhAttr { raw: ud.ah_attr }, qp_num: ud.qp_num, qkey: ud.qkey }
    }

    /// Builds parameters (for tests, or addresses learnt another way).
    pub fn new(ah_attr: AhAttr, qp_num: u32, qkey: u32) -> UdParam {
        UdParam { ah_attr, qp_num, qkey }
    }

    /// The address attributes to make an [`AddressHandle`] from.
    pub fn ah_attr(&self) -> &AhAttr {
        &self.ah_attr
    }

    /// The remote QP number (0xFFFFFF for a multicast group).
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The remote QKey.
    pub fn qkey(&self) -> u32 {
        self.qkey
    }
}

/// An owned address handle (`ibv_ah`), always behind an `Arc`: UD sends hold a clone until
/// their completions are reaped.
pub struct AddressHandle {
    raw: NonNull<ffi::ibv_ah>,
    attr: AhAttr,
    // Dropped after the AH is destroyed (Drop::drop runs before fields drop).
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the AH is immutable after creation and owned by this value; verbs on it (create,
// destroy, use in a post) are thread-safe, and it is destroyed once, in Drop.
unsafe impl Send for AddressHandle {}
// SAFETY: see the Send impl: `&AddressHandle` offers only reads of immutable data.
unsafe impl Sync for AddressHandle {}

/// The usual cause of an `ibv_create_ah` failure, by errno (as measured on rxe).
fn create_ah_hint(errno: i32) -> &'static str {
    match errno {
        libc::ENODATA => {
            "the source GID index is not in the port's GID table: pick a valid entry (`ibv_devinfo -v`, \
             VerbsContext::gid_table)"
        }
        _ => {
            "the destination GID is unusable or unreachable: a zero GID, or (on RoCE) an address the kernel \
             has no route for (`ip route get ADDR`; an IPv6 GID needs an IPv6 route on the RDMA netdev)"
        }
    }
}

impl AddressHandle {
    /// Creates an address handle on `pd` (`ibv_create_ah`).
    ///
    /// # Errors
    /// [`Error::Call`] naming `ibv_create_ah` and its errno, with a hint, when the kernel or
    /// provider refuses the attributes. Measured on rxe: `EINVAL` for a zero destination GID
    /// or one whose address has no route (an IPv6 GID without an IPv6 route); `ENODATA` for a
    /// source GID index that is not in the table. An IPv4 address that is routed (through a
    /// default route, say) but where nobody listens gives a handle: datagrams sent with it
    /// complete and are lost, as UD allows.
    pub fn new(pd: &Arc<ProtectionDomain>, attr: &AhAttr) -> Result<Arc<AddressHandle>> {
        let mut raw_attr = attr.raw;
        // SAFETY: the PD is valid for the call; `raw_attr` is a fully initialised attribute
        // struct the call reads (and may adjust) only during the call.
        let raw = unsafe { ffi::ibv_create_ah(pd.as_raw(), &mut raw_attr) };
        let raw = NonNull::new(raw).ok_or_else(|| create_ah_error("ibv_create_ah", errno()))?;
        Ok(Arc::new(AddressHandle { raw, attr: *attr, pd: Arc::clone(pd) }))
    }

    /// Creates an address handle that answers the sender of a received datagram
    /// (`ibv_create_ah_from_wc`): `wc` is the receive's completion and `grh` the 40 bytes the
    /// device wrote at the start of its buffer ([`Datagram::grh`](crate::verbs::ud::Datagram::grh)).
    /// `port_num` is the local port ([`UdQp::port_num`](crate::verbs::ud::UdQp::port_num)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a completion that is not a successful receive;
    /// [`Error::Call`] as for [`AddressHandle::new`].
    pub fn reply_to(pd: &Arc<ProtectionDomain>, port_num: u8, wc: &Wc, grh: &Grh) -> Result<Arc<AddressHandle>> {
        if !wc.is_ok() || wc.queue() != crate::status::WorkQueue::Recv {
            return Err(Error::InvalidArgument(format!(
                "an address handle answers a successful receive; this completion is a {:?} one with status {}",
                wc.queue(),
                wc.status()
            )));
        }
        let mut raw_wc = wc.to_raw();
        let mut raw_grh = grh.to_raw();
        // SAFETY: ibv_ah_attr is plain old data; zero is a valid start.
        let mut attr: ffi::ibv_ah_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the PD (and its context) is valid; `raw_wc` and `raw_grh` are initialised
        // copies the call only reads; `attr` is a valid out-parameter.
        let ret =
            unsafe { ffi::ibv_init_ah_from_wc(pd.context().as_raw(), port_num, &mut raw_wc, &mut raw_grh, &mut attr) };
        if ret != 0 {
            return Err(create_ah_error("ibv_init_ah_from_wc", if ret < 0 { errno() } else { ret }));
        }
        AddressHandle::new(pd, &AhAttr { raw: attr })
    }

    /// The raw handle, for calls this crate does not wrap. It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::ibv_ah {
        self.raw.as_ptr()
    }

    /// The attributes it was made from.
    pub fn attr(&self) -> &AhAttr {
        &self.attr
    }

    /// The PD it was made on.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

fn create_ah_error(op: &'static str, errno: i32) -> Error {
    let errno = errno.saturating_abs().max(1);
    Error::Call { op, addr: None, hint: Some(create_ah_hint(errno)), source: std::io::Error::from_raw_os_error(errno) }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        // SAFETY: the AH is owned by this value and destroyed exactly once, here. No posted
        // send uses it any more: each holds an Arc of it until its slot is retired.
        let ret = unsafe { ffi::ibv_destroy_ah(self.raw.as_ptr()) };
        if ret != 0 {
            crate::error::report_leak("ibv_destroy_ah", ret);
        }
    }
}

impl fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressHandle").field("attr", &self.attr).finish()
    }
}

/// The 40 bytes the device writes in front of a UD receive's payload: an InfiniBand/RoCE v1
/// GRH (an IPv6-shaped header), or on RoCE v2 over IPv4 twenty unused bytes followed by the
/// packet's IPv4 header. Copied out of the receive buffer, so it is plain data; its contents
/// came from the network and are untrusted.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Grh {
    bytes: [u8; GRH_LEN],
}

impl Grh {
    /// Wraps the 40 bytes at the start of a receive buffer.
    pub fn from_bytes(bytes: [u8; GRH_LEN]) -> Grh {
        Grh { bytes }
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; GRH_LEN] {
        &self.bytes
    }

    fn to_raw(self) -> ffi::ibv_grh {
        // SAFETY: ibv_grh is 40 bytes of plain old data (integers and two GID unions) with no
        // padding; every bit pattern is valid.
        unsafe { std::mem::transmute::<[u8; GRH_LEN], ffi::ibv_grh>(self.bytes) }
    }

    /// Whether bytes 20..40 hold an IPv4 header (RoCE v2 over IPv4), decided as libibverbs
    /// does (`get_grh_header_version`): when byte 0 does not start an IPv6 header, an IPv4
    /// version nibble at byte 20 settles it; when both could be, a 20-byte IPv4 header whose
    /// checksum adds up does.
    pub fn is_ipv4(&self) -> bool {
        let h = &self.bytes[20..40];
        if self.bytes[0] >> 4 != 6 {
            return h[0] >> 4 == 4;
        }
        if h[0] & 0x0f != 5 {
            return false;
        }
        let mut sum: u32 = h.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum == 0xffff
    }

    /// Whether the header is an IPv6-shaped GRH (InfiniBand, RoCE v1, RoCE v2 over IPv6).
    pub fn is_ipv6(&self) -> bool {
        self.bytes[0] >> 4 == 6 && !self.is_ipv4()
    }

    /// The sender's GID: from the GRH, or the IPv4-mapped GID of the IPv4 source address.
    /// `None` when the packet carried no header the device recognised (all zero, say: a
    /// local InfiniBand datagram without a GRH).
    pub fn sgid(&self) -> Option<Gid> {
        if self.is_ipv4() {
            let a: [u8; 4] = self.bytes[32..36].try_into().ok()?;
            return Some(Gid(Ipv4Addr::from(a).to_ipv6_mapped().octets()));
        }
        self.is_ipv6().then(|| Gid(self.bytes[8..24].try_into().unwrap_or([0; 16])))
    }

    /// The destination GID (ours, or the multicast group's), as for [`Grh::sgid`].
    pub fn dgid(&self) -> Option<Gid> {
        if self.is_ipv4() {
            let a: [u8; 4] = self.bytes[36..40].try_into().ok()?;
            return Some(Gid(Ipv4Addr::from(a).to_ipv6_mapped().octets()));
        }
        self.is_ipv6().then(|| Gid(self.bytes[24..40].try_into().unwrap_or([0; 16])))
    }

    /// The sender's IP address: the IPv4 source, or the source GID as an IPv6 address (an
    /// IPv4-mapped GID as its IPv4 address).
    pub fn src_ip(&self) -> Option<IpAddr> {
        let g = self.sgid()?;
        Some(match g.ipv4() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(g.to_ipv6()),
        })
    }
}

impl fmt::Debug for Grh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grh")
            .field("ipv4", &self.is_ipv4())
            .field("sgid", &self.sgid())
            .field("dgid", &self.dgid())
            .finish()
    }
}

/// Where a datagram goes: an address handle, the remote QP number and its QKey. Cheap to
/// clone (the handle is shared).
#[derive(Clone, Debug)]
pub struct UdDest {
    ah: Arc<AddressHandle>,
    qpn: u32,
    qkey: u32,
}

impl UdDest {
    /// A destination from its parts.
    pub fn new(ah: Arc<AddressHandle>, qpn: u32, qkey: u32) -> UdDest {
        UdDest { ah, qpn: qpn & 0x00ff_ffff, qkey }
    }

    /// The destination an event's `ud` parameters name (a UD `ESTABLISHED` event, or a
    /// multicast `JOIN`): makes the address handle on `pd` (`ibv_create_ah`).
    ///
    /// # Errors
    /// As for [`AddressHandle::new`].
    pub fn from_ud_param(pd: &Arc<ProtectionDomain>, ud: &UdParam) -> Result<UdDest> {
        Ok(UdDest::new(AddressHandle::new(pd, ud.ah_attr())?, ud.qp_num(), ud.qkey()))
    }

    /// The address handle.
    pub fn ah(&self) -> &Arc<AddressHandle> {
        &self.ah
    }

    /// The remote QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The remote QKey.
    pub fn qkey(&self) -> u32 {
        self.qkey
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4_grh(src: [u8; 4], dst: [u8; 4]) -> Grh {
        let mut b = [0u8; GRH_LEN];
        let h = &mut b[20..40];
        h[0] = 0x45;
        h[2..4].copy_from_slice(&60u16.to_be_bytes());
        h[8] = 64;
        h[9] = 17; // UDP
        h[12..16].copy_from_slice(&src);
        h[16..20].copy_from_slice(&dst);
        let mut sum: u32 = h.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
        Grh::from_bytes(b)
    }

    #[test]
    fn ipv4_header_gives_the_sender() {
        let g = ipv4_grh([10, 77, 0, 1], [10, 77, 0, 2]);
        assert!(g.is_ipv4() && !g.is_ipv6());
        assert_eq!(g.src_ip(), Some(IpAddr::V4(Ipv4Addr::new(10, 77, 0, 1))));
        assert_eq!(g.dgid().unwrap().ipv4(), Some(Ipv4Addr::new(10, 77, 0, 2)));
    }

    #[test]
    fn zeroes_are_not_an_address_and_the_checksum_decides_only_when_ambiguous() {
        // rxe leaves the checksum 0 in the header it hands up: still IPv4, as for libibverbs.
        let mut b = *ipv4_grh([10, 77, 0, 1], [10, 77, 0, 2]).as_bytes();
        b[30] = 0;
        b[31] = 0;
        assert!(Grh::from_bytes(b).is_ipv4());
        // Byte 0 could start an IPv6 header: then only a checksum that adds up makes it IPv4.
        b[0] = 0x60;
        assert!(!Grh::from_bytes(b).is_ipv4() && Grh::from_bytes(b).is_ipv6());
        let mut c = *ipv4_grh([10, 77, 0, 1], [10, 77, 0, 2]).as_bytes();
        c[0] = 0x60;
        assert!(Grh::from_bytes(c).is_ipv4());
        assert_eq!(Grh::from_bytes([0; GRH_LEN]).src_ip(), None);
    }

    #[test]
    fn ipv6_grh_gives_the_gids() {
        let mut b = [0u8; GRH_LEN];
        b[0] = 0x60;
        b[8..24].copy_from_slice(&[0xfd, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        b[24..40].copy_from_slice(&[0xfd, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        let g = Grh::from_bytes(b);
        assert!(g.is_ipv6());
        assert_eq!(g.src_ip(), Some("fd77::1".parse().unwrap()));
        assert_eq!(g.dgid().unwrap().to_ipv6(), "fd77::2".parse::<std::net::Ipv6Addr>().unwrap());
    }

    #[test]
    fn grh_layout_matches_the_c_struct() {
        assert_eq!(std::mem::size_of::<ffi::ibv_grh>(), GRH_LEN);
    }
}
