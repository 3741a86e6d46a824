//! A verbs-wing QP that a connection-manager id adopts, as `rping -q` does: an
//! [`UnconnectedQp`] (made with `ibv_create_qp`, not `rdma_create_qp`, so librdmacm never
//! sees it), handed to [`RouteResolved::adopt_qp`](crate::RouteResolved::adopt_qp) or
//! [`ConnectRequest::adopt_qp`](crate::ConnectRequest::adopt_qp), its number sent in the
//! connection parameters, and moved through its states with `rdma_init_qp_attr` and
//! `ibv_modify_qp` at the points librdmacm's rules put them:
//!
//! ```text
//! UnconnectedQp::new_reset (RESET) or UnconnectedQp::new (INIT)
//!   ─RouteResolved::adopt_qp / ConnectRequest::adopt_qp→ ClientQp / ServerQp (INIT, the CM's attributes)
//! client: connect (rdma_connect, qp_num) → CONNECT_RESPONSE → INIT → RTR → RTS → rdma_establish → Connection
//! server: accept: INIT → RTR → RTS → rdma_accept (qp_num) → ESTABLISHED → Connection
//! either: disconnect / the peer leaving → ERR (librdmacm does not touch a QP it did not make)
//! ```
//!
//! There is one QP type, made by the verbs wing; the CM only drives it. Everything about the
//! adopted QP is a [`QueuePair`]'s, and its work goes through a lane as any QP's does
//! ([`ClientQp::into_lane`](crate::ClientQp::into_lane),
//! [`ServerQp::into_lane`](crate::ServerQp::into_lane)); the lane takes receives only until
//! the connection exists.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use rdma_sys as ffi;

use crate::cm::cm_id::CmId;
use crate::cm::conn_param::ConnParam;
use crate::error::{check_ibv, check_rdma, Error, Result};
use crate::verbs::link::Link;
use crate::verbs::qp::{QueuePair, UnconnectedQp};

/// What an adopted QP asks of the connection manager: its id's events, and a disconnect that
/// moves the QP to the error state itself, since librdmacm only does that for the QP it made.
struct AdoptedLink {
    id: Arc<CmId>,
    /// The QP this link belongs to (used only through that QP, while it is alive).
    qp: AtomicPtr<ffi::ibv_qp>,
}

impl std::fmt::Debug for AdoptedLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdoptedLink").field("id", &self.id.handle()).finish()
    }
}

impl Link for AdoptedLink {
    fn destroy(&self, qp: *mut ffi::ibv_qp) -> i32 {
        // SAFETY: the QP was made by ibv_create_qp and is destroyed exactly once (QueuePair
        // calls this once); librdmacm never saw it (the id's `qp` stays NULL), so no event
        // processing uses it.
        unsafe { ffi::ibv_destroy_qp(qp) }
    }

    fn disconnect(&self) -> Result<()> {
        let qp = self.qp.load(Ordering::Acquire);
        // SAFETY: the pointer is the QP that owns this link (stored at adoption), and the QP
        // calls its link only while it is alive.
        unsafe { set_err(qp) }?;
        // The answer to the peer's disconnect: not held (see `CmLink::disconnect`).
        self.id.disconnect_now()
    }

    fn comm_established(&self) {
        // As for a QP librdmacm made: nothing to do when the CM declines.
        let _ = self.id.notify(crate::status::AsyncEventKind::CommEstablished);
    }
}

/// Moves `qp` to the error state.
///
/// # Safety
/// `qp` must be a live QP.
unsafe fn set_err(qp: *mut ffi::ibv_qp) -> Result<()> {
    // SAFETY: ibv_qp_attr is plain old data; zero is valid.
    let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
    // SAFETY: the caller passes a live QP; only the state changes, as the mask says.
    check_ibv(
        unsafe { ffi::ibv_modify_qp(qp, &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) },
        "ibv_modify_qp(ERR)",
    )
}

/// Makes `id` the driver of `qp` and moves it to INIT with the id's attributes (from RESET, or
/// INIT again: the CM's port, P_Key index and access rights replace the QP's own; receives
/// posted in INIT stay posted).
pub(crate) fn adopt(qp: UnconnectedQp, id: &Arc<CmId>) -> Result<QueuePair> {
    let ctx = qp.qp().pd().context();
    if id.verbs().map(|v| v.as_ptr()) != Some(ctx.as_raw()) {
        return Err(Error::InvalidArgument(format!(
            "the QP is on a context of device {} that is not the one of this connection's id: create its PD from the route or request (alloc_pd), so that the QP is on the id's device context",
            ctx.device_name()
        )));
    }
    let link = Arc::new(AdoptedLink { id: Arc::clone(id), qp: AtomicPtr::new(qp.qp().as_raw()) });
    let qp = qp.into_driven(link);
    // On failure the QP drops here: flushed, reaped and destroyed through the link.
    modify(id, &qp, ffi::ibv_qp_state::IBV_QPS_INIT, None, None)?;
    Ok(qp)
}

