//! Connections whose QP a [`Lane`] owns from before the connect to the disconnect:
//! [`LaneClient`] and [`LaneServer`].
//!
//! ```text
//! client: RouteResolved ─lane_qp(&mut lane)→ LaneClient ─connect(&mut lane)→ connected (LaneQp)
//! server: ConnectRequest ─lane_qp(&mut lane)→ LaneServer ─accept(&mut lane)→ connected (LaneQp)
//!                                                         └─reject(&mut lane)
//! either: Lane::peer_left (one non-blocking call), Lane::disconnect (one bounded call)
//! ```
//!
//! The QP is made by the verbs wing and adopted by the id ([`crate::cm::adopt`]), so the crate,
//! not librdmacm, moves it through INIT, RTR and RTS: receives posted on the lane before the
//! connect or accept are in place before the peer can send, and
//! [`ConnParam::min_rnr_timer`] is set at RTR, before the accept or the RTU goes out, so no
//! message of the peer's ever meets the CM's 655 ms. Until the connection is established the
//! lane takes receives only, and refuses sends, RDMA WRITEs, READs and atomics with an error
//! that says so.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
//! use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion, QpInit};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = Client::new()?.resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?.resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut lane = Lane::new(&route.context()?, 64)?;
//! let client = route.lane_qp(&mut lane, &pd, QpInit::new())?;
//! let qp = client.qp();
//! lane.post_recv(qp, RecvWr::new(MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?))?;
//! client.connect(&mut lane, &ConnParam::new().min_rnr_timer(12), t)?;
//! lane.post_send(qp, SendWr::send(MemoryRegion::new(&pd, 64, AccessFlags::empty())?, 0..64))?;
//! // ... poll; between polls, `lane.peer_left(qp)?` says whether the peer is gone ...
//! lane.disconnect(qp, t)?;
//! # Ok(()) }
//! ```
//!
//! Why here and not on the lane: connect and accept need the CM's inputs (connection
//! parameters, the event channel's waits), which the verbs wing does not know, so they are
//! methods of CM types that take the lane. What the lane asks of a connection after that
//! (the peer leaving, a disconnect) it asks through its owner's hooks
//! ([`LaneOwner`](crate::verbs::lane::LaneOwner)), so those are calls on the lane.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cm::adopt;
use crate::cm::client::{connected_event, rdma_connect_with, ready_to_send, ClientQp, RouteResolved};
use crate::cm::cm_id::CmId;
use crate::cm::conn_param::ConnParam;
use crate::cm::event_channel::{CmEventType, PrivateData};
use crate::cm::expect::{expect, expect_watching};
use crate::cm::server::{accept_on, reject, ConnectRequest, ServerQp};
use crate::error::{Error, Result};
use crate::verbs::lane::{Lane, LaneQp, Rejected};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::{QpInit, QueuePair, UnconnectedQp};

/// What a lane owns of a connection it took before the connect or accept: the adopted QP and
/// the id.
pub(crate) struct LaneConn {
    // Dropped first (after Drop::drop disconnects): the QP holds its own Arc of the id.
    pub(crate) qp: QueuePair,
    pub(crate) id: Arc<CmId>,
    /// The connection is established: sends are taken, and the drop disconnects.
    pub(crate) established: bool,
    /// This side disconnected (or answered the peer's).
    pub(crate) disconnected: bool,
}

impl Drop for LaneConn {
    fn drop(&mut self) {
        if self.established && !self.disconnected && !self.qp.peer_left() {
            // Best effort, as a Connection's drop: the peer learns we left.
            let _ = adopt::to_error(&self.qp);
            let _ = self.id.disconnect();
        }
    }
}

