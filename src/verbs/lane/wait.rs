//! The lane's waits (which to use when: the module docs' "Waiting"): [`Lane::wait`] sleeps on
//! the CQ's completion channel, [`Lane::spin`] busy-polls, [`Lane::wait_async`] sleeps on
//! tokio's reactor. Each first polls, so a wait that finds a completion costs what a poll does
//! and arms nothing; and each, when it runs out, asks what became of the attached QPs before
//! it says it timed out.
//!
//! The sleeping waits follow the channel's protocol: arm the CQ (`ibv_req_notify_cq`), poll
//! again (a completion that came before the arming raises no event, and this poll finds it;
//! one that comes after it raises one), then sleep on the channel's descriptor, read its
//! events (`ibv_get_cq_event`) and go round. The events are acknowledged in batches, and the
//! rest before the CQ is destroyed (`CompletionQueue`'s drop), as libibverbs requires. The
//! lane is the only reader of its channel: the CQ's own `drain_events` refuses a lane's CQ, so
//! no event a wait sleeps for can be taken from it.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::refused::qp_in_error;
use super::{Completion, Fault, Lane, Wc};
use crate::error::Error;
use crate::error::Result;
use crate::verbs::cq::CompletionQueue;
use crate::verbs::mr::MemoryRegion;
use crate::wait::{poll_readable, pollfd, Deadline};
use std::time::Duration;

/// Empty polls a busy-poll wait makes between two looks at the clock (the coarse clock, read
/// from the vDSO without a system call; still, at some 20 ns a look, not worth paying per
/// poll): the wait ends at most this many polls, and a clock tick, after its timeout.
const CLOCK_EVERY: u32 = 64;

/// Looks at the clock between two reads of the device's asynchronous events by a busy-poll
/// wait (a `poll(2)` with no timeout: a system call, so once every 4,096 empty polls).
const EVENTS_EVERY: u32 = 64;

/// The hints of a wait that ran out with no QP found in the error state.
const NOTHING_POSTED: &str =
    "no work request is outstanding on the lane, so nothing can complete: post a receive (or a send) first";
const NOTHING_CAME: &str = "nothing completed on the lane's CQ, and no attached QP is in the error state: is the peer \
                            alive and doing its part (a receive completes only when the peer sends)?";

impl Lane {
    /// Waits up to `timeout` for the next completion and hands it out as [`Lane::poll`] does,
    /// sleeping on the CQ's completion channel while there is none: no spinning and no sleep
    /// loop, so a lane waiting for a quiet peer costs no CPU. A completion already there is
    /// handed out at the cost of a poll. The default wait: see the module docs' "Waiting" for
    /// when [`Lane::spin`] or `Lane::wait_async` (feature `tokio`) fit better.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing came in time (its hint says whether anything was
    /// outstanding); [`Error::QpInError`] for a QP found in the error state with no completion
    /// of its own saying why: the device reported it with a fatal event (this wait wakes for
    /// those), or it was found there when the wait ran out (on RC, the peer's RDMA WRITE, READ
    /// or atomic with a bad rkey moves the responder there silently, and rxe then never
    /// completes a receive posted to it). That QP's posts are refused with the cause from then
    /// on, and it is reported once. [`Error::AsyncEvent`] when the CQ overran or the device
    /// failed; [`Error::Call`] when a verb or `poll(2)` fails.
    pub fn wait(&mut self, timeout: Duration) -> Result<Completion> {
        let mut out = None;
        self.wait_with(1, timeout, |wc, mr| out = Some(Completion::new(wc, mr)))?;
        out.ok_or_else(nothing_handed)
    }

    /// [`Lane::wait`] for up to `max` completions, handed to `f` as [`Lane::poll_with`] hands
    /// them (oldest first, each with its region); returns how many, at least one. The way to
    /// reap a burst once woken: everything the CQ holds then, up to `max`, in one call. A
    /// `max` of 0 hands out nothing and returns at once.
    ///
    /// # Errors
    /// As for [`Lane::wait`].
    pub fn wait_with(
        &mut self,
        max: usize,
        timeout: Duration,
        mut f: impl FnMut(Wc, Option<MemoryRegion>),
    ) -> Result<usize> {
        let n = self.poll_with(max, &mut f)?;
        if n > 0 || max == 0 {
            return Ok(n);
        }
        self.sleep_until_some(max, timeout, &mut f)
    }