/// Moves `qp` to `state` with the attributes the CM gives for `id` (`rdma_init_qp_attr`),
/// overriding `max_dest_rd_atomic` (RTR) or `max_rd_atomic` (RTS) with `rd_atomic` when given,
/// as librdmacm does with the connection parameters for its own QPs.
/// At RTR, `min_rnr_timer` (when given) replaces the CM's 0 ([`ConnParam::min_rnr_timer`]): set
/// there, before the peer can send, it leaves no window for the CM's 655 ms.
fn modify(
    id: &CmId,
    qp: &QueuePair,
    state: ffi::ibv_qp_state::Type,
    rd_atomic: Option<u8>,
    min_rnr_timer: Option<u8>,
) -> Result<()> {
    // SAFETY: ibv_qp_attr is plain old data; zero is valid.
    let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = state;
    let mut mask = 0;
    // SAFETY: the id is valid and has a device (route resolved, or a request); attr and mask
    // are valid out-pointers.
    let ret = unsafe { ffi::rdma_init_qp_attr(id.as_raw(), &mut attr, &mut mask) };
    let what = match state {
        ffi::ibv_qp_state::IBV_QPS_INIT => ("rdma_init_qp_attr(INIT)", "ibv_modify_qp(INIT)"),
        ffi::ibv_qp_state::IBV_QPS_RTR => ("rdma_init_qp_attr(RTR)", "ibv_modify_qp(RTR)"),
        _ => ("rdma_init_qp_attr(RTS)", "ibv_modify_qp(RTS)"),
    };
    check_rdma(ret, what.0).map_err(|e| with_peer(e, id))?;
    if let Some(n) = rd_atomic {
        if state == ffi::ibv_qp_state::IBV_QPS_RTR {
            attr.max_dest_rd_atomic = n;
        } else if state == ffi::ibv_qp_state::IBV_QPS_RTS {
            attr.max_rd_atomic = n;
        }
    }
    if let (Some(code), ffi::ibv_qp_state::IBV_QPS_RTR) = (min_rnr_timer, state) {
        attr.min_rnr_timer = code;
        mask |= ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as i32;
    }
    // SAFETY: the QP is alive (borrowed); attr and mask come from the CM for this state.
    check_ibv(unsafe { ffi::ibv_modify_qp(qp.as_raw(), &mut attr, mask) }, what.1).map_err(|e| with_peer(e, id))
}

fn with_peer(e: Error, id: &CmId) -> Error {
    match id.peer_addr() {
        Some(a) => e.with_addr(a),
        None => e,
    }
}

/// The QP number the connection sends: the QP's own. A different one in `param` is refused,
/// for a user QP (its peer would talk to a QP that is not this one) and for one librdmacm made
/// (which would send its own number whatever `param` says).
pub(crate) fn qp_num_for(param: &ConnParam, qp: &QueuePair) -> Result<u32> {
    let asked = param.qp_num_value();
    if asked != 0 && asked != qp.qp_num() {
        return Err(Error::InvalidArgument(format!(
            "ConnParam::qp_num is {asked}, but the connection's QP is number {}: leave it unset (the QP's own number is sent) or set it to QueuePair::qp_num",
            qp.qp_num()
        )));
    }
    Ok(qp.qp_num())
}

/// Client, on `CONNECT_RESPONSE`: INIT (again), RTR, RTS, then `rdma_establish` (the RTU). On failure the
/// QP is moved to ERR, as librdmacm does for its own.
pub(crate) fn establish(id: &CmId, qp: &QueuePair, min_rnr_timer: Option<u8>) -> Result<()> {
    // INIT again first: before the connect, the CM gave INIT no remote access rights (it
    // knows the READ depths only now); librdmacm and `rping -q` do the same.
    let r = modify(id, qp, ffi::ibv_qp_state::IBV_QPS_INIT, None, None)
        .and_then(|()| modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTR, None, min_rnr_timer))
        .and_then(|()| modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTS, None, None))
        .and_then(|()| {
            // SAFETY: the id is valid, connecting, with no librdmacm QP (id->qp is NULL).
            check_rdma(unsafe { ffi::rdma_establish(id.as_raw()) }, "rdma_establish").map_err(|e| with_peer(e, id))
        });
    if r.is_err() {
        // SAFETY: the QP is alive (borrowed).
        let _ = unsafe { set_err(qp.as_raw()) };
    }
    r
}

/// Server, before `rdma_accept`: INIT (again), RTR and RTS with the accept's READ depths (and
/// minimum RNR timer, when given).
pub(crate) fn ready(id: &CmId, qp: &QueuePair, param: &ffi::rdma_conn_param, min_rnr_timer: Option<u8>) -> Result<()> {
    // INIT again, with the access rights the request's READ depths allow (as librdmacm does).
    modify(id, qp, ffi::ibv_qp_state::IBV_QPS_INIT, None, None)?;
    modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTR, Some(param.responder_resources), min_rnr_timer)?;
    modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTS, Some(param.initiator_depth), None)
}

/// Moves a user QP to ERR before a disconnect (librdmacm only does that for its own QPs).
pub(crate) fn to_error(qp: &QueuePair) -> Result<()> {
    // SAFETY: the QP is alive (borrowed).
    unsafe { set_err(qp.as_raw()) }
}
