//! RC ping-pong on many QPs sharing one receive queue, over verbs alone: rdma-core's
//! `ibv_srq_pingpong` (rdma-core 44), with its flags, its TCP exchange (256
//! `LLLL:QQQQQQ:PPPPPP:GID` messages each way, whatever `-q` is: the unused ones are zeros) and
//! its output, written with this crate's [`UnconnectedQp`](rdma_cm::verbs::qp::UnconnectedQp) and a
//! [`Lane`](rdma_cm::verbs::lane::Lane) with its shared receive queue
//! ([`Lane::create_srq`](rdma_cm::verbs::lane::Lane::create_srq)). It interoperates with
//! `ibv_srq_pingpong` both ways.
//!
//! ```text
//! cargo run --example srq_pingpong -- -g 1                     # server (no host), TCP port 18515
//! cargo run --example srq_pingpong -- -g 1 10.77.0.1           # client
//! ibv_srq_pingpong -g 1 -n 100                                 # rdma-core's server ...
//! cargo run --example srq_pingpong -- -g 1 -n 100 10.77.0.1    # ... and this client
//! ```
//!
//! Flags, as `ibv_srq_pingpong`'s: `-p port` (18515), `-d device` (the first), `-i ib_port`
//! (1), `-s size` (4096), `-m mtu` (1024), `-q num_qp` (16, at most 256 and at most
//! `rx_depth`), `-r rx_depth` (500), `-n iters` (1000, in all, not per QP), `-l sl` (0), `-e`
//! (accepted; waits always sleep on the CQ's channel), `-g gid_index` (needed on RoCE: on rxe
//! usually 1). Both sides need the same `-s`, `-m`, `-q` and `-n`.
//!
//! What happens, as in `ibv_srq_pingpong`: each side creates `num_qp` RC QPs on one CQ and one
//! SRQ, posts `rx_depth` receives to the SRQ, and exchanges the QPs' addresses; the server
//! connects its QPs before it answers, the client after, and sends one message on every QP.
//! Each completion names its QP (`qp_num`); a QP sends again once its last send and a receive
//! for it have completed, until `iters` sends and receives in all. Every wait is bounded.

mod pingpong;

use std::time::Instant;

use clap::Parser;
use pingpong::{die, Args, IDLE_WAIT, RECV_WRID, SEND_WRID};
use rdma_cm::verbs::lane::{Lane, LaneQp, LaneSrq, RecvWr, SendWr};
use rdma_cm::verbs::peer::PeerInfo;
use rdma_cm::verbs::qp::{RcParams, UnconnectedQp};
use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, QpInit};

/// Messages each side sends, whatever `-q` is (`ibv_srq_pingpong`'s `MAX_QP`).
const MAX_QP: usize = 256;

