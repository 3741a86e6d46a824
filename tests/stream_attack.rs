//! Attacks on the stream's tokio side (features `stream` and `tokio`), on the device, with safe
//! code only: lost wake-ups (split halves on two runtimes, cancelled futures, blocking and
//! async calls taking turns, runtimes dropped under the stream), cancel safety of reads,
//! writes, flushes and shutdowns, `StreamConfig` at its extremes, odd calls after a shutdown
//! or the peer's DISCONNECT, and a peer that vanishes. Every wait is bounded, so a lost
//! wake-up fails a test instead of hanging it.

mod common;
#[path = "common/raw_peer.rs"]
mod raw_peer;

use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{Cap, DeviceTest, T};
use raw_peer::RawPeer;
use rdma_cm::stream::wire::{Ctrl, Msg};
use rdma_cm::stream::{Stream, StreamConfig, StreamListener};
use rdma_cm::verbs::lane::SendWr;
use rdma_cm::{AccessFlags, Error, MemoryRegion};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The bound of a whole transfer under the emulator.
const LONG: Duration = Duration::from_secs(120);
/// The bound of one wait that an event must end (a wake-up that is lost fails here).
const WAKE: Duration = Duration::from_secs(30);
/// The bound of one read or write of the split halves on their runtimes: far beyond what one
/// message takes there, so a call that sleeps this long was not woken.
const SPLIT_WAKE: Duration = Duration::from_secs(15);

/// `f` bounded by `d` on `rt` (the timer made inside the runtime, as tokio requires).
fn within<F: std::future::Future>(
    rt: &tokio::runtime::Runtime,
    d: Duration,
    f: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    rt.block_on(async { tokio::time::timeout(d, f).await })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Bytes that no offset or order mistake can reproduce.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed ^ ((len as u64) << 20);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The smallest sizes `StreamConfig` takes.
fn smallest() -> StreamConfig {
    StreamConfig::new().recv_buffer(4096).send_buffer(1024).credits(1)
}

/// Accepts on a thread while this one connects (both blocking): the two ends.
fn pair(listener: StreamListener, addr: SocketAddr, client: StreamConfig) -> (Stream, Stream, StreamListener) {
    let server = thread::spawn(move || {
        let s = listener.accept(T).expect("accept");
        (s, listener)
    });
    let c = client.connect(addr, T).expect("connect");
    let (s, listener) = server.join().unwrap();
    (c, s, listener)
}

/// Every size out of its range is refused by `bind`, `connect` and `connect_async` with
/// `InvalidArgument` naming the setting and the size, before any CM step; the bounds
/// themselves are taken.
#[test]
fn invalid_stream_config_sizes_fail_with_an_error_naming_the_size() {
    let t = DeviceTest::start();
    let addr = SocketAddr::new(t.addr, 7740);
    let cases = [
        (StreamConfig::new().recv_buffer(4094), "recv_buffer", "4094"),
        (StreamConfig::new().recv_buffer(0), "recv_buffer", "of 0 bytes"),
        (StreamConfig::new().recv_buffer(2 << 30), "recv_buffer", "2147483648"),
        (StreamConfig::new().recv_buffer(usize::MAX), "recv_buffer", "1 GiB"),
        (StreamConfig::new().send_buffer(1023), "send_buffer", "1023"),
        (StreamConfig::new().send_buffer(0), "send_buffer", "of 0 bytes"),
        (StreamConfig::new().send_buffer((64 << 20) + 1), "send_buffer", "67108865"),
        (StreamConfig::new().send_buffer(usize::MAX), "send_buffer", "64 MiB"),
        (StreamConfig::new().credits(0), "credits", "of 0"),
        (StreamConfig::new().credits(4097), "credits", "4097"),
        (StreamConfig::new().credits(u16::MAX), "credits", "65535"),
    ];
    let rt = runtime();
    for (cfg, what, size) in cases {
        let check = |r: Result<(), Error>, call: &str| match r {
            Err(Error::InvalidArgument(m)) => {
                assert!(m.contains(what) && m.contains(size), "{call} of {cfg:?}: {m}")
            }
            Err(e) => panic!("{call} of {cfg:?}: not InvalidArgument: {e}"),
            Ok(()) => panic!("{call} of {cfg:?} was taken"),
        };
        check(cfg.bind(addr).map(drop), "bind");
        check(cfg.connect(addr, T).map(drop), "connect");
        check(rt.block_on(cfg.connect_async(addr, T)).map(drop), "connect_async");
    }
    for cfg in [smallest(), StreamConfig::new().recv_buffer(1 << 30).send_buffer(64 << 20).credits(4096)] {
        drop(cfg.bind(addr).unwrap_or_else(|e| panic!("bind of {cfg:?} at the bounds: {e}")));
    }
    t.finish();
}

/// An odd receive buffer below the minimum is named as the caller gave it.
#[test]
fn an_odd_recv_buffer_below_the_minimum_is_named_as_given() {
    let t = DeviceTest::start();
    let addr = SocketAddr::new(t.addr, 7741);
    match StreamConfig::new().recv_buffer(4095).bind(addr) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("4095"), "the error names another size: {m}"),
        Err(e) => panic!("not InvalidArgument: {e}"),
        Ok(_) => panic!("a receive buffer of 4095 bytes was taken"),
    }
    t.finish();
}

