//! Memory windows on a lane: binding a window ([`Lane::bind_window`]), invalidating it
//! ([`Lane::invalidate_window`], then [`Lane::window_unbound`] once its completion is handed
//! out), and the peer's send with invalidate ([`SendWr::send_with_invalidate`],
//! [`Wc::invalidated_rkey`]). The rules are those of [`crate::verbs::mw`]; what the lane adds
//! is who holds what, and for how long:
//!
//! ```text
//!  BindWr::new(mw, region, range, rights)      the region moves in
//!   │ Lane::bind_window                        IBV_WR_BIND_MW (type 2) / ibv_bind_mw (type 1)
//!   ▼
//!  BoundWindow ── rkey(), remote()             holds the region (a count, no access to its bytes)
//!   │                                          the bind's completion hands the region back
//!   │ Lane::invalidate_window                  IBV_WR_LOCAL_INV (type 2) / zero-length bind (type 1)
//!   ▼
//!  Invalidating                                still holds the region
//!   │ Lane::window_unbound                     once the invalidation's completion is handed out,
//!   ▼                                          and no completion of the QP has failed
//!  MemoryWindow (unbound: bind it again)       the region released
//! ```
//!
//! - **The bind moves the region into its slot**, as any work request does, and its
//!   completion (`WcOpcode::BindMw`) hands it back. The [`BoundWindow`] it returns at once
//!   holds the region for as long as the window may be bound, so the region outlives the
//!   binding whatever is dropped first; with write or atomic rights, that hold counts as a
//!   writer, and the region's accessors refuse its bytes until it is released.
//! - **Nothing is released on the word of a completion that does not prove it.** The
//!   invalidation's slot holds nothing; the [`Invalidating`] it returns keeps the window and
//!   its hold on the region. [`Lane::window_unbound`] releases them only when the
//!   invalidation's own slot has retired and no completion of its QP failed so far: a failed
//!   or flushed completion moves a QP to the error state, which flushes everything after it,
//!   so a QP with no failure completed every work request it retired successfully, the
//!   invalidation included. Otherwise the window may still be bound (a type 1 window is
//!   reachable through any QP of its protection domain): the region stays held until the
//!   window is dropped, whose deallocation unbinds it.
//! - **A peer's send with invalidate releases nothing** ([`BoundWindow::invalidated_by`] keeps
//!   the region held until the window is dropped).
//! - **A type 2 window's rkey changes with every bind.** The bind names the key the window
//!   has and the one it is to have (`ibv_inc_rkey` of it); once the provider took the bind,
//!   the window records its new key, so the next bind names it. (rxe checks the key named
//!   against the window's, and fails a bind that names a stale one.)
//!
//! The ordinary post (`Lane::post_send`) is not touched: binds and invalidations are their own
//! entry points, taking a slot of the send queue as any work request does.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use rdma_sys as ffi;

use super::completion::RECV;
use super::refused::{post_list_failed, qp_in_error, refusal, Rejected};
use super::{Lane, LaneQp, Member, SendWr, Wc};
use crate::error::{Error, Result};
use crate::verbs::hold::Hold;
use crate::verbs::mr::{AccessFlags, MemoryRegion};
use crate::verbs::mw::{BoundWindow, InvalidateError, MemoryWindow, WindowType};

/// A bind of a memory window to a range of a region, for [`Lane::bind_window`]: the window
/// and the region move into the lane.
pub struct BindWr {
    mw: MemoryWindow,
    mr: MemoryRegion,
    range: Range<usize>,
    rights: AccessFlags,
    wr_id: u64,
}

impl BindWr {
    /// A bind of `mw` to `mr[range]` granting `rights` (any of [`AccessFlags::REMOTE_READ`],
    /// [`AccessFlags::REMOTE_WRITE`], [`AccessFlags::REMOTE_ATOMIC`]). Checked when posted.
    pub fn new(mw: MemoryWindow, mr: MemoryRegion, range: Range<usize>, rights: AccessFlags) -> BindWr {
        BindWr { mw, mr, range, rights, wr_id: 0 }
    }

