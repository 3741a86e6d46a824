//! # rdma-cm
//!
//! A safe, RAII wrapper over RDMA connection management (librdmacm) and verbs (libibverbs),
//! built on [`rdma-sys`](ffi). It runs the whole rdma_cm sequence of the classic
//! `rdma_cm_c.c`/`rdma_cm_s.c` teaching pair (resolve, bind/listen, connect/accept, register,
//! create the QP, exchange `qp_info` in the private data, send and receive, clean up) as owned
//! types whose drop order is always valid, and typestates that make an out-of-order call a
//! compile error.
//!
//! ## Quick start
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
//! use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion, QpInit};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = Client::new()?
//!     .resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?
//!     .resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut lane = Lane::new(&route.context()?, 64)?;           // one CQ, driven by this thread
//! let client = route.lane_qp(&mut lane, &pd, QpInit::new())?; // the QP joins the lane
//! let qp = client.qp();
//! let inbox = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//! lane.post_recv(qp, RecvWr::new(inbox).wr_id(1))?;           // before connect: ready in time
//! client.connect(&mut lane, &ConnParam::new(), t)?;
//! let mut msg = MemoryRegion::new(&pd, 64, AccessFlags::empty())?;
//! msg.write_at(0, b"hello")?;
//! lane.post_send(qp, SendWr::send(msg, 0..64).wr_id(2))?;     // `msg` moved: using it won't compile
//! loop {
//!     let mut c = lane.wait(t)?.ok()?;                         // sleeps; a failed completion is an error
//!     if c.wr_id() == 1 {
//!         let mut inbox = c.take_region().unwrap();            // back with its completion
//!         println!("{:?}", &inbox.as_slice()?[..c.byte_len() as usize]);
//!         break;
//!     }                                                        // the send's region drops with `c`
//! }
//! lane.disconnect(qp, t)
//! # }
//! ```
//!
//! ## Posting and reaping
//!
//! Data moves through a [`Lane`]: one thread owns a completion queue and the queue pairs that
//! complete on it (a connection's QP joins it before the connect or accept, with
//! [`RouteResolved::lane_qp`] or [`ConnectRequest::lane_qp`]). Posting a work request
//! ([`Lane::post_send`], [`Lane::post_recv`], with a [`SendWr`](verbs::lane::SendWr) or
//! [`RecvWr`](verbs::lane::RecvWr)) *moves* its [`MemoryRegion`] into the lane, and the
//! completion that retires it hands the region back ([`Lane::wait`] sleeps until the next
//! completion, [`Lane::spin`] busy-polls for it, `Lane::wait_async` awaits it under tokio,
//! [`Lane::poll`] takes one if it is there; [`Completion::take_region`](verbs::lane::Completion::take_region)
//! returns the region). While the device may use a region no Rust code holds it, and nothing
//! (`mem::forget`, a panic, a drop in any order) frees it under the device. A buffer posted
//! again and again is prepared once ([`Lane::prepare_send`], [`Lane::post_prepared`]), and
//! several requests over one buffer go as one batch ([`Lane::prepare_batch`]). Post and poll
//! take no lock, allocate nothing and count no references: they cost what the raw verbs do
//! (BENCHMARKS.md). [`verbs::lane`] says why each case is sound, and which wait fits where.
//!
//! ## The connection state machine
//!
//! ```text
//!  client                                         server
//!  Client::new            (rdma_create_id)        Server::new          (rdma_create_id)
//!   │ resolve_addr  → ADDR_RESOLVED               │ bind               (rdma_bind_addr)
//!  AddrResolved                                   Bound
//!   │ resolve_route → ROUTE_RESOLVED              │ listen             (rdma_listen)
//!  RouteResolved  ── alloc_pd, Lane::new          Listener
//!   │ lane_qp       (rdma_create_qp, in RESET)    │ get_request   → CONNECT_REQUEST
//!  LaneClient     ── lane.post_recv               ConnectRequest ── alloc_pd, Lane::new
//!   │ connect       → ESTABLISHED                  │ lane_qp / reject
//!   │             ◄──────────── RC ────────────►  LaneServer     ── lane.post_recv
//!   │ lane.post_send, lane.wait                    │ accept        → ESTABLISHED
//!   ▼ lane.disconnect → DISCONNECTED               ▼ lane.post_send, lane.wait
//! ```
//!
//! Any other event where one is expected (`REJECTED`, `UNREACHABLE`, `ADDR_ERROR`, …) becomes
//! [`Error::UnexpectedEvent`] naming what arrived, with the usual cause. Every wait is bounded.
//! [`Lane::peer_left`] says, without blocking, whether the peer disconnected. Event loops over
//! many connections, UD through the CM and multicast: [`cm`]. Verbs without the CM, the
//! ownership graph, shared CQs and thread safety: [`verbs`].
//!
//! ## Where things are
//!
//! Two wings on a small common floor, every import pointing down: [`cm`] (librdmacm: ids,
//! channels, the client and server typestates, connections, UD and multicast) stands on
//! [`verbs`] (libibverbs alone: devices, PDs, regions, CQs, QPs, SRQs, the [`verbs::lane`]).
//! Below both: [`error`] ([`Error`], which names the call, the errno and the usual cause),
//! [`status`] (the plain values: [`WcStatus`], [`QpState`], [`CmEventType`], ...), and
//! [`ready`] (one `poll(2)` over descriptors of both wings). The types of the connection and
//! the data path are re-exported here; each feature beside them is used from its module:
//! UD through the CM ([`cm::ud_cm`]), multicast ([`cm::multicast`]), datagrams and address
//! handles ([`verbs::ud`], [`verbs::ah`]), memory windows ([`verbs::mw`]), on-demand paging
//! ([`verbs::odp`]), ports and GIDs ([`verbs::port`]), device events ([`verbs::async_event`]),
//! verbs without the CM ([`verbs::qp::UnconnectedQp`], [`verbs::peer`]). [`ffi`] is the raw
//! bindings, for experts.
//!
//! Every object holds an `Arc` of what it depends on, so whatever order values are dropped in,
//! each C object is destroyed after everything that uses it: QP before CQ, SRQ, PD and id;
//! region before PD; id before channel. `Drop` never panics; when a destroy call fails it
//! prints one line to stderr and leaks the object (and any memory the device might still reach).
//!
//! With the `tokio` feature (off by default), every blocking step of the connection has an
//! `_async` twin, and the lane has `Lane::wait_async`; dropping any of these futures is safe.
//!
//! ## Troubleshooting
//!
//! | symptom | likely cause | check |
//! |---|---|---|
//! | `NoDevice` / `ENODEV` | no RDMA driver, or no device on that address | `rdma link`, `ibv_devices`; `modprobe rdma_rxe` and `rdma link add rxe0 type rxe netdev eth0` for Soft-RoCE |
//! | `rdma_resolve_addr … ETIMEDOUT` / `ADDR_ERROR` | netdev down, port not ACTIVE, no GID for the IP | `ip link`, `rdma link`, `ibv_devinfo -v` (GID table) |
//! | `REJECTED` (status 8) | nobody listens on that port | server running? right `-p`? |
//! | `UNREACHABLE` | the CM packets do not get through | route, MTU, UDP 4791 (RoCEv2) filtered? |
//! | `MemLock` / `ENOMEM` on `ibv_reg_mr` | locked-memory limit | `ulimit -l` |
//! | `/dev/infiniband/rdma_cm` missing | `rdma_ucm` not loaded | `modprobe rdma_ucm`, permissions |
//! | `RNR_RETRY_EXC_ERR` | the peer posted no receive | post receives before connecting |
//! | `RETRY_EXC_ERR` | the peer vanished or the link is down | `rdma link` on both sides |
//!
//! ## What you need installed
//!
//! Debian/Ubuntu: `libibverbs-dev librdmacm-dev libclang-dev pkg-config` to build (the bindings,
//! `rdma-cm-sys`, run bindgen with the newest libclang installed unless `LIBCLANG_PATH` names
//! another; 14 through 19 work), and `rdma-core ibverbs-providers` plus a device (a NIC, or
//! Soft-RoCE `rdma_rxe`) to run.

