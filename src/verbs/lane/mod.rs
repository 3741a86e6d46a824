//! [`Lane`]: the data path. One completion queue and the queue pairs that complete on it,
//! driven by one thread, with owned buffers instead of locks and reference counts. Every post
//! and poll of the crate goes through a lane.
//!
//! # What it is
//!
//! A lane costs what the raw verbs cost, and stays sound, by how it is built:
//!
//! - **Ownership instead of locks.** A lane owns its CQ and the QPs attached to it
//!   ([`Lane::attach`] takes what owns the QP: a [`Connection`](crate::Connection) or
//!   [`UdEndpoint`](crate::cm::ud_cm::UdEndpoint) from the CM, a [`QueuePair`] or [`UdQp`](crate::verbs::ud::UdQp) without it).
//!   It is `Send`, not `Sync`, and posting and polling take `&mut self`: no mutex, no atomic
//!   read-modify-write on the way. One lane per thread is how RDMA servers are built anyway.
//! - **Owned buffers instead of reference counts.** A work request *moves* its
//!   [`MemoryRegion`](crate::MemoryRegion) into the lane's slot table (sized by the queue depth, allocated once,
//!   when the QP is attached); the completion that retires the slot hands it back (beside
//!   the [`Wc`] in [`Lane::poll_with`]; in the [`Completion`] of [`Lane::poll`]). A post moves
//!   one pointer and touches no atomic.
//! - **Checks that cost compares.** A post checks the region's protection domain, the range,
//!   the access rights and the remote range with a few compares, lowers the work request in
//!   one place ([`SendWr`] → `ibv_send_wr`) and calls the provider. A poll decodes the
//!   completion's tag (which QP, which slot) and hands the raw fields over as they are; the
//!   typed accessors decode them when asked.
//! - **Selective signaling and post lists.** [`SendWr::unsignaled`] work requests complete
//!   with the next signaled one of their queue: that completion retires every earlier slot of
//!   the queue, in order, and each comes back as its own completion
//!   ([`Wc::is_signaled`] false). On an iWARP device, which may complete a send before an
//!   earlier READ's data has landed, every request is signaled and each slot retires with its
//!   own completion. [`Lane::post_send_list`] posts up to
//!   [`MAX_LIST`] work requests under one doorbell (one `ibv_post_send` of a chained list).
//! - **Checks hoisted out of the loop: prepared work requests.** The same buffer posted again
//!   and again (a ping-pong, a stream of WRITEs, a ring of receives) need not be checked and
//!   lowered each time. [`Lane::prepare_send`] and [`Lane::prepare_recv`] check a work request
//!   against its region and its QP once and keep the provider's work request; a post
//!   ([`Lane::post_prepared`], [`Lane::post_prepared_recv`], [`Lane::post_prepared_list`])
//!   only stamps the tag and the signaled bit, moves the region into the slot and calls the
//!   provider. The completion hands the region back, and [`PreparedSend::rearm`] takes it
//!   (that region only: the request was checked against it). This, with
//!   [`Lane::poll_with`], is the path for performance-sensitive code. (The examples' rate
//!   mode posts prepared requests; their latency mode, a [`SendWr`] per post.)
//! - **Batches over one region.** Work requests that are pieces of one buffer (a stream of
//!   WRITEs, a message scattered to several places) go as a [`PreparedBatch`]
//!   ([`Lane::prepare_batch`], [`Lane::post_batch`]): lowered once and linked, posted under one
//!   doorbell, only the last one signaled. The region moves into the lane once, and the last
//!   request's completion hands it back as one [`Wc`] for the whole batch, carrying the first
//!   failure among its requests when one failed. Per WRITE, a batch of 16 costs what the raw
//!   calls do (BENCHMARKS.md).
//!
//! - **The whole connection, from before connect to disconnect.** A connection's QP joins the
//!   lane before the connect or accept ([`RouteResolved::lane_qp`](crate::RouteResolved::lane_qp),
//!   [`ConnectRequest::lane_qp`](crate::ConnectRequest::lane_qp)): its receives are posted
//!   before the peer can send, [`ConnParam::min_rnr_timer`](crate::ConnParam::min_rnr_timer)
//!   is set at RTR, and until the connection is established the lane refuses sends (and RDMA
//!   and atomics) with an error that says so. Then [`Lane::peer_left`] (non-blocking) and
//!   [`Lane::disconnect`] (bounded) are one call each; see [`crate::cm::lane_conn`].
//! - **Memory windows and multicast**, each through an entry point of its own (the ordinary
//!   post is untouched): [`Lane::bind_window`] moves the region into the bind's slot and
//!   returns the bound window, [`Lane::invalidate_window`] and [`Lane::window_unbound`] take
//!   it back (see [`Invalidating`]); a [`McastEndpoint`](crate::cm::multicast::McastEndpoint) made with the
//!   lane's CQ is attached like any UD endpoint, and joins groups with
//!   [`Multicast::join_on`](crate::cm::multicast::Multicast::join_on).
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
//! use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion, QpInit};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = Client::new()?.resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?.resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut lane = Lane::new(&route.context()?, 64)?;
//! let client = route.lane_qp(&mut lane, &pd, QpInit::new())?;
//! let qp = client.qp();
//! let buf = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//! lane.post_recv(qp, RecvWr::new(buf).wr_id(1))?;    // before the connect: in place in time
//! client.connect(&mut lane, &ConnParam::new(), t)?;
//! let msg = MemoryRegion::new(&pd, 64, AccessFlags::empty())?;
//! lane.post_send(qp, SendWr::send(msg, 0..64).wr_id(2))?;
//! loop {
//!     let mut c = lane.wait(t)?.ok()?;       // sleeps until one comes; a failed one is an error
//!     let region = c.take_region();          // the buffer, back in our hands
//!     if c.wr_id() == 1 { break }
//! #   drop(region);
//! }
//! lane.disconnect(qp, t)?;
//! # Ok(()) }
//! ```
//!
//! # Waiting
//!
//! [`Lane::poll`] and [`Lane::poll_with`] never wait. Three waits do, each bounded by its
//! timeout ([`FOREVER`](crate::FOREVER) for none), and each with a `_with(max, f)` form that
//! hands up to `max` completions to a closure as `poll_with` does (to reap a burst without a
//! [`Completion`] each), beside the plain form that returns one `Completion` as `poll` does.
//! **[`Lane::wait`] is the one to start with**: it sleeps in the kernel on the CQ's completion
//! channel while nothing comes, so an idle lane costs no CPU, and only a wait that finds the
//! CQ empty pays for sleeping (arming the CQ, then `poll(2)` and reading the event: a few
//! system calls and a wake-up, microseconds); use it for servers, control messages, anything
//! that idles. [`Lane::spin`] polls without sleeping: it sees a completion within a poll of its
//! arrival, and burns its core for as long as it waits; use it only on a core given to the
//! lane when the last microseconds of latency matter (a latency benchmark's ping-pong).
//! `Lane::wait_async` (feature `tokio`) is `wait` for a lane driven from a tokio task: it
//! sleeps on the runtime's reactor instead of blocking the thread. All three end with
//! [`Error::Timeout`] when nothing came, with [`Error::QpInError`] naming a QP the device put
//! in the error state with no completion of its own saying why (found when the wait runs out,
//! or at once when the device reports it with a fatal event, as `IBV_EVENT_QP_FATAL`), and
//! with [`Error::AsyncEvent`] once the CQ overran or the device failed.
//!
//! A thread that waits on other things too (CM events, sockets, several lanes) waits on the
//! lane's CQ in its own loop instead: [`Lane::cq`] goes into a
//! [`Readiness`](crate::Readiness) set (or any `poll(2)`/`epoll` loop, by its descriptor), and
//! [`Lane::arm`] makes it readable at the next completion. Arm, poll until [`Lane::poll`]
//! returns `None`, wait, and when it is ready arm and poll again: a completion that came
//! before the arming raises no event, and the poll after it finds that one.
//!
//! # Why it is sound
//!
//! - **The device never writes memory Rust code can reach.** While a work request is posted,
//!   its region sits in the lane's slot table, and the lane offers no way to reach it: the
//!   caller gave up its only handle when it moved the region in. (A region's handle is unique:
//!   [`MemoryRegion`](crate::MemoryRegion) is not `Clone`.) The slot gives the region back only with the completion
//!   that retires it.
//!   Using a region after posting it does not compile: it moved into the lane.
//!
//!   ```compile_fail,E0382
//!   # fn f(lane: &mut rdma_cm::verbs::lane::Lane, qp: rdma_cm::verbs::lane::LaneQp, mut mr: rdma_cm::MemoryRegion) {
//!   lane.post_recv(qp, rdma_cm::verbs::lane::RecvWr::new(mr)).unwrap();
//!   let bytes = mr.as_slice(); // the device may be writing it: error[E0382], use of moved value
//!   # }
//!   ```
//!
//!   A prepared request ([`PreparedSend`], [`PreparedRecv`], [`PreparedBatch`]) was checked
//!   against its one region, and hands out no `&mut MemoryRegion` through which another could
//!   be swapped in (its bytes are reached through its own `as_mut_slice`, `write_at` and the
//!   like):
//!
//!   ```compile_fail,E0599
//!   # fn f(p: &mut rdma_cm::verbs::lane::PreparedRecv, other: &mut rdma_cm::MemoryRegion) {
//!   std::mem::swap(p.region_mut().unwrap(), other); // error[E0599]: no method `region_mut`
//!   # }
//!   ```
//! - **No memory is freed under the device.** A region leaves a slot only (a) with its
//!   completion, (b) when a later signaled completion of the same RC or UD queue retires it
//!   (queues complete in order), (c) when the provider said it did not take the work request
//!   (`bad_wr` pointing into the list), or (d) when its QP was destroyed successfully. (A post
//!   moves a region into its slot just before the provider's call, and takes it back only when
//!   the provider names that request as refused; a list whose later entry fails its checks
//!   takes the ones moved so far back before any call.) A post
//!   that fails without saying how far it got keeps every region and moves the QP to the error
//!   state, so the flush retires them.
//! - **`mem::forget` is safe.** Forgetting the lane, a [`Completion`] or a work request leaks
//!   regions, and leaking is safe. The slots, not the caller, own what the device may touch.
//! - **Dropping** a lane (or [`Lane::remove`] of one QP) moves each QP to the error state,
//!   reaps the flushed completions for up to 2 s, and then destroys the QP. Regions still in
//!   slots after that (work requests whose completion never came: unsignaled ones that ran
//!   before the error, or receives rxe never flushes) are handed to the QP just before it is
//!   destroyed, so they are released only when `ibv_destroy_qp` succeeds, and leaked when it
//!   fails.
//! - **No completion is lost.** The lane is the only reader of its CQ: nothing else in the
//!   crate polls a CQ, and a QP made with [`Lane::qp_init`] and never attached has no way to
//!   post, so it puts nothing there. A poll
//!   holds what it took from the CQ in the lane until it has been handed out, so a panic in
//!   the caller between two polls loses nothing. Completions that another QP's teardown reaps
//!   are kept, in order, for the next poll.
//! - **Stale completions retire nothing.** Each `wr_id` the lane posts names the QP's place
//!   in the lane, its queue, and a 45-bit sequence number. A place's sequence numbers continue
//!   across the QPs attached there (the lane keeps, per place and queue, the next one, and a
//!   new QP at the place starts its slots there), so every tag the lane posts at a place is
//!   new until 2^45 postings there. A completion is taken only when its sequence number is in
//!   its queue's window of outstanding work: a completion of a QP removed from the lane (or of
//!   any earlier QP at the place) names a number before the window, and so does one the
//!   device hands out twice (its slot retired the first time); either retires nothing, and
//!   says nothing of the QP's state. (The window is at most the queue's depth, and completions
//!   come out of the CQ in order, so a stale one is met long before its number could come
//!   round again.) The QP number must match too. Handles and prepared work requests name
//!   their QP by an attach number drawn from one process-wide `u64` count, never reused, so
//!   no handle, prepared work request or batch of an earlier QP (of this lane or another) is
//!   taken for a later one's.
//! - **A batch's region is held until the device is done with all of it.** It sits in the
//!   batch's first slot until the completion of the batch's *last* request, which the queue
//!   delivers after every earlier one ran (or was flushed: a failure moves the QP to the error
//!   state, so the last request always completes). The other requests' completions (failures
//!   and flushes only; they are unsignaled) carry an interior tag, which retires nothing. A batch the provider took only part of keeps its region until the flush of the
//!   last request taken, or, when none comes, until its QP is destroyed.
//! - **A prepared work request posts only what it was checked for.** It names its QP by
//!   handle (place and attach number), so it is refused once that QP is removed and by any
//!   other lane; it takes back only the region it was checked against (recognised by the
//!   region's number, unique in the process and never reused, unlike an address); while it is
//!   posted it holds no region, so posting it twice, or reaching its memory, is refused.
//!
//! # Limits of this version
//!
//! A scatter/gather list names pieces of one region: a send-queue work request gathers them
//! ([`SendWr::send_sg`], [`SendWr::write_sg`], [`SendWr::read_sg`]), and a receive scatters
//! the message over them in order, filling each before the next ([`RecvWr::scatter`]; on UD
//! the first piece holds the 40-byte GRH whole). A scattered receive is posted on its own
//! ([`Lane::post_recv`], or [`Lane::post_srq_recv`] on an SRQ made with
//! [`Lane::create_srq_with_sge`]), up to the QP's
//! [`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge) pieces; the lists
//! ([`Lane::post_recv_list`], [`Lane::post_srq_recv_list`]) and prepared receives
//! ([`Lane::prepare_recv`]) refuse it and take receives of one piece. A connection
//! attached once established ([`Lane::attach`] of a [`Connection`](crate::Connection)) gets its
//! first receives after the peer may have sent: such a send is NAKed and waits for the
//! receiving QP's minimum RNR timer, which the CM sets to 655 ms (measured: one such wait
//! halved the rate of a stream of 10,000 sends). Attach before the connect instead
//! ([`crate::cm::lane_conn`]).

