//! [`Lane`]: the fast data path. One completion queue and the queue pairs that complete on it,
//! driven by one thread, with owned buffers instead of locks and reference counts.
//!
//! # What it is for
//!
//! The convenient path ([`QueuePair::post_send`](crate::QueuePair::post_send) and its polls)
//! lets any thread post and poll any QP of a shared CQ, and lets work requests borrow their
//! regions. Both cost: a mutex on the QP's queues and on the CQ's routing table, and a
//! reference-count change per region per work request. A lane drops both:
//!
//! - **Ownership instead of locks.** A lane owns its CQ and the QPs attached to it
//!   ([`Lane::attach`] takes the [`Connection`], [`Lane::attach_ud`] the [`UdEndpoint`]).
//!   It is `Send`, not `Sync`, and posting and polling take `&mut self`: no mutex, no atomic
//!   read-modify-write on the way. One lane per thread is how RDMA servers are built anyway.
//! - **Owned buffers instead of reference counts.** A work request *moves* its
//!   [`MemoryRegion`] into the lane's slot table (sized by the queue depth, allocated once,
//!   when the QP is attached); the [`Completion`] that retires the slot hands it back
//!   ([`Completion::take_region`]). A post moves one pointer and touches no atomic.
//! - **Checks that cost compares.** A post checks the region's protection domain, the range,
//!   the access rights and the remote range with a few compares, lowers the work request in
//!   one place ([`SendWr`] → `ibv_send_wr`) and calls the provider. A poll decodes the
//!   completion's tag (which QP, which slot) and hands the raw fields over as they are; the
//!   typed accessors decode them when asked.
//! - **Selective signaling and post lists.** [`SendWr::unsignaled`] work requests complete
//!   with the next signaled one of their queue: that completion retires every earlier slot of
//!   the queue, in order, and each comes back as its own [`Completion`]
//!   ([`Completion::is_signaled`] false). [`Lane::post_send_list`] posts up to
//!   [`MAX_LIST`] work requests under one doorbell (one `ibv_post_send` of a chained list).
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::lane::{Lane, RecvWr, SendWr};
//! use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = Client::new()?.resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?.resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut lane = Lane::new(&route.context()?, 64)?;
//! let conn = route.create_qp(&pd, lane.qp_init())?.connect(&ConnParam::new(), t)?;
//! let qp = lane.attach(conn)?;
//! let buf = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//! let msg = MemoryRegion::new(&pd, 64, AccessFlags::empty())?;
//! lane.post_recv(qp, RecvWr::new(buf).wr_id(1))?;
//! lane.post_send(qp, SendWr::send(msg, 0..64).wr_id(2))?;
//! loop {
//!     let Some(c) = lane.poll()? else { continue };
//!     let mut c = c.ok()?;                   // a failed completion is an error
//!     let region = c.take_region();          // the buffer, back in our hands
//!     if c.wr_id() == 1 { break }
//! #   drop(region);
//! }
//! # Ok(()) }
//! ```
//!
//! # Why it is sound
//!
//! - **The device never writes memory Rust code can reach.** While a work request is posted,
//!   its region sits in the lane's slot table, and the lane offers no way to reach it: the
//!   caller gave up its only handle when it moved the region in. (A region's handle is unique:
//!   [`MemoryRegion`] is not `Clone`, and the convenient path's holds give no access to the
//!   bytes; the region's own accessors keep refusing while such a hold lets the device write
//!   it.) The slot gives the region back only with the completion that retires it.
//!   Using a region after posting it does not compile: it moved into the lane.
//!
//!   ```compile_fail,E0382
//!   # fn f(lane: &mut rdma_cm::lane::Lane, qp: rdma_cm::lane::LaneQp, mut mr: rdma_cm::MemoryRegion) {
//!   lane.post_recv(qp, rdma_cm::lane::RecvWr::new(mr)).unwrap();
//!   let bytes = mr.as_slice(); // the device may be writing it: error[E0382], use of moved value
//!   # }
//!   ```
//! - **No memory is freed under the device.** A region leaves a slot only (a) with its
//!   completion, (b) when a later signaled completion of the same RC or UD queue retires it
//!   (queues complete in order), (c) when the provider said it did not take the work request
//!   (`bad_wr` pointing into the list), or (d) when its QP was destroyed successfully. A post
//!   that fails without saying how far it got keeps every region and moves the QP to the error
//!   state, so the flush retires them.
//! - **`mem::forget` is safe.** Forgetting the lane, a [`Completion`] or a work request leaks
//!   regions, and leaking is safe. The slots, not the caller, own what the device may touch.
//! - **Dropping** a lane (or [`Lane::remove`] of one QP) moves each QP to the error state,
//!   reaps the flushed completions for up to 2 s, and then destroys the QP. Regions still in
//!   slots after that (work requests whose completion never came: unsignaled ones that ran
//!   before the error, or receives rxe never flushes) are handed to the QP's own slot rings
//!   just before it is destroyed, so they are released only when `ibv_destroy_qp` succeeds,
//!   and leaked with the rings when it fails.
//! - **No completion is lost.** The lane is the only reader of its CQ: the crate's other
//!   polls refuse a lane's CQ ([`Error::InvalidArgument`]), so a QP made with
//!   [`Lane::qp_init`] and never attached (or the CQ reached through it) cannot take the
//!   lane's completions. Completions of work posted through such a QP's convenient path are
//!   routed as usual and returned by [`Lane::poll`] ([`Completion::is_lane`] false). A poll
//!   holds what it took from the CQ in the lane until it has been handed out, so a panic in
//!   the caller between two polls loses nothing. Completions that another QP's teardown reaps
//!   are kept, in order, for the next poll.
//! - **Stale completions retire nothing.** Each `wr_id` the lane posts names the QP's place
//!   in the lane, that place's generation, and the slot's sequence number; a completion of a
//!   QP removed from the lane (or of an earlier QP at the same place) matches no slot.
//!
//! # Limits of this version
//!
//! No shared receive queue, no inline sends, and a scatter/gather list names pieces of one
//! region ([`SendWr::send_sg`], [`SendWr::write_sg`], [`SendWr::read_sg`]). A QP is attached
//! with nothing outstanding on its convenient path; receives posted before the connection is
//! established go through the lane once it is attached (set [`ConnParam`](crate::ConnParam)'s
//! RNR retry so the peer waits for them). The lane polls without sleeping.

use std::collections::VecDeque;
use std::fmt;
use std::mem::{self, MaybeUninit};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::ah::GRH_LEN;
use crate::connection::Connection;
use crate::cq::{CompletionQueue, WcOpcode, WcStatus, WorkCompletion, WorkQueue};
use crate::device::VerbsContext;
use crate::error::{Error, Result};
use crate::event_channel::CmEvent;
use crate::mr::{AccessFlags, MemoryRegion, RemoteRegion};
use crate::pd::ProtectionDomain;
use crate::qp::{rejected_from, QpInit, QueuePair};
use crate::ring::Hold;
use crate::ud::UdDest;
use crate::ud_cm::UdEndpoint;
use crate::wr::MAX_SGE;

/// The most work requests one [`Lane::post_send_list`] or [`Lane::post_recv_list`] posts: one
/// `ibv_post_*` call, one doorbell.
pub const MAX_LIST: usize = 16;

/// Completions taken from the CQ per `ibv_poll_cq`.
const POLL_BATCH: usize = 16;

/// How long teardown waits for flushed completions before destroying a QP anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The tag in every `wr_id` a lane posts:
///
/// ```text
/// bit 63   62      61..48             47..32          31..0
///     RECV  0      generation (14)    place (16)      sequence number
/// ```
///
/// Bit 62 is the convenient path's tag bit (`ring::tag::OURS`); it is clear here, so a
/// completion of the convenient path on a lane's CQ is told apart and routed the usual way.
mod tag {
    pub(super) const RECV: u64 = 1 << 63;
    pub(super) const CRATE: u64 = crate::ring::tag::OURS;
    const GEN_SHIFT: u32 = 48;
    pub(super) const GEN_MASK: u16 = (1 << 14) - 1;
    const PLACE_SHIFT: u32 = 32;

    #[inline(always)]
    pub(super) fn encode(place: u16, gen: u16, seq: u32, recv: bool) -> u64 {
        (if recv { RECV } else { 0 })
            | ((gen & GEN_MASK) as u64) << GEN_SHIFT
            | (place as u64) << PLACE_SHIFT
            | seq as u64
    }

    /// (recv, generation, place, sequence number).
    #[inline(always)]
    pub(super) fn decode(wr_id: u64) -> (bool, u16, u16, u32) {
        (wr_id & RECV != 0, (wr_id >> GEN_SHIFT) as u16 & GEN_MASK, (wr_id >> PLACE_SHIFT) as u16, wr_id as u32)
    }
}

/// A QP attached to a lane: its place there. Cheap to copy; meaningful only to the lane that
/// gave it (another lane, or this one after [`Lane::remove`], refuses it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaneQp {
    place: u16,
    gen: u16,
}

/// A UD destination registered with a lane for one of its QPs ([`Lane::add_dest`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DestKey {
    qp: LaneQp,
    index: u32,
}

/// A refused post: the error, and what is given back (the work request's region, for a post
/// the provider did not take; `None` when it may have: the lane then keeps the region until the
/// flush retires it).
pub struct Rejected<T> {
    // Boxed: a post that succeeds then returns one word, and only a refusal allocates.
    inner: Box<(Error, Option<T>)>,
}

