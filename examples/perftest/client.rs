//! `perf_client`, the perf tool's client: perftest's latency, bandwidth and rate modes over
//! rdma_cm, against `perf_server`. Every mode checks the data it moved (the echo byte for byte,
//! the atomics' values, the stream's count and content). For rdma_cm's steps one by one, read
//! the teaching pair first (`examples/client.rs`, `examples/server.rs`).
//!
//! ```text
//! cargo run --release --example perf_client -- -a 10.77.0.1 -p 7471                       # 1024 bytes, send/recv
//! cargo run --release --example perf_client -- -a 10.77.0.1 --mode write --size 65536
//! cargo run --release --example perf_client -- -a 10.77.0.1 --mode write --doorbell send   # as on iWARP, on any device
//! cargo run --release --example perf_client -- -a 10.77.0.1 --mode read --size 4096 --iters 1000   # latency table
//! cargo run --release --example perf_client -- -a 10.77.0.1 --mode fetch-add --iters 1000    # atomics on the server's counter
//! cargo run --release --example perf_client -- -a 10.77.0.1 --bw --mode send --size 64 --iters 100000 --post-list 8 --cq-mod 16
//! ```
//!
//! `--bw` streams `--iters` messages one way (sends, or RDMA WRITEs with `--mode write`) and
//! prints perftest's bandwidth table (`ib_send_bw`/`ib_write_bw`), with perftest's knobs:
//! `--tx-depth` work requests in flight (`-t`), `--post-list` work requests per post (`-l`), one
//! completion per `--cq-mod` work requests (`-Q`). The server checks a send stream (count,
//! lengths, content) and answers with what it got; a write stream is followed by one verified
//! round trip.
//!
//! Write mode rings the peer after each RDMA WRITE (a WRITE completes nothing at its target):
//! with immediate data where the device has it, else (iWARP) with a 4-byte SEND right after the
//! WRITE, which a reliable connection delivers after the WRITE's data; `--doorbell` chooses.
//!
//! Where the machine has no RDMA device, cargo runs it in the Soft-RoCE guest (harness/runner);
//! the harness's benchmark scripts (`harness/bench-lat`, `bench-rate`, `bench-tools`) run both
//! sides there beside perftest's own tools. With `--size 16 --iters 1` it also
//! talks to rdma-core's `rdma_server`. With `--iters N > 1` it prints a latency table in
//! perftest's format, to read next to `ib_send_lat`.
//!
//! Every mode runs on a lane (`rdma_cm::verbs::lane`), the crate's data path: one thread owns
//! the CQ and the QP, which joins the lane before the connect (`RouteResolved::lane_qp`), posts
//! and polls take no lock, and each work request moves its region into the lane until its
//! completion hands it back (`perftest/fast.rs`; the server does the same on its side).

#[path = "../common/mod.rs"]
mod common;
mod fast;
mod protocol;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Parser;
use common::{fail, micros, print_latency_table, resolve_host, Stopwatch, DEFAULT_PORT};
use fast::{LaneConn, Regions, INLINE_LAT};
use protocol::{fill_pattern, Doorbell, Mode, Request, LEGACY_SIZE, MAX_SIZE};
use rdma_cm::verbs::lane::{self, Lane};
use rdma_cm::{AccessFlags, Client, ConnParam, Error, MemoryRegion, ProtectionDomain, QpInfo, QpInit, RemoteRegion};

