use super::refused::poll_failed;
use super::{tag, Completion, Fault, Fields, Lane, Retiring, Wc, POLL_BATCH, RECV, SIGNALED};
use crate::error::Result;
use crate::verbs::mr::MemoryRegion;
use rdma_sys as ffi;

impl Lane {
    /// Hands out the next completion without waiting, with the region of its work request
    /// ([`Completion::take_region`]). A signaled completion that retires earlier unsignaled
    /// work requests hands those out first, one per call, oldest first, then itself. `None`
    /// when there was nothing to hand out: the CQ held no completion, or only ones that retire
    /// nothing (stale ones, a batch's interior ones). [`Lane::poll_with`] is the fast way to do the same.
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `ibv_poll_cq` fails.
    #[inline(always)]
    pub fn poll(&mut self) -> Result<Option<Completion>> {
        let mut out = None;
        self.poll_with(1, |wc, mr| out = Some(Completion::new(wc, mr)))?;
        Ok(out)
    }

    /// Hands up to `max` completions to `f`, oldest first, without waiting; returns how many.
    /// The fast way to reap: each completion's fields come as a [`Wc`] (plain data, decoded
    /// only where `f` reads it) and its work request's region beside it (`None` for work
    /// that named none), so `f`, inlined, works on values in registers. The
    /// lane is consistent whenever `f` runs: if `f` panics, the region it was given is dropped
    /// with it (the device is done with it) and every other completion stays for the next
    /// poll.
    ///
    /// The CQ is asked for no more than `max` completions at a time (at most 16), as a raw
    /// `ibv_poll_cq` of `max` would ask: a poll for one costs the least when one is all there
    /// is, and a loop that reaps a burst does best to ask for the whole burst in one call.
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `ibv_poll_cq` fails (after handing out what was reaped before).
    #[inline(always)]
    pub fn poll_with(&mut self, max: usize, mut f: impl FnMut(Wc, Option<MemoryRegion>)) -> Result<usize> {
        // The common case, straight-line: nothing is buffered, retiring or deferred, so the
        // poll goes to the CQ, and when that gives exactly one completion, it is started here
        // (handed out inline when it retires its slot alone; a batch's out of line). Everything else (several completions, one that retires several,
        // deferred ones) is the general loop's, out of line, so this path keeps a small frame.
        debug_assert!(self.backlog || !self.holds_backlog(), "a backlog the poll's flag does not say");
        if max == 0 || self.backlog {
            unlikely();
            return self.poll_more(max, 0, false, f);
        }
        // The CQ is asked for no more than the caller wants (as a raw `ibv_poll_cq` of `max`
        // would be): a provider that is asked for more looks at its queue once more to find it
        // empty, which is most of what a poll that finds nothing costs.
        let ask = max.min(POLL_BATCH) as i32;
        // SAFETY: as in `poll_loop`.
        // `poll_cq` was read from this CQ's own context (`ops`), which the CQ keeps open.
        let got = unsafe { (self.poll_cq)(self.cq_raw.as_ptr(), ask, self.wcs.as_mut_ptr().cast()) };
        if got != 1 {
            // Nothing, an error, or several: the general loop hands several out.
            if got <= 0 {
                return if got < 0 { Err(poll_failed(got)) } else { Ok(0) };
            }
            self.n = got as u8;
            self.at = 0;
            return self.poll_more(max, 0, got < ask, f);
        }
        // The one completion is handed out from `wcs[0]` with the buffer's `n` and `at` left
        // as they are (`at >= n`: nothing buffered, since there is no backlog), so a panic in
        // `f` leaves nothing behind to defer; they are set only after `f` has returned.
        // `start_common` is inlined, and anything it does not hand out goes out of line with
        // `f` moved there and back: the compiled code never takes `f`'s address, so a closure
        // that borrows one thing stays in a register.
        let (done, f) = match self.start_common(0, &mut f) {
            Start::Handed if max == 1 => return Ok(1),
            Start::Handed => (1, f),
            started => {
                let (handed, f) = self.start_rest(0, started, f);
                if handed as usize == max {
                    return Ok(max);
                }
                (handed as usize, f)
            }
        };
        self.n = 1;
        self.at = 1;
        // When the CQ gave one where it was asked for more, it held no other then, so the
        // general loop does not poll it again in this call (a poll that finds nothing costs
        // about what one that finds one does).
        self.poll_more(max, done, ask > 1, f)
    }

