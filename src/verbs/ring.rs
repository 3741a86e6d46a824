//! The slot ring behind each work queue of a [`QueuePair`](crate::QueuePair): which region
//! each posted work request holds, in posting order, until its completion retires it; the
//! completions reaped but not yet handed to the caller; and the tag every `wr_id` carries so
//! that a completion finds its way back from any CQ.

use std::mem;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::verbs::ah::AddressHandle;
use crate::verbs::mr::MrInner;
use crate::verbs::wc::WorkCompletion;

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

    /// The region held.
    pub(crate) fn region(&self) -> &Arc<MrInner> {
        &self.region
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.writes {
            self.region.writers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One slot of a work queue's ring. (Generic over the hold only so that unit tests can watch
/// holds without a device; the crate uses [`Hold`].)
pub(crate) struct Slot<H = Hold> {
    user_wr_id: u64,
    /// Never read: holding it keeps the region allocated while the device may use it.
    _hold: Option<H>,
    /// How many holds of this work request's later pieces sit in the ring's side table.
    extra: u8,
    /// The provider said it did not take this work request: it holds nothing, completes
    /// nothing, and the head steps over it.
    void: bool,
    /// Its address handle (a UD send's) sits in the ring's address-handle table.
    ah: bool,
}

impl<H> Default for Slot<H> {
    fn default() -> Self {
        Slot { user_wr_id: 0, _hold: None, extra: 0, void: false, ah: false }
    }
}

/// The holds of the pieces after the first of each slot's work request: `width` entries per
/// slot, slot `i`'s at `i * width ..`. Allocated once, with the ring, and only for a queue
/// that takes more than one piece per work request (`width` 0 allocates nothing).
pub(crate) struct Extra<H = Hold> {
    holds: Box<[Option<H>]>,
    width: usize,
}

impl<H> Extra<H> {
    pub(crate) fn new(slots: usize, max_pieces: u32) -> Extra<H> {
        let width = (max_pieces as usize).saturating_sub(1);
        Extra { holds: (0..slots * width).map(|_| None).collect(), width }
    }

    /// Stores the holds of slot `i`'s later pieces; returns how many it stored.
    pub(crate) fn store(&mut self, i: usize, holds: impl Iterator<Item = H>) -> u8 {
        let mut n = 0;
        for h in holds {
            match self.holds.get_mut(i * self.width + n).filter(|_| n < self.width) {
                Some(e) => {
                    *e = Some(h);
                    n += 1;
                }
                // More pieces than the queue was created for: the checks before posting make
                // this unreachable. Were it reached, the piece must stay held while the device
                // may use it, and there is no slot for it: leak its hold rather than drop it.
                None => {
                    debug_assert!(false, "more pieces than the side table holds");
                    mem::forget(h);
                }
            }
        }
        n as u8
    }

    /// Releases slot `i`'s `n` later pieces.
    #[cold]
    pub(crate) fn clear(&mut self, i: usize, n: u8) {
        let start = i * self.width;
        self.holds[start..start + n as usize].fill_with(|| None);
    }

    /// Holds stored (for tests and debug checks).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.holds.iter().filter(|h| h.is_some()).count()
    }
}

/// A fixed ring of in-flight work requests, in posting order.
pub(crate) struct Ring<H = Hold> {
    /// A power of two at least `depth` long, so a slot is `seq & mask` (no division).
    pub(crate) slots: Box<[Slot<H>]>,
    /// The holds of later pieces (empty for a queue of one piece per work request).
    extra: Extra<H>,
    /// The address handle each UD send uses, one entry per slot (empty for a queue that sends
    /// no datagrams: an RC QP's, or any receive queue). Allocated once, with the ring.
    ahs: Box<[Option<Arc<AddressHandle>>]>,
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

impl<H> Ring<H> {
    /// A ring of `depth` work requests of up to `max_pieces` pieces each.
    pub(crate) fn new(depth: u32, max_pieces: u32) -> Ring<H> {
        let len = (depth as usize).next_power_of_two();
        Ring {
            slots: (0..len).map(|_| Slot::default()).collect(),
            extra: Extra::<H>::new(len, max_pieces),
            ahs: Box::new([]),
            depth: depth as u64,
            head: 0,
            tail: 0,
            undelivered: 0,
        }
    }
    /// The ring's first sequence number is `base` (where the earlier QPs at its routing index
    /// stopped: see [`tag`]).
    pub(crate) fn starting_at(mut self, base: u64) -> Ring<H> {
        self.head = base;
        self.tail = base;
        self
    }
    /// The sequence number the next work request gets.
    pub(crate) fn next_seq(&self) -> u64 {
        self.tail
    }
    /// Gives the ring its address-handle table (a UD QP's send queue), one entry per slot.
    pub(crate) fn with_address_handles(mut self) -> Ring<H> {
        self.ahs = (0..self.slots.len()).map(|_| None).collect();
        self
    }
    /// Holds `ah` for the work request just staged as `seq` until its slot is retired, so the
    /// address handle cannot be destroyed while the device may use it. Returns false when the
    /// ring has no table (not a UD send queue): the caller must not post then.
    pub(crate) fn stage_ah(&mut self, seq: u64, ah: &Arc<AddressHandle>) -> bool {
        let i = self.index(seq);
        match self.ahs.get_mut(i) {
            Some(e) => {
                *e = Some(Arc::clone(ah));
                self.slots[i].ah = true;
                true
            }
            None => false,
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
    fn index(&self, seq: u64) -> usize {
        seq as usize & (self.slots.len() - 1)
    }
    fn slot(&mut self, seq: u64) -> &mut Slot<H> {
        let i = self.index(seq);
        &mut self.slots[i]
    }
    /// Empties the slot of `seq` and returns what it held; the holds of its later pieces are
    /// released here, the first piece's with the returned slot. Every retirement goes through
    /// this, so no side-table entry outlives its slot.
    #[inline(always)]
    fn take(&mut self, seq: u64) -> Slot<H> {
        let i = self.index(seq);
        let s = mem::take(&mut self.slots[i]);
        if s.extra > 0 {
            self.extra.clear(i, s.extra);
        }
        if s.ah {
            self.ahs[i] = None;
        }
        s
    }
    /// Records a work request at `tail + k` (not yet committed), holding `hold` (its first
    /// piece); the holds of its later pieces, if any, follow with [`Ring::stage_rest`].
    #[inline]
    pub(crate) fn stage(&mut self, k: u64, user_wr_id: u64, hold: Option<H>) -> u64 {
        let seq = self.tail + k;
        let i = self.index(seq);
        // The slot is free: at most `depth` work requests are outstanding, and retired slots
        // are emptied (side table included) by `take`.
        debug_assert!(self.slots[i]._hold.is_none() && self.slots[i].extra == 0);
        self.slots[i] = Slot { user_wr_id, _hold: hold, extra: 0, void: false, ah: false };
        seq
    }
    /// Adds the holds of the later pieces (at most `max_pieces - 1`) of the work request just
    /// staged as `seq`; they are released with its slot.
    pub(crate) fn stage_rest(&mut self, seq: u64, rest: impl Iterator<Item = H>) {
        let i = self.index(seq);
        let n = self.extra.store(i, rest);
        self.slots[i].extra = n;
    }
    /// Commits `staged` work requests, of which the provider took the first `posted`: the
    /// others become void (their regions, every piece's, are released at once), and their
    /// sequence numbers are used up all the same.
    #[inline]
    pub(crate) fn commit(&mut self, posted: u64, staged: u64) {
        if posted == staged {
            // Nothing becomes void, and the head never rests on a void slot: nothing to skip.
            self.tail += staged;
            return;
        }
        self.commit_partly(posted, staged);
    }
    /// [`Ring::commit`] when the provider refused some of the work requests.
    #[cold]
    fn commit_partly(&mut self, posted: u64, staged: u64) {
        for k in posted..staged {
            let seq = self.tail + k;
            drop(self.take(seq));
            self.slot(seq).void = true;
        }
        self.tail += staged;
        self.skip_void();
    }
    /// Retires void slots at the head: nothing before them is outstanding any more.
    #[inline(always)]
    fn skip_void(&mut self) {
        while self.head < self.tail {
            let h = self.head;
            if !self.slot(h).void {
                break;
            }
            drop(self.take(h));
            self.head += 1;
        }
    }
    /// Retires every work request up to and including `seq`; returns the caller's wr_id, or
    /// `None` for a sequence number outside the outstanding window (never ours, or stale) or
    /// a void slot.
    #[inline]
    pub(crate) fn complete(&mut self, seq: u64) -> Option<u64> {
        if seq < self.head || seq >= self.tail {
            return None;
        }
        // Earlier unsignaled work requests retire with it.
        while self.head < seq {
            let h = self.head;
            drop(self.take(h));
            self.head += 1;
        }
        let last = self.take(seq);
        self.head += 1;
        self.skip_void();
        if last.void {
            return None;
        }
        Some(last.user_wr_id)
    }
    /// `n` kept completions reached the caller.
    pub(crate) fn delivered(&mut self, n: u64) {
        self.undelivered -= n;
    }
    /// A completion is kept for later: it holds its place until delivered.
    pub(crate) fn kept(&mut self) {
        self.undelivered += 1;
    }
    /// The full sequence number of a work request whose low `bits` bits are `low`: the one in
    /// the outstanding window (or just past it, which [`Ring::complete`] then refuses).
    pub(crate) fn widen(&self, low: u64, bits: u32) -> u64 {
        let mask = (1u64 << bits) - 1;
        self.head.wrapping_add(low.wrapping_sub(self.head) & mask)
    }
}

/// The tag in every `wr_id` this crate posts. A completion carries it back, so it can be routed
/// from any CQ to the queue that owns it, in O(1), and a foreign or stale one is recognised:
///
/// ```text
/// bit 63    62    61    60..45           44..0
///     RECV  OURS  SRQ   owner (16 bits)  sequence number (low 45 bits) / SRQ slot and its posting
/// ```
///
/// `owner` is the QP's index in the CQ's routing table (an SRQ's id for SRQ receives). The
/// sequence numbers of an index never start again: a QP that takes an index begins where the
/// QPs there before it stopped ([`Router::attach_qp`](crate::verbs::router::Router)), so a
/// completion of an earlier QP at the same index (still in the CQ, or handed out twice by the
/// device) names a sequence number behind the new QP's window and retires nothing. The full
/// sequence number is recovered from the ring's window; two work requests of one index share
/// a tag only 2^45 postings apart. An SRQ receive's low bits are its slot (`SRQ_SLOT_BITS`)
/// and the slot's posting count above it (see [`crate::verbs::srq`]).
pub(crate) mod tag {
    pub(crate) const RECV: u64 = 1 << 63;
    pub(crate) const OURS: u64 = 1 << 62;
    pub(crate) const SRQ: u64 = 1 << 61;
    const OWNER_SHIFT: u32 = 45;
    pub(crate) const SEQ_BITS: u32 = 45;
    const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
    /// The low bits of an SRQ receive's tag that name its slot (an SRQ holds at most 2^16).
    pub(crate) const SRQ_SLOT_BITS: u32 = 16;
    /// The bits of an SRQ slot's posting count that its tags carry (29).
    pub(crate) const SRQ_POSTING_MASK: u64 = (1 << (SEQ_BITS - SRQ_SLOT_BITS)) - 1;

    /// A decoded tag.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) struct Tag {
        pub(crate) recv: bool,
        pub(crate) srq: bool,
        pub(crate) owner: u16,
        pub(crate) low: u64,
    }

    #[inline(always)]
    pub(crate) fn encode(owner: u16, seq: u64, recv: bool, srq: bool) -> u64 {
        OURS | if recv { RECV } else { 0 }
            | if srq { SRQ } else { 0 }
            | (owner as u64) << OWNER_SHIFT
            | (seq & SEQ_MASK)
    }

    /// An SRQ receive's tag: SRQ `owner`, slot `slot`, the slot's `posting`-th use.
    pub(crate) fn encode_srq(owner: u16, slot: u32, posting: u64) -> u64 {
        encode(owner, (posting & SRQ_POSTING_MASK) << SRQ_SLOT_BITS | slot as u64, true, true)
    }

    /// An SRQ tag's low bits as (slot, posting count modulo 2^29).
    pub(crate) fn srq_parts(low: u64) -> (usize, u64) {
        ((low & ((1 << SRQ_SLOT_BITS) - 1)) as usize, low >> SRQ_SLOT_BITS)
    }

    /// The tag of a `wr_id`, or `None` when it is not one of this crate's.
    #[inline(always)]
    pub(crate) fn decode(wr_id: u64) -> Option<Tag> {
        (wr_id & OURS != 0).then_some(Tag {
            recv: wr_id & RECV != 0,
            srq: wr_id & SRQ != 0,
            owner: (wr_id >> OWNER_SHIFT) as u16,
            low: wr_id & SEQ_MASK,
        })
    }
}

/// Why a QP is known to be in the error state without the caller having put it there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// A completion of it failed with this status (other than a flush).
    Completion(rdma_sys::ibv_wc_status::Type),
    /// A wait that ran out found it in the error state with no completion saying why: on RC,
    /// the peer's RDMA access with a bad rkey moves the responder there silently (rxe).
    FoundInError,
}

/// How a completion kept for a QP by another QP's poll reaches a wait of that QP that is
/// asleep, or about to sleep: every such keep bumps `seq`; a blocking wait that sleeps sets
/// `sleeping` and has the keep write its eventfd; an async wait leaves its waker.
#[derive(Default)]
pub(crate) struct Notify {
    /// Keeps made for this QP by others, ever (compared, never read as a count).
    pub(crate) seq: u64,
    /// A blocking wait of this QP sleeps on `fd`: a keep must write it.
    pub(crate) sleeping: bool,
    /// An eventfd a blocking wait sleeps on, made at the first wait that sleeps.
    pub(crate) fd: Option<std::os::fd::OwnedFd>,
    /// The task of an async wait of this QP that sleeps.
    #[cfg(feature = "tokio")]
    pub(crate) waker: Option<std::task::Waker>,
}

impl Notify {
    /// A completion was kept for this QP by someone else: wake whoever waits.
    pub(crate) fn bump(&mut self) {
        self.seq = self.seq.wrapping_add(1);
        if self.sleeping {
            if let Some(fd) = &self.fd {
                crate::wait::eventfd_signal(fd);
            }
        }
        #[cfg(feature = "tokio")]
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// The eventfd a blocking wait sleeps on (made here the first time).
    pub(crate) fn fd(&mut self) -> crate::error::Result<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        if self.fd.is_none() {
            self.fd = Some(crate::wait::eventfd()?);
        }
        Ok(self.fd.as_ref().map_or(-1, |f| f.as_raw_fd()))
    }
}

/// One QP's work-queue state: the slot rings and the completions kept for it. Shared between
/// the QP (which posts) and the routing tables of its CQs (which retire), behind a mutex.
pub(crate) struct Queues {
    pub(crate) send: Ring,
    pub(crate) recv: Ring,
    pub(crate) send_kept: Pending,
    pub(crate) recv_kept: Pending,
    /// The QP is in the error state, and why (on RC any failed completion does this, on UD a
    /// datagram longer than its receive buffer): posts are refused, since nothing posted now
    /// can run and rxe never flushes a receive posted then.
    pub(crate) failed: Option<Failure>,
    /// Wakes a wait of this QP when another QP's poll keeps a completion for it.
    pub(crate) notify: Notify,
    /// The regions of memory windows' invalidations posted and not completed yet.
    invalidations: Invalidations,
}

/// The regions of memory windows' invalidations in flight, each beside its send's sequence
/// number: released only by that send's *successful* completion. An invalidation that fails,
/// or never completes (the QP destroyed first), may leave its window bound (a type 1 window is
/// reachable through any QP of the protection domain), so its region is then leaked: never
/// released, and out of Rust's reach.
#[derive(Default)]
struct Invalidations(Vec<(u64, Hold)>);

impl Drop for Invalidations {
    fn drop(&mut self) {
        for (_, hold) in self.0.drain(..) {
            leak(hold);
        }
    }
}

/// Leaks `hold`: its region is never released (one reference never given back) and, if the
/// device may write it, stays out of Rust's reach (its writer count is never lowered).
fn leak(hold: Hold) {
    std::mem::forget(hold);
}

impl Queues {
    /// Rings of the given depths, for work requests of up to `send_sge`/`recv_sge` pieces;
    /// `datagrams`: the send ring holds an address handle per work request (a UD QP).
    /// `base`: the first sequence number of both rings (see [`tag`]).
    pub(crate) fn new(
        send_depth: u32,
        recv_depth: u32,
        send_sge: u32,
        recv_sge: u32,
        datagrams: bool,
        base: u64,
    ) -> Queues {
        let send = Ring::<Hold>::new(send_depth, send_sge).starting_at(base);
        Queues {
            send: if datagrams { send.with_address_handles() } else { send },
            recv: Ring::<Hold>::new(recv_depth, recv_sge).starting_at(base),
            send_kept: Pending::new(send_depth),
            recv_kept: Pending::new(recv_depth),
            failed: None,
            notify: Notify::default(),
            invalidations: Invalidations::default(),
        }
    }

    /// Notes a completion's status: any error but a flush moves the QP to the error state (IB
    /// spec; measured on rxe for a UD receive too short for its datagram), so posts are refused.
    /// Called by every path that retires a completion of this QP.
    #[inline]
    pub(crate) fn note_status(&mut self, status: rdma_sys::ibv_wc_status::Type) {
        use rdma_sys::ibv_wc_status::{IBV_WC_SUCCESS, IBV_WC_WR_FLUSH_ERR};
        if status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR && self.failed.is_none() {
            self.failed = Some(Failure::Completion(status));
        }
    }

    /// Retires what a completion with this tag names; the caller's wr_id, or `None` when it
    /// names nothing outstanding (stale). `status`: the completion's (a success releases a
    /// memory window invalidation's region: see [`Queues::invalidating`]).
    #[inline]
    pub(crate) fn complete(&mut self, t: &tag::Tag, status: rdma_sys::ibv_wc_status::Type) -> Option<u64> {
        if !self.invalidations.0.is_empty() {
            return self.complete_invalidating(t, status == rdma_sys::ibv_wc_status::IBV_WC_SUCCESS);
        }
        let ring = if t.recv { &mut self.recv } else { &mut self.send };
        let seq = ring.widen(t.low, tag::SEQ_BITS);
        ring.complete(seq)
    }

    /// `complete` while invalidations are in flight: the region of the one it completes, if
    /// any, is released when the completion is a success, leaked otherwise.
    #[cold]
    #[inline(never)]
    fn complete_invalidating(&mut self, t: &tag::Tag, ok: bool) -> Option<u64> {
        if t.recv {
            let seq = self.recv.widen(t.low, tag::SEQ_BITS);
            return self.recv.complete(seq);
        }
        let seq = self.send.widen(t.low, tag::SEQ_BITS);
        if let Some(k) = self.invalidations.0.iter().position(|(s, _)| *s == seq) {
            let (_, hold) = self.invalidations.0.swap_remove(k);
            if ok {
                drop(hold);
            } else {
                leak(hold);
            }
        }
        self.send.complete(seq)
    }

    /// Holds `region` (as written to) for the memory window invalidation just posted as send
    /// `seq`, until its successful completion; leaked if that never comes (see
    /// `Invalidations`).
    pub(crate) fn invalidating(&mut self, seq: u64, region: &Arc<MrInner>) {
        self.invalidations.0.push((seq, Hold::new(region, true)));
    }

    /// Keeps a completion for a later poll or wait of this QP.
    pub(crate) fn keep(&mut self, wc: WorkCompletion) {
        match wc.queue() {
            crate::status::WorkQueue::Send => {
                self.send.kept();
                self.send_kept.push(wc);
            }
            crate::status::WorkQueue::Recv => {
                self.recv.kept();
                self.recv_kept.push(wc);
            }
        }
    }

    /// Whether any completion is kept (cheap: the polls ask before delivering).
    #[inline]
    pub(crate) fn has_kept(&self) -> bool {
        self.send_kept.len() != 0 || self.recv_kept.len() != 0
    }

    /// Moves kept completions (of `which` queue, or both) into `out`.
    pub(crate) fn deliver_kept(
        &mut self,
        which: Option<crate::status::WorkQueue>,
        out: &mut [WorkCompletion],
    ) -> usize {
        use crate::status::WorkQueue;
        if !self.has_kept() {
            return 0;
        }
        let mut n = 0;
        if which != Some(WorkQueue::Recv) {
            let k = self.send_kept.drain_into(out);
            self.send.delivered(k as u64);
            n += k;
        }
        if which != Some(WorkQueue::Send) {
            let k = self.recv_kept.drain_into(&mut out[n..]);
            self.recv.delivered(k as u64);
            n += k;
        }
        n
    }

    /// Takes the first kept completion of `queue` that `pick` accepts.
    pub(crate) fn take_kept(
        &mut self,
        queue: crate::status::WorkQueue,
        pick: impl FnMut(&WorkCompletion) -> bool,
    ) -> Option<WorkCompletion> {
        let (kept, ring) = match queue {
            crate::status::WorkQueue::Send => (&mut self.send_kept, &mut self.send),
            crate::status::WorkQueue::Recv => (&mut self.recv_kept, &mut self.recv),
        };
        let wc = kept.take_first(pick)?;
        ring.delivered(1);
        Some(wc)
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
    /// Removes every entry that `drop_it` accepts, keeping the others in order; returns how
    /// many it removed.
    pub(crate) fn remove_all(&mut self, mut drop_it: impl FnMut(&WorkCompletion) -> bool) -> usize {
        let mut kept = 0;
        for i in 0..self.len {
            let wc = self.buf[self.at(i)];
            if !drop_it(&wc) {
                let dst = self.at(kept);
                self.buf[dst] = wc;
                kept += 1;
            }
        }
        let removed = self.len - kept;
        self.len = kept;
        removed
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

    /// A stand-in for a region's hold: the count of live clones shows what the ring holds.
    type Held = Arc<()>;

    /// Stages a work request of a first piece and `rest` later ones.
    fn stage(r: &mut Ring<Held>, k: u64, id: u64, hold: Option<Held>, rest: impl Iterator<Item = Held>) -> u64 {
        let seq = r.stage(k, id, hold);
        r.stage_rest(seq, rest);
        seq
    }

    #[test]
    fn ring_retires_in_order_and_refuses_overflow() {
        let mut r = Ring::<Held>::new(4, 1);
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
        r.kept();
        assert_eq!(r.free(), 3, "a kept completion keeps its place");
        r.delivered(1);
        assert_eq!(r.outstanding(), 0);
        assert_eq!(r.free(), 4);
    }

    #[test]
    fn rejected_work_requests_use_up_their_sequence_numbers() {
        let mut r = Ring::<Held>::new(4, 1);
        for k in 0..3 {
            r.stage(k, k, None);
        }
        // The provider took the first one only.
        r.commit(1, 3);
        assert_eq!(r.outstanding(), 3, "the void slots wait behind the posted one");
        assert_eq!(r.complete(0), Some(0));
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
        let mut r = Ring::<Held>::new(2, 1);
        r.stage(0, 1, None);
        r.stage(1, 2, None);
        r.commit(0, 2);
        assert_eq!(r.outstanding(), 0);
        assert_eq!(r.stage(0, 3, None), 2);
    }

    #[test]
    fn ring_of_odd_depth_admits_exactly_its_depth() {
        let mut r = Ring::<Held>::new(3, 1);
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
    fn ring_wraps_and_widens_truncated_sequence_numbers() {
        let mut r = Ring::<Held>::new(2, 1);
        for i in 0..10u64 {
            r.stage(0, i, None);
            r.commit(1, 1);
            let wide = r.widen(i & 0xf, 4);
            assert_eq!(wide, i);
            assert_eq!(r.complete(wide), Some(i));
        }
        assert_eq!(r.head, 10);
    }

    /// `n` holds of `region`.
    fn holds(region: &Held, n: usize) -> impl Iterator<Item = Held> + '_ {
        (0..n).map(|_| Arc::clone(region))
    }

    #[test]
    fn a_ring_of_single_pieces_has_no_side_table() {
        let r = Ring::<Held>::new(16, 1);
        assert_eq!(r.extra.holds.len(), 0);
        let r = Ring::<Held>::new(3, 4);
        assert_eq!(r.extra.holds.len(), 4 * 3, "slots x (pieces - 1)");
    }

    #[test]
    fn side_table_holds_every_piece_until_its_slot_retires() {
        let region: Held = Arc::new(());
        let mut r = Ring::<Held>::new(4, 3);
        // Three work requests of 3, 1 and 2 pieces.
        stage(&mut r, 0, 10, Some(Arc::clone(&region)), holds(&region, 2));
        stage(&mut r, 1, 11, Some(Arc::clone(&region)), holds(&region, 0));
        stage(&mut r, 2, 12, Some(Arc::clone(&region)), holds(&region, 1));
        r.commit(3, 3);
        assert_eq!(Arc::strong_count(&region), 1 + 6);
        assert_eq!(r.extra.held(), 3);
        // Retiring the first releases its three pieces, and only them.
        assert_eq!(r.complete(0), Some(10));
        assert_eq!(Arc::strong_count(&region), 1 + 3);
        assert_eq!(r.extra.held(), 1);
        // A completion that retires two (the first unsignaled) releases both, side table included.
        assert_eq!(r.complete(2), Some(12));
        assert_eq!(Arc::strong_count(&region), 1);
        assert_eq!(r.extra.held(), 0);
    }

    #[test]
    fn void_slots_release_their_later_pieces_at_once() {
        let (a, b): (Held, Held) = (Arc::new(()), Arc::new(()));
        let mut r = Ring::<Held>::new(4, 4);
        stage(&mut r, 0, 1, Some(Arc::clone(&a)), holds(&a, 3));
        stage(&mut r, 1, 2, Some(Arc::clone(&b)), holds(&b, 3));
        stage(&mut r, 2, 3, Some(Arc::clone(&b)), holds(&b, 1));
        // The provider took the first only: the refused ones' pieces go now, the taken one's stay.
        r.commit(1, 3);
        assert_eq!(Arc::strong_count(&a), 1 + 4);
        assert_eq!(Arc::strong_count(&b), 1, "a refused work request released every piece");
        assert_eq!(r.extra.held(), 3);
        assert_eq!(r.complete(0), Some(1));
        assert_eq!(Arc::strong_count(&a), 1);
        assert_eq!(r.extra.held(), 0);
        // A fully refused post holds nothing either.
        stage(&mut r, 0, 4, Some(Arc::clone(&a)), holds(&a, 2));
        r.commit(0, 1);
        assert_eq!((Arc::strong_count(&a), r.extra.held(), r.outstanding()), (1, 0, 0));
    }

    #[test]
    fn side_table_wraps_with_the_ring() {
        let region: Held = Arc::new(());
        let mut r = Ring::<Held>::new(3, 4);
        for i in 0..40u64 {
            // Two at a time, of varying piece counts; the second's completion retires both.
            let (p, q) = ((i % 4) as usize, ((i + 1) % 4) as usize);
            let s0 = stage(&mut r, 0, 2 * i, Some(Arc::clone(&region)), holds(&region, p));
            stage(&mut r, 1, 2 * i + 1, Some(Arc::clone(&region)), holds(&region, q));
            r.commit(2, 2);
            assert_eq!(Arc::strong_count(&region), 1 + 2 + p + q, "round {i}");
            assert_eq!(r.complete(s0 + 1), Some(2 * i + 1));
            assert_eq!((Arc::strong_count(&region), r.extra.held()), (1, 0), "round {i}");
        }
    }

    #[test]
    fn dropping_a_ring_releases_every_piece() {
        let region: Held = Arc::new(());
        let mut r = Ring::<Held>::new(2, 3);
        stage(&mut r, 0, 1, Some(Arc::clone(&region)), holds(&region, 2));
        r.commit(1, 1);
        assert_eq!(Arc::strong_count(&region), 4);
        drop(r);
        assert_eq!(Arc::strong_count(&region), 1);
    }

    #[test]
    fn tags_round_trip_and_foreign_ids_are_not_ours() {
        let w = tag::encode(513, 0x1_2345_6789_abcd, true, false);
        let t = tag::decode(w).unwrap();
        assert_eq!((t.recv, t.srq, t.owner, t.low), (true, false, 513, 0x1_2345_6789_abcd & ((1 << 45) - 1)));
        let t = tag::decode(tag::encode(65535, 7, false, true)).unwrap();
        assert_eq!((t.recv, t.srq, t.owner, t.low), (false, true, 65535, 7));
        let t = tag::decode(tag::encode_srq(9, 65535, (1 << 29) + 5)).unwrap();
        assert_eq!((t.recv, t.srq, t.owner, tag::srq_parts(t.low)), (true, true, 9, (65535, 5)));
        for foreign in [0, 1, 42, u64::MAX >> 2, 1 << 63] {
            assert_eq!(tag::decode(foreign), None, "{foreign:#x}");
        }
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

    #[test]
    fn pending_removes_what_it_is_told_and_keeps_the_rest_in_order() {
        let mut p = Pending::new(4);
        // Wrapped: start in the middle of the buffer.
        for i in 0..2 {
            p.push(WorkCompletion { wr_id: 100 + i, ..Default::default() });
        }
        let mut out = [WorkCompletion::default(); 4];
        assert_eq!(p.drain_into(&mut out[..2]), 2);
        for i in 0..4 {
            p.push(WorkCompletion { wr_id: i, qp_num: (i % 2) as u32, ..Default::default() });
        }
        assert_eq!(p.remove_all(|w| w.qp_num == 1), 2);
        assert_eq!(p.len(), 2);
        assert_eq!(p.drain_into(&mut out), 2);
        assert_eq!((out[0].wr_id, out[1].wr_id), (0, 2));
        assert_eq!(p.remove_all(|_| true), 0, "nothing left to remove");
    }
}