    /// Sets the `wr_id` the bind's completion carries.
    pub fn wr_id(mut self, id: u64) -> BindWr {
        self.wr_id = id;
        self
    }

    /// The window and the region, back (the bind is not posted).
    pub fn into_parts(self) -> (MemoryWindow, MemoryRegion) {
        (self.mw, self.mr)
    }
}

impl fmt::Debug for BindWr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BindWr")
            .field("kind", &self.mw.kind())
            .field("range", &self.range)
            .field("rights", &self.rights)
            .field("wr_id", &self.wr_id)
            .finish()
    }
}

/// A window whose invalidation a lane has posted ([`Lane::invalidate_window`]): it still holds
/// its region until [`Lane::window_unbound`] finds the invalidation done, or until it is
/// dropped (which deallocates the window, and so unbinds it, before the region is released).
///
/// How a lane keeps the rules of [`crate::verbs::mw`]:
///
/// ```text
///  BindWr::new(mw, region, range, rights)      the region moves in
///   │ Lane::bind_window                        IBV_WR_BIND_MW (type 2) / ibv_bind_mw (type 1)
///   ▼
///  BoundWindow ── rkey(), remote()             holds the region (a count, no access to its bytes);
///   │                                          the bind's completion hands the region back
///   │ Lane::invalidate_window                  IBV_WR_LOCAL_INV (type 2) / zero-length bind (type 1)
///   ▼
///  Invalidating                                still holds the region
///   │ Lane::window_unbound                     once the invalidation's completion is handed out,
///   ▼                                          and no completion of the QP has failed
///  MemoryWindow (unbound: bind it again)       the region released
/// ```
///
/// - The bind moves the region into its slot, as any work request does, and its completion
///   hands it back; the [`BoundWindow`] holds the region for as long as the window may be
///   bound, so the region outlives the binding whatever is dropped first. With write or
///   atomic rights that hold counts as a writer: the region's accessors refuse its bytes.
/// - The invalidation's slot holds nothing. [`Lane::window_unbound`] releases the region only
///   when the invalidation's slot has retired and no completion of its QP has failed: a failed
///   or flushed completion moves a QP to the error state, which flushes all that follows, so a
///   QP with none completed every work request it retired successfully. Otherwise the window
///   may still be bound (a type 1 window through any QP of its protection domain), and the
///   region stays held until the window is dropped, whose deallocation unbinds it.
/// - A peer's send with invalidate ([`SendWr::send_with_invalidate`],
///   [`Wc::invalidated_rkey`], [`BoundWindow::invalidated_by`]) releases nothing: the window
///   holds its region until it is dropped.
/// - A type 2 window's rkey changes with each bind: the bind names the window's key and the
///   next one (`ibv_inc_rkey`), and once the provider took it the window records the new one,
///   which the next bind names (rxe fails a bind that names a stale key).
///
/// An invalidation takes the bound window, and a release takes the invalidation: neither can be
/// asked twice.
///
/// ```compile_fail,E0382
/// # fn f(lane: &mut rdma_cm::verbs::lane::Lane, qp: rdma_cm::LaneQp, w: rdma_cm::verbs::mw::BoundWindow) {
/// let inv = lane.invalidate_window(qp, w, 1).unwrap();
/// let again = lane.invalidate_window(qp, w, 2); // error[E0382]: use of moved value `w`
/// # }
/// ```
///
/// ```compile_fail,E0382
/// # fn f(lane: &mut rdma_cm::verbs::lane::Lane, inv: rdma_cm::verbs::lane::Invalidating) {
/// let mw = lane.window_unbound(inv);
/// let again = lane.window_unbound(inv); // error[E0382]: use of moved value `inv`
/// # }
/// ```
pub struct Invalidating {
    /// Still holding its region (`MemoryWindow::held`): dropped, the window is deallocated
    /// first.
    window: BoundWindow,
    qp: LaneQp,
    /// The invalidation's sequence number in its QP's send queue (whole).
    seq: u64,
}

