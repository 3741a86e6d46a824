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

use std::time::{Duration, Instant};

use rdma_cm::{
    AccessFlags, Datagram, MemoryRegion, QpInit, RecvWr, UdClient, UdDest, UdEndpoint, UdSendWr, UdServer,
    WorkCompletion, WorkQueue, GRH_LEN,
};

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

/// Receive buffers: one region of `size` + 40 bytes per receive slot.
fn recv_bufs(ep: &UdEndpoint, a: &Args, n: u32) -> Vec<MemoryRegion> {
    let slot = a.size + GRH_LEN;
    MemoryRegion::new(ep.qp().pd(), slot * n as usize, AccessFlags::LOCAL_WRITE)
        .and_then(|m| m.split(slot))
        .unwrap_or_else(|e| fail("registering receive buffers", e))
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
    let mut sq = req.create_qp(&pd, init(a)).unwrap_or_else(|e| fail("creating the QP", e));
    let depth = if a.bw { RX_DEPTH } else { 1 };
    let slot = a.size + GRH_LEN;
    let mut bufs = MemoryRegion::new(&pd, slot * depth as usize, AccessFlags::LOCAL_WRITE)
        .and_then(|m| m.split(slot))
        .unwrap_or_else(|e| fail("registering receive buffers", e));
    for (i, b) in bufs.iter().enumerate() {
        sq.post_recv(&[RecvWr::new(b, 0..slot).wr_id(i as u64)]).unwrap_or_else(|e| fail("posting receives", e));
    }
    let mut ep = sq.accept(&[]).unwrap_or_else(|e| fail("accepting", e));
    ep.qp_mut().set_busy_poll(a.busy_poll);
    let mut wcs = [WorkCompletion::default(); 16];
    if a.bw {
        // Count arrivals until the stream goes quiet for 2 s after the first datagram.
        let mut got = 0u64;
        let mut idle = T;
        loop {
            let n = ep.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, idle).unwrap_or_else(|e| fail("receiving", e));
            if n == 0 {
                break;
            }
            idle = Duration::from_secs(2);
            for wc in &wcs[..n] {
                let i = wc.wr_id() as usize;
                if wc.is_ok() {
                    got += 1;
                }
                ep.qp_mut()
                    .post_recv(&[RecvWr::new(&bufs[i], 0..slot).wr_id(i as u64)])
                    .unwrap_or_else(|e| fail("reposting", e));
            }
        }
        println!("received {got} datagrams");
        return;
    }
    // Ping-pong: answer each datagram; the first one names the client.
    let send =
        MemoryRegion::new(&pd, a.size.max(1), AccessFlags::LOCAL_WRITE).unwrap_or_else(|e| fail("registering", e));
    let mut dest: Option<UdDest> = None;
    for k in 0..(a.iters + WARMUP) as u64 {
        let wc = ep.qp_mut().wait_for(WorkQueue::Recv, 0, T).unwrap_or_else(|e| fail("receiving", e));
        if dest.is_none() {
            let d = Datagram::parse(&wc, &mut bufs[0], 0).unwrap_or_else(|e| fail("reading the datagram", e));
            dest = Some(UdDest::reply_to(ep.qp(), &d, ep.qp().qkey()).unwrap_or_else(|e| fail("reply AH", e)));
        }
        ep.qp_mut().post_recv(&[RecvWr::new(&bufs[0], 0..slot).wr_id(0)]).unwrap_or_else(|e| fail("reposting", e));
        let to = dest.as_ref().expect("set above");
        ep.qp_mut().post_send(&[UdSendWr::send(to, &send, 0..a.size).wr_id(k)]).unwrap_or_else(|e| fail("sending", e));
        ep.qp_mut().wait_for(WorkQueue::Send, k, T).unwrap_or_else(|e| fail("send completion", e));
    }
}

fn client(a: &Args, dst: SocketAddr) {
    let route = UdClient::new()
        .and_then(|c| c.resolve_addr(None, dst, T))
        .and_then(|r| r.resolve_route(T))
        .unwrap_or_else(|e| fail("resolving", e));
    let pd = route.alloc_pd().unwrap_or_else(|e| fail("ibv_alloc_pd", e));
    let mut ep = route.create_qp(&pd, init(a)).unwrap_or_else(|e| fail("creating the QP", e));
    let send =
        MemoryRegion::new(&pd, a.size.max(1), AccessFlags::LOCAL_WRITE).unwrap_or_else(|e| fail("registering", e));
    let bufs = recv_bufs(&ep, a, 1);
    let slot = a.size + GRH_LEN;
    if !a.bw {
        ep.qp_mut().post_recv(&[RecvWr::new(&bufs[0], 0..slot).wr_id(0)]).unwrap_or_else(|e| fail("posting", e));
    }
    let to = ep.connect(&[], T).unwrap_or_else(|e| fail("connecting", e));
    ep.qp_mut().set_busy_poll(a.busy_poll);
    let qp = ep.qp_mut();
    if a.bw {
        let n = a.iters;
        let mut wcs = [WorkCompletion::default(); 16];
        let (mut posted, mut done) = (0u32, 0u32);
        let start = Instant::now();
        while done < n {
            while posted < n && posted - done < TX_DEPTH {
                let mut wr = UdSendWr::send(&to, &send, 0..a.size).wr_id(posted as u64);
                if posted % SIGNAL_EVERY != SIGNAL_EVERY - 1 && posted != n - 1 {
                    wr = wr.unsignaled();
                }
                qp.post_send(&[wr]).unwrap_or_else(|e| fail("sending", e));
                posted += 1;
            }
            let k = qp.wait_queue(WorkQueue::Send, &mut wcs, T).unwrap_or_else(|e| fail("send completions", e));
            if k == 0 {
                fail("streaming", "no send completion within 30 s");
            }
            for wc in &wcs[..k] {
                done = wc.ok().unwrap_or_else(|e| fail("send", e)).wr_id() as u32 + 1;
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
    let mut rtts = Vec::with_capacity(a.iters as usize);
    let clock = common::Stopwatch::calibrate();
    for k in 0..(a.iters + WARMUP) as u64 {
        let start = clock.now();
        qp.post_send(&[UdSendWr::send(&to, &send, 0..a.size).wr_id(k)]).unwrap_or_else(|e| fail("sending", e));
        qp.wait_for(WorkQueue::Recv, 0, T).unwrap_or_else(|e| fail("receiving the answer", e));
        let rtt = clock.since(start);
        // The next receive goes up before the next send, so the answer always has one.
        qp.post_recv(&[RecvWr::new(&bufs[0], 0..slot).wr_id(0)]).unwrap_or_else(|e| fail("posting", e));
        qp.wait_for(WorkQueue::Send, k, T).unwrap_or_else(|e| fail("send completion", e));
        if k >= WARMUP as u64 {
            rtts.push(rtt);
        }
    }
    common::print_latency_table(a.size as u32, &mut rtts);
}
