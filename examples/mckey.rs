//! Multicast over rdma_cm: rdma-core's `mckey` (rdma-core 44), with the same flags, the same
//! output and the same wire behaviour, written with this crate. It receives from `mckey -s`
//! and sends to `mckey` receivers.
//!
//! ```text
//! cargo run --example mckey -- -m 239.1.1.1 -b 10.77.0.1                  # receiver
//! cargo run --example mckey -- -m 239.1.1.1 -b 10.77.0.1 -s -C 10 -S 100  # sender
//! ```
//!
//! Flags: `-m multicast_address`, `-s` (sender), `-b bind_address`, `-c connections` (1),
//! `-C message_count` (10), `-S message_size` (100), `-p port_space` (0x111 UDP, 0x2 IPoIB),
//! `-o` (join as a send-only full member), `-l` (join without multicast loopback), `-M
//! unmapped_multicast_address` (an AF_IB address: refused with a clear line, as this crate's ids
//! take IP addresses). Two more, not in `mckey`: `--verify` fills every message with a pattern
//! and checks it at the receiver (use it when both ends are this example), and `--settle
//! SECONDS` (3, as `mckey`'s fixed pause) is how long a sender waits after joining before it
//! sends, for a subnet manager to program the switches; on RoCE nothing needs it.
//!
//! What happens, as in `mckey`: each id resolves the group's address (from `-b`), creates a UD
//! QP, posts `message_count` receives of `message_size` + 40 bytes (receivers only) and joins
//! the group; the `MULTICAST_JOIN` event gives the group's address, QPN 0xFFFFFF and QKey
//! (`mckey: joined dgid: ...`). A sender sends `message_count` datagrams (send with immediate:
//! its QP number); a receiver waits for `message_count` of them on each id and checks each one:
//! `message_size` bytes, sent to the group, immediate data equal to the sender's QP number. Then
//! every id leaves the group (the memberships are dropped). Unlike `mckey`, every wait is
//! bounded (30 s), and a message over the port's active MTU is refused before joining.

mod common;

use std::net::IpAddr;
use std::process::exit;
use std::sync::Arc;
use std::time::Duration;

