//! Asynchronous device events (`ibv_get_async_event`): port changes, QP, CQ and SRQ errors,
//! SRQ limits, a failed device. [`AsyncEvents`] is a non-blocking source of them with an
//! [`AsFd`] for event loops (and `AsyncEvents::next_async` under the `tokio` feature); each
//! event is also delivered to the object it names, when this crate owns it.
//!
//! ```no_run
//! use rdma_cm::{VerbsContext, FOREVER};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let ctx = VerbsContext::open("rxe0")?;
//! let mut events = ctx.async_events()?; // also an `AsFd`, for an event loop
//! loop {
//!     let ev = events.next(FOREVER)?;
//!     println!("{:?} on {:?}", ev.kind, ev.element); // e.g. PortActive on Port(1)
//!     if ev.kind.is_fatal() {
//!         break;
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Delivery to objects
//!
//! Every QP, CQ and SRQ this crate creates registers with its context, keyed by its raw handle,
//! and leaves before it is destroyed. An event naming a registered object marks it:
//! [`QueuePair::fatal_event`](crate::QueuePair::fatal_event) and
//! [`QueuePair::last_async_event`](crate::QueuePair::last_async_event),
//! [`CompletionQueue::has_error`](crate::CompletionQueue::has_error),
//! [`SharedReceiveQueue::limit_reached`](crate::SharedReceiveQueue::limit_reached). A QP that
//! went fatal, or one of whose CQs overran, or whose device failed, ends its lane's waits with
//! [`Error::AsyncEvent`] as soon as nothing is left to reap, instead of sleeping to the
//! timeout: [`Lane::wait`](crate::verbs::lane::Lane::wait) watches the context's event
//! descriptor beside the CQ's channel. `Lane::wait_async` (feature `tokio`)
//! checks the same marks at every wake-up but does not watch that descriptor (tokio cannot
//! register one descriptor for several lanes at once); keep an [`AsyncEvents`] source running,
//! or bound it with `tokio::time::timeout`. The element of an event is compared as
//! a number, never dereferenced, so an event about an object this crate does not own (made
//! through [`crate::ffi`]) is still returned, and marks nothing.
//!
//! Nobody has to read events for that to work: whoever notices the descriptor readable (a
//! QP's wait, a query such as `fatal_event`, or an [`AsyncEvents`] source) reads everything
//! pending, delivers it, and keeps it in the context's log for the sources.
//!
//! # Acknowledgement
//!
//! libibverbs' `ibv_destroy_qp`/`_cq`/`_srq` block until every event read about the object has
//! been acknowledged (`ibv_ack_async_event`). Each event is therefore acknowledged right after
//! it is copied and handed to its object (atomic stores, under the context's lock, with no
//! blocking step in between), before anyone sees it. Handing it over before the ack also
//! keeps delivery exact: the object cannot be destroyed, and its address reused by a new one,
//! until the ack. Objects leave the registry before they are destroyed, so the destroy never
//! waits on a lock held by a reader.
//!
//! # Why the descriptor is not the device's own
//!
//! The device's descriptor (`VerbsContext::as_raw_fd`) is not offered as `AsFd`: safe code
//! holding one could read an event from it, which libibverbs then never acknowledges, so the
//! destroy of the object it names would block forever; or clear `O_NONBLOCK`, so that a read
//! blocks. Each [`AsyncEvents`] has its own `epoll` descriptor instead, watching the device's
//! descriptor (level-triggered) and an `eventfd` the context signals when another reader has
//! already taken events this source has not seen. Reading that descriptor fails (`EINVAL`),
//! and changing its flags changes nothing here: the crate never reads it, it only polls it. The
//! device's descriptor itself is read only after `poll` with a zero timeout says it is
//! readable, and is made non-blocking first, so even a raw user who clears `O_NONBLOCK` on it
//! (through `unsafe`) cannot make the crate block, short of also racing to read it.
//!
//! One thing remains possible in safe code: adding other descriptors to a source's `epoll`
//! set (e.g. `rustix::event::epoll::add`). The source then looks readable when they are;
//! its [`AsyncEvents::next`] stays bounded by its timeout, but spins. Don't.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{errno, Error, Result};
pub use crate::status::AsyncEventKind;
use crate::verbs::device::VerbsContext;
pub use crate::verbs::hub::{AsyncElement, AsyncEvent, LOG_LEN};
use crate::wait::{poll_readable, pollfd, Deadline};

/// A source of a context's asynchronous events: non-blocking, with its own descriptor for
/// `epoll`/`poll`/tokio ([`AsFd`]), readable when [`AsyncEvents::try_next`] may have an event.
///
/// Every source sees every event of its context read after it was made, and first the ones the
/// context still keeps (up to [`LOG_LEN`] of the most recent), in order; one that falls more
/// than [`LOG_LEN`] events behind skips the oldest and counts them ([`AsyncEvents::lost`]).
/// The events were delivered to the objects they name before any source sees them.
///
/// ```no_run
/// # fn f(ctx: &rdma_cm::VerbsContext) -> rdma_cm::Result<()> {
/// use std::time::Duration;
/// let mut events = ctx.async_events()?;
/// // In an event loop: wait for `events.as_fd()` to be readable, then drain.
/// while let Some(ev) = events.try_next()? {
///     println!("{ev}");
/// }
/// // Or block, bounded:
/// let ev = events.next(Duration::from_secs(5))?;
/// # Ok(()) }
/// ```
pub struct AsyncEvents {
    /// Our number among the hub's sources.
    id: u64,
    /// The number of the next event to return.
    cursor: u64,
    lost: u64,
    // Drop::drop leaves the hub's list first; then the descriptors close (field order).
    epoll: OwnedFd,
    wake: OwnedFd,
    ctx: VerbsContext,
    /// The epoll descriptor's lasting registrations with tokio's reactors (cleared in Drop,
    /// before the descriptor closes): a wait never registers it for itself, so a forgotten
    /// wait leaves nothing behind.
    #[cfg(feature = "tokio")]
    reactor: crate::wait::Reactor,
}

