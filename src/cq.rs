//! [`CompletionQueue`] with its completion channel, and the typed [`WorkCompletion`].
//!
//! A CQ holds the [`VerbsContext`] it was created on. A [`QueuePair`](crate::QueuePair) holds
//! an `Arc` of each of its CQs, so a CQ is destroyed only after every QP using it.
//!
//! # One CQ, many QPs
//!
//! A CQ may serve any number of QPs (and the receives of shared receive queues). Each CQ keeps
//! a routing table: every `wr_id` the crate posts carries the index of its QP in that table
//! (see `ring::tag`), so whoever polls the CQ, [`CompletionQueue::poll`] or one of its QPs,
//! retires each completion's slot in the QP (or SRQ) that posted it, in O(1) and without
//! allocating. A completion of a QP that is gone, or of a raw post, retires nothing.
//!
//! The CQ also counts what its queues may have outstanding, and refuses a QP that could make it
//! overrun: a CQ serving QPs of depth 16/16 needs room for 32 completions per QP (an SRQ's
//! receives count once, at the SRQ's depth).
//!
//! CQ events are acknowledged in batches (`ibv_ack_cq_events` takes a lock); the remainder is
//! acknowledged before the CQ is destroyed, as libibverbs requires.

use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdma_sys as ffi;

use crate::device::VerbsContext;
use crate::error::{check_ibv, check_ptr, errno, Error, Result};
use crate::ring::{tag, Notify, Queues};
use crate::srq::SrqShared;
use crate::wait::{poll_readable, pollfd, Deadline};

pub use crate::status::{WcOpcode, WcStatus, WorkQueue};

/// How many CQ events are collected before one `ibv_ack_cq_events` call.
const ACK_BATCH: u32 = 64;

/// Completions polled per `ibv_poll_cq` call (the stack array's size).
pub(crate) const POLL_CHUNK: usize = 16;

/// A QP's entry in a CQ's routing table.
struct QpEntry {
    qp_num: u32,
    nonce: u16,
    queues: Arc<Mutex<Queues>>,
}

/// An SRQ whose receives complete on this CQ, and how many of its QPs use the CQ.
struct SrqEntry {
    srq: Arc<SrqShared>,
    users: usize,
}

/// Who a routed completion belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    Qp(u16),
    Srq(u16),
}

