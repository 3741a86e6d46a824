use super::refused::{
    bad_request, needs_local_write, no_room_for_grh, one_piece_only, other_pd, out_of_region, out_of_remote, too_long,
    too_many_pieces, too_many_recv_pieces, ud_needs_dest, unaligned_atomic, Rejected,
};
use super::{DestKey, Member};
use crate::error::Error;
use crate::error::Result;
use crate::verbs::ah::GRH_LEN;
use crate::verbs::mr::AccessFlags;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::mr::RemoteRegion;
use crate::verbs::wr::MAX_SGE;
use rdma_sys as ffi;
use std::fmt;
use std::mem::MaybeUninit;
use std::ops::Range;

/// A range of a region, as a post names it: (start, length), or why it cannot be one.
pub(super) type Piece = (u64, u32);

/// Turns a range into a piece; the bounds against the region are checked where it is built.
#[inline(always)]
pub(super) fn piece(r: &Range<usize>) -> std::result::Result<Piece, &'static str> {
    if r.start > r.end {
        return Err("a range is reversed");
    }
    match u32::try_from(r.end - r.start) {
        Ok(len) => Ok((r.start as u64, len)),
        Err(_) => Err("a work request moves at most 4 GiB"),
    }
}

/// Why a work request cannot be posted, found where it was built and reported by the post
/// (so that building one stays infallible and chainable).
#[derive(Clone, Copy, Debug)]
pub(super) enum Defect {
    Bad(&'static str),
    OutOfRegion { offset: u64, len: u32, size: u64 },
    OutOfRemote { offset: u64, len: u64, size: u64 },
    NeedsLocalWrite,
    Unaligned(u64),
}

impl Defect {
    /// Inlined, so that the defect's fields go to the (cold) error constructors as values: a
    /// call that took the defect's address would keep the whole work request holding it in
    /// memory on the post's common path, each field stored as it is built.
    #[inline(always)]
    pub(super) fn error(self, op: &str) -> Error {
        match self {
            Defect::Bad(why) => bad_request(op, why),
            Defect::OutOfRegion { offset, len, size } => out_of_region(offset, len, size),
            Defect::OutOfRemote { offset, len, size } => out_of_remote(offset, len, size),
            Defect::NeedsLocalWrite => needs_local_write(),
            Defect::Unaligned(addr) => unaligned_atomic(addr),
        }
    }
}

/// Why a post refuses a work request, found by `check_lower` (a [`SendWr`]) or `check` (a
/// [`RecvWr`]): as values, so that the error, and the `Rejected` that hands the region back,
/// are built out of line (`Refusal::rejected`) where the region is passed, never kept across a
/// call on the post's path.
#[derive(Clone, Copy, Debug)]
pub(super) enum Refusal {
    Defect(Defect),
    OtherPd,
    TooManyPieces { n: u32, max: u32, read: bool },
    TooManyRecvPieces { n: u32, max: u32 },
    UdNeedsDest { missing: bool },
    NotThisQpsDest,
    TooLong { len: u64, mtu: u32 },
    NoRoomForGrh(u32),
}

impl Refusal {
    /// The error a post of `op` reports for it.
    #[cold]
    #[inline(never)]
    pub(super) fn error(self, op: &str) -> Error {
        match self {
            Refusal::Defect(d) => d.error(op),
            Refusal::OtherPd => other_pd(),
            Refusal::TooManyPieces { n, max, read } => too_many_pieces(n as usize, max, read),
            Refusal::TooManyRecvPieces { n, max } => too_many_recv_pieces(n, max, false),
            Refusal::UdNeedsDest { missing } => ud_needs_dest(missing),
            Refusal::NotThisQpsDest => {
                Error::InvalidArgument("post_send: the DestKey is not this QP's (Lane::add_dest)".into())
            }
            Refusal::TooLong { len, mtu } => too_long(len, mtu),
            Refusal::NoRoomForGrh(len) => no_room_for_grh(len),
        }
    }

