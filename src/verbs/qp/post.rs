//! Posting: a send or receive is checked, staged in its slot, lowered to `ibv_*_wr` and posted.

use std::mem::MaybeUninit;

use rdma_sys as ffi;

use crate::error::{check_ibv, Error, Result};
use crate::verbs::ring::{tag, Hold, Queues};
use crate::verbs::wr::{
    check_local, check_pieces, check_recv, check_rest, hold_rest, needs_rest_holds, rejected_from, with_recv_list,
    AsSendWr, RecvWr, SendOp, SendWr, CHUNK, CHUNK_SGE, MAX_SGE,
};
use crate::wait::lock;

use super::{in_error_state, QueuePair};

impl QueuePair {
    /// Posts send-queue work requests (sends, RDMA WRITEs, RDMA READs, atomics), linked into as few
    /// `ibv_post_send` calls as possible. Nothing is posted unless the queue has room for all.
    ///
    /// # Errors
    /// [`Error::QueueFull`], [`Error::InvalidArgument`] or [`Error::OutOfBounds`] before
    /// anything is posted; [`Error::QpInError`] once a completion of this QP failed (the QP is
    /// in the error state: nothing posted now can run); [`Error::Call`] when `ibv_post_send`
    /// rejects a work request (the ones before it stay posted and are tracked).
    pub fn post_send(&mut self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.post_sends(wrs)
    }

    /// [`QueuePair::post_send`] for any list of work requests that are sends underneath (a
    /// UD QP's [`UdSendWr`](crate::UdSendWr)s).
    pub(crate) fn post_sends<W: AsSendWr>(&mut self, wrs: &[W]) -> Result<()> {
        self.check_send_queue_open("ibv_post_send")?;
        for w in wrs {
            self.check_send_wr(w.send_wr())?;
        }
        let mut q = lock(&self.queues);
        // Read under the lock the post takes anyway (one lock per post, not two).
        if let Some(f) = q.failed {
            return Err(self.failed_error(f, "ibv_post_send"));
        }
        if (wrs.len() as u64) > q.send.free() {
            return Err(Error::QueueFull { queue: "send", depth: q.send.cap() as u32 });
        }
        if let [w] = wrs {
            return self.post_send_single(&mut q, w.send_wr());
        }
        for chunk in wrs.chunks(CHUNK) {
            self.post_send_chunk(&mut q, chunk)?;
        }
        Ok(())
    }

    /// Checks one send-queue work request as every post does: its kind against the QP's, inline data against the QP's limit,
    /// every piece against its region (PD, bounds, `LOCAL_WRITE` where the device writes it),
    /// and immediate data only where the operation carries it.
    #[inline(always)]
    pub(super) fn check_send_wr(&self, w: &SendWr<'_>) -> Result<()> {
        if w.ud.is_some() != self.datagrams {
            // Unreachable through the public API: only a UdQp posts datagrams, and it
            // offers nothing else.
            return Err(Error::InvalidArgument(if self.datagrams {
                "a UD QP sends datagrams only, each addressed (UdSendWr)".into()
            } else {
                "an addressed datagram needs a UD QP".into()
            }));
        }
        if let Some(data) = w.inline {
            if data.len() > self.max_inline as usize {
                return Err(Error::InvalidArgument(format!(
                    "inline send of {} bytes exceeds the QP's max_inline_data of {}",
                    data.len(),
                    self.max_inline
                )));
            }
        }
        if let Some((mr, r)) = &w.local {
            check_local(&self.pd, mr, r, w.op.writes_local())?;
        }
        if !w.rest.is_empty() {
            // Every constructor of a list sets its first piece; were one ever to leave it
            // out, the later pieces must not reach the device unchecked.
            let Some((_, first)) = &w.local else {
                return Err(Error::InvalidArgument("a scatter/gather list needs its first piece".into()));
            };
            self.check_send_pieces(w, first.len())?;
        }
        if w.imm.is_some() && (w.op.is_atomic() || matches!(w.op, SendOp::SendInv { .. })) {
            return Err(Error::InvalidArgument(
                "an atomic, or a send with invalidate, carries no immediate data".into(),
            ));
        }
        Ok(())
    }

