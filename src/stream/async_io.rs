//! The stream under tokio (feature `tokio`): [`AsyncRead`] and [`AsyncWrite`], and the async
//! connect and accept.
//!
//! The protocol engine is the blocking stream's: a poll reaps the CQ, handles what came and
//! sends the credit update that is due, exactly as a blocking read or write does. Only the
//! sleep differs. Where a blocking call sleeps on the lane's completion channel in slices and
//! looks at the CM's events between them, a pending poll registers the task's waker with two
//! descriptors, both watched by the runtime's reactor: the CQ's completion channel (armed
//! first, then polled once more, so that a completion that came before the arming is found
//! and one that comes after it raises an event) and the connection's own CM event channel
//! (the peer's departure). A task that waits costs nothing until one of them fires.
//!
//! These impls have no timeouts of their own, as tokio's sockets have none: wrap a call in
//! `tokio::time::timeout` to bound it.

use std::io;
use std::net::{Shutdown, SocketAddr};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::{Error, Result};
use crate::stream::conn::{accept_request, StreamListener, MIN_HANDSHAKE};
use crate::stream::engine::Stream;

/// The tasks waiting on one stream: the last reader and the last writer (after
/// `tokio::io::split` they are two tasks). The stream registers one waker with the reactor,
/// made from this once at set-up, which wakes both: tokio keeps only the latest waker of a
/// descriptor, and a reader that handles the completion a writer waits for would otherwise
/// leave that writer asleep.
#[derive(Default)]
pub(super) struct Wakers {
    tasks: std::sync::Mutex<[Option<Waker>; 2]>,
}

/// Which of [`Wakers`]' tasks a poll is for.
#[derive(Clone, Copy)]
enum Dir {
    Read = 0,
    Write = 1,
}

impl Wakers {
    /// Keeps `w` as the `dir` task's waker.
    fn set(&self, dir: Dir, w: &Waker) {
        let mut tasks = crate::wait::lock(&self.tasks);
        let slot = &mut tasks[dir as usize];
        if !slot.as_ref().is_some_and(|old| old.will_wake(w)) {
            *slot = Some(w.clone());
        }
    }

    /// Wakes the task of the other direction, if one waits: this poll may have handled what
    /// it waits for (the reader the credits a writer needs, or the reverse) without an event
    /// reaching it (its runtime's reactor may be another, whose registration saw none).
    fn wake_other(&self, dir: Dir) {
        let other = match dir {
            Dir::Read => Dir::Write,
            Dir::Write => Dir::Read,
        };
        let task = crate::wait::lock(&self.tasks)[other as usize].take();
        if let Some(task) = task {
            task.wake();
        }
    }
}

impl Wake for Wakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let [r, w] = std::mem::take(&mut *crate::wait::lock(&self.tasks));
        // Woken outside the lock: a waker may run its task's poll at once.
        for task in [r, w].into_iter().flatten() {
            task.wake();
        }
    }
}

/// Whether a poll of the CQ's or the CM channel's readiness woke the task, or registered it.
fn ready_or_registered(
    r: Poll<io::Result<tokio::io::unix::AsyncFdReadyGuard<'_, crate::wait::Fd>>>,
) -> io::Result<bool> {
    match r {
        Poll::Ready(Ok(mut guard)) => {
            // Cleared only if no readiness came since this one (tokio compares the event's
            // tick): whatever comes from here on wakes the task again.
            guard.clear_ready();
            Ok(true)
        }
        Poll::Ready(Err(e)) => Err(e),
        Poll::Pending => Ok(false),
    }
}

impl Stream {
    /// Makes progress without blocking: handles what the CQ holds and, when nothing came,
    /// registers the task to be woken by the next completion or CM event. `Ready` when the
    /// stream's state may have changed (completions handled, the peer gone, the stream
    /// broken): the caller looks again. `Pending` when the task is registered with both
    /// descriptors and nothing is there. An error when the task cannot wait here (no tokio
    /// runtime with an IO driver): the stream itself stays as it was.
    fn poll_progress(&mut self, cx: &mut Context<'_>, dir: Dir) -> Poll<io::Result<()>> {
        self.wakers.set(dir, cx.waker());
        let r = self.poll_progress_once();
        if matches!(r, Poll::Ready(Ok(()))) {
            self.wakers.wake_other(dir);
        }
        r
    }

