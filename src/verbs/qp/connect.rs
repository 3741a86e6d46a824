//! Verbs without the connection manager: an RC QP made on a protection domain alone
//! ([`UnconnectedQp`], `ibv_create_qp`, moved to INIT at once) and connected from the peer's
//! [`PeerInfo`] (QP number, PSN, LID or GID), exchanged by any means: a TCP socket as rdma-core's
//! `ibv_rc_pingpong` does, a file, a channel between two threads.
//!
//! ```no_run
//! use rdma_cm::verbs::lane::Lane;
//! use rdma_cm::{ProtectionDomain, VerbsContext};
//! use rdma_cm::verbs::peer::PeerInfo;
//! use rdma_cm::verbs::qp::{RcParams, UnconnectedQp};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let ctx = VerbsContext::open("rxe0")?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let mut lane = Lane::new(&ctx, 64)?;
//! let q = UnconnectedQp::new(&pd, lane.qp_init(), RcParams::new())?; // completes on the lane's CQ
//! let wire = q.local().to_wire()?; // send it to the peer (over TCP, as ibv_rc_pingpong does)
//! # let theirs = wire;
//! let qp = q.connect(&PeerInfo::from_wire(&theirs)?)?; // the peer's answer: INIT → RTR → RTS
//! let qp = lane.attach(qp)?; // from now on, post and wait on the lane
//! # let _ = qp;
//! # Ok(()) }
//! ```
//!
//! ```text
//! UnconnectedQp::new(pd, init, RcParams)   ibv_create_qp (RESET), then INIT (port, access)
//!   │ local() → PeerInfo                  (send it to the peer; receive the peer's)
//!   │ connect(&peer)                      INIT → RTR (path MTU, dest QPN, rq PSN, address)
//!   ▼                                          → RTS (sq PSN, timeout, retries)
//! QueuePair → Lane::attach                sends, receives, RDMA WRITE/READ, atomics, waits
//!
//! UnconnectedQp::new_reset(pd, init)       ibv_create_qp (RESET), for an id to adopt
//!   │ RouteResolved::adopt_qp / ConnectRequest::adopt_qp (either kind of UnconnectedQp)
//!   ▼                                     the CM's INIT, then RTR and RTS at its events
//! ClientQp / ServerQp → Connection        (crate::cm::adopt)
//! ```
//!
//! The rule of the CM's typestates holds here too: **no send before RTS**. An
//! [`UnconnectedQp`] posts nothing; [`UnconnectedQp::connect`] hands back the [`QueuePair`] in
//! RTS, which a lane then takes.
//!
//! Nothing checks a peer's info but the peer: a QP number that names no QP, or a PSN off by
//! one, is accepted by RTR and RTS, and shows as the first send's failed completion (RETRY_EXC_ERR
//! after `timeout` × `retry_count`: about half a second with the defaults), never a hang of a
//! bounded wait. What can be checked before any call is: 24-bit ranges, a LID or a GID, a GID
//! on RoCE, the local GID index, the MTU against the port; each error says which.
//!
//! A QP connected this way has no connection manager behind it: nothing tells it the peer left
//! (a send then fails with RETRY_EXC_ERR), and dropping it moves it to the error state, reaps the
//! flush within a bound and destroys it, as for any [`QueuePair`].
//!
//! The same type is the QP a connection-manager id adopts (`RouteResolved::adopt_qp`,
//! `ConnectRequest::adopt_qp`, as `rping -q` creates its own QP): the verbs wing makes it, the
//! CM only drives it. [`UnconnectedQp::new_reset`] makes one in RESET, with no port or address
//! of its own, for that (the CM gives INIT's attributes); one from [`UnconnectedQp::new`] is
//! adopted too, INIT again with the CM's attributes. The CM drives it through a link the
//! verbs wing knows only as a trait (`verbs/link.rs`).

use std::sync::Arc;
use std::{fmt, mem};

use rdma_sys as ffi;

use crate::error::{check_ibv, check_ptr, Error, Result};
use crate::verbs::device::Transport;
use crate::verbs::link::Link;
use crate::verbs::mr::AccessFlags;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::peer::{PeerInfo, MAX_24};
use crate::verbs::port::{LinkLayer, PortInfo};

use super::{QpInit, QueuePair};

