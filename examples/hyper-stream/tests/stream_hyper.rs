//! The example's server and client binaries, end to end on the RDMA device: the server serves
//! two connections and exits; two clients at once each send `GET /` and three `POST /echo` of
//! 1 MiB on one connection and check every answer byte for byte (src/bin/client.rs). Then, in
//! one process, how hyper's connections end on the stream: 300 requests on one connection
//! closed by the server (`connection: close`), a client gone mid-body, a graceful shutdown.
//!
//! A device test: it fails when the machine has no RDMA device with an IPv4 address. Run it from
//! anywhere in the repository, so cargo finds its runner (.cargo/config.toml: harness/runner),
//! which starts the Soft-RoCE guest where this machine has no device: `cargo test` in this
//! directory, or `cargo test --manifest-path examples/hyper-stream/Cargo.toml` at the root.

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::thread;
use std::time::{Duration, Instant};

/// The bound of every wait: the guest emulates its CPU, and a loaded machine slows it further.
const BOUND: Duration = Duration::from_secs(120);

/// The first RDMA device with an ACTIVE port 1 whose netdev has an IPv4 address: its name and
/// that address. Panics when there is none: this test never passes without a device.
fn device() -> (String, IpAddr) {
    let devices: Vec<_> = std::fs::read_dir("/sys/class/infiniband").map(|d| d.flatten().collect()).unwrap_or_default();
    for dev in devices {
        let port = dev.path().join("ports/1");
        let active = std::fs::read_to_string(port.join("state")).is_ok_and(|s| s.contains("ACTIVE"));
        let netdev = std::fs::read_to_string(port.join("gid_attrs/ndevs/0")).unwrap_or_default();
        if !active || netdev.trim().is_empty() {
            continue;
        }
        let out = Command::new("ip").args(["-4", "-o", "addr", "show", "dev", netdev.trim()]).output();
        let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        // "2: eth0    inet 10.77.0.1/24 brd ..."
        let ip = text.split_whitespace().skip_while(|w| *w != "inet").nth(1).and_then(|a| a.split('/').next());
        if let Some(ip) = ip.and_then(|a| a.parse().ok()) {
            return (dev.file_name().to_string_lossy().into_owned(), ip);
        }
    }
    panic!(
        "no RDMA device with an IPv4 address: this is a device test. Run it with `cargo test` from \
         within the repository, where cargo's runner (harness/runner) starts a Soft-RoCE guest"
    );
}

/// A child process that is killed (by its own pid) if the test ends before it does.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(bin: &str, args: &[String]) -> (Proc, Receiver<String>) {
    let mut child =
        Command::new(bin).args(args).stdout(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("starting {bin}: {e}"));
    let out = child.stdout.take().unwrap();
    let (tx, rx) = channel();
    thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("  | {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (Proc(child), rx)
}