    /// The general loop of `poll_with`: hands out completions until `max` (counting the `done`
    /// already handed out) or until the CQ has nothing (`dry`: a poll of it in this call gave
    /// fewer than it asked for, so it is not polled again). It takes the closure by value (a
    /// closure that borrows one thing is then passed in a register: by reference, the common
    /// case would have to keep it in memory for this call it rarely makes).
    #[inline(never)]
    fn poll_more(
        &mut self,
        max: usize,
        done: usize,
        dry: bool,
        f: impl FnMut(Wc, Option<MemoryRegion>),
    ) -> Result<usize> {
        // Nothing buffered, retiring or kept, and the CQ had no more: nothing to do (the batch's
        // completion, handed out by `start_rare`, often ends here).
        if dry && !self.holds_backlog() {
            return Ok(done);
        }
        // Set while it runs (so a panic in `f` leaves it set), said again as it returns.
        self.backlog = true;
        let r = self.poll_loop(max, done, dry, f);
        self.backlog = self.holds_backlog();
        r
    }

    /// Whether anything waits to be handed out before the CQ is polled again: completions in
    /// the poll buffer, one that retires several, or kept ones (`backlog` says so, or more).
    pub(super) fn holds_backlog(&self) -> bool {
        self.retiring.is_some() || self.at < self.n || !self.deferred.is_empty() || !self.held.is_empty()
    }

    #[inline(always)]
    fn poll_loop(
        &mut self,
        max: usize,
        mut done: usize,
        mut dry: bool,
        mut f: impl FnMut(Wc, Option<MemoryRegion>),
    ) -> Result<usize> {
        // The handed-out count at which the held completions were last tried again: once per
        // call, then again after each completion handed out.
        let mut retried = usize::MAX;
        while done < max {
            if let Some(r) = self.retiring {
                done += self.retire(r, max - done, &mut f);
                continue;
            }
            if self.at >= self.n {
                if !self.deferred.is_empty() {
                    self.refill_from_deferred();
                    continue;
                }
                if !self.held.is_empty() && retried != done {
                    retried = done;
                    self.deferred.extend(self.held.drain(..));
                    continue;
                }
                if dry {
                    break;
                }
                // No more than the caller still wants, as in `poll_with`.
                let ask = (max - done).min(POLL_BATCH) as i32;
                // SAFETY: the CQ is alive (held by `self.cq`); `wcs` has room for POLL_BATCH
                // entries (`ask` is at most that), which the provider writes.
                // `poll_cq` was read from this CQ's own context (`ops`), which the CQ keeps open.
                let got = unsafe { (self.poll_cq)(self.cq_raw.as_ptr(), ask, self.wcs.as_mut_ptr().cast()) };
                if got <= 0 {
                    if got < 0 {
                        return Err(poll_failed(got));
                    }
                    break;
                }
                self.n = got as u8;
                self.at = 0;
                dry = got < ask;
            }
            let i = self.at;
            self.at += 1;
            let (handed, g) = self.start(i, f);
            f = g;
            done += handed as usize;
        }
        Ok(done)
    }

    /// Starts on the completion at `wcs[i]`: hands `f` the completion of the one slot it
    /// retires (a prepared batch's, whole, when it is the oldest), and returns true; returns
    /// false when it retires several (then `retiring` says which, for `retire`) or nothing (a
    /// batch's interior one, a stale one, one that is not the lane's). `f` is
    /// moved in and handed back (see `start_rare`).
    #[inline(always)]
    fn start<G: FnMut(Wc, Option<MemoryRegion>)>(&mut self, i: u8, mut f: G) -> (bool, G) {
        match self.start_common(i, &mut f) {
            Start::Handed => (true, f),
            started => self.start_rest(i, started, f),
        }
    }

