//! One thread serving N concurrent ping-pong clients, in the two shapes a server can take:
//!
//! - `many_clients/shared/N`: one lane (`rdma_cm::verbs::lane`) for every QP, so one
//!   completion queue for both queues of each, and the lane's shared receive queue of
//!   `SRQ_DEPTH` slots, whose slots are echoed in place;
//! - `many_clients/per_qp/N`: a lane per QP, so each QP its own CQ (with its own completion
//!   channel, as an event-driven server with a CQ per connection has) and its own `RECV_DEPTH`
//!   receive slots in a region registered for it.
//!
//! Both shapes accept on one event channel and share one protection domain; they differ only
//! in the CQs and the receive buffers. One iteration is one round: each of the N clients
//! sends one `MSG`-byte message and the server thread echoes it; the round ends when every
//! client has its echo (criterion's throughput line is round trips per second). The server
//! thread is event-driven, as a server that shares its CPUs is: it polls, and when nothing is
//! there it arms its CQ(s) and sleeps on their completion channels (one, through `Lane::wait`,
//! or N through poll(2)); the clients wait the same way. A region moves with its message: the
//! receive's completion hands it back, the echo sends it, and the send's completion hands it
//! back to be posted as a receive again. (Busy-polling on both sides took milliseconds per
//! round trip in the two-vCPU guest, where the two spinning processes leave no CPU to
//! Soft-RoCE's deferred work.) A batch of rounds is started and ended over a pipe to the
//! client process; criterion's linear sampling takes that fixed cost out of its slope.
//!
//! The clients run in a child process (this binary again, with `RDMA_CM_BENCH_MANY_CLIENT`
//! set), one thread driving N client QPs on one lane of its own. So this process holds the
//! server's objects alone, and the descriptors (`/proc/self/fd`) and pinned memory (`VmPin`
//! in `/proc/self/status`) it gains while setting up N connections are the server's. Those
//! counts are printed after criterion's output as lines `many_clients resources SHAPE N FDS
//! VMPIN_KIB MR_BYTES` and a markdown table; `harness/bench-many` joins them with the times.
//!
//! ```text
//! cargo bench --bench many
//! cargo bench --bench many -- per_qp           # the per_qp cases (the others are not set up)
//! ```

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{criterion, device_addr, T};
use criterion::{BenchmarkId, Criterion, Throughput};
use rdma_cm::status::WorkQueue;
use rdma_cm::verbs::lane::{Lane, LaneQp, LaneSrq, RecvWr, SendWr, Wc};
use rdma_cm::{
    AccessFlags, Client, CmEventType, ConnParam, ConnectRequest, EventChannel, Listener, MemoryRegion,
    ProtectionDomain, QpInit, Server,
};

/// Bytes of each message (and of each receive slot).
const MSG: usize = 64;
/// Receive slots of the shared receive queue, whatever N (at most N are in use: one message
/// per client per round).
const SRQ_DEPTH: u32 = 256;
/// Receive slots of each QP in the per-QP shape (the crate's default receive depth).
const RECV_DEPTH: u32 = 16;
/// Send queue depth of each server QP (one echo in flight per client).
const SEND_DEPTH: u32 = 4;
/// Completions taken per poll or wait.
const BURST: usize = 64;
const SIZES: [usize; 3] = [1, 10, 100];
/// Set in the child process that drives the clients.
const CLIENT_ENV: &str = "RDMA_CM_BENCH_MANY_CLIENT";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    Shared,
    PerQp,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Shared => "shared",
            Shape::PerQp => "per_qp",
        }
    }
}

/// What a poll handed out, kept until the lane is free to post again.
struct Done {
    queue: WorkQueue,
    qp: Option<LaneQp>,
    wr_id: u64,
    len: usize,
    region: MemoryRegion,
}

/// Hands `wc` and its region to `out`, checking that it succeeded.
fn keep(out: &mut Vec<Done>, who: &str, wc: Wc, region: Option<MemoryRegion>) {
    assert!(wc.is_ok(), "{who}: a completion failed: {:?}", wc.status());
    let region = region.unwrap_or_else(|| panic!("{who}: a completion without its region"));
    out.push(Done { queue: wc.queue(), qp: wc.qp(), wr_id: wc.wr_id(), len: wc.byte_len() as usize, region });
}