    /// The error, with `mr` handed back.
    #[cold]
    #[inline(never)]
    pub(super) fn rejected(self, op: &str, mr: MemoryRegion) -> Rejected<MemoryRegion> {
        Rejected::new(self.error(op), mr)
    }
}

/// A send-queue work request of a lane: a send, an RDMA WRITE or READ, or an atomic, whose
/// local memory is pieces of one [`MemoryRegion`], moved into the lane when it is posted.
///
/// It is built already lowered: the constructors check the pieces against the region and the
/// remote range against the remote region, and write the provider's work request and scatter
/// list as a raw program would; a post adds only what depends on the QP (its protection
/// domain, its piece limit, a UD destination) and on the lane (the `wr_id` tag, the signaled
/// bit).
pub struct SendWr {
    pub(super) mr: MemoryRegion,
    pub(super) opcode: u32,
    /// `IBV_SEND_SOLICITED` or nothing (the signaled bit is decided at post).
    pub(super) flags: u32,
    /// Immediate data, in network order.
    pub(super) imm: u32,
    /// The remote address (RDMA and atomics) and key.
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
    /// The remote region's length and the offset aimed at in it (RDMA and atomics): what a
    /// prepared request re-aims within ([`PreparedSend::aim`]).
    pub(super) remote_len: u64,
    pub(super) remote_offset: u64,
    /// An atomic's operands.
    pub(super) compare_add: u64,
    pub(super) swap: u64,
    pub(super) sge: [MaybeUninit<ffi::ibv_sge>; MAX_SGE],
    pub(super) n: u8,
    pub(super) total: u64,
    pub(super) defect: Option<Defect>,
    pub(super) wr_id: u64,
    pub(super) signaled: bool,
    pub(super) dest: Option<DestKey>,
}

impl fmt::Debug for SendWr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendWr")
            .field("opcode", &self.opcode)
            .field("pieces", &self.n)
            .field("len", &self.total)
            .field("wr_id", &self.wr_id)
            .field("signaled", &self.signaled)
            .field("defect", &self.defect)
            .finish()
    }
}

use ffi::ibv_wr_opcode::*;

impl SendWr {
    /// A request of no piece yet.
    #[inline(always)]
    fn start(mr: MemoryRegion, opcode: u32, writes: bool) -> SendWr {
        let defect = (writes && !mr.access().contains(AccessFlags::LOCAL_WRITE)).then_some(Defect::NeedsLocalWrite);
        SendWr {
            mr,
            opcode,
            flags: 0,
            imm: 0,
            remote_addr: 0,
            rkey: 0,
            remote_len: 0,
            remote_offset: 0,
            compare_add: 0,
            swap: 0,
            sge: [const { MaybeUninit::uninit() }; MAX_SGE],
            n: 0,
            total: 0,
            defect,
            wr_id: 0,
            signaled: true,
            dest: None,
        }
    }

    /// Adds `range` of the region as the next piece, checked against the region.
    #[inline(always)]
    fn push(&mut self, range: &Range<usize>) {
        let (start, len) = match piece(range) {
            Ok(p) => p,
            Err(why) => {
                self.defect = Some(Defect::Bad(why));
                return;
            }
        };
        let size = self.mr.len() as u64;
        if start + len as u64 > size {
            self.defect = Some(Defect::OutOfRegion { offset: start, len, size });
            return;
        }
        let k = self.n as usize;
        if k >= MAX_SGE {
            self.defect = Some(Defect::Bad("a work request names 1 to 4 pieces (rdma_cm::MAX_SGE)"));
            return;
        }
        self.sge[k].write(ffi::ibv_sge { addr: self.mr.addr() + start, length: len, lkey: self.mr.lkey() });
        self.n += 1;
        self.total += len as u64;
    }

    /// A request of one piece.
    #[inline(always)]
    fn one(mr: MemoryRegion, opcode: u32, writes: bool, range: Range<usize>) -> SendWr {
        let mut w = Self::start(mr, opcode, writes);
        w.push(&range);
        w
    }

