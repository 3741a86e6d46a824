//! The crate's one error type, and the helpers that turn each C error convention into it.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::{Client, Error};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! match Client::new()?.resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t) {
//!     Ok(_) => println!("resolved"),
//!     Err(Error::Timeout { op, .. }) => println!("{op} timed out: is 10.77.0.1 reachable over RDMA?"),
//!     Err(e) => return Err(e), // its message names what failed and the usual cause
//! }
//! # Ok(()) }
//! ```
//!
//! librdmacm and libibverbs report failure in four different ways, and crates that mixed them
//! up printed "os error 1" for "no RDMA device". Each convention gets exactly one helper here:
//!
//! | convention                                   | helper          |
//! |----------------------------------------------|-----------------|
//! | `rdma_*`: returns -1 and sets `errno`        | `check_rdma`    |
//! | most `ibv_*`: returns the errno itself       | `check_ibv`     |
//! | constructors: return NULL and set `errno`    | `check_ptr`     |
//! | `ibv_poll_cq`: returns a negative value      | handled in `cq` |

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::time::Duration;

use crate::status::AsyncEventKind;
use crate::status::{CmEventType, PrivateData, WcStatus};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in this crate.
///
/// Each variant names the operation that failed and carries the context that helps (the
/// address, the event that arrived instead of the expected one, the work-completion status),
/// and its message ends with a one-line hint where the usual cause is known.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A librdmacm or verbs call failed with an errno.
    #[error("{op} failed: {}{}{}", Errno(.source), AddrCtx(.addr), Hint(.hint))]
    Call {
        /// The C function (or step) that failed, e.g. `rdma_resolve_addr`.
        op: &'static str,
        /// The address involved, when there is one.
        addr: Option<SocketAddr>,
        /// The usual cause, when known.
        hint: Option<&'static str>,
        /// The OS error (errno).
        #[source]
        source: io::Error,
    },

    /// No RDMA device is present, or none is bound to the address used.
    #[error("{op}: no RDMA device found{}: is rdma_rxe or a NIC driver loaded? see `rdma link` and `ibv_devices` (without RDMA hardware, Soft-RoCE: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev NETDEV`)", AddrCtx(.addr))]
    NoDevice {
        /// The step that needed a device.
        op: &'static str,
        /// The address involved, when there is one.
        addr: Option<SocketAddr>,
    },

    /// An id bound to a wildcard address (`0.0.0.0`, `[::]`) was asked for its device. Such an id
    /// is on no device until a connection request arrives on one, however healthy the devices
    /// are: the request's id carries the device, the listener's never does.
    #[error("{op}: {addr} is a wildcard address, and an id bound to it is on no RDMA device until a connection request arrives (this says nothing about the devices): bind to the device's address (`rdma link` names its netdev, `ip -br addr` the address), take the context from the request (`ConnectRequest::context`), or open the device by name (`VerbsContext::cm_open`)")]
    WildcardAddress {
        /// The step that needed a device.
        op: &'static str,
        /// The wildcard address the id is bound to.
        addr: SocketAddr,
    },

    /// Memory registration failed because the locked-memory limit is too small.
    #[error("ibv_reg_mr of {len} bytes failed: {}: the locked-memory limit (ulimit -l) is {}; raise it with `ulimit -l unlimited` or in /etc/security/limits.conf", Errno(.source), Limit(*.limit))]
    MemLock {
        /// Bytes that were to be registered.
        len: usize,
        /// `RLIMIT_MEMLOCK` soft limit in bytes (`None` when unlimited).
        limit: Option<u64>,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// No huge pages were left for a mapping of 2 MiB pages ([`crate::Mapping::huge_pages`]).
    #[error("mmap of {len} bytes in 2 MiB huge pages failed: {}: the kernel's pool has {} of {} huge pages free (HugePages_Free/HugePages_Total in /proc/meminfo); reserve more with `sysctl vm.nr_hugepages=N` (/proc/sys/vm/nr_hugepages)", Errno(.source), Count(*.free), Count(*.total))]
    HugePages {
        /// Bytes that were to be mapped (whole huge pages).
        len: usize,
        /// The pool's size (`HugePages_Total`), when `/proc/meminfo` says it.
        total: Option<u64>,
        /// Free pages in the pool (`HugePages_Free`), when `/proc/meminfo` says it.
        free: Option<u64>,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A region was asked to give back its buffer as a type other than the one registered.
    #[error("the memory region holds {held}, not {wanted}: ask for the type that was registered")]
    WrongBuffer {
        /// What the region holds (a type name, or how the crate allocated it).
        held: &'static str,
        /// The type asked for.
        wanted: &'static str,
    },

    /// A typed view of a region was refused: its address is not aligned for the element type,
    /// or its length is no whole number of elements.
    #[error("the {len} bytes at {addr:#x} cannot be viewed as [{ty}]: {}", ViewWhy(*.addr, *.len, *.size, *.align))]
    TypedView {
        /// The element type.
        ty: &'static str,
        /// The region's address.
        addr: u64,
        /// The region's length in bytes.
        len: usize,
        /// The element's size in bytes.
        size: usize,
        /// The element's alignment in bytes.
        align: usize,
    },

    /// A connection-manager event other than the expected one arrived.
    #[error("{op}: expected {expected} but got {got}{}{}{}", Status(*.status), AddrCtx(.addr), Hint(.hint))]
    UnexpectedEvent {
        /// The step that was waiting.
        op: &'static str,
        /// The event that was expected.
        expected: CmEventType,
        /// The event that arrived.
        got: CmEventType,
        /// The event's status field (often a negative errno or a reject reason).
        status: i32,
        /// The peer address, when known.
        addr: Option<SocketAddr>,
        /// The usual cause of `got`, when known.
        hint: Option<&'static str>,
        /// The peer's private data carried by the event (e.g. a reject reason), at most 196 bytes.
        private_data: Box<PrivateData>,
    },

    /// The peer disconnected (its process exited, or it called disconnect) while work was
    /// outstanding; the posted work requests were flushed.
    #[error("{op}: the peer disconnected{}", AddrCtx(.addr))]
    Disconnected {
        /// The step that was waiting.
        op: &'static str,
        /// The peer address.
        addr: Option<SocketAddr>,
    },

    /// The QP is in the error state though the caller did not put it there: nothing posted to
    /// it can run (and rxe never flushes a receive posted then), so posts are refused. A
    /// completion failed, or a wait that ran out found the QP there with nothing saying why.
    #[error("{op}: the QP is in the error state{}: {cause}; nothing posted to it now can run: set up a new connection (or QP)", AddrCtx(.addr))]
    QpInError {
        /// The step that was refused or waiting.
        op: &'static str,
        /// The peer address, when connected.
        addr: Option<SocketAddr>,
        /// What put it there, with the usual cause.
        cause: String,
    },

    /// A bounded wait ran out.
    #[error("{op} timed out after {timeout:?}{}{}", AddrCtx(.addr), Hint(.hint))]
    Timeout {
        /// The step that was waiting.
        op: &'static str,
        /// How long it waited.
        timeout: Duration,
        /// The address involved, when there is one.
        addr: Option<SocketAddr>,
        /// The usual cause, when known.
        hint: Option<&'static str>,
    },

    /// A work request completed with an error status.
    #[error("work request {wr_id} failed: {status} (vendor error {vendor_err:#x}){}", Hint(&.status.hint()))]
    WorkCompletion {
        /// The caller's `wr_id`.
        wr_id: u64,
        /// The completion status.
        status: WcStatus,
        /// The provider-specific error code.
        vendor_err: u32,
    },

    /// A post found no free slot in the work queue.
    #[error("{queue} queue full ({depth} work requests outstanding): poll completions first{}", if *.queue == "send" { "; unsignaled sends are only retired by a later signaled one" } else { "" })]
    QueueFull {
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// The queue's depth.
        depth: u32,
    },

    /// Local access to a memory region was refused because the device may still use it.
    #[error("memory region is in use by {outstanding} posted work request(s); poll their completions first")]
    InFlight {
        /// How many work requests still hold the region.
        outstanding: usize,
    },

    /// A slice of a remotely writable region was requested.
    #[error("memory region is registered with REMOTE_WRITE or REMOTE_ATOMIC: the peer may write it at any time, so no slice is handed out; use read_at/write_at")]
    RemotelyWritable,

    /// A range fell outside a memory region or a remote region.
    #[error("range {offset}+{len} is outside the {what} of {size} bytes")]
    OutOfBounds {
        /// What was indexed (`"memory region"`, `"remote region"`).
        what: &'static str,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the indexed object.
        size: u64,
    },

    /// A UD datagram larger than the MTU was refused before posting: a datagram is one packet.
    #[error("a UD message of {len} bytes exceeds the MTU of {mtu} bytes: a datagram is a single packet, so split the message (or, on RoCE, raise the netdev's MTU: `ip link set DEV mtu 9000` gives an active MTU of 4096)")]
    MessageTooLong {
        /// Bytes the message carries.
        len: u64,
        /// The port's active MTU in bytes.
        mtu: u32,
    },

    /// An argument was rejected before calling into C.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The device lacks a capability the operation needs (e.g. memory windows on Soft-iWARP).
    #[error("{what} not supported: {why}")]
    Unsupported {
        /// The capability.
        what: &'static str,
        /// What the device said, and where it is available.
        why: String,
    },

    /// The peer's private data could not be decoded (untrusted input).
    #[error("bad private data from peer: {0}")]
    PrivateData(&'static str),

    /// The peer broke a wire protocol this crate speaks (the rsocket stream, feature `stream`):
    /// what it sent, and why that is refused. The connection is closed.
    #[error("protocol violation by the peer{}: {what}", AddrCtx(.addr))]
    Protocol {
        /// What the peer did.
        what: String,
        /// The peer address, when known.
        addr: Option<SocketAddr>,
    },

    /// A host or service name could not be resolved (`rdma_getaddrinfo`).
    #[error(
        "cannot resolve {query}: {reason}; check the name (`getent hosts NAME`) or give a numeric address and port"
    )]
    Lookup {
        /// What was looked up, as `host:service`.
        query: String,
        /// The resolver's reason (`gai_strerror`, or the errno).
        reason: String,
    },

    /// The device reported the object unusable through an asynchronous event (a QP that went
    /// fatal, a CQ that overran, a failed device): see [`crate::verbs::async_event`].
    #[error("{op}: the device reported {event} on this {object}")]
    AsyncEvent {
        /// The step that was waiting.
        op: &'static str,
        /// `"QP"`, `"CQ"`, `"SRQ"` or `"device"`.
        object: &'static str,
        /// The event (its message carries the usual cause).
        event: AsyncEventKind,
    },
}

