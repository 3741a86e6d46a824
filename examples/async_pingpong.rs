//! Async ping-pong on tokio: a server and a client in one process, each on its own thread with
//! its own current-thread runtime (as the synchronous server and client run in two processes),
//! both awaiting the CM channels and their lanes' completions (`Lane::wait_async`) through
//! tokio's reactor. With
//! `--iters N > 1` the client prints the same latency table as the synchronous client
//! (perftest's `ib_send_lat` format), so the two compare line by line; `--same-thread` runs
//! both tasks on one runtime thread instead.
//!
//! ```text
//! cargo run --example async_pingpong --features tokio                    # in the guest without a device
//! cargo run --example async_pingpong --features tokio -- -a 10.0.0.1 --iters 1000 --size 4096
//! cargo run --example async_pingpong --features tokio -- --size 2 --iters 3000   # next to `client --size 2`
//! ```
//!
//! Without `-a` it uses the first address the doctor finds usable (a RoCE v2 GID's IPv4).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Parser;
use rdma_cm::verbs::lane::{Completion, Lane, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion, QpInit, Server, WorkQueue};

#[derive(Parser, Debug)]
#[command(about = "async RDMA ping-pong (server and client in one process)")]
struct Args {
    /// Address of the RDMA device (default: the first usable one).
    #[arg(short = 'a', long = "addr")]
    addr: Option<IpAddr>,
    /// Port.
    #[arg(short = 'p', long = "port", default_value_t = 7480)]
    port: u16,
    /// Message size.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Round trips.
    #[arg(long, default_value_t = 100)]
    iters: u64,
    /// Run the server and client tasks on one runtime thread instead of one thread each.
    #[arg(long)]
    same_thread: bool,
}

/// Bounds every await of the example: nothing waits forever.
const T: Duration = Duration::from_secs(10);

async fn bounded<F: std::future::Future<Output = rdma_cm::Result<R>>, R>(what: &str, f: F) -> Result<R, String> {
    match tokio::time::timeout(T, f).await {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no progress within {T:?}")),
    }
}

/// Bounds a loop of `iters` round trips: T, plus 10 ms a round trip.
async fn loop_bounded<F: std::future::Future<Output = Result<(), String>>>(
    what: &str,
    iters: u64,
    f: F,
) -> Result<(), String> {
    let bound = T + Duration::from_millis(10).saturating_mul(iters.min(u32::MAX as u64) as u32);
    match tokio::time::timeout(bound, f).await {
        Ok(r) => r,
        Err(_) => Err(format!("{what}: not done within {bound:?}")),
    }
}

/// Runs a blocking step of the lane (connect, accept, the wait for the peer to leave, the
/// disconnect: each bounded, none with an async form) on tokio's blocking pool, so the runtime's
/// thread keeps driving the other task meanwhile (under `--same-thread`, the peer's half of the
/// handshake). The lane moves to that thread for the step and comes back with its result.
async fn off_thread<R: Send + 'static>(
    what: &'static str,
    mut lane: Lane,
    step: impl FnOnce(&mut Lane) -> rdma_cm::Result<R> + Send + 'static,
) -> Result<(Lane, R), String> {
    let done = tokio::task::spawn_blocking(move || {
        let r = step(&mut lane);
        (lane, r)
    });
    let (lane, r) = done.await.map_err(|e| format!("{what}: {e}"))?;
    Ok((lane, r.map_err(|e| format!("{what}: {e}"))?))
}

/// The next completion, which must have succeeded (its region in it).
async fn next(lane: &mut Lane, what: &str) -> Result<Completion, String> {
    lane.wait_async(T).await.and_then(Completion::ok).map_err(|e| format!("{what}: {e}"))
}

async fn server(addr: SocketAddr, size: usize, iters: u64) -> Result<(), String> {
    let listener = Server::new().and_then(|s| s.bind(addr)).and_then(|b| b.listen(4)).map_err(|e| e.to_string())?;
    println!("[server] listening on {addr}");
    let req = bounded("get_request", listener.get_request_async()).await?;
    let pd = req.alloc_pd().map_err(|e| e.to_string())?;
    let mut lane = Lane::new(&req.context().map_err(|e| e.to_string())?, 8).map_err(|e| e.to_string())?;
    // Two buffers, alternating: the next receive is posted (into one) before the echo is sent
    // (from the other), as the synchronous server does, so that the client's next message
    // never finds no receive posted (an RNR NAK and a retry timer, milliseconds on rxe). The
    // first receive is posted before the accept; each buffer moves into the lane with its
    // work request and comes back with the completion.
    let mr = || MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE).map_err(|e| e.to_string());
    let mut spare = Some(mr()?);
    let pending = req.lane_qp(&mut lane, &pd, QpInit::new()).map_err(|e| e.to_string())?;
    let qp = pending.qp();
    lane.post_recv(qp, RecvWr::new(mr()?).wr_id(0)).map_err(|e| e.to_string())?;
    let (mut lane, ()) = off_thread("accept", lane, move |l| pending.accept(l, &ConnParam::new(), T)).await?;
    println!("[server] connection established");
    // One bound for the whole loop (T, plus 10 ms a round trip), not a timer per wait: a
    // per-wait `tokio::time::timeout` costs clock reads and timer-wheel work at every wait.
    let echo_loop = async {
        // The client's next message may complete here before our echo's send does.
        let mut early: Option<Completion> = None;
        for i in 0..iters {
            let mut got = match early.take() {
                Some(c) => c,
                None => next(&mut lane, "receive").await?,
            };
            if got.queue() != WorkQueue::Recv || got.wr_id() != i {
                return Err(format!("receive {i}: a completion of {:?} {} came instead", got.queue(), got.wr_id()));
            }
            let n = got.byte_len() as usize;
            let buf = got.take_region().ok_or("a receive's completion hands its buffer back")?;
            if i + 1 < iters {
                let next = spare.take().ok_or("the last echo has not completed")?;
                lane.post_recv(qp, RecvWr::new(next).wr_id(i + 1)).map_err(|e| e.to_string())?;
            }
            lane.post_send(qp, SendWr::send(buf, 0..n).wr_id(i)).map_err(|e| e.to_string())?;
            loop {
                let mut c = next(&mut lane, "echo").await?;
                if c.queue() == WorkQueue::Send {
                    spare = c.take_region();
                    break;
                }
                early = Some(c);
            }
        }
        Ok::<(), String>(())
    };
    loop_bounded("echo loop", iters, echo_loop).await?;
    // Wait (bounded) for the client to leave.
    let (_lane, left) = off_thread("disconnect", lane, move |l| l.wait_peer_left(qp, T)).await?;
    if !left {
        return Err(format!("disconnect: the client did not leave within {T:?}"));
    }
    println!("[server] echoed {iters} messages, client left");
    Ok(())
}