/// The server: one thread, one event channel, N connections on one lane (shared) or on a lane
/// each (per_qp).
struct ServerSide {
    shape: Shape,
    ch: EventChannel,
    _listener: Listener,
    pd: Option<Arc<ProtectionDomain>>,
    /// Shared: the one lane; per_qp: the lane of each connection, in `conns`' order.
    lanes: Vec<Lane>,
    /// The shared shape's receive queue (on `lanes[0]`).
    srq: Option<LaneSrq>,
    /// Each connection: the index of its lane in `lanes`, and its QP there.
    conns: Vec<(usize, LaneQp)>,
    /// Bytes of memory regions registered for receives.
    mr_bytes: usize,
    done: Vec<Done>,
}

/// The child process that drives the N clients.
struct Clients {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Clients {
    fn spawn() -> Clients {
        let exe = std::env::current_exe().expect("the bench binary's path");
        let mut child = Command::new(exe)
            .env(CLIENT_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the client process");
        let to = child.stdin.take().expect("piped");
        let from = BufReader::new(child.stdout.take().expect("piped"));
        Clients { child, to, from }
    }
    fn send(&mut self, line: &str) {
        writeln!(self.to, "{line}").and_then(|()| self.to.flush()).expect("write to the client process");
    }
    fn expect(&mut self, want: &str) {
        let mut line = String::new();
        self.from.read_line(&mut line).expect("read from the client process");
        assert_eq!(line.trim_end(), want, "the client process said {line:?} (it failed: see its stderr above)");
    }
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

/// `VmPin` of this process, KiB.
fn vm_pin_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmPin:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmPin in /proc/self/status")
}

impl ServerSide {
    /// Listens, lets the child connect `n` clients (one after another), and accepts them all
    /// from this thread.
    fn start(shape: Shape, n: usize, clients: &mut Clients) -> ServerSide {
        let ch = EventChannel::new().unwrap();
        let listener =
            Server::on_channel(&ch).unwrap().bind(SocketAddr::new(device_addr(), 0)).unwrap().listen(128).unwrap();
        let port = listener.local_addr().unwrap().port();
        clients.send(&format!("C {port} {n}"));
        let mut s = ServerSide {
            shape,
            ch,
            _listener: listener,
            pd: None,
            lanes: Vec::new(),
            srq: None,
            conns: Vec::with_capacity(n),
            mr_bytes: 0,
            done: Vec::with_capacity(BURST),
        };
        while s.conns.len() < n {
            let ev = s.ch.get_event(T).expect("server: a CM event while the clients connect");
            match ev.event_type() {
                CmEventType::ConnectRequest => {
                    let req = ConnectRequest::from_event(ev).unwrap();
                    s.accept(req, n);
                }
                other => panic!("server: unexpected {other} while accepting"),
            }
        }
        clients.expect("READY");
        s
    }

    /// Creates the request's QP on its lane in this shape, posts its receives (per-QP), and
    /// accepts (waiting for ESTABLISHED; the other ids' events stay queued on the channel).
    fn accept(&mut self, req: ConnectRequest, n: usize) {
        let ctx = req.context().unwrap();
        let pd = Arc::clone(self.pd.get_or_insert_with(|| req.alloc_pd().unwrap()));
        let (k, init) = match self.shape {
            Shape::Shared => {
                if self.lanes.is_empty() {
                    let mut lane = Lane::new(&ctx, SEND_DEPTH * n as u32 + SRQ_DEPTH).unwrap();
                    let srq = lane.create_srq(&pd, SRQ_DEPTH).unwrap();
                    let region = MemoryRegion::new(&pd, MSG * SRQ_DEPTH as usize, AccessFlags::LOCAL_WRITE).unwrap();
                    self.mr_bytes += region.len();
                    for (i, m) in region.split(MSG).unwrap().into_iter().enumerate() {
                        lane.post_srq_recv(srq, RecvWr::new(m).wr_id(i as u64)).unwrap();
                    }
                    self.lanes.push(lane);
                    self.srq = Some(srq);
                }
                let srq = self.srq.expect("made with the lane");
                (0, self.lanes[0].srq_qp_init(srq, QpInit::new().max_send_wr(SEND_DEPTH)).unwrap())
            }
            Shape::PerQp => {
                self.lanes.push(Lane::new(&ctx, SEND_DEPTH + RECV_DEPTH).unwrap());
                (self.lanes.len() - 1, QpInit::new().max_send_wr(SEND_DEPTH).max_recv_wr(RECV_DEPTH))
            }
        };
        let lane = &mut self.lanes[k];
        let s = req.lane_qp(lane, &pd, init).unwrap();
        let qp = s.qp();
        if self.shape == Shape::PerQp {
            let region = MemoryRegion::new(&pd, MSG * RECV_DEPTH as usize, AccessFlags::LOCAL_WRITE).unwrap();
            self.mr_bytes += region.len();
            for (i, m) in region.split(MSG).unwrap().into_iter().enumerate() {
                lane.post_recv(qp, RecvWr::new(m).wr_id(i as u64)).unwrap();
            }
        }
        s.accept(lane, &ConnParam::new(), T).unwrap();
        self.conns.push((k, qp));
    }

