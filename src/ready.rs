//! [`Readiness`]: one thread waiting on event channels, CQs, async event sources and its own
//! descriptors at once, without an async runtime.
//!
//! The crate's descriptors are [`AsRawFd`] only (a borrowed
//! [`AsFd`] would let safe code read them behind the library's back, or clear `O_NONBLOCK`),
//! so a safe program cannot hand them to `poll(2)` itself. A [`Readiness`] borrows the sources
//! for as long as it lives, so every descriptor it polls stays open, and reports which are
//! ready, by a token the caller chooses:
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::{EventChannel, Readiness};
//! use rdma_cm::verbs::lane::Lane;
//!
//! #[derive(Clone, Copy, PartialEq, Debug)]
//! enum Source { Cm, Lane, Stdin }
//!
//! # fn f(ch: &EventChannel, lane: &mut Lane) -> rdma_cm::Result<()> {
//! let stdin = std::io::stdin();
//! let cq = lane.cq();
//! let mut ready = Readiness::new().channel(ch, Source::Cm).cq(&cq, Source::Lane).fd(&stdin, Source::Stdin);
//! lane.arm()?; // a CQ reports a completion only once armed
//! loop {
//!     for source in ready.wait(Duration::from_secs(1))? {
//!         match source {
//!             Source::Cm => {
//!                 while let Some(ev) = ch.try_get_event()? {
//!                     println!("{:?}", ev.event_type()); // or hand it to its connection
//!                 }
//!             }
//!             Source::Lane => {
//!                 lane.arm()?; // read the event and re-arm before polling, so nothing is missed
//!                 while let Some(c) = lane.poll()? {
//!                     println!("{:?}", c.status()); // and take its region back
//!                 }
//!             }
//!             Source::Stdin => return Ok(()),
//!         }
//!     }
//! }
//! # }
//! ```
//!
//! # Semantics
//!
//! [`Readiness::wait`] is one `poll(2)`: **level-triggered**. A source reported ready stays
//! ready until it is drained, so drain it (or do not mind seeing it again):
//!
//! - an [`EventChannel`]: call [`EventChannel::try_get_event`] until it returns `None`. A channel
//!   is also reported ready, without waiting, when the crate's own targeted waits kept events on
//!   it that an untargeted read would return: those are no longer in the kernel's queue, so
//!   `poll(2)` alone would not see them.
//! - a [`CompletionQueue`], such as a lane's ([`Lane::cq`](crate::verbs::lane::Lane::cq)):
//!   ready when its completion channel has an event, that is, only after it was armed and a
//!   completion arrived. For a lane: [`Lane::arm`](crate::verbs::lane::Lane::arm) before the
//!   first wait; when it is ready, `arm` again, then [`Lane::poll`](crate::verbs::lane::Lane::poll)
//!   until it returns `None` (a completion that arrives between the event and the re-arm would
//!   otherwise wait for the next one).
//! - an [`AsyncEvents`] source: call [`AsyncEvents::try_next`] until it returns `None`.
//! - a descriptor of the caller's ([`Readiness::fd`], [`Readiness::fd_writable`]): as `poll(2)`
//!   reports it. A hang-up or an error on it counts as ready, so the read that follows sees it.
//!
//! A ready source may yield nothing: another thread may have read it first (a blocking step on
//! a shared channel, say). Wait again.
//!
//! Building a `Readiness` allocates (two vectors, one entry per source); a wait allocates
//! nothing. When `poll(2)` is interrupted by a signal and has to be repeated, the repeat gets
//! what is left of the timeout (the coarse monotonic clock, read without a system call, as
//! every wait of this crate): the wait lasts the timeout, to a clock tick.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::Duration;

use crate::cm::event_channel::EventChannel;
use crate::error::{errno, Error, Result};
use crate::verbs::async_event::AsyncEvents;
use crate::verbs::cq::CompletionQueue;
use crate::wait::Deadline;

/// What `poll(2)` reports as ready besides the interest asked for: the read or write that
/// follows then sees the hang-up or the error.
const ALWAYS: libc::c_short = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;

/// A source whose readiness `poll(2)` does not see entirely.
#[derive(Clone, Copy)]
enum Kind<'a> {
    /// Events kept in the channel's queue by targeted waits.
    Channel(&'a EventChannel),
    /// Nothing beyond the descriptor.
    Fd,
}

struct Entry<'a, T> {
    kind: Kind<'a>,
    token: T,
    ready: bool,
}

