//! Revocable remote access with a memory window: a server hands out a 4 KiB window inside a
//! 1 MiB region, lets the peer write it, revokes it, and shows the peer's next write refused.
//!
//! ```text
//! cargo run --example memory_window -- -a 10.77.0.1            # both sides, in one process
//! cargo run --example memory_window -- -a 10.77.0.1 -p 7474 -t 1   # a type 1 window
//! ```
//!
//! The server and the client are two threads connected through the device (the address must
//! be an RDMA device's, e.g. the guest's `RDMA_VM_ADDR`). The region is registered with
//! `LOCAL_WRITE | MW_BIND` only: its own rkey lets no peer write it. The window's address, rkey
//! and length travel in a send posted after the bind on the same QP, so they reach the client
//! after the bind took effect. Revocation is a local invalidation (type 2) or a zero-length bind
//! (type 1); the client's write through the old rkey then completes with `REM_ACCESS_ERR`, and
//! the server shows that no byte of the region changed.

use std::net::{IpAddr, SocketAddr};
use std::process::exit;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use rdma_cm::verbs::lane::{BindWr, Lane, RecvWr, SendWr};
use rdma_cm::verbs::mw::{MemoryWindow, WindowType};
use rdma_cm::{AccessFlags, Client, ConnParam, Error, MemoryRegion, QpInit, RemoteRegion, Server};

const T: Duration = Duration::from_secs(10);
const REGION: usize = 1 << 20;
const WINDOW: std::ops::Range<usize> = 4096..8192;

fn usage() -> ! {
    eprintln!("usage: memory_window [-a ADDR] [-p PORT] [-t 1|2]");
    exit(2)
}

fn main() {
    let mut addr: IpAddr =
        std::env::var("RDMA_VM_ADDR").ok().and_then(|a| a.parse().ok()).unwrap_or([10, 77, 0, 1].into());
    let (mut port, mut kind) = (7473u16, WindowType::Two);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "-a" => addr = v.parse().unwrap_or_else(|_| usage()),
            "-p" => port = v.parse().unwrap_or_else(|_| usage()),
            "-t" => {
                kind = if v == "1" {
                    WindowType::One
                } else if v == "2" {
                    WindowType::Two
                } else {
                    usage()
                }
            }
            _ => usage(),
        }
    }
    if let Err(e) = run(SocketAddr::new(addr, port), kind) {
        eprintln!("[ERROR] {e}");
        exit(1);
    }
}

fn run(at: SocketAddr, kind: WindowType) -> rdma_cm::Result<()> {
    let listener = Server::new()?.bind(at)?.listen(1)?;
    println!("[SERVER] listening on {at}");
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let client = thread::spawn(move || client(at, done_rx));
    let req = listener.get_request(T)?;
    let pd = req.alloc_pd()?;
    let region = MemoryRegion::new(&pd, REGION, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
    let mut msg = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE)?;
    let mut lane = Lane::new(&req.context()?, 16)?;
    let pending = req.lane_qp(&mut lane, &pd, QpInit::new())?;
    let qp = pending.qp();
    pending.accept(&mut lane, &ConnParam::new(), T)?;
    println!("[SERVER] connected; region of {REGION} bytes, rkey {:#x} (no remote rights)", region.rkey());

    // The bind moves the region into the lane; its completion hands it back, but the bound
    // window keeps the region's bytes out of reach while the peer may write them.
    let mw = MemoryWindow::new(&pd, kind)?;
    let window = lane.bind_window(qp, BindWr::new(mw, region, WINDOW, AccessFlags::REMOTE_WRITE).wr_id(1))?;
    let mut region = next(&mut lane, 1)?.expect("the bind's completion hands the region back");
    let remote = window.remote();
    println!(
        "[SERVER] {kind:?} window bound at offset {} ({} bytes), rkey {:#x}",
        WINDOW.start, remote.len, remote.rkey
    );
    let mut wire = [0u8; 16];
    wire[..8].copy_from_slice(&remote.addr.to_be_bytes());
    wire[8..12].copy_from_slice(&remote.rkey.to_be_bytes());
    wire[12..].copy_from_slice(&(remote.len as u32).to_be_bytes());
    msg.write_at(0, &wire)?;
    lane.post_send(qp, SendWr::send(msg, 0..16).wr_id(2))?;
    let msg = next(&mut lane, 2)?.expect("a send's completion hands its region back");
    // The client says it wrote (a send of its own), then the server revokes.
    lane.post_recv(qp, RecvWr::new(msg).wr_id(3))?;
    next(&mut lane, 3)?;
    println!("[SERVER] the client wrote through the window; revoking it");
    let revoking = lane.invalidate_window(qp, window, 4).map_err(|e| e.error)?;
    next(&mut lane, 4)?;
    // The invalidation's completion has been handed out: the window lets the region go.
    let _unbound = lane.window_unbound(revoking)?;
    println!("[SERVER] window revoked");
    let _ = done_tx.send(());
    client.join().expect("client thread")?;
    let mut bytes = vec![0; REGION];
    region.read_at(0, &mut bytes)?;
    let written = bytes.iter().filter(|&&b| b != 0).count();
    let inside = bytes[WINDOW].iter().all(|&b| b == 0xab);
    println!("[SERVER] region: {written} bytes written, all inside the window: {inside}");
    if written != WINDOW.len() || !inside {
        return Err(Error::InvalidArgument("the region was not left as the window allowed".into()));
    }
    Ok(())
}

