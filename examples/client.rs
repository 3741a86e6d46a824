//! The rdma_cm client, step by step: connect to the server, send a message, receive it back.
//!
//! ```text
//! cargo run --example client -- -a 10.77.0.1                  # the server's address; port 7471
//! cargo run --example client -- -a 10.77.0.1 -p 7471 -b 10.77.0.2 --size 4096
//! ```
//!
//! Start `examples/server.rs` first (`cargo run --example server`). This is the client half of
//! rdma_cm's teaching pair (`rdma_cm_c.c` in C), one step after the other, each with the C call
//! it makes and what usually goes wrong there:
//!
//! 1. create an id, resolve the server's address to a device, then a route to it;
//! 2. register two buffers (the message, and where the echo lands) and create the QP;
//! 3. connect, with our `QpInfo` in the private data; read the server's from its answer;
//! 4. send the message, receive the echo, check it byte for byte;
//! 5. disconnect; everything is released as it goes out of scope.
//!
//! `-b` binds a local address first, which chooses the device when there are several. With
//! `--size 16` it also talks to rdma-core's `rdma_server`, which sends no `QpInfo` and answers
//! 16 bytes of its own. Where the machine has no RDMA device, cargo runs it in the Soft-RoCE
//! guest (harness/runner), and `harness/demo` runs server and client together there. For
//! latency tables and bandwidth, see the perf tool (`examples/perftest`).

use std::fmt::Display;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::Parser;
use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion, QpInfo, QpInit};

#[derive(Parser)]
#[command(about = "rdma_cm echo client: sends one message and checks the server's echo")]
struct Args {
    /// Server address or host name.
    #[arg(short = 'a', long = "addr")]
    addr: String,
    /// Server port.
    #[arg(short = 'p', long = "port", default_value_t = 7471)]
    port: u16,
    /// Local address (or host name) to bind: chooses the RDMA device.
    #[arg(short = 'b', long = "bind")]
    bind: Option<String>,
    /// Message bytes (16 for rdma-core's rdma_server).
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Seconds each step may take (address, route, connect, each message).
    #[arg(long, default_value_t = 10)]
    timeout: u64,
}

/// What rdma-core's `rdma_server` answers: 16 bytes, and no `QpInfo`.
const LEGACY_SIZE: usize = 16;
/// The largest message the server accepts.
const MAX_SIZE: usize = 64 << 20;
/// The receive's `wr_id`, to tell its completion from the send's.
const RECV: u64 = 1;

