//! [`ConnParam`]: the parameters of `rdma_connect` and `rdma_accept` (depths, retries, private
//! data), and the private-data limits of RC.
//!
//! ```no_run
//! use rdma_cm::ConnParam;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let param = ConnParam::new()
//!     .initiator_depth(4) // RDMA READs and atomics this side keeps in flight
//!     .responder_resources(4) // the peer's READs and atomics this side serves
//!     .rnr_retry_count(7) // retry without end while the peer has no receive posted
//!     .min_rnr_timer(12) // a lane connection sets this RNR delay at RTR
//!     .private_data(b"hello")?; // up to 56 bytes on a connect, 196 on an accept
//! // then `client.connect(&mut lane, &param, t)` or `server.accept(&mut lane, &param, t)`
//! # let _ = param;
//! # Ok(()) }
//! ```

use rdma_sys as ffi;

use crate::cm::cm_id::CmId;
use crate::cm::event_channel::PrivateData;
use crate::cm::expect::with_opt_addr;
use crate::error::{check_ibv, Error, Result};
use crate::verbs::qp::QueuePair;

/// Most private data `rdma_connect` carries on RC.
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;

/// Most private data `rdma_accept` carries on RC.
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;

/// Most private data `rdma_reject` carries on IB/RoCE.
pub const MAX_REJECT_PRIVATE_DATA: usize = 148;

/// Connection parameters for connect and accept. Defaults: the RDMA READ depths
/// (`responder_resources`, `initiator_depth`) what the device allows
/// ([`ConnParam::FROM_DEVICE`]), retry and RNR retry counts 7, no private data.
///
/// # RDMA READ depths
///
/// By default a connection may have as many RDMA READs (and atomics) in flight each way as
/// both devices allow: on connect, this device's limits (`max_qp_init_rd_atom`,
/// `max_qp_rd_atom`, which the CM then negotiates down to what the server accepts); on accept,
/// what the request asks, clamped to this device's limits, as [`ConnParam::from_request`] and
/// `rdma_accept(id, NULL)` do. With a depth of 1, a batch of READs posted together runs one
/// at a time, a round trip each. An explicit value (1, as the C seed program and the teaching
/// examples set, to show the field) is sent as it is; over the device's limit, connect and
/// accept fail with `EINVAL`. [`Connection::qp`](crate::Connection::qp)'s
/// [`attributes`](crate::QueuePair::attributes) (`max_rd_atomic`, `max_dest_rd_atomic`) say
/// what was agreed.
///
/// # Flow control
///
/// The crate always sends `flow_control = 1`, as the seed program did; there is no setter.
/// The field says whether this side's hardware does end-to-end flow control: the CM passes it
/// to the peer (it arrives in the peer's `CONNECT_REQUEST` or `ESTABLISHED`) and configures no
/// QP with it (`rdma_connect(3)`, `rdma_accept(3)`). rxe sends unlimited credits in every ACK
/// whatever the field says. `rdma_accept(id, NULL)` sends 0.
#[derive(Debug, Clone, Copy)]
pub struct ConnParam {
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    private_data: PrivateData,
    qp_num: u32,
    min_rnr_timer: Option<u8>,
}

impl Default for ConnParam {
    fn default() -> Self {
        ConnParam {
            responder_resources: ConnParam::FROM_DEVICE,
            initiator_depth: ConnParam::FROM_DEVICE,
            retry_count: 7,
            rnr_retry_count: 7,
            private_data: PrivateData::EMPTY,
            qp_num: 0,
            min_rnr_timer: None,
        }
    }
}

impl ConnParam {
    /// The defaults.
    pub fn new() -> ConnParam {
        ConnParam::default()
    }
    /// librdmacm's "choose for me" value of [`ConnParam::responder_resources`] and
    /// [`ConnParam::initiator_depth`] (`RDMA_MAX_RESP_RES`, `RDMA_MAX_INIT_DEPTH`): on
    /// connect, the device's limit; on accept, the request's value, clamped to the device's
    /// limit.
    pub const FROM_DEVICE: u8 = 0xFF;