#[derive(Parser, Debug)]
#[command(
    about = "perf tool client: perftest's latency and bandwidth tables over rdma_cm (send/recv, RDMA WRITE, READ, atomics)"
)]
struct Args {
    /// Server address or host name.
    #[arg(short = 'a', long = "addr")]
    addr: String,
    /// Server port.
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Local address (or host name) to bind: chooses the RDMA device.
    #[arg(short = 'b', long = "bind")]
    bind: Option<String>,
    /// Payload bytes.
    #[arg(long, default_value_t = 1024)]
    size: u32,
    /// Round trips; more than 1 prints a latency table.
    #[arg(long, default_value_t = 1)]
    iters: u32,
    /// How the payload travels.
    #[arg(long, value_enum, default_value_t = Mode::Send)]
    mode: Mode,
    /// How --mode write tells the peer a WRITE landed, both ways: immediate data, or a send
    /// after it; auto: immediate data unless the device lacks it (iWARP).
    #[arg(long, value_enum, default_value_t = Doorbell::Auto)]
    doorbell: Doorbell,
    /// Seconds any single wait may take (resolution, handshake, each message).
    #[arg(long, default_value_t = 10)]
    timeout: u64,
    /// Seconds a disconnect waits for this host's RDMA port to be ACTIVE again when its link
    /// is down (rdma_cm::cm::hold::set_disconnect_hold): a CM message sent while the link is down can
    /// leave the host's CM deaf until the device is re-created. 0: never wait.
    #[arg(long, default_value_t = 10)]
    disconnect_hold: u64,
    /// Stream --iters messages one way (--mode send or write) and print the bandwidth table
    /// of ib_send_bw / ib_write_bw; the server verifies a send stream, a write stream is
    /// followed by one verified round trip.
    #[arg(long)]
    bw: bool,
    /// With --bw: work requests in flight (perftest's -t).
    #[arg(long, default_value_t = 128)]
    tx_depth: u32,
    /// With --bw: work requests per post_send call (perftest's -l).
    #[arg(long, default_value_t = 1)]
    post_list: u32,
    /// With --bw: one signaled completion per this many work requests (perftest's -Q).
    #[arg(long, default_value_t = 100)]
    cq_mod: u32,
    /// Run the whole client this many times in one process, one connection after another, and
    /// print each setup step's cost per connection in cmtime's format.
    #[arg(long, default_value_t = 1)]
    connections: u32,
    /// Busy-poll the completion queues while waiting (lowest latency, a whole core), as
    /// perftest does (on the lane, `Lane::spin_with`); default: spin briefly, then sleep on
    /// the completion channel (on the lane, `Lane::wait_with`: sleep on it at once).
    #[arg(long)]
    busy_poll: bool,
}

/// Quiets the per-step log lines when --connections runs many clients.
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

macro_rules! say {
    ($($t:tt)*) => {
        if !$crate::QUIET.load(std::sync::atomic::Ordering::Relaxed) {
            println!($($t)*);
        }
    };
}

mod stream;

use stream::stream;

