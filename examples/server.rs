//! The rdma_cm server: listens, accepts each client, and echoes what it sends.
//!
//! ```text
//! cargo run --example server -- -a 0.0.0.0 -p 7471            # serve until Ctrl-C
//! cargo run --example server -- -a 10.77.0.1 -p 7471 --count 1 # exit after one client
//! ```
//!
//! Where the machine has no RDMA device, cargo runs it in the Soft-RoCE guest (harness/runner);
//! `harness/demo` runs server and client together there. The client chooses the mode
//! (send/write/read), the size and the iteration count and tells the server in the connect
//! private data; a client without that data (rdma-core's `rdma_client`) gets the 16-byte
//! exchange of rdma-core's `rdma_server`. Clients are served concurrently, one thread each; a
//! client's failure is logged and never stops the server. SIGINT/SIGTERM stop it cleanly.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use common::{fail, micros, resolve_host, Mode, Request, DEFAULT_PORT, LEGACY_SIZE};
use rdma_cm::{
    AccessFlags, ConnParam, ConnectRequest, Connection, Error, MemoryRegion, QpInfo, QpInit, RecvWr, SendWr, Server,
    WorkQueue,
};

#[derive(Parser, Debug)]
#[command(about = "rdma_cm echo server (send/recv, RDMA WRITE, RDMA READ)")]
struct Args {
    /// Address (or host name) to bind; 0.0.0.0: every RDMA device.
    #[arg(short = 'a', long = "addr", default_value = "0.0.0.0")]
    addr: String,
    /// Port to listen on.
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Exit after serving this many clients (default: serve until SIGINT/SIGTERM).
    #[arg(long)]
    count: Option<u32>,
    /// Listen backlog.
    #[arg(long, default_value_t = 16)]
    backlog: i32,
    /// Seconds any single wait may take (resolution, handshake, each message).
    #[arg(long, default_value_t = 10)]
    timeout: u64,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: on_signal only stores to an atomic, which is async-signal-safe; the handler
        // stays valid for the program's life.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

fn main() {
    let args = Args::parse();
    if args.port == 0 {
        fail("bad arguments", "port 0 is not a port a client can reach: choose 1..=65535 with -p");
    }
    install_signal_handlers();
    let timeout = Duration::from_secs(args.timeout.max(1));
    let bind = resolve_host(&args.addr, args.port).unwrap_or_else(|e| fail("bad arguments", e));

    let server = Server::new().unwrap_or_else(|e| fail("creating the listening id", e));
    println!("[INFO] Created listening ID");
    let bound = server.bind(bind).unwrap_or_else(|e| fail("binding", e));
    println!("[INFO] Bound to address {bind}");
    let listener = bound.listen(args.backlog).unwrap_or_else(|e| fail("listening", e));
    println!("[INFO] Listening on port {}...", args.port);

    let served = Arc::new(AtomicU32::new(0));
    let failed = Arc::new(AtomicU32::new(0));
    let mut workers = Vec::new();
    let mut accepted = 0u32;
    while !STOP.load(Ordering::SeqCst) && args.count.is_none_or(|c| accepted < c) {
        let req = match listener.get_request(Duration::from_millis(500)) {
            Ok(r) => r,
            Err(Error::Timeout { .. }) => continue,
            Err(e) => {
                eprintln!("[ERROR] waiting for a connection request: {e}");
                continue;
            }
        };
        accepted += 1;
        let peer = req.peer_addr().map_or_else(|| "?".into(), |a| a.to_string());
        println!("[EVENT] Received CONNECT_REQUEST from {peer}");
        let (served, failed) = (Arc::clone(&served), Arc::clone(&failed));
        workers.push(std::thread::spawn(move || match serve(req, timeout) {
            Ok(()) => {
                served.fetch_add(1, Ordering::SeqCst);
                println!("[INFO] Client {peer} done");
            }
            Err(e) => {
                failed.fetch_add(1, Ordering::SeqCst);
                eprintln!("[ERROR] client {peer}: {e}");
            }
        }));
        workers.retain(|w| !w.is_finished());
    }
    for w in workers {
        let _ = w.join();
    }
    println!(
        "[INFO] Server exiting: {} client(s) served, {} failed",
        served.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst)
    );
}