/// A CQ's routing table: which QP (or SRQ) each completion retires a slot of.
#[derive(Default)]
pub(crate) struct Router {
    qps: Vec<Option<QpEntry>>,
    free: Vec<u16>,
    srqs: Vec<SrqEntry>,
    /// Completions the attached queues may have outstanding at once.
    reserved: u64,
    /// A QP's poll kept completions of other QPs here: the CQ's own poll looks for them.
    kept: bool,
    /// Wakes a [`CompletionQueue::wait`] asleep while a QP's poll keeps a completion (which
    /// took the CQ's entry, and perhaps its event, from under the sleeper).
    notify: Notify,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the data consistent at each step, so a poisoned lock (a
    // panic elsewhere while holding it) is used as it is.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Router {
    /// Reserves room for `n` more outstanding completions on a CQ of `depth`.
    pub(crate) fn reserve(&mut self, n: u64, depth: u32) -> Result<()> {
        if self.reserved + n > depth as u64 {
            return Err(Error::InvalidArgument(format!(
                "the CQ holds {depth} completions and its queues may already have {} outstanding: {n} more could overrun it; create it deeper (the sum of the depths of the queues it serves), resize it (CompletionQueue::resize), or let it grow as queues join (CompletionQueue::set_auto_grow)",
                self.reserved
            )));
        }
        self.reserved += n;
        Ok(())
    }

    pub(crate) fn unreserve(&mut self, n: u64) {
        self.reserved = self.reserved.saturating_sub(n);
    }

    /// Enters a QP; returns its index (the `owner` of its `wr_id`s on this CQ).
    pub(crate) fn attach_qp(&mut self, qp_num: u32, nonce: u16, queues: Arc<Mutex<Queues>>) -> Result<u16> {
        let e = Some(QpEntry { qp_num, nonce, queues });
        if let Some(i) = self.free.pop() {
            self.qps[i as usize] = e;
            return Ok(i);
        }
        if self.qps.len() > u16::MAX as usize {
            return Err(Error::InvalidArgument("a CQ serves at most 65536 QPs".into()));
        }
        self.qps.push(e);
        Ok((self.qps.len() - 1) as u16)
    }

    /// Removes a QP (after it was destroyed): its late completions retire nothing.
    pub(crate) fn detach_qp(&mut self, index: u16) {
        if let Some(e) = self.qps.get_mut(index as usize) {
            if e.take().is_some() {
                self.free.push(index);
            }
        }
    }

    /// Counts one more QP of `srq` when the SRQ completes here already; false when it does not.
    fn add_srq_user(&mut self, srq: &Arc<SrqShared>) -> bool {
        match self.srqs.iter_mut().find(|e| Arc::ptr_eq(&e.srq, srq)) {
            Some(e) => {
                e.users += 1;
                true
            }
            None => false,
        }
    }

    /// Whether the QP about to detach is the last of `srq`'s on this CQ (the SRQ's entry goes
    /// with it, so none of its completions may be left in the CQ: see
    /// [`CompletionQueue::detach_srq`]).
    fn last_user_of(&self, srq: &Arc<SrqShared>) -> bool {
        self.srqs.iter().any(|e| Arc::ptr_eq(&e.srq, srq) && e.users == 1)
    }

    /// Only through [`CompletionQueue::detach_srq`], which empties the CQ first.
    fn detach_srq(&mut self, srq: &Arc<SrqShared>) {
        if let Some(i) = self.srqs.iter().position(|e| Arc::ptr_eq(&e.srq, srq)) {
            self.srqs[i].users -= 1;
            if self.srqs[i].users == 0 {
                let e = self.srqs.swap_remove(i);
                self.unreserve(e.srq.depth() as u64);
            }
        }
    }

    /// Retires the slot a raw completion names; the completion for the caller, and its owner.
    /// `None` for a completion that is not the crate's, or names nothing outstanding.
    pub(crate) fn route(&mut self, wc: &ffi::ibv_wc) -> Option<(WorkCompletion, Owner)> {
        let t = tag::decode(wc.wr_id)?;
        if t.srq {
            let e = self.srqs.iter().find(|e| e.srq.id == t.owner)?;
            let id = e.srq.slots().complete(&t)?;
            if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                // A failed receive moves the QP that consumed it to the error state (a flush
                // says it is there already): its posts must be refused, as for its own receives.
                if let Some(qp) = self.qps.iter().flatten().find(|q| q.qp_num == wc.qp_num) {
                    lock(&qp.queues).note_status(wc.status);
                }
            }
            return Some((WorkCompletion::from_raw(wc, id, WorkQueue::Recv), Owner::Srq(t.owner)));
        }
        let e = self.qps.get(t.owner as usize)?.as_ref()?;
        if e.qp_num != wc.qp_num || e.nonce != t.nonce {
            return None;
        }
        let mut q = lock(&e.queues);
        let id = q.complete(&t)?;
        q.note_status(wc.status);
        drop(q);
        let queue = if t.recv { WorkQueue::Recv } else { WorkQueue::Send };
        Some((WorkCompletion::from_raw(wc, id, queue), Owner::Qp(t.owner)))
    }

    /// A QP kept one of its own completions (polled on its own, without [`Router::keep`]):
    /// the CQ's own poll looks for it.
    pub(crate) fn note_kept(&mut self) {
        self.kept = true;
        self.notify.bump();
    }

    /// Whether completions are kept here for the CQ's own poll to deliver.
    fn has_kept(&self) -> bool {
        self.kept || self.srqs.iter().any(|e| e.srq.slots().has_kept())
    }

    /// Keeps a routed completion for its owner's next poll or wait.
    /// The QP's wait, asleep or about to sleep, is told (`ring::Notify`), so a completion kept
    /// for a QP waited on by another thread is never missed.
    pub(crate) fn keep(&mut self, wc: WorkCompletion, owner: Owner) {
        match owner {
            Owner::Qp(i) => {
                if let Some(Some(e)) = self.qps.get(i as usize) {
                    let mut q = lock(&e.queues);
                    q.keep(wc);
                    q.notify.bump();
                    drop(q);
                    self.kept = true;
                    self.notify.bump();
                }
            }
            Owner::Srq(id) => {
                // Kept for the QP that consumed the receive; every live QP whose receives
                // complete on this CQ is in this table.
                let Some(qp) = self.qps.iter().flatten().find(|e| e.qp_num == wc.qp_num()) else {
                    // That QP is gone: no poll or wait can ever take the completion, and kept it
                    // would count against the SRQ's room for good. Its slot (and the region it
                    // held) was retired by `route`; the completion is dropped, as a dropped QP's
                    // own completions are.
                    return;
                };
                if let Some(e) = self.srqs.iter().find(|e| e.srq.id == id) {
                    e.srq.slots().keep(wc);
                    lock(&qp.queues).notify.bump();
                    self.notify.bump();
                }
            }
        }
    }

