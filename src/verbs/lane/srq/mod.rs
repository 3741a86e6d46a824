//! Shared receive queues on the lane: [`Lane::create_srq`] makes one, owned by the lane;
//! QPs made with [`Lane::srq_qp_init`] take their receives from it, many QPs one SRQ; a
//! receive goes in with [`Lane::post_srq_recv`] (its region moved into the lane, as for
//! [`Lane::post_recv`]), and the completion that retires it hands the region back, saying
//! which QP the message arrived on ([`Wc::qp`], [`Wc::qp_num`]) and that it was the SRQ's
//! ([`Wc::is_srq`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{Lane, RecvWr};
//! use rdma_cm::{AccessFlags, ConnParam, MemoryRegion, ProtectionDomain, QpInit, Server};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let listener = Server::new()?.bind("10.77.0.1:7471".parse().unwrap())?.listen(8)?;
//! let ctx = listener.context()?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let mut lane = Lane::new(&ctx, 256)?;
//! let srq = lane.create_srq(&pd, 128)?;
//! for k in 0..128 {
//!     let buf = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//!     lane.post_srq_recv(srq, RecvWr::new(buf).wr_id(k))?;
//! }
//! loop {
//!     let init = lane.srq_qp_init(srq, QpInit::new().max_send_wr(16))?;
//!     let server = listener.get_request(t)?.lane_qp(&mut lane, &pd, init)?;
//!     server.accept(&mut lane, &ConnParam::new(), t)?;
//!     let mut c = lane.wait(t)?.ok()?;       // a message, from whichever client sent it
//!     let (from, buf) = (c.qp(), c.take_region().unwrap());
//!     lane.post_srq_recv(srq, RecvWr::new(buf).wr_id(c.wr_id()))?; // back into the pool
//! #   let _ = from;
//! }
//! # }
//! ```
//!
//! A receive's region moved into the lane; reading it while the SRQ holds it does not compile:
//!
//! ```compile_fail,E0382
//! # fn f(lane: &mut rdma_cm::verbs::lane::Lane, srq: rdma_cm::verbs::lane::LaneSrq, mr: rdma_cm::MemoryRegion) {
//! lane.post_srq_recv(srq, rdma_cm::verbs::lane::RecvWr::new(mr)).unwrap();
//! let bytes = mr.as_slice(); // the device may be writing it: error[E0382], use of moved value
//! # }
//! ```
//!
//! # Why the lane owns the SRQ
//!
//! The lane's ownership model is what makes its path fast and sound without locks: one thread
//! owns the CQ, the QPs and the slots that hold the regions the device may write. An SRQ feeds
//! the QPs of one lane and completes on that lane's CQ, so its slots belong in the lane too:
//! posting a receive to it is `&mut Lane`, no mutex and no reference count, and the
//! completion that retires a receive is read by the same thread that posted it. Attaching an
//! existing [`SharedReceiveQueue`] instead would leave its handle with the caller, who could
//! post through it from any thread; the lane would then share the queue with a second slot
//! table behind a lock. So [`Lane::create_srq`] makes the SRQ (a [`SharedReceiveQueue`] under
//! the hood, for its creation, its lifetime and its async events) and hands out only a
//! [`LaneSrq`], a copyable handle that this lane alone accepts.
//!
//! # Tags and slots
//!
//! An SRQ's receive tags have both `RECV` and `INTERIOR` set (bits 63 and 61), which no other
//! tag of the lane has (an interior tag is a send's), the SRQ's index in the lane in bits
//! 60..45, and a 45-bit sequence number below: the SRQ's count of postings, one per receive,
//! never reset. Its receives complete in any order (on whichever QP takes each, and flushed
//! QPs' ones late), so the slots are not a ring of the outstanding window: the table has twice
//! (at least) as many slots as the SRQ is deep, and receive number `seq` sits in slot
//! `seq mod len`; a post skips over the slots still held (when receives complete in the order
//! they were posted, which is how the devices consume an SRQ, none is), so it always finds one
//! within `depth` steps. A completion retires a slot only when the slot holds a receive and
//! that receive's sequence number is the one the tag names, all 45 bits: a completion handed
//! out twice, or one of an earlier posting of the slot, names a number the slot no longer
//! holds, and retires nothing. Every tag an SRQ posts is new until 2^45 postings of that SRQ,
//! as for a QP's queues. SRQ indices are never reused in a lane, so a completion of an SRQ
//! that is gone matches none.
//!
//! The poll finds an SRQ's completion by the tag's high bits, on the branch where the tag
//! matched no QP's queue: a post or poll of a QP's own queues runs no extra instruction.
//!
//! # Which QP
//!
//! A completion's QP number says which QP took the receive; the lane keeps a map from QP
//! number to [`LaneQp`] of the QPs on its SRQs, filled at attach and emptied at
//! [`Lane::remove`]. A completion whose QP has left the lane (it was removed while it held a
//! receive it had taken) still retires its slot and hands the region back; it names no
//! [`LaneQp`] then ([`Wc::qp`] is `None`, [`Wc::qp_num`] says the number).
//!
//! # Teardown
//!
//! Removing or dropping a QP leaves the SRQ's receives where they are: in the SRQ, where the
//! device may still hand them to another QP, so their regions stay in the lane's slots. A
//! receive the QP had taken comes back as its completion (flushed when the QP is moved to the
//! error state); [`Lane::remove`] keeps such completions, met while it reaps the QP's own
//! work, for the next poll. Dropping the lane destroys its QPs first, then hands the regions
//! still in an SRQ's slots to the SRQ's own table, which releases them only after
//! `ibv_destroy_srq` succeeds (the SRQ is destroyed once its last QP and the lane's CQ are
//! gone), and leaks them when it fails: the device can never write memory Rust code can
//! reach.
//!
//! # The limit event
//!
//! [`Lane::srq_arm_limit`] asks for `IBV_EVENT_SRQ_LIMIT_REACHED` when fewer than a number of
//! receives remain posted; [`Lane::srq_limit_reached`] says whether it came. The device's async
//! events are read by the context's registry, as for [`SharedReceiveQueue::arm_limit`].
//!
//! # Limits
//!
//! A receive names pieces of one region ([`RecvWr`]): one, or up to the SRQ's `max_sge`
//! scattered ones ([`RecvWr::scatter`], on an SRQ made with [`Lane::create_srq_with_sge`];
//! [`Lane::post_srq_recv_list`] takes receives of one piece only). There is no prepared
//! receive ([`Lane::prepare_recv`](super::Lane::prepare_recv) is per QP). An SRQ serving UD QPs
//! needs receives whose first piece has room for the GRH ([`GRH_LEN`](crate::verbs::ah::GRH_LEN)
//! bytes): the lane cannot check it at the post, since it does not know which QP will take the
//! receive. An SRQ stays for the lane's life.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::mem::{self, MaybeUninit};
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::completion::{Fields, RECV, SIGNALED, SRQ};
use super::refused::{one_piece_only, too_many_recv_pieces};
use super::wr::{piece, Defect};
use super::{tag, Fault, Lane, LaneQp, RecvWr, Rejected, Wc, MAX_LIST, NEXT_ATTACH};
use crate::error::{Error, Result};
use crate::verbs::mr::{AccessFlags, MemoryRegion};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::{QpInit, QueuePair};
use crate::verbs::srq::SharedReceiveQueue;
use crate::verbs::wr::rejected_from;

