//! One work queue's slots in a lane: the regions of posted work requests, in posting order.

use super::tag;
use crate::verbs::mr::MemoryRegion;

/// One work queue's slots: the regions of posted work requests, in posting order.
pub(super) struct Slots {
    slots: Box<[Slot]>,
    mask: u32,
    pub(super) depth: u32,
    /// Sequence number of the oldest outstanding work request. A place's sequence numbers
    /// continue across the QPs attached there (`Lane::next_seq`); a tag carries their low 45
    /// bits (`tag::SEQ_MASK`).
    pub(super) head: u64,
    /// Sequence number the next one gets (at most `depth` apart from `head`).
    pub(super) tail: u64,
    /// Beside each slot, 0, or the length of the prepared batch whose first slot it is
    /// ([`super::PreparedBatch`]: one region in that slot, the batch's other slots empty). Only
    /// a batch writes it and only its retiring resets it: the common post and poll never read
    /// it.
    spans: Box<[u32]>,
    /// Bits 63..45 of this queue's ordinary tags (`tag::queue_hi`): its member's place, and
    /// `RECV` for the receive queue. An ordinary completion's tag carries it whole, so the poll
    /// finds the queue and compares one word; a batch's interior tag (`INTERIOR`) never does.
    pub(super) hi: u32,
    /// `hi` where a tag carries it (bits 63..45), so that a post's tag is this and the
    /// sequence number's low 45 bits (`tag`): `tag::encode` of the queue, read once.
    tag_hi: u64,
}

struct Slot {
    mr: Option<MemoryRegion>,
    wr_id: u64,
}