fn owned(fd: RawFd, op: &'static str) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(Error::call(op, errno(), None));
    }
    // SAFETY: `fd` was just returned by the call that created it and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn epoll_add(epoll: &OwnedFd, fd: RawFd) -> Result<()> {
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
    // SAFETY: both descriptors are open; `ev` is a valid epoll_event the call copies.
    if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        return Err(Error::call("epoll_ctl(ADD)", errno(), None));
    }
    Ok(())
}

impl AsyncEvents {
    /// A new source of `ctx`'s events (also [`VerbsContext::async_events`]).
    ///
    /// # Errors
    /// [`Error::Call`] when `epoll_create1`, `eventfd` or `epoll_ctl` fail (`EMFILE`: out of
    /// descriptors).
    pub fn new(ctx: &VerbsContext) -> Result<AsyncEvents> {
        // SAFETY: plain system calls; the results are checked and owned below.
        let epoll = owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }, "epoll_create1")?;
        // SAFETY: as above.
        let wake = owned(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) }, "eventfd")?;
        epoll_add(&epoll, ctx.as_raw_fd())?;
        epoll_add(&epoll, wake.as_raw_fd())?;
        let (id, cursor) = ctx.hub().add_source(wake.as_raw_fd());
        Ok(AsyncEvents {
            id,
            cursor,
            lost: 0,
            epoll,
            wake,
            ctx: ctx.clone(),
            #[cfg(feature = "tokio")]
            reactor: crate::wait::Reactor::default(),
        })
    }

    /// The context whose events these are.
    pub fn context(&self) -> &VerbsContext {
        &self.ctx
    }

    /// How many events this source skipped because it fell more than [`LOG_LEN`] behind.
    pub fn lost(&self) -> u64 {
        self.lost
    }

    /// The next event from the log, if this source has not seen it.
    fn take(&mut self) -> Option<AsyncEvent> {
        self.ctx.hub().take(&mut self.cursor, &mut self.lost)
    }

    /// The next event, without waiting. Call it until it returns `None` after the descriptor
    /// became readable (that also clears the readiness it owes to other readers).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails with anything but `EAGAIN`.
    pub fn try_next(&mut self) -> Result<Option<AsyncEvent>> {
        let hub = Arc::clone(self.ctx.hub());
        hub.pump()?;
        if let Some(ev) = self.take() {
            return Ok(Some(ev));
        }
        // Nothing for us: clear the wake-up, then look again, so that events another reader
        // logged between the look and the clear are not left without a wake-up.
        let mut buf = 0u64;
        // SAFETY: our open, non-blocking eventfd; 8 bytes into a valid u64.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), (&mut buf as *mut u64).cast(), 8) };
        hub.pump()?;
        Ok(self.take())
    }

    /// Waits up to `timeout` for the next event.
    ///
    /// # Errors
    /// [`Error::Timeout`]; as for [`AsyncEvents::try_next`].
    pub fn next(&mut self, timeout: Duration) -> Result<AsyncEvent> {
        let mut deadline = Deadline::new(timeout);
        loop {
            if let Some(ev) = self.try_next()? {
                return Ok(ev);
            }
            let left = deadline.left();
            if left.is_zero() || !poll_readable(&mut [pollfd(self.epoll.as_raw_fd())], left)? {
                return Err(Error::Timeout {
                    op: "waiting for an async device event",
                    timeout,
                    addr: None,
                    hint: Some("the device reported nothing (port changes, QP/CQ/SRQ errors, SRQ limits)"),
                });
            }
        }
    }

    /// Waits for the next event without blocking a tokio runtime (feature `tokio`). Unbounded
    /// by itself: wrap it in `tokio::time::timeout`. Cancelling it loses no event (events are
    /// taken from the log only when returned). One task at a time may await a given source.
    ///
    /// # Errors
    /// As for [`AsyncEvents::try_next`]; [`Error::InvalidArgument`] outside a runtime with IO.
    #[cfg(feature = "tokio")]
    pub async fn next_async(&mut self) -> Result<AsyncEvent> {
        loop {
            if let Some(ev) = self.try_next()? {
                return Ok(ev);
            }
            crate::wait::readable_any([Some((self.epoll.as_raw_fd(), &self.reactor)), None, None], |_| false).await?;
        }
    }
}

/// The source's own `epoll` descriptor (readable when [`AsyncEvents::try_next`] may have an
/// event), not the device's: see the module docs for why it is safe to hand out.
impl AsFd for AsyncEvents {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

impl AsRawFd for AsyncEvents {
    fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}

impl Drop for AsyncEvents {
    fn drop(&mut self) {
        // Leave the list before the eventfd closes (the fields drop after this).
        self.ctx.hub().remove_source(self.id);
        // Out of tokio's reactors before the epoll descriptor closes.
        #[cfg(feature = "tokio")]
        self.reactor.clear();
    }
}

impl fmt::Debug for AsyncEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncEvents")
            .field("device", &self.ctx.device_name())
            .field("fd", &self.epoll.as_raw_fd())
            .field("lost", &self.lost)
            .finish()
    }
}

impl VerbsContext {
    /// A new source of this context's asynchronous events ([`AsyncEvents::new`]).
    ///
    /// # Errors
    /// As for [`AsyncEvents::new`].
    pub fn async_events(&self) -> Result<AsyncEvents> {
        AsyncEvents::new(self)
    }
}
