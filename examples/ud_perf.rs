//! UD latency and message rate over rdma_cm, printed in perftest's format so they read beside
//! `ib_send_lat -c UD` and `ib_send_bw -c UD` (see `harness/bench-tools`).
//!
//! ```text
//! cargo run --release --example ud_perf -- -p 18610 --mode lat                       # server
//! cargo run --release --example ud_perf -- -s 10.77.0.1 -p 18610 --mode lat -S 2 -n 2000   # client
//! cargo run --release --example ud_perf -- -p 18611 --mode bw                        # server
//! cargo run --release --example ud_perf -- -s 10.77.0.1 -p 18611 --mode bw -S 1024 -n 20000
//! ```
//!
//! `--mode lat`: ping-pong of `-S` bytes, `-n` times after 16 warm-up round trips; the client
//! prints ib_send_lat's table (half round trips). `--mode bw`: the client streams `-n`
//! datagrams of `-S` bytes, keeping up to 128 in flight and asking a completion of every 16th,
//! and prints ib_send_bw's line (measured at the sender, as perftest's client does); the
//! server keeps 512 receives posted and reports how many datagrams arrived (UD may drop when
//! the receiver falls behind). `--busy-poll` makes the waits spin, as perftest's do.
//! Both ends must use the same `--mode` and `-S`.

mod common;

use std::net::SocketAddr;
use std::process::exit;
use std::sync::Arc;

use std::time::{Duration, Instant};

use rdma_cm::cm::ud_cm::{UdClient, UdServer};
use rdma_cm::verbs::ah::{AddressHandle, GRH_LEN};
use rdma_cm::verbs::lane::{Completion, DestKey, Lane, RecvWr, SendWr, Wc};
use rdma_cm::verbs::ud::{Datagram, UdDest};
use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, QpInit, WorkQueue};

const T: Duration = Duration::from_secs(30);
const WARMUP: u32 = 16;
const TX_DEPTH: u32 = 128;
const SIGNAL_EVERY: u32 = 16;
const RX_DEPTH: u32 = 512;

struct Args {
    server: Option<String>,
    port: u16,
    bw: bool,
    size: usize,
    iters: u32,
    busy_poll: bool,
}

fn usage() -> ! {
    eprintln!("usage: ud_perf [-s server_address] [-p port] [--mode lat|bw] [-S size] [-n iterations] [--busy-poll]");
    exit(1)
}

fn parse() -> Args {
    let mut a = Args { server: None, port: 18610, bw: false, size: 2, iters: 1000, busy_poll: false };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        if f == "--busy-poll" {
            a.busy_poll = true;
            continue;
        }
        let v = it.next().unwrap_or_else(|| usage());
        match f.as_str() {
            "-s" => a.server = Some(v),
            "-p" => a.port = v.parse().unwrap_or_else(|_| usage()),
            "--mode" => {
                a.bw = match v.as_str() {
                    "lat" => false,
                    "bw" => true,
                    _ => usage(),
                }
            }
            "-S" => a.size = v.parse().unwrap_or_else(|_| usage()),
            "-n" => a.iters = v.parse::<u32>().unwrap_or_else(|_| usage()).max(1),
            _ => usage(),
        }
    }
    a
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    common::fail(what, e)
}

fn init(a: &Args) -> QpInit {
    if a.bw {
        QpInit::new().max_send_wr(TX_DEPTH).max_recv_wr(RX_DEPTH)
    } else {
        QpInit::new().max_send_wr(16).max_recv_wr(16)
    }
}

/// `n` buffers of `len` bytes.
fn regions(pd: &Arc<ProtectionDomain>, len: usize, n: u32) -> Vec<MemoryRegion> {
    (0..n)
        .map(|_| {
            MemoryRegion::new(pd, len, AccessFlags::LOCAL_WRITE).unwrap_or_else(|e| fail("registering buffers", e))
        })
        .collect()
}

/// The next completion: spinning under `--busy-poll` (as perftest's waits do), else sleeping on
/// the CQ's channel. A failed completion is an error.
fn next(lane: &mut Lane, busy: bool, what: &str) -> Completion {
    let c = if busy { lane.spin(T) } else { lane.wait(T) };
    c.and_then(Completion::ok).unwrap_or_else(|e| fail(what, e))
}

fn main() {
    let a = parse();
    match a.server.clone() {
        Some(s) => client(&a, common::resolve_host(&s, a.port).unwrap_or_else(|e| fail("resolving", e))),
        None => server(&a),
    }
}

