//! Connecting to a server: the client's typestates [`Client`] → [`AddrResolved`] →
//! [`RouteResolved`] → [`ClientQp`] → [`Connection`] (or, with a lane, [`LaneClient`](crate::LaneClient)),
//! the event-loop steps between them ([`ResolvingAddr`], [`ResolvingRoute`], [`Connecting`]),
//! and their async twins (feature `tokio`). See [`crate::cm::connection`] for the whole state
//! machine.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::Lane;
//! use rdma_cm::{Client, ConnParam, QpInit};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let addr = Client::new()?.resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?;
//! let route = addr.resolve_route(t)?; // the device and port the connection will use
//! let pd = route.alloc_pd()?;
//! let mut lane = Lane::new(&route.context()?, 64)?;
//! let client = route.lane_qp(&mut lane, &pd, QpInit::new())?;
//! let qp = client.qp();
//! let reply = client.connect(&mut lane, &ConnParam::new(), t)?; // the server's private data
//! println!("connected; the server sent {} bytes", reply.len());
//! lane.disconnect(qp, t)?;
//! # Ok(()) }
//! ```

use std::borrow::Borrow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::cm::adopt;
use crate::cm::cm_id::{CmId, IdHandle};
use crate::cm::cm_qp::create_qp_on;
use crate::cm::conn_param::{apply_min_rnr_timer, ConnParam, MAX_CONNECT_PRIVATE_DATA};
use crate::cm::connection::Connection;
use crate::cm::event_channel::{CmEvent, CmEventType, EventChannel};
#[cfg(feature = "tokio")]
use crate::cm::expect::expect_async;
use crate::cm::expect::{check_event, context_of, expect, with_opt_addr};
use crate::cm::step::StepError;
use crate::error::{check_rdma, Error, Result};
use crate::verbs::device::VerbsContext;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::UnconnectedQp;
use crate::verbs::qp::{QpInit, QueuePair};

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

/// A client id with a route: allocate the PD, register memory, then create the QP.
#[derive(Debug)]
pub struct RouteResolved {
    pub(crate) id: Arc<CmId>,
}

impl RouteResolved {
    /// The device context the route runs over: librdmacm's context of the device, which holds
    /// no id, so PDs and CQs made on it may serve other connections and outlive this one (see
    /// [`crate::cm::cm_id`]).
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

    /// Adopts a QP the verbs wing made ([`UnconnectedQp`], as `rping -q` creates its own)
    /// instead of creating one, and moves it to INIT with the route's attributes
    /// (`rdma_init_qp_attr`, `ibv_modify_qp`): from RESET ([`UnconnectedQp::new_reset`]), or
    /// INIT again ([`UnconnectedQp::new`], whose posted receives stay posted). The connect then
    /// sends its number and moves it to RTR and RTS when the peer answers; a disconnect moves
    /// it to ERR. See [`crate::cm::adopt`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the QP is not on the route's device context;
    /// [`Error::Call`] when `rdma_init_qp_attr` or `ibv_modify_qp` fails. The QP is dropped
    /// (flushed and destroyed) either way.
    pub fn adopt_qp(self, qp: UnconnectedQp) -> Result<ClientQp> {
        let qp = adopt::adopt(qp, &self.id)?;
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
    /// The QP was adopted ([`RouteResolved::adopt_qp`]): this crate, not librdmacm, moves it
    /// through its states.
    pub(crate) user: bool,
}

impl ClientQp {
    /// The id, for its options: [`CmId::set_ack_timeout`] takes effect when set before
    /// connecting.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The QP, to read its number and capabilities.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// Destroys the QP (flushing any posted receives) and returns the route, e.g. to create
    /// a QP with other capabilities.
    pub fn destroy_qp(self) -> RouteResolved {
        drop(self.qp);
        RouteResolved { id: self.id }
    }

    /// Connects (`rdma_connect`) and waits for `ESTABLISHED`, all within `timeout`.
    ///
    /// On iWARP, `rdma_connect` itself makes the TCP connection and blocks in the kernel until
    /// TCP gives up (Soft-iWARP: a blocking connect, about two minutes of SYN retries to an
    /// address nobody answers for). So there the call is made on a helper thread: when
    /// `timeout` passes first, this returns [`Error::Timeout`], and the thread keeps the id and
    /// the QP (with the buffers posted on it) until the kernel returns, then destroys them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for private data over 56 bytes; [`Error::UnexpectedEvent`]
    /// naming `REJECTED`, `UNREACHABLE` or `CONNECT_ERROR` with a hint; [`Error::Timeout`].
    pub fn connect(self, param: &ConnParam, timeout: Duration) -> Result<Connection> {
        let start = Instant::now();
        let _expecting = self.id.channel().expecting(self.id.handle());
        let this = if self.id.is_iwarp() { self.start_connect_within(param, timeout)? } else { self.started(param)? };
        // The event's wait gets what the call left of the timeout.
        let left = timeout.saturating_sub(start.elapsed());
        let ev = expect(&this.id, connected_event(&this.id, this.user), "rdma_connect", left)?;
        finish_connect(this.id, this.qp, this.user, &ev, param.min_rnr_timer_value())
    }

