//! [`QueuePair`]: an owned RC queue pair and its sound, allocation-free data path.
//!
//! # Ownership of in-flight memory
//!
//! Every work request names its local memory as a range of a [`MemoryRegion`]. Posting stores
//! a clone of the region's handle in the QP's slot table (a fixed ring per work queue, sized by
//! the queue depth and allocated once, when the QP is created). Reaping the completion drops
//! that clone. Since the region's byte accessors need the handle to be unique, Rust code can
//! never read or write memory the device may be using, and the memory can never be freed
//! under the device. Posting clones an `Arc` (an atomic increment): no heap allocation.
//!
//! Work queues of an RC QP complete in order, so each ring retires every slot up to the one a
//! completion names. That is also how unsignaled sends are retired: by the next signaled
//! completion on the same queue; the work request that takes the send queue's last free slot
//! is signaled whatever it asked, so a queue full of unsignaled work can always drain. The
//! rings never admit more work requests than the queue holds, so a full queue is a clear
//! [`Error::QueueFull`] rather than a provider error, and the CQ (at least as deep as the
//! queue) cannot overrun.
//!
//! # Failed posts
//!
//! When `ibv_post_send`/`ibv_post_recv` fails and names the first work request it did not
//! take (`bad_wr` inside the list), the ones before it are tracked as posted and the rest are
//! released. When it fails *without* saying how far it got (`bad_wr` NULL or outside the list:
//! rxe, for one, keeps a send posted before the QP is ready and runs it later), nothing is
//! released: every staged work request counts as posted, the QP is moved to the error state,
//! and the flush retires them. Sequence numbers are never reused, so a late completion can
//! never retire a newer work request.
//!
//! # Completions nobody asked for yet
//!
//! [`QueuePair::wait_for`] waits for one `wr_id`; successful completions of other work requests
//! that it meets first are kept, in order, and returned by the next [`QueuePair::poll`],
//! [`QueuePair::wait`] or `wait_for`. They hold their place in the queue until then (the
//! queue's room is what bounds them), so nothing is lost and nothing allocates.
//!
//! # Raw posts
//!
//! Every `wr_id` this crate posts carries a tag (bit 62 set, and 14 bits unique to the QP). A
//! completion without that tag is not the crate's: it retires nothing and is discarded by the
//! polls here. Work posted through [`QueuePair::as_raw`] must therefore use `wr_id`s with bit
//! 62 clear, and be reaped by the caller from a CQ the crate does not poll.
//!
//! # Leaks, panics and drop
//!
//! `mem::forget` on a QP leaks its slots, so the regions they hold are never freed: safe.
//! Dropping a QP (also during unwinding) moves it to the error state, reaps the flushed
//! completions for a bounded time, destroys the QP, and only then releases the slots. If the
//! destroy fails, the slots are leaked rather than released.

use std::fmt;
use std::mem::{self, MaybeUninit};
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::cm_id::CmId;
use crate::cq::{CompletionQueue, WorkCompletion, WorkQueue};
use crate::error::{check_ibv, check_rdma, Error, Result};
use crate::event_channel::{CmEvent, CmEventType};
use crate::mr::{check_range, AccessFlags, MemoryRegion};
use crate::pd::ProtectionDomain;
use crate::ring::{Hold, Pending, Ring};
use crate::wait::{poll_readable, pollfd, Deadline};
use crate::wr::{RecvWr, SendOp, SendWr};

/// Tags receive-queue `wr_id`s so a CQ shared by both queues of one QP routes correctly.
const RECV_TAG: u64 = 1 << 63;
/// Set in every `wr_id` this crate posts: a completion without it is someone else's.
const OURS: u64 = 1 << 62;
/// Where the QP's nonce sits in a `wr_id`, and how wide it is.
const NONCE_SHIFT: u32 = 48;
const NONCE_MASK: u64 = (1 << 14) - 1;
/// The sequence number's bits in a `wr_id` (the full number is recovered from the ring).
const SEQ_BITS: u32 = 48;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// A QP's tag: a counter mixed with the QP number, so that two QPs on one CQ, or a QP made
/// after another with the same number, do not share it.
fn next_nonce(qp_num: u32) -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (n.wrapping_mul(0x9E37_79B9) ^ qp_num as u64) & NONCE_MASK
}
/// Work requests linked into one `ibv_post_*` call (the stack arrays' size).
const CHUNK: usize = 16;
/// Completions read per `ibv_poll_cq` call (the stack array's size).
const POLL_CHUNK: usize = 16;
/// How long Drop waits for flushed completions before destroying the QP anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Queue-pair capabilities. Defaults follow the seed program: 16 send and 16 receive work
/// requests, one scatter/gather entry each, and 64 bytes of inline data.
#[derive(Debug, Clone)]
pub struct QpInit {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_inline_data: u32,
    pub(crate) send_cq: Option<Arc<CompletionQueue>>,
    pub(crate) recv_cq: Option<Arc<CompletionQueue>>,
}

impl Default for QpInit {
    fn default() -> Self {
        QpInit { max_send_wr: 16, max_recv_wr: 16, max_inline_data: 64, send_cq: None, recv_cq: None }
    }
}

