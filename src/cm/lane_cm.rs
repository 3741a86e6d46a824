//! The connection manager's side of a [`Lane`]: its connections and UD endpoints as owners a
//! lane takes over, and the CM events a lane's event loop feeds it.

use std::any::Any;

use crate::cm::connection::Connection;
use crate::cm::event_channel::CmEvent;
use crate::cm::ud_cm::UdEndpoint;
use crate::error::Result;
use crate::verbs::lane::{Lane, LaneOwner, LaneQp, Sealed};
use crate::verbs::qp::QueuePair;

impl Sealed for Connection {}
impl LaneOwner for Connection {
    fn lane_qp(&self) -> &QueuePair {
        self.qp()
    }
    fn lane_peer(&self) -> Option<std::net::SocketAddr> {
        self.peer_addr()
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

impl Lane {
    /// Feeds a CM event of `qp`'s connection (read from its channel by an event loop): a
    /// `DISCONNECTED` moves the QP to the error state, so its posted work flushes, and later
    /// posts are refused. Other events, and QPs not attached with a
    /// [`Connection`], are ignored.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an unknown `qp`.
    pub fn handle_event(&mut self, qp: LaneQp, ev: &CmEvent) -> Result<()> {
        self.with_owner(qp, |owner| match owner.downcast_mut::<Connection>() {
            Some(c) => {
                c.handle_event(ev);
                c.is_disconnected()
            }
            None => false,
        })
    }
}