    /// `start`'s common case: the completion of a member's oldest outstanding slot, which it
    /// retires alone, handed to `f`. For anything else nothing is done but a member's failure
    /// noted, and what was found goes to `start_rest`. Inlined, it takes no address of `f`.
    #[inline(always)]
    fn start_common(&mut self, i: u8, f: &mut impl FnMut(Wc, Option<MemoryRegion>)) -> Start {
        // SAFETY: wcs[i] is initialised: either `i < n`, and the provider (or
        // `refill_from_deferred`) initialised wcs[..n], or (`poll_with`'s one-completion case,
        // `i` 0, before it sets `n`) the provider's poll just returned that one entry there.
        let Some(wc) = self.wcs.get(i as usize).map(|w| unsafe { w.assume_init_ref() }) else { return Start::Nothing };
        // The tag's queue and place, compared whole with its queue's (`Slots::hi`); a
        // completion that is not the lane's or of a batch's interior request has a bit set
        // that no queue's `hi` has, and goes to `unmatched` (through `start_rest`).
        let hi = tag::hi_of(wc.wr_id);
        let place = hi as u16;
        let Some(Some(m)) = self.members.get_mut(place as usize) else { return Start::unmatched(wc.wr_id) };
        let m = &mut **m;
        // The queue whose `hi` the tag carries whole (the send queue's has no `RECV`, the
        // receive queue's has it): two compares at most, where selecting by the bit and then
        // comparing takes more.
        let (slots, recv) = if m.send.hi == hi {
            (&mut m.send, false)
        } else if m.recv.hi == hi {
            (&mut m.recv, true)
        } else {
            return Start::unmatched(wc.wr_id);
        };
        if m.qp_num != wc.qp_num {
            return Start::Unmatched;
        }
        // The common case: it names the oldest outstanding slot (its sequence number's 45
        // bits are `head`'s), and retires it alone. A sequence number outside the window
        // (an earlier QP's at the place, or one handed out twice) goes to `start_rare`, which
        // retires nothing for it.
        if (wc.wr_id ^ slots.head) & tag::SEQ_MASK == 0 && slots.tail != slots.head {
            let (mr, wr_id) = slots.pop();
            if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                // Any error but a flush puts the QP in the error state (a flush says it is there).
                m.failed.get_or_insert(Fault::Completion(wc.status));
            }
            let flags = if recv { RECV | SIGNALED } else { SIGNALED };
            f(Wc { wr_id, f: Fields::of(wc), place, attach: m.key.attach, flags }, mr);
            return Start::Handed;
        }
        Start::Rare { place, recv, seq: wc.wr_id & tag::SEQ_MASK }
    }

    /// The rest of `start`, for a completion `start_common` did not hand out: one whose tag
    /// matches no member (`unmatched`), or a member's that is not its oldest slot's alone
    /// (`start_rare`); both out of line. True when one was handed to `f`.
    #[inline(always)]
    fn start_rest<G: FnMut(Wc, Option<MemoryRegion>)>(&mut self, i: u8, started: Start, f: G) -> (bool, G) {
        match started {
            Start::Handed => (true, f),
            Start::Nothing => (false, f),
            Start::Unmatched => {
                self.unmatched(i);
                (false, f)
            }
            Start::Srq => self.srq_with(i, f),
            Start::Rare { place, recv, seq } => self.start_rare(place, recv, seq, i, f),
        }
    }

    /// The rest of `start`, out of line: the completion of a prepared batch that is the oldest
    /// outstanding (handed to `f` here: true), one that retires earlier unsignaled work
    /// requests too (`retiring` is set, for `retire`), or nothing (stale).
    /// It takes `f` by value and hands it back, so that `poll_with`, which calls it, never
    /// takes `f`'s address: its common case then keeps a closure that borrows one thing in a
    /// register (two instructions fewer per poll, and a frame that needs no slot for it).
    #[cold]
    #[inline(never)]
    fn start_rare<G: FnMut(Wc, Option<MemoryRegion>)>(
        &mut self,
        place: u16,
        recv: bool,
        seq: u64,
        i: u8,
        mut f: G,
    ) -> (bool, G) {
        let handed = self.start_rare_in(place, recv, seq, i, &mut f);
        (handed, f)
    }

    #[inline(always)]
    fn start_rare_in(
        &mut self,
        place: u16,
        recv: bool,
        seq: u64,
        i: u8,
        f: &mut impl FnMut(Wc, Option<MemoryRegion>),
    ) -> bool {
        // The member `start_common` just matched (tag and QP number): nothing has changed since.
        let Some(Some(m)) = self.members.get_mut(place as usize) else { return false };
        let slots = if recv { &mut m.recv } else { &mut m.send };
        // Outside the window: stale, retires nothing (and says nothing of this QP's state).
        let Some(seq) = slots.holds(seq) else { return false };
        // SAFETY: as in `start_common`.
        let Some(wc) = self.wcs.get(i as usize).map(|w| unsafe { w.assume_init_ref() }) else { return false };
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            m.failed.get_or_insert(Fault::Completion(wc.status));
        }
        let in_order = m.in_order();
        let slots = if recv { &mut m.recv } else { &mut m.send };
        let mark = slots.head_mark();
        if mark > 1 && seq == slots.head.wrapping_add(mark as u64 - 1) {
            // A prepared batch, the oldest outstanding: it retires whole, here (the general
            // loop's `retire` would do the same, at the cost of the detour).
            let (mr, wr_id) = slots.pop_batch(mark);
            let fields = m.batch_fields(Fields::of(wc));
            f(Wc { wr_id, f: fields, place, attach: m.key.attach, flags: SIGNALED }, mr);
            return true;
        }
        if in_order && seq != slots.head {
            // iWARP: an earlier slot's own completion is still to come (every request there is
            // signaled, `Member::always_flags`): perhaps a READ whose data has not landed yet.
            // Held until a completion has been handed out, then tried again (`poll_loop`).
            // SAFETY: `ibv_wc` is plain old data; this copy is the one kept (the buffer's
            // entry is not handed out: the poll moves past it).
            let held = unsafe { std::ptr::read(wc) };
            self.held.push_back(held);
            self.backlog = true;
            return false;
        }
        self.retiring = Some(Retiring { place, recv, upto: seq, wc: i });
        self.backlog = true;
        false
    }

    /// A completion whose tag matched no member: a batch's interior work request (an error or
    /// a flush: its failure is kept for the batch's own completion, which retires it), a stale
    /// one (of a QP removed from the lane), or one that is not the lane's (`tag::FOREIGN`).
    /// None of them retires anything or is handed out.
    #[cold]
    #[inline(never)]
    fn unmatched(&mut self, i: u8) {
        // SAFETY: as in `start_common`.
        let Some(wc) = self.wcs.get(i as usize).map(|w| unsafe { w.assume_init_ref() }) else { return };
        if wc.wr_id & (tag::FOREIGN | tag::INTERIOR) != tag::INTERIOR {
            return;
        }
        // An interior tag is a send's: its queue's `hi` with `INTERIOR`.
        let hi = tag::hi_of(wc.wr_id) & !tag::hi_of(tag::INTERIOR);
        let place = hi as u16;
        let Some(Some(m)) = self.members.get_mut(place as usize) else { return };
        if m.send.hi != hi || m.qp_num != wc.qp_num {
            return;
        }
        // Its batch's number: one prepared before this QP was attached is an earlier QP's at
        // the place, and says nothing of this one.
        let (batch, index) = tag::interior_parts(wc.wr_id);
        if !m.owns_batch(batch) {
            return;
        }
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            m.failed.get_or_insert(Fault::Completion(wc.status));
            if wc.status != ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                m.batch_error.get_or_insert((wc.status, wc.vendor_err));
            }
        }
        // The last posted request of a batch the provider took only part of: the batch retires
        // with it (through `retire`, which hands the batch out with this completion).
        if let Some(upto) = m.orphan_done(batch, index) {
            self.retiring = Some(Retiring { place, recv: false, upto, wc: i });
            self.backlog = true;
        }
    }

    /// Hands up to `room` slots of a completion that retires several to `f`, oldest first (the
    /// unsignaled ones, then the one it names; a prepared batch is one slot); returns how many.
    /// Out of line, as is `unmatched`: the poll's common case then calls `f` from one place,
    /// where the compiler inlines it.
    #[cold]
    #[inline(never)]
    fn retire(&mut self, r: Retiring, room: usize, f: &mut impl FnMut(Wc, Option<MemoryRegion>)) -> usize {
        let Some(Some(m)) = self.members.get_mut(r.place as usize) else {
            // Never: a QP stays in place while its completion is handed out.
            self.retiring = None;
            return 0;
        };
        let (attach, recv) = (m.key.attach, if r.recv { RECV } else { 0 });
        let mut k = 0;
        while k < room {
            let slots = if r.recv { &mut m.recv } else { &mut m.send };
            let mark = slots.head_mark();
            let (last, (mr, wr_id)) = if mark <= 1 {
                (slots.head == r.upto, slots.pop())
            } else {
                (r.upto.wrapping_sub(slots.head) < mark as u64, slots.pop_batch(mark))
            };
            k += 1;
            if !last {
                // An unsignaled work request (or batch) that ran before the one the completion
                // names.
                f(Wc { wr_id, f: Fields::default(), place: r.place, attach, flags: recv }, mr);
                continue;
            }
            self.retiring = None;
            // SAFETY: `r.wc < n`, initialised (see `start_common`), and not overwritten while retiring.
            let fields = self.wcs.get(r.wc as usize).map(|w| Fields::of(unsafe { w.assume_init_ref() }));
            let fields = fields.unwrap_or_default();
            let fields = if mark > 1 { m.batch_fields(fields) } else { fields };
            let wc = Wc { wr_id, f: fields, place: r.place, attach, flags: recv | SIGNALED };
            f(wc, mr);
            break;
        }
        k
    }

    #[cold]
    fn refill_from_deferred(&mut self) {
        let mut k = 0;
        while k < POLL_BATCH {
            let Some(wc) = self.deferred.pop_front() else { break };
            self.wcs[k].write(wc);
            k += 1;
        }
        self.n = k as u8;
        self.at = 0;
    }

    /// Moves what the poll buffer still holds (a completion being handed out included) to the
    /// front of the deferred queue, so a teardown can poll the CQ itself.
    pub(super) fn defer_buffer(&mut self) {
        let first = match self.retiring.take() {
            Some(r) => r.wc,
            None => self.at,
        };
        for i in (first..self.n).rev() {
            // SAFETY: i < n: initialised; read once, since the buffer is emptied below.
            self.deferred.push_front(unsafe { self.wcs[i as usize].assume_init_read() });
        }
        // The held ones are older than the buffer's.
        while let Some(wc) = self.held.pop_back() {
            self.deferred.push_front(wc);
        }
        self.n = 0;
        self.at = 0;
        self.backlog = !self.deferred.is_empty();
    }
}