async fn client(addr: SocketAddr, size: usize, iters: u64) -> Result<(), String> {
    let route =
        bounded("resolve address", Client::new().map_err(|e| e.to_string())?.resolve_addr_async(None, addr, T)).await?;
    let route = bounded("resolve route", route.resolve_route_async(T)).await?;
    let pd = route.alloc_pd().map_err(|e| e.to_string())?;
    let mut ping = MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE).map_err(|e| e.to_string())?;
    let mut pong = MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE).map_err(|e| e.to_string())?;
    let mut lane = Lane::new(&route.context().map_err(|e| e.to_string())?, 8).map_err(|e| e.to_string())?;
    let pending = route.lane_qp(&mut lane, &pd, QpInit::new()).map_err(|e| e.to_string())?;
    let qp = pending.qp();
    let (mut lane, _) = off_thread("connect", lane, move |l| pending.connect(l, &ConnParam::new(), T)).await?;
    println!("[client] connection established");
    let mut rtts = Vec::with_capacity(iters as usize);
    let clock = common::Stopwatch::calibrate();
    let ping_loop = async {
        for i in 0..iters {
            let byte = (i % 251) as u8;
            ping.as_mut_slice().map_err(|e| e.to_string())?.fill(byte);
            let start = clock.now();
            // Both buffers move into the lane; the send's and the echo's completions (in
            // either order) hand them back.
            lane.post_recv(qp, RecvWr::new(pong).wr_id(i)).map_err(|e| e.to_string())?;
            lane.post_send(qp, SendWr::send(ping, 0..size).wr_id(i)).map_err(|e| e.to_string())?;
            let (mut sent, mut echo) = (None, None);
            while sent.is_none() || echo.is_none() {
                let mut c = next(&mut lane, "ping").await?;
                match c.queue() {
                    WorkQueue::Send => sent = c.take_region(),
                    _ => echo = c.take_region(),
                }
            }
            rtts.push(clock.since(start));
            (ping, pong) = (sent.expect("sent"), echo.expect("echoed"));
            if pong.as_slice().map_err(|e| e.to_string())?.iter().any(|&b| b != byte) {
                return Err(format!("echo {i} differs"));
            }
        }
        Ok::<(), String>(())
    };
    loop_bounded("ping loop", iters, ping_loop).await?;
    println!("[client] {iters} round trips of {size} bytes verified");
    if iters > 1 {
        common::print_latency_table(size as u32, &mut rtts);
    }
    off_thread("disconnect", lane, move |l| l.disconnect(qp, T)).await?;
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| common::fail("tokio runtime", e))
}

fn main() {
    let args = Args::parse();
    let ip =
        args.addr.or_else(|| rdma_cm::verbs::diagnostics::diagnose(0).usable_addrs().first().map(|&a| IpAddr::V4(a)));
    let Some(ip) = ip else {
        eprintln!("error: no usable RDMA address found: run `cargo run --example doctor`, or give -a");
        std::process::exit(1);
    };
    if args.size == 0 || args.iters == 0 {
        eprintln!("error: --size and --iters must be at least 1");
        std::process::exit(1);
    }
    let addr = SocketAddr::new(ip, args.port);
    let (size, iters) = (args.size, args.iters);
    let (c, s) = if args.same_thread {
        runtime().block_on(async move {
            let srv = tokio::spawn(server(addr, size, iters));
            tokio::time::sleep(Duration::from_millis(200)).await; // let the server listen
            let c = client(addr, size, iters).await;
            (c, srv.await.map_err(|e| e.to_string()).and_then(|r| r))
        })
    } else {
        let srv = std::thread::spawn(move || runtime().block_on(server(addr, size, iters)));
        std::thread::sleep(Duration::from_millis(200)); // let the server listen
        let c = runtime().block_on(client(addr, size, iters));
        (c, srv.join().map_err(|_| "the server thread panicked".to_string()).and_then(|r| r))
    };
    match (c, s) {
        (Ok(()), Ok(())) => println!("[INFO] Round-trip completed."),
        (c, s) => {
            eprintln!("error: client: {:?}; server: {:?}", c.err(), s.err());
            std::process::exit(1);
        }
    }
}