fn main() {
    let args = Args::parse();
    rdma_cm::cm::hold::set_disconnect_hold(Duration::from_secs(args.disconnect_hold));
    if args.port == 0 {
        fail("bad arguments", "port 0 is not a port a server listens on: choose 1..=65535 with -p");
    }
    if args.size == 0 || args.size > MAX_SIZE {
        fail("bad arguments", format!("--size {} is outside 1..={MAX_SIZE}", args.size));
    }
    if args.iters == 0 {
        fail("bad arguments", "--iters must be at least 1");
    }
    if args.bw && !matches!(args.mode, Mode::Write | Mode::Send) {
        fail("bad arguments", "--bw streams sends or RDMA WRITEs: use it with --mode send or --mode write");
    }
    if args.tx_depth == 0 || args.tx_depth > 8192 {
        fail("bad arguments", format!("--tx-depth {} is outside 1..=8192", args.tx_depth));
    }
    if args.post_list == 0 || args.post_list > args.tx_depth {
        fail("bad arguments", format!("--post-list {} is outside 1..=--tx-depth ({})", args.post_list, args.tx_depth));
    }
    if args.cq_mod == 0 {
        fail("bad arguments", "--cq-mod must be at least 1");
    }
    let timeout = Duration::from_secs(args.timeout.max(1));
    let dst = resolve_host(&args.addr, args.port).unwrap_or_else(|e| fail("bad arguments", e));
    let src = args.bind.as_deref().map(|b| resolve_host(b, 0).unwrap_or_else(|e| fail("bad arguments", e)));
    if args.connections > 1 {
        QUIET.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let mut steps = Steps::default();
    for _ in 0..args.connections {
        if let Err(e) = run(&args, dst, src, timeout, &mut steps) {
            fail(&format!("client to {dst}"), e);
        }
    }
    if args.connections > 1 {
        steps.print_cmtime_table(args.connections);
    }
}

fn run(args: &Args, dst: SocketAddr, src: Option<SocketAddr>, t: Duration, steps: &mut Steps) -> Result<(), Error> {
    steps.start_connection();
    let client = steps.time(Client::new)?;
    say!("[INFO] Created CM ID");
    let resolved = steps.time(|| client.resolve_addr(src, dst, t))?;
    say!("[EVENT] Address resolved");
    let route = steps.time(|| resolved.resolve_route(t))?;
    say!("[EVENT] Route resolved");
    let ctx = route.context()?;
    say!("[INFO] Device {}", ctx.device_name());
    let doorbell = args.doorbell.resolve(&ctx);
    let send_doorbell = args.mode == Mode::Write && doorbell == Doorbell::Send;
    if args.mode == Mode::Write {
        say!("[INFO] Write mode rings the peer with {doorbell} (device transport {:?})", ctx.transport());
    }
    let pd = route.alloc_pd()?;

    // The atomic modes work on one 8-byte counter, whatever --size says.
    let size = if args.mode.is_atomic() { 8 } else { args.size as usize };
    let started = Instant::now();
    // `data`: what we send (or expose to RDMA READ); `back`: where the echo lands.
    let (data_access, back_access) = match args.mode {
        Mode::Send | Mode::SendStream => (AccessFlags::LOCAL_WRITE, AccessFlags::LOCAL_WRITE),
        Mode::Write => (AccessFlags::LOCAL_WRITE, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE),
        Mode::Read => (AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, AccessFlags::LOCAL_WRITE),
        // `back` takes the value each atomic found.
        Mode::FetchAdd | Mode::CmpSwap => (AccessFlags::LOCAL_WRITE, AccessFlags::LOCAL_WRITE),
    };
    let data = MemoryRegion::new(&pd, size, data_access)?;
    let back = MemoryRegion::new(&pd, size, back_access)?;
    let ctl = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE)?;
    say!("[INFO] Memory registration took {:.1} us (2 x {size} bytes)", micros(started.elapsed()));

    // Every mode runs on a lane (rdma_cm::verbs::lane): the QP joins it before the connect, so
    // the receives that the server's first messages need are in place before it can send.
    let started = Instant::now();
    let send_depth = if args.bw { args.tx_depth } else { 16 };
    let mut lane = Lane::new(&ctx, send_depth + 16)?;
    let init = QpInit::new().max_send_wr(send_depth);
    // Send mode's latency table sends small messages inline, as ib_send_lat does.
    let init = if !args.bw && args.mode == Mode::Send { init.max_inline_data(INLINE_LAT) } else { init };
    let client = steps.time(|| route.lane_qp(&mut lane, &pd, init))?;
    let qp = client.qp();
    let qp_num = lane.qp_num(qp)?;
    say!(
        "[INFO] QP creation took {:.1} us (qp_num {qp_num}, {send_depth} send / 16 recv WRs)",
        micros(started.elapsed())
    );
    // A 4-byte region for our small sends (write mode's send doorbell, read mode's "go", the
    // atomics' "done").
    let ring = MemoryRegion::new(&pd, 4, AccessFlags::LOCAL_WRITE)?;

    let region = match args.mode {
        Mode::Send | Mode::FetchAdd | Mode::CmpSwap | Mode::SendStream => QpInfo { qp_num, ..QpInfo::default() },
        Mode::Write => QpInfo { qp_num, psn: 0, rkey: back.rkey(), vaddr: back.addr(), len: args.size.into() },
        Mode::Read => QpInfo { qp_num, psn: 0, rkey: data.rkey(), vaddr: data.addr(), len: args.size.into() },
    };
    let mut regs = Regions::new(vec![data, back, ctl, ring]);
    // With --bw the stream is one-sided. A write stream is followed by a single verified round
    // trip (all the server sees); a send stream is checked by the server, with no round trip.
    let send_stream = args.bw && args.mode == Mode::Send;
    let iters = match (args.bw, send_stream) {
        (false, _) => args.iters,
        (true, false) => 1,
        (true, true) => 0,
    };
    let req = if send_stream {
        Request { info: region, mode: Mode::SendStream, size: size as u32, iters: args.iters, send_doorbell }
    } else {
        Request { info: region, mode: args.mode, size: size as u32, iters, send_doorbell }
    };
    if send_stream {
        // The server's "ready" lands in `ring`, its answer to the stream (its count and
        // verdict) in `ctl`: posted before the connect, so "ready", sent as soon as the
        // server's receives are posted, finds them.
        lane.post_recv(qp, lane::RecvWr::new(regs.take(RING)?).wr_id(RING as u64))?;
        lane.post_recv(qp, lane::RecvWr::range(regs.take(CTL)?, 0..64).wr_id(CTL as u64))?;
    }
    say!("[INFO] Connecting to {dst} (mode {}, {} bytes, {} iteration(s))...", args.mode, args.size, args.iters);
    let param = ConnParam::new().private_data(&req.encode())?;
    let theirs = steps.time(|| client.connect(&mut lane, &param, t))?;
    say!("[EVENT] Connection established");
    let u = steps.current();
    say!(
        "[INFO] Connection setup steps (us): create id {:.1}, resolve addr {:.1}, resolve route {:.1}, create qp {:.1}, connect {:.1}",
        u[0], u[1], u[2], u[3], u[4]
    );

    let server = if QpInfo::is_present(&theirs) { Some(QpInfo::decode(&theirs)?.0) } else { None };
    if server.is_none() {
        if args.mode != Mode::Send || args.size != LEGACY_SIZE || args.iters != 1 {
            return Err(Error::InvalidArgument(format!(
                "the server sent no qp_info (rdma-core rdma_server?); it only speaks --mode send --size {LEGACY_SIZE} --iters 1"
            )));
        }
        say!("[INFO] Server sent no qp_info: rdma-core rdma_server protocol, echo content is not checked");
    }
    let server_region = server.and_then(|s| s.region());

    let mut lc = LaneConn::new(lane, qp, Some(dst), args.busy_poll);
    let target = if args.mode != Mode::Send { Some(need(server_region)?) } else { None };
    run_on_lane(args, &mut lc, &mut regs, &pd, target, send_doorbell, iters, server.is_some(), t)?;
    steps.time(|| lc.disconnect(t))?;
    say!("[INFO] Disconnected");
    // Teardown: the lane (QP, CQ), regions, PD, then the id and its channel.
    steps.time(|| drop((regs, pd, ctx)));
    Ok(())
}