/// Called on the branches of the poll's common case that are not taken in it, and does
/// nothing: a call to a cold function is how stable Rust tells the compiler which way a branch
/// usually goes. Without it the compiler takes each of the common case's six tests for a coin
/// toss, rates the call of the caller's closure at the end of them rare, and, for a rare call,
/// inlines only the smallest closures (a threshold of 45 where it is 225).
#[cold]
#[inline(never)]
fn unlikely() {}

/// What `Lane::start_common` did with a completion.
#[derive(Clone, Copy)]
enum Start {
    /// Handed to `f`: it retired its member's oldest slot alone.
    Handed,
    /// Not there (an index past the poll buffer: not reached).
    Nothing,
    /// Its tag matches no member.
    Unmatched,
    /// Its tag is an SRQ receive's (`srq::is_srq`).
    Srq,
    /// A member's, in one of `start_rare`'s cases.
    /// `seq` is the low 45 bits of its sequence number, as its tag carries them.
    Rare { place: u16, recv: bool, seq: u64 },
}

impl Start {
    /// A completion whose tag matched no member's queue: an SRQ receive's, or one for
    /// `unmatched`. Reached only where the tag matched no queue, so a QP's own completions
    /// never test it.
    #[inline(always)]
    fn unmatched(wr_id: u64) -> Start {
        if super::srq::is_srq(wr_id) {
            Start::Srq
        } else {
            Start::Unmatched
        }
    }
}
