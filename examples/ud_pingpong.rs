//! UD ping-pong over verbs alone, without the connection manager: rdma-core's
//! `ibv_ud_pingpong` (rdma-core 44), with its flags, its TCP exchange of
//! `LLLL:QQQQQQ:PPPPPP:GID` messages and its output, written with this crate's
//! [`UdQp::new`](rdma_cm::verbs::ud::UdQp::new) (a UD QP from a port and a Q_Key) on a
//! [`Lane`](rdma_cm::verbs::lane::Lane). It interoperates with `ibv_ud_pingpong` both ways.
//!
//! ```text
//! cargo run --example ud_pingpong -- -g 1                      # server (no host), TCP port 18515
//! cargo run --example ud_pingpong -- -g 1 10.77.0.1            # client
//! ibv_ud_pingpong -g 1 -n 100                                  # rdma-core's server ...
//! cargo run --example ud_pingpong -- -g 1 -n 100 10.77.0.1     # ... and this client
//! ```
//!
//! Flags, as `ibv_ud_pingpong`'s: `-p port` (18515), `-d device` (the first), `-i ib_port`
//! (1), `-s size` (2048; at most the port's active MTU: a datagram is one packet), `-r
//! rx_depth` (500), `-n iters` (1000), `-l sl` (0), `-e` (accepted; waits always sleep on the
//! CQ's channel), `-g gid_index` (needed on RoCE: on rxe usually 1), `-c` (the first byte of
//! every page sent is 0, from both sides; the server checks what it received last). Both sides need the same
//! `-s` and `-n`.
//!
//! What happens, as in `ibv_ud_pingpong`: each side creates a UD QP with Q_Key `0x11111111`
//! (INIT, RTR, RTS at once) and sends its address; the server makes its address handle for
//! the client and posts `rx_depth` receives of `size` + 40 bytes (the GRH) before it answers,
//! the client does the same once it has the answer, and sends first. (`ibv_ud_pingpong` posts
//! its receives first; here the lane takes the QP with its destination, and each receive moves
//! a buffer of its own into it, handed back by its completion.) Each side sends one datagram per
//! datagram received until it has sent and received `iters`. Every wait is bounded (60 s for
//! the exchange, 20 s without a completion: a lost datagram ends the run with that error,
//! where `ibv_ud_pingpong` would spin forever).

mod pingpong;

use clap::Parser;
use pingpong::{die, Args, OneQp};
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::Lane;
use rdma_cm::verbs::peer::PeerInfo;
use rdma_cm::verbs::ud::UdQp;
use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, QpInit};

/// `ibv_ud_pingpong`'s Q_Key.
const QKEY: u32 = 0x1111_1111;

fn main() {
    let args = Args::parse();
    let size = args.size.unwrap_or(2048);
    if size < 1 || args.rx_depth < 2 || args.iters < 1 {
        die("size, rx-depth (at least 2) and iters must be positive");
    }
    let listener = match args.host {
        None => Some(pingpong::listen(args.port).unwrap_or_else(|e| die(e))),
        Some(_) => None,
    };
    let ctx = pingpong::open_device(args.ib_dev.as_deref());
    let pd = ProtectionDomain::new(&ctx).unwrap_or_else(|e| die(format!("Couldn't allocate PD: {e}")));
    // The lane owns the CQ, and the QP once the peer's address handle is made; each receive
    // moves its own buffer into it, so there is one buffer per receive (and one more: the last
    // one received stays out).
    let lane = Lane::new(&ctx, args.rx_depth + 1).unwrap_or_else(|e| die(format!("Couldn't create CQ: {e}")));
    let init = lane.qp_init_from(QpInit::new().max_send_wr(1).max_recv_wr(args.rx_depth));
    let qp = UdQp::new(&pd, init, args.ib_port, QKEY).unwrap_or_else(|e| die(format!("Couldn't create QP: {e}")));
    if size > qp.mtu() {
        die(format!("Requested size larger than port MTU ({})", qp.mtu()));
    }
    let rlen = GRH_LEN + size as usize;
    let spare: Vec<MemoryRegion> = (0..=args.rx_depth)
        .map(|_| {
            MemoryRegion::new(&pd, rlen, AccessFlags::LOCAL_WRITE)
                .unwrap_or_else(|e| die(format!("Couldn't register MR: {e}")))
        })
        .collect();
    let mut smr = MemoryRegion::new(&pd, size as usize, AccessFlags::LOCAL_WRITE)
        .unwrap_or_else(|e| die(format!("Couldn't register MR: {e}")));
    {
        let s = smr.as_mut_slice().unwrap_or_else(|e| die(e));
        s.fill(0x7b);
        // -c: the first byte of every page is 0 in what the client sends and in what the server
        // sends back (rdma-core's server sends back the buffer it received into), and the server
        // checks what it received.
        if args.chk {
            for i in (0..s.len()).step_by(pingpong::page_size()) {
                s[i] = 0;
            }
        }
    }
    let me = qp.local(args.gid_idx).unwrap_or_else(|e| die(format!("Couldn't get port info: {e}")));
    pingpong::print_local(&me);

    // `reach` makes the address handle for the peer, hands the QP to the lane with it and posts
    // the receives: the server does it inside the exchange, before it answers, so its receives
    // are in place before the client can send; the client after, before it sends first.
    let mut slot = Some((qp, lane, spare));
    let mut one: Option<OneQp> = None;
    let reach = |peer: &PeerInfo| -> Result<(), String> {
        let (q, mut lane, spare) = slot.take().ok_or("reached twice")?;
        let dest = q.dest_to(peer, args.gid_idx, args.sl, QKEY).map_err(|e| format!("Failed to create AH: {e}"))?;
        let qp = lane.attach(q).map_err(|e| format!("Couldn't attach the QP to the lane: {e}"))?;
        let dest = lane.add_dest(qp, &dest).map_err(|e| format!("Failed to create AH: {e}"))?;
        let mut o = OneQp { lane, qp, dest: Some(dest), send: Some(smr), size: size as usize, spare };
        o.post_recvs(args.rx_depth as usize).map_err(|e| format!("Couldn't post receive: {e}"))?;
        one = Some(o);
        Ok(())
    };
    let peer = match (&args.host, listener) {
        (Some(host), _) => {
            let peer = pingpong::client_exchange(host, args.port, &[me]).unwrap_or_else(|e| die(e))[0];
            reach(&peer).unwrap_or_else(|e| die(e));
            peer
        }
        (None, Some(l)) => {
            pingpong::server_exchange(l, 1, |theirs| reach(&theirs[0]).map(|()| vec![me])).unwrap_or_else(|e| die(e))[0]
        }
        (None, None) => unreachable!("a server always has its listener"),
    };
    pingpong::print_remote(&peer);
    let mut one = one.unwrap_or_else(|| die("no address handle"));

    let routs = args.rx_depth;
    let (elapsed, last) = pingpong::run(
        &mut one,
        args.iters,
        args.rx_depth,
        routs,
        args.host.is_some(),
        "a datagram was lost, or the peer is gone",
    );
    pingpong::print_figures(size, args.iters, elapsed);
    // Dropping the lane flushes the receives still posted and releases their buffers.
    drop(one);
    if args.chk && args.host.is_none() {
        let mut rmr = last.unwrap_or_else(|| die("no datagram received"));
        let r = rmr.as_slice().unwrap_or_else(|e| die(e));
        for (page, i) in (0..size as usize).step_by(pingpong::page_size()).enumerate() {
            if r[GRH_LEN + i] != 0 {
                println!("invalid data in page {page}");
            }
        }
    }
}
