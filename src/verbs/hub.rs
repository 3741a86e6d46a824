//! The hub of a device context's asynchronous events: the registry of the context's QPs, CQs
//! and SRQs, each event's delivery to the object it names, its acknowledgement, and the log the
//! event sources ([`crate::verbs::async_event::AsyncEvents`]) read. See [`crate::verbs::async_event`] for the rules.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{errno, Error, Result};
use crate::status::{AsyncEventKind, Subject};
use crate::verbs::link::Link;
use crate::wait::{lock, poll_readable, pollfd};

/// Events a context keeps for its sources (the most recent ones; older ones are counted as
/// lost by a source that had not read them).
pub const LOG_LEN: usize = 64;

/// What an asynchronous event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncElement {
    /// A QP (its raw handle, compare with `QueuePair::as_raw`).
    Qp(usize),
    /// A CQ (its raw handle, compare with `CompletionQueue::as_raw`).
    Cq(usize),
    /// A shared receive queue (its raw handle, compare with `SharedReceiveQueue::as_raw`).
    Srq(usize),
    /// A work queue (`ibv_wq`, its raw handle).
    Wq(usize),
    /// A port (numbered from 1).
    Port(u8),
    /// The whole device.
    Device,
}

/// An asynchronous event of a device (`ibv_get_async_event`), copied and acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// What it is about.
    pub element: AsyncElement,
}

impl AsyncEvent {
    fn from_raw(ev: &RawAsyncEvent) -> AsyncEvent {
        let kind = AsyncEventKind::from_raw(ev.event_type);
        // SAFETY: every member of the union is plain data; which one libibverbs wrote is
        // decided by the kind, as ibv_get_async_event decodes it. Pointers are kept as numbers.
        let element = unsafe {
            match kind.subject() {
                Subject::Cq => AsyncElement::Cq(ev.element.ptr as usize),
                Subject::Qp => AsyncElement::Qp(ev.element.ptr as usize),
                Subject::Srq => AsyncElement::Srq(ev.element.ptr as usize),
                Subject::Wq => AsyncElement::Wq(ev.element.ptr as usize),
                Subject::Device => AsyncElement::Device,
                Subject::Port => AsyncElement::Port(ev.element.port.clamp(0, 255) as u8),
            }
        };
        AsyncEvent { kind, element }
    }

    /// Whether this is an SRQ limit event (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    pub fn is_srq_limit(&self) -> bool {
        self.kind == AsyncEventKind::SrqLimitReached
    }

    fn key(&self) -> Option<(Subject, usize)> {
        match self.element {
            AsyncElement::Qp(p) => Some((Subject::Qp, p)),
            AsyncElement::Cq(p) => Some((Subject::Cq, p)),
            AsyncElement::Srq(p) => Some((Subject::Srq, p)),
            _ => None,
        }
    }
}

impl fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.element {
            AsyncElement::Qp(p) => write!(f, "QP {p:#x}: ")?,
            AsyncElement::Cq(p) => write!(f, "CQ {p:#x}: ")?,
            AsyncElement::Srq(p) => write!(f, "SRQ {p:#x}: ")?,
            AsyncElement::Wq(p) => write!(f, "WQ {p:#x}: ")?,
            AsyncElement::Port(n) => write!(f, "port {n}: ")?,
            AsyncElement::Device => f.write_str("device: ")?,
        }
        write!(f, "{}", self.kind)
    }
}

/// `union ibv_async_event::element`.
#[repr(C)]
#[derive(Clone, Copy)]
union RawElement {
    ptr: *mut libc::c_void,
    port: libc::c_int,
}

/// `struct ibv_async_event`, with the event type read as the raw integer, never as rdma-sys's
/// Rust enum (a value a newer library adds would be undefined behaviour there).
#[repr(C)]
struct RawAsyncEvent {
    element: RawElement,
    event_type: u32,
}

/// What one object has been told: kept by the object, filled by whoever reads the events.
#[derive(Default)]
pub(crate) struct ObjectEvents {
    /// Raw kind + 1 of the last event (0: none).
    last: AtomicU32,
    /// Raw kind + 1 of the first fatal event (0: none).
    fatal: AtomicU32,
    /// An SRQ limit event arrived since the limit was last armed.
    limit: AtomicBool,
    /// For a QP a connection manager drives: who answers its `COMM_EST` (`rdma_notify`).
    answer: OnceLock<Weak<dyn Link>>,
    /// How many `COMM_EST` events were answered.
    answered: AtomicU32,
}

impl fmt::Debug for ObjectEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectEvents")
            .field("last", &self.last())
            .field("fatal", &self.fatal())
            .field("limit", &self.limit())
            .field("answered", &self.answered.load(Ordering::Relaxed))
            .finish()
    }
}