fn main() {
    let args = Args::parse();
    if args.port == 0 {
        fail("bad arguments", "port 0 is not a port a server listens on: choose 1..=65535 with -p");
    }
    if args.size == 0 || args.size > MAX_SIZE {
        fail("bad arguments", format!("--size {} is outside 1..={MAX_SIZE}", args.size));
    }
    let (t, size) = (Duration::from_secs(args.timeout.max(1)), args.size);
    let dst = resolve(&args.addr, args.port);
    let src = args.bind.as_deref().map(|b| resolve(b, 0));

    // rdma_create_event_channel + rdma_create_id(RDMA_PS_TCP). Fails when the rdma_cm kernel
    // module is not loaded (ENODEV, ENOENT: `modprobe rdma_ucm`).
    let client = Client::new().unwrap_or_else(|e| fail("creating the id", e));
    println!("[INFO] Created CM ID");

    // rdma_resolve_addr, then RDMA_CM_EVENT_ADDR_RESOLVED: finds the local device that reaches
    // the server. ETIMEDOUT: the address does not answer ARP (`ip link`: is the link up?
    // `rdma link`: is the RDMA device on that netdev? its GID table: does it have the address?);
    // EADDRNOTAVAIL or ENODEV: no RDMA device serves the route (127.0.0.1 has none).
    let resolved = client.resolve_addr(src, dst, t).unwrap_or_else(|e| fail("resolving the address", e));
    println!("[EVENT] Address resolved");

    // rdma_resolve_route, then RDMA_CM_EVENT_ROUTE_RESOLVED: the path to the server. Fails
    // like the address on a broken link, or when the server's GID is unknown.
    let route = resolved.resolve_route(t).unwrap_or_else(|e| fail("resolving the route", e));
    println!("[EVENT] Route resolved");
    let ctx = route.context().unwrap_or_else(|e| fail("opening the device", e));
    println!("[INFO] Device {}", ctx.device_name());

    // ibv_alloc_pd + ibv_reg_mr, twice: the message, and the buffer the echo lands in. ENOMEM
    // here is nearly always the locked-memory limit: `ulimit -l` (the error says how much).
    let pd = route.alloc_pd().unwrap_or_else(|e| fail("allocating the protection domain", e));
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let started = Instant::now();
    let mut data = MemoryRegion::new(&pd, size, access).unwrap_or_else(|e| fail("registering memory", e));
    let back = MemoryRegion::new(&pd, size, access).unwrap_or_else(|e| fail("registering memory", e));
    println!("[INFO] Memory registration took {:.1} us (2 x {size} bytes)", micros(started));
    // A region the peer may write hands out no slice: its bytes are copied in and out.
    let message: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    data.write_at(0, &message).unwrap_or_else(|e| fail("writing the message", e));

    // ibv_create_cq, then ibv_create_qp and the id's adoption of it (what rdma_create_qp
    // does): the lane (rdma_cm::verbs::lane) owns the completion queue and the QP. EINVAL or
    // ENOMEM: more work requests than the device allows (`ibv_devinfo -v`: max_qp_wr).
    let mut lane = Lane::new(&ctx, 32).unwrap_or_else(|e| fail("creating the completion queue", e));
    let started = Instant::now();
    let init = QpInit::new().max_send_wr(16).max_recv_wr(16);
    let pending = route.lane_qp(&mut lane, &pd, init).unwrap_or_else(|e| fail("creating the QP", e));
    let qp = pending.qp();
    let qp_num = lane.qp_num(qp).unwrap_or_else(|e| fail("reading the QP number", e));
    println!("[INFO] QP creation took {:.1} us (qp_num {qp_num}, 16 send / 16 recv WRs)", micros(started));

    // ibv_post_recv before rdma_connect, so the echo finds it. The receive moves the buffer
    // into the lane; its completion hands it back.
    let info = QpInfo { qp_num, psn: 0, rkey: back.rkey(), vaddr: back.addr(), len: size as u64 };
    lane.post_recv(qp, RecvWr::new(back).wr_id(RECV)).unwrap_or_else(|e| fail("ibv_post_recv", e));

    // rdma_connect with our QpInfo in the private data, then RDMA_CM_EVENT_ESTABLISHED. One
    // RDMA READ in flight each way, and retries without end (7) when a message is lost or the
    // server's receive is not posted yet. REJECTED: nobody listens on that port (or the server
    // refused our request: its log says why); UNREACHABLE or ETIMEDOUT: the server's host
    // does not answer over RDMA (a firewall on UDP 4791 for RoCE, a host down).
    let param = ConnParam::new()
        .responder_resources(1)
        .initiator_depth(1)
        .retry_count(7)
        .rnr_retry_count(7)
        .private_data(&info.encode())
        .unwrap_or_else(|e| fail("building the connect parameters", e));
    println!("[INFO] Connecting to {dst}...");
    let reply = pending.connect(&mut lane, &param, t).unwrap_or_else(|e| fail(&format!("connecting to {dst}"), e));
    println!("[EVENT] Connection established");

    // The server's QpInfo, from the private data of its answer. rdma-core's rdma_server sends
    // none, and answers 16 bytes of its own instead of an echo.
    let legacy = !QpInfo::is_present(&reply);
    if legacy {
        if size != LEGACY_SIZE {
            fail("the server sent no qp_info (rdma-core rdma_server?)", "it only speaks --size 16");
        }
        println!("[INFO] Server sent no qp_info: rdma-core rdma_server protocol, echo content is not checked");
    } else {
        let server = QpInfo::decode(&reply).unwrap_or_else(|e| fail("reading the server's qp_info", e)).0;
        println!("[INFO] Server qp_num {}, rkey {:#x}, vaddr {:#x}", server.qp_num, server.rkey, server.vaddr);
    }

    // ibv_post_send; then ibv_get_cq_event + ibv_poll_cq: `wait` sleeps until a completion
    // comes, the send's and the echo's receive, in either order. A failed completion names
    // its status and cause (RNR retry exceeded: the server posted no receive; remote access
    // error: a wrong rkey).
    lane.post_send(qp, SendWr::send(data, 0..size)).unwrap_or_else(|e| fail("ibv_post_send", e));
    let mut echo = None;
    for _ in 0..2 {
        let mut c = lane.wait(t).and_then(|c| c.ok()).unwrap_or_else(|e| fail("waiting for the echo", e));
        if c.wr_id() == RECV {
            echo = c.take_region().map(|mr| (c.byte_len() as usize, mr));
        }
    }
    let (n, mut back) = echo.expect("a receive's completion hands its buffer back");
    println!("[INFO] Sent {size} bytes");
    println!("[INFO] Received {n} bytes");
    if !legacy {
        let mut got = vec![0u8; n];
        back.read_at(0, &mut got).unwrap_or_else(|e| fail("reading the echo", e));
        if got != message {
            fail("checking the echo", format!("{n} bytes came back, and they differ from the {size} sent"));
        }
        println!("[INFO] Echo verified: 1 x {size} bytes match");
    }
    println!("[INFO] Round-trip completed.");

    // rdma_disconnect, then RDMA_CM_EVENT_DISCONNECTED from the server; the QP is destroyed
    // (rdma_destroy_qp). Then teardown, in reverse order of creation, as the values drop: the
    // lane (ibv_destroy_cq), the buffers (ibv_dereg_mr), the protection domain (ibv_dealloc_pd),
    // the id (rdma_destroy_id) and the event channel.
    lane.disconnect(qp, t).unwrap_or_else(|e| fail("disconnecting", e));
    drop(lane);
    println!("[INFO] Disconnected");
}

/// `host` as an address: an IP address as it is, a name through rdma_getaddrinfo.
fn resolve(host: &str, port: u16) -> SocketAddr {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return SocketAddr::new(ip, port);
    }
    let addrs = rdma_cm::lookup(host, &port.to_string()).unwrap_or_else(|e| fail("bad arguments", e));
    addrs.into_iter().find(SocketAddr::is_ipv4).unwrap_or_else(|| fail("bad arguments", "no IPv4 address"))
}

fn micros(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e6
}

/// Prints the failed step and the error (its errno and usual cause) on one line; exits 1.
fn fail(step: &str, e: impl Display) -> ! {
    eprintln!("error: {step}: {e}");
    std::process::exit(1)
}