    fn started(self, param: &ConnParam) -> Result<ClientQp> {
        self.start_connect(param)?;
        Ok(self)
    }

    /// `rdma_connect` on a helper thread ([`HelperCall`]), waited for up to `timeout` (see
    /// [`ClientQp::connect`]). When the time passes first, the thread keeps `self` and drops it
    /// once `rdma_connect` has returned, so nothing the call uses is freed under it.
    fn start_connect_within(self, param: &ConnParam, timeout: Duration) -> Result<ClientQp> {
        let start = Instant::now();
        adopt::qp_num_for(param, &self.qp)?;
        let peer = self.id.peer_addr();
        let call = match self.connect_on_helper(*param) {
            Ok(call) => call,
            // No thread to be had: the call, unbounded, as on every other transport.
            Err(back) => return back.0.started(param),
        };
        let mut h = crate::wait::lock(&call.state);
        loop {
            if let Some(answer) = h.answer() {
                return answer;
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(Error::Timeout {
                    op: "rdma_connect",
                    timeout,
                    addr: peer,
                    hint: Some("iWARP's TCP connect, made inside rdma_connect, got no answer: is the peer running and reachable over RDMA (the address of its RDMA netdev; `ip route get`)?"),
                });
            }
            h = call.cv.wait_timeout(h, left).map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Starts `rdma_connect` on a helper thread ([`HelperCall`]), which owns `self` for the
    /// call; gives `self` back, with the error, when no thread can be had.
    fn connect_on_helper(
        self,
        param: ConnParam,
    ) -> std::result::Result<Arc<HelperCall>, Box<(ClientQp, std::io::Error)>> {
        let call = Arc::new(HelperCall { state: Default::default(), cv: Default::default() });
        let ended = Ended(Arc::clone(&call));
        // `self` goes to the thread once it runs: a failed spawn leaves it here.
        let (give, take) = std::sync::mpsc::sync_channel::<ClientQp>(1);
        let spawned = std::thread::Builder::new().name("rdma_connect (iWARP)".into()).spawn(move || {
            let ended = ended;
            let Ok(this) = take.recv() else { return };
            let r = this.start_connect(&param);
            crate::wait::lock(&ended.0.state).done = Some((this, r));
        });
        if let Err(e) = spawned {
            return Err(Box::new((self, e)));
        }
        // The thread holds the receiver until it has `self`, so this succeeds.
        give.send(self).map_err(|back| Box::new((back.0, std::io::Error::from_raw_os_error(libc::EPIPE))))?;
        Ok(call)
    }

    /// Connects without waiting; feed the id's next event to [`Connecting::complete`].
    /// On iWARP `rdma_connect` makes the TCP connection itself and may block until TCP gives
    /// up (see [`ClientQp::connect`]).
    ///
    /// # Errors
    /// As for [`ClientQp::connect`], without the waiting.
    pub fn start(self, param: &ConnParam) -> Result<Connecting> {
        self.start_connect(param)?;
        Ok(Connecting { id: self.id, qp: self.qp, user: self.user, min_rnr_timer: param.min_rnr_timer_value() })
    }

    pub(crate) fn start_connect(&self, param: &ConnParam) -> Result<()> {
        let qp_num = adopt::qp_num_for(param, &self.qp)?;
        rdma_connect_with(&self.id, param, qp_num, self.qp.srq().is_some())
    }
}

/// `rdma_connect` of `id` with `param`, sending `qp_num` (the id's QP: checked by the caller
/// with `adopt::qp_num_for`).
pub(crate) fn rdma_connect_with(id: &CmId, param: &ConnParam, qp_num: u32, srq: bool) -> Result<()> {
    let mut raw = param.raw(MAX_CONNECT_PRIVATE_DATA, "connect private data")?;
    raw.qp_num = qp_num;
    raw.srq = u8::from(srq);
    let peer = id.peer_addr();
    // SAFETY: the id is valid with a route, and its QP is `qp_num`'s (made by librdmacm, or
    // adopted); `raw` and its private data (inside `param`) outlive the call, which copies
    // them.
    check_rdma(unsafe { ffi::rdma_connect(id.as_raw(), &mut raw) }, "rdma_connect").map_err(|e| with_opt_addr(e, peer))
}

/// Whether the crate moves the client's QP to RTS and completes the handshake itself: a
/// QP the id adopted, on InfiniBand's CM. On iWARP the kernel's CM does both for any QP.
fn crate_drives(id: &CmId, user: bool) -> bool {
    user && !id.is_iwarp()
}

/// The event that answers a connect: librdmacm turns the CM's `CONNECT_RESPONSE` into
/// `ESTABLISHED` only for a QP it made; on iWARP the kernel reports `ESTABLISHED` for any.
pub(crate) fn connected_event(id: &CmId, user: bool) -> CmEventType {
    if crate_drives(id, user) {
        CmEventType::ConnectResponse
    } else {
        CmEventType::Established
    }
}

/// Turns the answer to a connect into the connection; an adopted QP is made ready to send and
/// the handshake completed (`rdma_establish`) first, except on iWARP, whose kernel CM has done
/// both.
pub(crate) fn finish_connect(
    id: Arc<CmId>,
    qp: QueuePair,
    user: bool,
    ev: &CmEvent,
    min_rnr_timer: Option<u8>,
) -> Result<Connection> {
    ready_to_send(&id, &qp, user, min_rnr_timer)?;
    Ok(Connection::new(id, qp, *ev.private_data(), user))
}

/// An answered connect's last steps on this side: an adopted QP moved to RTS and the RTU sent
/// (with the RNR timer set at RTR), or librdmacm's QP given the RNR timer in RTS.
pub(crate) fn ready_to_send(id: &CmId, qp: &QueuePair, user: bool, min_rnr_timer: Option<u8>) -> Result<()> {
    if crate_drives(id, user) {
        adopt::establish(id, qp, min_rnr_timer)
    } else {
        apply_min_rnr_timer(id, qp, min_rnr_timer)
    }
}

/// A client whose connect is under way: feed its next event to [`Connecting::complete`].
#[derive(Debug)]
pub struct Connecting {
    id: Arc<CmId>,
    qp: QueuePair,
    user: bool,
    min_rnr_timer: Option<u8>,
}

impl Connecting {
    /// The id's token, to match events.
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// Completes the connection with the id's `ESTABLISHED` event (`CONNECT_RESPONSE` for an
    /// adopted QP on InfiniBand or RoCE, which this then moves to RTR and RTS before
    /// `rdma_establish`; on iWARP the kernel's CM does that, and reports `ESTABLISHED`), given by
    /// reference or by value. Any other event gives this state back in the [`StepError`].
    ///
    /// # Errors
    /// [`Error::UnexpectedEvent`] naming `REJECTED`, `UNREACHABLE` or `CONNECT_ERROR` with a
    /// hint, or another id's event (the state can take the right event later; after
    /// `REJECTED` or `UNREACHABLE` the connect is over: drop it); for an adopted QP,
    /// [`Error::Call`] naming the `rdma_init_qp_attr`, `ibv_modify_qp` or `rdma_establish`
    /// call that failed. Each with this state, unchanged.
    pub fn complete(self, ev: impl Borrow<CmEvent>) -> std::result::Result<Connection, StepError<Connecting>> {
        let ev = ev.borrow();
        if let Err(e) = check_event(&self.id, ev, connected_event(&self.id, self.user), "rdma_connect") {
            return Err(StepError::new(self, e));
        }
        if let Err(e) = ready_to_send(&self.id, &self.qp, self.user, self.min_rnr_timer) {
            // After a refused RNR timer the connection is up (librdmacm sent the RTU): this
            // state cannot take the event again. Drop it, which disconnects.
            return Err(StepError::new(self, e));
        }
        Ok(Connection::new(self.id, self.qp, *ev.private_data(), self.user))
    }
}

#[cfg(feature = "tokio")]
impl Client {
    /// [`Client::resolve_addr`] without blocking the runtime.
    ///
    /// # Errors
    /// As for [`Client::resolve_addr`].
    pub async fn resolve_addr_async(
        self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<AddrResolved> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.start_resolve_addr(src, dst, timeout)?;
        expect_async(&self.id, CmEventType::AddrResolved, "rdma_resolve_addr").await.map_err(|e| e.with_addr(dst))?;
        Ok(AddrResolved { id: self.id })
    }
}

#[cfg(feature = "tokio")]
impl AddrResolved {
    /// [`AddrResolved::resolve_route`] without blocking the runtime.
    ///
    /// # Errors
    /// As for [`AddrResolved::resolve_route`].
    pub async fn resolve_route_async(self, timeout: Duration) -> Result<RouteResolved> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.id.resolve_route(timeout).map_err(|e| with_opt_addr(e, self.id.peer_addr()))?;
        expect_async(&self.id, CmEventType::RouteResolved, "rdma_resolve_route").await?;
        Ok(RouteResolved { id: std::sync::Arc::new(self.id) })
    }
}

#[cfg(feature = "tokio")]
impl ClientQp {
    /// [`ClientQp::connect`] without blocking the runtime. Bound it with the runtime's own
    /// timer (`tokio::time::timeout`): dropping the future gives up the connection (its id and
    /// QP are destroyed).
    ///
    /// On iWARP, where `rdma_connect` blocks in the kernel for the TCP connect (about two
    /// minutes of SYN retries when nobody answers), the call runs on a helper thread while
    /// the task waits, so no worker thread of the runtime is held. A future dropped before
    /// the call returned leaves the id and the QP to that thread, which destroys them once the
    /// kernel returns (as [`ClientQp::connect`] does at its timeout): until then each such
    /// connect holds a thread, its id, its QP and the buffers posted on it, so a loop of
    /// short retries to a peer that never answers holds that many. If the peer does answer
    /// meanwhile, the kernel completes the connection, which the destroy then tears down.
    ///
    /// # Errors
    /// As for [`ClientQp::connect`].
    pub async fn connect_async(self, param: &ConnParam) -> Result<Connection> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        let this =
            if self.id.is_iwarp() { self.start_connect_off_runtime(*param).await? } else { self.started(param)? };
        let ev = expect_async(&this.id, connected_event(&this.id, this.user), "rdma_connect").await?;
        finish_connect(this.id, this.qp, this.user, &ev, param.min_rnr_timer_value())
    }