impl<T> Rejected<T> {
    #[cold]
    fn new(error: Error, returned: T) -> Rejected<T> {
        Rejected { inner: Box::new((error, Some(returned))) }
    }
    #[cold]
    fn kept(error: Error) -> Rejected<T> {
        Rejected { inner: Box::new((error, None)) }
    }
    /// The error.
    pub fn error(&self) -> &Error {
        &self.inner.0
    }
    /// What was given back (the region, when the work request was not posted).
    pub fn into_inner(self) -> Option<T> {
        self.inner.1
    }
    /// The error and what was given back.
    pub fn into_parts(self) -> (Error, Option<T>) {
        let (e, t) = *self.inner;
        (e, t)
    }
}

impl<T> From<Rejected<T>> for Error {
    fn from(r: Rejected<T>) -> Error {
        r.inner.0
    }
}

impl<T> fmt::Debug for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejected").field("error", &self.inner.0).field("returned", &self.inner.1.is_some()).finish()
    }
}

impl<T> fmt::Display for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner.0, f)
    }
}

impl<T> std::error::Error for Rejected<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.inner.0)
    }
}

/// A refused [`Lane::post_send_iter`]: the error, and the regions (with their `wr_id`s) of
/// the work requests it took from the iterator and did not post, in order. Regions the
/// provider may have taken are not among them: the lane keeps those until the flush retires
/// them.
#[derive(Debug)]
pub struct RejectedList {
    error: Error,
    returned: Vec<(u64, MemoryRegion)>,
}

impl RejectedList {
    /// The error.
    pub fn error(&self) -> &Error {
        &self.error
    }
    /// The error and the regions given back, as (`wr_id`, region).
    pub fn into_parts(self) -> (Error, Vec<(u64, MemoryRegion)>) {
        (self.error, self.returned)
    }
}

impl From<RejectedList> for Error {
    fn from(r: RejectedList) -> Error {
        r.error
    }
}

impl fmt::Display for RejectedList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for RejectedList {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Send,
    Write { remote: RemoteRegion, offset: u64 },
    Read { remote: RemoteRegion, offset: u64 },
    FetchAdd { remote: RemoteRegion, offset: u64, add: u64 },
    CompareSwap { remote: RemoteRegion, offset: u64, compare: u64, swap: u64 },
}

/// A range of a region, as a post names it: (start, length), or why it cannot be one.
type Piece = (u64, u32);

/// Turns a range into a piece; the bounds against the region are checked at post.
#[inline(always)]
fn piece(r: &Range<usize>) -> std::result::Result<Piece, &'static str> {
    if r.start > r.end {
        return Err("a range is reversed");
    }
    match u32::try_from(r.end - r.start) {
        Ok(len) => Ok((r.start as u64, len)),
        Err(_) => Err("a work request moves at most 4 GiB"),
    }
}

/// A send-queue work request of a lane: a send, an RDMA WRITE or READ, or an atomic, whose
/// local memory is pieces of one [`MemoryRegion`], moved into the lane when it is posted.
pub struct SendWr {
    mr: MemoryRegion,
    kind: Kind,
    pieces: [Piece; MAX_SGE],
    n: u8,
    /// Why the request cannot be posted (found by a constructor; reported by the post).
    bad: Option<&'static str>,
    wr_id: u64,
    imm: Option<u32>,
    signaled: bool,
    solicited: bool,
    dest: Option<DestKey>,
}

impl fmt::Debug for SendWr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendWr")
            .field("kind", &self.kind)
            .field("pieces", &&self.pieces[..self.n as usize])
            .field("wr_id", &self.wr_id)
            .field("signaled", &self.signaled)
            .finish()
    }
}

impl SendWr {
    /// A request of one piece.
    #[inline(always)]
    fn one(mr: MemoryRegion, kind: Kind, range: Range<usize>) -> SendWr {
        let (first, bad) = match piece(&range) {
            Ok(p) => (p, None),
            Err(why) => ((0, 0), Some(why)),
        };
        SendWr {
            mr,
            kind,
            pieces: [first, (0, 0), (0, 0), (0, 0)],
            n: 1,
            bad,
            wr_id: 0,
            imm: None,
            signaled: true,
            solicited: false,
            dest: None,
        }
    }

    /// A request of the pieces `ranges`.
    #[inline(always)]
    fn new(mr: MemoryRegion, kind: Kind, ranges: &[Range<usize>]) -> SendWr {
        let Some((head, tail)) = ranges.split_first().filter(|_| ranges.len() <= MAX_SGE) else {
            let mut w = Self::one(mr, kind, 0..0);
            w.bad = Some("a work request names 1 to 4 pieces (rdma_cm::MAX_SGE)");
            return w;
        };
        let mut w = Self::one(mr, kind, head.clone());
        for r in tail {
            match piece(r) {
                Ok(p) => {
                    w.pieces[w.n as usize] = p;
                    w.n += 1;
                }
                Err(why) => w.bad = Some(why),
            }
        }
        if w.n > 1 && w.pieces[..w.n as usize].iter().any(|p| p.1 == 0) {
            w.bad = Some("a list of several pieces takes non-empty ones only (some providers read 0 bytes as 2 GiB)");
        }
        w
    }

    /// Sends `mr[range]`.
    #[inline(always)]
    pub fn send(mr: MemoryRegion, range: Range<usize>) -> SendWr {
        Self::one(mr, Kind::Send, range)
    }

    /// Sends the concatenation of `ranges` of `mr`, in order (at most [`MAX_SGE`], and at most
    /// the QP's [`QpInit::max_send_sge`]).
    #[inline]
    pub fn send_sg(mr: MemoryRegion, ranges: &[Range<usize>]) -> SendWr {
        Self::new(mr, Kind::Send, ranges)
    }

    /// Writes `mr[range]` to `remote` at `offset` (RDMA WRITE).
    #[inline(always)]
    pub fn write(mr: MemoryRegion, range: Range<usize>, remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::one(mr, Kind::Write { remote: *remote, offset }, range)
    }

    /// Writes the concatenation of `ranges` of `mr` to `remote` at `offset` (a gathered RDMA
    /// WRITE).
    #[inline(always)]
    pub fn write_sg(mr: MemoryRegion, ranges: &[Range<usize>], remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::new(mr, Kind::Write { remote: *remote, offset }, ranges)
    }

    /// Reads `remote` at `offset` into `mr[range]` (RDMA READ). The region needs
    /// [`AccessFlags::LOCAL_WRITE`].
    #[inline]
    pub fn read(mr: MemoryRegion, range: Range<usize>, remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::one(mr, Kind::Read { remote: *remote, offset }, range)
    }

    /// Reads `remote` at `offset` into `ranges` of `mr`, in order (a scattered RDMA READ).
    #[inline]
    pub fn read_sg(mr: MemoryRegion, ranges: &[Range<usize>], remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::new(mr, Kind::Read { remote: *remote, offset }, ranges)
    }

    /// Atomically adds `add` to the 8-byte integer at `offset` of `remote`; its original value
    /// lands in `mr[at..at + 8]` (RDMA fetch-and-add). The region needs
    /// [`AccessFlags::LOCAL_WRITE`]; the target must be 8-byte aligned.
    #[inline(always)]
    pub fn fetch_add(mr: MemoryRegion, at: usize, remote: &RemoteRegion, offset: u64, add: u64) -> SendWr {
        Self::one(mr, Kind::FetchAdd { remote: *remote, offset, add }, at..at.saturating_add(8))
    }

    /// Atomically replaces the 8-byte integer at `offset` of `remote` with `swap` if it equals
    /// `compare`; its original value lands in `mr[at..at + 8]` (RDMA compare-and-swap).
    #[inline]
    pub fn compare_swap(
        mr: MemoryRegion,
        at: usize,
        remote: &RemoteRegion,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> SendWr {
        Self::one(mr, Kind::CompareSwap { remote: *remote, offset, compare, swap }, at..at.saturating_add(8))
    }

    /// Sets the `wr_id` its completion carries.
    #[inline(always)]
    pub fn wr_id(mut self, id: u64) -> SendWr {
        self.wr_id = id;
        self
    }

    /// Adds 32 bits of immediate data (a send or WRITE with immediate).
    pub fn imm(mut self, imm: u32) -> SendWr {
        self.imm = Some(imm);
        self
    }

    /// Asks for no completion on success: the next signaled completion of the queue retires
    /// it (and hands its region back, as a [`Completion`] whose
    /// [`is_signaled`](Completion::is_signaled) is false). The work request that takes the
    /// queue's last free slot is signaled whatever it asks, so a full queue always drains.
    #[inline(always)]
    pub fn unsignaled(mut self) -> SendWr {
        self.signaled = false;
        self
    }

    /// Sets the solicited-event bit.
    pub fn solicited(mut self) -> SendWr {
        self.solicited = true;
        self
    }

    /// Addresses a send to a UD destination registered with [`Lane::add_dest`] (required on a
    /// UD QP, refused on RC).
    #[inline(always)]
    pub fn to(mut self, dest: DestKey) -> SendWr {
        self.dest = Some(dest);
        self
    }

    /// The region, back (the work request is not posted).
    pub fn into_region(self) -> MemoryRegion {
        self.mr
    }
}

/// A receive of a lane: the device writes the message into its region, moved into the lane
/// when it is posted.
pub struct RecvWr {
    mr: MemoryRegion,
    piece: std::result::Result<Piece, &'static str>,
    wr_id: u64,
}

impl fmt::Debug for RecvWr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvWr").field("piece", &self.piece).field("wr_id", &self.wr_id).finish()
    }
}

impl RecvWr {
    /// A receive into the whole of `mr` (which needs [`AccessFlags::LOCAL_WRITE`]). On UD the
    /// first [`GRH_LEN`] bytes take the GRH.
    #[inline(always)]
    pub fn new(mr: MemoryRegion) -> RecvWr {
        let len = mr.len();
        RecvWr { mr, piece: piece(&(0..len)), wr_id: 0 }
    }

