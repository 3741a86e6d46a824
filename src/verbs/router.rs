//! A CQ's routing table ([`Router`]): every `wr_id` the crate posts carries the index of its QP
//! (or SRQ) in the table of the CQ it completes on (see `ring::tag`), so whoever polls the
//! CQ retires each completion's slot in the queue that posted it, in O(1) and without
//! allocating; completions of other QPs are kept for them. See [`crate::verbs::cq`].

use std::sync::{Arc, Mutex};

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::status::WorkQueue;
use crate::verbs::ring::{tag, Notify, Queues};
use crate::verbs::srq::SrqShared;
use crate::verbs::wc::WorkCompletion;
use crate::wait::lock;

/// A QP's entry in a CQ's routing table.
struct QpEntry {
    qp_num: u32,
    queues: Arc<Mutex<Queues>>,
    /// Which of the QP's queues complete on this CQ: `None` for both, else the one.
    here: Option<WorkQueue>,
}

/// An SRQ whose receives complete on this CQ, and how many of its QPs use the CQ.
pub(crate) struct SrqEntry {
    pub(crate) srq: Arc<SrqShared>,
    pub(crate) users: usize,
}

/// Who a routed completion belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    Qp(u16),
    Srq(u16),
}

/// A CQ's routing table: which QP (or SRQ) each completion retires a slot of.
#[derive(Default)]
pub(crate) struct Router {
    qps: Vec<Option<QpEntry>>,
    /// Beside each index, the sequence number its next QP starts at: past every one the QPs
    /// there before it used, so none of their completions can name a work request of a later
    /// QP at the index (see `ring::tag`).
    bases: Vec<u64>,
    free: Vec<u16>,
    pub(crate) srqs: Vec<SrqEntry>,
    /// Completions the attached queues may have outstanding at once.
    pub(crate) reserved: u64,
    /// A QP's poll kept completions of other QPs here: the CQ's own poll looks for them.
    kept: bool,
    /// Wakes a [`CompletionQueue::wait`] asleep while a QP's poll keeps a completion (which
    /// took the CQ's entry, and perhaps its event, from under the sleeper).
    pub(crate) notify: Notify,
}

impl Router {
    /// Reserves room for `n` more outstanding completions on a CQ of `depth`.
    pub(crate) fn reserve(&mut self, n: u64, depth: u32) -> Result<()> {
        if self.reserved + n > depth as u64 {
            return Err(Error::InvalidArgument(format!(
                "the CQ holds {depth} completions and its queues may already have {} outstanding: {n} more could overrun it; create it deeper (the sum of the depths of the queues it serves), resize it (CompletionQueue::resize), or let it grow as queues join (CompletionQueue::set_auto_grow)",
                self.reserved
            )));
        }
        self.reserved += n;
        Ok(())
    }

    pub(crate) fn unreserve(&mut self, n: u64) {
        self.reserved = self.reserved.saturating_sub(n);
    }

    /// Takes a free index for a QP, with the sequence number its rings must start at (the
    /// index's base: see `bases`); [`Router::enter_qp`] then enters it.
    pub(crate) fn reserve_index(&mut self) -> Result<(u16, u64)> {
        if let Some(i) = self.free.pop() {
            return Ok((i, self.bases[i as usize]));
        }
        if self.qps.len() > u16::MAX as usize {
            return Err(Error::InvalidArgument("a CQ serves at most 65536 QPs".into()));
        }
        self.qps.push(None);
        self.bases.push(0);
        Ok(((self.qps.len() - 1) as u16, 0))
    }

    /// Enters a QP at the index [`Router::reserve_index`] gave it (the `owner` of its `wr_id`s
    /// on this CQ); its rings start at that index's base or later. `here`: which of its queues
    /// complete on this CQ (`None`: both).
    pub(crate) fn enter_qp(&mut self, index: u16, qp_num: u32, queues: Arc<Mutex<Queues>>, here: Option<WorkQueue>) {
        if let Some(e) = self.qps.get_mut(index as usize) {
            *e = Some(QpEntry { qp_num, queues, here });
        }
    }

    /// Removes a QP (after it was destroyed): its late completions retire nothing, and the
    /// index's next QP starts past every sequence number it used.
    pub(crate) fn detach_qp(&mut self, index: u16) {
        let Some(Some(e)) = self.qps.get_mut(index as usize).map(Option::take) else { return };
        let q = lock(&e.queues);
        let end = q.send.next_seq().max(q.recv.next_seq());
        drop(q);
        let base = &mut self.bases[index as usize];
        *base = (*base).max(end);
        self.free.push(index);
    }

    /// Gives back an index [`Router::reserve_index`] gave for a QP that was never entered.
    pub(crate) fn release_index(&mut self, index: u16) {
        if matches!(self.qps.get(index as usize), Some(None)) {
            self.free.push(index);
        }
    }