/// How a verbs-only RC QP runs: its port, the local GID it sends from, the path MTU, its
/// first PSN, and the transport's timers. The defaults are `ibv_rc_pingpong`'s: port 1, no
/// GID (InfiniBand within one subnet; RoCE needs [`RcParams::gid_index`]), MTU 1024, service
/// level 0, a random PSN, ACK timeout 14 (67 ms), 7 retries, 7 RNR retries ("forever"),
/// minimum RNR timer 12 (0.64 ms), one RDMA READ or atomic outstanding each way; and access
/// rights for the peer to WRITE and READ this side's remotely accessible regions.
#[derive(Debug, Clone)]
pub struct RcParams {
    pub(crate) port: u8,
    pub(crate) gid_index: Option<u8>,
    pub(crate) mtu: u32,
    pub(crate) sl: u8,
    pub(crate) psn: Option<u32>,
    pub(crate) timeout: u8,
    pub(crate) retry_count: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) rd_atomic: u8,
    pub(crate) access: AccessFlags,
}

impl Default for RcParams {
    fn default() -> Self {
        RcParams {
            port: 1,
            gid_index: None,
            mtu: 1024,
            sl: 0,
            psn: None,
            timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            rd_atomic: 1,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        }
    }
}

impl RcParams {
    /// The defaults (see [`RcParams`]).
    pub fn new() -> RcParams {
        RcParams::default()
    }
    /// The device port (from 1; `ibv_rc_pingpong -i`).
    pub fn port(mut self, port: u8) -> Self {
        self.port = port;
        self
    }
    /// The local GID table entry the QP sends from (`-g`; perftest's `-x`). Needed on RoCE,
    /// where ports are addressed by GID: on rxe, the IPv4-mapped entry (index 1 on a netdev
    /// with one IPv4 address; see [`VerbsContext::gid_table`](crate::VerbsContext::gid_table)).
    pub fn gid_index(mut self, index: u8) -> Self {
        self.gid_index = Some(index);
        self
    }
    /// The path MTU in bytes: 256, 512, 1024, 2048 or 4096 (`-m`); at most the port's MTU.
    /// Both sides must use the same.
    pub fn mtu(mut self, bytes: u32) -> Self {
        self.mtu = bytes;
        self
    }
    /// The service level (`-l`; InfiniBand).
    pub fn sl(mut self, sl: u8) -> Self {
        self.sl = sl;
        self
    }
    /// The first PSN this side sends (24 bits; random by default). The peer's RTR needs it
    /// ([`UnconnectedQp::local`] carries it).
    pub fn psn(mut self, psn: u32) -> Self {
        self.psn = Some(psn);
        self
    }
    /// The ACK timeout exponent: 4.096 µs × 2^`t` (0: wait forever; 14: 67 ms).
    pub fn timeout(mut self, t: u8) -> Self {
        self.timeout = t;
        self
    }
    /// Retries after an ACK timeout before a send fails with RETRY_EXC_ERR (0..=7).
    pub fn retry_count(mut self, n: u8) -> Self {
        self.retry_count = n;
        self
    }
    /// Retries after a receiver-not-ready NAK (0..=7; 7 is "forever").
    pub fn rnr_retry(mut self, n: u8) -> Self {
        self.rnr_retry = n;
        self
    }
    /// What the peer may do to this side's regions (`qp_access_flags`): by default
    /// `REMOTE_WRITE | REMOTE_READ`; add `REMOTE_ATOMIC` for atomics.
    pub fn access(mut self, access: AccessFlags) -> Self {
        self.access = access;
        self
    }
    /// RDMA READs and atomics outstanding at once, each way (`max_rd_atomic`,
    /// `max_dest_rd_atomic`; 1 by default).
    pub fn rd_atomic(mut self, n: u8) -> Self {
        self.rd_atomic = n;
        self
    }
}

/// An `enum ibv_mtu` from bytes.
fn mtu_enum(bytes: u32) -> Option<ffi::ibv_mtu::Type> {
    Some(match bytes {
        256 => ffi::ibv_mtu::IBV_MTU_256,
        512 => ffi::ibv_mtu::IBV_MTU_512,
        1024 => ffi::ibv_mtu::IBV_MTU_1024,
        2048 => ffi::ibv_mtu::IBV_MTU_2048,
        4096 => ffi::ibv_mtu::IBV_MTU_4096,
        _ => return None,
    })
}