/// A set of sources to wait on together, each with a token of the caller's (see the
/// [module docs](self) for what "ready" means for each kind, and how to drain it).
///
/// It borrows every source, so none can be dropped, and no descriptor closed, while it waits:
///
/// ```compile_fail,E0505
/// let ch = rdma_cm::EventChannel::new().unwrap();
/// let mut set = rdma_cm::Readiness::new().channel(&ch, 0);
/// drop(ch); // error[E0505]: cannot move out of `ch` because it is borrowed
/// set.wait(std::time::Duration::ZERO).unwrap();
/// ```
///
/// # Examples
///
/// A descriptor of the caller's (here a socket) beside the crate's sources:
///
/// ```
/// use std::io::Write;
/// use std::os::unix::net::UnixStream;
/// use std::time::Duration;
///
/// let (reader, mut writer) = UnixStream::pair()?;
/// let mut ready = rdma_cm::Readiness::new().fd(&reader, "socket");
/// assert_eq!(ready.wait(Duration::ZERO)?.len(), 0);
/// writer.write_all(b"x")?;
/// assert_eq!(ready.wait(Duration::from_secs(5))?.collect::<Vec<_>>(), ["socket"]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Readiness<'a, T> {
    /// Parallel to `entries`: the array `poll(2)` takes.
    fds: Vec<libc::pollfd>,
    entries: Vec<Entry<'a, T>>,
}

impl<T> Default for Readiness<'_, T> {
    fn default() -> Self {
        Readiness { fds: Vec::new(), entries: Vec::new() }
    }
}

impl<'a, T: Copy> Readiness<'a, T> {
    /// An empty set. [`Readiness::wait`] on it sleeps for the timeout.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty set with room for `n` sources.
    pub fn with_capacity(n: usize) -> Self {
        Readiness { fds: Vec::with_capacity(n), entries: Vec::with_capacity(n) }
    }

    fn push(mut self, fd: std::os::fd::RawFd, events: libc::c_short, kind: Kind<'a>, token: T) -> Self {
        self.fds.push(libc::pollfd { fd, events, revents: 0 });
        self.entries.push(Entry { kind, token, ready: false });
        self
    }

    /// Adds a CM event channel: ready when [`EventChannel::try_get_event`] may return an event.
    pub fn channel(self, ch: &'a EventChannel, token: T) -> Self {
        self.push(ch.as_raw_fd(), libc::POLLIN, Kind::Channel(ch), token)
    }

    /// Adds a CQ: ready when its completion channel has an event (after
    /// [`CompletionQueue::req_notify`]), or a QP's poll kept completions for it.
    pub fn cq(self, cq: &'a CompletionQueue, token: T) -> Self {
        self.push(cq.as_raw_fd(), libc::POLLIN, Kind::Fd, token)
    }

    /// Adds a source of async device events: ready when [`AsyncEvents::try_next`] may return
    /// an event.
    pub fn async_events(self, events: &'a AsyncEvents, token: T) -> Self {
        self.push(events.as_raw_fd(), libc::POLLIN, Kind::Fd, token)
    }

    /// Adds a descriptor of the caller's (a socket, a pipe, an eventfd, stdin): ready when it
    /// is readable, hung up or in error.
    pub fn fd<F: AsFd + ?Sized>(self, fd: &'a F, token: T) -> Self {
        let fd: BorrowedFd<'a> = fd.as_fd();
        self.push(fd.as_raw_fd(), libc::POLLIN, Kind::Fd, token)
    }

    /// Adds a descriptor of the caller's: ready when it is writable, hung up or in error.
    pub fn fd_writable<F: AsFd + ?Sized>(self, fd: &'a F, token: T) -> Self {
        let fd: BorrowedFd<'a> = fd.as_fd();
        self.push(fd.as_raw_fd(), libc::POLLOUT, Kind::Fd, token)
    }

    /// How many sources the set holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the set holds no source.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Waits up to `timeout` ([`FOREVER`](crate::FOREVER) for no bound) until at least one
    /// source is ready, and returns the tokens of all that are, in the order they were added;
    /// none when the timeout passed. Sources already ready (events kept on a channel,
    /// completions kept for a CQ) end the wait at once. Then drain each as the
    /// [module docs](self) say. Allocates nothing.
    ///
    /// # Errors
    /// [`Error::Call`] naming `poll` when `poll(2)` fails: `ENOMEM` (the kernel could not
    /// allocate its table), or `EINVAL` for more sources than `RLIMIT_NOFILE` allows.
    pub fn wait(&mut self, timeout: Duration) -> Result<Ready<'_, 'a, T>> {
        let mut early = false;
        for e in &mut self.entries {
            e.ready = match e.kind {
                Kind::Channel(ch) => ch.has_untargeted_queued(),
                Kind::Fd => false,
            };
            early |= e.ready;
        }
        let mut deadline = Deadline::new(if early { Duration::ZERO } else { timeout });
        loop {
            let left = deadline.left();
            // Round up, so that a sub-millisecond remainder still waits instead of spinning;
            // beyond what poll(2) takes (24 days), wait without a bound (FOREVER).
            let ms = left.as_micros().div_ceil(1000);
            let ms = if ms > i32::MAX as u128 { -1 } else { ms as i32 };
            for f in &mut self.fds {
                f.revents = 0;
            }
            // SAFETY: `fds` is an exclusively borrowed array of `fds.len()` pollfds. Every
            // descriptor in it belongs to a source `self` borrows for 'a, so it is open.
            let n = unsafe { libc::poll(self.fds.as_mut_ptr(), self.fds.len() as libc::nfds_t, ms) };
            if n >= 0 {
                break;
            }
            let e = errno();
            if e != libc::EINTR {
                return Err(Error::call("poll", e, None));
            }
            if left.is_zero() {
                break;
            }
        }
        let mut count = 0;
        for (e, f) in self.entries.iter_mut().zip(&self.fds) {
            e.ready |= f.revents & (f.events | ALWAYS) != 0;
            count += usize::from(e.ready);
        }
        Ok(Ready { entries: self.entries.iter(), left: count })
    }
}

