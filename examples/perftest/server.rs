//! `perf_server`, the perf tool's server: serves `perf_client`'s latency, bandwidth and rate
//! modes, many clients at once. For rdma_cm's steps one by one, read the teaching pair first
//! (`examples/server.rs`, `examples/client.rs`).
//!
//! ```text
//! cargo run --release --example perf_server -- -a 0.0.0.0 -p 7471            # serve until Ctrl-C
//! cargo run --release --example perf_server -- -a 10.77.0.1 -p 7471 --count 1 # exit after one client
//! cargo run --release --example perf_server -- -a 10.77.0.1 --shared          # one thread, one channel, one CQ, one SRQ
//! ```
//!
//! `--shared` serves every client from one thread: one event channel for all connections, one
//! completion queue shared by all their QPs, and one shared receive queue whose slots are
//! echoed in place (send mode, messages up to `--slot` bytes). A silent or dead client delays
//! nobody: it is dropped after `--timeout` seconds without a message.
//!
//! Where the machine has no RDMA device, cargo runs it in the Soft-RoCE guest (harness/runner). The client chooses the mode
//! (send/write/read), the size and the iteration count and tells the server in the connect
//! private data; a client without that data (rdma-core's `rdma_client`) gets the 16-byte
//! exchange of rdma-core's `rdma_server`; a client streaming sends (`client --bw --mode send`)
//! gets a receiver that keeps 512 receives posted and reports what arrived. Clients are served
//! concurrently, one thread each; a client's failure is logged and never stops the server.
//! SIGINT/SIGTERM stop it cleanly.
//!
//! Each client is served on a lane (`rdma_cm::verbs::lane`), the crate's data path: the
//! client's thread owns the CQ and the QP, which joins the lane before the accept (so the
//! receive for the client's first message is in place before it can send), and each work
//! request moves its region into the lane until its completion hands it back
//! (`perftest/fast.rs`). `--shared` serves every client on one lane, whose SRQ
//! (`Lane::create_srq`) feeds all their QPs (`perftest/shared.rs`).

#[path = "../common/mod.rs"]
mod common;
mod fast;
mod protocol;
mod shared;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use common::{fail, micros, resolve_host, DEFAULT_PORT};
use fast::{LaneConn, Regions, INLINE_LAT};
use protocol::{fill_pattern, Doorbell, Mode, Request, LEGACY_SIZE};
use rdma_cm::verbs::lane::{self, Lane, Wc};
use rdma_cm::{
    AccessFlags, ConnParam, ConnectRequest, Error, MemoryRegion, ProtectionDomain, QpInfo, QpInit, Server, WorkQueue,
};

