//! Work requests lowered once and posted many times: the lane's fastest path.
//!
//! A [`SendWr`] or [`RecvWr`] is checked where it is built and lowered at every post. A
//! [`PreparedSend`] or [`PreparedRecv`] is checked and lowered once, for one QP of the lane
//! ([`Lane::prepare_send`], [`Lane::prepare_recv`]); a post then only stamps the `wr_id` tag and
//! the signaled bit into the provider's work request it already holds, moves the region into
//! the QP's slot and calls the provider. The completion hands the region back (beside the [`Wc`] in
//! [`Lane::poll_with`]), and
//! [`PreparedSend::rearm`] puts it back into the prepared request, which refuses any other
//! region: the request's scatter list was checked against that one.
//!
//! A prepared RDMA WRITE, READ or atomic is re-aimed at another offset of the remote region it
//! was checked against ([`PreparedSend::aim`], a compare and two stores), and its one piece at
//! another range of its region ([`PreparedSend::aim_local`]): a one-sided store reads another
//! slot each time with one request.
//!
//! ```text
//! let mut send = lane.prepare_send(qp, SendWr::write(mr, 0..64, &remote, 0))?;  // checked once
//! loop {
//!     lane.post_prepared(&mut send)?;          // the region moves into the lane
//!     lane.poll_with(1, |_wc, mr| region = mr)?;
//!     send.rearm(region.take().unwrap())?;     // back, for the next post
//! }
//! ```

use super::refused::{post_failed_one, post_list_failed, refusal, refusal_recv};
use super::{tag, Lane, LaneQp, Member, RecvWr, Rejected, SendWr};
use crate::error::Error;
use crate::error::Result;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::wr::MAX_SGE;
use rdma_sys as ffi;
use std::fmt;
use std::mem;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

mod aim;

const SIGNALED_FLAG: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;

/// A send-queue work request lowered once for one QP of a lane ([`Lane::prepare_send`]), posted
/// any number of times with [`Lane::post_prepared`].
///
/// It holds its region while it is *armed*; a post moves the region into the lane, and the
/// completion that retires the work request hands it back, to [`PreparedSend::rearm`] this
/// request with. Only that region is taken back: the request was checked against it (bounds,
/// access, protection domain). The request stays meaningful while its QP is attached; once
/// the QP is removed, a post is refused.
#[repr(C)]
pub struct PreparedSend {
    /// The provider's work request (first, so that its address is the request's own, which a
    /// post then keeps in one register). Between posts its `sg_list` points at `sge`, its `next`
    /// is NULL (a list post links the requests, and unlinks them before it returns) and its
    /// `send_flags` are `flags` (a post that signals because it takes the queue's last slot
    /// puts them back).
    raw: ffi::ibv_send_wr,
    /// Owned here; read by the provider only, through `raw.sg_list`.
    #[allow(dead_code)]
    sge: Sges<[MaybeUninit<ffi::ibv_sge>; MAX_SGE]>,
    mr: Option<MemoryRegion>,
    /// The number of the region it was checked against (unique in the process, never reused).
    of: u64,
    key: LaneQp,
    /// Its `wr_id` tag without the sequence number (`tag::encode` with 0).
    tag: u64,
    /// The send flags of a post that does not take the queue's last free slot:
    /// `IBV_SEND_SOLICITED` or nothing, and `IBV_SEND_SIGNALED` when it asks for a completion
    /// (also in `raw.send_flags` between posts).
    flags: u32,
    /// The flags its QP's requests always carry (`Member::always_flags`: signaled on iWARP),
    /// which `set_signaled(false)` keeps.
    forced: u32,
    wr_id: u64,
    /// Where it may be re-aimed ([`PreparedSend::aim`], [`PreparedSend::aim_local`]).
    bounds: aim::Bounds,
}

// SAFETY: the raw pointers in `raw` are its scatter list (its own `sge`, which it owns alone),
// a list post's link to another request (reset before the post returns) and a UD
// destination's address handle, which the lane's member keeps alive; only the lane that
// prepared it hands them to the provider, from whatever thread owns the lane (`Lane` is
// `Send`). Nothing is shared between threads: the request is owned, and used through `&mut`.
unsafe impl Send for PreparedSend {}