    /// `rdma_connect` on a helper thread ([`HelperCall`]), awaited. When the future is
    /// dropped first, the thread keeps `self` and drops it once `rdma_connect` has returned.
    async fn start_connect_off_runtime(self, param: ConnParam) -> Result<ClientQp> {
        // What can be refused without the call is refused here, before the QP leaves: bad
        // private data, a QP the parameters do not fit, no runtime to wait on.
        param.raw(MAX_CONNECT_PRIVATE_DATA, "connect private data")?;
        adopt::qp_num_for(&param, &self.qp)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::InvalidArgument(
                "connect_async must be awaited inside a tokio runtime (on iWARP its rdma_connect runs on a helper thread while the task waits)".into(),
            ));
        }
        // No thread to be had: the call here would hold the runtime's thread for as long as TCP
        // tries, beyond any timer, so it is refused instead (ClientQp::start makes it blocking).
        let call = self.connect_on_helper(param).map_err(|back| {
            Error::call(
                "std::thread::spawn (rdma_connect's helper)",
                back.1.raw_os_error().unwrap_or(libc::EAGAIN),
                None,
            )
        })?;
        let mut answer = None;
        crate::wait::readable_any([None, None, None], |waker| {
            let mut h = crate::wait::lock(&call.state);
            answer = h.answer();
            if answer.is_none() {
                h.waker = Some(waker.clone());
            }
            answer.is_some()
        })
        .await?;
        // `readable_any` returned because `answer` is set.
        answer.unwrap_or_else(|| Err(Error::call("rdma_connect (its helper thread)", libc::EIO, None)))
    }
}