/// Hands the adopted QP `qp` of `id` to `lane`, receives only until the connection is
/// established; with a refusal, the two back when the lane gave them back (boxed: a refusal
/// is rare, and a QP is large).
#[allow(clippy::type_complexity)]
fn attach(
    lane: &mut Lane,
    id: Arc<CmId>,
    qp: QueuePair,
) -> std::result::Result<LaneQp, Box<(Error, Option<(Arc<CmId>, QueuePair)>)>> {
    let conn = LaneConn { qp, id, established: false, disconnected: false };
    lane.attach(conn).map_err(|r| {
        let (e, back) = r.into_parts();
        let back = back.map(|c| {
            // Taken apart without its Drop, which does nothing for a connection never made.
            let c = std::mem::ManuallyDrop::new(c);
            // SAFETY: `c` is never dropped (ManuallyDrop) nor used after these reads, so the
            // QP and the id are each moved out exactly once and dropped once, by their new
            // owners; the other fields are bools.
            unsafe { (std::ptr::read(&c.id), std::ptr::read(&c.qp)) }
        });
        Box::new((e, back))
    })
}

/// The lane's connection of `qp`, for the connect or accept.
fn conn_of(lane: &mut Lane, qp: LaneQp) -> Result<&mut LaneConn> {
    lane.owner_mut(qp)?.downcast_mut::<LaneConn>().ok_or_else(|| {
        Error::InvalidArgument("this LaneQp's QP was not attached for a connection (LaneClient, LaneServer)".into())
    })
}

/// The refusal of a QP librdmacm made, whose RTR the crate cannot set the RNR timer at.
fn not_adopted() -> Error {
    Error::InvalidArgument(
        "a lane takes a connection's QP before the connect only when the id adopted it (RouteResolved::lane_qp, \
         ConnectRequest::lane_qp, or adopt_qp with UnconnectedQp::new_reset): librdmacm moves its own QP (create_qp) \
         to RTR inside the CM's handshake, where its receive-not-ready timer cannot be set"
            .into(),
    )
}

/// Ends the wait of `qp`'s connection on the lane: sends are taken once `r` is Ok; otherwise
/// the QP is moved to the error state (what it has posted flushes) and posts are refused.
fn settle<T>(lane: &mut Lane, qp: LaneQp, r: Result<T>) -> Result<T> {
    if r.is_err() {
        if let Ok(c) = conn_of(lane, qp) {
            let _ = adopt::to_error(&c.qp);
        }
    }
    lane.connection_done(qp, r.is_ok())?;
    r
}

impl RouteResolved {
    /// Creates the connection's QP for `lane` (on `pd`, with `init`'s capabilities and the
    /// lane's CQ), adopted by the id, and hands it to the lane before the connect: post the
    /// receives on the lane ([`LaneClient::qp`]), then [`LaneClient::connect`]. See
    /// [`crate::cm::lane_conn`].
    ///
    /// # Errors
    /// As for [`UnconnectedQp::new_reset`] and [`RouteResolved::adopt_qp`]; as for
    /// [`Lane::attach`].
    pub fn lane_qp(self, lane: &mut Lane, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<LaneClient> {
        let qp = UnconnectedQp::new_reset(pd, lane.qp_init_from(init))?;
        self.adopt_qp(qp)?.into_lane(lane).map_err(|r| r.into_parts().0)
    }
}

impl ClientQp {
    /// Hands the QP (adopted: [`RouteResolved::adopt_qp`], made with the lane's CQ) to `lane`
    /// before the connect. [`RouteResolved::lane_qp`] does it all in one step.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`], with this state given back, for a QP librdmacm made
    /// ([`RouteResolved::create_qp`]); as for [`Lane::attach`].
    pub fn into_lane(self, lane: &mut Lane) -> std::result::Result<LaneClient, Rejected<ClientQp>> {
        if !self.user {
            return Err(Rejected::with(not_adopted(), Some(self)));
        }
        match attach(lane, self.id, self.qp) {
            Ok(qp) => Ok(LaneClient { qp }),
            Err(refused) => {
                let (e, back) = *refused;
                Err(Rejected::with(e, back.map(|(id, qp)| ClientQp { id, qp, user: true })))
            }
        }
    }
}

/// A client connection whose QP a lane owns, not connected yet: post receives on the lane
/// ([`LaneClient::qp`]), then [`LaneClient::connect`].
#[derive(Debug)]
pub struct LaneClient {
    qp: LaneQp,
}

impl LaneClient {
    /// The QP's handle on the lane: it takes receives now, sends once connected.
    pub fn qp(&self) -> LaneQp {
        self.qp
    }