use std::collections::VecDeque;
use std::fmt;
use std::mem::{self, MaybeUninit};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::ah::UdDest;
use crate::verbs::cq::CompletionQueue;
use crate::verbs::device::VerbsContext;
use crate::verbs::hold::Hold;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::connect::KnownError;
use crate::verbs::qp::{QpInit, QueuePair};

mod batch;
pub(crate) mod completion;
mod grow;
mod inline;
mod lifecycle;
mod mw;
mod ops;
mod owner;
mod poll;
mod post;
mod prepared;
mod refused;
mod slots;
pub mod srq;
mod tag;
mod teardown;
mod wait;
mod wr;

pub use batch::PreparedBatch;
pub use completion::{Completion, Wc};
use completion::{Fields, RECV, SIGNALED};
pub use inline::InlineWr;
pub use mw::{BindWr, Invalidating};
pub(crate) use owner::Sealed;
pub use owner::{LaneEvent, LaneOwner};
pub use prepared::{PreparedRecv, PreparedSend};
pub use refused::{Rejected, RejectedList};
use slots::Slots;
pub use srq::LaneSrq;
pub use wr::{RecvWr, SendWr};

/// The most work requests one [`Lane::post_send_list`] or [`Lane::post_recv_list`] posts: one
/// `ibv_post_*` call, one doorbell.
pub const MAX_LIST: usize = 16;

