//! What `rc_pingpong`, `ud_pingpong` and `srq_pingpong` share: rdma-core's pingpong flags, the
//! TCP exchange of their `LLLL:QQQQQQ:PPPPPP:GID` messages (each side's [`PeerInfo`]), opening
//! the device, and the closing figures. Every wait is bounded; every byte from the network is
//! checked ([`PeerInfo::from_wire`]).
//!
//! The exchange, as rdma-core's programs run it (`libibverbs/examples/*_pingpong.c`):
//!
//! ```text
//! client                                     server (listens on -p, default 18515)
//! connect ────────────────────────────────►  accept
//! its N messages (52 bytes each) ─────────►  reads N messages
//!                                            connects its QPs (RTR, RTS) with them
//! reads N messages  ◄─────────────────────── its N messages
//! "done\0" ───────────────────────────────►  reads 5 bytes
//! connects its QPs, then sends first
//! ```
//!
//! N is 1 for `ibv_rc_pingpong` and `ibv_ud_pingpong`, and always 256 for `ibv_srq_pingpong`
//! (its unused entries are zeros).
#![allow(dead_code)] // each example uses part of this module

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use rdma_cm::verbs::lane::{DestKey, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::verbs::peer::PeerInfo;
use rdma_cm::{devices, MemoryRegion, VerbsContext};

/// How long the server waits for a client, and each side for the other's messages.
pub const EXCHANGE_WAIT: Duration = Duration::from_secs(60);
/// How long the ping-pong may go without a completion before it gives up.
pub const IDLE_WAIT: Duration = Duration::from_secs(20);

/// rdma-core's pingpong flags (the ones these examples support).
#[derive(Debug, clap::Parser)]
#[command(disable_help_flag = true)]
pub struct Args {
    /// Listen on / connect to TCP port PORT.
    #[arg(short = 'p', long = "port", default_value_t = 18515)]
    pub port: u16,
    /// Use RDMA device DEV (default: the first one found).
    #[arg(short = 'd', long = "ib-dev")]
    pub ib_dev: Option<String>,
    /// Use port PORT of the device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    pub ib_port: u8,
    /// Size of each message in bytes (default 4096; ud_pingpong: 2048).
    #[arg(short = 's', long = "size")]
    pub size: Option<u32>,
    /// Path MTU in bytes (RC): 256, 512, 1024, 2048 or 4096.
    #[arg(short = 'm', long = "mtu", default_value_t = 1024)]
    pub mtu: u32,
    /// Receives to keep posted.
    #[arg(short = 'r', long = "rx-depth", default_value_t = 500)]
    pub rx_depth: u32,
    /// Exchanges.
    #[arg(short = 'n', long = "iters", default_value_t = 1000)]
    pub iters: u32,
    /// Service level.
    #[arg(short = 'l', long = "sl", default_value_t = 0)]
    pub sl: u8,
    /// Sleep on CQ events (accepted: the waits here always sleep on the CQ's channel).
    #[arg(short = 'e', long = "events")]
    pub events: bool,
    /// Local GID index (needed on RoCE; on rxe usually 1, the IPv4-mapped GID).
    #[arg(short = 'g', long = "gid-idx")]
    pub gid_idx: Option<u8>,
    /// Validate the received buffer (as rdma-core's `-c`: the first byte of every page sent
    /// is 0, from both sides, since rdma-core's server sends back what it received; the
    /// server checks what it received last).
    #[arg(short = 'c', long = "chk")]
    pub chk: bool,
    /// Number of QPs (srq_pingpong only).
    #[arg(short = 'q', long = "num-qp", default_value_t = 16)]
    pub num_qp: u32,
    /// Print help.
    #[arg(short = 'h', long = "help", action = clap::ArgAction::Help)]
    pub help: Option<bool>,
    /// The server to connect to; without it, this is the server.
    pub host: Option<String>,
}

/// Prints `msg` on stderr and exits with status 1, as rdma-core's programs do on failure.
pub fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("{msg}");
    std::process::exit(1)
}

/// Opens `-d`'s device, or the first one.
pub fn open_device(name: Option<&str>) -> VerbsContext {
    let name = match name {
        Some(n) => n.to_string(),
        None => match devices() {
            Ok(list) => match list.into_iter().next() {
                Some(d) => d.name,
                None => die("No IB devices found"),
            },
            Err(e) => die(format!("Failed to get IB devices list: {e}")),
        },
    };
    VerbsContext::open(&name).unwrap_or_else(|e| die(format!("IB device {name} not found: {e}")))
}