    /// A receive into `mr[range]`.
    #[inline(always)]
    pub fn range(mr: MemoryRegion, range: Range<usize>) -> RecvWr {
        RecvWr { piece: piece(&range), mr, wr_id: 0 }
    }

    /// Sets the `wr_id` its completion carries.
    #[inline(always)]
    pub fn wr_id(mut self, id: u64) -> RecvWr {
        self.wr_id = id;
        self
    }

    /// The region, back (the receive is not posted).
    pub fn into_region(self) -> MemoryRegion {
        self.mr
    }
}

/// The fields of an `ibv_wc` after its `wr_id`, as the provider wrote them: a completion is
/// copied in one piece and decoded only when asked.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Fields {
    status: u32,
    opcode: u32,
    vendor_err: u32,
    byte_len: u32,
    imm: u32,
    qp_num: u32,
    src_qp: u32,
    wc_flags: u32,
    pkey_index: u16,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
}

// `Fields` is `ibv_wc` from `status` on, field for field.
const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(ffi::ibv_wc, status) == 8);
    assert!(offset_of!(ffi::ibv_wc, qp_num) == 8 + offset_of!(Fields, qp_num));
    assert!(offset_of!(ffi::ibv_wc, wc_flags) == 8 + offset_of!(Fields, wc_flags));
    assert!(offset_of!(ffi::ibv_wc, pkey_index) == 8 + offset_of!(Fields, pkey_index));
    assert!(offset_of!(ffi::ibv_wc, dlid_path_bits) == 8 + offset_of!(Fields, dlid_path_bits));
    assert!(mem::size_of::<ffi::ibv_wc>() >= 8 + mem::size_of::<Fields>());
};

impl Fields {
    /// The fields of `wc`.
    #[inline(always)]
    fn of(wc: &ffi::ibv_wc) -> Fields {
        // SAFETY: `Fields` is laid out as `ibv_wc` from offset 8 on (checked above), every field
        // an integer, and `wc` is initialised; offset 8 of an 8-aligned `ibv_wc` is aligned for
        // `Fields`. Its padding may read the C struct's padding, which it never looks at.
        unsafe { std::ptr::read((wc as *const ffi::ibv_wc).cast::<u8>().add(8).cast::<Fields>()) }
    }
}

/// Flags of a [`Completion`].
const RECV: u8 = 1;
const SIGNALED: u8 = 2;
const LANE: u8 = 4;

/// A completion reaped by [`Lane::poll`]: the work request's region, handed back, and the
/// completion's fields as the provider wrote them (decoded by the accessors).
pub struct Completion {
    mr: Option<MemoryRegion>,
    wr_id: u64,
    f: Fields,
    place: u16,
    gen: u16,
    flags: u8,
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("qp", &self.qp())
            .field("wc", &self.work_completion())
            .field("signaled", &self.is_signaled())
            .field("region", &self.mr.is_some())
            .finish()
    }
}

impl Completion {
    /// The region of the work request, handed back (once; `None` afterwards, and for
    /// completions of the convenient path).
    #[inline(always)]
    pub fn take_region(&mut self) -> Option<MemoryRegion> {
        self.mr.take()
    }

    /// The `wr_id` the work request was given.
    #[inline(always)]
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The QP it belongs to (`None` for a completion of the convenient path of a QP that is
    /// not attached: see [`Completion::qp_num`]).
    pub fn qp(&self) -> Option<LaneQp> {
        self.is_lane().then_some(LaneQp { place: self.place, gen: self.gen })
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.f.qp_num
    }

    /// Whether it came from a work request posted through the lane (false: through the
    /// convenient path of a QP made with [`Lane::qp_init`]; it carries no region).
    pub fn is_lane(&self) -> bool {
        self.flags & LANE != 0
    }

    /// False for an unsignaled work request retired by a later signaled completion of its
    /// queue (it succeeded: its fields other than the status, `wr_id` and queue say nothing).
    pub fn is_signaled(&self) -> bool {
        self.flags & SIGNALED != 0
    }

    /// The queue it completed on.
    pub fn queue(&self) -> WorkQueue {
        if self.flags & RECV != 0 {
            WorkQueue::Recv
        } else {
            WorkQueue::Send
        }
    }

    /// Whether it succeeded.
    #[inline(always)]
    pub fn is_ok(&self) -> bool {
        self.f.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.f.status)
    }

    /// `Ok(self)` on success.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] with the status, its usual cause and the vendor error. The
    /// region is dropped with the completion: call [`Completion::take_region`] first to keep
    /// it.
    pub fn ok(self) -> Result<Completion> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion { wr_id: self.wr_id, status: self.status(), vendor_err: self.f.vendor_err })
        }
    }

    /// The operation, for successful signaled completions.
    pub fn opcode(&self) -> Option<WcOpcode> {
        (self.is_signaled() && self.is_ok()).then(|| WcOpcode::from_raw(self.f.opcode))
    }

    /// Bytes received (receives) or transferred (RDMA READ).
    pub fn byte_len(&self) -> u32 {
        self.f.byte_len
    }

    /// Immediate data of a receive, in host order, when the peer sent any.
    pub fn imm_data(&self) -> Option<u32> {
        self.work_completion().imm_data()
    }

    /// The sender's QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.f.src_qp
    }

    /// The completion as the convenient path reports it (for
    /// [`Datagram::parse`](crate::Datagram::parse), say).
    pub fn work_completion(&self) -> WorkCompletion {
        let f = &self.f;
        WorkCompletion {
            wr_id: self.wr_id,
            status: f.status,
            opcode: f.opcode,
            vendor_err: f.vendor_err,
            byte_len: f.byte_len,
            imm: f.imm,
            qp_num: f.qp_num,
            src_qp: f.src_qp,
            wc_flags: f.wc_flags,
            pkey_index: f.pkey_index,
            slid: f.slid,
            sl: f.sl,
            dlid_path_bits: f.dlid_path_bits,
            queue: self.queue(),
        }
    }
}

/// One work queue's slots: the regions of posted work requests, in posting order.
struct Slots {
    slots: Box<[Slot]>,
    mask: u32,
    depth: u32,
    /// Sequence number of the oldest outstanding work request.
    head: u32,
    /// Sequence number the next one gets (wrapping; at most `depth` apart from `head`).
    tail: u32,
}

struct Slot {
    mr: Option<MemoryRegion>,
    wr_id: u64,
}

impl Slots {
    fn new(depth: u32) -> Slots {
        let len = depth.max(1).next_power_of_two();
        Slots { slots: (0..len).map(|_| Slot { mr: None, wr_id: 0 }).collect(), mask: len - 1, depth, head: 0, tail: 0 }
    }
    #[inline(always)]
    fn outstanding(&self) -> u32 {
        self.tail.wrapping_sub(self.head)
    }
    #[inline(always)]
    fn free(&self) -> u32 {
        self.depth - self.outstanding()
    }
    /// Stores a posted work request at `tail + k` (committed by `commit`).
    #[inline(always)]
    fn put(&mut self, k: u32, mr: MemoryRegion, wr_id: u64) {
        let i = (self.tail.wrapping_add(k) & self.mask) as usize;
        if let Some(s) = self.slots.get_mut(i) {
            // The slot is free: at most `depth` are outstanding, and retiring empties a slot.
            s.mr = Some(mr);
            s.wr_id = wr_id;
        }
    }
    /// Whether `seq` is outstanding.
    #[inline(always)]
    fn holds(&self, seq: u32) -> bool {
        seq.wrapping_sub(self.head) < self.outstanding()
    }
    /// Retires the oldest work request: its region and `wr_id`.
    #[inline(always)]
    fn pop(&mut self) -> (Option<MemoryRegion>, u64) {
        let i = (self.head & self.mask) as usize;
        self.head = self.head.wrapping_add(1);
        match self.slots.get_mut(i) {
            Some(s) => (s.mr.take(), s.wr_id),
            None => (None, 0),
        }
    }
    /// Takes every region still held (for a QP being destroyed).
    fn drain(&mut self) -> impl Iterator<Item = MemoryRegion> + '_ {
        let n = self.outstanding();
        let start = self.head;
        self.head = self.tail;
        (0..n).filter_map(move |k| self.slots[(start.wrapping_add(k) & self.mask) as usize].mr.take())
    }
}

/// What owns the QP: the connection, or the UD endpoint.
enum Owner {
    Rc(Connection),
    Ud(UdEndpoint),
}

impl Owner {
    fn qp(&self) -> &QueuePair {
        match self {
            Owner::Rc(c) => c.qp(),
            Owner::Ud(e) => e.qp().qp(),
        }
    }
}

/// A UD destination as a post needs it, and the handle that keeps its address handle alive.
struct Dest {
    ah: *mut ffi::ibv_ah,
    qpn: u32,
    qkey: u32,
    keep: UdDest,
}

/// A QP attached to a lane.
struct Member {
    // Field order is drop order after Drop::drop: the owner (and so the QP) goes first; the
    // slots are empty by then (Drop::drop hands what they hold to the QP's own rings).
    owner: Owner,
    raw: NonNull<ffi::ibv_qp>,
    qp_num: u32,
    gen: u16,
    pd: Arc<ProtectionDomain>,
    max_send_sge: u32,
    /// A UD QP's MTU (the largest datagram), 0 for RC.
    mtu: u32,
    /// A completion of it failed (not a flush), or the lane moved it to the error state:
    /// nothing posted now can run (and rxe never flushes a receive posted then).
    failed: Option<u32>,
    send: Slots,
    recv: Slots,
    dests: Vec<Dest>,
}