    /// Polls without sleeping until a completion comes or `timeout` has passed, and hands it
    /// out as [`Lane::poll`] does. It answers within a poll of the completion's arrival, and
    /// takes its whole core meanwhile: for a lane on a core of its own whose latency matters
    /// more than the CPU (see the module docs' "Waiting"); [`Lane::wait`] otherwise. The
    /// clock is looked at once every 64 empty polls, the device's asynchronous events once
    /// every 4,096, so the wait ends a clock tick (or 64 polls) after its timeout at most.
    ///
    /// # Errors
    /// As for [`Lane::wait`].
    pub fn spin(&mut self, timeout: Duration) -> Result<Completion> {
        let mut out = None;
        self.spin_with(1, timeout, |wc, mr| out = Some(Completion::new(wc, mr)))?;
        out.ok_or_else(nothing_handed)
    }

    /// [`Lane::spin`] for up to `max` completions, handed to `f` as [`Lane::poll_with`] hands
    /// them; returns how many, at least one (a `max` of 0 hands out nothing and returns at
    /// once).
    ///
    /// # Errors
    /// As for [`Lane::wait`].
    pub fn spin_with(
        &mut self,
        max: usize,
        timeout: Duration,
        mut f: impl FnMut(Wc, Option<MemoryRegion>),
    ) -> Result<usize> {
        let n = self.poll_with(max, &mut f)?;
        if n > 0 || max == 0 {
            return Ok(n);
        }
        self.spin_until_some(max, timeout, &mut f)
    }

    /// The lane's completion queue, to wait on beside other sources: put it in a
    /// [`Readiness`](crate::Readiness) set ([`Readiness::cq`](crate::Readiness::cq)). Its
    /// descriptor is readable once [`Lane::arm`] armed it and a completion came. The lane
    /// stays the CQ's only reader: the CQ's own polls and event reads refuse a lane's CQ, so
    /// this handle can only be waited on.
    pub fn cq(&self) -> Arc<CompletionQueue> {
        Arc::clone(&self.cq)
    }

