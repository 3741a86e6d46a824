//! [`QueuePair`]: an owned RC (or, under a [`UdQp`](crate::UdQp), UD) queue pair and its sound,
//! allocation-free data path.
//!
//! # Ownership of in-flight memory
//!
//! Every work request names its local memory as a range of a [`MemoryRegion`]. Posting stores
//! a clone of the region's handle in the QP's slot table (a fixed ring per work queue, sized by
//! the queue depth and allocated once, when the QP is created). Reaping the completion drops
//! that clone. The region's byte accessors refuse while the device may write it (and writes
//! while it may read it), so Rust code never holds a reference the device may change, and the
//! memory can never be freed under the device. Posting clones an `Arc` (an atomic increment):
//! no heap allocation.
//!
//! A work request of several pieces ([scatter/gather](crate::wr#scattergather)) holds every
//! piece's region the same way: the first piece's handle in its slot, the others' in a side
//! table of the ring (slots × (pieces − 1) entries, allocated with the ring, and only for a
//! queue created for more than one piece: [`QpInit::max_send_sge`], [`QpInit::max_recv_sge`]).
//! Whatever retires the slot (its completion, a later signaled completion, the provider
//! refusing the work request, the flush, dropping the QP) releases all of them together.
//!
//! Work queues of an RC QP complete in order, so each ring retires every slot up to the one a
//! completion names. That is also how unsignaled sends are retired: by the next signaled
//! completion on the same queue; the work request that takes the send queue's last free slot
//! is signaled whatever it asked, so a queue full of unsignaled work can always drain. The
//! rings never admit more work requests than the queue holds, so a full queue is a clear
//! [`Error::QueueFull`] rather than a provider error, and the CQs (which count what their
//! queues may have outstanding) cannot overrun.
//!
//! # Shared CQs and SRQs
//!
//! A QP's CQs may serve other QPs too, and its receives may come from a
//! [`SharedReceiveQueue`]. Every completion carries its owner in its `wr_id`, so whoever polls
//! a CQ retires the right slot: the QP's [`QueuePair::poll`] and waits keep the completions of
//! other QPs they meet for those QPs, and [`CompletionQueue::poll`] returns everyone's.
//! Dropping a QP reaps only its own work; completions of it still in a shared CQ afterwards
//! retire nothing.
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
//! Every `wr_id` this crate posts carries a tag (bit 62 set; see the crate's `ring::tag`). A
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
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::cq::{lock, CompletionQueue, WorkCompletion, WorkQueue, POLL_CHUNK};
use crate::error::{check_ibv, Error, Result};
use crate::mr::{check_range, AccessFlags, MemoryRegion};
use crate::pd::ProtectionDomain;
use crate::ring::{tag, Failure, Hold, Queues};
use crate::srq::SharedReceiveQueue;
use crate::ud::UdDest;
use crate::wait::{poll_readable, pollfd, Deadline};
use crate::wr::{hold_rest, needs_rest_holds, AsSendWr, RecvWr, SendOp, SendWr, MAX_SGE};

/// Work requests linked into one `ibv_post_*` call (the stack arrays' size).
pub(crate) const CHUNK: usize = 16;
/// Scatter/gather entries of one `ibv_post_*` call: every piece of a chunk of work requests.
const CHUNK_SGE: usize = CHUNK * MAX_SGE;
/// How long Drop waits for flushed completions before destroying the QP anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// A QP's nonce: tells it from an earlier QP at the same index of a CQ's routing table.
fn next_nonce() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & tag::NONCE_MASK as u16
}

/// Queue-pair capabilities. Defaults follow the seed program: 16 send and 16 receive work
/// requests, one scatter/gather entry each, and 64 bytes of inline data.
#[derive(Debug, Clone)]
pub struct QpInit {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_send_sge: u32,
    pub(crate) max_recv_sge: u32,
    pub(crate) max_inline_data: u32,
    pub(crate) send_cq: Option<Arc<CompletionQueue>>,
    pub(crate) recv_cq: Option<Arc<CompletionQueue>>,
    pub(crate) srq: Option<SharedReceiveQueue>,
    /// A UD QP (set by the UD layer only): `IBV_QPT_UD`, and a send ring that holds address
    /// handles.
    pub(crate) datagrams: bool,
    /// Create the QP with `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB` (set by the multicast layer
    /// only): it does not receive the multicast datagrams it sends itself.
    pub(crate) block_self_mcast_lb: bool,
}

impl Default for QpInit {
    fn default() -> Self {
        QpInit {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
            send_cq: None,
            recv_cq: None,
            srq: None,
            datagrams: false,
            block_self_mcast_lb: false,
        }
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
    /// Receive queue depth (ignored with an SRQ).
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.max_recv_wr = n;
        self
    }
    /// The most pieces a send-queue work request may name
    /// ([`SendWr::send_sg`], [`SendWr::write_sg`], [`SendWr::read_sg`]): 1 (the default) to
    /// [`MAX_SGE`], and at most the device's `max_sge`
    /// ([`DeviceLimits`](crate::DeviceLimits)); checked when the QP is created. A queue of
    /// more than one piece gets a side table for the extra holds (slots × (n − 1) entries).
    pub fn max_send_sge(mut self, n: u32) -> Self {
        self.max_send_sge = n;
        self
    }
    /// The most pieces a receive may name ([`RecvWr::sg`]): as for
    /// [`QpInit::max_send_sge`]. Ignored with an SRQ (see
    /// [`SharedReceiveQueue::with_sge`]).
    pub fn max_recv_sge(mut self, n: u32) -> Self {
        self.max_recv_sge = n;
        self
    }
    /// Largest inline send, in bytes.
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.max_inline_data = n;
        self
    }
    /// Uses `cq` for send completions instead of creating one. It may be the receive CQ, and
    /// it may serve other QPs too, as long as it is deep enough for all their queues; it must
    /// be on the QP's device.
    pub fn send_cq(mut self, cq: Arc<CompletionQueue>) -> Self {
        self.send_cq = Some(cq);
        self
    }
    /// Uses `cq` for receive completions instead of creating one (same conditions as
    /// [`QpInit::send_cq`]).
    pub fn recv_cq(mut self, cq: Arc<CompletionQueue>) -> Self {
        self.recv_cq = Some(cq);
        self
    }
    /// Takes receives from `srq` instead of a receive queue of its own. The SRQ must be on
    /// the QP's protection domain.
    pub fn srq(mut self, srq: &SharedReceiveQueue) -> Self {
        self.srq = Some(srq.clone());
        self
    }
}

/// What a QP asks of whoever created it: the connection manager, for QPs made through
/// `rdma_create_qp` (it owns the id's `qp` field and the events that say the peer left).
pub(crate) trait Link: Send + Sync {
    /// Destroys the QP as its creator requires.
    fn destroy(&self, qp: *mut ffi::ibv_qp) -> i32;
    /// The descriptor on which the peer leaving shows, when waits may watch it now.
    fn watch_fd(&self) -> Option<RawFd>;
    /// That descriptor's registration with tokio's reactor (kept by its channel).
    #[cfg(feature = "tokio")]
    fn watch_reactor(&self) -> Option<&crate::wait::Reactor>;
    /// Reads what arrived on that descriptor; true when the peer left.
    fn peer_left(&self) -> Result<bool>;
    /// Disconnects (which also moves the QP to the error state).
    fn disconnect(&self) -> Result<()>;
    /// The peer's address, for errors.
    fn peer_addr(&self) -> Option<SocketAddr>;
    /// The device reported `IBV_EVENT_COMM_EST` for the QP (a message arrived before the
    /// CM's handshake completed): tell the QP's connection manager (`rdma_notify`). Called by
    /// whoever reads the context's events, under the context's registry lock, while the QP is
    /// registered (so it holds this link): it must not block, nor take that lock.
    fn comm_established(&self) {}
}

/// Polls a blocking wait makes before it arms the CQs and sleeps.
const SYNC_SPINS: u32 = 64;
/// Polls an async wait makes before it arms the CQs and sleeps on tokio's reactor.
#[cfg(feature = "tokio")]
const ASYNC_SPINS: u32 = 1024;

/// What ended a wait on the CQs.
enum Woke {
    /// This many completions were polled into the caller's slice.
    Found(usize),
    /// Another QP's poll kept a completion for this QP (only for waits that do not poll the
    /// kept ones themselves).
    Kept,
    /// The deadline passed.
    TimedOut,
}

/// Where this QP sits in a CQ's routing table.
#[derive(Clone, Copy)]
struct Slot {
    index: u16,
}

