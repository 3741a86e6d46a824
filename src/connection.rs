//! The connection typestates and the established [`Connection`].
//!
//! Each step consumes the previous state and returns the next, so a call out of order does
//! not compile:
//!
//! ```text
//! client: Client ─resolve_addr→ AddrResolved ─resolve_route→ RouteResolved ─create_qp→ ClientQp ─connect→ Connection
//! server: Server ─bind→ Bound ─listen→ Listener ─get_request→ ConnectRequest ─create_qp→ ServerQp ─accept→ Connection
//!                                                                      └─reject                └─reject
//! a QP the user made: RouteResolved / ConnectRequest ─attach_qp(UserQp)→ ClientQp / ServerQp (see crate::user_qp)
//! closing:            Connection ─shutdown→ Disconnecting (see crate::closing)
//! ```
//!
//! ```compile_fail
//! # fn f() -> rdma_cm::Result<()> {
//! use std::time::Duration;
//! // A client cannot connect before resolving the address and route and creating a QP.
//! let conn = rdma_cm::Client::new()?.connect(&rdma_cm::ConnParam::new(), Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # fn f() -> rdma_cm::Result<()> {
//! // A server cannot listen before binding.
//! let l = rdma_cm::Server::new()?.listen(8)?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # fn f(req: rdma_cm::ConnectRequest) -> rdma_cm::Result<()> {
//! use std::time::Duration;
//! // A request cannot be accepted before its QP exists.
//! let c = req.accept(&rdma_cm::ConnParam::new(), Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # fn f(l: rdma_cm::AddrResolved, pd: std::sync::Arc<rdma_cm::ProtectionDomain>) -> rdma_cm::Result<()> {
//! // A QP cannot be created before the route is resolved.
//! let q = l.create_qp(&pd, rdma_cm::QpInit::new())?;
//! # Ok(()) }
//! ```
//!
//! Before the connection exists, a QP takes receives only: a send, RDMA WRITE or READ posted
//! before `ESTABLISHED` is not something the typestates offer (on rxe such a post fails, yet the
//! provider keeps it and runs it after the connection is up).
//!
//! ```compile_fail
//! # fn f(mut q: rdma_cm::ClientQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
//! // A client cannot send before it is connected.
//! q.qp_mut().post_send(&[rdma_cm::SendWr::send(&mr, 0..8)])?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # fn f(mut q: rdma_cm::ServerQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
//! // Nor can a server before it has accepted.
//! q.qp_mut().post_send(&[rdma_cm::SendWr::send(&mr, 0..8)])?;
//! # Ok(()) }
//! ```
//!
//! Every blocking step takes a timeout ([`FOREVER`](crate::FOREVER) waits without one). The
//! blocking steps read only their own id's events ([`EventChannel::get_event_for`]), so ids may
//! share a channel: [`Client::new`] and [`Server::new`] create a channel per id, while
//! [`Client::on_channel`] and [`Server::on_channel`] put many ids on one, and
//! [`Listener::get_request`] moves each new id onto a channel of its own. An event loop that
//! serves many connections on one channel uses [`EventChannel::get_event`],
//! [`ConnectRequest::from_event`], [`ServerQp::start_accept`] and [`Accepting::complete`].

use std::borrow::Borrow;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::cm_id::{CmId, IdHandle};
use crate::device::VerbsContext;
use crate::error::{check_rdma, Error, Result};
use crate::event_channel::{CmEvent, CmEventType, EventChannel, PrivateData};
use crate::pd::ProtectionDomain;
use crate::qp::{Link, QpInit, QueuePair};
use crate::step::StepError;
use crate::user_qp::{self, UserQp};

/// Most private data `rdma_connect` carries on RC.
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Most private data `rdma_accept` carries on RC.
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
/// Most private data `rdma_reject` carries on IB/RoCE.
pub const MAX_REJECT_PRIVATE_DATA: usize = 148;

/// Connection parameters for connect and accept. Defaults follow the seed program:
/// responder_resources and initiator_depth 1, retry and RNR retry counts 7, no private data.
/// [`ConnParam::from_request`] takes the RDMA READ depths from the request instead, as
/// `rdma_accept(id, NULL)` does.
///
/// # Flow control
///
/// The crate always sends `flow_control = 1`, as the seed program did; there is no setter.
/// The field says whether this side's hardware does end-to-end flow control: the CM passes it
/// to the peer (it arrives in the peer's `CONNECT_REQUEST` or `ESTABLISHED`) and configures no
/// QP with it (`rdma_connect(3)`, `rdma_accept(3)`). rxe sends unlimited credits in every ACK
/// whatever the field says. `rdma_accept(id, NULL)` sends 0.
#[derive(Debug, Clone, Copy)]
pub struct ConnParam {
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    private_data: PrivateData,
    qp_num: u32,
}

impl Default for ConnParam {
    fn default() -> Self {
        ConnParam {
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            private_data: PrivateData::EMPTY,
            qp_num: 0,
        }
    }
}

