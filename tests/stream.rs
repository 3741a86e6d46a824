//! The rsocket-compatible stream (`rdma_cm::stream`, feature `stream`) on the device: against
//! rdma-core's `rstream` (rdmacm-utils) both ways, against itself (an echo larger than every
//! buffer, a half-close), against a hostile peer that breaks the protocol, and under a counting
//! allocator (the data path allocates nothing).

mod common;
#[path = "common/counting.rs"]
mod counting;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::{scrambled, Cap, DeviceTest, T};
use rdma_cm::stream::wire::{ConnData, Ctrl, Msg, Sge};
use rdma_cm::stream::{Stream, StreamConfig, StreamListener};
use rdma_cm::verbs::lane::{InlineWr, Lane, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Client, ConnParam, Error, MemoryRegion, QpInit, RemoteRegion, Transport, VerbsContext};

/// Prints how long the test took when it ends (the guest's speed varies with the machine).
struct Took(&'static str, std::time::Instant);

impl Drop for Took {
    fn drop(&mut self) {
        println!("{} took {:?}", self.0, self.1.elapsed());
    }
}

/// The bound of a whole transfer under the emulator.
const LONG: Duration = Duration::from_secs(120);

/// rstream's `-T v` pattern: a byte counter continued across every transfer of the process.
struct Counter(u8);

impl Counter {
    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.0;
            self.0 = self.0.wrapping_add(1);
        }
    }

    fn check(&mut self, buf: &[u8], at: usize) {
        for (k, b) in buf.iter().enumerate() {
            assert_eq!(*b, self.0, "byte {} of rstream's data", at + k);
            self.0 = self.0.wrapping_add(1);
        }
    }
}

/// The transfer of both rstream tests: `-S SIZE -C COUNT -I ITERS`, blocking, verified.
const SIZE: usize = 16 * 1024;
const COUNT: usize = 48;
const ITERS: usize = 2;

fn rstream_args(extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    for s in
        ["-f", "ip", "-S", &SIZE.to_string(), "-C", &COUNT.to_string(), "-I", &ITERS.to_string(), "-T", "b", "-T", "v"]
    {
        a.push(s.to_string());
    }
    a
}