/// Echoes `len` bytes from a client of `client`'s sizes through a server of `server`'s sizes
/// that copies between the halves of `tokio::io::split`, all on one current-thread runtime.
fn echo_with(port: u16, client: StreamConfig, server: StreamConfig, len: usize) {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, port);
    let data = random_bytes(len, port.into());
    let back = runtime().block_on(async {
        let listener = server.bind(addr).unwrap();
        let srv = tokio::spawn(async move {
            let s = listener.accept_async().await.expect("accept_async");
            let (mut r, mut w) = tokio::io::split(s);
            let n = tokio::io::copy(&mut r, &mut w).await.expect("the server's copy");
            w.shutdown().await.expect("the server's shutdown");
            drop(r.unsplit(w));
            n
        });
        let s = client.connect_async(addr, T).await.expect("connect_async");
        let (mut r, mut w) = tokio::io::split(s);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(7_777) {
                w.write_all(piece).await.expect("write_all");
            }
            w.shutdown().await.expect("the client's shutdown");
            w
        });
        let mut back = Vec::new();
        tokio::time::timeout(LONG, r.read_to_end(&mut back)).await.expect("the echo in time").expect("read_to_end");
        let w = tokio::time::timeout(WAKE, writer).await.expect("the writer ends").unwrap();
        let moved = tokio::time::timeout(WAKE, srv).await.expect("the server ends").unwrap();
        assert_eq!(moved, len as u64, "bytes the server's copy moved");
        drop(r.unsplit(w));
        back
    });
    assert_eq!(back.len(), data.len(), "bytes echoed");
    assert!(back == data, "the echo differs from what was sent");
    t.finish();
}

/// Both ends at the smallest sizes (a 4 KiB receive buffer, a 1 KiB send buffer, 1 credit):
/// every message waits for a credit update, and the echo still arrives whole.
#[test]
fn smallest_config_echoes_through_split_halves() {
    echo_with(7742, smallest(), smallest(), 200_000);
}

/// Lopsided ends: a client with a 4 KiB receive buffer, 4,096 credits and a 4 MiB send
/// buffer against a server with a 1 MiB receive buffer, a 1 KiB send buffer and 1 credit.
#[test]
fn lopsided_configs_echo_through_split_halves() {
    let client = StreamConfig::new().recv_buffer(4096).send_buffer(4 << 20).credits(4096);
    let server = StreamConfig::new().recv_buffer(1 << 20).send_buffer(1024).credits(1);
    echo_with(7743, client, server, 1 << 20);
}

/// Writes `len` bytes of seed `seed` through `w`, each `write` bounded by [`SPLIT_WAKE`]; one
/// that runs out is polled once more, to tell a lost wake-up from a stall.
async fn write_half(mut w: tokio::io::WriteHalf<Stream>, len: usize, seed: u64) -> tokio::io::WriteHalf<Stream> {
    let data = random_bytes(len, seed);
    let mut off = 0;
    while off < data.len() {
        let piece = &data[off..(off + 3_001).min(data.len())];
        off += match tokio::time::timeout(SPLIT_WAKE, w.write(piece)).await {
            Ok(r) => r.expect("write"),
            Err(_) => match tokio::time::timeout(Duration::ZERO, w.write(piece)).await {
                Ok(r) => panic!("lost wake-up: a write slept {SPLIT_WAKE:?}, yet polled once more it returned {r:?}"),
                Err(_) => panic!("a write stalled for {SPLIT_WAKE:?} and is still pending"),
            },
        };
    }
    tokio::time::timeout(WAKE, w.shutdown()).await.expect("the shutdown in time").unwrap();
    w
}

/// Reads to the end through `r` and checks the bytes (seed `seed`), each `read` bounded as in
/// [`write_half`].
async fn read_half(mut r: tokio::io::ReadHalf<Stream>, len: usize, seed: u64) -> tokio::io::ReadHalf<Stream> {
    let mut got = Vec::with_capacity(len);
    let mut buf = vec![0u8; 5_000];
    loop {
        let n = match tokio::time::timeout(SPLIT_WAKE, r.read(&mut buf)).await {
            Ok(r) => r.expect("read"),
            Err(_) => match tokio::time::timeout(Duration::ZERO, r.read(&mut buf)).await {
                Ok(r) => panic!(
                    "lost wake-up: a read slept {SPLIT_WAKE:?}, yet polled once more it returned {r:?} \
                         after {} bytes",
                    got.len()
                ),
                Err(_) => panic!("a read stalled for {SPLIT_WAKE:?} after {} bytes", got.len()),
            },
        };
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(got.len(), len, "bytes read before the end (fewer: the peer's end was dropped early)");
    assert!(got == random_bytes(len, seed), "the bytes read differ from those sent");
    r
}

/// Full duplex between two ends split into reader and writer halves, with tiny windows so that
/// every writer waits on credits its sibling reader's polls reap: each end's halves on two
/// threads with a current-thread runtime each (`two_runtimes`), or as two tasks of one.
fn split_duplex(port: u16, two_runtimes: bool) {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, port);
    let cfg = StreamConfig::new().recv_buffer(8192).send_buffer(4096).credits(2);
    let listener = cfg.bind(addr).unwrap();
    let (c, s, listener) = pair(listener, addr, cfg);
    let len = 1 << 20;
    let run = |s: Stream, seed_out: u64, seed_in: u64| -> thread::JoinHandle<Stream> {
        let (r, w) = tokio::io::split(s);
        if two_runtimes {
            let writer = thread::spawn(move || runtime().block_on(write_half(w, len, seed_out)));
            let reader = thread::spawn(move || runtime().block_on(read_half(r, len, seed_in)));
            thread::spawn(move || {
                let r = reader.join().expect("a reader");
                r.unsplit(writer.join().expect("a writer"))
            })
        } else {
            thread::spawn(move || {
                runtime().block_on(async move {
                    let writer = tokio::spawn(write_half(w, len, seed_out));
                    let reader = tokio::spawn(read_half(r, len, seed_in));
                    let r = reader.await.expect("a reader");
                    r.unsplit(writer.await.expect("a writer"))
                })
            })
        }
    };
    let c = run(c, 1, 2);
    let s = run(s, 2, 1);
    let (c, s) = (c.join().expect("the client"), s.join().expect("the server"));
    drop((c, s, listener));
    t.finish();
}

