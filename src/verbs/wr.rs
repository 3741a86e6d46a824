//! Work requests: [`SendWr`] (send, RDMA WRITE, RDMA READ, atomics) and [`RecvWr`]. They borrow the
//! regions they name; posting them ([`QueuePair::post_send`](crate::QueuePair::post_send))
//! takes a handle of each for as long as the device may use it.
//!
//! # Scatter/gather
//!
//! A send, RDMA WRITE, RDMA READ or receive may name several pieces, each a range of a
//! [`MemoryRegion`] ([`SendWr::send_sg`], [`SendWr::write_sg`], [`SendWr::read_sg`],
//! [`RecvWr::sg`]): the device gathers a message from them in order, or scatters one into
//! them in order. At most [`MAX_SGE`] pieces, and at most what the queue was created for
//! ([`QpInit::max_send_sge`](crate::QpInit::max_send_sge),
//! [`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge),
//! [`SharedReceiveQueue::with_sge`](crate::SharedReceiveQueue::with_sge); 1 by default).
//!
//! Every piece's region is held by the queue's slot until the completion is reaped, exactly as
//! a single region is: the pieces the device writes (a receive's, an RDMA READ's) are
//! unreachable from Rust until then, and none can be freed. Posting allocates nothing; the
//! handles of the pieces after the first live in a side table of the queue, allocated when it
//! is created (and only when it takes more than one piece).
//!
//! The pieces may be ranges of different regions or of one region, and may overlap: the device
//! writing two overlapping pieces of a receive is no memory-safety issue (the region is held as
//! written, so Rust cannot see it meanwhile), but which piece's bytes the overlap ends up with is
//! unspecified. In a list of more than one piece every piece must be non-empty: some providers
//! read a zero byte count as 2 GiB, so a zero-length entry is refused rather than passed on (a
//! one-piece list behaves as the single-piece constructor, which posts an empty receive with no
//! scatter entry at all).
//!
//! ```no_run
//! # fn f(qp: &mut rdma_cm::QueuePair, header: &rdma_cm::MemoryRegion, body: &rdma_cm::MemoryRegion)
//! # -> rdma_cm::Result<()> {
//! use rdma_cm::SendWr;
//! // The QP was created with QpInit::new().max_send_sge(2).
//! let pieces = [(header, 0..16), (body, 4096..8192)];
//! qp.post_send(&[SendWr::send_sg(&pieces)?.wr_id(7)])?;
//! # Ok(()) }
//! ```

use std::mem::{self, MaybeUninit};
use std::ops::Range;
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::ah::UdDest;
use crate::verbs::mr::{check_range, AccessFlags, MemoryRegion, MrInner, RemoteRegion};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::ring::Hold;

/// The most pieces (scatter/gather entries) one work request may name. A queue takes at most
/// what it was created for, up to this ([`QpInit::max_send_sge`](crate::QpInit::max_send_sge),
/// [`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge),
/// [`SharedReceiveQueue::with_sge`](crate::SharedReceiveQueue::with_sge)). It sizes the
/// scatter/gather arrays a post builds on the stack.
pub const MAX_SGE: usize = 4;

/// One piece of a work request: a range of a region.
pub(crate) type Piece<'a> = (&'a MemoryRegion, Range<usize>);

/// Splits a list of pieces into the first (which goes where a single piece goes) and the rest,
/// refusing an empty list, more than [`MAX_SGE`] pieces, and empty pieces in a list of several.
pub(crate) fn split_pieces<'a>(pieces: &'a [Piece<'a>], what: &str) -> Result<(Piece<'a>, &'a [Piece<'a>])> {
    let Some(((mr, first), rest)) = pieces.split_first() else {
        return Err(Error::InvalidArgument(format!(
            "{what} of no pieces: a scatter/gather list needs at least one (region, range)"
        )));
    };
    if pieces.len() > MAX_SGE {
        return Err(Error::InvalidArgument(format!(
            "{what} of {} pieces: a work request names at most {MAX_SGE} (rdma_cm::MAX_SGE)",
            pieces.len()
        )));
    }
    if !rest.is_empty() {
        if let Some((i, (_, r))) = pieces.iter().enumerate().find(|(_, (_, r))| r.is_empty()) {
            return Err(Error::InvalidArgument(format!(
                "{what}: piece {i} ({r:?}) is empty or reversed; a list of several pieces takes non-empty ones only (leave it out)"
            )));
        }
    }
    Ok(((*mr, first.clone()), rest))
}

