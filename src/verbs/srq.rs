//! [`SharedReceiveQueue`]: receives posted once, consumed by whichever attached QP a message
//! arrives on (`ibv_create_srq`).
//!
//! ```no_run
//! use rdma_cm::{ProtectionDomain, QpInit, SharedReceiveQueue, VerbsContext};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let pd = ProtectionDomain::new(&VerbsContext::open("rxe0")?)?;
//! let srq = SharedReceiveQueue::new(&pd, 1024)?; // one pool of receives for many QPs
//! let init = QpInit::new().srq(&srq); // each QP made with this takes its receives from `srq`
//! srq.arm_limit(64)?; // an async event when fewer than 64 receives are left
//! # let _ = init;
//! # Ok(()) }
//! ```
//!
//! # Ownership of in-flight memory
//!
//! As on a QP, posting a receive moves a handle of its region into a slot the SRQ holds until
//! the completion is reaped. An SRQ's receives complete in any order, on the receive CQs of
//! the QPs attached to it, so its slots are a table with a free list rather than a ring: a
//! completion names its slot and which posting of that slot it is (the slot's count of
//! postings, 29 bits of it, in its `wr_id`), and retires that slot only while that same posting
//! is outstanding. A completion handed out again (a device that replays a lap of its CQ, as
//! rdma-core 44's Soft-RoCE does after an extended poll's end) names an earlier posting of its slot and
//! retires nothing: it would have to be 2^29 postings of that one slot old to match, and a CQ
//! holds far fewer completions than that. The table is allocated once, at creation; posting and retiring allocate nothing.
//!
//! An SRQ made with [`SharedReceiveQueue::with_sge`] takes receives of several pieces
//! ([`RecvWr::sg`]): the first piece's handle sits in the slot, the others' in a side table
//! (slots × (pieces − 1) entries, allocated with the slots), and retiring or releasing the slot
//! releases them all together.
//!
//! Every QP attached to an SRQ holds it, so it is destroyed after them; its slots (and the
//! regions they hold) are released only once it is destroyed, since until then the device may
//! still write a posted receive. A receive that a QP took but whose completion was never
//! reaped (the QP was dropped meanwhile) stays held until the SRQ goes.
//!
//! # The limit event
//!
//! [`SharedReceiveQueue::arm_limit`] asks the device for an `IBV_EVENT_SRQ_LIMIT_REACHED`
//! asynchronous event when fewer than the given number of receives remain posted. It fires once
//! per arming, and is delivered to the SRQ: [`SharedReceiveQueue::limit_reached`] says whether
//! it came since the last arming. It also arrives on the context's event sources
//! ([`crate::VerbsContext::async_events`]), where [`SharedReceiveQueue::is_limit_event`] tells
//! whether an event is this SRQ's.

use std::fmt;
use std::mem;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rdma_sys as ffi;

use crate::error::{check_ibv, errno, Error, Result};
use crate::status::Subject;
use crate::status::WorkQueue;
use crate::verbs::device::AsyncEvent;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::ring::{tag, Extra, Hold, Pending};
use crate::verbs::wc::WorkCompletion;
use crate::verbs::wr::RecvWr;

/// One slot of an SRQ.
#[derive(Default)]
struct Slot {
    /// Counts the slot's postings (bumped at every post), so a completion names one of them.
    posting: u64,
    posted: bool,
    user_wr_id: u64,
    _hold: Option<Hold>,
    /// How many holds of the receive's later pieces sit in the side table.
    extra: u8,
}

/// An SRQ's slots and the completions kept for the QPs that consumed them.
pub(crate) struct Slots {
    slots: Box<[Slot]>,
    /// The holds of each posted receive's pieces after the first (empty for one piece).
    extra: Extra,
    /// Free slot indices (capacity: every slot), so taking and returning one allocates nothing.
    free: Vec<u32>,
    /// Completions of this SRQ reaped by one QP's poll for another QP; each keeps its place.
    kept: Pending,
}

impl Slots {
    fn new(depth: u32, max_sge: u32) -> Slots {
        Slots {
            slots: (0..depth).map(|_| Slot::default()).collect(),
            extra: Extra::<Hold>::new(depth as usize, max_sge),
            free: (0..depth).rev().collect(),
            kept: Pending::new(depth),
        }
    }

