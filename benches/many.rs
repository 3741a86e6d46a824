//! One thread serving N concurrent ping-pong clients, in the two shapes a server can take:
//!
//! - `many_clients/shared/N`: one completion queue for every QP (send and receive) and one
//!   shared receive queue of `SRQ_DEPTH` slots, whose slots are echoed in place;
//! - `many_clients/per_qp/N`: each QP its own CQ (with its own completion channel, as an
//!   event-driven server with a CQ per connection has) and its own `RECV_DEPTH` receive slots
//!   in a region registered for it.
//!
//! Both shapes accept on one event channel and share one protection domain; they differ only
//! in the CQs and the receive buffers. One iteration is one round: each of the N clients
//! sends one `MSG`-byte message and the server thread echoes it; the round ends when every
//! client has its echo (criterion's throughput line is round trips per second). The server
//! thread is event-driven, as a server that shares its CPUs is: it polls, and when nothing is
//! there it arms its CQ(s) and sleeps on their completion channels (one, or N through
//! poll(2)); the clients wait the same way. (Busy-polling on both sides took milliseconds per
//! round trip in the two-vCPU guest, where the two spinning processes leave no CPU to
//! Soft-RoCE's deferred work.) A batch of rounds is started and ended over a pipe to the
//! client process; criterion's linear sampling takes that fixed cost out of its slope.
//!
//! The clients run in a child process (this binary again, with `RDMA_CM_BENCH_MANY_CLIENT`
//! set), one thread driving N client QPs on one CQ of its own. So this process holds the
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

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{criterion, device_addr, T};
use criterion::{BenchmarkId, Criterion, Throughput};
use rdma_cm::{
    Accepting, AccessFlags, Client, CmEventType, CompletionQueue, ConnParam, ConnectRequest, Connection, EventChannel,
    IdHandle, Listener, MemoryRegion, ProtectionDomain, QpInit, RecvWr, SendWr, Server, SharedReceiveQueue,
    WorkCompletion, WorkQueue,
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

/// The shared shape's pool: one CQ, one SRQ and its slots.
struct Pool {
    cq: Arc<CompletionQueue>,
    srq: SharedReceiveQueue,
    slots: Vec<MemoryRegion>,
}

/// One server connection; `slots` are its own receive slots in the per-QP shape.
struct Conn {
    conn: Connection,
    slots: Vec<MemoryRegion>,
}

/// The server: one thread, one event channel, N connections.
struct ServerSide {
    shape: Shape,
    ch: EventChannel,
    _listener: Listener,
    pd: Option<Arc<ProtectionDomain>>,
    pool: Option<Pool>,
    conns: Vec<Conn>,
    /// qp_num -> index in `conns` (the shared CQ's completions name their QP).
    by_qp: HashMap<u32, usize>,
    wcs: Vec<WorkCompletion>,
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
    /// Listens, lets the child connect `n` clients, and accepts them all from this thread.
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
            pool: None,
            conns: Vec::with_capacity(n),
            by_qp: HashMap::new(),
            wcs: vec![WorkCompletion::default(); 64],
        };
        let mut accepting: HashMap<IdHandle, (Accepting, Vec<MemoryRegion>)> = HashMap::new();
        while s.conns.len() < n {
            let ev = s.ch.get_event(T).expect("server: a CM event while the clients connect");
            match ev.event_type() {
                CmEventType::ConnectRequest => {
                    let req = ConnectRequest::from_event(ev).unwrap();
                    let (acc, slots) = s.accept(req, n);
                    accepting.insert(acc.handle(), (acc, slots));
                }
                CmEventType::Established => {
                    let (acc, slots) = accepting.remove(&ev.id()).expect("ESTABLISHED of a known id");
                    let conn = acc.complete(ev).unwrap();
                    s.by_qp.insert(conn.qp().qp_num(), s.conns.len());
                    s.conns.push(Conn { conn, slots });
                }
                other => panic!("server: unexpected {other} while accepting"),
            }
        }
        clients.expect("READY");
        s
    }

    /// Creates the request's QP in this shape, posts its receives (per-QP), starts the accept.
    fn accept(&mut self, req: ConnectRequest, n: usize) -> (Accepting, Vec<MemoryRegion>) {
        let ctx = req.context().unwrap();
        let pd = Arc::clone(self.pd.get_or_insert_with(|| req.alloc_pd().unwrap()));
        let (init, slots) = match self.shape {
            Shape::Shared => {
                let pool = self.pool.get_or_insert_with(|| {
                    let cq = CompletionQueue::new(&ctx, SEND_DEPTH * n as u32 + SRQ_DEPTH).unwrap();
                    let srq = SharedReceiveQueue::new(&pd, SRQ_DEPTH).unwrap();
                    let region = MemoryRegion::new(&pd, MSG * SRQ_DEPTH as usize, AccessFlags::LOCAL_WRITE).unwrap();
                    let slots = region.split(MSG).unwrap();
                    let recvs: Vec<RecvWr> =
                        slots.iter().enumerate().map(|(i, m)| RecvWr::new(m, 0..MSG).wr_id(i as u64)).collect();
                    srq.post_recv(&recvs).unwrap();
                    Pool { cq, srq, slots }
                });
                let init = QpInit::new()
                    .max_send_wr(SEND_DEPTH)
                    .send_cq(Arc::clone(&pool.cq))
                    .recv_cq(Arc::clone(&pool.cq))
                    .srq(&pool.srq);
                (init, vec![])
            }
            Shape::PerQp => {
                let cq = CompletionQueue::new(&ctx, SEND_DEPTH + RECV_DEPTH).unwrap();
                let region = MemoryRegion::new(&pd, MSG * RECV_DEPTH as usize, AccessFlags::LOCAL_WRITE).unwrap();
                let init =
                    QpInit::new().max_send_wr(SEND_DEPTH).max_recv_wr(RECV_DEPTH).send_cq(Arc::clone(&cq)).recv_cq(cq);
                (init, region.split(MSG).unwrap())
            }
        };
        let mut q = req.create_qp(&pd, init).unwrap();
        if !slots.is_empty() {
            let recvs: Vec<RecvWr> =
                slots.iter().enumerate().map(|(i, m)| RecvWr::new(m, 0..MSG).wr_id(i as u64)).collect();
            q.post_recv(&recvs).unwrap();
        }
        (q.start_accept(&ConnParam::new()).unwrap(), slots)
    }

    /// Bytes of memory regions this server registered.
    fn mr_bytes(&self) -> usize {
        let srq = self.pool.as_ref().map_or(0, |p| p.slots.iter().map(MemoryRegion::len).sum());
        srq + self.conns.iter().flat_map(|c| &c.slots).map(MemoryRegion::len).sum::<usize>()
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

    /// The shared shape: wait on the one CQ (poll; when it is empty, arm it and sleep on its
    /// channel); echo each receive from its SRQ slot on the QP the completion names; return
    /// the slot to the SRQ when the echo's send completes.
    fn echo_shared(&mut self, target: u64) {
        let pool = self.pool.as_ref().expect("the pool exists once a client connected");
        let (mut echoed, mut in_flight) = (0u64, 0u64);
        while echoed < target || in_flight > 0 {
            let k = pool.cq.wait(&mut self.wcs, T).unwrap();
            assert!(k > 0, "server: no completion within {T:?} ({echoed} of {target} echoed)");
            for wc in &self.wcs[..k] {
                let wc = wc.ok().expect("server: a completion failed");
                let slot = wc.wr_id() as usize;
                match wc.queue() {
                    WorkQueue::Recv => {
                        let c = &mut self.conns[self.by_qp[&wc.qp_num()]];
                        let len = wc.byte_len() as usize;
                        c.conn
                            .qp_mut()
                            .post_send(&[SendWr::send(&pool.slots[slot], 0..len).wr_id(slot as u64)])
                            .unwrap();
                        echoed += 1;
                        in_flight += 1;
                    }
                    WorkQueue::Send => {
                        pool.srq.post_recv(&[RecvWr::new(&pool.slots[slot], 0..MSG).wr_id(slot as u64)]).unwrap();
                        in_flight -= 1;
                    }
                }
            }
        }
    }

    /// The per-QP shape, the same wait over N CQs: poll each QP's CQ in turn; when a sweep
    /// finds nothing, arm every CQ, sweep again, and sleep in poll(2) on all N completion
    /// channels. Echo from the QP's own slot, and post the slot again when the echo's send
    /// completes.
    fn echo_per_qp(&mut self, target: u64) {
        let (mut echoed, mut in_flight) = (0u64, 0u64);
        let mut pfds: Vec<libc::pollfd> = self
            .conns
            .iter()
            .map(|c| libc::pollfd { fd: c.conn.qp().recv_cq().as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        while echoed < target || in_flight > 0 {
            if self.sweep(&mut echoed, &mut in_flight) > 0 {
                continue;
            }
            for c in &self.conns {
                c.conn.qp().recv_cq().req_notify(false).unwrap();
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
            for (p, c) in pfds.iter_mut().zip(&self.conns) {
                if std::mem::take(&mut p.revents) != 0 {
                    c.conn.qp().recv_cq().drain_events().unwrap();
                }
            }
        }
    }

    /// One pass over the per-QP connections; returns the completions it handled.
    fn sweep(&mut self, echoed: &mut u64, in_flight: &mut u64) -> usize {
        let mut seen = 0;
        for c in &mut self.conns {
            let k = c.conn.qp_mut().poll(&mut self.wcs).unwrap();
            seen += k;
            for wc in &self.wcs[..k] {
                let wc = wc.ok().expect("server: a completion failed");
                let slot = wc.wr_id() as usize;
                match wc.queue() {
                    WorkQueue::Recv => {
                        let len = wc.byte_len() as usize;
                        c.conn.qp_mut().post_send(&[SendWr::send(&c.slots[slot], 0..len).wr_id(slot as u64)]).unwrap();
                        *echoed += 1;
                        *in_flight += 1;
                    }
                    WorkQueue::Send => {
                        c.conn.qp_mut().post_recv(&[RecvWr::new(&c.slots[slot], 0..MSG).wr_id(slot as u64)]).unwrap();
                        *in_flight -= 1;
                    }
                }
            }
        }
        seen
    }

    /// Has the clients leave, answers each disconnect, and drops everything.
    fn finish(mut self, mut clients: Clients) {
        clients.send("Q");
        let mut by_id: HashMap<IdHandle, usize> =
            self.conns.iter().enumerate().map(|(i, c)| (c.conn.id().handle(), i)).collect();
        let mut conns: Vec<Option<Conn>> = self.conns.drain(..).map(Some).collect();
        while !by_id.is_empty() {
            let ev = self.ch.get_event(T).expect("server: the clients' disconnects");
            if ev.event_type() != CmEventType::Disconnected {
                continue;
            }
            if let Some(i) = by_id.remove(&ev.id()) {
                let mut c = conns[i].take().expect("one DISCONNECTED per connection");
                c.conn.handle_event(&ev);
            }
        }
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
                mr_bytes: server.mr_bytes(),
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

/// The child process: N clients on one CQ, driven from one thread by lines on stdin
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

        let mut shared: Option<(Arc<ProtectionDomain>, Arc<CompletionQueue>)> = None;
        let mut conns = Vec::with_capacity(n);
        let mut sends = Vec::with_capacity(n);
        let mut recvs = Vec::with_capacity(n);
        for i in 0..n {
            let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let (pd, cq) = shared.get_or_insert_with(|| {
                let ctx = route.context().unwrap();
                (route.alloc_pd().unwrap(), CompletionQueue::new(&ctx, 4 * n as u32).unwrap())
            });
            let mut mrs = MemoryRegion::new(pd, 2 * MSG, AccessFlags::LOCAL_WRITE).unwrap().split(MSG).unwrap();
            let (recv, mut send) = (mrs.pop().unwrap(), mrs.pop().unwrap());
            send.as_mut_slice().unwrap().fill(i as u8);
            let init = QpInit::new().max_send_wr(2).max_recv_wr(2).send_cq(Arc::clone(cq)).recv_cq(Arc::clone(cq));
            let mut q = route.create_qp(pd, init).unwrap();
            q.post_recv(&[RecvWr::new(&recv, 0..MSG).wr_id(i as u64)]).unwrap();
            conns.push(q.connect(&ConnParam::new(), T).unwrap());
            sends.push(send);
            recvs.push(recv);
        }
        let cq = Arc::clone(&shared.as_ref().expect("at least one client").1);
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY").and_then(|()| out.flush()).unwrap();
        let mut wcs = vec![WorkCompletion::default(); 64];
        loop {
            let line = next();
            let Some(rounds) = line.strip_prefix("R ") else { break };
            for _ in 0..rounds.parse::<u64>().expect("R K") {
                for (i, c) in conns.iter_mut().enumerate() {
                    c.qp_mut().post_send(&[SendWr::send(&sends[i], 0..MSG).wr_id(i as u64)]).unwrap();
                }
                let (mut got, mut sent) = (0, 0);
                while got < n || sent < n {
                    let k = cq.wait(&mut wcs, T).unwrap();
                    assert!(k > 0, "client: no completion within {T:?}");
                    for wc in &wcs[..k] {
                        let wc = wc.ok().expect("client: a completion failed");
                        match wc.queue() {
                            WorkQueue::Recv => {
                                let i = wc.wr_id() as usize;
                                assert_eq!(wc.byte_len() as usize, MSG);
                                conns[i].qp_mut().post_recv(&[RecvWr::new(&recvs[i], 0..MSG).wr_id(i as u64)]).unwrap();
                                got += 1;
                            }
                            WorkQueue::Send => sent += 1,
                        }
                    }
                }
            }
            writeln!(out, "D").and_then(|()| out.flush()).unwrap();
        }
        // `Q`: leave. The server answers each disconnect; the drops reap the flushed receives.
        for c in &mut conns {
            let _ = c.start_disconnect();
        }
        drop(conns);
    }
}