/// The bits an SRQ receive's tag has set above its index: `RECV` and `INTERIOR`.
pub(super) const SRQ_TAG: u64 = tag::RECV | tag::INTERIOR;

/// Whether `wr_id` is an SRQ receive's tag (`SRQ_TAG`, and not a foreign one's).
#[inline(always)]
pub(super) fn is_srq(wr_id: u64) -> bool {
    wr_id & (SRQ_TAG | tag::FOREIGN) == SRQ_TAG
}

/// The provider's `post_srq_recv`.
type PostSrqRecv = unsafe extern "C" fn(*mut ffi::ibv_srq, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> c_int;

/// A shared receive queue owned by a lane ([`Lane::create_srq`]): its index there and a number
/// drawn from the process-wide count of attaches, never reused, so no other lane (and no other
/// SRQ) accepts it. Cheap to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaneSrq {
    index: u16,
    id: u64,
}

/// One slot: a receive's region (`R`: a [`MemoryRegion`], but for the unit tests), its
/// `wr_id`, and its sequence number (whole).
struct Slot<R> {
    mr: Option<R>,
    wr_id: u64,
    seq: u64,
}

/// The slots of an SRQ's receives: receive number `seq` in slot `seq mod len`, `len` a power
/// of two at least twice the depth (see the module docs).
struct Table<R> {
    slots: Box<[Slot<R>]>,
    mask: u64,
    depth: u32,
    outstanding: u32,
    /// The sequence number the next receive may take (a post skips held slots from here).
    next: u64,
}

