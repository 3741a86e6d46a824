//! Unreliable datagrams (UD) through rdma_cm: [`UdQp`], a UD queue pair whose sends are
//! addressed per work request (a lane's [`SendWr::to`](crate::verbs::lane::SendWr::to) a
//! destination registered from a [`UdDest`]); [`Datagram`], a received message with its 40-byte
//! GRH accounted for; and the UD connection-manager steps.
//!
//! ```text
//!  client                                         server
//!  UdClient::new           (RDMA_PS_UDP)          UdServer::new        (RDMA_PS_UDP)
//!   │ resolve_addr  → ADDR_RESOLVED               │ listen             (rdma_bind_addr, rdma_listen)
//!  UdAddrResolved                                 UdListener
//!   │ resolve_route → ROUTE_RESOLVED              │ get_request   → CONNECT_REQUEST (SIDR REQ)
//!  UdRoute        ── alloc_pd                     UdRequest     ── alloc_pd
//!   │ create_qp     (rdma_create_qp, UD: RTS)     │ create_qp / reject
//!  UdEndpoint     ── Lane::attach                 UdServerQp
//!   │ connect       → ESTABLISHED + ud param      │ accept             (rdma_accept: SIDR REP)
//!   ▼ = UdDest of the server's QP                 UdEndpoint    ── Lane::attach (learns each sender
//!                                                                 from its datagrams)
//! ```
//!
//! A UD "connect" is one request and one reply (IB SIDR): the client learns the server's QP
//! number and QKey and an address for it from the `ESTABLISHED` event's `ud` parameters
//! ([`UdParam`](crate::verbs::ah::UdParam)); nothing is connected, and the server learns a client from the datagrams it
//! receives ([`AddressHandle::reply_to`], [`Datagram::src_qp`]).
//!
//! # What a UD QP refuses, and why
//!
//! Its lane checks each post (see [`crate::verbs::lane`]):
//!
//! - **RDMA WRITE, READ and atomics** do not exist on UD: only sends (with or without immediate
//!   data, gathered or inline) are taken, each to a destination
//!   ([`Lane::add_dest`](crate::verbs::lane::Lane::add_dest)).
//! - **A message over the MTU** is one packet too big to send: refused before posting, with
//!   [`Error::MessageTooLong`] naming both sizes.
//! - **A receive buffer of fewer than [`GRH_LEN`] bytes** has no room for the header the
//!   device writes first: refused before posting. A message longer than the buffer's room
//!   after the 40 bytes completes with an error (`LOC_LEN_ERR`; rxe says `LOC_QP_OP_ERR`)
//!   **and moves the QP to the error state**: one peer's datagram stops it receiving. Posts
//!   are refused from then on; receives of [`UdQp::recv_len`] bytes make it impossible, since
//!   no datagram exceeds the MTU.
//! - **An address handle on another protection domain** than the QP's is refused.
//!
//! # Soundness
//!
//! As for RC (see [`crate::verbs::lane`]): every region a send or receive names is held by the
//! lane until the completion retires it. A UD send also holds its [`AddressHandle`]: the lane
//! keeps the destination's handle while a send to it is posted, so dropping every handle the
//! caller has only delays `ibv_destroy_ah` until the completion is reaped (or the QP is gone).

use std::ops::Range;
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{check_ibv, Error, Result};
use crate::status::WorkQueue;
pub use crate::verbs::ah::UdDest;
use crate::verbs::ah::{AddressHandle, Grh, GRH_LEN};
use crate::verbs::cq::CompletionQueue;
use crate::verbs::lane::Wc;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::peer::PeerInfo;
use crate::verbs::qp::{QpInit, QueuePair};

/// The QKey librdmacm gives every UD QP of the UDP port space (`RDMA_UDP_QKEY`).
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

/// Private data a UD connect request carries at most (the SIDR REQ's 216 bytes less the
/// rdma_cm header's 20).
pub const MAX_UD_PRIVATE_DATA: usize = 196;

/// A received datagram: where its payload lies in the receive buffer (after the 40-byte GRH
/// area), who sent it, and its GRH. Built from a receive's completion and its region
/// ([`Datagram::parse`]); the sizes come from the device and are checked, never trusted.
#[derive(Clone, Copy, Debug)]
pub struct Datagram {
    wc: Wc,
    grh: Option<Grh>,
    payload: (usize, usize),
}