/// Serves one client from its request to its disconnect.
fn serve(req: ConnectRequest, timeout: Duration) -> Result<(), String> {
    let parsed = match Request::decode(req.private_data()) {
        Ok(r) => r,
        Err(why) => {
            println!("[INFO] Rejecting {:?}: {why}", req.peer_addr());
            let _ = req.reject(why.as_bytes().get(..100).unwrap_or(why.as_bytes()));
            return Err(format!("rejected: {why}"));
        }
    };
    let (mode, size, iters) = match parsed {
        Some(r) => (r.mode, r.size, r.iters),
        None => {
            println!("[INFO] Peer sent no qp_info: rdma-core rdma_client protocol ({LEGACY_SIZE}-byte echo)");
            (Mode::Send, LEGACY_SIZE, 1)
        }
    };
    println!("[INFO] Mode {mode}, {size} bytes, {iters} iteration(s)");
    let err = |e: Error| e.to_string();
    let pd = req.alloc_pd().map_err(err)?;

    let t = Instant::now();
    let access = match mode {
        Mode::Send => AccessFlags::LOCAL_WRITE,
        Mode::Write => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        Mode::Read => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    };
    let bufs = [
        MemoryRegion::new(&pd, size as usize, access).map_err(err)?,
        MemoryRegion::new(&pd, size as usize, access).map_err(err)?,
    ];
    let ctl = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).map_err(err)?;
    println!("[INFO] Memory registration took {:.1} us ({} bytes, {:?})", micros(t.elapsed()), size, access);

    let t = Instant::now();
    let mut pending = req.create_qp(&pd, QpInit::new()).map_err(err)?;
    println!(
        "[INFO] QP creation took {:.1} us (qp_num {}, 16 send / 16 recv WRs)",
        micros(t.elapsed()),
        pending.qp().qp_num()
    );

    let client_region = parsed.and_then(|r| r.info.region());
    match mode {
        Mode::Send => pending.post_recv(&[RecvWr::new(&bufs[0], 0..size as usize).wr_id(0)]).map_err(err)?,
        Mode::Write | Mode::Read => pending.post_recv(&[RecvWr::new(&ctl, 0..64).wr_id(0)]).map_err(err)?,
    }
    let info = QpInfo {
        qp_num: pending.qp().qp_num(),
        psn: 0,
        rkey: bufs[0].rkey(),
        vaddr: bufs[0].addr(),
        len: if mode == Mode::Send { 0 } else { size },
    };
    let info = if mode == Mode::Send { QpInfo { rkey: 0, vaddr: 0, ..info } } else { info };
    let param = ConnParam::new().private_data(&info.encode()).map_err(err)?;
    let mut conn = pending.accept(&param, timeout).map_err(err)?;
    println!("[EVENT] Connection established");

    let result = match mode {
        Mode::Send => echo_send(&mut conn, &bufs, size, iters, timeout),
        Mode::Write => {
            echo_write(&mut conn, &bufs[0], &ctl, client_region.ok_or("no client region")?, size, iters, timeout)
        }
        Mode::Read => {
            echo_read(&mut conn, &bufs[0], &ctl, client_region.ok_or("no client region")?, size, iters, timeout)
        }
    };
    result.map_err(err)?;
    // The client disconnects first; wait for it, bounded.
    let deadline = Instant::now() + timeout;
    while !conn.is_disconnected() {
        let left = deadline.saturating_duration_since(Instant::now());
        match conn.next_event(left) {
            Ok(_) => {}
            Err(Error::Timeout { .. }) => break,
            Err(e) => return Err(e.to_string()),
        }
    }
    println!("[INFO] Disconnected");
    Ok(())
}

fn echo_send(conn: &mut Connection, bufs: &[MemoryRegion; 2], size: u32, iters: u32, t: Duration) -> Result<(), Error> {
    let qp = conn.qp_mut();
    for i in 0..iters {
        let cur = (i % 2) as usize;
        let wc = qp.wait_for(WorkQueue::Recv, i as u64, t)?;
        let n = wc.byte_len() as usize;
        if iters == 1 {
            println!("[INFO] Received {n} bytes");
        }
        if i + 1 < iters {
            qp.post_recv(&[RecvWr::new(&bufs[1 - cur], 0..size as usize).wr_id(i as u64 + 1)])?;
        }
        qp.post_send(&[SendWr::send(&bufs[cur], 0..n).wr_id(i as u64)])?;
        qp.wait_for(WorkQueue::Send, i as u64, t)?;
        if iters == 1 {
            println!("[INFO] Sent {n} bytes");
        }
    }
    if iters > 1 {
        println!("[INFO] Echoed {iters} messages of {size} bytes");
    }
    Ok(())
}

/// Write mode: the client's WRITE_WITH_IMM lands in `buf`; we write it back into its region.
fn echo_write(
    conn: &mut Connection,
    buf: &MemoryRegion,
    ctl: &MemoryRegion,
    client: rdma_cm::RemoteRegion,
    size: u32,
    iters: u32,
    t: Duration,
) -> Result<(), Error> {
    let qp = conn.qp_mut();
    for i in 0..iters {
        let wc = qp.wait_for(WorkQueue::Recv, i as u64, t)?;
        if wc.imm_data() != Some(i) {
            return Err(Error::InvalidArgument(format!("expected immediate {i}, got {:?}", wc.imm_data())));
        }
        if iters == 1 {
            println!("[INFO] Received {size} bytes (RDMA WRITE)");
        }
        if i + 1 < iters {
            qp.post_recv(&[RecvWr::new(ctl, 0..64).wr_id(i as u64 + 1)])?;
        }
        qp.post_send(&[SendWr::write(buf, 0..size as usize, &client, 0)?.imm(i).wr_id(i as u64)])?;
        qp.wait_for(WorkQueue::Send, i as u64, t)?;
        if iters == 1 {
            println!("[INFO] Sent {size} bytes (RDMA WRITE)");
        }
    }
    Ok(())
}

/// Read mode: on the client's "go", RDMA READ its region into `buf`, then answer "done" so the
/// client reads `buf` back.
fn echo_read(
    conn: &mut Connection,
    buf: &MemoryRegion,
    ctl: &MemoryRegion,
    client: rdma_cm::RemoteRegion,
    size: u32,
    iters: u32,
    t: Duration,
) -> Result<(), Error> {
    let qp = conn.qp_mut();
    for i in 0..iters {
        qp.wait_for(WorkQueue::Recv, i as u64, t)?;
        qp.post_send(&[SendWr::read(buf, 0..size as usize, &client, 0)?.wr_id(i as u64)])?;
        qp.wait_for(WorkQueue::Send, i as u64, t)?;
        if iters == 1 {
            println!("[INFO] Received {size} bytes (RDMA READ)");
        }
        if i + 1 < iters {
            qp.post_recv(&[RecvWr::new(ctl, 0..64).wr_id(i as u64 + 1)])?;
        }
        qp.post_send(&[SendWr::send_inline(&i.to_be_bytes()).wr_id(u64::MAX)])?;
        qp.wait_for(WorkQueue::Send, u64::MAX, t)?;
    }
    Ok(())
}