/// rstream as the client, our listener as the server: rstream sends 16 bytes and expects them
/// back, then per iteration sends COUNT × SIZE bytes and expects as many back, verifying its
/// counter pattern (`-T v`): an echo in order passes its check.
#[test]
fn rstream_client_against_our_server() {
    let t = DeviceTest::start();
    let _took = Took("rstream_client_against_our_server", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7711u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let child = Command::new("rstream")
        .args(rstream_args(&["-s", &t.addr.to_string(), "-p", &port.to_string()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run rstream (rdmacm-utils)");
    let mut s = listener.accept(T).expect("accept rstream's connect");
    s.set_read_timeout(LONG);
    s.set_write_timeout(LONG);
    let mut buf = vec![0u8; 64 * 1024];
    let mut seen = Counter(0);
    let mut total = 0usize;
    loop {
        let n = s.read(&mut buf).expect("read from rstream");
        if n == 0 {
            break;
        }
        seen.check(&buf[..n], total);
        s.write_all(&buf[..n]).expect("echo to rstream");
        total += n;
    }
    assert_eq!(total, 16 + ITERS * COUNT * SIZE, "bytes from rstream before its disconnect");
    s.flush().unwrap();
    drop(s);
    let (status, out) = common::wait_exit(child, LONG, "rstream -s");
    assert!(status.success(), "rstream exited with {status}:\n{out}");
    assert!(out.contains("custom"), "rstream's result line:\n{out}");
    println!("rstream (client): {}", out.lines().last().unwrap_or(""));
    drop(listener);
    t.finish();
}

/// rstream as the server, our stream as the client doing what rstream's client does: 16 bytes
/// each way, then per iteration COUNT × SIZE bytes each way, with rstream's counter pattern
/// (rstream verifies what we send, we verify what it sends). The second iteration is sent
/// zero-copy, from a registered region.
#[test]
fn our_client_against_rstream_server() {
    let t = DeviceTest::start();
    let _took = Took("our_client_against_rstream_server", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7712u16;
    let child = Command::new("rstream")
        .args(rstream_args(&["-b", &t.addr.to_string(), "-p", &port.to_string()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run rstream (rdmacm-utils)");
    common::wait_listening(port, Duration::from_secs(60));
    let mut s = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect to rstream");
    s.set_read_timeout(LONG);
    s.set_write_timeout(LONG);
    let (mut out, mut back) = (Counter(0), Counter(0));
    // Copied, or sent straight from a registered region (`write_region`): rstream checks both.
    let mut xfer = |s: &mut Stream, len: usize, zero_copy: bool| {
        let mut b = vec![0u8; len];
        out.fill(&mut b);
        if zero_copy {
            let mr = MemoryRegion::register(s.pd(), b.clone(), AccessFlags::empty()).unwrap();
            s.write_region(mr, 0..len).expect("send to rstream from a region");
        } else {
            s.write_all(&b).expect("send to rstream");
        }
        s.read_exact(&mut b).expect("receive from rstream");
        back.check(&b, 0);
    };
    xfer(&mut s, 16, false);
    for k in 0..ITERS {
        xfer(&mut s, COUNT * SIZE, k % 2 == 1);
    }
    // rstream shuts down (a DISCONNECT) once its run is over: the end of the stream.
    let mut rest = [0u8; 1];
    assert_eq!(s.read(&mut rest).expect("rstream's close"), 0, "end of stream after rstream's run");
    assert!(s.write(b"x").is_err(), "a write after the peer's DISCONNECT fails");
    drop(s);
    let (status, text) = common::wait_exit(child, LONG, "rstream (server)");
    assert!(status.success(), "rstream exited with {status}:\n{text}");
    assert!(text.contains("custom"), "rstream's result line:\n{text}");
    println!("rstream (server): {}", text.lines().last().unwrap_or(""));
    t.finish();
}

/// rstream killed mid-transfer: our reads return what had arrived, then an error that says
/// the peer left without rsocket's SHUTDOWN or DISCONNECT, within the read timeout.
#[test]
fn abrupt_peer_is_named() {
    let t = DeviceTest::start();
    let _took = Took("abrupt_peer_is_named", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7718u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let child = Command::new("rstream")
        .args(["-s", &t.addr.to_string(), "-p", &port.to_string(), "-f", "ip", "-S", "16384", "-C", "1000", "-T", "b"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run rstream (rdmacm-utils)");
    let pid = child.id() as i32;
    let mut s = listener.accept(T).expect("accept rstream's connect");
    s.set_read_timeout(T);
    let mut sync = [0u8; 16];
    s.read_exact(&mut sync).unwrap();
    s.write_all(&sync).unwrap();
    let mut buf = vec![0u8; 4096];
    assert!(s.read(&mut buf).unwrap() > 0, "rstream's first data");
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped yet.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let (status, _) = common::wait_exit(child, T, "the killed rstream");
    assert!(!status.success());
    let started = std::time::Instant::now();
    let err = loop {
        match s.read(&mut buf) {
            Ok(0) => panic!("end of stream from a peer that was killed"),
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    assert!(err.to_string().contains("without an rsocket SHUTDOWN or DISCONNECT"), "{err}");
    assert!(started.elapsed() < T, "noticed within the read timeout");
    println!("killed peer: {err}");
    drop(s);
    drop(listener);
    t.finish();
}

/// A read from a peer that sends nothing ends at the read timeout, and the stream still works.
#[test]
fn read_times_out_and_the_stream_goes_on() {
    let t = DeviceTest::start();
    let _took = Took("read_times_out_and_the_stream_goes_on", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7719u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        rx.recv().unwrap();
        s.write_all(b"late").unwrap();
        s.shutdown(Shutdown::Both).unwrap();
    });
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    c.set_read_timeout(Duration::from_millis(500));
    let started = std::time::Instant::now();
    let err = c.read(&mut [0u8; 8]).expect_err("nothing to read");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(started.elapsed() >= Duration::from_millis(500) && started.elapsed() < T, "{:?}", started.elapsed());
    tx.send(()).unwrap();
    c.set_read_timeout(T);
    let mut got = Vec::new();
    c.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"late");
    server.join().unwrap();
    drop(c);
    t.finish();
}

/// On an iWARP device (no immediate data) both ends refuse, naming why, and nothing leaks.
#[test]
fn iwarp_is_refused_naming_why() {
    let t = DeviceTest::start();
    let ctx = VerbsContext::open(&common::caps::device_under_test()).expect("open the device");
    let iwarp = ctx.transport() == Transport::Iwarp;
    drop(ctx);
    if !iwarp {
        common::skipped("an iWARP device", "this one has immediate data: its streams are not refused");
        return t.finish();
    }
    let port = 7722u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let err = Stream::connect(SocketAddr::new(t.addr, port), T).expect_err("a stream on iWARP");
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("iWARP"), "{err}");
    println!("on iWARP: {err}");
    drop(listener);
    t.finish();
}

/// Two of our streams: the client sends 6 MiB in blocks of 192 KiB, written in odd-sized
/// pieces that line up with nothing; the server echoes what it reads as it reads it; every
/// byte comes back in order.
#[test]
fn echo_between_our_streams() {
    let t = DeviceTest::start();
    let _took = Took("echo_between_our_streams", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7713u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut buf = vec![0u8; 50_000];
        let mut total = 0usize;
        loop {
            let n = s.read(&mut buf).expect("server read");
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).expect("server echo");
            total += n;
        }
        s.shutdown(Shutdown::Both).expect("server shutdown");
        total
    });
    let data = scrambled(6 << 20, 7);
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    let mut got = vec![0u8; data.len()];
    for (k, block) in data.chunks(192 * 1024).enumerate() {
        for piece in block.chunks(40_009) {
            c.write_all(piece).unwrap();
        }
        let at = k * 192 * 1024;
        c.read_exact(&mut got[at..at + block.len()]).unwrap();
    }
    assert!(got == data, "the echo differs from what was sent");
    c.shutdown(Shutdown::Both).unwrap();
    assert_eq!(server.join().unwrap(), data.len(), "bytes the server read");
    drop(c);
    t.finish();
}

/// Writes of every kind the send path has, sent through small send buffers (their ring wraps
/// every few writes) and echoed back: inline (up to 64 bytes) and not, one byte past and short of the
/// buffer, larger than one WRITE carries (64 KiB) and than the whole buffer; every byte comes
/// back in order. Once with an 8 KiB send buffer at each end, once with the smallest sizes
/// `StreamConfig` takes (1 KiB to send, 4 KiB to receive, one credit).
#[test]
fn writes_of_every_size_echo_through_a_small_send_ring() {
    let t = DeviceTest::start();
    let _took = Took("writes_of_every_size_echo_through_a_small_send_ring", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    echo_every_size(&t, 7729, StreamConfig::new().send_buffer(8 * 1024));
    echo_every_size(&t, 7730, StreamConfig::new().recv_buffer(4096).send_buffer(1024).credits(1));
    t.finish();
}

/// The client writes every size in turn and shuts its writing down; the server reads to the
/// end, then writes it all back (an echo as it reads would deadlock once a write outgrows both
/// ends' buffers, as on any stream).
fn echo_every_size(t: &DeviceTest, port: u16, cfg: StreamConfig) {
    let listener = cfg.bind(SocketAddr::new(t.addr, port)).unwrap();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("server read");
        if let Err(e) = s.write_all(&got) {
            panic!("server echo: {e}: {s:?}");
        }
        s.shutdown(Shutdown::Both).expect("server shutdown");
    });
    let sizes = [1, 63, 64, 65, 1000, 1023, 1024, 1025, 8191, 8192, 8193, 3, 70_000, 65_536, 65_537, 200_000, 2];
    let data = scrambled(sizes.iter().sum::<usize>() * 3, 11);
    let mut c = cfg.connect(SocketAddr::new(t.addr, port), T).expect("connect");
    let mut at = 0;
    for &n in sizes.iter().cycle().take(sizes.len() * 3) {
        c.write_all(&data[at..at + n]).unwrap();
        at += n;
    }
    if let Err(e) = c.shutdown(Shutdown::Write) {
        panic!("client shutdown: {e}: {c:?}");
    }
    let mut got = Vec::new();
    c.read_to_end(&mut got).unwrap();
    assert!(got == data, "the echo differs from what was sent ({cfg:?})");
    server.join().unwrap();
}

/// A half-close: the client sends 3 MiB (more than both buffers together) and shuts down its
/// writing; the server reads exactly that, then end of stream, and answers; the client still
/// reads the answer, then the end of the stream at the server's close.
#[test]
fn half_close_between_our_streams() {
    let t = DeviceTest::start();
    let _took = Took("half_close_between_our_streams", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7714u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let data = scrambled(3 << 20, 11);
    let expect = data.clone();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("server reads to the half-close");
        assert!(got == expect, "the server read {} bytes, not the 3 MiB sent", got.len());
        assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "end of stream stays");
        s.write_all(b"got it").expect("answer after the peer's half-close");
        s.shutdown(Shutdown::Both).expect("server shutdown");
    });
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    c.write_all(&data).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let err = c.write(b"late").expect_err("a write after shutdown(Write)");
    assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{err}");
    let mut answer = Vec::new();
    c.read_to_end(&mut answer).expect("read after our half-close");
    assert_eq!(answer, b"got it");
    server.join().unwrap();
    drop(c);
    t.finish();
}

/// A client speaking the verbs itself, as a hostile or an rsocket-like peer would: connected
/// with valid connection data and 32 receives posted; it writes what a test tells it to.
struct RawPeer {
    lane: Lane,
    qp: rdma_cm::verbs::lane::LaneQp,
    pd: std::sync::Arc<rdma_cm::ProtectionDomain>,
    /// The server's connection data, and its first half (one byte longer than granted, so
    /// that a write beyond the grant gets past this side's own bounds check).
    theirs: ConnData,
    half: RemoteRegion,
    _bufs: (MemoryRegion, MemoryRegion),
}

impl RawPeer {
    fn connect(t: &DeviceTest, port: u16) -> RawPeer {
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, port), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = Lane::new(&route.context().unwrap(), 512).unwrap();
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rbuf = MemoryRegion::new(&pd, 4096, remote).unwrap();
        let sgl = MemoryRegion::new(&pd, 32, remote).unwrap();
        let client = route.lane_qp(&mut lane, &pd, QpInit::new().max_recv_wr(32).max_send_wr(256)).unwrap();
        let qp = client.qp();
        for r in MemoryRegion::new(&pd, 32, AccessFlags::LOCAL_WRITE).unwrap().split(1).unwrap() {
            lane.post_recv(qp, RecvWr::range(r, 0..0).wr_id(1)).unwrap();
        }
        let mine = ConnData::new(
            16,
            Sge { addr: sgl.addr(), key: sgl.rkey(), length: 2 },
            Sge { addr: rbuf.addr(), key: rbuf.rkey(), length: 2048 },
        );
        let reply = client.connect(&mut lane, &ConnParam::new().private_data(&mine.encode()).unwrap(), T).unwrap();
        let theirs = ConnData::decode(&reply).expect("the server's connection data");
        let half = RemoteRegion::new(theirs.data_buf.addr, theirs.data_buf.key, u64::from(theirs.data_buf.length) + 1);
        RawPeer { lane, qp, pd, theirs, half, _bufs: (rbuf, sgl) }
    }

    /// Writes `grant` into slot 1 of the server's target SGL with `imm`, as a buffer grant goes.
    fn grant(&mut self, grant: Sge, imm: u32) {
        let sgl = RemoteRegion::new(self.theirs.target_sgl.addr, self.theirs.target_sgl.key, 32);
        let bytes = grant.encode(self.theirs.order);
        self.lane.post_inline(self.qp, InlineWr::write(&bytes, &sgl, 16).imm(imm).wr_id(2)).unwrap();
    }

    /// Sends `imm` with `len` bytes written at `at` in the server's first half (none for 0).
    fn send(&mut self, imm: u32, len: usize, at: usize) {
        if len == 0 {
            let none = RemoteRegion::new(0, 0, 0);
            self.lane.post_inline(self.qp, InlineWr::write(&[], &none, 0).imm(imm).wr_id(2)).unwrap();
        } else {
            let src = MemoryRegion::new(&self.pd, len, AccessFlags::empty()).unwrap();
            let wr = SendWr::write(src, 0..len, &self.half, at as u64).imm(imm).wr_id(2);
            self.lane.post_send(self.qp, wr).unwrap();
        }
    }

    /// Waits for the completions of `n` sends (each must succeed).
    fn sent(&mut self, n: usize) {
        let mut done = 0;
        while done < n {
            let c = self.lane.wait(T).expect("a completion of the raw peer's");
            if c.wr_id() == 2 {
                assert!(c.is_ok(), "the raw peer's send failed: {:?}", c.status());
                done += 1;
            }
        }
    }

    /// Disconnects at once, as the server's stream closes at the same time.
    fn close(mut self, server: Stream) {
        let closing = thread::spawn(move || drop(server));
        let _ = self.lane.disconnect(self.qp, Duration::from_secs(2));
        closing.join().unwrap();
    }
}

/// A hostile client ([`RawPeer`]) that sends `imm` `count` times, each with `len` bytes
/// written at the next place of the server's first half. The server reads (or, with
/// `server_writes`, only writes, so that it reads nothing and its credits are not renewed):
/// its call must fail with `InvalidData` naming `needle`, never hang or panic.
fn hostile(t: &DeviceTest, port: u16, (imm, len, count): (u32, usize, usize), server_writes: bool, needle: &str) {
    hostile_with(t, port, (imm, len, count), None, server_writes, needle)
}

/// [`hostile`], first writing `grant` (when given) into slot 1 of the server's target SGL
/// with `imm`, as a buffer grant goes.
fn hostile_with(
    t: &DeviceTest,
    port: u16,
    (imm, len, count): (u32, usize, usize),
    grant: Option<Sge>,
    server_writes: bool,
    needle: &str,
) {
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept the hostile client");
        s.set_read_timeout(T);
        s.set_write_timeout(T);
        let mut buf = [0u8; 1024];
        loop {
            let r = if server_writes { s.write(&buf) } else { s.read(&mut buf) };
            match r {
                Ok(0) => return (Err("end of stream".to_string()), s),
                Ok(_) => continue,
                Err(e) => return (Ok(e), s),
            }
        }
    });
    let mut peer = RawPeer::connect(t, port);
    if let Some(g) = grant {
        peer.grant(g, imm);
    }
    for k in 0..count {
        peer.send(imm, len, k * len);
    }
    let (seen, s) = server.join().unwrap();
    let e = seen.unwrap_or_else(|why| panic!("the server's call saw {why}, not an error"));
    assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains(needle), "the error names the violation ({needle}): {e}");
    println!("hostile {imm:#010x} x{count}: {e}");
    peer.close(s);
}

/// What arrived before a violation is read first, in order, and then the error: three data
/// messages, then a reserved operation, all in the server's CQ before it reads.
#[test]
fn data_before_a_violation_is_read_before_the_error() {
    let t = DeviceTest::start();
    let _took = Took("data_before_a_violation_is_read_before_the_error", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7725u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        rx.recv().unwrap();
        let mut got = Vec::new();
        let e = s.read_to_end(&mut got).expect_err("the violation, after the data");
        (got, e, s)
    });
    let mut peer = RawPeer::connect(&t, port);
    for k in 0..3 {
        peer.send(Msg::Data { len: 1000 }.to_imm(), 1000, k * 1000);
    }
    peer.send(0x2000_0000, 0, 0);
    peer.sent(4);
    tx.send(()).unwrap();
    let (got, e, s) = server.join().unwrap();
    assert_eq!(got.len(), 3000, "the three messages' bytes, read before the error");
    assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains("reserved"), "{e}");
    peer.close(s);
    t.finish();
}