/// Wall-clock time of each step of each connection, in microseconds.
#[derive(Default)]
struct Steps {
    runs: Vec<Vec<f64>>,
}

const STEP_NAMES: [&str; 7] =
    ["create id", "resolve addr", "resolve route", "create qp", "connect", "disconnect", "destroy"];

impl Steps {
    fn start_connection(&mut self) {
        self.runs.push(Vec::with_capacity(STEP_NAMES.len()));
    }
    fn current(&self) -> &[f64] {
        self.runs.last().map_or(&[], |r| r.as_slice())
    }
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        if let Some(run) = self.runs.last_mut() {
            run.push(micros(t.elapsed()));
        }
        r
    }
    /// cmtime's table: total ms, max ms, min us and us per connection of each step.
    fn print_cmtime_table(&self, n: u32) {
        println!("step              total ms     max ms     min us  us / conn");
        for (i, name) in STEP_NAMES.iter().enumerate() {
            let v: Vec<f64> = self.runs.iter().filter_map(|r| r.get(i).copied()).collect();
            let total: f64 = v.iter().sum();
            let max = v.iter().cloned().fold(0.0, f64::max);
            let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
            println!(
                "{:<13}: {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                name,
                total / 1000.0,
                max / 1000.0,
                min,
                total / n as f64
            );
        }
    }
}

/// Region numbers on the lane: each work request's `wr_id` is its region's number, so its
/// completion says where the region goes back ([`Regions`]).
const DATA: usize = 0; // what we send or write
const BACK: usize = 1; // where the echo lands
const CTL: usize = 2; // the server's doorbell or answer
const RING: usize = 3; // our doorbell in write mode with `--doorbell send`