/// Whether any piece after the first names a region other than `first` (the first piece's),
/// so that [`hold_rest`] has holds to give: a list of ranges of one buffer has none, and its
/// post skips the side table altogether.
#[inline]
pub(crate) fn needs_rest_holds(first: Option<&Arc<MrInner>>, rest: &[Piece<'_>]) -> bool {
    match first {
        Some(f) => rest.iter().take(MAX_SGE - 1).any(|(m, _)| !Arc::ptr_eq(m.inner(), f)),
        None => !rest.is_empty(),
    }
}

/// The holds of the pieces after the first, as a post stages them (at most `MAX_SGE - 1`: the
/// same pieces its scatter/gather list names). `writes`: the device writes them.
///
/// A piece whose region the work request already holds (the first piece's, `first`, or an
/// earlier piece's) takes no second hold: every hold of one work request is released together,
/// when its slot retires, so one hold of a region keeps it allocated, and for `writes` its
/// writer count above zero, for exactly as long as a hold per piece would. A list of ranges of
/// one buffer, the usual gather, then costs one hold instead of one per piece.
pub(crate) fn hold_rest<'a>(
    first: Option<&'a Arc<MrInner>>,
    rest: &'a [Piece<'a>],
    writes: bool,
) -> impl Iterator<Item = Hold> + 'a {
    let rest = &rest[..rest.len().min(MAX_SGE - 1)];
    rest.iter().enumerate().filter_map(move |(i, (m, _))| {
        let region = m.inner();
        let held = first.is_some_and(|f| Arc::ptr_eq(region, f))
            || rest[..i].iter().any(|(e, _)| Arc::ptr_eq(e.inner(), region));
        (!held).then(|| Hold::new(region, writes))
    })
}

/// Bytes a list of pieces moves in all (what the remote side of a WRITE or READ must hold).
fn total_len(first: &Range<usize>, rest: &[Piece<'_>]) -> u64 {
    rest.iter().fold(first.len() as u64, |n, (_, r)| n.saturating_add(r.len() as u64))
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SendOp {
    Send,
    Write {
        addr: u64,
        rkey: u32,
    },
    Read {
        addr: u64,
        rkey: u32,
    },
    FetchAdd {
        addr: u64,
        rkey: u32,
        add: u64,
    },
    CompareSwap {
        addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    /// A send that also invalidates the peer's memory window `rkey`.
    SendInv {
        rkey: u32,
    },
    /// Binds a type 2 window to a region's range (the window, the new rkey, the bind info).
    /// (The window and the region as addresses, so that work requests stay `Send`.)
    BindMw {
        mw: usize,
        rkey: u32,
        mr: usize,
        addr: u64,
        len: u64,
        access: u32,
    },
    /// Invalidates one of this side's rkeys (a type 2 window).
    LocalInv {
        rkey: u32,
    },
}

impl SendOp {
    /// Whether the device writes the local range (READ targets, atomics' original values).
    pub(crate) fn writes_local(&self) -> bool {
        matches!(self, SendOp::Read { .. } | SendOp::FetchAdd { .. } | SendOp::CompareSwap { .. })
    }

    pub(crate) fn is_atomic(&self) -> bool {
        matches!(self, SendOp::FetchAdd { .. } | SendOp::CompareSwap { .. })
    }
}

/// A send-queue work request: a send, an RDMA WRITE, an RDMA READ, or an atomic.
#[derive(Clone, Debug)]
pub struct SendWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) local: Option<Piece<'a>>,
    /// The pieces after `local` (empty for a single piece).
    pub(crate) rest: &'a [Piece<'a>],
    pub(crate) inline: Option<&'a [u8]>,
    pub(crate) imm: Option<u32>,
    pub(crate) signaled: bool,
    pub(crate) solicited: bool,
    /// Where a datagram goes (a UD send's; only [`UdSendWr`](crate::UdSendWr) sets it).
    pub(crate) ud: Option<&'a UdDest>,
}