    /// The lane's CQ, borrowed: for crate-internal waits that register its channel with a
    /// reactor themselves (the stream's `AsyncRead`), without an `Arc` clone per wait.
    #[cfg(feature = "tokio")]
    pub(crate) fn cq_ref(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Makes the lane's CQ descriptor ([`Lane::cq`]) readable at the next completion, for a
    /// loop that waits on it itself: reads (and acknowledges) the events that made it
    /// readable, then arms the CQ (`ibv_req_notify_cq`). Poll until [`Lane::poll`] returns
    /// `None` after arming and before waiting: a completion that came before the arming
    /// raised no event, and only a poll finds it.
    ///
    /// ```no_run
    /// # fn f(lane: &mut rdma_cm::verbs::lane::Lane, ch: &rdma_cm::EventChannel) -> rdma_cm::Result<()> {
    /// use std::time::Duration;
    /// let cq = lane.cq();
    /// let mut ready = rdma_cm::Readiness::new().cq(&cq, "lane").channel(ch, "cm");
    /// loop {
    ///     lane.arm()?;
    ///     while let Some(c) = lane.poll()? {
    ///         println!("{:?} {}", c.status(), c.wr_id()); // and take its region back
    ///     }
    ///     for source in ready.wait(Duration::from_secs(1))? {
    ///         if source == "cm" {
    ///             while let Some(ev) = ch.try_get_event()? { println!("{:?}", ev.event_type()); }
    ///         }
    ///     }
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::Call`] when reading the channel or arming the CQ fails.
    pub fn arm(&mut self) -> Result<()> {
        self.cq.drain_channel()?;
        self.cq.arm_exclusive()
    }

    /// [`Lane::wait`] for async code: sleeps on the CQ's completion channel through tokio's
    /// reactor instead of blocking the thread (the channel is registered with each runtime
    /// once, at its first async wait, and stays so: no system call to register per wait). The
    /// runtime needs its IO and time drivers (`Builder::enable_all`).
    ///
    /// Cancel-safe: a completion is taken from the CQ only in the same step that returns it,
    /// so a future dropped at any point has taken none (what the CQ holds stays for the next
    /// poll or wait), and the regions stay in the lane until their completions are handed out.
    ///
    /// # Errors
    /// As for [`Lane::wait`]; [`Error::InvalidArgument`] outside a tokio runtime, or in one
    /// without its IO or time driver. Unlike the blocking wait it does not wake for the
    /// device's fatal events about a QP (tokio cannot watch the device's event descriptor
    /// for several owners): it finds them at its next wake-up, or when it runs out.
    #[cfg(feature = "tokio")]
    pub async fn wait_async(&mut self, timeout: Duration) -> Result<Completion> {
        let mut out = None;
        self.wait_async_with(1, timeout, |wc, mr| out = Some(Completion::new(wc, mr))).await?;
        out.ok_or_else(nothing_handed)
    }

    /// [`Lane::wait_async`] for up to `max` completions, handed to `f` as
    /// [`Lane::poll_with`] hands them; returns how many, at least one (a `max` of 0 hands out
    /// nothing and returns at once). Cancel-safe as `wait_async` is: `f` is handed completions
    /// only in the step that returns.
    ///
    /// # Errors
    /// As for [`Lane::wait_async`].
    #[cfg(feature = "tokio")]
    pub async fn wait_async_with(
        &mut self,
        max: usize,
        timeout: Duration,
        mut f: impl FnMut(Wc, Option<MemoryRegion>),
    ) -> Result<usize> {
        use std::future::Future;
        use std::task::Context;
        const OP: &str = "Lane::wait_async";
        let n = self.poll_with(max, &mut f)?;
        if n > 0 || max == 0 {
            return Ok(n);
        }
        let mut timer = std::pin::pin!(crate::wait::timer(timeout)?);
        let channel = self.cq.as_raw_fd();
        let mut expired = false;
        loop {
            // Every completion is handed out in the step that returns it: no await between
            // a poll that found some and the return.
            self.cq.arm_exclusive()?;
            let n = self.poll_with(max, &mut f)?;
            if n > 0 {
                return Ok(n);
            }
            self.async_failure(OP, true)?;
            if expired {
                break;
            }
            let woke = crate::wait::readable_any([Some((channel, self.cq.reactor())), None, None], |waker| {
                timer.as_mut().poll(&mut Context::from_waker(waker)).is_ready()
            })
            .await?;
            match woke {
                None => expired = true,
                // The readiness was cleared: read every event, so the next wake-up is a new one.
                // The event disarmed the CQ, and the completion that raised it is there: poll
                // before arming again (an arm is a system call on Soft-RoCE and siw).
                Some(_) => {
                    self.cq.drain_channel()?;
                    let n = self.poll_with(max, &mut f)?;
                    if n > 0 {
                        return Ok(n);
                    }
                }
            }
        }
        self.ran_out(OP, timeout)
    }

    /// The sleeping part of `wait_with`, after a poll found nothing.
    #[inline(never)]
    fn sleep_until_some(
        &mut self,
        max: usize,
        timeout: Duration,
        f: &mut impl FnMut(Wc, Option<MemoryRegion>),
    ) -> Result<usize> {
        const OP: &str = "Lane::wait";
        let mut deadline = Deadline::new(timeout);
        let channel = self.cq.as_raw_fd();
        let events = self.cq.context().as_raw_fd();
        let mut read_events = false;
        loop {
            // Armed before the poll that decides to sleep: a completion that comes after
            // that poll raises an event, which ends the sleep.
            self.cq.arm_exclusive()?;
            let n = self.poll_with(max, &mut *f)?;
            if n > 0 {
                return Ok(n);
            }
            // Fatal events, read by this wait (its members are looked at then) or by anyone.
            self.async_failure(OP, read_events)?;
            let left = deadline.left();
            if left.is_zero() {
                break;
            }
            // The device's event descriptor too, so that a QP going fatal ends the sleep.
            let mut fds = [pollfd(channel), pollfd(events)];
            poll_readable(&mut fds, left)?;
            read_events = fds[1].revents != 0;
            if read_events {
                self.cq.refresh_async()?;
            }
            // One read takes the event that woke us (the CQ raises one per arming). It
            // disarmed the CQ, and the completion that raised it is there: poll before arming
            // again (an arm is a system call on Soft-RoCE and siw).
            if fds[0].revents != 0 && self.cq.take_event()? {
                let n = self.poll_with(max, &mut *f)?;
                if n > 0 {
                    return Ok(n);
                }
            }
        }
        self.ran_out(OP, timeout)
    }

    /// The busy part of `spin_with`, after a poll found nothing.
    #[inline(never)]
    fn spin_until_some(
        &mut self,
        max: usize,
        timeout: Duration,
        f: &mut impl FnMut(Wc, Option<MemoryRegion>),
    ) -> Result<usize> {
        const OP: &str = "Lane::spin";
        let deadline = Deadline::new(timeout);
        let mut looks = 0u32;
        loop {
            for _ in 0..CLOCK_EVERY {
                let n = self.poll_with(max, &mut *f)?;
                if n > 0 {
                    return Ok(n);
                }
                std::hint::spin_loop();
            }
            if deadline.passed() {
                break;
            }
            looks = looks.wrapping_add(1);
            if looks % EVENTS_EVERY == 0 {
                self.cq.refresh_async()?;
                self.async_failure(OP, true)?;
            }
        }
        self.ran_out(OP, timeout)
    }

    /// The error that ends a wait once the device reported the CQ overrun or itself failed
    /// (read by anyone); with `members`, also the first attached QP it reported a fatal event
    /// about, not yet known to have failed (recorded, so its posts are refused and it is
    /// reported once). Reads no events.
    fn async_failure(&mut self, op: &'static str, members: bool) -> Result<()> {
        if let Some(e) = self.cq.async_error(op) {
            return Err(e);
        }
        if !members {
            return Ok(());
        }
        let mut first = None;
        for m in self.members.iter_mut().flatten() {
            if m.failed.is_some() {
                continue;
            }
            if let Some(kind) = m.owner.lane_qp().fatal_mark() {
                m.failed = Some(Fault::Async(kind));
                if first.is_none() {
                    first = Some(qp_in_error(m, Fault::Async(kind), op));
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// A wait ran out: reads the device's pending events and asks it for the state of every
    /// attached QP not yet known to have failed (`ibv_query_qp`, once each), and fails naming
    /// the first found in the error state; else times out, saying whether anything was
    /// outstanding.
    #[cold]
    #[inline(never)]
    fn ran_out(&mut self, op: &'static str, timeout: Duration) -> Result<usize> {
        self.cq.refresh_async()?;
        self.async_failure(op, true)?;
        self.check_silent_errors(op)?;
        let idle =
            self.members.iter().flatten().all(|m| m.send.outstanding() + m.recv.outstanding() == 0) && self.srqs.idle();
        Err(Error::Timeout { op, timeout, addr: None, hint: Some(if idle { NOTHING_POSTED } else { NOTHING_CAME }) })
    }

    /// Asks the device for the state of every member not yet known to have failed; records
    /// those found in the error state (`Fault::Silent`) and names the first.
    fn check_silent_errors(&mut self, op: &'static str) -> Result<()> {
        let mut first = None;
        for m in self.members.iter_mut().flatten() {
            if m.failed.is_some() {
                continue;
            }
            if m.owner.lane_qp().state()? == crate::status::QpState::Error {
                m.failed = Some(Fault::Silent);
                if first.is_none() {
                    first = Some(qp_in_error(m, Fault::Silent, op));
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Never returned: a wait for one completion that returns `Ok` has handed one out.
#[cold]
fn nothing_handed() -> Error {
    Error::InvalidArgument("a lane's wait returned without a completion".into())
}