    /// A request of the pieces `ranges`.
    ///
    /// Piece `k` of `ranges` goes to entry `k` of the scatter list (a piece refused leaves its
    /// entry unwritten, and the request carries its defect, so it is never posted): with
    /// `ranges` known where it is built, every index is a constant and the compiler keeps the
    /// list in registers until the post writes it out. The checks, and the defect reported, are
    /// `push`'s for each piece in order, then those of the list as a whole.
    #[inline(always)]
    fn gather(mr: MemoryRegion, opcode: u32, writes: bool, ranges: &[Range<usize>]) -> SendWr {
        let mut w = Self::start(mr, opcode, writes);
        if ranges.is_empty() || ranges.len() > MAX_SGE {
            w.defect = Some(Defect::Bad("a work request names 1 to 4 pieces (rdma_cm::MAX_SGE)"));
            return w;
        }
        let (addr, lkey, size) = (w.mr.addr(), w.mr.lkey(), w.mr.len() as u64);
        // The pieces written, and whether one of them is empty.
        let (mut written, mut empty) = (0u8, false);
        for (entry, range) in w.sge.iter_mut().zip(ranges) {
            match piece(range) {
                Err(why) => w.defect = Some(Defect::Bad(why)),
                Ok((start, len)) if start + len as u64 > size => {
                    w.defect = Some(Defect::OutOfRegion { offset: start, len, size })
                }
                Ok((start, len)) => {
                    entry.write(ffi::ibv_sge { addr: addr + start, length: len, lkey });
                    w.total += len as u64;
                    written += 1;
                    empty |= len == 0;
                }
            }
        }
        // Without a defect every piece was written: entries `..n` are initialised.
        w.n = written;
        if written > 1 && empty {
            w.defect = Some(Defect::Bad(
                "a list of several pieces takes non-empty ones only (some providers read 0 bytes as 2 GiB)",
            ));
        }
        if w.total > u32::MAX as u64 {
            w.defect = Some(Defect::Bad("a work request moves at most 4 GiB"));
        }
        w
    }

    /// Aims an RDMA WRITE or READ of the pieces at `remote` + `offset`, checked against it.
    #[inline(always)]
    fn at(mut self, remote: &RemoteRegion, offset: u64) -> SendWr {
        match offset.checked_add(self.total) {
            Some(end) if end <= remote.len => {
                self.remote_addr = remote.addr.wrapping_add(offset);
                self.rkey = remote.rkey;
                (self.remote_len, self.remote_offset) = (remote.len, offset);
            }
            _ => self.defect = Some(Defect::OutOfRemote { offset, len: self.total, size: remote.len }),
        }
        self
    }

    /// Aims an atomic at the 8 bytes at `remote` + `offset`, checked (bounds, alignment).
    #[inline(always)]
    fn atomic_at(mut self, remote: &RemoteRegion, offset: u64, compare_add: u64, swap: u64) -> SendWr {
        match offset.checked_add(8) {
            Some(end) if end <= remote.len => {
                let addr = remote.addr.wrapping_add(offset);
                if addr % 8 != 0 {
                    self.defect = Some(Defect::Unaligned(addr));
                }
                (self.remote_addr, self.rkey, self.compare_add, self.swap) = (addr, remote.rkey, compare_add, swap);
                (self.remote_len, self.remote_offset) = (remote.len, offset);
            }
            _ => self.defect = Some(Defect::OutOfRemote { offset, len: 8, size: remote.len }),
        }
        self
    }

    /// Sends `mr[range]`.
    #[inline(always)]
    pub fn send(mr: MemoryRegion, range: Range<usize>) -> SendWr {
        Self::one(mr, IBV_WR_SEND, false, range)
    }

    /// Sends the concatenation of `ranges` of `mr`, in order (at most [`MAX_SGE`], and at most
    /// the QP's [`QpInit::max_send_sge`](crate::QpInit::max_send_sge)).
    #[inline]
    pub fn send_sg(mr: MemoryRegion, ranges: &[Range<usize>]) -> SendWr {
        Self::gather(mr, IBV_WR_SEND, false, ranges)
    }

    /// Writes `mr[range]` to `remote` at `offset` (RDMA WRITE).
    #[inline(always)]
    pub fn write(mr: MemoryRegion, range: Range<usize>, remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::one(mr, IBV_WR_RDMA_WRITE, false, range).at(remote, offset)
    }

    /// Writes the concatenation of `ranges` of `mr` to `remote` at `offset` (a gathered RDMA
    /// WRITE).
    #[inline(always)]
    pub fn write_sg(mr: MemoryRegion, ranges: &[Range<usize>], remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::gather(mr, IBV_WR_RDMA_WRITE, false, ranges).at(remote, offset)
    }

