//! A QP the user creates ([`UserQp`]) and the connection manager drives by hand, as
//! `rping -q` does: created with `ibv_create_qp` (not `rdma_create_qp`, so librdmacm never
//! sees it), its number sent in the connection parameters, and moved through its states with
//! `rdma_init_qp_attr` and `ibv_modify_qp` at the points librdmacm's rules put them:
//!
//! ```text
//! UserQp::new (RESET) ─RouteResolved::attach_qp / ConnectRequest::attach_qp→ ClientQp / ServerQp (INIT)
//! client: connect (rdma_connect, qp_num) → CONNECT_RESPONSE → INIT → RTR → RTS → rdma_establish → Connection
//! server: accept: INIT → RTR → RTS → rdma_accept (qp_num) → ESTABLISHED → Connection
//! either: disconnect / the peer leaving → ERR (librdmacm does not touch a QP it did not make)
//! ```
//!
//! Everything else about the QP is a [`QueuePair`]'s: the same slots hold the regions of its
//! work requests until their completions are reaped, the same bounded flush runs when it is
//! dropped, and the typestates offer receives only until the connection exists. A `UserQp`
//! itself hands out no mutable QP, so nothing is posted to it before it is attached:
//!
//! ```compile_fail
//! # fn f(mut q: rdma_cm::UserQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
//! q.qp_mut().post_recv(&[rdma_cm::RecvWr::new(&mr, 0..8)])?;
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, OnceLock};

use rdma_sys as ffi;

use crate::cm::cm_id::CmId;
use crate::cm::conn_param::ConnParam;
use crate::cm::expect::is_peer_gone;
use crate::error::{check_ibv, check_ptr, check_rdma, Error, Result};
use crate::verbs::link::Link;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::{QpInit, QueuePair};

/// What a user-created QP asks of the connection manager: its id's events (once attached), and
/// a disconnect that moves the QP to the error state itself, since librdmacm only does that for
/// the QP it made.
struct UserLink {
    id: OnceLock<Arc<CmId>>,
    /// The QP this link belongs to (set right after it is created; used only through that QP,
    /// while it is alive).
    qp: AtomicPtr<ffi::ibv_qp>,
}

impl Link for UserLink {
    fn destroy(&self, qp: *mut ffi::ibv_qp) -> i32 {
        // SAFETY: the QP was made by ibv_create_qp and is destroyed exactly once (QueuePair
        // calls this once); librdmacm never saw it (the id's `qp` stays NULL), so no event
        // processing uses it.
        unsafe { ffi::ibv_destroy_qp(qp) }
    }

    fn watch_fd(&self) -> Option<RawFd> {
        use std::os::fd::AsRawFd;
        let id = self.id.get()?;
        id.channel().is_exclusive().then(|| id.channel().as_raw_fd())
    }

    #[cfg(feature = "tokio")]
    fn watch_reactor(&self) -> Option<&crate::wait::Reactor> {
        Some(self.id.get()?.channel().reactor())
    }

    fn peer_left(&self) -> Result<bool> {
        let Some(id) = self.id.get() else { return Ok(false) };
        let me = id.handle();
        let mut left = false;
        id.channel().pump(|ev| left |= ev.id() == me && is_peer_gone(ev))?;
        Ok(left)
    }

    fn disconnect(&self) -> Result<()> {
        let qp = self.qp.load(Ordering::Acquire);
        if !qp.is_null() {
            // SAFETY: the pointer is the QP that owns this link (stored right after creation),
            // and the QP calls its link only while it is alive.
            unsafe { set_err(qp) }?;
        }
        match self.id.get() {
            Some(id) => id.disconnect(),
            None => Ok(()),
        }
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.get().and_then(|id| id.peer_addr())
    }

    fn comm_established(&self) {
        if let Some(id) = self.id.get() {
            // As for a QP librdmacm made: nothing to do when the CM declines.
            let _ = id.notify(crate::status::AsyncEventKind::CommEstablished);
        }
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

/// A queue pair the user creates on a protection domain, outside the connection manager
/// (`ibv_create_qp`, in the RESET state), for a connection to drive by hand: attach it to a
/// route ([`RouteResolved::attach_qp`](crate::RouteResolved::attach_qp)) or a request
/// ([`ConnectRequest::attach_qp`](crate::ConnectRequest::attach_qp)), which moves it to INIT,
/// and connect or accept as usual. This is `rping -q`'s way; it lets a QP be created before
/// the route exists, from a PD the application already has on the device.
///
/// The PD must be on the id's device context (allocate it from the route or request, or from
/// one of them earlier: contexts librdmacm opens are one per device).
#[derive(Debug)]
pub struct UserQp {
    qp: QueuePair,
    link: Arc<UserLink>,
}

impl std::fmt::Debug for UserLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserLink").field("attached", &self.id.get().is_some()).finish()
    }
}