/// A random 24-bit PSN (`getrandom`; the clock if that fails).
pub(crate) fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: `b` is valid for writes of its 4 bytes, the length passed.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let v = if n == 4 {
        u32::from_ne_bytes(b)
    } else {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0x5eed, |d| d.subsec_nanos())
    };
    v & MAX_24
}

/// Moves `qp` to the state in `attr` with `mask`.
fn modify(qp: &QueuePair, attr: &mut ffi::ibv_qp_attr, mask: u32, op: &'static str) -> Result<()> {
    // SAFETY: the QP is alive (borrowed); `attr` is a valid attribute set, and `mask` names
    // only fields the caller set.
    check_ibv(unsafe { ffi::ibv_modify_qp(qp.as_raw(), attr, mask as i32) }, op)
}

/// An RC queue pair made without the connection manager, in the INIT state: it takes
/// receives, and [`UnconnectedQp::connect`] with the peer's [`PeerInfo`] turns it into a
/// [`QueuePair`] that can send. See [`crate::verbs::qp::connect`]. Made in RESET
/// ([`UnconnectedQp::new_reset`]), it is for a connection-manager id to adopt.
pub struct UnconnectedQp {
    qp: QueuePair,
    params: RcParams,
    local: PeerInfo,
    link_layer: LinkLayer,
    /// Made by [`UnconnectedQp::new_reset`]: in RESET, with no port of its own.
    reset: bool,
}

impl fmt::Debug for UnconnectedQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnconnectedQp").field("qp", &self.qp).field("local", &self.local).finish()
    }
}

/// The largest path MTU a QP on `port` may be given: the port's maximum, or its active MTU when
/// that is larger. Soft-iWARP on kernel 6.12 reports a maximum of 256 beside an active 4096
/// (iWARP runs over TCP and uses no path MTU at all); refusing 1024 there refused every RC QP.
fn path_mtu_limit(port: &PortInfo) -> u32 {
    port.max_mtu.max(port.active_mtu)
}

impl UnconnectedQp {
    /// Creates an RC QP on `pd` with `init`'s capabilities (`ibv_create_qp`; its CQs are made
    /// on the PD's context unless `init` names them) and moves it to INIT on `params`' port
    /// with its access rights.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a port the device lacks, an MTU that is not 256..4096 or
    /// over the port's, a GID index with no entry (the message lists the valid ones), or no
    /// GID index on RoCE; as for [`UnconnectedQp::new_reset`]; [`Error::Call`] when
    /// `ibv_modify_qp(INIT)` fails.
    pub fn new(pd: &Arc<ProtectionDomain>, init: QpInit, params: RcParams) -> Result<UnconnectedQp> {
        let ctx = pd.context();
        let port = ctx.port(params.port)?;
        if mtu_enum(params.mtu).is_none() {
            return Err(Error::InvalidArgument(format!(
                "path MTU {} is not one of 256, 512, 1024, 2048, 4096",
                params.mtu
            )));
        }
        let mtu_limit = path_mtu_limit(&port);
        if params.mtu > mtu_limit {
            return Err(Error::InvalidArgument(format!(
                "path MTU {} is over the {} bytes {} port {} supports (active MTU {}; on RoCE the netdev's MTU sets it)",
                params.mtu,
                mtu_limit,
                ctx.device_name(),
                params.port,
                port.active_mtu
            )));
        }
        if let Some(p) = params.psn {
            if p > MAX_24 {
                return Err(Error::InvalidArgument(format!("PSN {p:#x} is wider than 24 bits")));
            }
        }
        let (lid, gid) = PeerInfo::local_address(ctx, params.port, params.gid_index)?;
        if port.link_layer == LinkLayer::Ethernet && params.gid_index.is_none() {
            let kind = if ctx.transport() == Transport::Iwarp { "iWARP" } else { "RoCE" };
            return Err(Error::InvalidArgument(format!(
                "{} port {} is {kind} (Ethernet link layer), where QPs are addressed by GID: give RcParams::gid_index \
                 (the entry of the address to use; `ibv_devinfo -v` lists the GID table, and on rxe index 1 is \
                 usually the IPv4-mapped one)",
                ctx.device_name(),
                params.port
            )));
        }
        let mut init = init;
        init.datagrams = false;
        let qp = QueuePair::create(
            pd,
            init,
            |attr| {
                // SAFETY: the PD and the CQs in `attr` are valid and on one context (checked by
                // QueuePair::create); attr is fully initialised.
                check_ptr(unsafe { ffi::ibv_create_qp(pd.as_raw(), attr) }, "ibv_create_qp")
            },
            None,
        )?;
        // SAFETY: ibv_qp_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = params.port;
        attr.qp_access_flags = params.access.bits();
        use ffi::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0;
        modify(&qp, &mut attr, mask, "ibv_modify_qp(INIT) of a verbs-only QP")?;
        let psn = params.psn.unwrap_or_else(random_psn);
        let local = PeerInfo { lid, qp_num: qp.qp_num(), psn, gid };
        Ok(UnconnectedQp { qp, params, local, link_layer: port.link_layer, reset: false })
    }

