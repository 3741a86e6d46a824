//! The UD steps of the connection manager: [`UdClient`] → [`UdAddrResolved`] → [`UdRoute`] →
//! [`UdEndpoint`] on the client, [`UdServer`] → [`UdListener`] → [`UdRequest`] →
//! [`UdServerQp`] → [`UdEndpoint`] on the server. See [`crate::verbs::ud`] for the picture and the
//! data path.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::QpInit;
//! use rdma_cm::cm::ud_cm::UdClient;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let route = UdClient::new()?.resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?.resolve_route(t)?;
//! let pd = route.alloc_pd()?;
//! let mut endpoint = route.create_qp(&pd, QpInit::new())?;
//! let dest = endpoint.connect(b"hello", t)?; // the server's QP number, QKey and address handle
//! println!("the server's QP is {:#x}", dest.qpn());
//! // datagrams go to `dest` on a lane (`Lane::attach(endpoint)`): see crate::verbs::ud
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::cm::cm_id::CmId;
use crate::cm::cm_qp::create_qp_on;
use crate::cm::event_channel::{CmEventType, EventChannel, PrivateData};
use crate::cm::expect::{context_of, expect, expect_any_request, with_opt_addr};
use crate::error::{check_rdma, Error, Result};
use crate::verbs::device::VerbsContext;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::QpInit;
use crate::verbs::ud::{UdDest, UdQp, MAX_UD_PRIVATE_DATA};

/// The port space of a UD id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PortSpace {
    /// `RDMA_PS_UDP` (0x111): UD over IP addresses, what `udaddy` uses by default.
    #[default]
    Udp,
    /// `RDMA_PS_IPOIB` (0x2): the IPoIB port space.
    Ipoib,
}

impl PortSpace {
    /// The port space with this raw value (as `udaddy -p` takes it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for any other value.
    pub fn from_raw(v: u32) -> Result<PortSpace> {
        match v {
            ffi::rdma_port_space::RDMA_PS_UDP => Ok(PortSpace::Udp),
            ffi::rdma_port_space::RDMA_PS_IPOIB => Ok(PortSpace::Ipoib),
            v => Err(Error::InvalidArgument(format!(
                "port space {v:#x} is not a UD one: {:#x} for UDP, {:#x} for IPoIB",
                ffi::rdma_port_space::RDMA_PS_UDP,
                ffi::rdma_port_space::RDMA_PS_IPOIB
            ))),
        }
    }

    fn raw(self) -> ffi::rdma_port_space::Type {
        match self {
            PortSpace::Udp => ffi::rdma_port_space::RDMA_PS_UDP,
            PortSpace::Ipoib => ffi::rdma_port_space::RDMA_PS_IPOIB,
        }
    }
}

/// A fresh UD client id, not yet resolved.
#[derive(Debug)]
pub struct UdClient {
    id: CmId,
}

impl UdClient {
    /// Creates a UD client id (`RDMA_PS_UDP`) on its own event channel.
    ///
    /// # Errors
    /// [`Error::NoDevice`] without RDMA support; [`Error::Call`] otherwise.
    pub fn new() -> Result<UdClient> {
        UdClient::on_channel(&EventChannel::new()?, PortSpace::Udp)
    }

    /// Creates a UD client id of port space `ps` on `channel`.
    ///
    /// # Errors
    /// As for [`UdClient::new`].
    pub fn on_channel(channel: &EventChannel, ps: PortSpace) -> Result<UdClient> {
        Ok(UdClient { id: CmId::with_port_space(channel, ps.raw())? })
    }