#[derive(Parser, Debug)]
#[command(about = "perf tool server: serves perf_client's modes (send/recv, RDMA WRITE, READ, atomics, streams)")]
struct Args {
    /// Address (or host name) to bind; 0.0.0.0: every RDMA device.
    #[arg(short = 'a', long = "addr", default_value = "0.0.0.0")]
    addr: String,
    /// Port to listen on.
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Exit after serving this many clients (default: serve until SIGINT/SIGTERM).
    #[arg(long)]
    count: Option<u32>,
    /// Listen backlog.
    #[arg(long, default_value_t = 16)]
    backlog: i32,
    /// Seconds any single wait may take (resolution, handshake, each message).
    #[arg(long, default_value_t = 10)]
    timeout: u64,
    /// Seconds a disconnect waits for this host's RDMA port to be ACTIVE again when its link
    /// is down (rdma_cm::cm::hold::set_disconnect_hold): a CM message sent while the link is down can
    /// leave the host's CM deaf until the device is re-created. 0: never wait.
    #[arg(long, default_value_t = 10)]
    disconnect_hold: u64,
    /// Serve all clients from one thread, on one event channel, one CQ and one SRQ.
    #[arg(long)]
    shared: bool,
    /// With --shared: receive slots in the SRQ.
    #[arg(long, default_value_t = 512)]
    srq_depth: u32,
    /// With --shared: bytes per receive slot (the largest message a client may send).
    #[arg(long, default_value_t = 4096)]
    slot: u32,
    /// With --shared: most clients connected at once (sizes the shared CQ).
    #[arg(long, default_value_t = 1024)]
    max_clients: u32,
    /// Busy-poll the completion queues while waiting (lowest latency, a core per client),
    /// as perftest does (on the lane, `Lane::spin_with`); default: spin briefly, then sleep on
    /// the completion channel (on the lane, `Lane::wait_with`: sleep on it at once).
    #[arg(long)]
    busy_poll: bool,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: on_signal only stores to an atomic, which is async-signal-safe; the handler
        // stays valid for the program's life.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

fn main() {
    let args = Args::parse();
    rdma_cm::cm::hold::set_disconnect_hold(Duration::from_secs(args.disconnect_hold));
    if args.port == 0 {
        fail("bad arguments", "port 0 is not a port a client can reach: choose 1..=65535 with -p");
    }
    install_signal_handlers();
    let timeout = Duration::from_secs(args.timeout.max(1));
    let bind = resolve_host(&args.addr, args.port).unwrap_or_else(|e| fail("bad arguments", e));

    if args.shared {
        shared::serve_all(&args, bind, timeout);
        return;
    }
    let server = Server::new().unwrap_or_else(|e| fail("creating the listening id", e));
    println!("[INFO] Created listening ID");
    let bound = server.bind(bind).unwrap_or_else(|e| fail("binding", e));
    println!("[INFO] Bound to address {bind}");
    let listener = bound.listen(args.backlog).unwrap_or_else(|e| fail("listening", e));
    println!("[INFO] Listening on port {}...", args.port);

    let served = Arc::new(AtomicU32::new(0));
    let failed = Arc::new(AtomicU32::new(0));
    let mut workers = Vec::new();
    let mut accepted = 0u32;
    while !STOP.load(Ordering::SeqCst) && args.count.is_none_or(|c| accepted < c) {
        let req = match listener.get_request(Duration::from_millis(500)) {
            Ok(r) => r,
            Err(Error::Timeout { .. }) => continue,
            Err(e) => {
                eprintln!("[ERROR] waiting for a connection request: {e}");
                continue;
            }
        };
        accepted += 1;
        let peer = req.peer_addr().map_or_else(|| "?".into(), |a| a.to_string());
        println!("[EVENT] Received CONNECT_REQUEST from {peer}");
        let (served, failed) = (Arc::clone(&served), Arc::clone(&failed));
        let busy = args.busy_poll;
        workers.push(std::thread::spawn(move || match serve(req, timeout, busy) {
            Ok(()) => {
                served.fetch_add(1, Ordering::SeqCst);
                println!("[INFO] Client {peer} done");
            }
            Err(e) => {
                failed.fetch_add(1, Ordering::SeqCst);
                eprintln!("[ERROR] client {peer}: {e}");
            }
        }));
        workers.retain(|w| !w.is_finished());
    }
    for w in workers {
        let _ = w.join();
    }
    println!(
        "[INFO] Server exiting: {} client(s) served, {} failed",
        served.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst)
    );
}

