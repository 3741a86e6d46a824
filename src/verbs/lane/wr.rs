use super::*;

/// A refused post: the error, and what is given back (the work request's region, for a post
/// the provider did not take; `None` when it may have: the lane then keeps the region until the
/// flush retires it).
pub struct Rejected<T> {
    // Boxed: a post that succeeds then returns one word, and only a refusal allocates.
    inner: Box<(Error, Option<T>)>,
}

impl<T> Rejected<T> {
    #[cold]
    pub(super) fn new(error: Error, returned: T) -> Rejected<T> {
        Rejected { inner: Box::new((error, Some(returned))) }
    }
    #[cold]
    pub(super) fn with(error: Error, returned: Option<T>) -> Rejected<T> {
        Rejected { inner: Box::new((error, returned)) }
    }
    #[cold]
    pub(super) fn kept(error: Error) -> Rejected<T> {
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
    pub(super) error: Error,
    pub(super) returned: Vec<(u64, MemoryRegion)>,
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
pub(super) enum Kind {
    Send,
    Write { remote: RemoteRegion, offset: u64 },
    Read { remote: RemoteRegion, offset: u64 },
    FetchAdd { remote: RemoteRegion, offset: u64, add: u64 },
    CompareSwap { remote: RemoteRegion, offset: u64, compare: u64, swap: u64 },
}

/// A range of a region, as a post names it: (start, length), or why it cannot be one.
pub(super) type Piece = (u64, u32);

/// Turns a range into a piece; the bounds against the region are checked at post.
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

/// A send-queue work request of a lane: a send, an RDMA WRITE or READ, or an atomic, whose
/// local memory is pieces of one [`MemoryRegion`], moved into the lane when it is posted.
pub struct SendWr {
    pub(super) mr: MemoryRegion,
    pub(super) kind: Kind,
    pub(super) pieces: [Piece; MAX_SGE],
    pub(super) n: u8,
    /// Why the request cannot be posted (found by a constructor; reported by the post).
    pub(super) bad: Option<&'static str>,
    pub(super) wr_id: u64,
    pub(super) imm: Option<u32>,
    pub(super) signaled: bool,
    pub(super) solicited: bool,
    pub(super) dest: Option<DestKey>,
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
    pub(super) fn one(mr: MemoryRegion, kind: Kind, range: Range<usize>) -> SendWr {
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
    pub(super) fn new(mr: MemoryRegion, kind: Kind, ranges: &[Range<usize>]) -> SendWr {
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
    pub(super) mr: MemoryRegion,
    pub(super) piece: std::result::Result<Piece, &'static str>,
    pub(super) wr_id: u64,
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

/// Gives back the `k` staged (uncommitted) work requests of a list that is not posted, and
/// `w`, with `error`.
#[cold]
#[inline(never)]
pub(super) fn unstage(m: &mut Member, k: u32, w: (u64, MemoryRegion), error: Error) -> RejectedList {
    let mut returned = take_staged(&mut m.send, 0, k);
    returned.push(w);
    RejectedList { error, returned }
}

/// Takes the staged slots `tail + from .. tail + to` back out.
pub(super) fn take_staged(slots: &mut Slots, from: u32, to: u32) -> Vec<(u64, MemoryRegion)> {
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
pub(super) fn list_refused(m: &mut Member, ret: i32, named: Option<usize>, k: u32) -> RejectedList {
    let posted = named.map_or(k, |p| p as u32);
    let returned = take_staged(&mut m.send, posted, k);
    m.send.tail = m.send.tail.wrapping_add(posted);
    RejectedList { error: post_list_failed(m, ret, named.is_some(), "ibv_post_send"), returned }
}

#[cold]
pub(super) fn list_too_long(k: u32, free: u32) -> Error {
    if k == free {
        Error::QueueFull { queue: "send", depth: free }
    } else {
        Error::InvalidArgument(format!("post_send_iter: more than {MAX_LIST} work requests in one list"))
    }
}

/// Lowers a send-queue work request into `out` (a zeroed `ibv_send_wr`) and `sge`, checking it
/// against the QP `m`: the one place where a lane's work request becomes the verbs' form.
#[inline(always)]
pub(super) fn lower_send(
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
pub(super) fn lower_recv(w: &RecvWr, m: &Member, sge: &mut MaybeUninit<ffi::ibv_sge>) -> Result<i32> {
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
pub(super) fn remote_at(remote: &RemoteRegion, offset: u64, len: u64) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= remote.len => Ok(remote.addr.wrapping_add(offset)),
        _ => Err(out_of_remote(offset, len, remote.len)),
    }
}

#[cold]
pub(super) fn out_of_remote(offset: u64, len: u64, size: u64) -> Error {
    Error::OutOfBounds { what: "remote region", offset, len, size }
}

#[cold]
pub(super) fn out_of_region(offset: u64, len: u32, size: u64) -> Error {
    Error::OutOfBounds { what: "memory region", offset, len: len as u64, size }
}

#[cold]
pub(super) fn bad_request(op: &str, why: &str) -> Error {
    Error::InvalidArgument(format!("{op}: {why}"))
}

#[cold]
pub(super) fn atomic_target(remote: &RemoteRegion, offset: u64) -> Result<u64> {
    let addr = remote.at(offset, 8)?;
    if addr % 8 != 0 {
        return Err(Error::InvalidArgument(format!(
            "post_send: an atomic's target {addr:#x} is not 8-byte aligned (the device would fail it)"
        )));
    }
    Ok(addr)
}

#[cold]
pub(super) fn no_room_for_grh(len: u32) -> Error {
    Error::InvalidArgument(format!(
        "post_recv: a UD receive of {len} bytes has no room for the {GRH_LEN}-byte GRH the device writes first"
    ))
}

#[cold]
pub(super) fn too_long(len: u64, mtu: u32) -> Error {
    Error::MessageTooLong { len, mtu }
}

#[cold]
pub(super) fn other_pd() -> Error {
    Error::InvalidArgument("post: the memory region is registered on another protection domain than the QP".into())
}

#[cold]
pub(super) fn needs_local_write() -> Error {
    Error::InvalidArgument(
        "post: the device writes this region (receive, RDMA READ target or atomic result): register it with LOCAL_WRITE"
            .into(),
    )
}

#[cold]
pub(super) fn too_many_pieces(n: usize, max: u32) -> Error {
    Error::InvalidArgument(format!(
        "post_send: a work request of {n} pieces exceeds the QP's limit of {max}: create it with QpInit::max_send_sge"
    ))
}

#[cold]
pub(super) fn ud_needs_dest(missing: bool) -> Error {
    Error::InvalidArgument(if missing {
        "post_send: a UD QP sends datagrams only, each to a destination (SendWr::to, Lane::add_dest)".into()
    } else {
        "post_send: an RC QP takes no destination, and a UD QP no RDMA or atomic".into()
    })
}

/// Why a post is refused before it reaches the provider: a full send queue, or a QP in error.
#[cold]
pub(super) fn refusal(m: &Member, op: &'static str) -> Error {
    match m.failed {
        Some(status) => qp_in_error(m, status, op),
        None => Error::QueueFull { queue: "send", depth: m.send.depth },
    }
}

#[cold]
pub(super) fn refusal_recv(m: &Member) -> Error {
    match m.failed {
        Some(status) => qp_in_error(m, status, "ibv_post_recv"),
        None => Error::QueueFull { queue: "receive", depth: m.recv.depth },
    }
}

pub(super) fn qp_in_error(m: &Member, status: u32, op: &'static str) -> Error {
    let addr = m.owner.lane_peer();
    let cause = if status == ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
        "the lane moved it there (Lane::set_error, or the peer disconnected)".to_string()
    } else {
        let st = WcStatus::from_raw(status);
        format!("a completion failed with {st}{}", st.hint().map(|h| format!(" ({h})")).unwrap_or_default())
    };
    Error::QpInError { op, addr, cause }
}

#[cold]
pub(super) fn poll_failed(ret: i32) -> Error {
    Error::call("ibv_poll_cq", if ret == -1 { libc::EIO } else { ret.saturating_neg() }, None)
}

/// What is left to do when the provider refused a single work request: give it back when the
/// provider named it (`named`), or keep it (it may run) and move the QP to the error state.
#[cold]
#[inline(never)]
pub(super) fn post_failed_one(
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
pub(super) fn post_list_failed(m: &mut Member, ret: i32, known: bool, op: &'static str) -> Error {
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