/// What the posting code needs of a send-queue work request: the [`SendWr`] underneath (a
/// [`UdSendWr`](crate::UdSendWr) is one with a destination).
pub(crate) trait AsSendWr {
    fn send_wr(&self) -> &SendWr<'_>;
}

impl AsSendWr for SendWr<'_> {
    #[inline(always)]
    fn send_wr(&self) -> &SendWr<'_> {
        self
    }
}

impl<'a> SendWr<'a> {
    #[inline]
    pub(crate) fn new(op: SendOp, local: Option<Piece<'a>>) -> Self {
        SendWr { wr_id: 0, op, local, rest: &[], inline: None, imm: None, signaled: true, solicited: false, ud: None }
    }

    pub(crate) fn with_rest(mut self, rest: &'a [Piece<'a>]) -> Self {
        self.rest = rest;
        self
    }

    /// Bytes the work request moves: the inline data, or all pieces together.
    pub(crate) fn total_len(&self) -> u64 {
        match (&self.inline, &self.local) {
            (Some(d), _) => d.len() as u64,
            (None, Some((_, r))) => total_len(r, self.rest),
            (None, None) => 0,
        }
    }

    /// Sends `mr[range]`.
    #[inline]
    pub fn send(mr: &'a MemoryRegion, range: Range<usize>) -> Self {
        Self::new(SendOp::Send, Some((mr, range)))
    }

    /// Sends `mr[range]` and invalidates the peer's memory window `rkey`
    /// (`IBV_WR_SEND_WITH_INV`): the peer's receive completion says so
    /// ([`WorkCompletion::invalidated_rkey`](crate::WorkCompletion::invalidated_rkey),
    /// [`BoundWindow::invalidated_by`](crate::BoundWindow::invalidated_by)). Carries no
    /// immediate data (they share a field).
    #[inline]
    pub fn send_with_invalidate(mr: &'a MemoryRegion, range: Range<usize>, rkey: u32) -> Self {
        Self::new(SendOp::SendInv { rkey }, Some((mr, range)))
    }

    /// Sends `data` inline: the provider copies it during the post, so it needs no memory
    /// region and may be any buffer. At most the QP's `max_inline_data` bytes.
    pub fn send_inline(data: &'a [u8]) -> Self {
        SendWr { inline: Some(data), ..Self::new(SendOp::Send, None) }
    }

    /// Sends the concatenation of `pieces`, in order (a gathered send). See the
    /// [module docs](self) on scatter/gather.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list, more than [`MAX_SGE`] pieces, or an empty
    /// piece in a list of several. Each piece is checked against its region, and the count
    /// against the QP's [`QpInit::max_send_sge`](crate::QpInit::max_send_sge), when posting.
    pub fn send_sg(pieces: &'a [(&'a MemoryRegion, Range<usize>)]) -> Result<Self> {
        let (first, rest) = split_pieces(pieces, "a send")?;
        Ok(Self::new(SendOp::Send, Some(first)).with_rest(rest))
    }

    /// Writes `mr[range]` to `remote` at `remote_offset` (RDMA WRITE).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the target range leaves the remote region.
    #[inline]
    pub fn write(mr: &'a MemoryRegion, range: Range<usize>, remote: &RemoteRegion, remote_offset: u64) -> Result<Self> {
        let len = range.len() as u64;
        let addr = remote.at(remote_offset, len)?;
        Ok(Self::new(SendOp::Write { addr, rkey: remote.rkey }, Some((mr, range))))
    }

    /// Writes the concatenation of `pieces` to `remote` at `remote_offset` (a gathered RDMA
    /// WRITE).
    ///
    /// # Errors
    /// As for [`SendWr::send_sg`]; [`Error::OutOfBounds`] when the target range (as long as
    /// all pieces together) leaves the remote region.
    pub fn write_sg(
        pieces: &'a [(&'a MemoryRegion, Range<usize>)],
        remote: &RemoteRegion,
        remote_offset: u64,
    ) -> Result<Self> {
        let ((mr, first), rest) = split_pieces(pieces, "an RDMA WRITE")?;
        let addr = remote.at(remote_offset, total_len(&first, rest))?;
        Ok(Self::new(SendOp::Write { addr, rkey: remote.rkey }, Some((mr, first))).with_rest(rest))
    }

    /// Reads `remote` at `remote_offset` into `pieces`, in order (a scattered RDMA READ). Every
    /// piece's region needs [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE), and
    /// none is readable from Rust until the completion is reaped.
    ///
    /// # Errors
    /// As for [`SendWr::send_sg`]; [`Error::OutOfBounds`] when the source range (as long as
    /// all pieces together) leaves the remote region.
    pub fn read_sg(
        pieces: &'a [(&'a MemoryRegion, Range<usize>)],
        remote: &RemoteRegion,
        remote_offset: u64,
    ) -> Result<Self> {
        let ((mr, first), rest) = split_pieces(pieces, "an RDMA READ")?;
        let addr = remote.at(remote_offset, total_len(&first, rest))?;
        Ok(Self::new(SendOp::Read { addr, rkey: remote.rkey }, Some((mr, first))).with_rest(rest))
    }

    /// How many pieces (scatter/gather entries) it names: 0 for an inline send, 1 for the
    /// single-region constructors.
    pub fn num_pieces(&self) -> usize {
        self.local.is_some() as usize + self.rest.len()
    }

    /// Reads `remote` at `remote_offset` into `mr[range]` (RDMA READ). The region needs
    /// [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE).
    ///
    /// How many READs (and atomics) run at once is what the connection agreed on: this side's
    /// [`ConnParam::initiator_depth`](crate::ConnParam::initiator_depth), at most the peer's
    /// responder resources. Both default to 1, as in the seed programs, so posted READs run one
    /// after another unless both sides ask for more (for example
    /// [`ConnParam::FROM_DEVICE`](crate::ConnParam::FROM_DEVICE) on the client and
    /// [`ConnParam::from_request`](crate::ConnParam::from_request) on the server).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the source range leaves the remote region.
    pub fn read(mr: &'a MemoryRegion, range: Range<usize>, remote: &RemoteRegion, remote_offset: u64) -> Result<Self> {
        let len = range.len() as u64;
        let addr = remote.at(remote_offset, len)?;
        Ok(Self::new(SendOp::Read { addr, rkey: remote.rkey }, Some((mr, range))))
    }

    /// Atomically adds `add` to the 8-byte integer at `remote_offset` of `remote` and returns
    /// the value it had into `mr[range]` (RDMA fetch-and-add). `range` is 8 bytes of a region
    /// with [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE), held (no slice of
    /// it is handed out) until the completion is reaped; read the original value then, e.g.
    /// with [`MemoryRegion::read_at`]. The peer's region needs
    /// [`AccessFlags::REMOTE_ATOMIC`](crate::AccessFlags::REMOTE_ATOMIC) (otherwise the
    /// completion is [`WcStatus::RemAccessErr`](crate::WcStatus::RemAccessErr)),
    /// and the connection an initiator depth of at least 1 ([`ConnParam`](crate::ConnParam)'s
    /// default). The original value is written in the byte order the device uses: the host's
    /// on Soft-RoCE; compare against a known value on other hardware.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `range` is not 8 bytes
    /// or the target address is not 8-byte aligned (the device would fail the request);
    /// [`Error::OutOfBounds`] when the target leaves the remote
    /// region.
    pub fn fetch_add(
        mr: &'a MemoryRegion,
        range: Range<usize>,
        remote: &RemoteRegion,
        remote_offset: u64,
        add: u64,
    ) -> Result<Self> {
        let addr = atomic_target(&range, remote, remote_offset)?;
        Ok(Self::new(SendOp::FetchAdd { addr, rkey: remote.rkey, add }, Some((mr, range))))
    }

    /// Atomically replaces the 8-byte integer at `remote_offset` of `remote` with `swap` if it
    /// equals `compare`, and returns the value it had into `mr[range]` either way (RDMA
    /// compare-and-swap: the swap happened when the returned value equals `compare`). As for
    /// [`SendWr::fetch_add`] otherwise.
    ///
    /// # Errors
    /// As for [`SendWr::fetch_add`].
    pub fn compare_swap(
        mr: &'a MemoryRegion,
        range: Range<usize>,
        remote: &RemoteRegion,
        remote_offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<Self> {
        let addr = atomic_target(&range, remote, remote_offset)?;
        Ok(Self::new(SendOp::CompareSwap { addr, rkey: remote.rkey, compare, swap }, Some((mr, range))))
    }

    /// Sets the `wr_id` returned in the completion.
    #[inline]
    pub fn wr_id(mut self, id: u64) -> Self {
        self.wr_id = id;
        self
    }

    /// Adds 32 bits of immediate data (a send or WRITE with immediate; the WRITE then consumes
    /// a receive at the peer).
    pub fn imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }

    /// Generates no completion on success. The work request (and the region it holds) is
    /// retired by the next signaled completion on this queue.
    #[inline]
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// Sets the solicited-event bit.
    pub fn solicited(mut self) -> Self {
        self.solicited = true;
        self
    }
}