    /// Has the clients run `rounds` rounds, echoing every message; returns the time taken.
    fn run(&mut self, clients: &mut Clients, rounds: u64) -> Duration {
        let target = rounds * self.conns.len() as u64;
        let start = Instant::now();
        clients.send(&format!("R {rounds}"));
        match self.shape {
            Shape::Shared => self.echo_shared(target),
            Shape::PerQp => self.echo_per_qp(target),
        }
        clients.expect("D");
        start.elapsed()
    }

    /// The shared shape: wait on the one lane (`Lane::wait_with` polls; when the CQ is empty,
    /// it arms it and sleeps on its channel); echo each receive's region from the SRQ on the
    /// QP the completion names; post the region to the SRQ again when the echo's send
    /// completes.
    fn echo_shared(&mut self, target: u64) {
        let srq = self.srq.expect("the SRQ exists once a client connected");
        let (lane, done) = (&mut self.lanes[0], &mut self.done);
        let (mut echoed, mut in_flight) = (0u64, 0u64);
        while echoed < target || in_flight > 0 {
            lane.wait_with(BURST, T, |wc, r| keep(done, "server", wc, r))
                .unwrap_or_else(|e| panic!("server: no completion ({echoed} of {target} echoed): {e}"));
            for d in done.drain(..) {
                match d.queue {
                    WorkQueue::Recv => {
                        let qp = d.qp.expect("the SRQ receive's QP");
                        lane.post_send(qp, SendWr::send(d.region, 0..d.len).wr_id(d.wr_id)).unwrap();
                        echoed += 1;
                        in_flight += 1;
                    }
                    WorkQueue::Send => {
                        lane.post_srq_recv(srq, RecvWr::new(d.region).wr_id(d.wr_id)).unwrap();
                        in_flight -= 1;
                    }
                }
            }
        }
    }

    /// The per-QP shape, the same wait over N lanes: poll each lane in turn; when a sweep
    /// finds nothing, arm every lane's CQ, sweep again, and sleep in poll(2) on all N
    /// completion channels. Echo from the QP's own slot, and post the slot again when the
    /// echo's send completes.
    fn echo_per_qp(&mut self, target: u64) {
        let (mut echoed, mut in_flight) = (0u64, 0u64);
        let mut pfds: Vec<libc::pollfd> = self
            .lanes
            .iter()
            .map(|l| libc::pollfd { fd: l.cq().as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        while echoed < target || in_flight > 0 {
            if self.sweep(&mut echoed, &mut in_flight) > 0 {
                continue;
            }
            for l in &mut self.lanes {
                l.arm().unwrap();
            }
            if self.sweep(&mut echoed, &mut in_flight) > 0 {
                continue;
            }
            // SAFETY: `pfds` is a live array of `pfds.len()` pollfd entries for the whole call.
            let ready = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, T.as_millis() as i32) };
            assert!(
                ready > 0,
                "server: poll(2) on the completion channels returned {ready} ({echoed} of {target} echoed)"
            );
            // The next arming reads the events that made them readable.
            pfds.iter_mut().for_each(|p| p.revents = 0);
        }
    }