/// Completions taken from the CQ per `ibv_poll_cq`.
const POLL_BATCH: usize = 16;

/// How long teardown waits for flushed completions before destroying a QP anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// A QP attached to a lane: its place there, and the number of its attach. Cheap to copy;
/// meaningful only to the lane that gave it (another lane, or this one after [`Lane::remove`],
/// refuses it).
#[derive(Clone, Copy, Debug)]
pub struct LaneQp {
    place: u16,
    /// The number of the attach that made it: drawn from one process-wide count, never reused,
    /// so no other attach (at any place of any lane) has it.
    attach: u64,
}

impl PartialEq for LaneQp {
    /// By the attach's number alone, which names the place too: one compare.
    #[inline(always)]
    fn eq(&self, other: &LaneQp) -> bool {
        self.attach == other.attach
    }
}

impl Eq for LaneQp {}

impl std::hash::Hash for LaneQp {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.attach.hash(h)
    }
}

/// The numbers attaches are given, one each, in every lane of the process. A `u64` counted up
/// by one per attach never wraps (an attach creates a QP: at a million a second, 584,000
/// years).
static NEXT_ATTACH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Why a member's QP can run nothing more: posts are refused with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// A completion of it failed with this status, or came flushed.
    Completion(u32),
    /// The lane moved it to the error state ([`Lane::set_error`], or a post the provider
    /// failed without saying which work requests it took).
    Moved,
    /// The peer disconnected.
    PeerLeft,
    /// It was in the error state when it was attached, as its own path knew (moved there,
    /// its connection gone, or a completion that failed there).
    BeforeAttach(KnownError),
    /// A lane's wait that ran out found it in the error state with no completion of its own
    /// saying why (on RC, the peer's RDMA access with a bad rkey does this to the responder).
    Silent,
    /// Not a failure: its connection is not established yet (attached before connect or
    /// accept). Receives are taken, sends refused; the connect or accept clears it.
    Connecting,
    /// Its connect or accept failed (the QP was moved to the error state).
    ConnectFailed,
    /// The device reported this fatal event about it (or itself failed), as a lane's wait read.
    Async(crate::status::AsyncEventKind),
}

