//! Small value types shared by the layers: work-completion statuses and opcodes, CM event
//! types, private data, and the kinds of asynchronous device events. A leaf module: it depends
//! on nothing else in the crate, so the error type can name these without importing the object
//! modules.
//!
//! ```no_run
//! use rdma_cm::status::{AsyncEventKind, WcStatus};
//!
//! let s = WcStatus::from_raw(12); // IBV_WC_RETRY_EXC_ERR, as a completion reports it
//! println!("{s:?}: {}", s.hint().unwrap_or("no usual cause known"));
//! let k = AsyncEventKind::from_raw(1); // IBV_EVENT_QP_FATAL
//! println!("{} is fatal: {}", k.name(), k.is_fatal());
//! ```
//!
//! rdma-sys binds `ibv_event_type` as a Rust enum, so reading a value the library adds later
//! through it would be undefined behaviour: the crate reads the raw integer and turns it into
//! [`AsyncEventKind`], with [`AsyncEventKind::Other`] for what it does not know.

use std::fmt;
use std::ops::Deref;

use rdma_sys as ffi;

macro_rules! wc_status {
    ($( $var:ident = $c:ident, $name:literal, $hint:expr; )*) => {
        /// The status of a work completion (`enum ibv_wc_status`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum WcStatus {
            $( #[doc = concat!("`IBV_WC_", $name, "`")] $var, )*
            /// A value this crate does not know.
            Other(u32),
        }
        impl WcStatus {
            /// Maps the raw value.
            pub fn from_raw(v: u32) -> WcStatus {
                use ffi::ibv_wc_status::*;
                match v { $( $c => WcStatus::$var, )* v => WcStatus::Other(v) }
            }
            /// The raw value.
            pub fn to_raw(self) -> u32 {
                use ffi::ibv_wc_status::*;
                match self { $( WcStatus::$var => $c, )* WcStatus::Other(v) => v }
            }
            /// The usual cause, when known.
            pub fn hint(self) -> Option<&'static str> {
                match self { $( WcStatus::$var => $hint, )* WcStatus::Other(_) => None }
            }
        }
        impl fmt::Display for WcStatus {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self { $( WcStatus::$var => f.write_str($name), )* WcStatus::Other(v) => write!(f, "status {v}") }
            }
        }
    };
}

