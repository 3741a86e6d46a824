//! Unreliable-datagram ping over rdma_cm: rdma-core's `udaddy` (rdma-core 44), with the same
//! flags, the same output and the same wire behaviour, written with this crate. It
//! interoperates with `udaddy` both ways.
//!
//! ```text
//! cargo run --example udaddy                                   # server, on port 7174 of every device
//! cargo run --example udaddy -- -s 10.77.0.1 -C 10 -S 100      # client
//! ```
//!
//! Flags: `-s server_address` (client mode), `-b bind_address`, `-c connections` (1),
//! `-C message_count` (10), `-S message_size` (100), `-p port_space` (0x111 UDP, 0x2 IPoIB),
//! `-t type_of_service`. One more, not in `udaddy`: `--verify` fills every message with a
//! pattern and checks it at the other end (and, on the client, the echo): use it when both
//! ends are this example.
//!
//! What happens, as in `udaddy`: each client id resolves the server's address and route,
//! creates a UD QP, asks the server for its QP (`rdma_connect` on a UD id; the `ESTABLISHED`
//! event gives the server's QP number, QKey and address) and posts `message_count` receives of
//! `message_size` + 40 bytes (the GRH), before it sends anything the server would answer. The server creates a QP and posts receives for each
//! request and accepts it (the receives go to a shared receive queue of the connection's lane,
//! which the QP takes them from: the lane takes a UD server's QP only once accepted, and a
//! datagram that finds no receive is lost). The client then sends `message_count` datagrams (send with
//! immediate: its QP number), unsignaled; the server receives them, makes an address handle
//! from the first datagram's completion and GRH, and replies with `message_count` signaled
//! sends to the QP number in the immediate data; the client receives the replies. Unlike
//! `udaddy`, every wait is bounded (30 s; the server waits 120 s for each client), and a
//! message over the port's active MTU is refused before anything is sent.

mod common;

use std::net::SocketAddr;
use std::process::exit;
use std::sync::Arc;
use std::time::Duration;

use rdma_cm::cm::ud_cm::{PortSpace, UdClient, UdServer};
use rdma_cm::verbs::ah::{AddressHandle, GRH_LEN};
use rdma_cm::verbs::lane::{DestKey, Lane, LaneQp, RecvWr, Rejected, SendWr};
use rdma_cm::verbs::ud::{Datagram, UdDest};
use rdma_cm::{AccessFlags, EventChannel, MemoryRegion, ProtectionDomain, QpInit, WorkQueue};

const PORT: u16 = 7174;
const WAIT: Duration = Duration::from_secs(30);

struct Args {
    server: Option<String>,
    bind: Option<String>,
    connections: usize,
    count: usize,
    size: usize,
    ps: PortSpace,
    tos: Option<u8>,
    verify: bool,
}

fn usage(prog: &str) -> ! {
    println!("usage: {prog}");
    println!("\t[-s server_address]");
    println!("\t[-b bind_address]");
    println!("\t[-c connections]");
    println!("\t[-C message_count]");
    println!("\t[-S message_size]");
    println!("\t[-t type_of_service]");
    println!("\t[-p port_space - 0x111 for UDP (default), 0x2 for IPOIB]");
    println!("\t[--verify]  check a pattern in every message (both ends this example)");
    exit(1);
}

fn parse() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let prog = argv.first().cloned().unwrap_or_else(|| "udaddy".into());
    let mut a = Args {
        server: None,
        bind: None,
        connections: 1,
        count: 10,
        size: 100,
        ps: PortSpace::Udp,
        tos: None,
        verify: false,
    };
    let mut it = argv.iter().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--verify" {
            a.verify = true;
            continue;
        }
        let v = it.next().cloned().unwrap_or_else(|| usage(&prog));
        let n = || common::c_number(&v).unwrap_or_else(|| usage(&prog));
        match flag.as_str() {
            "-s" => a.server = Some(v.clone()),
            "-b" => a.bind = Some(v.clone()),
            "-c" => a.connections = n().max(1) as usize,
            "-C" => a.count = n() as usize,
            "-S" => a.size = n() as usize,
            "-t" => a.tos = Some(n() as u8),
            "-p" => a.ps = PortSpace::from_raw(n() as u32).unwrap_or_else(|e| fail(&format!("udaddy: {e}"))),
            _ => usage(&prog),
        }
    }
    if a.size == 0 {
        a.count = 0;
    }
    a
}