    /// Resolves `dst` (binding to `src` if given) within `timeout`.
    ///
    /// # Errors
    /// As for [`Client::resolve_addr`](crate::Client::resolve_addr).
    pub fn resolve_addr(self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<UdAddrResolved> {
        if dst.port() == 0 {
            return Err(Error::InvalidArgument(format!("destination {dst} has port 0")));
        }
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.id.resolve_addr(src, dst, timeout)?;
        let wait = timeout.saturating_add(Duration::from_secs(1));
        expect(&self.id, CmEventType::AddrResolved, "rdma_resolve_addr", wait).map_err(|e| e.with_addr(dst))?;
        Ok(UdAddrResolved { id: Arc::new(self.id) })
    }

    /// The id, for options to set first ([`CmId::set_tos`], ...).
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A UD client whose address is resolved.
#[derive(Debug)]
pub struct UdAddrResolved {
    id: Arc<CmId>,
}

impl UdAddrResolved {
    /// Resolves the route within `timeout`.
    ///
    /// # Errors
    /// As for [`AddrResolved::resolve_route`](crate::AddrResolved::resolve_route).
    pub fn resolve_route(self, timeout: Duration) -> Result<UdRoute> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.id.resolve_route(timeout).map_err(|e| with_opt_addr(e, self.id.peer_addr()))?;
        let wait = timeout.saturating_add(Duration::from_secs(1));
        expect(&self.id, CmEventType::RouteResolved, "rdma_resolve_route", wait)?;
        Ok(UdRoute { id: self.id })
    }

    /// The id, for options to set before the route is resolved ([`CmId::set_tos`]).
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The device context the address resolved to.
    ///
    /// # Errors
    /// [`Error::NoDevice`] if the id has no device (cannot happen after address resolution).
    pub fn context(&self) -> Result<VerbsContext> {
        context_of(&self.id)
    }

    /// Allocates a PD on the device the address resolved to.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_alloc_pd` fails.
    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>> {
        ProtectionDomain::new(&self.context()?)
    }

    /// Creates the UD QP without resolving a route: what a multicast sender or receiver
    /// needs, which joins a group rather than connecting. ([`UdEndpoint::connect`] needs the
    /// route: resolve it first to reach a server.)
    ///
    /// # Errors
    /// As for [`UdRoute::create_qp`].
    pub fn create_qp(self, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<UdEndpoint> {
        let qp = create_ud_qp(&self.id, pd, init)?;
        Ok(UdEndpoint { qp, id: self.id })
    }
}

/// A UD client with a route: allocate the PD, then create the QP.
#[derive(Debug)]
pub struct UdRoute {
    id: Arc<CmId>,
}

impl UdRoute {
    /// The device context the route runs over.
    ///
    /// # Errors
    /// [`Error::NoDevice`] if the id has no device (cannot happen after route resolution).
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

    /// The active MTU of the route's port: the largest datagram.
    ///
    /// # Errors
    /// As for [`VerbsContext::port`].
    pub fn mtu(&self) -> Result<u32> {
        Ok(self.context()?.port(self.id.port_num())?.active_mtu)
    }

    /// Creates the UD QP (ready to send and receive at once).
    ///
    /// # Errors
    /// As for [`RouteResolved::create_qp`](crate::RouteResolved::create_qp).
    pub fn create_qp(self, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<UdEndpoint> {
        let qp = create_ud_qp(&self.id, pd, init)?;
        Ok(UdEndpoint { qp, id: self.id })
    }

    /// The id.
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A UD endpoint: its QP and its id. A client's asks the server for its QP's address with
/// [`UdEndpoint::connect`]; a server's ([`UdServerQp::accept`]) answers whoever sends to it.
#[derive(Debug)]
pub struct UdEndpoint {
    // Dropped first: the QP holds its own Arc of the id.
    qp: UdQp,
    id: Arc<CmId>,
}

impl UdEndpoint {
    /// The UD QP.
    pub fn qp(&self) -> &UdQp {
        &self.qp
    }

    /// The UD QP, for posting and polling.
    pub fn qp_mut(&mut self) -> &mut UdQp {
        &mut self.qp
    }

    /// The id.
    pub fn id(&self) -> &Arc<CmId> {
        &self.id
    }

    /// The peer's address (the server's, on a client).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// Asks the server for its QP (`rdma_connect` on a UD id: a SIDR request carrying
    /// `private_data`) and waits for the `ESTABLISHED` event whose `ud` parameters name it;
    /// returns that destination, its address handle made on the QP's PD.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for private data over [`MAX_UD_PRIVATE_DATA`];
    /// [`Error::UnexpectedEvent`] naming `UNREACHABLE`: with status 1 when nobody listens on
    /// that port (the SIDR reply's "service not supported", measured on rxe), 2 when the
    /// server rejected the request, a negative errno when nothing answered; or
    /// `CONNECT_ERROR`; [`Error::Timeout`];
    /// [`Error::Call`] when the address handle cannot be made.
    pub fn connect(&mut self, private_data: &[u8], timeout: Duration) -> Result<UdDest> {
        let ev = {
            let _expecting = self.id.channel().expecting(self.id.handle());
            let mut raw = ud_conn_param(private_data, 0)?;
            let peer = self.id.peer_addr();
            // SAFETY: the id is valid with a route and a QP; `raw` and the private data it
            // points to outlive the call, which copies them.
            check_rdma(unsafe { ffi::rdma_connect(self.id.as_raw(), &mut raw) }, "rdma_connect")
                .map_err(|e| with_opt_addr(e, peer))?;
            expect(&self.id, CmEventType::Established, "rdma_connect (UD)", timeout).map_err(sidr_hint)?
        };
        let ud = ev.ud().ok_or_else(|| {
            with_opt_addr(
                ev.unexpected("rdma_connect (UD): no ud parameters", CmEventType::Established),
                self.peer_addr(),
            )
        })?;
        UdDest::from_ud_param(self.qp.pd(), ud)
    }
}

/// A UD connect's `UNREACHABLE` carries the SIDR reply's status (`enum ib_cm_sidr_status`)
/// when the server's side answered: say what it means rather than "no answer".
fn sidr_hint(e: Error) -> Error {
    match e {
        Error::UnexpectedEvent { op, expected, got: CmEventType::Unreachable, status, addr, private_data, .. }
            if (1..=5).contains(&status) =>
        {
            let hint = Some(match status {
                1 => "the server's side answered that nobody listens there (SIDR status 1, service not supported): is the UD server running, on this port and port space?",
                2 => "the server rejected the request (SIDR status 2)",
                3 => "the server has no QP for the request (SIDR status 3)",
                4 => "the server redirected the request (SIDR status 4), which rdma_cm does not follow",
                _ => "the server does not support this SIDR version (status 5)",
            });
            Error::UnexpectedEvent { op, expected, got: CmEventType::Unreachable, status, addr, hint, private_data }
        }
        e => e,
    }
}

fn ud_conn_param(private_data: &[u8], qp_num: u32) -> Result<ffi::rdma_conn_param> {
    if private_data.len() > MAX_UD_PRIVATE_DATA {
        return Err(Error::InvalidArgument(format!(
            "UD private data is {} bytes; at most {MAX_UD_PRIVATE_DATA} fit in a SIDR request",
            private_data.len()
        )));
    }
    Ok(ffi::rdma_conn_param {
        private_data: if private_data.is_empty() { std::ptr::null() } else { private_data.as_ptr().cast() },
        private_data_len: private_data.len() as u8,
        responder_resources: 0,
        initiator_depth: 0,
        flow_control: 0,
        retry_count: 0,
        rnr_retry_count: 0,
        srq: 0,
        qp_num,
    })
}

/// A fresh UD server id.
#[derive(Debug)]
pub struct UdServer {
    id: CmId,
}

impl UdServer {
    /// Creates a UD server id (`RDMA_PS_UDP`) on its own event channel.
    ///
    /// # Errors
    /// [`Error::NoDevice`] without RDMA support; [`Error::Call`] otherwise.
    pub fn new() -> Result<UdServer> {
        UdServer::on_channel(&EventChannel::new()?, PortSpace::Udp)
    }

    /// Creates a UD server id of port space `ps` on `channel`.
    ///
    /// # Errors
    /// As for [`UdServer::new`].
    pub fn on_channel(channel: &EventChannel, ps: PortSpace) -> Result<UdServer> {
        Ok(UdServer { id: CmId::with_port_space(channel, ps.raw())? })
    }

    /// Binds to `addr` and listens with `backlog` pending requests (0 or less: the system's
    /// limit, `net.rdma_ucm.max_backlog`; see [`Bound::listen`](crate::Bound::listen)).
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_bind_addr` or `rdma_listen` fails (`EADDRINUSE`: the port is
    /// taken).
    pub fn listen(self, addr: SocketAddr, backlog: i32) -> Result<UdListener> {
        self.id.bind(addr)?;
        let local = self.id.local_addr();
        self.id.listen(backlog).map_err(|e| with_opt_addr(e, local))?;
        Ok(UdListener { id: self.id })
    }

    /// The id, for options to set first ([`CmId::set_reuse_addr`], ...).
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A listening UD id.
#[derive(Debug)]
pub struct UdListener {
    id: CmId,
}

impl UdListener {
    /// Waits up to `timeout` for a UD connect request (a SIDR request), and moves its new id
    /// onto an event channel of its own.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::UnexpectedEvent`] for any other event.
    pub fn get_request(&self, timeout: Duration) -> Result<UdRequest> {
        let mut ev = expect_any_request(&self.id, timeout)?;
        let Some(mut id) = ev.take_id() else {
            return Err(ev.unexpected("taking a UD request", CmEventType::ConnectRequest));
        };
        let ch = EventChannel::new()?;
        id.migrate(&ch)?;
        id.set_channel(ch);
        Ok(UdRequest { id: Arc::new(id), private_data: *ev.private_data() })
    }

    /// The bound address (with the chosen port when bound to port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The id.
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A peer's UD connect request: create a QP and accept, or reject.
#[derive(Debug)]
pub struct UdRequest {
    id: Arc<CmId>,
    private_data: PrivateData,
}

impl UdRequest {
    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// The peer's private data (untrusted).
    pub fn private_data(&self) -> &PrivateData {
        &self.private_data
    }

    /// The request's device context.
    ///
    /// # Errors
    /// [`Error::NoDevice`] if the request has no device (cannot happen for a request).
    pub fn context(&self) -> Result<VerbsContext> {
        context_of(&self.id)
    }

    /// Allocates a PD on the request's device.
    ///
    /// # Errors
    /// As for [`UdRoute::alloc_pd`].
    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>> {
        ProtectionDomain::new(&self.context()?)
    }

    /// The active MTU of the request's port: the largest datagram.
    ///
    /// # Errors
    /// As for [`VerbsContext::port`].
    pub fn mtu(&self) -> Result<u32> {
        Ok(self.context()?.port(self.id.port_num())?.active_mtu)
    }

    /// Creates the UD QP that will answer the peer; post receives on it, then accept.
    ///
    /// # Errors
    /// As for [`UdRoute::create_qp`].
    pub fn create_qp(self, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<UdServerQp> {
        let qp = create_ud_qp(&self.id, pd, init)?;
        Ok(UdServerQp { qp, id: self.id })
    }

    /// Rejects the request (the peer's connect fails with `REJECTED`).
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_reject` fails.
    pub fn reject(self) -> Result<()> {
        // SAFETY: the id is a pending request; no private data.
        check_rdma(unsafe { ffi::rdma_reject(self.id.as_raw(), std::ptr::null(), 0) }, "rdma_reject")
    }

    /// The id.
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A UD request with its QP: post receives, then accept.
#[derive(Debug)]
pub struct UdServerQp {
    qp: UdQp,
    id: Arc<CmId>,
}

impl UdServerQp {
    /// The UD QP, for its number and limits.
    pub fn qp(&self) -> &UdQp {
        &self.qp
    }

    /// Accepts (`rdma_accept`: the SIDR reply carries this QP's number and QKey). UD has no
    /// `ESTABLISHED` on this side: the endpoint is ready at once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for private data over [`MAX_UD_PRIVATE_DATA`];
    /// [`Error::Call`] when `rdma_accept` fails.
    pub fn accept(self, private_data: &[u8]) -> Result<UdEndpoint> {
        let mut raw = ud_conn_param(private_data, self.qp.qp_num())?;
        // SAFETY: the id is a pending UD request with a QP; `raw` and its private data outlive
        // the call, which copies them.
        check_rdma(unsafe { ffi::rdma_accept(self.id.as_raw(), &mut raw) }, "rdma_accept")
            .map_err(|e| with_opt_addr(e, self.id.peer_addr()))?;
        Ok(UdEndpoint { qp: self.qp, id: self.id })
    }

    /// Rejects the request.
    ///
    /// # Errors
    /// As for [`UdRequest::reject`].
    pub fn reject(self) -> Result<()> {
        // SAFETY: the id is a pending request; no private data.
        check_rdma(unsafe { ffi::rdma_reject(self.id.as_raw(), std::ptr::null(), 0) }, "rdma_reject")
    }
}

/// Creates the UD QP of `id` on `pd` through `rdma_create_qp` (which takes it to RTS with the
/// port space's QKey).
pub(crate) fn create_ud_qp(id: &Arc<CmId>, pd: &Arc<ProtectionDomain>, mut init: QpInit) -> Result<UdQp> {
    init.datagrams = true;
    let qp = create_qp_on(id, pd, init)?;
    UdQp::from_qp(qp, id.port_num())
}