wc_status! {
    Success = IBV_WC_SUCCESS, "SUCCESS", None;
    LocLenErr = IBV_WC_LOC_LEN_ERR, "LOC_LEN_ERR", Some("the message is larger than the posted receive buffer");
    LocQpOpErr = IBV_WC_LOC_QP_OP_ERR, "LOC_QP_OP_ERR", Some("the work request is invalid for this QP (e.g. inline data too long), or the device could not send it: Soft-RoCE reports this when the link is down (check `ip link` and `rdma link`)");
    LocEecOpErr = IBV_WC_LOC_EEC_OP_ERR, "LOC_EEC_OP_ERR", None;
    LocProtErr = IBV_WC_LOC_PROT_ERR, "LOC_PROT_ERR", Some("a local buffer is not covered by its memory region or lacks LOCAL_WRITE");
    WrFlushErr = IBV_WC_WR_FLUSH_ERR, "WR_FLUSH_ERR", Some("the QP went to the error state (peer disconnected, or an earlier work request failed)");
    MwBindErr = IBV_WC_MW_BIND_ERR, "MW_BIND_ERR", None;
    BadRespErr = IBV_WC_BAD_RESP_ERR, "BAD_RESP_ERR", None;
    LocAccessErr = IBV_WC_LOC_ACCESS_ERR, "LOC_ACCESS_ERR", None;
    RemInvReqErr = IBV_WC_REM_INV_REQ_ERR, "REM_INV_REQ_ERR", Some("the peer rejected the request: message larger than its receive buffer, or an operation it does not allow");
    RemAccessErr = IBV_WC_REM_ACCESS_ERR, "REM_ACCESS_ERR", Some("the remote address, rkey or access rights do not allow this RDMA READ/WRITE or atomic (atomics need REMOTE_ATOMIC)");
    RemOpErr = IBV_WC_REM_OP_ERR, "REM_OP_ERR", Some("the peer could not complete the operation (e.g. its receive buffer is too small)");
    RetryExcErr = IBV_WC_RETRY_EXC_ERR, "RETRY_EXC_ERR", Some("the peer did not acknowledge: it is gone or the link is down (check `rdma link`)");
    RnrRetryExcErr = IBV_WC_RNR_RETRY_EXC_ERR, "RNR_RETRY_EXC_ERR", Some("the peer had no receive posted (receiver not ready)");
    LocRddViolErr = IBV_WC_LOC_RDD_VIOL_ERR, "LOC_RDD_VIOL_ERR", None;
    RemInvRdReqErr = IBV_WC_REM_INV_RD_REQ_ERR, "REM_INV_RD_REQ_ERR", None;
    RemAbortErr = IBV_WC_REM_ABORT_ERR, "REM_ABORT_ERR", None;
    InvEecnErr = IBV_WC_INV_EECN_ERR, "INV_EECN_ERR", None;
    InvEecStateErr = IBV_WC_INV_EEC_STATE_ERR, "INV_EEC_STATE_ERR", None;
    FatalErr = IBV_WC_FATAL_ERR, "FATAL_ERR", Some("the device reported a fatal error");
    RespTimeoutErr = IBV_WC_RESP_TIMEOUT_ERR, "RESP_TIMEOUT_ERR", Some("the peer did not respond in time");
    GeneralErr = IBV_WC_GENERAL_ERR, "GENERAL_ERR", None;
}

/// What a completed work request did (`enum ibv_wc_opcode`). Valid only for successful
/// completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A send.
    Send,
    /// An RDMA WRITE.
    RdmaWrite,
    /// An RDMA READ.
    RdmaRead,
    /// Compare-and-swap.
    CompSwap,
    /// Fetch-and-add.
    FetchAdd,
    /// A receive.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate data.
    RecvRdmaWithImm,
    /// A memory window bind (`IBV_WC_BIND_MW`).
    BindMw,
    /// A local invalidation (`IBV_WC_LOCAL_INV`).
    LocalInv,
    /// A value this crate does not map.
    Other(u32),
}

impl WcOpcode {
    /// Maps the raw value.
    pub fn from_raw(v: u32) -> WcOpcode {
        use ffi::ibv_wc_opcode::*;
        match v {
            IBV_WC_SEND => WcOpcode::Send,
            IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
            IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            IBV_WC_RECV => WcOpcode::Recv,
            IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            IBV_WC_BIND_MW => WcOpcode::BindMw,
            IBV_WC_LOCAL_INV => WcOpcode::LocalInv,
            v => WcOpcode::Other(v),
        }
    }
}

/// Which work queue a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WorkQueue {
    /// The send queue (sends, RDMA READ/WRITE).
    #[default]
    Send,
    /// The receive queue.
    Recv,
}

