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
//! creates a UD QP, posts `message_count` receives of `message_size` + 40 bytes (the GRH) and
//! asks the server for its QP (`rdma_connect` on a UD id); the `ESTABLISHED` event gives the
//! server's QP number, QKey and address. The server creates a QP and posts receives for each
//! request and accepts it. The client then sends `message_count` datagrams (send with
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

use rdma_cm::{
    AccessFlags, Datagram, EventChannel, MemoryRegion, PortSpace, ProtectionDomain, QpInit, RecvWr, UdClient, UdDest,
    UdEndpoint, UdSendWr, UdServer, WorkCompletion, WorkQueue, GRH_LEN,
};

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

/// One connection's resources: the endpoint, its receive buffers (one region per posted
/// receive, each `message_size` + 40 bytes), the send buffer, and where replies go.
struct Node {
    ep: UdEndpoint,
    recv: Vec<MemoryRegion>,
    send: MemoryRegion,
    dest: Option<UdDest>,
}

fn qp_init(count: usize) -> QpInit {
    let n = count.max(1) as u32;
    QpInit::new().max_send_wr(n).max_recv_wr(n)
}

fn buffers(pd: &Arc<ProtectionDomain>, a: &Args) -> rdma_cm::Result<(Vec<MemoryRegion>, MemoryRegion)> {
    let slot = a.size + GRH_LEN;
    let recv = if a.count > 0 {
        MemoryRegion::new(pd, a.count * slot, AccessFlags::LOCAL_WRITE)?.split(slot)?
    } else {
        vec![]
    };
    let send = MemoryRegion::new(pd, a.size.max(1), AccessFlags::LOCAL_WRITE)?;
    Ok((recv, send))
}

fn verify_mtu(mtu: u32, a: &Args) {
    if a.count > 0 && a.size > mtu as usize {
        fail(&format!("udaddy: message_size {} is larger than active mtu {mtu}", a.size));
    }
}

fn post_recvs(post: &mut dyn FnMut(&[RecvWr<'_>]) -> rdma_cm::Result<()>, recv: &[MemoryRegion], size: usize) {
    for (i, b) in recv.iter().enumerate() {
        if let Err(e) = post(&[RecvWr::new(b, 0..size + GRH_LEN).wr_id(i as u64)]) {
            fail(&format!("failed to post receives: {e}"));
        }
    }
}

/// Sends `count` datagrams to the node's destination (imm: our QP number), as `udaddy`'s
/// post_sends: signaled on the server, unsignaled on the client.
fn post_sends(node: &mut Node, a: &Args, signaled: bool) {
    let Some(dest) = node.dest.clone() else { return };
    if a.verify {
        let bytes = node.send.as_mut_slice().unwrap_or_else(|e| fail(&format!("udaddy: send buffer: {e}")));
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = pattern(0, i);
        }
    }
    let qpn = node.ep.qp().qp_num();
    for k in 0..a.count {
        let wr = UdSendWr::send(&dest, &node.send, 0..a.size).imm(qpn).wr_id(1000 + k as u64);
        let wr = if signaled { wr } else { wr.unsignaled() };
        if let Err(e) = node.ep.qp_mut().post_send(&[wr]) {
            fail(&format!("failed to post sends: {e}"));
        }
    }
}

/// Reaps `count` completions of `queue`, as `udaddy`'s poll_cqs; on the server the first
/// receive gives the reply address. Under `--verify` every received message is checked.
fn poll(node: &mut Node, a: &Args, queue: WorkQueue, reply: bool) -> usize {
    let mut wcs = [WorkCompletion::default(); 8];
    let mut done = 0;
    let mut verified = 0;
    while done < a.count {
        let n = node
            .ep
            .qp_mut()
            .wait_queue(queue, &mut wcs, WAIT)
            .unwrap_or_else(|e| fail(&format!("udaddy: failed polling CQ: {e}")));
        if n == 0 {
            fail(&format!("udaddy: no completion within {WAIT:?} ({done} of {} done)", a.count));
        }
        for wc in &wcs[..n] {
            if !wc.is_ok() {
                fail(&format!("udaddy: completion failed: {}", wc.status()));
            }
            if queue != WorkQueue::Recv {
                continue;
            }
            let Some(buf) = node.recv.get_mut(wc.wr_id() as usize) else { continue };
            let d = Datagram::parse(wc, buf, 0).unwrap_or_else(|e| fail(&format!("udaddy: bad datagram: {e}")));
            if reply && node.dest.is_none() {
                // udaddy answers the QP number in the immediate data (its own), with its QKey.
                let qkey = node.ep.qp().qkey();
                let mut dest = UdDest::reply_to(node.ep.qp(), &d, qkey)
                    .unwrap_or_else(|e| fail(&format!("udaddy: failed to create reply AH: {e}")));
                if let Some(qpn) = d.imm_data() {
                    dest = UdDest::new(Arc::clone(dest.ah()), qpn, qkey);
                }
                node.dest = Some(dest);
            }
            if a.verify {
                let bytes = buf.as_slice().unwrap_or_else(|e| fail(&format!("udaddy: receive buffer: {e}")));
                let p = &bytes[d.payload()];
                if p.len() != a.size || p.iter().enumerate().any(|(i, b)| *b != pattern(0, i)) {
                    fail(&format!("udaddy: message {} has the wrong bytes ({} bytes)", wc.wr_id(), p.len()));
                }
                verified += 1;
            }
        }
        done += n;
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
        let mut ep = route
            .create_qp(&pd, qp_init(a.count))
            .unwrap_or_else(|e| fail(&format!("udaddy: unable to create QP: {e}")));
        post_recvs(&mut |w| ep.qp_mut().post_recv(w), &recv, a.size);
        let dest = ep.connect(&[], WAIT).unwrap_or_else(|e| event_fail(e));
        nodes.push(Node { ep, recv, send, dest: Some(dest) });
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
        let mut sq =
            req.create_qp(&pd, qp_init(a.count)).unwrap_or_else(|e| fail(&format!("udaddy: unable to create QP: {e}")));
        post_recvs(&mut |w| sq.post_recv(w), &recv, a.size);
        let ep = sq.accept(&[]).unwrap_or_else(|e| fail(&format!("udaddy: failure accepting: {e}")));
        nodes.push(Node { ep, recv, send, dest: None });
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
