//! The verbs wing: devices, protection domains, memory regions, completion queues, shared
//! receive queues, queue pairs, address handles and work requests (libibverbs). Nothing here
//! imports the connection manager ([`crate::cm`]), which stands on top of it.
//!
//! The data path is the [`lane`]: one thread's completion queue and the QPs on it, with work
//! requests that move their regions in and completions that hand them back. Every post and
//! poll goes through a lane; the sections below are about the objects themselves.
//!
//! # Verbs without the connection manager
//!
//! An RC QP can be made on a protection domain alone and connected from the peer's
//! [`PeerInfo`](crate::verbs::peer::PeerInfo) (QP number, PSN, LID or GID), exchanged by any means:
//! [`UnconnectedQp`](crate::verbs::qp::UnconnectedQp) is in INIT;
//! [`UnconnectedQp::connect`](crate::verbs::qp::UnconnectedQp::connect) moves it to RTR and RTS and hands
//! back the [`QueuePair`](crate::QueuePair), which a lane takes to post on it. A UD QP comes
//! from a port and a Q_Key ([`UdQp::new`](crate::verbs::ud::UdQp::new)). [`PeerInfo`](crate::verbs::peer::PeerInfo)
//! speaks rdma-core's pingpong wire form; `examples/rc_pingpong`, `ud_pingpong` and
//! `srq_pingpong` interoperate with `ibv_rc_pingpong`, `ibv_ud_pingpong` and
//! `ibv_srq_pingpong`. See [`qp::connect`].
//!
//! ```no_run
//! use rdma_cm::verbs::lane::{Lane, RecvWr};
//! use rdma_cm::{devices, AccessFlags, MemoryRegion, ProtectionDomain, VerbsContext};
//! use rdma_cm::verbs::qp::{RcParams, UnconnectedQp};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! # let peer_info = |_: rdma_cm::verbs::peer::PeerInfo| -> rdma_cm::verbs::peer::PeerInfo { unimplemented!() };
//! let ctx = VerbsContext::open(&devices()?[0].name)?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let mut lane = Lane::new(&ctx, 64)?;
//! let qp = UnconnectedQp::new(&pd, lane.qp_init(), RcParams::new().gid_index(1))?;
//! let theirs = peer_info(qp.local()); // send ours, receive theirs: TCP, a file, anything
//! let qp = lane.attach(qp.connect(&theirs)?)?; // RTR, RTS; the lane posts on it
//! lane.post_recv(qp, RecvWr::new(MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?))?;
//! # Ok(()) }
//! ```
//!
//! # Ownership and cleanup
//!
//! Children hold an `Arc` of what they depend on:
//!
//! ```text
//! Connection ─► QueuePair ─► CmId ─► EventChannel
//!                   ├──────► CompletionQueue ─► VerbsContext ─► (librdmacm's device list,
//!                   ├──────► SharedReceiveQueue ─► ProtectionDomain         or the opened device)
//!                   └──────► ProtectionDomain ─► VerbsContext
//! MemoryRegion ─► ProtectionDomain
//! AddressHandle ─► ProtectionDomain
//! UdEndpoint ─► UdQp ─► QueuePair (as above; its send slots hold the AddressHandles in use)
//! ```
//!
//! so whatever order values are dropped in, each C object is destroyed after everything that
//! uses it: QP before CQs, SRQ, PD and id; MR before PD; id before channel. The verbs layer
//! ([`device`], [`pd`], [`mr`], [`cq`], [`srq`], [`qp`]) knows nothing of connection
//! management: a QP made through `rdma_create_qp` holds its id through a link the connection
//! layer gives it.
//!
//! # Many connections
//!
//! One lane's CQ serves any number of QPs, and one of its shared receive queues
//! ([`Lane::create_srq`](crate::verbs::lane::Lane::create_srq)) the receives of any number of
//! them. Every `wr_id` a lane posts names its QP's place in the lane, so its poll retires each
//! completion's slot in O(1), without allocating; a completion of a QP that is gone retires
//! nothing. A CQ counts what its queues may have outstanding: the lane grows its CQ when it
//! attaches a QP it has no room for. One [`EventChannel`](crate::EventChannel) may carry every
//! connection's events: the event loop reads them
//! ([`EventChannel::get_event`](crate::EventChannel::get_event)) and hands each to its
//! connection ([`Lane::handle_event`](crate::verbs::lane::Lane::handle_event)), or each blocking
//! step reads its own ([`EventChannel::get_event_for`](crate::EventChannel::get_event_for)).
//! `examples/perftest/server.rs --shared` (`perf_server`) serves all its clients that way from
//! one thread; `examples/cmtime.rs` pipelines the setup of many. `Drop` never panics; when a
//! destroy call fails it prints one line to stderr and leaks the object (and any memory the
//! device might still reach). [`Lane::disconnect`](crate::verbs::lane::Lane::disconnect) and
//! [`ProtectionDomain::close`](crate::ProtectionDomain::close) return errors to callers who want
//! them.
//!
//! # Soundness
//!
//! Posting moves the [`MemoryRegion`](crate::MemoryRegion) into the lane's slot table; the
//! completion hands it back. What is guaranteed, exactly (the lane's docs argue each point):
//!
//! - no safe call lets the device write memory that Rust code can reach through a reference: a
//!   posted region has no handle outside the lane;
//! - no memory is freed or reused while the device may use it, even through `mem::forget` or a
//!   panic (forgetting leaks, which is safe), nor when a post fails without saying which work
//!   requests the provider took;
//! - a completion retires only the work request it names: sequence numbers are never reused,
//!   completions of other QPs and of raw posts are recognised and retire nothing, and none is
//!   lost;
//! - remotely writable regions never hand out slices (a peer may write them at any time); they
//!   are copied with volatile accesses. Regions a peer may only *read* are handed out as slices:
//!   the peer may see a buffer while Rust writes it, which is no memory-safety issue.
//!
//! A UD send also holds its [`AddressHandle`](crate::verbs::ah::AddressHandle) until its slot is retired,
//! so the handle outlives every send that names it, however the caller drops it (see [`ud`]).
//!
//! A bound [`MemoryWindow`](crate::verbs::mw::MemoryWindow) ([`BoundWindow`](crate::verbs::mw::BoundWindow)) holds its
//! whole region, as a writer when it grants remote writes, until it is unbound or dropped; an
//! invalidation holds the region until its completion (see [`verbs::mw`](crate::verbs::mw)).
//!
//! [`QueuePair::as_raw`](crate::QueuePair::as_raw) and [`ffi`](crate::ffi) remain for experts.
//! Post and poll make no heap allocation.
//!
//! # Thread safety
//!
//! | type | Send | Sync | why |
//! |---|---|---|---|
//! | [`EventChannel`](crate::EventChannel), [`CmId`](crate::CmId), [`VerbsContext`](crate::VerbsContext) | yes | yes | librdmacm/libibverbs calls on them are thread-safe |
//! | [`ProtectionDomain`](crate::ProtectionDomain), [`CompletionQueue`](crate::CompletionQueue), [`SharedReceiveQueue`](crate::SharedReceiveQueue) | yes | yes | thread-safe verbs through `&self`; a CQ's counts are behind a mutex |
//! | [`MemoryRegion`](crate::MemoryRegion) | yes | yes | bytes only through `&mut self` with a unique handle |
//! | [`AsyncEvents`](crate::verbs::async_event::AsyncEvents) | yes | yes | reads through `&mut self`; the context's registry and event log are behind a mutex |
//! | [`AddressHandle`](crate::verbs::ah::AddressHandle) | yes | yes | immutable once made; shared by the sends that use it |
//! | [`UdQp`](crate::verbs::ud::UdQp), [`UdEndpoint`](crate::cm::ud_cm::UdEndpoint) | yes | no | as [`QueuePair`](crate::QueuePair) |
//! | [`QueuePair`](crate::QueuePair), [`UnconnectedQp`](crate::verbs::qp::UnconnectedQp), [`Connection`](crate::Connection) | yes | no | changing the QP's state needs `&mut self` |
//! | [`Lane`](crate::verbs::lane::Lane) | yes | no | posting and polling need `&mut self`: one thread drives a lane, with no lock |
//!
//! A server of many connections runs one lane per thread, each with its QPs.
//!
//! Ids may share an [`EventChannel`](crate::EventChannel) across threads. Every read of a channel happens under its
//! lock, and each blocking step takes only its own id's events, keeping the others, in order,
//! for their owners ([`EventChannel::get_event_for`](crate::EventChannel::get_event_for)); the untargeted reads
//! ([`EventChannel::get_event`](crate::EventChannel::get_event)) return what is kept first and leave alone the events a
//! targeted wait is waiting for. The same lock serialises QP creation and destruction with the
//! event processing inside `rdma_get_cm_event`, which touches the id's QP. A connection watches
//! its id's events for the peer leaving only while nothing else holds the channel; on a shared
//! channel, whoever reads the events feeds them to it ([`Connection::handle_event`](crate::Connection::handle_event), or its own
//! [`Connection::next_event`](crate::Connection::next_event)).
//!

pub mod ah;
pub mod async_event;
pub mod buffer;
pub mod cq;
pub mod device;
pub mod diagnostics;
pub mod fork;
pub(crate) mod hold;
pub(crate) mod hub;
pub mod lane;
pub(crate) mod link;
pub mod mr;
pub mod mw;
pub mod odp;
mod odp_caps;
pub mod pd;
pub mod peer;
pub mod port;
pub mod qp;
pub(crate) mod qp_attr;
pub mod srq;
pub mod ud;
pub mod wr;