impl QpInit {
    /// Defaults (16/16 work requests, 64 bytes inline).
    pub fn new() -> QpInit {
        QpInit::default()
    }
    /// Send queue depth.
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.max_send_wr = n;
        self
    }
    /// Receive queue depth.
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.max_recv_wr = n;
        self
    }
    /// Largest inline send, in bytes.
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.max_inline_data = n;
        self
    }
    /// Uses `cq` for send completions instead of creating one. It may be the same as the
    /// receive CQ, but no other QP may use it, and it must be on the QP's device.
    pub fn send_cq(mut self, cq: Arc<CompletionQueue>) -> Self {
        self.send_cq = Some(cq);
        self
    }
    /// Uses `cq` for receive completions instead of creating one.
    pub fn recv_cq(mut self, cq: Arc<CompletionQueue>) -> Self {
        self.recv_cq = Some(cq);
        self
    }
}

/// An owned RC queue pair, created through librdmacm on a [`CmId`].
///
/// Only the connection typestates create one, each consuming the state that owns the id, so an
/// id has at most one QP; there is no constructor that takes a shared id:
///
/// ```compile_fail
/// # fn f(id: &std::sync::Arc<rdma_cm::CmId>, pd: &std::sync::Arc<rdma_cm::ProtectionDomain>) {
/// let qp = rdma_cm::QueuePair::new(id, pd, rdma_cm::QpInit::new());
/// # }
/// ```
pub struct QueuePair {
    raw: NonNull<ffi::ibv_qp>,
    qp_num: u32,
    max_inline: u32,
    /// The tag in every `wr_id` this QP posts (already shifted into place, with `OURS`).
    tag: u64,
    /// The connection is established: waits may read the id's CM events (when no one else
    /// can read its channel), to notice the peer leaving.
    connected: bool,
    /// A DISCONNECTED (or DEVICE_REMOVAL) event was seen; the QP was moved to error.
    peer_left: bool,
    /// Its teardown was handed to another value (see Drop): this one destroys nothing.
    #[cfg(feature = "tokio")]
    detached: bool,
    send: Ring,
    recv: Ring,
    /// Completions reaped but not delivered yet, per queue.
    send_pending: Pending,
    recv_pending: Pending,
    // Field order is drop order after Drop::drop: the id, CQs and PD outlive the QP, which
    // Drop::drop destroys first.
    id: Arc<CmId>,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the QP is owned uniquely; posting and polling take &mut self. The regions in the
// rings are Send + Sync handles. Verbs on a QP may be called from any thread.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Creates an RC QP on `id` with `rdma_create_qp`, so librdmacm drives its state changes
    /// during connect/accept. Only the typestates call this ([`RouteResolved::create_qp`],
    /// [`ConnectRequest::create_qp`]), each consuming the state that owns the id, so an id gets
    /// at most one QP.
    ///
    /// [`RouteResolved::create_qp`]: crate::RouteResolved::create_qp
    /// [`ConnectRequest::create_qp`]: crate::ConnectRequest::create_qp
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for empty queues, CQs shallower than the queues, or a PD or
    /// CQ of another device; [`Error::CqInUse`]; [`Error::Call`] when `rdma_create_qp` fails
    /// (e.g. `EINVAL` when the capabilities exceed the device's limits).
    pub(crate) fn new(id: &Arc<CmId>, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<QueuePair> {
        if init.max_send_wr == 0 || init.max_recv_wr == 0 {
            return Err(Error::InvalidArgument("QP needs at least one send and one receive work request".into()));
        }
        let ctx = pd.context();
        // The kernel looks CQ handles up in the QP's own device file, where another device's
        // CQ number names some other CQ: require one device for the id, the PD and the CQs.
        let dev = ctx.as_raw();
        if id.verbs().map(|v| v.as_ptr()) != Some(dev) {
            return Err(Error::InvalidArgument(format!(
                "the protection domain is on device {}, not on the device of this connection's route",
                ctx.device_name()
            )));
        }
        for cq in [&init.send_cq, &init.recv_cq].into_iter().flatten() {
            if cq.context().as_raw() != dev {
                return Err(Error::InvalidArgument(format!(
                    "the completion queue is on device {}, but the QP is on {}: a QP and its CQs must share a device",
                    cq.context().device_name(),
                    ctx.device_name()
                )));
            }
        }
        let send_cq = match init.send_cq {
            Some(cq) => cq,
            None => CompletionQueue::new(ctx, init.max_send_wr)?,
        };
        let recv_cq = match init.recv_cq {
            Some(cq) => cq,
            None => CompletionQueue::new(ctx, init.max_recv_wr)?,
        };
        send_cq.claim()?;
        if !Arc::ptr_eq(&send_cq, &recv_cq) {
            if let Err(e) = recv_cq.claim() {
                send_cq.unclaim();
                return Err(e);
            }
        }
        let unclaim = || {
            send_cq.unclaim();
            recv_cq.unclaim();
        };
        let shared_depth = init.max_send_wr as u64 + init.max_recv_wr as u64;
        if (Arc::ptr_eq(&send_cq, &recv_cq) && (send_cq.depth() as u64) < shared_depth)
            || send_cq.depth() < init.max_send_wr
            || recv_cq.depth() < init.max_recv_wr
        {
            unclaim();
            return Err(Error::InvalidArgument(
                "a CQ is shallower than the work queues it serves; it could overrun".into(),
            ));
        }
        // SAFETY: ibv_qp_init_attr is plain old data; zero is a valid start.
        let mut attr: ffi::ibv_qp_init_attr = unsafe { mem::zeroed() };
        attr.send_cq = send_cq.as_raw();
        attr.recv_cq = recv_cq.as_raw();
        attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = init.max_send_wr;
        attr.cap.max_recv_wr = init.max_recv_wr;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.cap.max_inline_data = init.max_inline_data;
        let raw = {
            // The channel's lock: no event processing reads id->qp while it is being set.
            let _lock = id.channel().lock();
            // SAFETY: id, PD and CQs are valid and on one device (checked above; librdmacm
            // checks the PD's context against the id's too); attr is fully initialised. The
            // caller owns the id's only QP-creating state, and the lock keeps librdmacm's
            // event processing off id->qp meanwhile.
            let ret = unsafe { ffi::rdma_create_qp(id.as_raw(), pd.as_raw(), &mut attr) };
            if let Err(e) = check_rdma(ret, "rdma_create_qp") {
                unclaim();
                return Err(e);
            }
            // SAFETY: rdma_create_qp succeeded, so id->qp is the new QP.
            unsafe { (*id.as_raw()).qp }
        };
        let Some(raw) = NonNull::new(raw) else {
            unclaim();
            return Err(Error::call("rdma_create_qp", libc::EIO, None));
        };
        // SAFETY: raw is a valid QP; qp_num is immutable.
        let qp_num = unsafe { (*raw.as_ptr()).qp_num };
        Ok(QueuePair {
            raw,
            qp_num,
            tag: OURS | (next_nonce(qp_num) << NONCE_SHIFT),
            connected: false,
            peer_left: false,
            #[cfg(feature = "tokio")]
            detached: false,
            max_inline: attr.cap.max_inline_data,
            send: Ring::new(init.max_send_wr),
            recv: Ring::new(init.max_recv_wr),
            send_pending: Pending::new(init.max_send_wr),
            recv_pending: Pending::new(init.max_recv_wr),
            id: Arc::clone(id),
            send_cq,
            recv_cq,
            pd: Arc::clone(pd),
        })
    }

    /// The raw QP. It stays owned by `self`. Posting to it directly bypasses the slot table:
    /// such work requests must use `wr_id`s with bit 62 clear (the crate's tag), which the
    /// polls here recognise as foreign and discard, and the memory they name is the caller's
    /// to keep alive (see the module docs).
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.raw.as_ptr()
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &Arc<CompletionQueue> {
        &self.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &Arc<CompletionQueue> {
        &self.recv_cq
    }

    /// The largest inline send the QP accepts.
    pub fn max_inline_data(&self) -> u32 {
        self.max_inline
    }

    /// Send-queue work requests posted and not yet retired.
    pub fn outstanding_sends(&self) -> usize {
        self.send.outstanding() as usize
    }

    /// Completions reaped (by a [`QueuePair::wait_for`] that met them first) and not yet
    /// returned; the next poll or wait returns them before anything new.
    pub fn undelivered(&self) -> usize {
        self.send_pending.len() + self.recv_pending.len()
    }

    /// Receive-queue work requests posted and not yet completed.
    pub fn outstanding_recvs(&self) -> usize {
        self.recv.outstanding() as usize
    }

    fn check_local(&self, mr: &MemoryRegion, range: &Range<usize>, needs_write: bool) -> Result<()> {
        if !Arc::ptr_eq(mr.pd(), &self.pd) {
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
                "the device writes this region (receive or RDMA READ target): register it with LOCAL_WRITE".into(),
            ));
        }
        Ok(())
    }

