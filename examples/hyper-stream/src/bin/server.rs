//! An HTTP/1.1 server (hyper) over RDMA: rdma-cm's rsocket-compatible stream in place of TCP.
//!
//! ```text
//! cargo run --bin server -- -a 10.77.0.1 -p 7480          # serve until stopped
//! cargo run --bin server -- -a 10.77.0.1 -p 7480 -c 2     # serve two connections, then exit
//! ```
//!
//! Run it on a machine with an RDMA device, from this directory, then `src/bin/client.rs`
//! against it (`tests/stream_hyper.rs` runs both in the Soft-RoCE guest). What it shows: hyper
//! needs nothing but a byte stream that implements tokio's `AsyncRead` and `AsyncWrite`, which
//! `rdma_cm::stream::Stream` does (features `stream` and `tokio`); `hyper_util::rt::TokioIo`
//! adapts it to hyper's own I/O traits. The listener takes connects with `accept_async` on the
//! runtime, and each connection is served by hyper's HTTP/1.1 `serve_connection` in a task of
//! its own:
//!
//! - `GET /` answers a fixed greeting;
//! - `POST /echo` answers the request's body, byte for byte;
//! - anything else is a 404.
//!
//! It prints `[INFO] listening on ADDR` once the listener is bound (a client may connect from
//! then on) and one line per connection accepted and per connection ended.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};

use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rdma_cm::stream::StreamListener;

#[derive(Parser)]
#[command(about = "HTTP/1.1 server (hyper) over rdma-cm's rsocket-compatible stream")]
struct Args {
    /// Address to listen on: an address of the RDMA device's netdev; 0.0.0.0: every device.
    #[arg(short = 'a', long = "addr", default_value = "0.0.0.0")]
    addr: IpAddr,
    /// Port to listen on.
    #[arg(short = 'p', long = "port", default_value_t = 7480)]
    port: u16,
    /// Exit once this many connections were served (default: serve until stopped).
    #[arg(short = 'c', long = "connections")]
    connections: Option<usize>,
}

/// What `GET /` answers.
const GREETING: &str = "hello from hyper over RDMA\n";

/// One request, one response: hyper calls this for every request of a connection.
async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = match (req.method(), req.uri().path()) {
        (&Method::GET, "/") => Response::new(Full::new(Bytes::from_static(GREETING.as_bytes()))),
        (&Method::POST, "/echo") => match req.into_body().collect().await {
            Ok(body) => Response::new(Full::new(body.to_bytes())),
            Err(e) => status(StatusCode::BAD_REQUEST, format!("reading the body: {e}\n")),
        },
        _ => status(StatusCode::NOT_FOUND, "not found\n".into()),
    };
    Ok(response)
}

fn status(code: StatusCode, text: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(text)));
    *r.status_mut() = code;
    r
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let addr = SocketAddr::new(args.addr, args.port);
    // rdma_bind_addr + rdma_listen: fails when no RDMA device has this address.
    let listener = StreamListener::bind(addr).unwrap_or_else(|e| fail("listening", e));
    println!("[INFO] listening on {addr}");

    let mut tasks = tokio::task::JoinSet::new();
    let mut accepted = 0;
    while args.connections != Some(accepted) {
        // A connect request, accepted off the runtime's thread (the CM's calls block).
        let stream = match listener.accept_async().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("[WARN] accepting a connection: {e}");
                continue;
            }
        };
        accepted += 1;
        let peer = stream.peer_addr().map_or("?".to_string(), |a| a.to_string());
        println!("[INFO] connection {accepted} from {peer}");
        tasks.spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), hyper::service::service_fn(handle))
                .await;
            match &served {
                Ok(()) => println!("[INFO] connection from {peer} closed"),
                Err(e) => println!("[ERROR] connection from {peer}: {e}"),
            }
            served.is_ok()
        });
    }
    // With -c: wait for the connections' ends; any that failed fails the server.
    let mut failed = 0;
    while let Some(ok) = tasks.join_next().await {
        failed += usize::from(!ok.unwrap_or(false));
    }
    if failed > 0 {
        fail("serving", format!("{failed} of {accepted} connections failed"));
    }
    println!("[INFO] served {accepted} connections");
}

fn fail(step: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("error: {step}: {e}");
    std::process::exit(1)
}