/// `rdma_connect` made on a helper thread, where the call may block for minutes (iWARP: a
/// blocking TCP connect in the kernel). The thread owns the [`ClientQp`] for the call and
/// leaves it, with the result, in `state`; whoever lets go of the call last (the waiter, or the
/// thread when the waiter gave up) drops it, so the id and the QP are destroyed only after
/// `rdma_connect` returned. Waited for by [`ClientQp::connect`] (the condition variable) and
/// [`ClientQp::connect_async`] (the waker).
struct HelperCall {
    state: std::sync::Mutex<Handoff>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct Handoff {
    done: Option<(ClientQp, Result<()>)>,
    /// The thread is done (answered, or unwound): a wait ends either way.
    ended: bool,
    #[cfg(feature = "tokio")]
    waker: Option<std::task::Waker>,
}

impl Handoff {
    /// The call's outcome, once the thread is done with it.
    fn answer(&mut self) -> Option<Result<ClientQp>> {
        if let Some((this, r)) = self.done.take() {
            return Some(r.map(|()| this));
        }
        // Only a panic ends the thread without an answer (the id and QP were dropped there).
        self.ended.then(|| Err(Error::call("rdma_connect (its helper thread panicked)", libc::EIO, None)))
    }
}

/// The helper thread's end, however it ends: says so and wakes the waiter.
struct Ended(Arc<HelperCall>);

impl Drop for Ended {
    fn drop(&mut self) {
        let mut h = crate::wait::lock(&self.0.state);
        h.ended = true;
        #[cfg(feature = "tokio")]
        let waker = h.waker.take();
        drop(h);
        self.0.cv.notify_all();
        #[cfg(feature = "tokio")]
        if let Some(w) = waker {
            w.wake();
        }
    }
}