    /// `post_send_chunk` for one work request (the common case): staged, lowered and posted
    /// on the stack without the list's arrays and loops; the ring's side table is touched only
    /// when a later piece names another region.
    #[inline]
    fn post_send_single(&self, q: &mut Queues, w: &SendWr<'_>) -> Result<()> {
        // Taking the last free slot makes it signaled (see post_send_chunk).
        let signaled = w.signaled || q.send.free() == 1;
        let writes = w.op.writes_local();
        let first = w.local.as_ref().map(|(m, _)| m.inner());
        let seq = q.send.stage(0, w.wr_id, first.map(|m| Hold::new(m, writes)));
        if needs_rest_holds(first, w.rest) {
            q.send.stage_rest(seq, hold_rest(first, w.rest, writes));
        }
        // A datagram's address handle is held like the region (see post_send_chunk).
        let ud = w.ud.filter(|d| q.send.stage_ah(seq, d.ah()));
        let mut sge = [const { MaybeUninit::<ffi::ibv_sge>::uninit() }; MAX_SGE];
        let tag = tag::encode(self.send_slot.index, seq, false, false);
        // SAFETY: `sge` has room for MAX_SGE entries, the most a checked work request has, and
        // lives until the post below returns.
        let mut wr = unsafe { w.lower(tag, signaled, ud, sge.as_mut_ptr().cast()) };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // Every piece was checked against a region on this PD (post_sends), and the slot staged
        // above (with its side table) holds each region named until the completion is reaped;
        // inline data is copied in the call; a datagram's address handle is held likewise.
        // SAFETY: QP valid; `wr` is one NULL-terminated work request over `sge`, both alive for
        // the call; every region and address handle it names is held (above).
        let ret = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        self.commit_posted(q, ret, bad, &wr, 1, true, "ibv_post_send")
    }

    /// Refuses send-queue work before the connection exists, after the peer left, or once the
    /// QP is in the error state (`op` names the call for the error).
    #[inline]
    pub(super) fn check_send_queue_open(&self, op: &'static str) -> Result<()> {
        if !self.connected {
            // Only reachable through a ClientQp/ServerQp, whose API does not offer sends.
            return Err(Error::InvalidArgument("sends need an established connection".into()));
        }
        if self.peer_left {
            return Err(Error::Disconnected { op, addr: self.peer_addr() });
        }
        if self.errored {
            return Err(in_error_state(op));
        }
        if self.fenced {
            return Err(fenced(op));
        }
        Ok(())
    }

    /// Checks a send-queue work request of several pieces: their count against the QP's
    /// limits, and every piece after the first.
    fn check_send_pieces(&self, w: &SendWr<'_>, first_len: usize) -> Result<()> {
        let pieces = w.num_pieces();
        check_pieces(pieces, self.max_send_sge, "QP's send queue", "QpInit::max_send_sge")?;
        if matches!(w.op, SendOp::Read { .. }) && pieces > self.max_read_sge as usize {
            return Err(Error::InvalidArgument(format!(
                "an RDMA READ of {pieces} pieces exceeds the device's limit of {} for READs (max_sge_rd)",
                self.max_read_sge
            )));
        }
        check_rest(&self.pd, first_len, w.rest, w.op.writes_local())
    }