/// The lines `p` prints until it exits (its stdout closes), then its exit status; bounded.
fn finish(mut p: Proc, lines: Receiver<String>, what: &str) -> Vec<String> {
    let deadline = Instant::now() + BOUND;
    let mut seen = Vec::new();
    while let Ok(l) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        seen.push(l);
    }
    assert!(Instant::now() < deadline, "{what} did not finish within {BOUND:?}; it printed {seen:?}");
    loop {
        if let Some(status) = p.0.try_wait().unwrap() {
            assert!(status.success(), "{what} failed ({status}); it printed {seen:?}");
            return seen;
        }
        assert!(Instant::now() < deadline, "{what} closed its output but did not exit within {BOUND:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn hyper_get_and_1_mib_echoes_on_two_connections_at_once() {
    let (name, ip) = device();
    println!("device {name}, address {ip}");
    let port = "7480".to_string();

    let (server, server_lines) = start(
        env!("CARGO_BIN_EXE_server"),
        &["-a".into(), ip.to_string(), "-p".into(), port.clone(), "-c".into(), "2".into()],
    );
    // Synchronised on the server's own word that its listener is bound.
    let first = server_lines.recv_timeout(BOUND).expect("the server's first line");
    assert!(first.starts_with("[INFO] listening on"), "the server's first line: {first:?}");

    let client_args =
        ["-a".into(), ip.to_string(), "-p".into(), port, "-n".into(), "3".into(), "-s".into(), "1048576".into()];
    let clients: Vec<_> = (0..2).map(|_| start(env!("CARGO_BIN_EXE_client"), &client_args)).collect();
    for (i, (c, lines)) in clients.into_iter().enumerate() {
        let out = finish(c, lines, &format!("client {i}"));
        assert!(
            out.iter().any(|l| l.starts_with("[INFO] ok: GET / and 3 x POST /echo of 1048576 bytes")),
            "client {i}: {out:?}"
        );
    }

    let out = finish(server, server_lines, "the server");
    assert!(out.iter().filter(|l| l.ends_with(" closed")).count() == 2, "the server: {out:?}");
    assert!(out.last().is_some_and(|l| l == "[INFO] served 2 connections"), "the server: {out:?}");
    // Whether both were accepted before either closed (they are started together, so they
    // should be; printed, not asserted: the order of two processes is the scheduler's).
    let second_accepted = out.iter().position(|l| l.starts_with("[INFO] connection 2 from"));
    let first_closed = out.iter().position(|l| l.ends_with(" closed"));
    println!("the two connections were open at once: {}", second_accepted < first_closed);
}

// In one process: hyper's own corners on the stream, both ends on one current-thread runtime.

mod in_process {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use http_body_util::{BodyExt, Full};
    use hyper::body::{Bytes, Incoming};
    use hyper::{Request, Response};
    use hyper_util::rt::TokioIo;
    use rdma_cm::stream::{Stream, StreamListener};
    use tokio::io::AsyncWriteExt;

    const T: Duration = Duration::from_secs(10);
    const BOUND: Duration = super::BOUND;

    fn run<F: std::future::Future>(f: F) -> F::Output {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async { tokio::time::timeout(BOUND, f).await.expect("the test within its bound") })
    }

    async fn echo(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
        Ok(Response::new(Full::new(req.into_body().collect().await?.to_bytes())))
    }

    type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

    /// Accepts one stream and serves `echo` on it until the connection ends.
    async fn serve_one(listener: StreamListener) -> Result<(), hyper::Error> {
        let s = listener.accept_async().await.expect("accept_async");
        let service = hyper::service::service_fn(echo);
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), service).await
    }

    async fn post(sender: &mut Sender, body: Bytes, close: bool) -> Bytes {
        let mut req = Request::post("/echo").header("host", "x");
        if close {
            req = req.header("connection", "close");
        }
        let res = sender.send_request(req.body(Full::new(body)).unwrap()).await.expect("send_request");
        assert!(res.status().is_success(), "{}", res.status());
        res.into_body().collect().await.expect("the response's body").to_bytes()
    }

    /// 300 small requests one after the other on one connection (more messages each way than
    /// the 128 credits either side grants), then one that asks the server to close
    /// (`connection: close`): the server shuts its writing down after the response, the
    /// client's connection ends without an error, and so does the server's.
    #[test]
    fn many_small_requests_then_the_server_closes() {
        let (_, ip) = super::device();
        let addr = SocketAddr::new(ip, 7481);
        run(async {
            let listener = StreamListener::bind(addr).unwrap();
            let server = tokio::spawn(serve_one(listener));
            let s = Stream::connect_async(addr, T).await.expect("connect_async");
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.unwrap();
            let conn = tokio::spawn(conn);
            let start = Instant::now();
            for i in 0..300u32 {
                let body = Bytes::from(format!("request {i} {}", "x".repeat(i as usize % 100)));
                assert_eq!(post(&mut sender, body.clone(), false).await, body);
            }
            println!("300 requests on one connection: {:?} each", start.elapsed() / 300);
            assert_eq!(post(&mut sender, Bytes::from_static(b"last"), true).await, &b"last"[..]);
            conn.await.unwrap().expect("the client's connection ends cleanly after the server's close");
            server.await.unwrap().expect("the server's connection ends cleanly");
        });
    }

    /// A client that sends the head and part of a body, then vanishes (its stream dropped: a
    /// DISCONNECT): the server's connection ends with hyper's error, not a hang.
    #[test]
    fn a_client_gone_mid_body_fails_the_servers_connection() {
        let (_, ip) = super::device();
        let addr = SocketAddr::new(ip, 7482);
        run(async {
            let listener = StreamListener::bind(addr).unwrap();
            let server = tokio::spawn(serve_one(listener));
            let mut s = Stream::connect_async(addr, T).await.expect("connect_async");
            s.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1048576\r\n\r\n").await.unwrap();
            s.write_all(&[7u8; 65536]).await.unwrap();
            s.flush().await.unwrap();
            drop(s);
            let err = server.await.unwrap().expect_err("the server's connection fails");
            println!("the server's connection, its client gone mid-body: {err} ({err:?})");
        });
    }

    /// An idle keep-alive connection ended by the server's graceful shutdown: hyper shuts the
    /// stream's writing down, and the client's connection sees the end and ends cleanly.
    #[test]
    fn a_graceful_shutdown_ends_an_idle_connection() {
        let (_, ip) = super::device();
        let addr = SocketAddr::new(ip, 7483);
        run(async {
            let listener = StreamListener::bind(addr).unwrap();
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(async move {
                let s = listener.accept_async().await.expect("accept_async");
                let service = hyper::service::service_fn(echo);
                let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), service);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    r = conn.as_mut() => return r,
                    _ = stop_rx => conn.as_mut().graceful_shutdown(),
                }
                conn.await
            });
            let s = Stream::connect_async(addr, T).await.expect("connect_async");
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.unwrap();
            let conn = tokio::spawn(conn);
            assert_eq!(post(&mut sender, Bytes::from_static(b"one"), false).await, &b"one"[..]);
            stop_tx.send(()).unwrap();
            server.await.unwrap().expect("the server's connection ends cleanly");
            conn.await.unwrap().expect("the client's connection ends cleanly");
        });
    }
}
