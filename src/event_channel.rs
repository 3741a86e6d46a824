//! [`EventChannel`]: the file descriptor on which librdmacm reports connection events.
//!
//! # Acking
//!
//! `rdma_destroy_id` blocks until every event it reported for that id has been acked with
//! `rdma_ack_cm_event`, so an event held across the drop of its id deadlocks. This module never
//! lets a raw event escape: [`EventChannel::get_event`] copies what the event carries (type,
//! status, private data, connection parameters) into an owned [`CmEvent`] and acks the raw event
//! before it returns. Every event is therefore acked exactly once, before any id can be dropped.
//!
//! The one thing an event hands over is the new id of a `CONNECT_REQUEST`, which becomes an
//! owned [`CmId`] inside the [`CmEvent`].
//!
//! # Bounded waits
//!
//! The channel's descriptor is non-blocking from birth. Waits use `poll(2)` with the caller's
//! timeout, so no call here can block forever, and the descriptor can be handed to `epoll` or
//! an async runtime through [`AsFd`].

use std::fmt;
use std::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::cm_id::{CmId, IdHandle};
use crate::error::{check_ptr, errno, Error, Result};
use crate::wait::{poll_readable, pollfd, Deadline};

/// A librdmacm event channel. Cloning is cheap and yields another handle to the same channel.
///
/// Every [`CmId`] created on a channel holds a clone, so the channel outlives its ids, as
/// `rdma_destroy_event_channel` requires.
#[derive(Clone)]
pub struct EventChannel {
    inner: Arc<ChannelInner>,
}

pub(crate) struct ChannelInner {
    raw: NonNull<ffi::rdma_event_channel>,
}

// SAFETY: an rdma_event_channel is a file descriptor plus nothing mutable on the Rust side;
// librdmacm's rdma_get_cm_event and rdma_create_id are thread-safe on one channel (the kernel
// serialises reads of the fd), so the handle may move to and be shared between threads.
unsafe impl Send for ChannelInner {}
// SAFETY: see the Send impl: all operations through &ChannelInner are thread-safe in librdmacm.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: `raw` came from rdma_create_event_channel and is destroyed only here, once.
        // Every CmId on this channel holds an Arc of this inner, so none is alive now.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

impl EventChannel {
    /// Opens a new event channel (`rdma_create_event_channel`), with a non-blocking descriptor.
    ///
    /// # Errors
    /// [`Error::NoDevice`] or [`Error::Call`] when `/dev/infiniband/rdma_cm` cannot be opened.
    pub fn new() -> Result<EventChannel> {
        // SAFETY: no preconditions; the result is checked for NULL.
        let raw = check_ptr(unsafe { ffi::rdma_create_event_channel() }, "rdma_create_event_channel")?;
        let ch = EventChannel { inner: Arc::new(ChannelInner { raw }) };
        crate::wait::set_nonblocking(ch.as_raw_fd())?;
        Ok(ch)
    }

    pub(crate) fn raw(&self) -> *mut ffi::rdma_event_channel {
        self.inner.raw.as_ptr()
    }

    /// The raw channel, for calls this crate does not wrap. It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::rdma_event_channel {
        self.raw()
    }

    /// Returns the next event without waiting, or `None` when none is pending. Use this to drain
    /// the channel after an edge-triggered readiness notification: call until it returns `None`.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_get_cm_event` fails with anything but `EAGAIN`.
    pub fn try_get_event(&self) -> Result<Option<CmEvent>> {
        let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is open (we hold it); `ev` is a valid out-pointer.
        let ret = unsafe { ffi::rdma_get_cm_event(self.raw(), &mut ev) };
        if ret != 0 {
            let e = errno();
            return if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                Ok(None)
            } else {
                Err(Error::call("rdma_get_cm_event", e, None))
            };
        }
        // SAFETY: on success librdmacm stored a valid event that we have not acked yet.
        Ok(Some(unsafe { CmEvent::from_raw(ev, self) }))
    }

    /// Waits up to `timeout` for the next event (twice that at most, if another thread takes
    /// an event this call was woken for).
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing arrives in time; [`Error::Call`] when the channel fails.
    pub fn get_event(&self, timeout: Duration) -> Result<CmEvent> {
        // Wait first, read second: a blocking step asks for an event that has rarely arrived
        // yet, so the usual cost is one poll and one read (see crate::wait for the bound).
        let mut deadline = Deadline::new(timeout);
        let mut fds = [pollfd(self.as_raw_fd())];
        loop {
            let left = deadline.left();
            if left.is_zero() || !poll_readable(&mut fds, left)? {
                return Err(Error::Timeout { op: "rdma_get_cm_event", timeout, addr: None, hint: None });
            }
            if let Some(ev) = self.try_get_event()? {
                return Ok(ev);
            }
        }
    }

    /// Whether two handles name the same channel.
    pub fn same_as(&self, other: &EventChannel) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel").field("fd", &self.as_raw_fd()).finish()
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is valid while `self` lives; reading its `fd` field has no effect.
        unsafe { (*self.raw()).fd }
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor stays open until the last handle (including `self`) drops.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
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

