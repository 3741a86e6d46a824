//! A member's connection around the data path: attached before its connection exists
//! (receives only), the peer leaving, and the disconnect of one member.
//!
//! The lane asks these of the member's owner ([`LaneOwner`]'s hooks, which the CM wing
//! implements), so each is one call here, on the lane.

use std::time::{Duration, Instant};

use super::{Fault, Lane, LaneEvent, LaneQp, Member};
use crate::error::{Error, Result};

impl Member {
    /// Records why the QP can run nothing more. The first cause stays, except that any real
    /// one replaces [`Fault::Connecting`], which is no failure.
    pub(super) fn record(&mut self, fault: Fault) {
        if matches!(self.failed, None | Some(Fault::Connecting)) {
            self.failed = Some(fault);
        }
    }

    /// Whether `count` receives are refused, asked only when the queue looked full or
    /// `failed` is set (out of the post's way): a member whose connection is not established
    /// yet takes receives while its queue has room.
    #[cold]
    #[inline(never)]
    pub(super) fn refuses_recv(&self, count: u32) -> bool {
        count > self.recv.free() || self.failed != Some(Fault::Connecting)
    }
}

/// The refusal of a send (or WRITE, READ, atomic) posted before the connection exists.
#[cold]
pub(super) fn not_connected(m: &Member, op: &'static str) -> Error {
    let peer = m.owner.lane_peer().map(|a| format!(" to {a}")).unwrap_or_default();
    Error::InvalidArgument(format!(
        "{op}: the connection{peer} is not established yet: before it is, the lane takes receives only (post them \
         now, so the peer's first message finds one); send once LaneClient::connect or LaneServer::accept has \
         returned"
    ))
}

impl Lane {
    /// Whether the peer of `qp`'s connection has left. Reads, without waiting, the pending CM
    /// events of that connection (and of no other: events of other ids read on the way, on a
    /// channel they share, stay queued for their owners). When the peer has left (its
    /// `DISCONNECTED`; a `REJECTED`, which an established connection gets when the peer's side
    /// was destroyed before its CM had this side's RTU; or the device's removal), its
    /// disconnect is answered and the QP moved to
    /// the error state: everything it has posted comes back flushed from the lane's polls,
    /// and posts are refused ([`Error::QpInError`]). True from then on.
    ///
    /// Each call reads the channel (a system call, under the channel's lock): make it while the
    /// lane is idle, not after every poll. Events of other ids it reads wait in the channel's
    /// queue, where `poll(2)` on the descriptor does not see them: their owners' reads
    /// (targeted waits, [`EventChannel::try_get_event`](crate::EventChannel::try_get_event))
    /// and [`Readiness`](crate::Readiness) look there first.
    ///
    /// A QP attached without a connection (a [`QueuePair`](crate::QueuePair) or a UD QP) has
    /// no peer to leave: false. An event loop that reads the channel itself (untargeted
    /// reads take any connection's events) hands each event to [`Lane::handle_event`]
    /// instead. The answer to a disconnect of the peer's is sent here, so a peer waiting in
    /// its own bounded disconnect ([`Lane::disconnect`], `Connection::disconnect`) waits for
    /// this side's check.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`; [`Error::Call`] when reading the
    /// channel fails.
    pub fn peer_left(&mut self, qp: LaneQp) -> Result<bool> {
        let m = self.member(qp)?;
        if m.failed == Some(Fault::PeerLeft) {
            return Ok(true);
        }
        let left = m.owner.lane_peer_left()?;
        if left {
            m.record(Fault::PeerLeft);
        }
        Ok(left)
    }