    /// Outstanding RDMA READs (and atomics) the peer may send us; [`ConnParam::FROM_DEVICE`]
    /// (the default) lets librdmacm choose. Over the device's limit, connect and accept fail
    /// with `EINVAL`.
    pub fn responder_resources(mut self, n: u8) -> Self {
        self.responder_resources = n;
        self
    }
    /// Outstanding RDMA READs (and atomics) we may send the peer; [`ConnParam::FROM_DEVICE`]
    /// (the default) lets librdmacm choose. Over the device's limit, connect and accept fail
    /// with `EINVAL`.
    pub fn initiator_depth(mut self, n: u8) -> Self {
        self.initiator_depth = n;
        self
    }
    /// Transport retries (0..=7). Meaningful in connect; the CM negotiates it for both sides.
    pub fn retry_count(mut self, n: u8) -> Self {
        self.retry_count = n.min(7);
        self
    }
    /// Receiver-not-ready retries (0..=7; 7 means retry forever) of the *peer's* sends: the
    /// value given to connect applies to the server's QP, the one given to accept to the
    /// client's.
    ///
    /// Each retry is costly on a connection the CM sets up: the kernel's CM gives the receiving
    /// QP a `min_rnr_timer` of 0, the longest (655 ms), and librdmacm has no option to lower
    /// it ([`ConnParam::min_rnr_timer`] lowers it once the QP is ready). A send that finds no
    /// receive posted is thus delayed 0.66 s or more, not microseconds: keep enough receives
    /// posted that the receiver never runs out (measured on rxe: a receiver two messages
    /// behind turned every other message into 0.66 to 7 s), and have the peer start sending
    /// only once the first ones are posted (measured on rxe: a stream of 10,000 sends that
    /// started before its receiver's lane had posted them ran at half the rate, from one RNR
    /// wait).
    pub fn rnr_retry_count(mut self, n: u8) -> Self {
        self.rnr_retry_count = n.min(7);
        self
    }
    /// Private data for the peer. Its length is checked when it is used: at most 56 bytes for
    /// connect, 196 for accept.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] beyond 196 bytes.
    pub fn private_data(mut self, data: &[u8]) -> Result<Self> {
        if data.len() > MAX_ACCEPT_PRIVATE_DATA {
            return Err(too_long("private data", data.len(), MAX_ACCEPT_PRIVATE_DATA));
        }
        self.private_data = PrivateData::from_slice(data);
        Ok(self)
    }

    /// How long a peer told "receiver not ready" by *this* side waits before sending again
    /// (`min_rnr_timer`, IB's 5-bit code): 0 is 655.36 ms, 1 is 0.01 ms, 12 is 0.64 ms, 14 is
    /// 1.28 ms, 31 is 491.52 ms (the codes in between as in the InfiniBand specification's
    /// RNR NAK timer table); over 31 is 31.
    ///
    /// Unset (the default), the QP keeps the kernel CM's 0, the longest. Set, it is applied:
    /// - to a QP the crate moves through its states (an adopted one, `adopt_qp`) at RTR,
    ///   before the accept or the RTU goes out, so the peer never meets the CM's value;
    /// - to a QP librdmacm made (`create_qp`), which librdmacm moves to RTS inside
    ///   `rdma_accept` or before reporting `ESTABLISHED`, with an RTS-to-RTS `ibv_modify_qp`
    ///   right after: a send of the peer's that comes before it still meets the CM's value, so
    ///   post the first receives before accepting or connecting where the API allows it.
    ///
    /// A refused modify fails the accept or the connect after the CM's message went out: the
    /// connection is dropped and the peer sees it closed. Not applied on iWARP, which has no
    /// RNR flow control (a send that finds no receive posted breaks the connection there).
    pub fn min_rnr_timer(mut self, code: u8) -> Self {
        self.min_rnr_timer = Some(code.min(31));
        self
    }

    pub(crate) fn min_rnr_timer_value(&self) -> Option<u8> {
        self.min_rnr_timer
    }

    /// The QP number to send (`rdma_conn_param.qp_num`). Optional: the connection sends its
    /// QP's own number, for a QP librdmacm made and for an adopted one (`adopt_qp`) alike; a number set here
    /// must be that one, or connect and accept refuse it.
    pub fn qp_num(mut self, n: u32) -> Self {
        self.qp_num = n;
        self
    }

    pub(crate) fn qp_num_value(&self) -> u32 {
        self.qp_num
    }

    pub(crate) fn raw(&self, limit: usize, what: &str) -> Result<ffi::rdma_conn_param> {
        if self.private_data.len() > limit {
            return Err(too_long(what, self.private_data.len(), limit));
        }
        Ok(ffi::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 1,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: self.qp_num,
        })
    }
}

pub(crate) fn too_long(what: &str, len: usize, max: usize) -> Error {
    Error::InvalidArgument(format!("{what} is {len} bytes; at most {max} fit on RC"))
}

/// Gives `qp` (in RTS) the minimum RNR timer `code` ([`ConnParam::min_rnr_timer`]) with an
/// RTS-to-RTS `ibv_modify_qp`; nothing when unset or on iWARP.
pub(crate) fn apply_min_rnr_timer(id: &CmId, qp: &QueuePair, code: Option<u8>) -> Result<()> {
    let Some(code) = code else { return Ok(()) };
    if id.is_iwarp() {
        return Ok(());
    }
    // SAFETY: ibv_qp_attr is plain old data; zero is valid.
    let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.min_rnr_timer = code;
    let mask = ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as i32;
    // SAFETY: the QP is alive (borrowed); `attr` is valid for the call, which reads only the
    // field the mask names.
    let ret = unsafe { ffi::ibv_modify_qp(qp.as_raw(), &mut attr, mask) };
    check_ibv(ret, "ibv_modify_qp(RTS to RTS, MIN_RNR_TIMER)").map_err(|e| with_opt_addr(e, id.peer_addr()))
}
