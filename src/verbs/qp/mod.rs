//! [`QueuePair`]: an owned RC (or, under a [`UdQp`](crate::verbs::ud::UdQp), UD) queue pair: its creation
//! ([`QpInit`]), capabilities, state and teardown. Its work is posted and reaped through a
//! [`Lane`](crate::verbs::lane::Lane), which takes the QP by value
//! ([`Lane::attach`](crate::verbs::lane::Lane::attach), or a connection step that puts it there)
//! and owns the regions of its work in flight: see [`crate::verbs::lane`].
//!
//! # Completion queues and shared receive queues
//!
//! [`QpInit`] names the QP's CQs (a lane's: [`Lane::qp_init`](crate::verbs::lane::Lane::qp_init))
//! and, optionally, its [`SharedReceiveQueue`]. A CQ counts what the queues it serves may have
//! outstanding: any other CQ than a lane's refuses a QP that could make it overrun, and a lane
//! grows its own when it attaches a QP it has no room for.
//!
//! # Raw posts
//!
//! A lane never sets bit 62 of a `wr_id`. Work posted through [`QueuePair::as_raw`] (or
//! [`Lane::qp_as_raw`](crate::verbs::lane::Lane::qp_as_raw)) must set it, and its memory is the
//! caller's to keep alive until its completion: a completion with that bit is not the lane's,
//! retires nothing, and is discarded by the lane's poll.
//!
//! # Leaks, panics and drop
//!
//! `mem::forget` on a QP leaks it and whatever its lane left posted: safe. Dropping a QP (also
//! during unwinding) destroys it, and only then releases the regions its lane left posted
//! (`Parked`); if the destroy fails, they are leaked rather than released, since the device may
//! still use them.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::{fmt, mem};

use rdma_sys as ffi;

use crate::error::{check_ibv, Error, Result};
use crate::verbs::ah::AddressHandle;
use crate::verbs::cq::CompletionQueue;
use crate::verbs::hold::Hold;
use crate::verbs::link::Link;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::srq::SharedReceiveQueue;
use crate::verbs::wr::{check_sge_device, check_sge_request};
use crate::wait::lock;

pub mod connect;

pub use connect::{RcParams, UnconnectedQp};

/// Queue-pair capabilities. Defaults follow the seed program: 16 send and 16 receive work
/// requests, one scatter/gather entry each, and 64 bytes of inline data.
#[derive(Debug, Clone)]
pub struct QpInit {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_send_sge: u32,
    pub(crate) max_recv_sge: u32,
    pub(crate) max_inline_data: u32,
    pub(crate) send_cq: Option<Arc<CompletionQueue>>,
    pub(crate) recv_cq: Option<Arc<CompletionQueue>>,
    pub(crate) srq: Option<SharedReceiveQueue>,
    /// A UD QP (set by the UD layer only): `IBV_QPT_UD`, and a send ring that holds address
    /// handles.
    pub(crate) datagrams: bool,
    /// Create the QP with `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB` (set by the multicast layer
    /// only): it does not receive the multicast datagrams it sends itself.
    pub(crate) block_self_mcast_lb: bool,
}

impl Default for QpInit {
    fn default() -> Self {
        QpInit {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
            send_cq: None,
            recv_cq: None,
            srq: None,
            datagrams: false,
            block_self_mcast_lb: false,
        }
    }
}