fn client(at: SocketAddr, revoked: mpsc::Receiver<()>) -> rdma_cm::Result<()> {
    let route = Client::new()?.resolve_addr(None, at, T)?.resolve_route(T)?;
    let pd = route.alloc_pd()?;
    let mut buf = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
    let msg = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE)?;
    let mut lane = Lane::new(&route.context()?, 16)?;
    let pending = route.lane_qp(&mut lane, &pd, QpInit::new())?;
    let qp = pending.qp();
    lane.post_recv(qp, RecvWr::new(msg).wr_id(1))?;
    pending.connect(&mut lane, &ConnParam::new(), T)?;
    let mut msg = next(&mut lane, 1)?.expect("a receive's completion hands its region back");
    let mut wire = [0u8; 16];
    msg.read_at(0, &mut wire)?;
    let addr = u64::from_be_bytes(wire[..8].try_into().expect("8 bytes"));
    let rkey = u32::from_be_bytes(wire[8..12].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(wire[12..].try_into().expect("4 bytes"));
    let window = RemoteRegion::new(addr, rkey, len as u64);
    println!("[CLIENT] got window {addr:#x}+{len} rkey {rkey:#x}");
    buf.write_at(0, &[0xab; 4096])?;
    lane.post_send(qp, SendWr::write(buf, 0..4096, &window, 0).wr_id(2))?;
    let mut buf = next(&mut lane, 2)?.expect("a WRITE's completion hands its region back");
    println!("[CLIENT] wrote 4096 bytes through the window");
    lane.post_send(qp, SendWr::send(msg, 0..1).wr_id(3))?;
    next(&mut lane, 3)?;
    revoked.recv_timeout(T).map_err(|_| Error::InvalidArgument("the server did not revoke the window".into()))?;
    buf.write_at(0, &[0xcd; 4096])?;
    lane.post_send(qp, SendWr::write(buf, 0..4096, &window, 0).wr_id(4))?;
    match lane.wait(T)?.ok() {
        Err(Error::WorkCompletion { status, .. }) => {
            println!("[CLIENT] write after revocation refused: {status}");
            Ok(())
        }
        Ok(_) => Err(Error::InvalidArgument("a write through a revoked window succeeded".into())),
        Err(e) => Err(e),
    }
}

/// Waits for the next completion, which must be the successful one of `wr_id` (each side has
/// one work request in flight at a time), and hands back its region (an invalidation has none).
fn next(lane: &mut Lane, wr_id: u64) -> rdma_cm::Result<Option<MemoryRegion>> {
    let mut c = lane.wait(T)?.ok()?;
    if c.wr_id() != wr_id {
        return Err(Error::InvalidArgument(format!("completion {} came, waiting for {wr_id}", c.wr_id())));
    }
    Ok(c.take_region())
}