    /// Connects (`rdma_connect`) and waits for the server's answer, all within `timeout`,
    /// then moves the QP to RTR (with [`ConnParam::min_rnr_timer`], when set) and RTS and
    /// completes the handshake (`rdma_establish`). On iWARP the kernel's CM moves the QP
    /// itself, and `rdma_connect`, which makes the TCP connection, runs on a helper thread so
    /// the timeout bounds it too. Returns the server's private data; the lane takes sends on
    /// [`LaneClient::qp`] from now on.
    ///
    /// # Errors
    /// As for [`ClientQp::connect`]. The QP is then moved to the error state (its receives
    /// flush) and stays on the lane, refusing posts, until [`Lane::remove`] or
    /// [`Lane::disconnect`].
    pub fn connect(self, lane: &mut Lane, param: &ConnParam, timeout: Duration) -> Result<PrivateData> {
        let r = conn_of(lane, self.qp).and_then(|c| c.connect(param, timeout));
        settle(lane, self.qp, r)
    }
}

impl LaneConn {
    fn connect(&mut self, param: &ConnParam, timeout: Duration) -> Result<PrivateData> {
        let start = Instant::now();
        let _expecting = self.id.channel().expecting(self.id.handle());
        let qp_num = adopt::qp_num_for(param, &self.qp)?;
        if self.id.is_iwarp() {
            connect_off_thread(&self.id, param, qp_num, timeout)?;
        } else {
            rdma_connect_with(&self.id, param, qp_num, false)?;
        }
        let left = timeout.saturating_sub(start.elapsed());
        let ev = expect(&self.id, connected_event(&self.id, true), "rdma_connect", left)?;
        ready_to_send(&self.id, &self.qp, true, param.min_rnr_timer_value())?;
        self.qp.set_connected();
        self.established = true;
        Ok(*ev.private_data())
    }

    fn accept(&mut self, asked: (u8, u8), param: &ConnParam, timeout: Duration) -> Result<()> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        accept_on(&self.id, &self.qp, true, asked, param)?;
        // The device's events are read meanwhile: a COMM_EST (the client's first message came
        // before the CM's RTU) is answered, so ESTABLISHED is not held up.
        let ctx = self.qp.pd().context().clone();
        expect_watching(&self.id, CmEventType::Established, "rdma_accept", timeout, Some(&ctx))?;
        self.qp.set_connected();
        self.established = true;
        Ok(())
    }
}

/// `rdma_connect` on a helper thread that holds the id for the call (on iWARP it makes the TCP
/// connection and blocks until TCP gives up, about two minutes when nobody answers), waited
/// for up to `timeout`. When the time passes first, the thread keeps its handle of the id until
/// the call returns. No thread to be had: the call, unbounded, here.
fn connect_off_thread(id: &Arc<CmId>, param: &ConnParam, qp_num: u32, timeout: Duration) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let (held, param_copy) = (Arc::clone(id), *param);
    let spawned = std::thread::Builder::new().name("rdma_connect (iWARP)".into()).spawn(move || {
        let _ = tx.send(rdma_connect_with(&held, &param_copy, qp_num, false));
    });
    if spawned.is_err() {
        return rdma_connect_with(id, param, qp_num, false);
    }
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Error::Timeout {
            op: "rdma_connect",
            timeout,
            addr: id.peer_addr(),
            hint: Some("iWARP's TCP connect, made inside rdma_connect, got no answer: is the peer running and reachable over RDMA (the address of its RDMA netdev; `ip route get`)?"),
        }),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Err(Error::call("rdma_connect (its helper thread panicked)", libc::EIO, None))
        }
    }
}

