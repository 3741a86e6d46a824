//! The verbs-only examples (`rc_pingpong`, `ud_pingpong`, `srq_pingpong`) as processes,
//! against themselves and against rdma-core's `ibv_rc_pingpong`, `ibv_ud_pingpong` and
//! `ibv_srq_pingpong` both ways (ours as the server with theirs as the client, and the
//! reverse), and against a peer that sends garbage over the TCP exchange.
//!
//! Each pair: the server starts, the test waits until its TCP port is listening (the kernel's
//! socket table; our servers also print their address only once they listen), the client runs;
//! both must exit 0, print the closing figures, and name each other's QP: the client's
//! "remote address" is the server's "local address". Every wait is bounded.
//!
//! Run alone, build the examples first (`cargo test --test pingpong` builds only this binary):
//! `cargo build --all-features --examples && cargo test --all-features --test pingpong`. A
//! stale example is refused.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::DeviceTest;
use rdma_cm::{devices, VerbsContext};

/// How long one side of a pair may run.
const RUN: Duration = Duration::from_secs(120);

use common::example;

/// The GID index of the RoCE v2 GID of the device's IPv4 address (what `-g` is given). An
/// iWARP device's GIDs carry its MAC, not an address: its first, index 0, for the tests that
/// run there (the refusals, made before any connection, which iWARP could not make without
/// the CM).
fn gid_index(addr: IpAddr) -> String {
    if common::caps::iwarp() {
        return "0".into();
    }
    let name = devices().unwrap().into_iter().next().expect("a device").name;
    let ctx = VerbsContext::open(&name).unwrap();
    common::rocev2_gid_index(&ctx, addr).to_string()
}

/// A program of either side, its stdout and stderr collected line by line.
struct Proc {
    what: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    fn spawn(program: PathBuf, args: &[&str]) -> Proc {
        let what = format!("{} {}", program.file_name().unwrap().to_string_lossy(), args.join(" "));
        let mut child = Command::new(&program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let (tx, rx) = mpsc::channel();
        for r in
            [Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>, Box::new(child.stderr.take().unwrap())]
        {
            let tx = tx.clone();
            thread::spawn(move || {
                for l in BufReader::new(r).lines().map_while(Result::ok) {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            });
        }
        Proc { what, child, lines: rx, seen: vec![] }
    }

    fn wait_line(&mut self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.seen.iter().any(|l| l.contains(needle)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!("{} never printed {needle:?}; it printed:\n{}", self.what, self.seen.join("\n")),
            }
        }
    }

    /// Waits (bounded) for the exit; returns the exit code and the whole output.
    fn finish(mut self) -> (i32, String) {
        let deadline = Instant::now() + RUN;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
                    self.seen.push(l);
                }
                panic!("{} did not exit within {RUN:?}; output:\n{}", self.what, self.seen.join("\n"));
            }
            // The child's exit is an event this loop cannot block on without a second thread;
            // it polls it, bounded by the deadline.
            thread::sleep(Duration::from_millis(20));
        };
        // Its pipes end with it: read to that end (bounded).
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(30)) {
            self.seen.push(l);
        }
        (status.code().unwrap_or(-1), self.seen.join("\n"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether a socket listens on TCP `port` (IPv4 or IPv6), from the kernel's socket tables.
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X} ");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).unwrap_or_default().lines().skip(1).any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && format!("{} ", cols[1]).ends_with(&want) && cols[3] == "0A"
        })
    })
}

fn wait_listening(server: &mut Proc, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !listening(port) {
        if let Ok(Some(s)) = server.child.try_wait() {
            while let Ok(l) = server.lines.recv_timeout(Duration::from_secs(5)) {
                server.seen.push(l);
            }
            panic!("{} exited ({s}) before listening:\n{}", server.what, server.seen.join("\n"));
        }
        assert!(Instant::now() < deadline, "{} never listened on port {port}", server.what);
        thread::sleep(Duration::from_millis(10));
    }
}

/// The QPN of the first `  local address:` or `  remote address:` line of `out`.
fn qpn(out: &str, which: &str) -> String {
    let l = out.lines().find(|l| l.contains(which)).unwrap_or_else(|| panic!("no {which:?} line in:\n{out}"));
    let at = l.find("QPN ").unwrap_or_else(|| panic!("no QPN in {l:?}")) + 4;
    l[at..at + 8].to_string()
}

#[derive(Clone, Copy)]
enum Side {
    Ours,
    Theirs,
}

fn program(example_name: &str, tool: &str, side: Side) -> PathBuf {
    match side {
        Side::Ours => example(example_name),
        Side::Theirs => PathBuf::from(tool),
    }
}

/// Runs one pair: `server` on `port`, then `client` against it, both with `args`; asserts
/// both succeed, print `iters` exchanges and name each other's QPs. Returns both outputs, or
/// `None` when the device cannot connect QPs that way (skipped, with its line).
fn run_pair(
    example_name: &str,
    tool: &str,
    server: Side,
    client: Side,
    port: u16,
    args: &[&str],
) -> Option<(String, String)> {
    let t = DeviceTest::start();
    // Every pair connects its QPs from the exchanged info, by RTR/RTS: not on iWARP.
    if !common::require(common::Cap::ConnectWithoutCm) {
        return None;
    }
    let (host, gidx) = (t.addr.to_string(), gid_index(t.addr));
    let port_s = port.to_string();
    let mut common_args = vec!["-g", &gidx, "-p", &port_s];
    common_args.extend_from_slice(args);
    let mut srv = Proc::spawn(program(example_name, tool, server), &common_args);
    if let Side::Ours = server {
        // Ours binds before it prints anything.
        srv.wait_line("local address", Duration::from_secs(30));
    }
    wait_listening(&mut srv, port);
    let mut client_args = common_args.clone();
    client_args.push(&host);
    let cli = Proc::spawn(program(example_name, tool, client), &client_args);
    let (ccode, cout) = cli.finish();
    let (scode, sout) = srv.finish();
    let iters = args.windows(2).find(|w| w[0] == "-n").map_or("1000", |w| w[1]);
    for (who, code, out) in [("server", scode, &sout), ("client", ccode, &cout)] {
        assert_eq!(code, 0, "{who} failed:\n--- server\n{sout}\n--- client\n{cout}");
        assert!(out.contains(&format!("{iters} iters in")), "{who} printed no figures:\n{out}");
        assert!(out.contains(" bytes in "), "{who}:\n{out}");
        assert!(!out.contains("invalid data"), "{who} found bad bytes:\n{out}");
    }
    assert_eq!(qpn(&cout, "remote address"), qpn(&sout, "local address"), "client's peer is the server's QP");
    assert_eq!(qpn(&sout, "remote address"), qpn(&cout, "local address"), "server's peer is the client's QP");
    t.finish();
    Some((sout, cout))
}