fn fail(msg: &str) -> ! {
    println!("{msg}");
    println!("test complete");
    println!("return status -1");
    exit(1)
}

fn addr(host: &str, port: u16) -> SocketAddr {
    match rdma_cm::lookup(host, &port.to_string()) {
        Ok(v) if !v.is_empty() => v[0],
        Ok(_) => fail(&format!("udaddy: getaddrinfo error: no address for {host}")),
        Err(e) => fail(&format!("udaddy: getaddrinfo error: {e}")),
    }
}

/// The byte at `i` of message `k` under `--verify`.
fn pattern(k: usize, i: usize) -> u8 {
    (i as u32).wrapping_mul(131).wrapping_add(k as u32 * 17 + 3) as u8
}

/// One connection's resources: its lane (the CQ and the endpoint's QP), the send buffers (one
/// per datagram: a send moves its buffer into the lane), and where replies go. The receive
/// buffers (`message_size` + 40 bytes each) are in the lane, posted.
struct Node {
    lane: Lane,
    qp: LaneQp,
    /// The QP's number, port, QKey and PD, for the reply's address handle and the immediate data.
    qp_num: u32,
    port: u8,
    qkey: u32,
    pd: Arc<ProtectionDomain>,
    send: Vec<MemoryRegion>,
    dest: Option<DestKey>,
}

fn qp_init(count: usize) -> QpInit {
    let n = count.max(1) as u32;
    QpInit::new().max_send_wr(n).max_recv_wr(n)
}

/// `count` receive buffers and as many send buffers (one, at least, for the QP's checks).
fn buffers(pd: &Arc<ProtectionDomain>, a: &Args) -> rdma_cm::Result<(Vec<MemoryRegion>, Vec<MemoryRegion>)> {
    let regions = |len| {
        (0..a.count).map(|_| MemoryRegion::new(pd, len, AccessFlags::LOCAL_WRITE)).collect::<rdma_cm::Result<Vec<_>>>()
    };
    Ok((regions(a.size + GRH_LEN)?, regions(a.size.max(1))?))
}

fn verify_mtu(mtu: u32, a: &Args) {
    if a.count > 0 && a.size > mtu as usize {
        fail(&format!("udaddy: message_size {} is larger than active mtu {mtu}", a.size));
    }
}

/// Posts a receive on each buffer, its `wr_id` its index, through `post` (the QP's receive
/// queue, or the SRQ).
fn post_recvs(post: &mut dyn FnMut(RecvWr) -> Result<(), Rejected<MemoryRegion>>, recv: Vec<MemoryRegion>) {
    for (i, b) in recv.into_iter().enumerate() {
        if let Err(e) = post(RecvWr::new(b).wr_id(i as u64)) {
            fail(&format!("failed to post receives: {e}"));
        }
    }
}

/// Sends `count` datagrams to the node's destination (imm: our QP number), as `udaddy`'s
/// post_sends: signaled on the server, unsignaled on the client (which does not wait for
/// them: the lane hands their buffers back whenever it retires them, and keeps them until then).
fn post_sends(node: &mut Node, a: &Args, signaled: bool) {
    let Some(dest) = node.dest else { return };
    for (k, mut buf) in std::mem::take(&mut node.send).into_iter().enumerate() {
        if a.verify {
            let bytes = buf.as_mut_slice().unwrap_or_else(|e| fail(&format!("udaddy: send buffer: {e}")));
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = pattern(0, i);
            }
        }
        let wr = SendWr::send(buf, 0..a.size).to(dest).imm(node.qp_num).wr_id(1000 + k as u64);
        let wr = if signaled { wr } else { wr.unsignaled() };
        if let Err(e) = node.lane.post_send(node.qp, wr) {
            fail(&format!("failed to post sends: {e}"));
        }
    }
}

