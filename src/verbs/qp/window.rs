//! Binding and invalidating memory windows: work requests on the send queue, staged in its ring
//! like any other, so their completions come back through the QP's polls and the region stays
//! held until the device is done (see [`crate::verbs::mw`]).

use std::mem::MaybeUninit;
use std::ops::Range;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::mr::{AccessFlags, MemoryRegion};
use crate::verbs::mw::{BoundWindow, InvalidateError, MemoryWindow, WindowType};
use crate::verbs::ring::{tag, Hold};
use crate::verbs::wr::{SendOp, SendWr};
use crate::wait::lock;

use super::QueuePair;

impl QueuePair {
    /// Binds `mw` to `mr[range]` with the remote `rights` (any of
    /// [`AccessFlags::REMOTE_READ`], [`AccessFlags::REMOTE_WRITE`],
    /// [`AccessFlags::REMOTE_ATOMIC`]): a type 1 window through `ibv_bind_mw`, a type 2 window
    /// with a bind work request. The bind is posted signaled with `wr_id`; reap its completion
    /// (`WcOpcode::BindMw`) before handing the rkey to the peer by any other way than a send
    /// posted after it on this QP. The returned window holds the region until it is unbound
    /// or dropped; with write or atomic rights the region's bytes are out of Rust's reach
    /// meanwhile.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (the window back is lost: it is deallocated) for a window,
    /// region or QP on different protection domains, a region without `MW_BIND`, rights a
    /// window cannot have, or an empty or out-of-bounds range; [`Error::QueueFull`]; as for
    /// [`QueuePair::post_send`] when the QP cannot take sends; [`Error::Call`] when the
    /// provider refuses the bind.
    pub fn bind_window(
        &mut self,
        mw: MemoryWindow,
        mr: &MemoryRegion,
        range: Range<usize>,
        rights: AccessFlags,
        wr_id: u64,
    ) -> Result<BoundWindow> {
        self.check_send_queue_open("bind memory window")?;
        mw.check_bind(&self.pd, mr, &range, rights)?;
        let writes = rights.remotely_writable();
        let addr = mr.addr() + range.start as u64;
        let len = range.len() as u64;
        let mut q = lock(&self.queues);
        if let Some(f) = q.failed {
            return Err(self.failed_error(f, "bind memory window"));
        }
        if q.send.free() == 0 {
            return Err(Error::QueueFull { queue: "send", depth: q.send.cap() as u32 });
        }
        // The bind's slot holds the region (as written to, if the window may be) until its
        // completion; the bound window takes a hold of its own for as long as it is bound.
        let seq = q.send.stage(0, wr_id, Some(Hold::new(mr.inner(), writes)));
        let tagged = tag::encode(self.send_slot.index, seq, false, false);
        let access = rights.bits();
        let (ret, rkey) = match mw.kind() {
            WindowType::One => {
                let info = ffi::ibv_mw_bind_info { mr: mr.as_raw(), addr, length: len, mw_access_flags: access };
                // SAFETY: window and region are valid and on the QP's PD (check_bind); the region
                // is held by the slot staged above.
                (unsafe { self.bind_type1(&mw, tagged, info) }, mw.current_rkey())
            }
            WindowType::Two => {
                // SAFETY: ibv_inc_rkey only computes on the integer.
                let rkey = unsafe { ffi::ibv_inc_rkey(mw.current_rkey()) };
                let op = SendOp::BindMw { mw: mw.as_raw() as usize, rkey, mr: mr.as_raw() as usize, addr, len, access };
                (self.post_lowered(&SendWr::new(op, None), tagged), rkey)
            }
        };
        self.commit_one(&mut q, ret, "bind memory window")?;
        drop(q);
        let mut mw = mw;
        if mw.kind() == WindowType::Two {
            // The next bind names this key (type 1 windows are updated by `ibv_bind_mw`).
            mw.record_rkey(rkey);
        }
        let hold = Hold::new(mr.inner(), writes);
        Ok(BoundWindow::new(mw, hold, rkey, addr, len, rights, &self.queues))
    }