impl<R> Table<R> {
    fn new(depth: u32, start: u64) -> Table<R> {
        let len = (depth.max(1) as usize).next_power_of_two() * 2;
        Table {
            slots: (0..len).map(|_| Slot { mr: None, wr_id: 0, seq: 0 }).collect(),
            mask: len as u64 - 1,
            depth,
            outstanding: 0,
            next: start,
        }
    }

    #[inline(always)]
    fn slot(&mut self, seq: u64) -> &mut Slot<R> {
        let i = (seq & self.mask) as usize;
        debug_assert!(i < self.slots.len());
        // SAFETY: `slots.len()` is `mask + 1` (`Table::new`), so `i`, masked, is in bounds.
        unsafe { self.slots.get_unchecked_mut(i) }
    }

    /// The first sequence number from `from` on whose slot is free. At most `depth` slots are
    /// held and the table has at least twice as many, so it is found within `depth` steps.
    #[inline(always)]
    fn free_from(&mut self, mut from: u64) -> u64 {
        while self.slot(from).mr.is_some() {
            from = from.wrapping_add(1);
        }
        from
    }

    /// Puts a receive's region into the (free) slot of `seq`.
    #[inline(always)]
    fn put(&mut self, seq: u64, mr: R, wr_id: u64) {
        let slot = self.slot(seq);
        debug_assert!(slot.mr.is_none());
        slot.mr = Some(mr);
        slot.wr_id = wr_id;
        slot.seq = seq;
        self.outstanding += 1;
    }

    /// Retires the receive whose tag carries `seq` (its low 45 bits), if that exact receive is
    /// held: its region and `wr_id`. Anything else (a slot empty, or holding another posting)
    /// retires nothing.
    #[inline(always)]
    fn retire(&mut self, seq: u64) -> Option<(R, u64)> {
        let s = self.slot(seq);
        if (s.seq ^ seq) & tag::SEQ_MASK != 0 {
            return None;
        }
        let mr = s.mr.take()?;
        let wr_id = s.wr_id;
        self.outstanding -= 1;
        Some((mr, wr_id))
    }

    /// Takes back the region put for `seq` (the provider did not take its receive).
    #[cold]
    fn unput(&mut self, seq: u64) -> Option<R> {
        let mr = self.slot(seq).mr.take()?;
        self.outstanding -= 1;
        Some(mr)
    }
}

/// An SRQ of the lane: the SRQ, the provider's post function for it, and its slots.
struct State {
    key: LaneSrq,
    raw: NonNull<ffi::ibv_srq>,
    post: PostSrqRecv,
    pd: Arc<ProtectionDomain>,
    /// The most pieces a receive may name (the SRQ's `max_sge`, as granted).
    max_sge: u32,
    /// `SRQ_TAG` and the index, in a tag's bits 63..45.
    tag_hi: u64,
    t: Table<MemoryRegion>,
    /// QPs attached to the lane that take their receives from it.
    users: u32,
    /// Kept last: its QPs hold it too, and the SRQ is destroyed with the last of them (Drop).
    srq: SharedReceiveQueue,
}

impl State {
    /// Why `wr` cannot be posted to this SRQ, if it cannot (the checks, in order, of
    /// `RecvWr::check`, with the SRQ's protection domain and `max_sge`); else its scatter
    /// count.
    #[inline(always)]
    fn check(&self, wr: &RecvWr) -> std::result::Result<i32, Refusal> {
        if !wr.mr.access().contains(AccessFlags::LOCAL_WRITE) {
            return Err(Refusal::Defect(Defect::NeedsLocalWrite));
        }
        let size = wr.mr.len() as u64;
        match piece(&wr.range) {
            Err(why) => return Err(Refusal::Defect(Defect::Bad(why))),
            Ok((start, len)) if start + len as u64 > size => {
                return Err(Refusal::Defect(Defect::OutOfRegion { offset: start, len, size }))
            }
            Ok(_) => {}
        }
        if let Some(d) = wr.rest {
            return Err(Refusal::Defect(d));
        }
        if !wr.mr.inner().on_pd(&self.pd) {
            return Err(Refusal::OtherPd);
        }
        if wr.n > 1 {
            let n = wr.n as u32;
            if n > self.max_sge {
                return Err(Refusal::TooManyPieces { n, max: self.max_sge });
            }
            return Ok(n as i32);
        }
        Ok((wr.sge.length != 0) as i32)
    }
}