impl ConnParam {
    /// The defaults.
    pub fn new() -> ConnParam {
        ConnParam::default()
    }
    /// librdmacm's "choose for me" value of [`ConnParam::responder_resources`] and
    /// [`ConnParam::initiator_depth`] (`RDMA_MAX_RESP_RES`, `RDMA_MAX_INIT_DEPTH`): on
    /// connect, the device's limit; on accept, the request's value, clamped to the device's
    /// limit.
    pub const FROM_DEVICE: u8 = 0xFF;

    /// The parameters to accept `req` with as `rdma_accept(id, NULL)` would choose them: the
    /// responder resources and initiator depth the request asks for (its
    /// [`ConnectRequest::responder_resources`] and [`ConnectRequest::initiator_depth`], as seen
    /// from this side), each clamped to this device's limit (`max_qp_rd_atom`,
    /// `max_qp_init_rd_atom`) by librdmacm, which is what an explicit value over the limit
    /// would fail with (`EINVAL`). The other fields are the defaults (retries 7, no private
    /// data; add it with [`ConnParam::private_data`]); unlike `rdma_accept(id, NULL)`, the
    /// crate's `flow_control` (1) is sent.
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

    /// Outstanding RDMA READs (and atomics) the peer may send us; [`ConnParam::FROM_DEVICE`]
    /// lets librdmacm choose. Over the device's limit, connect and accept fail with `EINVAL`.
    pub fn responder_resources(mut self, n: u8) -> Self {
        self.responder_resources = n;
        self
    }
    /// Outstanding RDMA READs (and atomics) we may send the peer; [`ConnParam::FROM_DEVICE`]
    /// lets librdmacm choose. Over the device's limit, connect and accept fail with `EINVAL`.
    pub fn initiator_depth(mut self, n: u8) -> Self {
        self.initiator_depth = n;
        self
    }
    /// Transport retries (0..=7). Meaningful in connect; the CM negotiates it for both sides.
    pub fn retry_count(mut self, n: u8) -> Self {
        self.retry_count = n.min(7);
        self
    }
    /// Receiver-not-ready retries (0..=7; 7 means retry forever) of the *peer's* sends: the
    /// value given to connect applies to the server's QP, the one given to accept to the
    /// client's.
    pub fn rnr_retry_count(mut self, n: u8) -> Self {
        self.rnr_retry_count = n.min(7);
        self
    }
    /// Private data for the peer. Its length is checked when it is used: at most 56 bytes for
    /// connect, 196 for accept.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] beyond 196 bytes.
    pub fn private_data(mut self, data: &[u8]) -> Result<Self> {
        if data.len() > MAX_ACCEPT_PRIVATE_DATA {
            return Err(too_long("private data", data.len(), MAX_ACCEPT_PRIVATE_DATA));
        }
        self.private_data = PrivateData::from_slice(data);
        Ok(self)
    }

    /// The QP number to send (`rdma_conn_param.qp_num`). Optional: the connection sends its
    /// QP's own number, for a QP librdmacm made and for a [`UserQp`] alike; a number set here
    /// must be that one, or connect and accept refuse it.
    pub fn qp_num(mut self, n: u32) -> Self {
        self.qp_num = n;
        self
    }

    pub(crate) fn qp_num_value(&self) -> u32 {
        self.qp_num
    }

    pub(crate) fn raw(&self, limit: usize, what: &str) -> Result<ffi::rdma_conn_param> {
        if self.private_data.len() > limit {
            return Err(too_long(what, self.private_data.len(), limit));
        }
        Ok(ffi::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 1,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: self.qp_num,
        })
    }
}

fn too_long(what: &str, len: usize, max: usize) -> Error {
    Error::InvalidArgument(format!("{what} is {len} bytes; at most {max} fit on RC"))
}

/// How a QP made through `rdma_create_qp` relates to its id: the id's channel lock serialises
/// its destruction with librdmacm's event processing (which uses `id->qp`), and the id's events
/// say when the peer left.
struct CmLink(Arc<CmId>);

impl Link for CmLink {
    fn destroy(&self, qp: *mut ffi::ibv_qp) -> i32 {
        // No event processing (which reads and modifies id->qp) runs between the destroy and
        // clearing id->qp.
        let _lock = self.0.channel().lock();
        // SAFETY: the QP is the id's, destroyed exactly once (QueuePair::drop calls this once).
        let ret = unsafe { ffi::ibv_destroy_qp(qp) };
        if ret == 0 {
            // SAFETY: the id is valid; clearing `qp` mirrors rdma_destroy_qp, so librdmacm
            // never uses the freed QP.
            unsafe { (*self.0.as_raw()).qp = std::ptr::null_mut() };
        }
        ret
    }

    fn watch_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        // Only while nothing but this id holds the channel: nobody else reads it, so watching
        // cannot keep an event from its owner's wait.
        self.0.channel().is_exclusive().then(|| self.0.channel().as_raw_fd())
    }

    #[cfg(feature = "tokio")]
    fn watch_reactor(&self) -> Option<&crate::wait::Reactor> {
        Some(self.0.channel().reactor())
    }

    fn peer_left(&self) -> Result<bool> {
        let me = self.0.handle();
        let mut left = false;
        // The events stay queued on the channel, so the connection's next_event still sees them.
        self.0.channel().pump(|ev| left |= ev.id() == me && is_peer_gone(ev))?;
        Ok(left)
    }

    fn disconnect(&self) -> Result<()> {
        self.0.disconnect()
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        self.0.peer_addr()
    }

    fn comm_established(&self) {
        // EISCONN (the CM saw the handshake complete first) and EINVAL (a transport whose CM
        // takes no notification) both leave nothing to do.
        let _ = self.0.notify(crate::AsyncEventKind::CommEstablished);
    }
}