    /// Moves completions that QPs' polls kept (for other QPs, or in this CQ's SRQs) into `out`.
    fn deliver_kept(&mut self, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        if self.kept {
            for e in self.qps.iter().flatten() {
                n += lock(&e.queues).deliver_kept(None, &mut out[n..]);
            }
            // All delivered (or `out` is full and the next poll looks again).
            self.kept = n == out.len();
        }
        for e in &self.srqs {
            let mut slots = e.srq.slots();
            while n < out.len() {
                match slots.take_kept(|_| true) {
                    Some(wc) => {
                        out[n] = wc;
                        n += 1;
                    }
                    None => break,
                }
            }
        }
        n
    }
}

/// A completion queue and the completion channel it reports events on.
pub struct CompletionQueue {
    raw: NonNull<ffi::ibv_cq>,
    channel: NonNull<ffi::ibv_comp_channel>,
    /// The completions it holds (what it was created or last resized with); changed only under
    /// the router's lock.
    depth: AtomicU32,
    /// Grows (`ibv_resize_cq`) when a queue joining it would otherwise be refused.
    auto_grow: AtomicBool,
    router: Mutex<Router>,
    /// Whether the channel's descriptor was made non-blocking (done at first use, to keep two
    /// syscalls off CQ creation).
    nonblocking: AtomicBool,
    unacked: AtomicU32,
    /// Its place in the context's registry of async events (left before the CQ is destroyed).
    async_reg: crate::async_event::Registration,
    /// The channel's lasting registration with tokio's reactor, made at the first async wait.
    #[cfg(feature = "tokio")]
    reactor: crate::wait::Reactor,
    /// The CQ of a [`Lane`](crate::lane::Lane), which is its only reader: the crate's own polls
    /// refuse it (`poll_raw`), so no completion of the lane can be taken elsewhere.
    exclusive: bool,
    // Dropped after the CQ and channel are destroyed (Drop::drop runs first).
    ctx: VerbsContext,
}