impl Error {
    /// The errno behind this error, when there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Call { source, .. } | Error::MemLock { source, .. } | Error::HugePages { source, .. } => {
                source.raw_os_error()
            }
            Error::Timeout { .. } => Some(libc::ETIMEDOUT),
            Error::NoDevice { .. } | Error::WildcardAddress { .. } => Some(libc::ENODEV),
            _ => None,
        }
    }

    /// Builds a [`Error::Call`] from an errno value, choosing the hint and detecting the
    /// "no device" case.
    pub(crate) fn call(op: &'static str, errno: i32, addr: Option<SocketAddr>) -> Error {
        // Some providers return a negative errno from their post functions (siw: -EINVAL).
        let errno = errno.saturating_abs();
        if errno == libc::ENODEV && !op.starts_with("ibv_") && !ADDRESS_OPS.contains(&op) {
            return Error::NoDevice { op, addr };
        }
        Error::Call { op, addr, hint: hint_for(op, errno), source: io::Error::from_raw_os_error(errno) }
    }

    /// Attaches an address to an error that has a slot for one.
    pub(crate) fn with_addr(mut self, a: SocketAddr) -> Error {
        match &mut self {
            Error::Call { addr, .. }
            | Error::NoDevice { addr, .. }
            | Error::UnexpectedEvent { addr, .. }
            | Error::Disconnected { addr, .. }
            | Error::Timeout { addr, .. } => {
                addr.get_or_insert(a);
            }
            _ => {}
        }
        self
    }
}