/// The type of a connection-manager event (`enum rdma_cm_event_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CmEventType {
    /// `RDMA_CM_EVENT_ADDR_RESOLVED`
    AddrResolved,
    /// `RDMA_CM_EVENT_ADDR_ERROR`
    AddrError,
    /// `RDMA_CM_EVENT_ROUTE_RESOLVED`
    RouteResolved,
    /// `RDMA_CM_EVENT_ROUTE_ERROR`
    RouteError,
    /// `RDMA_CM_EVENT_CONNECT_REQUEST`
    ConnectRequest,
    /// `RDMA_CM_EVENT_CONNECT_RESPONSE`
    ConnectResponse,
    /// `RDMA_CM_EVENT_CONNECT_ERROR`
    ConnectError,
    /// `RDMA_CM_EVENT_UNREACHABLE`
    Unreachable,
    /// `RDMA_CM_EVENT_REJECTED`
    Rejected,
    /// `RDMA_CM_EVENT_ESTABLISHED`
    Established,
    /// `RDMA_CM_EVENT_DISCONNECTED`
    Disconnected,
    /// `RDMA_CM_EVENT_DEVICE_REMOVAL`
    DeviceRemoval,
    /// `RDMA_CM_EVENT_MULTICAST_JOIN`
    MulticastJoin,
    /// `RDMA_CM_EVENT_MULTICAST_ERROR`
    MulticastError,
    /// `RDMA_CM_EVENT_ADDR_CHANGE`
    AddrChange,
    /// `RDMA_CM_EVENT_TIMEWAIT_EXIT`
    TimewaitExit,
    /// A value this crate does not know (read as the raw integer, never transmuted).
    Other(u32),
}

impl CmEventType {
    /// Maps the raw integer; unknown values become [`CmEventType::Other`].
    pub fn from_raw(v: u32) -> CmEventType {
        use ffi::rdma_cm_event_type::*;
        match v {
            RDMA_CM_EVENT_ADDR_RESOLVED => Self::AddrResolved,
            RDMA_CM_EVENT_ADDR_ERROR => Self::AddrError,
            RDMA_CM_EVENT_ROUTE_RESOLVED => Self::RouteResolved,
            RDMA_CM_EVENT_ROUTE_ERROR => Self::RouteError,
            RDMA_CM_EVENT_CONNECT_REQUEST => Self::ConnectRequest,
            RDMA_CM_EVENT_CONNECT_RESPONSE => Self::ConnectResponse,
            RDMA_CM_EVENT_CONNECT_ERROR => Self::ConnectError,
            RDMA_CM_EVENT_UNREACHABLE => Self::Unreachable,
            RDMA_CM_EVENT_REJECTED => Self::Rejected,
            RDMA_CM_EVENT_ESTABLISHED => Self::Established,
            RDMA_CM_EVENT_DISCONNECTED => Self::Disconnected,
            RDMA_CM_EVENT_DEVICE_REMOVAL => Self::DeviceRemoval,
            RDMA_CM_EVENT_MULTICAST_JOIN => Self::MulticastJoin,
            RDMA_CM_EVENT_MULTICAST_ERROR => Self::MulticastError,
            RDMA_CM_EVENT_ADDR_CHANGE => Self::AddrChange,
            RDMA_CM_EVENT_TIMEWAIT_EXIT => Self::TimewaitExit,
            v => Self::Other(v),
        }
    }

    /// The usual cause of this event when it arrives instead of the expected one.
    pub fn hint(self) -> Option<&'static str> {
        Some(match self {
            Self::Rejected => {
                "nobody listens on that address and port, or the server refused the connection: is the server running, and is the port right?"
            }
            Self::Unreachable => {
                "the peer did not answer: check the route, the MTU, and that UDP port 4791 (RoCEv2) is not filtered"
            }
            Self::AddrError => {
                "address resolution failed: check `ip link` (netdev up?), `rdma link` (port ACTIVE?) and the GID table (`ibv_devinfo -v`)"
            }
            Self::RouteError => "route resolution failed: check `ip route` and the GID table",
            Self::ConnectError => "the connection attempt failed part-way (peer gone or QP error)",
            Self::Disconnected => "the peer disconnected",
            Self::DeviceRemoval => "the RDMA device was removed (driver unloaded or link deleted)",
            _ => return None,
        })
    }
}