/// An owned, already-acked connection-manager event.
#[derive(Debug)]
pub struct CmEvent {
    kind: CmEventType,
    status: i32,
    id: IdHandle,
    listen_id: Option<IdHandle>,
    private_data: PrivateData,
    responder_resources: u8,
    initiator_depth: u8,
    new_id: Option<CmId>,
}

impl CmEvent {
    /// Copies `ev` into an owned value and acks it.
    ///
    /// # Safety
    /// `ev` must be a valid event returned by `rdma_get_cm_event` on `channel` and not yet acked.
    unsafe fn from_raw(ev: *mut ffi::rdma_cm_event, channel: &EventChannel) -> CmEvent {
        // SAFETY: caller guarantees `ev` is valid until we ack it below.
        let e = unsafe { &*ev };
        let kind = CmEventType::from_raw(e.event);
        // SAFETY: for connection events (all but UD/multicast, which this crate does not
        // create) the `conn` arm of the param union is the one librdmacm filled.
        let conn = unsafe { e.param.conn };
        let len = (conn.private_data_len as usize).min(MAX_PRIVATE_DATA);
        let private_data = if conn.private_data.is_null() || len == 0 {
            PrivateData::EMPTY
        } else {
            // SAFETY: librdmacm guarantees private_data points to private_data_len readable
            // bytes until the event is acked; we copy at most that many, before the ack.
            PrivateData::from_slice(unsafe { std::slice::from_raw_parts(conn.private_data.cast::<u8>(), len) })
        };
        let new_id = match (kind, NonNull::new(e.id)) {
            // SAFETY: a CONNECT_REQUEST's `id` is a new id created on this channel, which the
            // application owns from now on (rdma_cm(7)); nothing else will destroy it.
            (CmEventType::ConnectRequest, Some(raw)) => Some(unsafe { CmId::from_raw(raw, channel.clone()) }),
            _ => None,
        };
        let out = CmEvent {
            kind,
            status: e.status,
            id: IdHandle::of(e.id),
            listen_id: NonNull::new(e.listen_id).map(|p| IdHandle::of(p.as_ptr())),
            private_data,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            new_id,
        };
        // SAFETY: `ev` is valid and acked exactly once, here; nothing reads it afterwards.
        unsafe { ffi::rdma_ack_cm_event(ev) };
        out
    }

    /// The event type.
    pub fn event_type(&self) -> CmEventType {
        self.kind
    }

    /// The event's status: 0, a negative errno, or (for `REJECTED`) the transport's reject
    /// reason.
    pub fn status(&self) -> i32 {
        self.status
    }

    /// The id the event is about. For a `CONNECT_REQUEST` this is the new id (see
    /// [`CmEvent::take_id`]); for other events, compare it with [`CmId::handle`].
    pub fn id(&self) -> IdHandle {
        self.id
    }

    /// The listening id, for a `CONNECT_REQUEST`.
    pub fn listen_id(&self) -> Option<IdHandle> {
        self.listen_id
    }

    /// The peer's private data (untrusted).
    pub fn private_data(&self) -> &PrivateData {
        &self.private_data
    }

    /// The peer's responder resources (for `CONNECT_REQUEST`/`ESTABLISHED`).
    pub fn responder_resources(&self) -> u8 {
        self.responder_resources
    }

    /// The peer's initiator depth (for `CONNECT_REQUEST`/`ESTABLISHED`).
    pub fn initiator_depth(&self) -> u8 {
        self.initiator_depth
    }

    /// Takes the new id out of a `CONNECT_REQUEST`. Dropping it unaccepted rejects the peer.
    pub fn take_id(&mut self) -> Option<CmId> {
        self.new_id.take()
    }

    /// Turns this event into an [`Error::UnexpectedEvent`] for step `op` that expected
    /// `expected`.
    pub fn unexpected(&self, op: &'static str, expected: CmEventType) -> Error {
        Error::UnexpectedEvent {
            op,
            expected,
            got: self.kind,
            status: self.status,
            addr: None,
            hint: self.kind.hint(),
            private_data: Box::new(self.private_data),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_type_round_trip_and_unknown() {
        use ffi::rdma_cm_event_type::*;
        assert_eq!(CmEventType::from_raw(RDMA_CM_EVENT_REJECTED), CmEventType::Rejected);
        assert_eq!(CmEventType::from_raw(RDMA_CM_EVENT_TIMEWAIT_EXIT), CmEventType::TimewaitExit);
        assert_eq!(CmEventType::from_raw(999), CmEventType::Other(999));
        assert_eq!(CmEventType::Rejected.to_string(), "REJECTED");
        assert!(CmEventType::Rejected.hint().unwrap().contains("listens"));
        assert!(CmEventType::Established.hint().is_none());
    }

    #[test]
    fn private_data_is_capped() {
        let big = [7u8; 300];
        let p = PrivateData::from_slice(&big);
        assert_eq!(p.len(), MAX_PRIVATE_DATA);
        assert_eq!(&p[..], &big[..MAX_PRIVATE_DATA]);
        assert_eq!(PrivateData::from_slice(&[1, 2, 3]).as_ref(), &[1, 2, 3]);
    }
}