/// A UD destination registered with a lane for one of its QPs ([`Lane::add_dest`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DestKey {
    qp: LaneQp,
    index: u32,
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
    owner: Box<dyn LaneOwner>,
    raw: NonNull<ffi::ibv_qp>,
    /// The provider's post functions for it (`ops`), read once.
    post_send: ops::PostSend,
    post_recv: ops::PostRecv,
    qp_num: u32,
    /// Its handle: place and attach number (what `member` and a `DestKey` must match).
    key: LaneQp,
    pd: Arc<ProtectionDomain>,
    max_send_sge: u32,
    /// The most pieces an RDMA READ may scatter into (`max_sge_rd`, at most `max_send_sge`).
    max_read_sge: u32,
    /// The most pieces a receive may name (the QP's `max_recv_sge`; 0 on an SRQ).
    max_recv_sge: u32,
    /// The most bytes an inline send may carry (`max_inline_data` as the provider granted it).
    max_inline: u32,
    /// A UD QP's MTU (the largest datagram), 0 for RC.
    mtu: u32,
    /// Send flags every send-queue work request of it carries: `IBV_SEND_SIGNALED` on an
    /// iWARP device, 0 elsewhere. iWARP completes a send once its bytes are handed to the
    /// transport, which can be before an earlier RDMA READ's (or atomic's) response has been
    /// placed; so there no completion may retire an earlier slot, and every request is
    /// signaled, so that each slot retires with its own (`in_order`, in the poll).
    always_flags: u32,
    /// Why it is in the error state, once that is known (a completion failed or came flushed,
    /// the lane moved it there, its connection is gone, or it was found there): nothing posted
    /// now can run (and rxe never flushes a receive posted then).
    failed: Option<Fault>,
    /// The status and vendor error of the first failed completion of a batch's interior work
    /// request (not a flush): the batch's own completion, which comes next for this QP (a
    /// flush then), carries it.
    batch_error: Option<(u32, u32)>,
    /// A batch the provider took only part of (it named the first request it refused): the
    /// sequence number of its first slot, how many of its requests were posted, and its number
    /// (`PreparedBatch::number`). Its last posted request is an interior one, so that one's
    /// completion (a flush: the QP was moved to the error state) retires it.
    orphan: Option<(u64, u32, u64)>,
    /// The number the first batch prepared for this QP can have (`batch::NEXT_BATCH` when it
    /// was attached): an interior completion of a lower one is an earlier QP's at the place.
    batch_floor: u64,
    send: Slots,
    recv: Slots,
    dests: Vec<Dest>,
}