    /// Posts send-queue work requests (sends, RDMA WRITEs, RDMA READs), linked into as few
    /// `ibv_post_send` calls as possible. Nothing is posted unless the queue has room for all.
    ///
    /// # Errors
    /// [`Error::QueueFull`], [`Error::InvalidArgument`] or [`Error::OutOfBounds`] before
    /// anything is posted; [`Error::Call`] when `ibv_post_send` rejects a work request (the
    /// ones before it stay posted and are tracked).
    pub fn post_send(&mut self, wrs: &[SendWr<'_>]) -> Result<()> {
        if !self.connected {
            // Only reachable through a ClientQp/ServerQp, whose API does not offer sends.
            return Err(Error::InvalidArgument("sends need an established connection".into()));
        }
        if (wrs.len() as u64) > self.send.free() {
            return Err(Error::QueueFull { queue: "send", depth: self.send.cap() as u32 });
        }
        for w in wrs {
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
                self.check_local(mr, r, matches!(w.op, SendOp::Read { .. }))?;
            }
        }
        for chunk in wrs.chunks(CHUNK) {
            self.post_send_chunk(chunk)?;
        }
        Ok(())
    }

    fn post_send_chunk(&mut self, wrs: &[SendWr<'_>]) -> Result<()> {
        // Only the `n` entries used are initialised (zeroing whole arrays costs on every post).
        let mut raw: [MaybeUninit<ffi::ibv_send_wr>; CHUNK] = [const { MaybeUninit::uninit() }; CHUNK];
        let mut sge: [MaybeUninit<ffi::ibv_sge>; CHUNK] = [const { MaybeUninit::uninit() }; CHUNK];
        let n = wrs.len();
        let base: *mut ffi::ibv_send_wr = raw.as_mut_ptr().cast();
        // The work request that takes the last free slot is signaled, so that a queue full of
        // unsignaled work always has a completion coming that retires it.
        let free = self.send.free();
        for (k, w) in wrs.iter().enumerate() {
            let writes = matches!(w.op, SendOp::Read { .. });
            let hold = w.local.as_ref().map(|(m, _)| Hold::new(m.inner(), writes));
            let seq = self.send.stage(k as u64, w.wr_id, hold);
            let sg = sge[k].write(match (w.inline, &w.local) {
                (Some(data), _) => ffi::ibv_sge { addr: data.as_ptr() as u64, length: data.len() as u32, lkey: 0 },
                (None, Some((m, range))) => {
                    ffi::ibv_sge { addr: m.addr() + range.start as u64, length: range.len() as u32, lkey: m.lkey() }
                }
                (None, None) => ffi::ibv_sge { addr: 0, length: 0, lkey: 0 },
            });
            // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions of those);
            // all-zero is a valid value.
            let r = raw[k].write(unsafe { mem::zeroed() });
            r.wr_id = self.wire_id(seq, false);
            let has_data = w.inline.is_some() || w.local.as_ref().is_some_and(|(_, r)| !r.is_empty());
            r.num_sge = has_data as i32;
            r.sg_list = sg;
            // SAFETY: k + 1 <= CHUNK, so the pointer stays within (or one past) `raw`.
            r.next = if k + 1 < n { unsafe { base.add(k + 1) } } else { std::ptr::null_mut() };
            use ffi::ibv_wr_opcode::*;
            r.opcode = match (w.op, w.imm.is_some()) {
                (SendOp::Send, false) => IBV_WR_SEND,
                (SendOp::Send, true) => IBV_WR_SEND_WITH_IMM,
                (SendOp::Write { .. }, false) => IBV_WR_RDMA_WRITE,
                (SendOp::Write { .. }, true) => IBV_WR_RDMA_WRITE_WITH_IMM,
                (SendOp::Read { .. }, _) => IBV_WR_RDMA_READ,
            };
            if let Some(imm) = w.imm {
                r.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            if let SendOp::Write { addr, rkey } | SendOp::Read { addr, rkey } = w.op {
                r.wr.rdma = ffi::rdma_t { remote_addr: addr, rkey };
            }
            use ffi::ibv_send_flags as f;
            let mut flags = 0;
            if w.signaled || free == k as u64 + 1 {
                flags |= f::IBV_SEND_SIGNALED.0;
            }
            if w.solicited {
                flags |= f::IBV_SEND_SOLICITED.0;
            }
            if w.inline.is_some() {
                flags |= f::IBV_SEND_INLINE.0;
            }
            r.send_flags = flags;
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: QP valid; raw[..n] is an initialised, NULL-terminated list over `sge`, alive for
        // the call. Each range was checked against a region on this PD, whose handle a ring slot
        // now holds until the completion is reaped; inline data is copied before post returns.
        let ret = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), base, &mut bad) };
        self.commit_posted(ret, bad, base, n, true, "ibv_post_send")
    }