/// Each end's reader and writer halves on two threads, each its own current-thread runtime:
/// four runtimes in all, every task woken for the credits and data it waits on, even when a
/// poll on one runtime reaps the completion its sibling half waits for and drains the CQ
/// event (`Lane::arm`) before the other runtime's reactor saw it.
#[test]
fn split_halves_on_two_runtimes_each_are_woken_for_credits_and_data() {
    // The loss is a race between the threads: three rounds, to meet it more often.
    for port in [7744, 7757, 7758] {
        split_duplex(port, true);
    }
}

/// The same duplex with each end's halves as two tasks of one current-thread runtime (the
/// control of the test above: one runtime per stream).
#[test]
fn split_halves_on_one_runtime_each_are_woken_for_credits_and_data() {
    split_duplex(7756, false);
}

/// Reads, writes and flushes cancelled after their first poll (`timeout` of zero) or after a
/// millisecond, again and again on both ends while the data flows through small windows:
/// every byte arrives once, in order. Every fifth call is awaited to its end (bounded), so the
/// wake-ups of a task that cancelled futures before are exercised too.
#[test]
fn cancelled_reads_writes_and_flushes_lose_and_duplicate_nothing() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7745);
    let cfg = StreamConfig::new().recv_buffer(8192).send_buffer(2048).credits(2);
    let len = 400_000;
    let data = random_bytes(len, 45);
    let sent = data.clone();
    let (got, cancelled) = runtime().block_on(async move {
        let listener = cfg.bind(addr).unwrap();
        let srv = tokio::spawn(async move {
            let mut s = listener.accept_async().await.expect("accept");
            let (mut got, mut buf, mut i, mut cancelled) = (Vec::new(), vec![0u8; 3000], 0usize, 0usize);
            let start = Instant::now();
            loop {
                assert!(start.elapsed() < LONG, "the data within {LONG:?}");
                i += 1;
                let bound = match i % 5 {
                    0 => WAKE,
                    1 | 3 => Duration::ZERO,
                    _ => Duration::from_millis(1),
                };
                match tokio::time::timeout(bound, s.read(&mut buf)).await {
                    Err(_) => {
                        assert!(bound < WAKE, "an awaited read not woken within {WAKE:?}");
                        cancelled += 1;
                        tokio::task::yield_now().await;
                    }
                    Ok(Ok(0)) => break,
                    Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                    Ok(Err(e)) => panic!("read: {e}"),
                }
            }
            drop(s);
            (got, cancelled)
        });
        let mut c = cfg.connect_async(addr, T).await.expect("connect");
        let (mut off, mut i, mut cancelled) = (0usize, 0usize, 0usize);
        let start = Instant::now();
        while off < sent.len() {
            assert!(start.elapsed() < LONG, "the writes within {LONG:?}");
            i += 1;
            let bound = match i % 5 {
                0 => WAKE,
                1 | 3 => Duration::ZERO,
                _ => Duration::from_millis(1),
            };
            let end = (off + 1 + i % 2500).min(sent.len());
            match tokio::time::timeout(bound, c.write(&sent[off..end])).await {
                Err(_) => {
                    assert!(bound < WAKE, "an awaited write not woken within {WAKE:?}");
                    cancelled += 1;
                    tokio::task::yield_now().await;
                }
                Ok(Ok(n)) => {
                    assert!(n > 0 && n <= end - off, "write returned {n} of {}", end - off);
                    off += n;
                }
                Ok(Err(e)) => panic!("write: {e}"),
            }
            if i % 7 == 0 && tokio::time::timeout(Duration::ZERO, c.flush()).await.is_err() {
                cancelled += 1;
            }
        }
        tokio::time::timeout(WAKE, c.flush()).await.expect("the flush in time").expect("flush");
        tokio::time::timeout(WAKE, AsyncWriteExt::shutdown(&mut c))
            .await
            .expect("the shutdown in time")
            .expect("shutdown");
        let (got, srv_cancelled) = tokio::time::timeout(LONG, srv).await.expect("the server in time").unwrap();
        drop(c);
        (got, cancelled + srv_cancelled)
    });
    println!("{cancelled} futures cancelled");
    assert_eq!(got.len(), data.len(), "bytes read");
    assert!(got == data, "the bytes read differ from those written");
    t.finish();
}