impl<T: fmt::Debug> fmt::Debug for Readiness<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.entries.iter().zip(&self.fds).map(|(e, p)| (&e.token, p.fd))).finish()
    }
}

/// The tokens of the sources a [`Readiness::wait`] found ready, in the order they were added.
pub struct Ready<'r, 'a, T> {
    entries: std::slice::Iter<'r, Entry<'a, T>>,
    left: usize,
}

impl<T: Copy> Iterator for Ready<'_, '_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        let e = self.entries.by_ref().find(|e| e.ready)?;
        self.left -= 1;
        Some(e.token)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<T: Copy> ExactSizeIterator for Ready<'_, '_, T> {}

impl<T: Copy + fmt::Debug> fmt::Debug for Ready<'_, '_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.entries.clone().filter(|e| e.ready).map(|e| e.token)).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::{Read, Write};
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::time::Instant;

    /// A pipe: (read end, write end). (`std::io::pipe` is newer than the crate's MSRV.)
    fn pipe() -> (File, File) {
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two descriptors pipe(2) writes.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0, "pipe: {}", std::io::Error::last_os_error());
        // SAFETY: pipe(2) succeeded: both descriptors are open and owned by nobody else.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        (File::from(r), File::from(w))
    }

    #[test]
    fn a_pipe_is_ready_while_it_holds_data_and_at_its_hang_up() {
        let (mut r, mut w) = pipe();
        let mut set = Readiness::new().fd(&r, 7u8);
        assert_eq!(set.wait(Duration::ZERO).unwrap().len(), 0, "an empty pipe is not readable");
        w.write_all(b"ab").unwrap();
        assert_eq!(set.wait(Duration::from_secs(5)).unwrap().collect::<Vec<_>>(), [7]);
        // Level-triggered: still ready until drained.
        assert_eq!(set.wait(Duration::ZERO).unwrap().collect::<Vec<_>>(), [7]);
        drop(set);
        let mut buf = [0; 2];
        r.read_exact(&mut buf).unwrap();
        let mut set = Readiness::new().fd(&r, 7u8);
        assert_eq!(set.wait(Duration::ZERO).unwrap().len(), 0, "drained");
        drop(set);
        drop(w);
        let mut set = Readiness::new().fd(&r, 7u8);
        assert_eq!(set.wait(Duration::from_secs(5)).unwrap().collect::<Vec<_>>(), [7], "hang-up counts as ready");
    }

    #[test]
    fn only_the_ready_sources_are_reported_in_the_order_added() {
        let (r1, _w1) = pipe();
        let (r2, mut w2) = pipe();
        let (_r3, w3) = pipe();
        w2.write_all(b"x").unwrap();
        let mut set = Readiness::new().fd(&r1, "r1").fd(&r2, "r2").fd_writable(&w3, "w3");
        assert_eq!(set.len(), 3);
        let ready = set.wait(Duration::from_secs(5)).unwrap();
        assert_eq!(ready.len(), 2);
        assert_eq!(ready.collect::<Vec<_>>(), ["r2", "w3"]);
    }

    #[test]
    fn a_timeout_reports_nothing_and_waits_the_timeout() {
        let (r, _w) = pipe();
        let mut set = Readiness::new().fd(&r, ());
        let t = Duration::from_millis(100);
        let start = Instant::now();
        let ready = set.wait(t).unwrap();
        assert_eq!(ready.len(), 0);
        assert!(start.elapsed() >= t, "returned after {:?}, before the timeout", start.elapsed());
        let mut empty = Readiness::<()>::new();
        assert!(empty.is_empty());
        assert_eq!(empty.wait(Duration::ZERO).unwrap().len(), 0);
    }
}