/// Checks an atomic's local range and remote target; returns the target address.
fn atomic_target(range: &Range<usize>, remote: &RemoteRegion, remote_offset: u64) -> Result<u64> {
    if range.len() != 8 || range.start > range.end {
        return Err(Error::InvalidArgument(format!(
            "an atomic's local range must be 8 bytes (the original value lands there), not {range:?}"
        )));
    }
    let addr = remote.at(remote_offset, 8)?;
    if addr % 8 != 0 {
        return Err(Error::InvalidArgument(format!(
            "atomic target {addr:#x} (offset {remote_offset} of the remote region) is not 8-byte aligned: the device fails such a request with a remote error"
        )));
    }
    Ok(addr)
}

/// A receive-queue work request: receive into `mr[range]`, or scatter into several pieces.
#[derive(Clone, Debug)]
pub struct RecvWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) mr: &'a MemoryRegion,
    pub(crate) range: Range<usize>,
    /// The pieces after the first (empty for a single piece); each non-empty.
    pub(crate) rest: &'a [Piece<'a>],
}

impl<'a> RecvWr<'a> {
    /// Receives into `mr[range]`. The region needs [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE).
    #[inline]
    pub fn new(mr: &'a MemoryRegion, range: Range<usize>) -> Self {
        RecvWr { wr_id: 0, mr, range, rest: &[] }
    }