pub(crate) fn is_peer_gone(ev: &CmEvent) -> bool {
    matches!(ev.event_type(), CmEventType::Disconnected | CmEventType::DeviceRemoval)
}

/// Creates the RC QP of `id` on `pd` through `rdma_create_qp`, so librdmacm drives its state
/// changes during connect/accept. Only the typestates call this, each consuming the state that
/// owns the id, so an id gets at most one QP.
pub(crate) fn create_qp_on(id: &Arc<CmId>, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<QueuePair> {
    if id.verbs().map(|v| v.as_ptr()) != Some(pd.context().as_raw()) {
        return Err(Error::InvalidArgument(format!(
            "the protection domain is on device {}, not on the device context of this connection's id (allocate it from the id: alloc_pd)",
            pd.context().device_name()
        )));
    }
    let block_self_mcast_lb = init.block_self_mcast_lb;
    QueuePair::create(
        pd,
        init,
        |attr| {
            // The channel's lock: no event processing reads id->qp while it is being set.
            let _lock = id.channel().lock();
            if block_self_mcast_lb {
                crate::multicast::create_qp_blocking_loopback(id, pd, attr)?;
            } else {
                crate::error::clear_errno();
                // SAFETY: id, PD and CQs are valid and on one device context (checked above and
                // in QueuePair::create; librdmacm checks the PD's context against the id's
                // too); attr is fully initialised.
                let ret = unsafe { ffi::rdma_create_qp(id.as_raw(), pd.as_raw(), attr) };
                check_rdma(ret, "rdma_create_qp")?;
            }
            // SAFETY: rdma_create_qp succeeded, so id->qp is the new QP.
            std::ptr::NonNull::new(unsafe { (*id.as_raw()).qp })
                .ok_or_else(|| Error::call("rdma_create_qp", libc::EIO, None))
        },
        Some(Arc::new(CmLink(Arc::clone(id))) as Arc<dyn Link>),
    )
}

/// Waits on `id`'s channel for `expected`; any other event becomes a clear error.
pub(crate) fn expect(id: &CmId, expected: CmEventType, op: &'static str, timeout: Duration) -> Result<CmEvent> {
    expect_watching(id, expected, op, timeout, None)
}

/// [`expect`], reading the device events of `ctx` meanwhile (see
/// `EventChannel::get_event_for_watching`).
pub(crate) fn expect_watching(
    id: &CmId,
    expected: CmEventType,
    op: &'static str,
    timeout: Duration,
    ctx: Option<&VerbsContext>,
) -> Result<CmEvent> {
    let peer = id.peer_addr();
    let got = match ctx {
        Some(ctx) => id.channel().get_event_for_watching(id.handle(), timeout, ctx),
        None => id.channel().get_event_for(id.handle(), timeout),
    };
    let ev = got.map_err(|e| match e {
        Error::Timeout { timeout, .. } => Error::Timeout { op, timeout, addr: peer, hint: expected_hint(expected) },
        e => e,
    })?;
    check_event(id, &ev, expected, op)?;
    Ok(ev)
}

/// Accepts `ev` if it is `expected` for `id`; turns anything else into a clear error.
pub(crate) fn check_event(id: &CmId, ev: &CmEvent, expected: CmEventType, op: &'static str) -> Result<()> {
    let peer = id.peer_addr();
    if ev.event_type() == expected && ev.id() == id.handle() {
        return Ok(());
    }
    // Resolution errors carry a negative errno: report them as the call that failed.
    if matches!(ev.event_type(), CmEventType::AddrError | CmEventType::RouteError) && ev.status() < 0 {
        let call = if ev.event_type() == CmEventType::AddrError { "rdma_resolve_addr" } else { "rdma_resolve_route" };
        return Err(Error::call(call, -ev.status(), peer));
    }
    let mut e = ev.unexpected(op, expected);
    if let Error::UnexpectedEvent { hint, got: CmEventType::Rejected, status, .. } = &mut e {
        *hint = Some(reject_hint(*status));
    }
    Err(match peer {
        Some(p) => e.with_addr(p),
        None => e,
    })
}

fn expected_hint(expected: CmEventType) -> Option<&'static str> {
    Some(match expected {
        CmEventType::AddrResolved => {
            "no answer from the RDMA address resolution: check `ip link`, `rdma link` and the GID table"
        }
        CmEventType::ConnectRequest => "no client connected in time",
        CmEventType::Established => {
            "the peer did not complete the handshake: is it running and reachable over RDMA (UDP 4791 for RoCEv2)?"
        }
        CmEventType::Disconnected => "the peer did not confirm the disconnect",
        _ => return None,
    })
}