    /// Reads `remote` at `offset` into `mr[range]` (RDMA READ). The region needs
    /// [`AccessFlags::LOCAL_WRITE`].
    #[inline]
    pub fn read(mr: MemoryRegion, range: Range<usize>, remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::one(mr, IBV_WR_RDMA_READ, true, range).at(remote, offset)
    }

    /// Reads `remote` at `offset` into `ranges` of `mr`, in order (a scattered RDMA READ).
    #[inline]
    pub fn read_sg(mr: MemoryRegion, ranges: &[Range<usize>], remote: &RemoteRegion, offset: u64) -> SendWr {
        Self::gather(mr, IBV_WR_RDMA_READ, true, ranges).at(remote, offset)
    }

    /// Atomically adds `add` to the 8-byte integer at `offset` of `remote`; its original value
    /// lands in `mr[at..at + 8]` (RDMA fetch-and-add). The region needs
    /// [`AccessFlags::LOCAL_WRITE`]; the target must be 8-byte aligned.
    #[inline(always)]
    pub fn fetch_add(mr: MemoryRegion, at: usize, remote: &RemoteRegion, offset: u64, add: u64) -> SendWr {
        Self::one(mr, IBV_WR_ATOMIC_FETCH_AND_ADD, true, at..at.saturating_add(8)).atomic_at(remote, offset, add, 0)
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
        Self::one(mr, IBV_WR_ATOMIC_CMP_AND_SWP, true, at..at.saturating_add(8))
            .atomic_at(remote, offset, compare, swap)
    }

    /// Sets the `wr_id` its completion carries.
    #[inline(always)]
    pub fn wr_id(mut self, id: u64) -> SendWr {
        self.wr_id = id;
        self
    }

    /// Adds 32 bits of immediate data (a send or WRITE with immediate).
    pub fn imm(mut self, imm: u32) -> SendWr {
        match self.opcode {
            IBV_WR_SEND | IBV_WR_SEND_WITH_IMM => self.opcode = IBV_WR_SEND_WITH_IMM,
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => self.opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
            _ => {
                self.defect = Some(Defect::Bad("an RDMA READ or atomic carries no immediate data"));
                return self;
            }
        }
        self.imm = imm.to_be();
        self
    }

    /// Asks for no completion on success: the next signaled completion of the queue retires
    /// it (and hands its region back, as a [`Completion`](crate::verbs::lane::Completion) whose
    /// [`is_signaled`](crate::verbs::lane::Wc::is_signaled) is false). The work request that takes the
    /// queue's last free slot is signaled whatever it asks, so a full queue always drains.
    ///
    /// On an iWARP device every request is signaled whatever it asks: iWARP may complete a
    /// send before an earlier RDMA READ's data has landed, so there each slot retires with
    /// its own completion (a later one is held until the earlier ones have come).
    #[inline(always)]
    pub fn unsignaled(mut self) -> SendWr {
        self.signaled = false;
        self
    }

    /// Sets the solicited-event bit.
    pub fn solicited(mut self) -> SendWr {
        self.flags |= ffi::ibv_send_flags::IBV_SEND_SOLICITED.0;
        self
    }

    /// Addresses a send to a UD destination registered with [`Lane::add_dest`](crate::verbs::lane::Lane::add_dest) (required on a
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

    /// Whether it is a send (with or without immediate data): the only operation of UD.
    #[inline(always)]
    fn is_send(&self) -> bool {
        matches!(self.opcode, IBV_WR_SEND | IBV_WR_SEND_WITH_IMM)
    }

    /// Whether it carries immediate data (a send or WRITE with it).
    pub(super) fn has_imm(&self) -> bool {
        matches!(self.opcode, IBV_WR_SEND_WITH_IMM | IBV_WR_RDMA_WRITE_WITH_IMM)
    }

    /// Whether the device writes its region with the peer's response: an RDMA READ or an atomic.
    pub(super) fn is_fetch(&self) -> bool {
        matches!(self.opcode, IBV_WR_RDMA_READ | IBV_WR_ATOMIC_FETCH_AND_ADD | IBV_WR_ATOMIC_CMP_AND_SWP)
    }