    /// Creates an RC QP on `pd` with `init`'s capabilities (`ibv_create_qp`; its CQs are
    /// made on the PD's context unless `init` names them) and leaves it in RESET, for a
    /// connection-manager id to adopt (`RouteResolved::adopt_qp`, `ConnectRequest::adopt_qp`),
    /// which moves it to INIT with the CM's port, P_Key and access rights. This is `rping -q`'s
    /// way: the QP exists before the route. The PD must be on the id's device context.
    ///
    /// [`UnconnectedQp::connect`] refuses a QP in RESET; its [`UnconnectedQp::local`] carries its number
    /// only (the CM's handshake exchanges the rest).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for empty queues, or CQs or an SRQ of another device or PD;
    /// [`Error::Call`] when `ibv_create_qp` fails (with the device-limits hint).
    pub fn new_reset(pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<UnconnectedQp> {
        let mut init = init;
        init.datagrams = false;
        let qp = QueuePair::create(
            pd,
            init,
            |attr| {
                // SAFETY: the PD and the CQs in `attr` are valid and on one context (checked by
                // QueuePair::create); attr is fully initialised.
                check_ptr(unsafe { ffi::ibv_create_qp(pd.as_raw(), attr) }, "ibv_create_qp")
            },
            None,
        )?;
        let local = PeerInfo { lid: 0, qp_num: qp.qp_num(), psn: 0, gid: Default::default() };
        Ok(UnconnectedQp { qp, params: RcParams::default(), local, link_layer: LinkLayer::Unspecified, reset: true })
    }

    /// Hands the QP to whoever drives it from now on (a connection-manager id): `link` is
    /// what the QP asks of it (destroy, disconnect, the peer leaving). The caller moves it on.
    pub(crate) fn into_driven(self, link: Arc<dyn Link>) -> QueuePair {
        let mut qp = self.qp;
        qp.set_link(link);
        qp
    }

    /// What the peer needs to connect to this QP: its LID, QP number, first PSN and GID.
    pub fn local(&self) -> PeerInfo {
        self.local
    }

    /// The QP, shared: its number, capabilities, state and counts. Nothing is posted through
    /// it: sends wait for [`UnconnectedQp::connect`].
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// Connects the QP to `peer`: INIT → RTR (path MTU, the peer's QP number and PSN, its GID
    /// or LID) → RTS (this side's PSN, timeout, retries), and hands back the QP, which can
    /// now send. The peer must have posted receives before this side sends, and must connect
    /// its own QP with this side's [`UnconnectedQp::local`].
    ///
    /// On failure the QP is dropped (its receives flushed and released).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a QP made by [`UnconnectedQp::new_reset`], for info no QP
    /// can have (see [`PeerInfo::check`]), a peer without a GID on RoCE, or a peer with a GID
    /// while this QP has no GID index; [`Error::Unsupported`] on an iWARP device, whose QPs are
    /// connected only through the connection manager (a CM id can adopt this QP instead);
    /// [`Error::Call`] when `ibv_modify_qp` refuses RTR or RTS (EINVAL at RTR: usually the GID
    /// index, the MTU or the peer's address).
    pub fn connect(self, peer: &PeerInfo) -> Result<QueuePair> {
        if self.reset {
            return Err(Error::InvalidArgument(
                "this QP was made in RESET for a connection-manager id to adopt (UnconnectedQp::new_reset): \
                 to connect it from a PeerInfo, create it with UnconnectedQp::new and RcParams"
                    .into(),
            ));
        }
        peer.check()?;
        let p = &self.params;
        if !peer.has_gid() && self.link_layer == LinkLayer::Ethernet {
            return Err(Error::InvalidArgument(
                "the peer gave no GID, and this port is on Ethernet (RoCE), where QPs are addressed by GID: run the peer with a GID \
                 index (rdma-core's pingpong tools: -g)"
                    .into(),
            ));
        }
        if peer.has_gid() && p.gid_index.is_none() {
            return Err(Error::InvalidArgument(
                "the peer gave a GID (it is on RoCE or another subnet), but this QP has no GID index to send from: \
                 set RcParams::gid_index"
                    .into(),
            ));
        }
        // The info is checked first, so that bad info is named as such on every device.
        let ctx = self.qp.pd().context();
        if ctx.transport() == Transport::Iwarp {
            return Err(Error::Unsupported {
                what: "connecting a QP without the connection manager",
                why: format!(
                    "{} is an iWARP device: its QPs run over TCP connections that only the connection manager \
                     makes; let a CM id adopt this QP (RouteResolved::adopt_qp, ConnectRequest::adopt_qp) or \
                     connect through Client/Server",
                    ctx.device_name()
                ),
            });
        }
        use ffi::ibv_qp_attr_mask as m;
        // SAFETY: ibv_qp_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = mtu_enum(p.mtu).unwrap_or(ffi::ibv_mtu::IBV_MTU_1024);
        attr.dest_qp_num = peer.qp_num;
        attr.rq_psn = peer.psn;
        attr.max_dest_rd_atomic = p.rd_atomic;
        attr.min_rnr_timer = p.min_rnr_timer;
        attr.ah_attr = peer.ah_attr(p.port, p.gid_index, p.sl);
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        modify(&self.qp, &mut attr, mask, "ibv_modify_qp(RTR) with the peer's info")?;
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = p.timeout;
        attr.retry_cnt = p.retry_count;
        attr.rnr_retry = p.rnr_retry;
        attr.sq_psn = self.local.psn;
        attr.max_rd_atomic = p.rd_atomic;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        modify(&self.qp, &mut attr, mask, "ibv_modify_qp(RTS) of a verbs-only QP")?;
        let mut qp = self.qp;
        qp.set_connected();
        Ok(qp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::port::PortState;

    fn port(max_mtu: u32, active_mtu: u32) -> PortInfo {
        PortInfo {
            port: 1,
            state: PortState::Active,
            phys_state: 5,
            link_layer: LinkLayer::Ethernet,
            max_mtu,
            active_mtu,
            lid: 0,
            gid_table_len: 16,
            max_msg_size: 1 << 31,
        }
    }

    #[test]
    fn the_path_mtu_limit_is_the_larger_of_the_ports_maximum_and_active_mtu() {
        // rxe, mlx5: the maximum bounds it.
        assert_eq!(path_mtu_limit(&port(4096, 1024)), 4096);
        // siw on 6.12: maximum 256 beside an active 4096; 1024 must not be refused.
        assert_eq!(path_mtu_limit(&port(256, 4096)), 4096);
        assert!(1024 <= path_mtu_limit(&port(256, 4096)));
        assert_eq!(path_mtu_limit(&port(1024, 1024)), 1024);
    }
}

/// What a QP's own path knows of it being in the error state: what a [`Lane`] that takes the
/// QP over carries on (`Lane::attach`), so that its posts are refused with the cause.
///
/// [`Lane`]: crate::verbs::lane::Lane
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KnownError {
    /// Its owner moved it there ([`QueuePair::set_error`]).
    SetError,
    /// Its peer left (or the device went away), or this side disconnected.
    Disconnected,
}

impl QueuePair {
    /// Whether, and why, this QP's own path knows it to be in the error state.
    pub(crate) fn known_error(&self) -> Option<KnownError> {
        if self.errored {
            return Some(KnownError::SetError);
        }
        (self.peer_left || self.closing).then_some(KnownError::Disconnected)
    }
}