impl fmt::Display for CmEventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::AddrResolved => "ADDR_RESOLVED",
            Self::AddrError => "ADDR_ERROR",
            Self::RouteResolved => "ROUTE_RESOLVED",
            Self::RouteError => "ROUTE_ERROR",
            Self::ConnectRequest => "CONNECT_REQUEST",
            Self::ConnectResponse => "CONNECT_RESPONSE",
            Self::ConnectError => "CONNECT_ERROR",
            Self::Unreachable => "UNREACHABLE",
            Self::Rejected => "REJECTED",
            Self::Established => "ESTABLISHED",
            Self::Disconnected => "DISCONNECTED",
            Self::DeviceRemoval => "DEVICE_REMOVAL",
            Self::MulticastJoin => "MULTICAST_JOIN",
            Self::MulticastError => "MULTICAST_ERROR",
            Self::AddrChange => "ADDR_CHANGE",
            Self::TimewaitExit => "TIMEWAIT_EXIT",
            Self::Other(v) => return write!(f, "event {v}"),
        };
        f.write_str(s)
    }
}

/// The largest private data any RC event can carry (`rdma_accept`'s limit).
pub const MAX_PRIVATE_DATA: usize = 196;

/// Private data copied out of an event: at most [`MAX_PRIVATE_DATA`] bytes, stored inline.
///
/// It is the peer's, and so untrusted. Note that on InfiniBand and RoCE the CM pads private
/// data to the transport maximum with zeros, so its length is not the length the peer sent.
#[derive(Clone, Copy)]
pub struct PrivateData {
    buf: [u8; MAX_PRIVATE_DATA],
    len: u8,
}

impl PrivateData {
    /// An empty value.
    pub const EMPTY: PrivateData = PrivateData { buf: [0; MAX_PRIVATE_DATA], len: 0 };

    /// Copies at most [`MAX_PRIVATE_DATA`] bytes of `data`.
    pub fn from_slice(data: &[u8]) -> PrivateData {
        let n = data.len().min(MAX_PRIVATE_DATA);
        let mut p = PrivateData::EMPTY;
        p.buf[..n].copy_from_slice(&data[..n]);
        p.len = n as u8;
        p
    }
}

impl Default for PrivateData {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl Deref for PrivateData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

impl fmt::Debug for PrivateData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrivateData({} bytes)", self.len)
    }
}

/// A QP's state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpState {
    /// Created, not yet initialised.
    Reset,
    /// Initialised: receives may be posted, nothing is sent.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send: connected.
    ReadyToSend,
    /// Send queue drain in progress.
    SendQueueDrain,
    /// Send queue error: sends failed, receives still work.
    SendQueueError,
    /// Error: every outstanding work request is flushed.
    Error,
    /// A value this crate does not know.
    Other(u32),
}

impl QpState {
    pub(crate) fn from_raw(s: ffi::ibv_qp_state::Type) -> QpState {
        use ffi::ibv_qp_state as s_;
        match s {
            s_::IBV_QPS_RESET => QpState::Reset,
            s_::IBV_QPS_INIT => QpState::Init,
            s_::IBV_QPS_RTR => QpState::ReadyToReceive,
            s_::IBV_QPS_RTS => QpState::ReadyToSend,
            s_::IBV_QPS_SQD => QpState::SendQueueDrain,
            s_::IBV_QPS_SQE => QpState::SendQueueError,
            s_::IBV_QPS_ERR => QpState::Error,
            other => QpState::Other(other),
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::ReadyToReceive => "RTR",
            QpState::ReadyToSend => "RTS",
            QpState::SendQueueDrain => "SQD",
            QpState::SendQueueError => "SQE",
            QpState::Error => "ERR",
            QpState::Other(n) => return write!(f, "state {n}"),
        };
        f.write_str(s)
    }
}

