//! The stream's state and its protocol engine: completions reaped and checked, credits and
//! buffer grants sent, the sender's window and target slots (`docs/rsocket-protocol.md` §4).

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::stream::buffers::{Buffers, WR_CTRL, WR_DATA, WR_RECV, WR_REGION};
use crate::stream::config::{StreamConfig, CTRL_SLOTS, INLINE};
use crate::stream::wire::{ByteOrder, ConnData, Ctrl, Msg, Sge, QP_CTRL_SIZE, SGE_LEN, SGL_SLOTS};
use crate::verbs::lane::{Completion, InlineWr, Lane, LaneQp, RecvWr, SendWr};
use crate::verbs::mr::{MemoryRegion, RemoteRegion, Spare};

/// The default bound of a blocking read or write.
pub(super) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The most one data WRITE carries (rsocket's `RS_MAX_TRANSFER`).
const MAX_WRITE: usize = 64 * 1024;
/// How long a blocking wait polls before it sleeps (rsocket's default `polling_time`).
const POLL_WINDOW: Duration = Duration::from_micros(10);
/// Empty polls between two looks at the clock while a blocking wait polls.
const POLLS_PER_LOOK: u32 = 16;
/// How long one wait on the CQ sleeps before the connection's CM events are looked at.
const SLICE: Duration = Duration::from_millis(200);

/// The immediate data of a data message of `n` bytes (at most 64 KiB).
fn data_imm(n: usize) -> u32 {
    Msg::Data { len: n as u32 }.to_imm()
}

/// A byte stream over one RC connection that speaks librdmacm's rsocket protocol: made by
/// [`Stream::connect`] or [`StreamListener::accept`](crate::stream::StreamListener::accept),
/// used through [`std::io::Read`] and [`std::io::Write`], ended by
/// [`Stream::shutdown`] or its drop. See the [module docs](crate::stream).
pub struct Stream {
    pub(super) lane: Lane,
    pub(super) qp: LaneQp,
    pub(super) peer_addr: Option<SocketAddr>,
    /// The receive buffer: the peer writes into it at any moment, so only `read_at` reads it.
    pub(super) rbuf: MemoryRegion,
    /// The sizes: of `rbuf` (`cfg.half()` is one grant), the credits given, the CQ's depth.
    pub(super) cfg: StreamConfig,
    /// This side's target SGL: the peer writes its grants there; read only with `read_at`.
    sgl: MemoryRegion,
    /// The send buffer's free space, a ring: chunks in ring order from where the next WRITE's
    /// bytes go (at most two once joined: the space may wrap around the buffer's end). A WRITE
    /// takes its bytes from the front; its completion gives them back at the back.
    send_free: VecDeque<MemoryRegion>,
    /// Handles a split of the ring's front turns into chunks, so that no WRITE allocates.
    spares: Vec<Spare>,
    /// The most bytes a data write sends inline (no send-buffer space): what the QP takes, at
    /// most rsocket's 64.
    inline_max: usize,

    // The peer.
    peer_order: ByteOrder,
    /// The peer's target-SGL array (its slots, 16 bytes each).
    peer_sgl: RemoteRegion,
    peer_slots: u32,
    /// The peer's receive queue size, its credit count: no credit update may give more.
    peer_credits: u16,

    // Sending.
    /// Data messages sent (`sseq_no`), and the limit the peer's last update set (`sseq_comp`).
    pub(super) sseq_no: u16,
    sseq_comp: u16,
    /// Where the next data WRITE goes: what is left of the current granted half, and the one
    /// granted after it.
    pub(super) target: Option<Sge>,
    next_target: Option<Sge>,
    /// The slot of this side's target SGL the peer's next grant lands in (1, 0, 1, ...).
    next_grant_slot: u32,
    pub(super) data_in_flight: usize,
    ctrl_in_flight: usize,

    // Receiving.
    /// Data messages the application has read whole (`rseq_no`), and the count at which the
    /// next credit update is due (`rseq_comp`).
    rseq_no: u16,
    rseq_comp: u16,
    /// Receive-buffer bytes read by the application and not granted again.
    rbuf_bytes_avail: usize,
    /// The next half to grant, as an offset in the buffer.
    rbuf_free_offset: usize,
    /// The peer's target slot the next grant goes to.
    remote_sge: u32,
    /// Data messages arrived (`rseq_no` counts those read), and the limit of the last credit
    /// update sent: the peer may send only while the first is short of the second.
    rx_seq: u16,
    rx_limit: u16,
    /// Where the peer's next data lands, and how much of the granted space it has not filled.
    rx_write_off: usize,
    rx_granted: usize,
    /// Lengths of the data messages arrived and not read whole (at most the credits: never
    /// grows past the capacity it was made with).
    pub(super) rx_msgs: VecDeque<u32>,
    /// Where the application reads next, and how much of the first message it has read.
    pub(super) rd_off: usize,
    pub(super) head_read: usize,

    // State.
    /// This side may still read / write (no local shutdown of that direction).
    pub(super) readable: bool,
    pub(super) writable: bool,
    /// The peer sent SHUTDOWN or DISCONNECT: reads end once the queue is drained.
    pub(super) peer_eof: bool,
    /// The peer sent DISCONNECT (or SHUTDOWN after this side's): writes fail.
    pub(super) peer_disconnected: bool,
    /// This side sent DISCONNECT: nothing more goes out.
    pub(super) disconnect_sent: bool,
    /// This side sent SHUTDOWN.
    pub(super) shutdown_sent: bool,
    /// The connection went away without the peer's SHUTDOWN or DISCONNECT.
    pub(super) peer_gone: bool,
    /// What broke the stream: the error every later call returns.
    pub(super) fatal: Option<(io::ErrorKind, String)>,
    /// The first data WRITE that failed, even where the failure broke nothing more (the peer
    /// had left or disconnected): `flush` and `shutdown` report it, so that no write the
    /// peer never got is reported done.
    pub(super) write_lost: Option<String>,
    pub(super) read_timeout: Duration,
    pub(super) write_timeout: Duration,
    /// The connection's CM event channel (its own), whose descriptor an async wait watches
    /// for the peer's departure.
    #[cfg(feature = "tokio")]
    pub(super) channel: crate::EventChannel,
    /// Whether the CQ is armed with no event read since: an async wait arms it only then.
    #[cfg(feature = "tokio")]
    pub(super) cq_armed: bool,
    /// The tasks waiting on the stream; the waker made from them, which the reactor holds,
    /// wakes them all.
    #[cfg(feature = "tokio")]
    pub(super) wakers: std::sync::Arc<crate::stream::async_io::Wakers>,
    /// Completions handled so far: an async call that handled some wakes the other
    /// direction's task, which may wait for them.
    #[cfg(feature = "tokio")]
    pub(super) handled: u64,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("peer_addr", &self.peer_addr)
            .field("readable", &self.readable)
            .field("writable", &self.writable)
            .field("peer_eof", &self.peer_eof)
            .field("fatal", &self.fatal)
            .field("sent", &(self.sseq_no, self.sseq_comp))
            .field("in_flight", &(self.data_in_flight, self.ctrl_in_flight))
            .field("target", &self.target.map(|t| t.length))
            .field("unread", &self.rx_msgs.len())
            .field("received", &(self.rx_seq, self.rx_limit))
            .finish_non_exhaustive()
    }
}

