//! Writes straight from the caller's registered memory: [`Stream::write_region`].

use std::io;
use std::ops::Range;
use std::sync::Arc;

use crate::stream::engine::Stream;
use crate::stream::io::deadline;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::pd::ProtectionDomain;

impl Stream {
    /// The protection domain of the stream's own buffers: a region registered on it
    /// ([`MemoryRegion::new`], [`MemoryRegion::register`]) can be sent with
    /// [`Stream::write_region`].
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        self.rbuf.pd()
    }

    /// Sends bytes `range` of `mr` without copying them: each data WRITE (up to 64 KiB, within
    /// what the peer granted) goes from the region straight into the peer's receive buffer.
    /// The peer reads them as any other data, in order with this stream's other writes
    /// (an rsocket peer too: the messages on the wire are the same). Returns once every byte
    /// is posted, waiting as [`Write::write_all`](std::io::Write::write_all) does while the
    /// peer's credits or granted space run out; the write timeout bounds each wait that makes
    /// no progress.
    ///
    /// The WRITEs may still be in flight when it returns. Until they complete, the region
    /// can be read and sent again, but not changed: [`MemoryRegion::as_mut_slice`],
    /// [`MemoryRegion::write_at`] and [`MemoryRegion::into_buffer`] return
    /// [`Error::InFlight`](crate::Error::InFlight) (each WRITE holds a handle of it, as a posted
    /// work request does). [`Write::flush`](std::io::Write::flush) waits for them.
    ///
    /// A write is copied when it is small: [`Write::write`](std::io::Write::write) copies
    /// into the registered send buffer, which costs less than a WRITE per small region on the
    /// devices measured (BENCHMARKS.md, "Zero-copy writes", has the crossover).
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidInput`] for a range outside the region, or a region registered
    /// on another protection domain than [`Stream::pd`]; otherwise as for
    /// [`Write::write`](std::io::Write::write). After an error some of the range may have been
    /// sent: the message says how much was posted.
    pub fn write_region(&mut self, mr: &MemoryRegion, range: Range<usize>) -> io::Result<()> {
        self.check_region(mr, &range)?;
        let (mut at, end) = (range.start, range.end);
        let mut until = None;
        loop {
            let before = at;
            let step = self.try_write_region(mr, &mut at, end);
            if let Some(r) = step {
                return r.map_err(|e| posted_so_far(e, &range, at));
            }
            if at > before {
                until = None;
            }
            let d = *until.get_or_insert_with(|| deadline(self.write_timeout));
            if !self.wait_until(d) {
                let e = self.timeout_error("write_region", self.write_timeout);
                return Err(posted_so_far(e, &range, at));
            }
        }
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