/// Calls whose ENODEV means "no RDMA device behind this address", not "no device at all".
const ADDRESS_OPS: [&str; 3] = ["rdma_resolve_addr", "rdma_resolve_route", "rdma_bind_addr"];

/// The current thread's errno.
pub(crate) fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Sets the current thread's errno to 0, before a call whose provider may fail without
/// setting it (rdma-core 44's libsiw returns NULL from `ibv_create_cq` and `ibv_create_qp` so
/// when it runs out of queue mappings): its error then says "no errno", not a stale one.
pub(crate) fn clear_errno() {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = 0 };
}

/// `rdma_*` convention: 0 on success, -1 with `errno` set on failure.
pub(crate) fn check_rdma(ret: libc::c_int, op: &'static str) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::call(op, errno(), None))
    }
}

/// `ibv_*` convention: 0 on success, the errno itself on failure.
pub(crate) fn check_ibv(ret: libc::c_int, op: &'static str) -> Result<()> {
    match ret {
        0 => Ok(()),
        // Some providers return -errno; a few return -1 with errno set.
        -1 => Err(Error::call(op, errno(), None)),
        e => Err(Error::call(op, e.saturating_abs(), None)),
    }
}

/// Constructor convention: non-NULL on success, NULL with `errno` set on failure.
pub(crate) fn check_ptr<T>(ptr: *mut T, op: &'static str) -> Result<NonNull<T>> {
    NonNull::new(ptr).ok_or_else(|| Error::call(op, errno(), None))
}