/// An owned RC queue pair.
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
    /// The most pieces a send, a receive and an RDMA READ may name (what the rings were sized
    /// for; 0 receive pieces on an SRQ).
    max_send_sge: u32,
    max_recv_sge: u32,
    max_read_sge: u32,
    nonce: u16,
    /// Our index in the send CQ's and the receive CQ's routing tables.
    send_slot: Slot,
    recv_slot: Slot,
    /// Reserved capacity on each CQ (released on drop).
    send_reserved: u64,
    recv_reserved: u64,
    /// The connection is established: sends may be posted, and waits may watch the link.
    connected: bool,
    /// A UD QP: its sends are datagrams, each naming an address handle.
    datagrams: bool,
    /// The peer left (or the device went away); the QP was moved to error.
    peer_left: bool,
    /// The caller moved the QP to the error state ([`QueuePair::set_error`]): nothing posted
    /// from then on can run, and rxe never flushes a receive posted then (it would stay held,
    /// and its wait time out), so posts are refused.
    errored: bool,
    /// This side disconnected (`rdma_disconnect` moved the QP to the error state): not an error
    /// a wait that runs out should report.
    closing: bool,
    /// Waits spin on the CQs instead of sleeping on their channels ([`QueuePair::set_busy_poll`]).
    busy_poll: bool,
    /// Its teardown was handed to another value (see Drop): this one destroys nothing.
    #[cfg(feature = "tokio")]
    detached: bool,
    /// This value is that other one: it tears down where it is dropped (the blocking pool is
    /// inside the runtime too, so it must not hand the work on again).
    #[cfg(feature = "tokio")]
    inline_teardown: bool,
    queues: Arc<Mutex<Queues>>,
    /// Its place in the context's registry of async events (left before the QP is destroyed).
    async_reg: crate::async_event::Registration,
    // Field order is drop order after Drop::drop: the link (id), CQs, SRQ and PD outlive the
    // QP, which Drop::drop destroys first.
    link: Option<Arc<dyn Link>>,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    srq: Option<SharedReceiveQueue>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the QP is owned uniquely; posting and polling take &mut self; its queues are behind a
// mutex shared only with its CQs' routing tables. The regions in the rings are Send + Sync
// handles. Verbs on a QP may be called from any thread.
unsafe impl Send for QueuePair {}

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

/// The first scatter entry of a send-queue work request: its inline data, its (first) piece,
/// or nothing.
#[inline(always)]
fn first_sge(w: &SendWr<'_>) -> ffi::ibv_sge {
    match (w.inline, &w.local) {
        (Some(data), _) => ffi::ibv_sge { addr: data.as_ptr() as u64, length: data.len() as u32, lkey: 0 },
        (None, Some((m, range))) => m.sge(range),
        (None, None) => ffi::ibv_sge { addr: 0, length: 0, lkey: 0 },
    }
}

/// Whether a send-queue work request moves any bytes (a zero-length one gets no scatter entry:
/// some providers read a byte count of 0 as 2 GiB).
#[inline(always)]
fn has_data(w: &SendWr<'_>) -> bool {
    w.inline.is_some() || w.local.as_ref().is_some_and(|(_, r)| !r.is_empty())
}

