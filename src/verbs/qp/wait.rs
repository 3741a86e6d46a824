//! Polling and waiting: the QP's polls, blocking waits and their async twins (feature `tokio`).

use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::status::WorkQueue;
use crate::verbs::cq::{CompletionQueue, POLL_CHUNK};
use crate::verbs::ring::{tag, Failure};
use crate::verbs::wc::WorkCompletion;
#[cfg(feature = "tokio")]
use crate::wait::lock;
use crate::wait::{poll_readable, pollfd, Deadline};

use super::{failed_datagram, QueuePair};

/// Polls a blocking wait makes before it arms the CQs and sleeps.
const SYNC_SPINS: u32 = 64;

/// Polls an async wait makes before it arms the CQs and sleeps on tokio's reactor.
#[cfg(feature = "tokio")]
const ASYNC_SPINS: u32 = 1024;

/// Polls between two looks, by a spinning wait that does not take kept completions in its
/// polls (`wait_for`), at the completions other threads' polls kept for its QP since it last
/// looked (one lock of the QP's queues). Each poll takes the CQ's lock, so when others hold it
/// for long (a resize, a poll routing many completions) a long run of polls lasts seconds:
/// looked for once per 4,096 polls, a completion kept for a busy `wait_for` on a shared CQ
/// waited that long, the receiver fell two messages behind, and each message it then missed
/// cost the sender an RNR NAK and 0.66 s (the CM's `min_rnr_timer`): on rxe/6.1 a send's wait
/// overran 10 s (tests/attacks, resizing_a_shared_cq_under_traffic_loses_nothing, 2026-12-03).
const KEPT_EVERY: u32 = 16;

/// What ended a wait on the CQs.
enum Woke {
    /// This many completions were polled into the caller's slice.
    Found(usize),
    /// Another QP's poll kept a completion for this QP (only for waits that do not poll the
    /// kept ones themselves).
    Kept,
    /// The deadline passed.
    TimedOut,
}

/// A descriptor and its owner's reactor registrations, for `readable_any`.
#[cfg(feature = "tokio")]
fn with_fd(fd: RawFd, r: Option<&crate::wait::Reactor>) -> Option<(RawFd, &crate::wait::Reactor)> {
    r.map(|r| (fd, r))
}

