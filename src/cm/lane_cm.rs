//! The connection manager's side of a [`Lane`](crate::verbs::lane::Lane): its connections and
//! UD endpoints as owners a lane takes over, with the hooks through which the lane asks them
//! whether the peer left and to disconnect; and its events as ones the lane hands on.

use std::any::Any;
use std::net::SocketAddr;
use std::time::Duration;

use crate::cm::adopt;
use crate::cm::cm_id::CmId;
use crate::cm::connection::{await_disconnected, Connection};
use crate::cm::event_channel::CmEvent;
use crate::cm::expect::is_peer_gone;
use crate::cm::lane_conn::LaneConn;
use crate::cm::ud_cm::UdEndpoint;
use crate::error::{Error, Result};
use crate::verbs::lane::{LaneEvent, LaneOwner, Sealed};
use crate::verbs::qp::QueuePair;
use crate::wait::Deadline;

impl Sealed for CmEvent {}
impl LaneEvent for CmEvent {}

/// Reads `id`'s pending events without waiting (other ids' stay queued for their owners);
/// a departure is answered and moves `qp` to the error state. Whether the peer has left.
pub(crate) fn read_departure(id: &CmId, qp: &mut QueuePair) -> Result<bool> {
    while let Some(ev) = id.channel().try_get_event_for(id.handle())? {
        if is_peer_gone(&ev) {
            qp.peer_gone();
        }
    }
    Ok(qp.peer_left())
}

/// [`read_departure`], waiting up to `timeout` for the departure; whether the peer has left.
/// Other events of `id` that come meanwhile are read and dropped, as `read_departure` drops
/// them.
pub(crate) fn wait_departure(id: &CmId, qp: &mut QueuePair, timeout: Duration) -> Result<bool> {
    let mut deadline = Deadline::new(timeout);
    loop {
        if read_departure(id, qp)? {
            return Ok(true);
        }
        let left = deadline.left();
        if left.is_zero() {
            return Ok(false);
        }
        match id.channel().get_event_for(id.handle(), left) {
            Ok(ev) if is_peer_gone(&ev) => qp.peer_gone(),
            Ok(_) => {}
            Err(Error::Timeout { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
}

/// An event of `id` read by the caller's loop: a departure is answered, as in
/// [`read_departure`]. Whether the peer has left.
pub(crate) fn take_event(id: &CmId, qp: &mut QueuePair, ev: &dyn Any) -> bool {
    if let Some(ev) = ev.downcast_ref::<CmEvent>() {
        if ev.id() == id.handle() && is_peer_gone(ev) {
            qp.peer_gone();
        }
    }
    qp.peer_left()
}

/// Disconnects (`rdma_disconnect`, after moving an adopted QP to the error state itself) and
/// waits up to `timeout` for the answer; nothing when the peer left first or this side
/// disconnected before (`disconnected`).
pub(crate) fn disconnect_and_wait(
    id: &CmId,
    qp: &mut QueuePair,
    adopted: bool,
    disconnected: &mut bool,
    timeout: Duration,
) -> Result<()> {
    if *disconnected || qp.peer_left() {
        *disconnected = true;
        return Ok(());
    }
    // Registered before the disconnect, so no other reader of a shared channel takes the
    // DISCONNECTED this waits for.
    let _expecting = id.channel().expecting(id.handle());
    if adopted {
        adopt::to_error(qp)?;
    }
    *disconnected = true;
    qp.set_closing();
    id.disconnect()?;
    await_disconnected(id, timeout)
}

impl Sealed for Connection {}
impl LaneOwner for Connection {
    fn lane_qp(&self) -> &QueuePair {
        self.qp()
    }
    fn lane_peer(&self) -> Option<SocketAddr> {
        self.peer_addr()
    }
    fn lane_peer_left(&mut self) -> Result<bool> {
        read_departure(&self.id, &mut self.qp)
    }
    fn lane_wait_peer_left(&mut self, timeout: Duration) -> Result<bool> {
        wait_departure(&self.id, &mut self.qp, timeout)
    }
    fn lane_event(&mut self, ev: &dyn Any) -> bool {
        take_event(&self.id, &mut self.qp, ev)
    }
    fn lane_disconnect(&mut self, timeout: Duration) -> Result<()> {
        disconnect_and_wait(&self.id, &mut self.qp, self.user_qp, &mut self.disconnected, timeout)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Sealed for LaneConn {}
impl LaneOwner for LaneConn {
    fn lane_qp(&self) -> &QueuePair {
        &self.qp
    }
    fn lane_peer(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }
    fn lane_connected(&self) -> bool {
        self.established
    }
    fn lane_peer_left(&mut self) -> Result<bool> {
        if !self.established {
            return Ok(false);
        }
        read_departure(&self.id, &mut self.qp)
    }
    fn lane_wait_peer_left(&mut self, timeout: Duration) -> Result<bool> {
        if !self.established {
            return Ok(false);
        }
        wait_departure(&self.id, &mut self.qp, timeout)
    }
    fn lane_event(&mut self, ev: &dyn Any) -> bool {
        self.established && take_event(&self.id, &mut self.qp, ev)
    }
    fn lane_disconnect(&mut self, timeout: Duration) -> Result<()> {
        if !self.established {
            // Never connected: destroying the id (the member's removal) is all there is.
            return Ok(());
        }
        disconnect_and_wait(&self.id, &mut self.qp, true, &mut self.disconnected, timeout)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Sealed for UdEndpoint {}
impl LaneOwner for UdEndpoint {
    fn lane_qp(&self) -> &QueuePair {
        self.qp().qp()
    }
    fn lane_ud_mtu(&self) -> Option<u32> {
        Some(self.qp().mtu())
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