impl Stream {
    /// The connected stream, from its lane, QP, buffers and the peer's connection data. Sends
    /// the first credit update (the grant of the second half) at once, as rsocket's first
    /// poll does.
    pub(super) fn start(
        lane: Lane,
        qp: LaneQp,
        bufs: Buffers,
        peer: ConnData,
        peer_addr: Option<SocketAddr>,
        #[cfg_attr(not(feature = "tokio"), allow(unused_variables))] channel: crate::EventChannel,
    ) -> Result<Stream> {
        let Buffers { rbuf, sgl, send, spares, cfg, .. } = bufs;
        let mut send_free = VecDeque::with_capacity(spares.len() + 1);
        send_free.push_back(send);
        let (half, credits) = (cfg.half(), cfg.credits_given());
        let mut s = Stream {
            lane,
            qp,
            peer_addr,
            rbuf,
            cfg,
            sgl,
            send_free,
            spares,
            inline_max: 0,
            peer_order: peer.order,
            peer_sgl: RemoteRegion::new(
                peer.target_sgl.addr,
                peer.target_sgl.key,
                u64::from(peer.target_sgl.length) * SGE_LEN as u64,
            ),
            peer_slots: peer.target_sgl.length,
            peer_credits: peer.credits,
            sseq_no: 0,
            sseq_comp: peer.credits,
            target: Some(peer.data_buf),
            next_target: None,
            next_grant_slot: 1,
            data_in_flight: 0,
            ctrl_in_flight: 0,
            rseq_no: 0,
            rseq_comp: cfg.update_every(),
            rbuf_bytes_avail: half,
            rbuf_free_offset: half,
            remote_sge: 1,
            rx_seq: 0,
            rx_limit: credits,
            rx_write_off: 0,
            rx_granted: half,
            rx_msgs: VecDeque::with_capacity(usize::from(credits)),
            rd_off: 0,
            head_read: 0,
            readable: true,
            writable: true,
            peer_eof: false,
            peer_disconnected: false,
            disconnect_sent: false,
            shutdown_sent: false,
            peer_gone: false,
            fatal: None,
            write_lost: None,
            read_timeout: DEFAULT_TIMEOUT,
            write_timeout: DEFAULT_TIMEOUT,
            #[cfg(feature = "tokio")]
            channel,
            #[cfg(feature = "tokio")]
            cq_armed: false,
            #[cfg(feature = "tokio")]
            wakers: std::sync::Arc::new(crate::stream::async_io::Wakers::default()),
            #[cfg(feature = "tokio")]
            handled: 0,
        };
        let inline = s.lane.max_inline_data(qp)?;
        if inline < SGE_LEN as u32 {
            return Err(Error::Unsupported {
                what: "an rsocket stream on this device",
                why: "the QP takes fewer than 16 inline bytes, and grants are written inline".into(),
            });
        }
        s.inline_max = inline.min(INLINE) as usize;
        s.give_credits();
        Ok(s)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// The error that broke the stream, as an `io::Error`.
    pub(super) fn fatal_error(&self) -> Option<io::Error> {
        self.fatal.as_ref().map(|(k, m)| io::Error::new(*k, m.clone()))
    }

    /// Breaks the stream with `what`: the QP goes to the error state (everything posted
    /// flushes) and every later call fails with it. The first cause is kept.
    pub(super) fn fail(&mut self, kind: io::ErrorKind, what: String) {
        if self.fatal.is_none() {
            self.fatal = Some((kind, what));
            let _ = self.lane.set_error(self.qp);
        }
    }

    /// A protocol violation by the peer: the stream is closed.
    fn violation(&mut self, what: String) {
        let e = Error::Protocol { what, addr: self.peer_addr };
        self.fail(io::ErrorKind::InvalidData, e.to_string());
    }

    /// Reaps what the CQ holds, without waiting, then sends the credit update that is due. At
    /// most a CQ's depth of completions per call: a peer that floods uncounted control
    /// messages cannot keep a read or write here past its deadline, which the caller checks
    /// between calls.
    /// Returns how many completions it handled.
    pub(super) fn poll_now(&mut self) -> usize {
        let mut n = 0;
        for _ in 0..self.cfg.cq_depth() {
            match self.lane.poll() {
                Ok(Some(c)) => {
                    self.handle(c);
                    n += 1;
                }
                Ok(None) => break,
                Err(e) => {
                    self.fail(io::ErrorKind::Other, e.to_string());
                    break;
                }
            }
        }
        self.give_credits();
        #[cfg(feature = "tokio")]
        {
            self.handled = self.handled.wrapping_add(n as u64);
        }
        n
    }

    /// Waits until `deadline` for at least one completion and handles everything then there.
    /// Between slices of the wait it looks at the connection's CM events, so a peer that left
    /// without a word is noticed. Returns false when the deadline passed with nothing new; true
    /// at once when the stream is broken.
    pub(super) fn wait_until(&mut self, deadline: Instant) -> bool {
        // The lane's wait arms the CQ and reads the event it raises: an async wait must arm
        // it again before it sleeps.
        #[cfg(feature = "tokio")]
        {
            self.cq_armed = false;
        }
        // Polls a little before it sleeps, as rsocket does (its `polling_time`): an answer
        // that comes within the window costs no arming, sleep and wake-up.
        // The clock is looked at every few polls: a poll costs less than a clock read.
        let spin_end = (Instant::now() + POLL_WINDOW).min(deadline);
        loop {
            for _ in 0..POLLS_PER_LOOK {
                if self.poll_now() > 0 || self.fatal.is_some() {
                    return true;
                }
                std::hint::spin_loop();
            }
            if Instant::now() >= spin_end {
                break;
            }
        }
        loop {
            // Broken meanwhile (a violation found by a poll): nothing to wait for.
            if self.fatal.is_some() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            match self.lane.wait((deadline - now).min(SLICE)) {
                Ok(c) => {
                    self.handle(c);
                    self.poll_now();
                    return true;
                }
                Err(Error::Timeout { .. }) => {
                    if !self.peer_gone && matches!(self.lane.peer_left(self.qp), Ok(true)) {
                        self.peer_gone = true;
                        // The flush of what was posted follows; nothing more can arrive.
                        return true;
                    }
                }
                Err(e) => {
                    self.fail(io::ErrorKind::ConnectionAborted, e.to_string());
                    return true;
                }
            }
        }
    }

    /// Waits until `deadline` for completions, the flushes of a broken stream's too, until
    /// `done` holds; whether it does.
    pub(super) fn wait_flushed(&mut self, deadline: Instant, done: impl Fn(&Stream) -> bool) -> bool {
        // The lane's wait reads the CQ's events: an async wait must arm it again.
        #[cfg(feature = "tokio")]
        {
            self.cq_armed = false;
        }
        loop {
            self.poll_now();
            if done(self) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            match self.lane.wait((deadline - now).min(SLICE)) {
                Ok(c) => self.handle(c),
                Err(Error::Timeout { .. }) => {}
                Err(_) => return done(self),
            }
        }
    }

    /// One completion.
    fn handle(&mut self, mut c: Completion) {
        match c.wr_id() {
            WR_RECV => {
                let region = c.take_region();
                if !c.is_ok() {
                    self.lost(&c);
                    return;
                }
                // Posted again at once, as rsocket does after each poll (rsocket.c:2079).
                if let Some(r) = region {
                    if self.fatal.is_none() && !self.peer_gone {
                        if let Err(e) = self.lane.post_recv(self.qp, RecvWr::range(r, 0..0).wr_id(WR_RECV)) {
                            self.fail(io::ErrorKind::Other, e.to_string());
                        }
                    }
                }
                self.message(c.imm_data(), c.byte_len());
            }
            WR_DATA | WR_REGION => {
                self.data_in_flight = self.data_in_flight.saturating_sub(1);
                // A send-buffer chunk joins the ring again; a caller's region's handle is
                // dropped: the device is done reading it for this WRITE.
                if let Some(r) = c.take_region() {
                    if c.wr_id() == WR_DATA {
                        self.give_back(r);
                    }
                }
                if !c.is_ok() {
                    if self.write_lost.is_none() {
                        let status = c.status();
                        self.write_lost = Some(format!(
                            "a data WRITE failed ({status}): its bytes may not have reached the peer{}",
                            self.peer_addr.map(|a| format!(" {a}")).unwrap_or_default()
                        ));
                    }
                    self.lost(&c);
                }
            }
            _ => {
                self.ctrl_in_flight = self.ctrl_in_flight.saturating_sub(1);
                if !c.is_ok() {
                    self.lost(&c);
                }
            }
        }
    }

    /// A failed completion: a flush after the stream broke or the peer left says nothing new,
    /// nor does a failure after the peer's DISCONNECT (rsocket moves its QP to the error state
    /// right after sending it, and sends its CM disconnect only when it closes); any other
    /// failure breaks the stream with its status.
    fn lost(&mut self, c: &Completion) {
        if self.fatal.is_some() || self.peer_gone || self.disconnect_sent || self.peer_disconnected {
            return;
        }
        if !self.peer_gone && matches!(self.lane.peer_left(self.qp), Ok(true)) {
            self.peer_gone = true;
            return;
        }
        let what = match c.wr_id() {
            WR_RECV => "a receive",
            WR_DATA | WR_REGION => "a data WRITE",
            _ => "a control message",
        };
        let status = c.status();
        self.fail(
            io::ErrorKind::ConnectionAborted,
            format!("{what} failed: {status} ({}); the connection is broken", status.hint().unwrap_or("no hint")),
        );
    }

    /// One message from the peer: its immediate data (if any) and the bytes that arrived.
    fn message(&mut self, imm: Option<u32>, byte_len: u32) {
        let Some(imm) = imm else {
            return self.violation(format!(
                "a message of {byte_len} bytes without immediate data (a SEND): rsocket on InfiniBand and RoCE sends \
                 only RDMA WRITEs with immediate data"
            ));
        };
        let msg = match Msg::from_imm(imm) {
            Ok(m) => m,
            Err(e) => return self.violation(e.to_string()),
        };
        match msg {
            Msg::Data { len } => self.data(len, byte_len),
            Msg::Sgl { limit } => self.credit(limit, byte_len),
            Msg::IoMapSgl { index } => {
                self.violation(format!("an iomap update (entry {index}), though this side advertised no iomap entries"))
            }
            Msg::Ctrl(c) if byte_len != 0 => {
                self.violation(format!("a control message ({c:?}) that wrote {byte_len} bytes"))
            }
            Msg::Ctrl(Ctrl::Keepalive) => {}
            Msg::Ctrl(Ctrl::Shutdown) => {
                self.peer_eof = true;
                if !self.writable {
                    self.peer_disconnected = true;
                }
            }
            Msg::Ctrl(Ctrl::Disconnect) => {
                self.peer_eof = true;
                self.peer_disconnected = true;
            }
        }
    }

    /// A data message: `len` bytes written at the next place of the granted space.
    fn data(&mut self, len: u32, byte_len: u32) {
        let n = len as usize;
        if n == 0 {
            // A read would take it for the end of the stream; rsocket never sends one.
            return self.violation("a data message of 0 bytes".into());
        }
        if byte_len != len {
            return self.violation(format!("a data message of {len} bytes whose WRITE carried {byte_len}"));
        }
        let half = self.cfg.half();
        let in_half = half - self.rx_write_off % half;
        if n > self.rx_granted || n > in_half {
            return self.violation(format!(
                "a data message of {len} bytes where {} bytes of granted space were left ({in_half} in the current half)",
                self.rx_granted.min(in_half)
            ));
        }
        let window = self.rx_limit.wrapping_sub(self.rx_seq);
        if window == 0
            || window > self.cfg.credits_given()
            || self.rx_msgs.len() >= usize::from(self.cfg.credits_given())
        {
            return self.violation(format!(
                "data message {} beyond its credits: the last credit limit sent was {}",
                self.rx_seq, self.rx_limit
            ));
        }
        if self.peer_eof {
            return self.violation("a data message after its SHUTDOWN or DISCONNECT".into());
        }
        self.rx_seq = self.rx_seq.wrapping_add(1);
        self.rx_granted -= n;
        self.rx_write_off = (self.rx_write_off + n) % self.cfg.rbuf_size();
        self.rx_msgs.push_back(len);
    }

    /// A credit update, with a grant in this side's target SGL when 16 bytes came.
    fn credit(&mut self, limit: u16, byte_len: u32) {
        match byte_len {
            0 => {}
            16 => {
                let mut b = [0u8; SGE_LEN];
                let at = self.next_grant_slot as usize * SGE_LEN;
                if let Err(e) = self.sgl.read_at(at, &mut b) {
                    return self.fail(io::ErrorKind::Other, e.to_string());
                }
                let g = match Sge::decode(&b, ByteOrder::native()).check_grant() {
                    Ok(g) => g,
                    Err(e) => return self.violation(e.to_string()),
                };
                if self.target.is_none() {
                    self.target = Some(g);
                } else if self.next_target.is_none() {
                    self.next_target = Some(g);
                } else {
                    return self.violation("a third buffer grant while the two before it were not filled yet".into());
                }
                self.next_grant_slot = (self.next_grant_slot + 1) % SGL_SLOTS;
            }
            n => return self.violation(format!("a credit update that wrote {n} bytes (a grant is 16)")),
        }
        let window = limit.wrapping_sub(self.sseq_no);
        if window > self.peer_credits {
            return self.violation(format!(
                "a credit limit of {limit} after {} data messages: {window} credits, more than its {} receives",
                self.sseq_no, self.peer_credits
            ));
        }
        self.sseq_comp = limit;
    }

    /// Whether a data WRITE of (some of) `len` bytes may start now: a send-queue entry,
    /// send-buffer space unless it goes inline, a credit (a few kept back so the peer's
    /// receives also cover this side's control messages), and granted space.
    pub(super) fn can_send_data(&self, len: usize) -> bool {
        // What the WRITE would carry: the grant's rest may make it small enough to go inline.
        let Some(room) = self.can_post_data() else {
            return false;
        };
        len.min(room) <= self.inline_max || !self.send_free.is_empty()
    }

    /// The granted space left, when a data WRITE that needs no send-buffer space (inline, or
    /// from a caller's region) may start now: a send-queue entry, a credit (a few kept back so
    /// the peer's receives also cover this side's control messages) and granted space.
    pub(super) fn can_post_data(&self) -> Option<usize> {
        let reserve = if self.peer_credits > 2 * QP_CTRL_SIZE { QP_CTRL_SIZE } else { 0 };
        let room = self.target.map(|t| t.length as usize).filter(|&r| r > 0)?;
        (self.data_in_flight < self.cfg.data_slots() && self.sseq_comp.wrapping_sub(self.sseq_no) > reserve)
            .then_some(room)
    }

    /// Posts one data WRITE of the start of `src` (non-empty; the caller checked
    /// [`Stream::can_send_data`]): at most 64 KiB (rsocket's largest transfer), what the
    /// current grant has left, and the send buffer's contiguous free space; inline, from `src`
    /// itself, when that is at most 64 bytes. Returns the bytes taken.
    pub(super) fn send_data(&mut self, src: &[u8]) -> io::Result<usize> {
        let Some(t) = self.target else {
            return Ok(0);
        };
        let want = src.len().min(MAX_WRITE).min(t.length as usize);
        let remote = RemoteRegion::new(t.addr, t.key, u64::from(t.length));
        let n = if want <= self.inline_max {
            let wr = InlineWr::write(&src[..want], &remote, 0).imm(data_imm(want)).wr_id(WR_DATA);
            if let Err(e) = self.lane.post_inline(self.qp, wr) {
                return Err(self.post_failed(e));
            }
            want
        } else {
            let Some(mut chunk) = self.take_send_space(want) else {
                return Ok(0);
            };
            // A chunk longer than `want` (no spare handle to split it with) is sent in part.
            let n = want.min(chunk.len());
            // A plain copy: the send buffer is registered for local access only and the chunk
            // is in no work request, so `as_mut_slice` hands it out.
            match chunk.as_mut_slice() {
                Ok(bytes) => bytes[..n].copy_from_slice(&src[..n]),
                Err(e) => {
                    self.send_free.push_front(chunk);
                    return Err(io::Error::other(e));
                }
            }
            let wr = SendWr::write(chunk, 0..n, &remote, 0).imm(data_imm(n)).wr_id(WR_DATA);
            if let Err(r) = self.lane.post_send(self.qp, wr) {
                let (e, back) = r.into_parts();
                if let Some(c) = back {
                    self.send_free.push_front(c);
                }
                return Err(self.post_failed(e));
            }
            n
        };
        self.data_posted(t, n);
        Ok(n)
    }

    /// Posts one data WRITE straight from `mr`'s bytes `at..end` (a non-empty range; the
    /// caller checked [`Stream::can_post_data`], the range and the region's protection domain):
    /// at most 64 KiB and what the current grant has left. The work request holds a handle of
    /// the region until its completion; the caller holds the region itself until then, out of
    /// its owner's reach ([`Stream::write_region`]), so its bytes cannot change meanwhile.
    /// Returns the bytes taken.
    pub(super) fn send_region(&mut self, mr: &MemoryRegion, at: usize, end: usize) -> io::Result<usize> {
        let Some(t) = self.target else {
            return Ok(0);
        };
        let n = (end - at).min(MAX_WRITE).min(t.length as usize);
        let remote = RemoteRegion::new(t.addr, t.key, u64::from(t.length));
        let wr = SendWr::write(mr.share_for_reading(), at..at + n, &remote, 0).imm(data_imm(n)).wr_id(WR_REGION);
        if let Err(r) = self.lane.post_send(self.qp, wr) {
            return Err(self.post_failed(r.into_parts().0));
        }
        self.data_posted(t, n);
        Ok(n)
    }

    /// A refused post of a data WRITE: the stream is broken with it (what was posted before
    /// may have been taken or not); the error to return.
    fn post_failed(&mut self, e: Error) -> io::Error {
        self.fail(io::ErrorKind::Other, e.to_string());
        self.fatal_error().unwrap_or_else(|| io::Error::other("post failed"))
    }

    /// A data WRITE of `n` bytes posted into `t`, the current grant: one more message in
    /// flight, and the grant's rest (or the next grant once it is used up).
    fn data_posted(&mut self, mut t: Sge, n: usize) {
        self.data_in_flight += 1;
        self.sseq_no = self.sseq_no.wrapping_add(1);
        // check_grant: the range ends at or below 2^64; an address that reaches 2^64 exactly
        // comes with length 0 and is never used.
        t.addr = t.addr.wrapping_add(n as u64);
        t.length -= n as u32;
        self.target = if t.length == 0 { self.next_target.take() } else { Some(t) };
    }

    /// The send buffer's next `want` bytes (fewer where its free space ends or wraps), as a
    /// chunk of their own: the front of the ring, split when it is longer and a spare handle
    /// is there.
    fn take_send_space(&mut self, want: usize) -> Option<MemoryRegion> {
        let mut front = self.send_free.pop_front()?;
        if front.len() > want {
            if let Some(spare) = self.spares.pop() {
                match front.split_off(want, spare) {
                    Ok(rest) => self.send_free.push_front(rest),
                    Err(spare) => self.spares.push(spare),
                }
            }
        }
        Some(front)
    }

    /// A WRITE's chunk back from its completion: joined onto the ring's free space. WRITEs
    /// complete in the order they were posted, so the chunk starts where the free space ends
    /// (or at the buffer's start, after a wrap).
    fn give_back(&mut self, chunk: MemoryRegion) {
        let chunk = match self.send_free.back_mut() {
            Some(back) => match back.join(chunk) {
                Ok(spare) => return self.spares.push(spare),
                Err(chunk) => chunk,
            },
            None => chunk,
        };
        self.send_free.push_back(chunk);
    }

    /// Whether a control message may be posted now.
    pub(super) fn ctrl_free(&self) -> bool {
        self.ctrl_in_flight < CTRL_SLOTS
    }

    /// Posts a control message (a zero-length WRITE with immediate data). The caller checked
    /// [`Stream::ctrl_free`].
    pub(super) fn send_ctrl(&mut self, msg: Msg) {
        let none = RemoteRegion::new(0, 0, 0);
        let wr = InlineWr::write(&[], &none, 0).imm(msg.to_imm()).wr_id(WR_CTRL);
        match self.lane.post_inline(self.qp, wr) {
            Ok(()) => self.ctrl_in_flight += 1,
            Err(e) => self.fail(io::ErrorKind::Other, e.to_string()),
        }
    }

    /// Sends the credit update that is due, as rsocket's `rs_give_credits`: when a half of the
    /// receive buffer is free again, a grant of it; when half the credits were used, a bare
    /// update.
    /// None once the peer sent its SHUTDOWN or DISCONNECT: it sends no more data, and after a
    /// DISCONNECT rsocket's QP is in the error state, so an update would only fail.
    pub(super) fn give_credits(&mut self) {
        if self.fatal.is_some() || self.peer_gone || self.disconnect_sent || self.peer_eof || !self.ctrl_free() {
            return;
        }
        let (half, credits) = (self.cfg.half(), self.cfg.credits_given());
        let grant = self.rbuf_bytes_avail >= half;
        if !grant && (self.rseq_no.wrapping_sub(self.rseq_comp) as i16) < 0 {
            return;
        }
        let limit = self.rseq_no.wrapping_add(credits);
        let imm = Msg::Sgl { limit }.to_imm();
        if grant {
            let sge = Sge {
                addr: self.rbuf.addr() + self.rbuf_free_offset as u64,
                key: self.rbuf.rkey(),
                length: half as u32,
            };
            let bytes = sge.encode(self.peer_order);
            let at = u64::from(self.remote_sge) * SGE_LEN as u64;
            let wr = InlineWr::write(&bytes, &self.peer_sgl, at).imm(imm).wr_id(WR_CTRL);
            if let Err(e) = self.lane.post_inline(self.qp, wr) {
                return self.fail(io::ErrorKind::Other, e.to_string());
            }
            self.ctrl_in_flight += 1;
            self.rbuf_bytes_avail -= half;
            self.rbuf_free_offset = (self.rbuf_free_offset + half) % self.cfg.rbuf_size();
            self.remote_sge = (self.remote_sge + 1) % self.peer_slots;
            self.rx_granted += half;
        } else {
            self.send_ctrl(Msg::Sgl { limit });
        }
        self.rx_limit = limit;
        self.rseq_comp = self.rseq_no.wrapping_add(self.cfg.update_every());
    }

    /// Copies queued data into `dst`, in order; returns the bytes copied.
    pub(super) fn copy_out(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < dst.len() {
            let Some(&len) = self.rx_msgs.front() else { break };
            let n = (len as usize - self.head_read).min(dst.len() - done);
            // A message lies inside one half (checked when it came), so no wrap here.
            self.rbuf.read_at(self.rd_off, &mut dst[done..done + n]).map_err(io::Error::other)?;
            done += n;
            self.head_read += n;
            self.rd_off = (self.rd_off + n) % self.cfg.rbuf_size();
            self.rbuf_bytes_avail += n;
            if self.head_read == len as usize {
                self.rx_msgs.pop_front();
                self.head_read = 0;
                self.rseq_no = self.rseq_no.wrapping_add(1);
            }
        }
        Ok(done)
    }

    /// Whether every send posted has completed.
    pub(super) fn sends_done(&self) -> bool {
        self.data_in_flight == 0 && self.ctrl_in_flight == 0
    }

    /// The connection went away: the error for a read or write that finds it so.
    pub(super) fn gone_error(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::ConnectionReset,
            format!(
                "the peer{} closed the connection without an rsocket SHUTDOWN or DISCONNECT message (its process \
                 exited, or it closed the connection abruptly)",
                self.peer_addr.map(|a| format!(" {a}")).unwrap_or_default()
            ),
        )
    }

    /// A timeout error for `op` after `t`.
    pub(super) fn timeout_error(&self, op: &str, t: Duration) -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, format!("{op} on the stream timed out after {t:?}"))
    }
}
