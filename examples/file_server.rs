//! A file served by RDMA READ, with no copy: the server maps the file, registers the mapping
//! itself, and tells each client where it is; the client's device reads it straight out of the
//! server's page cache. The server's CPU never touches the bytes.
//!
//! ```text
//! cargo run --example file_server --features memmap2 -- -a 10.77.0.1 /dev/shm/data.bin
//! cargo run --example file_server --features memmap2 -- -a 10.77.0.1 -p 7471 --clients 3 /dev/shm/data.bin
//! ```
//!
//! Then run `examples/file_client.rs` against it (`cargo run --example file_client --features
//! memmap2 -- -a 10.77.0.1 -o copy.bin`). Each client connects, finds the file's address, rkey
//! and length in the accept's private data (a `QpInfo`), READs what it wants, and disconnects.
//!
//! Registration pins the file's pages for as long as it lasts. Kernels from 6.5 on refuse
//! long-term pins *for writing* of shared mappings on file systems that track dirty pages
//! (ext4, xfs, ...); tmpfs (`/dev/shm`, where the tests put their files) is exempt. This server
//! registers for remote READ only, so it pins for reading, and that is allowed: measured on
//! Soft-RoCE with Linux 6.12, a file on ext4 registers and serves with `REMOTE_READ`, while the
//! same file registered with `LOCAL_WRITE` is refused (`EFAULT`). If a kernel refuses anyway
//! (`EFAULT`, `EOPNOTSUPP`), the error names this cause: put the file on tmpfs.
//!
//! **Do not truncate or shrink the file while it is served.** The mapping's maker promises that
//! (`MmapOptions::map_mut` is `unsafe`). Measured on Soft-RoCE (Linux 6.1, tmpfs): truncated
//! while registered, the pinned pages stay with the device, and a client's READ still completes
//! from pages the file no longer holds (what it returns is no longer the file); this process
//! would get `SIGBUS` if it touched the mapping past the new end (it never does). Truncated
//! before a client comes (the mapping is registered anew for each), the registration is refused
//! (`EFAULT`) and the client rejected. Appending is harmless: clients see the length the file
//! had when it was mapped.

use std::fmt::Display;
use std::fs::OpenOptions;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Parser;
use memmap2::{MmapMut, MmapOptions};
use rdma_cm::verbs::lane::Lane;
use rdma_cm::{AccessFlags, ConnParam, Error, MemoryRegion, QpInfo, QpInit, Server};

