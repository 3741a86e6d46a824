//! RC ping-pong on many QPs sharing one receive queue, over verbs alone: rdma-core's
//! `ibv_srq_pingpong` (rdma-core 44), with its flags, its TCP exchange (256
//! `LLLL:QQQQQQ:PPPPPP:GID` messages each way, whatever `-q` is: the unused ones are zeros) and
//! its output, written with this crate's [`UnconnectedQp`](rdma_cm::UnconnectedQp) and
//! [`SharedReceiveQueue`](rdma_cm::SharedReceiveQueue). It interoperates with
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

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use pingpong::{die, Args, IDLE_WAIT, RECV_WRID, SEND_WRID};
use rdma_cm::{
    AccessFlags, CompletionQueue, MemoryRegion, PeerInfo, ProtectionDomain, QpInit, QueuePair, RcParams, RecvWr,
    SendWr, SharedReceiveQueue, UnconnectedQp, WorkCompletion,
};

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
    let rmr = MemoryRegion::new(&pd, size as usize, AccessFlags::LOCAL_WRITE)
        .unwrap_or_else(|e| die(format!("Couldn't register MR: {e}")));
    let mut smr = MemoryRegion::new(&pd, size as usize, AccessFlags::LOCAL_WRITE)
        .unwrap_or_else(|e| die(format!("Couldn't register MR: {e}")));
    smr.as_mut_slice().unwrap_or_else(|e| die(e)).fill(0);
    let cq: Arc<CompletionQueue> = CompletionQueue::new(&ctx, args.rx_depth + args.num_qp)
        .unwrap_or_else(|e| die(format!("Couldn't create CQ: {e}")));
    let srq = SharedReceiveQueue::new(&pd, args.rx_depth).unwrap_or_else(|e| die(format!("Couldn't create SRQ: {e}")));
    let mut params = RcParams::new().port(args.ib_port).mtu(args.mtu).sl(args.sl);
    if let Some(g) = args.gid_idx {
        params = params.gid_index(g);
    }
    let mut unconnected: Vec<UnconnectedQp> = (0..num_qp)
        .map(|i| {
            let init = QpInit::new().max_send_wr(1).send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq)).srq(&srq);
            UnconnectedQp::new(&pd, init, params.clone())
                .unwrap_or_else(|e| die(format!("Couldn't create QP[{i}]: {e}")))
        })
        .collect();
    let recvs: Vec<RecvWr> = (0..args.rx_depth).map(|_| RecvWr::new(&rmr, 0..size as usize).wr_id(RECV_WRID)).collect();
    srq.post_recv(&recvs).unwrap_or_else(|e| die(format!("Couldn't post receive: {e}")));
    let mut routs = args.rx_depth;
    let mut mine = vec![PeerInfo::default(); MAX_QP];
    for (m, q) in mine.iter_mut().zip(&unconnected) {
        *m = q.local();
        pingpong::print_local(m);
    }

    let mut qps: Vec<QueuePair> = Vec::with_capacity(num_qp);
    let mut connect = |theirs: &[PeerInfo]| -> Result<(), String> {
        for (i, (q, peer)) in unconnected.drain(..).zip(theirs).enumerate() {
            qps.push(q.connect(peer).map_err(|e| format!("Couldn't connect QP[{i}] to its remote QP: {e}"))?);
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

    let send = [SendWr::send(&smr, 0..size as usize).wr_id(SEND_WRID)];
    let mut pending = vec![RECV_WRID; num_qp];
    if args.host.is_some() {
        for (q, p) in qps.iter_mut().zip(&mut pending) {
            q.post_send(&send).unwrap_or_else(|e| die(format!("Couldn't post send: {e}")));
            *p |= SEND_WRID;
        }
    }
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut wcs = vec![WorkCompletion::default(); num_qp + args.rx_depth as usize];
    while rcnt < args.iters || scnt < args.iters {
        let n = cq.wait(&mut wcs, IDLE_WAIT).unwrap_or_else(|e| die(format!("poll CQ failed: {e}")));
        if n == 0 {
            die(format!(
                "no completion for {IDLE_WAIT:?} after {scnt} sends and {rcnt} receives: is the peer still running?"
            ));
        }
        for wc in &wcs[..n] {
            if !wc.is_ok() {
                die(format!("Failed status {} ({}) for wr_id {}", wc.status(), wc.status().to_raw(), wc.wr_id()));
            }
            let Some(i) = qps.iter().position(|q| q.qp_num() == wc.qp_num()) else {
                die(format!("Couldn't find QPN {:06x}", wc.qp_num()))
            };
            match wc.wr_id() {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    routs -= 1;
                    if routs <= args.num_qp {
                        let more = (args.rx_depth - routs) as usize;
                        srq.post_recv(&recvs[..more])
                            .unwrap_or_else(|e| die(format!("Couldn't post receive ({routs}): {e}")));
                        routs += more as u32;
                    }
                    rcnt += 1;
                }
                other => die(format!("Completion for unknown wr_id {other}")),
            }
            pending[i] &= !wc.wr_id();
            if scnt < args.iters && pending[i] == 0 {
                qps[i].post_send(&send).unwrap_or_else(|e| die(format!("Couldn't post send: {e}")));
                pending[i] = RECV_WRID | SEND_WRID;
            }
        }
    }
    pingpong::print_figures(size, args.iters, start.elapsed());
}