    /// Lowers it for a post on `m` into `out` (zeroed) over `sge` (a copy of its scatter list
    /// that lives as long as `out`): checks what depends on the QP (its protection domain, its
    /// piece limit, a UD destination and MTU), then writes what raw code writes, with the tag
    /// as `wr_id`. The one place where a lane's send-queue work request becomes the verbs' form.
    #[inline(always)]
    pub(super) fn lower(
        &self,
        m: &Member,
        wr_id: u64,
        signaled: bool,
        out: &mut ffi::ibv_send_wr,
        sge: &mut [MaybeUninit<ffi::ibv_sge>; MAX_SGE],
    ) -> Result<()> {
        self.check_lower(m, wr_id, signaled, out, sge).map_err(|r| r.error("post_send"))
    }

    /// `lower`, saying why it refuses as a `Refusal`: a value, whose error is built out of line
    /// (`Refusal::rejected`), so that no call is made on the post's path while the region is
    /// in hand.
    #[inline(always)]
    pub(super) fn check_lower(
        &self,
        m: &Member,
        wr_id: u64,
        signaled: bool,
        out: &mut ffi::ibv_send_wr,
        sge: &mut [MaybeUninit<ffi::ibv_sge>; MAX_SGE],
    ) -> std::result::Result<(), Refusal> {
        if let Some(d) = self.defect {
            return Err(Refusal::Defect(d));
        }
        if !self.mr.inner().on_pd(&m.pd) {
            return Err(Refusal::OtherPd);
        }
        let n = self.n as u32;
        if n > 1 {
            if n > m.max_send_sge {
                return Err(Refusal::TooManyPieces { n, max: m.max_send_sge, read: false });
            }
            // The device may scatter a READ's data into fewer pieces than it gathers a send's.
            if self.opcode == IBV_WR_RDMA_READ && n > m.max_read_sge {
                return Err(Refusal::TooManyPieces { n, max: m.max_read_sge, read: true });
            }
            *sge = self.sge;
        } else {
            sge[0] = self.sge[0];
        }
        if m.is_ud() {
            out.wr.ud = self.lower_ud(m)?;
        } else if self.dest.is_some() {
            return Err(Refusal::UdNeedsDest { missing: false });
        }
        match self.opcode {
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM | IBV_WR_RDMA_READ => {
                out.wr.rdma = ffi::rdma_t { remote_addr: self.remote_addr, rkey: self.rkey }
            }
            IBV_WR_ATOMIC_FETCH_AND_ADD | IBV_WR_ATOMIC_CMP_AND_SWP => {
                out.wr.atomic = ffi::atomic_t {
                    remote_addr: self.remote_addr,
                    compare_add: self.compare_add,
                    swap: self.swap,
                    rkey: self.rkey,
                }
            }
            _ => {}
        }
        out.wr_id = wr_id;
        out.sg_list = sge.as_mut_ptr().cast();
        // A zero-length one has no scatter entry (some providers read a count of 0 as 2 GiB).
        out.num_sge = if self.total == 0 { 0 } else { n as i32 };
        out.opcode = self.opcode;
        out.imm_data_invalidated_rkey_union.imm_data = self.imm;
        // Signaled when asked, and always on iWARP (`Member::always_flags`).
        out.send_flags =
            self.flags | m.always_flags | if signaled { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
        Ok(())
    }

    /// A UD send's destination, checked with its size.
    #[inline(always)]
    fn lower_ud(&self, m: &Member) -> std::result::Result<ffi::ud_t, Refusal> {
        let (true, Some(d)) = (self.is_send(), self.dest) else {
            return Err(Refusal::UdNeedsDest { missing: self.dest.is_none() });
        };
        let Some(dest) = m.dests.get(d.index as usize).filter(|_| d.qp == m.key) else {
            return Err(Refusal::NotThisQpsDest);
        };
        if self.total > m.mtu as u64 {
            return Err(Refusal::TooLong { len: self.total, mtu: m.mtu });
        }
        Ok(ffi::ud_t { ah: dest.ah, remote_qpn: dest.qpn, remote_qkey: dest.qkey })
    }
}

/// A receive of a lane: the device writes the message into its region, moved into the lane
/// when it is posted. Built already lowered, as [`SendWr`] is; its first (or only) range is
/// checked against the region when it is posted (`check`), where each check is one compare
/// and branch.
///
/// A receive names one range ([`RecvWr::new`], [`RecvWr::range`]) or, scattered, up to
/// [`MAX_SGE`] ranges of its one region ([`RecvWr::scatter`]): the device writes the message
/// into them in order, filling each before the next, so the first bytes land in the first
/// range, the next ones in the second, and so on
/// ([`Wc::byte_len`](crate::verbs::lane::Wc::byte_len) says how many came in all). A scattered
/// receive is posted one at a time ([`Lane::post_recv`](crate::verbs::lane::Lane::post_recv),
/// [`Lane::post_srq_recv`](crate::verbs::lane::Lane::post_srq_recv)), on a QP created with
/// [`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge) of at least its pieces (an SRQ made
/// with [`Lane::create_srq_with_sge`](crate::verbs::lane::Lane::create_srq_with_sge)); the
/// lists and prepared receives take receives of one range only.
///
/// On UD the device writes the 40-byte GRH ([`GRH_LEN`]) first: the lane asks that the first
/// range hold it whole, so the datagram's payload starts at byte [`GRH_LEN`] of the first
/// range and continues into the next ones.
pub struct RecvWr {
    pub(super) mr: MemoryRegion,
    /// The first range as given: `sge` names it only once `check` has found it in the region.
    pub(super) range: Range<usize>,
    pub(super) sge: ffi::ibv_sge,
    pub(super) wr_id: u64,
    /// Its pieces: 1 for a receive of one range; 1 to [`MAX_SGE`] for a scattered one.
    pub(super) n: u8,
    /// What [`RecvWr::scatter`] found wrong with the ranges after the first, or with the list
    /// as a whole (`None` for a receive of one range, whose range is checked at post).
    pub(super) rest: Option<Defect>,
    /// Pieces 2 to `n` of a scattered receive: entries `..n - 1` are written (each checked
    /// against the region) whenever `rest` is `None`; never read when `n` is 1.
    pub(super) more: [MaybeUninit<ffi::ibv_sge>; MAX_SGE - 1],
}

impl fmt::Debug for RecvWr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvWr")
            .field("pieces", &self.n)
            .field("len", &self.sge.length)
            .field("wr_id", &self.wr_id)
            .field("defect", &self.defect())
            .finish()
    }
}