    /// Counts one more QP of `srq` when the SRQ completes here already; false when it does not.
    pub(crate) fn add_srq_user(&mut self, srq: &Arc<SrqShared>) -> bool {
        match self.srqs.iter_mut().find(|e| Arc::ptr_eq(&e.srq, srq)) {
            Some(e) => {
                e.users += 1;
                true
            }
            None => false,
        }
    }

    /// Whether the QP about to detach is the last of `srq`'s on this CQ (the SRQ's entry goes
    /// with it, so none of its completions may be left in the CQ: see
    /// [`CompletionQueue::detach_srq`]).
    pub(crate) fn last_user_of(&self, srq: &Arc<SrqShared>) -> bool {
        self.srqs.iter().any(|e| Arc::ptr_eq(&e.srq, srq) && e.users == 1)
    }

    /// Only through [`CompletionQueue::detach_srq`], which empties the CQ first.
    pub(crate) fn detach_srq(&mut self, srq: &Arc<SrqShared>) {
        if let Some(i) = self.srqs.iter().position(|e| Arc::ptr_eq(&e.srq, srq)) {
            self.srqs[i].users -= 1;
            if self.srqs[i].users == 0 {
                let e = self.srqs.swap_remove(i);
                self.unreserve(e.srq.depth() as u64);
            }
        }
    }