    /// Receives into `pieces`, in order: the message fills the first piece, then the next, and
    /// so on (a scattered receive). Every piece's region needs
    /// [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE), and none is readable
    /// from Rust until the completion is reaped. See the [module docs](self) on
    /// scatter/gather.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list, more than [`MAX_SGE`] pieces, or an empty
    /// piece in a list of several. Each piece is checked against its region, and the count
    /// against the queue's limit ([`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge),
    /// [`SharedReceiveQueue::with_sge`](crate::SharedReceiveQueue::with_sge)), when posting.
    pub fn sg(pieces: &'a [(&'a MemoryRegion, Range<usize>)]) -> Result<Self> {
        let ((mr, range), rest) = split_pieces(pieces, "a receive")?;
        Ok(RecvWr { wr_id: 0, mr, range, rest })
    }

    /// How many pieces (scatter/gather entries) it names.
    pub fn num_pieces(&self) -> usize {
        1 + self.rest.len()
    }

    /// Sets the `wr_id` returned in the completion.
    #[inline]
    pub fn wr_id(mut self, id: u64) -> Self {
        self.wr_id = id;
        self
    }
}

/// Work requests linked into one `ibv_post_*` call (the stack arrays' size).
pub(crate) const CHUNK: usize = 16;
/// Scatter/gather entries of one `ibv_post_*` call: every piece of a chunk of work requests.
pub(crate) const CHUNK_SGE: usize = CHUNK * MAX_SGE;

