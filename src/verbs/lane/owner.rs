//! What a lane can own: a QP ready to post on, and whatever keeps it alive.

use std::any::Any;

use crate::verbs::qp::QueuePair;
use crate::verbs::ud::UdQp;

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// An owner of a QP that a [`Lane`](super::Lane) can take over ([`Lane::attach`](super::Lane::attach)):
/// [`QueuePair`] (RC, brought to RTS without the CM), [`UdQp`], and on the CM side
/// [`Connection`](crate::Connection) and [`UdEndpoint`](crate::UdEndpoint). Sealed: the lane
/// relies on each of them for the QP's state (ready to post, no SRQ checked at attach).
pub trait LaneOwner: Sealed + Send + 'static {
    /// The QP.
    #[doc(hidden)]
    fn lane_qp(&self) -> &QueuePair;
    /// A UD QP's MTU (its largest datagram); `None` for RC.
    #[doc(hidden)]
    fn lane_ud_mtu(&self) -> Option<u32> {
        None
    }
    /// The peer's address, for errors that name it (a connection's).
    #[doc(hidden)]
    fn lane_peer(&self) -> Option<std::net::SocketAddr> {
        None
    }
    /// For giving an owner back, and for the CM side's event handling.
    #[doc(hidden)]
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
    #[doc(hidden)]
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl Sealed for QueuePair {}
impl LaneOwner for QueuePair {
    fn lane_qp(&self) -> &QueuePair {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Sealed for UdQp {}
impl LaneOwner for UdQp {
    fn lane_qp(&self) -> &QueuePair {
        self.qp()
    }
    fn lane_ud_mtu(&self) -> Option<u32> {
        Some(self.mtu())
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
