//! The rdma_cm server, step by step: listen, accept one client, echo its message, clean up.
//!
//! ```text
//! cargo run --example server                            # listen on every RDMA device, port 7471
//! cargo run --example server -- -a 10.77.0.1 -p 7471    # the device that has this address
//! ```
//!
//! Then run `examples/client.rs` against it (`cargo run --example client -- -a 10.77.0.1`).
//! This is the server half of rdma_cm's teaching pair (`rdma_cm_s.c` in C), one step after the
//! other, each with the C call it makes and what usually goes wrong there:
//!
//! 1. create the listening id, bind it to an address, listen;
//! 2. wait for a connect request; read the client's `QpInfo` from its private data;
//! 3. register a buffer, create the QP, accept with our own `QpInfo`;
//! 4. receive the client's message and send it back;
//! 5. wait for the client to disconnect; everything is released as it goes out of scope.
//!
//! It serves one client and exits. It also serves rdma-core's `rdma_client`, which sends no
//! `QpInfo` and a 16-byte message. Where the machine has no RDMA device, cargo runs it in the
//! Soft-RoCE guest (harness/runner), and `harness/demo` runs server and client together there.
//! For latency tables and bandwidth, see the perf tool (`examples/perftest`).

use std::fmt::Display;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::Parser;
use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
use rdma_cm::{AccessFlags, ConnParam, Error, MemoryRegion, QpInfo, QpInit, Server};

#[derive(Parser)]
#[command(about = "rdma_cm echo server: accepts one client and sends its message back")]
struct Args {
    /// Address (or host name) to listen on; 0.0.0.0: every RDMA device.
    #[arg(short = 'a', long = "addr", default_value = "0.0.0.0")]
    addr: String,
    /// Port to listen on.
    #[arg(short = 'p', long = "port", default_value_t = 7471)]
    port: u16,
}

/// How long each step may take once a client is here (handshake, message, disconnect).
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// What rdma-core's `rdma_client` sends: 16 bytes, and no `QpInfo`.
const LEGACY_SIZE: u32 = 16;
/// The largest message a client may announce.
const MAX_SIZE: u64 = 64 << 20;

