//! [`AsyncEventKind`]: the typed `enum ibv_event_type`, a leaf the error type can name.
//!
//! rdma-sys binds `ibv_event_type` as a Rust enum, so reading a value the library adds later
//! through it would be undefined behaviour: the crate reads the raw integer and turns it into
//! this enum, with [`AsyncEventKind::Other`] for what it does not know.

use std::fmt;

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
mod tests {
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
