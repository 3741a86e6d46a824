//! Connection-setup timing, step by step, over many connections at once: rdma-core's `cmtime`
//! (rdma-core 44), with the same flags and the same table, written with this crate.
//!
//! ```text
//! cargo run --example cmtime -- -b 10.77.0.1 -c 100            # server: waits for the connections
//! cargo run --example cmtime -- -s 10.77.0.1 -c 100            # client: times each step
//! ```
//!
//! Like `cmtime`, the client creates every id on one event channel, then runs each step for
//! all connections before the next (resolve address, resolve route, create the QP, connect,
//! disconnect, destroy), the asynchronous steps pipelined: all are started, then the events
//! complete them in whatever order they arrive. The server accepts on one channel from one
//! thread and exits once every connection has come and gone.
//!
//! The steps mean what cmtime's mean:
//!
//! - "create qp" creates one QP per connection on one pair of CQs that all QPs share, created
//!   by the first connection's step. That is what `cmtime` does, though not on purpose: its
//!   `rdma_create_qp(id, NULL, &init_qp_attr)` creates a completion channel and a CQ for each
//!   queue when the attributes name none, and writes them back into the static
//!   `init_qp_attr` that every later call passes, so every later QP shares the first one's
//!   CQs (an strace of `cmtime -c 5` shows the CQs created once, and its later
//!   `rdma_destroy_qp` failing to destroy them with `EBUSY`).
//! - "disconnect" is [`Connection::shutdown`](rdma_cm::Connection::shutdown) (`rdma_disconnect`,
//!   then the QP destroyed at once, as `cmtime`'s `rdma_disconnect` + `rdma_destroy_qp`) for
//!   every connection, then the wait for every `DISCONNECTED`.
//! - "destroy" destroys the ids (`rdma_destroy_id`); the shared CQs and the PD go afterwards,
//!   outside the table (`cmtime` never destroys its CQs).
//!
//! Each QP has one send and one receive work request, as cmtime's.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::exit;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_cm::{
    Accepting, Client, CmEvent, CmEventType, CompletionQueue, ConnParam, ConnectRequest, Connection, Disconnecting,
    EventChannel, IdHandle, ProtectionDomain, QpInit, Server,
};

#[derive(Clone, Copy)]
enum Step {
    CreateId,
    Bind,
    ResolveAddr,
    ResolveRoute,
    CreateQp,
    Connect,
    Disconnect,
    Destroy,
}
const STEPS: usize = 8;
const NAMES: [&str; STEPS] =
    ["create id", "bind addr", "resolve addr", "resolve route", "create qp", "connect", "disconnect", "destroy"];

/// Per-step times: the step's whole span, and each connection's own.
struct Perf {
    step: [(Option<Instant>, Option<Instant>); STEPS],
    conn: Vec<[(Option<Instant>, Option<Instant>); STEPS]>,
}

impl Perf {
    fn new(n: usize) -> Perf {
        Perf { step: [(None, None); STEPS], conn: vec![[(None, None); STEPS]; n] }
    }
    fn begin(&mut self, s: Step) {
        self.step[s as usize].0 = Some(Instant::now());
    }
    fn end(&mut self, s: Step) {
        self.step[s as usize].1 = Some(Instant::now());
    }
    fn begin_conn(&mut self, i: usize, s: Step) {
        self.conn[i][s as usize].0 = Some(Instant::now());
    }
    fn end_conn(&mut self, i: usize, s: Step) {
        self.conn[i][s as usize].1 = Some(Instant::now());
    }
    /// cmtime's table: total ms, max ms, min us and us / conn of each step.
    fn show(&self, bound: bool) {
        let us = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e6;
        println!("step              total ms     max ms     min us  us / conn");
        for (i, name) in NAMES.iter().enumerate() {
            if i == Step::Bind as usize && !bound {
                continue;
            }
            let per: Vec<f64> = self.conn.iter().filter_map(|c| Some(us(c[i].0?, c[i].1?))).collect();
            let max = per.iter().cloned().fold(0.0, f64::max);
            let min = per.iter().cloned().fold(999_999_999.0, f64::min);
            let total = match self.step[i] {
                (Some(a), Some(b)) => us(a, b),
                _ => 0.0,
            };
            println!(
                "{:<13}: {:>11.2}{:>11.2}{:>11.2}{:>11.2}",
                name,
                total / 1000.0,
                max / 1000.0,
                min,
                total / self.conn.len().max(1) as f64
            );
        }
    }
}