/// The latency table (`--iters N`) and the rate mode (`--bw`), on the lane.
#[allow(clippy::too_many_arguments)]
fn run_on_lane(
    args: &Args,
    lc: &mut LaneConn,
    regs: &mut Regions,
    pd: &std::sync::Arc<ProtectionDomain>,
    target: Option<RemoteRegion>,
    send_doorbell: bool,
    iters: u32,
    verify: bool,
    t: Duration,
) -> Result<(), Error> {
    let size = regs.get(DATA)?.len();
    let send_stream = args.bw && args.mode == Mode::Send;
    if send_stream {
        // The stream starts on "ready", when the server's receives are posted (ours, for
        // "ready" and for its answer, were posted before the connect).
        let n = match lc.wait(regs, RING, "waiting for the server's receives to be posted", t) {
            Ok(done) => done.byte_len as usize,
            Err(Error::Timeout { op, timeout, addr, .. }) => {
                let hint = Some("the server sends \"ready\" once its receives are posted: is it alive, and is it this version's example server (an older one sends nothing before the stream)?");
                return Err(Error::Timeout { op, timeout, addr, hint });
            }
            Err(e) => return Err(e),
        };
        let mut ready = [0u8; 4];
        regs.get(RING)?.read_at(0, &mut ready)?;
        if n != ready.len() || &ready != b"rdy!" {
            return Err(Error::InvalidArgument(format!(
                "the server's first message is not \"ready\" ({n} bytes: {ready:?}): an older server?"
            )));
        }
    }
    if args.bw {
        stream(lc, regs, pd, size, target, args, t)?;
    }
    if send_stream {
        let answer_len = lc.wait(regs, CTL, "waiting for the server's count", t)?.byte_len;
        let mut answer = [0u8; 5];
        regs.get(CTL)?.read_at(0, &mut answer)?;
        let got = u32::from_be_bytes([answer[0], answer[1], answer[2], answer[3]]);
        if answer_len != 5 || got != args.iters || answer[4] != 1 {
            return Err(Error::InvalidArgument(format!(
                "the server received {got} of {} messages (content {})",
                args.iters,
                if answer[4] == 1 { "matched" } else { "did not match" }
            )));
        }
        say!("[INFO] Stream verified: the server received {got} x {size} bytes, content matched");
    }
    let mut rtts = Vec::with_capacity(iters as usize);
    let clock = Stopwatch::calibrate();
    let mut expected = vec![0u8; size];
    let mut got = vec![0u8; size];
    let one_sided =
        matches!((args.mode, &target), (Mode::Write | Mode::Read | Mode::FetchAdd | Mode::CmpSwap, Some(_)));
    // Send mode's round trips post prepared requests: checked and lowered once, here.
    let mut ping = if one_sided { None } else { Some(PreparedPingPong::new(lc, regs, size)?) };
    for i in 0..iters {
        let one = iters == 1;
        let n = if let Some(p) = ping.as_mut() {
            fill_pattern(p.message()?, i);
            let start = clock.now();
            let n = p.round_trip(lc, one, t)?;
            rtts.push(clock.since(start));
            if verify && n == size {
                p.recv.read_at(0, &mut got)?;
                check_echo(&got, i, &mut expected)?;
            }
            n
        } else {
            fill_pattern(regs.get(DATA)?.as_mut_slice()?, i);
            let start = clock.now();
            let n = match (args.mode, &target) {
                (Mode::Write, Some(server)) => lane_round_trip_write(lc, regs, server, send_doorbell, i, one, t)?,
                (Mode::Read, Some(server)) => lane_round_trip_read(lc, regs, server, i, one, t)?,
                (_, Some(server)) => lane_atomic_step(lc, regs, server, args.mode, i, one, t)?,
                (_, None) => unreachable!("one-sided modes have the server's region"),
            };
            rtts.push(clock.since(start));
            if verify && !args.mode.is_atomic() && n == size {
                regs.get(BACK)?.read_at(0, &mut got)?;
                check_echo(&got, i, &mut expected)?;
            }
            n
        };
        if n != size {
            return Err(Error::InvalidArgument(format!("echo has {n} bytes, sent {size}")));
        }
    }
    if let Some(p) = ping {
        p.put_back(regs)?;
    }
    if args.mode.is_atomic() {
        // "done": the server checks its counter now.
        regs.get(RING)?.write_at(0, &iters.to_be_bytes())?;
        lc.lane.post_send(lc.qp, lane::SendWr::send(regs.take(RING)?, 0..4).wr_id(RING as u64))?;
        lc.wait(regs, RING, "telling the server we are done", t)?;
        say!("[INFO] Atomics verified: {iters} x {} returned the expected values", args.mode);
    } else if verify {
        say!("[INFO] Echo verified: {iters} x {size} bytes match");
    }
    say!("[INFO] Round-trip completed.");
    if iters > 1 {
        print_latency_table(size as u32, &mut rtts);
    }
    Ok(())
}

/// Checks the echo of iteration `i`, read into `got` (`expected` is scratch of its size). The
/// echo region is read with `read_at`, not borrowed: in write mode the peer may write it.
fn check_echo(got: &[u8], i: u32, expected: &mut [u8]) -> Result<(), Error> {
    fill_pattern(expected, i);
    match got.iter().zip(expected.iter()).position(|(a, b)| a != b) {
        Some(pos) => Err(Error::InvalidArgument(format!(
            "echo differs at byte {pos} of iteration {i}: got {:#04x}, expected {:#04x}",
            got[pos], expected[pos]
        ))),
        None => Ok(()),
    }
}