impl QueuePair {
    /// Creates an RC QP on `pd` with `init`'s capabilities. `create` makes the QP from the
    /// prepared attributes (the connection manager's `rdma_create_qp`, under its lock), and
    /// `link` is what the QP asks of its creator afterwards.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for empty queues, CQs or an SRQ of another device or PD, or
    /// CQs too shallow for what they would serve; what `create` returns.
    pub(crate) fn create(
        pd: &Arc<ProtectionDomain>,
        init: QpInit,
        create: impl FnOnce(&mut ffi::ibv_qp_init_attr) -> Result<NonNull<ffi::ibv_qp>>,
        link: Option<Arc<dyn Link>>,
    ) -> Result<QueuePair> {
        let on_srq = init.srq.is_some();
        let recv_depth = if on_srq { 0 } else { init.max_recv_wr };
        if init.max_send_wr == 0 || (!on_srq && init.max_recv_wr == 0) {
            return Err(Error::InvalidArgument("QP needs at least one send and one receive work request".into()));
        }
        let ctx = pd.context();
        let max_recv_sge = if on_srq { 0 } else { init.max_recv_sge };
        check_sge_request(init.max_send_sge, "QpInit::max_send_sge")?;
        if !on_srq {
            check_sge_request(max_recv_sge, "QpInit::max_recv_sge")?;
        }
        // The device is asked only when a queue takes more than one piece. An RDMA READ may be
        // limited to fewer pieces than other sends (`max_sge_rd`).
        let mut max_read_sge = init.max_send_sge;
        if init.max_send_sge > 1 || max_recv_sge > 1 {
            let limits = ctx.limits()?;
            let device = ctx.device_name();
            check_sge_device(init.max_send_sge, "QpInit::max_send_sge", limits.max_sge, "max_sge", &device)?;
            check_sge_device(max_recv_sge, "QpInit::max_recv_sge", limits.max_sge, "max_sge", &device)?;
            if limits.max_sge_rd > 0 {
                max_read_sge = max_read_sge.min(limits.max_sge_rd);
            }
        }
        for cq in [&init.send_cq, &init.recv_cq].into_iter().flatten() {
            if !cq.context().same_as(ctx) {
                return Err(Error::InvalidArgument(format!(
                    "the completion queue is on device {}, but the QP is on {}: a QP and its CQs must share a device context",
                    cq.context().device_name(),
                    ctx.device_name()
                )));
            }
        }
        if let Some(srq) = &init.srq {
            if !Arc::ptr_eq(srq.pd(), pd) {
                return Err(Error::InvalidArgument("the SRQ is on another protection domain than the QP".into()));
            }
        }
        let send_cq = match init.send_cq {
            Some(cq) => cq,
            None => CompletionQueue::new(ctx, init.max_send_wr)?,
        };
        let recv_cq = match init.recv_cq {
            Some(cq) => cq,
            None => {
                CompletionQueue::new(ctx, if on_srq { init.srq.as_ref().map_or(1, |s| s.depth()) } else { recv_depth })?
            }
        };
        // Reserve room on the CQs (and register the SRQ) before creating anything.
        let send_reserved = init.max_send_wr as u64;
        let recv_reserved = recv_depth as u64;
        send_cq.reserve(&mut send_cq.router(), send_reserved)?;
        let undo_send = || send_cq.router().unreserve(send_reserved);
        // The result first, so that the routing table's lock is released before `undo_send`
        // takes it again (the send and receive CQ may be one).
        let reserved = recv_cq.reserve(&mut recv_cq.router(), recv_reserved);
        if let Err(e) = reserved {
            undo_send();
            return Err(e);
        }
        let undo = || {
            undo_send();
            recv_cq.router().unreserve(recv_reserved);
        };
        if let Some(srq) = &init.srq {
            if let Err(e) = recv_cq.attach_srq(srq.shared()) {
                undo();
                return Err(e);
            }
        }
        let undo = || {
            undo();
            if let Some(srq) = &init.srq {
                recv_cq.detach_srq(srq.shared());
            }
        };
        // SAFETY: ibv_qp_init_attr is plain old data; zero is a valid start.
        let mut attr: ffi::ibv_qp_init_attr = unsafe { mem::zeroed() };
        attr.send_cq = send_cq.as_raw();
        attr.recv_cq = recv_cq.as_raw();
        attr.srq = init.srq.as_ref().map_or(std::ptr::null_mut(), |s| s.as_raw());
        attr.qp_type = if init.datagrams { ffi::ibv_qp_type::IBV_QPT_UD } else { ffi::ibv_qp_type::IBV_QPT_RC };
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = init.max_send_wr;
        attr.cap.max_recv_wr = recv_depth;
        attr.cap.max_send_sge = init.max_send_sge;
        attr.cap.max_recv_sge = max_recv_sge;
        attr.cap.max_inline_data = init.max_inline_data;
        let raw = match create(&mut attr) {
            Ok(raw) => raw,
            Err(e) => {
                undo();
                return Err(e);
            }
        };
        // SAFETY: raw is a valid QP; qp_num is immutable.
        let qp_num = unsafe { (*raw.as_ptr()).qp_num };
        let nonce = next_nonce();
        // The QP takes what was asked, or less if the provider says so (it may allow more: the
        // rings are sized for what was asked).
        let max_send_sge = attr.cap.max_send_sge.clamp(1, init.max_send_sge);
        let max_recv_sge = if on_srq { 0 } else { attr.cap.max_recv_sge.clamp(1, max_recv_sge) };
        let max_read_sge = max_read_sge.min(max_send_sge);
        let queues =
            Arc::new(Mutex::new(Queues::new(init.max_send_wr, recv_depth, max_send_sge, max_recv_sge, init.datagrams)));
        let send_index = send_cq.router().attach_qp(qp_num, nonce, Arc::clone(&queues));
        let recv_index = if Arc::ptr_eq(&send_cq, &recv_cq) {
            send_index.as_ref().map(|i| *i).map_err(|_| Error::InvalidArgument(String::new()))
        } else {
            recv_cq.router().attach_qp(qp_num, nonce, Arc::clone(&queues))
        };
        let (send_index, recv_index) = match (send_index, recv_index) {
            (Ok(s), Ok(r)) => (s, r),
            (s, _) => {
                // The table is full: take the QP down again.
                if let Ok(i) = s {
                    send_cq.router().detach_qp(i);
                }
                let ret = match &link {
                    Some(l) => l.destroy(raw.as_ptr()),
                    // SAFETY: the QP was just created and nothing refers to it.
                    None => unsafe { ffi::ibv_destroy_qp(raw.as_ptr()) },
                };
                if ret == 0 {
                    undo();
                }
                return Err(Error::InvalidArgument("a CQ serves at most 65536 QPs".into()));
            }
        };
        let async_reg =
            crate::async_event::Registration::new(ctx, crate::async_kind::Subject::Qp, raw.as_ptr() as usize);
        if let Some(l) = &link {
            // COMM_EST is answered through the link (see crate::async_event).
            async_reg.events().answer_with(Arc::downgrade(l));
        }
        Ok(QueuePair {
            raw,
            qp_num,
            max_inline: attr.cap.max_inline_data,
            max_send_sge,
            max_recv_sge,
            max_read_sge,
            nonce,
            send_slot: Slot { index: send_index },
            recv_slot: Slot { index: recv_index },
            send_reserved,
            recv_reserved,
            // A UD QP has no connection: librdmacm moves it to RTS as it creates it.
            connected: init.datagrams,
            datagrams: init.datagrams,
            peer_left: false,
            errored: false,
            closing: false,
            busy_poll: false,
            #[cfg(feature = "tokio")]
            detached: false,
            #[cfg(feature = "tokio")]
            inline_teardown: false,
            queues,
            async_reg,
            link,
            send_cq,
            recv_cq,
            srq: init.srq,
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

    /// The shared receive queue it takes receives from, if any.
    pub fn srq(&self) -> Option<&SharedReceiveQueue> {
        self.srq.as_ref()
    }

    /// The largest inline send the QP accepts.
    pub fn max_inline_data(&self) -> u32 {
        self.max_inline
    }

    /// The most pieces a send-queue work request may name ([`QpInit::max_send_sge`]).
    pub fn max_send_sge(&self) -> u32 {
        self.max_send_sge
    }

    /// The most pieces an RDMA READ may name: [`QueuePair::max_send_sge`], or less where the
    /// device limits READs further (`max_sge_rd`).
    pub fn max_read_sge(&self) -> u32 {
        self.max_read_sge
    }

    /// The most pieces a receive may name ([`QpInit::max_recv_sge`]; 0 on an SRQ, whose own
    /// limit applies).
    pub fn max_recv_sge(&self) -> u32 {
        self.max_recv_sge
    }

    pub(crate) fn queues(&self) -> std::sync::MutexGuard<'_, Queues> {
        lock(&self.queues)
    }

    /// Send-queue work requests posted and not yet retired (including ones the provider refused
    /// in a partly failed post, until the head passes them).
    pub fn outstanding_sends(&self) -> usize {
        self.queues().send.outstanding() as usize
    }

    /// Receive-queue work requests posted and not yet completed (0 on an SRQ: see
    /// [`SharedReceiveQueue::outstanding`]).
    pub fn outstanding_recvs(&self) -> usize {
        self.queues().recv.outstanding() as usize
    }

    /// Completions reaped (by a wait that met them first, here or on another QP of a shared
    /// CQ) and not yet returned; the next poll or wait returns them before anything new.
    pub fn undelivered(&self) -> usize {
        let q = self.queues();
        q.send_kept.len() + q.recv_kept.len()
    }

    /// Posts send-queue work requests (sends, RDMA WRITEs, RDMA READs, atomics), linked into as few
    /// `ibv_post_send` calls as possible. Nothing is posted unless the queue has room for all.
    ///
    /// # Errors
    /// [`Error::QueueFull`], [`Error::InvalidArgument`] or [`Error::OutOfBounds`] before
    /// anything is posted; [`Error::QpInError`] once a completion of this QP failed (the QP is
    /// in the error state: nothing posted now can run); [`Error::Call`] when `ibv_post_send`
    /// rejects a work request (the ones before it stay posted and are tracked).
    pub fn post_send(&mut self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.post_sends(wrs)
    }

    /// [`QueuePair::post_send`] for any list of work requests that are sends underneath (a
    /// UD QP's [`UdSendWr`](crate::UdSendWr)s).
    pub(crate) fn post_sends<W: AsSendWr>(&mut self, wrs: &[W]) -> Result<()> {
        if !self.connected {
            // Only reachable through a ClientQp/ServerQp, whose API does not offer sends.
            return Err(Error::InvalidArgument("sends need an established connection".into()));
        }
        if self.peer_left {
            return Err(Error::Disconnected { op: "ibv_post_send", addr: self.peer_addr() });
        }
        if self.errored {
            return Err(in_error_state("ibv_post_send"));
        }
        for w in wrs {
            let w = w.send_wr();
            if w.ud.is_some() != self.datagrams {
                // Unreachable through the public API: only a UdQp posts datagrams, and it
                // offers nothing else.
                return Err(Error::InvalidArgument(if self.datagrams {
                    "a UD QP sends datagrams only, each addressed (UdSendWr)".into()
                } else {
                    "an addressed datagram needs a UD QP".into()
                }));
            }
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
                check_local(&self.pd, mr, r, w.op.writes_local())?;
            }
            if !w.rest.is_empty() {
                // Every constructor of a list sets its first piece; were one ever to leave it
                // out, the later pieces must not reach the device unchecked.
                let Some((_, first)) = &w.local else {
                    return Err(Error::InvalidArgument("a scatter/gather list needs its first piece".into()));
                };
                self.check_send_pieces(w, first.len())?;
            }
            if w.op.is_atomic() && w.imm.is_some() {
                return Err(Error::InvalidArgument("an atomic carries no immediate data".into()));
            }
        }
        let mut q = lock(&self.queues);
        // Read under the lock the post takes anyway (one lock per post, not two).
        if let Some(f) = q.failed {
            return Err(self.failed_error(f, "ibv_post_send"));
        }
        if (wrs.len() as u64) > q.send.free() {
            return Err(Error::QueueFull { queue: "send", depth: q.send.cap() as u32 });
        }
        if let [w] = wrs {
            let w = w.send_wr();
            return if w.rest.is_empty() { self.post_send_one(&mut q, w) } else { self.post_send_gather(&mut q, w) };
        }
        for chunk in wrs.chunks(CHUNK) {
            self.post_send_chunk(&mut q, chunk)?;
        }
        Ok(())
    }

    /// `post_send_chunk` for one work request of at most one piece (the common
    /// case): the same work request, built on the stack without the list's arrays and loops.
    #[inline]
    fn post_send_one(&self, q: &mut Queues, w: &SendWr<'_>) -> Result<()> {
        // Taking the last free slot makes it signaled (see post_send_chunk).
        let signaled = w.signaled || q.send.free() == 1;
        let hold = w.local.as_ref().map(|(m, _)| Hold::new(m.inner(), w.op.writes_local()));
        let seq = q.send.stage(0, w.wr_id, hold);
        // A datagram's address handle is held like the region (see post_send_chunk).
        let ud = w.ud.filter(|d| q.send.stage_ah(seq, d.ah()));
        let mut sge = first_sge(w);
        let mut wr = self.send_wr(w, seq, signaled, ud);
        wr.sg_list = &mut sge;
        wr.num_sge = has_data(w) as i32;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // The piece was checked against a region on this PD, whose handle the slot staged above
        // now holds until the completion is reaped; inline data is copied in the call.
        // SAFETY: QP valid; `wr` is one NULL-terminated work request over `sge`, both alive for
        // the call; the region it names is held (above).
        let ret = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        self.commit_posted(q, ret, bad, &wr, 1, true, "ibv_post_send")
    }

    /// `post_send_chunk` for one work request of several pieces: its scatter list on the stack
    /// (at most [`MAX_SGE`] entries, the count checked above), without the list's arrays and
    /// loops, and the side table touched only when a later piece names another region.
    fn post_send_gather(&self, q: &mut Queues, w: &SendWr<'_>) -> Result<()> {
        let signaled = w.signaled || q.send.free() == 1;
        let writes = w.op.writes_local();
        let first = w.local.as_ref().map(|(m, _)| m.inner());
        let seq = q.send.stage(0, w.wr_id, first.map(|m| Hold::new(m, writes)));
        if needs_rest_holds(first, w.rest) {
            q.send.stage_rest(seq, hold_rest(first, w.rest, writes));
        }
        let ud = w.ud.filter(|d| q.send.stage_ah(seq, d.ah()));
        let mut sge = [first_sge(w); MAX_SGE];
        let mut n = 1;
        for (m, r) in w.rest.iter().take(MAX_SGE - 1) {
            sge[n] = m.sge(r);
            n += 1;
        }
        let mut wr = self.send_wr(w, seq, signaled, ud);
        // A list of several pieces has no empty piece (the constructors refuse them).
        wr.sg_list = sge.as_mut_ptr();
        wr.num_sge = n as i32;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // Every piece was checked against a region on this PD (check_send_pieces), and the slot
        // staged above (with its side table) holds each region named until the completion.
        // SAFETY: QP valid; `wr` is one NULL-terminated work request over `sge[..n]`, both alive
        // for the call; every region it names is held (above), and so is a datagram's address
        // handle.
        let ret = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        self.commit_posted(q, ret, bad, &wr, 1, true, "ibv_post_send")
    }

    /// A send-queue work request's fields for `w` staged as `seq`, but its scatter list
    /// (`sg_list`, `num_sge`) and `next`, which the caller sets.
    #[inline(always)]
    fn send_wr(&self, w: &SendWr<'_>, seq: u64, signaled: bool, ud: Option<&UdDest>) -> ffi::ibv_send_wr {
        // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions of those); all-zero
        // is a valid value.
        let mut r: ffi::ibv_send_wr = unsafe { mem::zeroed() };
        r.wr_id = tag::encode(self.send_slot.index, self.nonce, seq, false, false);
        use ffi::ibv_wr_opcode::*;
        r.opcode = match (w.op, w.imm.is_some()) {
            (SendOp::Send, false) => IBV_WR_SEND,
            (SendOp::Send, true) => IBV_WR_SEND_WITH_IMM,
            (SendOp::Write { .. }, false) => IBV_WR_RDMA_WRITE,
            (SendOp::Write { .. }, true) => IBV_WR_RDMA_WRITE_WITH_IMM,
            (SendOp::Read { .. }, _) => IBV_WR_RDMA_READ,
            (SendOp::FetchAdd { .. }, _) => IBV_WR_ATOMIC_FETCH_AND_ADD,
            (SendOp::CompareSwap { .. }, _) => IBV_WR_ATOMIC_CMP_AND_SWP,
        };
        if let Some(imm) = w.imm {
            r.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        match w.op {
            SendOp::Write { addr, rkey } | SendOp::Read { addr, rkey } => {
                r.wr.rdma = ffi::rdma_t { remote_addr: addr, rkey };
            }
            SendOp::FetchAdd { addr, rkey, add } => {
                r.wr.atomic = ffi::atomic_t { remote_addr: addr, compare_add: add, swap: 0, rkey };
            }
            SendOp::CompareSwap { addr, rkey, compare, swap } => {
                r.wr.atomic = ffi::atomic_t { remote_addr: addr, compare_add: compare, swap, rkey };
            }
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
        if w.solicited {
            flags |= f::IBV_SEND_SOLICITED.0;
        }
        if w.inline.is_some() {
            flags |= f::IBV_SEND_INLINE.0;
        }
        r.send_flags = flags;
        r
    }

    /// Checks a send-queue work request of several pieces: their count against the QP's
    /// limits, and every piece after the first.
    fn check_send_pieces(&self, w: &SendWr<'_>, first_len: usize) -> Result<()> {
        let pieces = w.num_pieces();
        check_pieces(pieces, self.max_send_sge, "QP's send queue", "QpInit::max_send_sge")?;
        if matches!(w.op, SendOp::Read { .. }) && pieces > self.max_read_sge as usize {
            return Err(Error::InvalidArgument(format!(
                "an RDMA READ of {pieces} pieces exceeds the device's limit of {} for READs (max_sge_rd)",
                self.max_read_sge
            )));
        }
        check_rest(&self.pd, first_len, w.rest, w.op.writes_local())
    }

    fn post_send_chunk<W: AsSendWr>(&self, q: &mut Queues, wrs: &[W]) -> Result<()> {
        // Only the `n` entries used are initialised (zeroing whole arrays costs on every post).
        let mut raw: [MaybeUninit<ffi::ibv_send_wr>; CHUNK] = [const { MaybeUninit::uninit() }; CHUNK];
        let mut sge: [MaybeUninit<ffi::ibv_sge>; CHUNK_SGE] = [const { MaybeUninit::uninit() }; CHUNK_SGE];
        let n = wrs.len().min(CHUNK);
        // Both arrays are written only through these pointers from here on, so the pointers the
        // list holds into them stay valid.
        let base: *mut ffi::ibv_send_wr = raw.as_mut_ptr().cast();
        let sge_base: *mut ffi::ibv_sge = sge.as_mut_ptr().cast();
        let mut used = 0;
        // The work request that takes the last free slot is signaled, so that a queue full of
        // unsignaled work always has a completion coming that retires it.
        let free = q.send.free();
        for (k, w) in wrs[..n].iter().enumerate() {
            let w = w.send_wr();
            let writes = w.op.writes_local();
            let first = w.local.as_ref().map(|(m, _)| m.inner());
            let seq = q.send.stage(k as u64, w.wr_id, first.map(|m| Hold::new(m, writes)));
            if needs_rest_holds(first, w.rest) {
                // Every later piece's region is held too, in the ring's side table (once).
                q.send.stage_rest(seq, hold_rest(first, w.rest, writes));
            }
            // A datagram's address handle is held in the ring's table until the slot retires
            // (the check above made sure this is a UD QP, whose send ring has the table).
            let ud = w.ud.filter(|d| q.send.stage_ah(seq, d.ah()));
            let first = first_sge(w);
            let start = used;
            // SAFETY: at most MAX_SGE entries per work request (the first, and at most
            // MAX_SGE - 1 more below) and at most CHUNK work requests: `used` < CHUNK_SGE.
            unsafe { sge_base.add(used).write(first) };
            used += 1;
            for (m, r) in w.rest.iter().take(MAX_SGE - 1) {
                // SAFETY: as above.
                unsafe { sge_base.add(used).write(m.sge(r)) };
                used += 1;
            }
            // SAFETY: k < n <= CHUNK: within `raw`. The entry is initialised in place, and
            // reached only through `base`.
            let r = unsafe {
                base.add(k).write(self.send_wr(w, seq, w.signaled || free == k as u64 + 1, ud));
                &mut *base.add(k)
            };
            // A list of several pieces has no empty piece (the constructors refuse them).
            r.num_sge = if w.rest.is_empty() { has_data(w) as i32 } else { (used - start) as i32 };
            // SAFETY: start < CHUNK_SGE (see above).
            r.sg_list = unsafe { sge_base.add(start) };
            // SAFETY: k + 1 < n <= CHUNK, so the pointer stays within `raw`.
            r.next = if k + 1 < n { unsafe { base.add(k + 1) } } else { std::ptr::null_mut() };
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // Each piece was checked against a region on this PD, whose handle a ring slot (or its
        // side table) now holds until the completion is reaped; inline data is copied in the call;
        // a datagram's address handle is held by the ring's address-handle table likewise.
        // SAFETY: QP valid; raw[..n] is an initialised, NULL-terminated list over `sge`, alive
        // for the call; every region and address handle it names is held (above).
        let ret = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), base, &mut bad) };
        self.commit_posted(q, ret, bad, base, n, true, "ibv_post_send")
    }

    /// Commits the staged slots after a post, and maps the error (see "Failed posts" in the
    /// module docs).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn commit_posted<T>(
        &self,
        q: &mut Queues,
        ret: i32,
        bad: *mut T,
        first: *const T,
        n: usize,
        send: bool,
        op: &'static str,
    ) -> Result<()> {
        if ret == 0 {
            let ring = if send { &mut q.send } else { &mut q.recv };
            ring.commit(n as u64, n as u64);
            return Ok(());
        }
        self.commit_failed(q, ret, bad, first, n, send, op)
    }