/// Shutdown futures (`AsyncWriteExt::shutdown` and `shutdown_async`, taking turns) dropped
/// after their first poll until one finishes: the peer reads every byte written before, then
/// the end of the stream, once; later writes fail with `BrokenPipe`.
#[test]
fn cancelled_shutdown_futures_lose_no_bytes_and_end_the_stream_once() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7746);
    let data = random_bytes(300_000, 46);
    let sent = data.clone();
    let got = runtime().block_on(async move {
        let listener = StreamListener::bind(addr).unwrap();
        let srv = tokio::spawn(async move {
            let mut s = listener.accept_async().await.expect("accept");
            let mut got = Vec::new();
            tokio::time::timeout(LONG, s.read_to_end(&mut got)).await.expect("the end in time").expect("read");
            let mut more = [0u8; 16];
            for _ in 0..3 {
                let n = tokio::time::timeout(WAKE, s.read(&mut more)).await.expect("in time").expect("read");
                assert_eq!(n, 0, "a read after the end of the stream");
            }
            got
        });
        let mut c = Stream::connect_async(addr, T).await.expect("connect");
        c.write_all(&sent).await.expect("write_all");
        let mut tries = 0usize;
        loop {
            tries += 1;
            assert!(tries < 1_000_000, "no shutdown finished");
            let r = if tries % 2 == 0 {
                tokio::time::timeout(Duration::ZERO, c.shutdown_async(Shutdown::Write)).await
            } else {
                tokio::time::timeout(Duration::ZERO, AsyncWriteExt::shutdown(&mut c)).await
            };
            match r {
                Ok(r) => break r.expect("shutdown"),
                Err(_) => tokio::task::yield_now().await,
            }
        }
        let e = c.write(b"late").await.expect_err("a write after the shutdown");
        assert_eq!(e.kind(), ErrorKind::BrokenPipe, "{e}");
        let got = tokio::time::timeout(LONG, srv).await.expect("the server in time").unwrap();
        drop(c);
        got
    });
    assert_eq!(got.len(), data.len(), "bytes read before the end");
    assert!(got == data, "the bytes read differ");
    t.finish();
}

/// [`RawPeer`]'s messages here.
impl RawPeer {
    /// Sends a data message of `len` bytes at `at` in the server's first half, and waits for
    /// its completion.
    fn send_data(&mut self, len: usize, at: usize) {
        let src = MemoryRegion::new(&self.pd, len, AccessFlags::empty()).unwrap();
        let wr = SendWr::write(src, 0..len, &self.half, at as u64).imm(Msg::Data { len: len as u32 }.to_imm()).wr_id(2);
        self.lane.post_send(self.qp, wr).unwrap();
        loop {
            let c = self.lane.wait(T).expect("the raw peer's send completes");
            if c.wr_id() == 2 {
                assert!(c.is_ok(), "the raw peer's send failed: {:?}", c.status());
                return;
            }
        }
    }

    /// The immediate data of every message received until none comes for half a second.
    fn received(&mut self) -> Vec<u32> {
        let mut imms = Vec::new();
        while let Ok(c) = self.lane.wait(Duration::from_millis(500)) {
            if c.wr_id() == 1 {
                assert!(c.is_ok(), "a receive of the raw peer's failed: {:?}", c.status());
                imms.extend(c.imm_data());
            }
        }
        imms
    }
}

/// A server stream (4 KiB receive buffer, 2 credits) whose four control slots are all taken by
/// messages the raw peer has no receive for: its first grant and three credit updates (each
/// after a data message the stream read).
fn control_slots_full(t: &DeviceTest, port: u16, rt: &tokio::runtime::Runtime) -> (Stream, RawPeer) {
    let addr = SocketAddr::new(t.addr, port);
    let listener = StreamConfig::new().recv_buffer(4096).credits(2).bind(addr).unwrap();
    let accepting = thread::spawn(move || listener.accept(T).expect("accept"));
    let mut peer = RawPeer::connect(t, port, 0);
    let mut s = accepting.join().unwrap();
    for i in 0..3 {
        peer.send_data(8, 8 * i);
        let mut b = [0u8; 8];
        within(rt, WAKE, s.read_exact(&mut b)).expect("the data in time").expect("read");
    }
    (s, peer)
}

fn shutdowns(imms: &[u32]) -> usize {
    imms.iter().filter(|&&i| i == Msg::Ctrl(Ctrl::Shutdown).to_imm()).count()
}

/// `shutdown_async(Write)` dropped while it waits for a control slot, then
/// `AsyncWriteExt::shutdown`: the SHUTDOWN must still reach the peer (else its reads never
/// end while this side lives).
#[test]
fn poll_shutdown_after_a_cancelled_shutdown_async_still_sends_shutdown() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let rt = runtime();
    let (mut s, mut peer) = control_slots_full(&t, 7747, &rt);
    let r = within(&rt, Duration::ZERO, s.shutdown_async(Shutdown::Write));
    assert!(r.is_err(), "shutdown_async finished with every control slot taken: {r:?}");
    peer.post_recvs(32);
    within(&rt, WAKE, AsyncWriteExt::shutdown(&mut s)).expect("the shutdown in time").expect("shutdown");
    let imms = peer.received();
    assert_eq!(shutdowns(&imms), 1, "SHUTDOWNs the peer received (every message: {imms:x?})");
    drop(rt);
    drop(s);
    drop(peer);
    t.finish();
}