/// Checks a local range of a work request against its region.
#[inline(always)]
pub(crate) fn check_local(
    pd: &Arc<ProtectionDomain>,
    mr: &MemoryRegion,
    range: &Range<usize>,
    needs_write: bool,
) -> Result<()> {
    if !mr.inner().on_pd(pd) {
        return Err(Error::InvalidArgument("memory region is registered on another protection domain".into()));
    }
    if range.start > range.end {
        return Err(Error::InvalidArgument(format!("range {range:?} is reversed")));
    }
    check_range(range.start, range.len(), mr.len())?;
    if range.len() > u32::MAX as usize {
        return Err(Error::InvalidArgument("a work request moves at most 4 GiB".into()));
    }
    if needs_write && !mr.access().contains(AccessFlags::LOCAL_WRITE) {
        return Err(Error::InvalidArgument(
            "the device writes this region (receive, RDMA READ target or atomic result): register it with LOCAL_WRITE"
                .into(),
        ));
    }
    Ok(())
}

/// Checks the pieces after the first of a work request, and the whole list: every piece as
/// [`check_local`] does, and at most 4 GiB in all. `first_len` is the first piece's length.
pub(crate) fn check_rest(
    pd: &Arc<ProtectionDomain>,
    first_len: usize,
    rest: &[(&MemoryRegion, Range<usize>)],
    needs_write: bool,
) -> Result<()> {
    let mut total = first_len as u64;
    for (mr, r) in rest {
        check_local(pd, mr, r, needs_write)?;
        total += r.len() as u64;
    }
    if total > u32::MAX as u64 {
        return Err(Error::InvalidArgument(format!(
            "a work request moves at most 4 GiB; its {} pieces add up to {total} bytes",
            rest.len() + 1
        )));
    }
    Ok(())
}

/// Checks a receive before posting: every piece against its region (PD, bounds, LOCAL_WRITE),
/// and their count against the queue's limit `max` (`queue` and `setter` name them).
pub(crate) fn check_recv(
    pd: &Arc<ProtectionDomain>,
    w: &RecvWr<'_>,
    max: u32,
    queue: &str,
    setter: &str,
) -> Result<()> {
    check_local(pd, w.mr, &w.range, true)?;
    if !w.rest.is_empty() {
        check_pieces(w.num_pieces(), max, queue, setter)?;
        check_rest(pd, w.range.len(), w.rest, true)?;
    }
    Ok(())
}

/// Refuses a work request of more pieces than its queue takes.
pub(crate) fn check_pieces(pieces: usize, max: u32, queue: &str, setter: &str) -> Result<()> {
    if pieces > max as usize {
        return Err(Error::InvalidArgument(format!(
            "a work request of {pieces} pieces exceeds the {queue}'s limit of {max}: create it with {setter}"
        )));
    }
    Ok(())
}

/// Checks a requested number of pieces per work request against the crate's limit; `what`
/// names the setter.
pub(crate) fn check_sge_request(n: u32, what: &str) -> Result<()> {
    if n == 0 || n as usize > MAX_SGE {
        return Err(Error::InvalidArgument(format!(
            "{what}({n}): a work request names 1 to {MAX_SGE} pieces (rdma_cm::MAX_SGE)"
        )));
    }
    Ok(())
}

/// Checks a requested number of pieces against the device's limit `max` (`field` names it).
pub(crate) fn check_sge_device(n: u32, what: &str, max: u32, field: &str, device: &str) -> Result<()> {
    if n > max {
        return Err(Error::InvalidArgument(format!(
            "{what}({n}) exceeds device {device}'s {field} of {max} (see `ibv_devinfo -v`)"
        )));
    }
    Ok(())
}

/// Where a failed post stopped, when the provider said so: the index of `bad` in the list of
/// `n` starting at `first`. Compared as addresses, so nothing is assumed about a pointer we did
/// not give it. `None`: unknown extent.
pub(crate) fn rejected_from<T>(bad: *mut T, first: *const T, n: usize) -> Option<usize> {
    let size = mem::size_of::<T>().max(1);
    let (b, f) = (bad as usize, first as usize);
    (!bad.is_null() && b >= f && b < f + n * size && (b - f) % size == 0).then(|| (b - f) / size)
}