/// Serves one client from its request to its disconnect.
fn serve(req: ConnectRequest, timeout: Duration, busy_poll: bool) -> Result<(), String> {
    let parsed = match Request::decode(req.private_data()) {
        Ok(r) => r,
        Err(why) => {
            println!("[INFO] Rejecting {:?}: {why}", req.peer_addr());
            let _ = req.reject(why.as_bytes().get(..100).unwrap_or(why.as_bytes()));
            return Err(format!("rejected: {why}"));
        }
    };
    let (mode, size, iters, send_doorbell) = match parsed {
        Some(r) => (r.mode, r.size, r.iters, r.send_doorbell),
        None => {
            println!("[INFO] Peer sent no qp_info: rdma-core rdma_client protocol ({LEGACY_SIZE}-byte echo)");
            (Mode::Send, LEGACY_SIZE, 1, false)
        }
    };
    println!("[INFO] Mode {mode}, {size} bytes, {iters} iteration(s)");
    if mode == Mode::Write {
        let doorbell = if send_doorbell { Doorbell::Send } else { Doorbell::Imm };
        println!("[INFO] Each RDMA WRITE is rung with {doorbell}, as the client asked");
    }
    let err = |e: Error| e.to_string();
    let pd = req.alloc_pd().map_err(err)?;

    let t = Instant::now();
    let access = match mode {
        Mode::Send | Mode::SendStream => AccessFlags::LOCAL_WRITE,
        Mode::Write => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        Mode::Read => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        Mode::FetchAdd | Mode::CmpSwap => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
    };
    let mut bufs = [
        MemoryRegion::new(&pd, size as usize, access).map_err(err)?,
        MemoryRegion::new(&pd, size as usize, access).map_err(err)?,
    ];
    let ctl = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).map_err(err)?;
    println!("[INFO] Memory registration took {:.1} us ({} bytes, {:?})", micros(t.elapsed()), size, access);

    // Every mode is served on a lane (rdma_cm::verbs::lane): the QP joins it before the
    // accept, so the receive the client's first message needs is posted before it can send.
    let t = Instant::now();
    // A stream of sends needs receives posted well ahead of it, as ib_send_bw's server does.
    let recv_depth = if mode == Mode::SendStream { STREAM_RX_DEPTH } else { 16 };
    let mut lane = Lane::new(&req.context().map_err(err)?, 16 + recv_depth).map_err(err)?;
    let init = QpInit::new().max_recv_wr(recv_depth);
    // Send mode echoes small messages inline, as ib_send_lat does.
    let init = if mode == Mode::Send { init.max_inline_data(INLINE_LAT) } else { init };
    let peer = req.peer_addr();
    let client_region = parsed.and_then(|r| r.info.region());
    let server = req.lane_qp(&mut lane, &pd, init).map_err(err)?;
    let qp = server.qp();
    let qp_num = lane.qp_num(qp).map_err(err)?;
    println!(
        "[INFO] QP creation took {:.1} us (qp_num {qp_num}, 16 send / {recv_depth} recv WRs)",
        micros(t.elapsed())
    );

    if mode.is_atomic() {
        bufs[0].write_at(0, &0u64.to_ne_bytes()).map_err(err)?; // the counter starts at 0
    }
    let info = QpInfo {
        qp_num,
        psn: 0,
        rkey: bufs[0].rkey(),
        vaddr: bufs[0].addr(),
        len: if mode == Mode::Send { 0 } else { size.into() },
    };
    let info =
        if matches!(mode, Mode::Send | Mode::SendStream) { QpInfo { rkey: 0, vaddr: 0, len: 0, ..info } } else { info };
    // A 4-byte region for our small sends (doorbell, "done").
    let ring = MemoryRegion::new(&pd, 4, AccessFlags::LOCAL_WRITE).map_err(err)?;
    let [buf, other] = bufs;
    // Numbered as BUF, OTHER, CTL and RING. They outlive the client's disconnect: in read
    // mode its last RDMA READ of `buf` comes after our last answer.
    let mut regs = Regions::new(vec![buf, other, ctl, ring]);
    let mut lc = LaneConn::new(lane, qp, peer, busy_poll);
    // The receive for the client's first message, before the accept: its echo's, or its
    // doorbell, "go" or "done" (a send stream waits for our "ready", sent once its receives
    // are posted).
    let ends = match mode {
        Mode::Send => Some(EchoEnd::arm(&mut lc, &mut regs, size as usize).map_err(err)?),
        Mode::SendStream => None,
        Mode::Write | Mode::Read | Mode::FetchAdd | Mode::CmpSwap => {
            let first = lane::RecvWr::range(regs.take(CTL).map_err(err)?, 0..64).wr_id(CTL as u64);
            lc.lane.post_recv(lc.qp, first).map_err(|e| err(e.into()))?;
            None
        }
    };
    let param = ConnParam::new().private_data(&info.encode()).map_err(err)?;
    server.accept(&mut lc.lane, &param, timeout).map_err(err)?;
    println!("[EVENT] Connection established");

    let result = match (mode, client_region, ends) {
        (Mode::SendStream, _, _) => lane_sink(&mut lc, &pd, size, iters, timeout),
        (Mode::Write, Some(client), _) => {
            lane_echo_write(&mut lc, &mut regs, &client, send_doorbell, size, iters, timeout)
        }
        (Mode::Read, Some(client), _) => lane_echo_read(&mut lc, &mut regs, &client, size, iters, timeout),
        (Mode::Write | Mode::Read, None, _) => return Err("no client region".into()),
        (Mode::FetchAdd | Mode::CmpSwap, _, _) => lane_check_counter(&mut lc, &mut regs, mode, iters, timeout),
        (Mode::Send, _, Some(ends)) => lane_echo_send(&mut lc, &mut regs, ends, size, iters, timeout),
        (Mode::Send, _, None) => unreachable!("send mode arms its echo before the accept"),
    };
    result.map_err(err)?;
    // The client disconnects first; wait for it, bounded.
    match lc.wait_disconnected(timeout) {
        Ok(()) | Err(Error::Timeout { .. }) => {}
        Err(e) => return Err(e.to_string()),
    }
    println!("[INFO] Disconnected");
    drop((lc, regs));
    Ok(())
}