/// The symbolic name of an errno, e.g. `ETIMEDOUT`.
pub fn errno_name(e: i32) -> &'static str {
    match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::ENODATA => "ENODATA",
        libc::EPROTO => "EPROTO",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::ENETDOWN => "ENETDOWN",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::ECONNRESET => "ECONNRESET",
        libc::EISCONN => "EISCONN",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::EHOSTDOWN => "EHOSTDOWN",
        libc::EALREADY => "EALREADY",
        libc::EINPROGRESS => "EINPROGRESS",
        _ => "errno",
    }
}

/// The usual cause of `errno` from `op`, when the field knows it.
pub(crate) fn hint_for(op: &'static str, errno: i32) -> Option<&'static str> {
    use libc::*;
    Some(match (op, errno) {
        ("rdma_resolve_addr", ETIMEDOUT | EADDRNOTAVAIL | ENETUNREACH | EHOSTUNREACH) => {
            "no RDMA device answers for this address: check `ip link` (netdev up?), `rdma link` (port ACTIVE?) and the GID table (`ibv_devinfo -v`)"
        }
        ("rdma_resolve_addr" | "rdma_resolve_route" | "rdma_bind_addr", ENODEV) => {
            "no RDMA device serves this address (loopback 127.0.0.1 never does): use an address of an RDMA netdev; `rdma link` lists the netdevs, `ip -br addr` their addresses"
        }
        // Soft-iWARP refuses loopback this way (`rdma_resolve_addr` to 127.0.0.1: EINVAL).
        ("rdma_resolve_addr", EINVAL) => {
            "no RDMA device serves this address (loopback 127.0.0.1 never does; iWARP devices refuse it with EINVAL), or the source and destination address families differ: use an address of an RDMA netdev; `rdma link` lists the netdevs, `ip -br addr` their addresses"
        }
        ("rdma_resolve_route", _) => {
            "no route over the RDMA device: check `ip route` and that the address belongs to an RDMA netdev (`rdma link`)"
        }
        ("rdma_bind_addr", EADDRINUSE) => "the port is already in use: choose another one with -p",
        ("rdma_bind_addr", EADDRNOTAVAIL) => {
            "no local interface has this address: see `ip -br addr`, and `rdma link` for the netdev behind each RDMA device"
        }
        ("rdma_listen", EADDRINUSE) => "the port is already in use: choose another one with -p",
        ("ibv_fork_init", EINVAL) => {
            "memory was registered already: call it first, before any registration (or set RDMAV_FORK_SAFE=1 in the environment)"
        }
        ("bind memory window" | "invalidate memory window", _) => {
            "the provider refused it: check that the QP is connected (RC) and the device's memory-window support (`ibv_devinfo -v`)"
        }
        // iWARP makes the TCP connection inside rdma_connect (InfiniBand and RoCE get REJECTED).
        ("rdma_connect", ECONNREFUSED) => {
            "nobody listens on that address and port (the iWARP connection's TCP connect was refused): is the server running, and is the port right?"
        }
        ("rdma_notify", EISCONN) => "the connection is established already: the CM needs no notice",
        ("rdma_notify", EINVAL) => {
            "the id is not connecting or connected, or its transport's CM takes no notice (iWARP)"
        }
        ("rdma_create_event_channel" | "rdma_create_id", ENOENT | ENXIO | EACCES | EPERM) => {
            "/dev/infiniband/rdma_cm is missing or not accessible: load rdma_ucm (`modprobe rdma_ucm`) and check permissions"
        }
        ("ibv_reg_mr", EFAULT) => "the buffer is not mapped memory",
        ("ibv_create_qp" | "rdma_create_qp", EINVAL) => {
            "the QP capabilities exceed the device limits (see `ibv_devinfo -v`: max_qp_wr, max_sge, max_inline)"
        }
        ("ibv_modify_qp(RTR) with the peer's info", EINVAL) => {
            "the peer's info does not fit this port: usually the GID index (-g: an empty or wrong-type entry), a path MTU over the port's (-m), or the peer's LID/GID (a GID is needed on RoCE)"
        }
        ("ibv_modify_qp(RTR) with the peer's info" | "ibv_modify_qp(INIT) of a verbs-only QP", ETIMEDOUT | ENODATA | EHOSTUNREACH | ENETUNREACH) => {
            "the peer's GID does not resolve to a neighbour of this netdev: is the peer's address reachable (`ip route get`, `ip neigh`)?"
        }
        ("ibv_modify_qp(INIT) of a verbs-only QP", EINVAL) => {
            "the port or the access rights are not the device's (see `ibv_devinfo`)"
        }
        ("ibv_modify_qp(RTS) of a verbs-only QP", EINVAL) => {
            "the RTS attributes are out of range: timeout, retry counts (0..=7) or rd_atomic over the device's max_qp_init_rd_atom"
        }
        ("ibv_create_cq", EINVAL) => "the CQ depth exceeds the device's max_cqe (see `ibv_devinfo -v`)",
        ("ibv_post_send" | "ibv_post_recv", ENOMEM) => "the work queue is full: poll completions first",
        ("ibv_post_send" | "ibv_post_recv", EINVAL) => {
            "the work request exceeds the QP's capabilities (max_sge, max_inline_data), uses what the device lacks (iWARP: immediate data; atomics where `ibv_devinfo -v` says ATOMIC_NONE), or the QP is in the wrong state"
        }
        (_, ETIMEDOUT) => "the peer did not answer in time: is it running, and is the link up (`rdma link`)?",
        (_, 0) => {
            "the provider failed without saying why; it may have run out of a resource of its own: rdma-core 44's Soft-iWARP library (libsiw) maps only about 150 pages of queues per process"
        }
        _ => return None,
    })
}

/// Displays "ENAME (message, os error N)".
struct Errno<'a>(&'a io::Error);
impl fmt::Display for Errno<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.raw_os_error() {
            Some(0) => f.write_str("no errno"),
            Some(e) => write!(f, "{} ({})", errno_name(e), self.0),
            None => write!(f, "{}", self.0),
        }
    }
}