impl Invalidating {
    /// The QP the invalidation was posted on.
    pub fn qp(&self) -> LaneQp {
        self.qp
    }

    /// The rkey being revoked.
    pub fn rkey(&self) -> u32 {
        self.window.rkey()
    }

    /// The window's type.
    pub fn kind(&self) -> WindowType {
        self.window.kind()
    }
}

impl fmt::Debug for Invalidating {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Invalidating").field("window", &self.window).field("qp", &self.qp).finish()
    }
}

/// How a bind or an invalidation went to the provider.
enum Posted {
    /// Taken.
    Ok,
    /// Refused, and the provider said this request was not taken.
    Named(i32),
    /// Refused without saying whether it took it.
    Unknown(i32),
}

impl Member {
    /// Refuses a window operation where a send-queue work request could not go: a UD QP, a
    /// full queue, a QP in error or not connected yet.
    fn check_window_op(&self, op: &'static str) -> Result<()> {
        if self.is_ud() {
            return Err(Error::InvalidArgument(format!("{op}: memory windows are bound on RC QPs; this one is UD")));
        }
        if self.send.free() == 0 || self.failed.is_some() {
            return Err(refusal(self, op));
        }
        Ok(())
    }

    /// Posts the one send-queue work request `raw` (tag set, signaled).
    fn post_window_wr(&mut self, raw: &mut ffi::ibv_send_wr) -> Posted {
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (its owner is in `self`); `raw` is one NULL-terminated work
        // request naming no scatter list; the window and the region it names are the caller's
        // to keep alive until its slot retires (see the callers).
        let ret = unsafe { self.provider_post_send(raw, &mut bad) };
        match ret {
            0 => Posted::Ok,
            _ if std::ptr::eq(bad, raw) => Posted::Named(ret),
            _ => Posted::Unknown(ret),
        }
    }

    /// Binds (or, with a zero length, unbinds) the type 1 window `mw` as `info` says, posted
    /// signaled with the tag `wr_id` (`ibv_bind_mw`). `ibv_bind_mw` names no refused request,
    /// so a refusal's extent is unknown; rxe returns 0 even when its post failed (rdma-core's
    /// `rxe_bind_mw` sets `errno` and returns 0), while a bind it took always gives the window
    /// a new rkey: an unchanged one reads as `EINVAL`.
    ///
    /// # Safety
    /// `mw` and `info.mr` are on this QP's protection domain, and the region stays registered
    /// until the request's slot retires.
    unsafe fn bind_type1(&self, mw: &MemoryWindow, wr_id: u64, info: ffi::ibv_mw_bind_info) -> Posted {
        let old = mw.current_rkey();
        let mut bind =
            ffi::ibv_mw_bind { wr_id, send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0, bind_info: info };
        // SAFETY: the QP and the window are valid while `self` and `mw` live; `bind` lives for
        // the call; the region is the caller's to keep valid (# Safety).
        let ret = unsafe { ffi::ibv_bind_mw(self.raw.as_ptr(), mw.as_raw(), &mut bind) };
        match ret {
            0 if mw.current_rkey() != old => Posted::Ok,
            0 => Posted::Unknown(libc::EINVAL),
            e => Posted::Unknown(e),
        }
    }
}

/// A zeroed send work request with the tag `wr_id`, signaled, of `opcode`.
fn window_wr(wr_id: u64, opcode: u32) -> ffi::ibv_send_wr {
    // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of those): all-zero is
    // a valid value (no scatter list, no next).
    let mut raw: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
    raw.wr_id = wr_id;
    raw.opcode = opcode;
    raw.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    raw
}