    /// Retires the slot a raw completion names; the completion for the caller, and its owner.
    /// `None` for a completion that is not the crate's, or names nothing outstanding.
    pub(crate) fn route(&mut self, wc: &ffi::ibv_wc) -> Option<(WorkCompletion, Owner)> {
        let t = tag::decode(wc.wr_id)?;
        if t.srq {
            let e = self.srqs.iter().find(|e| e.srq.id == t.owner)?;
            let id = e.srq.slots().complete(&t)?;
            if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                // A failed receive moves the QP that consumed it to the error state (a flush
                // says it is there already): its posts must be refused, as for its own receives.
                if let Some(qp) = self.qps.iter().flatten().find(|q| q.qp_num == wc.qp_num) {
                    lock(&qp.queues).note_status(wc.status);
                }
            }
            return Some((WorkCompletion::from_raw(wc, id, WorkQueue::Recv), Owner::Srq(t.owner)));
        }
        let e = self.qps.get(t.owner as usize)?.as_ref()?;
        if e.qp_num != wc.qp_num {
            return None;
        }
        let mut q = lock(&e.queues);
        let id = q.complete(&t, wc.status)?;
        q.note_status(wc.status);
        drop(q);
        let queue = if t.recv { WorkQueue::Recv } else { WorkQueue::Send };
        Some((WorkCompletion::from_raw(wc, id, queue), Owner::Qp(t.owner)))
    }

    /// A QP kept one of its own completions (polled on its own, without [`Router::keep`]):
    /// the CQ's own poll looks for it.
    pub(crate) fn note_kept(&mut self) {
        self.kept = true;
        self.notify.bump();
    }

    /// Whether completions are kept here for the CQ's own poll to deliver.
    pub(crate) fn has_kept(&self) -> bool {
        self.kept || self.srqs.iter().any(|e| e.srq.slots().has_kept())
    }

    /// Keeps a routed completion for its owner's next poll or wait.
    /// The QP's wait, asleep or about to sleep, is told (`ring::Notify`), so a completion kept
    /// for a QP waited on by another thread is never missed.
    pub(crate) fn keep(&mut self, wc: WorkCompletion, owner: Owner) {
        match owner {
            Owner::Qp(i) => {
                if let Some(Some(e)) = self.qps.get(i as usize) {
                    let mut q = lock(&e.queues);
                    q.keep(wc);
                    q.notify.bump();
                    drop(q);
                    self.kept = true;
                    self.notify.bump();
                }
            }
            Owner::Srq(id) => {
                // Kept for the QP that consumed the receive; every live QP whose receives
                // complete on this CQ is in this table.
                let Some(qp) = self.qps.iter().flatten().find(|e| e.qp_num == wc.qp_num()) else {
                    // That QP is gone: no poll or wait can ever take the completion, and kept it
                    // would count against the SRQ's room for good. Its slot (and the region it
                    // held) was retired by `route`; the completion is dropped, as a dropped QP's
                    // own completions are.
                    return;
                };
                if let Some(e) = self.srqs.iter().find(|e| e.srq.id == id) {
                    e.srq.slots().keep(wc);
                    lock(&qp.queues).notify.bump();
                    self.notify.bump();
                }
            }
        }
    }

    /// Moves completions that QPs' polls kept (for other QPs, or in this CQ's SRQs) into `out`:
    /// only those of queues that complete on this CQ. A QP whose send and receive queues
    /// complete on different CQs has each queue's kept completions handed out by that queue's
    /// CQ; an SRQ's kept completion, by the receive CQ of the QP that consumed it (an SRQ may
    /// serve QPs on several CQs, and keeps one list for them all).
    pub(crate) fn deliver_kept(&mut self, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        if self.kept {
            for e in self.qps.iter().flatten() {
                n += lock(&e.queues).deliver_kept(e.here, &mut out[n..]);
            }
            // All delivered (or `out` is full and the next poll looks again).
            self.kept = n == out.len();
        }
        let qps = &self.qps;
        let receives_here =
            |qp_num: u32| qps.iter().flatten().any(|e| e.qp_num == qp_num && e.here != Some(WorkQueue::Send));
        for e in &self.srqs {
            let mut slots = e.srq.slots();
            while n < out.len() {
                match slots.take_kept(|wc| receives_here(wc.qp_num())) {
                    Some(wc) => {
                        out[n] = wc;
                        n += 1;
                    }
                    None => break,
                }
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A completion of the QP at `index` with sequence number `seq`, successful.
    fn wc(index: u16, seq: u64, qp_num: u32) -> ffi::ibv_wc {
        // SAFETY: ibv_wc is plain old data; zero is a valid value of every field.
        let mut wc: ffi::ibv_wc = unsafe { std::mem::zeroed() };
        wc.wr_id = tag::encode(index, seq, false, false);
        wc.qp_num = qp_num;
        wc.status = ffi::ibv_wc_status::IBV_WC_SUCCESS;
        wc
    }

    /// Enters a QP of send depth 4 at the next free index; posts `n` sends (their wr_ids are
    /// 1000 + k) on it without holds.
    fn enter(r: &mut Router, qp_num: u32, n: u64) -> (u16, u64, Arc<Mutex<Queues>>) {
        let (index, base) = r.reserve_index().unwrap();
        let q = Arc::new(Mutex::new(Queues::new(4, 4, 1, 1, false, base)));
        {
            let mut g = lock(&q);
            for k in 0..n {
                g.send.stage(k, 1000 + k, None);
            }
            g.send.commit(n, n);
        }
        r.enter_qp(index, qp_num, Arc::clone(&q), None);
        (index, base, q)
    }

    #[test]
    fn a_qp_at_a_reused_index_starts_past_every_sequence_number_used_there() {
        let mut r = Router::default();
        let (i0, base0, _q0) = enter(&mut r, 17, 3);
        assert_eq!(base0, 0);
        r.detach_qp(i0);
        // The same QP number again (rxe's numbers cycle device-wide) at the same index.
        let (i1, base1, _q1) = enter(&mut r, 17, 2);
        assert_eq!((i1, base1), (i0, 3), "the index's next QP starts where the last one stopped");
        for stale in 0..3 {
            assert!(r.route(&wc(i1, stale, 17)).is_none(), "the earlier QP's completion {stale} retires nothing");
        }
        let (done, owner) = r.route(&wc(i1, 3, 17)).expect("the new QP's first send");
        assert_eq!((done.wr_id(), owner == Owner::Qp(i1)), (1000, true));
        assert!(r.route(&wc(i1, 3, 17)).is_none(), "a completion handed out twice retires nothing the second time");
    }

    #[test]
    fn no_number_of_qps_at_one_index_lets_an_old_completion_through() {
        // 20,000 QPs through one index (a 13-bit nonce would have wrapped twice), each posting
        // once: the first QP's completion, replayed at the end, names nothing outstanding.
        let mut r = Router::default();
        let first = wc(0, 0, 5);
        let mut last = None;
        for _ in 0..20_000 {
            let (i, base, q) = enter(&mut r, 5, 1);
            assert_eq!(i, 0);
            last = Some((base, q));
            r.detach_qp(i);
        }
        let (base, _q) = last.unwrap();
        assert_eq!(base, 19_999);
        let (i, base, _q) = enter(&mut r, 5, 1);
        assert_eq!((i, base), (0, 20_000));
        assert!(r.route(&first).is_none());
        assert_eq!(r.route(&wc(0, 20_000, 5)).map(|(d, _)| d.wr_id()), Some(1000));
    }

    #[test]
    fn an_index_given_back_unused_is_reused_and_keeps_its_base() {
        let mut r = Router::default();
        let (i, _, _q) = enter(&mut r, 1, 2);
        r.detach_qp(i);
        let (j, base) = r.reserve_index().unwrap();
        assert_eq!((j, base), (i, 2));
        r.release_index(j);
        assert_eq!(r.reserve_index().unwrap(), (i, 2), "given back with its base");
        assert_eq!(r.reserve_index().unwrap(), (1, 0), "and only once");
    }
}
