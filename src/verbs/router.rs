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
    nonce: u16,
    queues: Arc<Mutex<Queues>>,
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

    /// Enters a QP; returns its index (the `owner` of its `wr_id`s on this CQ).
    pub(crate) fn attach_qp(&mut self, qp_num: u32, nonce: u16, queues: Arc<Mutex<Queues>>) -> Result<u16> {
        let e = Some(QpEntry { qp_num, nonce, queues });
        if let Some(i) = self.free.pop() {
            self.qps[i as usize] = e;
            return Ok(i);
        }
        if self.qps.len() > u16::MAX as usize {
            return Err(Error::InvalidArgument("a CQ serves at most 65536 QPs".into()));
        }
        self.qps.push(e);
        Ok((self.qps.len() - 1) as u16)
    }

    /// Removes a QP (after it was destroyed): its late completions retire nothing.
    pub(crate) fn detach_qp(&mut self, index: u16) {
        if let Some(e) = self.qps.get_mut(index as usize) {
            if e.take().is_some() {
                self.free.push(index);
            }
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
        if e.qp_num != wc.qp_num || e.nonce != t.nonce {
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

    /// Moves completions that QPs' polls kept (for other QPs, or in this CQ's SRQs) into `out`.
    pub(crate) fn deliver_kept(&mut self, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        if self.kept {
            for e in self.qps.iter().flatten() {
                n += lock(&e.queues).deliver_kept(None, &mut out[n..]);
            }
            // All delivered (or `out` is full and the next poll looks again).
            self.kept = n == out.len();
        }
        for e in &self.srqs {
            let mut slots = e.srq.slots();
            while n < out.len() {
                match slots.take_kept(|_| true) {
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