/// A receive lowered once for one QP of a lane ([`Lane::prepare_recv`]), posted any number of
/// times with [`Lane::post_prepared_recv`]; armed and re-armed as [`PreparedSend`] is.
#[repr(C)]
pub struct PreparedRecv {
    /// The provider's receive (first, as in `PreparedSend`), its `sg_list` pointing at `sge`
    /// for good.
    raw: ffi::ibv_recv_wr,
    sge: Sges<ffi::ibv_sge>,
    mr: Option<MemoryRegion>,
    of: u64,
    key: LaneQp,
    tag: u64,
    wr_id: u64,
}

// SAFETY: the one raw pointer is the scatter list, its own `sge`; see `PreparedSend`.
unsafe impl Send for PreparedRecv {}

/// A prepared request's scatter list, on the heap: the request's `sg_list` is pointed at it
/// once, when it is prepared, and stays valid wherever the request moves (it was pointed again
/// at every post when the list was part of the request). Held through a raw pointer, not a
/// `Box`, since the request's `sg_list` points into it; freed on drop.
struct Sges<T>(NonNull<T>);

impl<T> Sges<T> {
    fn new(value: T) -> Self {
        Sges(NonNull::from(Box::leak(Box::new(value))))
    }
    fn as_ptr(&self) -> *mut T {
        self.0.as_ptr()
    }
    fn get(&self) -> &T {
        // SAFETY: allocated and initialised by `new`, freed only by drop; written only through
        // `get_mut`, whose `&mut self` no shared borrow outlives (the provider only reads a
        // scatter list, and only during a post).
        unsafe { self.0.as_ref() }
    }
    /// The list, to re-aim a request ([`PreparedSend::aim_local`]).
    fn get_mut(&mut self) -> &mut T {
        // SAFETY: allocated and initialised by `new`, freed only by drop, owned by `self` alone:
        // `&mut self` makes this the only reference. The provider holds no pointer into it
        // between posts (`ibv_post_send` copies the scatter list before it returns).
        unsafe { self.0.as_mut() }
    }
}

impl<T> Drop for Sges<T> {
    fn drop(&mut self) {
        // SAFETY: from `Box::leak` in `new`, freed only here. The provider holds no pointer
        // into it: `ibv_post_send` and `ibv_post_recv` copy the scatter list before they return.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

impl fmt::Debug for PreparedSend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedSend")
            .field("qp", &self.key)
            .field("opcode", &self.raw.opcode)
            .field("pieces", &self.raw.num_sge)
            .field("wr_id", &self.wr_id)
            .field("signaled", &(self.flags & SIGNALED_FLAG != 0))
            .field("armed", &self.mr.is_some())
            .finish()
    }
}

impl fmt::Debug for PreparedRecv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedRecv")
            .field("qp", &self.key)
            .field("len", &self.sge.get().length)
            .field("wr_id", &self.wr_id)
            .field("armed", &self.mr.is_some())
            .finish()
    }
}

/// Puts `mr` into `slot` when it is the region `of` names and the slot is empty; gives it
/// back otherwise.
#[inline(always)]
pub(super) fn rearm(
    slot: &mut Option<MemoryRegion>,
    of: u64,
    mr: MemoryRegion,
) -> std::result::Result<(), Rejected<MemoryRegion>> {
    if mr.inner().serial() == of {
        // A region's number is its own: no two `MemoryRegion` values share one (each is made
        // with a new number, and none is cloned). `slot` only ever holds the region numbered
        // `of` (the request is prepared with it, only `rearm` puts one back, and the request
        // hands out no `&mut` to it, through which another could be swapped in). `mr` has the
        // number `of`, so `slot` is empty: nothing is overwritten (were it not empty, the
        // value would be leaked, not dropped twice).
        let old = slot.replace(mr);
        debug_assert!(old.is_none(), "two regions with one number");
        std::mem::forget(old);
        return Ok(());
    }
    Err(rearm_refused(slot.is_some(), mr))
}

#[cold]
#[inline(never)]
fn rearm_refused(armed: bool, mr: MemoryRegion) -> Rejected<MemoryRegion> {
    let why = if armed {
        "rearm: the prepared work request already holds its region"
    } else {
        "rearm: not the region this work request was prepared with (prepare another one for it)"
    };
    Rejected::new(Error::InvalidArgument(why.into()), mr)
}