impl Lane {
    /// Binds `bind`'s window to its range of its region with its rights, posted signaled on
    /// `qp`'s send queue: a type 2 window with a bind work request (`IBV_WR_BIND_MW`), a type 1
    /// window through `ibv_bind_mw`. The region moves into the bind's slot, and the bind's
    /// completion (`WcOpcode::BindMw`) hands it back; reap it before handing the rkey to the
    /// peer by any other way than a send posted after it on `qp`. The returned window holds
    /// the region until it is invalidated ([`Lane::invalidate_window`], then
    /// [`Lane::window_unbound`]) or dropped; with write or atomic rights the region's bytes are
    /// out of Rust's reach meanwhile. The rules are those of [`crate::verbs::mw`]; how the lane
    /// keeps them is told at [`Invalidating`].
    ///
    /// # Errors
    /// The window and the region come back in the [`BindWr`] when nothing was posted:
    /// [`Error::InvalidArgument`] for a window, region or QP on different protection domains,
    /// a region without `MW_BIND` or a chunk of a split registration, rights a window cannot
    /// have, an empty or out-of-bounds range, a UD QP or an unknown `qp`;
    /// [`Error::QueueFull`]; [`Error::QpInError`] (or not connected yet) as for
    /// [`Lane::post_send`]; [`Error::Call`] when the provider refuses the bind, naming it. When
    /// the provider fails it without saying whether it took it, nothing comes back: the region
    /// stays in its slot until the flush retires it (the QP is moved to the error state), and
    /// the window is deallocated.
    pub fn bind_window(&mut self, qp: LaneQp, bind: BindWr) -> std::result::Result<BoundWindow, Rejected<BindWr>> {
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return Err(Rejected::new(e, bind)),
        };
        if let Err(e) = m.check_window_op("bind memory window") {
            return Err(Rejected::new(e, bind));
        }
        if let Err(e) = bind.mw.check_bind(&m.pd, &bind.mr, &bind.range, bind.rights) {
            return Err(Rejected::new(e, bind));
        }
        let BindWr { mw, mr, range, rights, wr_id } = bind;
        let writes = rights.remotely_writable();
        let addr = mr.addr() + range.start as u64;
        let len = range.len() as u64;
        // The window's hold, taken before the region moves into the slot.
        let hold = Hold::new(mr.inner(), writes);
        let raw_mr = mr.as_raw();
        let seq = m.send.tail;
        let tag = m.send.tag(seq);
        // Into the slot at `tail`, committed, before the call: the region stays registered until
        // the bind's completion (or the flush) retires the slot, whatever becomes of the window.
        m.send.put(0, mr, wr_id);
        m.send.tail = seq.wrapping_add(1);
        let info = ffi::ibv_mw_bind_info { mr: raw_mr, addr, length: len, mw_access_flags: rights.bits() };
        let (posted, rkey) = match mw.kind() {
            WindowType::One => {
                // SAFETY: window and region are on the QP's PD (check_bind); the region sits in
                // the slot staged above until the request retires.
                let posted = unsafe { m.bind_type1(&mw, tag, info) };
                (posted, mw.current_rkey())
            }
            WindowType::Two => {
                // SAFETY: ibv_inc_rkey only computes on the integer.
                let rkey = unsafe { ffi::ibv_inc_rkey(mw.current_rkey()) };
                let mut raw = window_wr(tag, ffi::ibv_wr_opcode::IBV_WR_BIND_MW);
                raw.bind_mw_tso_union.bind_mw = ffi::bind_mw_t { mw: mw.as_raw(), rkey, bind_info: info };
                // The window and the region are valid (owned here, and in the slot).
                (m.post_window_wr(&mut raw), rkey)
            }
        };
        let queues = Arc::clone(m.owner.lane_qp().identity());
        match posted {
            Posted::Ok => {
                let mut mw = mw;
                if mw.kind() == WindowType::Two {
                    // Type 1 windows are updated by `ibv_bind_mw` itself.
                    mw.record_rkey(rkey);
                }
                Ok(BoundWindow::new(mw, hold, rkey, addr, len, rights, &queues))
            }
            Posted::Named(ret) => {
                // Not taken: the slot is emptied again, and everything goes back.
                m.send.tail = seq;
                drop(hold);
                let error = Error::call("ibv_post_send(IBV_WR_BIND_MW)", ret, None);
                match m.send.unput() {
                    Some(mr) => Err(Rejected::new(error, BindWr { mw, mr, range, rights, wr_id })),
                    // Never: the region was put there above and nothing took it since.
                    None => Err(Rejected::kept(error)),
                }
            }
            Posted::Unknown(ret) => {
                // It may run: the region stays in its slot until the flush retires it, and the
                // window is deallocated (a window that cannot be keeps holding the region, for
                // good: `MemoryWindow`'s drop).
                let op = if mw.kind() == WindowType::One { "ibv_bind_mw" } else { "ibv_post_send(IBV_WR_BIND_MW)" };
                let error = post_list_failed(m, ret, false, op);
                drop(BoundWindow::new(mw, hold, rkey, addr, len, rights, &queues));
                Err(Rejected::kept(error))
            }
        }
    }

    /// Unbinds `window` through `qp`, the QP that bound it: a type 2 window with a local
    /// invalidation (`IBV_WR_LOCAL_INV`), a type 1 window with a bind of zero length; posted
    /// signaled with `wr_id`. Its completion (`WcOpcode::LocalInv`, or `WcOpcode::BindMw` for
    /// type 1) carries no region. The window comes back as an [`Invalidating`], which still
    /// holds the region: [`Lane::window_unbound`] releases it once that completion has been
    /// handed out. After a successful invalidation the old rkey opens nothing
    /// (`REM_ACCESS_ERR` at the peer).
    ///
    /// # Errors
    /// An [`InvalidateError`] with the window, still bound and holding its region:
    /// [`Error::InvalidArgument`] for a window bound through another QP (two send queues are
    /// not ordered: that QP's bind could run after this invalidation), or on another
    /// protection domain, or an unknown `qp`; [`Error::QueueFull`]; [`Error::QpInError`] as
    /// for [`Lane::post_send`]; [`Error::Call`] when the provider refuses it (when it did not
    /// say whether it took it, the QP is moved to the error state: drop the window to unbind
    /// it).
    pub fn invalidate_window(
        &mut self,
        qp: LaneQp,
        window: BoundWindow,
        wr_id: u64,
    ) -> std::result::Result<Invalidating, Box<InvalidateError>> {
        let refuse = |error, window| Err(Box::new(InvalidateError { error, window }));
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return refuse(e, window),
        };
        if let Err(e) = m.check_window_op("invalidate memory window") {
            return refuse(e, window);
        }
        if !Arc::ptr_eq(window.window().pd(), &m.pd) {
            return refuse(
                Error::InvalidArgument("the memory window is on another protection domain than this QP".into()),
                window,
            );
        }
        if !window.bound_on(m.owner.lane_qp().identity()) {
            return refuse(
                Error::InvalidArgument(
                    "the memory window was bound through another QP: invalidate it through that one (its send queue \
                     runs the invalidation after the bind), or drop it (deallocating it unbinds it)"
                        .into(),
                ),
                window,
            );
        }
        let seq = m.send.tail;
        let tag = m.send.tag(seq);
        // The slot holds nothing: the window (in the `Invalidating`) holds the region.
        m.send.put_none(wr_id);
        m.send.tail = seq.wrapping_add(1);
        let rkey = window.rkey();
        let posted = match window.kind() {
            WindowType::Two => {
                let mut raw = window_wr(tag, ffi::ibv_wr_opcode::IBV_WR_LOCAL_INV);
                raw.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
                m.post_window_wr(&mut raw)
            }
            WindowType::One => {
                let region = window.hold().region();
                let info =
                    ffi::ibv_mw_bind_info { mr: region.raw_mr(), addr: region.addr(), length: 0, mw_access_flags: 0 };
                // SAFETY: the window is on the QP's PD (checked above) and so is its region (the
                // bind checked it); the region is held by `window`, which the `Invalidating`
                // keeps until the request has retired, or which deallocates the window first.
                unsafe { m.bind_type1(window.window(), tag, info) }
            }
        };
        let op = if window.kind() == WindowType::One { "ibv_bind_mw" } else { "ibv_post_send(IBV_WR_LOCAL_INV)" };
        match posted {
            Posted::Ok => Ok(Invalidating { window, qp, seq }),
            Posted::Named(ret) => {
                m.send.tail = seq;
                let _ = m.send.unput();
                refuse(Error::call(op, ret, None), window)
            }
            Posted::Unknown(ret) => {
                // Kept as posted; the QP goes to the error state, so no `window_unbound` will
                // find it done: the window, given back, keeps holding the region.
                let e = post_list_failed(m, ret, false, op);
                refuse(e, window)
            }
        }
    }

    /// The window of `inv`, unbound, with its region released, once its invalidation is done:
    /// its completion has been handed out (polled or waited for), and no completion of its QP
    /// has failed. (A failed or flushed completion moves the QP to the error state, which
    /// flushes all that follows; so a QP with none completed successfully every work request
    /// it retired, the invalidation included.)
    ///
    /// # Errors
    /// `inv` back, still holding its region: [`Error::InvalidArgument`] while the
    /// invalidation's completion has not been handed out yet (poll, then ask again), or when
    /// its QP is no longer attached; [`Error::QpInError`] once a completion of the QP failed
    /// (the invalidation may not have run: drop `inv` to unbind the window by deallocating it,
    /// which releases the region).
    pub fn window_unbound(&mut self, inv: Invalidating) -> std::result::Result<MemoryWindow, Rejected<Invalidating>> {
        let m = match self.member(inv.qp) {
            Ok(m) => m,
            Err(e) => return Err(Rejected::new(e, inv)),
        };
        if let Some(fault) = m.failed {
            return Err(Rejected::new(qp_in_error(m, fault, "invalidate memory window"), inv));
        }
        // Retired: before `head` (and so handed out: the lane hands out what it retires, with
        // the completion that retires it). `seq` was committed below `tail`, and the window of
        // outstanding work is at most the queue's depth, so the differences cannot wrap.
        let retired = m.send.head.wrapping_sub(inv.seq);
        if retired == 0 || retired > m.send.tail.wrapping_sub(inv.seq) {
            return Err(Rejected::new(
                Error::InvalidArgument(
                    "the invalidation's completion has not been handed out yet: poll or wait for it, then ask again"
                        .into(),
                ),
                inv,
            ));
        }
        let (mw, hold) = inv.window.into_parts();
        // Done: no rkey of this binding opens anything now.
        drop(hold);
        Ok(mw)
    }
}

impl SendWr {
    /// Sends `mr[range]` and invalidates the peer's memory window `rkey` with it
    /// (`IBV_WR_SEND_WITH_INV`, RC only): the peer's receive completion names the rkey
    /// ([`Wc::invalidated_rkey`]).
    #[inline]
    pub fn send_with_invalidate(mr: MemoryRegion, range: Range<usize>, rkey: u32) -> SendWr {
        let mut w = SendWr::send(mr, range);
        w.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_INV;
        // The union's other member: the rkey, in host order (not immediate data).
        w.imm = rkey;
        w
    }
}

impl Wc {
    /// The rkey the peer's send with invalidate revoked, for a receive completion flagged
    /// `IBV_WC_WITH_INV`. (rxe flags it otherwise: see [`crate::verbs::mw`].)
    #[inline]
    pub fn invalidated_rkey(&self) -> Option<u32> {
        (self.flags & RECV != 0 && self.f.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_INV.0 != 0).then_some(self.f.imm)
    }
}