    /// The `wr_id` posted for sequence number `seq`.
    fn wire_id(&self, seq: u64, recv: bool) -> u64 {
        self.tag | if recv { RECV_TAG } else { 0 } | (seq & SEQ_MASK)
    }

    /// Commits the staged slots after a post, and maps the error (see "Failed posts" in the
    /// module docs).
    fn commit_posted<T>(
        &mut self,
        ret: i32,
        bad: *mut T,
        first: *const T,
        n: usize,
        send: bool,
        op: &'static str,
    ) -> Result<()> {
        if ret == 0 {
            let ring = if send { &mut self.send } else { &mut self.recv };
            ring.commit(n as u64, n as u64);
            return Ok(());
        }
        // Where the provider stopped, if it said so: `bad` inside the list we passed. Compared
        // as addresses, so nothing is assumed about a pointer we did not give it.
        let size = mem::size_of::<T>().max(1);
        let (b, f) = (bad as usize, first as usize);
        let known = !bad.is_null() && b >= f && b < f + n * size && (b - f) % size == 0;
        let ring = if send { &mut self.send } else { &mut self.recv };
        if known {
            ring.commit(((b - f) / size) as u64, n as u64);
            return check_ibv(ret, op);
        }
        // Unknown extent: every staged work request may be posted (and may still run). Keep
        // them all, and flush them through the error state.
        ring.commit(n as u64, n as u64);
        let flushed = self.set_error().is_ok();
        Err(Error::Call {
            op,
            addr: None,
            hint: Some(if flushed {
                "the provider failed the post without saying which work requests it took: they are kept until the flush retires them, and the QP was moved to the error state"
            } else {
                "the provider failed the post without saying which work requests it took, and the QP could not be moved to the error state: its regions stay held until the QP is dropped"
            }),
            source: std::io::Error::from_raw_os_error(ret.abs()),
        })
    }

