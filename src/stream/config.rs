//! The sizes of a stream's buffers and queues ([`StreamConfig`]), as rsocket's socket options
//! set them (`SO_RCVBUF`, `SO_SNDBUF`, `RDMA_RQSIZE`).

use std::net::SocketAddr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::stream::conn::StreamListener;
use crate::stream::engine::Stream;
use crate::verbs::qp::QpInit;

/// Receives posted beyond the credits, for the peer's control messages (grants, credit
/// updates, shutdown), which the protocol does not count: with them the peer's messages find
/// a receive posted without leaning on RNR retries.
const SPARE_RECVS: u32 = 16;
/// Send-queue entries reserved for control messages (rsocket's `RS_QP_CTRL_SIZE`).
pub(super) const CTRL_SLOTS: usize = 4;
/// Inline bytes asked of the QP: grants (16 bytes), control messages and data writes of up to
/// this many bytes go inline, as rsocket's default (`RDMA_INLINE`, 64).
pub(super) const INLINE: u32 = 64;

/// The sizes of a stream: its receive buffer, its send buffer and the credits it gives the
/// peer. The defaults suit bulk transfer (256 KiB each way, 128 credits); many streams that
/// each carry little take smaller ones (`tests/stream_tokio.rs` runs 1,000 streams of 32 KiB
/// each way). Both ends choose their own; each tells the other what it gives in the
/// connection data and its grants, as rsocket does, so any sizes talk to any rsocket.
///
/// ```no_run
/// use std::time::Duration;
/// use rdma_cm::stream::StreamConfig;
/// # fn main() -> rdma_cm::Result<()> {
/// let small = StreamConfig::new().recv_buffer(32 * 1024).send_buffer(32 * 1024).credits(32);
/// let listener = small.bind("10.77.0.1:7471".parse().unwrap())?;
/// let stream = listener.accept(Duration::from_secs(5))?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// The receive buffer as asked for (half of it is one grant).
    recv_buffer: usize,
    send_buffer: usize,
    credits: u16,
}

impl Default for StreamConfig {
    fn default() -> StreamConfig {
        StreamConfig::new()
    }
}

impl StreamConfig {
    /// The defaults: a 256 KiB receive buffer, a 256 KiB send buffer, 128 credits (and so up
    /// to 128 data WRITEs in flight).
    pub const fn new() -> StreamConfig {
        StreamConfig { recv_buffer: 256 * 1024, send_buffer: 256 * 1024, credits: 128 }
    }

    /// The receive buffer the peer RDMA-WRITEs into, registered for the stream's life
    /// (rsocket's `SO_RCVBUF`). It is granted half at a time, so an odd size loses a byte.
    /// From 4 KiB to 1 GiB; checked when the stream is set up.
    #[must_use]
    pub const fn recv_buffer(mut self, bytes: usize) -> StreamConfig {
        self.recv_buffer = bytes;
        self
    }

    /// The send buffer writes are copied into, registered for the stream's life (rsocket's
    /// `SO_SNDBUF`), used as a ring as rsocket's: each RDMA WRITE takes the bytes it carries
    /// (up to 64 KiB), and gives them back when it completes. Writes of up to 64 bytes go
    /// inline and take none. From 1 KiB to 64 MiB; checked when the stream is set up.
    #[must_use]
    pub const fn send_buffer(mut self, bytes: usize) -> StreamConfig {
        self.send_buffer = bytes;
        self
    }

    /// The data messages the peer may send before this side reads them (rsocket's
    /// `RDMA_RQSIZE`): a receive posted for each, and 16 more for control messages. They also
    /// size this side's send queue: as many data WRITEs in flight (from 16 to 512). From 1 to
    /// 4,096; checked when the stream is set up.
    #[must_use]
    pub const fn credits(mut self, n: u16) -> StreamConfig {
        self.credits = n;
        self
    }

    /// Connects to the rsocket (or [`StreamListener`]) at `addr` with these sizes: see
    /// [`Stream::connect`].
    ///
    /// # Errors
    /// As for [`Stream::connect`]; [`Error::InvalidArgument`] for a size out of its range.
    pub fn connect(self, addr: SocketAddr, timeout: Duration) -> Result<Stream> {
        self.check()?;
        Stream::connect_sized(self, addr, timeout)
    }

    /// Listens on `addr`; every stream the listener accepts has these sizes: see
    /// [`StreamListener::bind`].
    ///
    /// # Errors
    /// As for [`StreamListener::bind`]; [`Error::InvalidArgument`] for a size out of its
    /// range.
    pub fn bind(self, addr: SocketAddr) -> Result<StreamListener> {
        self.check()?;
        StreamListener::bind_sized(self, addr)
    }

    /// [`StreamConfig::connect`] for async code, as [`Stream::connect_async`].
    ///
    /// # Errors
    /// As for [`StreamConfig::connect`]; [`Error::InvalidArgument`] outside a tokio runtime.
    #[cfg(feature = "tokio")]
    pub async fn connect_async(self, addr: SocketAddr, timeout: Duration) -> Result<Stream> {
        self.check()?;
        crate::stream::async_io::off_runtime(move || Stream::connect_sized(self, addr, timeout)).await
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        if !(4 * 1024..=1 << 30).contains(&self.recv_buffer) {
            return bad(format!(
                "StreamConfig::recv_buffer of {} bytes: it must be from 4 KiB to 1 GiB",
                self.recv_buffer
            ));
        }
        if !(1024..=64 << 20).contains(&self.send_buffer) {
            return bad(format!(
                "StreamConfig::send_buffer of {} bytes: it must be from 1 KiB to 64 MiB",
                self.send_buffer
            ));
        }
        if !(1..=4096).contains(&self.credits) {
            return bad(format!("StreamConfig::credits of {}: they must be from 1 to 4,096", self.credits));
        }
        Ok(())
    }

    /// Half the receive buffer: one grant.
    pub(super) fn half(&self) -> usize {
        self.recv_buffer / 2
    }

    /// The receive buffer's size.
    pub(super) fn rbuf_size(&self) -> usize {
        self.half() * 2
    }

    pub(super) fn credits_given(&self) -> u16 {
        self.credits
    }

    /// Data messages read between two bare credit updates: half the credits, as rsocket's
    /// (whose receive queue is never under 16), and at least one: with a single credit, half
    /// would be none, and an update would be due at every poll, forever.
    pub(super) fn update_every(&self) -> u16 {
        (self.credits / 2).max(1)
    }

    /// The send buffer's size.
    pub(super) fn sbuf_size(&self) -> usize {
        self.send_buffer
    }

    /// Data WRITEs in flight at most: one per credit given, from 16 to 512 (the peer's
    /// credits bound them too).
    pub(super) fn data_slots(&self) -> usize {
        usize::from(self.credits).clamp(16, 512)
    }

    /// Receives posted: one per credit, and the spare ones.
    pub(super) fn recvs(&self) -> u32 {
        u32::from(self.credits) + SPARE_RECVS
    }

    /// Send-queue depth: every data WRITE in flight, and the control slots.
    fn sq_size(&self) -> u32 {
        (self.data_slots() + CTRL_SLOTS) as u32
    }

    /// The QP's capabilities: rsocket's shape (one RC QP, every send signaled, inline control
    /// messages), sized to these buffers.
    pub(super) fn qp_init(&self) -> QpInit {
        QpInit::new().max_send_wr(self.sq_size()).max_recv_wr(self.recvs()).max_inline_data(INLINE)
    }

    /// The lane's CQ depth: both queues.
    pub(super) fn cq_depth(&self) -> u32 {
        self.sq_size() + self.recvs()
    }
}