    /// [`QueuePair::commit_posted`] after the provider refused a post.
    #[cold]
    #[allow(clippy::too_many_arguments)]
    fn commit_failed<T>(
        &self,
        q: &mut Queues,
        ret: i32,
        bad: *mut T,
        first: *const T,
        n: usize,
        send: bool,
        op: &'static str,
    ) -> Result<()> {
        let ring = if send { &mut q.send } else { &mut q.recv };
        if let Some(k) = rejected_from(bad, first, n) {
            ring.commit(k as u64, n as u64);
            return check_ibv(ret, op);
        }
        // Unknown extent: every staged work request may be posted (and may still run). Keep
        // them all, and flush them through the error state.
        ring.commit(n as u64, n as u64);
        let flushed = self.set_error_state().is_ok();
        Err(Error::Call {
            op,
            addr: None,
            hint: Some(if flushed {
                "the provider failed the post without saying which work requests it took: they are kept until the flush retires them, and the QP was moved to the error state"
            } else {
                "the provider failed the post without saying which work requests it took, and the QP could not be moved to the error state: its regions stay held until the QP is dropped"
            }),
            source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
        })
    }

    /// Posts receive work requests.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a QP that takes its receives from an SRQ (post there), or
    /// one moved to the error state ([`QueuePair::set_error`]); [`Error::QpInError`] once a
    /// completion failed (or a wait found the QP in the error state); as for
    /// [`QueuePair::post_send`].
    pub fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<()> {
        if self.srq.is_some() {
            return Err(Error::InvalidArgument(
                "this QP takes its receives from a shared receive queue: post them there".into(),
            ));
        }
        if self.peer_left {
            // The QP is in the error state: a receive posted now may never be flushed (rxe).
            return Err(Error::Disconnected { op: "ibv_post_recv", addr: self.peer_addr() });
        }
        if self.errored {
            return Err(in_error_state("ibv_post_recv"));
        }
        if let [w] = wrs {
            if w.rest.is_empty() {
                return self.post_recv_one(w);
            }
        }
        for w in wrs {
            check_recv(&self.pd, w, self.max_recv_sge, "QP's receive queue", "QpInit::max_recv_sge")?;
        }
        let mut q = lock(&self.queues);
        if let Some(f) = q.failed {
            return Err(self.failed_error(f, "ibv_post_recv"));
        }
        if (wrs.len() as u64) > q.recv.free() {
            return Err(Error::QueueFull { queue: "receive", depth: q.recv.cap() as u32 });
        }
        for chunk in wrs.chunks(CHUNK) {
            let stage = |k: usize, w: &RecvWr<'_>| {
                let seq = q.recv.stage(k as u64, w.wr_id, Some(Hold::new(w.mr.inner(), true)));
                if needs_rest_holds(Some(w.mr.inner()), w.rest) {
                    q.recv.stage_rest(seq, hold_rest(Some(w.mr.inner()), w.rest, true));
                }
                tag::encode(self.recv_slot.index, self.nonce, seq, true, false)
            };
            let post = |head: *mut ffi::ibv_recv_wr, n| {
                let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
                // SAFETY: as in post_send_chunk: a well-formed list over live stack arrays, every
                // piece checked (bounds, PD, LOCAL_WRITE), and each region held by a slot (or its
                // side table) until reaped.
                let ret = unsafe { ffi::ibv_post_recv(self.raw.as_ptr(), head, &mut bad) };
                (ret, bad, head, n)
            };
            let (ret, bad, head, n) = with_recv_list(chunk, stage, post);
            self.commit_posted(&mut q, ret, bad, head.cast_const(), n, false, "ibv_post_recv")?;
        }
        Ok(())
    }

    /// `post_recv` for one receive of at most one piece (the common case): the same checks and
    /// work request, built on the stack without the list's arrays and loops.
    #[inline]
    fn post_recv_one(&self, w: &RecvWr<'_>) -> Result<()> {
        check_local(&self.pd, w.mr, &w.range, true)?;
        let mut q = lock(&self.queues);
        // Read under the lock the post takes anyway (see post_sends).
        if let Some(f) = q.failed {
            return Err(self.failed_error(f, "ibv_post_recv"));
        }
        if q.recv.free() == 0 {
            return Err(Error::QueueFull { queue: "receive", depth: q.recv.cap() as u32 });
        }
        let seq = q.recv.stage(0, w.wr_id, Some(Hold::new(w.mr.inner(), true)));
        let mut sge = w.mr.sge(&w.range);
        let mut wr = ffi::ibv_recv_wr {
            wr_id: tag::encode(self.recv_slot.index, self.nonce, seq, true, false),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            // A zero-length receive has no scatter entry (see with_recv_list).
            num_sge: !w.range.is_empty() as i32,
        };
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // The piece was checked (bounds, PD, LOCAL_WRITE) and its region is held by the slot
        // staged above until the completion is reaped.
        // SAFETY: QP valid; `wr` is one NULL-terminated work request over `sge`, both alive for
        // the call.
        let ret = unsafe { ffi::ibv_post_recv(self.raw.as_ptr(), &mut wr, &mut bad) };
        self.commit_posted(&mut q, ret, bad, &wr, 1, false, "ibv_post_recv")
    }

    /// Polls both CQs into `out` without waiting; returns how many entries were filled. Each
    /// completion releases the region its work request held (and, on the send queue, those of
    /// earlier unsignaled work requests). Completions kept for this QP come first; those of
    /// other QPs on a shared CQ are kept for them.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    pub fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.poll_on(None, out, true)
    }

    /// Polls only `queue`'s completions into `out`, without waiting. With a CQ shared by
    /// both queues, the other queue's completions met on the way are kept for later.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_poll_cq` fails.
    pub fn poll_queue(&mut self, queue: WorkQueue, out: &mut [WorkCompletion]) -> Result<usize> {
        self.poll_on(Some(queue), out, true)
    }

    /// Polls `which` queue (or both) into `out`; with `kept`, the completions kept for this QP
    /// come first. A wait for one `wr_id` polls without them: it has looked at them already, and
    /// getting them back would keep it from ever reaching the CQ (or its deadline).
    #[inline(always)]
    fn poll_on(&self, which: Option<WorkQueue>, out: &mut [WorkCompletion], kept: bool) -> Result<usize> {
        if self.srq.is_none() || which == Some(WorkQueue::Send) {
            return self.poll_own(which, out, kept);
        }
        // Each queue's kept completions are delivered under the lock of the CQ it completes
        // on, before that CQ is polled: nothing can be kept for this QP meanwhile, so a later
        // completion never overtakes an earlier one that another thread kept.
        let same = Arc::ptr_eq(&self.send_cq, &self.recv_cq);
        let mut n = 0;
        if which != Some(WorkQueue::Recv) || same {
            let deliver = kept.then_some(if same { which } else { Some(WorkQueue::Send) });
            n += self.poll_cq(&self.send_cq, which, &mut out[n..], deliver)?;
        }
        if which != Some(WorkQueue::Send) && !same {
            n += self.poll_cq(&self.recv_cq, which, &mut out[n..], kept.then_some(Some(WorkQueue::Recv)))?;
        }
        Ok(n)
    }

    /// [`QueuePair::poll_on`] without an SRQ's kept receives to deliver (no SRQ, or only the
    /// send queue asked for): each CQ is polled with this QP's queues locked once, and its own
    /// completions are retired under that lock rather than through the routing table.
    #[inline(always)]
    fn poll_own(&self, which: Option<WorkQueue>, out: &mut [WorkCompletion], kept: bool) -> Result<usize> {
        let same = Arc::ptr_eq(&self.send_cq, &self.recv_cq);
        let mut n = 0;
        // Each queue's kept completions under the lock of the CQ it completes on (see poll_on).
        if which != Some(WorkQueue::Recv) || same {
            let deliver = kept.then_some(if same { which } else { Some(WorkQueue::Send) });
            n += self.poll_cq_own(&self.send_cq, self.send_slot.index, which, out, deliver)?;
        }
        if which != Some(WorkQueue::Send) && !same {
            let deliver = kept.then_some(Some(WorkQueue::Recv));
            n += self.poll_cq_own(&self.recv_cq, self.recv_slot.index, which, &mut out[n..], deliver)?;
        }
        Ok(n)
    }

    /// Polls `cq`, on whose routing table this QP sits at `index`, with the routing table and
    /// then this QP's queues locked (the order `Router::route` takes them in): completions of
    /// `which` queue of this QP go to `out`, after the kept ones when `deliver`; this QP's
    /// others are kept here, everyone else's for their owner.
    #[inline(always)]
    fn poll_cq_own(
        &self,
        cq: &CompletionQueue,
        index: u16,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deliver: Option<Option<WorkQueue>>,
    ) -> Result<usize> {
        let mut router = cq.router();
        let mut q = self.queues();
        let mut filled = match deliver {
            Some(d) if q.has_kept() => q.deliver_kept(d, out),
            _ => 0,
        };
        while filled < out.len() {
            let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
            let want = (out.len() - filled).min(POLL_CHUNK);
            let got = match cq.poll_raw(&mut raw[..want]) {
                Ok(got) => got,
                // What was reaped already is returned; the error comes back on the next poll.
                Err(_) if filled > 0 => break,
                Err(e) => return Err(e),
            };
            for wc in &raw[..got] {
                // SAFETY: ibv_poll_cq initialised the first `got` entries.
                let wc = unsafe { wc.assume_init_ref() };
                let Some(t) = tag::decode(wc.wr_id) else { continue };
                if !t.srq && t.owner == index {
                    // This QP's index: ours, or stale (an earlier QP at the index: the checks
                    // Router::route makes).
                    if t.nonce != self.nonce || wc.qp_num != self.qp_num {
                        continue;
                    }
                    let Some(id) = q.complete(&t) else { continue };
                    q.note_status(wc.status);
                    let queue = if t.recv { WorkQueue::Recv } else { WorkQueue::Send };
                    let done = WorkCompletion::from_raw(wc, id, queue);
                    if which.is_none_or(|w| w == queue) {
                        out[filled] = done;
                        filled += 1;
                    } else {
                        q.keep(done);
                        router.note_kept();
                    }
                    continue;
                }
                // Another QP's, or an SRQ's: routed (and kept) without this QP's lock, so that
                // no poll ever holds two QPs' queues at once.
                drop(q);
                if let Some((done, owner)) = router.route(wc) {
                    if done.qp_num() == self.qp_num && which.is_none_or(|q| q == done.queue()) {
                        out[filled] = done;
                        filled += 1;
                    } else {
                        router.keep(done, owner);
                    }
                }
                q = self.queues();
            }
            if got < want {
                break;
            }
        }
        Ok(filled)
    }

    /// Polls `cq`: completions of this QP (of `which` queue) go to `out`; every other one is
    /// kept for its owner.
    ///
    /// With `deliver`, the completions kept for this QP of that queue (`None`: both) come
    /// first, the SRQ's kept receives of this QP among them, delivered under the CQ's lock.
    fn poll_cq(
        &self,
        cq: &CompletionQueue,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deliver: Option<Option<WorkQueue>>,
    ) -> Result<usize> {
        let mut router = cq.router();
        let mut filled = 0;
        if let Some(d) = deliver {
            filled += self.queues().deliver_kept(d, out);
            if d != Some(WorkQueue::Send) {
                if let Some(srq) = &self.srq {
                    filled += srq.deliver_kept_for(self.qp_num, &mut out[filled..]);
                }
            }
        }
        while filled < out.len() {
            let mut raw: [MaybeUninit<ffi::ibv_wc>; POLL_CHUNK] = [const { MaybeUninit::uninit() }; POLL_CHUNK];
            let want = (out.len() - filled).min(POLL_CHUNK);
            let got = match cq.poll_raw(&mut raw[..want]) {
                Ok(got) => got,
                // What was reaped already is returned; the error comes back on the next poll.
                Err(_) if filled > 0 => break,
                Err(e) => return Err(e),
            };
            for wc in &raw[..got] {
                // SAFETY: ibv_poll_cq initialised the first `got` entries.
                let wc = unsafe { wc.assume_init_ref() };
                let Some((done, owner)) = router.route(wc) else { continue };
                let mine = done.qp_num() == self.qp_num && which.is_none_or(|q| q == done.queue());
                if mine {
                    out[filled] = done;
                    filled += 1;
                } else {
                    // Another QP's, or ours of the other queue: kept for the next poll or wait
                    // that asks for it (an SRQ receive stays with its SRQ, under its QP number).
                    router.keep(done, owner);
                }
            }
            if got < want {
                break;
            }
        }
        Ok(filled)
    }

    /// Waits up to `timeout` for at least one completion on either queue and polls it into
    /// `out`.
    ///
    /// It polls first, then arms the CQs and sleeps on their completion channels, so an idle
    /// wait costs no CPU. Returns 0 only when the timeout passed. On CQs shared with QPs that
    /// other threads wait on, a completion another thread's poll keeps for this QP wakes this
    /// wait.
    ///
    /// # Errors
    /// [`Error::Call`] when polling or the channels fail; [`Error::AsyncEvent`] when nothing is
    /// left to reap and the device reported the QP, one of its CQs, or itself unusable;
    /// [`Error::QpInError`] when the timeout passed and the QP is in the error state though
    /// nothing said so (see [`QueuePair::wait_for`]).
    pub fn wait(&mut self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        self.wait_kept(None, out, timeout)
    }

    /// [`QueuePair::wait`] on `which` queue (or both): kept completions come first, and one
    /// kept for this QP by another thread meanwhile ends a sleep.
    fn wait_kept(&mut self, which: Option<WorkQueue>, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        let mut seen = self.queues().notify.seq;
        match self.wait_on(which, out, &mut Deadline::new(timeout), true, &mut seen)? {
            Woke::Found(n) => Ok(n),
            // Not returned with `kept`: a kept completion is polled like any other.
            Woke::Kept => Ok(0),
            Woke::TimedOut => {
                self.check_silent_error("waiting for a completion")?;
                Ok(0)
            }
        }
    }

    /// Makes the blocking waits ([`QueuePair::wait`], [`QueuePair::wait_queue`],
    /// [`QueuePair::wait_for`]) busy-poll: they poll the CQs in a loop until a completion
    /// arrives or the timeout passes, and never sleep on the completion channels. This is what
    /// perftest's latency tools do: the lowest and steadiest latency, for a whole core while
    /// waiting. A busy wait still notices the peer leaving (it looks at the connection's events
    /// without sleeping, every few thousand polls) and still honours its timeout. Off by
    /// default: a wait spins briefly, then sleeps. The async waits are not affected.
    pub fn set_busy_poll(&mut self, on: bool) {
        self.busy_poll = on;
    }

    /// Whether waits busy-poll ([`QueuePair::set_busy_poll`]).
    pub fn busy_poll(&self) -> bool {
        self.busy_poll
    }

    /// Like [`QueuePair::wait`], for one queue only: the other queue's completions stay for
    /// later (in their CQ, or kept when the queues share one).
    ///
    /// # Errors
    /// As for [`QueuePair::wait`].
    pub fn wait_queue(&mut self, queue: WorkQueue, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        self.wait_kept(Some(queue), out, timeout)
    }

    /// The CQs a wait on `which` sleeps on (one entry is None when there is only one).
    /// Borrowed, not cloned: a wait owns nothing, so a wait future that is forgotten
    /// (`mem::forget`) keeps no CQ alive, and a wait makes no reference-count changes.
    fn wait_cqs(&self, which: Option<WorkQueue>) -> [Option<&CompletionQueue>; 2] {
        match which {
            _ if Arc::ptr_eq(&self.send_cq, &self.recv_cq) => [Some(&self.send_cq), None],
            None => [Some(&self.send_cq), Some(&self.recv_cq)],
            Some(WorkQueue::Send) => [Some(&self.send_cq), None],
            Some(WorkQueue::Recv) => [Some(&self.recv_cq), None],
        }
    }

    /// Polls, then arms the CQs and polls again (so no completion slips between the two);
    /// returns what was found, or 0 when the caller should sleep on the descriptors.
    fn poll_or_arm(
        &self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        kept: bool,
        spins: u32,
    ) -> Result<usize> {
        // A short busy phase keeps latency low without burning a core while idle.
        for _ in 0..spins {
            let n = self.poll_on(which, out, kept)?;
            if n > 0 {
                return Ok(n);
            }
            std::hint::spin_loop();
        }
        for cq in self.wait_cqs(which).into_iter().flatten() {
            cq.req_notify(false)?;
        }
        self.poll_on(which, out, kept)
    }

    /// The link's descriptor, when waits watch it: once connected, until the peer left.
    fn watch_fd(&self) -> RawFd {
        match &self.link {
            Some(l) if self.connected && !self.peer_left => l.watch_fd().unwrap_or(-1),
            _ => -1,
        }
    }

    /// The descriptors a sleeping wait watches: the CQ channels, and the link's.
    fn wait_fds(&self, which: Option<WorkQueue>) -> [RawFd; 3] {
        let [a, b] = self.wait_cqs(which).map(|cq| cq.map_or(-1, |c| c.as_raw_fd()));
        [a, b, self.watch_fd()]
    }

    /// After a sleep: acks the CQ events and asks the link what woke us.
    fn after_wake(&mut self, which: Option<WorkQueue>, link_ready: bool) -> Result<()> {
        for cq in self.wait_cqs(which).into_iter().flatten() {
            cq.drain_events()?;
        }
        if link_ready {
            self.check_link()?;
        }
        Ok(())
    }

    /// Asks the link whether the peer left (its descriptor was readable), and if so moves the
    /// QP to the error state so its work is flushed.
    fn check_link(&mut self) -> Result<()> {
        if let Some(l) = &self.link {
            if l.peer_left()? {
                self.peer_gone();
            }
        }
        Ok(())
    }

    /// Polls, sleeps on the CQs (and the link, the device's events, and this QP's notify
    /// eventfd) until something arrives or `deadline` passes. With `kept`, completions kept for
    /// this QP are polled like new ones; without (a wait for one `wr_id`, which has looked at
    /// them already), a completion kept for this QP by another QP's poll since `seen` ends the
    /// wait with [`Woke::Kept`], so that the caller looks at it.
    fn wait_on(
        &mut self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deadline: &mut Deadline,
        kept: bool,
        seen: &mut u64,
    ) -> Result<Woke> {
        if out.is_empty() {
            return Ok(Woke::TimedOut);
        }
        if self.busy_poll {
            return self.spin_on(which, out, deadline, kept, seen);
        }
        loop {
            let n = self.poll_or_arm(which, out, kept, SYNC_SPINS)?;
            if n > 0 {
                return Ok(Woke::Found(n));
            }
            if let Some(e) = self.async_error() {
                return Err(e);
            }
            let left = deadline.left();
            if left.is_zero() {
                return Ok(Woke::TimedOut);
            }
            // Announce the sleep (see ring::Notify): from here on, a completion another QP's
            // poll keeps for this one writes the eventfd; one kept since `seen` ends the sleep
            // before it starts. (The CQ's event alone cannot be relied on: the thread that took
            // the completion may also have taken the event.)
            let notify_fd = {
                let mut q = self.queues();
                if q.notify.seq != *seen {
                    *seen = q.notify.seq;
                    drop(q);
                    if kept {
                        continue;
                    }
                    return Ok(Woke::Kept);
                }
                let fd = q.notify.fd()?;
                q.notify.sleeping = true;
                fd
            };
            // The context's async events too, so that a QP going fatal ends the wait at once.
            let [a, b, c] = self.wait_fds(which);
            let mut fds = [a, b, c, self.pd.context().as_raw_fd(), notify_fd].map(pollfd);
            let slept = poll_readable(&mut fds, left);
            self.queues().notify.sleeping = false;
            slept?;
            if fds[4].revents != 0 {
                crate::wait::eventfd_clear(notify_fd);
            }
            if fds[3].revents != 0 {
                self.async_reg.refresh(self.pd.context())?;
            }
            self.after_wake(which, fds[2].revents != 0)?;
        }
    }

    /// The busy-poll wait: polls until something arrives or the deadline passes, looking at
    /// the link (without sleeping) between rounds so that a peer that left is noticed and its
    /// flushed completions are reaped like any others, and (without `kept`) at completions
    /// kept for this QP by others since `seen`.
    fn spin_on(
        &mut self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        deadline: &mut Deadline,
        kept: bool,
        seen: &mut u64,
    ) -> Result<Woke> {
        // Polls per round: the clock and the link are read once a round, not once a poll.
        const ROUND: u32 = 4096;
        let budget = deadline.left();
        // The clock is read once a whole round has found nothing, not on entry: a latency loop
        // usually finds its completion within the first round, and a clock read is a system
        // call where there is no fast vDSO clock (0.8 µs in the project's QEMU guest, whose
        // clock source is the HPET). The wait may thus last up to one round past `budget`.
        let mut start: Option<std::time::Instant> = None;
        loop {
            for _ in 0..ROUND {
                let n = self.poll_on(which, out, kept)?;
                if n > 0 {
                    return Ok(Woke::Found(n));
                }
                std::hint::spin_loop();
            }
            if !kept {
                let seq = self.queues().notify.seq;
                if seq != *seen {
                    *seen = seq;
                    return Ok(Woke::Kept);
                }
            }
            let link = self.watch_fd();
            if link >= 0 && poll_readable(&mut [pollfd(link)], Duration::ZERO)? {
                self.check_link()?;
            }
            self.async_reg.refresh(self.pd.context())?;
            if let Some(e) = self.async_error() {
                return Err(e);
            }
            if start.get_or_insert_with(std::time::Instant::now).elapsed() >= budget {
                return Ok(Woke::TimedOut);
            }
        }
    }

    /// After a wait ran out: a connected QP found in the error state though nothing said so
    /// (on RC, the peer's RDMA access with a bad rkey does this to the responder, with no
    /// completion and, on rxe, no async event) is recorded as failed, so posts are refused
    /// from then on, and the wait fails saying so instead of timing out blind.
    fn check_silent_error(&mut self, op: &'static str) -> Result<()> {
        if !self.connected || self.peer_left || self.errored || self.closing {
            return Ok(());
        }
        if self.state()? != crate::QpState::Error {
            return Ok(());
        }
        let f = *self.queues().failed.get_or_insert(Failure::FoundInError);
        Err(self.failed_error(f, op))
    }

    /// The refusal (or the wait's error) for a QP known to be in the error state.
    fn failed_error(&self, f: Failure, op: &'static str) -> Error {
        if self.datagrams {
            if let Failure::Completion(_) = f {
                return failed_datagram(op);
            }
        }
        let cause = match f {
            Failure::Completion(status) => {
                let st = crate::WcStatus::from_raw(status);
                let hint = st.hint().map(|h| format!(" ({h})")).unwrap_or_default();
                format!("a completion failed with {st}{hint}")
            }
            Failure::FoundInError => {
                "it went there with no completion saying why: on RC the usual cause is the peer's \
                RDMA WRITE, READ or atomic naming a wrong rkey or a range outside the region (the responder's QP fails \
                silently), or a local catastrophic error (see `dmesg`)"
                    .into()
            }
        };
        Error::QpInError { op, addr: self.peer_addr(), cause }
    }

    /// Like [`QueuePair::wait`], without blocking a tokio runtime: sleeps on the CQ channels
    /// (and the CM channel, to notice the peer leaving) through tokio's reactor, where the CQ
    /// and the channel stay registered from their first async wait on (no system calls to
    /// register per wait; a wait on another runtime registers for its own duration). Unbounded by
    /// itself: wrap it in `tokio::time::timeout`. Cancelling it (dropping the future) is safe at
    /// any point: the posted work requests, and the regions they hold, stay with the QP until
    /// their completions are polled or the QP is dropped.
    ///
    /// # Errors
    /// As for [`QueuePair::wait`].
    #[cfg(feature = "tokio")]
    pub async fn wait_async(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut seen = self.queues().notify.seq;
        loop {
            // With `kept`, a completion kept by another thread is polled like a new one.
            if let Woke::Found(n) = self.wait_on_async(None, out, true, &mut seen).await? {
                return Ok(n);
            }
        }
    }

    /// [`QueuePair::wait_for`] for async code: waits for `wr_id` on `queue`, failing on any
    /// failed completion of that queue. Unbounded by itself (use `tokio::time::timeout`);
    /// cancellation-safe as [`QueuePair::wait_async`] is.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`], [`Error::Disconnected`].
    #[cfg(feature = "tokio")]
    pub async fn wait_for_async(&mut self, queue: WorkQueue, wr_id: u64) -> Result<WorkCompletion> {
        let mut seen = 0;
        if let Some(r) = self.pick_kept(queue, wr_id, &mut seen) {
            return r;
        }
        let mut wcs = [WorkCompletion::default(); 4];
        loop {
            // Completions are kept or returned within the poll that reaps them, so dropping
            // this future between polls loses none.
            let r = match self.wait_on_async(Some(queue), &mut wcs, false, &mut seen).await? {
                Woke::Found(n) => self.pick(&wcs[..n], queue, wr_id),
                // Another thread kept a completion for this QP: it may be the one.
                Woke::Kept | Woke::TimedOut => self.pick_kept(queue, wr_id, &mut seen),
            };
            if let Some(r) = r {
                return r;
            }
        }
    }

    #[cfg(feature = "tokio")]
    async fn wait_on_async(
        &mut self,
        which: Option<WorkQueue>,
        out: &mut [WorkCompletion],
        kept: bool,
        seen: &mut u64,
    ) -> Result<Woke> {
        if out.is_empty() {
            return Ok(Woke::Found(0));
        }
        loop {
            // A longer busy phase than the blocking wait's: a sleep through the reactor costs
            // more than one in poll(2) (the runtime's park and wake-up).
            let n = self.poll_or_arm(which, out, kept, ASYNC_SPINS)?;
            if n > 0 {
                return Ok(Woke::Found(n));
            }
            if let Some(e) = self.async_error() {
                return Err(e);
            }
            let [a, b, c] = self.wait_fds(which);
            // Each descriptor with its owner's lasting reactor registration: no epoll_ctl
            // calls per wait.
            let cqs = self.wait_cqs(which);
            let reactor = |i: usize| cqs[i].map(CompletionQueue::reactor);
            let link = self.link.as_deref().and_then(|l| l.watch_reactor());
            let queues = &self.queues;
            // A completion another QP's poll keeps for this one wakes the task (ring::Notify);
            // one kept since `seen` ends the wait before it sleeps.
            let woke = crate::wait::readable_any(
                [with_fd(a, reactor(0)), with_fd(b, reactor(1)), with_fd(c, link)],
                |waker| {
                    let mut q = lock(queues);
                    if q.notify.seq != *seen {
                        *seen = q.notify.seq;
                        q.notify.waker = None;
                        return true;
                    }
                    if !q.notify.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                        q.notify.waker = Some(waker.clone());
                    }
                    false
                },
            )
            .await;
            lock(&self.queues).notify.waker = None;
            match woke? {
                None if kept => continue,
                None => return Ok(Woke::Kept),
                // The link is read only when its descriptor woke us, as in the blocking wait.
                Some(i) => self.after_wake(which, i == 2)?,
            }
        }
    }

    /// Whether a completion decides a wait for `wr_id` on `queue`: it is that work request,
    /// or a failure of that queue.
    fn decides(wc: &WorkCompletion, queue: WorkQueue, wr_id: u64) -> bool {
        wc.queue() == queue && (wc.wr_id() == wr_id || !wc.is_ok())
    }

    /// The answer a deciding completion gives a wait for `wr_id`: itself, or the error it
    /// carries. The disconnect is named when the peer left and the failed completion is the
    /// awaited one; another work request's failure is reported as such (with its `wr_id`), so
    /// its completion is not lost behind the error.
    fn answer(&self, wc: WorkCompletion, wr_id: u64) -> Result<WorkCompletion> {
        if !wc.is_ok() && self.peer_left && wc.wr_id() == wr_id {
            return Err(Error::Disconnected { op: "waiting for a completion", addr: self.peer_addr() });
        }
        if !wc.is_ok() && wc.wr_id() == wr_id {
            if let Some(e) = self.async_error() {
                return Err(e);
            }
        }
        wc.ok()
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        self.link.as_ref().and_then(|l| l.peer_addr())
    }

    /// A kept completion that decides a wait for `wr_id`, if there is one. `seen` becomes the
    /// count of keeps by others looked at (see `ring::Notify`).
    fn pick_kept(&mut self, queue: WorkQueue, wr_id: u64, seen: &mut u64) -> Option<Result<WorkCompletion>> {
        let wc = {
            let mut q = self.queues();
            *seen = q.notify.seq;
            q.take_kept(queue, |wc| Self::decides(wc, queue, wr_id))
        };
        let wc = wc.or_else(|| {
            let srq = self.srq.as_ref().filter(|_| queue == WorkQueue::Recv)?;
            srq.take_kept_for(self.qp_num, |wc| Self::decides(wc, queue, wr_id))
        })?;
        Some(self.answer(wc, wr_id))
    }

    /// Goes through a batch in order: the first completion that decides the wait answers it;
    /// every other one is kept for a later poll or wait, so none is lost.
    fn pick(&mut self, wcs: &[WorkCompletion], queue: WorkQueue, wr_id: u64) -> Option<Result<WorkCompletion>> {
        let mut found = None;
        for wc in wcs {
            if found.is_none() && Self::decides(wc, queue, wr_id) {
                found = Some(*wc);
            } else if let (Some(srq), WorkQueue::Recv) = (&self.srq, wc.queue()) {
                srq.shared().slots().keep(*wc);
            } else {
                self.queues().keep(*wc);
            }
        }
        found.map(|wc| self.answer(wc, wr_id))
    }

    /// Lets the QP react to the peer leaving (or the device going away): move it to the error
    /// state so every posted work request flushes instead of waiting forever. librdmacm does
    /// not do this on the passive side of a disconnect.
    pub(crate) fn peer_gone(&mut self) {
        if self.peer_left {
            return;
        }
        self.peer_left = true;
        // rdma_disconnect moves the QP to ERR and completes the CM handshake; set_error is
        // the fallback when the id is past that state.
        let disconnected = self.link.as_ref().is_some_and(|l| l.disconnect().is_ok());
        if !disconnected {
            let _ = self.set_error_state();
        }
    }

    /// This side disconnected: the QP is in the error state by the caller's wish.
    pub(crate) fn set_closing(&mut self) {
        self.closing = true;
    }

    pub(crate) fn set_connected(&mut self) {
        self.connected = true;
    }

    /// Whether the peer disconnected (seen while waiting, or through the connection's events).
    pub fn peer_left(&self) -> bool {
        self.peer_left
    }

    /// What ends a wait once the device reported this QP, one of its CQs, or itself unusable
    /// (delivered by whoever read the event; see [`crate::async_event`]).
    fn async_error(&self) -> Option<Error> {
        const OP: &str = "waiting for a completion";
        self.async_reg.error(OP).or_else(|| self.send_cq.async_error(OP)).or_else(|| self.recv_cq.async_error(OP))
    }

    /// The last asynchronous event the device reported about this QP (e.g.
    /// [`AsyncEventKind::QpFatal`](crate::AsyncEventKind::QpFatal)), after reading what is
    /// pending. See [`crate::async_event`].
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn last_async_event(&self) -> Result<Option<crate::AsyncEventKind>> {
        self.async_reg.refresh(self.pd.context())?;
        Ok(self.async_reg.events().last())
    }

    /// The event that made this QP unusable (a fatal QP event, or the device failing), after
    /// reading what is pending. Once there is one, waits that find nothing to reap fail with
    /// [`Error::AsyncEvent`] instead of sleeping; so they do when one of its CQs overran
    /// ([`CompletionQueue::has_error`]).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn fatal_event(&self) -> Result<Option<crate::AsyncEventKind>> {
        self.async_reg.refresh(self.pd.context())?;
        Ok(self.async_reg.fatal())
    }

    /// Waits for the completion with `wr_id` on `queue`, checking every completion of that
    /// queue on the way: a failed completion, or running out of `timeout`, is an error.
    /// Completions of other work requests met on the way are kept, in order, for the next
    /// poll or wait ([`QueuePair::undelivered`] counts them).
    ///
    /// When the timeout passes, the QP's state is asked ([`QueuePair::state`]): a QP in the
    /// error state that no completion explained (the responder of the peer's RDMA access with a
    /// bad rkey gets there silently) fails the wait with [`Error::QpInError`], and its posts
    /// are refused from then on.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] for a failed completion; [`Error::Disconnected`];
    /// [`Error::Timeout`]; [`Error::QpInError`] (above); [`Error::AsyncEvent`] when the device
    /// reported the QP, one of its CQs, or itself unusable (see [`QueuePair::fatal_event`]).
    pub fn wait_for(&mut self, queue: WorkQueue, wr_id: u64, timeout: Duration) -> Result<WorkCompletion> {
        let mut seen = 0;
        if let Some(r) = self.pick_kept(queue, wr_id, &mut seen) {
            return r;
        }
        let mut deadline = Deadline::new(timeout);
        let mut wcs = [WorkCompletion::default(); 4];
        loop {
            let r = match self.wait_on(Some(queue), &mut wcs, &mut deadline, false, &mut seen)? {
                Woke::Found(n) => self.pick(&wcs[..n], queue, wr_id),
                // Another thread's poll kept a completion for this QP: it may be the one.
                Woke::Kept => self.pick_kept(queue, wr_id, &mut seen),
                Woke::TimedOut => {
                    let op = if queue == WorkQueue::Recv {
                        "waiting for a receive"
                    } else {
                        "waiting for a send completion"
                    };
                    self.check_silent_error(op)?;
                    return Err(Error::Timeout {
                        op,
                        timeout,
                        addr: self.peer_addr(),
                        hint: Some("the peer sent nothing, or is gone without a disconnect (link down?)"),
                    });
                }
            };
            if let Some(r) = r {
                return r;
            }
        }
    }

    /// Moves the QP to the error state, which flushes every outstanding work request. From
    /// then on posts are refused: nothing posted to a QP in the error state can run, and rxe
    /// never flushes a receive posted then (it would stay held until the QP is dropped).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_modify_qp` fails.
    pub fn set_error(&mut self) -> Result<()> {
        self.set_error_state()?;
        self.errored = true;
        Ok(())
    }

    fn set_error_state(&self) -> Result<()> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: QP valid; only the state is modified, as the mask says.
        check_ibv(
            unsafe { ffi::ibv_modify_qp(self.as_raw(), &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) },
            "ibv_modify_qp(ERR)",
        )
    }

    fn outstanding(&self) -> (u64, u64) {
        let q = self.queues();
        (q.send.outstanding(), q.recv.outstanding())
    }

    /// Flushes and reaps outstanding work for up to `timeout`; true when nothing is left.
    fn drain(&mut self, timeout: Duration) -> bool {
        let (s, r) = self.outstanding();
        if s + r == 0 {
            return true;
        }
        self.connected = false; // no link reads from here on: its events are not ours to take
        if self.set_error_state().is_err() {
            return false;
        }
        let deadline = Instant::now() + timeout;
        let mut wcs = [WorkCompletion::default(); POLL_CHUNK];
        loop {
            let (s, r) = self.outstanding();
            if s + r == 0 {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // Unsignaled sends that succeeded before the flush produce no completion; the
            // flushed ones after them do. What remains is retired by the destroy below.
            match self.wait(&mut wcs, left.min(Duration::from_millis(50))) {
                Ok(0) if s > 0 && r == 0 => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }
}

/// A descriptor and its owner's reactor registrations, for `readable_any`.
#[cfg(feature = "tokio")]
fn with_fd(fd: RawFd, r: Option<&crate::wait::Reactor>) -> Option<(RawFd, &crate::wait::Reactor)> {
    r.map(|r| (fd, r))
}

/// The refusal of a post to a QP the caller moved to the error state.
fn in_error_state(op: &'static str) -> Error {
    Error::InvalidArgument(format!(
        "{op}: the QP is in the error state (QueuePair::set_error): nothing posted now can run, and a receive \
         posted now is never flushed on rxe; create a new QP"
    ))
}

/// The refusal of a post to a UD QP that a failed completion moved to the error state.
fn failed_datagram(op: &'static str) -> Error {
    Error::InvalidArgument(format!(
        "{op}: the UD QP is in the error state after a completion failed (a datagram longer than the receive \
         buffer does this: one peer can stop the QP): nothing posted now can run; create a new QP, and post \
         receives of UdQp::recv_len() bytes, which any datagram fits"
    ))
}

impl QueuePair {
    /// On a tokio runtime thread, a QP with work in flight would block the runtime for up to
    /// `DRAIN_TIMEOUT` while the flush is reaped: hand the whole teardown to the runtime's
    /// blocking pool instead. Returns whether it did (then `self` destroys nothing).
    #[cfg(feature = "tokio")]
    fn detach_to_blocking_pool(&mut self) -> bool {
        let (s, r) = self.outstanding();
        if self.detached || self.inline_teardown || s + r == 0 {
            return false;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return false };
        let guts = QueuePair {
            raw: self.raw,
            qp_num: self.qp_num,
            max_inline: self.max_inline,
            max_send_sge: self.max_send_sge,
            max_recv_sge: self.max_recv_sge,
            max_read_sge: self.max_read_sge,
            nonce: self.nonce,
            send_slot: self.send_slot,
            recv_slot: self.recv_slot,
            send_reserved: self.send_reserved,
            recv_reserved: self.recv_reserved,
            connected: self.connected,
            datagrams: self.datagrams,
            peer_left: self.peer_left,
            errored: self.errored,
            closing: self.closing,
            busy_poll: self.busy_poll,
            detached: false,
            inline_teardown: true,
            queues: Arc::clone(&self.queues),
            async_reg: self.async_reg.clone(),
            link: self.link.clone(),
            send_cq: Arc::clone(&self.send_cq),
            recv_cq: Arc::clone(&self.recv_cq),
            srq: self.srq.clone(),
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
        // Out of the registry before the destroy (see crate::async_event).
        self.async_reg.leave();
        let ret = match &self.link {
            Some(l) => l.destroy(self.raw.as_ptr()),
            // SAFETY: the QP is destroyed exactly once, here; nothing else refers to it.
            None => unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) },
        };
        if ret != 0 {
            // The device may still access the slots' memory: leak it instead of freeing it,
            // before anything else can fail or panic. The routing tables keep their entries
            // (and so their handles of the slots) too.
            mem::forget(Arc::clone(&self.queues));
            crate::report_leak("ibv_destroy_qp", ret);
            return;
        }
        // The QP is gone: its entries leave the routing tables, so completions of it still in
        // a shared CQ retire nothing; its reservations are returned.
        let same = Arc::ptr_eq(&self.send_cq, &self.recv_cq);
        {
            let mut r = self.send_cq.router();
            r.detach_qp(self.send_slot.index);
            r.unreserve(self.send_reserved);
        }
        {
            let mut r = self.recv_cq.router();
            if !same {
                r.detach_qp(self.recv_slot.index);
            }
            r.unreserve(self.recv_reserved);
        }
        if let Some(srq) = &self.srq {
            self.recv_cq.detach_srq(srq.shared());
            // Receives this QP consumed and nobody polled, kept in the SRQ, can reach nobody
            // now: they would hold the SRQ's room for good. (From here on the routing tables
            // keep none for it: it is in none of them.)
            srq.shared().slots().discard_for(self.qp_num);
        }
        // The rings (and the regions they hold) drop with the last handle of the queues.
    }
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, r) = self.outstanding();
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num)
            .field("outstanding_sends", &s)
            .field("outstanding_recvs", &r)
            .field("srq", &self.srq.is_some())
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