/// `AsyncWriteExt::shutdown` dropped while it waits for a control slot, then the blocking
/// `shutdown(Write)`, then `AsyncWriteExt::shutdown` again: one SHUTDOWN reaches the peer.
#[test]
fn blocking_shutdown_after_a_cancelled_poll_shutdown_sends_one_shutdown() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let rt = runtime();
    let (mut s, mut peer) = control_slots_full(&t, 7748, &rt);
    let r = within(&rt, Duration::ZERO, AsyncWriteExt::shutdown(&mut s));
    assert!(r.is_err(), "shutdown finished with every control slot taken: {r:?}");
    peer.post_recvs(32);
    s.shutdown(Shutdown::Write).expect("the blocking shutdown");
    within(&rt, WAKE, AsyncWriteExt::shutdown(&mut s)).expect("the shutdown in time").expect("shutdown");
    let imms = peer.received();
    assert_eq!(shutdowns(&imms), 1, "SHUTDOWNs the peer received (every message: {imms:x?})");
    drop(rt);
    drop(s);
    drop(peer);
    t.finish();
}

/// A blocking `shutdown(Write)` that timed out waiting for a control slot, then
/// `AsyncWriteExt::shutdown`: the SHUTDOWN must still reach the peer.
#[test]
fn poll_shutdown_after_a_timed_out_blocking_shutdown_still_sends_shutdown() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let rt = runtime();
    let (mut s, mut peer) = control_slots_full(&t, 7759, &rt);
    s.set_write_timeout(Duration::from_millis(100));
    let e = s.shutdown(Shutdown::Write).expect_err("a shutdown with every control slot taken");
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    s.set_write_timeout(WAKE);
    peer.post_recvs(32);
    within(&rt, WAKE, AsyncWriteExt::shutdown(&mut s)).expect("the shutdown in time").expect("shutdown");
    let imms = peer.received();
    assert_eq!(shutdowns(&imms), 1, "SHUTDOWNs the peer received (every message: {imms:x?})");
    drop(rt);
    drop(s);
    drop(peer);
    t.finish();
}

/// The reader and the writer half of one stream, both pending on one current-thread runtime
/// (nothing to read; the writer past the peer's window), are both woken by the peer's
/// DISCONNECT: the read ends the stream, the write fails `ConnectionReset`; a flush and a
/// shutdown after it end too.
#[test]
fn split_reader_and_writer_are_both_woken_by_the_peer_disconnect() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7749);
    let listener = StreamListener::bind(addr).unwrap();
    let (pend_tx, pend_rx) = mpsc::channel::<()>();
    let client = thread::spawn(move || {
        let c = Stream::connect(addr, T).expect("connect");
        for _ in 0..2 {
            pend_rx.recv_timeout(WAKE).expect("the server's tasks pending");
        }
        drop(c); // a DISCONNECT, then the CM's disconnect
    });
    runtime().block_on(async move {
        let s = tokio::time::timeout(T, listener.accept_async()).await.expect("accept in time").unwrap();
        let (mut r, mut w) = tokio::io::split(s);
        let pend = pend_tx.clone();
        let reader = tokio::spawn(async move {
            let mut b = [0u8; 64];
            assert!(tokio::time::timeout(Duration::ZERO, r.read(&mut b)).await.is_err(), "a read with nothing sent");
            pend.send(()).unwrap();
            let n = tokio::time::timeout(WAKE, r.read(&mut b)).await.expect("the read woken in time").expect("read");
            assert_eq!(n, 0, "the end of the stream after the peer's DISCONNECT");
            r
        });
        let writer = tokio::spawn(async move {
            let chunk = vec![5u8; 64 * 1024];
            let mut told = false;
            let start = Instant::now();
            loop {
                assert!(start.elapsed() < WAKE, "the writes end within {WAKE:?}");
                match tokio::time::timeout(Duration::ZERO, w.write(&chunk)).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => panic!("a write failed before the peer left: {e}"),
                    Err(_) => {}
                }
                // Pending: past the window, or every piece in flight; the bounded write says.
                if !told {
                    pend_tx.send(()).unwrap();
                    told = true;
                }
                match tokio::time::timeout(WAKE, w.write(&chunk)).await.expect("the write woken in time") {
                    Ok(_) => continue,
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
                        break;
                    }
                }
            }
            let f = tokio::time::timeout(WAKE, w.flush()).await.expect("a flush after the peer left ends");
            println!("flush after the DISCONNECT: {f:?}");
            let sd = tokio::time::timeout(WAKE, w.shutdown()).await.expect("a shutdown after the peer left ends");
            println!("shutdown after the DISCONNECT: {sd:?}");
            w
        });
        let r = tokio::time::timeout(LONG, reader).await.expect("the reader ends").expect("the reader");
        let w = tokio::time::timeout(LONG, writer).await.expect("the writer ends").expect("the writer");
        drop(r.unsplit(w));
    });
    client.join().unwrap();
    t.finish();
}