fn server(a: &Args) {
    let l = UdServer::new()
        .and_then(|s| s.listen(SocketAddr::from(([0, 0, 0, 0], a.port)), 8))
        .unwrap_or_else(|e| fail("listening", e));
    println!("listening on port {}", a.port);
    let req = l.get_request(Duration::from_secs(120)).unwrap_or_else(|e| fail("waiting for the client", e));
    let pd = req.alloc_pd().unwrap_or_else(|e| fail("ibv_alloc_pd", e));
    let ctx = req.context().unwrap_or_else(|e| fail("opening the device", e));
    let mut lane = Lane::new(&ctx, 2 * RX_DEPTH).unwrap_or_else(|e| fail("creating the CQ", e));
    // The client sends the moment it has our answer, and a datagram that finds no receive is
    // dropped: the receives go up before the accept, on a shared receive queue the lane owns
    // (the lane takes the QP only once accepted).
    let depth = if a.bw { RX_DEPTH } else { 1 };
    let srq = lane.create_srq(&pd, depth).unwrap_or_else(|e| fail("creating the SRQ", e));
    for (i, b) in regions(&pd, a.size + GRH_LEN, depth).into_iter().enumerate() {
        lane.post_srq_recv(srq, RecvWr::new(b).wr_id(i as u64)).unwrap_or_else(|e| fail("posting receives", e));
    }
    let init = lane.srq_qp_init(srq, init(a)).unwrap_or_else(|e| fail("creating the QP", e));
    let sq = req.create_qp(&pd, init).unwrap_or_else(|e| fail("creating the QP", e));
    let ep = sq.accept(&[]).unwrap_or_else(|e| fail("accepting", e));
    let (port, qkey) = (ep.qp().port_num(), ep.qp().qkey());
    let qp = lane.attach(ep).unwrap_or_else(|e| fail("attaching the QP to the lane", e));
    if a.bw {
        // Count arrivals until the stream goes quiet for 2 s after the first datagram.
        let mut got = 0u64;
        let mut idle = T;
        let mut back = Vec::with_capacity(16);
        loop {
            let mut take = |wc: Wc, mr: Option<MemoryRegion>| {
                got += u64::from(wc.is_ok());
                back.extend(mr.map(|m| (wc.wr_id(), m)));
            };
            let r = if a.busy_poll { lane.spin_with(16, idle, &mut take) } else { lane.wait_with(16, idle, &mut take) };
            match r {
                Ok(_) => {}
                Err(rdma_cm::Error::Timeout { .. }) => break,
                Err(e) => fail("receiving", e),
            }
            idle = Duration::from_secs(2);
            for (i, b) in back.drain(..) {
                lane.post_srq_recv(srq, RecvWr::new(b).wr_id(i)).unwrap_or_else(|e| fail("reposting", e));
            }
        }
        println!("received {got} datagrams");
        return;
    }
    // Ping-pong: answer each datagram; the first one names the client.
    let mut send =
        MemoryRegion::new(&pd, a.size.max(1), AccessFlags::LOCAL_WRITE).unwrap_or_else(|e| fail("registering", e));
    let mut dest: Option<DestKey> = None;
    // The client's next datagram may complete here before our answer's send does.
    let mut early: Option<Completion> = None;
    for k in 0..(a.iters + WARMUP) as u64 {
        let mut got = early.take().unwrap_or_else(|| next(&mut lane, a.busy_poll, "receiving"));
        let mut buf = got.take_region().unwrap_or_else(|| fail("receiving", "a completion without its buffer"));
        if dest.is_none() {
            let wc = *got;
            let d = Datagram::parse(&wc, &mut buf, 0).unwrap_or_else(|e| fail("reading the datagram", e));
            let grh = d.grh().unwrap_or_else(|| fail("reply AH", "the datagram carried no GRH"));
            let ah = AddressHandle::reply_to(&pd, port, &wc, grh).unwrap_or_else(|e| fail("reply AH", e));
            let key = lane.add_dest(qp, &UdDest::new(ah, d.src_qp(), qkey));
            dest = Some(key.unwrap_or_else(|e| fail("reply AH", e)));
        }
        lane.post_srq_recv(srq, RecvWr::new(buf).wr_id(0)).unwrap_or_else(|e| fail("reposting", e));
        let to = dest.expect("set above");
        lane.post_send(qp, SendWr::send(send, 0..a.size).to(to).wr_id(k)).unwrap_or_else(|e| fail("sending", e));
        send = loop {
            let mut c = next(&mut lane, a.busy_poll, "send completion");
            if c.queue() == WorkQueue::Send {
                break c.take_region().unwrap_or_else(|| fail("send completion", "without its buffer"));
            }
            early = Some(c);
        };
    }
}

