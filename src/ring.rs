//! The slot ring behind each work queue of a [`QueuePair`](crate::QueuePair): which region
//! each posted work request holds, in posting order, until its completion retires it; and the
//! completions reaped but not yet handed to the caller.

use std::mem;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::cq::WorkCompletion;
use crate::mr::MrInner;

/// A region held by a posted work request. Dropping it releases the region (and, for work
/// the device writes, the region's writer count).
pub(crate) struct Hold {
    region: Arc<MrInner>,
    writes: bool,
}

impl Hold {
    /// Takes a handle of `region` for a work request; `writes` when the device writes it
    /// (receives, RDMA READ targets).
    pub(crate) fn new(region: &Arc<MrInner>, writes: bool) -> Hold {
        if writes {
            region.writers.fetch_add(1, Ordering::AcqRel);
        }
        Hold { region: Arc::clone(region), writes }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.writes {
            self.region.writers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One slot of a work queue's ring.
#[derive(Default)]
pub(crate) struct Slot {
    user_wr_id: u64,
    /// Never read: holding it keeps the region allocated while the device may use it.
    _hold: Option<Hold>,
    /// The provider said it did not take this work request: it holds nothing, completes
    /// nothing, and the head steps over it.
    void: bool,
}

/// A fixed ring of in-flight work requests, in posting order.
pub(crate) struct Ring {
    /// A power of two at least `depth` long, so a slot is `seq & mask` (no division).
    pub(crate) slots: Box<[Slot]>,
    /// How many work requests the queue holds.
    depth: u64,
    /// Sequence number of the oldest outstanding work request.
    head: u64,
    /// Sequence number the next work request gets. Never goes back: a sequence number is
    /// never given to two work requests.
    tail: u64,
    /// Completions reaped and not yet delivered to the caller; each still counts against the
    /// depth, so they always fit in [`Pending`].
    undelivered: u64,
}

impl Ring {
    pub(crate) fn new(depth: u32) -> Ring {
        let len = (depth as usize).next_power_of_two();
        Ring {
            slots: (0..len).map(|_| Slot::default()).collect(),
            depth: depth as u64,
            head: 0,
            tail: 0,
            undelivered: 0,
        }
    }
    pub(crate) fn cap(&self) -> u64 {
        self.depth
    }
    /// Work requests posted and not yet retired.
    pub(crate) fn outstanding(&self) -> u64 {
        self.tail - self.head
    }
    pub(crate) fn free(&self) -> u64 {
        self.depth - self.outstanding() - self.undelivered
    }
    fn slot(&mut self, seq: u64) -> &mut Slot {
        let mask = self.slots.len() - 1;
        &mut self.slots[seq as usize & mask]
    }
    /// Records a work request at `tail + k` (not yet committed).
    pub(crate) fn stage(&mut self, k: u64, user_wr_id: u64, hold: Option<Hold>) -> u64 {
        let seq = self.tail + k;
        *self.slot(seq) = Slot { user_wr_id, _hold: hold, void: false };
        seq
    }
    /// Commits `staged` work requests, of which the provider took the first `posted`: the
    /// others become void (their regions are released at once), and their sequence numbers
    /// are used up all the same.
    pub(crate) fn commit(&mut self, posted: u64, staged: u64) {
        for k in posted..staged {
            let seq = self.tail + k;
            *self.slot(seq) = Slot { void: true, ..Slot::default() };
        }
        self.tail += staged;
        self.skip_void();
    }
    /// Retires void slots at the head: nothing before them is outstanding any more.
    fn skip_void(&mut self) {
        while self.head < self.tail {
            let h = self.head;
            if !self.slot(h).void {
                break;
            }
            *self.slot(h) = Slot::default();
            self.head += 1;
        }
    }
    /// Retires every work request up to and including `seq`; returns the caller's wr_id, or
    /// `None` for a sequence number outside the outstanding window (never ours, or stale) or
    /// a void slot. The completion is counted as undelivered until [`Ring::delivered`].
    pub(crate) fn complete(&mut self, seq: u64) -> Option<u64> {
        if seq < self.head || seq >= self.tail {
            return None;
        }
        let mut last = Slot::default();
        while self.head <= seq {
            let h = self.head;
            last = mem::take(self.slot(h));
            self.head += 1;
        }
        self.skip_void();
        if last.void {
            return None;
        }
        self.undelivered += 1;
        Some(last.user_wr_id)
    }
    /// A completion [`Ring::complete`] returned reached the caller.
    pub(crate) fn delivered(&mut self, n: u64) {
        self.undelivered -= n;
    }
    /// A delivered completion was taken back to be kept for later.
    pub(crate) fn undeliver(&mut self) {
        self.undelivered += 1;
    }
    /// The full sequence number of a work request whose low `bits` bits are `low`: the one in
    /// the outstanding window (or just past it, which [`Ring::complete`] then refuses).
    pub(crate) fn widen(&self, low: u64, bits: u32) -> u64 {
        let mask = (1u64 << bits) - 1;
        self.head.wrapping_add(low.wrapping_sub(self.head) & mask)
    }
}

/// Completions reaped from a CQ but not yet handed to the caller (a wait for one `wr_id` met
/// others first). A fixed FIFO as deep as the work queue, allocated once.
pub(crate) struct Pending {
    buf: Box<[WorkCompletion]>,
    start: usize,
    len: usize,
}

impl Pending {
    pub(crate) fn new(depth: u32) -> Pending {
        Pending { buf: vec![WorkCompletion::default(); depth.max(1) as usize].into_boxed_slice(), start: 0, len: 0 }
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    fn at(&self, i: usize) -> usize {
        (self.start + i) % self.buf.len()
    }
    /// Appends `wc`. The ring's accounting guarantees room (every entry holds a slot's place).
    pub(crate) fn push(&mut self, wc: WorkCompletion) {
        debug_assert!(self.len < self.buf.len());
        if self.len < self.buf.len() {
            let i = self.at(self.len);
            self.buf[i] = wc;
            self.len += 1;
        }
    }
    /// Removes and returns the first entry that `pick` accepts, keeping the others in order.
    pub(crate) fn take_first(&mut self, mut pick: impl FnMut(&WorkCompletion) -> bool) -> Option<WorkCompletion> {
        let found = (0..self.len).find(|&i| pick(&self.buf[self.at(i)]))?;
        let wc = self.buf[self.at(found)];
        for i in found..self.len - 1 {
            let (dst, src) = (self.at(i), self.at(i + 1));
            self.buf[dst] = self.buf[src];
        }
        self.len -= 1;
        Some(wc)
    }
    /// Moves up to `out.len()` entries, oldest first, into `out`; returns how many.
    pub(crate) fn drain_into(&mut self, out: &mut [WorkCompletion]) -> usize {
        let n = self.len.min(out.len());
        for (k, o) in out.iter_mut().enumerate().take(n) {
            *o = self.buf[self.at(k)];
        }
        self.start = self.at(n);
        self.len -= n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_retires_in_order_and_refuses_overflow() {
        let mut r = Ring::new(4);
        for k in 0..3 {
            r.stage(k, 100 + k, None);
        }
        r.commit(3, 3);
        assert_eq!(r.outstanding(), 3);
        assert_eq!(r.free(), 1);
        // Completion of seq 1 retires seq 0 (unsignaled) and 1.
        assert_eq!(r.complete(1), Some(101));
        r.delivered(1);
        assert_eq!(r.outstanding(), 1);
        // Stale or foreign sequence numbers retire nothing.
        assert_eq!(r.complete(0), None);
        assert_eq!(r.complete(7), None);
        assert_eq!(r.complete(2), Some(102));
        assert_eq!(r.free(), 3, "an undelivered completion keeps its place");
        r.delivered(1);
        assert_eq!(r.outstanding(), 0);
        assert_eq!(r.free(), 4);
    }

    #[test]
    fn rejected_work_requests_use_up_their_sequence_numbers() {
        let mut r = Ring::new(4);
        for k in 0..3 {
            r.stage(k, k, None);
        }
        // The provider took the first one only.
        r.commit(1, 3);
        assert_eq!(r.outstanding(), 3, "the void slots wait behind the posted one");
        assert_eq!(r.complete(0), Some(0));
        r.delivered(1);
        assert_eq!(r.outstanding(), 0, "void slots behind a retired one are retired with it");
        assert_eq!(r.complete(1), None, "an unposted work request must not be completable");
        // The next post gets a fresh sequence number, not the rejected ones.
        assert_eq!(r.stage(0, 9, None), 3);
        r.commit(1, 1);
        assert_eq!(r.complete(1), None, "an old sequence number is refused");
        assert_eq!(r.complete(3), Some(9));
    }

    #[test]
    fn a_fully_rejected_post_leaves_nothing_outstanding() {
        let mut r = Ring::new(2);
        r.stage(0, 1, None);
        r.stage(1, 2, None);
        r.commit(0, 2);
        assert_eq!(r.outstanding(), 0);
        assert_eq!(r.stage(0, 3, None), 2);
    }

    #[test]
    fn ring_of_odd_depth_admits_exactly_its_depth() {
        let mut r = Ring::new(3);
        assert_eq!(r.slots.len(), 4);
        assert_eq!(r.free(), 3);
        for k in 0..3 {
            r.stage(k, k, None);
        }
        r.commit(3, 3);
        assert_eq!(r.free(), 0);
        assert_eq!(r.complete(2), Some(2));
        r.delivered(1);
        assert_eq!(r.free(), 3);
    }

    #[test]
    fn ring_wraps_and_widens_truncated_sequence_numbers() {
        let mut r = Ring::new(2);
        for i in 0..10u64 {
            r.stage(0, i, None);
            r.commit(1, 1);
            let wide = r.widen(i & 0xf, 4);
            assert_eq!(wide, i);
            assert_eq!(r.complete(wide), Some(i));
            r.delivered(1);
        }
        assert_eq!(r.head, 10);
    }

    #[test]
    fn pending_keeps_order_and_takes_from_the_middle() {
        let mut p = Pending::new(4);
        for i in 0..4 {
            p.push(WorkCompletion { wr_id: i, ..Default::default() });
        }
        assert_eq!(p.take_first(|w| w.wr_id == 2).map(|w| w.wr_id), Some(2));
        let mut out = [WorkCompletion::default(); 8];
        assert_eq!(p.drain_into(&mut out[..2]), 2);
        assert_eq!((out[0].wr_id, out[1].wr_id), (0, 1));
        p.push(WorkCompletion { wr_id: 7, ..Default::default() });
        assert_eq!(p.drain_into(&mut out), 2);
        assert_eq!((out[0].wr_id, out[1].wr_id), (3, 7));
        assert_eq!(p.len(), 0);
    }
}