/// Reaps `count` completions of `queue`, as `udaddy`'s poll_cqs; on the server the first
/// receive gives the reply address. Under `--verify` every received message is checked.
fn poll(node: &mut Node, a: &Args, queue: WorkQueue, reply: bool) -> usize {
    let mut verified = 0;
    let mut done = 0;
    while done < a.count {
        let mut c = match node.lane.wait(WAIT) {
            Ok(c) => c,
            Err(rdma_cm::Error::Timeout { .. }) => {
                fail(&format!("udaddy: no completion within {WAIT:?} ({done} of {} done)", a.count))
            }
            Err(e) => fail(&format!("udaddy: failed polling CQ: {e}")),
        };
        if !c.is_ok() {
            fail(&format!("udaddy: completion failed: {}", c.status()));
        }
        // The client's unsignaled sends come back too, when the lane retires them.
        if c.queue() != queue {
            continue;
        }
        done += 1;
        if queue != WorkQueue::Recv {
            continue;
        }
        let Some(mut buf) = c.take_region() else { continue };
        let d = Datagram::parse(&c, &mut buf, 0).unwrap_or_else(|e| fail(&format!("udaddy: bad datagram: {e}")));
        if reply && node.dest.is_none() {
            // udaddy answers the QP number in the immediate data (its own), with its QKey.
            let grh = d.grh().unwrap_or_else(|| fail("udaddy: failed to create reply AH: the datagram has no GRH"));
            let ah = AddressHandle::reply_to(&node.pd, node.port, &c, grh)
                .unwrap_or_else(|e| fail(&format!("udaddy: failed to create reply AH: {e}")));
            let dest = UdDest::new(ah, d.imm_data().unwrap_or(d.src_qp()), node.qkey);
            let key = node.lane.add_dest(node.qp, &dest);
            node.dest = Some(key.unwrap_or_else(|e| fail(&format!("udaddy: failed to create reply AH: {e}"))));
        }
        if a.verify {
            let bytes = buf.as_slice().unwrap_or_else(|e| fail(&format!("udaddy: receive buffer: {e}")));
            let p = &bytes[d.payload()];
            if p.len() != a.size || p.iter().enumerate().any(|(i, b)| *b != pattern(0, i)) {
                fail(&format!("udaddy: message {} has the wrong bytes ({} bytes)", c.wr_id(), p.len()));
            }
            verified += 1;
        }
    }
    verified
}

fn client(a: &Args, dst: SocketAddr) {
    println!("udaddy: starting client");
    let src = a.bind.as_deref().map(|b| addr(b, 0));
    println!("udaddy: connecting");
    let ch = EventChannel::new().unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
    let mut nodes = Vec::with_capacity(a.connections);
    for _ in 0..a.connections {
        let c = UdClient::on_channel(&ch, a.ps).unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
        let r = c.resolve_addr(src, dst, Duration::from_millis(2000)).unwrap_or_else(|e| event_fail(e));
        if let Some(tos) = a.tos {
            if let Err(e) = r.id().set_tos(tos) {
                println!("udaddy: set TOS option failed: {e}");
            }
        }
        let route = r.resolve_route(Duration::from_millis(2000)).unwrap_or_else(|e| event_fail(e));
        verify_mtu(route.mtu().unwrap_or_else(|e| fail(&format!("udaddy: {e}"))), a);
        let pd = route.alloc_pd().unwrap_or_else(|e| fail(&format!("udaddy: unable to allocate PD: {e}")));
        let (recv, send) = buffers(&pd, a).unwrap_or_else(|e| fail(&format!("udaddy: failed to create messages: {e}")));
        let ctx = route.context().unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
        let mut lane = Lane::new(&ctx, 2 * a.count.max(1) as u32)
            .unwrap_or_else(|e| fail(&format!("udaddy: unable to create CQ: {e}")));
        let mut ep = route
            .create_qp(&pd, lane.qp_init_from(qp_init(a.count)))
            .unwrap_or_else(|e| fail(&format!("udaddy: unable to create QP: {e}")));
        let dest = ep.connect(&[], WAIT).unwrap_or_else(|e| event_fail(e));
        // The server sends only once our datagrams reached it: receives posted now are in time.
        let (qp_num, port, qkey) = (ep.qp().qp_num(), ep.qp().port_num(), ep.qp().qkey());
        let qp = lane.attach(ep).unwrap_or_else(|e| fail(&format!("udaddy: unable to create QP: {e}")));
        post_recvs(&mut |w| lane.post_recv(qp, w), recv);
        let dest = lane.add_dest(qp, &dest).unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
        nodes.push(Node { lane, qp, qp_num, port, qkey, pd, send, dest: Some(dest) });
    }
    if a.count > 0 {
        println!("initiating data transfers");
        for n in &mut nodes {
            post_sends(n, a, false);
        }
        println!("receiving data transfers");
        let verified: usize = nodes.iter_mut().map(|n| poll(n, a, WorkQueue::Recv, false)).sum();
        if a.verify {
            println!("udaddy: {verified} messages verified");
        }
        println!("data transfers complete");
    }
    drop(nodes);
    println!("test complete");
    println!("return status 0");
}

