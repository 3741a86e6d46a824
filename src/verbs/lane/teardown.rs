//! Teardown: moving QPs to the error state and reaping their flushed work within a bound, so
//! regions are released only once the device is done with them (see the module docs' "Why it
//! is sound").

use super::*;

impl Lane {
    /// Moves `only` (or every QP) to the error state and reaps their flushed work within the
    /// bound; completions of other QPs are kept, in order, for later polls.
    pub(super) fn drain(&mut self, only: Option<u16>) {
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
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        loop {
            let mut left = 0;
            for (p, m) in self.members.iter().enumerate() {
                if let Some(m) = m.as_ref().filter(|_| mine(p as u16)) {
                    left += m.send.outstanding() + m.recv.outstanding();
                }
            }
            if left == 0 || Instant::now() >= deadline {
                break;
            }
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
        }
        self.deferred = others;
        self.backlog = self.holds_backlog();
    }

    /// Retires what `wc` names when it is a completion of a QP being torn down (the regions are
    /// dropped: the device is done with them); false for any other completion.
    fn retire_for_teardown(&mut self, wc: &ffi::ibv_wc, mine: &impl Fn(u16) -> bool) -> bool {
        if wc.wr_id & tag::CRATE != 0 {
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