const RC: (&str, &str) = ("rc_pingpong", "ibv_rc_pingpong");
const UD: (&str, &str) = ("ud_pingpong", "ibv_ud_pingpong");
const SRQ: (&str, &str) = ("srq_pingpong", "ibv_srq_pingpong");
const RC_ARGS: &[&str] = &["-n", "200", "-c"];
// 1024 bytes: within the active MTU of any RoCE netdev with a standard 1500-byte MTU.
const UD_ARGS: &[&str] = &["-n", "200", "-s", "1024", "-c"];
const SRQ_ARGS: &[&str] = &["-n", "200", "-q", "8"];

#[test]
fn rc_ours_with_ours() {
    run_pair(RC.0, RC.1, Side::Ours, Side::Ours, 18601, RC_ARGS);
}

#[test]
fn rc_ours_serves_ibv_rc_pingpong() {
    run_pair(RC.0, RC.1, Side::Ours, Side::Theirs, 18602, RC_ARGS);
}

#[test]
fn rc_ibv_rc_pingpong_serves_ours() {
    run_pair(RC.0, RC.1, Side::Theirs, Side::Ours, 18603, RC_ARGS);
}

#[test]
fn ud_ours_with_ours() {
    if common::require(common::Cap::Ud) {
        run_pair(UD.0, UD.1, Side::Ours, Side::Ours, 18611, UD_ARGS);
    }
}

#[test]
fn ud_ours_serves_ibv_ud_pingpong() {
    if common::require(common::Cap::Ud) {
        run_pair(UD.0, UD.1, Side::Ours, Side::Theirs, 18612, UD_ARGS);
    }
}

#[test]
fn ud_ibv_ud_pingpong_serves_ours() {
    if common::require(common::Cap::Ud) {
        run_pair(UD.0, UD.1, Side::Theirs, Side::Ours, 18613, UD_ARGS);
    }
}

#[test]
fn srq_ours_with_ours() {
    if let Some((sout, _)) = run_pair(SRQ.0, SRQ.1, Side::Ours, Side::Ours, 18621, SRQ_ARGS) {
        assert_eq!(sout.matches("remote address").count(), 8, "one line per QP:\n{sout}");
    }
}

#[test]
fn srq_ours_serves_ibv_srq_pingpong() {
    run_pair(SRQ.0, SRQ.1, Side::Ours, Side::Theirs, 18622, SRQ_ARGS);
}

#[test]
fn srq_ibv_srq_pingpong_serves_ours() {
    run_pair(SRQ.0, SRQ.1, Side::Theirs, Side::Ours, 18623, SRQ_ARGS);
}

/// A client that sends garbage instead of its address: our server says what was wrong in one
/// line and exits 1 (no panic, which would exit 101), having connected nothing.
#[test]
fn servers_refuse_a_garbage_address_without_panicking() {
    let t = DeviceTest::start();
    let gidx = gid_index(t.addr);
    let garbage: [&[u8]; 3] = [
        b"0000:00001g:000000:00000000000000000000ffff0a4d0001\0", // not hex
        b"0000:000011:000000:00000000000000000000ffff0a4d0001X",  // no NUL
        b"0000:000000:000000:00000000000000000000000000000000\0", // QP number 0
    ];
    for (i, msg) in garbage.iter().enumerate() {
        let port = 18631 + i as u16;
        let port_s = port.to_string();
        let mut srv = Proc::spawn(example(RC.0), &["-g", &gidx, "-p", &port_s, "-n", "10"]);
        srv.wait_line("local address", Duration::from_secs(30));
        let mut s = TcpStream::connect((t.addr, port)).expect("connect to the server");
        s.write_all(msg).unwrap();
        let (code, out) = srv.finish();
        assert_eq!(code, 1, "message {i}: {out}");
        assert!(out.contains("remote") || out.contains("QP number"), "message {i} names the fault: {out}");
        assert!(!out.contains("panicked"), "{out}");
    }
    t.finish();
}

/// A server that answers with a short message and closes: our client fails in one line, exit
/// 1, in bounded time.
#[test]
fn clients_refuse_a_short_answer_without_panicking() {
    let t = DeviceTest::start();
    let gidx = gid_index(t.addr);
    let l = TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let peer = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut theirs = [0u8; 52];
        s.read_exact(&mut theirs).unwrap();
        s.write_all(b"0000:0000").unwrap();
    });
    let host = t.addr.to_string();
    let cli = Proc::spawn(example(RC.0), &["-g", &gidx, "-p", &port, "-n", "10", &host]);
    let (code, out) = cli.finish();
    peer.join().unwrap();
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("Couldn't read remote address"), "{out}");
    t.finish();
}