/// What a send stream's receiver sends the client once its receives are posted (perftest's
/// handshake after posting its receives does the same).
const READY: [u8; 4] = *b"rdy!";

/// Receives posted ahead of a client's stream of sends (ib_send_bw's default rx depth).
const STREAM_RX_DEPTH: u32 = 512;

/// Region numbers on the lane: each work request's `wr_id` is its region's number, so its
/// completion says where the region goes back ([`Regions`]).
const BUF: usize = 0; // the client's message, or the target of its (and our) RDMA
const OTHER: usize = 1; // send mode's second buffer: the next receive while BUF is echoed
const CTL: usize = 2; // the client's doorbell or "go"
const RING: usize = 3; // our doorbell or "done"

/// Most bytes a stream's receives take: on the lane each posted receive holds a region of its
/// own (chunks of one registration), so fewer are posted ahead for huge messages.
const STREAM_BYTES: usize = 64 << 20;

/// The receiving end of `client --bw --mode send`, on the lane: keeps receives posted (each in
/// a chunk of its own, up to 16 per doorbell) until `iters` sends have arrived, checks each
/// length and the last message's content, and answers with the count and the verdict.
fn lane_sink(lc: &mut LaneConn, pd: &Arc<ProtectionDomain>, size: u32, iters: u32, t: Duration) -> Result<(), Error> {
    const OP: &str = "receiving a stream of sends";
    let size = size as usize;
    let depth = STREAM_RX_DEPTH.min((STREAM_BYTES / size).max(1) as u32) as usize;
    let mut free = MemoryRegion::new(pd, size * depth, AccessFlags::LOCAL_WRITE)?.split(size)?;
    // The region of the latest message, kept out of the receives to check its content.
    let mut latest: Option<MemoryRegion> = None;
    let (mut posted, mut got, mut bad_len) = (0u32, 0u32, 0u32);
    // "ready", sent once the first receives are posted: the client starts its stream on it.
    let mut ready = Some(MemoryRegion::new(pd, 4, AccessFlags::LOCAL_WRITE)?);
    while got < iters {
        while posted < iters && !free.is_empty() {
            let n = ((iters - posted) as usize).min(free.len()).min(lane::MAX_LIST);
            let mut wrs: [Option<lane::RecvWr>; lane::MAX_LIST] = std::array::from_fn(|_| None);
            for w in &mut wrs[..n] {
                *w = free.pop().map(|mr| lane::RecvWr::range(mr, 0..size));
            }
            posted += lc.lane.post_recv_list(lc.qp, &mut wrs[..n])? as u32;
        }
        if let Some(mut mr) = ready.take().filter(|_| posted > 0) {
            // Over the CM a send that finds no receive posted waits for the receiver's
            // min_rnr_timer, 655 ms: the client must not start before these receives.
            mr.write_at(0, &READY)?;
            lc.lane.post_send(lc.qp, lane::SendWr::send(mr, 0..4).wr_id(u64::MAX))?;
        }
        lc.reap_once(64, OP, t, |c, region| {
            if c.queue() == WorkQueue::Send {
                return Ok(()); // "ready" was sent; its region is dropped here
            }
            if c.byte_len() as usize != size {
                bad_len += 1;
            }
            got += 1;
            if let Some(prev) = latest.replace(region) {
                free.push(prev);
            }
            Ok(())
        })?;
    }
    let mut last = vec![0u8; size];
    let mut expected = vec![0u8; size];
    fill_pattern(&mut expected, 0);
    let content = match &mut latest {
        Some(mr) => mr.read_at(0, &mut last).is_ok() && last == expected,
        None => false,
    };
    let ok = bad_len == 0 && content;
    println!(
        "[INFO] Received a stream of {got} messages of {size} bytes ({})",
        if ok { "lengths and content checked" } else { "MISMATCH" }
    );
    let mut answer = MemoryRegion::new(pd, 5, AccessFlags::LOCAL_WRITE)?;
    answer.write_at(0, &got.to_be_bytes())?;
    answer.write_at(4, &[ok as u8])?;
    let mut regs = Regions::new(vec![answer]);
    lc.lane.post_send(lc.qp, lane::SendWr::send(regs.take(0)?, 0..5).wr_id(0))?;
    lane_wait_answer(lc, &mut regs, 0, true, t)?;
    if !ok {
        return Err(Error::InvalidArgument(format!(
            "the stream arrived damaged: {bad_len} message(s) of the wrong length, last message content {}",
            if content { "matches" } else { "differs" }
        )));
    }
    Ok(())
}