/// What an asynchronous device event reports (`enum ibv_event_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncEventKind {
    /// `IBV_EVENT_CQ_ERR`: a CQ overran (more completions than it has room for); it is
    /// unusable.
    CqError,
    /// `IBV_EVENT_QP_FATAL`: the QP hit an error it cannot report in a completion; it is in the
    /// error state.
    QpFatal,
    /// `IBV_EVENT_QP_REQ_ERR`: the QP received an invalid request (a transport error on the
    /// responder side); it is in the error state.
    QpRequestError,
    /// `IBV_EVENT_QP_ACCESS_ERR`: a peer's RDMA access was refused (bad rkey, bounds or access
    /// rights); the QP is in the error state.
    QpAccessError,
    /// `IBV_EVENT_COMM_EST`: the first message arrived on a QP still in RTR.
    CommEstablished,
    /// `IBV_EVENT_SQ_DRAINED`: the send queue of a QP in SQD has drained.
    SqDrained,
    /// `IBV_EVENT_PATH_MIG`: the QP migrated to its alternate path.
    PathMigrated,
    /// `IBV_EVENT_PATH_MIG_ERR`: migrating to the alternate path failed.
    PathMigrationError,
    /// `IBV_EVENT_DEVICE_FATAL`: the device failed; every object on it is unusable.
    DeviceFatal,
    /// `IBV_EVENT_PORT_ACTIVE`: a port became ACTIVE.
    PortActive,
    /// `IBV_EVENT_PORT_ERR`: a port left ACTIVE (link down).
    PortError,
    /// `IBV_EVENT_LID_CHANGE`: a port's LID changed.
    LidChange,
    /// `IBV_EVENT_PKEY_CHANGE`: a port's P_Key table changed.
    PkeyChange,
    /// `IBV_EVENT_SM_CHANGE`: a port's subnet manager changed.
    SmChange,
    /// `IBV_EVENT_SRQ_ERR`: a shared receive queue failed; it is unusable.
    SrqError,
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`: fewer receives than the armed limit remain posted on an
    /// SRQ (it fires once per arming).
    SrqLimitReached,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`: a QP attached to an SRQ, in the error state, will take
    /// no more receives from it.
    QpLastWqeReached,
    /// `IBV_EVENT_CLIENT_REREGISTER`: the subnet manager asks for re-registration.
    ClientReregister,
    /// `IBV_EVENT_GID_CHANGE`: a port's GID table changed (an address was added or removed).
    GidChange,
    /// `IBV_EVENT_WQ_FATAL`: a work queue (`ibv_wq`) failed.
    WqFatal,
    /// A value this crate does not know (a newer libibverbs).
    Other(u32),
}

/// Kinds by their raw value, in `enum ibv_event_type`'s order.
const KINDS: [AsyncEventKind; 20] = [
    AsyncEventKind::CqError,
    AsyncEventKind::QpFatal,
    AsyncEventKind::QpRequestError,
    AsyncEventKind::QpAccessError,
    AsyncEventKind::CommEstablished,
    AsyncEventKind::SqDrained,
    AsyncEventKind::PathMigrated,
    AsyncEventKind::PathMigrationError,
    AsyncEventKind::DeviceFatal,
    AsyncEventKind::PortActive,
    AsyncEventKind::PortError,
    AsyncEventKind::LidChange,
    AsyncEventKind::PkeyChange,
    AsyncEventKind::SmChange,
    AsyncEventKind::SrqError,
    AsyncEventKind::SrqLimitReached,
    AsyncEventKind::QpLastWqeReached,
    AsyncEventKind::ClientReregister,
    AsyncEventKind::GidChange,
    AsyncEventKind::WqFatal,
];

/// What an event is about, by its kind (as `ibv_get_async_event` decodes the element).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Subject {
    Cq,
    Qp,
    Srq,
    Wq,
    Port,
    Device,
}

impl AsyncEventKind {
    /// The kind of a raw `enum ibv_event_type` value.
    pub fn from_raw(raw: u32) -> AsyncEventKind {
        KINDS.get(raw as usize).copied().unwrap_or(AsyncEventKind::Other(raw))
    }

    /// The raw `enum ibv_event_type` value.
    pub fn as_raw(self) -> u32 {
        match self {
            AsyncEventKind::Other(v) => v,
            k => KINDS.iter().position(|&x| x == k).map_or(u32::MAX, |i| i as u32),
        }
    }