/// Builds the receive list for `chunk` (at most [`CHUNK`] work requests) on the stack and
/// hands its head and length to `post`; `wr_id(k, w)` stages entry `k` (holding every piece of
/// it) and returns the `wr_id` to post. The list lives until `post` returns.
pub(crate) fn with_recv_list<R>(
    chunk: &[RecvWr<'_>],
    mut wr_id: impl FnMut(usize, &RecvWr<'_>) -> u64,
    post: impl FnOnce(*mut ffi::ibv_recv_wr, usize) -> R,
) -> R {
    // Only the entries used are initialised (zeroing whole arrays costs on every post).
    let mut wrs: [MaybeUninit<ffi::ibv_recv_wr>; CHUNK] = [const { MaybeUninit::uninit() }; CHUNK];
    let mut sge: [MaybeUninit<ffi::ibv_sge>; CHUNK_SGE] = [const { MaybeUninit::uninit() }; CHUNK_SGE];
    // Both arrays are written only through these pointers from here on, so the pointers the
    // list holds into them stay valid.
    let base: *mut ffi::ibv_recv_wr = wrs.as_mut_ptr().cast();
    let sge_base: *mut ffi::ibv_sge = sge.as_mut_ptr().cast();
    let n = chunk.len().min(CHUNK);
    let mut used = 0;
    for (k, w) in chunk[..n].iter().enumerate() {
        let first = used;
        let pieces = std::iter::once((w.mr, &w.range)).chain(w.rest.iter().map(|(m, r)| (*m, r)));
        for (mr, r) in pieces.take(MAX_SGE) {
            // SAFETY: at most MAX_SGE entries per work request and CHUNK work requests, so
            // `used` < CHUNK_SGE: within `sge`.
            unsafe { sge_base.add(used).write(mr.sge(r)) };
            used += 1;
        }
        // A zero-length receive has no scatter entry: some providers read a byte count of 0 as
        // 2 GiB. (A list of several pieces has no empty piece: RecvWr::sg refuses them.)
        let num_sge = if w.rest.is_empty() { !w.range.is_empty() as i32 } else { (used - first) as i32 };
        let entry = ffi::ibv_recv_wr {
            wr_id: wr_id(k, w),
            // SAFETY: k + 1 < n <= CHUNK, so the pointer stays within `wrs`.
            next: if k + 1 < n { unsafe { base.add(k + 1) } } else { std::ptr::null_mut() },
            // SAFETY: first < CHUNK_SGE (see above).
            sg_list: unsafe { sge_base.add(first) },
            num_sge,
        };
        // SAFETY: k < n <= CHUNK: within `wrs`.
        unsafe { base.add(k).write(entry) };
    }
    post(base, n)
}

impl SendWr<'_> {
    /// The scatter entries [`SendWr::lower`] writes: one for the first piece (or the inline
    /// data, or nothing), one for each later piece.
    #[inline(always)]
    pub(crate) fn sge_entries(&self) -> usize {
        1 + self.rest.len().min(MAX_SGE - 1)
    }

    /// Lowers this work request (checked, and staged in its slot as `wr_id`) to its raw form:
    /// the one place that builds an `ibv_send_wr` (opcode, flags, remote address or datagram
    /// destination, immediate data) and its scatter list. Writes the scatter entries at `sge`
    /// and points the work request at them; `next` is NULL (the caller links lists).
    ///
    /// A zero-length work request gets no scatter entry (some providers read a byte count of 0
    /// as 2 GiB); a list of several pieces has no empty piece (its constructors refuse them).
    ///
    /// # Safety
    /// `sge` must be valid for writes of [`SendWr::sge_entries`] entries (at most
    /// [`MAX_SGE`]), and stay so for as long as the returned work request is used.
    #[inline(always)]
    pub(crate) unsafe fn lower(
        &self,
        wr_id: u64,
        signaled: bool,
        ud: Option<&UdDest>,
        sge: *mut ffi::ibv_sge,
    ) -> ffi::ibv_send_wr {
        let first = match (self.inline, &self.local) {
            (Some(data), _) => ffi::ibv_sge { addr: data.as_ptr() as u64, length: data.len() as u32, lkey: 0 },
            (None, Some((m, range))) => m.sge(range),
            (None, None) => ffi::ibv_sge { addr: 0, length: 0, lkey: 0 },
        };
        // SAFETY: the caller gives room for sge_entries() >= 1 entries.
        unsafe { sge.write(first) };
        let mut num_sge = 1;
        for (m, r) in self.rest.iter().take(MAX_SGE - 1) {
            // SAFETY: one entry per later piece, within the sge_entries() the caller gave room
            // for.
            unsafe { sge.add(num_sge).write(m.sge(r)) };
            num_sge += 1;
        }
        if self.rest.is_empty() && self.inline.is_none() && self.local.as_ref().is_none_or(|(_, r)| r.is_empty()) {
            num_sge = 0;
        }
        // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions of those); all-zero
        // is a valid value.
        let mut r: ffi::ibv_send_wr = unsafe { mem::zeroed() };
        r.wr_id = wr_id;
        r.sg_list = sge;
        r.num_sge = num_sge as i32;
        use ffi::ibv_wr_opcode::*;
        r.opcode = match (self.op, self.imm.is_some()) {
            (SendOp::SendInv { rkey }, _) => {
                r.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
                IBV_WR_SEND_WITH_INV
            }
            (SendOp::BindMw { mw, rkey, mr, addr, len, access }, _) => {
                r.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
                    mw: mw as *mut ffi::ibv_mw,
                    rkey,
                    bind_info: ffi::ibv_mw_bind_info {
                        mr: mr as *mut ffi::ibv_mr,
                        addr,
                        length: len,
                        mw_access_flags: access,
                    },
                };
                IBV_WR_BIND_MW
            }
            (SendOp::LocalInv { rkey }, _) => {
                r.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
                IBV_WR_LOCAL_INV
            }
            (SendOp::Send, false) => IBV_WR_SEND,
            (SendOp::Send, true) => IBV_WR_SEND_WITH_IMM,
            (SendOp::Write { .. }, false) => IBV_WR_RDMA_WRITE,
            (SendOp::Write { .. }, true) => IBV_WR_RDMA_WRITE_WITH_IMM,
            (SendOp::Read { .. }, _) => IBV_WR_RDMA_READ,
            (SendOp::FetchAdd { .. }, _) => IBV_WR_ATOMIC_FETCH_AND_ADD,
            (SendOp::CompareSwap { .. }, _) => IBV_WR_ATOMIC_CMP_AND_SWP,
        };
        if let Some(imm) = self.imm {
            r.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        match self.op {
            SendOp::Write { addr, rkey } | SendOp::Read { addr, rkey } => {
                r.wr.rdma = ffi::rdma_t { remote_addr: addr, rkey };
            }
            SendOp::FetchAdd { addr, rkey, add } => {
                r.wr.atomic = ffi::atomic_t { remote_addr: addr, compare_add: add, swap: 0, rkey };
            }
            SendOp::CompareSwap { addr, rkey, compare, swap } => {
                r.wr.atomic = ffi::atomic_t { remote_addr: addr, compare_add: compare, swap, rkey };
            }
            SendOp::SendInv { .. } | SendOp::BindMw { .. } | SendOp::LocalInv { .. } => {}
            SendOp::Send => {
                if let Some(d) = ud {
                    r.wr.ud = ffi::ud_t { ah: d.ah().as_raw(), remote_qpn: d.qpn(), remote_qkey: d.qkey() };
                }
            }
        }
        use ffi::ibv_send_flags as f;
        let mut flags = 0;
        if signaled {
            flags |= f::IBV_SEND_SIGNALED.0;
        }
        if self.solicited {
            flags |= f::IBV_SEND_SOLICITED.0;
        }
        if self.inline.is_some() {
            flags |= f::IBV_SEND_INLINE.0;
        }
        r.send_flags = flags;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejected_from_accepts_only_pointers_into_the_list() {
        let list = [0u64; 4];
        let first = list.as_ptr();
        assert_eq!(rejected_from(first.wrapping_add(2).cast_mut(), first, 4), Some(2));
        assert_eq!(rejected_from(std::ptr::null_mut(), first, 4), None);
        assert_eq!(rejected_from(first.wrapping_add(4).cast_mut(), first, 4), None, "one past the end");
        let odd = (first as usize + 3) as *mut u64;
        assert_eq!(rejected_from(odd, first, 4), None, "not at an entry");
    }
}