impl Datagram {
    /// Reads a UD receive's completion `wc` against the region `mr` it was posted on,
    /// starting at `offset` (the receive's range start): copies the GRH out (when the packet
    /// had one) and computes the payload's range, `offset + 40 .. offset + byte_len`.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] for a failed completion; [`Error::InvalidArgument`] for a
    /// send's completion, or one shorter than the GRH area (not a UD receive);
    /// [`Error::OutOfBounds`] when the message does not fit the region from `offset` (the
    /// completion is not this region's); [`Error::InFlight`] while a posted receive still lets
    /// the device write `mr`.
    pub fn parse(wc: &Wc, mr: &mut MemoryRegion, offset: usize) -> Result<Datagram> {
        if let Some(e) = wc.error() {
            return Err(e);
        }
        let wc = *wc;
        if wc.queue() != WorkQueue::Recv {
            return Err(Error::InvalidArgument("a datagram is read from a receive's completion, not a send's".into()));
        }
        let len = wc.byte_len() as usize;
        if len < GRH_LEN {
            return Err(Error::InvalidArgument(format!(
                "a receive completion of {len} bytes is shorter than the {GRH_LEN}-byte GRH area every UD receive \
                 starts with: it is not a UD receive"
            )));
        }
        crate::verbs::mr::check_range(offset, len, mr.len())?;
        let grh = if wc.has_grh() {
            let mut b = [0u8; GRH_LEN];
            mr.read_at(offset, &mut b)?;
            Some(Grh::from_bytes(b))
        } else {
            None
        };
        Ok(Datagram { wc, grh, payload: (offset + GRH_LEN, offset + len) })
    }

    /// Where the payload lies in the region: after the GRH area, as long as the sender sent.
    pub fn payload(&self) -> Range<usize> {
        self.payload.0..self.payload.1
    }

    /// The payload's length.
    pub fn len(&self) -> usize {
        self.payload.1 - self.payload.0
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sender's QP number.
    pub fn src_qp(&self) -> u32 {
        self.wc.src_qp()
    }

    /// The GRH the packet carried (on RoCE: always), copied out of the buffer.
    pub fn grh(&self) -> Option<&Grh> {
        self.grh.as_ref()
    }

    /// The sender's IP address, from the GRH.
    pub fn src_ip(&self) -> Option<std::net::IpAddr> {
        self.grh.and_then(|g| g.src_ip())
    }

    /// The immediate data, if the sender attached any.
    pub fn imm_data(&self) -> Option<u32> {
        self.wc.imm_data()
    }

    /// The completion.
    pub fn completion(&self) -> &Wc {
        &self.wc
    }
}

impl UdDest {
    /// The destination that answers a received datagram: an address handle from its
    /// completion and GRH ([`AddressHandle::reply_to`]), the sender's QP number, and `qkey`
    /// (the sender's QKey; rdma_cm gives every UDP-space QP [`RDMA_UDP_QKEY`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the datagram carried no GRH (RoCE always has one);
    /// as for [`AddressHandle::reply_to`].
    pub fn reply_to(qp: &UdQp, d: &Datagram, qkey: u32) -> Result<UdDest> {
        let grh = d.grh().ok_or_else(|| {
            Error::InvalidArgument("the datagram carried no GRH: its sender's address is not known".into())
        })?;
        let ah = AddressHandle::reply_to(qp.pd(), qp.port_num(), &d.wc, grh)?;
        Ok(UdDest::new(ah, d.src_qp(), qkey))
    }
}

/// A UD queue pair, on a port with its QKey and MTU; a lane posts and polls on it
/// ([`Lane::attach`](crate::verbs::lane::Lane::attach)).
#[derive(Debug)]
pub struct UdQp {
    qp: QueuePair,
    port_num: u8,
    mtu: u32,
    qkey: u32,
    /// The send queue's PSN (what a verbs-only peer is told; nothing checks it on UD).
    psn: u32,
}

impl UdQp {
    /// Wraps a UD QP in RTS on port `port_num`, reading the port's MTU and the QP's QKey.
    pub(crate) fn from_qp(qp: QueuePair, port_num: u8) -> Result<UdQp> {
        let mtu = qp.pd().context().port(port_num)?.active_mtu;
        // SAFETY: ibv_qp_attr and ibv_qp_init_attr are plain old data; zero is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_QKEY.0 | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN.0;
        // SAFETY: the QP is valid; both out-pointers are live for the call.
        let ret = unsafe { ffi::ibv_query_qp(qp.as_raw(), &mut attr, mask as i32, &mut init) };
        check_ibv(ret, "ibv_query_qp(QKEY)")?;
        Ok(UdQp { qp, port_num, mtu, qkey: attr.qkey, psn: attr.sq_psn })
    }