#![deny(missing_docs)]
#![deny(missing_debug_implementations)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod cm;
pub mod error;
pub mod ready;
pub mod status;
#[cfg(feature = "stream")]
pub mod stream;
pub mod verbs;
mod wait;

pub use rdma_sys as ffi;

pub use cm::addrinfo::{lookup, lookup_passive};
pub use cm::client::{AddrResolved, Client, ClientQp, Connecting, ResolvingAddr, ResolvingRoute, RouteResolved};
pub use cm::cm_id::{CmId, IdHandle};
pub use cm::conn_param::ConnParam;
pub use cm::connection::{Connection, Disconnecting};
pub use cm::event_channel::{CmEvent, CmEventType, EventChannel, PrivateData};
pub use cm::lane_conn::{LaneClient, LaneServer};
pub use cm::private_data::QpInfo;
pub use cm::server::{Accepting, Bound, ConnectRequest, Listener, Server, ServerQp};
pub use cm::step::StepError;
pub use error::{Error, Result};
pub use ready::{Readiness, Ready};
pub use verbs::buffer::{Mapping, StableBuffer, HUGE_PAGE_SIZE};
pub use verbs::cq::{CompletionQueue, WcOpcode, WcStatus, WorkQueue};
pub use verbs::device::{devices, Device, DeviceLimits, Transport, VerbsContext};
pub use verbs::lane::{Lane, LaneQp};
pub use verbs::mr::{AccessFlags, IntoBufferError, MemoryRegion, RemoteRegion};
pub use verbs::pd::ProtectionDomain;
pub use verbs::qp::{QpInit, QueuePair};
pub use verbs::qp_attr::{QpAttributes, QpState};
pub use verbs::srq::SharedReceiveQueue;
pub use verbs::wr::MAX_SGE;
pub use wait::FOREVER;

/// Compiles the README's Rust example as a doctest, so the front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
