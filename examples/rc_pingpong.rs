//! RC ping-pong over verbs alone, without the connection manager: rdma-core's
//! `ibv_rc_pingpong` (rdma-core 44), with its flags, its TCP exchange of `LLLL:QQQQQQ:PPPPPP:GID`
//! messages and its output, written with this crate's [`UnconnectedQp`] and its
//! [`Lane`](rdma_cm::verbs::lane::Lane). It interoperates with `ibv_rc_pingpong` both ways.
//!
//! ```text
//! cargo run --example rc_pingpong -- -g 1                      # server (no host), TCP port 18515
//! cargo run --example rc_pingpong -- -g 1 10.77.0.1            # client
//! ibv_rc_pingpong -g 1 -n 100                                  # rdma-core's server ...
//! cargo run --example rc_pingpong -- -g 1 -n 100 10.77.0.1     # ... and this client
//! ```
//!
//! Flags, as `ibv_rc_pingpong`'s: `-p port` (18515), `-d device` (the first), `-i ib_port`
//! (1), `-s size` (4096), `-m mtu` (1024), `-r rx_depth` (500), `-n iters` (1000), `-l sl`
//! (0), `-e` (accepted; waits always sleep on the CQ's channel), `-g gid_index` (needed on
//! RoCE: on rxe the IPv4-mapped GID, usually 1; see `ibv_devinfo -v`), `-c` (the first byte of
//! every page sent is 0, from both sides, since rdma-core's server sends back the buffer it
//! received into; the server checks what it received last and prints `invalid data in page N`
//! for each page whose first byte is not). Both sides need the same `-s`, `-m` and `-n`.
//!
//! What happens, as in `ibv_rc_pingpong`: each side creates an RC QP, moves it to INIT and
//! sends its address (LID, QP number, a random PSN, the GID of `-g`); the server connects its
//! QP (RTR, RTS) with the client's and posts `rx_depth` receives before it answers, the client
//! does the same once it has the answer, and sends first. (`ibv_rc_pingpong` posts its
//! receives in INIT; here the lane takes the QP once connected, and each receive moves a
//! buffer of its own into it, handed back by its completion.) Each side then sends one message per message received
//! until it has sent and received `iters`, and prints the rate. Unlike `ibv_rc_pingpong`, every
//! wait is bounded (60 s for the exchange, 20 s without a completion), and the peer's message
//! is checked before any of it is used.

mod pingpong;

use clap::Parser;
use pingpong::{die, Args, OneQp};
use rdma_cm::verbs::lane::Lane;
use rdma_cm::verbs::peer::PeerInfo;
use rdma_cm::verbs::qp::{RcParams, UnconnectedQp};
use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, QpInit};

fn main() {
    let args = Args::parse();
    let size = args.size.unwrap_or(4096);
    if size < 1 || args.rx_depth < 2 || args.iters < 1 {
        die("size, rx-depth (at least 2) and iters must be positive");
    }
    let listener = match args.host {
        None => Some(pingpong::listen(args.port).unwrap_or_else(|e| die(e))),
        Some(_) => None,
    };
    let ctx = pingpong::open_device(args.ib_dev.as_deref());
    let pd = ProtectionDomain::new(&ctx).unwrap_or_else(|e| die(format!("Couldn't allocate PD: {e}")));
    // The lane owns the CQ, and the QP once it is connected; each receive moves its own buffer
    // into it, so there is one buffer per receive (and one more: the last one received stays out).
    let lane = Lane::new(&ctx, args.rx_depth + 1).unwrap_or_else(|e| die(format!("Couldn't create CQ: {e}")));
    let spare: Vec<MemoryRegion> = (0..=args.rx_depth)
        .map(|_| {
            MemoryRegion::new(&pd, size as usize, AccessFlags::LOCAL_WRITE)
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
    let mut params = RcParams::new().port(args.ib_port).mtu(args.mtu).sl(args.sl);
    if let Some(g) = args.gid_idx {
        params = params.gid_index(g);
    }
    let init = lane.qp_init_from(QpInit::new().max_send_wr(1).max_recv_wr(args.rx_depth));
    let qp = UnconnectedQp::new(&pd, init, params).unwrap_or_else(|e| die(format!("Couldn't create QP: {e}")));
    let me = qp.local();
    pingpong::print_local(&me);

    // `connect` moves the QP to RTR and RTS, hands it to the lane and posts the receives: the
    // server does it inside the exchange, before it answers, so its receives are in place
    // before the client can send; the client after, before it sends first.
    let mut slot = Some((qp, lane, spare));
    let mut one: Option<OneQp> = None;
    let connect = |peer: &PeerInfo| -> Result<(), String> {
        let (q, mut lane, spare) = slot.take().ok_or("connected twice")?;
        let q = q.connect(peer).map_err(|e| format!("Couldn't connect to remote QP: {e}"))?;
        let qp = lane.attach(q).map_err(|e| format!("Couldn't attach the QP to the lane: {e}"))?;
        let mut o = OneQp { lane, qp, dest: None, send: Some(smr), size: size as usize, spare };
        o.post_recvs(args.rx_depth as usize).map_err(|e| format!("Couldn't post receive: {e}"))?;
        one = Some(o);
        Ok(())
    };
    let peer = match (&args.host, listener) {
        (Some(host), _) => {
            let peer = pingpong::client_exchange(host, args.port, &[me]).unwrap_or_else(|e| die(e))[0];
            connect(&peer).unwrap_or_else(|e| die(e));
            peer
        }
        (None, Some(l)) => pingpong::server_exchange(l, 1, |theirs| connect(&theirs[0]).map(|()| vec![me]))
            .unwrap_or_else(|e| die(e))[0],
        (None, None) => unreachable!("a server always has its listener"),
    };
    pingpong::print_remote(&peer);
    let mut one = one.unwrap_or_else(|| die("not connected"));

    let routs = args.rx_depth;
    let (elapsed, last) =
        pingpong::run(&mut one, args.iters, args.rx_depth, routs, args.host.is_some(), "is the peer still running?");
    pingpong::print_figures(size, args.iters, elapsed);
    // Dropping the lane flushes the receives still posted and releases their buffers.
    drop(one);
    if args.chk && args.host.is_none() {
        let mut rmr = last.unwrap_or_else(|| die("no message received"));
        let r = rmr.as_slice().unwrap_or_else(|e| die(e));
        for (page, i) in (0..r.len()).step_by(pingpong::page_size()).enumerate() {
            if r[i] != 0 {
                println!("invalid data in page {page}");
            }
        }
    }
}