    /// Creates a UD QP without the connection manager (`ibv_create_qp` on `pd`, its CQs made
    /// on the PD's context unless `init` names them) on port `port` with Q_Key `qkey`, and
    /// moves it through INIT and RTR to RTS: it can send and receive at once. Its peers learn
    /// its address by any means ([`UdQp::local`]) and it reaches them through
    /// [`UdQp::dest_to`]. This is `ibv_ud_pingpong`'s QP (which uses Q_Key `0x11111111`).
    ///
    /// # Errors
    /// As for [`VerbsContext::port`](crate::VerbsContext::port) (a port the device lacks); as
    /// for [`UnconnectedQp::new_reset`](crate::verbs::qp::UnconnectedQp::new_reset); [`Error::Call`] when `ibv_modify_qp` refuses a
    /// state (EOPNOTSUPP or EINVAL on a device without UD).
    pub fn new(pd: &Arc<ProtectionDomain>, init: QpInit, port: u8, qkey: u32) -> Result<UdQp> {
        pd.context().port(port)?;
        let mut init = init;
        init.datagrams = true;
        let qp = QueuePair::create(
            pd,
            init,
            |attr| {
                // SAFETY: the PD and the CQs in `attr` are valid and on one context (checked by
                // QueuePair::create); attr is fully initialised, for a UD QP.
                crate::error::check_ptr(unsafe { ffi::ibv_create_qp(pd.as_raw(), attr) }, "ibv_create_qp")
            },
            None,
        )?;
        use ffi::ibv_qp_attr_mask as m;
        let steps: [(ffi::ibv_qp_state::Type, u32, &'static str); 3] = [
            (
                ffi::ibv_qp_state::IBV_QPS_INIT,
                m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_QKEY.0,
                "ibv_modify_qp(INIT) of a UD QP",
            ),
            (ffi::ibv_qp_state::IBV_QPS_RTR, m::IBV_QP_STATE.0, "ibv_modify_qp(RTR) of a UD QP"),
            (ffi::ibv_qp_state::IBV_QPS_RTS, m::IBV_QP_STATE.0 | m::IBV_QP_SQ_PSN.0, "ibv_modify_qp(RTS) of a UD QP"),
        ];
        // SAFETY: ibv_qp_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qkey = qkey;
        attr.sq_psn = crate::verbs::qp::connect::random_psn();
        for (state, mask, op) in steps {
            attr.qp_state = state;
            // SAFETY: the QP is alive (owned here); `attr` holds every field `mask` names.
            check_ibv(unsafe { ffi::ibv_modify_qp(qp.as_raw(), &mut attr, mask as i32) }, op)?;
        }
        UdQp::from_qp(qp, port)
    }

    /// This QP's address for a peer without the connection manager: the port's LID, the GID
    /// of entry `gid_index` (needed on RoCE), its QP number and send PSN.
    ///
    /// # Errors
    /// As for [`VerbsContext::port`](crate::VerbsContext::port); [`Error::InvalidArgument`]
    /// for a GID index with no entry (listing the ones there are).
    pub fn local(&self, gid_index: Option<u8>) -> Result<PeerInfo> {
        let (lid, gid) = PeerInfo::local_address(self.pd().context(), self.port_num, gid_index)?;
        Ok(PeerInfo { lid, qp_num: self.qp_num(), psn: self.psn, gid })
    }

    /// The destination of a peer's UD QP known by its [`PeerInfo`] (exchanged by any means):
    /// an address handle on this QP's PD that reaches its GID from local entry `gid_index`
    /// (or its LID, without a GID) at service level `sl`, its QP number, and its Q_Key `qkey`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for info no QP can have ([`PeerInfo::check`]), or a peer
    /// with a GID while no `gid_index` is given; as for [`AddressHandle::new`] (rxe fails it
    /// when the GID does not resolve to a neighbour).
    pub fn dest_to(&self, peer: &PeerInfo, gid_index: Option<u8>, sl: u8, qkey: u32) -> Result<UdDest> {
        peer.check()?;
        if peer.has_gid() && gid_index.is_none() {
            return Err(Error::InvalidArgument(
                "the peer gave a GID, but no local GID index was given to send from (-g)".into(),
            ));
        }
        let attr = crate::verbs::ah::AhAttr::from_raw(peer.ah_attr(self.port_num, gid_index, sl));
        let ah = AddressHandle::new(self.pd(), &attr)?;
        Ok(UdDest::new(ah, peer.qp_num, qkey))
    }

    /// The receive length that takes any datagram: [`GRH_LEN`] + [`UdQp::mtu`].
    pub fn recv_len(&self) -> usize {
        GRH_LEN + self.mtu as usize
    }

    /// The largest datagram it sends: the port's active MTU (a UD message is one packet).
    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// Its QKey (what its peers put in their sends to it).
    pub fn qkey(&self) -> u32 {
        self.qkey
    }

    /// The local port it runs on.
    pub fn port_num(&self) -> u8 {
        self.port_num
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        self.qp.pd()
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &Arc<CompletionQueue> {
        self.qp.send_cq()
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &Arc<CompletionQueue> {
        self.qp.recv_cq()
    }

    /// The queue pair underneath, shared: its number, capabilities and counts. Posting goes
    /// through the UD QP only.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The raw QP (see [`QueuePair::as_raw`]).
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.qp.as_raw()
    }

    /// Moves the QP to the error state, flushing everything posted.
    ///
    /// # Errors
    /// As for [`QueuePair::set_error`].
    pub fn set_error(&mut self) -> Result<()> {
        self.qp.set_error()
    }
}
