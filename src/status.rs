//! Small value types shared by the layers: work-completion statuses and opcodes, CM event
//! types, and private data. A leaf module: it depends on nothing else in the crate, so the
//! error type can name these without importing the object modules.

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
    LocQpOpErr = IBV_WC_LOC_QP_OP_ERR, "LOC_QP_OP_ERR", Some("the work request is invalid for this QP (e.g. inline data too long)");
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