fn client(a: &Args, dst: SocketAddr) {
    let route = UdClient::new()
        .and_then(|c| c.resolve_addr(None, dst, T))
        .and_then(|r| r.resolve_route(T))
        .unwrap_or_else(|e| fail("resolving", e));
    let pd = route.alloc_pd().unwrap_or_else(|e| fail("ibv_alloc_pd", e));
    let ctx = route.context().unwrap_or_else(|e| fail("opening the device", e));
    let mut lane = Lane::new(&ctx, 2 * TX_DEPTH).unwrap_or_else(|e| fail("creating the CQ", e));
    let mut ep = route.create_qp(&pd, lane.qp_init_from(init(a))).unwrap_or_else(|e| fail("creating the QP", e));
    let to = ep.connect(&[], T).unwrap_or_else(|e| fail("connecting", e));
    let qp = lane.attach(ep).unwrap_or_else(|e| fail("attaching the QP to the lane", e));
    let to = lane.add_dest(qp, &to).unwrap_or_else(|e| fail("connecting", e));
    if a.bw {
        // A send moves its buffer into the lane until a completion retires it (an unsignaled
        // one with the next signaled one): one buffer per send in flight.
        let mut free = regions(&pd, a.size.max(1), TX_DEPTH);
        let n = a.iters;
        let (mut posted, mut done) = (0u32, 0u32);
        let mut failed = None;
        let start = Instant::now();
        while done < n {
            while posted < n {
                let Some(buf) = free.pop() else { break };
                let mut wr = SendWr::send(buf, 0..a.size).to(to).wr_id(posted as u64);
                if posted % SIGNAL_EVERY != SIGNAL_EVERY - 1 && posted != n - 1 {
                    wr = wr.unsignaled();
                }
                lane.post_send(qp, wr).unwrap_or_else(|e| fail("sending", e));
                posted += 1;
            }
            let mut back = |wc: Wc, mr: Option<MemoryRegion>| {
                failed = failed.take().or(wc.error());
                free.extend(mr);
            };
            let k = if a.busy_poll {
                lane.spin_with(TX_DEPTH as usize, T, &mut back)
            } else {
                lane.wait_with(TX_DEPTH as usize, T, &mut back)
            };
            done += k.unwrap_or_else(|e| fail("send completions", e)) as u32;
            if let Some(e) = failed.take() {
                fail("send", e);
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let mbs = (a.size as f64 * n as f64) / secs / (1 << 20) as f64;
        println!("---------------------------------------------------------------------------------------");
        println!(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]");
        println!(
            " {:<10} {n:<10}       {mbs:<7.2}            {mbs:<7.2}              {:.6}",
            a.size,
            n as f64 / secs / 1e6
        );
        println!("---------------------------------------------------------------------------------------");
        return;
    }
    let mut send =
        MemoryRegion::new(&pd, a.size.max(1), AccessFlags::LOCAL_WRITE).unwrap_or_else(|e| fail("registering", e));
    let mut recv =
        MemoryRegion::new(&pd, a.size + GRH_LEN, AccessFlags::LOCAL_WRITE).unwrap_or_else(|e| fail("registering", e));
    let mut rtts = Vec::with_capacity(a.iters as usize);
    let clock = common::Stopwatch::calibrate();
    for k in 0..(a.iters + WARMUP) as u64 {
        // The receive goes up before the send, so the answer always has one.
        lane.post_recv(qp, RecvWr::new(recv).wr_id(0)).unwrap_or_else(|e| fail("posting", e));
        let start = clock.now();
        lane.post_send(qp, SendWr::send(send, 0..a.size).to(to).wr_id(k)).unwrap_or_else(|e| fail("sending", e));
        // The answer's and the send's completions, in either order, each with its buffer.
        let (mut sent, mut answer, mut rtt) = (None, None, Duration::ZERO);
        while sent.is_none() || answer.is_none() {
            let mut c = next(&mut lane, a.busy_poll, "receiving the answer");
            if c.queue() == WorkQueue::Recv {
                rtt = clock.since(start);
                answer = c.take_region();
            } else {
                sent = c.take_region();
            }
        }
        (send, recv) = (sent.expect("the send's buffer"), answer.expect("the receive's buffer"));
        if k >= WARMUP as u64 {
            rtts.push(rtt);
        }
    }
    common::print_latency_table(a.size as u32, &mut rtts);
}