/// Send mode's latency table on the lane: `BUF` and `OTHER` take turns (the next receive is
/// posted before the echo of this one). Each region is received into, then echoed from, so it
/// has a receive and a send prepared over it (checked and lowered once); each completion hands
/// the region back to re-arm the other one. The echo is prepared at `size` bytes, so a message
/// of another length ends the connection with an error (the client sends `size` bytes every
/// time; the rdma-core client's 16 bytes too). A message that fits the QP's
/// inline limit is echoed inline instead ([`LaneConn::send_inline`]), as `ib_send_lat` does: its
/// region goes straight back to its receive, and the echo's completion is not waited for.
fn lane_echo_send(
    lc: &mut LaneConn,
    regs: &mut Regions,
    mut ends: [EchoEnd; 2],
    size: u32,
    iters: u32,
    t: Duration,
) -> Result<(), Error> {
    let size = size as usize;
    // A message that fits the QP's inline limit is echoed inline (LaneConn::send_inline).
    let inline = lc.fits_inline(size)?;
    for i in 0..iters {
        let (cur, next) = if i % 2 == 0 { (0, 1) } else { (1, 0) };
        // The client's message: its region arms our echo.
        while !ends[cur].send.is_armed() {
            lc.reap(1, "waiting for the client's message", t, |c, r| EchoEnd::route(&mut ends, c, r))?;
        }
        let n = ends[cur].len;
        if n != size {
            return Err(Error::InvalidArgument(format!("the client's message {i} has {n} bytes, expected {size}")));
        }
        if i + 1 < iters {
            lc.lane.post_prepared_recv(&mut ends[next].recv)?;
        }
        if inline {
            // Copied by the provider at the post: the region is ours again at once, for the
            // next receive into it, and the send (signaled one in SIGNAL_EVERY) is not waited for.
            lc.send_inline(ends[cur].send.as_slice()?, 2 * cur as u64 + 1)?;
            let region = ends[cur].send.take_region().ok_or_else(|| stray(2 * cur as u64 + 1))?;
            ends[cur].recv.rearm(region)?;
            continue;
        }
        lc.lane.post_prepared(&mut ends[cur].send)?;
        // The echo's completion: its region arms the next receive into it.
        while !ends[cur].recv.is_armed() {
            match lc.reap(1, "answering the client", t, |c, r| EchoEnd::route(&mut ends, c, r)) {
                Err(Error::Disconnected { .. }) if i + 1 == iters => break,
                r => r?,
            }
        }
    }
    for (end, place) in ends.iter_mut().zip([BUF, OTHER]) {
        if let Some(region) = end.recv.take_region().or_else(|| end.send.take_region()) {
            regs.put(place, region);
        }
    }
    println!("[INFO] Echoed {iters} messages of {size} bytes");
    Ok(())
}