    /// Whether the object it names is unusable from now on (a QP in the error state, a CQ
    /// or SRQ in error, a failed device): its waits fail instead of waiting.
    pub fn is_fatal(self) -> bool {
        matches!(
            self,
            AsyncEventKind::CqError
                | AsyncEventKind::QpFatal
                | AsyncEventKind::QpRequestError
                | AsyncEventKind::QpAccessError
                | AsyncEventKind::DeviceFatal
                | AsyncEventKind::SrqError
                | AsyncEventKind::WqFatal
        )
    }

    /// The C name, e.g. `IBV_EVENT_QP_FATAL`.
    pub fn name(self) -> &'static str {
        match self {
            AsyncEventKind::CqError => "IBV_EVENT_CQ_ERR",
            AsyncEventKind::QpFatal => "IBV_EVENT_QP_FATAL",
            AsyncEventKind::QpRequestError => "IBV_EVENT_QP_REQ_ERR",
            AsyncEventKind::QpAccessError => "IBV_EVENT_QP_ACCESS_ERR",
            AsyncEventKind::CommEstablished => "IBV_EVENT_COMM_EST",
            AsyncEventKind::SqDrained => "IBV_EVENT_SQ_DRAINED",
            AsyncEventKind::PathMigrated => "IBV_EVENT_PATH_MIG",
            AsyncEventKind::PathMigrationError => "IBV_EVENT_PATH_MIG_ERR",
            AsyncEventKind::DeviceFatal => "IBV_EVENT_DEVICE_FATAL",
            AsyncEventKind::PortActive => "IBV_EVENT_PORT_ACTIVE",
            AsyncEventKind::PortError => "IBV_EVENT_PORT_ERR",
            AsyncEventKind::LidChange => "IBV_EVENT_LID_CHANGE",
            AsyncEventKind::PkeyChange => "IBV_EVENT_PKEY_CHANGE",
            AsyncEventKind::SmChange => "IBV_EVENT_SM_CHANGE",
            AsyncEventKind::SrqError => "IBV_EVENT_SRQ_ERR",
            AsyncEventKind::SrqLimitReached => "IBV_EVENT_SRQ_LIMIT_REACHED",
            AsyncEventKind::QpLastWqeReached => "IBV_EVENT_QP_LAST_WQE_REACHED",
            AsyncEventKind::ClientReregister => "IBV_EVENT_CLIENT_REREGISTER",
            AsyncEventKind::GidChange => "IBV_EVENT_GID_CHANGE",
            AsyncEventKind::WqFatal => "IBV_EVENT_WQ_FATAL",
            AsyncEventKind::Other(_) => "unknown event",
        }
    }

    /// The usual cause and what to check, for the kinds that have one.
    pub fn hint(self) -> Option<&'static str> {
        Some(match self {
            AsyncEventKind::CqError => {
                "the CQ overran: more completions arrived than it has room for; poll it more often or make it deeper \
                 (this crate sizes its own QPs' CQs, so a raw post or a foreign QP on it is the usual cause)"
            }
            AsyncEventKind::QpFatal => {
                "the QP hit an error it could not report in a completion (often its CQ overran, or a provider fault); \
                 check the CQ's events and `dmesg`"
            }
            AsyncEventKind::QpRequestError => {
                "the peer sent a request this QP cannot serve (wrong opcode for the QP type, or a protocol error); \
                 check that both sides agree on the QP type and operations"
            }
            AsyncEventKind::QpAccessError => {
                "a peer's RDMA access was refused: a wrong rkey, an address outside the region, or a region \
                 registered without REMOTE_READ/REMOTE_WRITE/REMOTE_ATOMIC"
            }
            AsyncEventKind::DeviceFatal => {
                "the device failed (driver reset, firmware fault, hot unplug): every object on it must be destroyed \
                 and the device reopened; see `dmesg` and `rdma link`"
            }
            AsyncEventKind::PortError => "the port left ACTIVE: link down? check `ip link` and `rdma link`",
            AsyncEventKind::SrqError => "the shared receive queue failed; see `dmesg`",
            AsyncEventKind::SrqLimitReached => "the SRQ is running dry: post more receives (and re-arm the limit)",
            AsyncEventKind::PathMigrationError => "the alternate path failed; check the fabric",
            AsyncEventKind::WqFatal => "the work queue failed; see `dmesg`",
            _ => return None,
        })
    }

    pub(crate) fn subject(self) -> Subject {
        use AsyncEventKind as K;
        match self {
            K::CqError => Subject::Cq,
            K::QpFatal
            | K::QpRequestError
            | K::QpAccessError
            | K::CommEstablished
            | K::SqDrained
            | K::PathMigrated
            | K::PathMigrationError
            | K::QpLastWqeReached => Subject::Qp,
            K::SrqError | K::SrqLimitReached => Subject::Srq,
            K::WqFatal => Subject::Wq,
            K::DeviceFatal => Subject::Device,
            // libibverbs decodes everything else, unknown values included, as a port number.
            _ => Subject::Port,
        }
    }
}

