//! [`CompletionQueue`] with its completion channel. A [`Lane`](crate::verbs::lane::Lane) makes
//! its own and is its only reader ([`Lane::cq`](crate::verbs::lane::Lane::cq) lends it, to be
//! armed and waited on beside other descriptors); its completions come through the lane.
//!
//! A CQ holds the [`VerbsContext`] it was created on. A [`QueuePair`](crate::QueuePair) holds
//! an `Arc` of each of its CQs, so a CQ is destroyed only after every QP using it.
//!
//! A CQ counts what its queues may have outstanding: a CQ serving QPs of depth 16/16 needs room
//! for 32 completions per QP (an SRQ's receives count once, at the SRQ's depth). Any CQ but a
//! lane's refuses a QP that could make it overrun; a lane grows its own when it attaches one.
//!
//! CQ events are acknowledged in batches (`ibv_ack_cq_events` takes a lock); the remainder is
//! acknowledged before the CQ is destroyed, as libibverbs requires.

use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rdma_sys as ffi;

use crate::error::{check_ibv, check_ptr, errno, Error, Result};
use crate::verbs::device::VerbsContext;
use crate::verbs::srq::SrqShared;
use crate::wait::lock;

pub use crate::status::{WcOpcode, WcStatus, WorkQueue};

/// How many CQ events are collected before one `ibv_ack_cq_events` call.
const ACK_BATCH: u32 = 64;

/// A completion queue and the completion channel it reports events on.
pub struct CompletionQueue {
    raw: NonNull<ffi::ibv_cq>,
    channel: NonNull<ffi::ibv_comp_channel>,
    /// The completions it holds (what it was created or last resized with); changed only under
    /// the router's lock.
    depth: AtomicU32,
    /// Grows (`ibv_resize_cq`) when a queue joining it would otherwise be refused.
    accounts: Mutex<Accounts>,
    /// Whether the channel's descriptor was made non-blocking (done at first use, to keep two
    /// syscalls off CQ creation).
    nonblocking: AtomicBool,
    unacked: AtomicU32,
    /// Its place in the context's registry of async events (left before the CQ is destroyed).
    async_reg: crate::verbs::hub::Registration,
    /// The channel's lasting registration with tokio's reactor, made at the first async wait.
    #[cfg(feature = "tokio")]
    reactor: crate::wait::Reactor,
    /// The CQ of a [`Lane`](crate::verbs::lane::Lane), which is its only reader: the crate's
    /// other polls refuse it (`poll_raw`), so no completion of the lane can be taken elsewhere.
    exclusive: bool,
    // Dropped after the CQ and channel are destroyed (Drop::drop runs first).
    ctx: VerbsContext,
}