macro_rules! armed_accessors {
    ($t:ty) => {
        impl $t {
            /// Puts its region back after a completion handed it out, arming it for the next
            /// post.
            ///
            /// # Errors
            /// The region comes back with [`Error::InvalidArgument`] when it is not the one
            /// this request was prepared with, or when the request already holds its region.
            #[inline(always)]
            pub fn rearm(&mut self, mr: MemoryRegion) -> std::result::Result<(), Rejected<MemoryRegion>> {
                rearm(&mut self.mr, self.of, mr)
            }

            /// Whether it holds its region (and so can be posted).
            pub fn is_armed(&self) -> bool {
                self.mr.is_some()
            }

            /// Its region while it is armed (not posted).
            ///
            /// There is no `&mut MemoryRegion` to be had: the request was checked against this
            /// very region, and a `&mut` would let another one be swapped in, which a post
            /// would then hand the device with this one's addresses. Its bytes are reached
            /// through [`Self::as_slice`], [`Self::as_mut_slice`], [`Self::read_at`] and
            /// [`Self::write_at`] instead, or by taking the region out ([`Self::take_region`])
            /// and re-arming with it.
            pub fn region(&self) -> Option<&MemoryRegion> {
                self.mr.as_ref()
            }

            /// Its region's bytes while it is armed ([`MemoryRegion::as_slice`]).
            ///
            /// # Errors
            /// [`Error::InvalidArgument`] when it is not armed; otherwise as for
            /// [`MemoryRegion::as_slice`].
            pub fn as_slice(&mut self) -> Result<&[u8]> {
                self.mr.as_mut().ok_or_else(|| disarmed("as_slice"))?.as_slice()
            }

            /// Its region's bytes, mutably, while it is armed ([`MemoryRegion::as_mut_slice`]):
            /// to fill a send.
            ///
            /// # Errors
            /// [`Error::InvalidArgument`] when it is not armed; otherwise as for
            /// [`MemoryRegion::as_mut_slice`].
            pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
                self.mr.as_mut().ok_or_else(|| disarmed("as_mut_slice"))?.as_mut_slice()
            }

            /// Copies out of its region while it is armed ([`MemoryRegion::read_at`]): to read
            /// what a receive brought.
            ///
            /// # Errors
            /// [`Error::InvalidArgument`] when it is not armed; otherwise as for
            /// [`MemoryRegion::read_at`].
            pub fn read_at(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
                self.mr.as_mut().ok_or_else(|| disarmed("read_at"))?.read_at(offset, dst)
            }

            /// Copies into its region while it is armed ([`MemoryRegion::write_at`]).
            ///
            /// # Errors
            /// [`Error::InvalidArgument`] when it is not armed; otherwise as for
            /// [`MemoryRegion::write_at`].
            pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
                self.mr.as_mut().ok_or_else(|| disarmed("write_at"))?.write_at(offset, src)
            }

            /// Its region, taken out (the request is then disarmed until [`Self::rearm`]).
            pub fn take_region(&mut self) -> Option<MemoryRegion> {
                self.mr.take()
            }

            /// The QP it was prepared for.
            pub fn qp(&self) -> LaneQp {
                self.key
            }

            /// The `wr_id` its completions carry.
            pub fn wr_id(&self) -> u64 {
                self.wr_id
            }

            /// Sets the `wr_id` its next completions carry.
            #[inline(always)]
            pub fn set_wr_id(&mut self, id: u64) {
                self.wr_id = id;
            }
        }
    };
}

armed_accessors!(PreparedSend);
armed_accessors!(PreparedRecv);
pub(super) use armed_accessors;

impl PreparedSend {
    /// Asks for a completion of each post (true, the default) or for none on success (see
    /// [`SendWr::unsignaled`]: the next signaled completion of the queue retires it).
    #[inline(always)]
    pub fn set_signaled(&mut self, signaled: bool) {
        self.flags = if signaled { self.flags | SIGNALED_FLAG } else { self.flags & !SIGNALED_FLAG | self.forced };
        self.raw.send_flags = self.flags;
    }
}

#[cold]
pub(super) fn disarmed(op: &str) -> Error {
    Error::InvalidArgument(format!(
        "{op}: the prepared work request holds no region (it is posted: its completion hands the region back)"
    ))
}

#[cold]
pub(super) fn not_armed() -> Error {
    Error::InvalidArgument(
        "post_prepared: the prepared work request holds no region (its last post's completion hands the region back: rearm it)"
            .into(),
    )
}