/// The defect of a list that names no piece or more than [`MAX_SGE`].
const PIECE_COUNT: &str = "a work request names 1 to 4 pieces (rdma_cm::MAX_SGE)";

impl RecvWr {
    /// A receive into the whole of `mr` (which needs [`AccessFlags::LOCAL_WRITE`]). On UD the
    /// first [`GRH_LEN`] bytes take the GRH.
    #[inline(always)]
    pub fn new(mr: MemoryRegion) -> RecvWr {
        let len = mr.len();
        Self::range(mr, 0..len)
    }

    /// A receive into `mr[range]`.
    #[inline(always)]
    pub fn range(mr: MemoryRegion, range: Range<usize>) -> RecvWr {
        // Its scatter entry as a raw program writes it; meaningful once `check` has found the
        // range in the region (a receive that fails it is never posted).
        let sge = ffi::ibv_sge {
            addr: mr.addr().wrapping_add(range.start as u64),
            length: range.end.wrapping_sub(range.start) as u32,
            lkey: mr.lkey(),
        };
        RecvWr { mr, range, sge, wr_id: 0, n: 1, rest: None, more: [const { MaybeUninit::uninit() }; MAX_SGE - 1] }
    }

    /// A receive scattered over `ranges` of `mr`, in order (1 to [`MAX_SGE`] of them): the
    /// message fills `ranges[0]`, then `ranges[1]`, and so on. The region needs
    /// [`AccessFlags::LOCAL_WRITE`].
    ///
    /// Each range is checked against the region as [`SendWr::send_sg`] checks its pieces;
    /// several ranges must all be non-empty, and they hold at most 4 GiB in all. A defect is
    /// reported when the receive is posted, with the region given back. A post also refuses
    /// more ranges than the QP takes ([`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge);
    /// for an SRQ, [`Lane::create_srq_with_sge`](crate::verbs::lane::Lane::create_srq_with_sge)'s
    /// `max_sge`). One range is the same receive as [`RecvWr::range`].
    #[inline]
    pub fn scatter(mr: MemoryRegion, ranges: &[Range<usize>]) -> RecvWr {
        let Some(first) = ranges.first() else {
            let mut w = Self::range(mr, 0..0);
            w.rest = Some(Defect::Bad(PIECE_COUNT));
            return w;
        };
        let mut w = Self::range(mr, first.clone());
        if ranges.len() > MAX_SGE {
            w.rest = Some(Defect::Bad(PIECE_COUNT));
            return w;
        }
        // The first range is checked at post, as a receive of one range is; its length counts
        // here only when it is one (a reversed range is reported there first).
        let first_len = piece(first).map_or(0, |(_, len)| len as u64);
        let (addr, lkey, size) = (w.mr.addr(), w.mr.lkey(), w.mr.len() as u64);
        let (mut total, mut empty) = (first_len, first_len == 0);
        for (entry, range) in w.more.iter_mut().zip(&ranges[1..]) {
            match piece(range) {
                Err(why) => {
                    w.rest.get_or_insert(Defect::Bad(why));
                }
                Ok((start, len)) if start.saturating_add(len as u64) > size => {
                    w.rest.get_or_insert(Defect::OutOfRegion { offset: start, len, size });
                }
                Ok((start, len)) => {
                    entry.write(ffi::ibv_sge { addr: addr + start, length: len, lkey });
                    total += len as u64;
                    empty |= len == 0;
                }
            }
        }
        // Without a defect every range was written: entries `..n - 1` of `more` are initialised.
        w.n = ranges.len() as u8;
        if w.n > 1 && empty {
            w.rest.get_or_insert(Defect::Bad(
                "a list of several pieces takes non-empty ones only (some providers read 0 bytes as 2 GiB)",
            ));
        }
        if total > u32::MAX as u64 {
            w.rest.get_or_insert(Defect::Bad("a work request moves at most 4 GiB"));
        }
        w
    }

