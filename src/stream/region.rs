//! Writes straight from the caller's registered memory: [`Stream::write_region`].
//!
//! The region moves into the call and comes back once no WRITE of it is in flight: while one
//! is, the device reads the region, and the caller holds no handle of it, so nothing (no Rust
//! code, no other work request made to write it) can change its bytes under the WRITE.

use std::fmt;
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crate::stream::engine::Stream;
use crate::stream::io::deadline;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::pd::ProtectionDomain;

/// How long a broken stream's call waits for the flush of its region's WRITEs (normally
/// immediate: the QP is in the error state).
const FLUSH_BOUND: Duration = Duration::from_secs(2);

/// A [`Stream::write_region`] that failed: the error, and the region once no WRITE holds it.
pub struct WriteRegionError {
    error: io::Error,
    region: Option<MemoryRegion>,
}

impl WriteRegionError {
    pub(super) fn new(error: io::Error, region: Option<MemoryRegion>) -> WriteRegionError {
        WriteRegionError { error, region }
    }

    /// What went wrong.
    pub fn error(&self) -> &io::Error {
        &self.error
    }

    /// The region, untouched. `None` only when the stream broke and the flush of its WRITEs
    /// did not come back within 2 s: the stream's QP then keeps the region's registration
    /// until it is destroyed.
    pub fn into_region(self) -> Option<MemoryRegion> {
        self.region
    }

    /// The error and the region.
    pub fn into_parts(self) -> (io::Error, Option<MemoryRegion>) {
        (self.error, self.region)
    }
}

impl fmt::Debug for WriteRegionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteRegionError").field("error", &self.error).field("region", &self.region).finish()
    }
}

impl fmt::Display for WriteRegionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.error)?;
        if self.region.is_none() {
            write!(f, " (the region stays with the stream's QP until it is destroyed)")?;
        }
        Ok(())
    }
}

impl std::error::Error for WriteRegionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<WriteRegionError> for io::Error {
    /// The error alone (the region is dropped).
    fn from(e: WriteRegionError) -> io::Error {
        e.error
    }
}