    /// Posts receive work requests.
    ///
    /// # Errors
    /// As for [`QueuePair::post_send`].
    pub fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<()> {
        if (wrs.len() as u64) > self.recv.free() {
            return Err(Error::QueueFull { queue: "receive", depth: self.recv.cap() as u32 });
        }
        for w in wrs {
            self.check_local(w.mr, &w.range, true)?;
        }
        for chunk in wrs.chunks(CHUNK) {
            // SAFETY: plain old data; all-zero is valid.
            let mut raw: [ffi::ibv_recv_wr; CHUNK] = unsafe { mem::zeroed() };
            // SAFETY: as above.
            let mut sge: [ffi::ibv_sge; CHUNK] = unsafe { mem::zeroed() };
            let n = chunk.len();
            for (k, w) in chunk.iter().enumerate() {
                let seq = self.recv.stage(k as u64, w.wr_id, Some(Hold::new(w.mr.inner(), true)));
                sge[k] = ffi::ibv_sge {
                    addr: w.mr.addr() + w.range.start as u64,
                    length: w.range.len() as u32,
                    lkey: w.mr.lkey(),
                };
                raw[k].wr_id = self.wire_id(seq, true);
                raw[k].sg_list = &mut sge[k];
                // A zero-length receive has no scatter entry: some providers read a byte count
                // of 0 as 2 GiB.
                raw[k].num_sge = !w.range.is_empty() as i32;
            }
            for k in 0..n.saturating_sub(1) {
                let next: *mut ffi::ibv_recv_wr = &mut raw[k + 1];
                raw[k].next = next;
            }
            let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
            // SAFETY: as in post_send_chunk: a well-formed list over live stack arrays, ranges
            // checked, LOCAL_WRITE checked, and each region held by a slot until reaped.
            let ret = unsafe { ffi::ibv_post_recv(self.raw.as_ptr(), raw.as_mut_ptr(), &mut bad) };
            self.commit_posted(ret, bad, raw.as_ptr(), n, false, "ibv_post_recv")?;
        }
        Ok(())
    }