impl ObjectEvents {
    fn deliver(&self, kind: AsyncEventKind) {
        let v = kind.as_raw().saturating_add(1);
        self.last.store(v, Ordering::Release);
        if kind.is_fatal() {
            let _ = self.fatal.compare_exchange(0, v, Ordering::AcqRel, Ordering::Acquire);
        }
        if kind == AsyncEventKind::SrqLimitReached {
            self.limit.store(true, Ordering::Release);
        }
        if kind == AsyncEventKind::CommEstablished {
            // The QP is registered (this runs under the registry's lock, for a registered
            // object), and it holds its link until after it leaves the registry, so the link is
            // alive and this handle of it is never the last one.
            if let Some(link) = self.answer.get().and_then(Weak::upgrade) {
                link.comm_established();
                self.answered.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// Makes `link` the one that answers this QP's `COMM_EST` (once; later calls change nothing).
    pub(crate) fn answer_with(&self, link: Weak<dyn Link>) {
        let _ = self.answer.set(link);
    }

    /// How many `COMM_EST` events were answered through the link.
    #[cfg(test)]
    pub(crate) fn answered(&self) -> u32 {
        self.answered.load(Ordering::Acquire)
    }

    fn decode(v: u32) -> Option<AsyncEventKind> {
        v.checked_sub(1).map(AsyncEventKind::from_raw)
    }

    /// The last event delivered.
    pub(crate) fn last(&self) -> Option<AsyncEventKind> {
        Self::decode(self.last.load(Ordering::Acquire))
    }

    /// The first fatal event delivered.
    pub(crate) fn fatal(&self) -> Option<AsyncEventKind> {
        Self::decode(self.fatal.load(Ordering::Acquire))
    }

    /// Whether a limit event arrived since [`ObjectEvents::clear_limit`].
    pub(crate) fn limit(&self) -> bool {
        self.limit.load(Ordering::Acquire)
    }

    pub(crate) fn clear_limit(&self) {
        self.limit.store(false, Ordering::Release);
    }
}

/// What a context shares among its handles: the registry of its objects and the log of its
/// events. One per open context (all handles of one `ibv_context` find the same one).
pub(crate) struct Hub {
    /// The context, kept open by `_keep` for as long as the hub lives.
    raw: NonNull<ffi::ibv_context>,
    _keep: Arc<dyn Any + Send + Sync>,
    state: Mutex<HubState>,
    nonblocking: AtomicBool,
    device_fatal: AtomicBool,
}

struct HubState {
    objects: HashMap<(Subject, usize), Arc<ObjectEvents>>,
    /// The last `LOG_LEN` events; event number `s` sits at `s % LOG_LEN`.
    log: Box<[Option<AsyncEvent>]>,
    /// The number the next event gets.
    next: u64,
    /// The sources' eventfds, by source number.
    sources: Vec<(u64, RawFd)>,
    next_source: u64,
}

impl HubState {
    fn new() -> HubState {
        HubState {
            objects: HashMap::new(),
            log: vec![None; LOG_LEN].into_boxed_slice(),
            next: 0,
            sources: Vec::new(),
            next_source: 0,
        }
    }

    /// Delivers `ev` to the registered object it names, if any (answering a QP's `COMM_EST`).
    fn dispatch(&self, ev: &AsyncEvent) {
        if let Some(obj) = ev.key().and_then(|k| self.objects.get(&k)) {
            obj.deliver(ev.kind);
        }
    }

    fn push(&mut self, ev: AsyncEvent) {
        self.log[(self.next % LOG_LEN as u64) as usize] = Some(ev);
        self.next += 1;
    }

    /// The number of the oldest event still kept.
    fn oldest(&self) -> u64 {
        self.next.saturating_sub(LOG_LEN as u64)
    }

    /// The event numbered `*cursor`, advancing it; one that is gone already is skipped and
    /// counted in `lost`.
    fn take(&self, cursor: &mut u64, lost: &mut u64) -> Option<AsyncEvent> {
        let oldest = self.oldest();
        if *cursor < oldest {
            *lost += oldest - *cursor;
            *cursor = oldest;
        }
        if *cursor >= self.next {
            return None;
        }
        let ev = self.log[(*cursor % LOG_LEN as u64) as usize];
        *cursor += 1;
        ev
    }
}

/// The hub of the context `raw`: the one its other handles use, or a new one.
pub(crate) fn hub_for(raw: NonNull<ffi::ibv_context>, keep: &Arc<dyn Any + Send + Sync>) -> Arc<Hub> {
    static HUBS: Mutex<Vec<(usize, Weak<Hub>)>> = Mutex::new(Vec::new());
    let mut hubs = lock(&HUBS);
    // A hub lives as long as a handle of its context, so a dead entry's context may be closed
    // and its address reused: forget those.
    hubs.retain(|(_, w)| w.strong_count() > 0);
    if let Some(h) = hubs.iter().find(|(r, _)| *r == raw.as_ptr() as usize).and_then(|(_, w)| w.upgrade()) {
        return h;
    }
    let h = Arc::new(Hub {
        raw,
        _keep: Arc::clone(keep),
        state: Mutex::new(HubState::new()),
        nonblocking: AtomicBool::new(false),
        device_fatal: AtomicBool::new(false),
    });
    hubs.push((raw.as_ptr() as usize, Arc::downgrade(&h)));
    h
}

// SAFETY: `raw` is only passed to libibverbs' event calls, which are thread-safe; everything
// else the hub holds is Send + Sync, and the event reads are serialised by `state`'s lock.
unsafe impl Send for Hub {}
// SAFETY: as above.
unsafe impl Sync for Hub {}

impl Hub {
    /// Adds a source whose eventfd `wake` is signalled when events arrive: its number, and the
    /// cursor it starts from (the oldest event still kept).
    pub(crate) fn add_source(&self, wake: RawFd) -> (u64, u64) {
        let mut st = lock(&self.state);
        let id = st.next_source;
        st.next_source += 1;
        st.sources.push((id, wake));
        (id, st.oldest())
    }

    /// Removes source `id` (before its eventfd closes).
    pub(crate) fn remove_source(&self, id: u64) {
        lock(&self.state).sources.retain(|&(s, _)| s != id);
    }

    /// The logged event numbered `*cursor`, advancing it (see [`HubState::take`]).
    pub(crate) fn take(&self, cursor: &mut u64, lost: &mut u64) -> Option<AsyncEvent> {
        lock(&self.state).take(cursor, lost)
    }

    /// Registers an object of this context; its events are delivered to what this returns
    /// until [`Hub::unregister`], which must come before the object is destroyed.
    pub(crate) fn register(&self, subject: Subject, raw: usize) -> Arc<ObjectEvents> {
        let ev = Arc::new(ObjectEvents::default());
        lock(&self.state).objects.insert((subject, raw), Arc::clone(&ev));
        ev
    }

    /// Takes an object out of the registry (before it is destroyed: see the module docs).
    pub(crate) fn unregister(&self, subject: Subject, raw: usize) {
        lock(&self.state).objects.remove(&(subject, raw));
    }

    /// Whether the device reported itself failed.
    pub(crate) fn device_fatal(&self) -> bool {
        self.device_fatal.load(Ordering::Acquire)
    }

    /// Reads every pending event of this hub's context without blocking: delivers each to its
    /// object, acknowledges it, and logs it for the sources. Returns how many.
    pub(crate) fn pump(&self) -> Result<usize> {
        // SAFETY: the context is open while the hub lives (`_keep`); `async_fd` is set when it
        // is opened and never changes.
        let fd: RawFd = unsafe { (*self.raw.as_ptr()).async_fd };
        let mut st = lock(&self.state);
        if !self.nonblocking.load(Ordering::Acquire) {
            crate::wait::set_nonblocking(fd)?;
            self.nonblocking.store(true, Ordering::Release);
        }
        let mut n = 0;
        // Poll before every read: a read is attempted only when the kernel has an event, so it
        // cannot block even if someone cleared O_NONBLOCK behind our back.
        while poll_readable(&mut [pollfd(fd)], Duration::ZERO)? {
            let mut raw = RawAsyncEvent { element: RawElement { ptr: std::ptr::null_mut() }, event_type: 0 };
            // SAFETY: the context is open while the hub lives (`_keep`); `raw` has the layout of struct
            // ibv_async_event (the union, then the type as a 32-bit integer).
            let ret = unsafe { ffi::ibv_get_async_event(self.raw.as_ptr(), (&mut raw as *mut RawAsyncEvent).cast()) };
            if ret != 0 {
                let e = errno();
                if e == libc::EAGAIN || e == libc::EWOULDBLOCK || e == libc::EINTR {
                    break;
                }
                return Err(Error::call("ibv_get_async_event", e, None));
            }
            let ev = AsyncEvent::from_raw(&raw);
            st.dispatch(&ev);
            if ev.kind == AsyncEventKind::DeviceFatal {
                self.device_fatal.store(true, Ordering::Release);
            }
            // SAFETY: returned by ibv_get_async_event above and acknowledged exactly once,
            // right after it was copied and delivered; the object it names cannot be destroyed
            // before this (its destroy waits for the ack).
            unsafe { ffi::ibv_ack_async_event((&mut raw as *mut RawAsyncEvent).cast()) };
            st.push(ev);
            n += 1;
        }
        if n > 0 {
            for &(_, efd) in &st.sources {
                let one: u64 = 1;
                // SAFETY: `efd` is a source's open eventfd (a source leaves this list before
                // closing it, under this lock); 8 bytes from a valid u64. A full counter
                // (EAGAIN) still reads as readable, which is all this is for.
                let _ = unsafe { libc::write(efd, (&one as *const u64).cast(), 8) };
            }
        }
        Ok(n)
    }
}

/// An object's place in its context's registry. The owner calls [`Registration::leave`] right
/// before destroying the object (not after: a new object may get the same address as soon as
/// the old one is destroyed) and never holds a lock a reader of events needs meanwhile.
#[derive(Clone)]
pub(crate) struct Registration {
    hub: Arc<Hub>,
    key: (Subject, usize),
    events: Arc<ObjectEvents>,
}

impl Registration {
    pub(crate) fn new(hub: &Arc<Hub>, subject: Subject, raw: usize) -> Registration {
        let hub = Arc::clone(hub);
        let events = hub.register(subject, raw);
        Registration { hub, key: (subject, raw), events }
    }

    /// Leaves the registry: events about the object are no longer delivered to it.
    pub(crate) fn leave(&self) {
        self.hub.unregister(self.key.0, self.key.1);
    }

    /// What the object has been told.
    pub(crate) fn events(&self) -> &ObjectEvents {
        &self.events
    }

    /// The event that makes the object unusable, if one came: its own first fatal event, or
    /// the device's.
    pub(crate) fn fatal(&self) -> Option<AsyncEventKind> {
        self.events.fatal().or_else(|| self.hub.device_fatal().then_some(AsyncEventKind::DeviceFatal))
    }

    /// Reads what the device has pending (one `poll` when nothing is), so the answers above
    /// are current.
    pub(crate) fn refresh(&self) -> Result<()> {
        self.hub.pump().map(|_| ())
    }

    /// The error a wait of the object returns once it is unusable.
    pub(crate) fn error(&self, op: &'static str) -> Option<Error> {
        let object = match self.key.0 {
            Subject::Qp => "QP",
            Subject::Cq => "CQ",
            Subject::Srq => "SRQ",
            _ => "object",
        };
        self.fatal().map(|event| Error::AsyncEvent {
            op,
            object: if event == AsyncEventKind::DeviceFatal { "device" } else { object },
            event,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_are_decoded_by_kind_and_never_dereferenced() {
        let ev = |t: u32, e: RawElement| AsyncEvent::from_raw(&RawAsyncEvent { element: e, event_type: t });
        let p = RawElement { ptr: 0x1000 as *mut libc::c_void };
        assert_eq!(ev(0, p).element, AsyncElement::Cq(0x1000));
        assert_eq!(ev(1, p).element, AsyncElement::Qp(0x1000));
        assert_eq!(ev(15, p).element, AsyncElement::Srq(0x1000));
        assert_eq!(ev(19, p).element, AsyncElement::Wq(0x1000));
        assert_eq!(ev(8, p).element, AsyncElement::Device);
        let mut port = RawElement { ptr: std::ptr::null_mut() };
        port.port = 1;
        assert_eq!(ev(9, port).element, AsyncElement::Port(1));
        assert_eq!(ev(9, port).kind, AsyncEventKind::PortActive);
        // An unknown kind: libibverbs decodes it as a port number; nothing is delivered.
        let e = ev(77, port);
        assert_eq!((e.kind, e.element, e.key()), (AsyncEventKind::Other(77), AsyncElement::Port(1), None));
        assert!(ev(15, p).is_srq_limit());
        assert_eq!(ev(10, port).to_string(), format!("port 1: {}", AsyncEventKind::PortError));
    }

    #[test]
    fn the_log_serves_each_cursor_in_order_and_counts_what_a_slow_one_lost() {
        let mut st = HubState::new();
        let ev = |n: u8| AsyncEvent { kind: AsyncEventKind::PortActive, element: AsyncElement::Port(n) };
        let (mut a, mut lost_a) = (st.oldest(), 0);
        assert_eq!(st.take(&mut a, &mut lost_a), None);
        for n in 0..3 {
            st.push(ev(n));
        }
        // A cursor made now starts at the oldest kept event: it sees all three.
        let (mut b, mut lost_b) = (st.oldest(), 0);
        for n in 0..3 {
            assert_eq!(st.take(&mut a, &mut lost_a), Some(ev(n)));
            assert_eq!(st.take(&mut b, &mut lost_b), Some(ev(n)));
        }
        assert_eq!(st.take(&mut a, &mut lost_a), None);
        // `b` falls LOG_LEN + 5 behind: it loses the 5 oldest, then gets the rest in order.
        for n in 0..(LOG_LEN as u64 + 5) {
            st.push(ev(n as u8));
        }
        assert_eq!(st.take(&mut b, &mut lost_b), Some(ev(5)));
        assert_eq!(lost_b, 5);
        let mut got = 1;
        while st.take(&mut b, &mut lost_b).is_some() {
            got += 1;
        }
        assert_eq!((got, lost_b), (LOG_LEN, 5));
    }

    /// A link that counts the `COMM_EST` notices it is asked to send.
    #[derive(Default)]
    struct Counting(AtomicU32);

    impl Link for Counting {
        fn destroy(&self, _qp: *mut ffi::ibv_qp) -> i32 {
            0
        }
        fn disconnect(&self) -> Result<()> {
            Ok(())
        }
        fn comm_established(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The routing that answers `COMM_EST` (rxe never raises it, so the device suite cannot):
    /// the event of a registered QP with a link is answered once per event, through that QP's
    /// link only; other kinds, other QPs, a CQ at the same address and a QP whose link is
    /// gone are not.
    #[test]
    fn comm_est_of_a_cm_qp_is_answered_through_its_link() {
        let mut st = HubState::new();
        let link = Arc::new(Counting::default());
        let other = Arc::new(Counting::default());
        let qp = Arc::new(ObjectEvents::default());
        let as_link = Arc::clone(&link) as Arc<dyn Link>;
        qp.answer_with(Arc::downgrade(&as_link));
        qp.answer_with(Arc::downgrade(&(Arc::clone(&other) as Arc<dyn Link>))); // set once only
        st.objects.insert((Subject::Qp, 0x1000), Arc::clone(&qp));
        let plain = Arc::new(ObjectEvents::default()); // a QP no CM drives
        st.objects.insert((Subject::Qp, 0x3000), Arc::clone(&plain));
        let ev = |kind, element| AsyncEvent { kind, element };
        st.dispatch(&ev(AsyncEventKind::CommEstablished, AsyncElement::Qp(0x1000)));
        assert_eq!((link.0.load(Ordering::Relaxed), qp.answered()), (1, 1));
        assert_eq!(qp.last(), Some(AsyncEventKind::CommEstablished));
        for e in [
            ev(AsyncEventKind::CommEstablished, AsyncElement::Qp(0x2000)), // not registered
            ev(AsyncEventKind::CommEstablished, AsyncElement::Qp(0x3000)), // no link
            ev(AsyncEventKind::CqError, AsyncElement::Cq(0x1000)),
            ev(AsyncEventKind::SqDrained, AsyncElement::Qp(0x1000)),
            ev(AsyncEventKind::PathMigrated, AsyncElement::Qp(0x1000)),
        ] {
            st.dispatch(&e);
        }
        assert_eq!((link.0.load(Ordering::Relaxed), qp.answered(), other.0.load(Ordering::Relaxed)), (1, 1, 0));
        assert_eq!(plain.last(), Some(AsyncEventKind::CommEstablished));
        st.dispatch(&ev(AsyncEventKind::CommEstablished, AsyncElement::Qp(0x1000)));
        assert_eq!(link.0.load(Ordering::Relaxed), 2, "each COMM_EST is answered");
        // The link gone (its QP dropped): nothing is called, nothing panics.
        drop((as_link, link));
        st.dispatch(&ev(AsyncEventKind::CommEstablished, AsyncElement::Qp(0x1000)));
        assert_eq!(qp.answered(), 2);
    }

    #[test]
    fn objects_keep_the_first_fatal_event_and_the_limit_flag() {
        let o = ObjectEvents::default();
        assert_eq!((o.last(), o.fatal(), o.limit()), (None, None, false));
        o.deliver(AsyncEventKind::CommEstablished);
        assert_eq!((o.last(), o.fatal()), (Some(AsyncEventKind::CommEstablished), None));
        o.deliver(AsyncEventKind::QpAccessError);
        o.deliver(AsyncEventKind::QpFatal);
        assert_eq!((o.last(), o.fatal()), (Some(AsyncEventKind::QpFatal), Some(AsyncEventKind::QpAccessError)));
        o.deliver(AsyncEventKind::SrqLimitReached);
        assert!(o.limit());
        o.clear_limit();
        assert!(!o.limit());
    }
}