impl QueuePair {
    /// Polls both CQs into `out` without waiting; returns how many entries were filled. Each
    /// completion releases the region its work request held (and, on the send queue, those of
    /// earlier unsignaled work requests). Completions kept for this QP come first; those of
    /// other QPs on a shared CQ are kept for them.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    pub fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.poll_on(None, out, true)
    }

    /// Polls only `queue`'s completions into `out`, without waiting. With a CQ shared by
    /// both queues, the other queue's completions met on the way are kept for later.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    pub fn poll_queue(&mut self, queue: WorkQueue, out: &mut [WorkCompletion]) -> Result<usize> {
        self.poll_on(Some(queue), out, true)
    }

    /// Polls `which` queue (or both) into `out`; with `kept`, the completions kept for this QP
    /// come first. A wait for one `wr_id` polls without them: it has looked at them already, and
    /// getting them back would keep it from ever reaching the CQ (or its deadline).
    #[inline(always)]
    fn poll_on(&self, which: Option<WorkQueue>, out: &mut [WorkCompletion], kept: bool) -> Result<usize> {
        if self.srq.is_none() || which == Some(WorkQueue::Send) {
            return self.poll_own(which, out, kept);
        }
        // Each queue's kept completions are delivered under the lock of the CQ it completes
        // on, before that CQ is polled: nothing can be kept for this QP meanwhile, so a later
        // completion never overtakes an earlier one that another thread kept.
        let same = Arc::ptr_eq(&self.send_cq, &self.recv_cq);
        let mut n = 0;
        if which != Some(WorkQueue::Recv) || same {
            let deliver = kept.then_some(if same { which } else { Some(WorkQueue::Send) });
            n += self.poll_cq(&self.send_cq, which, &mut out[n..], deliver)?;
        }
        if which != Some(WorkQueue::Send) && !same {
            n += self.poll_cq(&self.recv_cq, which, &mut out[n..], kept.then_some(Some(WorkQueue::Recv)))?;
        }
        Ok(n)
    }

    /// [`QueuePair::poll_on`] without an SRQ's kept receives to deliver (no SRQ, or only the
    /// send queue asked for): each CQ is polled with this QP's queues locked once, and its own
    /// completions are retired under that lock rather than through the routing table.
    #[inline(always)]
    fn poll_own(&self, which: Option<WorkQueue>, out: &mut [WorkCompletion], kept: bool) -> Result<usize> {
        let same = Arc::ptr_eq(&self.send_cq, &self.recv_cq);
        let mut n = 0;
        // Each queue's kept completions under the lock of the CQ it completes on (see poll_on).
        if which != Some(WorkQueue::Recv) || same {
            let deliver = kept.then_some(if same { which } else { Some(WorkQueue::Send) });
            n += self.poll_cq_own(&self.send_cq, self.send_slot.index, which, out, deliver)?;
        }
        if which != Some(WorkQueue::Send) && !same {
            let deliver = kept.then_some(Some(WorkQueue::Recv));
            n += self.poll_cq_own(&self.recv_cq, self.recv_slot.index, which, &mut out[n..], deliver)?;
        }
        Ok(n)
    }

    /// Polls `cq`, on whose routing table this QP sits at `index`, with the routing table and
    /// then this QP's queues locked (the order `Router::route` takes them in): completions of
    /// `which` queue of this QP go to `out`, after the kept ones when `deliver`; this QP's
    /// others are kept here, everyone else's for their owner.
    #[inline(always)]
    fn poll_cq_own(
        &self,
        cq: &CompletionQueue,
        index: u16,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deliver: Option<Option<WorkQueue>>,
    ) -> Result<usize> {
        let mut router = cq.router();
        let mut q = self.queues();
        let mut filled = match deliver {
            Some(d) if q.has_kept() => q.deliver_kept(d, out),
            _ => 0,
        };
        while filled < out.len() {
            let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
            let want = (out.len() - filled).min(POLL_CHUNK);
            let got = match cq.poll_raw(&mut raw[..want]) {
                Ok(got) => got,
                // What was reaped already is returned; the error comes back on the next poll.
                Err(_) if filled > 0 => break,
                Err(e) => return Err(e),
            };
            for wc in &raw[..got] {
                // SAFETY: ibv_poll_cq initialised the first `got` entries.
                let wc = unsafe { wc.assume_init_ref() };
                let Some(t) = tag::decode(wc.wr_id) else { continue };
                if !t.srq && t.owner == index {
                    // This QP's index: ours, or stale (an earlier QP at the index: the checks
                    // Router::route makes).
                    if wc.qp_num != self.qp_num {
                        continue;
                    }
                    let Some(id) = q.complete(&t, wc.status) else { continue };
                    q.note_status(wc.status);
                    let queue = if t.recv { WorkQueue::Recv } else { WorkQueue::Send };
                    let done = WorkCompletion::from_raw(wc, id, queue);
                    if which.is_none_or(|w| w == queue) {
                        out[filled] = done;
                        filled += 1;
                    } else {
                        q.keep(done);
                        router.note_kept();
                    }
                    continue;
                }
                // Another QP's, or an SRQ's: routed (and kept) without this QP's lock, so that
                // no poll ever holds two QPs' queues at once.
                drop(q);
                if let Some((done, owner)) = router.route(wc) {
                    if done.qp_num() == self.qp_num && which.is_none_or(|q| q == done.queue()) {
                        out[filled] = done;
                        filled += 1;
                    } else {
                        router.keep(done, owner);
                    }
                }
                q = self.queues();
            }
            if got < want {
                break;
            }
        }
        Ok(filled)
    }

    /// Polls `cq`: completions of this QP (of `which` queue) go to `out`; every other one is
    /// kept for its owner.
    ///
    /// With `deliver`, the completions kept for this QP of that queue (`None`: both) come
    /// first, the SRQ's kept receives of this QP among them, delivered under the CQ's lock.
    fn poll_cq(
        &self,
        cq: &CompletionQueue,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deliver: Option<Option<WorkQueue>>,
    ) -> Result<usize> {
        let mut router = cq.router();
        let mut filled = 0;
        if let Some(d) = deliver {
            filled += self.queues().deliver_kept(d, out);
            if d != Some(WorkQueue::Send) {
                if let Some(srq) = &self.srq {
                    filled += srq.deliver_kept_for(self.qp_num, &mut out[filled..]);
                }
            }
        }
        while filled < out.len() {
            let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
            let want = (out.len() - filled).min(POLL_CHUNK);
            let got = match cq.poll_raw(&mut raw[..want]) {
                Ok(got) => got,
                // What was reaped already is returned; the error comes back on the next poll.
                Err(_) if filled > 0 => break,
                Err(e) => return Err(e),
            };
            for wc in &raw[..got] {
                // SAFETY: ibv_poll_cq initialised the first `got` entries.
                let wc = unsafe { wc.assume_init_ref() };
                let Some((done, owner)) = router.route(wc) else { continue };
                let mine = done.qp_num() == self.qp_num && which.is_none_or(|q| q == done.queue());
                if mine {
                    out[filled] = done;
                    filled += 1;
                } else {
                    // Another QP's, or ours of the other queue: kept for the next poll or wait
                    // that asks for it (an SRQ receive stays with its SRQ, under its QP number).
                    router.keep(done, owner);
                }
            }
            if got < want {
                break;
            }
        }
        Ok(filled)
    }

    /// Waits up to `timeout` for at least one completion on either queue and polls it into
    /// `out`.
    ///
    /// It polls first, then arms the CQs and sleeps on their completion channels, so an idle
    /// wait costs no CPU. Returns 0 only when the timeout passed. On CQs shared with QPs that
    /// other threads wait on, a completion another thread's poll keeps for this QP wakes this
    /// wait.
    ///
    /// # Errors
    /// [`Error::Call`] when polling or the channels fail; [`Error::AsyncEvent`] when nothing is
    /// left to reap and the device reported the QP, one of its CQs, or itself unusable;
    /// [`Error::QpInError`] when the timeout passed and the QP is in the error state though
    /// nothing said so (see [`QueuePair::wait_for`]).
    pub fn wait(&mut self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        self.wait_kept(None, out, timeout)
    }

    /// [`QueuePair::wait`] on `which` queue (or both): kept completions come first, and one
    /// kept for this QP by another thread meanwhile ends a sleep.
    fn wait_kept(&mut self, which: Option<WorkQueue>, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        let mut seen = self.queues().notify.seq;
        match self.wait_on(which, out, &mut Deadline::new(timeout), true, &mut seen)? {
            Woke::Found(n) => Ok(n),
            // Not returned with `kept`: a kept completion is polled like any other.
            Woke::Kept => Ok(0),
            Woke::TimedOut => {
                self.check_silent_error("waiting for a completion")?;
                Ok(0)
            }
        }
    }

    /// Makes the blocking waits ([`QueuePair::wait`], [`QueuePair::wait_queue`],
    /// [`QueuePair::wait_for`]) busy-poll: they poll the CQs in a loop until a completion
    /// arrives or the timeout passes, and never sleep on the completion channels. This is what
    /// perftest's latency tools do: the lowest and steadiest latency, for a whole core while
    /// waiting. A busy wait still notices the peer leaving (it looks at the connection's events
    /// without sleeping, every few thousand polls) and still honours its timeout. Off by
    /// default: a wait spins briefly, then sleeps. The async waits are not affected.
    pub fn set_busy_poll(&mut self, on: bool) {
        self.busy_poll = on;
    }

    /// Whether waits busy-poll ([`QueuePair::set_busy_poll`]).
    pub fn busy_poll(&self) -> bool {
        self.busy_poll
    }

    /// Like [`QueuePair::wait`], for one queue only: the other queue's completions stay for
    /// later (in their CQ, or kept when the queues share one).
    ///
    /// # Errors
    /// As for [`QueuePair::wait`].
    pub fn wait_queue(&mut self, queue: WorkQueue, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        self.wait_kept(Some(queue), out, timeout)
    }

    /// The CQs a wait on `which` sleeps on (one entry is None when there is only one).
    /// Borrowed, not cloned: a wait owns nothing, so a wait future that is forgotten
    /// (`mem::forget`) keeps no CQ alive, and a wait makes no reference-count changes.
    fn wait_cqs(&self, which: Option<WorkQueue>) -> [Option<&CompletionQueue>; 2] {
        match which {
            _ if Arc::ptr_eq(&self.send_cq, &self.recv_cq) => [Some(&self.send_cq), None],
            None => [Some(&self.send_cq), Some(&self.recv_cq)],
            Some(WorkQueue::Send) => [Some(&self.send_cq), None],
            Some(WorkQueue::Recv) => [Some(&self.recv_cq), None],
        }
    }

    /// The count of completions other threads' polls kept for this QP (`ring::Notify::seq`),
    /// when it moved on from `seen`.
    fn kept_since(&self, seen: u64) -> Option<u64> {
        let seq = self.queues().notify.seq;
        (seq != seen).then_some(seq)
    }

    /// Polls, then arms the CQs and polls again (so no completion slips between the two);
    /// returns what was found, or 0 when the caller should look at its kept completions
    /// (without `kept`, ones kept for it since `seen`, which end the busy phase unarmed) and
    /// then sleep on the descriptors.
    fn poll_or_arm(
        &self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        kept: bool,
        spins: u32,
        seen: u64,
    ) -> Result<usize> {
        // A short busy phase keeps latency low without burning a core while idle.
        for i in 0..spins {
            let n = self.poll_on(which, out, kept)?;
            if n > 0 {
                return Ok(n);
            }
            if !kept && i % KEPT_EVERY == KEPT_EVERY - 1 && self.kept_since(seen).is_some() {
                return Ok(0);
            }
            std::hint::spin_loop();
        }
        for cq in self.wait_cqs(which).into_iter().flatten() {
            cq.req_notify(false)?;
        }
        self.poll_on(which, out, kept)
    }

    /// The link's descriptor, when waits watch it: once connected, until the peer left.
    fn watch_fd(&self) -> RawFd {
        match &self.link {
            Some(l) if self.connected && !self.peer_left => l.watch_fd().unwrap_or(-1),
            _ => -1,
        }
    }

    /// The descriptors a sleeping wait watches: the CQ channels, and the link's.
    fn wait_fds(&self, which: Option<WorkQueue>) -> [RawFd; 3] {
        let [a, b] = self.wait_cqs(which).map(|cq| cq.map_or(-1, |c| c.as_raw_fd()));
        [a, b, self.watch_fd()]
    }

    /// After a sleep: acks the CQ events and asks the link what woke us.
    fn after_wake(&mut self, which: Option<WorkQueue>, link_ready: bool) -> Result<()> {
        for cq in self.wait_cqs(which).into_iter().flatten() {
            cq.drain_events()?;
        }
        if link_ready {
            self.check_link()?;
        }
        Ok(())
    }

    /// Asks the link whether the peer left (its descriptor was readable), and if so moves the
    /// QP to the error state so its work is flushed.
    fn check_link(&mut self) -> Result<()> {
        if let Some(l) = &self.link {
            if l.peer_left()? {
                self.peer_gone();
            }
        }
        Ok(())
    }

    /// Polls, sleeps on the CQs (and the link, the device's events, and this QP's notify
    /// eventfd) until something arrives or `deadline` passes. With `kept`, completions kept for
    /// this QP are polled like new ones; without (a wait for one `wr_id`, which has looked at
    /// them already), a completion kept for this QP by another QP's poll since `seen` ends the
    /// wait with [`Woke::Kept`], so that the caller looks at it.
    fn wait_on(
        &mut self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deadline: &mut Deadline,
        kept: bool,
        seen: &mut u64,
    ) -> Result<Woke> {
        if out.is_empty() {
            return Ok(Woke::TimedOut);
        }
        if self.busy_poll {
            return self.spin_on(which, out, deadline, kept, seen);
        }
        loop {
            let n = self.poll_or_arm(which, out, kept, SYNC_SPINS, *seen)?;
            if n > 0 {
                return Ok(Woke::Found(n));
            }
            if let Some(e) = self.async_error() {
                return Err(e);
            }
            let left = deadline.left();
            if left.is_zero() {
                return Ok(Woke::TimedOut);
            }
            // Announce the sleep (see ring::Notify): from here on, a completion another QP's
            // poll keeps for this one writes the eventfd; one kept since `seen` ends the sleep
            // before it starts. (The CQ's event alone cannot be relied on: the thread that took
            // the completion may also have taken the event.)
            let notify_fd = {
                let mut q = self.queues();
                if q.notify.seq != *seen {
                    *seen = q.notify.seq;
                    drop(q);
                    if kept {
                        continue;
                    }
                    return Ok(Woke::Kept);
                }
                let fd = q.notify.fd()?;
                q.notify.sleeping = true;
                fd
            };
            // The context's async events too, so that a QP going fatal ends the wait at once.
            let [a, b, c] = self.wait_fds(which);
            let mut fds = [a, b, c, self.pd.context().as_raw_fd(), notify_fd].map(pollfd);
            let slept = poll_readable(&mut fds, left);
            self.queues().notify.sleeping = false;
            slept?;
            if fds[4].revents != 0 {
                crate::wait::eventfd_clear(notify_fd);
            }
            if fds[3].revents != 0 {
                self.async_reg.refresh()?;
            }
            self.after_wake(which, fds[2].revents != 0)?;
        }
    }

    /// The busy-poll wait: polls until something arrives or the deadline passes, looking at
    /// the link (without sleeping) between rounds so that a peer that left is noticed and its
    /// flushed completions are reaped like any others, and (without `kept`) at completions
    /// kept for this QP by others since `seen`.
    fn spin_on(
        &mut self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deadline: &mut Deadline,
        kept: bool,
        seen: &mut u64,
    ) -> Result<Woke> {
        // Polls per round: the link and the async events are read once a round.
        const ROUND: u32 = 4096;
        // Every KEPT_EVERY polls that found nothing, the completions another thread's poll kept
        // for this QP since `seen` are looked at (see KEPT_EVERY) and so is the deadline, on the
        // coarse clock (`Deadline::passed`: the vDSO's CLOCK_MONOTONIC_COARSE, which reads no
        // clock source, so it stays cheap where a precise clock read is a system call, as with
        // the HPET of the project's QEMU guest, 0.8 µs; never early, up to a tick late). Once a
        // round, as before, the deadline was read too late when polls are slow: each takes the
        // CQ's lock, and under a contended lock a round lasts seconds.
        // Out of time on entry (a zero timeout, or a `wait_for` back after `Woke::Kept` with its
        // time used up): one poll and a round's checks, not a round. A stream of keeps thus
        // cannot hold a `wait_for` past its deadline.
        let mut out_of_time = deadline.passed();
        loop {
            let polls = if out_of_time { 1 } else { ROUND };
            for i in 0..polls {
                let n = self.poll_on(which, out, kept)?;
                if n > 0 {
                    return Ok(Woke::Found(n));
                }
                if i % KEPT_EVERY == KEPT_EVERY - 1 {
                    let fresh = if kept { None } else { self.kept_since(*seen) };
                    if let Some(seq) = fresh {
                        *seen = seq;
                        return Ok(Woke::Kept);
                    }
                    if deadline.passed() {
                        out_of_time = true;
                        break;
                    }
                }
                std::hint::spin_loop();
            }
            let link = self.watch_fd();
            if link >= 0 && poll_readable(&mut [pollfd(link)], Duration::ZERO)? {
                self.check_link()?;
            }
            self.async_reg.refresh()?;
            if let Some(e) = self.async_error() {
                return Err(e);
            }
            if out_of_time {
                return Ok(Woke::TimedOut);
            }
        }
    }

    /// After a wait ran out: a connected QP found in the error state though nothing said so
    /// (on RC, the peer's RDMA access with a bad rkey does this to the responder, with no
    /// completion and, on rxe, no async event) is recorded as failed, so posts are refused
    /// from then on, and the wait fails saying so instead of timing out blind.
    fn check_silent_error(&mut self, op: &'static str) -> Result<()> {
        if !self.connected || self.peer_left || self.errored || self.closing {
            return Ok(());
        }
        if self.state()? != crate::status::QpState::Error {
            return Ok(());
        }
        let f = *self.queues().failed.get_or_insert(Failure::FoundInError);
        Err(self.failed_error(f, op))
    }

    /// The refusal (or the wait's error) for a QP known to be in the error state.
    pub(super) fn failed_error(&self, f: Failure, op: &'static str) -> Error {
        if self.datagrams {
            if let Failure::Completion(_) = f {
                return failed_datagram(op);
            }
        }
        let cause = match f {
            Failure::Completion(status) => {
                let st = crate::status::WcStatus::from_raw(status);
                let hint = st.hint().map(|h| format!(" ({h})")).unwrap_or_default();
                format!("a completion failed with {st}{hint}")
            }
            Failure::FoundInError => {
                "it went there with no completion saying why: on RC the usual cause is the peer's \
                RDMA WRITE, READ or atomic naming a wrong rkey or a range outside the region (the responder's QP fails \
                silently), or a local catastrophic error (see `dmesg`)"
                    .into()
            }
        };
        Error::QpInError { op, addr: self.peer_addr(), cause }
    }

    /// Like [`QueuePair::wait`], without blocking a tokio runtime: sleeps on the CQ channels
    /// (and the CM channel, to notice the peer leaving) through tokio's reactor, where the CQ
    /// and the channel stay registered from their first async wait on (no system calls to
    /// register per wait; a wait on another runtime registers for its own duration). Unbounded by
    /// itself: wrap it in `tokio::time::timeout`. Cancelling it (dropping the future) is safe at
    /// any point: the posted work requests, and the regions they hold, stay with the QP until
    /// their completions are polled or the QP is dropped.
    ///
    /// # Errors
    /// As for [`QueuePair::wait`].
    #[cfg(feature = "tokio")]
    pub async fn wait_async(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut seen = self.queues().notify.seq;
        loop {
            // With `kept`, a completion kept by another thread is polled like a new one.
            if let Woke::Found(n) = self.wait_on_async(None, out, true, &mut seen).await? {
                return Ok(n);
            }
        }
    }

    /// [`QueuePair::wait_for`] for async code: waits for `wr_id` on `queue`, failing on any
    /// failed completion of that queue. Unbounded by itself (use `tokio::time::timeout`);
    /// cancellation-safe as [`QueuePair::wait_async`] is.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`], [`Error::Disconnected`].
    #[cfg(feature = "tokio")]
    pub async fn wait_for_async(&mut self, queue: WorkQueue, wr_id: u64) -> Result<WorkCompletion> {
        let mut seen = 0;
        if let Some(r) = self.pick_kept(queue, wr_id, &mut seen) {
            return r;
        }
        let mut wcs = [WorkCompletion::default(); 4];
        loop {
            // Completions are kept or returned within the poll that reaps them, so dropping
            // this future between polls loses none.
            let r = match self.wait_on_async(Some(queue), &mut wcs, false, &mut seen).await? {
                Woke::Found(n) => self.pick(&wcs[..n], queue, wr_id),
                // Another thread kept a completion for this QP: it may be the one.
                Woke::Kept | Woke::TimedOut => self.pick_kept(queue, wr_id, &mut seen),
            };
            if let Some(r) = r {
                return r;
            }
        }
    }

    #[cfg(feature = "tokio")]
    async fn wait_on_async(
        &mut self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        kept: bool,
        seen: &mut u64,
    ) -> Result<Woke> {
        if out.is_empty() {
            return Ok(Woke::Found(0));
        }
        loop {
            // A longer busy phase than the blocking wait's: a sleep through the reactor costs
            // more than one in poll(2) (the runtime's park and wake-up).
            let n = self.poll_or_arm(which, out, kept, ASYNC_SPINS, *seen)?;
            if n > 0 {
                return Ok(Woke::Found(n));
            }
            if let Some(e) = self.async_error() {
                return Err(e);
            }
            let [a, b, c] = self.wait_fds(which);
            // Each descriptor with its owner's lasting reactor registration: no epoll_ctl
            // calls per wait.
            let cqs = self.wait_cqs(which);
            let reactor = |i: usize| cqs[i].map(CompletionQueue::reactor);
            let link = self.link.as_deref().and_then(|l| l.watch_reactor());
            let queues = &self.queues;
            // A completion another QP's poll keeps for this one wakes the task (ring::Notify);
            // one kept since `seen` ends the wait before it sleeps.
            let woke = crate::wait::readable_any(
                [with_fd(a, reactor(0)), with_fd(b, reactor(1)), with_fd(c, link)],
                |waker| {
                    let mut q = lock(queues);
                    if q.notify.seq != *seen {
                        *seen = q.notify.seq;
                        q.notify.waker = None;
                        return true;
                    }
                    if !q.notify.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                        q.notify.waker = Some(waker.clone());
                    }
                    false
                },
            )
            .await;
            lock(&self.queues).notify.waker = None;
            match woke? {
                None if kept => continue,
                None => return Ok(Woke::Kept),
                // The link is read only when its descriptor woke us, as in the blocking wait.
                Some(i) => self.after_wake(which, i == 2)?,
            }
        }
    }

    /// Whether a completion decides a wait for `wr_id` on `queue`: it is that work request,
    /// or a failure of that queue.
    fn decides(wc: &WorkCompletion, queue: WorkQueue, wr_id: u64) -> bool {
        wc.queue() == queue && (wc.wr_id() == wr_id || !wc.is_ok())
    }

    /// The answer a deciding completion gives a wait for `wr_id`: itself, or the error it
    /// carries. The disconnect is named when the peer left and the failed completion is the
    /// awaited one; another work request's failure is reported as such (with its `wr_id`), so
    /// its completion is not lost behind the error.
    fn answer(&self, wc: WorkCompletion, wr_id: u64) -> Result<WorkCompletion> {
        if !wc.is_ok() && self.peer_left && wc.wr_id() == wr_id {
            return Err(Error::Disconnected { op: "waiting for a completion", addr: self.peer_addr() });
        }
        if !wc.is_ok() && wc.wr_id() == wr_id {
            if let Some(e) = self.async_error() {
                return Err(e);
            }
        }
        wc.ok()
    }

    pub(super) fn peer_addr(&self) -> Option<SocketAddr> {
        self.link.as_ref().and_then(|l| l.peer_addr())
    }

    /// A kept completion that decides a wait for `wr_id`, if there is one. `seen` becomes the
    /// count of keeps by others looked at (see `ring::Notify`).
    fn pick_kept(&mut self, queue: WorkQueue, wr_id: u64, seen: &mut u64) -> Option<Result<WorkCompletion>> {
        let wc = {
            let mut q = self.queues();
            *seen = q.notify.seq;
            q.take_kept(queue, |wc| Self::decides(wc, queue, wr_id))
        };
        let wc = wc.or_else(|| {
            let srq = self.srq.as_ref().filter(|_| queue == WorkQueue::Recv)?;
            srq.take_kept_for(self.qp_num, |wc| Self::decides(wc, queue, wr_id))
        })?;
        Some(self.answer(wc, wr_id))
    }

    /// Goes through a batch in order: the first completion that decides the wait answers it;
    /// every other one is kept for a later poll or wait, so none is lost.
    fn pick(&mut self, wcs: &[WorkCompletion], queue: WorkQueue, wr_id: u64) -> Option<Result<WorkCompletion>> {
        let mut found = None;
        let (mut kept_send, mut kept_recv) = (false, false);
        for wc in wcs {
            if found.is_none() && Self::decides(wc, queue, wr_id) {
                found = Some(*wc);
            } else if let (Some(srq), WorkQueue::Recv) = (&self.srq, wc.queue()) {
                srq.shared().slots().keep(*wc);
            } else {
                self.queues().keep(*wc);
                match wc.queue() {
                    WorkQueue::Send => kept_send = true,
                    WorkQueue::Recv => kept_recv = true,
                }
            }
        }
        // The CQ's own poll must look for them too, as when a poll keeps one of its QP's own
        // (`poll_cq_own`). Without this, a CQ poll after the wait found none of them until some
        // other QP's completion was kept (seen on rxe with kernel 6.12, where the other QP's
        // completions came after the wait had ended).
        if kept_send {
            self.send_cq().router().note_kept();
        }
        if kept_recv {
            self.recv_cq().router().note_kept();
        }
        found.map(|wc| self.answer(wc, wr_id))
    }

    /// Waits for the completion with `wr_id` on `queue`, checking every completion of that
    /// queue on the way: a failed completion, or running out of `timeout`, is an error.
    /// Completions of other work requests met on the way are kept, in order, for the next
    /// poll or wait ([`QueuePair::undelivered`] counts them).
    ///
    /// When the timeout passes, the QP's state is asked ([`QueuePair::state`]): a QP in the
    /// error state that no completion explained (the responder of the peer's RDMA access with a
    /// bad rkey gets there silently) fails the wait with [`Error::QpInError`], and its posts
    /// are refused from then on.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] for a failed completion; [`Error::Disconnected`];
    /// [`Error::Timeout`]; [`Error::QpInError`] (above); [`Error::AsyncEvent`] when the device
    /// reported the QP, one of its CQs, or itself unusable (see [`QueuePair::fatal_event`]).
    pub fn wait_for(&mut self, queue: WorkQueue, wr_id: u64, timeout: Duration) -> Result<WorkCompletion> {
        let mut seen = 0;
        if let Some(r) = self.pick_kept(queue, wr_id, &mut seen) {
            return r;
        }
        let mut deadline = Deadline::new(timeout);
        let mut wcs = [WorkCompletion::default(); 4];
        loop {
            let r = match self.wait_on(Some(queue), &mut wcs, &mut deadline, false, &mut seen)? {
                Woke::Found(n) => self.pick(&wcs[..n], queue, wr_id),
                // Another thread's poll kept a completion for this QP: it may be the one.
                Woke::Kept => self.pick_kept(queue, wr_id, &mut seen),
                Woke::TimedOut => {
                    // A completion kept for this QP at the last moment (after the wait's last
                    // look) may be the one: it answers rather than a timeout.
                    if let Some(r) = self.pick_kept(queue, wr_id, &mut seen) {
                        return r;
                    }
                    let op = if queue == WorkQueue::Recv {
                        "waiting for a receive"
                    } else {
                        "waiting for a send completion"
                    };
                    self.check_silent_error(op)?;
                    return Err(Error::Timeout {
                        op,
                        timeout,
                        addr: self.peer_addr(),
                        hint: Some("the peer sent nothing, or is gone without a disconnect (link down?)"),
                    });
                }
            };
            if let Some(r) = r {
                return r;
            }
        }
    }
}