struct Args {
    server: Option<String>,
    bind: Option<String>,
    connections: usize,
    port: u16,
    retries: u32,
    timeout: Duration,
}

fn usage(prog: &str) -> ! {
    println!("usage: {prog}");
    println!("\t[-s server_address]");
    println!("\t[-b bind_address]");
    println!("\t[-c connections]");
    println!("\t[-p port_number]");
    println!("\t[-r retries]");
    println!("\t[-t timeout_ms]");
    exit(1);
}

fn parse() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let prog = argv.first().cloned().unwrap_or_else(|| "cmtime".into());
    let mut a = Args {
        server: None,
        bind: None,
        connections: 100,
        port: 7471,
        retries: 2,
        timeout: Duration::from_millis(2000),
    };
    let mut it = argv.iter().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().cloned().unwrap_or_else(|| usage(&prog));
        let num = |v: String| v.parse::<u64>().unwrap_or_else(|_| usage(&prog));
        match flag.as_str() {
            "-s" => a.server = Some(val()),
            "-b" => a.bind = Some(val()),
            "-c" => a.connections = num(val()).max(1) as usize,
            "-p" => a.port = num(val()).try_into().unwrap_or_else(|_| usage(&prog)),
            "-r" => a.retries = num(val()) as u32,
            "-t" => a.timeout = Duration::from_millis(num(val())),
            _ => usage(&prog),
        }
    }
    a
}

fn addr(host: &str, port: u16) -> SocketAddr {
    use std::net::ToSocketAddrs;
    (host, port).to_socket_addrs().ok().and_then(|mut a| a.next()).unwrap_or_else(|| {
        eprintln!("cmtime: cannot resolve {host}");
        exit(1)
    })
}

fn die(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("cmtime: {what}: {e}");
    exit(1)
}

/// Waits (bounded) for the channel's next event.
fn next_event(ch: &EventChannel) -> CmEvent {
    ch.get_event(Duration::from_secs(30)).unwrap_or_else(|e| die("waiting for an event", e))
}

fn main() {
    let args = parse();
    match &args.server {
        Some(s) => client(&args, addr(s, args.port)),
        None => server(&args),
    }
}