/// IB CM reject reasons that matter (IBTA table 112); the iWARP CM reports a negated errno.
fn reject_hint(status: i32) -> &'static str {
    match status {
        8 => "nobody listens on that address and port (invalid service ID): is the server running, and is the port right?",
        28 => "the server refused the connection (consumer reject); its private data may say why",
        s if s == -libc::ECONNRESET || s == -libc::ECONNREFUSED => {
            "the server refused the connection (iWARP: an MPA reject, or the connection was closed during the handshake); its private data may say why"
        }
        _ => "the peer rejected the connection: is the server running on that port?",
    }
}

/// A fresh client id, not yet resolved.
#[derive(Debug)]
pub struct Client {
    pub(crate) id: CmId,
}

impl Client {
    /// Creates a client id on its own event channel.
    ///
    /// # Errors
    /// [`Error::NoDevice`] without RDMA support; [`Error::Call`] otherwise.
    pub fn new() -> Result<Client> {
        Client::on_channel(&EventChannel::new()?)
    }

    /// Creates a client id on `channel`, which other ids may share: each blocking step takes
    /// only this id's events and keeps the others' for their owners.
    ///
    /// # Errors
    /// As for [`Client::new`].
    pub fn on_channel(channel: &EventChannel) -> Result<Client> {
        Ok(Client { id: CmId::new(channel)? })
    }