/// One of send mode's two buffers: a receive and a send prepared over one region (`wr_id`
/// `2k` and `2k + 1` for buffer `k`), and the length of the last message received into it.
struct EchoEnd {
    recv: lane::PreparedRecv,
    send: lane::PreparedSend,
    len: usize,
}

impl EchoEnd {
    /// Send mode's two ends over `BUF` and `OTHER`, the first one's receive posted: before
    /// the accept, so the client's first message finds it.
    fn arm(lc: &mut LaneConn, regs: &mut Regions, size: usize) -> Result<[EchoEnd; 2], Error> {
        let mut ends = [EchoEnd::new(lc, regs.take(BUF)?, 0, size)?, EchoEnd::new(lc, regs.take(OTHER)?, 1, size)?];
        lc.lane.post_prepared_recv(&mut ends[0].recv)?;
        Ok(ends)
    }

    fn new(lc: &mut LaneConn, region: MemoryRegion, k: u64, size: usize) -> Result<EchoEnd, Error> {
        let mut send = lc.lane.prepare_send(lc.qp, lane::SendWr::send(region, 0..size).wr_id(2 * k + 1))?;
        let region =
            send.take_region().ok_or_else(|| Error::InvalidArgument("a prepared send without its region".into()))?;
        let recv = lc.lane.prepare_recv(lc.qp, lane::RecvWr::range(region, 0..size).wr_id(2 * k))?;
        Ok(EchoEnd { recv, send, len: 0 })
    }

    /// A completion's region to the request it arms: a receive's to its buffer's send (and
    /// the length it brought), a send's to its buffer's receive.
    #[inline(always)]
    fn route(ends: &mut [EchoEnd; 2], c: Wc, region: MemoryRegion) -> Result<(), Error> {
        let end = ends.get_mut((c.wr_id() / 2) as usize).ok_or_else(|| stray(c.wr_id()))?;
        if c.wr_id() % 2 == 0 {
            end.len = c.byte_len() as usize;
            end.send.rearm(region).map_err(Error::from)
        } else {
            end.recv.rearm(region).map_err(Error::from)
        }
    }
}

/// A completion the echo did not post.
#[cold]
fn stray(wr_id: u64) -> Error {
    Error::InvalidArgument(format!("a stray completion (wr_id {wr_id})"))
}