    /// One pass over the per-QP lanes; returns the completions it handled.
    fn sweep(&mut self, echoed: &mut u64, in_flight: &mut u64) -> usize {
        let mut seen = 0;
        for &(k, qp) in &self.conns {
            let (lane, done) = (&mut self.lanes[k], &mut self.done);
            seen += lane.poll_with(BURST, |wc, r| keep(done, "server", wc, r)).unwrap();
            for d in done.drain(..) {
                match d.queue {
                    WorkQueue::Recv => {
                        lane.post_send(qp, SendWr::send(d.region, 0..d.len).wr_id(d.wr_id)).unwrap();
                        *echoed += 1;
                        *in_flight += 1;
                    }
                    WorkQueue::Send => {
                        lane.post_recv(qp, RecvWr::new(d.region).wr_id(d.wr_id)).unwrap();
                        *in_flight -= 1;
                    }
                }
            }
        }
        seen
    }

    /// Has the clients leave, waits for each to go (bounded), and drops everything.
    fn finish(mut self, mut clients: Clients) {
        clients.send("Q");
        for &(k, qp) in &self.conns {
            let left = self.lanes[k].wait_peer_left(qp, T).expect("server: the clients' disconnects");
            assert!(left, "server: a client did not leave within {T:?}");
        }
        drop(std::mem::take(&mut self.lanes));
        let status = clients.child.wait().expect("wait for the client process");
        assert!(status.success(), "the client process failed: {status}");
    }
}

/// What the server gained by setting up N connections.
struct Resources {
    shape: Shape,
    n: usize,
    fds: usize,
    vm_pin_kib: u64,
    mr_bytes: usize,
}

/// The criterion filter given on the command line, if any (to skip the setup of cases it
/// excludes; a filter with regex syntax is left to criterion).
fn filter() -> Option<String> {
    const WITH_VALUE: [&str; 15] = [
        "--warm-up-time",
        "--measurement-time",
        "--sample-size",
        "--nresamples",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--save-baseline",
        "--baseline",
        "--baseline-lenient",
        "--load-baseline",
        "--profile-time",
        "--output-format",
        "--plotting-backend",
        "--color",
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if WITH_VALUE.contains(&a.as_str()) {
            it.next();
        } else if !a.starts_with('-') {
            return Some(a.clone()).filter(|f| !f.contains(['^', '$', '*', '+', '?', '(', '[', '|', '\\', '.']));
        }
    }
    None
}

fn many_clients(c: &mut Criterion, table: &mut Vec<Resources>) {
    let only = filter();
    let listing = std::env::args().any(|a| a == "--list");
    let mut g = c.benchmark_group("many_clients");
    for n in SIZES {
        g.throughput(Throughput::Elements(n as u64));
        for shape in [Shape::Shared, Shape::PerQp] {
            let id = BenchmarkId::new(shape.name(), n);
            let full = format!("many_clients/{}/{n}", shape.name());
            if listing || only.as_ref().is_some_and(|f| !full.contains(f.as_str())) {
                g.bench_function(id, |b| b.iter(|| ()));
                continue;
            }
            let mut clients = Clients::spawn();
            let (fds0, pin0) = (fds(), vm_pin_kib());
            let mut server = ServerSide::start(shape, n, &mut clients);
            table.push(Resources {
                shape,
                n,
                fds: fds().saturating_sub(fds0),
                vm_pin_kib: vm_pin_kib().saturating_sub(pin0),
                mr_bytes: server.mr_bytes,
            });
            g.bench_function(id, |b| b.iter_custom(|rounds| server.run(&mut clients, rounds)));
            server.finish(clients);
        }
    }
    g.finish();
}

fn main() {
    if std::env::var_os(CLIENT_ENV).is_some() {
        client::main();
        return;
    }
    // librdmacm opens the device once per process, at the first id bound to it, and keeps it
    // open: open it here, so that every case's counts start from the same state.
    let fds_before = fds();
    drop(Server::new().unwrap().bind(SocketAddr::new(device_addr(), 0)).unwrap());
    let process_wide = fds() - fds_before;

    let mut table = Vec::new();
    // Rounds vary more than single operations (every message wakes the other process): sample
    // longer than the setup groups.
    let mut c = criterion().measurement_time(Duration::from_secs(5)).configure_from_args();
    many_clients(&mut c, &mut table);
    c.final_summary();
    if table.is_empty() {
        return;
    }
    println!();
    println!(
        "Server side only (clients in a child process): what setting up N connections added to this process; \
         not counted: the {process_wide} descriptors librdmacm opens once per process for the device."
    );
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("CPUs seen by the bench: {cpus} (in the guest: RDMA_VM_CPUS, default the host's count).");
    for r in &table {
        println!("many_clients resources {} {} {} {} {}", r.shape.name(), r.n, r.fds, r.vm_pin_kib, r.mr_bytes);
    }
    println!();
    println!("| shape | N | fds added | fds / conn | VmPin added (KiB) | VmPin / conn (KiB) | MR bytes / conn |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &table {
        let per = |v: f64| v / r.n as f64;
        println!(
            "| {} | {} | {} | {:.2} | {} | {:.2} | {:.0} |",
            r.shape.name(),
            r.n,
            r.fds,
            per(r.fds as f64),
            r.vm_pin_kib,
            per(r.vm_pin_kib as f64),
            per(r.mr_bytes as f64)
        );
    }
}

/// The child process: N clients on one lane, driven from one thread by lines on stdin
/// (`C PORT N`: connect; `R K`: run K rounds; `Q`: leave), answering on stdout
/// (`READY`, `D` after each batch of rounds).
mod client {
    use super::*;