/// Prints a failed CM step as `udaddy` prints the event (`udaddy: event: NAME, error: N`).
fn event_fail(e: rdma_cm::Error) -> ! {
    match &e {
        rdma_cm::Error::UnexpectedEvent { got, status, .. } => {
            println!("udaddy: event: RDMA_CM_EVENT_{got}, error: {status}");
            println!("udaddy: {e}");
            println!("test complete");
            println!("return status {status}");
            exit(1)
        }
        _ => fail(&format!("udaddy: {e}")),
    }
}

fn server(a: &Args) {
    println!("udaddy: starting server");
    let local = match a.bind.as_deref() {
        Some(b) => addr(b, PORT),
        None => SocketAddr::from(([0, 0, 0, 0], PORT)),
    };
    let ch = EventChannel::new().unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
    let srv = UdServer::on_channel(&ch, a.ps).unwrap_or_else(|e| fail(&format!("udaddy: listen request failed: {e}")));
    let l = srv.listen(local, 0).unwrap_or_else(|e| fail(&format!("udaddy: bind address failed: {e}")));
    let mut nodes = Vec::with_capacity(a.connections);
    for _ in 0..a.connections {
        let req = l.get_request(Duration::from_secs(120)).unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
        verify_mtu(req.mtu().unwrap_or_else(|e| fail(&format!("udaddy: {e}"))), a);
        let pd = req.alloc_pd().unwrap_or_else(|e| fail(&format!("udaddy: unable to allocate PD: {e}")));
        let (recv, send) = buffers(&pd, a).unwrap_or_else(|e| fail(&format!("udaddy: failed to create messages: {e}")));
        let ctx = req.context().unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
        let mut lane = Lane::new(&ctx, 2 * a.count.max(1) as u32)
            .unwrap_or_else(|e| fail(&format!("udaddy: unable to create CQ: {e}")));
        // The client sends the moment it has our answer, and a datagram that finds no receive
        // is dropped: the receives must be posted before the accept. The lane takes the QP only
        // once accepted (an endpoint), so they go to a shared receive queue the lane owns,
        // which the QP takes its receives from.
        let srq = lane
            .create_srq(&pd, a.count.max(1) as u32)
            .unwrap_or_else(|e| fail(&format!("udaddy: unable to create SRQ: {e}")));
        post_recvs(&mut |w| lane.post_srq_recv(srq, w), recv);
        let init = lane.srq_qp_init(srq, qp_init(a.count)).unwrap_or_else(|e| fail(&format!("udaddy: {e}")));
        let sq = req.create_qp(&pd, init).unwrap_or_else(|e| fail(&format!("udaddy: unable to create QP: {e}")));
        let ep = sq.accept(&[]).unwrap_or_else(|e| fail(&format!("udaddy: failure accepting: {e}")));
        let (qp_num, port, qkey) = (ep.qp().qp_num(), ep.qp().port_num(), ep.qp().qkey());
        let qp = lane.attach(ep).unwrap_or_else(|e| fail(&format!("udaddy: failure accepting: {e}")));
        nodes.push(Node { lane, qp, qp_num, port, qkey, pd, send, dest: None });
    }
    if a.count > 0 {
        println!("receiving data transfers");
        let verified: usize = nodes.iter_mut().map(|n| poll(n, a, WorkQueue::Recv, true)).sum();
        if a.verify {
            println!("udaddy: {verified} messages verified");
        }
        println!("sending replies");
        for n in &mut nodes {
            post_sends(n, a, true);
        }
        for n in &mut nodes {
            poll(n, a, WorkQueue::Send, false);
        }
        println!("data transfers complete");
    }
    drop(nodes);
    println!("test complete");
    println!("return status 0");
}

fn main() {
    let a = parse();
    match &a.server {
        Some(s) => client(&a, addr(s, PORT)),
        None => server(&a),
    }
}