fn client(args: &Args, dst: SocketAddr) {
    let n = args.connections;
    let src = args.bind.as_deref().map(|b| addr(b, 0));
    let ch = EventChannel::new().unwrap_or_else(|e| die("creating the event channel", e));
    let mut perf = Perf::new(n);

    println!("creating id");
    perf.begin(Step::CreateId);
    let mut clients = Vec::with_capacity(n);
    for i in 0..n {
        perf.begin_conn(i, Step::CreateId);
        clients.push(Client::on_channel(&ch).unwrap_or_else(|e| die("rdma_create_id", e)));
        perf.end_conn(i, Step::CreateId);
    }
    perf.end(Step::CreateId);

    if let Some(src) = src {
        println!("binding source address");
        perf.begin(Step::Bind);
        clients = clients
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                perf.begin_conn(i, Step::Bind);
                let c = c.bind(src).unwrap_or_else(|e| die("rdma_bind_addr", e));
                perf.end_conn(i, Step::Bind);
                c
            })
            .collect();
        perf.end(Step::Bind);
    }

    println!("resolving address");
    perf.begin(Step::ResolveAddr);
    let mut pending = HashMap::new();
    for (i, c) in clients.into_iter().enumerate() {
        perf.begin_conn(i, Step::ResolveAddr);
        let r = c.start_resolve(src, dst, args.timeout).unwrap_or_else(|e| die("rdma_resolve_addr", e));
        pending.insert(r.handle(), (i, r, args.retries));
    }
    let mut resolved = Vec::with_capacity(n);
    resolved.resize_with(n, || None);
    while !pending.is_empty() {
        let ev = next_event(&ch);
        let Some((i, r, retries)) = pending.remove(&ev.id()) else { continue };
        if ev.event_type() == CmEventType::AddrError && retries > 0 {
            r.retry(src, dst, args.timeout).unwrap_or_else(|e| die("rdma_resolve_addr", e));
            pending.insert(r.handle(), (i, r, retries - 1));
            continue;
        }
        resolved[i] = Some(r.complete(ev).unwrap_or_else(|e| die("resolving the address", e)));
        perf.end_conn(i, Step::ResolveAddr);
    }
    perf.end(Step::ResolveAddr);

    println!("resolving route");
    perf.begin(Step::ResolveRoute);
    let mut pending = HashMap::new();
    for (i, a) in resolved.into_iter().enumerate() {
        perf.begin_conn(i, Step::ResolveRoute);
        let r = a
            .expect("resolved above")
            .start_resolve_route(args.timeout)
            .unwrap_or_else(|e| die("rdma_resolve_route", e));
        pending.insert(r.handle(), (i, r, args.retries));
    }
    let mut routes = Vec::with_capacity(n);
    routes.resize_with(n, || None);
    while !pending.is_empty() {
        let ev = next_event(&ch);
        let Some((i, r, retries)) = pending.remove(&ev.id()) else { continue };
        if ev.event_type() == CmEventType::RouteError && retries > 0 {
            r.retry(args.timeout).unwrap_or_else(|e| die("rdma_resolve_route", e));
            pending.insert(r.handle(), (i, r, retries - 1));
            continue;
        }
        routes[i] = Some(r.complete(ev).unwrap_or_else(|e| die("resolving the route", e)));
        perf.end_conn(i, Step::ResolveRoute);
    }
    perf.end(Step::ResolveRoute);

    println!("creating qp");
    perf.begin(Step::CreateQp);
    let mut pd: Option<Arc<ProtectionDomain>> = None;
    let mut cqs: Option<[Arc<CompletionQueue>; 2]> = None;
    let mut qps = Vec::with_capacity(n);
    for (i, r) in routes.into_iter().enumerate() {
        let r = r.expect("routed above");
        // One PD for all, as librdmacm's default PD is one per device.
        let pd = pd.get_or_insert_with(|| r.alloc_pd().unwrap_or_else(|e| die("ibv_alloc_pd", e)));
        perf.begin_conn(i, Step::CreateQp);
        // The first connection creates the CQs every QP shares, as cmtime's (see the header).
        let [scq, rcq] = cqs.get_or_insert_with(|| shared_cqs(&r.context().unwrap_or_else(|e| die("context", e)), n));
        let init = QpInit::new().max_send_wr(1).max_recv_wr(1).send_cq(Arc::clone(scq)).recv_cq(Arc::clone(rcq));
        qps.push(r.create_qp(pd, init).unwrap_or_else(|e| die("rdma_create_qp", e)));
        perf.end_conn(i, Step::CreateQp);
    }
    perf.end(Step::CreateQp);

    println!("connecting");
    perf.begin(Step::Connect);
    let param = ConnParam::new();
    let mut pending = HashMap::new();
    for (i, q) in qps.into_iter().enumerate() {
        perf.begin_conn(i, Step::Connect);
        let c = q.start(&param).unwrap_or_else(|e| die("rdma_connect", e));
        pending.insert(c.handle(), (i, c));
    }
    let mut conns: Vec<Option<Connection>> = Vec::with_capacity(n);
    conns.resize_with(n, || None);
    while !pending.is_empty() {
        let ev = next_event(&ch);
        let Some((i, c)) = pending.remove(&ev.id()) else { continue };
        conns[i] = Some(c.complete(ev).unwrap_or_else(|e| die("connecting", e)));
        perf.end_conn(i, Step::Connect);
    }
    perf.end(Step::Connect);

    println!("disconnecting");
    perf.begin(Step::Disconnect);
    let mut waiting = HashMap::new();
    let mut closed: Vec<Option<Disconnecting>> = Vec::with_capacity(n);
    closed.resize_with(n, || None);
    for (i, c) in conns.into_iter().enumerate() {
        perf.begin_conn(i, Step::Disconnect);
        // rdma_disconnect and the QP destroyed at once, as cmtime's rdma_destroy_qp.
        let d = c.expect("connected above").shutdown().unwrap_or_else(|e| die("rdma_disconnect", e));
        if d.is_complete() {
            perf.end_conn(i, Step::Disconnect);
            closed[i] = Some(d);
        } else {
            waiting.insert(d.handle(), (i, d));
        }
    }
    while !waiting.is_empty() {
        let ev = next_event(&ch);
        if ev.event_type() != CmEventType::Disconnected {
            continue;
        }
        if let Some((i, mut d)) = waiting.remove(&ev.id()) {
            d.complete(&ev).unwrap_or_else(|e| die("disconnecting", e));
            perf.end_conn(i, Step::Disconnect);
            closed[i] = Some(d);
        }
    }
    perf.end(Step::Disconnect);

    println!("destroying id");
    perf.begin(Step::Destroy);
    for (i, d) in closed.into_iter().enumerate() {
        perf.begin_conn(i, Step::Destroy);
        drop(d);
        perf.end_conn(i, Step::Destroy);
    }
    perf.end(Step::Destroy);
    drop(cqs);
    drop(pd);
    perf.show(src.is_some());
}