impl Drop for State {
    /// Hands the regions still held to the SRQ, released once `ibv_destroy_srq`
    /// succeeds (leaked when it fails): until then the device may write them.
    fn drop(&mut self) {
        for s in self.t.slots.iter_mut() {
            if let Some(mr) = s.mr.take() {
                self.srq.park(mr);
            }
        }
    }
}

/// A hasher for QP numbers: one multiplication (the numbers are not chosen by a peer).
#[derive(Default)]
pub(super) struct QpnHasher(u64);

impl Hasher for QpnHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ *b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = (n as u64 ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The lane's SRQs, and which of its QPs take receives from them.
#[derive(Default)]
pub(super) struct Srqs {
    /// By index; an index is never reused.
    list: Vec<Option<Box<State>>>,
    /// QP number → the attached QP of that number on one of the SRQs.
    by_qpn: HashMap<u32, LaneQp, BuildHasherDefault<QpnHasher>>,
}

impl Srqs {
    #[inline(always)]
    fn get_mut(&mut self, srq: LaneSrq) -> Option<&mut State> {
        match self.list.get_mut(srq.index as usize) {
            Some(Some(s)) if s.key.id == srq.id => Some(s),
            _ => None,
        }
    }

    /// The index of this lane's SRQ that `qp` takes its receives from: `None` for a QP without
    /// an SRQ, `Some(Err)` for one on an SRQ that is not this lane's.
    pub(super) fn of(&self, qp: &QueuePair) -> Option<std::result::Result<u16, ()>> {
        let srq = qp.srq()?;
        let found = self.list.iter().flatten().find(|s| s.raw.as_ptr() == srq.as_raw());
        Some(found.map(|s| s.key.index).ok_or(()))
    }

    /// Whether no SRQ holds a receive.
    pub(super) fn idle(&self) -> bool {
        self.list.iter().flatten().all(|s| s.t.outstanding == 0)
    }

    /// Notes that `qp` (QP number `qp_num`) takes its receives from SRQ `index`.
    pub(super) fn joined(&mut self, index: u16, qp_num: u32, qp: LaneQp) {
        if let Some(Some(s)) = self.list.get_mut(index as usize) {
            s.users += 1;
        }
        self.by_qpn.insert(qp_num, qp);
    }

    /// Notes that `qp` (QP number `qp_num`) left the lane.
    pub(super) fn left(&mut self, qp_num: u32, qp: LaneQp, on: &QueuePair) {
        if self.by_qpn.get(&qp_num) == Some(&qp) {
            self.by_qpn.remove(&qp_num);
        }
        if let Some(Ok(index)) = self.of(on) {
            if let Some(Some(s)) = self.list.get_mut(index as usize) {
                s.users = s.users.saturating_sub(1);
            }
        }
    }
}

/// Why a receive is refused before it reaches the provider.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    Defect(Defect),
    OtherPd,
    TooManyPieces { n: u32, max: u32 },
}

impl Refusal {
    #[cold]
    #[inline(never)]
    fn error(self) -> Error {
        match self {
            Refusal::Defect(d) => d.error("post_srq_recv"),
            Refusal::OtherPd => Error::InvalidArgument(
                "post_srq_recv: the memory region is registered on another protection domain than the SRQ \
                 (Lane::create_srq's)"
                    .into(),
            ),
            Refusal::TooManyPieces { n, max } => too_many_recv_pieces(n, max, true),
        }
    }

    #[cold]
    #[inline(never)]
    fn rejected(self, mr: MemoryRegion) -> Rejected<MemoryRegion> {
        Rejected::new(self.error(), mr)
    }
}

#[cold]
fn unknown_srq() -> Error {
    Error::InvalidArgument("this LaneSrq is not one of this lane's (Lane::create_srq of another lane)".into())
}