    /// Resolves `dst` (and binds to `src` if given) within `timeout`.
    ///
    /// # Errors
    /// [`Error::Call`] with `ETIMEDOUT`/`EADDRNOTAVAIL` and a troubleshooting hint when no RDMA
    /// device answers for the address; [`Error::Timeout`].
    pub fn resolve_addr(self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<AddrResolved> {
        // Registered before the call, so no other reader of a shared channel takes the event.
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.start_resolve_addr(src, dst, timeout)?;
        // librdmacm reports ADDR_ERROR itself when its own timeout passes; allow for that.
        let wait = timeout.saturating_add(Duration::from_secs(1));
        expect(&self.id, CmEventType::AddrResolved, "rdma_resolve_addr", wait).map_err(|e| e.with_addr(dst))?;
        Ok(AddrResolved { id: self.id })
    }

    /// Binds the id to a local address first (`rdma_bind_addr`), which picks the device.
    ///
    /// # Errors
    /// [`Error::Call`] with `EADDRINUSE`/`EADDRNOTAVAIL` and a hint.
    pub fn bind(self, src: SocketAddr) -> Result<Client> {
        self.id.bind(src)?;
        Ok(self)
    }

    /// Starts resolving `dst` without waiting; the id's `ADDR_RESOLVED` event, read by an
    /// event loop, completes it ([`ResolvingAddr::complete`]). This is how many connections
    /// are set up at once on one channel (see `examples/cmtime.rs`).
    ///
    /// # Errors
    /// As for [`Client::resolve_addr`], without the waiting.
    pub fn start_resolve(self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<ResolvingAddr> {
        self.start_resolve_addr(src, dst, timeout)?;
        Ok(ResolvingAddr { id: self.id })
    }

    pub(crate) fn start_resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<()> {
        if dst.port() == 0 {
            return Err(Error::InvalidArgument(format!("destination {dst} has port 0")));
        }
        self.id.resolve_addr(src, dst, timeout)
    }

    /// The id.
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A client id whose address is resolved.
#[derive(Debug)]
pub struct AddrResolved {
    pub(crate) id: CmId,
}

/// A client whose address resolution is under way: feed its next event to
/// [`ResolvingAddr::complete`].
#[derive(Debug)]
pub struct ResolvingAddr {
    id: CmId,
}

impl ResolvingAddr {
    /// The id's token, to match events.
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// Starts the resolution again (after an `ADDR_ERROR`, say), as `rdma_resolve_addr`'s
    /// callers retry.
    ///
    /// # Errors
    /// As for [`Client::start_resolve`].
    pub fn retry(&self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<()> {
        self.id.resolve_addr(src, dst, timeout)
    }

    /// Completes the step with the id's `ADDR_RESOLVED` event (given by reference or by
    /// value). Any other event gives this state back in the [`StepError`]: after an
    /// `ADDR_ERROR`, [`ResolvingAddr::retry`] it and feed it the next event.
    ///
    /// # Errors
    /// [`Error::Call`] for an `ADDR_ERROR` (with the errno and hint);
    /// [`Error::UnexpectedEvent`] for any other event or another id's; either way with this
    /// state, unchanged.
    pub fn complete(self, ev: impl Borrow<CmEvent>) -> std::result::Result<AddrResolved, StepError<ResolvingAddr>> {
        match check_event(&self.id, ev.borrow(), CmEventType::AddrResolved, "rdma_resolve_addr") {
            Ok(()) => Ok(AddrResolved { id: self.id }),
            Err(e) => Err(StepError::new(self, e)),
        }
    }
}

/// A client whose route resolution is under way: feed its next event to
/// [`ResolvingRoute::complete`].
#[derive(Debug)]
pub struct ResolvingRoute {
    id: CmId,
}

impl ResolvingRoute {
    /// The id's token, to match events.
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// Starts the resolution again (after a `ROUTE_ERROR`, say).
    ///
    /// # Errors
    /// As for [`AddrResolved::start_resolve_route`].
    pub fn retry(&self, timeout: Duration) -> Result<()> {
        self.id.resolve_route(timeout)
    }

    /// Completes the step with the id's `ROUTE_RESOLVED` event (given by reference or by
    /// value). Any other event gives this state back in the [`StepError`]: after a
    /// `ROUTE_ERROR`, [`ResolvingRoute::retry`] it.
    ///
    /// # Errors
    /// As for [`ResolvingAddr::complete`] (`ROUTE_ERROR` names `rdma_resolve_route`).
    pub fn complete(self, ev: impl Borrow<CmEvent>) -> std::result::Result<RouteResolved, StepError<ResolvingRoute>> {
        match check_event(&self.id, ev.borrow(), CmEventType::RouteResolved, "rdma_resolve_route") {
            Ok(()) => Ok(RouteResolved { id: Arc::new(self.id) }),
            Err(e) => Err(StepError::new(self, e)),
        }
    }
}

/// The event that answers a connect: librdmacm turns the CM's `CONNECT_RESPONSE` into
/// `ESTABLISHED` only for a QP it made.
pub(crate) fn connected_event(user: bool) -> CmEventType {
    if user {
        CmEventType::ConnectResponse
    } else {
        CmEventType::Established
    }
}

/// Turns the answer to a connect into the connection; a [`UserQp`] is made ready to send and
/// the handshake completed (`rdma_establish`) first.
pub(crate) fn finish_connect(id: Arc<CmId>, qp: QueuePair, user: bool, ev: &CmEvent) -> Result<Connection> {
    if user {
        user_qp::establish(&id, &qp)?;
    }
    Ok(Connection::new(id, qp, *ev.private_data(), user))
}

/// A client whose connect is under way: feed its next event to [`Connecting::complete`].
#[derive(Debug)]
pub struct Connecting {
    id: Arc<CmId>,
    qp: QueuePair,
    user: bool,
}

impl Connecting {
    /// The id's token, to match events.
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// Completes the connection with the id's `ESTABLISHED` event (`CONNECT_RESPONSE` for a
    /// [`UserQp`], which this then moves to RTR and RTS before `rdma_establish`), given by
    /// reference or by value. Any other event gives this state back in the [`StepError`].
    ///
    /// # Errors
    /// [`Error::UnexpectedEvent`] naming `REJECTED`, `UNREACHABLE` or `CONNECT_ERROR` with a
    /// hint, or another id's event (the state can take the right event later; after
    /// `REJECTED` or `UNREACHABLE` the connect is over: drop it); for a [`UserQp`],
    /// [`Error::Call`] naming the `rdma_init_qp_attr`, `ibv_modify_qp` or `rdma_establish`
    /// call that failed. Each with this state, unchanged.
    pub fn complete(self, ev: impl Borrow<CmEvent>) -> std::result::Result<Connection, StepError<Connecting>> {
        let ev = ev.borrow();
        if let Err(e) = check_event(&self.id, ev, connected_event(self.user), "rdma_connect") {
            return Err(StepError::new(self, e));
        }
        if self.user {
            if let Err(e) = user_qp::establish(&self.id, &self.qp) {
                return Err(StepError::new(self, e));
            }
        }
        Ok(Connection::new(self.id, self.qp, *ev.private_data(), self.user))
    }
}

impl AddrResolved {
    /// Starts resolving the route without waiting ([`ResolvingRoute::complete`] finishes it).
    ///
    /// # Errors
    /// As for [`AddrResolved::resolve_route`], without the waiting.
    pub fn start_resolve_route(self, timeout: Duration) -> Result<ResolvingRoute> {
        self.id.resolve_route(timeout).map_err(|e| with_opt_addr(e, self.id.peer_addr()))?;
        Ok(ResolvingRoute { id: self.id })
    }

    /// Resolves the route within `timeout`.
    ///
    /// # Errors
    /// [`Error::Call`] or [`Error::UnexpectedEvent`] (`ROUTE_ERROR`), [`Error::Timeout`].
    pub fn resolve_route(self, timeout: Duration) -> Result<RouteResolved> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.id.resolve_route(timeout).map_err(|e| with_opt_addr(e, self.id.peer_addr()))?;
        let wait = timeout.saturating_add(Duration::from_secs(1));
        expect(&self.id, CmEventType::RouteResolved, "rdma_resolve_route", wait)?;
        Ok(RouteResolved { id: Arc::new(self.id) })
    }

    /// The id.
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

pub(crate) fn with_opt_addr(e: Error, a: Option<SocketAddr>) -> Error {
    match a {
        Some(a) => e.with_addr(a),
        None => e,
    }
}

pub(crate) fn context_of(id: &Arc<CmId>) -> Result<VerbsContext> {
    id.context().ok_or(Error::NoDevice { op: "rdma_cm_id.verbs", addr: id.peer_addr() })
}

/// A client id with a route: allocate the PD, register memory, then create the QP.
#[derive(Debug)]
pub struct RouteResolved {
    pub(crate) id: Arc<CmId>,
}

impl RouteResolved {
    /// The device context the route runs over: librdmacm's context of the device, which holds
    /// no id, so PDs and CQs made on it may serve other connections and outlive this one (see
    /// [`crate::cm_device`]).
    ///
    /// # Errors
    /// [`Error::NoDevice`] if the id has no device (cannot happen after route resolution), or
    /// [`Error::Call`] when `rdma_get_devices` fails.
    pub fn context(&self) -> Result<VerbsContext> {
        context_of(&self.id)
    }

    /// Allocates a PD on the route's device.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_alloc_pd` fails.
    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>> {
        ProtectionDomain::new(&self.context()?)
    }

    /// Creates the RC QP (and its CQs unless `init` supplies them). An id has at most one QP:
    /// this consumes the route, and [`ClientQp::destroy_qp`] gives it back.
    ///
    /// # Errors
    /// [`Error::Call`] (`rdma_create_qp`, with the device-limits hint),
    /// [`Error::InvalidArgument`] when `pd` or a CQ belongs to another device.
    pub fn create_qp(self, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<ClientQp> {
        let qp = create_qp_on(&self.id, pd, init)?;
        Ok(ClientQp { id: self.id, qp, user: false })
    }

    /// Takes a QP the user created ([`UserQp`], as `rping -q` does) instead of creating one,
    /// and moves it to INIT with the route's attributes (`rdma_init_qp_attr`,
    /// `ibv_modify_qp`). The connect then sends its number and moves it to RTR and RTS when the
    /// peer answers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the QP is not on the route's device context;
    /// [`Error::Call`] when `rdma_init_qp_attr` or `ibv_modify_qp` fails.
    pub fn attach_qp(self, qp: UserQp) -> Result<ClientQp> {
        let qp = qp.attach(&self.id)?;
        Ok(ClientQp { id: self.id, qp, user: true })
    }

    /// The id.
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A client with its QP: post receives now, then connect.
#[derive(Debug)]
pub struct ClientQp {
    pub(crate) id: Arc<CmId>,
    pub(crate) qp: QueuePair,
    /// The QP is a [`UserQp`]: this crate, not librdmacm, moves it through its states.
    pub(crate) user: bool,
}

impl ClientQp {
    /// The id, for its options: [`CmId::set_ack_timeout`] takes effect when set before
    /// connecting.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The QP, to read its number and capabilities. Before the connection exists it takes
    /// receives only ([`ClientQp::post_recv`]).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// Posts receives before connecting, so the peer's first message has somewhere to land.
    ///
    /// # Errors
    /// As for [`QueuePair::post_recv`].
    pub fn post_recv(&mut self, wrs: &[crate::RecvWr<'_>]) -> Result<()> {
        self.qp.post_recv(wrs)
    }

    /// Destroys the QP (flushing any posted receives) and returns the route, e.g. to create
    /// a QP with other capabilities.
    pub fn destroy_qp(self) -> RouteResolved {
        drop(self.qp);
        RouteResolved { id: self.id }
    }

    /// Connects (`rdma_connect`) and waits for `ESTABLISHED`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for private data over 56 bytes; [`Error::UnexpectedEvent`]
    /// naming `REJECTED`, `UNREACHABLE` or `CONNECT_ERROR` with a hint; [`Error::Timeout`].
    pub fn connect(self, param: &ConnParam, timeout: Duration) -> Result<Connection> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.start_connect(param)?;
        let ev = expect(&self.id, connected_event(self.user), "rdma_connect", timeout)?;
        finish_connect(self.id, self.qp, self.user, &ev)
    }

    /// Connects without waiting; feed the id's next event to [`Connecting::complete`].
    ///
    /// # Errors
    /// As for [`ClientQp::connect`], without the waiting.
    pub fn start(self, param: &ConnParam) -> Result<Connecting> {
        self.start_connect(param)?;
        Ok(Connecting { id: self.id, qp: self.qp, user: self.user })
    }

    pub(crate) fn start_connect(&self, param: &ConnParam) -> Result<()> {
        let mut raw = param.raw(MAX_CONNECT_PRIVATE_DATA, "connect private data")?;
        raw.qp_num = user_qp::qp_num_for(param, &self.qp)?;
        raw.srq = u8::from(self.qp.srq().is_some());
        let peer = self.id.peer_addr();
        // SAFETY: the id is valid with a route and a QP; `raw` and its private data (inside
        // `param`) outlive the call, which copies them.
        check_rdma(unsafe { ffi::rdma_connect(self.id.as_raw(), &mut raw) }, "rdma_connect")
            .map_err(|e| with_opt_addr(e, peer))
    }
}

/// A fresh server id, not yet bound.
#[derive(Debug)]
pub struct Server {
    id: CmId,
}

impl Server {
    /// Creates a server id on its own event channel.
    ///
    /// # Errors
    /// [`Error::NoDevice`] without RDMA support; [`Error::Call`] otherwise.
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
    /// [`Error::Call`] with `EADDRINUSE` or `EADDRNOTAVAIL` and a hint.
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
    /// [`Error::Call`] when `rdma_listen` fails (`EADDRINUSE`: the port is taken).
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
    /// [`Error::Timeout`]; [`Error::UnexpectedEvent`] for any other event.
    pub fn get_request(&self, timeout: Duration) -> Result<ConnectRequest> {
        ConnectRequest::build(expect_any_request(&self.id, timeout)?, true)
    }

    /// The bound address (with the chosen port when bound to port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// librdmacm's context of the device this listener is bound to, which holds no id (see
    /// [`crate::cm_device`]): make the PD, CQs and SRQ that the accepted connections will
    /// share on it before the first request arrives. [`ConnectRequest::context`] returns the
    /// same context for requests on that device.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when the listener is bound to a wildcard address (`0.0.0.0`, `[::]`),
    /// which is on no device (bind to the device's address, or use
    /// [`VerbsContext::cm_for_addr`] / [`VerbsContext::cm_open`]); [`Error::Call`] when
    /// `rdma_get_devices` fails.
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

pub(crate) fn expect_any_request(listener: &CmId, timeout: Duration) -> Result<CmEvent> {
    let ev = listener.channel().get_event_for(listener.handle(), timeout).map_err(|e| match e {
        Error::Timeout { timeout, .. } => Error::Timeout {
            op: "waiting for CONNECT_REQUEST",
            timeout,
            addr: listener.local_addr(),
            hint: expected_hint(CmEventType::ConnectRequest),
        },
        e => e,
    })?;
    if ev.event_type() == CmEventType::ConnectRequest {
        Ok(ev)
    } else {
        Err(ev.unexpected("waiting for CONNECT_REQUEST", CmEventType::ConnectRequest))
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
    /// [`Error::UnexpectedEvent`] for any other event, which the [`StepError`] gives back
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

    /// RDMA READs the peer may have outstanding towards us.
    pub fn initiator_depth(&self) -> u8 {
        self.initiator_depth
    }

    /// RDMA READs the peer accepts from us.
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
    /// [`Error::InvalidArgument`] for too much data; [`Error::Call`] when `rdma_reject` fails.
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        reject(&self.id, private_data)
    }

    /// Creates the QP on the request's device (after registering memory on `pd`).
    ///
    /// # Errors
    /// As for [`RouteResolved::create_qp`].
    pub fn create_qp(self, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<ServerQp> {
        let qp = create_qp_on(&self.id, pd, init)?;
        Ok(ServerQp { id: self.id, qp, private_data: self.private_data, user: false })
    }

    /// Takes a QP the user created ([`UserQp`]) instead of creating one, and moves it to INIT
    /// with the request's attributes; the accept moves it to RTR and RTS before
    /// `rdma_accept` and sends its number.
    ///
    /// # Errors
    /// As for [`RouteResolved::attach_qp`].
    pub fn attach_qp(self, qp: UserQp) -> Result<ServerQp> {
        let qp = qp.attach(&self.id)?;
        Ok(ServerQp { id: self.id, qp, private_data: self.private_data, user: true })
    }

    /// Allocates a PD on the request's device.
    ///
    /// # Errors
    /// [`Error::NoDevice`], or [`Error::Call`] when `ibv_alloc_pd` fails.
    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>> {
        ProtectionDomain::new(&self.context()?)
    }

    /// The device context of the request: librdmacm's context of the device, which holds no
    /// id (see [`crate::cm_device`]). PDs, CQs and SRQs made from it may serve this and later
    /// connections on the same device, and outlive this request's connection: dropping the
    /// connection destroys its id even while they live.
    ///
    /// # Errors
    /// [`Error::NoDevice`] if the request has no device (cannot happen for a request), or
    /// [`Error::Call`] when `rdma_get_devices` fails.
    pub fn context(&self) -> Result<VerbsContext> {
        context_of(&self.id)
    }
}

fn reject(id: &CmId, data: &[u8]) -> Result<()> {
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
    /// The QP is a [`UserQp`].
    pub(crate) user: bool,
}

impl ServerQp {
    /// The id, for its options: [`CmId::set_ack_timeout`] takes effect when set before
    /// accepting.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The QP, to read its number and capabilities. Before the connection exists it takes
    /// receives only ([`ServerQp::post_recv`]).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// Posts receives before accepting, so the peer's first message has somewhere to land.
    ///
    /// # Errors
    /// As for [`QueuePair::post_recv`].
    pub fn post_recv(&mut self, wrs: &[crate::RecvWr<'_>]) -> Result<()> {
        self.qp.post_recv(wrs)
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
    /// [`Error::InvalidArgument`] for private data over 196 bytes; [`Error::UnexpectedEvent`];
    /// [`Error::Timeout`].
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
        let mut raw = param.raw(MAX_ACCEPT_PRIVATE_DATA, "accept private data")?;
        raw.qp_num = user_qp::qp_num_for(param, &self.qp)?;
        raw.srq = u8::from(self.qp.srq().is_some());
        if self.user {
            // librdmacm moves only its own QP to RTR and RTS inside rdma_accept.
            user_qp::ready(&self.id, &self.qp, raw.responder_resources, raw.initiator_depth)?;
        }
        // SAFETY: the id is a pending request with a QP; `raw` and its private data outlive
        // the call, which copies them.
        check_rdma(unsafe { ffi::rdma_accept(self.id.as_raw(), &mut raw) }, "rdma_accept")
            .map_err(|e| with_opt_addr(e, self.id.peer_addr()))?;
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
    /// [`Error::UnexpectedEvent`] for any other event or an event of another id, with this
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

/// An established RC connection: the QP for the data path, and the id for its events.
pub struct Connection {
    // Dropped first (after Drop::drop disconnects): the QP holds its own Arc of the id.
    pub(crate) qp: QueuePair,
    pub(crate) id: Arc<CmId>,
    peer_private_data: PrivateData,
    /// We called rdma_disconnect.
    pub(crate) disconnected: bool,
    /// The QP is a [`UserQp`]: a disconnect moves it to ERR itself.
    pub(crate) user_qp: bool,
}

impl Connection {
    pub(crate) fn new(id: Arc<CmId>, mut qp: QueuePair, peer_private_data: PrivateData, user_qp: bool) -> Connection {
        qp.set_connected();
        Connection { qp, id, peer_private_data, disconnected: false, user_qp }
    }

    /// `rdma_disconnect`, after moving a [`UserQp`] to ERR (librdmacm does that only for its
    /// own QPs).
    pub(crate) fn send_disconnect(&self) -> Result<()> {
        if self.user_qp {
            user_qp::to_error(&self.qp)?;
        }
        self.id.disconnect()
    }

    /// The QP.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The QP, for posting and polling.
    pub fn qp_mut(&mut self) -> &mut QueuePair {
        &mut self.qp
    }

    /// The id.
    pub fn id(&self) -> &Arc<CmId> {
        &self.id
    }

    /// The private data the peer sent with its request (server side) or its accept (client
    /// side). Untrusted, and zero-padded by the CM.
    pub fn peer_private_data(&self) -> &PrivateData {
        &self.peer_private_data
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// Returns the connection's next CM event without waiting (e.g. `DISCONNECTED` when the
    /// peer left). Other ids' events on a shared channel stay there for their owners.
    ///
    /// # Errors
    /// [`Error::Call`] when reading the channel fails.
    pub fn try_event(&mut self) -> Result<Option<CmEvent>> {
        let ev = self.id.channel().try_get_event_for(self.id.handle())?;
        if let Some(ev) = &ev {
            self.handle_event(ev);
        }
        Ok(ev)
    }

    /// Waits up to `timeout` for the connection's next CM event, e.g. the peer's
    /// `DISCONNECTED`. Other ids' events on a shared channel stay there for their owners.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::Call`] when reading the channel fails.
    pub fn next_event(&mut self, timeout: Duration) -> Result<CmEvent> {
        let ev = self.id.channel().get_event_for(self.id.handle(), timeout)?;
        self.handle_event(&ev);
        Ok(ev)
    }

    /// Feeds an event of this connection's id, read from a shared channel by an event loop.
    /// A `DISCONNECTED` (the peer left) is answered here: `rdma_disconnect` sends the CM's
    /// reply the peer's disconnect waits for, and moves the QP to the error state, which
    /// flushes its posted work (see "Disconnects" in the crate docs). Events of other ids are
    /// ignored.
    pub fn handle_event(&mut self, ev: &CmEvent) {
        if ev.id() == self.id.handle() && is_peer_gone(ev) {
            self.qp.peer_gone();
        }
    }

    /// Whether the peer disconnected (a `DISCONNECTED` event was seen).
    pub fn is_disconnected(&self) -> bool {
        self.qp.peer_left()
    }

    /// Starts a disconnect without waiting (`rdma_disconnect`; the QP goes to the error state):
    /// the id's `DISCONNECTED` follows, for an event loop to read. Returns whether it was sent.
    ///
    /// `Ok(false)` means there was nothing to send: either the peer left first (its
    /// `DISCONNECTED` was seen, [`Connection::is_disconnected`] is true, and the connection
    /// answered it then, so no `DISCONNECTED` is to come), or this side disconnected before
    /// (the `DISCONNECTED` that answers it is still to come unless seen already). The QP is
    /// in the error state either way.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_disconnect` fails.
    pub fn start_disconnect(&mut self) -> Result<bool> {
        if self.disconnected || self.qp.peer_left() {
            self.disconnected = true;
            return Ok(false);
        }
        self.send_disconnect()?;
        self.disconnected = true;
        self.qp.set_closing();
        Ok(true)
    }

    /// Disconnects and waits up to `timeout` for the `DISCONNECTED` event, reporting errors
    /// that Drop would only print. The QP is destroyed before the wait, once its flushed work
    /// is reaped ([`Connection::shutdown`]), so its teardown overlaps the peer's answer.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_disconnect` fails; [`Error::Timeout`].
    pub fn disconnect(self, timeout: Duration) -> Result<()> {
        let id = Arc::clone(&self.id);
        // Registered before the disconnect, so no other reader of a shared channel takes the
        // DISCONNECTED meant for this wait.
        let _expecting = id.channel().expecting(id.handle());
        self.shutdown()?.wait(timeout)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !self.disconnected && !self.qp.peer_left() {
            // Best effort: the peer learns we left. Failure (already disconnected) is harmless.
            let _ = self.send_disconnect();
        }
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .field("qp", &self.qp)
            .finish()
    }
}