/// An rsocket peer that sends DISCONNECT moves its QP to the error state and sends the CM's
/// disconnect only when it closes. A WRITE posted to it then never lands: `flush` must not
/// say `Ok`. It fails when the WRITE does (`BrokenPipe`, its bytes may not have reached the
/// peer) or, as measured on rxe with kernel 6.1, where the WRITE neither completes nor fails
/// within 30 s, at its timeout. A read then returns the end of the stream, not an error.
#[test]
fn flush_after_the_peer_disconnected_never_says_ok() {
    let t = DeviceTest::start();
    let _took = Took("flush_after_the_peer_disconnected_never_says_ok", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7726u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        s.set_write_timeout(Duration::from_secs(5));
        rx.recv().unwrap();
        // Posted at once: the stream has credits and a grant, and has not polled yet.
        assert_eq!(s.write(&[7u8; 1000]).expect("the WRITE is posted"), 1000);
        let flushed = s.flush();
        let read = s.read(&mut [0u8; 8]);
        (flushed, read.map_err(|e| e.to_string()), s)
    });
    let mut peer = RawPeer::connect(&t, port);
    peer.send(Msg::Ctrl(Ctrl::Disconnect).to_imm(), 0, 0);
    peer.sent(1);
    peer.lane.set_error(peer.qp).unwrap();
    tx.send(()).unwrap();
    let (flushed, read, s) = server.join().unwrap();
    let e = flushed.expect_err("a flush of a WRITE the peer never got");
    match e.kind() {
        ErrorKind::BrokenPipe => assert!(e.to_string().contains("may not have reached"), "{e}"),
        ErrorKind::TimedOut => assert!(e.to_string().contains("timed out"), "{e}"),
        k => panic!("a flush error of kind {k:?}: {e}"),
    }
    println!("flush: {e}");
    assert_eq!(read, Ok(0), "after the peer's DISCONNECT a read ends the stream");
    peer.close(s);
    t.finish();
}

