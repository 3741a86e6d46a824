//! Bounded waits on file descriptors, shared by the CM event channel and the CQ channels.
//!
//! Every blocking step of this crate ends up here: one `poll(2)` with a timeout, then a
//! non-blocking read. A wait that has to be repeated (an interrupted poll, another thread
//! taking the event first, or a wake-up for an event of no interest) gets what is left of the
//! timeout, measured on the coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`, the kernel's
//! tick, which the vDSO serves without a system call on every clock source), so the bound is
//! the timeout, give or take a tick. `Instant::now()` is avoided: in a guest without a fast
//! clock it is a system call (measured: with it, a connection cost ~10 more system calls than
//! the same steps in C). Before, the clock was read only from the second wait, which let a
//! repeated wait last up to twice its timeout: the client's `--timeout 30` connect was seen
//! still waiting 60 s later.

use std::os::fd::RawFd;
use std::time::Duration;

use crate::error::{errno, Error, Result};

/// A timeout that never ends: every wait of this crate that takes a timeout accepts it and then
/// waits without a bound, as the C API does with -1 (what `rping` does). Use it knowingly: a
/// peer that vanishes without a word then stalls the call for ever. The crate's own defaults
/// are all bounded.
pub const FOREVER: Duration = Duration::MAX;

/// A timeout measured from its creation on the coarse monotonic clock: the first wait gets the
/// whole timeout; each later one what is left of it. Total: the timeout (to a clock tick).
pub(crate) struct Deadline {
    timeout: Duration,
    first: bool,
    /// The coarse clock at creation.
    start: Duration,
}

/// The longest the coarse clock lags the monotonic clock: one tick of a kernel built with
/// HZ=100 (Debian's have 250: 4 ms).
const COARSE_TICK: Duration = Duration::from_millis(10);

/// `CLOCK_MONOTONIC_COARSE`: the monotonic clock at the kernel's last tick (1 to 10 ms old).
fn coarse_now() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer for the call; CLOCK_MONOTONIC_COARSE exists on every
    // Linux this crate runs on (2.6.32 on), so it fails only with EFAULT, which `ts` rules out.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32)
}

impl Deadline {
    pub(crate) fn new(timeout: Duration) -> Deadline {
        Deadline { timeout, first: true, start: coarse_now() }
    }

    /// Whether the whole timeout has passed, never early, on the coarse clock alone: that
    /// clock runs up to one tick behind, so the timeout counts as passed once it and one tick
    /// more (`COARSE_TICK`) have passed on it. A zero timeout has passed at once. For a
    /// busy wait, which asks often and cannot afford a precise clock read each time.
    pub(crate) fn passed(&self) -> bool {
        self.timeout.is_zero() || coarse_now().saturating_sub(self.start) >= self.timeout.saturating_add(COARSE_TICK)
    }