// SAFETY: CQ verbs (poll, req_notify, get/ack events, destroy) are thread-safe in libibverbs;
// the counters are atomics, and destruction happens once, in Drop, with no other reference.
unsafe impl Send for CompletionQueue {}
// SAFETY: see the Send impl.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Creates a CQ with room for `depth` completions, with its own completion channel (whose
    /// descriptor this crate makes non-blocking before it first reads it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero depth; [`Error::Call`] when a verb fails.
    pub fn new(ctx: &VerbsContext, depth: u32) -> Result<Arc<CompletionQueue>> {
        if depth == 0 || depth > i32::MAX as u32 {
            return Err(Error::InvalidArgument(format!("CQ depth {depth} must be between 1 and {}", i32::MAX)));
        }
        // SAFETY: the context is open while `ctx` lives; NULL is checked.
        let channel = check_ptr(unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) }, "ibv_create_comp_channel")?;
        // SAFETY: context and channel valid; cq_context unused (NULL).
        let raw = unsafe { ffi::ibv_create_cq(ctx.as_raw(), depth as i32, std::ptr::null_mut(), channel.as_ptr(), 0) };
        let raw = match check_ptr(raw, "ibv_create_cq") {
            Ok(r) => r,
            Err(e) => {
                // SAFETY: the channel has no CQ attached; destroy it once.
                unsafe { ffi::ibv_destroy_comp_channel(channel.as_ptr()) };
                return Err(e);
            }
        };
        let cq = CompletionQueue {
            raw,
            channel,
            depth: AtomicU32::new(depth),
            auto_grow: AtomicBool::new(false),
            router: Mutex::new(Router::default()),
            nonblocking: AtomicBool::new(false),
            unacked: AtomicU32::new(0),
            async_reg: crate::async_event::Registration::new(
                ctx,
                crate::async_kind::Subject::Cq,
                raw.as_ptr() as usize,
            ),
            #[cfg(feature = "tokio")]
            reactor: crate::wait::Reactor::default(),
            exclusive: false,
            ctx: ctx.clone(),
        };
        Ok(Arc::new(cq))
    }

    /// A CQ for a [`Lane`](crate::lane::Lane): as [`CompletionQueue::new`], and every poll of
    /// the crate's other paths refuses it.
    pub(crate) fn new_exclusive(ctx: &VerbsContext, depth: u32) -> Result<Arc<CompletionQueue>> {
        let mut cq = Self::new(ctx, depth)?;
        if let Some(c) = Arc::get_mut(&mut cq) {
            c.exclusive = true;
        }
        Ok(cq)
    }

    /// Makes the channel's descriptor non-blocking, once. Everything that reads the channel
    /// calls this first, so no read can block; [`AsFd`] users get it through
    /// [`CompletionQueue::drain_events`].
    fn ensure_nonblocking(&self) -> Result<()> {
        if self.nonblocking.load(Ordering::Acquire) {
            return Ok(());
        }
        // Idempotent, so a race between two threads here is harmless.
        crate::wait::set_nonblocking(self.as_raw_fd())?;
        self.nonblocking.store(true, Ordering::Release);
        Ok(())
    }

    /// The raw CQ. It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.raw.as_ptr()
    }

    /// The completions it holds: the depth it was created with, or last resized to
    /// ([`CompletionQueue::resize`]).
    pub fn depth(&self) -> u32 {
        self.depth.load(Ordering::Acquire)
    }

    /// Changes how many completions the CQ holds (`ibv_resize_cq`); completions in it are kept.
    /// The crate counts what the queues it serves may have outstanding, so a depth below that
    /// is refused before the call. Polls of this crate are held off during the resize (they
    /// take the same lock); raw polls of [`CompletionQueue::as_raw`] must not run meanwhile.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth of 0, above `i32::MAX`, or below what its queues
    /// may have outstanding; [`Error::Call`] when `ibv_resize_cq` fails (`EINVAL` beyond the
    /// device's `max_cqe` or below the completions it holds now, `EOPNOTSUPP` where the
    /// provider cannot resize).
    pub fn resize(&self, depth: u32) -> Result<()> {
        let mut router = self.router();
        let reserved = router.reserved;
        if depth == 0 || depth > i32::MAX as u32 || (depth as u64) < reserved {
            return Err(Error::InvalidArgument(format!(
                "CQ depth {depth}: must be between 1 and {} and at least the {reserved} completions its queues may have outstanding",
                i32::MAX
            )));
        }
        self.resize_locked(&mut router, depth)
    }

    /// `ibv_resize_cq` with the router's lock held (`_router`): no poll of this crate runs.
    fn resize_locked(&self, _router: &mut Router, depth: u32) -> Result<()> {
        // SAFETY: the CQ is valid while `self` lives, and no poll of this crate runs while the
        // router is locked (every poll and arm path takes it), so the provider may replace its
        // queue.
        check_ibv(unsafe { ffi::ibv_resize_cq(self.as_raw(), depth as i32) }, "ibv_resize_cq")?;
        self.depth.store(depth, Ordering::Release);
        Ok(())
    }

    /// Lets the CQ grow as queues join it: a QP (or SRQ) that would make its queues' possible
    /// outstanding completions exceed its depth resizes it (`ibv_resize_cq`, to twice the
    /// depth or what is needed, within the device's `max_cqe`) instead of being refused. So a
    /// CQ shared by many connections need not be sized up front for all of them. It never
    /// shrinks by itself. Off by default.
    pub fn set_auto_grow(&self, on: bool) {
        self.auto_grow.store(on, Ordering::Relaxed);
    }

    /// Whether the CQ grows as queues join it ([`CompletionQueue::set_auto_grow`]).
    pub fn auto_grow(&self) -> bool {
        self.auto_grow.load(Ordering::Relaxed)
    }

    /// Reserves room for `n` more outstanding completions (a queue joining), growing the CQ
    /// first when it may ([`CompletionQueue::set_auto_grow`]).
    pub(crate) fn reserve(&self, router: &mut Router, n: u64) -> Result<()> {
        let depth = self.depth();
        if router.reserved + n > depth as u64 && self.auto_grow() {
            let need = router.reserved + n;
            let max = self.ctx.limits()?.max_cqe as u64;
            if need > max {
                return Err(Error::InvalidArgument(format!(
                    "the CQ's queues would have {need} completions outstanding, beyond device {}'s max_cqe of {max}: use another CQ for the next QPs",
                    self.ctx.device_name()
                )));
            }
            let want = need.max(depth as u64 * 2).min(max).min(i32::MAX as u64) as u32;
            self.resize_locked(router, want)?;
        }
        router.reserve(n, self.depth())
    }

    /// Registers an SRQ whose receives complete here (once per CQ; counted per QP), reserving
    /// room for its depth when it is new here.
    pub(crate) fn attach_srq(&self, srq: &Arc<SrqShared>) -> Result<()> {
        let mut router = self.router();
        if router.add_srq_user(srq) {
            return Ok(());
        }
        if router.srqs.iter().any(|e| e.srq.id == srq.id) {
            return Err(Error::InvalidArgument("another SRQ with the same tag already completes on this CQ".into()));
        }
        self.reserve(&mut router, srq.depth() as u64)?;
        router.srqs.push(SrqEntry { srq: Arc::clone(srq), users: 1 });
        Ok(())
    }

    /// The context it was created on.
    pub fn context(&self) -> &VerbsContext {
        &self.ctx
    }

    /// The routing table (locked).
    pub(crate) fn router(&self) -> MutexGuard<'_, Router> {
        lock(&self.router)
    }

    /// Polls up to `out.len()` completions of every QP and SRQ this CQ serves, without
    /// waiting: each retires its slot (releasing the region its work request held) and comes
    /// back with its QP number ([`WorkCompletion::qp_num`]) and the caller's `wr_id`. This is
    /// how a server polls one CQ shared by many connections. Completions that a QP's own poll
    /// or wait met and kept for another QP (a QP being dropped reaps its work that way) come
    /// first.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut router = self.router();
        let mut filled = router.deliver_kept(out);
        while filled < out.len() {
            let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
            let want = (out.len() - filled).min(POLL_CHUNK);
            let got = match self.poll_raw(&mut raw[..want]) {
                Ok(got) => got,
                // What was reaped already is returned; the error comes back on the next poll.
                Err(_) if filled > 0 => break,
                Err(e) => return Err(e),
            };
            for wc in &raw[..got] {
                // SAFETY: ibv_poll_cq initialised the first `got` entries.
                let wc = unsafe { wc.assume_init_ref() };
                if let Some((done, _)) = router.route(wc) {
                    out[filled] = done;
                    filled += 1;
                }
            }
            if got < want {
                break;
            }
        }
        Ok(filled)
    }

    /// Waits up to `timeout` for completions of any QP this CQ serves and polls them into
    /// `out`: polls, then arms the CQ and sleeps on its channel. Returns 0 only when the
    /// timeout passed. One thread at a time should wait on a CQ.
    ///
    /// # Errors
    /// [`Error::Call`] when polling or the channel fails; [`Error::AsyncEvent`] when nothing is
    /// left to reap and the device reported the CQ overrun ([`CompletionQueue::has_error`]).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let mut deadline = Deadline::new(timeout);
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            self.req_notify(false)?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            if let Some(e) = self.async_reg.error("waiting on a CQ") {
                return Err(e);
            }
            let left = deadline.left();
            if left.is_zero() {
                return Ok(0);
            }
            // Announce the sleep: a QP's poll that keeps a completion from here on (taking the
            // CQ's entry, and perhaps its event) wakes it; one kept already is polled first.
            let notify_fd = {
                let mut r = self.router();
                if r.has_kept() {
                    continue;
                }
                let fd = r.notify.fd()?;
                r.notify.sleeping = true;
                fd
            };
            // The context's async events too, so that an overrun ends the wait at once.
            let mut fds = [pollfd(self.as_raw_fd()), pollfd(self.ctx.as_raw_fd()), pollfd(notify_fd)];
            let slept = poll_readable(&mut fds, left);
            self.router().notify.sleeping = false;
            slept?;
            if fds[2].revents != 0 {
                crate::wait::eventfd_clear(notify_fd);
            }
            if fds[1].revents != 0 {
                self.async_reg.refresh(&self.ctx)?;
            }
            self.drain_events()?;
        }
    }

    /// Whether the device reported this CQ in error (`IBV_EVENT_CQ_ERR`: it overran, so
    /// completions were lost), or itself failed, after reading what is pending. Once it did,
    /// [`CompletionQueue::wait`] fails with [`Error::AsyncEvent`] when it finds nothing to
    /// reap. See [`crate::async_event`].
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn has_error(&self) -> Result<bool> {
        self.async_reg.refresh(&self.ctx)?;
        Ok(self.async_reg.fatal().is_some())
    }

    /// The error a wait on this CQ (or on a QP using it) returns once the device reported it
    /// unusable; reads nothing.
    pub(crate) fn async_error(&self, op: &'static str) -> Option<Error> {
        self.async_reg.error(op)
    }

    /// The last asynchronous event the device reported about this CQ, after reading what is
    /// pending.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn last_async_event(&self) -> Result<Option<crate::AsyncEventKind>> {
        self.async_reg.refresh(&self.ctx)?;
        Ok(self.async_reg.events().last())
    }

    /// The channel's registration with tokio's reactor (see [`crate::wait::Reactor`]).
    #[cfg(feature = "tokio")]
    pub(crate) fn reactor(&self) -> &crate::wait::Reactor {
        &self.reactor
    }

    /// Whether a QP's poll kept completions for this CQ's poll: readiness that `poll(2)` on
    /// the channel cannot see (`crate::ready`).
    pub(crate) fn has_kept(&self) -> bool {
        self.router().has_kept()
    }

    /// Asks for an event on the channel at the next completion (`ibv_req_notify_cq`).
    ///
    /// # Errors
    /// [`Error::Call`] when the verb fails.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // Under the router's lock, so that it never runs during a resize.
        let _router = self.router();
        // SAFETY: the CQ is valid while `self` lives.
        check_ibv(unsafe { ffi::ibv_req_notify_cq(self.as_raw(), solicited_only as i32) }, "ibv_req_notify_cq")
    }

    /// Reads every pending event from the non-blocking channel and returns how many there were.
    /// Acks are batched. Call after the descriptor became readable (edge-triggered safe).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_cq_event` fails with anything but `EAGAIN`.
    pub fn drain_events(&self) -> Result<u32> {
        self.ensure_nonblocking()?;
        let mut n = 0;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut cq_ctx = std::ptr::null_mut();
            // SAFETY: channel valid; out-pointers valid. The fd is non-blocking, so this
            // returns -1/EAGAIN instead of waiting when no event is pending.
            let ret = unsafe { ffi::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut cq_ctx) };
            if ret != 0 {
                let e = errno();
                if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                    return Ok(n);
                }
                return Err(Error::call("ibv_get_cq_event", e, None));
            }
            n += 1;
            if self.unacked.fetch_add(1, Ordering::AcqRel) + 1 >= ACK_BATCH {
                self.ack_pending();
            }
        }
    }

    fn ack_pending(&self) {
        let n = self.unacked.swap(0, Ordering::AcqRel);
        if n > 0 {
            // SAFETY: we received `n` events for this CQ on its channel and ack each once.
            unsafe { ffi::ibv_ack_cq_events(self.as_raw(), n) };
        }
    }

    /// One QP of `srq` leaves this CQ (it is destroyed, or was never created). With the last
    /// one the SRQ's routing entry goes, and first every completion the CQ holds is routed and
    /// kept for its owner: an SRQ's tag is only 16 bits, so a completion of it left in the CQ
    /// could be taken by a later SRQ given the same tag, which would release a receive the
    /// device still owns. No completion of the SRQ can come later (its QPs here are gone). If
    /// that poll fails, the entry stays (and with it the SRQ and its tag on this CQ).
    pub(crate) fn detach_srq(&self, srq: &Arc<SrqShared>) {
        let mut router = self.router();
        if !router.last_user_of(srq) || self.sweep(&mut router).is_ok() {
            router.detach_srq(srq);
        }
    }

    /// Routes every completion the CQ holds now, keeping each for its owner (QP or SRQ).
    fn sweep(&self, router: &mut Router) -> Result<()> {
        loop {
            let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
            let got = self.poll_raw(&mut raw)?;
            for wc in &raw[..got] {
                // SAFETY: ibv_poll_cq initialised the first `got` entries.
                let wc = unsafe { wc.assume_init_ref() };
                if let Some((done, owner)) = router.route(wc) {
                    router.keep(done, owner);
                }
            }
            if got < POLL_CHUNK {
                return Ok(());
            }
        }
    }

    /// Polls up to `out.len()` raw completions (`ibv_poll_cq`).
    pub(crate) fn poll_raw(&self, out: &mut [std::mem::MaybeUninit<ffi::ibv_wc>]) -> Result<usize> {
        if self.exclusive {
            return Err(lane_owned());
        }
        let n = out.len().min(i32::MAX as usize) as i32;
        // SAFETY: the CQ is valid; `out` has room for `n` entries that the provider writes.
        let ret = unsafe { ffi::ibv_poll_cq(self.as_raw(), n, out.as_mut_ptr().cast()) };
        if ret < 0 {
            // ibv_poll_cq's convention: a negative value, errno not reliably set.
            return Err(Error::call("ibv_poll_cq", if ret == -1 { libc::EIO } else { ret.saturating_neg() }, None));
        }
        Ok(ret as usize)
    }
}