    /// Receives that can still be posted.
    fn room(&self) -> usize {
        self.free.len().saturating_sub(self.kept.len())
    }

    /// Stages a receive in a free slot, holding every piece; returns the slot and its new
    /// posting count. `None` when no slot is free (the caller checked the room before).
    fn stage(&mut self, w: &RecvWr<'_>) -> Option<(u32, u64)> {
        let i = self.free.pop()?;
        let mut extra = 0;
        if crate::verbs::wr::needs_rest_holds(Some(w.mr.inner()), w.rest) {
            extra = self.extra.store(i as usize, crate::verbs::wr::hold_rest(Some(w.mr.inner()), w.rest, true));
        }
        let s = &mut self.slots[i as usize];
        let posting = s.posting.wrapping_add(1);
        *s = Slot { posting, posted: true, user_wr_id: w.wr_id, _hold: Some(Hold::new(w.mr.inner(), true)), extra };
        Some((i, posting))
    }

    /// Empties slot `i` (keeping its posting count), releases every piece it held, and returns it
    /// to the free list. Every retirement and release goes through this.
    #[inline]
    fn release(&mut self, i: u32) {
        let s = &mut self.slots[i as usize];
        let extra = s.extra;
        *s = Slot { posting: s.posting, ..Slot::default() };
        if extra > 0 {
            self.extra.clear(i as usize, extra);
        }
        self.free.push(i);
    }

    /// Retires the slot a completion names; the caller's wr_id, or `None` when the slot is not
    /// posted, or posted again since (stale, replayed or foreign).
    pub(crate) fn complete(&mut self, t: &tag::Tag) -> Option<u64> {
        let (i, posting) = tag::srq_parts(t.low);
        let s = self.slots.get_mut(i)?;
        if !s.posted || s.posting & tag::SRQ_POSTING_MASK != posting {
            return None;
        }
        let id = s.user_wr_id;
        self.release(i as u32);
        Some(id)
    }

    /// Keeps a completion for the QP that consumed it (`wc.qp_num()`).
    pub(crate) fn keep(&mut self, wc: WorkCompletion) {
        self.kept.push(wc);
    }

    /// Takes the first kept completion that `pick` accepts.
    pub(crate) fn take_kept(&mut self, pick: impl FnMut(&WorkCompletion) -> bool) -> Option<WorkCompletion> {
        self.kept.take_first(pick)
    }

    /// Drops the kept completions of QP `qp_num` (which is gone); their slots were retired
    /// when they were reaped.
    pub(crate) fn discard_for(&mut self, qp_num: u32) -> usize {
        self.kept.remove_all(|wc| wc.qp_num() == qp_num)
    }

    /// Whether completions are kept.
    pub(crate) fn has_kept(&self) -> bool {
        self.kept.len() > 0
    }
}

/// The SRQ itself: shared by its handle, the QPs attached to it and the routing tables of their
/// receive CQs. Destroyed when the last of them goes.
pub(crate) struct SrqShared {
    raw: NonNull<ffi::ibv_srq>,
    /// The owner field of this SRQ's `wr_id`s (unique among live SRQs of the process, mostly;
    /// the routing table compares the SRQ too).
    pub(crate) id: u16,
    depth: u32,
    /// The most pieces a receive may name (what the side table was sized for).
    max_sge: u32,
    slots: Mutex<Slots>,
    /// Its place in the context's registry of async events (left before the SRQ is destroyed).
    async_reg: crate::verbs::hub::Registration,
    // Dropped after the SRQ is destroyed (Drop::drop runs first).
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the SRQ's verbs (post, modify, destroy) are thread-safe in libibverbs; the slots are
// behind a mutex; destruction happens once, in Drop, when no QP or CQ refers to it.
unsafe impl Send for SrqShared {}
// SAFETY: see the Send impl.
unsafe impl Sync for SrqShared {}

impl SrqShared {
    pub(crate) fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.raw.as_ptr()
    }
    pub(crate) fn depth(&self) -> u32 {
        self.depth
    }
}

