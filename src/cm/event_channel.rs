//! [`EventChannel`]: the file descriptor on which librdmacm reports connection events.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::{ConnectRequest, EventChannel, Server};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let channel = EventChannel::new()?; // one descriptor for the events of many ids
//! let listener = Server::on_channel(&channel)?.bind("0.0.0.0:7471".parse().unwrap())?.listen(16)?;
//! // An event loop: wait on the channel (or put its descriptor in epoll) and route each event.
//! let ev = channel.get_event(Duration::from_secs(5))?;
//! println!("{:?} for {:?}", ev.event_type(), ev.id());
//! if ev.listen_id() == Some(listener.handle()) {
//!     let req = ConnectRequest::from_event(ev)?; // a client wants in: accept or reject it
//!     println!("request from {:?}", req.peer_addr());
//! }
//! # Ok(()) }
//! ```
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
//! # Routing events to ids
//!
//! One channel may carry the events of many ids. Every read of the channel happens under the
//! channel's lock, and the crate's own waits are *targeted*: a step of one id takes only that
//! id's events, and keeps every other event it reads in the channel's queue for its owner
//! ([`EventChannel::get_event_for`]). Nothing is consumed silently: an untargeted read
//! ([`EventChannel::get_event`], [`EventChannel::try_get_event`]) returns queued events first,
//! and skips the events of ids that a targeted wait is waiting for at that moment.
//!
//! The same lock serialises everything that touches an id's `qp` field on this channel:
//! librdmacm reads and modifies `id->qp` while it processes `CONNECT_RESPONSE` and `REJECTED`
//! inside `rdma_get_cm_event`, and the crate creates and destroys QPs under the lock, so a QP
//! is never destroyed while another thread's event processing uses it.
//!
//! # Bounded waits
//!
//! The channel's descriptor is non-blocking from birth. Waits use `poll(2)` with the caller's
//! timeout, so no call here can block forever, and the descriptor can be handed to `epoll` or
//! an async runtime through [`AsRawFd`]. (No `AsFd`: a borrowed descriptor lets safe code clone
//! it into a `File` and read events, or clear `O_NONBLOCK`, behind librdmacm's back.) Of several threads waiting on one channel, one polls the
//! descriptor and the others sleep on a condition variable until the poller queues an event
//! for them or leaves.

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rdma_sys as ffi;

use crate::cm::cm_id::{CmId, IdHandle};
use crate::error::{check_ptr, errno, Error, Result};
use crate::verbs::ah::UdParam;
use crate::verbs::device::VerbsContext;
use crate::wait::{poll_readable, pollfd, Deadline};

pub use crate::status::{CmEventType, PrivateData, MAX_PRIVATE_DATA};

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
    demux: Mutex<Demux>,
    /// Signalled when an event is queued for another waiter, or when the poller leaves.
    changed: Condvar,
    /// The descriptor's lasting registration with tokio's reactor, made at the first async wait.
    #[cfg(feature = "tokio")]
    reactor: crate::wait::Reactor,
}

/// What the channel's lock guards besides the reads themselves.
#[derive(Default)]
pub(crate) struct Demux {
    /// Events read for an id other than the reader's, oldest first.
    queued: VecDeque<CmEvent>,
    /// The ids that targeted waits are waiting for right now (a multiset).
    waiting: Vec<IdHandle>,
    /// A thread is in `poll(2)` on the descriptor for the targeted waiters.
    polling: bool,
    /// Bumped whenever an event is queued, so async waiters notice events read by others.
    generation: u64,
    /// Async waiters to wake when an event is queued.
    #[cfg(feature = "tokio")]
    pub(crate) wakers: Vec<std::task::Waker>,
}

/// The guard of a channel's lock; while it is held, no event of the channel is processed.
pub(crate) type ChannelLock<'a> = MutexGuard<'a, Demux>;