/// A write pending on a peer that granted no more space is woken when the peer leaves
/// without a word (its CM disconnect, no rsocket message) and fails `ConnectionReset`; then
/// flush, two shutdowns and a read each end, none hangs or panics.
#[test]
fn pending_write_is_woken_when_the_peer_vanishes() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7750u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let accepting = thread::spawn(move || listener.accept(T).expect("accept"));
    let mut peer = RawPeer::connect(&t, port, 32);
    let mut s = accepting.join().unwrap();
    let (pend_tx, pend_rx) = mpsc::channel::<()>();
    let writer = thread::spawn(move || {
        runtime().block_on(async {
            // The raw peer granted 2,048 bytes: they go, then a write waits for a grant.
            s.write_all(&[1u8; 2048]).await.expect("the granted bytes");
            let r = tokio::time::timeout(Duration::ZERO, s.write(&[2u8; 100])).await;
            assert!(r.is_err(), "a write past the grant went: {r:?}");
            pend_tx.send(()).unwrap();
            let e = tokio::time::timeout(WAKE, s.write(&[2u8; 100]))
                .await
                .expect("the write woken by the peer's departure")
                .expect_err("a write to a vanished peer");
            assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
            assert!(e.to_string().contains("without an rsocket"), "{e}");
            let f = tokio::time::timeout(WAKE, s.flush()).await.expect("a flush ends");
            println!("flush: {f:?}");
            for _ in 0..2 {
                let sd = tokio::time::timeout(WAKE, s.shutdown_async(Shutdown::Both)).await.expect("a shutdown ends");
                println!("shutdown: {sd:?}");
            }
            let rd = tokio::time::timeout(WAKE, s.read(&mut [0u8; 8])).await.expect("a read ends");
            assert!(matches!(rd, Ok(0) | Err(_)), "a read after the peer vanished: {rd:?}");
        });
        s
    });
    pend_rx.recv_timeout(WAKE).expect("the write pending");
    let _ = peer.lane.disconnect(peer.qp, Duration::from_secs(2));
    let s = writer.join().expect("the writer");
    drop(s);
    drop(peer);
    t.finish();
}

/// One stream read and written in turns by blocking calls and by async calls on three
/// runtimes (two kept, one made and dropped each round); before each message comes, a read
/// is cancelled after its first poll on another of them, so the CQ is armed under one and
/// the message awaited under another. Every message arrives, in order.
#[test]
fn blocking_and_async_calls_on_several_runtimes_take_turns_on_one_stream() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7751);
    let listener = StreamListener::bind(addr).unwrap();
    let (c, mut s, listener) = pair(listener, addr, StreamConfig::new());
    let rounds = 16usize;
    let (go_tx, go_rx) = mpsc::channel::<usize>();
    let peer = thread::spawn(move || {
        let mut c = c;
        c.set_read_timeout(WAKE);
        for r in 0..rounds {
            assert_eq!(go_rx.recv_timeout(LONG).expect("the next round"), r);
            let msg = random_bytes(1000 + r, r as u64);
            std::io::Write::write_all(&mut c, &msg).expect("the peer's write");
            let mut back = vec![0u8; msg.len()];
            std::io::Read::read_exact(&mut c, &mut back).expect("the echo");
            assert!(back == msg, "round {r}: the echo differs");
        }
        let mut rest = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut c, &mut rest).expect("the end"), 0);
        drop(c);
    });
    let (a, b) = (runtime(), runtime());
    s.set_read_timeout(WAKE);
    s.set_write_timeout(WAKE);
    // 0: runtime a, 1: blocking, 2: a new runtime, 3: runtime b.
    let cancel = |s: &mut Stream, mode: usize| {
        let mut buf = [0u8; 16];
        let r = match mode {
            0 => within(&a, Duration::ZERO, s.read(&mut buf)),
            3 => within(&b, Duration::ZERO, s.read(&mut buf)),
            _ => within(&runtime(), Duration::ZERO, s.read(&mut buf)),
        };
        assert!(r.is_err(), "a read with nothing sent: {r:?}");
    };
    for r in 0..rounds {
        cancel(&mut s, (r + 1) % 4);
        go_tx.send(r).unwrap();
        let mut msg = vec![0u8; 1000 + r];
        let fresh;
        let rt = match r % 4 {
            0 => Some(&a),
            3 => Some(&b),
            1 => None,
            _ => {
                fresh = runtime();
                Some(&fresh)
            }
        };
        match rt {
            Some(rt) => within(rt, WAKE, s.read_exact(&mut msg))
                .unwrap_or_else(|_| panic!("round {r}: the message not woken within {WAKE:?}"))
                .expect("read_exact"),
            None => std::io::Read::read_exact(&mut s, &mut msg).map(|()| 0).expect("the blocking read"),
        };
        assert!(msg == random_bytes(1000 + r, r as u64), "round {r}: the message differs");
        match (r + 2) % 4 {
            1 => {
                std::io::Write::write_all(&mut s, &msg).expect("the blocking write");
                std::io::Write::flush(&mut s).expect("the blocking flush");
            }
            m => {
                let rt = if m == 0 { &a } else { &b };
                within(rt, WAKE, async {
                    s.write_all(&msg).await?;
                    s.flush().await
                })
                .expect("the echo in time")
                .expect("the echo");
            }
        }
    }
    within(&a, WAKE, s.shutdown_async(Shutdown::Write)).expect("in time").expect("shutdown");
    drop(a);
    let mut rest = [0u8; 1];
    let n = within(&b, WAKE, s.read(&mut rest)).expect("the peer's close in time").unwrap();
    assert_eq!(n, 0, "the end of the stream");
    peer.join().expect("the peer");
    drop(b);
    drop(s);
    drop(listener);
    t.finish();
}

