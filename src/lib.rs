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
//! use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion, QpInit, RecvWr, SendWr, WorkQueue};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = Client::new()?
//!     .resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?
//!     .resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut buf = MemoryRegion::new(&pd, 1024, AccessFlags::LOCAL_WRITE)?;
//! buf.as_mut_slice()?.fill(b'x');
//! let mut pending = route.create_qp(&pd, QpInit::new())?;
//! pending.post_recv(&[RecvWr::new(&buf, 0..1024).wr_id(1)])?;
//! let mut conn = pending.connect(&ConnParam::new(), t)?;
//! // ... the receive holds `buf` until its completion is reaped:
//! let wc = conn.qp_mut().wait_for(WorkQueue::Recv, 1, t)?;
//! println!("received {} bytes: {:?}", wc.byte_len(), &buf.as_slice()?[..4]);
//! conn.disconnect(t)?;
//! # Ok(()) }
//! ```
//!
//! ## The connection state machine
//!
//! ```text
//!  client                                         server
//!  Client::new            (rdma_create_id)        Server::new          (rdma_create_id)
//!   │ resolve_addr  → ADDR_RESOLVED               │ bind               (rdma_bind_addr)
//!  AddrResolved                                   Bound
//!   │ resolve_route → ROUTE_RESOLVED              │ listen             (rdma_listen)
//!  RouteResolved  ── alloc_pd, MemoryRegion::new  Listener
//!   │ create_qp     (rdma_create_qp)              │ get_request   → CONNECT_REQUEST
//!  ClientQp       ── post_recv                    ConnectRequest ── alloc_pd, MemoryRegion::new
//!   │ connect       → ESTABLISHED                  │ create_qp / reject
//!  Connection  ◄──────────── RC ─────────────►   ServerQp ── post_recv
//!   │ disconnect    → DISCONNECTED                 │ accept        → ESTABLISHED
//!   ▼                                             Connection
//! ```
//!
//! Any other event where one is expected (`REJECTED`, `UNREACHABLE`, `ADDR_ERROR`, …) becomes
//! [`Error::UnexpectedEvent`] naming what arrived, with the usual cause. Every wait is bounded.
//!
//! Two variations on the same states:
//!
//! ```text
//!  a verbs QP the id adopts (rping -q)                  closing early (cmtime)
//!  UnconnectedQp::new_reset(pd, init) (RESET)           Connection
//!   │   or UnconnectedQp::new (INIT)                     │ shutdown: rdma_disconnect, QP flushed,
//!   │ RouteResolved::adopt_qp / ConnectRequest::adopt_qp │   reaped and destroyed at once
//!   ▼   (rdma_init_qp_attr + ibv_modify_qp: INIT)        │
//!  ClientQp ── connect: qp_num sent → CONNECT_RESPONSE   Disconnecting
//!              → INIT, RTR, RTS → rdma_establish          │ complete(DISCONNECTED) / wait
//!  ServerQp ── accept: INIT, RTR, RTS → rdma_accept       ▼ drop: rdma_destroy_id
//!              (qp_num sent) → ESTABLISHED
//!  Connection ── disconnect / peer left: ERR
//! ```
//!
//! An adopted QP is an [`UnconnectedQp`] made by the verbs wing (its PD must be on the id's
//! device context), not through `rdma_create_qp`, so librdmacm never drives it: the connection
//! moves it through its states with the attributes the CM gives (`rdma_init_qp_attr`) at the
//! points librdmacm's rules put them, and to the error state when either side disconnects. It
//! is a [`QueuePair`] in every other way. There is one QP type, made by the verbs wing; the CM
//! only drives it (see [`cm::adopt`]). [`Connection::shutdown`] destroys the QP without waiting
//! for the peer's answer to the disconnect, as rdma-core's `cmtime` does;
//! [`Connection::disconnect`] is `shutdown` and [`Disconnecting::wait`].
//!
//! ## Architecture: two wings
//!
//! The crate is two wings on a small common floor, and every import points down:
//!
//! ```text
//!  lib.rs   ready.rs (Readiness: one poll over both wings)
//!  ─────────────────────────────────────────────────────────────────────────────────────────
//!  cm/      librdmacm, on top of the verbs:
//!           client, server ──► connection (with its closing) ──► cm_qp (rdma_create_qp, Link)
//!           adopt (a verbs QP driven by an id, Link)
//!           ud_cm, multicast   conn_param   expect   step   private_data
//!           lane_cm (connections and UD endpoints as a lane's owners: LaneOwner's hooks)
//!           lane_conn (LaneClient, LaneServer: a connection on a lane from before the connect)
//!           cm_id ◄──► event_channel (an id holds its channel; an event names its id)   addrinfo
//!  ─────────────────────────────────────────────────────────────────────────────────────────
//!  verbs/   libibverbs alone (imports nothing from cm/):
//!           ud ──► qp/ (mod: create, state, drop; post; wait; connect) ──► srq, cq ──► router ──► ring
//!           qp_attr   wr (checks, the one lowering of a work request) ──► ah (UdDest), mr
//!           async_event ──► device ──► hub (event registry and log) ──► link (what drives a QP)
//!           pd, port, peer (PeerInfo), diagnostics, wc (WorkCompletion)
//!           extended (ibv_wr_* batches: qp/batch.rs; ibv_start_poll: extended/poll.rs)
//!           lane/ (the fast path: one thread's CQ and QPs, owned regions; LaneOwner) ──► cq, qp
//!  ─────────────────────────────────────────────────────────────────────────────────────────
//!  error.rs (Error, report_leak)   wait.rs (bounded fd waits, tokio reactor, lock)
//!  status.rs (leaf values: WcStatus, WcOpcode, WorkQueue, QpState, CmEventType, AsyncEventKind)
//! ```
//!
//! The one circle is `cm_id ↔ event_channel`. The verbs wing is usable without the connection
//! manager: a [`QueuePair`] is made and driven on it, and the CM's wing drives one through the
//! `Link` trait (`verbs/link.rs`) it implements, both for the QPs librdmacm makes (`cm_qp`) and
//! for a verbs-wing [`UnconnectedQp`] an id adopts (`adopt`). The types most programs use are
//! re-exported at the crate root; everything else is in its wing's module.
//!
//! ## Verbs without the connection manager
//!
//! An RC QP can be made on a protection domain alone and connected from the peer's
//! [`PeerInfo`] (QP number, PSN, LID or GID), exchanged by any means: [`UnconnectedQp`] is in
//! INIT and offers receives only; [`UnconnectedQp::connect`] moves it to RTR and RTS and hands
//! back the [`QueuePair`] that sends, so no send can come before RTS, as on the CM path. A UD
//! QP comes from a port and a Q_Key ([`UdQp::new`]). [`PeerInfo`] speaks rdma-core's pingpong
//! wire form; `examples/rc_pingpong`, `ud_pingpong` and `srq_pingpong` interoperate with
//! `ibv_rc_pingpong`, `ibv_ud_pingpong` and `ibv_srq_pingpong`. See [`qp::connect`](verbs::qp::connect).
//!
//! ```no_run
//! use rdma_cm::{devices, ProtectionDomain, QpInit, RcParams, UnconnectedQp, VerbsContext};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! # let peer_info = |_: rdma_cm::PeerInfo| -> rdma_cm::PeerInfo { unimplemented!() };
//! let ctx = VerbsContext::open(&devices()?[0].name)?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let qp = UnconnectedQp::new(&pd, QpInit::new(), RcParams::new().gid_index(1))?;
//! let theirs = peer_info(qp.local()); // send ours, receive theirs: TCP, a file, anything
//! let mut qp = qp.connect(&theirs)?;  // RTR, RTS: now it can send
//! # let _ = &mut qp;
//! # Ok(()) }
//! ```
//!
//! ## Ownership and cleanup
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
//! ([`device`](verbs::device), [`pd`](verbs::pd), [`mr`](verbs::mr), [`cq`](verbs::cq), [`srq`](verbs::srq), [`qp`](verbs::qp)) knows nothing of connection
//! management: a QP made through `rdma_create_qp` holds its id through a link the connection
//! layer gives it.
//!
//! ## Many connections
//!
//! One [`CompletionQueue`] may serve any number of QPs, and one [`SharedReceiveQueue`] the
//! receives of any number of them ([`QpInit::send_cq`], [`QpInit::recv_cq`], [`QpInit::srq`]).
//! Every `wr_id` the crate posts names its QP's place in the CQ's routing table (or its SRQ
//! slot), so [`CompletionQueue::poll`] retires each completion's slot in O(1), without
//! allocating, whoever polls; a completion of a QP that is gone retires nothing. A CQ counts
//! what its queues may have outstanding and refuses a QP that could overrun it. One
//! [`EventChannel`] may carry every connection's events: the event loop reads them
//! ([`EventChannel::get_event`]) and hands each to its connection, or each blocking step reads
//! its own ([`EventChannel::get_event_for`]). `examples/perftest/server.rs --shared` (`perf_server`) serves all its
//! clients that way from one thread; `examples/cmtime.rs` pipelines the setup of many. `Drop` never panics; when
//! a destroy call fails it prints one line to stderr and leaks the object (and any memory the
//! device might still reach). [`Connection::disconnect`] and [`ProtectionDomain::close`] return
//! errors to callers who want them.
//!
//! ## Soundness of the data path
//!
//! Posting moves a clone of the [`MemoryRegion`] handle into the QP's slot table; reaping the
//! completion releases it. A work request of several pieces ([scatter/gather](verbs::wr#scattergather),
//! up to [`MAX_SGE`]) holds every piece's region the same way, until the same completion. What
//! is guaranteed, exactly:
//!
//! - no safe call lets the device write memory that Rust code can reach through a reference:
//!   a region is readable only while no posted work lets the device write it, and writable only
//!   while no posted work uses it at all;
//! - no memory is freed or reused while the device may use it, even through `mem::forget` or a
//!   panic (forgetting leaks, which is safe), nor when a post fails without saying which work
//!   requests the provider took (they are all kept until the flush retires them);
//! - a completion retires only the work request it names: sequence numbers are never reused,
//!   completions of other QPs and of raw posts are recognised and retire nothing, and none is
//!   lost ([`QueuePair::wait_for`] keeps the ones it passes);
//! - remotely writable regions never hand out slices (a peer may write them at any time); they
//!   are copied with volatile accesses. Regions a peer may only *read* are handed out as slices:
//!   the peer may see a buffer while Rust writes it, which is no memory-safety issue.
//!
//! A UD send also holds its [`AddressHandle`] in the send ring's address-handle table (one
//! entry per slot, made with the QP) until its slot is retired, so the handle outlives every
//! send that names it, however the caller drops it (see [`ud`](verbs::ud)).
//!
//! A bound [`MemoryWindow`] ([`BoundWindow`]) holds its whole region the same way, as a writer
//! when it grants remote writes, until it is unbound or dropped; an invalidation holds the
//! region until its completion (see [`verbs::mw`]).
//!
//! Sends, RDMA WRITEs and READs need an established connection: before it, the typestates offer
//! receives only. See [`qp`](verbs::qp) and [`mr`](verbs::mr). [`QueuePair::as_raw`] and [`ffi`] remain for experts.
//! Post and poll make no heap allocation.
//!
//! ## Thread safety
//!
//! | type | Send | Sync | why |
//! |---|---|---|---|
//! | [`EventChannel`], [`CmId`], [`VerbsContext`] | yes | yes | librdmacm/libibverbs calls on them are thread-safe |
//! | [`ProtectionDomain`], [`CompletionQueue`], [`SharedReceiveQueue`] | yes | yes | thread-safe verbs through `&self`; a CQ's routing table and an SRQ's slots are behind mutexes |
//! | [`MemoryRegion`] | yes | yes | bytes only through `&mut self` with a unique handle |
//! | [`AsyncEvents`] | yes | yes | reads through `&mut self`; the context's registry and event log are behind a mutex |
//! | [`AddressHandle`] | yes | yes | immutable once made; shared by the sends that use it |
//! | [`UdQp`], [`UdEndpoint`] | yes | no | as [`QueuePair`] |
//! | [`QueuePair`], [`UnconnectedQp`], [`Connection`] | yes | no | posting and polling need `&mut self`; the slot rings are shared with the CQs' routing tables behind a mutex |
//!
//! QPs that share a CQ may live on different threads: each one's posts and polls are safe
//! together. A QP's poll keeps the completions of other QPs it meets for them, and wakes the
//! owner's wait if it sleeps (a blocking wait sleeps on an eventfd of its QP's too, made at its
//! first sleep; an async wait leaves its task's waker), so no wait misses what another thread
//! reaped for it. Waiting for a shared CQ from one thread ([`CompletionQueue::wait`]) and handing
//! the work out still costs the least.
//!
//! Ids may share an [`EventChannel`] across threads. Every read of a channel happens under its
//! lock, and each blocking step takes only its own id's events, keeping the others, in order,
//! for their owners ([`EventChannel::get_event_for`]); the untargeted reads
//! ([`EventChannel::get_event`]) return what is kept first and leave alone the events a
//! targeted wait is waiting for. The same lock serialises QP creation and destruction with the
//! event processing inside `rdma_get_cm_event`, which touches the id's QP. A connection watches
//! its id's events for the peer leaving only while nothing else holds the channel; on a shared
//! channel, whoever reads the events feeds them to it ([`Connection::handle_event`], or its own
//! [`Connection::next_event`]).
//!
//! Dropping a [`QueuePair`] with work in flight blocks for up to 2 s while the flush is reaped.
//! With the `tokio` feature, a QP dropped on a runtime thread (a future holding it was
//! cancelled, say) hands that wait to the runtime's blocking pool instead.
//!
//! ## Unreliable datagrams
//!
//! [`UdClient`] and [`UdServer`] run the UD side of rdma_cm (`RDMA_PS_UDP`): the client's
//! [`UdEndpoint::connect`] is one request and one reply, whose `ESTABLISHED` event carries the
//! server's QP number, QKey and address ([`CmEvent::ud`], [`UdDest`]); the server answers
//! whoever sends to it ([`UdDest::reply_to`]). A [`UdQp`] posts [`UdSendWr`]s, each addressed,
//! and only sends: an RDMA WRITE, READ or atomic on UD does not compile. Every receive starts
//! with [`GRH_LEN`] bytes the device writes; [`Datagram::parse`] gives the payload's range, the
//! sender's QP number and address. A datagram over the port's MTU, or a receive with no room
//! for the GRH, is refused before posting. `examples/udaddy` is rdma-core's `udaddy`.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::{AccessFlags, Datagram, MemoryRegion, QpInit, RecvWr, UdClient, UdSendWr, WorkQueue, GRH_LEN};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = UdClient::new()?.resolve_addr(None, "10.77.0.1:7174".parse().unwrap(), t)?.resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut ep = route.create_qp(&pd, QpInit::new())?;
//! let mut buf = MemoryRegion::new(&pd, GRH_LEN + 1024, AccessFlags::LOCAL_WRITE)?;
//! ep.qp_mut().post_recv(&[RecvWr::new(&buf, 0..GRH_LEN + 1024).wr_id(1)])?;
//! let server = ep.connect(&[], t)?;                         // its QPN, QKey and address
//! ep.qp_mut().post_send(&[UdSendWr::send_inline(&server, b"ping").wr_id(2)])?;
//! let wc = ep.qp_mut().wait_for(WorkQueue::Recv, 1, t)?;   // the answer
//! let d = Datagram::parse(&wc, &mut buf, 0)?;
//! println!("{} bytes from QP {} at {:?}", d.len(), d.src_qp(), d.src_ip());
//! # Ok(()) }
//! ```
//!
//! ## Event loops and async
//!
//! [`EventChannel`] and [`CompletionQueue`] implement `AsRawFd` (not `AsFd`, so safe code cannot
//! read them behind the library's back or clear `O_NONBLOCK`); their descriptors are
//! non-blocking, so an `epoll` loop waits for readability and then drains with
//! [`EventChannel::try_get_event`] / [`CompletionQueue::drain_events`] until they report
//! nothing (correct for edge-triggered notification). CQ events are acked in batches. Without
//! a runtime, one thread waits on channels, CQs, [`AsyncEvents`] and its own descriptors
//! together through a [`Readiness`] set (`poll(2)`, level-triggered). For
//! many connections on one channel: [`ConnectRequest::from_event`], [`ServerQp::start_accept`],
//! [`Accepting::complete`] and [`Connection::handle_event`].
//!
//! The client side has the same shape. Each blocking step has a `start_*` that returns the
//! state waiting for its id's next event, and that state's `complete` takes the event:
//!
//! ```text
//! Client::on_channel ─start_resolve→ ResolvingAddr ─complete(ADDR_RESOLVED)→ AddrResolved
//! AddrResolved ─start_resolve_route→ ResolvingRoute ─complete(ROUTE_RESOLVED)→ RouteResolved
//! RouteResolved ─create_qp→ ClientQp ─start→ Connecting ─complete(ESTABLISHED)→ Connection
//! Connection ─shutdown→ Disconnecting ─complete(DISCONNECTED)→ (drop: rdma_destroy_id)
//! ```
//!
//! A `complete` given any other event (another id's, or `ADDR_ERROR`, `REJECTED`, ...) hands
//! its state back, unchanged, in a [`StepError`] beside the error, so the loop can retry
//! ([`ResolvingAddr::retry`], [`ResolvingRoute::retry`]) or keep it for the right event;
//! `?` turns it into an [`Error`]. Fifty connections from one thread, one channel, one PD and
//! one CQ (made on the device's context, which holds no connection's id; see [`cm::cm_id`]);
//! `examples/cmtime.rs` times the same pipeline:
//!
//! ```no_run
//! use std::collections::HashMap;
//! use std::sync::Arc;
//! use std::time::Duration;
//! use rdma_cm::{
//!     Client, CompletionQueue, ConnParam, Connecting, Connection, EventChannel, ProtectionDomain, QpInit,
//!     ResolvingAddr, ResolvingRoute,
//! };
//!
//! enum Step { Addr(ResolvingAddr), Route(ResolvingRoute), Connect(Connecting) }
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let (t, n) = (Duration::from_secs(5), 50);
//! let dst = "10.77.0.1:7471".parse().unwrap();
//! let ch = EventChannel::new()?;
//! let mut steps = HashMap::new();
//! for _ in 0..n {
//!     let r = Client::on_channel(&ch)?.start_resolve(None, dst, t)?;
//!     steps.insert(r.handle(), Step::Addr(r));
//! }
//! let mut shared: Option<(Arc<ProtectionDomain>, Arc<CompletionQueue>)> = None;
//! let mut conns: HashMap<_, Connection> = HashMap::new();
//! while conns.len() < n {
//!     let ev = ch.get_event(t)?;
//!     let Some(step) = steps.remove(&ev.id()) else {
//!         // An event of an established connection (the peer left, say).
//!         if let Some(c) = conns.get_mut(&ev.id()) { c.handle_event(&ev) }
//!         continue;
//!     };
//!     let next = match step {
//!         Step::Addr(r) => Step::Route(r.complete(&ev)?.start_resolve_route(t)?),
//!         Step::Route(r) => {
//!             let route = r.complete(&ev)?;
//!             let (pd, cq) = match &shared {
//!                 Some(s) => s.clone(),
//!                 None => {
//!                     let ctx = route.context()?;
//!                     shared.insert((ProtectionDomain::new(&ctx)?, CompletionQueue::new(&ctx, 32 * n as u32)?)).clone()
//!                 }
//!             };
//!             let init = QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(cq);
//!             Step::Connect(route.create_qp(&pd, init)?.start(&ConnParam::new())?)
//!         }
//!         Step::Connect(c) => match c.complete(&ev) {
//!             Ok(conn) => {
//!                 conns.insert(conn.id().handle(), conn);
//!                 continue;
//!             }
//!             // REJECTED, UNREACHABLE: the state comes back; dropping it destroys its id.
//!             Err(e) => return Err(e.into()),
//!         },
//!     };
//!     let h = match &next { Step::Addr(r) => r.handle(), Step::Route(r) => r.handle(), Step::Connect(c) => c.handle() };
//!     steps.insert(h, next);
//! }
//! # Ok(()) }
//! ```
//!
//! ### Disconnects
//!
//! When the peer disconnects (its `rdma_disconnect` sends the CM's disconnect request), this
//! side's id reports `DISCONNECTED`, and the CM waits for this side's answer: the peer's own
//! `DISCONNECTED` (and so its [`Connection::disconnect`]) comes only with that answer, or
//! after its request times out. The connection answers as soon as it sees the event:
//! [`Connection::handle_event`] (fed by an event loop), [`Connection::next_event`] or
//! [`Connection::try_event`], or a wait of its QP while no other id shares its channel (the
//! wait watches the channel). Each calls `rdma_disconnect`, which sends the answer and moves
//! the QP to the error state, flushing its posted work. A connection whose events nobody
//! reads answers when it is dropped (`rdma_destroy_id` sends it). After that, or after this
//! side's own disconnect, [`Connection::start_disconnect`] returns `Ok(false)`: nothing is
//! left to send.
//!
//! What the device reports on its own (a port going down or up, a QP, CQ or SRQ error, an
//! SRQ running below its limit, the device failing) comes from an [`AsyncEvents`] source
//! ([`VerbsContext::async_events`]), which has an `AsFd` of its own (an `epoll` descriptor, so
//! safe code cannot take events the library must acknowledge), and is also delivered to the QP,
//! CQ or SRQ it names: their waits then fail at once with [`Error::AsyncEvent`]. See
//! [`async_event`](verbs::async_event).
//!
//! With the `tokio` feature (off by default), every blocking step has an `_async` twin
//! (`resolve_addr_async`, `resolve_route_async`, `connect_async`, `get_request_async`,
//! `accept_async`, `next_event_async`, `disconnect_async`), the QP has `wait_async` and
//! `wait_for_async`, and [`AsyncEvents`] has `next_async`, all awaiting the descriptors through tokio's reactor. Dropping any of
//! these futures is safe: posted work requests keep their regions inside the QP until their
//! completions are polled or the QP is dropped. A CQ's and a CM channel's descriptors are
//! registered with the reactor once, at their first async wait, for the CQ's or channel's life
//! (not once per wait, which cost ~40x the synchronous round trip), so an async wait costs what
//! a synchronous one does: poll, arm, poll, then sleep; any number of tasks may await one
//! descriptor. A wait on another runtime than that first one registers for its own duration.
//! The steady-state async round trip allocates nothing (`tests/alloc.rs`). See
//! `examples/async_pingpong.rs`.
//!
//! ## Multicast
//!
//! [`McastClient`] resolves a group's address (binding the id to the device that reaches it),
//! [`McastResolved::create_qp`] makes the UD QP, and [`McastEndpoint::join`] returns a
//! [`Multicast`] membership once the `MULTICAST_JOIN` event arrives; librdmacm has then
//! attached the QP (a [`JoinKind::FullMember`]; a send-only member is not attached). Sends to
//! the group go to [`Multicast::dest`]: the group's address handle, QPN `0xFFFFFF` and the
//! join's QKey, through the same [`UdQp::post_send`] (the handle held by every posted send until
//! its completion). Dropping the membership leaves the group; the endpoint and its memberships
//! may be dropped in either order (see [`multicast`](cm::multicast)). A unicast address as the group is
//! refused before any call; loopback off ([`McastResolved::loopback`]) is a clear error where
//! the device cannot block it (rxe). On RoCE v2 the kernel joins IPv4 groups only.
//! `examples/mckey` is rdma-core's `mckey`.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::{AccessFlags, Datagram, JoinKind, McastClient, MemoryRegion, QpInit, RecvWr, UdSendWr, WorkQueue, GRH_LEN};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let (src, group) = ("10.77.0.1".parse().unwrap(), "239.1.1.1".parse().unwrap());
//! let r = McastClient::new()?.resolve(Some(src), group, t)?;
//! let pd = r.alloc_pd()?;
//! let mut ep = r.create_qp(&pd, QpInit::new())?;
//! let mut buf = MemoryRegion::new(&pd, GRH_LEN + 1024, AccessFlags::LOCAL_WRITE)?;
//! ep.qp_mut().post_recv(&[RecvWr::new(&buf, 0..GRH_LEN + 1024).wr_id(1)])?;
//! let member = ep.join(JoinKind::FullMember, t)?;
//! ep.qp_mut().post_send(&[UdSendWr::send_inline(member.dest(), b"hello, group").wr_id(2)])?;
//! let wc = ep.qp_mut().wait_for(WorkQueue::Recv, 1, t)?; // our own datagram: loopback is on
//! let d = Datagram::parse(&wc, &mut buf, 0)?;
//! println!("{} bytes from QP {} at {:?}", d.len(), d.src_qp(), d.src_ip());
//! drop(member); // rdma_leave_multicast
//! # Ok(()) }
//! ```
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
pub mod verbs;
mod wait;