impl Drop for SrqShared {
    fn drop(&mut self) {
        // Out of the registry before the destroy (see crate::verbs::async_event).
        self.async_reg.leave();
        // SAFETY: every QP attached holds this value, so none exists; destroyed exactly once.
        let ret = unsafe { ffi::ibv_destroy_srq(self.raw.as_ptr()) };
        if ret != 0 {
            // The device may still write posted receives: leak their regions (every piece's),
            // then report.
            let slots = self.slots.get_mut().unwrap_or_else(|e| e.into_inner());
            mem::forget(mem::take(&mut slots.slots));
            mem::forget(mem::replace(&mut slots.extra, Extra::<Hold>::new(0, 1)));
            crate::error::report_leak("ibv_destroy_srq", ret);
        }
        // Destroyed: the slots (and regions) drop with the struct.
    }
}

/// A shared receive queue (`ibv_srq`). Cloning is cheap and yields another handle to the same
/// SRQ; attach QPs with [`crate::QpInit::srq`].
#[derive(Clone)]
pub struct SharedReceiveQueue {
    inner: Arc<SrqShared>,
}

impl SharedReceiveQueue {
    /// Creates an SRQ on `pd` that holds up to `depth` receives of one scatter entry each.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero depth; [`Error::Call`] when `ibv_create_srq`
    /// fails (e.g. `EINVAL` beyond the device's `max_srq_wr`, `ENOSYS` without SRQ support).
    pub fn new(pd: &Arc<ProtectionDomain>, depth: u32) -> Result<SharedReceiveQueue> {
        Self::with_sge(pd, depth, 1)
    }

    /// Creates an SRQ on `pd` that holds up to `depth` receives of up to `max_sge` pieces each
    /// ([`RecvWr::sg`]). Every piece of a posted receive is held until its completion is
    /// reaped (or the SRQ is destroyed), as a single region is.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero depth, or `max_sge` outside 1 to
    /// [`MAX_SGE`](crate::MAX_SGE) or beyond the device's `max_srq_sge`; [`Error::Call`] as
    /// for [`SharedReceiveQueue::new`].
    pub fn with_sge(pd: &Arc<ProtectionDomain>, depth: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        if depth == 0 || depth > u16::MAX as u32 + 1 {
            return Err(Error::InvalidArgument(format!("SRQ depth {depth} must be between 1 and 65536")));
        }
        crate::verbs::wr::check_sge_request(max_sge, "SharedReceiveQueue::with_sge")?;
        if max_sge > 1 {
            let ctx = pd.context();
            let max = ctx.limits()?.max_srq_sge;
            crate::verbs::wr::check_sge_device(
                max_sge,
                "SharedReceiveQueue::with_sge",
                max,
                "max_srq_sge",
                &ctx.device_name(),
            )?;
        }
        // SAFETY: ibv_srq_init_attr is plain old data; zero is a valid start.
        let mut attr: ffi::ibv_srq_init_attr = unsafe { mem::zeroed() };
        attr.attr.max_wr = depth;
        attr.attr.max_sge = max_sge;
        // SAFETY: the PD is valid; attr is initialised; the result is checked.
        let raw = unsafe { ffi::ibv_create_srq(pd.as_raw(), &mut attr) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::call("ibv_create_srq", errno(), None))?;
        // What was asked, or less if the provider says so (the side table is sized by it).
        let max_sge = attr.attr.max_sge.clamp(1, max_sge);
        static NEXT: AtomicU16 = AtomicU16::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let slots = Mutex::new(Slots::new(depth, max_sge));
        let async_reg = crate::verbs::hub::Registration::new(pd.context().hub(), Subject::Srq, raw.as_ptr() as usize);
        let pd = Arc::clone(pd);
        Ok(SharedReceiveQueue { inner: Arc::new(SrqShared { raw, id, depth, max_sge, slots, async_reg, pd }) })
    }

    pub(crate) fn shared(&self) -> &Arc<SrqShared> {
        &self.inner
    }

