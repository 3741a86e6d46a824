//! The connection-manager wing (librdmacm): event channels, ids, the client and server
//! typestates, connections and their closing, UD through the CM, and multicast. It stands on
//! the verbs wing ([`crate::verbs`]).
//!
//! # Two variations on the states
//!
//! The crate's front page draws the client's and the server's states, from `rdma_create_id`
//! to the disconnect. Two variations on them:
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
//! An adopted QP is an [`UnconnectedQp`](crate::verbs::qp::UnconnectedQp) made by the verbs wing (its PD must be on the id's
//! device context), not through `rdma_create_qp`, so librdmacm never drives it: the connection
//! moves it through its states with the attributes the CM gives (`rdma_init_qp_attr`) at the
//! points librdmacm's rules put them, and to the error state when either side disconnects. It
//! is a [`QueuePair`](crate::QueuePair) in every other way. There is one QP type, made by the verbs wing; the CM
//! only drives it (see [`cm::adopt`](crate::cm::adopt)). [`Connection::shutdown`](crate::Connection::shutdown) destroys the QP without waiting
//! for the peer's answer to the disconnect, as rdma-core's `cmtime` does;
//! [`Connection::disconnect`](crate::Connection::disconnect) is `shutdown` and [`Disconnecting::wait`](crate::Disconnecting::wait).
//!
//! # Unreliable datagrams
//!
//! [`UdClient`](crate::cm::ud_cm::UdClient) and [`UdServer`](crate::cm::ud_cm::UdServer) run the UD side of rdma_cm (`RDMA_PS_UDP`): the client's
//! [`UdEndpoint::connect`](crate::cm::ud_cm::UdEndpoint::connect) is one request and one reply, whose `ESTABLISHED` event carries the
//! server's QP number, QKey and address ([`CmEvent::ud`](crate::CmEvent::ud), [`UdDest`](crate::verbs::ud::UdDest)); the server answers
//! whoever sends to it ([`UdDest::reply_to`](crate::verbs::ud::UdDest::reply_to)). On a lane, a UD QP posts only sends, each to
//! a destination ([`Lane::add_dest`](crate::verbs::lane::Lane::add_dest)): an RDMA WRITE, READ or atomic on UD is refused. Every receive starts
//! with [`GRH_LEN`](crate::verbs::ah::GRH_LEN) bytes the device writes; [`Datagram::parse`](crate::verbs::ud::Datagram::parse) gives the payload's range, the
//! sender's QP number and address. A datagram over the port's MTU, or a receive with no room
//! for the GRH, is refused before posting. `examples/udaddy` is rdma-core's `udaddy`.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{InlineWr, Lane, RecvWr};
//! use rdma_cm::{AccessFlags, MemoryRegion, QpInit};
//! use rdma_cm::cm::ud_cm::UdClient;
//! use rdma_cm::verbs::ah::GRH_LEN;
//! use rdma_cm::verbs::ud::Datagram;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = UdClient::new()?.resolve_addr(None, "10.77.0.1:7174".parse().unwrap(), t)?.resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut lane = Lane::new(&route.context()?, 64)?;
//! let mut ep = route.create_qp(&pd, lane.qp_init_from(QpInit::new()))?;
//! let server = ep.connect(&[], t)?;                         // its QPN, QKey and address
//! let qp = lane.attach(ep)?;
//! let to_server = lane.add_dest(qp, &server)?;
//! let buf = MemoryRegion::new(&pd, GRH_LEN + 1024, AccessFlags::LOCAL_WRITE)?;
//! lane.post_recv(qp, RecvWr::new(buf).wr_id(1))?;
//! lane.post_inline(qp, InlineWr::send(b"ping").to(to_server).wr_id(2))?;
//! loop {
//!     let mut c = lane.wait(t)?.ok()?;                      // the send's, then the answer
//!     if let Some(mut buf) = c.take_region().filter(|_| c.wr_id() == 1) {
//!         let d = Datagram::parse(&c, &mut buf, 0)?;
//!         println!("{} bytes from QP {} at {:?}", d.len(), d.src_qp(), d.src_ip());
//!         break;
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Event loops and async
//!
//! [`EventChannel`](crate::EventChannel) and [`CompletionQueue`](crate::CompletionQueue) implement `AsRawFd` (not `AsFd`, so safe code cannot
//! read them behind the library's back or clear `O_NONBLOCK`); their descriptors are
//! non-blocking, so an `epoll` loop waits for readability and then drains with
//! [`EventChannel::try_get_event`](crate::EventChannel::try_get_event) / [`CompletionQueue::drain_events`](crate::CompletionQueue::drain_events) until they report
//! nothing (correct for edge-triggered notification). CQ events are acked in batches. Without
//! a runtime, one thread waits on channels, CQs, [`AsyncEvents`](crate::verbs::async_event::AsyncEvents) and its own descriptors
//! together through a [`Readiness`](crate::Readiness) set (`poll(2)`, level-triggered). For
//! many connections on one channel: [`ConnectRequest::from_event`](crate::ConnectRequest::from_event), [`ServerQp::start_accept`](crate::ServerQp::start_accept),
//! [`Accepting::complete`](crate::Accepting::complete) and [`Connection::handle_event`](crate::Connection::handle_event).
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
//! its state back, unchanged, in a [`StepError`](crate::StepError) beside the error, so the loop can retry
//! ([`ResolvingAddr::retry`](crate::ResolvingAddr::retry), [`ResolvingRoute::retry`](crate::ResolvingRoute::retry)) or keep it for the right event;
//! `?` turns it into an [`Error`](crate::Error). Fifty connections from one thread, one channel, one PD and
//! one CQ (made on the device's context, which holds no connection's id; see [`cm::cm_id`](crate::cm::cm_id));
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
//! # Disconnects
//!
//! When the peer disconnects (its `rdma_disconnect` sends the CM's disconnect request), this
//! side's id reports `DISCONNECTED`, and the CM waits for this side's answer: the peer's own
//! `DISCONNECTED` (and so its [`Connection::disconnect`](crate::Connection::disconnect)) comes only with that answer, or
//! after its request times out. The connection answers as soon as it sees the event:
//! [`Connection::handle_event`](crate::Connection::handle_event) (fed by an event loop), [`Connection::next_event`](crate::Connection::next_event) or
//! [`Connection::try_event`](crate::Connection::try_event), or a wait of its QP while no other id shares its channel (the
//! wait watches the channel). Each calls `rdma_disconnect`, which sends the answer and moves
//! the QP to the error state, flushing its posted work. A connection whose events nobody
//! reads answers when it is dropped (`rdma_destroy_id` sends it). After that, or after this
//! side's own disconnect, [`Connection::start_disconnect`](crate::Connection::start_disconnect) returns `Ok(false)`: nothing is
//! left to send.
//!
//! What the device reports on its own (a port going down or up, a QP, CQ or SRQ error, an
//! SRQ running below its limit, the device failing) comes from an [`AsyncEvents`](crate::verbs::async_event::AsyncEvents) source
//! ([`VerbsContext::async_events`](crate::VerbsContext::async_events)), which has an `AsFd` of its own (an `epoll` descriptor, so
//! safe code cannot take events the library must acknowledge), and is also delivered to the QP,
//! CQ or SRQ it names: their waits then fail at once with [`Error::AsyncEvent`](crate::Error::AsyncEvent). See
//! [`async_event`](crate::verbs::async_event).
//!
//! With the `tokio` feature (off by default), every blocking step has an `_async` twin
//! (`resolve_addr_async`, `resolve_route_async`, `connect_async`, `get_request_async`,
//! `accept_async`, `next_event_async`, `disconnect_async`), the lane has `wait_async`, and
//! [`AsyncEvents`](crate::verbs::async_event::AsyncEvents) has `next_async`, all awaiting the descriptors through tokio's reactor. Dropping any of
//! these futures is safe: posted work requests keep their regions inside the lane until their
//! completions are polled or the QP is dropped. A CQ's and a CM channel's descriptors are
//! registered with the reactor once, at their first async wait, for the CQ's or channel's life
//! (not once per wait, which cost ~40x the synchronous round trip), so an async wait costs what
//! a synchronous one does: poll, arm, poll, then sleep; any number of tasks may await one
//! descriptor. A wait on another runtime than that first one registers for its own duration.
//! The steady-state async round trip allocates nothing (`tests/alloc.rs`). See
//! `examples/async_pingpong.rs`.
//!
//! # Multicast
//!
//! [`McastClient`](crate::cm::multicast::McastClient) resolves a group's address (binding the id to the device that reaches it),
//! [`McastResolved::create_qp`](crate::cm::multicast::McastResolved::create_qp) makes the UD QP, and [`McastEndpoint::join`](crate::cm::multicast::McastEndpoint::join) returns a
//! [`Multicast`](crate::cm::multicast::Multicast) membership once the `MULTICAST_JOIN` event arrives; librdmacm has then
//! attached the QP (a [`JoinKind::FullMember`](crate::cm::multicast::JoinKind::FullMember); a send-only member is not attached). Sends to
//! the group go to [`Multicast::dest`](crate::cm::multicast::Multicast::dest): the group's address handle, QPN `0xFFFFFF` and the
//! join's QKey, posted on the lane like any datagram (the handle held by every posted send until
//! its completion). Dropping the membership leaves the group; the endpoint and its memberships
//! may be dropped in either order (see [`multicast`]). A unicast address as the group is
//! refused before any call; loopback off ([`McastResolved::loopback`](crate::cm::multicast::McastResolved::loopback)) is a clear error where
//! the device cannot block it (rxe). On RoCE v2 the kernel joins IPv4 groups only.
//! `examples/mckey` is rdma-core's `mckey`.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{InlineWr, Lane, RecvWr};
//! use rdma_cm::{AccessFlags, MemoryRegion, QpInit};
//! use rdma_cm::cm::multicast::{JoinKind, McastClient, Multicast};
//! use rdma_cm::verbs::ah::GRH_LEN;
//! use rdma_cm::verbs::ud::Datagram;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let (src, group) = ("10.77.0.1".parse().unwrap(), "239.1.1.1".parse().unwrap());
//! let r = McastClient::new()?.resolve(Some(src), group, t)?;
//! let pd = r.alloc_pd()?;
//! let mut lane = Lane::new(&r.context()?, 64)?;
//! let qp = lane.attach(r.create_qp(&pd, lane.qp_init_from(QpInit::new()))?)?;
//! let buf = MemoryRegion::new(&pd, GRH_LEN + 1024, AccessFlags::LOCAL_WRITE)?;
//! lane.post_recv(qp, RecvWr::new(buf).wr_id(1))?;
//! let (member, to_group) = Multicast::join_on(&mut lane, qp, group, JoinKind::FullMember, t)?;
//! lane.post_inline(qp, InlineWr::send(b"hello, group").to(to_group).wr_id(2))?;
//! loop {
//!     let mut c = lane.wait(t)?.ok()?;          // the send's, then our own datagram (loopback)
//!     if let Some(mut buf) = c.take_region().filter(|_| c.wr_id() == 1) {
//!         let d = Datagram::parse(&c, &mut buf, 0)?;
//!         println!("{} bytes from QP {} at {:?}", d.len(), d.src_qp(), d.src_ip());
//!         break;
//!     }
//! }
//! drop(member); // rdma_leave_multicast
//! # Ok(()) }
//! ```
//!

pub mod addrinfo;
pub mod adopt;
pub mod client;
pub mod cm_id;
pub(crate) mod cm_qp;
pub mod conn_param;
pub mod connection;
pub mod event_channel;
pub(crate) mod expect;
pub mod hold;
mod lane_cm;
pub mod lane_conn;
mod lane_mcast;
pub mod multicast;
pub mod private_data;
pub mod server;
pub mod step;
pub mod ud_cm;