/// The error of a post that the provider refused: the region, put uncommitted into the queue's
/// slot at `tail` before the call and committed there (`tail` advanced), is taken out again
/// (`tail` put back), and returned into `slot` when the provider named the request (it did not
/// take it).
#[cold]
#[inline(never)]
fn post_refused(
    m: &mut Member,
    ret: i32,
    named: bool,
    wr_id: u64,
    slot: &mut Option<MemoryRegion>,
    send: bool,
) -> Error {
    let op = if send { "ibv_post_send" } else { "ibv_post_recv" };
    let q = if send { &mut m.send } else { &mut m.recv };
    q.tail = q.tail.wrapping_sub(1);
    let Some(mr) = q.unput() else {
        // Never: the post put it there, and nothing took it since.
        debug_assert!(false, "the region a post put at tail is gone");
        return Error::call(op, ret, None);
    };
    match post_failed_one(m, ret, named, (wr_id, mr), send) {
        Ok(()) => Error::call(op, ret, None),
        Err(rejected) => {
            let (error, back) = rejected.into_parts();
            *slot = back;
            error
        }
    }
}

impl Lane {
    /// Checks and lowers `wr` once for `qp` (as [`Lane::post_send`] would before a post:
    /// bounds, access, protection domain, the QP's piece limit, a UD destination and its MTU),
    /// armed with `wr`'s region.
    ///
    /// # Errors
    /// The region comes back with the error [`Lane::post_send`] would give for these checks.
    pub fn prepare_send(
        &mut self,
        qp: LaneQp,
        wr: SendWr,
    ) -> std::result::Result<PreparedSend, Rejected<MemoryRegion>> {
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return Err(Rejected::new(e, wr.mr)),
        };
        let mut sge = [const { MaybeUninit::uninit() }; MAX_SGE];
        // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of those): all-zero
        // is a valid value.
        let mut raw: ffi::ibv_send_wr = unsafe { mem::zeroed() };
        if let Err(e) = wr.lower(m, 0, false, &mut raw, &mut sge) {
            return Err(Rejected::new(e, wr.mr));
        }
        // `lower` pointed the list at the local `sge`: now at the request's own, for good.
        let sge = Sges::new(sge);
        raw.sg_list = sge.as_ptr().cast();
        raw.next = std::ptr::null_mut();
        let flags = wr.flags | m.always_flags | if wr.signaled { SIGNALED_FLAG } else { 0 };
        raw.send_flags = flags;
        let of = wr.mr.inner().serial();
        let bounds = aim::Bounds::of(&wr, m);
        Ok(PreparedSend {
            raw,
            sge,
            of,
            key: qp,
            tag: tag::encode(qp.place, 0, false),
            flags,
            forced: m.always_flags,
            wr_id: wr.wr_id,
            bounds,
            mr: Some(wr.mr),
        })
    }

    /// Checks and lowers the receive `wr` once for `qp`, armed with its region. A prepared
    /// receive names one range: a scattered one ([`RecvWr::scatter`] of several) is refused.
    ///
    /// # Errors
    /// The region comes back with the error [`Lane::post_recv`] would give for these checks,
    /// or [`Error::InvalidArgument`] for a scattered receive (post it with
    /// [`Lane::post_recv`]).
    pub fn prepare_recv(
        &mut self,
        qp: LaneQp,
        wr: RecvWr,
    ) -> std::result::Result<PreparedRecv, Rejected<MemoryRegion>> {
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return Err(Rejected::new(e, wr.mr)),
        };
        let num_sge = match wr.lower_one(m, "prepare_recv") {
            Ok(n) => n,
            Err(e) => return Err(Rejected::new(e, wr.mr)),
        };
        let sge = Sges::new(wr.sge);
        let raw = ffi::ibv_recv_wr { wr_id: 0, next: std::ptr::null_mut(), sg_list: sge.as_ptr(), num_sge };
        let of = wr.mr.inner().serial();
        let tag = tag::encode(qp.place, 0, true);
        Ok(PreparedRecv { raw, sge, of, key: qp, tag, wr_id: wr.wr_id, mr: Some(wr.mr) })
    }

    /// Posts the prepared send-queue work request `p`: its region moves into the lane until
    /// the completion that retires it hands it back (to [`PreparedSend::rearm`] `p` with).
    ///
    /// # Errors
    /// The region stays in `p` when it was not posted: [`Error::InvalidArgument`] when `p` is
    /// not armed or its QP is no longer attached to this lane; [`Error::QueueFull`];
    /// [`Error::QpInError`]; [`Error::Call`] when `ibv_post_send` refuses it (as for
    /// [`Lane::post_send`]: when the provider did not say whether it took it, the region stays
    /// held until the flush retires it).
    #[inline(always)]
    pub fn post_prepared(&mut self, p: &mut PreparedSend) -> Result<()> {
        let m = self.member(p.key)?;
        let free = m.send.free();
        if free <= 1 || m.failed.is_some() {
            // A full queue, a QP in error, or the queue's last free slot (out of line).
            return post_last_slot(m, p, free);
        }
        post_one(m, p)
    }

    /// Posts the prepared receive `p`, as [`Lane::post_prepared`] posts a send.
    ///
    /// # Errors
    /// As for [`Lane::post_prepared`].
    #[inline(always)]
    pub fn post_prepared_recv(&mut self, p: &mut PreparedRecv) -> Result<()> {
        let m = self.member(p.key)?;
        if (m.recv.free() == 0 || m.failed.is_some()) && m.refuses_recv(1) {
            return Err(refusal_recv(m));
        }
        let Some(mr) = p.mr.take() else { return Err(not_armed()) };
        let seq = m.recv.tail;
        p.raw.wr_id = p.tag | seq & tag::SEQ_MASK;
        // Into the slot before the call, committed, as in `post_one`.
        m.recv.put(0, mr, p.wr_id);
        m.recv.tail = seq.wrapping_add(1);
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in `post_one`: the QP is alive; `p.raw` is one NULL-terminated receive
        // over `p.sge` (its `sg_list`, set when it was prepared), checked by `prepare_recv`
        // for this QP against the region now in the slot (bounds, PD, LOCAL_WRITE).
        let ret = unsafe { m.provider_post_recv(&mut p.raw, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        let named = std::ptr::eq(bad, &p.raw);
        Err(post_refused(m, ret, named, p.wr_id, &mut p.mr, false))
    }

    /// Posts the prepared send-queue work requests `ps` (all armed, all for one QP) in one
    /// `ibv_post_send`: one doorbell. Their regions move into the lane, in order. Returns how
    /// many were posted: all of them.
    ///
    /// # Errors
    /// Nothing is posted, and every region stays where it was, when the first request's QP is
    /// not attached, when they do not fit in the queue's free slots, when the QP is in the
    /// error state (these three are checked first, in this order), or when one of `ps` is not
    /// armed or is for another QP. When the provider refuses part of the list, the requests
    /// before the one it named are posted (their requests are disarmed: see
    /// [`PreparedSend::is_armed`]), and that one and those after it keep their regions.
    pub fn post_prepared_list(&mut self, ps: &mut [PreparedSend]) -> Result<usize> {
        let Some(first) = ps.first() else { return Ok(0) };
        let key = first.key;
        let m = self.member(key)?;
        // More than u32::MAX requests cannot fit a queue either: refused as too many.
        let count = u32::try_from(ps.len()).unwrap_or(u32::MAX);
        let free = m.send.free();
        if count > free || m.failed.is_some() {
            return Err(refusal(m, "ibv_post_send"));
        }
        let tail = m.send.tail;
        let (base, len) = (ps.as_mut_ptr(), ps.len());
        // One pass: each request is checked, linked, and its region put into its slot,
        // uncommitted (as in `post_prepared`); a request that fails its check sends the regions
        // moved so far back, before anything is posted.
        for k in 0..len {
            // SAFETY: k < len, and k + 1 < len where the link is taken: both within `ps`, which
            // outlives the call below and is not moved (borrowed mutably here). Raw pointers,
            // since one element's request links to the next's.
            let (p, next) = unsafe {
                (
                    &mut *base.add(k),
                    if k + 1 < len { std::ptr::addr_of_mut!((*base.add(k + 1)).raw) } else { std::ptr::null_mut() },
                )
            };
            let k = k as u32;
            let mr = match p.mr.take() {
                Some(mr) if p.key == key => mr,
                taken => {
                    p.mr = taken;
                    let error = if p.key != key { other_qp() } else { not_armed() };
                    return Err(unstage_list(m, ps, k, error));
                }
            };
            m.send.put(k, mr, p.wr_id);
            p.raw.wr_id = tag::encode(key.place, tail.wrapping_add(k as u64), false);
            if k + 1 == free {
                // The one that takes the last free slot is signaled, so a full queue drains
                // (its flags are put back below).
                p.raw.send_flags = p.flags | SIGNALED_FLAG;
            }
            p.raw.next = next;
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; the list is ps[0].raw → … → ps[count-1].raw (NULL-terminated),
        // each over its own `sge`, all alive for the call, each lowered for this QP against its
        // own armed region (as in `post_prepared`), which now sits in its slot, out of reach.
        let ret = unsafe { m.provider_post_send(&mut (*base).raw, &mut bad) };
        // The requests as they were before the post: unlinked, their own flags.
        for p in ps.iter_mut() {
            p.raw.next = std::ptr::null_mut();
            p.raw.send_flags = p.flags;
        }
        if ret == 0 {
            m.send.commit(count);
            return Ok(count as usize);
        }
        Err(list_refused(m, ps, ret, bad))
    }
}

/// The refusal of a list whose entry `k` is for another QP or not armed: the regions of
/// entries `..k`, put into slots uncommitted, go back into their requests, which are unlinked.
#[cold]
#[inline(never)]
fn unstage_list(m: &mut Member, ps: &mut [PreparedSend], k: u32, error: Error) -> Error {
    for (j, p) in ps.iter_mut().take(k as usize).enumerate() {
        p.mr = m.send.unput_at(j as u32);
        p.raw.next = std::ptr::null_mut();
        p.raw.send_flags = p.flags;
    }
    error
}

/// Posts the prepared `p` on `m`'s send queue, which has a free slot and is not in error: its
/// region moves into the slot at `tail`.
#[inline(always)]
fn post_one(m: &mut Member, p: &mut PreparedSend) -> Result<()> {
    let Some(mr) = p.mr.take() else { return Err(not_armed()) };
    let seq = m.send.tail;
    p.raw.wr_id = p.tag | seq & tag::SEQ_MASK;
    // The region goes into the slot at `tail` before the call, and the slot is committed:
    // then nothing but `m` and `p` is held across the call. When the provider did not take
    // the request, the slot is emptied again (`post_refused`).
    m.send.put(0, mr, p.wr_id);
    m.send.tail = seq.wrapping_add(1);
    let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
    // SAFETY: the QP is alive (its owner is in `m`, which `p.key` named: its attach number,
    // never reused, names one QP of one lane). `p.raw` is one NULL-terminated work
    // request (a list post unlinks its requests before it returns) over `p.sge` (its
    // `sg_list`, set when it was prepared; the allocation lives as long as `p`), lowered by
    // `prepare_send` for this very QP against the region now in the slot, which `rearm` made
    // sure is the one it was checked against; a UD destination's address handle is kept by
    // `m`. The region is out of Rust's reach in the slot until a completion retires it.
    let ret = unsafe { m.provider_post_send(&mut p.raw, &mut bad) };
    if ret == 0 {
        return Ok(());
    }
    let named = std::ptr::eq(bad, &p.raw);
    Err(post_refused(m, ret, named, p.wr_id, &mut p.mr, true))
}

/// The rest of `post_prepared`, out of line: the refusal of a post to a full queue or a QP in
/// error, or a post into the queue's last free slot, which asks for a completion whatever `p`
/// asks for, so a full queue drains.
#[cold]
#[inline(never)]
fn post_last_slot(m: &mut Member, p: &mut PreparedSend, free: u32) -> Result<()> {
    if free == 0 || m.failed.is_some() {
        return Err(refusal(m, "ibv_post_send"));
    }
    p.raw.send_flags = p.flags | SIGNALED_FLAG;
    let r = post_one(m, p);
    p.raw.send_flags = p.flags;
    r
}

/// A list the provider refused: the entries before the one it named are posted (committed);
/// that one and those after it take their regions back. When it named none, every region is
/// kept as posted, and the QP is moved to the error state (`post_list_failed`).
#[cold]
#[inline(never)]
fn list_refused(m: &mut Member, ps: &mut [PreparedSend], ret: i32, bad: *mut ffi::ibv_send_wr) -> Error {
    let count = ps.len() as u32;
    // `bad` is NULL or one of the list's entries: only its address is compared.
    let posted = ps.iter().position(|p| std::ptr::eq(bad, &p.raw)).map_or(count, |i| i as u32);
    for (j, p) in ps.iter_mut().enumerate().skip(posted as usize) {
        p.mr = m.send.unput_at(j as u32);
    }
    m.send.commit(posted);
    post_list_failed(m, ret, posted < count, "ibv_post_send")
}

#[cold]
fn other_qp() -> Error {
    Error::InvalidArgument("post_prepared_list: every work request of a list must be prepared for one QP".into())
}