// SAFETY: an rdma_event_channel is a file descriptor; librdmacm's calls on one channel are
// thread-safe, and every read of it here happens under `demux`'s lock. The queued events are
// Send (owned copies, and owned ids).
unsafe impl Send for ChannelInner {}
// SAFETY: see the Send impl: all operations through &ChannelInner lock or are thread-safe.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // Queued CONNECT_REQUESTs own new ids on this channel: destroy them (which rejects
        // their peers) before the channel. They hold no handle of this channel by now: a
        // queued event's id holds one, so the channel could not be dropping if any were left
        // (see `EventChannel::purge`), but be thorough.
        let queued = std::mem::take(&mut self.demux.get_mut().unwrap_or_else(|e| e.into_inner()).queued);
        drop(queued);
        // Out of tokio's reactor before the descriptor closes.
        #[cfg(feature = "tokio")]
        self.reactor.clear();
        // SAFETY: `raw` came from rdma_create_event_channel and is destroyed only here, once.
        // Every CmId on this channel holds an Arc of this inner, so none is alive now.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// Whether `ev` belongs to the id `h` (a `CONNECT_REQUEST` belongs to its listener).
fn is_for(ev: &CmEvent, h: IdHandle) -> bool {
    if ev.kind == CmEventType::ConnectRequest {
        ev.listen_id == Some(h)
    } else {
        ev.id == h
    }
}

/// The id whose owner an event belongs to.
fn owner(ev: &CmEvent) -> IdHandle {
    match (ev.kind, ev.listen_id) {
        (CmEventType::ConnectRequest, Some(l)) => l,
        _ => ev.id,
    }
}

/// Which events a read takes.
#[derive(Clone, Copy)]
enum Want {
    /// The events of one id.
    For(IdHandle),
    /// Any event not awaited by a targeted wait.
    Any,
}