/// The refusal of a poll of a [`Lane`](crate::lane::Lane)'s CQ by anyone but the lane.
#[cold]
fn lane_owned() -> Error {
    Error::InvalidArgument(
        "this CQ belongs to a Lane, which is its only reader: poll it through the lane (Lane::poll)".into(),
    )
}

/// The descriptor is offered as `AsRawFd` only: safe code cannot borrow it into a `File` to
/// read events behind the library's back, or clear `O_NONBLOCK` on it.
///
/// ```compile_fail
/// use std::os::fd::AsFd;
/// fn f(cq: &rdma_cm::CompletionQueue) {
///     let _owned = cq.as_fd().try_clone_to_owned();
/// }
/// ```
impl AsRawFd for CompletionQueue {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is valid while `self` lives; `fd` is plain data.
        unsafe { (*self.channel.as_ptr()).fd }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        self.ack_pending();
        // Out of the registry before the destroy (see crate::async_event).
        self.async_reg.leave();
        // Out of tokio's reactor before the channel's descriptor closes.
        #[cfg(feature = "tokio")]
        self.reactor.clear();
        // SAFETY: every QP using this CQ holds an Arc of it, so none is alive; all events are
        // acked above. The CQ and then its channel are destroyed exactly once.
        let ret = unsafe { ffi::ibv_destroy_cq(self.as_raw()) };
        if ret != 0 {
            // Whatever the routing table still holds stays held: the CQ, and so the QPs on
            // it, may still exist.
            std::mem::forget(std::mem::take(self.router.get_mut().unwrap_or_else(|e| e.into_inner())));
            crate::report_leak("ibv_destroy_cq", ret);
            return; // the channel is still in use by the leaked CQ
        }
        // SAFETY: no CQ is attached to the channel any more.
        let ret = unsafe { ffi::ibv_destroy_comp_channel(self.channel.as_ptr()) };
        if ret != 0 {
            crate::report_leak("ibv_destroy_comp_channel", ret);
        }
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("depth", &self.depth()).field("fd", &self.as_raw_fd()).finish()
    }
}

