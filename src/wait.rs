//! Bounded waits on file descriptors, shared by the CM event channel and the CQ channels.
//!
//! Every blocking step of this crate ends up here: one `poll(2)` with a timeout, then a
//! non-blocking read. The clock is read only when a wait has to be repeated (an interrupted
//! poll, another thread taking the event first, or a wake-up for an event of no interest),
//! because in a guest without a fast clock every `Instant::now()` is a system call (measured:
//! with it, a connection cost ~10 more system calls than the same steps in C). The bound is
//! therefore the timeout, and at most twice the timeout when a wait is repeated.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use crate::error::{errno, Error, Result};

/// A timeout that never ends: every wait of this crate that takes a timeout accepts it and then
/// waits without a bound, as the C API does with -1 (what `rping` does). Use it knowingly: a
/// peer that vanishes without a word then stalls the call for ever. The crate's own defaults
/// are all bounded.
pub const FOREVER: Duration = Duration::MAX;

/// A timeout whose clock starts only if the first wait did not settle things: the first wait
/// gets the whole timeout without reading the clock; from the second on, the time left is
/// measured from the second wait's start. Total: at most twice the timeout.
pub(crate) struct Deadline {
    timeout: Duration,
    first: bool,
    /// Set at the second wait; `Some(None)` when the end is too far away to represent.
    end: Option<Option<Instant>>,
}

impl Deadline {
    pub(crate) fn new(timeout: Duration) -> Deadline {
        Deadline { timeout, first: true, end: None }
    }

    /// Time left for the next wait.
    pub(crate) fn left(&mut self) -> Duration {
        if std::mem::take(&mut self.first) {
            return self.timeout;
        }
        let Some(end) = *self.end.get_or_insert_with(|| Instant::now().checked_add(self.timeout)) else {
            // Too far to represent: no deadline.
            return self.timeout;
        };
        end.saturating_duration_since(Instant::now())
    }
}

/// Waits up to `timeout` for any of `fds` (-1 entries are ignored) to become readable.
/// Returns `Ok(false)` on timeout, `Ok(true)` when readable or interrupted (the caller then
/// tries its non-blocking read and waits again if there was nothing).
pub(crate) fn poll_readable(fds: &mut [libc::pollfd], timeout: Duration) -> Result<bool> {
    // Round up so that a sub-millisecond remainder still waits instead of spinning; beyond
    // what poll(2) takes (24 days), wait without a bound (FOREVER).
    let ms = timeout.as_micros().div_ceil(1000);
    let ms = if ms > i32::MAX as u128 { -1 } else { ms as i32 };
    for f in fds.iter_mut() {
        f.events = libc::POLLIN;
        f.revents = 0;
    }
    // SAFETY: `fds` is a valid, exclusively borrowed array of pollfds for the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    match n {
        0 => Ok(false),
        n if n > 0 => Ok(true),
        _ if errno() == libc::EINTR => Ok(true),
        _ => Err(Error::call("poll", errno(), None)),
    }
}

/// A pollfd for `fd` (or an ignored entry for -1).
pub(crate) fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd { fd, events: libc::POLLIN, revents: 0 }
}

/// Makes `fd` non-blocking with one system call. F_SETFL replaces the status flags, and the
/// others it could change (O_APPEND, O_ASYNC, O_DIRECT, O_NOATIME) are never set on the
/// rdma_cm and uverbs character devices, so reading them first (F_GETFL) is not needed.
pub(crate) fn set_nonblocking(fd: RawFd) -> Result<()> {
    // SAFETY: fcntl(F_SETFL) on a descriptor we own changes only its status flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) } == 0 {
        Ok(())
    } else {
        Err(Error::call("fcntl(O_NONBLOCK)", errno(), None))
    }
}