impl Member {
    fn is_ud(&self) -> bool {
        self.mtu != 0
    }

    /// Moves the QP to the error state, flushing everything posted.
    fn set_error(&mut self) -> Result<()> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: the QP is alive while its owner is (a field of `self`); only the state changes,
        // as the mask says.
        let ret =
            unsafe { ffi::ibv_modify_qp(self.raw.as_ptr(), &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) };
        crate::error::check_ibv(ret, "ibv_modify_qp(ERR)")?;
        self.failed.get_or_insert(ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
        Ok(())
    }
}

impl Drop for Member {
    /// Hands every region still in a slot to the QP's own slot rings, staged but not
    /// committed (so the QP's teardown does not wait for them): the rings are released after
    /// `ibv_destroy_qp` succeeds and leaked when it fails (`QueuePair`'s Drop), which is
    /// exactly when the device can no longer reach the memory. A UD QP's address handles are
    /// handed over the same way, or leaked if the rings have no room for them.
    fn drop(&mut self) {
        let has_sends = self.send.outstanding() > 0;
        let sends: Vec<MemoryRegion> = self.send.drain().collect();
        let recvs: Vec<MemoryRegion> = self.recv.drain().collect();
        let qp = self.owner.qp();
        let mut q = qp.queues();
        let park = |ring: &mut crate::ring::Ring, regions: Vec<MemoryRegion>| {
            // Staging overwrites a slot: only an empty ring may take them (attach checked that
            // nothing was outstanding, and the convenient path is out of reach since).
            let empty = ring.outstanding() == 0;
            for (k, mr) in regions.into_iter().enumerate() {
                if !empty || k >= ring.slots.len() {
                    // Never (see above; both are sized by the queue depth). Were it reached, the
                    // region is leaked rather than released while the device may use it.
                    mem::forget(mr);
                    continue;
                }
                ring.stage(k as u64, 0, Some(Hold::new(mr.inner(), false)));
            }
        };
        park(&mut q.send, sends);
        park(&mut q.recv, recvs);
        if has_sends && self.is_ud() {
            let dests = mem::take(&mut self.dests);
            let room = q.send.slots.len();
            let mut parked = 0;
            for d in dests {
                if parked < room && q.send.stage_ah(parked as u64, d.keep.ah()) {
                    parked += 1;
                } else {
                    mem::forget(d);
                }
            }
        }
    }
}

/// Where the poll stands in a completion that retires several slots.
#[derive(Clone, Copy)]
struct Retiring {
    place: u16,
    recv: bool,
    /// The sequence number the completion names (the last slot it retires).
    upto: u32,
    /// Its index in the poll buffer.
    wc: u8,
}

/// One thread's data path: a completion queue and the QPs that complete on it. See the
/// [module docs](self).
pub struct Lane {
    cq_raw: NonNull<ffi::ibv_cq>,
    members: Vec<Option<Member>>,
    /// Each place's generation (kept across removals, so a new QP at a place is told apart).
    gens: Vec<u16>,
    /// Completions taken from the CQ and not yet handed out: `wcs[at..n]`.
    wcs: [MaybeUninit<ffi::ibv_wc>; POLL_BATCH],
    n: u8,
    at: u8,
    retiring: Option<Retiring>,
    /// Completions reaped while another QP was torn down, in order: handed out first.
    deferred: VecDeque<ffi::ibv_wc>,
    // Dropped after the members (whose QPs use it), in declaration order after Drop::drop.
    cq: Arc<CompletionQueue>,
}

// SAFETY: the lane owns its CQ and QPs (their handles are `Send`); the raw pointers it caches
// point into them and are used only through `&mut self`. It is not `Sync`: nothing is shared.
unsafe impl Send for Lane {}

impl fmt::Debug for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lane")
            .field("qps", &self.members.iter().flatten().count())
            .field("cq_depth", &self.cq.depth())
            .finish()
    }
}

/// The refusal of a [`LaneQp`] the lane does not hold.
#[cold]
fn unknown_qp() -> Error {
    Error::InvalidArgument("this LaneQp is not attached to this lane (removed, or another lane's)".into())
}

impl Lane {
    /// A lane with a new CQ of `depth` completions on `ctx` (the device of the QPs it will
    /// serve: [`RouteResolved::context`](crate::RouteResolved::context), say). The CQ must
    /// hold what every attached QP may have outstanding: the sum of their queue depths.
    ///
    /// # Errors
    /// As for [`CompletionQueue::new`].
    pub fn new(ctx: &VerbsContext, depth: u32) -> Result<Lane> {
        let cq = CompletionQueue::new_exclusive(ctx, depth)?;
        let cq_raw = NonNull::new(cq.as_raw()).ok_or_else(|| Error::InvalidArgument("CQ without a handle".into()))?;
        Ok(Lane {
            cq_raw,
            members: Vec::new(),
            gens: Vec::new(),
            wcs: [const { MaybeUninit::uninit() }; POLL_BATCH],
            n: 0,
            at: 0,
            retiring: None,
            deferred: VecDeque::with_capacity(depth as usize),
            cq,
        })
    }

    /// QP capabilities with the lane's CQ as both CQs: create the QP with them
    /// ([`RouteResolved::create_qp`](crate::RouteResolved::create_qp),
    /// [`ConnectRequest::create_qp`](crate::ConnectRequest::create_qp), the UD twins), then
    /// [`Lane::attach`] it.
    pub fn qp_init(&self) -> QpInit {
        self.qp_init_from(QpInit::new())
    }

    /// `init` with the lane's CQ as both CQs.
    pub fn qp_init_from(&self, init: QpInit) -> QpInit {
        init.send_cq(Arc::clone(&self.cq)).recv_cq(Arc::clone(&self.cq))
    }

    /// The CQ's depth.
    pub fn cq_depth(&self) -> u32 {
        self.cq.depth()
    }

    /// Attaches an RC connection whose QP was created with [`Lane::qp_init`]; from now on its
    /// work goes through the lane, and the lane owns it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (the connection given back) when its QP completes on
    /// another CQ, takes receives from an SRQ, or has work outstanding on its convenient path.
    pub fn attach(&mut self, conn: Connection) -> std::result::Result<LaneQp, Rejected<Connection>> {
        self.attach_owner(Owner::Rc(conn)).map_err(|b| {
            let (e, o) = *b;
            match o {
                Owner::Rc(c) => Rejected::new(e, c),
                Owner::Ud(_) => Rejected::kept(e),
            }
        })
    }

    /// Attaches a UD endpoint whose QP was created with [`Lane::qp_init`]. Its sends go to
    /// destinations registered with [`Lane::add_dest`].
    ///
    /// # Errors
    /// As for [`Lane::attach`].
    pub fn attach_ud(&mut self, ep: UdEndpoint) -> std::result::Result<LaneQp, Rejected<UdEndpoint>> {
        self.attach_owner(Owner::Ud(ep)).map_err(|b| {
            let (e, o) = *b;
            match o {
                Owner::Ud(u) => Rejected::new(e, u),
                Owner::Rc(_) => Rejected::kept(e),
            }
        })
    }

    fn attach_owner(&mut self, owner: Owner) -> std::result::Result<LaneQp, Box<(Error, Owner)>> {
        let qp = owner.qp();
        if !Arc::ptr_eq(qp.send_cq(), &self.cq) || !Arc::ptr_eq(qp.recv_cq(), &self.cq) {
            let e = Error::InvalidArgument(
                "attach: the QP completes on another CQ than the lane's: create it with Lane::qp_init".into(),
            );
            return Err(Box::new((e, owner)));
        }
        if qp.srq().is_some() {
            let e = Error::InvalidArgument("attach: a lane does not serve QPs on a shared receive queue".into());
            return Err(Box::new((e, owner)));
        }
        let (send_depth, recv_depth) = {
            let q = qp.queues();
            if q.send.outstanding() + q.recv.outstanding() > 0 || q.send_kept.len() + q.recv_kept.len() > 0 {
                drop(q);
                let e = Error::InvalidArgument(
                    "attach: the QP has work outstanding on its convenient path: reap it first (or post through the lane)"
                        .into(),
                );
                return Err(Box::new((e, owner)));
            }
            (q.send.cap() as u32, q.recv.cap() as u32)
        };
        let Some(raw) = NonNull::new(qp.as_raw()) else {
            return Err(Box::new((Error::InvalidArgument("attach: QP without a handle".into()), owner)));
        };
        let place = match self.members.iter().position(Option::is_none) {
            Some(p) => p,
            None if self.members.len() <= u16::MAX as usize => {
                self.members.push(None);
                self.gens.push(0);
                self.members.len() - 1
            }
            None => {
                return Err(Box::new((Error::InvalidArgument("attach: a lane serves at most 65536 QPs".into()), owner)))
            }
        };
        let gen = self.gens[place];
        let mtu = match &owner {
            Owner::Ud(e) => e.qp().mtu().max(1),
            Owner::Rc(_) => 0,
        };
        let m = Member {
            raw,
            qp_num: qp.qp_num(),
            gen,
            pd: Arc::clone(qp.pd()),
            max_send_sge: qp.max_send_sge(),
            mtu,
            failed: None,
            send: Slots::new(send_depth),
            recv: Slots::new(recv_depth),
            dests: Vec::new(),
            owner,
        };
        self.members[place] = Some(m);
        Ok(LaneQp { place: place as u16, gen })
    }

    #[inline(always)]
    fn member(&mut self, qp: LaneQp) -> Result<&mut Member> {
        match self.members.get_mut(qp.place as usize) {
            Some(Some(m)) if m.gen == qp.gen => Ok(m),
            _ => Err(unknown_qp()),
        }
    }