impl Slots {
    /// Room for `depth` outstanding work requests, of the queue whose ordinary tags carry `hi`
    /// in bits 63..45 (see `hi`), its first work request numbered `start`.
    pub(super) fn new(depth: u32, hi: u32, start: u64) -> Slots {
        let len = depth.max(1).next_power_of_two();
        Slots {
            slots: (0..len).map(|_| Slot { mr: None, wr_id: 0 }).collect(),
            spans: vec![0; len as usize].into_boxed_slice(),
            mask: len - 1,
            depth,
            head: start,
            tail: start,
            hi,
            tag_hi: (hi as u64) << tag::SHIFT,
        }
    }
    /// The tag of this queue's work request numbered `seq`: `tag::encode` of its place and
    /// queue, with `hi` read whole.
    #[inline(always)]
    pub(super) fn tag(&self, seq: u64) -> u64 {
        self.tag_hi | seq & tag::SEQ_MASK
    }
    #[inline(always)]
    pub(super) fn outstanding(&self) -> u32 {
        // At most `depth` apart: the difference fits.
        self.tail.wrapping_sub(self.head) as u32
    }
    /// The ring index of sequence number `seq`.
    #[inline(always)]
    fn index(&self, seq: u64) -> usize {
        (seq as u32 & self.mask) as usize
    }
    /// Advances `tail` by `k` (work requests the provider took).
    #[inline(always)]
    pub(super) fn commit(&mut self, k: u32) {
        self.tail = self.tail.wrapping_add(k as u64);
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
        let i = self.index(self.tail.wrapping_add(k as u64));
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
    /// Stores the `wr_id` of a work request that holds no region (an inline send: the provider
    /// copied its bytes) at `tail`, uncommitted, as `put` does.
    #[inline(always)]
    pub(super) fn put_none(&mut self, wr_id: u64) {
        let i = self.index(self.tail);
        debug_assert!(i < self.slots.len());
        // SAFETY: `slots.len()` is `mask + 1` (`Slots::new`), so `i`, masked, is in bounds. The
        // slot is free, as in `put` (whose argument holds here: the value overwritten is not
        // dropped, at worst a leak).
        unsafe {
            let s = self.slots.get_unchecked_mut(i);
            std::ptr::write(&mut s.mr, None);
            s.wr_id = wr_id;
        }
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
        let i = self.index(self.tail.wrapping_add(k as u64));
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
        let i = self.index(self.tail);
        debug_assert!(i < self.spans.len() && len >= 1);
        // SAFETY: `spans.len()` is `mask + 1`, as `slots.len()` (`Slots::new`).
        unsafe { *self.spans.get_unchecked_mut(i) = len };
    }
    /// `mark_batch` and `put` at `tail`, the slot's index computed once: a batch's post.
    #[inline(always)]
    pub(super) fn put_batch(&mut self, len: u32, mr: MemoryRegion, wr_id: u64) {
        let i = self.index(self.tail);
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
        let i = self.index(self.head);
        debug_assert!(i < self.spans.len());
        // SAFETY: `spans.len()` is `mask + 1` (`Slots::new`), so `i`, masked, is in bounds.
        unsafe { *self.spans.get_unchecked(i) }
    }
    /// Retires the oldest slot, the first of a batch of `mark` (its `head_mark`), and the
    /// batch's other slots, which hold nothing: its region and `wr_id`.
    #[inline]
    pub(super) fn pop_batch(&mut self, mark: u32) -> (Option<MemoryRegion>, u64) {
        if let Some(s) = self.spans.get_mut(self.index(self.head)) {
            *s = 0;
        }
        // Never past `tail`, whatever the mark says.
        let skip = (mark.max(1) - 1).min(self.outstanding().saturating_sub(1));
        let out = self.pop();
        self.head = self.head.wrapping_add(skip as u64);
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
            let i = self.index(self.tail.wrapping_add(k as u64));
            if let Some(s) = self.slots.get_mut(i) {
                drop(s.mr.take());
            }
        }
    }
    /// Whether the work request whose tag carries `seq` (a sequence number's low 45 bits) is
    /// outstanding: the sequence number, resolved against the window, when it is. A completion
    /// of an earlier QP at the place, or one handed out twice, names a sequence number before
    /// `head` (the place's numbers continue across its QPs), so it is not: it resolves to none
    /// until the place's sequence numbers wrap, 2^45 postings later.
    #[inline(always)]
    pub(super) fn holds(&self, seq: u64) -> Option<u64> {
        let ahead = seq.wrapping_sub(self.head) & tag::SEQ_MASK;
        (ahead < self.outstanding() as u64).then(|| self.head.wrapping_add(ahead))
    }
    /// Whether the sequence number `seq` (whole) is outstanding.
    #[inline(always)]
    pub(super) fn holds_whole(&self, seq: u64) -> bool {
        seq.wrapping_sub(self.head) < self.outstanding() as u64
    }
    /// Retires the oldest work request: its region and `wr_id`.
    #[inline(always)]
    pub(super) fn pop(&mut self) -> (Option<MemoryRegion>, u64) {
        let i = self.index(self.head);
        self.head = self.head.wrapping_add(1);
        debug_assert!(i < self.slots.len());
        // SAFETY: `slots.len()` is `mask + 1` (a power of two, `Slots::new`), so `i`, masked,
        // is in bounds.
        let s = unsafe { self.slots.get_unchecked_mut(i) };
        (s.mr.take(), s.wr_id)
    }
    /// Retires every slot through `seq` (whole; a completion a teardown reaped): their regions.
    pub(super) fn retire_through(&mut self, seq: u64) -> Vec<MemoryRegion> {
        let mut out = Vec::new();
        while self.holds_whole(seq) {
            out.extend(self.pop_span().0);
        }
        out
    }
    /// Takes every region still held (for a QP being destroyed).
    pub(super) fn drain(&mut self) -> impl Iterator<Item = MemoryRegion> + '_ {
        let n = self.outstanding();
        let start = self.head;
        self.head = self.tail;
        let mask = self.mask;
        (0..n).filter_map(move |k| self.slots[(start.wrapping_add(k as u64) as u32 & mask) as usize].mr.take())
    }

    /// Takes the staged slots `tail + from .. tail + to` back out.
    pub(super) fn take_staged(&mut self, from: u32, to: u32) -> Vec<(u64, MemoryRegion)> {
        let mut out = Vec::new();
        for j in from..to {
            let i = self.index(self.tail.wrapping_add(j as u64));
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
    fn a_queues_tags_are_its_places_and_queues() {
        for (place, recv) in [(0u16, false), (0, true), (65535, false), (65535, true), (7, true)] {
            let s = Slots::new(4, tag::queue_hi(place, recv), 0);
            for seq in [0, 1, tag::SEQ_MASK, tag::SEQ_MASK + 1, u64::MAX] {
                assert_eq!(s.tag(seq), tag::encode(place, seq, recv), "{place} {recv} {seq:#x}");
            }
        }
    }

    #[test]
    fn slots_refuse_sequence_numbers_outside_the_window_across_the_45_bit_wrap() {
        // A place's sequence numbers continue across its QPs: start just before the tags' 45
        // bits wrap.
        let start = tag::SEQ_MASK - 1;
        let mut s = Slots::new(3, 0, start);
        assert_eq!((s.slots.len(), s.free()), (4, 3));
        for k in 0..3 {
            assert!(s.holds(s.tail.wrapping_add(k) & tag::SEQ_MASK).is_none());
        }
        s.commit(3);
        assert_eq!(s.free(), 0);
        // The tags carry the low 45 bits; the window resolves them to the whole number.
        assert_eq!(s.holds(tag::SEQ_MASK - 1), Some(start));
        assert_eq!(s.holds(tag::SEQ_MASK), Some(start + 1));
        assert_eq!(s.holds(0), Some(start + 2), "past the wrap of the tag's bits");
        assert!(s.holds(1).is_none() && s.holds(tag::SEQ_MASK - 2).is_none());
        let _ = s.pop();
        assert!(s.holds(tag::SEQ_MASK - 1).is_none(), "a retired one is stale: handed out twice, it retires nothing");
        assert_eq!(s.free(), 1);
    }

    #[test]
    fn a_later_qp_at_a_place_holds_none_of_an_earlier_ones_sequence_numbers() {
        // The earlier QP posted 10 and retired 6 of them before it was removed; the next one at
        // the place starts where it stopped (`Lane::next_seq`).
        let mut earlier = Slots::new(8, tag::queue_hi(4, true), 1000);
        earlier.commit(10.min(earlier.depth));
        for _ in 0..6 {
            let _ = earlier.pop();
        }
        let mut later = Slots::new(8, tag::queue_hi(4, true), earlier.tail);
        later.commit(8);
        assert_eq!(later.hi, earlier.hi, "the same place and queue: only the sequence number tells them apart");
        for seq in 1000..earlier.tail {
            assert!(later.holds(seq & tag::SEQ_MASK).is_none(), "{seq}");
        }
        for seq in later.head..later.tail {
            assert_eq!(later.holds(seq & tag::SEQ_MASK), Some(seq));
        }
    }

    #[test]
    fn a_batch_mark_retires_its_slots_as_one_across_both_wraps_and_never_past_tail() {
        // A ring of 8; the batch's first slot at ring index 6 and sequence 2^45 - 1, so both
        // the ring index and the tag's sequence bits wrap inside the batch.
        let mut s = Slots::new(7, 0, tag::SEQ_MASK - 2);
        s.commit(2); // two ordinary requests, no regions (none needed here)
        s.mark_batch(5);
        assert_eq!(s.head_mark(), 0, "the mark is at tail, not at head");
        s.commit(5);
        assert_eq!(s.outstanding(), 7);
        let _ = s.pop_span();
        let _ = s.pop_span();
        assert_eq!(s.head_mark(), 5);
        let _ = s.pop_span();
        assert_eq!((s.head, s.outstanding()), (s.tail, 0), "the batch retired its five slots as one");
        assert_eq!(s.head_mark(), 0, "and its mark is gone");
        // A mark that claims more than is outstanding stops at tail.
        s.mark_batch(6);
        s.commit(2);
        let _ = s.pop_span();
        assert_eq!(s.outstanding(), 0);
        // A mark taken back with its region (a batch not posted) leaves an ordinary slot.
        s.mark_batch(3);
        assert!(s.unput_at(0).is_none());
        assert_eq!(s.spans[s.index(s.tail)], 0);
        // retire_through stops at the sequence number it is given, batches whole.
        s.commit(1);
        s.mark_batch(2);
        s.commit(2);
        let upto = s.tail.wrapping_sub(1);
        assert!(s.retire_through(upto).is_empty());
        assert_eq!(s.outstanding(), 0);
    }
}