    /// Polls both CQs into `out` without waiting; returns how many entries were filled. Each
    /// completion releases the region its work request held (and, on the send queue, those of
    /// earlier unsignaled work requests).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    pub fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut n = self.deliver_pending(None, out);
        n += self.poll_cq(true, &mut out[n..])?;
        if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            n += self.poll_cq(false, &mut out[n..])?;
        }
        Ok(n)
    }

    /// Moves kept completions (of `which` queue, or both) into `out`.
    fn deliver_pending(&mut self, which: Option<WorkQueue>, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        if which != Some(WorkQueue::Recv) {
            let k = self.send_pending.drain_into(out);
            self.send.delivered(k as u64);
            n += k;
        }
        if which != Some(WorkQueue::Send) {
            let k = self.recv_pending.drain_into(&mut out[n..]);
            self.recv.delivered(k as u64);
            n += k;
        }
        n
    }

    /// Keeps a completion for a later poll or wait.
    fn keep(&mut self, wc: WorkCompletion) {
        match wc.queue() {
            WorkQueue::Send => self.send_pending.push(wc),
            WorkQueue::Recv => self.recv_pending.push(wc),
        }
    }

    fn poll_cq(&mut self, send_side: bool, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut filled = 0;
        while filled < out.len() {
            let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
            let want = (out.len() - filled).min(POLL_CHUNK);
            let cq = if send_side { &self.send_cq } else { &self.recv_cq };
            let got = cq.poll_raw(&mut raw[..want])?;
            for wc in &raw[..got] {
                // SAFETY: ibv_poll_cq initialised the first `got` entries.
                let wc = unsafe { wc.assume_init_ref() };
                if let Some(done) = self.route(wc) {
                    out[filled] = done;
                    filled += 1;
                    match done.queue() {
                        WorkQueue::Send => self.send.delivered(1),
                        WorkQueue::Recv => self.recv.delivered(1),
                    }
                }
            }
            if got < want {
                break;
            }
        }
        Ok(filled)
    }

    /// Retires the slot(s) a raw completion names and builds the caller's completion.
    fn route(&mut self, wc: &ffi::ibv_wc) -> Option<WorkCompletion> {
        // Not ours (another QP's, a raw post by the user, or a stale entry): discard.
        if wc.qp_num != self.qp_num || wc.wr_id & (OURS | (NONCE_MASK << NONCE_SHIFT)) != self.tag {
            return None;
        }
        let (ring, queue) = if wc.wr_id & RECV_TAG != 0 {
            (&mut self.recv, WorkQueue::Recv)
        } else {
            (&mut self.send, WorkQueue::Send)
        };
        let seq = ring.widen(wc.wr_id & SEQ_MASK, SEQ_BITS);
        let user = ring.complete(seq)?;
        Some(WorkCompletion::from_raw(wc, user, queue))
    }

    /// Waits up to `timeout` for at least one completion on either queue and polls it into
    /// `out`.
    ///
    /// It polls first, then arms the CQs and sleeps on their completion channels, so an idle
    /// wait costs no CPU. Returns 0 only when the timeout passed.
    ///
    /// # Errors
    /// [`Error::Call`] when polling or the channels fail.
    pub fn wait(&mut self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        self.wait_on(None, out, &mut Deadline::new(timeout))
    }

    /// Like [`QueuePair::wait`], for one queue only: the other queue's completions stay in
    /// their CQ. Needs separate send and receive CQs (the default).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when both queues share one CQ; as for [`QueuePair::wait`].
    pub fn wait_queue(&mut self, queue: WorkQueue, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        self.wait_queue_until(queue, out, &mut Deadline::new(timeout))
    }

    /// [`QueuePair::wait_queue`] against a deadline the caller may reuse across waits, so that
    /// repeated waits share one bound.
    fn wait_queue_until(
        &mut self,
        queue: WorkQueue,
        out: &mut [WorkCompletion],
        deadline: &mut Deadline,
    ) -> Result<usize> {
        if Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            return Err(Error::InvalidArgument(
                "both queues share one CQ, so one queue cannot be waited for alone: use wait()".into(),
            ));
        }
        self.wait_on(Some(queue), out, deadline)
    }

    /// Polls only `queue`'s CQ into `out`, without waiting. With a CQ shared by both queues,
    /// completions of either queue come back.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    pub fn poll_queue(&mut self, queue: WorkQueue, out: &mut [WorkCompletion]) -> Result<usize> {
        let n = self.deliver_pending(Some(queue), out);
        Ok(n + self.poll_cq(queue == WorkQueue::Send, &mut out[n..])?)
    }

    fn poll_on(&mut self, which: Option<WorkQueue>, out: &mut [WorkCompletion]) -> Result<usize> {
        match which {
            None => self.poll(out),
            Some(q) => self.poll_queue(q, out),
        }
    }

    /// The CQs a wait on `which` sleeps on (one entry is None when there is only one).
    fn wait_cqs(&self, which: Option<WorkQueue>) -> [Option<Arc<CompletionQueue>>; 2] {
        match which {
            None if Arc::ptr_eq(&self.send_cq, &self.recv_cq) => [Some(Arc::clone(&self.send_cq)), None],
            None => [Some(Arc::clone(&self.send_cq)), Some(Arc::clone(&self.recv_cq))],
            Some(WorkQueue::Send) => [Some(Arc::clone(&self.send_cq)), None],
            Some(WorkQueue::Recv) => [Some(Arc::clone(&self.recv_cq)), None],
        }
    }

    /// Polls, then arms the CQs and polls again (so no completion slips between the two);
    /// returns what was found, or 0 when the caller should sleep on the descriptors.
    fn poll_or_arm(
        &mut self,
        which: Option<WorkQueue>,
        cqs: &[Option<Arc<CompletionQueue>>; 2],
        out: &mut [WorkCompletion],
    ) -> Result<usize> {
        // A short busy phase keeps latency low without burning a core while idle.
        for _ in 0..64 {
            let n = self.poll_on(which, out)?;
            if n > 0 {
                return Ok(n);
            }
            std::hint::spin_loop();
        }
        for cq in cqs.iter().flatten() {
            cq.req_notify(false)?;
        }
        self.poll_on(which, out)
    }

    /// Whether waits watch the id's CM channel for the peer leaving: once connected, and only
    /// while nothing but this connection's id holds the channel (nobody else reads it, so
    /// watching cannot keep an event from its owner's wait).
    fn watches_cm(&self) -> bool {
        self.connected && !self.peer_left && self.id.channel().is_exclusive()
    }

    /// The descriptors a sleeping wait watches: the CQ channels, and the CM channel when the
    /// QP watches it for the peer leaving.
    fn wait_fds(&self, cqs: &[Option<Arc<CompletionQueue>>; 2]) -> [RawFd; 3] {
        let cq_fd = |cq: &Option<Arc<CompletionQueue>>| cq.as_ref().map_or(-1, |c| c.as_raw_fd());
        let cm_fd = if self.watches_cm() { self.id.channel().as_raw_fd() } else { -1 };
        [cq_fd(&cqs[0]), cq_fd(&cqs[1]), cm_fd]
    }

    /// After a sleep: acks the CQ events and handles the CM events that woke us. The events
    /// stay queued on the channel, so the connection's `next_event` still returns them.
    fn after_wake(&mut self, cqs: &[Option<Arc<CompletionQueue>>; 2], cm_ready: bool) -> Result<()> {
        for cq in cqs.iter().flatten() {
            cq.drain_events()?;
        }
        if cm_ready {
            let me = self.id.handle();
            let mut left = false;
            self.id.channel().pump(|ev| {
                left |=
                    ev.id() == me && matches!(ev.event_type(), CmEventType::Disconnected | CmEventType::DeviceRemoval);
            })?;
            if left {
                self.peer_gone();
            }
        }
        Ok(())
    }

    fn wait_on(
        &mut self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deadline: &mut Deadline,
    ) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let cqs = self.wait_cqs(which);
        loop {
            let n = self.poll_or_arm(which, &cqs, out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.left();
            if left.is_zero() {
                return Ok(0);
            }
            let mut fds = self.wait_fds(&cqs).map(pollfd);
            poll_readable(&mut fds, left)?;
            self.after_wake(&cqs, fds[2].revents != 0)?;
        }
    }

    /// Like [`QueuePair::wait`], without blocking a tokio runtime: sleeps on the CQ channels
    /// (and the CM channel, to notice the peer leaving) through tokio's reactor. Unbounded by
    /// itself: wrap it in `tokio::time::timeout`. Cancelling it (dropping the future) is safe at
    /// any point: the posted work requests, and the regions they hold, stay with the QP until
    /// their completions are polled or the QP is dropped.
    ///
    /// # Errors
    /// As for [`QueuePair::wait`].
    #[cfg(feature = "tokio")]
    pub async fn wait_async(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.wait_on_async(None, out).await
    }

    /// [`QueuePair::wait_for`] for async code: waits for `wr_id` on `queue`, failing on any
    /// failed completion of that queue. Unbounded by itself (use `tokio::time::timeout`);
    /// cancellation-safe as [`QueuePair::wait_async`] is.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`], [`Error::Disconnected`]; [`Error::InvalidArgument`] with a
    /// shared CQ.
    #[cfg(feature = "tokio")]
    pub async fn wait_for_async(&mut self, queue: WorkQueue, wr_id: u64) -> Result<WorkCompletion> {
        if let Some(r) = self.pick_kept(queue, wr_id) {
            return r;
        }
        let which = self.wait_for_scope(queue);
        let mut wcs = [WorkCompletion::default(); 4];
        loop {
            // Completions are kept or returned within the poll that reaps them, so dropping
            // this future between polls loses none.
            let n = self.wait_on_async(which, &mut wcs).await?;
            if let Some(r) = self.pick(&wcs[..n], queue, wr_id) {
                return r;
            }
        }
    }

    #[cfg(feature = "tokio")]
    async fn wait_on_async(&mut self, which: Option<WorkQueue>, out: &mut [WorkCompletion]) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let cqs = self.wait_cqs(which);
        loop {
            let n = self.poll_or_arm(which, &cqs, out)?;
            if n > 0 {
                return Ok(n);
            }
            let fds = self.wait_fds(&cqs);
            crate::wait::readable_any(fds, |_| false).await?;
            self.after_wake(&cqs, fds[2] >= 0)?;
        }
    }

    /// Whether a completion decides a wait for `wr_id` on `queue`: it is that work request,
    /// or a failure of that queue.
    fn decides(wc: &WorkCompletion, queue: WorkQueue, wr_id: u64) -> bool {
        wc.queue() == queue && (wc.wr_id() == wr_id || !wc.is_ok())
    }

    /// The answer a deciding completion gives a wait: itself, or the error it carries (naming
    /// the disconnect when the peer left).
    fn answer(&self, wc: WorkCompletion) -> Result<WorkCompletion> {
        if !wc.is_ok() && self.peer_left {
            return Err(Error::Disconnected { op: "waiting for a completion", addr: self.id.peer_addr() });
        }
        wc.ok()
    }

    /// A kept completion that decides a wait for `wr_id`, if there is one.
    fn pick_kept(&mut self, queue: WorkQueue, wr_id: u64) -> Option<Result<WorkCompletion>> {
        let kept = if queue == WorkQueue::Send { &mut self.send_pending } else { &mut self.recv_pending };
        let wc = kept.take_first(|wc| Self::decides(wc, queue, wr_id))?;
        match queue {
            WorkQueue::Send => self.send.delivered(1),
            WorkQueue::Recv => self.recv.delivered(1),
        }
        Some(self.answer(wc))
    }

    /// Goes through a batch in order: the first completion that decides the wait answers it;
    /// every other one is kept for a later poll or wait, so none is lost.
    fn pick(&mut self, wcs: &[WorkCompletion], queue: WorkQueue, wr_id: u64) -> Option<Result<WorkCompletion>> {
        let mut found = None;
        for wc in wcs {
            if found.is_none() && Self::decides(wc, queue, wr_id) {
                found = Some(*wc);
            } else {
                self.keep(*wc);
                // It was counted as delivered when polled; it is undelivered again.
                match wc.queue() {
                    WorkQueue::Send => self.send.undeliver(),
                    WorkQueue::Recv => self.recv.undeliver(),
                }
            }
        }
        found.map(|wc| self.answer(wc))
    }

    /// The queues a wait for one queue's completion polls: that queue's CQ, or both when the
    /// queues share one (the other queue's completions are then kept).
    fn wait_for_scope(&self, queue: WorkQueue) -> Option<WorkQueue> {
        if Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            None
        } else {
            Some(queue)
        }
    }

    /// Lets the QP react to its id's CM event: when the peer left (or the device went away),
    /// move the QP to the error state so every posted work request flushes instead of waiting
    /// forever. librdmacm does not do this on the passive side of a disconnect. Events of
    /// other ids are ignored.
    pub(crate) fn on_cm_event(&mut self, ev: &CmEvent) {
        if ev.id() == self.id.handle()
            && matches!(ev.event_type(), CmEventType::Disconnected | CmEventType::DeviceRemoval)
        {
            self.peer_gone();
        }
    }

    fn peer_gone(&mut self) {
        if self.peer_left {
            return;
        }
        self.peer_left = true;
        // rdma_disconnect moves the QP to ERR and completes the CM handshake; set_error is
        // the fallback when the id is past that state.
        if self.id.disconnect().is_err() {
            let _ = self.set_error();
        }
    }

    pub(crate) fn set_connected(&mut self) {
        self.connected = true;
    }

    /// Whether the peer disconnected (seen while waiting, or through the connection's events).
    pub fn peer_left(&self) -> bool {
        self.peer_left
    }

    /// Waits for the completion with `wr_id` on `queue`, checking every completion of that
    /// queue on the way: a failed completion, or running out of `timeout`, is an error.
    /// Completions of other work requests met on the way are kept, in order, for the next
    /// poll or wait ([`QueuePair::undelivered`] counts them).
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] for a failed completion; [`Error::Disconnected`];
    /// [`Error::Timeout`].
    pub fn wait_for(&mut self, queue: WorkQueue, wr_id: u64, timeout: Duration) -> Result<WorkCompletion> {
        if let Some(r) = self.pick_kept(queue, wr_id) {
            return r;
        }
        let which = self.wait_for_scope(queue);
        let mut deadline = Deadline::new(timeout);
        let mut wcs = [WorkCompletion::default(); 4];
        loop {
            let n = self.wait_on(which, &mut wcs, &mut deadline)?;
            if n == 0 {
                let op =
                    if queue == WorkQueue::Recv { "waiting for a receive" } else { "waiting for a send completion" };
                return Err(Error::Timeout {
                    op,
                    timeout,
                    addr: self.id.peer_addr(),
                    hint: Some("the peer sent nothing, or is gone without a disconnect (link down?)"),
                });
            }
            if let Some(r) = self.pick(&wcs[..n], queue, wr_id) {
                return r;
            }
        }
    }

    /// Moves the QP to the error state, which flushes every outstanding work request.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_modify_qp` fails.
    pub fn set_error(&mut self) -> Result<()> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: QP valid; only the state is modified, as the mask says.
        check_ibv(
            unsafe { ffi::ibv_modify_qp(self.as_raw(), &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) },
            "ibv_modify_qp(ERR)",
        )
    }

    /// Flushes and reaps outstanding work for up to `timeout`; true when nothing is left.
    fn drain(&mut self, timeout: Duration) -> bool {
        if self.send.outstanding() + self.recv.outstanding() == 0 {
            return true;
        }
        self.connected = false; // no CM reads from here on: the id's events are not ours to take
        if self.set_error().is_err() {
            return false;
        }
        let deadline = Instant::now() + timeout;
        let mut wcs = [WorkCompletion::default(); POLL_CHUNK];
        while self.send.outstanding() + self.recv.outstanding() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // Unsignaled sends that succeeded before the flush produce no completion; the
            // flushed ones after them do. What remains is retired by the destroy below.
            match self.wait(&mut wcs, left.min(Duration::from_millis(50))) {
                Ok(0) if self.send.outstanding() > 0 && self.recv.outstanding() == 0 => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        true
    }
}

