//! Setting a stream up: the buffers, the QP on its own lane, the connect request and its
//! answer carrying [`ConnData`] both ways, as rsocket does (`docs/rsocket-protocol.md` §1, §2).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cm::client::Client;
use crate::cm::conn_param::ConnParam;
use crate::cm::server::{ConnectRequest, Listener, Server};
use crate::error::{Error, Result};
use crate::stream::engine::Stream;
use crate::stream::wire::{ConnData, Sge, SGE_LEN, SGL_SLOTS};
use crate::verbs::device::{Transport, VerbsContext};
use crate::verbs::lane::{Lane, LaneQp, RecvWr};
use crate::verbs::mr::{AccessFlags, MemoryRegion};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::QpInit;

/// Data messages the peer may have unread at once: the credits this side advertises (rsocket's
/// `rq_size`).
pub(super) const CREDITS: u16 = 128;
/// Receives posted beyond the credits, for the peer's control messages (grants, credit
/// updates, shutdown), which the protocol does not count: with them the peer's messages find
/// a receive posted without leaning on RNR retries.
pub(super) const SPARE_RECVS: u32 = 16;
/// Send-queue entries reserved for control messages (rsocket's `RS_QP_CTRL_SIZE`).
pub(super) const CTRL_SLOTS: usize = 4;
/// The receive buffer: two halves, each granted to the peer as a whole.
pub(super) const RBUF_SIZE: usize = 256 * 1024;
/// One piece of the send buffer: the most one data WRITE carries.
pub(super) const SEND_CHUNK: usize = 16 * 1024;
/// Pieces of the send buffer, so data WRITEs in flight at once.
pub(super) const SEND_CHUNKS: usize = 16;
/// Send-queue depth: every data WRITE in flight, and the control slots.
const SQ_SIZE: u32 = (SEND_CHUNKS + CTRL_SLOTS) as u32;
/// Inline bytes asked of the QP: a grant (16 bytes) and control messages go inline.
const INLINE: u32 = 64;
/// Minimum RNR NAK timer this side's QP asks of a peer whose message found no receive (IB
/// code 12, 0.64 ms): never needed while the spare receives last, short if it is.
const MIN_RNR_TIMER: u8 = 12;
/// `wr_id` of a receive.
pub(super) const WR_RECV: u64 = 1;
/// `wr_id` of a data WRITE.
pub(super) const WR_DATA: u64 = 2;
/// `wr_id` of a control message or grant.
pub(super) const WR_CTRL: u64 = 3;

/// What a stream registers: its receive buffer and target SGL (remotely writable, read only
/// with volatile copies), its send buffer in pieces, and one tiny region per receive.
pub(super) struct Buffers {
    pub(super) rbuf: MemoryRegion,
    pub(super) sgl: MemoryRegion,
    pub(super) send: Vec<MemoryRegion>,
    recvs: Vec<MemoryRegion>,
}

impl Buffers {
    fn new(pd: &Arc<ProtectionDomain>) -> Result<Buffers> {
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rbuf = MemoryRegion::new(pd, RBUF_SIZE, remote)?;
        let sgl = MemoryRegion::new(pd, SGL_SLOTS as usize * SGE_LEN, remote)?;
        let send = MemoryRegion::new(pd, SEND_CHUNK * SEND_CHUNKS, AccessFlags::empty())?.split(SEND_CHUNK)?;
        // Receives carry no scatter list (`num_sge` 0): every message is immediate data. A
        // receive still moves a region into the lane; one byte each, never touched.
        let n = usize::from(CREDITS) + SPARE_RECVS as usize;
        let recvs = MemoryRegion::new(pd, n, AccessFlags::LOCAL_WRITE)?.split(1)?;
        Ok(Buffers { rbuf, sgl, send, recvs })
    }

    /// This side's connection data: its credits, its target SGL, the first half of its
    /// receive buffer.
    fn conn_data(&self) -> ConnData {
        let sgl = Sge { addr: self.sgl.addr(), key: self.sgl.rkey(), length: SGL_SLOTS };
        let half = Sge { addr: self.rbuf.addr(), key: self.rbuf.rkey(), length: (RBUF_SIZE / 2) as u32 };
        ConnData::new(CREDITS, sgl, half)
    }