impl QpInit {
    /// Defaults (16/16 work requests, 64 bytes inline).
    pub fn new() -> QpInit {
        QpInit::default()
    }
    /// Send queue depth.
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.max_send_wr = n;
        self
    }
    /// Receive queue depth (ignored with an SRQ).
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.max_recv_wr = n;
        self
    }
    /// The most pieces a send-queue work request may name
    /// ([`lane::SendWr::send_sg`](crate::verbs::lane::SendWr::send_sg),
    /// [`write_sg`](crate::verbs::lane::SendWr::write_sg),
    /// [`read_sg`](crate::verbs::lane::SendWr::read_sg)): 1 (the default) to
    /// [`MAX_SGE`](crate::MAX_SGE), and at most the device's `max_sge`
    /// ([`DeviceLimits`](crate::DeviceLimits)); checked when the QP is created.
    pub fn max_send_sge(mut self, n: u32) -> Self {
        self.max_send_sge = n;
        self
    }
    /// The most pieces a receive may name ([`lane::RecvWr::scatter`](crate::verbs::lane::RecvWr::scatter),
    /// a receive scattered over several ranges of one region; a post of more is refused): 1
    /// (the default) to [`MAX_SGE`](crate::MAX_SGE), and at most the device's `max_sge`, as for
    /// [`QpInit::max_send_sge`]. Ignored with an SRQ, whose own limit is set when it is made
    /// ([`Lane::create_srq_with_sge`](crate::verbs::lane::Lane::create_srq_with_sge),
    /// [`SharedReceiveQueue::with_sge`]).
    pub fn max_recv_sge(mut self, n: u32) -> Self {
        self.max_recv_sge = n;
        self
    }
    /// Largest inline send, in bytes.
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.max_inline_data = n;
        self
    }
    /// Uses `cq` for send completions instead of creating one. It may be the receive CQ, and
    /// it may serve other QPs too, as long as it is deep enough for all their queues; it must
    /// be on the QP's device.
    pub fn send_cq(mut self, cq: Arc<CompletionQueue>) -> Self {
        self.send_cq = Some(cq);
        self
    }
    /// Uses `cq` for receive completions instead of creating one (same conditions as
    /// [`QpInit::send_cq`]).
    pub fn recv_cq(mut self, cq: Arc<CompletionQueue>) -> Self {
        self.recv_cq = Some(cq);
        self
    }
    /// Takes receives from `srq` instead of a receive queue of its own. The SRQ must be on
    /// the QP's protection domain.
    pub fn srq(mut self, srq: &SharedReceiveQueue) -> Self {
        self.srq = Some(srq.clone());
        self
    }
}

/// What a lane hands its QP when it goes: the regions (and a UD QP's address handles) of work
/// still posted, released once `ibv_destroy_qp` succeeds and leaked when it fails, since until
/// then the device may use them. Its address also names the QP to a memory window bound
/// through it ([`BoundWindow`](crate::verbs::mw::BoundWindow)).
#[derive(Default)]
pub(crate) struct Parked {
    pub(crate) regions: Vec<Hold>,
    pub(crate) ahs: Vec<Arc<AddressHandle>>,
}