impl UserQp {
    /// Creates an RC QP on `pd` with `init`'s capabilities (`ibv_create_qp`), in the RESET
    /// state; its CQs are made on the PD's context unless `init` names them.
    ///
    /// # Errors
    /// As for [`RouteResolved::create_qp`](crate::RouteResolved::create_qp), with
    /// `ibv_create_qp` as the call.
    pub fn new(pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<UserQp> {
        let link = Arc::new(UserLink { id: OnceLock::new(), qp: AtomicPtr::new(std::ptr::null_mut()) });
        let qp = QueuePair::create(
            pd,
            init,
            |attr| {
                // SAFETY: the PD and the CQs in `attr` are valid and on one context (checked by
                // QueuePair::create); attr is fully initialised.
                check_ptr(unsafe { ffi::ibv_create_qp(pd.as_raw(), attr) }, "ibv_create_qp")
            },
            Some(Arc::clone(&link) as Arc<dyn Link>),
        )?;
        link.qp.store(qp.as_raw(), Ordering::Release);
        Ok(UserQp { qp, link })
    }

    /// The QP (its number, capabilities and state).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The QP number, which the connection sends in its parameters.
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// Attaches the QP to `id` and moves it to INIT with the id's attributes.
    pub(crate) fn attach(self, id: &Arc<CmId>) -> Result<QueuePair> {
        let ctx = self.qp.pd().context();
        if id.verbs().map(|v| v.as_ptr()) != Some(ctx.as_raw()) {
            return Err(Error::InvalidArgument(format!(
                "the QP is on a context of device {} that is not the one of this connection's id: create its PD from the route or request (alloc_pd), so that the QP is on the id's device context",
                ctx.device_name()
            )));
        }
        if self.link.id.set(Arc::clone(id)).is_err() {
            return Err(Error::InvalidArgument("the QP is attached to a connection already".into()));
        }
        modify(id, &self.qp, ffi::ibv_qp_state::IBV_QPS_INIT, None)?;
        Ok(self.qp)
    }
}

/// Moves `qp` to `state` with the attributes the CM gives for `id` (`rdma_init_qp_attr`),
/// overriding `max_dest_rd_atomic` (RTR) or `max_rd_atomic` (RTS) with `rd_atomic` when given,
/// as librdmacm does with the connection parameters for its own QPs.
fn modify(id: &CmId, qp: &QueuePair, state: ffi::ibv_qp_state::Type, rd_atomic: Option<u8>) -> Result<()> {
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
pub(crate) fn establish(id: &CmId, qp: &QueuePair) -> Result<()> {
    // INIT again first: before the connect, the CM gave INIT no remote access rights (it
    // knows the READ depths only now); librdmacm and `rping -q` do the same.
    let r = modify(id, qp, ffi::ibv_qp_state::IBV_QPS_INIT, None)
        .and_then(|()| modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTR, None))
        .and_then(|()| modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTS, None))
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

/// Server, before `rdma_accept`: INIT (again), RTR and RTS with the accept's READ depths.
pub(crate) fn ready(id: &CmId, qp: &QueuePair, responder_resources: u8, initiator_depth: u8) -> Result<()> {
    // INIT again, with the access rights the request's READ depths allow (as librdmacm does).
    modify(id, qp, ffi::ibv_qp_state::IBV_QPS_INIT, None)?;
    modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTR, Some(responder_resources))?;
    modify(id, qp, ffi::ibv_qp_state::IBV_QPS_RTS, Some(initiator_depth))
}

/// Moves a user QP to ERR before a disconnect (librdmacm only does that for its own QPs).
pub(crate) fn to_error(qp: &QueuePair) -> Result<()> {
    // SAFETY: the QP is alive (borrowed).
    unsafe { set_err(qp.as_raw()) }
}