impl QueuePair {
    /// On a tokio runtime thread, a QP with work in flight would block the runtime for up to
    /// `DRAIN_TIMEOUT` while the flush is reaped: hand the whole teardown to the runtime's
    /// blocking pool instead. Returns whether it did (then `self` destroys nothing).
    #[cfg(feature = "tokio")]
    fn detach_to_blocking_pool(&mut self) -> bool {
        if self.detached || self.send.outstanding() + self.recv.outstanding() == 0 {
            return false;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return false };
        let guts = QueuePair {
            raw: self.raw,
            qp_num: self.qp_num,
            max_inline: self.max_inline,
            tag: self.tag,
            connected: self.connected,
            peer_left: self.peer_left,
            detached: false,
            send: mem::replace(&mut self.send, Ring::new(1)),
            recv: mem::replace(&mut self.recv, Ring::new(1)),
            send_pending: mem::replace(&mut self.send_pending, Pending::new(1)),
            recv_pending: mem::replace(&mut self.recv_pending, Pending::new(1)),
            id: Arc::clone(&self.id),
            send_cq: Arc::clone(&self.send_cq),
            recv_cq: Arc::clone(&self.recv_cq),
            pd: Arc::clone(&self.pd),
        };
        self.detached = true;
        // If the runtime is shutting down and never runs the task, the closure (and the QP in
        // it) is dropped wherever tokio drops it: the teardown then runs there. Either way the
        // regions stay held until the QP is destroyed.
        drop(rt.spawn_blocking(move || drop(guts)));
        true
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        #[cfg(feature = "tokio")]
        if self.detached || self.detach_to_blocking_pool() {
            return;
        }
        self.drain(DRAIN_TIMEOUT);
        let ret = {
            // The channel's lock: no event processing (which reads and modifies id->qp) runs
            // between the destroy and clearing id->qp.
            let _lock = self.id.channel().lock();
            // SAFETY: the QP is destroyed exactly once, here. The id, CQs and PD are still
            // alive (our fields).
            let ret = unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) };
            if ret == 0 {
                // SAFETY: the id is valid; clearing `qp` mirrors rdma_destroy_qp, so librdmacm
                // never uses the freed QP.
                unsafe { (*self.id.as_raw()).qp = std::ptr::null_mut() };
            }
            ret
        };
        if ret != 0 {
            // The device may still access the slots' memory: leak it instead of freeing it,
            // before anything else can fail or panic.
            mem::forget(mem::take(&mut self.send.slots));
            mem::forget(mem::take(&mut self.recv.slots));
            crate::report_leak("ibv_destroy_qp", ret);
            return;
        }
        // Discard completions the destroyed QP left behind, so a CQ handed to another QP later
        // cannot route them into that QP's rings.
        let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
        for cq in [&self.send_cq, &self.recv_cq] {
            while matches!(cq.poll_raw(&mut raw), Ok(n) if n > 0) {}
        }
        self.send_cq.unclaim();
        self.recv_cq.unclaim();
        // The rings (and the regions they hold) drop with the struct: the QP no longer exists.
    }
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num)
            .field("outstanding_sends", &self.send.outstanding())
            .field("outstanding_recvs", &self.recv.outstanding())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_seed() {
        let q = QpInit::default();
        assert_eq!((q.max_send_wr, q.max_recv_wr), (16, 16));
    }
}