/// An owned RC queue pair.
///
/// One that can send exists only once the QP is connected: the connection typestates create
/// one, each consuming the state that owns the id, and so does [`UnconnectedQp::connect`]
/// without the connection manager (consuming the QP in INIT). An id has at most one QP (pinned
/// to its error, E0382, by `tests/ui/two_qps_on_one_id.rs`):
///
/// ```compile_fail,E0382
/// # fn f(route: rdma_cm::RouteResolved, pd: std::sync::Arc<rdma_cm::ProtectionDomain>) -> rdma_cm::Result<()> {
/// let a = route.create_qp(&pd, rdma_cm::QpInit::new())?;
/// let b = route.create_qp(&pd, rdma_cm::QpInit::new())?; // `route` was moved
/// # Ok(()) }
/// ```
pub struct QueuePair {
    raw: NonNull<ffi::ibv_qp>,
    qp_num: u32,
    max_inline: u32,
    /// The most pieces a send, a receive and an RDMA READ may name (what the rings were sized
    /// for; 0 receive pieces on an SRQ).
    max_send_sge: u32,
    max_recv_sge: u32,
    max_read_sge: u32,
    /// The depths of its queues as created (0 receives on an SRQ).
    send_depth: u32,
    recv_depth: u32,
    /// Reserved capacity on each CQ (released on drop).
    send_reserved: u64,
    recv_reserved: u64,
    /// The connection is established: sends may be posted, and waits may watch the link.
    connected: bool,
    /// The peer left (or the device went away); the QP was moved to error.
    peer_left: bool,
    /// The caller moved the QP to the error state ([`QueuePair::set_error`]): nothing posted
    /// from then on can run, and rxe never flushes a receive posted then (it would stay held,
    /// and its wait time out), so posts are refused.
    errored: bool,
    /// This side disconnected (`rdma_disconnect` moved the QP to the error state): not an error
    /// a wait that runs out should report.
    closing: bool,
    /// What its lane left posted when it went (see [`Parked`]).
    parked: Arc<Mutex<Parked>>,
    /// Its place in the context's registry of async events (left before the QP is destroyed).
    async_reg: crate::verbs::hub::Registration,
    // Field order is drop order after Drop::drop: the link (id), CQs, SRQ and PD outlive the
    // QP, which Drop::drop destroys first.
    link: Option<Arc<dyn Link>>,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    srq: Option<SharedReceiveQueue>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the QP is owned uniquely; changing its state takes &mut self; what its lane left
// posted is behind a mutex and holds Send + Sync handles. Verbs on a QP may be called from any
// thread.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Creates an RC QP on `pd` with `init`'s capabilities. `create` makes the QP from the
    /// prepared attributes (the connection manager's `rdma_create_qp`, under its lock), and
    /// `link` is what the QP asks of its creator afterwards.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for empty queues, CQs or an SRQ of another device or PD, or
    /// CQs too shallow for what they would serve; what `create` returns.
    pub(crate) fn create(
        pd: &Arc<ProtectionDomain>,
        init: QpInit,
        create: impl FnOnce(&mut ffi::ibv_qp_init_attr) -> Result<NonNull<ffi::ibv_qp>>,
        link: Option<Arc<dyn Link>>,
    ) -> Result<QueuePair> {
        let on_srq = init.srq.is_some();
        let recv_depth = if on_srq { 0 } else { init.max_recv_wr };
        if init.max_send_wr == 0 || (!on_srq && init.max_recv_wr == 0) {
            return Err(Error::InvalidArgument("QP needs at least one send and one receive work request".into()));
        }
        let ctx = pd.context();
        let max_recv_sge = if on_srq { 0 } else { init.max_recv_sge };
        check_sge_request(init.max_send_sge, "QpInit::max_send_sge")?;
        if !on_srq {
            check_sge_request(max_recv_sge, "QpInit::max_recv_sge")?;
        }
        // The device is asked only when a queue takes more than one piece. An RDMA READ may be
        // limited to fewer pieces than other sends (`max_sge_rd`).
        let mut max_read_sge = init.max_send_sge;
        if init.max_send_sge > 1 || max_recv_sge > 1 {
            let limits = ctx.limits()?;
            let device = ctx.device_name();
            check_sge_device(init.max_send_sge, "QpInit::max_send_sge", limits.max_sge, "max_sge", &device)?;
            check_sge_device(max_recv_sge, "QpInit::max_recv_sge", limits.max_sge, "max_sge", &device)?;
            if limits.max_sge_rd > 0 {
                max_read_sge = max_read_sge.min(limits.max_sge_rd);
            }
        }
        for cq in [&init.send_cq, &init.recv_cq].into_iter().flatten() {
            if !cq.context().same_as(ctx) {
                return Err(Error::InvalidArgument(format!(
                    "the completion queue is on device {}, but the QP is on {}: a QP and its CQs must share a device context",
                    cq.context().device_name(),
                    ctx.device_name()
                )));
            }
        }
        if let Some(srq) = &init.srq {
            if !Arc::ptr_eq(srq.pd(), pd) {
                return Err(Error::InvalidArgument("the SRQ is on another protection domain than the QP".into()));
            }
        }
        let send_cq = match init.send_cq {
            Some(cq) => cq,
            None => CompletionQueue::new(ctx, init.max_send_wr)?,
        };
        let recv_cq = match init.recv_cq {
            Some(cq) => cq,
            None => {
                CompletionQueue::new(ctx, if on_srq { init.srq.as_ref().map_or(1, |s| s.depth()) } else { recv_depth })?
            }
        };
        // Reserve room on the CQs (and register the SRQ) before creating anything.
        let send_reserved = init.max_send_wr as u64;
        let recv_reserved = recv_depth as u64;
        send_cq.reserve(send_reserved)?;
        if let Err(e) = recv_cq.reserve(recv_reserved) {
            send_cq.unreserve(send_reserved);
            return Err(e);
        }
        let undo = || {
            send_cq.unreserve(send_reserved);
            recv_cq.unreserve(recv_reserved);
        };
        if let Some(srq) = &init.srq {
            if let Err(e) = recv_cq.attach_srq(srq.shared()) {
                undo();
                return Err(e);
            }
        }
        let undo = || {
            undo();
            if let Some(srq) = &init.srq {
                recv_cq.detach_srq(srq.shared());
            }
        };
        // SAFETY: ibv_qp_init_attr is plain old data; zero is a valid start.
        let mut attr: ffi::ibv_qp_init_attr = unsafe { mem::zeroed() };
        attr.send_cq = send_cq.as_raw();
        attr.recv_cq = recv_cq.as_raw();
        attr.srq = init.srq.as_ref().map_or(std::ptr::null_mut(), |s| s.as_raw());
        attr.qp_type = if init.datagrams { ffi::ibv_qp_type::IBV_QPT_UD } else { ffi::ibv_qp_type::IBV_QPT_RC };
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = init.max_send_wr;
        attr.cap.max_recv_wr = recv_depth;
        attr.cap.max_send_sge = init.max_send_sge;
        attr.cap.max_recv_sge = max_recv_sge;
        attr.cap.max_inline_data = init.max_inline_data;
        let raw = match create(&mut attr) {
            Ok(raw) => raw,
            Err(e) => {
                undo();
                return Err(e);
            }
        };
        // SAFETY: raw is a valid QP; qp_num is immutable.
        let qp_num = unsafe { (*raw.as_ptr()).qp_num };
        // The QP takes what was asked, or less if the provider says so (it may allow more: the
        // rings are sized for what was asked).
        let max_send_sge = attr.cap.max_send_sge.clamp(1, init.max_send_sge);
        let max_recv_sge = if on_srq { 0 } else { attr.cap.max_recv_sge.clamp(1, max_recv_sge) };
        let max_read_sge = max_read_sge.min(max_send_sge);
        let async_reg =
            crate::verbs::hub::Registration::new(ctx.hub(), crate::status::Subject::Qp, raw.as_ptr() as usize);
        if let Some(l) = &link {
            // COMM_EST is answered through the link (see crate::verbs::async_event).
            async_reg.events().answer_with(Arc::downgrade(l));
        }
        Ok(QueuePair {
            raw,
            qp_num,
            max_inline: attr.cap.max_inline_data,
            max_send_sge,
            max_recv_sge,
            max_read_sge,
            send_depth: init.max_send_wr,
            recv_depth,
            send_reserved,
            recv_reserved,
            // A UD QP has no connection: librdmacm moves it to RTS as it creates it.
            connected: init.datagrams,
            peer_left: false,
            errored: false,
            closing: false,
            parked: Arc::default(),
            async_reg,
            link,
            send_cq,
            recv_cq,
            srq: init.srq,
            pd: Arc::clone(pd),
        })
    }