    /// Posts every receive on `qp` (before the connect or accept: in place before the peer
    /// can send).
    fn post_recvs(&mut self, lane: &mut Lane, qp: LaneQp) -> Result<()> {
        while let Some(r) = self.recvs.pop() {
            lane.post_recv(qp, RecvWr::range(r, 0..0).wr_id(WR_RECV))?;
        }
        Ok(())
    }
}

/// The QP's capabilities: rsocket's shape (one RC QP, every send signaled, inline control
/// messages), sized to this stream's buffers.
fn qp_init() -> QpInit {
    QpInit::new().max_send_wr(SQ_SIZE).max_recv_wr(u32::from(CREDITS) + SPARE_RECVS).max_inline_data(INLINE)
}

/// The lane's CQ depth: both queues.
fn cq_depth() -> u32 {
    SQ_SIZE + u32::from(CREDITS) + SPARE_RECVS
}

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

/// Time left of `timeout` since `start`.
fn left(start: Instant, timeout: Duration) -> Duration {
    timeout.saturating_sub(start.elapsed())
}

impl Stream {
    /// Connects to the rsocket (or [`StreamListener`]) at `addr` (in the RDMA CM's TCP port
    /// space), every step within `timeout`.
    ///
    /// # Errors
    /// As for the CM's resolve and connect steps ([`Client`]); [`Error::Unsupported`] on an
    /// iWARP device; [`Error::Protocol`] when the server's connection data is refused (the
    /// connection is then closed).
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Stream> {
        let start = Instant::now();
        let route = Client::new()?.resolve_addr(None, addr, timeout)?.resolve_route(left(start, timeout))?;
        let ctx = route.context()?;
        refuse_iwarp(&ctx)?;
        let pd = route.alloc_pd()?;
        let mut bufs = Buffers::new(&pd)?;
        let mut lane = Lane::new(&ctx, cq_depth())?;
        let client = route.lane_qp(&mut lane, &pd, qp_init())?;
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
        Stream::start(lane, qp, bufs, peer, Some(addr))
    }
}

/// A listening rsocket-compatible stream endpoint: [`StreamListener::bind`], then
/// [`StreamListener::accept`] for each connection.
pub struct StreamListener {
    listener: Listener,
}

impl std::fmt::Debug for StreamListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamListener").field("local_addr", &self.local_addr()).finish()
    }
}

impl StreamListener {
    /// Listens on `addr` (an address of an RDMA device's netdev, or the wildcard; the port is
    /// in the RDMA CM's TCP port space, as an rsocket's).
    ///
    /// # Errors
    /// As for [`Server::bind`] and `listen`.
    pub fn bind(addr: SocketAddr) -> Result<StreamListener> {
        Ok(StreamListener { listener: Server::new()?.bind(addr)?.listen(16)? })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr()
    }

    /// Waits up to `timeout` for a connect request and accepts it, as an rsocket listener
    /// does: a request whose connection data is refused is rejected (and reported as
    /// [`Error::Protocol`]), an accepted one answered with this side's connection data.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no request came; [`Error::Unsupported`] on an iWARP device (the
    /// request is rejected); [`Error::Protocol`]; as for the CM's accept.
    pub fn accept(&self, timeout: Duration) -> Result<Stream> {
        let start = Instant::now();
        let req = self.listener.get_request(timeout)?;
        accept_request(req, left(start, timeout))
    }
}

/// Accepts `req` as an rsocket listener does (rsocket.c:1296-1346).
fn accept_request(req: ConnectRequest, timeout: Duration) -> Result<Stream> {
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
    let mut bufs = Buffers::new(&pd)?;
    let mut lane = Lane::new(&ctx, cq_depth())?;
    let server = req.lane_qp(&mut lane, &pd, qp_init())?;
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
    Stream::start(lane, qp, bufs, peer, addr)
}
