//! Accepting connections: the server's typestates [`Server`] → [`Bound`] → [`Listener`] →
//! [`ConnectRequest`] → [`ServerQp`] → [`Connection`] (or, with a lane,
//! [`LaneServer`](crate::LaneServer)), the event-loop step [`Accepting`], and their async twins
//! (feature `tokio`). See [`crate::cm::connection`] for the whole state machine.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{Lane, RecvWr};
//! use rdma_cm::{AccessFlags, ConnParam, MemoryRegion, QpInit, Server, FOREVER};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let listener = Server::new()?.bind("0.0.0.0:7471".parse().unwrap())?.listen(16)?;
//! let req = listener.get_request(FOREVER)?; // one client's connect request
//! let pd = req.alloc_pd()?;
//! let mut lane = Lane::new(&req.context()?, 64)?;
//! let server = req.lane_qp(&mut lane, &pd, QpInit::new())?;
//! let qp = server.qp();
//! lane.post_recv(qp, RecvWr::new(MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?))?;
//! server.accept(&mut lane, &ConnParam::new(), Duration::from_secs(5))?;
//! let mut c = lane.wait(FOREVER)?.ok()?; // the client's first message
//! let mut msg = c.take_region().expect("a receive hands its region back");
//! println!("got {:?}", &msg.as_slice()?[..c.byte_len() as usize]);
//! # Ok(()) }
//! ```

use std::borrow::Borrow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::cm::adopt;
use crate::cm::cm_id::{CmId, IdHandle};
use crate::cm::cm_qp::create_qp_on;
use crate::cm::conn_param::{
    apply_min_rnr_timer, too_long, ConnParam, MAX_ACCEPT_PRIVATE_DATA, MAX_REJECT_PRIVATE_DATA,
};
use crate::cm::connection::Connection;
use crate::cm::event_channel::{CmEvent, CmEventType, EventChannel, PrivateData};
#[cfg(feature = "tokio")]
use crate::cm::expect::expect_async;
use crate::cm::expect::{context_of, expect_any_request, expect_watching, with_opt_addr};
use crate::cm::step::StepError;
use crate::error::{check_rdma, Result};
use crate::verbs::device::VerbsContext;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::UnconnectedQp;
use crate::verbs::qp::{QpInit, QueuePair};

/// A fresh server id, not yet bound.
#[derive(Debug)]
pub struct Server {
    id: CmId,
}

impl Server {
    /// Creates a server id on its own event channel.
    ///
    /// # Errors
    /// [`Error::NoDevice`](crate::Error::NoDevice) without RDMA support; [`Error::Call`](crate::Error::Call) otherwise.
    pub fn new() -> Result<Server> {
        Server::on_channel(&EventChannel::new()?)
    }

    /// Creates a server id on `channel`, which other ids may share; connection requests arrive
    /// there.
    ///
    /// # Errors
    /// As for [`Server::new`].
    pub fn on_channel(channel: &EventChannel) -> Result<Server> {
        Ok(Server { id: CmId::new(channel)? })
    }

    /// Binds to `addr` (`0.0.0.0` for every RDMA device; port 0 picks a free port).
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) with `EADDRINUSE` or `EADDRNOTAVAIL` and a hint.
    pub fn bind(self, addr: SocketAddr) -> Result<Bound> {
        self.id.bind(addr)?;
        Ok(Bound { id: self.id })
    }

    /// The id, for the options to set before binding ([`CmId::set_reuse_addr`],
    /// [`CmId::set_afonly`], [`CmId::set_tos`]).
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A bound server id.
#[derive(Debug)]
pub struct Bound {
    id: CmId,
}