#[cold]
#[inline(never)]
fn unknown_srq_back(mr: MemoryRegion) -> Rejected<MemoryRegion> {
    Rejected::new(unknown_srq(), mr)
}

#[cold]
#[inline(never)]
fn full_back(depth: u32, mr: MemoryRegion) -> Rejected<MemoryRegion> {
    Rejected::new(Error::QueueFull { queue: "shared receive", depth }, mr)
}

#[cold]
fn too_many(count: u32, outstanding: u32, depth: u32) -> Error {
    Error::InvalidArgument(format!(
        "post_srq_recv_list of {count} receives: the SRQ holds {outstanding} of its {depth}, room for {}: poll \
         completions first",
        depth - outstanding
    ))
}

/// The error of a post the provider refused; `kept` when it did not say which receives it took
/// (they stay in their slots until their completions come or the SRQ is destroyed).
#[cold]
fn post_failed(ret: i32, kept: bool) -> Error {
    if !kept {
        return Error::call("ibv_post_srq_recv", ret, None);
    }
    Error::Call {
        op: "ibv_post_srq_recv",
        addr: None,
        hint: Some(
            "the provider failed the post without saying which receives it took: they stay held until their \
             completions come or the SRQ is destroyed",
        ),
        source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
    }
}

impl Lane {
    /// Creates a shared receive queue of `depth` receives (at most 65536) on `pd`, owned by
    /// the lane: QPs made with [`Lane::srq_qp_init`] take their receives from it, posted with
    /// [`Lane::post_srq_recv`]. The lane's CQ is grown to hold `depth` more completions (as
    /// [`Lane::attach`] grows it) where the device can resize a CQ. See the
    /// [module docs](self).
    ///
    /// # Errors
    /// As for [`SharedReceiveQueue::new`]; [`Error::InvalidArgument`] when the CQ has no room
    /// for `depth` more completions and cannot grow, or the lane already made 65536 SRQs.
    pub fn create_srq(&mut self, pd: &Arc<ProtectionDomain>, depth: u32) -> Result<LaneSrq> {
        self.create_srq_with_sge(pd, depth, 1)
    }

    /// [`Lane::create_srq`] of an SRQ whose receives may name up to `max_sge` pieces each
    /// (scattered receives, [`RecvWr::scatter`]), as [`SharedReceiveQueue::with_sge`] makes
    /// it.
    ///
    /// # Errors
    /// As for [`Lane::create_srq`] and [`SharedReceiveQueue::with_sge`] (`max_sge` outside 1
    /// to [`MAX_SGE`](crate::MAX_SGE) or beyond the device's `max_srq_sge`).
    pub fn create_srq_with_sge(&mut self, pd: &Arc<ProtectionDomain>, depth: u32, max_sge: u32) -> Result<LaneSrq> {
        if self.srqs.list.len() > u16::MAX as usize {
            return Err(Error::InvalidArgument("create_srq: a lane makes at most 65536 SRQs".into()));
        }
        let srq = SharedReceiveQueue::with_sge(pd, depth, max_sge)?;
        let raw = NonNull::new(srq.as_raw())
            .ok_or_else(|| Error::InvalidArgument("create_srq: SRQ without a handle".into()))?;
        // SAFETY: the SRQ is alive (held by `srq`, kept in the state), and so is its context,
        // whose table libibverbs filled before handing it out; the entry is not written again
        // while it is open (see `ops`).
        let post = unsafe { (*(*raw.as_ptr()).context).ops.post_srq_recv }
            .ok_or_else(|| Error::InvalidArgument("the provider's context has no post_srq_recv".into()))?;
        // Room on the CQ for every receive of the SRQ: counted while the lane grows the CQ,
        // then held by the SRQ's registration on it, which the lane keeps as long as the CQ
        // (so the QPs on it, joining and leaving, never find it the last one).
        self.cq.reserve(depth as u64)?;
        let room = self.make_room();
        self.cq.unreserve(depth as u64);
        room?;
        self.cq.attach_srq(srq.shared())?;
        let index = self.srqs.list.len() as u16;
        let key = LaneSrq { index, id: NEXT_ATTACH.fetch_add(1, std::sync::atomic::Ordering::Relaxed) };
        let state = State {
            key,
            raw,
            post,
            pd: Arc::clone(pd),
            max_sge: srq.max_sge(),
            tag_hi: SRQ_TAG | (index as u64) << tag::SHIFT,
            t: Table::new(depth, 0),
            users: 0,
            srq,
        };
        self.srqs.list.push(Some(Box::new(state)));
        Ok(key)
    }

