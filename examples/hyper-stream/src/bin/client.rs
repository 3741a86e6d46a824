//! An HTTP/1.1 client (hyper) over RDMA: rdma-cm's rsocket-compatible stream in place of TCP.
//!
//! ```text
//! cargo run --bin client -- -a 10.77.0.1 -p 7480                   # GET, then 3 POSTs of 1 MiB
//! cargo run --bin client -- -a 10.77.0.1 -p 7480 -n 10 -s 65536
//! ```
//!
//! Run it on a machine with an RDMA device, from this directory, once `src/bin/server.rs`
//! listens (`tests/stream_hyper.rs` runs both in the Soft-RoCE guest). What it shows: one RDMA
//! connection (`Stream::connect_async`) handed to hyper's HTTP/1.1 client handshake through
//! `hyper_util::rt::TokioIo`; hyper's connection task runs beside the requests, which go one
//! after the other on that connection (keep-alive). It sends `GET /` and checks the greeting,
//! then `-n` times `POST /echo` with a body of `-s` bytes (a pattern that differs per request)
//! and checks that the answer is the same bytes. It prints one `[INFO] ok: ...` line, or says
//! what differed and exits with 1.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::Parser;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rdma_cm::stream::Stream;

#[derive(Parser)]
#[command(about = "HTTP/1.1 client (hyper) over rdma-cm's rsocket-compatible stream")]
struct Args {
    /// Server address.
    #[arg(short = 'a', long = "addr")]
    addr: IpAddr,
    /// Server port.
    #[arg(short = 'p', long = "port", default_value_t = 7480)]
    port: u16,
    /// Bytes in each POST's body.
    #[arg(short = 's', long = "size", default_value_t = 1 << 20)]
    size: usize,
    /// POSTs to send, one after the other on the one connection.
    #[arg(short = 'n', long = "requests", default_value_t = 3)]
    requests: usize,
}

/// What the server's `GET /` answers.
const GREETING: &str = "hello from hyper over RDMA\n";

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let addr = SocketAddr::new(args.addr, args.port);
    let start = Instant::now();
    // rdma_resolve_addr, rdma_resolve_route, rdma_connect, bounded by the timeout.
    let stream = Stream::connect_async(addr, Duration::from_secs(10)).await.unwrap_or_else(|e| fail("connecting", e));
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap_or_else(|e| fail("handshake", e));
    // The connection's reads and writes: driven by this task until the sender is dropped.
    let conn = tokio::spawn(conn);

    let req = Request::get("/").header("host", addr.to_string()).body(Empty::<Bytes>::new().boxed()).unwrap();
    let res = sender.send_request(req).await.unwrap_or_else(|e| fail("GET /", e));
    let status = res.status();
    let body = res.into_body().collect().await.unwrap_or_else(|e| fail("GET /: the body", e)).to_bytes();
    if status != StatusCode::OK || body != GREETING.as_bytes() {
        fail("GET /", format!("{status}, {:?}", String::from_utf8_lossy(&body)));
    }

    for i in 0..args.requests {
        let sent = pattern(args.size, i);
        let req = Request::builder()
            .method(Method::POST)
            .uri("/echo")
            .header("host", addr.to_string())
            .body(Full::new(sent.clone()).boxed())
            .unwrap();
        let res = sender.send_request(req).await.unwrap_or_else(|e| fail("POST /echo", e));
        let status = res.status();
        let body = res.into_body().collect().await.unwrap_or_else(|e| fail("POST /echo: the body", e)).to_bytes();
        if status != StatusCode::OK {
            fail("POST /echo", status);
        }
        if body != sent {
            let at = body.iter().zip(sent.iter()).position(|(a, b)| a != b).unwrap_or(body.len().min(sent.len()));
            fail(
                "POST /echo",
                format!("request {i}: {} bytes back for {} sent, first difference at {at}", body.len(), sent.len()),
            );
        }
    }

    // No more requests: hyper's connection ends (it shuts the stream's writing down), and so does its task.
    drop(sender);
    conn.await.unwrap_or_else(|e| fail("the connection's task", e)).unwrap_or_else(|e| fail("the connection", e));
    println!(
        "[INFO] ok: GET / and {} x POST /echo of {} bytes echoed identical on one connection in {:.0?}",
        args.requests,
        args.size,
        start.elapsed()
    );
}

/// `len` bytes that differ per request `seed` and that no offset or order mistake reproduces.
fn pattern(len: usize, seed: usize) -> Bytes {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn fail(step: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("error: {step}: {e}");
    std::process::exit(1)
}