    /// The raw SRQ. It stays owned by the SRQ; posting to it directly bypasses the slot table.
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.as_raw()
    }

    /// How many receives it holds.
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// The most pieces a receive may name ([`SharedReceiveQueue::with_sge`]; 1 for
    /// [`SharedReceiveQueue::new`]).
    pub fn max_sge(&self) -> u32 {
        self.inner.max_sge
    }

    /// Receives posted and not yet completed (or completed and kept for their QP).
    pub fn outstanding(&self) -> usize {
        let s = self.inner.slots();
        self.inner.depth as usize - s.room()
    }

    /// The PD it was created on.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.inner.pd
    }

    /// Posts receives; any attached QP may consume them, in any order.
    ///
    /// # Errors
    /// [`Error::QueueFull`] or [`Error::InvalidArgument`]/[`Error::OutOfBounds`] before anything
    /// is posted; [`Error::Call`] when `ibv_post_srq_recv` fails (what it did not take is
    /// released; when it does not say what it took, everything stays held until the SRQ goes).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        for w in wrs {
            crate::verbs::wr::check_recv(&self.inner.pd, w, self.inner.max_sge, "SRQ", "SharedReceiveQueue::with_sge")?;
        }
        let mut slots = self.inner.slots();
        if wrs.len() > slots.room() {
            return Err(Error::QueueFull { queue: "shared receive", depth: self.inner.depth });
        }
        for chunk in wrs.chunks(crate::verbs::wr::CHUNK) {
            // Which slot each work request took.
            let mut taken = [None; crate::verbs::wr::CHUNK];
            let stage = |k: usize, w: &RecvWr<'_>| {
                let Some((i, posting)) = slots.stage(w) else {
                    // Unreachable: the room was checked above. Were it reached, the receive
                    // would be posted with no slot: its pieces must stay held all the same, so
                    // their holds are leaked, and its wr_id is not the crate's (it retires nothing).
                    mem::forget(Hold::new(w.mr.inner(), true));
                    for (m, _) in w.rest {
                        mem::forget(Hold::new(m.inner(), true));
                    }
                    return 0;
                };
                taken[k] = Some(i);
                tag::encode_srq(self.inner.id, i, posting)
            };
            let post = |first: *mut ffi::ibv_recv_wr, n| {
                let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
                // Every piece was checked against a region of this PD with LOCAL_WRITE, whose
                // handle a slot (or its side table) holds until reaped or the SRQ is destroyed.
                // SAFETY: the SRQ is valid; the list is well formed over live stack arrays; every
                // region it names is held (above).
                let ret = unsafe { ffi::ibv_post_srq_recv(self.inner.as_raw(), first, &mut bad) };
                (ret, crate::verbs::wr::rejected_from(bad, first.cast_const(), n), n)
            };
            let (ret, rejected, n) = crate::verbs::wr::with_recv_list(chunk, stage, post);
            if ret == 0 {
                continue;
            }
            match rejected {
                Some(k) => {
                    // The provider took the first k: release the others (every piece).
                    for i in taken[k..n].iter().flatten() {
                        slots.release(*i);
                    }
                    return check_ibv(ret, "ibv_post_srq_recv");
                }
                None => {
                    return Err(Error::Call {
                        op: "ibv_post_srq_recv",
                        addr: None,
                        hint: Some("the provider failed the post without saying which receives it took: they stay held until the SRQ is destroyed"),
                        source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
                    });
                }
            }
        }
        Ok(())
    }

    /// Asks for the limit event when fewer than `limit` receives remain posted (0 disarms),
    /// and clears [`SharedReceiveQueue::limit_reached`].
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_modify_srq` fails (`EINVAL` when `limit` exceeds the depth).
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        // Read what is pending first, so that an old limit event does not count for this arming.
        self.inner.async_reg.refresh()?;
        self.inner.async_reg.events().clear_limit();
        // SAFETY: ibv_srq_attr is plain old data.
        let mut attr: ffi::ibv_srq_attr = unsafe { mem::zeroed() };
        attr.srq_limit = limit;
        // SAFETY: the SRQ is valid; only srq_limit is read, as the mask says.
        check_ibv(
            unsafe { ffi::ibv_modify_srq(self.as_raw(), &mut attr, ffi::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32) },
            "ibv_modify_srq(limit)",
        )
    }

    /// Whether the limit event arrived since the limit was last armed
    /// ([`SharedReceiveQueue::arm_limit`]), after reading what the device has pending: the SRQ
    /// is running dry. Costs one `poll` when nothing is pending.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn limit_reached(&self) -> Result<bool> {
        self.inner.async_reg.refresh()?;
        Ok(self.inner.async_reg.events().limit())
    }

    /// The last asynchronous event the device reported about this SRQ
    /// ([`AsyncEventKind::SrqLimitReached`](crate::AsyncEventKind::SrqLimitReached),
    /// [`AsyncEventKind::SrqError`](crate::AsyncEventKind::SrqError)), after reading what is
    /// pending.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn last_async_event(&self) -> Result<Option<crate::status::AsyncEventKind>> {
        self.inner.async_reg.refresh()?;
        Ok(self.inner.async_reg.events().last())
    }

    /// Keeps `mr` until the SRQ is destroyed: a region a lane's slot held for a receive posted
    /// to this SRQ ([`crate::verbs::lane::LaneSrq`]), handed over when the lane goes. It takes
    /// a slot that no completion retires (not posted here), released with the slots after
    /// `ibv_destroy_srq` succeeds and leaked when it fails; with no slot free (never: the lane
    /// posts at most `depth` receives), the region is leaked.
    pub(crate) fn park(&self, mr: crate::verbs::mr::MemoryRegion) {
        let mut slots = self.inner.slots();
        match slots.free.pop() {
            Some(i) => slots.slots[i as usize]._hold = Some(Hold::new(mr.inner(), false)),
            None => mem::forget(mr),
        }
    }

    /// Whether `ev` is this SRQ's limit event.
    pub fn is_limit_event(&self, ev: &AsyncEvent) -> bool {
        ev.is_srq_limit() && ev.element == crate::verbs::device::AsyncElement::Srq(self.as_raw() as usize)
    }

    /// Takes kept completions of QP `qp_num` into `out` (those another QP's poll reaped).
    pub(crate) fn deliver_kept_for(&self, qp_num: u32, out: &mut [WorkCompletion]) -> usize {
        let mut slots = self.inner.slots();
        let mut n = 0;
        while n < out.len() && slots.has_kept() {
            match slots.take_kept(|wc| wc.qp_num() == qp_num) {
                Some(wc) => {
                    out[n] = wc;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// A kept completion of QP `qp_num` that `pick` accepts.
    pub(crate) fn take_kept_for(
        &self,
        qp_num: u32,
        mut pick: impl FnMut(&WorkCompletion) -> bool,
    ) -> Option<WorkCompletion> {
        let mut slots = self.inner.slots();
        if !slots.has_kept() {
            return None;
        }
        slots.take_kept(|wc| wc.qp_num() == qp_num && wc.queue() == WorkQueue::Recv && pick(wc))
    }
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("depth", &self.inner.depth)
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marks slot `i` of `s` as posted for the `posting`-th time (as `stage` does, without a
    /// region).
    fn post(s: &mut Slots, i: u32, posting: u64) {
        s.free.retain(|&f| f != i);
        s.slots[i as usize] = Slot { posting, posted: true, user_wr_id: posting, _hold: None, extra: 0 };
    }

    fn complete(s: &mut Slots, i: u32, posting: u64) -> Option<u64> {
        s.complete(&tag::decode(tag::encode_srq(3, i, posting)).unwrap())
    }

    #[test]
    fn a_replayed_completion_of_an_earlier_posting_of_the_slot_retires_nothing() {
        let mut s = Slots::new(4, 1);
        // 8,192 postings later (the replay a 13-bit generation took for the current one), and
        // 2^16 later: neither names the slot's current posting.
        for earlier in [8192u64, 1 << 16, 1 << 28] {
            let now = earlier + 1;
            post(&mut s, 2, now);
            assert_eq!(complete(&mut s, 2, now - earlier), None, "{earlier} postings back");
            assert_eq!(complete(&mut s, 2, now), Some(now), "the current posting retires");
            assert_eq!(complete(&mut s, 2, now), None, "and only once");
        }
        assert_eq!(complete(&mut s, 3, 0), None, "a slot never posted");
        // The posting count wraps in the tag after 2^29 postings of the one slot.
        post(&mut s, 1, (1 << 29) + 7);
        assert_eq!(complete(&mut s, 1, 7), Some((1 << 29) + 7));
    }
}
