//! Taking QPs out of a lane: moving one to the error state, removing it (its flushed work
//! reaped within a bound, other QPs' completions kept for later polls), and the lane's drop.

use std::collections::VecDeque;
use std::mem::{self, MaybeUninit};
use std::time::Instant;

use rdma_sys as ffi;

use super::{tag, Lane, LaneQp, DRAIN_TIMEOUT, POLL_BATCH};
use crate::error::Result;

impl Lane {
    /// Moves `qp` to the error state: everything it has posted completes (flushed), and posts
    /// are refused from then on.
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `ibv_modify_qp` fails; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an unknown `qp`.
    pub fn set_error(&mut self, qp: LaneQp) -> Result<()> {
        self.member(qp)?.set_error()
    }

    /// Detaches `qp` and destroys it: moves it to the error state, reaps its flushed work for
    /// up to 2 s (their regions are released: poll until [`Lane::outstanding`] is zero first
    /// to get them back), then destroys the QP. Completions of other QPs met on the way are
    /// kept for [`Lane::poll`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an unknown `qp`. Teardown itself does not fail: what it
    /// cannot release safely it leaks.
    pub fn remove(&mut self, qp: LaneQp) -> Result<()> {
        self.remove_by(qp, Instant::now() + DRAIN_TIMEOUT)
    }

    /// [`Lane::remove`], its flushed work reaped until `reaped_by`, then what the CQ holds: a
    /// disconnect, which reaped the flush before it told the peer, gives its own deadline, so
    /// the slots that never complete (unsignaled sends that ran) are waited for once.
    pub(super) fn remove_by(&mut self, qp: LaneQp, reaped_by: Instant) -> Result<()> {
        self.member(qp)?;
        self.drain(Some(qp.place), reaped_by);
        let place = qp.place as usize;
        // The next QP at the place continues its sequence numbers, so no tag this one posted
        // (a stale completion of it, reaped later) is ever in that QP's window; and the next
        // QP's handle has another attach number, so this one's handle and prepared work
        // requests stay refused.
        if let (Some(Some(m)), Some(next)) = (self.members.get(place), self.next_seq.get_mut(place)) {
            *next = [m.send.tail, m.recv.tail];
            // A QP on an SRQ leaves it: a completion of it met later names no LaneQp.
            if m.owner.lane_qp().srq().is_some() {
                self.srqs.left(m.qp_num, m.key, m.owner.lane_qp());
            }
        }
        drop(self.members[place].take());
        Ok(())
    }

    /// Moves `only` (or every QP) to the error state and reaps their flushed work until
    /// `deadline`, then what the CQ holds (so a deadline already passed still takes what came
    /// meanwhile); completions of other QPs are kept, in order, for later polls.
    pub(super) fn drain(&mut self, only: Option<u16>, deadline: Instant) {
        self.defer_buffer();
        let mine = |p: u16| only.is_none_or(|o| o == p);
        for (p, m) in self.members.iter_mut().enumerate() {
            if let Some(m) = m {
                if mine(p as u16) && m.send.outstanding() + m.recv.outstanding() > 0 {
                    // A QP that cannot be moved there keeps its regions until it is destroyed.
                    let _ = m.set_error();
                }
            }
        }
        // The kept completions first (they are older): those of the QPs torn down retire now,
        // the others stay, in order.
        let mut others = VecDeque::with_capacity(self.deferred.capacity());
        for wc in mem::take(&mut self.deferred) {
            if !self.retire_for_teardown(&wc, &mine) {
                others.push_back(wc);
            }
        }
        // Past the deadline, the CQ is emptied once: at most its depth, a batch at a time.
        let mut after = self.cq.depth() as usize / POLL_BATCH + 1;
        loop {
            let mut left = 0;
            for (p, m) in self.members.iter().enumerate() {
                if let Some(m) = m.as_ref().filter(|_| mine(p as u16)) {
                    left += m.send.outstanding() + m.recv.outstanding();
                }
            }
            if left == 0 {
                break;
            }
            let last = Instant::now() >= deadline;
            let mut buf: [MaybeUninit<ffi::ibv_wc>; POLL_BATCH] = [const { MaybeUninit::uninit() }; POLL_BATCH];
            // SAFETY: the CQ is alive; `buf` has room for POLL_BATCH entries; `poll_cq` is its
            // own context's (`ops`).
            let got = unsafe { (self.poll_cq)(self.cq_raw.as_ptr(), POLL_BATCH as i32, buf.as_mut_ptr().cast()) };
            if got < 0 {
                break;
            }
            if got == 0 {
                std::thread::yield_now();
            }
            for slot in &buf[..got as usize] {
                // SAFETY: the provider initialised the first `got` entries; each is read once.
                let wc = unsafe { slot.assume_init_read() };
                if !self.retire_for_teardown(&wc, &mine) {
                    others.push_back(wc);
                }
            }
            if last {
                after -= 1;
                if got < POLL_BATCH as i32 || after == 0 {
                    break;
                }
            }
        }
        self.deferred = others;
        self.backlog = self.holds_backlog();
    }

    /// Retires what `wc` names when it is a completion of a QP being torn down (the regions are
    /// dropped: the device is done with them); false for any other completion.
    fn retire_for_teardown(&mut self, wc: &ffi::ibv_wc, mine: &impl Fn(u16) -> bool) -> bool {
        // An SRQ receive's completion (of this QP or another) is kept for the next poll,
        // which retires its SRQ slot and hands its region out.
        if wc.wr_id & tag::FOREIGN != 0 || super::srq::is_srq(wc.wr_id) {
            return false;
        }
        let (recv, place, seq) = tag::decode(wc.wr_id);
        if !mine(place) {
            return false;
        }
        let Some(Some(m)) = self.members.get_mut(place as usize) else { return true };
        if m.qp_num != wc.qp_num {
            return true; // stale: retires nothing
        }
        // A batch's interior work request retires nothing: its batch retires with its last,
        // or, when only part of it was posted, with this one if it was the last posted.
        let through = if wc.wr_id & tag::INTERIOR != 0 {
            let (batch, index) = tag::interior_parts(wc.wr_id);
            if !m.owns_batch(batch) {
                return true; // an earlier QP's at the place
            }
            m.orphan_done(batch, index)
        } else {
            // Outside the window: an earlier QP's at the place, or one handed out twice.
            let slots = if recv { &mut m.recv } else { &mut m.send };
            slots.holds(seq)
        };
        let Some(through) = through else { return true };
        let slots = if recv { &mut m.recv } else { &mut m.send };
        drop(slots.retire_through(through));
        if !recv {
            m.batch_error = None;
        }
        true
    }
}

impl Drop for Lane {
    /// Moves every QP to the error state, reaps their flushes within the bound, then destroys
    /// them (regions still held then are released with the QP, see the module docs), and only
    /// then the CQ.
    fn drop(&mut self) {
        if self.members.iter().any(Option::is_some) {
            self.drain(None, Instant::now() + DRAIN_TIMEOUT);
        }
        self.members.clear();
    }
}