    /// The raw QP. It stays owned by `self`. Posting to it directly bypasses the slot table:
    /// such work requests must use `wr_id`s with bit 62 clear (the crate's tag), which the
    /// polls here recognise as foreign and discard, and the memory they name is the caller's
    /// to keep alive (see the module docs).
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.raw.as_ptr()
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &Arc<CompletionQueue> {
        &self.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &Arc<CompletionQueue> {
        &self.recv_cq
    }

    /// The shared receive queue it takes receives from, if any.
    pub fn srq(&self) -> Option<&SharedReceiveQueue> {
        self.srq.as_ref()
    }

    /// The largest inline send the QP accepts.
    pub fn max_inline_data(&self) -> u32 {
        self.max_inline
    }

    /// The most pieces a send-queue work request may name ([`QpInit::max_send_sge`]).
    pub fn max_send_sge(&self) -> u32 {
        self.max_send_sge
    }

    /// The most pieces an RDMA READ may name: [`QueuePair::max_send_sge`], or less where the
    /// device limits READs further (`max_sge_rd`).
    pub fn max_read_sge(&self) -> u32 {
        self.max_read_sge
    }

    /// The most pieces a receive may name ([`QpInit::max_recv_sge`]; 0 on an SRQ, whose own
    /// limit applies).
    pub fn max_recv_sge(&self) -> u32 {
        self.max_recv_sge
    }

    /// What its lane left posted (see [`Parked`]).
    pub(crate) fn parked(&self) -> std::sync::MutexGuard<'_, Parked> {
        lock(&self.parked)
    }

    /// What a memory window bound through this QP recognises it by
    /// ([`BoundWindow`](crate::verbs::mw::BoundWindow)).
    pub(crate) fn identity(&self) -> &Arc<Mutex<Parked>> {
        &self.parked
    }

    /// The send queue's depth as created.
    pub(crate) fn send_depth(&self) -> u32 {
        self.send_depth
    }

    /// The receive queue's depth as created (0 on an SRQ).
    pub(crate) fn recv_depth(&self) -> u32 {
        self.recv_depth
    }