    /// Unbinds `window`: a type 2 window with a local invalidation (`IBV_WR_LOCAL_INV`), a
    /// type 1 window with a bind of zero length. Posted signaled with `wr_id`; the window
    /// comes back at once, and its region stays held (as written to) by the work request's
    /// slot until the completion is reaped, so a peer's access that raced the invalidation
    /// never reaches memory Rust reads or frees. After a successful completion the old rkey
    /// opens nothing (`REM_ACCESS_ERR` at the peer), and the region is released.
    ///
    /// When the invalidation does not succeed (its completion is an error or a flush, or the
    /// QP is destroyed before it completes), the window may still be bound, and a type 1
    /// window is reachable through any QP on its protection domain: the region then stays
    /// held for good (leaked, and out of Rust's reach if the window was), even after the
    /// window is dropped.
    ///
    /// # Errors
    /// As for [`QueuePair::bind_window`], and [`Error::InvalidArgument`] for a window bound
    /// through another QP, in an [`InvalidateError`] that gives the window back, still bound.
    pub fn invalidate_window(
        &mut self,
        window: BoundWindow,
        wr_id: u64,
    ) -> std::result::Result<MemoryWindow, Box<InvalidateError>> {
        let refuse = |error, window| Err(Box::new(InvalidateError { error, window }));
        if let Err(e) = self.check_send_queue_open("invalidate memory window") {
            return refuse(e, window);
        }
        if !std::sync::Arc::ptr_eq(window.window().pd(), &self.pd) {
            return refuse(
                Error::InvalidArgument("the memory window is on another protection domain than this QP".into()),
                window,
            );
        }
        if !window.bound_on(&self.queues) {
            // Another QP's bind may not have run yet (two send queues are not ordered), and
            // would bind the window again after this invalidation succeeded.
            return refuse(
                Error::InvalidArgument(
                    "the memory window was bound through another QP: invalidate it through that one (its send queue runs the invalidation after the bind), or drop it (deallocating it unbinds it)".into(),
                ),
                window,
            );
        }
        let mut q = lock(&self.queues);
        if let Some(f) = q.failed {
            let e = self.failed_error(f, "invalidate memory window");
            return refuse(e, window);
        }
        if q.send.free() == 0 {
            return refuse(Error::QueueFull { queue: "send", depth: q.send.cap() as u32 }, window);
        }
        let region = std::sync::Arc::clone(window.hold().region());
        // The slot holds nothing: until the post is known to be taken, `window` holds the
        // region; from then on, `Queues::invalidating` does, until the successful completion.
        let seq = q.send.stage(0, wr_id, None);
        let tagged = tag::encode(self.send_slot.index, seq, false, false);
        let rkey = window.rkey();
        let ret = match window.kind() {
            WindowType::Two => self.post_lowered(&SendWr::new(SendOp::LocalInv { rkey }, None), tagged),
            WindowType::One => {
                // A zero-length bind unbinds a type 1 window.
                let info =
                    ffi::ibv_mw_bind_info { mr: region.raw_mr(), addr: region.addr(), length: 0, mw_access_flags: 0 };
                // SAFETY: the window is valid, and the region it is bound in is held by the bound
                // window and by the slot staged above.
                unsafe { self.bind_type1(window.window(), tagged, info) }
            }
        };
        match self.commit_one(&mut q, ret, "invalidate memory window") {
            Ok(()) => {
                // Posted: the region is held until the invalidation's successful completion
                // (under the queues' lock, so no completion of it is routed before).
                q.invalidating(seq, &region);
                Ok(window.into_parts().0)
            }
            Err(e) => refuse(e, window),
        }
    }

    /// Commits the one staged slot of a bind or an invalidation after its post returned
    /// `(ret, refused)`, as `post_send` does (see "Failed posts" in the QP's module docs): a
    /// request the provider named as refused releases its slot; any other error is an unknown
    /// extent (`ibv_bind_mw` names nothing), so the slot stays posted and the QP goes to the
    /// error state, whose flush retires it.
    fn commit_one(
        &self,
        q: &mut crate::verbs::ring::Queues,
        (ret, refused): (i32, bool),
        op: &'static str,
    ) -> Result<()> {
        let probe = MaybeUninit::<ffi::ibv_send_wr>::uninit();
        let first = probe.as_ptr();
        let bad = if refused { first.cast_mut() } else { std::ptr::null_mut() };
        self.commit_posted(q, ret, bad, first, 1, true, op)
    }

    /// Binds (or, with a zero length, unbinds) the type 1 window `mw` as `info` says, posted
    /// signaled as `tagged` (`ibv_bind_mw`); returns the outcome as `post_lowered` does, never
    /// naming the request as refused (`ibv_bind_mw` has no `bad_wr`). rxe returns 0 even when
    /// its post failed (rdma-core's `rxe_bind_mw` sets `errno` and returns 0): a bind that took
    /// always gives the window a new rkey, so an unchanged one reads as `EINVAL`.
    ///
    /// # Safety
    /// `mw` and `info.mr` must be on this QP's protection domain, and the region must stay
    /// registered until the request's slot retires (the caller's staged hold).
    unsafe fn bind_type1(&self, mw: &MemoryWindow, tagged: u64, info: ffi::ibv_mw_bind_info) -> (i32, bool) {
        let old = mw.current_rkey();
        let mut bind =
            ffi::ibv_mw_bind { wr_id: tagged, send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0, bind_info: info };
        // SAFETY: the QP and the window are valid while `self` and `mw` live; `bind` lives for
        // the call; the region is the caller's to keep valid (# Safety).
        let ret = unsafe { ffi::ibv_bind_mw(self.raw.as_ptr(), mw.as_raw(), &mut bind) };
        (if ret == 0 && mw.current_rkey() == old { libc::EINVAL } else { ret }, false)
    }

    /// Posts one send-queue work request that names no memory (a bind or an invalidation),
    /// staged as `tagged`, signaled; returns `ibv_post_send`'s value, and whether the provider
    /// named this request as the one it refused.
    fn post_lowered(&self, w: &SendWr<'_>, tagged: u64) -> (i32, bool) {
        let mut sge = [const { MaybeUninit::<ffi::ibv_sge>::uninit() }; 1];
        // SAFETY: `sge` has room for the one entry a request without pieces writes, and lives
        // until the post below returns.
        let mut wr = unsafe { w.lower(tagged, true, None, sge.as_mut_ptr().cast()) };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: QP valid; `wr` is one NULL-terminated work request; the window and region it
        // names are valid and held by the caller's staged slot and window.
        let ret = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        (ret, std::ptr::eq(bad, &wr))
    }
}