#[derive(Parser)]
#[command(about = "Serves one file to RDMA READ, zero-copy, from its memory mapping")]
struct Args {
    /// The file to serve (on tmpfs, e.g. /dev/shm: see the example's header).
    path: String,
    /// Address (or host name) to listen on; 0.0.0.0: every RDMA device.
    #[arg(short = 'a', long = "addr", default_value = "0.0.0.0")]
    addr: String,
    /// Port to listen on.
    #[arg(short = 'p', long = "port", default_value_t = 7471)]
    port: u16,
    /// Clients to serve, one after the other, before exiting.
    #[arg(long, default_value_t = 1)]
    clients: u32,
    /// Seconds a client may stay connected.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

/// How long the handshake and the disconnect may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

fn main() {
    let args = Args::parse();
    if args.port == 0 || args.clients == 0 {
        fail("bad arguments", "choose a port in 1..=65535 with -p, and at least one client with --clients");
    }
    let stay = Duration::from_secs(args.timeout.max(1));

    // The file, mapped shared (MAP_SHARED): the mapping *is* the page cache, so the device reads
    // the file's own pages. MmapMut is what the crate registers; it needs the file opened
    // read-write, although nothing here writes it.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&args.path)
        .unwrap_or_else(|e| fail(&format!("opening {}", args.path), e));
    let len = file.metadata().unwrap_or_else(|e| fail("reading the file's size", e)).len();
    if len == 0 {
        fail(&format!("serving {}", args.path), "the file is empty: there is nothing to register");
    }
    // SAFETY: the mapping is of the whole file as it is now. That nobody truncates or rewrites
    // the file while it is served is this program's documented condition (see the header):
    // the mapping's bytes are only ever read by the device, never through a Rust reference
    // here, so a change by another process cannot break an aliasing rule of ours.
    let mut mapped = Some(unsafe { MmapOptions::new().map_mut(&file) }.unwrap_or_else(|e| fail("mapping the file", e)));
    println!("[INFO] Mapped {} ({len} bytes)", args.path);

    // rdma_create_event_channel + rdma_create_id, rdma_bind_addr, rdma_listen: as in
    // examples/server.rs (EADDRINUSE: another listener has the port).
    let server = Server::new().unwrap_or_else(|e| fail("creating the listening id", e));
    let addr = resolve(&args.addr, args.port);
    let bound = server.bind(addr).unwrap_or_else(|e| fail("binding", e));
    let listener = bound.listen(1).unwrap_or_else(|e| fail("listening", e));
    println!("[INFO] Listening on port {}...", args.port);

    for n in 1..=args.clients {
        let req = loop {
            match listener.get_request(Duration::from_secs(3600)) {
                Ok(req) => break req,
                Err(Error::Timeout { .. }) => continue,
                Err(e) => fail("waiting for a connection request", e),
            }
        };
        let peer = req.peer_addr().map_or_else(|| "?".into(), |a| a.to_string());
        println!("[EVENT] Client {n}: CONNECT_REQUEST from {peer}");

        // ibv_reg_mr of the mapping, in place: `register` takes the MmapMut and holds it until
        // `into_buffer_as` gives it back, so nothing can unmap it while the device may read it.
        // REMOTE_READ is what lets a peer READ it; without it the client's READ completes with
        // a remote access error. No LOCAL_WRITE and no REMOTE_WRITE: the device never writes
        // the file, so the pages are pinned for reading only, which kernels from 6.5 on allow
        // on any file system (a writable pin of an ext4 file is refused there: see the header).
        let pd = req.alloc_pd().unwrap_or_else(|e| fail("allocating the protection domain", e));
        let map = mapped.take().expect("given back after each client");
        let mr = match MemoryRegion::register(&pd, map, AccessFlags::REMOTE_READ) {
            Ok(mr) => mr,
            Err(e) => fail_registration(req, &args.path, e),
        };

        // A QP on the lane, as in examples/server.rs. This side posts nothing: the client's
        // READs are served by the device, with no work request and no completion here.
        let ctx = req.context().unwrap_or_else(|e| fail("opening the device", e));
        let mut lane = Lane::new(&ctx, 8).unwrap_or_else(|e| fail("creating the completion queue", e));
        let init = QpInit::new().max_send_wr(1).max_recv_wr(1);
        let pending = req.lane_qp(&mut lane, &pd, init).unwrap_or_else(|e| fail("creating the QP", e));
        let qp = pending.qp();
        let qp_num = lane.qp_num(qp).unwrap_or_else(|e| fail("reading the QP number", e));
        let info = QpInfo { qp_num, psn: 0, rkey: mr.rkey(), vaddr: mr.addr(), len: mr.len() as u64 };

        // rdma_accept with the file's QpInfo in the private data. The READ depths stay at
        // ConnParam's default, what the device allows: responder_resources is how many READs the
        // client may have in flight towards us, taken from its request (its initiator depth)
        // and clamped to this device's limit. A depth of 0 would refuse every READ.
        let param =
            ConnParam::new().private_data(&info.encode()).unwrap_or_else(|e| fail("building the accept parameters", e));
        pending.accept(&mut lane, &param, STEP_TIMEOUT).unwrap_or_else(|e| fail("accepting", e));
        println!("[EVENT] Client {n}: connected; serving {len} bytes at {:#x}, rkey {:#x}", info.vaddr, info.rkey);

        // The client READs, then disconnects: wait for its DISCONNECTED (the CM event, not a
        // completion), then destroy the QP and its id.
        match lane.wait_peer_left(qp, stay) {
            Ok(true) => println!("[EVENT] Client {n} disconnected"),
            Ok(false) => eprintln!("[WARN] Client {n} still connected after {stay:?}: disconnecting it"),
            Err(e) => fail("waiting for the client to leave", e),
        }
        lane.disconnect(qp, STEP_TIMEOUT).unwrap_or_else(|e| fail("disconnecting", e));
        drop(lane);

        // ibv_dereg_mr, and the mapping back, at the same address, for the next client.
        let back: MmapMut = mr.into_buffer_as().unwrap_or_else(|e| fail("deregistering the file", e));
        mapped = Some(back);
    }
    println!("[INFO] Served {} client(s); exiting", args.clients);
}

/// Registration failed: rejects the client (rdma_reject, with the reason as private data) and
/// exits 1, naming the usual cause of the errno on a file mapping.
fn fail_registration(req: rdma_cm::ConnectRequest, path: &str, e: Error) -> ! {
    let why = match e.errno() {
        Some(libc::EFAULT | libc::EOPNOTSUPP) => format!(
            "{e}: the kernel refused to pin the file's pages. Either the file shrank after it was mapped (the \
             mapping reaches pages the file no longer has), or this kernel (6.5 on) refuses long-term pins of \
             shared mappings on this file system: put the file on tmpfs (/dev/shm/...)"
        ),
        _ => e.to_string(),
    };
    let _ = req.reject(b"the server could not register its file (see its log)");
    fail(&format!("registering the mapping of {path}"), why)
}

/// `host` as an address: an IP address as it is, a name through rdma_getaddrinfo.
fn resolve(host: &str, port: u16) -> SocketAddr {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return SocketAddr::new(ip, port);
    }
    let addrs = rdma_cm::lookup(host, &port.to_string()).unwrap_or_else(|e| fail("bad arguments", e));
    addrs.into_iter().find(SocketAddr::is_ipv4).unwrap_or_else(|| fail("bad arguments", "no IPv4 address"))
}

/// Prints the failed step and the error (its errno and usual cause) on one line; exits 1.
fn fail(step: &str, e: impl Display) -> ! {
    eprintln!("error: {step}: {e}");
    std::process::exit(1)
}