impl ConnectRequest {
    /// Creates the connection's QP for `lane` (on `pd`, with `init`'s capabilities and the
    /// lane's CQ), adopted by the request's id, and hands it to the lane before the accept:
    /// post the receives on the lane ([`LaneServer::qp`]), then [`LaneServer::accept`]. See
    /// [`crate::cm::lane_conn`].
    ///
    /// # Errors
    /// As for [`UnconnectedQp::new_reset`] and [`ConnectRequest::adopt_qp`]; as for
    /// [`Lane::attach`]. The request is dropped (the peer rejected) on error.
    pub fn lane_qp(self, lane: &mut Lane, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<LaneServer> {
        let qp = UnconnectedQp::new_reset(pd, lane.qp_init_from(init))?;
        self.adopt_qp(qp)?.into_lane(lane).map_err(|r| r.into_parts().0)
    }
}

impl ServerQp {
    /// Hands the QP (adopted: [`ConnectRequest::adopt_qp`], made with the lane's CQ) to `lane`
    /// before the accept. [`ConnectRequest::lane_qp`] does it all in one step.
    ///
    /// # Errors
    /// As for [`ClientQp::into_lane`].
    pub fn into_lane(self, lane: &mut Lane) -> std::result::Result<LaneServer, Rejected<ServerQp>> {
        if !self.user {
            return Err(Rejected::with(not_adopted(), Some(self)));
        }
        let (asked, private_data) = (self.asked, self.private_data);
        match attach(lane, self.id, self.qp) {
            Ok(qp) => Ok(LaneServer { qp, asked }),
            Err(refused) => {
                let (e, back) = *refused;
                Err(Rejected::with(e, back.map(|(id, qp)| ServerQp { id, qp, private_data, user: true, asked })))
            }
        }
    }
}

/// A connection request whose QP a lane owns, not accepted yet: post receives on the lane
/// ([`LaneServer::qp`]), then [`LaneServer::accept`] (or reject).
#[derive(Debug)]
pub struct LaneServer {
    qp: LaneQp,
    /// The request's READ depths, this side's view (see `ServerQp::asked`).
    asked: (u8, u8),
}

impl LaneServer {
    /// The QP's handle on the lane: it takes receives now, sends once accepted.
    pub fn qp(&self) -> LaneQp {
        self.qp
    }

    /// Accepts: moves the QP to RTR (with [`ConnParam::min_rnr_timer`], when set) and RTS,
    /// then `rdma_accept`, and waits up to `timeout` for `ESTABLISHED`. The receives posted
    /// on the lane before this are in place before the client can send. The lane takes sends
    /// on [`LaneServer::qp`] from now on.
    ///
    /// # Errors
    /// As for [`ServerQp::accept`]. The QP is then moved to the error state (its receives
    /// flush) and stays on the lane, refusing posts, until [`Lane::remove`] or
    /// [`Lane::disconnect`].
    pub fn accept(self, lane: &mut Lane, param: &ConnParam, timeout: Duration) -> Result<()> {
        let r = conn_of(lane, self.qp).and_then(|c| c.accept(self.asked, param, timeout));
        settle(lane, self.qp, r)
    }

    /// Rejects the request with `private_data` (at most 148 bytes) and removes its QP from the
    /// lane ([`Lane::remove`]: what was posted on it is flushed and released).
    ///
    /// # Errors
    /// As for [`ConnectRequest::reject`].
    pub fn reject(self, lane: &mut Lane, private_data: &[u8]) -> Result<()> {
        let r = conn_of(lane, self.qp).and_then(|c| reject(&c.id, private_data));
        lane.remove(self.qp)?;
        r
    }
}