    /// Time left for the next wait.
    pub(crate) fn left(&mut self) -> Duration {
        if std::mem::take(&mut self.first) {
            return self.timeout;
        }
        self.timeout.saturating_sub(coarse_now().saturating_sub(self.start))
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

/// A descriptor's registrations with tokio's reactors, kept by the object owning the
/// descriptor (a CQ's completion channel, a CM event channel, an async-event source) for that
/// object's life, so that a wait costs no `epoll_ctl` calls. One registration per runtime that
/// ever waited on it, each made at the first async wait on that runtime and kept from then on.
///
/// Why lasting, and why one per runtime: a descriptor can be registered with one reactor only
/// once (a second registration fails with `EEXIST`), so no wait may register it for itself:
/// two waits on the same runtime would collide, and a wait whose future was forgotten
/// (`mem::forget` never runs its drop) would leave its registration behind for good. The
/// owner drops them all ([`Reactor::clear`]) before closing the descriptor.
///
/// The registrations form an append-only list of `OnceLock`s, so finding this runtime's is a
/// few loads with no lock, and a new runtime appends a node (the one allocation, once per
/// runtime per descriptor).
#[cfg(feature = "tokio")]
#[derive(Default)]
pub(crate) struct Reactor {
    reg: std::sync::OnceLock<Registered>,
    next: std::sync::OnceLock<Box<Reactor>>,
}

#[cfg(feature = "tokio")]
pub(crate) struct Registered {
    rt: tokio::runtime::Id,
    /// The registration, or the errno (0: the runtime has no IO driver) it failed with: kept
    /// as such, so every wait on that runtime reports it.
    fd: std::result::Result<tokio::io::unix::AsyncFd<Fd>, i32>,
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

/// A tokio timer of `timeout` on the current runtime (`FOREVER` is some 30 years there).
///
/// # Errors
/// [`Error::InvalidArgument`] when the runtime has no time driver: tokio panics instead of
/// failing then, and offers no way to ask first, so that one panic is caught and reported.
#[cfg(feature = "tokio")]
pub(crate) fn timer(timeout: Duration) -> Result<tokio::time::Sleep> {
    std::panic::catch_unwind(|| tokio::time::sleep(timeout)).map_err(|_| {
        Error::InvalidArgument(
            "a bounded async wait needs a tokio runtime with its time driver enabled (Builder::enable_time or \
             enable_all)"
                .into(),
        )
    })
}

/// Registers `fd` with the current runtime's reactor; the errno on failure (0: no IO driver).
///
/// # Safety
/// `fd` must stay open for as long as the result lives.
#[cfg(feature = "tokio")]
unsafe fn register(fd: RawFd) -> std::result::Result<tokio::io::unix::AsyncFd<Fd>, i32> {
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
        Err(_) => Err(0),
        Ok(r) => r.map_err(|e| e.into_parts().1.raw_os_error().unwrap_or(libc::EIO)),
    }
}

#[cfg(feature = "tokio")]
impl Reactor {
    /// The lasting registration of `fd` (which must be the owner's descriptor, open while
    /// `self` lives) with the runtime `rt`; made here at that runtime's first call.
    pub(crate) fn get(&self, fd: RawFd, rt: tokio::runtime::Id) -> Result<&tokio::io::unix::AsyncFd<Fd>> {
        let mut node = self;
        loop {
            // SAFETY: `fd` is the owner's descriptor, and the owner drops every registration
            // (Reactor::clear) before it closes it.
            let reg = node.reg.get_or_init(|| Registered { rt, fd: unsafe { register(fd) } });
            if reg.rt == rt {
                return match &reg.fd {
                    Ok(a) => Ok(a),
                    Err(0) => Err(no_io()),
                    Err(e) => Err(Error::call("tokio AsyncFd::register", *e, None)),
                };
            }
            node = node.next.get_or_init(Default::default);
        }
    }

    /// Drops every registration (deregistering the descriptor): the owner calls this before
    /// it closes the descriptor.
    pub(crate) fn clear(&mut self) {
        drop(self.reg.take());
        drop(self.next.take());
    }

    /// Runtimes the descriptor is registered with (for tests).
    #[cfg(test)]
    fn runtimes(&self) -> usize {
        let mut n = 0;
        let mut node = Some(self);
        while let Some(r) = node {
            n += r.reg.get().is_some() as usize;
            node = r.next.get().map(|b| &**b);
        }
        n
    }
}

/// Waits until any of `fds` (`None` entries are ignored) is readable, or `ready` says so,
/// without blocking the runtime. `ready` is asked on every poll of the future, with the task's
/// waker, which it may keep to wake the task later (the event channel's queue does). Returns
/// the index of the descriptor found readable (`None` when `ready` ended the wait).
///
/// Each descriptor comes with its owner's [`Reactor`], whose lasting registration with the
/// current runtime is used (made at the first wait there). Nothing is registered for the
/// duration of one wait, so a cancelled or forgotten wait leaves nothing behind. The readiness a
/// wake-up reports is cleared before returning (tokio keeps it set until then), so callers must
/// read their descriptors without blocking until they are empty or they found what they wait
/// for, before waiting again: every caller does (the CQ drains its channel; the event channel
/// reads before each wait). Any number of tasks may wait on one descriptor: each wake-up wakes
/// them all.
#[cfg(feature = "tokio")]
pub(crate) async fn readable_any(
    fds: [Option<(RawFd, &Reactor)>; 3],
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
    let mut afds: [Option<&AsyncFd<Fd>>; 3] = [None, None, None];
    for (i, f) in fds.iter().enumerate() {
        if let Some((fd, reactor)) = *f {
            if fd >= 0 {
                afds[i] = Some(reactor.get(fd, rt)?);
            }
        }
    }
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

/// Locks `m`. Every critical section leaves its data consistent at each step, so a poisoned
/// lock (a panic elsewhere while holding it) is used as it is.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deadline whose clock started `ago` before now (on the clock it reads), so the tests
    /// need no sleep: the coarse clock is monotonic, so at least `ago` has passed on it.
    fn started_ago(timeout: Duration, ago: Duration) -> Deadline {
        Deadline { start: coarse_now().saturating_sub(ago), ..Deadline::new(timeout) }
    }

    #[test]
    fn deadline_reads_the_clock_only_from_the_second_wait() {
        // The first wait gets the whole timeout, however long ago the deadline was made.
        let mut d = started_ago(Duration::from_millis(50), Duration::from_millis(60));
        assert_eq!(d.left(), Duration::from_millis(50));
        // The second reads the clock: 60 ms of 50 have passed.
        assert_eq!(d.left(), Duration::ZERO);
        let mut fresh = Deadline::new(Duration::from_secs(60));
        assert_eq!(fresh.left(), Duration::from_secs(60));
        assert!(fresh.left() <= Duration::from_secs(60));
        // Passed only once the timeout and one tick of the coarse clock have.
        assert!(started_ago(Duration::from_millis(50), Duration::from_millis(50) + COARSE_TICK).passed());
        assert!(!Deadline::new(Duration::from_secs(60)).passed());
        assert!(Deadline::new(Duration::ZERO).passed());
    }

    /// A repeated wait gets what is left of the timeout, measured from the deadline's creation,
    /// not a fresh timeout from the second wait (which let a wait last twice its timeout).
    #[test]
    fn a_repeated_wait_gets_only_what_is_left_since_the_start() {
        let mut d = started_ago(Duration::from_millis(300), Duration::from_millis(200));
        assert_eq!(d.left(), Duration::from_millis(300), "the first wait: the whole timeout");
        // At least 200 ms have passed since the start.
        let left = d.left();
        assert!(left <= Duration::from_millis(100), "{left:?} left after 200 ms of 300 ms");
        d.start = d.start.saturating_sub(Duration::from_millis(150));
        assert_eq!(d.left(), Duration::ZERO);
    }

    /// One lasting registration per runtime: a second runtime, and a second wait on it, reuse
    /// theirs instead of registering again (which fails with EEXIST).
    #[cfg(feature = "tokio")]
    #[test]
    fn a_descriptor_is_registered_once_per_runtime() {
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two descriptors pipe() writes.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        let mut reactor = Reactor::default();
        let rts: Vec<_> =
            (0..3).map(|_| tokio::runtime::Builder::new_current_thread().enable_io().build().unwrap()).collect();
        for _ in 0..2 {
            for rt in &rts {
                rt.block_on(async {
                    let id = tokio::runtime::Handle::current().id();
                    reactor.get(p[0], id).expect("registered (or reused), never EEXIST");
                    reactor.get(p[0], id).expect("a second wait on the same runtime reuses it");
                });
            }
        }
        assert_eq!(reactor.runtimes(), 3);
        // A runtime without IO gets its error, every time, and no registration.
        let no_io = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let e = no_io.block_on(async { reactor.get(p[0], tokio::runtime::Handle::current().id()).err() });
        assert!(e.unwrap().to_string().contains("IO driver"));
        reactor.clear();
        assert_eq!(reactor.runtimes(), 0);
        // SAFETY: closing the two descriptors this test opened, after their registrations.
        unsafe {
            libc::close(p[0]);
            libc::close(p[1]);
        }
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