/// A send and a receive CQ deep enough for `n` QPs of one work request each.
fn shared_cqs(ctx: &rdma_cm::VerbsContext, n: usize) -> [Arc<CompletionQueue>; 2] {
    let depth = u32::try_from(n).unwrap_or(u32::MAX);
    let cq = || CompletionQueue::new(ctx, depth).unwrap_or_else(|e| die("ibv_create_cq", e));
    [cq(), cq()]
}

fn server(args: &Args) {
    let n = args.connections;
    let bind = addr(args.bind.as_deref().unwrap_or("0.0.0.0"), args.port);
    let ch = EventChannel::new().unwrap_or_else(|e| die("creating the event channel", e));
    let listener = Server::on_channel(&ch)
        .and_then(|s| s.bind(bind))
        .and_then(|b| b.listen(n.min(i32::MAX as usize) as i32))
        .unwrap_or_else(|e| die("listening", e));
    let mut perf = Perf::new(n);
    let mut pd: Option<Arc<ProtectionDomain>> = None;
    let mut cqs: Option<[Arc<CompletionQueue>; 2]> = None;
    let mut accepting: HashMap<IdHandle, (usize, Accepting)> = HashMap::new();
    let mut conns: HashMap<IdHandle, (usize, Connection)> = HashMap::new();
    let (mut next, mut gone) = (0usize, 0usize);
    while gone < n {
        let ev = ch.get_event(Duration::from_secs(3600)).unwrap_or_else(|e| die("waiting for an event", e));
        match ev.event_type() {
            CmEventType::ConnectRequest if ev.listen_id() == Some(listener.handle()) => {
                if next == 0 {
                    perf.begin(Step::Connect);
                }
                let i = next.min(n - 1);
                next += 1;
                perf.begin_conn(i, Step::CreateQp);
                let req = ConnectRequest::from_event(ev).unwrap_or_else(|e| die("taking a request", e));
                let pd = pd.get_or_insert_with(|| req.alloc_pd().unwrap_or_else(|e| die("ibv_alloc_pd", e)));
                // One CQ pair for all QPs, as cmtime's server (its requests pass the same static
                // init_qp_attr, into which the first rdma_create_qp wrote its CQs).
                let [scq, rcq] =
                    cqs.get_or_insert_with(|| shared_cqs(&req.context().unwrap_or_else(|e| die("context", e)), n));
                let init =
                    QpInit::new().max_send_wr(1).max_recv_wr(1).send_cq(Arc::clone(scq)).recv_cq(Arc::clone(rcq));
                let q = req.create_qp(pd, init).unwrap_or_else(|e| die("rdma_create_qp", e));
                perf.end_conn(i, Step::CreateQp);
                perf.begin_conn(i, Step::Connect);
                let acc = q.start_accept(&ConnParam::new()).unwrap_or_else(|e| die("rdma_accept", e));
                accepting.insert(acc.handle(), (i, acc));
            }
            CmEventType::Established => {
                let Some((i, acc)) = accepting.remove(&ev.id()) else { continue };
                let c = acc.complete(ev).unwrap_or_else(|e| die("accepting", e));
                perf.end_conn(i, Step::Connect);
                if conns.len() + 1 == n {
                    perf.end(Step::Connect);
                }
                conns.insert(c.id().handle(), (i, c));
            }
            CmEventType::Disconnected => {
                let Some((i, mut c)) = conns.remove(&ev.id()) else { continue };
                if gone == 0 {
                    perf.begin(Step::Disconnect);
                }
                perf.begin_conn(i, Step::Disconnect);
                c.handle_event(&ev); // answers the peer's disconnect
                perf.end_conn(i, Step::Disconnect);
                perf.begin_conn(i, Step::Destroy);
                drop(c);
                perf.end_conn(i, Step::Destroy);
                gone += 1;
                if gone == n {
                    perf.end(Step::Disconnect);
                }
            }
            _ => {}
        }
    }
    drop(listener);
    drop(cqs);
    drop(pd);
    perf.show(false);
}