impl Member {
    fn is_ud(&self) -> bool {
        self.mtu != 0
    }

    /// Whether its completions retire their own slots only (iWARP: see `always_flags`).
    fn in_order(&self) -> bool {
        self.always_flags != 0
    }

    /// Whether an interior tag's batch (`tag::interior_parts`) is one of this QP's.
    fn owns_batch(&self, batch: u64) -> bool {
        tag::batch_at_or_after(batch, self.batch_floor)
    }

    /// When the interior request `index` of batch `batch` (as its tag carries them) is the last
    /// one posted of a batch the provider took only part of (`orphan`): the sequence number
    /// through which it retires.
    fn orphan_done(&mut self, batch: u64, index: u32) -> Option<u64> {
        let (first, posted, number) = self.orphan?;
        if tag::carried_batch(number) != batch || index + 1 != posted {
            return None;
        }
        self.orphan = None;
        Some(first.wrapping_add(posted as u64 - 1))
    }

    /// The fields of a batch's own completion: flushed after one of its interior requests
    /// failed, it carries that failure (taken: it was this batch's).
    fn batch_fields(&mut self, mut f: Fields) -> Fields {
        if let Some((status, vendor_err)) = self.batch_error.take() {
            if f.status == ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                (f.status, f.vendor_err) = (status, vendor_err);
            }
        }
        f
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
        self.record(Fault::Moved);
        Ok(())
    }
}