    /// [`Stream::poll_progress`] after the task's waker is kept: registers the waker that
    /// wakes both tasks.
    fn poll_progress_once(&mut self) -> Poll<io::Result<()>> {
        let both = Waker::from(Arc::clone(&self.wakers));
        let cx = &mut Context::from_waker(&both);
        loop {
            if self.fatal.is_some() || self.peer_gone {
                return Poll::Ready(Ok(()));
            }
            // Polled here too, though the caller polled last: what this poll handles is
            // progress the other direction's task may wait for, and only a `Ready` from here
            // wakes it (`wake_other`).
            if self.poll_now() > 0 || self.fatal.is_some() {
                return Poll::Ready(Ok(()));
            }
            let Ok(rt) = tokio::runtime::Handle::try_current() else {
                return Poll::Ready(Err(io::Error::other(no_runtime())));
            };
            let rt = rt.id();
            let cq = self.lane.cq_ref();
            let cq_fd = match cq.reactor().get(cq.as_raw_fd(), rt) {
                Ok(a) => a,
                Err(e) => return Poll::Ready(Err(io::Error::other(e.to_string()))),
            };
            // An event was raised since the last arming: the CQ is disarmed and holds the
            // completion that raised it (the next round's poll finds it).
            match ready_or_registered(cq_fd.poll_read_ready(cx)) {
                Ok(true) => {
                    self.cq_armed = false;
                    continue;
                }
                Ok(false) => {}
                Err(e) => {
                    self.fail(io::ErrorKind::Other, format!("tokio readiness of the CQ's channel: {e}"));
                    return Poll::Ready(Ok(()));
                }
            }
            if !self.cq_armed {
                // Reads (and acknowledges) the events read so far, then arms; a completion
                // that came before the arming raised no event, so poll once more.
                if let Err(e) = self.lane.arm() {
                    self.fail(io::ErrorKind::Other, e.to_string());
                    return Poll::Ready(Ok(()));
                }
                self.cq_armed = true;
                if self.poll_now() > 0 || self.fatal.is_some() {
                    return Poll::Ready(Ok(()));
                }
            }
            let ch = &self.channel;
            let ch_fd = match ch.reactor().get(ch.as_raw_fd(), rt) {
                Ok(a) => a,
                Err(e) => return Poll::Ready(Err(io::Error::other(e.to_string()))),
            };
            if let Err(e) = ready_or_registered(ch_fd.poll_read_ready(cx)) {
                self.fail(io::ErrorKind::Other, format!("tokio readiness of the CM's channel: {e}"));
                return Poll::Ready(Ok(()));
            }
            // Registered with the channel: an event read here or coming later is seen.
            if matches!(self.lane.peer_left(self.qp), Ok(true)) {
                self.peer_gone = true;
                return Poll::Ready(Ok(()));
            }
            return Poll::Pending;
        }
    }

    /// Wakes the other direction's task when completions were handled since `seen` (a count
    /// of [`Stream::poll_now`]'s): the credits, space or data it waits for may be among them,
    /// and no event may reach it for them.
    fn woke_other_if_handled(&mut self, seen: u64, dir: Dir) {
        if self.handled != seen {
            self.wakers.wake_other(dir);
        }
    }

    /// `poll_flush`'s work: waits until every send posted has completed, then says what
    /// became of them.
    fn poll_sends(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let seen = self.handled;
        self.poll_now();
        self.woke_other_if_handled(seen, Dir::Write);
        while !self.sends_done() && self.fatal.is_none() && !self.peer_gone {
            std::task::ready!(self.poll_progress(cx, Dir::Write))?;
        }
        Poll::Ready(self.sends_result())
    }

    /// [`Stream::connect`] for async code: the CM's steps run on tokio's blocking pool
    /// (`spawn_blocking`), so the runtime's threads never wait on them.
    ///
    /// # Errors
    /// As for [`Stream::connect`]; [`Error::InvalidArgument`] outside a tokio runtime.
    pub async fn connect_async(addr: SocketAddr, timeout: Duration) -> Result<Stream> {
        crate::stream::StreamConfig::new().connect_async(addr, timeout).await
    }

    /// [`Stream::shutdown`] for async code, with the same rules: `Write` sends SHUTDOWN, `Both`
    /// DISCONNECT, then it waits for every send to complete. `poll_shutdown` of
    /// [`AsyncWrite`] is this with `Write`.
    ///
    /// # Errors
    /// As for [`Stream::shutdown`], without its timeout.
    pub async fn shutdown_async(&mut self, how: Shutdown) -> io::Result<()> {
        self.mark_shut(how);
        std::future::poll_fn(|cx| self.poll_close(cx)).await
    }