fn main() {
    let args = Args::parse();
    let size = args.size.unwrap_or(4096);
    let num_qp = args.num_qp as usize;
    if size < 1 || args.iters < 1 || !(1..=MAX_QP).contains(&num_qp) {
        die(format!("size and iters must be positive, and num-qp 1..={MAX_QP}"));
    }
    if args.num_qp > args.rx_depth {
        die(format!(
            "rx_depth {} is too small for {} QPs -- must have at least one receive per QP.",
            args.rx_depth, args.num_qp
        ));
    }
    let listener = match args.host {
        None => Some(pingpong::listen(args.port).unwrap_or_else(|e| die(e))),
        Some(_) => None,
    };
    let ctx = pingpong::open_device(args.ib_dev.as_deref());
    let pd = ProtectionDomain::new(&ctx).unwrap_or_else(|e| die(format!("Couldn't allocate PD: {e}")));
    let mr = || {
        MemoryRegion::new(&pd, size as usize, AccessFlags::LOCAL_WRITE)
            .unwrap_or_else(|e| die(format!("Couldn't register MR: {e}")))
    };
    // The lane owns the CQ, the SRQ, and the QPs once connected. A receive or a send moves its
    // buffer into the lane until its completion hands it back: one buffer per receive, and one
    // message per QP (each QP may have its send in flight at once).
    let mut lane =
        Lane::new(&ctx, args.rx_depth + args.num_qp).unwrap_or_else(|e| die(format!("Couldn't create CQ: {e}")));
    let srq = lane.create_srq(&pd, args.rx_depth).unwrap_or_else(|e| die(format!("Couldn't create SRQ: {e}")));
    let mut spare: Vec<MemoryRegion> = (0..args.rx_depth).map(|_| mr()).collect();
    let mut sends: Vec<Option<MemoryRegion>> = (0..num_qp)
        .map(|_| {
            let mut m = mr();
            m.as_mut_slice().unwrap_or_else(|e| die(e)).fill(0);
            Some(m)
        })
        .collect();
    let mut params = RcParams::new().port(args.ib_port).mtu(args.mtu).sl(args.sl);
    if let Some(g) = args.gid_idx {
        params = params.gid_index(g);
    }
    let mut unconnected: Vec<UnconnectedQp> = (0..num_qp)
        .map(|i| {
            let init = lane
                .srq_qp_init(srq, QpInit::new().max_send_wr(1))
                .unwrap_or_else(|e| die(format!("Couldn't create QP[{i}]: {e}")));
            UnconnectedQp::new(&pd, init, params.clone())
                .unwrap_or_else(|e| die(format!("Couldn't create QP[{i}]: {e}")))
        })
        .collect();
    post_recvs(&mut lane, srq, &mut spare, args.rx_depth as usize)
        .unwrap_or_else(|e| die(format!("Couldn't post receive: {e}")));
    let mut routs = args.rx_depth;
    let mut mine = vec![PeerInfo::default(); MAX_QP];
    for (m, q) in mine.iter_mut().zip(&unconnected) {
        *m = q.local();
        pingpong::print_local(m);
    }

    // `connect` moves each QP to RTR and RTS and hands it to the lane: the server inside the
    // exchange, before it answers; the client after.
    let mut qps: Vec<LaneQp> = Vec::with_capacity(num_qp);
    let mut connect = |theirs: &[PeerInfo]| -> Result<(), String> {
        for (i, (q, peer)) in unconnected.drain(..).zip(theirs).enumerate() {
            let q = q.connect(peer).map_err(|e| format!("Couldn't connect QP[{i}] to its remote QP: {e}"))?;
            qps.push(lane.attach(q).map_err(|e| format!("Couldn't attach QP[{i}] to the lane: {e}"))?);
        }
        Ok(())
    };
    let theirs = match (&args.host, listener) {
        (Some(host), _) => {
            let theirs = pingpong::client_exchange(host, args.port, &mine).unwrap_or_else(|e| die(e));
            connect(&theirs).unwrap_or_else(|e| die(e));
            theirs
        }
        (None, Some(l)) => {
            let mine = mine.clone();
            pingpong::server_exchange(l, MAX_QP, |theirs| connect(theirs).map(|()| mine)).unwrap_or_else(|e| die(e))
        }
        (None, None) => unreachable!("a server always has its listener"),
    };
    for t in &theirs[..num_qp] {
        pingpong::print_remote(t);
    }

    let send = |lane: &mut Lane, i: usize, msg: &mut Option<MemoryRegion>| {
        let m = msg.take().unwrap_or_else(|| die(format!("QP[{i}]: its last send has not completed")));
        lane.post_send(qps[i], SendWr::send(m, 0..size as usize).wr_id(SEND_WRID))
            .unwrap_or_else(|e| die(format!("Couldn't post send: {e}")));
    };
    let mut pending = vec![RECV_WRID; num_qp];
    if args.host.is_some() {
        for (i, p) in pending.iter_mut().enumerate() {
            send(&mut lane, i, &mut sends[i]);
            *p |= SEND_WRID;
        }
    }
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    while rcnt < args.iters || scnt < args.iters {
        let mut c = match lane.wait(IDLE_WAIT) {
            Ok(c) => c,
            Err(rdma_cm::Error::Timeout { .. }) => die(format!(
                "no completion for {IDLE_WAIT:?} after {scnt} sends and {rcnt} receives: is the peer still running?"
            )),
            Err(e) => die(format!("poll CQ failed: {e}")),
        };
        if !c.is_ok() {
            die(format!("Failed status {} ({}) for wr_id {}", c.status(), c.status().to_raw(), c.wr_id()));
        }
        // The completion names its QP, the SRQ's receives included.
        let Some(i) = c.qp().and_then(|q| qps.iter().position(|&p| p == q)) else {
            die(format!("Couldn't find QPN {:06x}", c.qp_num()))
        };
        match c.wr_id() {
            SEND_WRID => {
                sends[i] = c.take_region();
                scnt += 1;
            }
            RECV_WRID => {
                spare.extend(c.take_region());
                routs -= 1;
                if routs <= args.num_qp {
                    let more = (args.rx_depth - routs) as usize;
                    post_recvs(&mut lane, srq, &mut spare, more)
                        .unwrap_or_else(|e| die(format!("Couldn't post receive ({routs}): {e}")));
                    routs += more as u32;
                }
                rcnt += 1;
            }
            other => die(format!("Completion for unknown wr_id {other}")),
        }
        pending[i] &= !c.wr_id();
        if scnt < args.iters && pending[i] == 0 {
            send(&mut lane, i, &mut sends[i]);
            pending[i] = RECV_WRID | SEND_WRID;
        }
    }
    pingpong::print_figures(size, args.iters, start.elapsed());
}

/// Posts `n` receives to the SRQ, each on a buffer of `spare`.
fn post_recvs(lane: &mut Lane, srq: LaneSrq, spare: &mut Vec<MemoryRegion>, n: usize) -> Result<(), String> {
    for _ in 0..n {
        let mr = spare.pop().ok_or("no receive buffer left to post")?;
        lane.post_srq_recv(srq, RecvWr::new(mr).wr_id(RECV_WRID)).map_err(|e| e.to_string())?;
    }
    Ok(())
}