use rdma_cm::cm::multicast::{JoinKind, McastClient, Multicast};
use rdma_cm::cm::ud_cm::PortSpace;
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{DestKey, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::verbs::ud::Datagram;
use rdma_cm::{AccessFlags, EventChannel, MemoryRegion, ProtectionDomain, QpInit};

const WAIT: Duration = Duration::from_secs(30);

struct Args {
    group: Option<String>,
    unmapped: bool,
    sender: bool,
    bind: Option<String>,
    connections: usize,
    count: usize,
    size: usize,
    ps: PortSpace,
    send_only: bool,
    loopback: bool,
    verify: bool,
    settle: Duration,
}

fn usage(prog: &str) -> ! {
    println!("usage: {prog}");
    println!("\t-m multicast_address");
    println!("\t[-M unmapped_multicast_address]\n\t replaces -m and requires -b");
    println!("\t[-s(ender)]");
    println!("\t[-b bind_address]");
    println!("\t[-c connections]");
    println!("\t[-C message_count]");
    println!("\t[-S message_size]");
    println!("\t[-p port_space - 0x111 for UDP (default), 0x2 for IPOIB]");
    println!("\t[-o join as a send-only full-member]");
    println!("\t[-l join without multicast loopback]");
    println!("\t[--verify]  check a pattern in every message (both ends this example)");
    println!("\t[--settle seconds]  pause after joining before sending (3)");
    exit(1);
}

fn parse() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let prog = argv.first().cloned().unwrap_or_else(|| "mckey".into());
    let mut a = Args {
        group: None,
        unmapped: false,
        sender: false,
        bind: None,
        connections: 1,
        count: 10,
        size: 100,
        ps: PortSpace::Udp,
        send_only: false,
        loopback: true,
        verify: false,
        settle: Duration::from_secs(3),
    };
    let mut it = argv.iter().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "-s" => a.sender = true,
            "-o" => a.send_only = true,
            "-l" => a.loopback = false,
            "--verify" => a.verify = true,
            _ => {
                let v = it.next().cloned().unwrap_or_else(|| usage(&prog));
                let n = || common::c_number(&v).unwrap_or_else(|| usage(&prog));
                match flag.as_str() {
                    "-m" => a.group = Some(v.clone()),
                    "-M" => {
                        a.unmapped = true;
                        a.group = Some(v.clone());
                    }
                    "-b" => a.bind = Some(v.clone()),
                    "-c" => a.connections = n().max(1) as usize,
                    "-C" => a.count = n() as usize,
                    "-S" => a.size = n() as usize,
                    "-p" => a.ps = PortSpace::from_raw(n() as u32).unwrap_or_else(|e| fail(&format!("mckey: {e}"))),
                    "--settle" => a.settle = Duration::from_secs(n()),
                    _ => usage(&prog),
                }
            }
        }
    }
    if a.unmapped && a.bind.is_none() {
        println!("unmapped multicast address requires binding to source address");
        exit(1);
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

fn ip(host: &str) -> IpAddr {
    match rdma_cm::lookup(host, "0") {
        Ok(v) if !v.is_empty() => v[0].ip(),
        Ok(_) => fail(&format!("getaddrinfo failed (no address for {host}) - invalid hostname or IP address")),
        Err(e) => fail(&format!("getaddrinfo failed ({e}) - invalid hostname or IP address")),
    }
}

/// The byte at `i` of every message under `--verify`.
fn pattern(i: usize) -> u8 {
    (i as u32).wrapping_mul(131).wrapping_add(7) as u8
}

/// One id's resources: the membership, the lane (the CQ and the endpoint's QP), the key of the
/// group's destination on the lane, and the send buffers not posted (a send moves its buffer
/// into the lane; its completion hands it back). The receive buffers (`message_size` + 40
/// bytes each) are in the lane, posted.
struct Node {
    // Dropped first: leaves the group (the endpoint's QP may go before or after; see
    // rdma_cm::cm::multicast).
    mc: Option<Multicast>,
    lane: Lane,
    qp: LaneQp,
    to_group: DestKey,
    qp_num: u32,
    group: IpAddr,
    send: Vec<MemoryRegion>,
}

/// The receive buffers (receivers only) and the send buffers, one per send the queue holds.
fn buffers(pd: &Arc<ProtectionDomain>, a: &Args) -> rdma_cm::Result<(Vec<MemoryRegion>, Vec<MemoryRegion>)> {
    let receives = if a.sender { 0 } else { a.count };
    let recv = (0..receives)
        .map(|_| MemoryRegion::new(pd, a.size + GRH_LEN, AccessFlags::LOCAL_WRITE))
        .collect::<rdma_cm::Result<Vec<_>>>()?;
    let mut send = Vec::with_capacity(a.count);
    for _ in 0..a.count.max(1) {
        let mut m = MemoryRegion::new(pd, a.size.max(1), AccessFlags::LOCAL_WRITE)?;
        for (i, b) in m.as_mut_slice()?.iter_mut().enumerate() {
            *b = pattern(i);
        }
        send.push(m);
    }
    Ok((recv, send))
}

/// Sends `count` datagrams to the group (imm: our QP number, as `mckey`), each signaled, and
/// reaps their completions, each of which hands its buffer back for the next send.
fn post_sends(node: &mut Node, a: &Args) {
    let mut posted = 0;
    let mut done = 0;
    while done < a.count {
        while posted < a.count {
            let Some(buf) = node.send.pop() else { break };
            let wr = SendWr::send(buf, 0..a.size).to(node.to_group).imm(node.qp_num).wr_id(posted as u64);
            if let Err(e) = node.lane.post_send(node.qp, wr) {
                fail(&format!("failed to post sends: {e}"));
            }
            posted += 1;
        }
        let mut c = match node.lane.wait(WAIT) {
            Ok(c) => c,
            Err(rdma_cm::Error::Timeout { .. }) => {
                fail(&format!("mckey: no send completion within {WAIT:?} ({done} of {} done)", a.count))
            }
            Err(e) => fail(&format!("mckey: failed polling CQ: {e}")),
        };
        if !c.is_ok() {
            fail(&format!("mckey: send failed: {}", c.status()));
        }
        node.send.extend(c.take_region());
        done += 1;
    }
}

/// Reaps `count` receives and checks each datagram; under `--verify`, its bytes too. Returns
/// how many were checked.
fn poll_recvs(node: &mut Node, a: &Args) -> usize {
    let group = node.group;
    for done in 0..a.count {
        let mut c = match node.lane.wait(WAIT) {
            Ok(c) => c,
            Err(rdma_cm::Error::Timeout { .. }) => {
                fail(&format!("mckey: no datagram within {WAIT:?} ({done} of {} received)", a.count))
            }
            Err(e) => fail(&format!("mckey: failed polling CQ: {e}")),
        };
        let Some(mut buf) = c.take_region() else { continue };
        let d = Datagram::parse(&c, &mut buf, 0).unwrap_or_else(|e| fail(&format!("mckey: bad datagram: {e}")));
        if d.len() != a.size {
            fail(&format!("mckey: datagram {} has {} bytes, not {}", c.wr_id(), d.len(), a.size));
        }
        if d.imm_data() != Some(d.src_qp()) {
            fail(&format!(
                "mckey: datagram {} carries immediate data {:?}, not its sender's QP number {}",
                c.wr_id(),
                d.imm_data(),
                d.src_qp()
            ));
        }
        let to = d.grh().and_then(|g| g.dgid());
        let to_group = match (to, group) {
            (Some(g), IpAddr::V4(v4)) => g.ipv4() == Some(v4),
            (Some(g), IpAddr::V6(v6)) => g.to_ipv6() == v6,
            (None, _) => false,
        };
        if !to_group {
            fail(&format!("mckey: datagram {} was not sent to the group {group} ({to:?})", c.wr_id()));
        }
        if a.verify {
            let bytes = buf.as_slice().unwrap_or_else(|e| fail(&format!("mckey: receive buffer: {e}")));
            if bytes[d.payload()].iter().enumerate().any(|(i, b)| *b != pattern(i)) {
                fail(&format!("mckey: datagram {} has the wrong bytes", c.wr_id()));
            }
        }
    }
    a.count
}

fn main() {
    let a = parse();
    println!("mckey: starting {}", if a.sender { "client" } else { "server" });
    let Some(group) = a.group.as_deref() else {
        fail("mckey: give the group with -m multicast_address");
    };
    if a.unmapped {
        fail("mckey: -M (an unmapped AF_IB address, InfiniBand only) is not supported by this example: use -m with an IP group");
    }
    let group = ip(group);
    let src = a.bind.as_deref().map(ip);
    println!("mckey: joining");
    let ch = EventChannel::new().unwrap_or_else(|e| fail(&format!("mckey: {e}")));
    let kind = if a.send_only { JoinKind::SendOnlyFullMember } else { JoinKind::FullMember };
    let mut nodes = Vec::with_capacity(a.connections);
    for _ in 0..a.connections {
        let c = McastClient::on_channel(&ch, a.ps).unwrap_or_else(|e| fail(&format!("mckey: {e}")));
        let r = c
            .resolve(src, group, Duration::from_millis(2000))
            .unwrap_or_else(|e| fail(&format!("mckey: resolve addr failure: {e}")));
        let mtu = r.mtu().unwrap_or_else(|e| fail(&format!("mckey: {e}")));
        if a.count > 0 && a.size > mtu as usize {
            fail(&format!("mckey: message_size {} is larger than active mtu {mtu}", a.size));
        }
        let pd = r.alloc_pd().unwrap_or_else(|e| fail(&format!("mckey: unable to allocate PD: {e}")));
        let (recv, send) = buffers(&pd, &a).unwrap_or_else(|e| fail(&format!("mckey: failed to create messages: {e}")));
        let n = a.count.max(1) as u32;
        let ctx = r.context().unwrap_or_else(|e| fail(&format!("mckey: {e}")));
        let mut lane = Lane::new(&ctx, 2 * n).unwrap_or_else(|e| fail(&format!("mckey: unable to create CQ: {e}")));
        let ep = r
            .loopback(a.loopback)
            .create_qp(&pd, lane.qp_init_from(QpInit::new().max_send_wr(n).max_recv_wr(n)))
            .unwrap_or_else(|e| fail(&format!("mckey: unable to create QP: {e}")));
        let (qp_num, group) = (ep.qp().qp_num(), ep.group());
        let qp = lane.attach(ep).unwrap_or_else(|e| fail(&format!("mckey: unable to create QP: {e}")));
        // Receives first, so the group's first datagrams have somewhere to land.
        for (i, b) in recv.into_iter().enumerate() {
            if let Err(e) = lane.post_recv(qp, RecvWr::new(b).wr_id(i as u64)) {
                fail(&format!("failed to post receives: {e}"));
            }
        }
        let (mc, to_group) = Multicast::join_on(&mut lane, qp, group, kind, WAIT).unwrap_or_else(|e| match &e {
            rdma_cm::Error::UnexpectedEvent { got, status, .. } => {
                println!("mckey: event: RDMA_CM_EVENT_{got}, error: {status}");
                fail(&format!("mckey: {e}"))
            }
            _ => fail(&format!("mckey: failure joining: {e}")),
        });
        let attr = *mc.dest().ah().attr();
        println!("mckey: joined dgid: {} mlid 0x{:x} sl {}", attr.dgid().to_ipv6(), attr.dlid(), attr.sl());
        nodes.push(Node { mc: Some(mc), lane, qp, to_group, qp_num, group, send });
    }
    if a.count > 0 {
        if a.sender {
            std::thread::sleep(a.settle);
            println!("initiating data transfers");
            for n in &mut nodes {
                post_sends(n, &a);
            }
        } else {
            println!("receiving data transfers");
            let checked: usize = nodes.iter_mut().map(|n| poll_recvs(n, &a)).sum();
            println!(
                "mckey: {checked} datagrams checked: {} bytes each, sent to the group, immediate data = the sender's QP number{}",
                a.size,
                if a.verify { ", every byte" } else { "" }
            );
        }
        println!("data transfers complete");
    }
    let mut status = 0;
    for n in &mut nodes {
        if let Some(mc) = n.mc.take() {
            if let Err(e) = mc.leave() {
                println!("mckey: failure leaving: {e}");
                status = -1;
            }
        }
    }
    println!("test complete");
    drop(nodes);
    println!("return status {status}");
    if status != 0 {
        exit(1);
    }
}