impl Bound {
    /// Starts listening (`rdma_listen`), with room for `backlog` connection requests that have
    /// not been read from the channel yet.
    ///
    /// The kernel's `rdma_ucm` counts, per listener, the `CONNECT_REQUEST` events queued on its
    /// channel and not yet read (by any reader: requests the crate has read and keeps for a
    /// targeted wait no longer count). A `backlog` of 0 or less, or one at or above the
    /// `net.rdma_ucm.max_backlog` sysctl (1024 by default), means that sysctl's value: `listen(0)`
    /// is "as many as the system allows", not "none". A request that arrives while the backlog
    /// is full is dropped without a reject (the kernel's CM leaves it for the client's CM to
    /// send again), so a client sees a slow connect, or a timeout, rather than `REJECTED`.
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `rdma_listen` fails (`EADDRINUSE`: the port is taken).
    pub fn listen(self, backlog: i32) -> Result<Listener> {
        let local = self.id.local_addr();
        self.id.listen(backlog).map_err(|e| with_opt_addr(e, local))?;
        Ok(Listener { id: self.id })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The id, for its options ([`CmId::set_tos`], [`CmId::set_ack_timeout`], ...).
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A listening id.
#[derive(Debug)]
pub struct Listener {
    pub(crate) id: CmId,
}

impl Listener {
    /// Waits up to `timeout` for a connection request, and moves the new id onto its own
    /// event channel so that its blocking steps never see other connections' events.
    ///
    /// # Errors
    /// [`Error::Timeout`](crate::Error::Timeout); [`Error::UnexpectedEvent`](crate::Error::UnexpectedEvent) for any other event.
    pub fn get_request(&self, timeout: Duration) -> Result<ConnectRequest> {
        ConnectRequest::build(expect_any_request(&self.id, timeout)?, true)
    }

    /// The bound address (with the chosen port when bound to port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// librdmacm's context of the device this listener is bound to, which holds no id (see
    /// [`crate::cm::cm_id`]): make the PD, CQs and SRQ that the accepted connections will
    /// share on it before the first request arrives. [`ConnectRequest::context`] returns the
    /// same context for requests on that device.
    ///
    /// # Errors
    /// [`Error::WildcardAddress`](crate::Error::WildcardAddress) when the listener is bound to a wildcard address
    /// (`0.0.0.0`, `[::]`), which is on no device until a request arrives (bind to the device's
    /// address, take the context from the [`ConnectRequest`], or use
    /// [`VerbsContext::cm_for_addr`] / [`VerbsContext::cm_open`]); [`Error::NoDevice`](crate::Error::NoDevice) when no
    /// device serves its address; [`Error::Call`](crate::Error::Call) when `rdma_get_devices` fails.
    pub fn context(&self) -> Result<VerbsContext> {
        self.id.device_context()
    }

    /// The listener's id token (a `CONNECT_REQUEST`'s [`CmEvent::listen_id`]).
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// The id, for its options ([`CmId::set_tos`], [`CmId::set_ack_timeout`], ...).
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A peer's connection request: inspect it, then create a QP and accept, or reject.
#[derive(Debug)]
pub struct ConnectRequest {
    id: Arc<CmId>,
    private_data: PrivateData,
    responder_resources: u8,
    initiator_depth: u8,
}

impl ConnectRequest {
    /// The id, for its options: [`CmId::set_ack_timeout`] takes effect when set before
    /// accepting.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Takes the request out of a `CONNECT_REQUEST` event. The id stays on the event's
    /// channel: an event loop uses [`ServerQp::start_accept`] and [`Accepting::complete`] with
    /// it, and [`ServerQp::accept`] works too (it takes only this id's events).
    ///
    /// # Errors
    /// [`Error::UnexpectedEvent`](crate::Error::UnexpectedEvent) for any other event, which the [`StepError`] gives back
    /// (for its owner).
    pub fn from_event(mut ev: CmEvent) -> std::result::Result<ConnectRequest, StepError<CmEvent>> {
        let id = if ev.event_type() == CmEventType::ConnectRequest { ev.take_id() } else { None };
        match id {
            Some(id) => Ok(Self::from_parts(&ev, id)),
            None => {
                let e = ev.unexpected("taking a connection request", CmEventType::ConnectRequest);
                Err(StepError::new(ev, e))
            }
        }
    }

    /// `own_channel`: move the new id onto a fresh channel of its own first.
    pub(crate) fn build(mut ev: CmEvent, own_channel: bool) -> Result<ConnectRequest> {
        if ev.event_type() != CmEventType::ConnectRequest {
            return Err(ev.unexpected("taking a connection request", CmEventType::ConnectRequest));
        }
        let Some(mut id) = ev.take_id() else {
            return Err(ev.unexpected("taking a connection request", CmEventType::ConnectRequest));
        };
        if own_channel {
            let ch = EventChannel::new()?;
            id.migrate(&ch)?;
            id.set_channel(ch);
        }
        Ok(Self::from_parts(&ev, id))
    }

    fn from_parts(ev: &CmEvent, id: CmId) -> ConnectRequest {
        ConnectRequest {
            id: Arc::new(id),
            private_data: *ev.private_data(),
            responder_resources: ev.responder_resources(),
            initiator_depth: ev.initiator_depth(),
        }
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// The local address the request arrived on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The peer's private data (untrusted; zero-padded by the CM).
    pub fn private_data(&self) -> &PrivateData {
        &self.private_data
    }

    /// The most RDMA READs (and atomics) *this side* may have outstanding towards the peer:
    /// the peer's responder resources. The CM hands the request's two values over in this
    /// side's view, so this is the value to accept with as [`ConnParam::initiator_depth`] (or
    /// less).
    pub fn initiator_depth(&self) -> u8 {
        self.initiator_depth
    }

    /// The RDMA READs (and atomics) the peer wants to have outstanding towards this side: its
    /// initiator depth, in this side's view. Accept with at least this as
    /// [`ConnParam::responder_resources`] (the device allowing), or the peer's READs beyond
    /// what was accepted wait for each other. [`ConnParam::from_request`] takes both values.
    pub fn responder_resources(&self) -> u8 {
        self.responder_resources
    }

    /// The new id's token.
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// Rejects the request with `private_data` (at most 148 bytes; the peer sees `REJECTED`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for too much data; [`Error::Call`](crate::Error::Call) when `rdma_reject` fails.
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        reject(&self.id, private_data)
    }

    /// Creates the QP on the request's device (after registering memory on `pd`).
    ///
    /// # Errors
    /// As for [`RouteResolved::create_qp`](crate::RouteResolved::create_qp).
    pub fn create_qp(self, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<ServerQp> {
        let qp = create_qp_on(&self.id, pd, init)?;
        let asked = (self.responder_resources, self.initiator_depth);
        Ok(ServerQp { id: self.id, qp, private_data: self.private_data, user: false, asked })
    }

    /// Adopts a QP the verbs wing made ([`UnconnectedQp`], in RESET or INIT) instead of
    /// creating one, and moves it to INIT with the request's attributes; the accept moves it to
    /// RTR and RTS before `rdma_accept` and sends its number. See
    /// [`RouteResolved::adopt_qp`](crate::RouteResolved::adopt_qp).
    ///
    /// # Errors
    /// As for [`RouteResolved::adopt_qp`](crate::RouteResolved::adopt_qp).
    pub fn adopt_qp(self, qp: UnconnectedQp) -> Result<ServerQp> {
        let qp = adopt::adopt(qp, &self.id)?;
        let asked = (self.responder_resources, self.initiator_depth);
        Ok(ServerQp { id: self.id, qp, private_data: self.private_data, user: true, asked })
    }

    /// Allocates a PD on the request's device.
    ///
    /// # Errors
    /// [`Error::NoDevice`](crate::Error::NoDevice), or [`Error::Call`](crate::Error::Call) when `ibv_alloc_pd` fails.
    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>> {
        ProtectionDomain::new(&self.context()?)
    }

    /// The device context of the request: librdmacm's context of the device, which holds no
    /// id (see [`crate::cm::cm_id`]). PDs, CQs and SRQs made from it may serve this and later
    /// connections on the same device, and outlive this request's connection: dropping the
    /// connection destroys its id even while they live.
    ///
    /// # Errors
    /// [`Error::NoDevice`](crate::Error::NoDevice) if the request has no device (cannot happen for a request), or
    /// [`Error::Call`](crate::Error::Call) when `rdma_get_devices` fails.
    pub fn context(&self) -> Result<VerbsContext> {
        context_of(&self.id)
    }
}

pub(crate) fn reject(id: &CmId, data: &[u8]) -> Result<()> {
    if data.len() > MAX_REJECT_PRIVATE_DATA {
        return Err(too_long("reject private data", data.len(), MAX_REJECT_PRIVATE_DATA));
    }
    let ptr = if data.is_empty() { std::ptr::null() } else { data.as_ptr().cast() };
    // SAFETY: id is a pending request; `data` outlives the call, which copies it.
    check_rdma(unsafe { ffi::rdma_reject(id.as_raw(), ptr, data.len() as u8) }, "rdma_reject")
}

/// A request with its QP: post receives now, then accept (or reject).
#[derive(Debug)]
pub struct ServerQp {
    pub(crate) id: Arc<CmId>,
    pub(crate) qp: QueuePair,
    pub(crate) private_data: PrivateData,
    /// The QP was adopted ([`ConnectRequest::adopt_qp`]).
    pub(crate) user: bool,
    /// The request's READ depths, this side's view (`responder_resources`, `initiator_depth`):
    /// what [`ConnParam::FROM_DEVICE`] resolves to for an adopted QP.
    pub(crate) asked: (u8, u8),
}

impl ServerQp {
    /// The id, for its options: [`CmId::set_ack_timeout`] takes effect when set before
    /// accepting.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The QP, to read its number and capabilities.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The peer's private data (untrusted).
    pub fn private_data(&self) -> &PrivateData {
        &self.private_data
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// Accepts (`rdma_accept`) and waits for the id's `ESTABLISHED`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for private data over 196 bytes; [`Error::UnexpectedEvent`](crate::Error::UnexpectedEvent);
    /// [`Error::Timeout`](crate::Error::Timeout).
    pub fn accept(self, param: &ConnParam, timeout: Duration) -> Result<Connection> {
        let id = Arc::clone(&self.id);
        let _expecting = id.channel().expecting(id.handle());
        let acc = self.start_accept(param)?;
        // The device's events are read meanwhile: a COMM_EST of the QP (the client's first
        // message came before the CM's RTU) is answered, so ESTABLISHED is not held up.
        let ctx = acc.qp.pd().context().clone();
        let ev = expect_watching(&acc.id, CmEventType::Established, "rdma_accept", timeout, Some(&ctx))?;
        Ok(acc.complete(&ev)?)
    }

    /// Accepts without waiting; feed the id's next event to [`Accepting::complete`].
    ///
    /// # Errors
    /// As for [`ServerQp::accept`], without the waiting.
    pub fn start_accept(self, param: &ConnParam) -> Result<Accepting> {
        accept_on(&self.id, &self.qp, self.user, self.asked, param)?;
        Ok(Accepting { id: self.id, qp: self.qp, private_data: self.private_data, user: self.user })
    }

    /// Rejects the request with `private_data` (at most 148 bytes).
    ///
    /// # Errors
    /// As for [`ConnectRequest::reject`].
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        reject(&self.id, private_data)
    }
}

/// `rdma_accept` of the request `id` with its QP `qp`: an adopted one (`user`) is moved to RTR
/// (with the minimum RNR timer, when given) and RTS first, with `FROM_DEVICE` resolved from
/// the request's READ depths (`asked`, this side's view) as `rdma_accept` would; librdmacm's
/// own is given the RNR timer in RTS after.
pub(crate) fn accept_on(id: &CmId, qp: &QueuePair, user: bool, asked: (u8, u8), param: &ConnParam) -> Result<()> {
    let mut raw = param.raw(MAX_ACCEPT_PRIVATE_DATA, "accept private data")?;
    raw.qp_num = adopt::qp_num_for(param, qp)?;
    raw.srq = u8::from(qp.srq().is_some());
    if user {
        // librdmacm moves only its own QP to RTR and RTS inside rdma_accept, resolving
        // FROM_DEVICE there; an adopted QP reaches RTS first, so resolve it here as
        // rdma_accept would (the request's value, clamped to the device's limit): the raw
        // 255 would fail the modify to RTR or RTS with EINVAL.
        if raw.responder_resources == ConnParam::FROM_DEVICE || raw.initiator_depth == ConnParam::FROM_DEVICE {
            let limits = qp.pd().context().limits()?;
            let clamp = |asked: u8, limit: u32| asked.min(u8::try_from(limit).unwrap_or(u8::MAX));
            if raw.responder_resources == ConnParam::FROM_DEVICE {
                raw.responder_resources = clamp(asked.0, limits.max_qp_rd_atom);
            }
            if raw.initiator_depth == ConnParam::FROM_DEVICE {
                raw.initiator_depth = clamp(asked.1, limits.max_qp_init_rd_atom);
            }
        }
        // With the minimum RNR timer set at RTR, before the accept goes out.
        adopt::ready(id, qp, &raw, param.min_rnr_timer_value())?;
    }
    // SAFETY: the id is a pending request with a QP; `raw` and its private data outlive
    // the call, which copies them.
    check_rdma(unsafe { ffi::rdma_accept(id.as_raw(), &mut raw) }, "rdma_accept")
        .map_err(|e| with_opt_addr(e, id.peer_addr()))?;
    if !user {
        // librdmacm's QP reached RTS inside rdma_accept, with the CM's timer: set it now.
        apply_min_rnr_timer(id, qp, param.min_rnr_timer_value())?;
    }
    Ok(())
}

/// An accepted request waiting for `ESTABLISHED`.
#[derive(Debug)]
pub struct Accepting {
    pub(crate) id: Arc<CmId>,
    pub(crate) qp: QueuePair,
    pub(crate) private_data: PrivateData,
    pub(crate) user: bool,
}

impl Accepting {
    /// The id's token, to match the next event.
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// The QP. The peer may send as soon as it has the accept, so a receive can complete
    /// (on a CQ an event loop polls) before this side sees `ESTABLISHED`: match it by
    /// [`QueuePair::qp_num`] and answer once [`Accepting::complete`] gives the connection.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// Completes the handshake with the id's `ESTABLISHED` event, given by reference or by
    /// value. Any other event gives this state back in the [`StepError`], so an event loop
    /// loses nothing when it feeds it the wrong one.
    ///
    /// # Errors
    /// [`Error::UnexpectedEvent`](crate::Error::UnexpectedEvent) for any other event or an event of another id, with this
    /// state, unchanged (after `CONNECT_ERROR`, `UNREACHABLE` or `DISCONNECTED` the connection
    /// is over: drop it, which destroys the id).
    pub fn complete(self, ev: impl Borrow<CmEvent>) -> std::result::Result<Connection, StepError<Accepting>> {
        let ev = ev.borrow();
        if ev.event_type() != CmEventType::Established || ev.id() != self.id.handle() {
            let e = with_opt_addr(ev.unexpected("rdma_accept", CmEventType::Established), self.id.peer_addr());
            return Err(StepError::new(self, e));
        }
        Ok(Connection::new(self.id, self.qp, self.private_data, self.user))
    }
}

impl ConnParam {
    /// The parameters to accept `req` with as `rdma_accept(id, NULL)` would choose them: the
    /// responder resources and initiator depth the request asks for (its
    /// [`ConnectRequest::responder_resources`] and [`ConnectRequest::initiator_depth`], as seen
    /// from this side), each clamped to this device's limit (`max_qp_rd_atom`,
    /// `max_qp_init_rd_atom`) by librdmacm, which is what an explicit value over the limit
    /// would fail with (`EINVAL`). The other fields are the defaults (retries 7, no private
    /// data; add it with [`ConnParam::private_data`]); unlike `rdma_accept(id, NULL)`, the
    /// crate's `flow_control` (1) is sent. Since the depths' default is
    /// [`ConnParam::FROM_DEVICE`], this is [`ConnParam::new`]; the name says the intent.
    ///
    /// The clamping happens in `rdma_accept` against the values librdmacm stored for the
    /// accepted id, so the parameters follow whichever request they accept; `req` names the
    /// intent.
    ///
    /// ```no_run
    /// # fn f(req: rdma_cm::ConnectRequest, pd: &std::sync::Arc<rdma_cm::ProtectionDomain>) -> rdma_cm::Result<()> {
    /// let param = rdma_cm::ConnParam::from_request(&req).private_data(b"welcome")?;
    /// let conn = req.create_qp(pd, rdma_cm::QpInit::new())?.accept(&param, std::time::Duration::from_secs(5))?;
    /// # Ok(()) }
    /// ```
    pub fn from_request(req: &ConnectRequest) -> ConnParam {
        let _ = req;
        ConnParam::new().responder_resources(ConnParam::FROM_DEVICE).initiator_depth(ConnParam::FROM_DEVICE)
    }
}

#[cfg(feature = "tokio")]
impl Listener {
    /// [`Listener::get_request`] without blocking the runtime; the new id gets its own channel.
    ///
    /// # Errors
    /// [`crate::Error::UnexpectedEvent`] for any event but a connection request.
    pub async fn get_request_async(&self) -> Result<ConnectRequest> {
        let ev = self.id.channel().get_event_for_async(self.id.handle()).await?;
        if ev.event_type() != CmEventType::ConnectRequest {
            return Err(ev.unexpected("waiting for CONNECT_REQUEST", CmEventType::ConnectRequest));
        }
        ConnectRequest::build(ev, true)
    }
}

#[cfg(feature = "tokio")]
impl ServerQp {
    /// [`ServerQp::accept`] without blocking the runtime.
    ///
    /// # Errors
    /// As for [`ServerQp::accept`].
    pub async fn accept_async(self, param: &ConnParam) -> Result<Connection> {
        let id = std::sync::Arc::clone(&self.id);
        let _expecting = id.channel().expecting(id.handle());
        let acc = self.start_accept(param)?;
        let ev = expect_async(&acc.id, CmEventType::Established, "rdma_accept").await?;
        Ok(acc.complete(&ev)?)
    }
}