    /// [`Stream::write_region`] for async code: pending while the peer's credits or granted
    /// space run out, and until its last WRITE completes. A future dropped before it ended
    /// leaves part of the range sent, and drops the region (the WRITEs in flight keep its
    /// registration until they complete).
    ///
    /// # Errors
    /// As for [`Stream::write_region`], without its timeout. On a broken stream the region
    /// comes back only if the flush of its WRITEs was already there.
    pub async fn write_region_async(
        &mut self,
        mr: crate::MemoryRegion,
        range: std::ops::Range<usize>,
    ) -> std::result::Result<crate::MemoryRegion, crate::stream::WriteRegionError> {
        use crate::stream::region::{posted_so_far, WriteRegionError};
        if let Err(error) = self.check_region(&mr, &range) {
            return Err(WriteRegionError::new(error, Some(mr)));
        }
        let mut at = range.start;
        let error = std::future::poll_fn(|cx| loop {
            let seen = self.handled;
            let r = if at < range.end {
                self.try_write_region(&mr, &mut at, range.end)
                    .map(|r| r.map_err(|e| posted_so_far(e, &range, at)).err())
                    .filter(|e| e.is_some() || mr.outstanding() == 0)
            } else {
                self.poll_now();
                (mr.outstanding() == 0 || self.fatal.is_some() || self.peer_gone).then(|| self.region_result())
            };
            self.woke_other_if_handled(seen, Dir::Write);
            if let Some(e) = r {
                return Poll::Ready(e);
            }
            if let Err(e) = std::task::ready!(self.poll_progress(cx, Dir::Write)) {
                return Poll::Ready(Some(e));
            }
        })
        .await;
        // A flush not there at once is not waited for: that would block the runtime's thread.
        self.region_back(mr, error, Duration::ZERO)
    }

    /// Sends the close message that is due once a control slot is free, then waits for the
    /// sends. The message is worked out from the stream's state at each poll: a future
    /// dropped before it went out leaves it due for the next shutdown (or the drop's
    /// DISCONNECT).
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.close_due().is_some() {
            while !self.ctrl_free() && self.fatal.is_none() && !self.peer_gone {
                std::task::ready!(self.poll_progress(cx, Dir::Write))?;
            }
            self.send_close();
        }
        self.poll_sends(cx)
    }
}

impl StreamListener {
    /// [`StreamListener::accept`] for async code: waits for a connect request on tokio's
    /// reactor, then accepts it on tokio's blocking pool (the CM's handshake, given at least
    /// 5 s), so the runtime's threads never wait on the CM. Cancel-safe while it waits for a
    /// request; a request taken is accepted (or rejected) even if the future is dropped then.
    ///
    /// # Errors
    /// As for [`StreamListener::accept`], without its timeout; [`Error::InvalidArgument`]
    /// outside a tokio runtime.
    pub async fn accept_async(&self) -> Result<Stream> {
        let req = self.listener().get_request_async().await?;
        let cfg = self.config();
        off_runtime(move || accept_request(req, &cfg, MIN_HANDSHAKE)).await
    }
}

/// Runs `f` on tokio's blocking pool.
pub(super) async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(Error::InvalidArgument(no_runtime()));
    }
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => {
            Err(Error::InvalidArgument(format!("the stream's setup on tokio's blocking pool did not finish: {e}")))
        }
    }
}

fn no_runtime() -> String {
    "the stream's async calls need a tokio runtime with its IO driver (Builder::enable_io or enable_all)".into()
}

impl AsyncRead for Stream {
    /// Reads what has arrived; pending while nothing has. The end of the stream (`Ok` with
    /// nothing read) and the errors are those of [`std::io::Read::read`].
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let s = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            // Zeroes only the part of `buf` never initialised before (tokio remembers).
            let seen = s.handled;
            let r = s.try_read(buf.initialize_unfilled());
            s.woke_other_if_handled(seen, Dir::Read);
            if let Some(r) = r {
                buf.advance(r?);
                return Poll::Ready(Ok(()));
            }
            std::task::ready!(s.poll_progress(cx, Dir::Read))?;
        }
    }
}

impl AsyncWrite for Stream {
    /// Copies as much of `buf` as fits now into the send buffer (or inline) and RDMA-WRITEs
    /// it, as [`std::io::Write::write`] does; pending while nothing fits: no credits, no
    /// granted space or no free send buffer.
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let s = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            let seen = s.handled;
            let r = s.try_write(buf);
            s.woke_other_if_handled(seen, Dir::Write);
            if let Some(r) = r {
                return Poll::Ready(r);
            }
            std::task::ready!(s.poll_progress(cx, Dir::Write))?;
        }
    }

    /// Waits until every WRITE posted has completed, as [`std::io::Write::flush`].
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_sends(cx)
    }

    /// Shuts writing down as [`Stream::shutdown`] with [`Shutdown::Write`] does (rsocket's
    /// SHUTDOWN: the peer's reads end after the data sent so far), then waits for every send
    /// to complete.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let s = self.get_mut();
        s.mark_shut(Shutdown::Write);
        s.poll_close(cx)
    }
}