/// Pending read and flush futures forgotten (`mem::forget`), then their runtime dropped
/// before the stream: the stream goes on under blocking calls and a new runtime, every byte
/// intact, and its drop releases everything.
#[test]
fn forgotten_futures_and_a_runtime_dropped_first_leave_the_stream_whole() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7752);
    let listener = StreamListener::bind(addr).unwrap();
    let data = random_bytes(200_000, 52);
    let sent = data.clone();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let peer = thread::spawn(move || {
        let mut p = listener.accept(T).expect("accept");
        p.set_read_timeout(WAKE);
        let mut got = vec![0u8; sent.len()];
        std::io::Read::read_exact(&mut p, &mut got).expect("the data");
        assert!(got == sent, "the data differs");
        go_rx.recv_timeout(LONG).expect("go");
        std::io::Write::write_all(&mut p, b"after the runtime").expect("write");
        go_rx.recv_timeout(LONG).expect("go");
        std::io::Write::write_all(&mut p, b"on a new runtime").expect("write");
        let mut rest = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut p, &mut rest).expect("the end"), 0);
        (p, listener)
    });
    let rt = runtime();
    let mut s = rt.block_on(Stream::connect_async(addr, T)).expect("connect");
    rt.block_on(async {
        let mut buf = [0u8; 32];
        let mut read = Box::pin(s.read(&mut buf));
        assert!(tokio::time::timeout(Duration::ZERO, &mut read).await.is_err(), "a read with nothing sent");
        std::mem::forget(read);
        s.write_all(&data).await.expect("write_all");
        let mut flush = Box::pin(s.flush());
        let _ = tokio::time::timeout(Duration::ZERO, &mut flush).await;
        std::mem::forget(flush);
    });
    drop(rt);
    s.set_read_timeout(WAKE);
    std::io::Write::flush(&mut s).expect("the blocking flush");
    go_tx.send(()).unwrap();
    let mut b = [0u8; 17];
    std::io::Read::read_exact(&mut s, &mut b).expect("the blocking read");
    assert_eq!(&b, b"after the runtime");
    let rt2 = runtime();
    rt2.block_on(async {
        let mut b = [0u8; 16];
        let mut first = Box::pin(s.read(&mut b));
        assert!(tokio::time::timeout(Duration::ZERO, &mut first).await.is_err(), "a read with nothing sent");
        std::mem::forget(first);
        go_tx.send(()).unwrap();
        tokio::time::timeout(WAKE, s.read_exact(&mut b)).await.expect("the read woken in time").expect("read");
        assert_eq!(&b, b"on a new runtime");
        tokio::time::timeout(WAKE, s.shutdown_async(Shutdown::Both)).await.expect("in time").expect("shutdown");
    });
    let (p, listener) = peer.join().expect("the peer");
    // The stream dropped inside the second runtime, the first long gone.
    rt2.block_on(async move { drop(s) });
    drop((p, listener, rt2));
    t.finish();
}

/// Zero-length buffers, one huge buffer each way, and every call after a shutdown or the
/// peer's DISCONNECT: each returns what it should, promptly, with no panic.
#[test]
fn empty_and_huge_buffers_and_calls_after_the_end_are_answered() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7753);
    let huge = random_bytes(16 << 20, 53);
    let sent = huge.clone();
    runtime().block_on(async move {
        let listener = StreamListener::bind(addr).unwrap();
        let srv = tokio::spawn(async move {
            let mut s = listener.accept_async().await.expect("accept");
            let mut big = vec![0u8; 16 << 20];
            tokio::time::timeout(LONG, s.read_exact(&mut big)).await.expect("the huge read in time").expect("read");
            assert!(big == sent, "the huge buffer differs");
            // A huge buffer takes what there is, without waiting for it to fill.
            let n = tokio::time::timeout(WAKE, s.read(&mut big)).await.expect("in time").expect("read");
            assert_eq!(&big[..n], b"small", "a small message into a huge buffer");
            // The client's half-close: the end, again and again; this side still writes.
            for _ in 0..3 {
                assert_eq!(tokio::time::timeout(WAKE, s.read(&mut big)).await.expect("in time").expect("read"), 0);
            }
            s.write_all(b"to a half-closed peer").await.expect("a write to a half-closed peer");
            tokio::time::timeout(WAKE, s.shutdown_async(Shutdown::Both)).await.expect("in time").expect("shutdown");
            tokio::time::timeout(WAKE, s.shutdown_async(Shutdown::Both)).await.expect("in time").expect("again");
            assert_eq!(s.read(&mut [0u8; 4]).await.expect("a read after this side's DISCONNECT"), 0);
            let e = s.write(b"x").await.expect_err("a write after this side's DISCONNECT");
            assert_eq!(e.kind(), ErrorKind::BrokenPipe, "{e}");
            s
        });
        let mut c = Stream::connect_async(addr, T).await.expect("connect");
        let r = tokio::time::timeout(Duration::ZERO, c.read(&mut [])).await;
        assert!(matches!(r, Ok(Ok(0))), "a read into an empty buffer: {r:?}");
        let r = tokio::time::timeout(Duration::ZERO, c.write(&[])).await;
        assert!(matches!(r, Ok(Ok(0))), "a write of nothing: {r:?}");
        tokio::time::timeout(LONG, c.write_all(&huge)).await.expect("the huge write in time").expect("write_all");
        c.write_all(b"small").await.expect("write");
        tokio::time::timeout(WAKE, c.flush()).await.expect("in time").expect("flush");
        for _ in 0..2 {
            tokio::time::timeout(WAKE, AsyncWriteExt::shutdown(&mut c)).await.expect("in time").expect("shutdown");
        }
        let e = c.write(b"late").await.expect_err("a write after the shutdown");
        assert_eq!(e.kind(), ErrorKind::BrokenPipe, "{e}");
        tokio::time::timeout(WAKE, c.flush()).await.expect("in time").expect("a flush after the shutdown");
        let mut b = [0u8; 21];
        tokio::time::timeout(WAKE, c.read_exact(&mut b)).await.expect("in time").expect("read");
        assert_eq!(&b, b"to a half-closed peer");
        assert!(tokio::time::timeout(Duration::ZERO, c.read(&mut [])).await.is_ok(), "an empty read stays prompt");
        for _ in 0..3 {
            let n = tokio::time::timeout(WAKE, c.read(&mut b)).await.expect("woken by the DISCONNECT").expect("read");
            assert_eq!(n, 0, "the end after the peer's DISCONNECT");
        }
        let e = c.write(b"x").await.expect_err("a write after the peer's DISCONNECT");
        assert!(matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset), "{e}");
        let f = tokio::time::timeout(WAKE, c.flush()).await.expect("a flush after the DISCONNECT ends");
        println!("flush after the peer's DISCONNECT: {f:?}");
        for _ in 0..2 {
            let r = tokio::time::timeout(WAKE, c.shutdown_async(Shutdown::Both)).await.expect("a shutdown ends");
            println!("shutdown after the peer's DISCONNECT: {r:?}");
        }
        let s = tokio::time::timeout(LONG, srv).await.expect("the server in time").unwrap();
        drop(c);
        drop(s);
    });
    t.finish();
}