/// The client's half: sends `mine`, reads as many messages back, sends `"done\0"`.
///
/// # Errors
/// A one-line reason: the server unreachable, a short or malformed message, a timeout.
pub fn client_exchange(host: &str, port: u16, mine: &[PeerInfo]) -> Result<Vec<PeerInfo>, String> {
    let addrs: Vec<SocketAddr> =
        (host, port).to_socket_addrs().map_err(|e| format!("{e} for {host}:{port}"))?.collect();
    let mut sock = addrs
        .iter()
        .find_map(|a| TcpStream::connect_timeout(a, EXCHANGE_WAIT).ok())
        .ok_or_else(|| format!("Couldn't connect to {host}:{port}"))?;
    sock.set_read_timeout(Some(EXCHANGE_WAIT)).map_err(|e| e.to_string())?;
    sock.set_write_timeout(Some(EXCHANGE_WAIT)).map_err(|e| e.to_string())?;
    sock.write_all(&encode(mine)?).map_err(|e| format!("Couldn't send local address: {e}"))?;
    let theirs = read_messages(&mut sock, mine.len())?;
    sock.write_all(b"done\0").map_err(|e| format!("Couldn't send \"done\": {e}"))?;
    Ok(theirs)
}

/// The server's socket, bound and listening on `port` (with `SO_REUSEADDR`, as std sets it),
/// before anything is printed: whoever waits for the server's first line can connect.
///
/// # Errors
/// A one-line reason (the port in use, say).
pub fn listen(port: u16) -> Result<TcpListener, String> {
    TcpListener::bind(("0.0.0.0", port)).map_err(|e| format!("Couldn't listen to port {port}: {e}"))
}

/// The server's half: accepts one client on `listener` within [`EXCHANGE_WAIT`], reads `n`
/// messages, calls `connect` with them (its QPs must be ready to receive before the client
/// learns them), sends what `connect` returns, and waits for `"done"`.
///
/// # Errors
/// A one-line reason, as for [`client_exchange`], or what `connect` returned.
pub fn server_exchange(
    listener: TcpListener,
    n: usize,
    connect: impl FnOnce(&[PeerInfo]) -> Result<Vec<PeerInfo>, String>,
) -> Result<Vec<PeerInfo>, String> {
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    wait_readable(&listener, EXCHANGE_WAIT).map_err(|e| format!("no client connected to port {port}: {e}"))?;
    let (mut sock, _) = listener.accept().map_err(|e| format!("accept() failed: {e}"))?;
    drop(listener);
    sock.set_read_timeout(Some(EXCHANGE_WAIT)).map_err(|e| e.to_string())?;
    sock.set_write_timeout(Some(EXCHANGE_WAIT)).map_err(|e| e.to_string())?;
    let theirs = read_messages(&mut sock, n)?;
    let mine = connect(&theirs)?;
    sock.write_all(&encode(&mine)?).map_err(|e| format!("Couldn't send local address: {e}"))?;
    let mut done = [0u8; 5];
    sock.read_exact(&mut done).map_err(|e| format!("Couldn't read \"done\": {e}"))?;
    if &done != b"done\0" {
        return Err(format!("the client sent {done:?}, not \"done\""));
    }
    Ok(theirs)
}

fn encode(mine: &[PeerInfo]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(mine.len() * PeerInfo::WIRE_LEN);
    for m in mine {
        out.extend_from_slice(&m.to_wire().map_err(|e| e.to_string())?);
    }
    Ok(out)
}

fn read_messages(sock: &mut TcpStream, n: usize) -> Result<Vec<PeerInfo>, String> {
    let mut out = Vec::with_capacity(n);
    let mut msg = [0u8; PeerInfo::WIRE_LEN];
    for i in 0..n {
        sock.read_exact(&mut msg)
            .map_err(|e| format!("Couldn't read remote address [{i}]: {e} (the peer closed, or sent less)"))?;
        out.push(PeerInfo::from_wire(&msg).map_err(|e| format!("remote address [{i}]: {e}"))?);
    }
    Ok(out)
}

fn wait_readable(l: &TcpListener, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("timed out after {within:?}"));
        }
        let mut p = libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: `p` is one valid pollfd for the call; the listener's descriptor is open.
        let r = unsafe { libc::poll(&mut p, 1, left.as_millis().min(1000) as i32) };
        if r > 0 {
            return Ok(());
        }
        if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err(std::io::Error::last_os_error().to_string());
        }
    }
}

/// Prints `  local address:  …` as rdma-core's programs do.
pub fn print_local(p: &PeerInfo) {
    println!("  local address:  {p}");
}

/// Prints `  remote address: …`.
pub fn print_remote(p: &PeerInfo) {
    println!("  remote address: {p}");
}