    pub fn main() {
        let stdin = std::io::stdin();
        let mut lines = stdin.lock().lines();
        let mut next = || lines.next().expect("the bench closed the pipe").expect("read stdin");
        let first = next();
        let mut words = first.split_whitespace().skip(1).map(|w| w.parse::<usize>().expect("C PORT N"));
        let (port, n) = (words.next().expect("PORT") as u16, words.next().expect("N"));
        let dst = SocketAddr::new(device_addr(), port);

        let mut shared: Option<(Arc<ProtectionDomain>, Lane)> = None;
        let mut qps = Vec::with_capacity(n);
        let mut sends = Vec::with_capacity(n);
        for i in 0..n {
            let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let (pd, lane) = shared.get_or_insert_with(|| {
                let ctx = route.context().unwrap();
                (route.alloc_pd().unwrap(), Lane::new(&ctx, 4 * n as u32).unwrap())
            });
            let mut mrs = MemoryRegion::new(pd, 2 * MSG, AccessFlags::LOCAL_WRITE).unwrap().split(MSG).unwrap();
            let (recv, mut send) = (mrs.pop().unwrap(), mrs.pop().unwrap());
            send.as_mut_slice().unwrap().fill(i as u8);
            let c = route.lane_qp(lane, pd, QpInit::new().max_send_wr(2).max_recv_wr(2)).unwrap();
            let qp = c.qp();
            lane.post_recv(qp, RecvWr::new(recv).wr_id(i as u64)).unwrap();
            c.connect(lane, &ConnParam::new(), T).unwrap();
            qps.push(qp);
            sends.push(Some(send));
        }
        let (_pd, mut lane) = shared.expect("at least one client");
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY").and_then(|()| out.flush()).unwrap();
        let mut done = Vec::with_capacity(BURST);
        loop {
            let line = next();
            let Some(rounds) = line.strip_prefix("R ") else { break };
            for _ in 0..rounds.parse::<u64>().expect("R K") {
                for (i, &qp) in qps.iter().enumerate() {
                    let send = sends[i].take().expect("the send's region is back");
                    lane.post_send(qp, SendWr::send(send, 0..MSG).wr_id(i as u64)).unwrap();
                }
                let (mut got, mut sent) = (0, 0);
                while got < n || sent < n {
                    lane.wait_with(BURST, T, |wc, r| keep(&mut done, "client", wc, r))
                        .unwrap_or_else(|e| panic!("client: no completion: {e}"));
                    for d in done.drain(..) {
                        let i = d.wr_id as usize;
                        match d.queue {
                            WorkQueue::Recv => {
                                assert_eq!(d.len, MSG);
                                lane.post_recv(qps[i], RecvWr::new(d.region).wr_id(i as u64)).unwrap();
                                got += 1;
                            }
                            WorkQueue::Send => {
                                sends[i] = Some(d.region);
                                sent += 1;
                            }
                        }
                    }
                }
            }
            writeln!(out, "D").and_then(|()| out.flush()).unwrap();
        }
        // `Q`: leave. Dropping the lane disconnects each connection (the server waits for each
        // to go), moves its QP to the error state and reaps the flushed receives.
        drop(lane);
    }
}