// SAFETY: CQ verbs (poll, req_notify, get/ack events, destroy) are thread-safe in libibverbs;
// the counters are
// atomics, and destruction happens once, in Drop, with no other reference.
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
        crate::error::clear_errno();
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
        Ok(Arc::new(CompletionQueue::from_parts(ctx, raw, channel, depth)))
    }

    /// The value owning a CQ just created as `raw` on `channel`.
    pub(crate) fn from_parts(
        ctx: &VerbsContext,
        raw: NonNull<ffi::ibv_cq>,
        channel: NonNull<ffi::ibv_comp_channel>,
        depth: u32,
    ) -> CompletionQueue {
        CompletionQueue {
            raw,
            channel,
            depth: AtomicU32::new(depth),
            accounts: Mutex::new(Accounts::default()),
            nonblocking: AtomicBool::new(false),
            unacked: AtomicU32::new(0),
            async_reg: crate::verbs::hub::Registration::new(
                ctx.hub(),
                crate::status::Subject::Cq,
                raw.as_ptr() as usize,
            ),
            #[cfg(feature = "tokio")]
            reactor: crate::wait::Reactor::default(),
            exclusive: false,
            ctx: ctx.clone(),
        }
    }

    /// A CQ for a [`Lane`](crate::verbs::lane::Lane): as [`CompletionQueue::new`], and every
    /// poll of the crate's other paths refuses it.
    pub(crate) fn new_exclusive(ctx: &VerbsContext, depth: u32) -> Result<Arc<CompletionQueue>> {
        let mut cq = Self::new(ctx, depth)?;
        match Arc::get_mut(&mut cq) {
            Some(c) => c.exclusive = true,
            // Never: the CQ was just made and is not shared yet.
            None => return Err(Error::InvalidArgument("a lane's CQ was shared before it was marked".into())),
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

    /// The completions it holds: the depth it was created with, or that its lane grew it to.
    pub fn depth(&self) -> u32 {
        self.depth.load(Ordering::Acquire)
    }

    /// The completions its queues may have outstanding (what `reserve` counted).
    pub(crate) fn reserved(&self) -> u64 {
        self.accounts().reserved
    }

    /// Resizes a lane's CQ to `depth` (`ibv_resize_cq`); the completions in it are kept, in
    /// order (the provider copies them into the new queue: rxe's `rxe_queue_resize` copies
    /// from the consumer index to the producer index under the CQ's locks).
    ///
    /// # Safety
    /// No poll of this CQ may run during the call: the caller is the lane that owns it, through
    /// `&mut Lane` (the lane is its only reader: every other path refuses to poll it).
    pub(crate) unsafe fn resize_for_lane(&self, depth: u32) -> Result<()> {
        let _accounts = self.accounts();
        // SAFETY: the CQ is valid while `self` lives; no poll runs (the caller's promise), so
        // the provider may replace its queue; the lane keeps the same `ibv_cq` and its context's
        // `poll_cq`, which stay valid across a resize.
        check_ibv(unsafe { ffi::ibv_resize_cq(self.as_raw(), depth as i32) }, "ibv_resize_cq")?;
        self.depth.store(depth, Ordering::Release);
        Ok(())
    }

    /// Counts `n` more completions the CQ's queues may have outstanding. A lane's CQ takes any
    /// number (the lane grows it, or fences the QP, at attach); any other CQ refuses what could
    /// overrun it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the CQ is too shallow for `n` more.
    pub(crate) fn reserve(&self, n: u64) -> Result<()> {
        let mut a = self.accounts();
        if self.exclusive {
            a.reserved += n;
            return Ok(());
        }
        a.reserve(n, self.depth())
    }

    /// Gives back what [`CompletionQueue::reserve`] counted.
    pub(crate) fn unreserve(&self, n: u64) {
        self.accounts().unreserve(n);
    }

    /// Registers an SRQ whose receives complete here (once per CQ; counted per QP), reserving
    /// room for its depth when it is new here.
    pub(crate) fn attach_srq(&self, srq: &Arc<SrqShared>) -> Result<()> {
        let mut a = self.accounts();
        if let Some(e) = a.srqs.iter_mut().find(|e| Arc::ptr_eq(&e.0, srq)) {
            e.1 += 1;
            return Ok(());
        }
        // A QP a lane's CQ has no room for waits for the lane to grow the CQ at attach, but
        // receives posted to an SRQ do not: one the CQ has no room for is refused.
        a.reserve(srq.depth() as u64, self.depth())?;
        a.srqs.push((Arc::clone(srq), 1));
        Ok(())
    }

    /// The context it was created on.
    pub fn context(&self) -> &VerbsContext {
        &self.ctx
    }

    /// Its counts (locked).
    pub(crate) fn accounts(&self) -> MutexGuard<'_, Accounts> {
        lock(&self.accounts)
    }

    /// Whether the device reported this CQ in error (`IBV_EVENT_CQ_ERR`: it overran, so
    /// completions were lost), or itself failed, after reading what is pending. Once it did,
    /// its lane's waits fail with [`Error::AsyncEvent`] when they find nothing to reap. See
    /// [`crate::verbs::async_event`].
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn has_error(&self) -> Result<bool> {
        self.async_reg.refresh()?;
        Ok(self.async_reg.fatal().is_some())
    }

    /// The error a wait on this CQ (or on a QP using it) returns once the device reported it
    /// unusable; reads nothing.
    pub(crate) fn async_error(&self, op: &'static str) -> Option<Error> {
        self.async_reg.error(op)
    }

    /// Reads the device's pending asynchronous events, delivering each to what it names.
    pub(crate) fn refresh_async(&self) -> Result<()> {
        self.async_reg.refresh()
    }

    /// The last asynchronous event the device reported about this CQ, after reading what is
    /// pending.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn last_async_event(&self) -> Result<Option<crate::status::AsyncEventKind>> {
        self.async_reg.refresh()?;
        Ok(self.async_reg.events().last())
    }

    /// The channel's registration with tokio's reactor (see [`crate::wait::Reactor`]).
    #[cfg(feature = "tokio")]
    pub(crate) fn reactor(&self) -> &crate::wait::Reactor {
        &self.reactor
    }

    /// Arms a lane's CQ for its next completion (`ibv_req_notify_cq`), without the router's
    /// lock [`CompletionQueue::req_notify`] takes against a resize: a lane's CQ is never
    /// resized (`resize_locked` refuses it).
    pub(crate) fn arm_exclusive(&self) -> Result<()> {
        debug_assert!(self.exclusive, "only a lane's CQ is armed without the lock");
        // SAFETY: the CQ is valid while `self` lives. A lane's is resized only by the lane's
        // attach, which holds the lane (`&mut`) that every arm goes through: never during one.
        check_ibv(unsafe { ffi::ibv_req_notify_cq(self.as_raw(), 0) }, "ibv_req_notify_cq")
    }

    /// Asks for an event on the channel at the next completion (`ibv_req_notify_cq`).
    ///
    /// # Errors
    /// [`Error::Call`] when the verb fails.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // Under the router's lock, so that it never runs during a resize.
        let _accounts = self.accounts();
        // SAFETY: the CQ is valid while `self` lives.
        check_ibv(unsafe { ffi::ibv_req_notify_cq(self.as_raw(), solicited_only as i32) }, "ibv_req_notify_cq")
    }

    /// Moderates the CQ's events (`ibv_modify_cq`, `IBV_CQ_ATTR_MODERATE`): the device raises
    /// an event once `count` completions have gathered or `period_us` microseconds have passed
    /// since the first, whichever comes first, instead of one per armed completion. Polling is
    /// unaffected. `(0, 0)` turns moderation off where the device takes that.
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the device cannot moderate (Soft-RoCE and Soft-iWARP
    /// cannot: `EOPNOTSUPP`); [`Error::Call`] naming `ibv_modify_cq` otherwise (`EINVAL` beyond
    /// the device's `max_cq_moderation_count`/`_period`, see `ibv_devinfo -v`).
    pub fn set_moderation(&self, count: u16, period_us: u16) -> Result<()> {
        let mut attr = ffi::ibv_modify_cq_attr {
            attr_mask: ffi::ibv_cq_attr_mask::IBV_CQ_ATTR_MODERATE.0,
            moderate: ffi::ibv_moderate_cq { cq_count: count, cq_period: period_us },
        };
        // Under the router's lock, so that it never runs during a resize.
        let _accounts = self.accounts();
        // SAFETY: the CQ is valid while `self` lives; `attr` is fully initialised and lives for
        // the call.
        let ret = unsafe { ffi::ibv_modify_cq(self.as_raw(), &mut attr) };
        match ret {
            0 => Ok(()),
            libc::EOPNOTSUPP | libc::ENOSYS => Err(Error::Unsupported {
                what: "CQ moderation",
                why: format!(
                    "device {} cannot moderate its CQ events (ibv_modify_cq: {})",
                    self.ctx.device_name(),
                    crate::error::errno_name(ret)
                ),
            }),
            e => Err(Error::call("ibv_modify_cq", e, None)),
        }
    }

    /// Reads every pending event from the non-blocking channel and returns how many there were.
    /// Acks are batched. Call after the descriptor became readable (edge-triggered safe).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_cq_event` fails with anything but `EAGAIN`;
    /// [`Error::InvalidArgument`] for the CQ of a [`Lane`](crate::verbs::lane::Lane), whose
    /// waits are the only readers of its channel (an event read here would not wake them).
    pub fn drain_events(&self) -> Result<u32> {
        if self.exclusive {
            return Err(Error::InvalidArgument(
                "this CQ belongs to a Lane, whose waits are the only readers of its channel: wait through the lane \
                 (Lane::wait)"
                    .into(),
            ));
        }
        self.drain_channel()
    }

    /// [`CompletionQueue::drain_events`] for every CQ, a lane's included (its waits call this).
    pub(crate) fn drain_channel(&self) -> Result<u32> {
        let mut n = 0;
        while self.take_event()? {
            n += 1;
        }
        Ok(n)
    }

    /// Reads one event from the channel if one is pending, without blocking; whether there
    /// was one. Enough for a lane's blocking wait once `poll(2)` said the channel is
    /// readable: the lane's CQ is the channel's only one and raises at most one event per
    /// arming, so a second read would only find the channel empty, at the cost of a system
    /// call.
    pub(crate) fn take_event(&self) -> Result<bool> {
        self.ensure_nonblocking()?;
        let mut cq = std::ptr::null_mut();
        let mut cq_ctx = std::ptr::null_mut();
        // SAFETY: channel valid; out-pointers valid. The fd is non-blocking, so this
        // returns -1/EAGAIN instead of waiting when no event is pending.
        let ret = unsafe { ffi::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut cq_ctx) };
        if ret != 0 {
            let e = errno();
            if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                return Ok(false);
            }
            return Err(Error::call("ibv_get_cq_event", e, None));
        }
        if self.unacked.fetch_add(1, Ordering::AcqRel) + 1 >= ACK_BATCH {
            self.ack_pending();
        }
        Ok(true)
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
        let mut a = self.accounts();
        if let Some(i) = a.srqs.iter().position(|e| Arc::ptr_eq(&e.0, srq)) {
            a.srqs[i].1 -= 1;
            if a.srqs[i].1 == 0 {
                let (srq, _) = a.srqs.swap_remove(i);
                a.unreserve(srq.depth() as u64);
            }
        }
    }
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
        // Out of the registry before the destroy (see crate::verbs::async_event).
        self.async_reg.leave();
        // Out of tokio's reactor before the channel's descriptor closes.
        #[cfg(feature = "tokio")]
        self.reactor.clear();
        // SAFETY: every QP using this CQ holds an Arc of it, so none is alive; all events are
        // acked above. The CQ and then its channel are destroyed exactly once.
        let ret = unsafe { ffi::ibv_destroy_cq(self.as_raw()) };
        if ret != 0 {
            // The SRQs it counts stay alive: the CQ may still refer to them.
            std::mem::forget(std::mem::take(self.accounts.get_mut().unwrap_or_else(|e| e.into_inner())));
            crate::error::report_leak("ibv_destroy_cq", ret);
            return; // the channel is still in use by the leaked CQ
        }
        // SAFETY: no CQ is attached to the channel any more.
        let ret = unsafe { ffi::ibv_destroy_comp_channel(self.channel.as_ptr()) };
        if ret != 0 {
            crate::error::report_leak("ibv_destroy_comp_channel", ret);
        }
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("depth", &self.depth()).field("fd", &self.as_raw_fd()).finish()
    }
}

/// What a CQ's queues may have outstanding at once, and the shared receive queues whose
/// receives complete on it (each counted once, at its depth, however many QPs use it).
#[derive(Default)]
pub(crate) struct Accounts {
    pub(crate) reserved: u64,
    srqs: Vec<(Arc<SrqShared>, usize)>,
}

impl Accounts {
    fn reserve(&mut self, n: u64, depth: u32) -> Result<()> {
        if self.reserved + n > depth as u64 {
            return Err(Error::InvalidArgument(format!(
                "the CQ holds {depth} completions and its queues may already have {} outstanding: {n} more could \
                 overrun it; create it deeper (the sum of the depths of the queues it serves)",
                self.reserved
            )));
        }
        self.reserved += n;
        Ok(())
    }

    fn unreserve(&mut self, n: u64) {
        self.reserved = self.reserved.saturating_sub(n);
    }
}