    /// `init` with the lane's CQ as both CQs and `srq` as the QP's receive queue: create the
    /// QP with it (for a connection: [`RouteResolved::lane_qp`](crate::RouteResolved::lane_qp),
    /// [`ConnectRequest::lane_qp`](crate::ConnectRequest::lane_qp); for UD: the UD CM's
    /// `create_qp`, then [`Lane::attach`]). `init`'s receive capabilities are ignored.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an SRQ that is not this lane's.
    pub fn srq_qp_init(&mut self, srq: LaneSrq, init: QpInit) -> Result<QpInit> {
        let handle = self.srqs.get_mut(srq).ok_or_else(unknown_srq)?.srq.clone();
        let mut init = self.qp_init_from(init);
        init.srq = Some(handle);
        Ok(init)
    }

    /// The raw SRQ, for what the lane does not wrap (queries). It stays owned by the lane.
    /// Posting on it directly (an `unsafe` call) is outside what the lane tracks: such a
    /// receive completes on the lane's CQ, where its `wr_id` is read as a lane's tag.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an SRQ that is not this lane's.
    pub fn srq_as_raw(&mut self, srq: LaneSrq) -> Result<*mut ffi::ibv_srq> {
        Ok(self.srqs.get_mut(srq).ok_or_else(unknown_srq)?.raw.as_ptr())
    }

    /// Receives posted to `srq` and not yet retired.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an SRQ that is not this lane's.
    pub fn srq_outstanding(&mut self, srq: LaneSrq) -> Result<usize> {
        Ok(self.srqs.get_mut(srq).ok_or_else(unknown_srq)?.t.outstanding as usize)
    }

    /// How many receives `srq` holds ([`Lane::create_srq`]'s depth).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an SRQ that is not this lane's.
    pub fn srq_depth(&mut self, srq: LaneSrq) -> Result<u32> {
        Ok(self.srqs.get_mut(srq).ok_or_else(unknown_srq)?.t.depth)
    }

    /// QPs attached to the lane that take their receives from `srq`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an SRQ that is not this lane's.
    pub fn srq_users(&mut self, srq: LaneSrq) -> Result<u32> {
        Ok(self.srqs.get_mut(srq).ok_or_else(unknown_srq)?.users)
    }

    /// Asks for the SRQ's limit event when fewer than `limit` receives remain posted (0
    /// disarms), as [`SharedReceiveQueue::arm_limit`] does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an SRQ that is not this lane's; as for
    /// [`SharedReceiveQueue::arm_limit`].
    pub fn srq_arm_limit(&mut self, srq: LaneSrq, limit: u32) -> Result<()> {
        self.srqs.get_mut(srq).ok_or_else(unknown_srq)?.srq.arm_limit(limit)
    }

    /// Whether the limit event came since [`Lane::srq_arm_limit`] armed it, as
    /// [`SharedReceiveQueue::limit_reached`] says.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an SRQ that is not this lane's; as for
    /// [`SharedReceiveQueue::limit_reached`].
    pub fn srq_limit_reached(&mut self, srq: LaneSrq) -> Result<bool> {
        self.srqs.get_mut(srq).ok_or_else(unknown_srq)?.srq.limit_reached()
    }

