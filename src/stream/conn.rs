//! Setting a stream up: the QP on its own lane, with the buffers of `buffers`, the connect request and its
//! answer carrying [`ConnData`] both ways, as rsocket does (`docs/rsocket-protocol.md` §1, §2).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::cm::client::Client;
use crate::cm::conn_param::ConnParam;
use crate::cm::server::{ConnectRequest, Listener, Server};
use crate::error::{Error, Result};
use crate::stream::buffers::{Buffers, MIN_RNR_TIMER};
use crate::stream::config::StreamConfig;
use crate::stream::engine::Stream;
use crate::stream::wire::ConnData;
use crate::verbs::device::{Transport, VerbsContext};
use crate::verbs::lane::Lane;

/// Refuses an iWARP device: rsocket sends every message there as a 4-byte SEND (no immediate
/// data), which this stream does not implement.
fn refuse_iwarp(ctx: &VerbsContext) -> Result<()> {
    if ctx.transport() == Transport::Iwarp {
        return Err(Error::Unsupported {
            what: "an rsocket stream on iWARP",
            why: format!(
                "{} is an iWARP device: it has no immediate data, and rsocket's iWARP form (every message a \
                 4-byte SEND after the WRITE) is not implemented; use an InfiniBand or RoCE device",
                ctx.device_name()
            ),
        });
    }
    Ok(())
}

/// The peer's connection data, checked.
fn peer_data(bytes: &[u8], addr: Option<SocketAddr>) -> Result<ConnData> {
    let d = ConnData::decode(bytes).map_err(|e| Error::Protocol { what: e.to_string(), addr })?;
    if d.credits == 0 {
        return Err(Error::Protocol { what: "the peer's connection data grants 0 credits".into(), addr });
    }
    Ok(d)
}

/// The least time a connect request that came is given to finish its handshake, however
/// little of `accept`'s timeout was left when it came: a client is not dropped for arriving
/// late in the wait.
pub(super) const MIN_HANDSHAKE: Duration = Duration::from_secs(5);

/// Time left of `timeout` since `start`.
fn left(start: Instant, timeout: Duration) -> Duration {
    timeout.saturating_sub(start.elapsed())
}

impl Stream {
    /// Connects to the rsocket (or [`StreamListener`]) at `addr` (in the RDMA CM's TCP port
    /// space), every step within `timeout`, with the default sizes ([`StreamConfig`] sets
    /// others).
    ///
    /// # Errors
    /// As for the CM's resolve and connect steps ([`Client`]); [`Error::Unsupported`] on an
    /// iWARP device; [`Error::Protocol`] when the server's connection data is refused (the
    /// connection is then closed).
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Stream> {
        StreamConfig::new().connect(addr, timeout)
    }

    /// [`Stream::connect`] with the sizes of `cfg` (checked by the caller).
    pub(super) fn connect_sized(cfg: StreamConfig, addr: SocketAddr, timeout: Duration) -> Result<Stream> {
        let start = Instant::now();
        let route = Client::new()?.resolve_addr(None, addr, timeout)?.resolve_route(left(start, timeout))?;
        let ctx = route.context()?;
        refuse_iwarp(&ctx)?;
        let pd = route.alloc_pd()?;
        let mut bufs = Buffers::new(&pd, &cfg)?;
        let mut lane = Lane::new(&ctx, cfg.cq_depth())?;
        let channel = route.id().channel().clone();
        let client = route.lane_qp(&mut lane, &pd, cfg.qp_init())?;
        let qp = client.qp();
        bufs.post_recvs(&mut lane, qp)?;
        // rsocket.c:1435-1448: no READ depths, retries 7, RNR retries 7.
        let param = ConnParam::new()
            .responder_resources(0)
            .initiator_depth(0)
            .retry_count(7)
            .rnr_retry_count(7)
            .min_rnr_timer(MIN_RNR_TIMER)
            .private_data(&bufs.conn_data().encode())?;
        let reply = client.connect(&mut lane, &param, left(start, timeout))?;
        let peer = match peer_data(&reply, Some(addr)) {
            Ok(p) => p,
            Err(e) => {
                let _ = lane.disconnect(qp, Duration::from_secs(1));
                return Err(e);
            }
        };
        Stream::start(lane, qp, bufs, peer, Some(addr), channel)
    }
}

