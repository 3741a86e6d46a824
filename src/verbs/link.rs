//! [`Link`]: what a QP asks of whoever created it and drives it (the connection manager, for
//! QPs made through `rdma_create_qp` or adopted by an id). The verbs wing names only this
//! trait; the CM wing implements it.

use rdma_sys as ffi;

use crate::error::Result;

/// What a QP asks of whoever created it: the connection manager, for QPs made through
/// `rdma_create_qp` (it owns the id's `qp` field and the events that say the peer left).
pub(crate) trait Link: Send + Sync {
    /// Destroys the QP as its creator requires.
    fn destroy(&self, qp: *mut ffi::ibv_qp) -> i32;
    /// Answers the peer's disconnect (which also moves the QP to the error state); called only
    /// when the peer left, so not held while the port is down (`crate::hold` in the CM wing).
    fn disconnect(&self) -> Result<()>;
    /// The device reported `IBV_EVENT_COMM_EST` for the QP (a message arrived before the
    /// CM's handshake completed): tell the QP's connection manager (`rdma_notify`). Called by
    /// whoever reads the context's events, under the context's registry lock, while the QP is
    /// registered (so it holds this link): it must not block, nor take that lock.
    fn comm_established(&self) {}
}