/// Prints the closing figures in rdma-core's format.
pub fn print_figures(size: u32, iters: u32, elapsed: Duration) {
    let usec = elapsed.as_secs_f64() * 1e6;
    let bytes = u64::from(size) * u64::from(iters) * 2;
    println!("{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec", usec / 1e6, bytes as f64 * 8.0 / usec);
    println!("{iters} iters in {:.2} seconds = {:.2} usec/iter", usec / 1e6, usec / f64::from(iters.max(1)));
}

/// The system's page size (what `-c` marks).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The `wr_id` of every receive and of the send, as rdma-core's pingpongs number them.
pub const RECV_WRID: u64 = 1;
/// See [`RECV_WRID`].
pub const SEND_WRID: u64 = 2;

/// The one QP an rc or ud ping-pong drives, on its lane: the message it sends (in the lane
/// while its send is posted, handed back by the send's completion) and the receive buffers
/// not posted (each receive moves its own buffer into the lane; its completion hands it back).
pub struct OneQp {
    pub lane: Lane,
    pub qp: LaneQp,
    /// Where the sends go on UD; `None` on RC.
    pub dest: Option<DestKey>,
    /// The message, while no send of it is posted.
    pub send: Option<MemoryRegion>,
    /// Bytes sent from it.
    pub size: usize,
    /// Receive buffers not posted.
    pub spare: Vec<MemoryRegion>,
}

impl OneQp {
    /// Posts `n` receives, each on a buffer of [`OneQp::spare`].
    pub fn post_recvs(&mut self, n: usize) -> Result<(), String> {
        for _ in 0..n {
            let mr = self.spare.pop().ok_or("no receive buffer left to post")?;
            self.lane.post_recv(self.qp, RecvWr::new(mr).wr_id(RECV_WRID)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Posts the send of the message (to [`OneQp::dest`] on UD).
    fn post_send(&mut self) -> Result<(), String> {
        let mr = self.send.take().ok_or("the last send has not completed")?;
        let mut wr = SendWr::send(mr, 0..self.size).wr_id(SEND_WRID);
        if let Some(d) = self.dest {
            wr = wr.to(d);
        }
        self.lane.post_send(self.qp, wr).map_err(|e| e.to_string())
    }
}

/// rdma-core's rc/ud ping-pong loop: the client sends first; each side sends again once its
/// last send and a receive have completed, re-posting receives when one or none is left of the
/// `rx_depth` (`routs` posted now), until `iters` of each. Returns the time from the first
/// send, and the buffer the last message landed in (kept out of the receive queue, so
/// [`OneQp::spare`] needs one buffer more than `rx_depth - routs`). `idle` ends the message
/// printed when no completion comes for [`IDLE_WAIT`].
pub fn run(
    qp: &mut OneQp,
    iters: u32,
    rx_depth: u32,
    mut routs: u32,
    client: bool,
    idle: &str,
) -> (Duration, Option<MemoryRegion>) {
    let mut pending = RECV_WRID;
    if client {
        qp.post_send().unwrap_or_else(|e| die(format!("Couldn't post send: {e}")));
        pending |= SEND_WRID;
    }
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut last = None;
    while rcnt < iters || scnt < iters {
        let mut c = match qp.lane.wait(IDLE_WAIT) {
            Ok(c) => c,
            Err(rdma_cm::Error::Timeout { .. }) => {
                die(format!("no completion for {IDLE_WAIT:?} after {scnt} sends and {rcnt} receives: {idle}"))
            }
            Err(e) => die(format!("poll CQ failed: {e}")),
        };
        if !c.is_ok() {
            die(format!("Failed status {} ({}) for wr_id {}", c.status(), c.status().to_raw(), c.wr_id()));
        }
        match c.wr_id() {
            SEND_WRID => {
                qp.send = c.take_region();
                scnt += 1;
            }
            RECV_WRID => {
                // The buffer received into before this one goes back to the spares.
                qp.spare.extend(std::mem::replace(&mut last, c.take_region()));
                routs -= 1;
                if routs <= 1 {
                    let more = (rx_depth - routs) as usize;
                    qp.post_recvs(more).unwrap_or_else(|e| die(format!("Couldn't post receive ({routs}): {e}")));
                    routs += more as u32;
                }
                rcnt += 1;
            }
            other => die(format!("Completion for unknown wr_id {other}")),
        }
        pending &= !c.wr_id();
        if scnt < iters && pending == 0 {
            qp.post_send().unwrap_or_else(|e| die(format!("Couldn't post send: {e}")));
            pending = RECV_WRID | SEND_WRID;
        }
    }
    (start.elapsed(), last)
}