struct AddrCtx<'a>(&'a Option<SocketAddr>);
impl fmt::Display for AddrCtx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(a) => write!(f, " [{a}]"),
            None => Ok(()),
        }
    }
}

struct Hint<'a>(&'a Option<&'static str>);
impl fmt::Display for Hint<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(h) => write!(f, ": {h}"),
            None => Ok(()),
        }
    }
}

struct Status(i32);
impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => Ok(()),
            s if s < 0 => write!(f, " (status {})", errno_name(-s)),
            s => write!(f, " (status {s})"),
        }
    }
}

struct Count(Option<u64>);
impl fmt::Display for Count {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("?"),
        }
    }
}

/// Which check a typed view failed: (address, length, element size, element alignment).
struct ViewWhy(u64, usize, usize, usize);
impl fmt::Display for ViewWhy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ViewWhy(addr, len, size, align) = *self;
        if size == 0 {
            f.write_str("the element type is zero-sized")
        } else if align > 1 && addr % align as u64 != 0 {
            write!(
                f,
                "the address is not a multiple of {align}, the element's alignment ({} bytes past one)",
                addr % align as u64
            )
        } else {
            write!(
                f,
                "the length {len} is not a multiple of {size}, the element's size ({} bytes left over)",
                len % size
            )
        }
    }
}