/// Send mode's ping-pong on prepared requests: the receive for the echo over `BACK`, the send
/// over `DATA`, each checked and lowered once; a round trip posts both and reaps both, each
/// completion handing its region back to re-arm its request. A message that fits the QP's
/// inline limit (up to [`INLINE_LAT`] bytes, as `ib_send_lat`) is sent inline from `inline`
/// instead, signaled once in [`fast::SIGNAL_EVERY`]: the round trip then waits for the echo
/// alone.
struct PreparedPingPong {
    send: lane::PreparedSend,
    recv: lane::PreparedRecv,
    size: usize,
    inline: Option<Vec<u8>>,
}

impl PreparedPingPong {
    fn new(lc: &mut LaneConn, regs: &mut Regions, size: usize) -> Result<PreparedPingPong, Error> {
        let recv = lc.lane.prepare_recv(lc.qp, lane::RecvWr::range(regs.take(BACK)?, 0..size).wr_id(BACK as u64))?;
        let send = lc.lane.prepare_send(lc.qp, lane::SendWr::send(regs.take(DATA)?, 0..size).wr_id(DATA as u64))?;
        let inline = if lc.fits_inline(size)? { Some(vec![0; size]) } else { None };
        Ok(PreparedPingPong { send, recv, size, inline })
    }

    /// The bytes the next round trip sends.
    fn message(&mut self) -> Result<&mut [u8], Error> {
        match self.inline.as_mut() {
            Some(msg) => Ok(msg),
            None => self.send.as_mut_slice(),
        }
    }

    /// One round trip; the bytes the echo brought.
    fn round_trip(&mut self, lc: &mut LaneConn, log: bool, t: Duration) -> Result<usize, Error> {
        lc.lane.post_prepared_recv(&mut self.recv)?;
        let inline = match &self.inline {
            Some(msg) => lc.send_inline(msg, DATA as u64).map(|()| true)?,
            None => lc.lane.post_prepared(&mut self.send).map(|()| false)?,
        };
        let (send, recv, mut n) = (&mut self.send, &mut self.recv, 0);
        let mut each = |c: lane::Wc, region| match c.wr_id() as usize {
            BACK => {
                n = c.byte_len() as usize;
                recv.rearm(region).map_err(Error::from)
            }
            DATA => send.rearm(region).map_err(Error::from),
            other => Err(stray(other)),
        };
        if inline {
            // The inline send's completions (one in SIGNAL_EVERY) carry no region, and reach
            // no callback: the echo is what the round trip waits for.
            let mut echoed = false;
            while !echoed {
                lc.reap_once(2, "waiting for the echo", t, |c, region| {
                    echoed |= c.wr_id() as usize == BACK;
                    each(c, region)
                })?;
            }
        } else {
            lc.reap(2, "waiting for the echo", t, &mut each)?;
        }
        if log {
            say!("[INFO] Sent {} bytes", self.size);
            say!("[INFO] Received {n} bytes");
        }
        Ok(n)
    }

    /// Gives the regions back to `regs`, for what follows the table.
    fn put_back(mut self, regs: &mut Regions) -> Result<(), Error> {
        let (Some(data), Some(back)) = (self.send.take_region(), self.recv.take_region()) else {
            return Err(Error::InvalidArgument("a prepared request of the ping-pong is still posted".into()));
        };
        regs.put(DATA, data);
        regs.put(BACK, back);
        Ok(())
    }
}

/// A completion the ping-pong did not post.
#[cold]
fn stray(wr_id: usize) -> Error {
    Error::InvalidArgument(format!("a stray completion (wr_id {wr_id}) in the ping-pong"))
}