/// A work completion, copied out of the CQ.
///
/// Kept as the provider wrote it (`ibv_wc`'s fields in `ibv_wc`'s order, the `wr_id` the
/// caller's), so that reaping one is a plain copy; the accessors decode.
#[derive(Clone, Copy, Default)]
pub struct WorkCompletion {
    pub(crate) wr_id: u64,
    /// `ibv_wc_status`, as the provider wrote it ([`WorkCompletion::status`] decodes it).
    pub(crate) status: u32,
    pub(crate) opcode: u32,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    /// The immediate data in network order, when `wc_flags` has `IBV_WC_WITH_IMM`.
    pub(crate) imm: u32,
    pub(crate) qp_num: u32,
    /// The sender's QP number (UD receives).
    pub(crate) src_qp: u32,
    pub(crate) wc_flags: u32,
    pub(crate) pkey_index: u16,
    pub(crate) slid: u16,
    pub(crate) sl: u8,
    pub(crate) dlid_path_bits: u8,
    pub(crate) queue: WorkQueue,
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id)
            .field("status", &self.status())
            .field("opcode", &self.opcode)
            .field("vendor_err", &self.vendor_err)
            .field("byte_len", &self.byte_len)
            .field("imm", &self.imm_data())
            .field("qp_num", &self.qp_num)
            .field("queue", &self.queue)
            .field("src_qp", &self.src_qp)
            .field("wc_flags", &self.wc_flags)
            .field("pkey_index", &self.pkey_index)
            .field("slid", &self.slid)
            .field("sl", &self.sl)
            .field("dlid_path_bits", &self.dlid_path_bits)
            .finish()
    }
}