pub use rdma_sys as ffi;

pub use cm::addrinfo::{lookup, lookup_passive};
pub use cm::client::{AddrResolved, Client, ClientQp, Connecting, ResolvingAddr, ResolvingRoute, RouteResolved};
pub use cm::cm_id::{CmId, IdHandle};
pub use cm::conn_param::ConnParam;
pub use cm::connection::{Connection, Disconnecting};
pub use cm::event_channel::{CmEvent, CmEventType, EventChannel, PrivateData};
pub use cm::hold::{disconnect_hold, set_disconnect_hold, DEFAULT_DISCONNECT_HOLD};
pub use cm::lane_conn::{LaneClient, LaneServer};
pub use cm::multicast::{JoinKind, McastClient, McastEndpoint, McastResolved, Multicast, MULTICAST_QPN};
pub use cm::private_data::QpInfo;
pub use cm::server::{Accepting, Bound, ConnectRequest, Listener, Server, ServerQp};
pub use cm::step::StepError;
pub use cm::ud_cm::{
    PortSpace, UdAddrResolved, UdClient, UdEndpoint, UdListener, UdRequest, UdRoute, UdServer, UdServerQp,
};
pub use error::{Error, Result};
pub use ready::{Readiness, Ready};
pub use verbs::ah::{AddressHandle, AhAttr, Grh, UdParam, GRH_LEN};
pub use verbs::async_event::{AsyncElement, AsyncEvent, AsyncEventKind, AsyncEvents};
pub use verbs::buffer::{Mapping, StableBuffer, HUGE_PAGE_SIZE};
pub use verbs::cq::{CompletionQueue, WcOpcode, WcStatus, WorkCompletion, WorkQueue};
pub use verbs::device::{devices, Device, DeviceLimits, Transport, VerbsContext};
pub use verbs::extended::{ExtendedCompletion, SendOps};
pub use verbs::fork::{fork_init, fork_status, ForkStatus};
pub use verbs::lane::{Lane, LaneQp};
pub use verbs::mr::{AccessFlags, IntoBufferError, MemoryRegion, RemoteRegion};
pub use verbs::mw::{BoundWindow, InvalidateError, MemoryWindow, WindowType};
pub use verbs::pd::ProtectionDomain;
pub use verbs::peer::PeerInfo;
pub use verbs::port::{Gid, GidEntry, GidType, LinkLayer, PortInfo, PortState};
pub use verbs::qp::{QpInit, QueuePair, RcParams, UnconnectedQp, WrBatch};
pub use verbs::qp_attr::{QpAttributes, QpState};
pub use verbs::srq::SharedReceiveQueue;
pub use verbs::ud::{Datagram, UdDest, UdQp, UdSendWr, MAX_UD_PRIVATE_DATA, RDMA_UDP_QKEY};
pub use verbs::wr::{RecvWr, SendWr, MAX_SGE};
pub use wait::FOREVER;

/// Compiles the README's Rust example as a doctest, so the front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