    /// [`Lane::peer_left`], waiting up to `timeout` for the peer to leave: true once it has
    /// (its `DISCONNECTED` answered, the QP in the error state), false when the time ran out
    /// first. The usual end of a server's side: wait for the client to leave, then
    /// [`Lane::disconnect`], which then only destroys. It blocks on the connection's CM
    /// events, not on the CQ: completions that come meanwhile stay for the next poll. A QP
    /// attached without a connection, or not connected yet, returns false at once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`; [`Error::Call`] when reading the
    /// channel fails.
    pub fn wait_peer_left(&mut self, qp: LaneQp, timeout: Duration) -> Result<bool> {
        let m = self.member(qp)?;
        if m.failed == Some(Fault::PeerLeft) {
            return Ok(true);
        }
        let left = m.owner.lane_wait_peer_left(timeout)?;
        if left {
            m.record(Fault::PeerLeft);
        }
        Ok(left)
    }

    /// Hands `qp`'s connection an event of its id that the caller's own event loop read (a
    /// [`CmEvent`](crate::CmEvent)): a `DISCONNECTED` is answered and moves the QP to the error
    /// state, so its posted work flushes and later posts are refused, as [`Lane::peer_left`]
    /// does. Other events, events of other ids, and QPs attached without a connection are
    /// ignored.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`.
    pub fn handle_event<E: LaneEvent>(&mut self, qp: LaneQp, ev: &E) -> Result<()> {
        let m = self.member(qp)?;
        if m.owner.lane_event(ev) {
            m.record(Fault::PeerLeft);
        }
        Ok(())
    }

    /// Disconnects `qp`'s connection and destroys it, bounded by `timeout`: the QP is moved to
    /// the error state, its flushed work reaped (for up to 2 s; their regions are released:
    /// poll them back first to keep them), the CM's disconnect sent (unless the peer left
    /// first) and its answer awaited, then the QP and the id are destroyed. The lane's other
    /// members go on: their completions met on the way are kept for [`Lane::poll`], and other
    /// connections' CM events for their owners. A QP attached without a connection is only
    /// removed ([`Lane::remove`]).
    ///
    /// The answer comes when the peer's side reads its CM events (its own
    /// [`Lane::peer_left`], or its connection's waits): a peer that never looks leaves this
    /// call to its timeout. While the id's port is down, the disconnect is first held,
    /// bounded, for the port to come back (`rdma_cm::cm::hold`), which `timeout` does not
    /// count.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`; [`Error::Call`] when `rdma_disconnect`
    /// fails; [`Error::Timeout`] when the peer's answer does not come in time. The member is
    /// removed and destroyed either way.
    pub fn disconnect(&mut self, qp: LaneQp, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        // In the error state first, so nothing more runs and the flush is reaped before the
        // peer is told (a QP that cannot be moved there keeps its regions until destroyed).
        let _ = self.member(qp)?.set_error();
        // One deadline for both reaps: the removal takes what came meanwhile, and does not wait
        // again for slots that never complete (unsignaled sends that ran before the error).
        let reaped_by = start + super::DRAIN_TIMEOUT;
        self.drain(Some(qp.place), reaped_by);
        let left = timeout.saturating_sub(start.elapsed());
        let r = self.member(qp)?.owner.lane_disconnect(left);
        self.remove_by(qp, reaped_by)?;
        r
    }

    /// `qp`'s owner, for the CM side's connect and accept.
    pub(crate) fn owner_mut(&mut self, qp: LaneQp) -> Result<&mut dyn std::any::Any> {
        Ok(self.member(qp)?.owner.as_any_mut())
    }

    /// Ends the wait for `qp`'s connection: established (`ok`; sends are taken from now on) or
    /// failed (the QP is in the error state, and posts are refused with that cause).
    pub(crate) fn connection_done(&mut self, qp: LaneQp, ok: bool) -> Result<()> {
        let m = self.member(qp)?;
        if m.failed == Some(Fault::Connecting) {
            m.failed = if ok { None } else { Some(Fault::ConnectFailed) };
        }
        Ok(())
    }
}

impl Lane {
    /// `qp`'s attributes as the device reports them (`ibv_query_qp`): its state, the READ
    /// depths agreed, the RNR timer and retries.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`; [`Error::Call`] when `ibv_query_qp`
    /// fails.
    pub fn attributes(&mut self, qp: LaneQp) -> Result<crate::verbs::qp_attr::QpAttributes> {
        self.member(qp)?.owner.lane_qp().attributes()
    }
}