/// Write mode's latency table on the lane: the client's WRITE lands in `BUF`, rung by its
/// immediate data or by a 4-byte send into `CTL`; we write `BUF` back into the client's
/// region, rung the same way (the doorbell send from `RING`, posted with the WRITE).
#[allow(clippy::too_many_arguments)]
fn lane_echo_write(
    lc: &mut LaneConn,
    regs: &mut Regions,
    client: &rdma_cm::RemoteRegion,
    send_doorbell: bool,
    size: u32,
    iters: u32,
    t: Duration,
) -> Result<(), Error> {
    // The first receive into `CTL` was posted before the accept.
    for i in 0..iters {
        let wc = lc.wait(regs, CTL, "waiting for the client's WRITE", t)?;
        let rung = if send_doorbell {
            let mut ring = [0u8; 4];
            regs.get(CTL)?.read_at(0, &mut ring)?;
            (wc.byte_len == 4).then_some(u32::from_be_bytes(ring))
        } else {
            wc.imm
        };
        if rung != Some(i) {
            return Err(Error::InvalidArgument(format!(
                "expected the client's doorbell for iteration {i}, got {rung:?} ({} bytes)",
                wc.byte_len
            )));
        }
        if i + 1 < iters {
            lc.lane.post_recv(lc.qp, lane::RecvWr::range(regs.take(CTL)?, 0..64).wr_id(CTL as u64))?;
        }
        let write = lane::SendWr::write(regs.take(BUF)?, 0..size as usize, client, 0).wr_id(BUF as u64);
        let last = i + 1 == iters;
        if send_doorbell {
            // The send's completion retires the unsignaled WRITE before it.
            regs.get(RING)?.write_at(0, &i.to_be_bytes())?;
            let ring = lane::SendWr::send(regs.take(RING)?, 0..4).wr_id(RING as u64);
            lc.lane.post_send_list(lc.qp, &mut [Some(write.unsignaled()), Some(ring)])?;
            lane_wait_answer(lc, regs, RING, last, t)?;
        } else {
            lc.lane.post_send(lc.qp, write.imm(i))?;
        }
        lane_wait_answer(lc, regs, BUF, last, t)?;
    }
    Ok(())
}

/// Read mode's latency table on the lane: on the client's "go" (into `CTL`), RDMA READ its
/// region into `BUF`, then answer "done" (from `RING`).
fn lane_echo_read(
    lc: &mut LaneConn,
    regs: &mut Regions,
    client: &rdma_cm::RemoteRegion,
    size: u32,
    iters: u32,
    t: Duration,
) -> Result<(), Error> {
    // The first receive into `CTL` was posted before the accept.
    for i in 0..iters {
        lc.wait(regs, CTL, "waiting for the client's go", t)?;
        let read = lane::SendWr::read(regs.take(BUF)?, 0..size as usize, client, 0).wr_id(BUF as u64);
        lc.lane.post_send(lc.qp, read)?;
        lc.wait(regs, BUF, "reading the client's region", t)?;
        if i + 1 < iters {
            lc.lane.post_recv(lc.qp, lane::RecvWr::range(regs.take(CTL)?, 0..64).wr_id(CTL as u64))?;
        }
        regs.get(RING)?.write_at(0, &i.to_be_bytes())?;
        lc.lane.post_send(lc.qp, lane::SendWr::send(regs.take(RING)?, 0..4).wr_id(RING as u64))?;
        lane_wait_answer(lc, regs, RING, i + 1 == iters, t)?;
    }
    Ok(())
}

/// Waits for region `i` to come back from an answer to the client (an echo, or read mode's
/// "done"). The last answer counts once posted: the client may take it and leave before its
/// acknowledgement reaches us (on a lossy wire a lost ACK is made good only after the ACK
/// timeout, seconds later), and its disconnect then flushes the send. Whether the answer
/// arrived intact, the client checks and reports itself.
fn lane_wait_answer(lc: &mut LaneConn, regs: &mut Regions, i: usize, last: bool, t: Duration) -> Result<(), Error> {
    match lc.wait(regs, i, "answering the client", t) {
        Err(Error::Disconnected { .. }) if last => Ok(()),
        r => r.map(drop),
    }
}

/// Atomic modes: the client moves our counter (`BUF`) with RDMA atomics; on its "done" (into
/// `CTL`, whose receive was posted before the accept), the counter must be exactly `iters`.
fn lane_check_counter(lc: &mut LaneConn, regs: &mut Regions, mode: Mode, iters: u32, t: Duration) -> Result<(), Error> {
    lc.wait(regs, CTL, "waiting for the client's done", t)?;
    let mut v = [0u8; 8];
    regs.get(BUF)?.read_at(0, &mut v)?;
    let n = u64::from_ne_bytes(v);
    if n != u64::from(iters) {
        return Err(Error::InvalidArgument(format!("counter is {n} after {iters} {mode}(s)")));
    }
    println!("[INFO] Counter is {n} after {iters} {mode}(s)");
    Ok(())
}