    /// Why it cannot be posted on any QP, if it cannot: without `LOCAL_WRITE` the device
    /// cannot write the region; else the first range's defect; else what `scatter` found in
    /// the others. (`check` finds the same, in the same order.)
    #[inline(always)]
    pub(super) fn defect(&self) -> Option<Defect> {
        if !self.mr.access().contains(AccessFlags::LOCAL_WRITE) {
            return Some(Defect::NeedsLocalWrite);
        }
        let size = self.mr.len() as u64;
        match piece(&self.range) {
            Err(why) => Some(Defect::Bad(why)),
            Ok((start, len)) if start + len as u64 > size => Some(Defect::OutOfRegion { offset: start, len, size }),
            Ok(_) => self.rest,
        }
    }

    /// Its scatter list, `n` entries of which are written (when it has no defect).
    #[inline(always)]
    pub(super) fn sges(&self) -> [MaybeUninit<ffi::ibv_sge>; MAX_SGE] {
        let mut list = [const { MaybeUninit::uninit() }; MAX_SGE];
        list[0].write(self.sge);
        if self.n > 1 {
            list[1..].copy_from_slice(&self.more);
        }
        list
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

    /// Checks it for a post by `op` on the QP `m` that takes receives of one range only (a
    /// list, a prepared receive): what `check` checks, and that it is not scattered; returns
    /// the scatter count.
    #[inline(always)]
    pub(super) fn lower_one(&self, m: &Member, op: &'static str) -> Result<i32> {
        if self.n > 1 {
            return Err(one_piece_only(op));
        }
        self.check(m).map_err(|r| r.error(op))
    }

    /// Checks what depends on the QP `m` (its protection domain; a UD receive's room for the
    /// GRH in its first piece; a scattered receive's pieces against the QP's
    /// `max_recv_sge`); returns the scatter count.
    #[inline(always)]
    pub(super) fn check(&self, m: &Member) -> std::result::Result<i32, Refusal> {
        if let Some(d) = self.defect() {
            return Err(Refusal::Defect(d));
        }
        if !self.mr.inner().on_pd(&m.pd) {
            return Err(Refusal::OtherPd);
        }
        let len = self.sge.length;
        if m.is_ud() && (len as usize) < GRH_LEN {
            return Err(Refusal::NoRoomForGrh(len));
        }
        if self.n > 1 {
            let n = self.n as u32;
            if n > m.max_recv_sge {
                return Err(Refusal::TooManyRecvPieces { n, max: m.max_recv_sge });
            }
            return Ok(n as i32);
        }
        Ok((len != 0) as i32)
    }
}