/// A descriptor's registration with tokio's reactor, kept by the object owning the descriptor
/// (a CQ's completion channel, a CM event channel) for that object's life, so that a wait costs
/// no `epoll_ctl` calls. Made at the first async wait, with the runtime that wait runs on; a
/// wait on another runtime registers the descriptor with that runtime's reactor for the
/// duration of the wait instead (correct, but slower). A descriptor can be registered with one
/// reactor only once, which is why the registration lives in the owner of the descriptor and
/// not in the QPs that share it. The owner drops it ([`Reactor::clear`]) before closing the
/// descriptor.
#[cfg(feature = "tokio")]
#[derive(Default)]
pub(crate) struct Reactor(std::sync::OnceLock<Option<Registered>>);

#[cfg(feature = "tokio")]
pub(crate) struct Registered {
    rt: tokio::runtime::Id,
    fd: tokio::io::unix::AsyncFd<Fd>,
}

/// A descriptor owned elsewhere, for [`tokio::io::unix::AsyncFd`].
#[cfg(feature = "tokio")]
pub(crate) struct Fd(RawFd);

#[cfg(feature = "tokio")]
impl std::os::fd::AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

#[cfg(feature = "tokio")]
fn no_io() -> Error {
    Error::InvalidArgument(
        "the async API needs a tokio runtime with its IO driver enabled (Builder::enable_io or enable_all)".into(),
    )
}

/// Registers `fd` with the current runtime's reactor.
///
/// # Safety
/// `fd` must stay open for as long as the result lives.
#[cfg(feature = "tokio")]
unsafe fn register(fd: RawFd) -> Result<tokio::io::unix::AsyncFd<Fd>> {
    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;
    // tokio panics ("IO is disabled") instead of failing when the runtime has no IO driver,
    // and offers no way to ask first: catch that one panic and report it.
    let attempt = std::panic::catch_unwind(|| {
        // SAFETY: the caller keeps `fd` open for the AsyncFd's life, and Fd::as_raw_fd always
        // returns it.
        unsafe { AsyncFd::register_with_interest(Fd(fd), Interest::READABLE) }
    });
    match attempt {
        Err(_) => Err(no_io()),
        Ok(r) => r.map_err(|e| {
            Error::call("tokio AsyncFd::register", e.into_parts().1.raw_os_error().unwrap_or(libc::EIO), None)
        }),
    }
}

#[cfg(feature = "tokio")]
impl Reactor {
    /// The lasting registration of `fd` (which must be the owner's descriptor, open while
    /// `self` lives), when it belongs to the runtime `rt`; made here at the first call.
    fn get(&self, fd: RawFd, rt: tokio::runtime::Id) -> Option<&tokio::io::unix::AsyncFd<Fd>> {
        let reg = self.0.get_or_init(|| {
            // A failure (a runtime without IO) is not kept as such: such waits register
            // their own and report the error.
            // SAFETY: `fd` is the owner's descriptor, and the owner drops this registration
            // (Reactor::clear) before it closes it.
            unsafe { register(fd) }.ok().map(|fd| Registered { rt, fd })
        });
        reg.as_ref().filter(|r| r.rt == rt).map(|r| &r.fd)
    }

    /// Drops the registration (deregistering the descriptor): the owner calls this before it
    /// closes the descriptor.
    pub(crate) fn clear(&mut self) {
        drop(self.0.take());
    }
}