/// `connect_async` dropped after its first poll (its CM steps already on the blocking pool):
/// the connection it makes anyway is closed, so the server's read of it ends, and nothing
/// leaks once the runtime is gone.
#[test]
fn a_cancelled_connect_async_closes_the_connection_it_made() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7754);
    let listener = StreamListener::bind(addr).unwrap();
    let server = thread::spawn(move || {
        let mut s = listener.accept(WAKE).expect("the cancelled connect's connection");
        s.set_read_timeout(WAKE);
        let r = std::io::Read::read(&mut s, &mut [0u8; 8]);
        (r.map_err(|e| e.kind()), s, listener)
    });
    let rt = runtime();
    let r = within(&rt, Duration::ZERO, Stream::connect_async(addr, T));
    assert!(r.is_err(), "connect_async finished at its first poll");
    drop(rt); // waits for the blocking pool: the connect ends, its stream is dropped
    let (read, s, listener) = server.join().expect("the server");
    assert!(matches!(read, Ok(0) | Err(ErrorKind::ConnectionReset)), "the server's read: {read:?}");
    drop((s, listener));
    t.finish();
}

/// `accept_async` dropped again and again after its first poll while a client connects:
/// each request taken is accepted (or rejected) and closed, never left hanging; a later
/// `accept_async` gets the next client, whose echo arrives.
#[test]
fn cancelled_accept_async_leaves_the_listener_usable() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7755);
    let listener = StreamListener::bind(addr).unwrap();
    let first = thread::spawn(move || match Stream::connect(addr, WAKE) {
        Err(e) => format!("refused: {e}"),
        Ok(mut c) => {
            c.set_read_timeout(WAKE);
            match std::io::Read::read(&mut c, &mut [0u8; 8]) {
                Ok(0) => "closed".to_string(),
                r => panic!("the first client's read: {r:?}"),
            }
        }
    });
    let rt = runtime();
    rt.block_on(async {
        let start = Instant::now();
        // Cancelled until the first client's request is taken (its accept then runs on).
        while !first.is_finished() {
            assert!(start.elapsed() < WAKE, "the first client not served within {WAKE:?}");
            let _ = tokio::time::timeout(Duration::ZERO, listener.accept_async()).await;
            tokio::task::yield_now().await;
        }
    });
    println!("the first client: {}", first.join().unwrap());
    let second = thread::spawn(move || {
        let mut c = Stream::connect(addr, WAKE).expect("the second client");
        c.set_read_timeout(WAKE);
        std::io::Write::write_all(&mut c, b"second").unwrap();
        let mut b = [0u8; 6];
        std::io::Read::read_exact(&mut c, &mut b).expect("the echo");
        assert_eq!(&b, b"second");
    });
    rt.block_on(async {
        let mut s = tokio::time::timeout(WAKE, listener.accept_async()).await.expect("accept in time").unwrap();
        let mut b = [0u8; 6];
        tokio::time::timeout(WAKE, s.read_exact(&mut b)).await.expect("in time").expect("read");
        s.write_all(&b).await.expect("echo");
        tokio::time::timeout(WAKE, s.flush()).await.expect("in time").expect("flush");
        tokio::task::spawn_blocking(move || second.join()).await.unwrap().expect("the second client");
        drop(s);
    });
    drop(rt);
    drop(listener);
    t.finish();
}