impl Stream {
    /// The protection domain of the stream's own buffers: a region registered on it
    /// ([`MemoryRegion::new`], [`MemoryRegion::register`]) can be sent with
    /// [`Stream::write_region`].
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        self.rbuf.pd()
    }

    /// Sends bytes `range` of `mr` without copying them, and gives the region back once the
    /// peer's device has them. Each data WRITE (up to 64 KiB, within what the peer granted)
    /// goes from the region straight into the peer's receive buffer, as many in flight as
    /// credits and grants allow. The peer reads them as any other data, in order with this
    /// stream's other writes (an rsocket peer too: the messages on the wire are the same).
    /// Waits, as [`Write::write_all`](std::io::Write::write_all) does, while the peer's credits
    /// or granted space run out; the write timeout bounds each wait that makes no progress.
    ///
    /// The region moves in: while its WRITEs are in flight the caller holds no handle of it,
    /// so nothing can change its bytes under them. It pays for large writes: each call waits
    /// for its last WRITE's completion (one round trip), where [`Write::write`](std::io::Write::write)
    /// returns once its copy is posted. Measured (BENCHMARKS.md, "The stream beside `rstream`
    /// and TCP"): 0.89 × the copy's user-space instructions at 4 KiB a call, a fifth at 64 KiB,
    /// more at 64 B.
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidInput`] for a range outside the region, or a region registered
    /// on another protection domain than [`Stream::pd`]; otherwise as for
    /// [`Write::write`](std::io::Write::write) and [`Write::flush`](std::io::Write::flush). The
    /// region comes back with the error ([`WriteRegionError::into_region`]); part of the range
    /// may have been sent (the message says how much was posted). A WRITE that did not
    /// complete in time breaks the stream: its region is then given back only once the flush
    /// has released it.
    pub fn write_region(&mut self, mr: MemoryRegion, range: Range<usize>) -> Result<MemoryRegion, WriteRegionError> {
        if let Err(error) = self.check_region(&mr, &range) {
            return Err(WriteRegionError::new(error, Some(mr)));
        }
        let (mut at, end) = (range.start, range.end);
        let mut until = None;
        let mut error = loop {
            let before = at;
            match self.try_write_region(&mr, &mut at, end) {
                Some(Ok(())) => break None,
                Some(Err(e)) => break Some(posted_so_far(e, &range, at)),
                None => {}
            }
            if at > before {
                until = None;
            }
            let d = *until.get_or_insert_with(|| deadline(self.write_timeout));
            if !self.wait_until(d) {
                break Some(posted_so_far(self.timeout_error("write_region", self.write_timeout), &range, at));
            }
        };
        // Until the last WRITE completes (they complete in order); each wait without progress
        // bounded by the write timeout.
        let mut until = None;
        while error.is_none() && mr.outstanding() > 0 && self.fatal.is_none() && !self.peer_gone {
            let before = mr.outstanding();
            let d = *until.get_or_insert_with(|| deadline(self.write_timeout));
            if !self.wait_until(d) {
                let t = self.write_timeout;
                self.fail(
                    io::ErrorKind::TimedOut,
                    format!(
                        "write_region: its WRITEs did not complete within {t:?}: the peer's device does not acknowledge \
                         them; the stream is closed"
                    ),
                );
            }
            if mr.outstanding() < before {
                until = None;
            }
        }
        if error.is_none() {
            error = self.region_result();
        }
        self.region_back(mr, error, FLUSH_BOUND)
    }

    /// A region call's end: the region back, with `error` if any. A WRITE still holds it only
    /// if the stream broke or the peer left: the QP goes to the error state, and the flush,
    /// waited for up to `flush`, releases it; without the flush, the error comes without it.
    pub(super) fn region_back(
        &mut self,
        mr: MemoryRegion,
        error: Option<io::Error>,
        flush: Duration,
    ) -> Result<MemoryRegion, WriteRegionError> {
        if mr.outstanding() > 0 {
            let _ = self.lane.set_error(self.qp);
            self.wait_flushed(deadline(flush), |_| mr.outstanding() == 0);
            let region = (mr.outstanding() == 0).then_some(mr);
            let error = error.unwrap_or_else(|| self.fatal_error().unwrap_or_else(|| self.gone_error()));
            return Err(WriteRegionError::new(error, region));
        }
        match error {
            None => Ok(mr),
            Some(error) => Err(WriteRegionError::new(error, Some(mr))),
        }
    }

    /// What became of a region's WRITEs once none is in flight: the error that broke the
    /// stream, or the first data WRITE that failed.
    pub(super) fn region_result(&self) -> Option<io::Error> {
        if let Some(e) = self.fatal_error() {
            return Some(e);
        }
        self.write_lost.as_ref().map(|w| io::Error::new(io::ErrorKind::BrokenPipe, w.clone()))
    }

    /// Refuses a range outside `mr`, and a region of another protection domain (the device
    /// would refuse its key).
    pub(super) fn check_region(&self, mr: &MemoryRegion, range: &Range<usize>) -> io::Result<()> {
        if range.start > range.end || range.end > mr.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("write_region: the range {range:?} is not inside the region's {} bytes", mr.len()),
            ));
        }
        if !mr.inner().on_pd(self.pd()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "write_region: the region is registered on another protection domain than the stream's: register \
                 it on Stream::pd()",
            ));
        }
        Ok(())
    }

    /// A write-region step without waiting, the step the blocking and the async call share:
    /// posts as much of `*at..end` as credits, granted space and send-queue entries allow
    /// now, advancing `*at`. `Some(Ok(()))` once everything is posted; `Some(Err)` when no
    /// write can go out; `None` when the caller must wait (the CQ was polled last).
    pub(super) fn try_write_region(&mut self, mr: &MemoryRegion, at: &mut usize, end: usize) -> Option<io::Result<()>> {
        loop {
            if *at == end {
                return Some(Ok(()));
            }
            if let Err(e) = self.write_refusal() {
                return Some(Err(e));
            }
            let before = *at;
            while *at < end && self.can_post_data().is_some() {
                match self.send_region(mr, *at, end) {
                    Ok(0) => break,
                    Ok(n) => *at += n,
                    Err(e) => return Some(Err(e)),
                }
            }
            if *at > before {
                continue;
            }
            self.poll_now();
            if self.can_post_data().is_some() || self.fatal.is_some() {
                continue;
            }
            return None;
        }
    }
}

/// `e`, saying how much of `range` was posted before it when some was.
pub(super) fn posted_so_far(e: io::Error, range: &Range<usize>, at: usize) -> io::Error {
    if at == range.start {
        return e;
    }
    let (done, all) = (at - range.start, range.end - range.start);
    io::Error::new(e.kind(), format!("{e} (after {done} of the range's {all} bytes were posted)"))
}