impl Drop for Member {
    /// Hands every region still in a slot, and a UD QP's address handles in use, to the QP
    /// ([`Parked`](crate::verbs::qp::Parked)): released after `ibv_destroy_qp` succeeds and
    /// leaked when it fails (`QueuePair`'s Drop), which is exactly when the device can no
    /// longer reach them.
    fn drop(&mut self) {
        let has_sends = self.send.outstanding() > 0;
        let sends = self.send.drain();
        let recvs = self.recv.drain();
        let qp = self.owner.lane_qp();
        let mut parked = qp.parked();
        parked.regions.extend(sends.chain(recvs).map(|mr| Hold::new(mr.inner(), false)));
        if has_sends && self.is_ud() {
            parked.ahs.extend(mem::take(&mut self.dests).into_iter().map(|d| Arc::clone(d.keep.ah())));
        }
    }
}

/// Where the poll stands in a completion that retires several slots.
#[derive(Clone, Copy)]
struct Retiring {
    place: u16,
    recv: bool,
    /// The sequence number (whole) the completion names (the last slot it retires).
    upto: u64,
    /// Its index in the poll buffer.
    wc: u8,
}

/// One thread's data path: a completion queue and the QPs that complete on it. See the
/// [module docs](self).
pub struct Lane {
    cq_raw: NonNull<ffi::ibv_cq>,
    /// The provider's `poll_cq` for it (`ops`), read once.
    poll_cq: ops::PollCq,
    /// Boxed: finding a place's member is then one load and a null test.
    members: Vec<Option<Box<Member>>>,
    /// Each place's next sequence numbers, of its send and its receive queue: kept across
    /// removals, so the QP attached there next continues them, and no tag of an earlier QP at
    /// the place is ever in its window (`Slots::holds`).
    next_seq: Vec<[u64; 2]>,
    /// Completions taken from the CQ and not yet handed out: `wcs[at..n]`.
    wcs: [MaybeUninit<ffi::ibv_wc>; POLL_BATCH],
    n: u8,
    at: u8,
    retiring: Option<Retiring>,
    /// True when anything is buffered, retiring or deferred (`holds_backlog`), so the poll's
    /// common case tests one flag; it may be true when nothing is (then the general loop runs
    /// once and clears it), never false when something is.
    backlog: bool,
    /// Completions reaped while another QP was torn down, in order: handed out first.
    deferred: VecDeque<ffi::ibv_wc>,
    /// Completions of an iWARP QP that came before an earlier slot's own (`Member::in_order`),
    /// in order: tried again, through `deferred`, once a completion has been handed out.
    held: VecDeque<ffi::ibv_wc>,
    /// Its shared receive queues (`srq`): dropped after the members (whose QPs take receives
    /// from them), before the CQ.
    srqs: srq::Srqs,
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
    /// hold what every attached QP may have outstanding: the sum of their queue depths
    /// ([`Lane::attach`] grows it where the device can resize a CQ; siw cannot).
    ///
    /// # Errors
    /// As for [`CompletionQueue::new`].
    pub fn new(ctx: &VerbsContext, depth: u32) -> Result<Lane> {
        let cq = CompletionQueue::new_exclusive(ctx, depth)?;
        let cq_raw = NonNull::new(cq.as_raw()).ok_or_else(|| Error::InvalidArgument("CQ without a handle".into()))?;
        // SAFETY: the CQ was just made, and `cq` (kept in the lane, dropped last) holds it.
        let poll_cq = unsafe { ops::poll_cq_of(cq_raw) }?;
        Ok(Lane {
            cq_raw,
            poll_cq,
            members: Vec::new(),
            next_seq: Vec::new(),
            wcs: [const { MaybeUninit::uninit() }; POLL_BATCH],
            n: 0,
            at: 0,
            retiring: None,
            backlog: false,
            deferred: VecDeque::with_capacity(depth as usize),
            held: VecDeque::new(),
            srqs: srq::Srqs::default(),
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

    /// Attaches a QP whose CQs are the lane's ([`Lane::qp_init`]) with what owns it: an RC
    /// [`Connection`](crate::Connection) or a [`QueuePair`] brought to RTS without the CM
    /// ([`UnconnectedQp::connect`](crate::verbs::qp::UnconnectedQp::connect)), a UD
    /// [`UdEndpoint`](crate::cm::ud_cm::UdEndpoint) or [`UdQp`](crate::verbs::ud::UdQp). From now on its work goes
    /// through the lane, and the lane owns it (until [`Lane::remove`] or the lane's drop).
    ///
    /// A QP already in the error state (its own path saw a completion fail, found it there, or
    /// moved it there; its connection is gone; or the device says so) is attached with that
    /// failure: the lane refuses its posts with the cause ([`Error::QpInError`]), since nothing
    /// posted to it can run.
    ///
    /// A CQ with no room for its queues is grown first (`ibv_resize_cq`), keeping its completions.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (the owner given back) when the CQ has no room for its
    /// queues and cannot grow (the message says what depth the lane needs), when its QP completes on another CQ,
    /// takes receives from an SRQ that is not this lane's ([`Lane::create_srq`]),.
    pub fn attach<T: LaneOwner>(&mut self, owner: T) -> std::result::Result<LaneQp, Rejected<T>> {
        match self.check_attach(owner.lane_qp()).and_then(|()| self.make_room()) {
            Ok(()) => {}
            Err(e) => return Err(Rejected::new(e, owner)),
        }
        let mtu = owner.lane_ud_mtu().map_or(0, |m| m.max(1));
        let (srq, qp_num) = (self.srqs.of(owner.lane_qp()), owner.lane_qp().qp_num());
        let key = self.attach_checked(Box::new(owner), mtu).map_err(|(e, o)| {
            let back = o.into_any().downcast::<T>().ok().map(|b| *b);
            Rejected::with(e, back)
        })?;
        if let Some(Ok(index)) = srq {
            self.srqs.joined(index, qp_num, key);
        }
        Ok(key)
    }

    /// What `attach` refuses, checked on the QP before the owner is boxed.
    fn check_attach(&self, qp: &QueuePair) -> Result<()> {
        if !Arc::ptr_eq(qp.send_cq(), &self.cq) || !Arc::ptr_eq(qp.recv_cq(), &self.cq) {
            return Err(Error::InvalidArgument(
                "attach: the QP completes on another CQ than the lane's: create it with Lane::qp_init".into(),
            ));
        }
        if let Some(Err(())) = self.srqs.of(qp) {
            return Err(Error::InvalidArgument(
                "attach: the QP takes its receives from an SRQ that is not this lane's: make it with \
                 Lane::srq_qp_init of a Lane::create_srq"
                    .into(),
            ));
        }
        if qp.as_raw().is_null() {
            return Err(Error::InvalidArgument("attach: QP without a handle".into()));
        }
        Ok(())
    }

    #[allow(clippy::type_complexity)]
    fn attach_checked(
        &mut self,
        owner: Box<dyn LaneOwner>,
        mtu: u32,
    ) -> std::result::Result<LaneQp, (Error, Box<dyn LaneOwner>)> {
        let qp = owner.lane_qp();
        let (send_depth, recv_depth) = (qp.send_depth(), qp.recv_depth());
        let Some(raw) = NonNull::new(qp.as_raw()) else {
            return Err((Error::InvalidArgument("attach: QP without a handle".into()), owner));
        };
        let iwarp = qp.pd().context().transport() == crate::verbs::device::Transport::Iwarp;
        // SAFETY: `raw` is the live QP of `owner`, which the member keeps (dropped with it).
        let (post_send, post_recv) = match unsafe { ops::post_of(raw, iwarp) } {
            Ok(f) => f,
            Err(e) => return Err((e, owner)),
        };
        // What the QP's own path knows of it being in the error state; else the device's word
        // (a QP there with nothing saying why takes receives that never complete).
        let failed = match qp.known_error() {
            Some(k) => Some(Fault::BeforeAttach(k)),
            None => match qp.state() {
                Ok(crate::status::QpState::Error) => Some(Fault::Silent),
                // Attached before its connection exists: receives only, until it does.
                _ if !owner.lane_connected() => Some(Fault::Connecting),
                _ => None,
            },
        };
        let place = match self.members.iter().position(Option::is_none) {
            Some(p) => p,
            None if self.members.len() <= u16::MAX as usize => {
                self.members.push(None);
                self.next_seq.push([0, 0]);
                self.members.len() - 1
            }
            None => return Err((Error::InvalidArgument("attach: a lane serves at most 65536 QPs".into()), owner)),
        };
        let attach = NEXT_ATTACH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = LaneQp { attach, place: place as u16 };
        // The place's sequence numbers continue where its last QP's stopped.
        let [send_seq, recv_seq] = self.next_seq[place];
        let m = Member {
            key,
            raw,
            post_send,
            post_recv,
            qp_num: qp.qp_num(),
            pd: Arc::clone(qp.pd()),
            max_send_sge: qp.max_send_sge(),
            max_read_sge: qp.max_read_sge(),
            max_recv_sge: qp.max_recv_sge(),
            max_inline: qp.max_inline_data(),
            mtu,
            always_flags: if iwarp { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 },
            failed,
            batch_error: None,
            orphan: None,
            batch_floor: batch::NEXT_BATCH.load(std::sync::atomic::Ordering::Relaxed),
            send: Slots::new(send_depth, tag::queue_hi(place as u16, false), send_seq),
            recv: Slots::new(recv_depth, tag::queue_hi(place as u16, true), recv_seq),
            dests: Vec::new(),
            owner,
        };
        if m.in_order() {
            // Room for every completion it may have held, so that a poll never allocates.
            // (`reserve` counts from the length: this adds the QP's depth to the room there is.)
            self.held.reserve(self.held.capacity() - self.held.len() + send_depth as usize);
        }
        self.members[place] = Some(Box::new(m));
        Ok(key)
    }

    #[inline(always)]
    fn member(&mut self, qp: LaneQp) -> Result<&mut Member> {
        match self.members.get_mut(qp.place as usize) {
            Some(Some(m)) if m.key.attach == qp.attach => Ok(m),
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
    /// such work completes on the lane's CQ, so its `wr_id` must have bit 62 set, which the
    /// lane never sets (a completion with it is not the lane's, and its poll discards it), and
    /// its memory is the caller's to keep alive until then.
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
}

#[cfg(test)]
mod tests {
    use super::wr::piece;

    #[test]
    fn pieces_refuse_reversed_and_huge_ranges() {
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 5..4;
        assert!(piece(&reversed).is_err());
        assert_eq!(piece(&(4..10)), Ok((4, 6)));
        assert!(piece(&(0..(u32::MAX as usize + 1))).is_err());
    }
}