/// Waits until any of `fds` (-1 entries are ignored) is readable, or `ready` says so, without
/// blocking the runtime. `ready` is asked on every poll of the future, with the task's waker,
/// which it may keep to wake the task later (the event channel's queue does). Returns the
/// index of the descriptor found readable (`None` when `ready` ended the wait).
///
/// Each descriptor comes with its owner's [`Reactor`], whose lasting registration is used when
/// it belongs to the current runtime; otherwise the descriptor is registered for the duration
/// of this call. The readiness a wake-up reports is cleared before returning (tokio keeps it
/// set until then), so callers must read their descriptors without blocking until they are
/// empty or they found what they wait for, before waiting again: every caller does (the CQ
/// drains its channel; the event channel reads before each wait). Any number of tasks may wait
/// on one descriptor: each wake-up wakes them all.
#[cfg(feature = "tokio")]
pub(crate) async fn readable_any(
    fds: [(RawFd, Option<&Reactor>); 3],
    mut ready: impl FnMut(&std::task::Waker) -> bool,
) -> Result<Option<usize>> {
    use std::future::Future;
    use std::pin::pin;
    use std::task::Poll;
    use tokio::io::unix::AsyncFd;

    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return Err(no_io());
    };
    let rt = rt.id();
    // Per descriptor: the lasting registration, or one for this wait (its `AsyncFd` dropped,
    // so deregistered, when the wait returns or is cancelled; callers hold the channel or CQ
    // owning the descriptor across the await).
    let mut own: [Option<AsyncFd<Fd>>; 3] = [None, None, None];
    let mut lasting: [Option<&AsyncFd<Fd>>; 3] = [None, None, None];
    for (i, &(fd, reactor)) in fds.iter().enumerate() {
        if fd < 0 {
            continue;
        }
        lasting[i] = reactor.and_then(|r| r.get(fd, rt));
        if lasting[i].is_none() {
            // SAFETY: `own` is dropped when this function returns or is cancelled, and the
            // callers hold the channel or CQ owning `fd` across the await.
            own[i] = Some(unsafe { register(fd) }?);
        }
    }
    let afds: [Option<&AsyncFd<Fd>>; 3] = std::array::from_fn(|i| lasting[i].or(own[i].as_ref()));
    let mut w0 = pin!(afds[0].map(|a| a.readable()));
    let mut w1 = pin!(afds[1].map(|a| a.readable()));
    let mut w2 = pin!(afds[2].map(|a| a.readable()));
    std::future::poll_fn(|cx| {
        if ready(cx.waker()) {
            return Poll::Ready(Ok(None));
        }
        for (i, w) in [w0.as_mut(), w1.as_mut(), w2.as_mut()].into_iter().enumerate() {
            let Some(w) = w.as_pin_mut() else { continue };
            match w.poll(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    // Cleared only if no new readiness came since this one (tokio compares
                    // the event's tick), so nothing arriving from here on is missed.
                    guard.clear_ready();
                    return Poll::Ready(Ok(Some(i)));
                }
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(Error::call(
                        "tokio readiness",
                        e.raw_os_error().unwrap_or(libc::EIO),
                        None,
                    )))
                }
                Poll::Pending => {}
            }
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_reads_the_clock_only_from_the_second_wait() {
        let mut d = Deadline::new(Duration::from_millis(50));
        assert_eq!(d.left(), Duration::from_millis(50));
        assert!(d.left() <= Duration::from_millis(50));
        assert!(d.left() > Duration::from_millis(30));
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(d.left(), Duration::ZERO);
    }

    #[test]
    fn poll_times_out_and_sees_readable_pipes() {
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two descriptors pipe() writes.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        let mut fds = [pollfd(p[0]), pollfd(-1)];
        assert!(!poll_readable(&mut fds, Duration::from_millis(10)).unwrap());
        // SAFETY: p[1] is the pipe's open write end; one byte from a valid buffer.
        assert_eq!(unsafe { libc::write(p[1], b"x".as_ptr().cast(), 1) }, 1);
        assert!(poll_readable(&mut fds, Duration::from_secs(1)).unwrap());
        set_nonblocking(p[0]).unwrap();
        // SAFETY: fcntl(F_GETFL) on an open descriptor.
        assert_ne!(unsafe { libc::fcntl(p[0], libc::F_GETFL) } & libc::O_NONBLOCK, 0);
        // SAFETY: closing the two descriptors this test opened.
        unsafe {
            libc::close(p[0]);
            libc::close(p[1]);
        }
    }
}
