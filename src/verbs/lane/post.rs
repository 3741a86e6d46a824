use super::refused::{post_list_failed, refusal, refusal_recv};
use super::{tag, unknown_qp, Lane, LaneQp, Member, RecvWr, Rejected, RejectedList, SendWr, MAX_LIST};
use crate::error::Error;
use crate::error::Result;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::wr::rejected_from;
use crate::verbs::wr::MAX_SGE;
use rdma_sys as ffi;
use std::mem;
use std::mem::MaybeUninit;

impl Lane {
    /// `member` without building its error: `None` for a `qp` this lane does not hold.
    #[inline(always)]
    fn member_or_none(&mut self, qp: LaneQp) -> Option<&mut Member> {
        match self.members.get_mut(qp.place as usize) {
            Some(Some(m)) if m.key.attach == qp.attach => Some(m),
            _ => None,
        }
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
        // Without drop glue until its region is taken out: no unwinding path then needs the
        // request's address, so the compiler keeps its fields in registers (a request some
        // path may drop in place is kept in memory, each field stored as it is built). Every
        // path below takes it back (`into_inner`); were a panic to unwind through here, the
        // region would be leaked, which is safe.
        let wr = mem::ManuallyDrop::new(wr);
        // Every refusal below builds its error out of line, where the region is handed over
        // (`unknown_qp_back`, `refused_back`, `Refusal::rejected`): no call is made on the way
        // while the region is in hand, so the compiler keeps it in a scratch register.
        let Some(m) = self.member_or_none(qp) else {
            return Err(unknown_qp_back(mem::ManuallyDrop::into_inner(wr).mr));
        };
        let free = m.send.free();
        if free == 0 || m.failed.is_some() {
            return Err(refused_back(m, true, mem::ManuallyDrop::into_inner(wr).mr));
        }
        let seq = m.send.tail;
        let mut sge: [MaybeUninit<ffi::ibv_sge>; MAX_SGE] = [const { MaybeUninit::uninit() }; MAX_SGE];
        // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of those): all-zero
        // is a valid value.
        let mut raw: ffi::ibv_send_wr = unsafe { mem::zeroed() };
        let id = m.send.tag(seq);
        if let Err(r) = wr.check_lower(m, id, wr.signaled || free == 1, &mut raw, &mut sge) {
            return Err(r.rejected("post_send", mem::ManuallyDrop::into_inner(wr).mr));
        }
        let SendWr { mr, wr_id, .. } = mem::ManuallyDrop::into_inner(wr);
        // The region goes into the slot at `tail` before the call, committed: nothing but `m`
        // is then held across the call. When the provider did not take the request, the slot
        // is emptied again (`refused_after_put`).
        m.send.put(0, mr, wr_id);
        m.send.tail = seq.wrapping_add(1);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (its owner is in `m`); `raw` is one NULL-terminated work
        // request over `sge`, both alive for the call; the constructors and `lower` checked
        // every piece against the region (bounds, access, PD), and the region sits in the
        // slot, so it stays allocated and out of Rust's reach until a completion retires the
        // slot.
        let ret = unsafe { m.provider_post_send(&mut raw, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        Err(refused_after_put(m, ret, std::ptr::eq(bad, &raw), true))
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
        // The slots filled so far, released if the iterator panics (its `next`, or its drop).
        let mut staging = Staging { m, k: 0 };
        for w in wrs {
            // Without drop glue until its region is taken out, as in `post_send`.
            let w = mem::ManuallyDrop::new(w);
            let (m, k) = (&mut *staging.m, staging.k);
            if k as usize == MAX_LIST || k == free {
                staging.k = 0;
                let w = mem::ManuallyDrop::into_inner(w);
                return Err(unstage(staging.m, k, (w.wr_id, w.mr), list_too_long(k, free)));
            }
            // SAFETY: k < MAX_LIST: within `raw`; all-zero is a valid ibv_send_wr.
            let r = unsafe {
                base.add(k as usize).write(mem::zeroed());
                &mut *base.add(k as usize)
            };
            let id = m.send.tag(seq.wrapping_add(k as u64));
            // The one that takes the last free slot is signaled, so a full queue drains.
            if let Err(r) = w.check_lower(m, id, w.signaled || k + 1 == free, r, &mut sge[k as usize]) {
                staging.k = 0;
                let w = mem::ManuallyDrop::into_inner(w);
                return Err(unstage(staging.m, k, (w.wr_id, w.mr), r.error("post_send")));
            }
            let i = k as usize;
            if k > 0 {
                // SAFETY: k - 1 < k < MAX_LIST: both entries written above, within `raw`.
                unsafe { (*base.add(i - 1)).next = base.add(i) };
            }
            // Staged: the slot holds it from here on; committed below once the provider took it.
            // Counted, so that a panic of the iterator's `next` releases it.
            let SendWr { mr, wr_id, .. } = mem::ManuallyDrop::into_inner(w);
            m.send.put(k, mr, wr_id);
            staging.k = k + 1;
        }
        // The iterator is done (and dropped): no user code runs from here on.
        let k = std::mem::take(&mut staging.k);
        let m = &mut *staging.m;
        if k == 0 {
            return Ok(0);
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; raw[..k] is an initialised NULL-terminated list (the last
        // entry's `next` is still zero) over `sge`, alive for the call; every piece was checked
        // by `SendWr::lower`, and every region sits in a slot until a completion retires it.
        let ret = unsafe { m.provider_post_send(base, &mut bad) };
        if ret == 0 {
            m.send.tail = seq.wrapping_add(k as u64);
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
            let id = tag::encode(qp.place, m.send.tail.wrapping_add(k as u64), false);
            // The one that takes the last free slot is signaled, so a full queue drains.
            w.lower(m, id, w.signaled || k + 1 == free, r, &mut sge[k as usize])?;
            if k + 1 < count {
                // SAFETY: k + 1 < count <= MAX_LIST: within `raw`.
                r.next = unsafe { base.add(k as usize + 1) };
            }
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; raw[..count] is an initialised NULL-terminated list over
        // `sge`, alive for the call; every piece was checked by `SendWr::lower`, and every region
        // moves into a slot below before anything can reach it.
        let ret = unsafe { m.provider_post_send(base, &mut bad) };
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
        m.send.commit(posted);
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
    /// domain or without `LOCAL_WRITE`, a UD receive with no room for the [`GRH_LEN`](crate::verbs::ah::GRH_LEN)-byte GRH,
    /// or an unknown `qp`, and for a scattered receive ([`RecvWr::scatter`]) of more pieces
    /// than the QP takes ([`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge)) or of an
    /// empty one; [`Error::QpInError`]; [`Error::Call`] as for [`Lane::post_send`].
    #[inline(always)]
    pub fn post_recv(&mut self, qp: LaneQp, wr: RecvWr) -> std::result::Result<(), Rejected<MemoryRegion>> {
        // Without drop glue until its region is taken out, as in `post_send`.
        let wr = mem::ManuallyDrop::new(wr);
        let Some(m) = self.member_or_none(qp) else {
            return Err(unknown_qp_back(mem::ManuallyDrop::into_inner(wr).mr));
        };
        if (m.recv.free() == 0 || m.failed.is_some()) && m.refuses_recv(1) {
            return Err(refused_back(m, false, mem::ManuallyDrop::into_inner(wr).mr));
        }
        let seq = m.recv.tail;
        let num_sge = match wr.check(m) {
            Ok(n) => n,
            Err(r) => return Err(r.rejected("post_recv", mem::ManuallyDrop::into_inner(wr).mr)),
        };
        // Its scatter list: the first piece, and the others only for a scattered receive.
        let mut sge = wr.sges();
        let RecvWr { mr, wr_id, .. } = mem::ManuallyDrop::into_inner(wr);
        let mut raw = ffi::ibv_recv_wr {
            wr_id: m.recv.tag(seq),
            next: std::ptr::null_mut(),
            sg_list: sge.as_mut_ptr().cast(),
            num_sge,
        };
        // Into the slot before the call, committed, as in `post_send`.
        m.recv.put(0, mr, wr_id);
        m.recv.tail = seq.wrapping_add(1);
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `raw` is one NULL-terminated receive over `sge`, alive for
        // the call, whose first `num_sge` entries are written (`check` found no defect, so
        // `scatter` wrote every piece); each piece was checked (bounds, PD, LOCAL_WRITE, the
        // QP's `max_recv_sge`), and the region sits in the slot, out of Rust's reach until its
        // completion.
        let ret = unsafe { m.provider_post_recv(&mut raw, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        Err(refused_after_put(m, ret, std::ptr::eq(bad, &raw), false))
    }

    /// Posts up to [`MAX_LIST`] receives in one `ibv_post_recv`, as
    /// [`Lane::post_send_list`] posts sends.
    ///
    /// Each receive names one range: a scattered one ([`RecvWr::scatter`] of several) is
    /// refused with [`Error::InvalidArgument`] (post it with [`Lane::post_recv`]).
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
        if (count > m.recv.free() || m.failed.is_some()) && m.refuses_recv(count) {
            return Err(refusal_recv(m));
        }
        let mut raw: [MaybeUninit<ffi::ibv_recv_wr>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let mut sge: [MaybeUninit<ffi::ibv_sge>; MAX_LIST] = [const { MaybeUninit::uninit() }; MAX_LIST];
        let base: *mut ffi::ibv_recv_wr = raw.as_mut_ptr().cast();
        for (k, w) in wrs.iter().flatten().enumerate() {
            let k = k as u32;
            let num_sge = w.lower_one(m, "post_recv_list")?;
            sge[k as usize].write(w.sge);
            let next = if k + 1 < count {
                // SAFETY: k + 1 < count <= MAX_LIST: within `raw`.
                unsafe { base.add(k as usize + 1) }
            } else {
                std::ptr::null_mut()
            };
            let entry = ffi::ibv_recv_wr {
                wr_id: tag::encode(qp.place, m.recv.tail.wrapping_add(k as u64), true),
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
        let ret = unsafe { m.provider_post_recv(base, &mut bad) };
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
        m.recv.commit(posted);
        if ret == 0 {
            return Ok(posted as usize);
        }
        Err(post_list_failed(m, ret, posted < count, "ibv_post_recv"))
    }
}

/// The slots a `post_send_iter` has filled beyond `tail` while its iterator runs (`k` of
/// them): if the iterator panics, in its `next` or its drop, they are released (never posted:
/// the device never saw those regions).
struct Staging<'a> {
    m: &'a mut Member,
    k: u32,
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if self.k != 0 {
            self.m.send.release_staged(self.k);
        }
    }
}

/// The refusal of a single work request whose region was put into the slot at `tail` and
/// committed before the provider's call: when the provider named it (it did not take it), the
/// slot is emptied again (`tail` put back) and the region comes back; otherwise it may run, so
/// it stays in its slot until the flush retires it, and the QP is moved to the error state.
#[cold]
#[inline(never)]
fn refused_after_put(m: &mut Member, ret: i32, named: bool, send: bool) -> Rejected<MemoryRegion> {
    let op = if send { "ibv_post_send" } else { "ibv_post_recv" };
    if !named {
        return Rejected::kept(post_list_failed(m, ret, false, op));
    }
    let slots = if send { &mut m.send } else { &mut m.recv };
    slots.tail = slots.tail.wrapping_sub(1);
    match slots.unput() {
        Some(mr) => Rejected::new(Error::call(op, ret, None), mr),
        // Never: the post put it there, and nothing took it since.
        None => Rejected::kept(Error::call(op, ret, None)),
    }
}

/// The refusal of a post for a `LaneQp` the lane does not hold, with its region.
#[cold]
#[inline(never)]
fn unknown_qp_back(mr: MemoryRegion) -> Rejected<MemoryRegion> {
    Rejected::new(unknown_qp(), mr)
}

/// The refusal of a post to a full queue (the send queue: `send`) or a QP in error, with its
/// region.
#[cold]
#[inline(never)]
fn refused_back(m: &Member, send: bool, mr: MemoryRegion) -> Rejected<MemoryRegion> {
    Rejected::new(if send { refusal(m, "ibv_post_send") } else { refusal_recv(m) }, mr)
}

/// Gives back the `k` staged (uncommitted) work requests of a list that is not posted, and
/// `w`, with `error`.
#[cold]
#[inline(never)]
fn unstage(m: &mut Member, k: u32, w: (u64, MemoryRegion), error: Error) -> RejectedList {
    let mut returned = m.send.take_staged(0, k);
    returned.push(w);
    RejectedList { error, returned }
}

/// A list of `k` staged work requests the provider refused from `named` on (`None`: it did not
/// say, so all are kept as posted and the QP goes to the error state).
#[cold]
#[inline(never)]
fn list_refused(m: &mut Member, ret: i32, named: Option<usize>, k: u32) -> RejectedList {
    let posted = named.map_or(k, |p| p as u32);
    let returned = m.send.take_staged(posted, k);
    m.send.commit(posted);
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
