//! rdma-core's `rstream` test, over this crate's rsocket-compatible stream (feature `stream`),
//! or over TCP (`--tcp`, the reference line): the same transfers and the same result line, so
//! the three read side by side (`harness/bench-stream`).
//!
//! ```text
//! cargo run --release --features stream --example stream_perf -- -b 10.77.0.1 -S 65536 -C 1000      # server
//! cargo run --release --features stream --example stream_perf -- -s 10.77.0.1 -S 65536 -C 1000      # client
//! rstream -b 10.77.0.1 -S 65536 -C 1000 -T b                                                          # the same, in C
//! ```
//!
//! As `rstream`: after a 16-byte exchange both ways, each of `-I` iterations sends `-C`
//! messages of `-S` bytes from the client to the server, then as many back; the client prints
//! rstream's line, `name size xfers iters bytes seconds Gb/sec usec/xfer` (sizes in bytes where
//! rstream abbreviates them), the bytes both ways counted. A
//! latency test is `-C 1` with many iterations, a bandwidth test one iteration of many
//! messages. Because the stream speaks rsocket's protocol, either end may be `rstream` itself.
//! With `--zero-copy` each end sends from a registered region (`Stream::write_region`)
//! instead of copying into the send buffer: the peer cannot tell the difference.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::exit;
use std::time::{Duration, Instant};

use rdma_cm::stream::{Stream, StreamListener};
use rdma_cm::{AccessFlags, MemoryRegion};

const T: Duration = Duration::from_secs(30);

struct Args {
    client: Option<String>,
    bind: Option<String>,
    port: u16,
    size: usize,
    count: usize,
    iters: usize,
    tcp: bool,
    zero_copy: bool,
}

/// How a transfer's bytes go out: copied (`write_all`), or, for the stream with
/// `--zero-copy`, RDMA-WRITTEN straight from `region`.
trait Out: Read + Write {
    fn send(&mut self, buf: &[u8], region: &mut Option<MemoryRegion>) -> std::io::Result<()> {
        let _ = region;
        self.write_all(buf)
    }
}

impl Out for TcpStream {}

impl Out for Stream {
    /// From the region when there is one: it moves into `write_region` and comes back.
    fn send(&mut self, buf: &[u8], region: &mut Option<MemoryRegion>) -> std::io::Result<()> {
        match region.take() {
            Some(mr) => *region = Some(self.write_region(mr, 0..buf.len())?),
            None => self.write_all(buf)?,
        }
        Ok(())
    }
}

fn usage() -> ! {
    eprintln!("usage: stream_perf (-s server_address | -b bind_address) [-p port] [-S size] [-C count] [-I iterations] [--tcp | --zero-copy]");
    exit(1)
}

fn parse() -> Args {
    let mut a =
        Args { client: None, bind: None, port: 7471, size: 1000, count: 1000, iters: 1, tcp: false, zero_copy: false };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        if f == "--tcp" || f == "--zero-copy" {
            (a.tcp, a.zero_copy) = (a.tcp || f == "--tcp", a.zero_copy || f == "--zero-copy");
            continue;
        }
        let v = it.next().unwrap_or_else(|| usage());
        let num = |v: &str| v.parse::<usize>().unwrap_or_else(|_| usage());
        match f.as_str() {
            "-s" => a.client = Some(v),
            "-b" => a.bind = Some(v),
            "-p" => a.port = v.parse().unwrap_or_else(|_| usage()),
            "-S" => a.size = num(&v),
            "-C" => a.count = num(&v),
            "-I" => a.iters = num(&v),
            _ => usage(),
        }
    }
    if a.client.is_some() == a.bind.is_some() || a.size == 0 || a.count == 0 || a.iters == 0 || a.tcp && a.zero_copy {
        usage();
    }
    a
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("[ERROR] {what}: {e}");
    exit(1)
}

/// rstream's `run_test`: the exchange, timed from after the 16-byte sync. The transfers are
/// sent from `region` when one is given (the sync is copied).
fn run<S: Out>(s: &mut S, client: bool, a: &Args, mut region: Option<MemoryRegion>) -> Duration {
    let mut buf = vec![0u8; a.size.max(16)];
    let mut xfer = |s: &mut S, send: bool, n: usize, region: &mut Option<MemoryRegion>| {
        let r = if send { s.send(&buf[..n], region) } else { s.read_exact(&mut buf[..n]) };
        r.unwrap_or_else(|e| fail(if send { "send" } else { "receive" }, e));
    };
    xfer(s, client, 16, &mut None);
    xfer(s, !client, 16, &mut None);
    let start = Instant::now();
    for _ in 0..a.iters {
        for _ in 0..a.count {
            xfer(s, client, a.size, &mut region);
        }
        for _ in 0..a.count {
            xfer(s, !client, a.size, &mut region);
        }
    }
    start.elapsed()
}

/// The stream's run: with `--zero-copy`, from a region of the transfer's size registered on
/// the stream's protection domain.
fn run_stream(s: &mut Stream, client: bool, a: &Args) -> Duration {
    let region = a.zero_copy.then(|| {
        MemoryRegion::new(s.pd(), a.size, AccessFlags::empty()).unwrap_or_else(|e| fail("registering the region", e))
    });
    run(s, client, a, region)
}

/// rstream's `show_perf` line.
fn show(a: &Args, took: Duration) {
    let usec = took.as_secs_f64() * 1e6;
    let bytes = (a.iters * a.count * a.size * 2) as f64;
    println!(
        "{:<10}{:<8}{:<8}{:<8}{:<8}{:8.2}s{:10.2}{:11.2}",
        "custom",
        a.size,
        a.count,
        a.iters,
        bytes as u64,
        usec / 1e6,
        bytes * 8.0 / (1000.0 * usec),
        usec / a.iters as f64 / (a.count * 2) as f64
    );
}

fn main() {
    let a = parse();
    let host = a.client.as_deref().or(a.bind.as_deref()).unwrap_or_else(|| usage());
    let addr: SocketAddr = format!("{host}:{}", a.port).parse().unwrap_or_else(|e| fail("the address", e));
    let client = a.client.is_some();
    let took = match (a.tcp, client) {
        (false, true) => run_stream(&mut Stream::connect(addr, T).unwrap_or_else(|e| fail("connect", e)), true, &a),
        (false, false) => {
            let l = StreamListener::bind(addr).unwrap_or_else(|e| fail("listen", e));
            println!("[INFO] Listening on {addr}");
            let mut s = l.accept(Duration::from_secs(120)).unwrap_or_else(|e| fail("accept", e));
            let took = run_stream(&mut s, false, &a);
            // Until the client has read everything: then its close ends our stream.
            let _ = s.read(&mut [0u8; 1]);
            took
        }
        (true, true) => {
            let mut s = TcpStream::connect_timeout(&addr, T).unwrap_or_else(|e| fail("connect", e));
            s.set_nodelay(true).unwrap_or_else(|e| fail("TCP_NODELAY", e));
            run(&mut s, true, &a, None)
        }
        (true, false) => {
            let l = TcpListener::bind(addr).unwrap_or_else(|e| fail("listen", e));
            println!("[INFO] Listening on {addr}");
            let (mut s, _) = l.accept().unwrap_or_else(|e| fail("accept", e));
            s.set_nodelay(true).unwrap_or_else(|e| fail("TCP_NODELAY", e));
            let took = run(&mut s, false, &a, None);
            let _ = s.read(&mut [0u8; 1]);
            took
        }
    };
    if client {
        println!("name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer");
        show(&a, took);
    }
}