    /// Posts one receive to `srq`: whichever QP on it a message arrives on takes it. Its region
    /// moves into the lane until the completion that retires it hands it back.
    ///
    /// # Errors
    /// The region comes back with the error when it was not posted: [`Error::QueueFull`] when
    /// the SRQ holds `depth` receives; [`Error::OutOfBounds`] for a range outside the region;
    /// [`Error::InvalidArgument`] for a region without `LOCAL_WRITE`, one registered on
    /// another protection domain than the SRQ, an SRQ that is not this lane's, or a scattered
    /// receive ([`RecvWr::scatter`]) of more pieces than the SRQ takes
    /// ([`Lane::create_srq_with_sge`]) or of an empty one;
    /// [`Error::Call`] when `ibv_post_srq_recv` refuses it (without the region when the
    /// provider did not say whether it took it: it stays held until its completion comes or
    /// the SRQ is destroyed).
    #[inline(always)]
    pub fn post_srq_recv(&mut self, srq: LaneSrq, wr: RecvWr) -> std::result::Result<(), Rejected<MemoryRegion>> {
        // Without drop glue until its region is taken out, as in `post_recv`.
        let wr = mem::ManuallyDrop::new(wr);
        let Some(s) = self.srqs.get_mut(srq) else {
            return Err(unknown_srq_back(mem::ManuallyDrop::into_inner(wr).mr));
        };
        if s.t.outstanding >= s.t.depth {
            return Err(full_back(s.t.depth, mem::ManuallyDrop::into_inner(wr).mr));
        }
        let num_sge = match s.check(&wr) {
            Ok(n) => n,
            Err(r) => return Err(r.rejected(mem::ManuallyDrop::into_inner(wr).mr)),
        };
        // Its scatter list: the first piece, and the others only for a scattered receive.
        let mut sge = wr.sges();
        let RecvWr { mr, wr_id, .. } = mem::ManuallyDrop::into_inner(wr);
        let seq = s.t.free_from(s.t.next);
        let mut raw = ffi::ibv_recv_wr {
            wr_id: s.tag_hi | seq & tag::SEQ_MASK,
            next: std::ptr::null_mut(),
            sg_list: sge.as_mut_ptr().cast(),
            num_sge,
        };
        // Into the (free) slot before the call, as on a QP: nothing but `s` is held across it.
        s.t.put(seq, mr, wr_id);
        s.t.next = seq.wrapping_add(1);
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the SRQ is alive (held by `s.srq`); `post` is its context's own
        // `post_srq_recv`; `raw` is one NULL-terminated receive over `sge`, alive for the
        // call, whose first `num_sge` entries are written (`check` found no defect, so
        // `scatter` wrote every piece); each piece was checked (bounds, LOCAL_WRITE, the SRQ's
        // PD and `max_sge`), and the region sits in the slot, out of Rust's reach until the
        // completion that names this posting.
        let ret = unsafe { (s.post)(s.raw.as_ptr(), &mut raw, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        Err(refused_one(s, seq, ret, std::ptr::eq(bad, &raw)))
    }

    /// Posts up to [`MAX_LIST`] receives to `srq` in one `ibv_post_srq_recv`: every `Some`
    /// entry of `wrs`, in order. Posted entries become `None` (their regions are in the lane);
    /// entries not posted stay where they were. Returns how many were posted.
    ///
    /// # Errors
    /// As for [`Lane::post_srq_recv`], checked for every entry before anything is posted;
    /// [`Error::InvalidArgument`] for more than [`MAX_LIST`] entries, more than the SRQ has
    /// room for (the message says how many it holds), or a scattered receive (post it with
    /// [`Lane::post_srq_recv`]). When the provider refuses part of the
    /// list, the entries before the one it names are posted (and `None`).
    pub fn post_srq_recv_list(&mut self, srq: LaneSrq, wrs: &mut [Option<RecvWr>]) -> Result<usize> {
        if wrs.len() > MAX_LIST {
            return Err(Error::InvalidArgument(format!(
                "post_srq_recv_list of {} receives: at most {MAX_LIST}",
                wrs.len()
            )));
        }
        let s = self.srqs.get_mut(srq).ok_or_else(unknown_srq)?;
        let count = wrs.iter().filter(|w| w.is_some()).count() as u32;
        if count == 0 {
            return Ok(0);
        }
        if count > s.t.depth - s.t.outstanding {
            return Err(too_many(count, s.t.outstanding, s.t.depth));
        }
        let mut raw: [MaybeUninit<ffi::ibv_recv_wr>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let mut sge: [MaybeUninit<ffi::ibv_sge>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let mut seqs = [0u64; MAX_LIST];
        let base: *mut ffi::ibv_recv_wr = raw.as_mut_ptr().cast();
        // The sequence numbers each takes: free slots from `next` on, distinct (at most
        // `depth` numbers are looked at, fewer than the table's slots).
        let mut seq = s.t.next;
        for (k, w) in wrs.iter().flatten().enumerate() {
            if w.n > 1 {
                return Err(one_piece_only("post_srq_recv_list"));
            }
            if let Err(r) = s.check(w) {
                return Err(r.error());
            }
            seq = s.t.free_from(seq);
            seqs[k] = seq;
            sge[k].write(w.sge);
            let next = if (k as u32) + 1 < count {
                // SAFETY: k + 1 < count <= MAX_LIST: within `raw`.
                unsafe { base.add(k + 1) }
            } else {
                std::ptr::null_mut()
            };
            let entry = ffi::ibv_recv_wr {
                wr_id: s.tag_hi | seq & tag::SEQ_MASK,
                next,
                sg_list: sge[k].as_mut_ptr(),
                num_sge: (w.sge.length != 0) as i32,
            };
            // SAFETY: k < count <= MAX_LIST: within `raw`.
            unsafe { base.add(k).write(entry) };
            seq = seq.wrapping_add(1);
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the SRQ is alive; raw[..count] is an initialised NULL-terminated list over
        // `sge`, alive for the call; every piece was checked, and every region moves into its
        // slot below, before anything can reach it.
        let ret = unsafe { (s.post)(s.raw.as_ptr(), base, &mut bad) };
        let named = if ret == 0 { None } else { rejected_from(bad, base, count as usize) };
        let posted = if ret == 0 { count } else { named.map_or(count, |p| p as u32) };
        let mut k = 0;
        for w in wrs.iter_mut() {
            if k == posted as usize {
                break;
            }
            if let Some(w) = w.take() {
                s.t.put(seqs[k], w.mr, w.wr_id);
                k += 1;
            }
        }
        if posted > 0 {
            s.t.next = seqs[posted as usize - 1].wrapping_add(1);
        }
        if ret == 0 {
            return Ok(posted as usize);
        }
        Err(post_failed(ret, named.is_none()))
    }

    /// Hands `f` the completion at `wcs[i]`, an SRQ receive's: true when it retired its slot
    /// (false for a stale one, or one of an SRQ the lane no longer has). `f` by value and
    /// handed back, as for the poll's other out-of-line cases.
    #[inline(never)]
    pub(super) fn srq_with<G: FnMut(Wc, Option<MemoryRegion>)>(&mut self, i: u8, mut f: G) -> (bool, G) {
        let handed = self.srq_in(i, &mut f);
        (handed, f)
    }

    #[inline(always)]
    fn srq_in(&mut self, i: u8, f: &mut impl FnMut(Wc, Option<MemoryRegion>)) -> bool {
        // SAFETY: as in `start_common`: wcs[i] was initialised by the provider (or
        // `refill_from_deferred`) before the poll looked at it.
        let Some(wc) = self.wcs.get(i as usize).map(|w| unsafe { w.assume_init_ref() }) else { return false };
        let index = tag::hi_of(wc.wr_id) as u16;
        let Some(Some(s)) = self.srqs.list.get_mut(index as usize) else { return false };
        let Some((mr, wr_id)) = s.t.retire(wc.wr_id & tag::SEQ_MASK) else { return false };
        let (place, attach) = match self.srqs.by_qpn.get(&wc.qp_num) {
            Some(q) => (q.place, q.attach),
            None => (0, 0),
        };
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            if let Some(Some(m)) = self.members.get_mut(place as usize) {
                if m.key.attach == attach {
                    // Any error but a flush puts the QP in the error state (a flush says it is there).
                    m.failed.get_or_insert(Fault::Completion(wc.status));
                }
            }
        }
        let flags = RECV | SIGNALED | SRQ;
        f(Wc { wr_id, f: Fields::of(wc), place, attach, flags }, Some(mr));
        true
    }
}

/// The refusal of a single receive put into the slot of `seq` before the provider's call:
/// when the provider named it, the slot is emptied and the region comes back; otherwise it
/// may be posted, so it stays until its completion or the SRQ's destruction.
#[cold]
#[inline(never)]
fn refused_one(s: &mut State, seq: u64, ret: i32, named: bool) -> Rejected<MemoryRegion> {
    if !named {
        return Rejected::kept(post_failed(ret, true));
    }
    match s.t.unput(seq) {
        Some(mr) => Rejected::new(post_failed(ret, false), mr),
        // Never: the post put it there, and nothing took it since.
        None => Rejected::kept(post_failed(ret, false)),
    }
}

#[cfg(test)]
mod tests;
