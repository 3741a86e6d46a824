//! What a lane can own: a QP, and whatever keeps it alive and drives it.
//!
//! The lane knows nothing of the connection manager (the verbs wing imports nothing from
//! the CM wing). What it asks of a connection, it asks of its owner through the hooks below,
//! which the CM wing implements for its types: whether the connection is established yet,
//! whether the peer left (reading that connection's events), and a disconnect. So each of
//! these is one call on the lane ([`Lane::peer_left`](super::Lane::peer_left),
//! [`Lane::disconnect`](super::Lane::disconnect)), and the lane's methods all live in the
//! lane's own module. The steps that need the CM's own inputs (connection parameters, the
//! event channel's waits) are the CM's types' methods, which take the lane:
//! [`LaneClient::connect`](crate::LaneClient::connect),
//! [`LaneServer::accept`](crate::LaneServer::accept).

use std::any::Any;
use std::time::Duration;

use crate::error::Result;

use crate::verbs::qp::QueuePair;
use crate::verbs::ud::UdQp;

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// An owner of a QP that a [`Lane`](super::Lane) can take over ([`Lane::attach`](super::Lane::attach)):
/// [`QueuePair`] (RC, brought to RTS without the CM), [`UdQp`], and on the CM side
/// [`Connection`](crate::Connection) and [`UdEndpoint`](crate::cm::ud_cm::UdEndpoint). Sealed: the lane
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
    /// Whether the QP may send: false while its connection is not established yet (attached
    /// before connect or accept), when the lane takes receives only.
    #[doc(hidden)]
    fn lane_connected(&self) -> bool {
        true
    }
    /// Reads, without waiting, what the QP's driver reported of its connection (the CM's
    /// events of this connection, and of no other); when the peer left, answers it and moves
    /// the QP to the error state. True once the peer has left.
    ///
    /// # Errors
    /// When reading the events fails.
    #[doc(hidden)]
    fn lane_peer_left(&mut self) -> Result<bool> {
        Ok(false)
    }
    /// [`LaneOwner::lane_peer_left`], waiting up to `timeout` for the peer to leave: true
    /// once it has, false when the time ran out first. Without a connection, false at once.
    ///
    /// # Errors
    /// When reading the events fails.
    #[doc(hidden)]
    fn lane_wait_peer_left(&mut self, timeout: Duration) -> Result<bool> {
        let _ = timeout;
        Ok(false)
    }
    /// An event of the QP's driver, read by the caller's own event loop (a [`LaneEvent`]);
    /// true when it says the peer left (answered, and the QP moved to the error state).
    #[doc(hidden)]
    fn lane_event(&mut self, ev: &dyn Any) -> bool {
        let _ = ev;
        false
    }
    /// Disconnects (the QP is in the error state, its flushed work reaped by the lane) and
    /// waits up to `timeout` for the peer's answer; nothing to do without a connection.
    ///
    /// # Errors
    /// When the disconnect fails or its answer does not come in time.
    #[doc(hidden)]
    fn lane_disconnect(&mut self, timeout: Duration) -> Result<()> {
        let _ = timeout;
        Ok(())
    }
    /// For giving an owner back, and for the CM side's event handling.
    #[doc(hidden)]
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
    #[doc(hidden)]
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// An event of a lane member's driver, read by the caller's own event loop, that
/// [`Lane::handle_event`](super::Lane::handle_event) hands to the member it names: the CM's
/// [`CmEvent`](crate::CmEvent). Sealed.
pub trait LaneEvent: Sealed + Any {}

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
