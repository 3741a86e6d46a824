//! The slot ring behind each work queue of a [`QueuePair`](crate::QueuePair): which region
//! each posted work request holds, in posting order, until its completion retires it.

use std::mem;
use std::sync::Arc;

use crate::mr::MrInner;

/// One slot of a work queue's ring.
#[derive(Default)]
pub(crate) struct Slot {
    user_wr_id: u64,
    /// Never read: holding it keeps the region allocated while the device may use it.
    _region: Option<Arc<MrInner>>,
}

/// A fixed ring of in-flight work requests, in posting order.
pub(crate) struct Ring {
    /// A power of two at least `depth` long, so a slot is `seq & mask` (no division).
    pub(crate) slots: Box<[Slot]>,
    /// How many work requests the queue holds.
    depth: u64,
    /// Sequence number of the oldest outstanding work request.
    head: u64,
    /// Sequence number the next work request gets.
    tail: u64,
}

impl Ring {
    pub(crate) fn new(depth: u32) -> Ring {
        let len = (depth as usize).next_power_of_two();
        Ring { slots: (0..len).map(|_| Slot::default()).collect(), depth: depth as u64, head: 0, tail: 0 }
    }
    pub(crate) fn cap(&self) -> u64 {
        self.depth
    }
    pub(crate) fn outstanding(&self) -> u64 {
        self.tail - self.head
    }
    pub(crate) fn free(&self) -> u64 {
        self.cap() - self.outstanding()
    }
    fn slot(&mut self, seq: u64) -> &mut Slot {
        let mask = self.slots.len() - 1;
        &mut self.slots[seq as usize & mask]
    }
    /// Records a work request at `tail + k` (not yet committed).
    pub(crate) fn stage(&mut self, k: u64, user_wr_id: u64, mr: Option<&Arc<MrInner>>) -> u64 {
        let seq = self.tail + k;
        *self.slot(seq) = Slot { user_wr_id, _region: mr.cloned() };
        seq
    }
    /// Commits `n` staged work requests and drops the rest of `staged`.
    pub(crate) fn commit(&mut self, n: u64, staged: u64) {
        for k in n..staged {
            let seq = self.tail + k;
            *self.slot(seq) = Slot::default();
        }
        self.tail += n;
    }
    /// Retires every work request up to and including `seq`; returns the caller's wr_id.
    /// A sequence number outside the outstanding window (never ours) retires nothing.
    pub(crate) fn complete(&mut self, seq: u64) -> Option<u64> {
        if seq < self.head || seq >= self.tail {
            return None;
        }
        let mut id = 0;
        while self.head <= seq {
            let h = self.head;
            let s = mem::take(self.slot(h));
            id = s.user_wr_id;
            self.head += 1;
        }
        Some(id)
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
        assert_eq!(r.outstanding(), 1);
        // Stale or foreign sequence numbers retire nothing.
        assert_eq!(r.complete(0), None);
        assert_eq!(r.complete(7), None);
        assert_eq!(r.complete(2), Some(102));
        assert_eq!(r.outstanding(), 0);
    }

    #[test]
    fn partial_commit_clears_unposted_slots() {
        let mut r = Ring::new(4);
        for k in 0..3 {
            r.stage(k, k, None);
        }
        r.commit(1, 3);
        assert_eq!(r.outstanding(), 1);
        assert_eq!(r.complete(0), Some(0));
        assert_eq!(r.complete(1), None, "an unposted work request must not be completable");
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
        assert_eq!(r.free(), 3);
    }

    #[test]
    fn ring_wraps() {
        let mut r = Ring::new(2);
        for i in 0..10u64 {
            r.stage(0, i, None);
            r.commit(1, 1);
            assert_eq!(r.complete(i), Some(i));
        }
        assert_eq!(r.head, 10);
    }
}
