//! What the device says a QP is now (`ibv_query_qp`): its state and the connection parameters
//! it runs with, to check what was negotiated or set (the ACK timeout, the retry counts, the
//! path MTU) rather than trust it.

use std::mem;

use rdma_sys as ffi;

use crate::error::{check_ibv, Result};
pub use crate::status::QpState;
use crate::verbs::port::mtu_bytes;
use crate::verbs::qp::QueuePair;

/// A QP's attributes as the device reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpAttributes {
    /// The current state.
    pub state: QpState,
    /// The path MTU in bytes (256..4096), 0 before the QP has a path.
    pub path_mtu: u32,
    /// The local ACK timeout exponent: a request unacknowledged for 4.096 µs × 2^`ack_timeout`
    /// is sent again (0: wait forever). See [`CmId::set_ack_timeout`](crate::CmId::set_ack_timeout).
    pub ack_timeout: u8,
    /// Retries after an ACK timeout before the QP fails (`retry_cnt`).
    pub retry_count: u8,
    /// Retries after a receiver-not-ready NAK (`rnr_retry`; 7 is "forever").
    pub rnr_retry: u8,
    /// How long a peer told "receiver not ready" by this QP waits (`min_rnr_timer`, IB's
    /// 5-bit code: 0 is 655.36 ms, 1 is 0.01 ms, 12 is 0.64 ms); see
    /// [`ConnParam::min_rnr_timer`](crate::ConnParam::min_rnr_timer).
    pub min_rnr_timer: u8,
    /// RDMA READs and atomics this QP may have outstanding as initiator (`max_rd_atomic`).
    pub max_rd_atomic: u8,
    /// ... and as responder (`max_dest_rd_atomic`).
    pub max_dest_rd_atomic: u8,
    /// The peer's QP number (0 before the QP is connected).
    pub dest_qp_num: u32,
    /// The send queue's packet sequence number.
    pub sq_psn: u32,
    /// The receive queue's packet sequence number.
    pub rq_psn: u32,
    /// The device port of the QP's path (0 before it has one).
    pub port_num: u8,
    /// The traffic class of the path's global route header: on RoCE, the IP type of service
    /// the id was given ([`CmId::set_tos`](crate::CmId::set_tos)).
    pub traffic_class: u8,
}

impl QueuePair {
    /// The QP's state as the device reports it now (`ibv_query_qp`, the state only). A QP
    /// can reach [`QpState::Error`] without a completion saying so (the responder of an RDMA
    /// access with a bad rkey, on rxe): waits that run out ask this, and fail with
    /// [`Error::QpInError`](crate::Error::QpInError) when it says so.
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `ibv_query_qp` fails.
    pub fn state(&self) -> Result<QpState> {
        // SAFETY: both are plain old data; all-zero is a valid value of each.
        let (mut a, mut init): (ffi::ibv_qp_attr, ffi::ibv_qp_init_attr) = unsafe { (mem::zeroed(), mem::zeroed()) };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE.0;
        // SAFETY: the QP is alive (self holds it); `a` and `init` are valid out-pointers of the
        // types the call fills.
        check_ibv(unsafe { ffi::ibv_query_qp(self.as_raw(), &mut a, mask as i32, &mut init) }, "ibv_query_qp")?;
        Ok(QpState::from_raw(a.qp_state))
    }

    /// Queries the QP's state and connection attributes (`ibv_query_qp`).
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `ibv_query_qp` fails.
    pub fn attributes(&self) -> Result<QpAttributes> {
        use ffi::ibv_qp_attr_mask as m;
        // SAFETY: both are plain old data; all-zero is a valid value of each.
        let (mut a, mut init): (ffi::ibv_qp_attr, ffi::ibv_qp_init_attr) = unsafe { (mem::zeroed(), mem::zeroed()) };
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_MIN_RNR_TIMER.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_PORT.0
            | m::IBV_QP_AV.0;
        // SAFETY: the QP is alive (self holds it); `a` and `init` are valid out-pointers of the
        // types the call fills.
        check_ibv(unsafe { ffi::ibv_query_qp(self.as_raw(), &mut a, mask as i32, &mut init) }, "ibv_query_qp")?;
        Ok(QpAttributes {
            state: QpState::from_raw(a.qp_state),
            path_mtu: mtu_bytes(a.path_mtu),
            ack_timeout: a.timeout,
            retry_count: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            min_rnr_timer: a.min_rnr_timer,
            max_rd_atomic: a.max_rd_atomic,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            dest_qp_num: a.dest_qp_num,
            sq_psn: a.sq_psn,
            rq_psn: a.rq_psn,
            port_num: a.port_num,
            traffic_class: a.ah_attr.grh.traffic_class,
        })
    }
}