    /// Registers a UD destination for `qp`'s sends ([`SendWr::to`]). The lane keeps it (and
    /// its address handle) for as long as the QP is attached.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an RC QP, an unknown `qp`, or a destination whose
    /// address handle is on another protection domain.
    pub fn add_dest(&mut self, qp: LaneQp, dest: &UdDest) -> Result<DestKey> {
        let m = self.member(qp)?;
        if !m.is_ud() {
            return Err(Error::InvalidArgument("add_dest: the QP is RC; destinations are for UD QPs".into()));
        }
        if !Arc::ptr_eq(dest.ah().pd(), &m.pd) {
            return Err(Error::InvalidArgument(
                "add_dest: the destination's address handle is on another protection domain than the QP".into(),
            ));
        }
        let index = m.dests.len() as u32;
        m.dests.push(Dest { ah: dest.ah().as_raw(), qpn: dest.qpn(), qkey: dest.qkey(), keep: dest.clone() });
        Ok(DestKey { qp, index })
    }

    /// Work requests of `qp` posted and not yet retired: (send queue, receive queue).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`.
    pub fn outstanding(&mut self, qp: LaneQp) -> Result<(usize, usize)> {
        let m = self.member(qp)?;
        Ok((m.send.outstanding() as usize, m.recv.outstanding() as usize))
    }

    /// The raw QP of `qp`, for what the lane does not wrap (queries, attributes). It stays owned
    /// by the lane. Posting on it directly (an `unsafe` call) is outside what the lane tracks:
    /// such work completes on the lane's CQ, where its `wr_id` would be read as a lane's tag.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`.
    pub fn qp_as_raw(&mut self, qp: LaneQp) -> Result<*mut ffi::ibv_qp> {
        Ok(self.member(qp)?.raw.as_ptr())
    }

    /// The QP number of `qp`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`.
    pub fn qp_num(&mut self, qp: LaneQp) -> Result<u32> {
        Ok(self.member(qp)?.qp_num)
    }

    /// Posts one send-queue work request. Its region moves into the lane until the completion
    /// that retires it hands it back.
    ///
    /// # Errors
    /// The region comes back with the error when it was not posted:
    /// [`Error::QueueFull`]; [`Error::OutOfBounds`] for a range outside the region or the
    /// remote region; [`Error::InvalidArgument`] for a region of another protection domain,
    /// one without `LOCAL_WRITE` that the device would write (READ target, atomic result), an
    /// unaligned or wrongly sized atomic, more pieces than the QP takes, an operation or
    /// destination the QP's type does not have, or an unknown `qp`;
    /// [`Error::MessageTooLong`] for a datagram over the MTU; [`Error::QpInError`] once a
    /// completion of the QP failed; [`Error::Call`] when `ibv_post_send` refuses it (without
    /// the work request when the provider did not say whether it took it: it stays held until
    /// the flush retires it, and the QP is moved to the error state).
    #[inline(always)]
    pub fn post_send(&mut self, qp: LaneQp, wr: SendWr) -> std::result::Result<(), Rejected<MemoryRegion>> {
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return Err(Rejected::new(e, wr.mr)),
        };
        let free = m.send.free();
        if free == 0 || m.failed.is_some() {
            return Err(Rejected::new(refusal(m, "ibv_post_send"), wr.mr));
        }
        let seq = m.send.tail;
        let mut sge: [MaybeUninit<ffi::ibv_sge>; MAX_SGE] = [const { MaybeUninit::uninit() }; MAX_SGE];
        // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of those): all-zero
        // is a valid value.
        let mut raw: ffi::ibv_send_wr = unsafe { mem::zeroed() };
        let id = tag::encode(qp.place, qp.gen, seq, false);
        if let Err(e) = lower_send(&wr, m, id, wr.signaled || free == 1, &mut raw, &mut sge) {
            return Err(Rejected::new(e, wr.mr));
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (its owner is in `m`); `raw` is one NULL-terminated work
        // request over `sge`, both alive for the call; `lower_send` checked every piece against
        // the region (bounds, PD, access), and the region moves into the slot below, so it stays
        // allocated and out of Rust's reach until a completion retires the slot.
        let ret = unsafe { ffi::ibv_post_send(m.raw.as_ptr(), &mut raw, &mut bad) };
        if ret == 0 {
            m.send.put(0, wr.mr, wr.wr_id);
            m.send.tail = seq.wrapping_add(1);
            return Ok(());
        }
        post_failed_one(m, ret, std::ptr::eq(bad, &raw), (wr.wr_id, wr.mr), true)
    }