fn main() {
    let args = Args::parse();
    if args.port == 0 {
        fail("bad arguments", "port 0 is not a port a client can reach: choose 1..=65535 with -p");
    }
    let addr = resolve(&args.addr, args.port);

    // rdma_create_event_channel + rdma_create_id(RDMA_PS_TCP). Fails when the rdma_cm kernel
    // module is not loaded (ENODEV, ENOENT: `modprobe rdma_ucm`).
    let server = Server::new().unwrap_or_else(|e| fail("creating the listening id", e));
    println!("[INFO] Created listening ID");

    // rdma_bind_addr: EADDRINUSE when another listener has the port; EADDRNOTAVAIL when no
    // interface has the address (`ip -br addr`). 0.0.0.0 binds every RDMA device.
    let bound = server.bind(addr).unwrap_or_else(|e| fail("binding", e));
    println!("[INFO] Bound to address {addr}");

    // rdma_listen: a backlog of 1 is enough for one client.
    let listener = bound.listen(1).unwrap_or_else(|e| fail("listening", e));
    println!("[INFO] Listening on port {}...", args.port);

    // rdma_get_cm_event until RDMA_CM_EVENT_CONNECT_REQUEST: waits for as long as no client
    // comes. None comes when the client's address resolution fails on its side (see there).
    let req = loop {
        match listener.get_request(Duration::from_secs(3600)) {
            Ok(req) => break req,
            Err(Error::Timeout { .. }) => continue,
            Err(e) => fail("waiting for a connection request", e),
        }
    };
    let peer = req.peer_addr().map_or_else(|| "?".into(), |a| a.to_string());
    println!("[EVENT] Received CONNECT_REQUEST from {peer}");

    // The client's QpInfo (qp_num, psn, rkey, vaddr, len) travels in the request's private
    // data; its len is the size of the message it will send. Untrusted: a request we cannot
    // read is rejected (rdma_reject) with the reason, which the client sees.
    let client = QpInfo::is_present(req.private_data()).then(|| QpInfo::decode(req.private_data()).map(|d| d.0));
    let size = match client {
        Some(Ok(info)) if (1..=MAX_SIZE).contains(&info.len) => {
            println!("[INFO] Client qp_num {}, rkey {:#x}, vaddr {:#x}", info.qp_num, info.rkey, info.vaddr);
            info.len as usize
        }
        Some(Ok(info)) => reject(req, format!("message size {} is outside 1..={MAX_SIZE}", info.len)),
        Some(Err(e)) => reject(req, e.to_string()),
        None => {
            println!("[INFO] Peer sent no qp_info: rdma-core rdma_client protocol ({LEGACY_SIZE}-byte echo)");
            LEGACY_SIZE as usize
        }
    };

    // ibv_alloc_pd + ibv_reg_mr on the request's device. ENOMEM here is nearly always the
    // locked-memory limit: `ulimit -l` (the error says how much it is).
    let pd = req.alloc_pd().unwrap_or_else(|e| fail("allocating the protection domain", e));
    let started = Instant::now();
    let buf = MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap_or_else(|e| fail("registering memory", e));
    println!("[INFO] Memory registration took {:.1} us ({size} bytes)", micros(started));

    // ibv_create_cq, then ibv_create_qp and the id's adoption of it (what rdma_create_qp
    // does): the lane (rdma_cm::verbs::lane) owns the completion queue and the QP. EINVAL or
    // ENOMEM: more work requests than the device allows (`ibv_devinfo -v`: max_qp_wr).
    let ctx = req.context().unwrap_or_else(|e| fail("opening the device", e));
    let mut lane = Lane::new(&ctx, 32).unwrap_or_else(|e| fail("creating the completion queue", e));
    let started = Instant::now();
    let init = QpInit::new().max_send_wr(16).max_recv_wr(16);
    let pending = req.lane_qp(&mut lane, &pd, init).unwrap_or_else(|e| fail("creating the QP", e));
    let qp = pending.qp();
    let qp_num = lane.qp_num(qp).unwrap_or_else(|e| fail("reading the QP number", e));
    println!("[INFO] QP creation took {:.1} us (qp_num {qp_num}, 16 send / 16 recv WRs)", micros(started));

    // ibv_post_recv before rdma_accept, as rdma_cm_s.c does: the client may send the moment
    // it is connected, and a message that finds no receive waits for the RNR timer. The
    // receive moves the buffer into the lane; its completion hands it back.
    let info = QpInfo { qp_num, psn: 0, rkey: buf.rkey(), vaddr: buf.addr(), len: size as u64 };
    lane.post_recv(qp, RecvWr::new(buf)).unwrap_or_else(|e| fail("ibv_post_recv", e));

    // rdma_accept with our QpInfo in the private data, then RDMA_CM_EVENT_ESTABLISHED. One
    // RDMA READ in flight each way, and retries without end (7) when a message is lost or a
    // receive is not posted yet. Timeouts here: the client gave up, or its side of the route
    // is broken.
    let param = ConnParam::new()
        .responder_resources(1)
        .initiator_depth(1)
        .retry_count(7)
        .rnr_retry_count(7)
        .private_data(&info.encode())
        .unwrap_or_else(|e| fail("building the accept parameters", e));
    pending.accept(&mut lane, &param, STEP_TIMEOUT).unwrap_or_else(|e| fail("accepting", e));
    println!("[EVENT] Connection established");

    // ibv_get_cq_event + ibv_poll_cq: `wait` sleeps until the receive completes. A failed
    // completion names its status and cause (RNR retry exceeded: nobody posted a receive;
    // remote access error: a wrong rkey).
    let mut got = lane.wait(STEP_TIMEOUT).and_then(|c| c.ok()).unwrap_or_else(|e| fail("receiving", e));
    let n = got.byte_len() as usize;
    println!("[INFO] Received {n} bytes");
    let buf = got.take_region().expect("a receive's completion hands its buffer back");
    lane.post_send(qp, SendWr::send(buf, 0..n)).unwrap_or_else(|e| fail("ibv_post_send", e));
    lane.wait(STEP_TIMEOUT).and_then(|c| c.ok()).unwrap_or_else(|e| fail("sending the echo", e));
    println!("[INFO] Sent {n} bytes");

    // rdma_disconnect, then RDMA_CM_EVENT_DISCONNECTED: the client disconnects once it has its
    // echo; whichever side goes first, both see the event. The QP is destroyed (rdma_destroy_qp).
    lane.disconnect(qp, STEP_TIMEOUT).unwrap_or_else(|e| fail("disconnecting", e));
    println!("[EVENT] Client disconnected");
    // Teardown, in reverse order of creation, as the values drop: the lane (ibv_destroy_cq),
    // the protection domain (ibv_dealloc_pd), the ids (rdma_destroy_id) and the event channel.
    drop(lane);
    println!("[INFO] Server exiting");
}

/// `host` as an address: an IP address as it is, a name through rdma_getaddrinfo.
fn resolve(host: &str, port: u16) -> SocketAddr {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return SocketAddr::new(ip, port);
    }
    let addrs = rdma_cm::lookup(host, &port.to_string()).unwrap_or_else(|e| fail("bad arguments", e));
    addrs.into_iter().find(SocketAddr::is_ipv4).unwrap_or_else(|| fail("bad arguments", "no IPv4 address"))
}

/// rdma_reject with the reason as private data (the client prints it), then exits 1.
fn reject(req: rdma_cm::ConnectRequest, why: String) -> ! {
    let _ = req.reject(&why.as_bytes()[..why.len().min(100)]);
    fail("rejected the client", why)
}

fn micros(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e6
}

/// Prints the failed step and the error (its errno and usual cause) on one line; exits 1.
fn fail(step: &str, e: impl Display) -> ! {
    eprintln!("error: {step}: {e}");
    std::process::exit(1)
}