    /// Lets the QP react to the peer leaving (or the device going away): move it to the error
    /// state so every posted work request flushes instead of waiting forever. librdmacm does
    /// not do this on the passive side of a disconnect.
    pub(crate) fn peer_gone(&mut self) {
        if self.peer_left {
            return;
        }
        self.peer_left = true;
        // rdma_disconnect moves the QP to ERR and completes the CM handshake; set_error is
        // the fallback when the id is past that state. When this side disconnected already,
        // there is nothing to answer: the event is the end of its own disconnect.
        let disconnected = !self.closing && self.link.as_ref().is_some_and(|l| l.disconnect().is_ok());
        if !disconnected {
            let _ = self.set_error_state();
        }
    }

    /// This side disconnected: the QP is in the error state by the caller's wish.
    pub(crate) fn set_closing(&mut self) {
        self.closing = true;
    }

    /// Makes `link` what the QP asks of its driver from now on (a QP made by the verbs wing,
    /// which a connection-manager id adopts), and the one that answers its `COMM_EST`.
    pub(crate) fn set_link(&mut self, link: Arc<dyn Link>) {
        self.async_reg.events().answer_with(Arc::downgrade(&link));
        self.link = Some(link);
    }

    pub(crate) fn set_connected(&mut self) {
        self.connected = true;
    }

    /// Whether the peer disconnected (seen while waiting, or through the connection's events).
    pub fn peer_left(&self) -> bool {
        self.peer_left
    }

    /// The last asynchronous event the device reported about this QP (e.g.
    /// [`AsyncEventKind::QpFatal`](crate::verbs::async_event::AsyncEventKind::QpFatal)), after reading what is
    /// pending. See [`crate::verbs::async_event`].
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn last_async_event(&self) -> Result<Option<crate::status::AsyncEventKind>> {
        self.async_reg.refresh()?;
        Ok(self.async_reg.events().last())
    }

    /// The fatal event delivered to this QP so far (or the device's), without reading what is
    /// pending: one atomic load, for a lane's wait that looks at its members after it read the
    /// events itself.
    pub(crate) fn fatal_mark(&self) -> Option<crate::status::AsyncEventKind> {
        self.async_reg.fatal()
    }

    /// The event that made this QP unusable (a fatal QP event, or the device failing), after
    /// reading what is pending. Once there is one, waits that find nothing to reap fail with
    /// [`Error::AsyncEvent`] instead of sleeping; so they do when one of its CQs overran
    /// ([`CompletionQueue::has_error`]).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn fatal_event(&self) -> Result<Option<crate::status::AsyncEventKind>> {
        self.async_reg.refresh()?;
        Ok(self.async_reg.fatal())
    }

    /// Moves the QP to the error state, which flushes every outstanding work request. From
    /// then on posts are refused: nothing posted to a QP in the error state can run, and rxe
    /// never flushes a receive posted then (it would stay held until the QP is dropped).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_modify_qp` fails.
    pub fn set_error(&mut self) -> Result<()> {
        self.set_error_state()?;
        self.errored = true;
        Ok(())
    }

    fn set_error_state(&self) -> Result<()> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: QP valid; only the state is modified, as the mask says.
        check_ibv(
            unsafe { ffi::ibv_modify_qp(self.as_raw(), &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) },
            "ibv_modify_qp(ERR)",
        )
    }
}

impl QueuePair {}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // Out of the registry before the destroy (see crate::verbs::async_event).
        self.async_reg.leave();
        let ret = match &self.link {
            Some(l) => l.destroy(self.raw.as_ptr()),
            // SAFETY: the QP is destroyed exactly once, here; nothing else refers to it.
            None => unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) },
        };
        if ret != 0 {
            // The device may still access what its lane left posted: leak it instead of
            // freeing it, before anything else can fail or panic.
            mem::forget(Arc::clone(&self.parked));
            crate::error::report_leak("ibv_destroy_qp", ret);
            return;
        }
        // The QP is gone: its reservations are returned.
        self.send_cq.unreserve(self.send_reserved);
        self.recv_cq.unreserve(self.recv_reserved);
        if let Some(srq) = &self.srq {
            self.recv_cq.detach_srq(srq.shared());
        }
        // What its lane left posted drops with the last handle of `parked`.
    }
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair").field("qp_num", &self.qp_num).field("srq", &self.srq.is_some()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_seed() {
        let q = QpInit::default();
        assert_eq!((q.max_send_wr, q.max_recv_wr), (16, 16));
    }
}