    /// Posts the work requests `wrs` yields (at most [`MAX_LIST`], and at most the queue's free
    /// slots) in one `ibv_post_send` (one doorbell), building each one where it is lowered: the
    /// way to post a batch without an array of work requests. Returns how many were posted.
    ///
    /// # Errors
    /// As for [`Lane::post_send`], for the first work request that fails its checks, or when
    /// `wrs` yields more than fits; nothing is posted then, and every region taken from `wrs`
    /// comes back in the error (the rest of `wrs` is not consumed). When the provider refuses
    /// part of the list, the ones before the one it names are posted and the others come back.
    #[inline(always)]
    pub fn post_send_iter<I: IntoIterator<Item = SendWr>>(
        &mut self,
        qp: LaneQp,
        wrs: I,
    ) -> std::result::Result<usize, RejectedList> {
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return Err(RejectedList { error: e, returned: Vec::new() }),
        };
        if m.failed.is_some() {
            return Err(RejectedList { error: refusal(m, "ibv_post_send"), returned: Vec::new() });
        }
        let free = m.send.free();
        let seq = m.send.tail;
        let mut raw: [MaybeUninit<ffi::ibv_send_wr>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let mut sge: [[MaybeUninit<ffi::ibv_sge>; MAX_SGE]; MAX_LIST] =
            [const { [const { MaybeUninit::uninit() }; MAX_SGE] }; MAX_LIST];
        let base: *mut ffi::ibv_send_wr = raw.as_mut_ptr().cast();
        let mut k = 0u32;
        for w in wrs {
            if k as usize == MAX_LIST || k == free {
                return Err(unstage(m, k, (w.wr_id, w.mr), list_too_long(k, free)));
            }
            // SAFETY: k < MAX_LIST: within `raw`; all-zero is a valid ibv_send_wr.
            let r = unsafe {
                base.add(k as usize).write(mem::zeroed());
                &mut *base.add(k as usize)
            };
            let id = tag::encode(qp.place, qp.gen, seq.wrapping_add(k), false);
            // The one that takes the last free slot is signaled, so a full queue drains.
            if let Err(e) = lower_send(&w, m, id, w.signaled || k + 1 == free, r, &mut sge[k as usize]) {
                return Err(unstage(m, k, (w.wr_id, w.mr), e));
            }
            if k > 0 {
                // SAFETY: k - 1 < k < MAX_LIST: an entry written above, within `raw`.
                unsafe { (*base.add(k as usize - 1)).next = r };
            }
            // Staged: the slot holds it from here on; committed below once the provider took it.
            m.send.put(k, w.mr, w.wr_id);
            k += 1;
        }
        if k == 0 {
            return Ok(0);
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; raw[..k] is an initialised NULL-terminated list (the last
        // entry's `next` is still zero) over `sge`, alive for the call; every piece was checked
        // by `lower_send`, and every region sits in a slot until a completion retires it.
        let ret = unsafe { ffi::ibv_post_send(m.raw.as_ptr(), base, &mut bad) };
        if ret == 0 {
            m.send.tail = seq.wrapping_add(k);
            return Ok(k as usize);
        }
        Err(list_refused(m, ret, rejected_from(bad, base, k as usize), k))
    }

    /// Posts up to [`MAX_LIST`] send-queue work requests in one `ibv_post_send` (one
    /// doorbell): every `Some` entry of `wrs`, in order. Posted entries become `None` (their
    /// regions are in the lane); entries not posted stay where they were. Returns how many were
    /// posted.
    ///
    /// # Errors
    /// As for [`Lane::post_send`], checked for every entry before anything is posted, and
    /// [`Error::InvalidArgument`] for more than [`MAX_LIST`] entries. When the provider refuses
    /// part of the list, the entries before the one it names are posted (and `None`).
    pub fn post_send_list(&mut self, qp: LaneQp, wrs: &mut [Option<SendWr>]) -> Result<usize> {
        if wrs.len() > MAX_LIST {
            return Err(Error::InvalidArgument(format!(
                "post_send_list of {} work requests: at most {MAX_LIST}",
                wrs.len()
            )));
        }
        let m = self.member(qp)?;
        let count = wrs.iter().filter(|w| w.is_some()).count() as u32;
        if count == 0 {
            return Ok(0);
        }
        let free = m.send.free();
        if count > free || m.failed.is_some() {
            return Err(refusal(m, "ibv_post_send"));
        }
        let mut raw: [MaybeUninit<ffi::ibv_send_wr>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let mut sge: [[MaybeUninit<ffi::ibv_sge>; MAX_SGE]; MAX_LIST] =
            [const { [const { MaybeUninit::uninit() }; MAX_SGE] }; MAX_LIST];
        let base: *mut ffi::ibv_send_wr = raw.as_mut_ptr().cast();
        for (k, w) in wrs.iter().flatten().enumerate() {
            let k = k as u32;
            // SAFETY: k < count <= MAX_LIST: within `raw`; all-zero is a valid ibv_send_wr.
            let r = unsafe {
                base.add(k as usize).write(mem::zeroed());
                &mut *base.add(k as usize)
            };
            let id = tag::encode(qp.place, qp.gen, m.send.tail.wrapping_add(k), false);
            // The one that takes the last free slot is signaled, so a full queue drains.
            lower_send(w, m, id, w.signaled || k + 1 == free, r, &mut sge[k as usize])?;
            if k + 1 < count {
                // SAFETY: k + 1 < count <= MAX_LIST: within `raw`.
                r.next = unsafe { base.add(k as usize + 1) };
            }
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; raw[..count] is an initialised NULL-terminated list over
        // `sge`, alive for the call; every piece was checked by `lower_send`, and every region
        // moves into a slot below before anything can reach it.
        let ret = unsafe { ffi::ibv_post_send(m.raw.as_ptr(), base, &mut bad) };
        let posted =
            if ret == 0 { count } else { rejected_from(bad, base, count as usize).map_or(count, |p| p as u32) };
        let mut k = 0;
        for w in wrs.iter_mut() {
            if k == posted {
                break;
            }
            if let Some(w) = w.take() {
                m.send.put(k, w.mr, w.wr_id);
                k += 1;
            }
        }
        m.send.tail = m.send.tail.wrapping_add(posted);
        if ret == 0 {
            return Ok(posted as usize);
        }
        Err(post_list_failed(m, ret, posted < count, "ibv_post_send"))
    }

    /// Posts one receive. Its region moves into the lane until its completion hands it back.
    ///
    /// # Errors
    /// The region comes back with the error when it was not posted: [`Error::QueueFull`];
    /// [`Error::OutOfBounds`]; [`Error::InvalidArgument`] for a region of another protection
    /// domain or without `LOCAL_WRITE`, a UD receive with no room for the [`GRH_LEN`]-byte GRH,
    /// or an unknown `qp`; [`Error::QpInError`]; [`Error::Call`] as for [`Lane::post_send`].
    #[inline(always)]
    pub fn post_recv(&mut self, qp: LaneQp, wr: RecvWr) -> std::result::Result<(), Rejected<MemoryRegion>> {
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return Err(Rejected::new(e, wr.mr)),
        };
        if m.recv.free() == 0 || m.failed.is_some() {
            return Err(Rejected::new(refusal_recv(m), wr.mr));
        }
        let seq = m.recv.tail;
        let mut sge = MaybeUninit::<ffi::ibv_sge>::uninit();
        let mut raw = ffi::ibv_recv_wr {
            wr_id: tag::encode(qp.place, qp.gen, seq, true),
            next: std::ptr::null_mut(),
            sg_list: sge.as_mut_ptr(),
            num_sge: 0,
        };
        match lower_recv(&wr, m, &mut sge) {
            Ok(n) => raw.num_sge = n,
            Err(e) => return Err(Rejected::new(e, wr.mr)),
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `raw` is one NULL-terminated receive over `sge`, alive for
        // the call; the piece was checked (bounds, PD, LOCAL_WRITE), and the region moves into
        // the slot below, out of Rust's reach until its completion.
        let ret = unsafe { ffi::ibv_post_recv(m.raw.as_ptr(), &mut raw, &mut bad) };
        if ret == 0 {
            m.recv.put(0, wr.mr, wr.wr_id);
            m.recv.tail = seq.wrapping_add(1);
            return Ok(());
        }
        post_failed_one(m, ret, std::ptr::eq(bad, &raw), (wr.wr_id, wr.mr), false)
    }

    /// Posts up to [`MAX_LIST`] receives in one `ibv_post_recv`, as
    /// [`Lane::post_send_list`] posts sends.
    ///
    /// # Errors
    /// As for [`Lane::post_recv`] and [`Lane::post_send_list`].
    pub fn post_recv_list(&mut self, qp: LaneQp, wrs: &mut [Option<RecvWr>]) -> Result<usize> {
        if wrs.len() > MAX_LIST {
            return Err(Error::InvalidArgument(format!(
                "post_recv_list of {} receives: at most {MAX_LIST}",
                wrs.len()
            )));
        }
        let m = self.member(qp)?;
        let count = wrs.iter().filter(|w| w.is_some()).count() as u32;
        if count == 0 {
            return Ok(0);
        }
        if count > m.recv.free() || m.failed.is_some() {
            return Err(refusal_recv(m));
        }
        let mut raw: [MaybeUninit<ffi::ibv_recv_wr>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let mut sge: [MaybeUninit<ffi::ibv_sge>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let base: *mut ffi::ibv_recv_wr = raw.as_mut_ptr().cast();
        for (k, w) in wrs.iter().flatten().enumerate() {
            let k = k as u32;
            let num_sge = lower_recv(w, m, &mut sge[k as usize])?;
            let next = if k + 1 < count {
                // SAFETY: k + 1 < count <= MAX_LIST: within `raw`.
                unsafe { base.add(k as usize + 1) }
            } else {
                std::ptr::null_mut()
            };
            let entry = ffi::ibv_recv_wr {
                wr_id: tag::encode(qp.place, qp.gen, m.recv.tail.wrapping_add(k), true),
                next,
                sg_list: sge[k as usize].as_mut_ptr(),
                num_sge,
            };
            // SAFETY: k < count <= MAX_LIST: within `raw`.
            unsafe { base.add(k as usize).write(entry) };
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in post_send_list: a well-formed list over live arrays, every piece
        // checked, every region moved into a slot below.
        let ret = unsafe { ffi::ibv_post_recv(m.raw.as_ptr(), base, &mut bad) };
        let posted =
            if ret == 0 { count } else { rejected_from(bad, base, count as usize).map_or(count, |p| p as u32) };
        let mut k = 0;
        for w in wrs.iter_mut() {
            if k == posted {
                break;
            }
            if let Some(w) = w.take() {
                m.recv.put(k, w.mr, w.wr_id);
                k += 1;
            }
        }
        m.recv.tail = m.recv.tail.wrapping_add(posted);
        if ret == 0 {
            return Ok(posted as usize);
        }
        Err(post_list_failed(m, ret, posted < count, "ibv_post_recv"))
    }

    /// Hands out the next completion without waiting: a region comes back with each
    /// ([`Completion::take_region`]). A signaled completion that retires earlier unsignaled work
    /// requests hands those out first, one per call, oldest first, then itself. `None` when the
    /// CQ holds nothing now. [`Lane::poll_with`] does the same without moving each completion
    /// out of the lane's frame.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    #[inline(always)]
    pub fn poll(&mut self) -> Result<Option<Completion>> {
        let mut out = None;
        self.poll_with(1, |c| out = Some(c))?;
        Ok(out)
    }

    /// Hands up to `max` completions to `f`, oldest first, without waiting; returns how many.
    /// The fast way to reap: each [`Completion`] is built where `f` (inlined) reads it, so what
    /// `f` does not look at is never decoded. The lane is consistent whenever `f` runs: if `f`
    /// panics, the completion it was given is dropped (its region with it: the device is done
    /// with it) and every other one stays for the next poll.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails (after handing out what was reaped before).
    #[inline(always)]
    pub fn poll_with(&mut self, max: usize, mut f: impl FnMut(Completion)) -> Result<usize> {
        let mut done = 0;
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
                // SAFETY: the CQ is alive (held by `self.cq`); `wcs` has room for POLL_BATCH
                // entries, which the provider writes.
                let got =
                    unsafe { ffi::ibv_poll_cq(self.cq_raw.as_ptr(), POLL_BATCH as i32, self.wcs.as_mut_ptr().cast()) };
                if got <= 0 {
                    if got < 0 {
                        return Err(poll_failed(got));
                    }
                    break;
                }
                self.n = got as u8;
                self.at = 0;
            }
            let i = self.at;
            self.at += 1;
            done += self.start(i, &mut f) as usize;
        }
        Ok(done)
    }

    /// Starts on the completion at `wcs[i]`: hands `f` the completion of the one slot it
    /// retires, or of the convenient path (routed), and returns true; returns false when it
    /// retires several (then `retiring` says which, for `retire`) or nothing (stale).
    #[inline(always)]
    fn start(&mut self, i: u8, f: &mut impl FnMut(Completion)) -> bool {
        // SAFETY: `i < n`, and the provider (or `refill_from_deferred`) initialised wcs[..n].
        let Some(wc) = self.wcs.get(i as usize).map(|w| unsafe { w.assume_init_ref() }) else { return false };
        if wc.wr_id & tag::CRATE != 0 {
            return match self.convenient(i) {
                Some(c) => {
                    f(c);
                    true
                }
                None => false,
            };
        }
        let (recv, gen, place, seq) = tag::decode(wc.wr_id);
        let m = match self.members.get_mut(place as usize) {
            Some(Some(m)) if m.gen == gen && m.qp_num == wc.qp_num => m,
            _ => return false,
        };
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            // Any error but a flush puts the QP in the error state (a flush says it is there).
            m.failed.get_or_insert(wc.status);
        }
        let slots = if recv { &mut m.recv } else { &mut m.send };
        if !slots.holds(seq) {
            return false;
        }
        if slots.head == seq {
            // The common case: it retires one slot.
            let (mr, wr_id) = slots.pop();
            let flags = if recv { RECV | SIGNALED | LANE } else { SIGNALED | LANE };
            f(Completion { mr, wr_id, f: Fields::of(wc), place, gen, flags });
            return true;
        }
        self.retiring = Some(Retiring { place, recv, upto: seq, wc: i });
        false
    }

    /// Hands up to `room` slots of a completion that retires several to `f`, oldest first (the
    /// unsignaled ones, then the one it names); returns how many.
    #[inline(always)]
    fn retire(&mut self, r: Retiring, room: usize, f: &mut impl FnMut(Completion)) -> usize {
        let Some(Some(m)) = self.members.get_mut(r.place as usize) else {
            // Never: a QP stays in place while its completion is handed out.
            self.retiring = None;
            return 0;
        };
        let (gen, recv) = (m.gen, if r.recv { RECV } else { 0 });
        let slots = if r.recv { &mut m.recv } else { &mut m.send };
        let mut k = 0;
        while k < room && slots.head != r.upto {
            // An unsignaled work request that ran before the one the completion names.
            let (mr, wr_id) = slots.pop();
            f(Completion { mr, wr_id, f: Fields::default(), place: r.place, gen, flags: recv | LANE });
            k += 1;
        }
        if k < room {
            let (mr, wr_id) = slots.pop();
            self.retiring = None;
            // SAFETY: `r.wc < n`, initialised (see `start`), and not overwritten while retiring.
            let fields = self.wcs.get(r.wc as usize).map(|w| Fields::of(unsafe { w.assume_init_ref() }));
            f(Completion {
                mr,
                wr_id,
                f: fields.unwrap_or_default(),
                place: r.place,
                gen,
                flags: recv | SIGNALED | LANE,
            });
            k += 1;
        }
        k
    }

    /// A completion of work posted through the convenient path of a QP on this CQ: routed as
    /// the CQ's own poll routes it (its slot retired, its region released).
    #[cold]
    #[inline(never)]
    fn convenient(&mut self, i: u8) -> Option<Completion> {
        // SAFETY: as in `start`.
        let wc = unsafe { self.wcs.get(i as usize)?.assume_init_ref() };
        let (done, _) = self.cq.router().route(wc)?;
        let raw = done.to_raw();
        let flags = if done.queue() == WorkQueue::Recv { RECV | SIGNALED } else { SIGNALED };
        Some(Completion { mr: None, wr_id: done.wr_id(), f: Fields::of(&raw), place: 0, gen: 0, flags })
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
    fn defer_buffer(&mut self) {
        let first = match self.retiring.take() {
            Some(r) => r.wc,
            None => self.at,
        };
        for i in (first..self.n).rev() {
            // SAFETY: i < n: initialised; read once, since the buffer is emptied below.
            self.deferred.push_front(unsafe { self.wcs[i as usize].assume_init_read() });
        }
        self.n = 0;
        self.at = 0;
    }

    /// Moves `qp` to the error state: everything it has posted completes (flushed), and posts
    /// are refused from then on.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_modify_qp` fails; [`Error::InvalidArgument`] for an unknown `qp`.
    pub fn set_error(&mut self, qp: LaneQp) -> Result<()> {
        self.member(qp)?.set_error()
    }

    /// Feeds a CM event of `qp`'s connection (read from its channel by an event loop): a
    /// `DISCONNECTED` moves the QP to the error state, so its posted work flushes. Other
    /// events, and UD QPs, are ignored.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`.
    pub fn handle_event(&mut self, qp: LaneQp, ev: &CmEvent) -> Result<()> {
        let m = self.member(qp)?;
        if let Owner::Rc(c) = &mut m.owner {
            c.handle_event(ev);
            if c.is_disconnected() {
                m.failed.get_or_insert(ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
            }
        }
        Ok(())
    }

    /// Detaches `qp` and destroys it: moves it to the error state, reaps its flushed work for
    /// up to 2 s (their regions are released: poll until [`Lane::outstanding`] is zero first
    /// to get them back), then destroys the QP. Completions of other QPs met on the way are
    /// kept for [`Lane::poll`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`. Teardown itself does not fail: what it
    /// cannot release safely it leaks.
    pub fn remove(&mut self, qp: LaneQp) -> Result<()> {
        self.member(qp)?;
        self.drain(Some(qp.place));
        let place = qp.place as usize;
        self.gens[place] = (self.gens[place] + 1) & tag::GEN_MASK;
        drop(self.members[place].take());
        Ok(())
    }

    /// Moves `only` (or every QP) to the error state and reaps their flushed work within the
    /// bound; completions of other QPs are kept, in order, for later polls.
    fn drain(&mut self, only: Option<u16>) {
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
            // SAFETY: the CQ is alive; `buf` has room for POLL_BATCH entries.
            let got = unsafe { ffi::ibv_poll_cq(self.cq_raw.as_ptr(), POLL_BATCH as i32, buf.as_mut_ptr().cast()) };
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
    }

    /// Retires what `wc` names when it is a completion of a QP being torn down (the regions are
    /// dropped: the device is done with them); false for any other completion.
    fn retire_for_teardown(&mut self, wc: &ffi::ibv_wc, mine: &impl Fn(u16) -> bool) -> bool {
        if wc.wr_id & tag::CRATE != 0 {
            return false;
        }
        let (recv, gen, place, seq) = tag::decode(wc.wr_id);
        if !mine(place) {
            return false;
        }
        let Some(Some(m)) = self.members.get_mut(place as usize) else { return true };
        if m.gen != gen || m.qp_num != wc.qp_num {
            return true; // stale: retires nothing
        }
        let slots = if recv { &mut m.recv } else { &mut m.send };
        if slots.holds(seq) {
            while slots.head != seq.wrapping_add(1) {
                drop(slots.pop());
            }
        }
        true
    }
}

impl Drop for Lane {
    /// Moves every QP to the error state, reaps their flushes within the bound, then destroys
    /// them (regions still held then are released with the QP, see the module docs), and only
    /// then the CQ.
    fn drop(&mut self) {
        if self.members.iter().any(Option::is_some) {
            self.drain(None);
        }
        self.members.clear();
    }
}

/// Gives back the `k` staged (uncommitted) work requests of a list that is not posted, and
/// `w`, with `error`.
#[cold]
#[inline(never)]
fn unstage(m: &mut Member, k: u32, w: (u64, MemoryRegion), error: Error) -> RejectedList {
    let mut returned = take_staged(&mut m.send, 0, k);
    returned.push(w);
    RejectedList { error, returned }
}

/// Takes the staged slots `tail + from .. tail + to` back out.
fn take_staged(slots: &mut Slots, from: u32, to: u32) -> Vec<(u64, MemoryRegion)> {
    let mut out = Vec::new();
    for j in from..to {
        let i = (slots.tail.wrapping_add(j) & slots.mask) as usize;
        if let Some(s) = slots.slots.get_mut(i) {
            if let Some(mr) = s.mr.take() {
                out.push((s.wr_id, mr));
            }
        }
    }
    out
}

/// A list of `k` staged work requests the provider refused from `named` on (`None`: it did not
/// say, so all are kept as posted and the QP goes to the error state).
#[cold]
#[inline(never)]
fn list_refused(m: &mut Member, ret: i32, named: Option<usize>, k: u32) -> RejectedList {
    let posted = named.map_or(k, |p| p as u32);
    let returned = take_staged(&mut m.send, posted, k);
    m.send.tail = m.send.tail.wrapping_add(posted);
    RejectedList { error: post_list_failed(m, ret, named.is_some(), "ibv_post_send"), returned }
}

#[cold]
fn list_too_long(k: u32, free: u32) -> Error {
    if k == free {
        Error::QueueFull { queue: "send", depth: free }
    } else {
        Error::InvalidArgument(format!("post_send_iter: more than {MAX_LIST} work requests in one list"))
    }
}

/// Lowers a send-queue work request into `out` (a zeroed `ibv_send_wr`) and `sge`, checking it
/// against the QP `m`: the one place where a lane's work request becomes the verbs' form.
#[inline(always)]
fn lower_send(
    w: &SendWr,
    m: &Member,
    wr_id: u64,
    signaled: bool,
    out: &mut ffi::ibv_send_wr,
    sge: &mut [MaybeUninit<ffi::ibv_sge>; MAX_SGE],
) -> Result<()> {
    if let Some(why) = w.bad {
        return Err(bad_request("post_send", why));
    }
    let inner = w.mr.inner();
    if !inner.on_pd(&m.pd) {
        return Err(other_pd());
    }
    let n = w.n as usize;
    if n > 1 && n > m.max_send_sge as usize {
        return Err(too_many_pieces(n, m.max_send_sge));
    }
    let (base, size, lkey) = (inner.addr(), inner.len() as u64, inner.lkey());
    let mut total = 0u64;
    for (k, &(start, len)) in w.pieces[..n.min(MAX_SGE)].iter().enumerate() {
        if start + len as u64 > size {
            return Err(out_of_region(start, len, size));
        }
        sge[k].write(ffi::ibv_sge { addr: base + start, length: len, lkey });
        total += len as u64;
    }
    use ffi::ibv_wr_opcode::*;
    let (opcode, writes) = match (w.kind, w.imm.is_some()) {
        (Kind::Send, false) => (IBV_WR_SEND, false),
        (Kind::Send, true) => (IBV_WR_SEND_WITH_IMM, false),
        (Kind::Write { remote, offset }, imm) => {
            out.wr.rdma = ffi::rdma_t { remote_addr: remote_at(&remote, offset, total)?, rkey: remote.rkey };
            (if imm { IBV_WR_RDMA_WRITE_WITH_IMM } else { IBV_WR_RDMA_WRITE }, false)
        }
        (Kind::Read { remote, offset }, false) => {
            out.wr.rdma = ffi::rdma_t { remote_addr: remote_at(&remote, offset, total)?, rkey: remote.rkey };
            (IBV_WR_RDMA_READ, true)
        }
        (Kind::FetchAdd { remote, offset, add }, false) => {
            out.wr.atomic = ffi::atomic_t {
                remote_addr: atomic_target(&remote, offset)?,
                compare_add: add,
                swap: 0,
                rkey: remote.rkey,
            };
            (IBV_WR_ATOMIC_FETCH_AND_ADD, true)
        }
        (Kind::CompareSwap { remote, offset, compare, swap }, false) => {
            out.wr.atomic = ffi::atomic_t {
                remote_addr: atomic_target(&remote, offset)?,
                compare_add: compare,
                swap,
                rkey: remote.rkey,
            };
            (IBV_WR_ATOMIC_CMP_AND_SWP, true)
        }
        _ => return Err(Error::InvalidArgument("post_send: an RDMA READ or atomic carries no immediate data".into())),
    };
    if writes && !w.mr.access().contains(AccessFlags::LOCAL_WRITE) {
        return Err(needs_local_write());
    }
    if m.is_ud() {
        let (Kind::Send, Some(d)) = (w.kind, w.dest) else { return Err(ud_needs_dest(w.dest.is_none())) };
        let Some(dest) = m.dests.get(d.index as usize).filter(|_| d.qp.gen == m.gen) else {
            return Err(Error::InvalidArgument("post_send: the DestKey is not this QP's (Lane::add_dest)".into()));
        };
        if total > m.mtu as u64 {
            return Err(too_long(total, m.mtu));
        }
        out.wr.ud = ffi::ud_t { ah: dest.ah, remote_qpn: dest.qpn, remote_qkey: dest.qkey };
    } else if w.dest.is_some() {
        return Err(ud_needs_dest(false));
    }
    if total > u32::MAX as u64 {
        return Err(bad_request("post_send", "a work request moves at most 4 GiB"));
    }
    out.wr_id = wr_id;
    out.sg_list = sge.as_mut_ptr().cast();
    // A zero-length one has no scatter entry (some providers read a count of 0 as 2 GiB).
    out.num_sge = if total == 0 { 0 } else { n as i32 };
    out.opcode = opcode;
    if let Some(imm) = w.imm {
        out.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
    }
    use ffi::ibv_send_flags as f;
    out.send_flags =
        if signaled { f::IBV_SEND_SIGNALED.0 } else { 0 } | if w.solicited { f::IBV_SEND_SOLICITED.0 } else { 0 };
    Ok(())
}

/// Lowers a receive into `sge`, checking it against `m`; returns its scatter count.
#[inline(always)]
fn lower_recv(w: &RecvWr, m: &Member, sge: &mut MaybeUninit<ffi::ibv_sge>) -> Result<i32> {
    let (start, len) = match w.piece {
        Ok(p) => p,
        Err(why) => return Err(bad_request("post_recv", why)),
    };
    let inner = w.mr.inner();
    if !inner.on_pd(&m.pd) {
        return Err(other_pd());
    }
    let size = inner.len() as u64;
    if start + len as u64 > size {
        return Err(out_of_region(start, len, size));
    }
    if !w.mr.access().contains(AccessFlags::LOCAL_WRITE) {
        return Err(needs_local_write());
    }
    if m.is_ud() && (len as usize) < GRH_LEN {
        return Err(no_room_for_grh(len));
    }
    sge.write(ffi::ibv_sge { addr: inner.addr() + start, length: len, lkey: inner.lkey() });
    Ok((len != 0) as i32)
}

/// The remote address of `offset..offset + len` of `remote`, checked against its length.
#[inline(always)]
fn remote_at(remote: &RemoteRegion, offset: u64, len: u64) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= remote.len => Ok(remote.addr.wrapping_add(offset)),
        _ => Err(out_of_remote(offset, len, remote.len)),
    }
}

#[cold]
fn out_of_remote(offset: u64, len: u64, size: u64) -> Error {
    Error::OutOfBounds { what: "remote region", offset, len, size }
}

#[cold]
fn out_of_region(offset: u64, len: u32, size: u64) -> Error {
    Error::OutOfBounds { what: "memory region", offset, len: len as u64, size }
}

#[cold]
fn bad_request(op: &str, why: &str) -> Error {
    Error::InvalidArgument(format!("{op}: {why}"))
}

#[cold]
fn atomic_target(remote: &RemoteRegion, offset: u64) -> Result<u64> {
    let addr = remote.at(offset, 8)?;
    if addr % 8 != 0 {
        return Err(Error::InvalidArgument(format!(
            "post_send: an atomic's target {addr:#x} is not 8-byte aligned (the device would fail it)"
        )));
    }
    Ok(addr)
}

#[cold]
fn no_room_for_grh(len: u32) -> Error {
    Error::InvalidArgument(format!(
        "post_recv: a UD receive of {len} bytes has no room for the {GRH_LEN}-byte GRH the device writes first"
    ))
}

#[cold]
fn too_long(len: u64, mtu: u32) -> Error {
    Error::MessageTooLong { len, mtu }
}

#[cold]
fn other_pd() -> Error {
    Error::InvalidArgument("post: the memory region is registered on another protection domain than the QP".into())
}

#[cold]
fn needs_local_write() -> Error {
    Error::InvalidArgument(
        "post: the device writes this region (receive, RDMA READ target or atomic result): register it with LOCAL_WRITE"
            .into(),
    )
}

#[cold]
fn too_many_pieces(n: usize, max: u32) -> Error {
    Error::InvalidArgument(format!(
        "post_send: a work request of {n} pieces exceeds the QP's limit of {max}: create it with QpInit::max_send_sge"
    ))
}

#[cold]
fn ud_needs_dest(missing: bool) -> Error {
    Error::InvalidArgument(if missing {
        "post_send: a UD QP sends datagrams only, each to a destination (SendWr::to, Lane::add_dest)".into()
    } else {
        "post_send: an RC QP takes no destination, and a UD QP no RDMA or atomic".into()
    })
}

/// Why a post is refused before it reaches the provider: a full send queue, or a QP in error.
#[cold]
fn refusal(m: &Member, op: &'static str) -> Error {
    match m.failed {
        Some(status) => qp_in_error(m, status, op),
        None => Error::QueueFull { queue: "send", depth: m.send.depth },
    }
}

#[cold]
fn refusal_recv(m: &Member) -> Error {
    match m.failed {
        Some(status) => qp_in_error(m, status, "ibv_post_recv"),
        None => Error::QueueFull { queue: "receive", depth: m.recv.depth },
    }
}

fn qp_in_error(m: &Member, status: u32, op: &'static str) -> Error {
    let addr = match &m.owner {
        Owner::Rc(c) => c.peer_addr(),
        Owner::Ud(_) => None,
    };
    let cause = if status == ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
        "the lane moved it there (Lane::set_error, or the peer disconnected)".to_string()
    } else {
        let st = WcStatus::from_raw(status);
        format!("a completion failed with {st}{}", st.hint().map(|h| format!(" ({h})")).unwrap_or_default())
    };
    Error::QpInError { op, addr, cause }
}

#[cold]
fn poll_failed(ret: i32) -> Error {
    Error::call("ibv_poll_cq", if ret == -1 { libc::EIO } else { ret.saturating_neg() }, None)
}

/// What is left to do when the provider refused a single work request: give it back when the
/// provider named it (`named`), or keep it (it may run) and move the QP to the error state.
#[cold]
#[inline(never)]
fn post_failed_one(
    m: &mut Member,
    ret: i32,
    named: bool,
    (wr_id, mr): (u64, MemoryRegion),
    send: bool,
) -> std::result::Result<(), Rejected<MemoryRegion>> {
    let op = if send { "ibv_post_send" } else { "ibv_post_recv" };
    if named {
        return Err(Rejected::new(Error::call(op, ret, None), mr));
    }
    let slots = if send { &mut m.send } else { &mut m.recv };
    slots.put(0, mr, wr_id);
    slots.tail = slots.tail.wrapping_add(1);
    Err(Rejected::kept(post_list_failed(m, ret, false, op)))
}

/// The error of a post the provider refused; when it did not say how far it got (`known`
/// false), everything staged was kept as posted and the QP is moved to the error state, so the
/// flush retires it.
#[cold]
fn post_list_failed(m: &mut Member, ret: i32, known: bool, op: &'static str) -> Error {
    if known {
        return Error::call(op, ret, None);
    }
    let flushed = m.set_error().is_ok();
    Error::Call {
        op,
        addr: None,
        hint: Some(if flushed {
            "the provider failed the post without saying which work requests it took: they are kept until the flush retires them, and the QP was moved to the error state"
        } else {
            "the provider failed the post without saying which work requests it took, and the QP could not be moved to the error state: its regions stay held until the QP is destroyed"
        }),
        source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_never_carry_the_convenient_bit() {
        for (place, gen, seq, recv) in [(0, 0, 0, false), (65535, tag::GEN_MASK, u32::MAX, true), (7, 3, 12345, false)]
        {
            let w = tag::encode(place, gen, seq, recv);
            assert_eq!(w & tag::CRATE, 0, "{w:#x}");
            assert_eq!(tag::decode(w), (recv, gen, place, seq));
        }
    }

    #[test]
    fn pieces_refuse_reversed_and_huge_ranges() {
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 5..4;
        assert!(piece(&reversed).is_err());
        assert_eq!(piece(&(4..10)), Ok((4, 6)));
        assert!(piece(&(0..(u32::MAX as usize + 1))).is_err());
    }

    #[test]
    fn slots_wrap_and_refuse_sequence_numbers_outside_the_window() {
        let mut s = Slots::new(3);
        assert_eq!((s.slots.len(), s.free()), (4, 3));
        // Start near the wrap of the 32-bit sequence numbers.
        s.head = u32::MAX - 1;
        s.tail = u32::MAX - 1;
        for k in 0..3 {
            assert!(!s.holds(s.tail.wrapping_add(k)));
        }
        s.tail = s.tail.wrapping_add(3);
        assert_eq!(s.free(), 0);
        assert!(s.holds(u32::MAX - 1) && s.holds(u32::MAX) && s.holds(0));
        assert!(!s.holds(1) && !s.holds(u32::MAX - 2));
        let _ = s.pop();
        assert!(!s.holds(u32::MAX - 1), "a retired one is stale");
        assert_eq!(s.free(), 1);
    }
}
