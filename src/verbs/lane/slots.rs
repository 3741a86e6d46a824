//! One work queue's slots in a lane: the regions of posted work requests, in posting order.

use super::*;

/// One work queue's slots: the regions of posted work requests, in posting order.
pub(super) struct Slots {
    slots: Box<[Slot]>,
    mask: u32,
    pub(super) depth: u32,
    /// Sequence number of the oldest outstanding work request.
    pub(super) head: u32,
    /// Sequence number the next one gets (wrapping; at most `depth` apart from `head`).
    pub(super) tail: u32,
    /// Beside each slot, 0, or the length of the prepared batch whose first slot it is
    /// ([`super::PreparedBatch`]: one region in that slot, the batch's other slots empty). Only
    /// a batch writes it and only its retiring resets it: the common post and poll never read
    /// it.
    spans: Box<[u32]>,
    /// Bits 63..32 of this queue's ordinary tags (`tag::queue_hi`): its member's generation and
    /// place (`tag::hi`), and `RECV` for the receive queue. An ordinary completion's tag carries
    /// it whole, so the poll finds the queue and compares one word; a batch's interior tag
    /// (`INTERIOR`) never does.
    pub(super) hi: u32,
}

struct Slot {
    mr: Option<MemoryRegion>,
    wr_id: u64,
}