/// Timeouts too large for the clock (`Duration::MAX`) mean no bound, never a panic.
#[test]
fn huge_timeouts_do_not_panic() {
    let t = DeviceTest::start();
    let _took = Took("huge_timeouts_do_not_panic", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7727u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        s.set_read_timeout(Duration::MAX);
        s.set_write_timeout(Duration::MAX);
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("read to the half-close");
        s.write_all(&got).expect("echo");
        s.shutdown(Shutdown::Both).expect("shutdown");
    });
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    c.set_read_timeout(Duration::MAX);
    c.set_write_timeout(Duration::MAX);
    c.write_all(b"unbounded").unwrap();
    c.flush().unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(back, b"unbounded");
    server.join().unwrap();
    drop(c);
    t.finish();
}

/// Protocol violations close the stream with an error that names them: a reserved
/// operation, data beyond the granted half, a credit update for more receives than the peer
/// has, one data message more than the credits the server gave (it reads nothing, so they
/// are never renewed), buffer grants that wrap the address space or are empty, and a data
/// message of 0 bytes (a read would take it for the end of the stream).
#[test]
fn protocol_violations_close_the_stream() {
    let t = DeviceTest::start();
    let _took = Took("protocol_violations_close_the_stream", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    hostile(&t, 7715, (0x2000_0000, 0, 1), false, "reserved");
    let half = 128 * 1024u32;
    hostile(&t, 7716, (Msg::Data { len: half + 1 }.to_imm(), half as usize + 1, 1), false, "granted space");
    hostile(&t, 7717, (Msg::Sgl { limit: 0xffff }.to_imm(), 0, 1), false, "credit limit");
    hostile(&t, 7720, (Msg::Data { len: 1 }.to_imm(), 1, 129), true, "beyond its credits");
    let wraps = Sge { addr: u64::MAX - 15, key: 1, length: 4096 };
    hostile_with(&t, 7723, (Msg::Sgl { limit: 16 }.to_imm(), 0, 0), Some(wraps), true, "past the end");
    let empty = Sge { addr: 4096, key: 1, length: 0 };
    hostile_with(&t, 7724, (Msg::Sgl { limit: 16 }.to_imm(), 0, 0), Some(empty), true, "length 0");
    hostile(&t, 7728, (Msg::Data { len: 0 }.to_imm(), 0, 1), false, "0 bytes");
    t.finish();
}

/// Reads and writes allocate nothing per message: 4 MiB written in pieces of 1 to 70,000
/// bytes (inline, through the send ring, several WRITEs each) and read in 3000-byte ones, both threads counted (`common/counting.rs`), credits, grants and
/// completions included.
#[test]
fn reads_and_writes_allocate_nothing() {
    let t = DeviceTest::start();
    let _took = Took("reads_and_writes_allocate_nothing", std::time::Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    const TOTAL: usize = 4 << 20;
    let port = 7721u16;
    counting::assert_it_counts();
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut buf = vec![0u8; 3000];
        let mut sum = 0u64;
        let mut total = 0usize;
        counting::watched(|| {
            while total < TOTAL {
                let n = s.read(&mut buf).expect("read");
                assert!(n > 0, "end of stream after {total} bytes");
                sum = buf[..n].iter().fold(sum, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
                total += n;
            }
        });
        sum
    });
    let data = scrambled(TOTAL, 5);
    let expect = data.iter().fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    counting::watched(|| {
        // Inline writes, writes into the send ring, and writes of several WRITEs.
        let (mut at, sizes) = (0, [4000, 1, 64, 65, 70_000, 3000]);
        for &n in sizes.iter().cycle() {
            let n = n.min(TOTAL - at);
            if n == 0 {
                break;
            }
            c.write_all(&data[at..at + n]).expect("write");
            at += n;
        }
        c.flush().expect("flush");
    });
    assert_eq!(server.join().unwrap(), expect, "the bytes the server read");
    let (allocs, bytes) = counting::counts();
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) reading and writing {TOTAL} bytes");
    drop(c);
    t.finish();
}
