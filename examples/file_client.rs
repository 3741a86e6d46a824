//! Fetches a file from `examples/file_server.rs` by RDMA READ: the whole file, or a byte
//! range, in chunks, into one registered buffer; writes it to a local file and prints its
//! checksum (64-bit FNV-1a).
//!
//! ```text
//! cargo run --example file_client --features memmap2 -- -a 10.77.0.1 -o copy.bin
//! cargo run --example file_client --features memmap2 -- -a 10.77.0.1 -p 7471 --offset 4096 --length 65536
//! ```
//!
//! Start the server first. The server's CPU takes no part in the transfer: each READ is served
//! by its device, straight from the file's pages, which it registered in place. Here, every
//! chunk lands in our registered buffer and is written out from there.

use std::fmt::Display;
use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::Parser;
use rdma_cm::verbs::lane::{Lane, SendWr};
use rdma_cm::{AccessFlags, Client, ConnParam, Error, MemoryRegion, QpInfo, QpInit};

#[derive(Parser)]
#[command(about = "Fetches a file from file_server by RDMA READ, in chunks")]
struct Args {
    /// Server address or host name.
    #[arg(short = 'a', long = "addr")]
    addr: String,
    /// Server port.
    #[arg(short = 'p', long = "port", default_value_t = 7471)]
    port: u16,
    /// Where to write what was read (without it, only the checksum is printed).
    #[arg(short = 'o', long = "output")]
    output: Option<String>,
    /// First byte of the file to read.
    #[arg(long, default_value_t = 0)]
    offset: u64,
    /// Bytes to read (default: to the end of the file).
    #[arg(long)]
    length: Option<u64>,
    /// Bytes per READ: the size of the registered buffer.
    #[arg(long, default_value_t = 1 << 20)]
    chunk: usize,
    /// Seconds each step may take (address, route, connect, each READ).
    #[arg(long, default_value_t = 10)]
    timeout: u64,
}

fn main() {
    let args = Args::parse();
    if args.port == 0 || args.chunk == 0 {
        fail("bad arguments", "choose a port in 1..=65535 with -p, and a --chunk of at least 1 byte");
    }
    let t = Duration::from_secs(args.timeout.max(1));
    let dst = resolve(&args.addr, args.port);

    // rdma_create_id, rdma_resolve_addr, rdma_resolve_route: as in examples/client.rs.
    let client = Client::new().unwrap_or_else(|e| fail("creating the id", e));
    let resolved = client.resolve_addr(None, dst, t).unwrap_or_else(|e| fail("resolving the address", e));
    let route = resolved.resolve_route(t).unwrap_or_else(|e| fail("resolving the route", e));
    let ctx = route.context().unwrap_or_else(|e| fail("opening the device", e));

    // The buffer each READ lands in. The device writes it, so it needs LOCAL_WRITE; no peer
    // may touch it, so no remote rights (and it can be read as a plain slice).
    let pd = route.alloc_pd().unwrap_or_else(|e| fail("allocating the protection domain", e));
    let mut buf = Some(
        MemoryRegion::new(&pd, args.chunk, AccessFlags::LOCAL_WRITE).unwrap_or_else(|e| fail("registering memory", e)),
    );
    let mut lane = Lane::new(&ctx, 8).unwrap_or_else(|e| fail("creating the completion queue", e));
    let init = QpInit::new().max_send_wr(4).max_recv_wr(1);
    let pending = route.lane_qp(&mut lane, &pd, init).unwrap_or_else(|e| fail("creating the QP", e));
    let qp = pending.qp();

    // rdma_connect. A READ is a request this side sends and the server's device answers, so
    // this side needs an initiator depth (READs it may have in flight) and the server a
    // responder resource for each: ConnParam's default asks what the device allows (0 would
    // forbid READs). This client keeps one READ in flight; a deeper pipeline would post up to
    // the depth agreed (lane.attributes(qp): max_rd_atomic) before waiting.
    let param = ConnParam::new();
    let reply = pending.connect(&mut lane, &param, t).unwrap_or_else(|e| {
        // A server that refuses says why in the reject's private data.
        let why = match &e {
            Error::UnexpectedEvent { private_data, .. } => {
                String::from_utf8_lossy(private_data).trim_end_matches('\0').to_string()
            }
            _ => String::new(),
        };
        fail(&format!("connecting to {dst}"), if why.is_empty() { e.to_string() } else { format!("{e}: \"{why}\"") })
    });
    println!("[EVENT] Connected to {dst}");

    // The file's address, rkey and length, from the accept's private data (untrusted: decoded
    // with checks). Its length is the file's size when the server mapped it.
    let info = QpInfo::decode(&reply).unwrap_or_else(|e| fail("reading the server's QpInfo", e)).0;
    let file = info.region().unwrap_or_else(|| fail("reading the server's QpInfo", "it advertises no file"));
    println!("[INFO] File of {} bytes at {:#x}, rkey {:#x}", file.len, file.addr, file.rkey);
    let len = args.length.unwrap_or(file.len.saturating_sub(args.offset));
    let end = args.offset.checked_add(len).filter(|&e| e <= file.len);
    let Some(end) = end else {
        let _ = lane.disconnect(qp, t);
        fail(
            "bad range",
            format!(
                "--offset {} --length {len} reaches past the end of the file, which has {} bytes",
                args.offset, file.len
            ),
        );
    };

    let mut out = args.output.as_ref().map(|p| File::create(p).unwrap_or_else(|e| fail(&format!("creating {p}"), e)));

    // ibv_post_send(IBV_WR_RDMA_READ), one chunk at a time: the READ moves the buffer into the
    // lane, and its completion hands it back, filled. A remote access error here means a
    // wrong rkey, a range the server did not register, or a server without REMOTE_READ.
    let started = Instant::now();
    let (mut at, mut hash) = (args.offset, Fnv::new());
    while at < end {
        let n = (end - at).min(args.chunk as u64) as usize;
        let wr = SendWr::read(buf.take().expect("handed back by each completion"), 0..n, &file, at);
        lane.post_send(qp, wr).unwrap_or_else(|e| fail("posting the READ", e));
        let mut c = lane.wait(t).and_then(|c| c.ok()).unwrap_or_else(|e| fail(&format!("reading at {at}"), e));
        let mut mr = c.take_region().expect("a READ's completion hands its buffer back");
        let bytes = &mr.as_slice().unwrap_or_else(|e| fail("reading the buffer", e))[..n];
        hash.update(bytes);
        if let Some(f) = out.as_mut() {
            f.write_all(bytes).unwrap_or_else(|e| fail("writing the output", e));
        }
        buf = Some(mr);
        at += n as u64;
    }
    let secs = started.elapsed().as_secs_f64();
    println!("[INFO] Read {len} bytes ({}..{end}) in {secs:.3} s", args.offset);
    println!("[INFO] fnv1a64 {:016x}", hash.0);
    if let Some(f) = out {
        f.sync_all().unwrap_or_else(|e| fail("writing the output", e));
        println!("[INFO] Wrote {}", args.output.as_deref().unwrap_or_default());
    }

    // rdma_disconnect; the server sees DISCONNECTED and serves its next client.
    lane.disconnect(qp, t).unwrap_or_else(|e| fail("disconnecting", e));
    println!("[INFO] Disconnected");
}

/// 64-bit FNV-1a, a checksum that needs no dependency (`file_client` against a local copy:
/// the same value means the same bytes, with high probability).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
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