impl Want {
    fn takes(self, ev: &CmEvent, d: &Demux) -> bool {
        match self {
            Want::For(h) => is_for(ev, h),
            Want::Any => !d.waiting.contains(&owner(ev)),
        }
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
        let ch = EventChannel {
            inner: Arc::new(ChannelInner {
                raw,
                // Room for a connection's own few events, so that keeping them allocates nothing.
                demux: Mutex::new(Demux { queued: VecDeque::with_capacity(8), ..Demux::default() }),
                changed: Condvar::new(),
                #[cfg(feature = "tokio")]
                reactor: crate::wait::Reactor::default(),
            }),
        };
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

    /// Takes the channel's lock. While it is held no event of this channel is processed, so
    /// librdmacm does not touch the `qp` field of any id on it.
    pub(crate) fn lock(&self) -> ChannelLock<'_> {
        // A panic while holding the lock leaves the queue consistent (every change to it is
        // one push or remove), so a poisoned lock is used as it is.
        self.inner.demux.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads one event from the channel, if one is pending. Call with the lock held.
    fn read_locked(&self, _lock: &mut ChannelLock<'_>) -> Result<Option<CmEvent>> {
        let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is open (we hold it); `ev` is a valid out-pointer. The caller
        // holds the channel's lock, which serialises this with QP creation and destruction.
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

    /// Queues `ev` for its owner and wakes the waiters. Call with the lock held.
    fn queue_locked(&self, d: &mut ChannelLock<'_>, ev: CmEvent) {
        d.queued.push_back(ev);
        d.generation = d.generation.wrapping_add(1);
        self.inner.changed.notify_all();
        #[cfg(feature = "tokio")]
        for w in d.wakers.drain(..) {
            w.wake();
        }
    }

    /// Takes a queued event, or reads the channel until one matches (queueing the others).
    /// Returns `None` when nothing is pending. Call with the lock held. While a blocking waiter
    /// polls the descriptor (`polling`), only that waiter reads the kernel's queue: a read here
    /// could take its event without waking it; it queues what it reads and wakes the others.
    fn take_locked(&self, d: &mut ChannelLock<'_>, want: Want) -> Result<Option<CmEvent>> {
        self.take_locked_as(d, want, false)
    }

    fn take_locked_as(&self, d: &mut ChannelLock<'_>, want: Want, poller: bool) -> Result<Option<CmEvent>> {
        let found = d.queued.iter().position(|ev| want.takes(ev, d));
        if let Some(i) = found {
            return Ok(d.queued.remove(i));
        }
        if d.polling && !poller {
            return Ok(None);
        }
        while let Some(ev) = self.read_locked(d)? {
            if want.takes(&ev, d) {
                return Ok(Some(ev));
            }
            self.queue_locked(d, ev);
        }
        Ok(None)
    }

    /// Returns the next event without waiting, or `None` when none is pending. Use this to
    /// drain the channel after an edge-triggered readiness notification: call until it returns
    /// `None`. Events queued by the crate's own targeted waits come first; events that a
    /// targeted wait is waiting for are left to it.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_get_cm_event` fails with anything but `EAGAIN`.
    pub fn try_get_event(&self) -> Result<Option<CmEvent>> {
        let mut d = self.lock();
        self.take_locked(&mut d, Want::Any)
    }

    /// Returns the next event of the id `id` without waiting (for a `CONNECT_REQUEST`, `id` is
    /// the listener's). Events of other ids read on the way are kept for their owners.
    ///
    /// # Errors
    /// As for [`EventChannel::try_get_event`].
    pub fn try_get_event_for(&self, id: IdHandle) -> Result<Option<CmEvent>> {
        let mut d = self.lock();
        self.take_locked(&mut d, Want::For(id))
    }

    /// Whether an untargeted read ([`EventChannel::try_get_event`]) would return an event kept
    /// in the queue: readiness that `poll(2)` on the descriptor cannot see (`crate::ready`).
    pub(crate) fn has_untargeted_queued(&self) -> bool {
        let d = self.lock();
        d.queued.iter().any(|ev| Want::Any.takes(ev, &d))
    }

    /// Drops the queued events of `id` (and the requests of a listener `id`): called when the
    /// id is destroyed, after which no event of it can be read any more.
    pub(crate) fn purge(&self, id: IdHandle) {
        let gone: VecDeque<CmEvent> = {
            let mut d = self.lock();
            if d.queued.is_empty() {
                return;
            }
            let (gone, keep) = std::mem::take(&mut d.queued).into_iter().partition(|ev| is_for(ev, id));
            d.queued = keep;
            gone
        };
        // Dropped outside the lock: a request's new id purges its own events when it drops.
        drop(gone);
    }

    /// Registers a targeted wait for `id` for as long as the guard lives: from before the call
    /// that causes the event is issued, so that no untargeted reader can take the event in
    /// between.
    pub(crate) fn expecting(&self, id: IdHandle) -> Expecting {
        self.lock().waiting.push(id);
        Expecting { ch: self.clone(), id }
    }

    /// Waits up to `timeout` for the next event that no targeted wait is waiting for (a wait
    /// that repeats gets what is left of the timeout, see `crate::wait`).
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing arrives in time; [`Error::Call`] when the channel fails.
    pub fn get_event(&self, timeout: Duration) -> Result<CmEvent> {
        self.wait(Want::Any, timeout, None)
    }

    /// Waits up to `timeout` for the next event of the id `id` (for a `CONNECT_REQUEST`, the
    /// listener's id). Events of other ids that arrive meanwhile are kept, in order, for their
    /// owners' waits and for the untargeted reads: this is how several connections' blocking
    /// steps share one channel.
    ///
    /// # Errors
    /// As for [`EventChannel::get_event`].
    pub fn get_event_for(&self, id: IdHandle, timeout: Duration) -> Result<CmEvent> {
        self.wait(Want::For(id), timeout, None)
    }

    /// [`EventChannel::get_event_for`] that also reads the device events of `ctx` while it
    /// polls the channel, so that they reach their objects meanwhile (a QP's `COMM_EST` is
    /// answered with `rdma_notify`, which the `ESTABLISHED` being waited for may depend on).
    pub(crate) fn get_event_for_watching(
        &self,
        id: IdHandle,
        timeout: Duration,
        ctx: &VerbsContext,
    ) -> Result<CmEvent> {
        self.wait(Want::For(id), timeout, Some(ctx))
    }

    fn wait(&self, want: Want, timeout: Duration, mut watch: Option<&VerbsContext>) -> Result<CmEvent> {
        let mut deadline = Deadline::new(timeout);
        let mut d = self.lock();
        if let Want::For(h) = want {
            d.waiting.push(h);
        }
        let r = loop {
            match self.take_locked(&mut d, want) {
                Ok(Some(ev)) => break Ok(ev),
                Err(e) => break Err(e),
                Ok(None) => {}
            }
            let left = deadline.left();
            if left.is_zero() {
                break Err(Error::Timeout { op: "rdma_get_cm_event", timeout, addr: None, hint: None });
            }
            if d.polling {
                // Another waiter polls the descriptor; it queues our events and wakes us.
                d = self.inner.changed.wait_timeout(d, left).unwrap_or_else(|e| e.into_inner()).0;
                continue;
            }
            d.polling = true;
            drop(d);
            let mut fds = [pollfd(self.as_raw_fd()), pollfd(watch.map_or(-1, |c| c.as_raw_fd()))];
            let polled = poll_readable(&mut fds, left);
            if let (Some(ctx), true) = (watch, fds[1].revents != 0) {
                // Without the channel's lock: delivering may call rdma_notify. A context whose
                // events cannot be read is not watched again (it would stay readable).
                if ctx.hub().pump().is_err() {
                    watch = None;
                }
            }
            d = self.lock();
            // Read what woke us while still the poller (so no one else has read it), then
            // hand the descriptor back.
            let got = self.take_locked_as(&mut d, want, true);
            d.polling = false;
            self.inner.changed.notify_all();
            if let Err(e) = polled {
                break Err(e);
            }
            match got {
                Ok(Some(ev)) => break Ok(ev),
                Err(e) => break Err(e),
                Ok(None) => {}
            }
        };
        if let Want::For(h) = want {
            if let Some(i) = d.waiting.iter().position(|w| *w == h) {
                d.waiting.swap_remove(i);
            }
        }
        r
    }

    /// Waits for the next event of `id` (or, with `None`, any event no targeted wait is
    /// waiting for) without blocking a tokio runtime. Events read by other waiters of the
    /// channel wake this one through the queue. Cancellation-safe: an event is taken only in
    /// the poll that returns it.
    #[cfg(feature = "tokio")]
    pub(crate) async fn wait_async(&self, id: Option<IdHandle>) -> Result<CmEvent> {
        /// Registers a targeted wait for as long as the future lives (cancellation included).
        struct Waiting<'a>(&'a EventChannel, Option<IdHandle>);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                if let Some(h) = self.1 {
                    let mut d = self.0.lock();
                    if let Some(i) = d.waiting.iter().position(|w| *w == h) {
                        d.waiting.swap_remove(i);
                    }
                }
            }
        }
        let want = id.map_or(Want::Any, Want::For);
        if let Some(h) = id {
            self.lock().waiting.push(h);
        }
        let _waiting = Waiting(self, id);
        loop {
            let seen = {
                let mut d = self.lock();
                if let Some(ev) = self.take_locked(&mut d, want)? {
                    return Ok(ev);
                }
                d.generation
            };
            crate::wait::readable_any([Some((self.as_raw_fd(), self.reactor())), None, None], |waker| {
                let mut d = self.lock();
                if d.generation != seen {
                    return true;
                }
                if !d.wakers.iter().any(|w| w.will_wake(waker)) {
                    d.wakers.push(waker.clone());
                }
                false
            })
            .await?;
        }
    }
}