/// The C name, then the usual cause where there is one:
/// `IBV_EVENT_CQ_ERR (the CQ overran: …)`.
impl fmt::Display for AsyncEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AsyncEventKind::Other(v) => write!(f, "unknown async event {v}")?,
            k => f.write_str(k.name())?,
        }
        match self.hint() {
            Some(h) => write!(f, " ({h})"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod event_kind_tests {
    use super::*;

    #[test]
    fn raw_values_round_trip_and_unknown_ones_are_kept() {
        for raw in 0..20 {
            let k = AsyncEventKind::from_raw(raw);
            assert!(!matches!(k, AsyncEventKind::Other(_)), "{raw}");
            assert_eq!(k.as_raw(), raw);
        }
        assert_eq!(AsyncEventKind::from_raw(1), AsyncEventKind::QpFatal);
        assert_eq!(AsyncEventKind::from_raw(15), AsyncEventKind::SrqLimitReached);
        assert_eq!(AsyncEventKind::from_raw(99), AsyncEventKind::Other(99));
        assert_eq!(AsyncEventKind::Other(99).as_raw(), 99);
        assert_eq!(AsyncEventKind::from_raw(u32::MAX).subject(), Subject::Port);
    }

    #[test]
    fn the_values_match_the_bindings() {
        use rdma_sys::ibv_event_type as t;
        assert_eq!(AsyncEventKind::CqError.as_raw(), t::IBV_EVENT_CQ_ERR as u32);
        assert_eq!(AsyncEventKind::DeviceFatal.as_raw(), t::IBV_EVENT_DEVICE_FATAL as u32);
        assert_eq!(AsyncEventKind::PortActive.as_raw(), t::IBV_EVENT_PORT_ACTIVE as u32);
        assert_eq!(AsyncEventKind::SrqLimitReached.as_raw(), t::IBV_EVENT_SRQ_LIMIT_REACHED as u32);
        assert_eq!(AsyncEventKind::GidChange.as_raw(), t::IBV_EVENT_GID_CHANGE as u32);
        assert_eq!(AsyncEventKind::WqFatal.as_raw(), t::IBV_EVENT_WQ_FATAL as u32);
    }

    #[test]
    fn fatal_kinds_name_their_cause() {
        for k in KINDS.into_iter().filter(|k| k.is_fatal()) {
            let s = k.to_string();
            assert!(s.starts_with("IBV_EVENT_") && s.contains(" ("), "{s}");
        }
        assert_eq!(AsyncEventKind::CommEstablished.to_string(), "IBV_EVENT_COMM_EST");
        assert!(AsyncEventKind::Other(42).to_string().contains("42"));
    }
}