    fn post_send_chunk<W: AsSendWr>(&self, q: &mut Queues, wrs: &[W]) -> Result<()> {
        // Only the `n` entries used are initialised (zeroing whole arrays costs on every post).
        let mut raw: [MaybeUninit<ffi::ibv_send_wr>; CHUNK] = [const { MaybeUninit::uninit() }; CHUNK];
        let mut sge: [MaybeUninit<ffi::ibv_sge>; CHUNK_SGE] = [const { MaybeUninit::uninit() }; CHUNK_SGE];
        let n = wrs.len().min(CHUNK);
        // Both arrays are written only through these pointers from here on, so the pointers the
        // list holds into them stay valid.
        let base: *mut ffi::ibv_send_wr = raw.as_mut_ptr().cast();
        let sge_base: *mut ffi::ibv_sge = sge.as_mut_ptr().cast();
        let mut used = 0;
        // The work request that takes the last free slot is signaled, so that a queue full of
        // unsignaled work always has a completion coming that retires it.
        let free = q.send.free();
        for (k, w) in wrs[..n].iter().enumerate() {
            let w = w.send_wr();
            let writes = w.op.writes_local();
            let first = w.local.as_ref().map(|(m, _)| m.inner());
            let seq = q.send.stage(k as u64, w.wr_id, first.map(|m| Hold::new(m, writes)));
            if needs_rest_holds(first, w.rest) {
                // Every later piece's region is held too, in the ring's side table (once).
                q.send.stage_rest(seq, hold_rest(first, w.rest, writes));
            }
            // A datagram's address handle is held in the ring's table until the slot retires
            // (the check above made sure this is a UD QP, whose send ring has the table).
            let ud = w.ud.filter(|d| q.send.stage_ah(seq, d.ah()));
            let tag = tag::encode(self.send_slot.index, seq, false, false);
            // SAFETY: k < n <= CHUNK: within `raw`. At most MAX_SGE entries per work request
            // and CHUNK work requests, so `used` + sge_entries() <= CHUNK_SGE: within `sge`. Both
            // are initialised in place, and reached only through `base` and `sge_base`.
            let r = unsafe {
                base.add(k).write(w.lower(tag, w.signaled || free == k as u64 + 1, ud, sge_base.add(used)));
                &mut *base.add(k)
            };
            used += w.sge_entries();
            // SAFETY: k + 1 < n <= CHUNK, so the pointer stays within `raw`.
            r.next = if k + 1 < n { unsafe { base.add(k + 1) } } else { std::ptr::null_mut() };
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // Each piece was checked against a region on this PD, whose handle a ring slot (or its
        // side table) now holds until the completion is reaped; inline data is copied in the call;
        // a datagram's address handle is held by the ring's address-handle table likewise.
        // SAFETY: QP valid; raw[..n] is an initialised, NULL-terminated list over `sge`, alive
        // for the call; every region and address handle it names is held (above).
        let ret = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), base, &mut bad) };
        self.commit_posted(q, ret, bad, base, n, true, "ibv_post_send")
    }

    /// Commits the staged slots after a post, and maps the error (see "Failed posts" in the
    /// module docs).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn commit_posted<T>(
        &self,
        q: &mut Queues,
        ret: i32,
        bad: *mut T,
        first: *const T,
        n: usize,
        send: bool,
        op: &'static str,
    ) -> Result<()> {
        if ret == 0 {
            let ring = if send { &mut q.send } else { &mut q.recv };
            ring.commit(n as u64, n as u64);
            return Ok(());
        }
        self.commit_failed(q, ret, bad, first, n, send, op)
    }

    /// [`QueuePair::commit_posted`] after the provider refused a post.
    #[cold]
    #[allow(clippy::too_many_arguments)]
    fn commit_failed<T>(
        &self,
        q: &mut Queues,
        ret: i32,
        bad: *mut T,
        first: *const T,
        n: usize,
        send: bool,
        op: &'static str,
    ) -> Result<()> {
        let ring = if send { &mut q.send } else { &mut q.recv };
        if let Some(k) = rejected_from(bad, first, n) {
            ring.commit(k as u64, n as u64);
            return check_ibv(ret, op);
        }
        // Unknown extent: every staged work request may be posted (and may still run). Keep
        // them all, and flush them through the error state.
        ring.commit(n as u64, n as u64);
        let flushed = self.set_error_state().is_ok();
        Err(Error::Call {
            op,
            addr: None,
            hint: Some(if flushed {
                "the provider failed the post without saying which work requests it took: they are kept until the flush retires them, and the QP was moved to the error state"
            } else {
                "the provider failed the post without saying which work requests it took, and the QP could not be moved to the error state: its regions stay held until the QP is dropped"
            }),
            source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
        })
    }

    /// Posts receive work requests.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a QP that takes its receives from an SRQ (post there), or
    /// one moved to the error state ([`QueuePair::set_error`]); [`Error::QpInError`] once a
    /// completion failed (or a wait found the QP in the error state); as for
    /// [`QueuePair::post_send`].
    pub fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<()> {
        if self.srq.is_some() {
            return Err(Error::InvalidArgument(
                "this QP takes its receives from a shared receive queue: post them there".into(),
            ));
        }
        if self.peer_left {
            // The QP is in the error state: a receive posted now may never be flushed (rxe).
            return Err(Error::Disconnected { op: "ibv_post_recv", addr: self.peer_addr() });
        }
        if self.errored {
            return Err(in_error_state("ibv_post_recv"));
        }
        if self.fenced {
            return Err(fenced("ibv_post_recv"));
        }
        if let [w] = wrs {
            if w.rest.is_empty() {
                return self.post_recv_one(w);
            }
        }
        for w in wrs {
            check_recv(&self.pd, w, self.max_recv_sge, "QP's receive queue", "QpInit::max_recv_sge")?;
        }
        let mut q = lock(&self.queues);
        if let Some(f) = q.failed {
            return Err(self.failed_error(f, "ibv_post_recv"));
        }
        if (wrs.len() as u64) > q.recv.free() {
            return Err(Error::QueueFull { queue: "receive", depth: q.recv.cap() as u32 });
        }
        for chunk in wrs.chunks(CHUNK) {
            let stage = |k: usize, w: &RecvWr<'_>| {
                let seq = q.recv.stage(k as u64, w.wr_id, Some(Hold::new(w.mr.inner(), true)));
                if needs_rest_holds(Some(w.mr.inner()), w.rest) {
                    q.recv.stage_rest(seq, hold_rest(Some(w.mr.inner()), w.rest, true));
                }
                tag::encode(self.recv_slot.index, seq, true, false)
            };
            let post = |head: *mut ffi::ibv_recv_wr, n| {
                let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
                // SAFETY: as in post_send_chunk: a well-formed list over live stack arrays, every
                // piece checked (bounds, PD, LOCAL_WRITE), and each region held by a slot (or its
                // side table) until reaped.
                let ret = unsafe { ffi::ibv_post_recv(self.raw.as_ptr(), head, &mut bad) };
                (ret, bad, head, n)
            };
            let (ret, bad, head, n) = with_recv_list(chunk, stage, post);
            self.commit_posted(&mut q, ret, bad, head.cast_const(), n, false, "ibv_post_recv")?;
        }
        Ok(())
    }

    /// `post_recv` for one receive of at most one piece (the common case): the same checks and
    /// work request, built on the stack without the list's arrays and loops.
    #[inline]
    fn post_recv_one(&self, w: &RecvWr<'_>) -> Result<()> {
        check_local(&self.pd, w.mr, &w.range, true)?;
        let mut q = lock(&self.queues);
        // Read under the lock the post takes anyway (see post_sends).
        if let Some(f) = q.failed {
            return Err(self.failed_error(f, "ibv_post_recv"));
        }
        if q.recv.free() == 0 {
            return Err(Error::QueueFull { queue: "receive", depth: q.recv.cap() as u32 });
        }
        let seq = q.recv.stage(0, w.wr_id, Some(Hold::new(w.mr.inner(), true)));
        let mut sge = w.mr.sge(&w.range);
        let mut wr = ffi::ibv_recv_wr {
            wr_id: tag::encode(self.recv_slot.index, seq, true, false),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            // A zero-length receive has no scatter entry (see with_recv_list).
            num_sge: !w.range.is_empty() as i32,
        };
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // The piece was checked (bounds, PD, LOCAL_WRITE) and its region is held by the slot
        // staged above until the completion is reaped.
        // SAFETY: QP valid; `wr` is one NULL-terminated work request over `sge`, both alive for
        // the call.
        let ret = unsafe { ffi::ibv_post_recv(self.raw.as_ptr(), &mut wr, &mut bad) };
        self.commit_posted(&mut q, ret, bad, &wr, 1, false, "ibv_post_recv")
    }
}

/// The refusal of a post to a QP whose lane's CQ has no room for it yet (`fenced`).
#[cold]
fn fenced(op: &'static str) -> Error {
    Error::InvalidArgument(format!(
        "{op}: this QP completes on a Lane's CQ that had no room for its queues when it was created, so its own \
         posts could overrun it: attach it (Lane::attach grows the CQ where the device can), or create the lane \
         deeper (Lane::new)"
    ))
}