impl Slots {
    /// Room for `depth` outstanding work requests, of the queue whose ordinary tags carry `hi`
    /// in bits 63..32 (see `hi`).
    pub(super) fn new(depth: u32, hi: u32) -> Slots {
        let len = depth.max(1).next_power_of_two();
        Slots {
            slots: (0..len).map(|_| Slot { mr: None, wr_id: 0 }).collect(),
            spans: vec![0; len as usize].into_boxed_slice(),
            mask: len - 1,
            depth,
            head: 0,
            tail: 0,
            hi,
        }
    }
    #[inline(always)]
    pub(super) fn outstanding(&self) -> u32 {
        self.tail.wrapping_sub(self.head)
    }
    #[inline(always)]
    pub(super) fn free(&self) -> u32 {
        self.depth - self.outstanding()
    }
    /// Stores a work request's region at `tail + k`, uncommitted: the caller advances `tail`
    /// once the provider took the request, or takes the region back (`unput_at`) when it did
    /// not. The slot holds nothing then (see below).
    #[inline(always)]
    pub(super) fn put(&mut self, k: u32, mr: MemoryRegion, wr_id: u64) {
        let i = (self.tail.wrapping_add(k) & self.mask) as usize;
        debug_assert!(i < self.slots.len());
        // SAFETY: `slots.len()` is `mask + 1` (a power of two, `Slots::new`), so `i`, masked,
        // is in bounds.
        let s = unsafe { self.slots.get_unchecked_mut(i) };
        // The slot is free: at most `depth` are outstanding, retiring empties a slot, and a
        // region put here but not posted is taken back (`unput_at`, `take_staged`; or
        // `release_staged` when a `post_send_iter`'s iterator panics). Were one still there, it
        // is overwritten without being dropped (leaked, which is safe). Nothing here may
        // panic: the callers put a region here while the provider may hold its request.
        // SAFETY: `&mut s.mr` is valid for a write; the value overwritten, `None` or a region
        // never posted, is not dropped: at worst a leak.
        unsafe { std::ptr::write(&mut s.mr, Some(mr)) };
        s.wr_id = wr_id;
    }
    /// Takes back the region `put` at `tail` (uncommitted: the provider did not take its work
    /// request).
    #[cold]
    pub(super) fn unput(&mut self) -> Option<MemoryRegion> {
        self.unput_at(0)
    }
    /// Takes back the region `put` at `tail + k` (uncommitted), and a batch's mark there.
    #[cold]
    pub(super) fn unput_at(&mut self, k: u32) -> Option<MemoryRegion> {
        let i = (self.tail.wrapping_add(k) & self.mask) as usize;
        if let Some(span) = self.spans.get_mut(i) {
            *span = 0;
        }
        self.slots.get_mut(i)?.mr.take()
    }
    /// Marks the slot at `tail` as the first of a batch of `len` work requests, whose region
    /// `put` stores there: the batch retires as one, with its last request's completion. (A
    /// mark of 1 is an ordinary slot's: `pop` may leave it behind, and it means what 0 does.)
    #[inline(always)]
    pub(super) fn mark_batch(&mut self, len: u32) {
        let i = (self.tail & self.mask) as usize;
        debug_assert!(i < self.spans.len() && len >= 1);
        // SAFETY: `spans.len()` is `mask + 1`, as `slots.len()` (`Slots::new`).
        unsafe { *self.spans.get_unchecked_mut(i) = len };
    }
    /// `mark_batch` and `put` at `tail`, the slot's index computed once: a batch's post.
    #[inline(always)]
    pub(super) fn put_batch(&mut self, len: u32, mr: MemoryRegion, wr_id: u64) {
        let i = (self.tail & self.mask) as usize;
        debug_assert!(i < self.slots.len() && i < self.spans.len() && len >= 1);
        // SAFETY: `spans.len()` and `slots.len()` are `mask + 1` (`Slots::new`): `i`, masked,
        // is in bounds of both. The slot is free, as in `put` (whose argument holds here: the
        // value overwritten is not dropped, at worst a leak).
        unsafe {
            *self.spans.get_unchecked_mut(i) = len;
            let s = self.slots.get_unchecked_mut(i);
            std::ptr::write(&mut s.mr, Some(mr));
            s.wr_id = wr_id;
        }
    }
    /// The mark of the oldest outstanding slot: a batch's length when a batch starts there,
    /// else 0 or 1 (an ordinary slot).
    #[inline(always)]
    pub(super) fn head_mark(&self) -> u32 {
        let i = (self.head & self.mask) as usize;
        debug_assert!(i < self.spans.len());
        // SAFETY: `spans.len()` is `mask + 1` (`Slots::new`), so `i`, masked, is in bounds.
        unsafe { *self.spans.get_unchecked(i) }
    }
    /// Retires the oldest slot, the first of a batch of `mark` (its `head_mark`), and the
    /// batch's other slots, which hold nothing: its region and `wr_id`.
    #[inline]
    pub(super) fn pop_batch(&mut self, mark: u32) -> (Option<MemoryRegion>, u64) {
        if let Some(s) = self.spans.get_mut((self.head & self.mask) as usize) {
            *s = 0;
        }
        // Never past `tail`, whatever the mark says.
        let skip = (mark.max(1) - 1).min(self.outstanding().saturating_sub(1));
        let out = self.pop();
        self.head = self.head.wrapping_add(skip);
        out
    }
    /// Retires the oldest slot, a batch or an ordinary one (`pop_batch` or `pop`).
    #[inline]
    pub(super) fn pop_span(&mut self) -> (Option<MemoryRegion>, u64) {
        match self.head_mark() {
            0 | 1 => self.pop(),
            mark => self.pop_batch(mark),
        }
    }
    /// Releases the `count` regions a panicked `post_send_iter` left staged beyond `tail`
    /// (never posted: the device never saw those regions).
    #[cold]
    #[inline(never)]
    pub(super) fn release_staged(&mut self, count: u32) {
        for k in 0..count {
            let i = (self.tail.wrapping_add(k) & self.mask) as usize;
            if let Some(s) = self.slots.get_mut(i) {
                drop(s.mr.take());
            }
        }
    }
    /// Whether `seq` is outstanding.
    #[inline(always)]
    pub(super) fn holds(&self, seq: u32) -> bool {
        seq.wrapping_sub(self.head) < self.outstanding()
    }
    /// Retires the oldest work request: its region and `wr_id`.
    #[inline(always)]
    pub(super) fn pop(&mut self) -> (Option<MemoryRegion>, u64) {
        let i = (self.head & self.mask) as usize;
        self.head = self.head.wrapping_add(1);
        debug_assert!(i < self.slots.len());
        // SAFETY: `slots.len()` is `mask + 1` (a power of two, `Slots::new`), so `i`, masked,
        // is in bounds.
        let s = unsafe { self.slots.get_unchecked_mut(i) };
        (s.mr.take(), s.wr_id)
    }
    /// Retires every slot through `seq` (a completion a teardown reaped): their regions.
    pub(super) fn retire_through(&mut self, seq: u32) -> Vec<MemoryRegion> {
        let mut out = Vec::new();
        while self.holds(seq) {
            out.extend(self.pop_span().0);
        }
        out
    }
    /// Takes every region still held (for a QP being destroyed).
    pub(super) fn drain(&mut self) -> impl Iterator<Item = MemoryRegion> + '_ {
        let n = self.outstanding();
        let start = self.head;
        self.head = self.tail;
        (0..n).filter_map(move |k| self.slots[(start.wrapping_add(k) & self.mask) as usize].mr.take())
    }

    /// Takes the staged slots `tail + from .. tail + to` back out.
    pub(super) fn take_staged(&mut self, from: u32, to: u32) -> Vec<(u64, MemoryRegion)> {
        let mut out = Vec::new();
        for j in from..to {
            let i = (self.tail.wrapping_add(j) & self.mask) as usize;
            if let Some(s) = self.slots.get_mut(i) {
                if let Some(mr) = s.mr.take() {
                    out.push((s.wr_id, mr));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_wrap_and_refuse_sequence_numbers_outside_the_window() {
        let mut s = Slots::new(3, 0);
        assert_eq!((s.slots.len(), s.free()), (4, 3));
        // Start near the wrap of the 32-bit sequence numbers.
        s.head = u32::MAX - 1;
        s.tail = u32::MAX - 1;
        for k in 0..3 {
            assert!(!s.holds(s.tail.wrapping_add(k)));
        }
        s.tail = s.tail.wrapping_add(3);
        assert_eq!(s.free(), 0);
        assert!(s.holds(u32::MAX - 1) && s.holds(u32::MAX) && s.holds(0));
        assert!(!s.holds(1) && !s.holds(u32::MAX - 2));
        let _ = s.pop();
        assert!(!s.holds(u32::MAX - 1), "a retired one is stale");
        assert_eq!(s.free(), 1);
    }

    #[test]
    fn a_batch_mark_retires_its_slots_as_one_across_both_wraps_and_never_past_tail() {
        // A ring of 8; the batch's first slot at ring index 6 and sequence u32::MAX - 1, so
        // both the ring index and the sequence number wrap inside the batch.
        let mut s = Slots::new(7, 0);
        s.head = u32::MAX - 3;
        s.tail = u32::MAX - 3;
        s.tail = s.tail.wrapping_add(2); // two ordinary requests, no regions (none needed here)
        s.mark_batch(5);
        assert_eq!(s.head_mark(), 0, "the mark is at tail, not at head");
        s.tail = s.tail.wrapping_add(5);
        assert_eq!(s.outstanding(), 7);
        let _ = s.pop_span();
        let _ = s.pop_span();
        assert_eq!(s.head_mark(), 5);
        let _ = s.pop_span();
        assert_eq!((s.head, s.outstanding()), (s.tail, 0), "the batch retired its five slots as one");
        assert_eq!(s.head_mark(), 0, "and its mark is gone");
        // A mark that claims more than is outstanding stops at tail.
        s.mark_batch(6);
        s.tail = s.tail.wrapping_add(2);
        let _ = s.pop_span();
        assert_eq!(s.outstanding(), 0);
        // A mark taken back with its region (a batch not posted) leaves an ordinary slot.
        s.mark_batch(3);
        assert!(s.unput_at(0).is_none());
        assert_eq!(s.spans[(s.tail & s.mask) as usize], 0);
        // retire_through stops at the sequence number it is given, batches whole.
        s.tail = s.tail.wrapping_add(1);
        s.mark_batch(2);
        s.tail = s.tail.wrapping_add(2);
        let upto = s.tail.wrapping_sub(1);
        assert!(s.retire_through(upto).is_empty());
        assert_eq!(s.outstanding(), 0);
    }
}