/// A registered targeted wait (see [`EventChannel::expecting`]).
pub(crate) struct Expecting {
    ch: EventChannel,
    id: IdHandle,
}

impl Drop for Expecting {
    fn drop(&mut self) {
        let mut d = self.ch.lock();
        if let Some(i) = d.waiting.iter().position(|w| *w == self.id) {
            d.waiting.swap_remove(i);
        }
    }
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel").field("fd", &self.as_raw_fd()).finish()
    }
}

/// The descriptor is offered as `AsRawFd` only: safe code cannot borrow it into a `File` to
/// read events behind the library's back, or clear `O_NONBLOCK` on it.
///
/// ```compile_fail
/// use std::os::fd::AsFd;
/// fn f(ch: &rdma_cm::EventChannel) {
///     let _owned = ch.as_fd().try_clone_to_owned();
/// }
/// ```
impl EventChannel {
    /// The descriptor's registration with tokio's reactor (see [`crate::wait::Reactor`]).
    #[cfg(feature = "tokio")]
    pub(crate) fn reactor(&self) -> &crate::wait::Reactor {
        &self.inner.reactor
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is valid while `self` lives; reading its `fd` field has no effect.
        unsafe { (*self.raw()).fd }
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
    ud: Option<UdParam>,
    /// A multicast event's context: the token its join passed (`param.ud.private_data`).
    mc_context: usize,
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
        // Which arm of the param union librdmacm filled: `ud` for every event of an id whose
        // QP type is UD (a UDP or IPoIB port-space id) and for multicast events, `conn`
        // otherwise (see `rdma_get_cm_event`).
        // SAFETY: a non-null `id` of a valid event is a valid rdma_cm_id.
        let on_ud = !e.id.is_null() && unsafe { (*e.id).qp_type } == ffi::ibv_qp_type::IBV_QPT_UD;
        let multicast = matches!(kind, CmEventType::MulticastJoin | CmEventType::MulticastError);
        // SAFETY: both arms are plain old data; the one read is the one filled (above).
        let ud = (on_ud || multicast).then(|| UdParam::from_raw(unsafe { &e.param.ud }));
        // SAFETY: the union's arms are plain old data of which every bit pattern is valid;
        // `private_data` and its length sit at the same offsets in both arms, and the
        // remaining `conn` fields read below are only meaningful for connection events.
        let conn = unsafe { e.param.conn };
        // A multicast event's private-data pointer is the join's user context, not bytes.
        let len = if multicast { 0 } else { (conn.private_data_len as usize).min(MAX_PRIVATE_DATA) };
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
            ud,
            mc_context: if multicast { conn.private_data as usize } else { 0 },
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

    /// For `CONNECT_REQUEST`/`ESTABLISHED`, in this side's view: the RDMA READs (and atomics)
    /// the peer may have outstanding towards this side (the peer's initiator depth). The CM
    /// swaps the peer's two values into this side's view.
    pub fn responder_resources(&self) -> u8 {
        self.responder_resources
    }

    /// For `CONNECT_REQUEST`/`ESTABLISHED`, in this side's view: the RDMA READs (and atomics)
    /// this side may have outstanding towards the peer (the peer's responder resources).
    pub fn initiator_depth(&self) -> u8 {
        self.initiator_depth
    }

    /// The `ud` parameters (the peer's or the group's address attributes, QP number and
    /// QKey) of an event on a UD id, or of a multicast event. A UD `ESTABLISHED` event (the
    /// answer to [`UdEndpoint::connect`](crate::cm::ud_cm::UdEndpoint::connect)) and a `MULTICAST_JOIN`
    /// carry meaningful ones; `None` for RC events.
    pub fn ud(&self) -> Option<&UdParam> {
        self.ud.as_ref()
    }

    /// The context a multicast event's join passed (0 for other events): which membership of
    /// the id the event is about.
    pub(crate) fn mc_context(&self) -> usize {
        self.mc_context
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

#[cfg(feature = "tokio")]
impl EventChannel {
    /// Waits for the next event without blocking the runtime.
    ///
    /// # Errors
    /// [`crate::Error::Call`] when the channel or the reactor fails.
    pub async fn get_event_async(&self) -> Result<CmEvent> {
        self.wait_async(None).await
    }

    /// [`EventChannel::get_event_for`] without blocking the runtime: the next event of the id
    /// `id`; other ids' events read meanwhile are kept for their owners.
    ///
    /// # Errors
    /// As for [`EventChannel::get_event_async`].
    pub async fn get_event_for_async(&self, id: crate::cm::cm_id::IdHandle) -> Result<CmEvent> {
        self.wait_async(Some(id)).await
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