struct Limit(Option<u64>);
impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(l) => write!(f, "{} KiB", l / 1024),
            None => f.write_str("unlimited"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_convention_reads_errno() {
        // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
        unsafe { *libc::__errno_location() = libc::ETIMEDOUT };
        let e = check_rdma(-1, "rdma_resolve_addr").unwrap_err();
        assert_eq!(e.errno(), Some(libc::ETIMEDOUT));
        let msg = e.to_string();
        assert!(msg.starts_with("rdma_resolve_addr failed: ETIMEDOUT"), "{msg}");
        assert!(msg.contains("rdma link"), "hint missing: {msg}");
    }

    #[test]
    fn ibv_convention_uses_return_value_not_errno() {
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = libc::EPERM };
        let e = check_ibv(libc::EINVAL, "ibv_modify_qp").unwrap_err();
        assert_eq!(e.errno(), Some(libc::EINVAL));
        assert!(check_ibv(0, "ibv_modify_qp").is_ok());
        let e = check_ibv(-libc::ENOMEM, "ibv_post_send").unwrap_err();
        assert_eq!(e.errno(), Some(libc::ENOMEM));
        assert!(e.to_string().contains("poll completions"), "{e}");
        let e = check_ibv(libc::EINVAL, "ibv_post_send").unwrap_err();
        assert!(e.to_string().contains("immediate data"), "{e}");
    }

    #[test]
    fn a_refused_iwarp_connect_says_nobody_listens() {
        let e = Error::call("rdma_connect", libc::ECONNREFUSED, None);
        assert!(e.to_string().starts_with("rdma_connect failed: ECONNREFUSED"), "{e}");
        assert!(e.to_string().contains("nobody listens"), "{e}");
    }

    #[test]
    fn a_constructor_that_sets_no_errno_says_so() {
        clear_errno();
        let e = check_ptr(std::ptr::null_mut::<u8>(), "ibv_create_cq").unwrap_err();
        assert_eq!(e.errno(), Some(0));
        assert!(
            e.to_string().starts_with("ibv_create_cq failed: no errno: the provider failed without saying why"),
            "{e}"
        );
    }

    #[test]
    fn null_constructor_reads_errno_and_maps_enodev() {
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = libc::ENODEV };
        let e = check_ptr(std::ptr::null_mut::<u8>(), "rdma_create_id").unwrap_err();
        assert!(matches!(e, Error::NoDevice { .. }), "{e:?}");
        assert!(e.to_string().contains("no RDMA device found"), "{e}");
        let mut x = 5u8;
        assert!(check_ptr(&mut x as *mut u8, "rdma_create_id").is_ok());
    }

    #[test]
    fn address_appears_in_message() {
        let a: SocketAddr = "10.0.0.1:7471".parse().unwrap();
        let e = Error::call("rdma_bind_addr", libc::EADDRINUSE, None).with_addr(a);
        let m = e.to_string();
        assert!(m.contains("EADDRINUSE") && m.contains("10.0.0.1:7471") && m.contains("-p"), "{m}");
    }

    #[test]
    fn enodev_on_an_address_names_the_address_not_the_driver() {
        let a: SocketAddr = "127.0.0.1:7471".parse().unwrap();
        let e = Error::call("rdma_resolve_route", libc::ENODEV, Some(a));
        let m = e.to_string();
        assert!(matches!(e, Error::Call { .. }) && m.contains("ENODEV") && m.contains("loopback"), "{m}");
        assert!(matches!(Error::call("rdma_create_id", libc::ENODEV, None), Error::NoDevice { .. }));
    }

    #[test]
    fn errno_names() {
        assert_eq!(errno_name(libc::ETIMEDOUT), "ETIMEDOUT");
        assert_eq!(errno_name(libc::ECONNREFUSED), "ECONNREFUSED");
        assert_eq!(errno_name(9999), "errno");
    }
}