/// Read mode on the lane: "go" (the server RDMA-READs our data region), then, on its "done",
/// we RDMA-READ its copy back.
fn lane_round_trip_read(
    lc: &mut LaneConn,
    regs: &mut Regions,
    server: &RemoteRegion,
    i: u32,
    log: bool,
    t: Duration,
) -> Result<usize, Error> {
    let size = regs.get(BACK)?.len();
    lc.lane.post_recv(lc.qp, lane::RecvWr::range(regs.take(CTL)?, 0..64).wr_id(CTL as u64))?;
    regs.get(RING)?.write_at(0, &i.to_be_bytes())?;
    lc.lane.post_send(lc.qp, lane::SendWr::send(regs.take(RING)?, 0..4).wr_id(RING as u64))?;
    lc.wait(regs, RING, "telling the server to read", t)?;
    if log {
        say!("[INFO] Sent {size} bytes (exposed to RDMA READ)");
    }
    lc.wait(regs, CTL, "waiting for the server's read", t)?;
    lc.lane.post_send(lc.qp, lane::SendWr::read(regs.take(BACK)?, 0..size, server, 0).wr_id(BACK as u64))?;
    let n = lc.wait(regs, BACK, "reading the server's copy", t)?.byte_len;
    if log {
        say!("[INFO] Received {n} bytes (RDMA READ)");
    }
    Ok(n as usize)
}

/// One atomic on the server's counter, on the lane (see [`atomic_step`]).
fn lane_atomic_step(
    lc: &mut LaneConn,
    regs: &mut Regions,
    server: &RemoteRegion,
    mode: Mode,
    i: u32,
    log: bool,
    t: Duration,
) -> Result<usize, Error> {
    let i = u64::from(i);
    let back = regs.take(BACK)?;
    let wr = match mode {
        Mode::CmpSwap => lane::SendWr::compare_swap(back, 0, server, 0, i, i + 1),
        _ => lane::SendWr::fetch_add(back, 0, server, 0, 1),
    };
    lc.lane.post_send(lc.qp, wr.wr_id(BACK as u64))?;
    lc.wait(regs, BACK, "waiting for the atomic", t)?;
    let mut v = [0u8; 8];
    regs.get(BACK)?.read_at(0, &mut v)?;
    let found = u64::from_ne_bytes(v);
    if found != i {
        return Err(Error::InvalidArgument(format!("{mode} {i} found the counter at {found}, expected {i}")));
    }
    if log {
        say!("[INFO] {mode}: the counter was {found}");
    }
    Ok(8)
}

/// One RDMA WRITE round trip on the lane: the receive for the server's doorbell, then our
/// WRITE, rung with immediate data or with a 4-byte send after it (one post of both: the
/// send's completion retires the unsignaled WRITE).
#[allow(clippy::too_many_arguments)]
fn lane_round_trip_write(
    lc: &mut LaneConn,
    regs: &mut Regions,
    server: &RemoteRegion,
    send_doorbell: bool,
    i: u32,
    log: bool,
    t: Duration,
) -> Result<usize, Error> {
    let size = regs.get(DATA)?.len();
    lc.lane.post_recv(lc.qp, lane::RecvWr::range(regs.take(CTL)?, 0..64).wr_id(CTL as u64))?;
    let write = lane::SendWr::write(regs.take(DATA)?, 0..size, server, 0).wr_id(DATA as u64);
    if send_doorbell {
        regs.get(RING)?.write_at(0, &i.to_be_bytes())?;
        let ring = lane::SendWr::send(regs.take(RING)?, 0..4).wr_id(RING as u64);
        lc.lane.post_send_list(lc.qp, &mut [Some(write.unsignaled()), Some(ring)])?;
        lc.wait(regs, RING, "ringing the server", t)?;
    } else {
        lc.lane.post_send(lc.qp, write.imm(i))?;
    }
    lc.wait(regs, DATA, "writing", t)?;
    if log {
        say!("[INFO] Sent {size} bytes (RDMA WRITE)");
    }
    let wc = lc.wait(regs, CTL, "waiting for the server's doorbell", t)?;
    let rung = if send_doorbell {
        let mut ring = [0u8; 4];
        regs.get(CTL)?.read_at(0, &mut ring)?;
        (wc.byte_len == 4).then_some(u32::from_be_bytes(ring))
    } else {
        wc.imm
    };
    if rung != Some(i) {
        return Err(Error::InvalidArgument(format!(
            "expected the server's doorbell for iteration {i} ({}), got {rung:?} ({} bytes)",
            if send_doorbell { "a 4-byte send" } else { "immediate data" },
            wc.byte_len
        )));
    }
    if log {
        say!("[INFO] Received {size} bytes (RDMA WRITE)");
    }
    Ok(size)
}

fn need(r: Option<RemoteRegion>) -> Result<RemoteRegion, Error> {
    r.ok_or(Error::PrivateData("server advertised no region for RDMA"))
}