/// A listening rsocket-compatible stream endpoint: [`StreamListener::bind`], then
/// [`StreamListener::accept`] for each connection.
pub struct StreamListener {
    listener: Listener,
    cfg: StreamConfig,
}

impl std::fmt::Debug for StreamListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamListener").field("local_addr", &self.local_addr()).finish()
    }
}

impl StreamListener {
    /// Listens on `addr` (an address of an RDMA device's netdev, or the wildcard; the port is
    /// in the RDMA CM's TCP port space, as an rsocket's). The streams it accepts have the
    /// default sizes ([`StreamConfig::bind`] sets others).
    ///
    /// # Errors
    /// As for [`Server::bind`] and `listen`.
    pub fn bind(addr: SocketAddr) -> Result<StreamListener> {
        StreamConfig::new().bind(addr)
    }

    /// [`StreamListener::bind`] with the sizes of `cfg` (checked by the caller). The backlog
    /// of connect requests not yet accepted is the most the kernel takes
    /// (`net.rdma_ucm.max_backlog`, 1,024 by default), so that many clients connecting at once
    /// are not refused.
    pub(super) fn bind_sized(cfg: StreamConfig, addr: SocketAddr) -> Result<StreamListener> {
        Ok(StreamListener { listener: Server::new()?.bind(addr)?.listen(0)?, cfg })
    }

    /// The CM listener.
    #[cfg(feature = "tokio")]
    pub(super) fn listener(&self) -> &Listener {
        &self.listener
    }

    /// The sizes of the streams it accepts.
    pub fn config(&self) -> StreamConfig {
        self.cfg
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr()
    }

    /// Waits up to `timeout` for a connect request and accepts it, as an rsocket listener
    /// does: a request whose connection data is refused is rejected (and reported as
    /// [`Error::Protocol`]), an accepted one answered with this side's connection data. A
    /// request that came is given at least 5 s to finish its handshake, even where that
    /// outlasts `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no request came; [`Error::Unsupported`] on an iWARP device (the
    /// request is rejected); [`Error::Protocol`]; as for the CM's accept.
    pub fn accept(&self, timeout: Duration) -> Result<Stream> {
        let start = Instant::now();
        let req = self.listener.get_request(timeout)?;
        accept_request(req, &self.cfg, left(start, timeout).max(MIN_HANDSHAKE))
    }
}

/// Accepts `req` as an rsocket listener does (rsocket.c:1296-1346).
pub(super) fn accept_request(req: ConnectRequest, cfg: &StreamConfig, timeout: Duration) -> Result<Stream> {
    let addr = req.peer_addr();
    let ctx = req.context()?;
    if let Err(e) = refuse_iwarp(&ctx) {
        let _ = req.reject(&[]);
        return Err(e);
    }
    let peer = match peer_data(req.private_data(), addr) {
        Ok(p) => p,
        Err(e) => {
            let _ = req.reject(&[]);
            return Err(e);
        }
    };
    // rsocket accepts with the request's own parameters, only its private data replaced.
    let (resp, init) = (req.responder_resources(), req.initiator_depth());
    let pd = req.alloc_pd()?;
    let mut bufs = Buffers::new(&pd, cfg)?;
    let mut lane = Lane::new(&ctx, cfg.cq_depth())?;
    let channel = req.id().channel().clone();
    let server = req.lane_qp(&mut lane, &pd, cfg.qp_init())?;
    let qp = server.qp();
    bufs.post_recvs(&mut lane, qp)?;
    let param = ConnParam::new()
        .responder_resources(resp)
        .initiator_depth(init)
        .retry_count(7)
        .rnr_retry_count(7)
        .min_rnr_timer(MIN_RNR_TIMER)
        .private_data(&bufs.conn_data().encode())?;
    server.accept(&mut lane, &param, timeout)?;
    Stream::start(lane, qp, bufs, peer, addr, channel)
}