impl WorkCompletion {
    #[inline(always)]
    pub(crate) fn from_raw(wc: &ffi::ibv_wc, wr_id: u64, queue: WorkQueue) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status: wc.status,
            opcode: wc.opcode,
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            // SAFETY: both members of the union are u32s, so either reads a valid value; it
            // is read as immediate data only when IBV_WC_WITH_IMM says it is one.
            imm: unsafe { wc.imm_data_invalidated_rkey_union.imm_data },
            qp_num: wc.qp_num,
            src_qp: wc.src_qp,
            wc_flags: wc.wc_flags,
            pkey_index: wc.pkey_index,
            slid: wc.slid,
            sl: wc.sl,
            dlid_path_bits: wc.dlid_path_bits,
            queue,
        }
    }

    /// The completion as libibverbs lays it out (for `ibv_init_ah_from_wc`); `wr_id` is the
    /// caller's, the opcode and status as received.
    pub(crate) fn to_raw(self) -> ffi::ibv_wc {
        ffi::ibv_wc {
            wr_id: self.wr_id,
            status: self.status,
            opcode: self.opcode,
            vendor_err: self.vendor_err,
            byte_len: self.byte_len,
            imm_data_invalidated_rkey_union: ffi::imm_data_invalidated_rkey_union_t { imm_data: self.imm },
            qp_num: self.qp_num,
            src_qp: self.src_qp,
            wc_flags: self.wc_flags,
            pkey_index: self.pkey_index,
            slid: self.slid,
            sl: self.sl,
            dlid_path_bits: self.dlid_path_bits,
        }
    }

    /// The sender's QP number (a UD receive's; meaningless for RC and for sends).
    pub fn src_qp(&self) -> u32 {
        self.src_qp
    }

    /// Whether the received packet carried a GRH (`IBV_WC_GRH`): on RoCE every datagram does,
    /// and the first 40 bytes of the receive buffer hold it ([`crate::Grh`]). On a UD QP those
    /// 40 bytes are taken whether or not a GRH was present.
    pub fn has_grh(&self) -> bool {
        self.wc_flags & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0
    }

    /// The sender's LID (InfiniBand; 0 on RoCE).
    pub fn slid(&self) -> u16 {
        self.slid
    }

    /// The service level of the received packet.
    pub fn sl(&self) -> u8 {
        self.sl
    }

    /// The partition key index of the received packet (UD).
    pub fn pkey_index(&self) -> u16 {
        self.pkey_index
    }

    /// The `wr_id` the caller gave the work request.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.status)
    }

    /// Whether it succeeded.
    #[inline]
    pub fn is_ok(&self) -> bool {
        self.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// `Ok(self)` on success, else [`Error::WorkCompletion`] with the status and vendor error.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] when the status is not `SUCCESS`.
    pub fn ok(self) -> Result<WorkCompletion> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion { wr_id: self.wr_id, status: self.status(), vendor_err: self.vendor_err })
        }
    }

    /// The operation, for successful completions (`None` otherwise: the field is undefined
    /// for errors).
    pub fn opcode(&self) -> Option<WcOpcode> {
        self.is_ok().then(|| WcOpcode::from_raw(self.opcode))
    }

    /// Bytes received (receives) or transferred (RDMA READ).
    pub fn byte_len(&self) -> u32 {
        self.byte_len
    }

    /// The provider-specific error code.
    pub fn vendor_err(&self) -> u32 {
        self.vendor_err
    }

    /// Immediate data in host order, when the peer sent any: on a receive's completion only.
    /// (`IBV_WC_WITH_IMM` is defined for receives; rxe also sets it on the sender's completion
    /// of a send or WRITE with immediate, with the value 0, which is not data anyone sent.)
    pub fn imm_data(&self) -> Option<u32> {
        (self.queue == WorkQueue::Recv && self.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            .then(|| u32::from_be(self.imm))
    }

    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The queue the work request was posted to.
    pub fn queue(&self) -> WorkQueue {
        self.queue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping() {
        use ffi::ibv_wc_status::*;
        assert_eq!(WcStatus::from_raw(IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(WcStatus::from_raw(IBV_WC_RNR_RETRY_EXC_ERR), WcStatus::RnrRetryExcErr);
        assert_eq!(WcStatus::from_raw(IBV_WC_WR_FLUSH_ERR).to_string(), "WR_FLUSH_ERR");
        assert_eq!(WcStatus::from_raw(4242), WcStatus::Other(4242));
        assert!(WcStatus::RnrRetryExcErr.hint().unwrap().contains("no receive posted"));
    }

    #[test]
    fn failed_completion_becomes_error_and_hides_opcode() {
        let wc = WorkCompletion {
            status: ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
            vendor_err: 0x81,
            wr_id: 9,
            ..Default::default()
        };
        assert_eq!(wc.opcode(), None);
        let e = wc.ok().unwrap_err();
        let m = e.to_string();
        assert!(m.contains("REM_ACCESS_ERR") && m.contains("0x81") && m.contains("rkey"), "{m}");
        let ok = WorkCompletion { opcode: ffi::ibv_wc_opcode::IBV_WC_RECV, ..Default::default() };
        assert_eq!(ok.opcode(), Some(WcOpcode::Recv));
    }
}