/// Reports a destroy call that failed in `Drop` (which must not panic): one line on stderr.
/// The object is leaked by the caller.
/// Never panics: `eprintln!` would when stderr is a closed pipe, so the line is written and
/// any failure to write it ignored.
pub(crate) fn report_leak(op: &str, errno: i32) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "rdma-cm: {op} failed in drop: {} ({}); the object is leaked",
        errno_name(errno.saturating_abs()),
        std::io::Error::from_raw_os_error(errno.saturating_abs())
    );
}

#[cfg(test)]
mod leak_tests {
    /// `report_leak` runs in Drop, which must not panic: not even when stderr is a closed pipe
    /// (where `eprintln!` panics).
    #[test]
    fn reporting_a_leak_to_a_closed_stderr_does_not_panic() {
        // The test harness captures output written through `eprintln!`, which would hide the
        // panic this test looks for: run the check again in a child process, uncaptured.
        if std::env::var_os("RDMA_CM_LEAK_REPORT_CHILD").is_none() {
            let st = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "error::leak_tests::reporting_a_leak_to_a_closed_stderr_does_not_panic",
                    "--nocapture",
                ])
                .args(["--test-threads=1"])
                .env("RDMA_CM_LEAK_REPORT_CHILD", "1")
                .status()
                .unwrap();
            assert!(st.success(), "the uncaptured run failed: {st}");
            return;
        }
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two descriptors; dup/dup2/close act on descriptors this
        // test owns (and restores fd 2 before returning).
        unsafe {
            assert_eq!(libc::pipe(p.as_mut_ptr()), 0);
            let saved = libc::dup(2);
            assert!(saved >= 0);
            libc::close(p[0]); // no reader: writes fail with EPIPE
            libc::dup2(p[1], 2);
            let r = std::panic::catch_unwind(|| super::report_leak("ibv_destroy_qp", libc::EBUSY));
            libc::dup2(saved, 2);
            libc::close(saved);
            libc::close(p[1]);
            assert!(r.is_ok(), "report_leak panicked with stderr closed");
        }
    }
}
