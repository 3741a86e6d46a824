//! The rsocket-compatible stream under tokio (features `stream` and `tokio`), on the device:
//! `AsyncRead` and `AsyncWrite` driven by tokio's own utilities (`tokio::io::copy`, `split`,
//! `read_to_end`), both ends on one current-thread runtime; against rdma-core's `rstream`; a
//! pending read woken by the peer's death, not by a timer; cancelled reads that lose nothing;
//! and 1,000 streams echoing at once on one runtime thread.

mod common;

use std::net::{Shutdown, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{Cap, DeviceTest, T};
use rdma_cm::stream::{Stream, StreamListener};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The bound of a whole transfer under the emulator.
const LONG: Duration = Duration::from_secs(120);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Bytes that no offset or order mistake can reproduce.
fn random_bytes(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ len as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Both ends on one current-thread runtime: the server echoes with `tokio::io::copy` over the
/// halves of `tokio::io::split`, then shuts its writing down; the client writes 2 MiB (eight
/// times every buffer of either end, so the two tasks must take turns on the one thread),
/// shuts its writing down, and reads everything back with `read_to_end`, byte for byte.
#[test]
fn tokio_copy_echoes_2_mib_on_one_thread() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7731);
    let data = random_bytes(2 << 20);
    let back = runtime().block_on(async {
        let listener = StreamListener::bind(addr).unwrap();
        let server = tokio::spawn(async move {
            let s = listener.accept_async().await.expect("accept_async");
            let (mut r, mut w) = tokio::io::split(s);
            let n = tokio::io::copy(&mut r, &mut w).await.expect("copy");
            w.shutdown().await.expect("the server's shutdown");
            n
        });
        let s = Stream::connect_async(addr, T).await.expect("connect_async");
        let (mut r, mut w) = tokio::io::split(s);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(100_003) {
                w.write_all(piece).await.expect("write_all");
            }
            w.shutdown().await.expect("the client's shutdown");
            w
        });
        let mut back = Vec::new();
        tokio::time::timeout(LONG, r.read_to_end(&mut back)).await.expect("the echo in time").expect("read_to_end");
        let echoed = server.await.unwrap();
        assert_eq!(echoed, data.len() as u64, "bytes the server's copy moved");
        drop(writer.await.unwrap());
        back
    });
    assert_eq!(back.len(), data.len(), "bytes echoed");
    assert!(back == data, "the echo differs from what was sent");
    t.finish();
}

/// Our async client against rdma-core's `rstream` server (`-T b -T v`, its counter pattern):
/// what we write it echoes, and we check every byte; its close ends our reads.
#[test]
fn tokio_client_against_rstream_server() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7732u16;
    let (size, count) = (16 * 1024usize, 48usize);
    let child = Command::new("rstream")
        .args(["-b", &t.addr.to_string(), "-p", &port.to_string(), "-f", "ip"])
        .args(["-S", &size.to_string(), "-C", &count.to_string(), "-I", "1", "-T", "b", "-T", "v"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run rstream (rdmacm-utils)");
    common::wait_listening(port, Duration::from_secs(60));
    runtime().block_on(async {
        let mut s = Stream::connect_async(SocketAddr::new(t.addr, port), T).await.expect("connect to rstream");
        let mut next = 0usize;
        for len in [16, size * count] {
            let sent: Vec<u8> = (next..next + len).map(|i| i as u8).collect();
            next += len;
            let mut b = vec![0u8; len];
            s.write_all(&sent).await.expect("send to rstream");
            tokio::time::timeout(LONG, s.read_exact(&mut b)).await.expect("rstream's echo in time").expect("read");
            assert!(b == sent, "rstream's echo of {len} bytes differs");
        }
        let mut rest = [0u8; 1];
        let n = tokio::time::timeout(LONG, s.read(&mut rest)).await.expect("rstream's close in time").unwrap();
        assert_eq!(n, 0, "end of stream after rstream's run");
    });
    let (status, text) = common::wait_exit(child, LONG, "rstream (server)");
    assert!(status.success(), "rstream exited with {status}:\n{text}");
    t.finish();
}

/// A read pending on a quiet peer is woken by the peer's death (the connection's CM event,
/// which the task waits on beside the CQ), and says the peer left, well before any timer.
#[test]
fn tokio_pending_read_wakes_when_the_peer_dies() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7733u16;
    let addr = SocketAddr::new(t.addr, port);
    // rstream as the client sends its 16-byte sync and waits for the echo; killed then, it
    // leaves without a word.
    let listener = StreamListener::bind(addr).unwrap();
    let child = Command::new("rstream")
        .args(["-s", &t.addr.to_string(), "-p", &port.to_string(), "-f", "ip", "-S", "1024", "-C", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run rstream (rdmacm-utils)");
    let pid = child.id() as i32;
    runtime().block_on(async {
        let mut s = tokio::time::timeout(T, listener.accept_async()).await.expect("accept in time").unwrap();
        let mut sync = [0u8; 16];
        s.read_exact(&mut sync).await.expect("rstream's sync");
        let killer = tokio::task::spawn_blocking(move || {
            // SAFETY: kill(2) on the pid of a child this test started and has not reaped yet.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
            let (status, _) = common::wait_exit(child, T, "the killed rstream");
            assert!(!status.success());
            Instant::now()
        });
        let mut buf = [0u8; 64];
        let err = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
            .await
            .expect("the read woke for the peer's death within 30 s")
            .expect_err("a read from a killed peer fails");
        let killed = killer.await.unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
        assert!(err.to_string().contains("without an rsocket SHUTDOWN or DISCONNECT"), "{err}");
        println!("woke {:?} after the kill: {err}", killed.elapsed());
    });
    drop(listener);
    t.finish();
}

/// A field of `/proc/self/status`, in KiB.
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

/// Raises this process's descriptor limit to `want` (each stream end holds two: its CQ's
/// completion channel and its CM event channel), failing clearly where it cannot.
fn raise_fd_limit(want: u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        if r.rlim_cur < want {
            r.rlim_cur = want;
            r.rlim_max = r.rlim_max.max(want);
            assert_eq!(
                libc::setrlimit(libc::RLIMIT_NOFILE, &r),
                0,
                "raising RLIMIT_NOFILE to {want}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The small streams of the scale test: 32 KiB each way and 32 credits, so that 2,000 stream
/// ends register some 130 MiB, not the defaults' 1 GiB.
fn small() -> rdma_cm::stream::StreamConfig {
    rdma_cm::stream::StreamConfig::new().recv_buffer(32 * 1024).send_buffer(32 * 1024).credits(32)
}

/// `n` streams open at once, the server's ends all on one current-thread runtime (this
/// thread), each echoing; the clients on a runtime of their own thread. Each client sends
/// `rounds` messages of 64 bytes (its number and the round in them) and checks each echo, then
/// half-closes and reads the server's close. Returns the round trips per second over all
/// streams, and the resident and pinned memory added per connection (both ends, KiB).
fn echo_many(port: u16, n: usize, rounds: usize) -> (f64, u64, u64) {
    let t = DeviceTest::start();
    raise_fd_limit(4 * n as u64 + 256);
    let addr = SocketAddr::new(t.addr, port);
    let (rss0, pin0) = (status_kib("VmRSS:"), status_kib("VmPin:"));
    let listener = small().bind(addr).unwrap();
    let (opened_tx, opened_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let clients = thread::spawn(move || {
        runtime().block_on(async move {
            // Connected 50 at a time: each connect's CM steps run on the blocking pool.
            let opened = Instant::now();
            let mut streams = Vec::with_capacity(n);
            for batch in (0..n).collect::<Vec<_>>().chunks(50) {
                let tasks: Vec<_> = batch.iter().map(|_| tokio::spawn(small().connect_async(addr, LONG))).collect();
                for task in tasks {
                    streams.push(task.await.unwrap().expect("connect"));
                }
            }
            eprintln!("{n} streams connected in {:?}", opened.elapsed());
            opened_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            let start = Instant::now();
            let tasks: Vec<_> = streams
                .into_iter()
                .enumerate()
                .map(|(id, mut s)| {
                    tokio::spawn(async move {
                        let mut msg = [0u8; 64];
                        let mut back = [0u8; 64];
                        for r in 0..rounds {
                            msg[..8].copy_from_slice(&(id as u64).to_le_bytes());
                            msg[8..16].copy_from_slice(&(r as u64).to_le_bytes());
                            let echo = async {
                                s.write_all(&msg).await.expect("write");
                                s.read_exact(&mut back).await.expect("read the echo");
                            };
                            tokio::time::timeout(LONG, echo)
                                .await
                                .unwrap_or_else(|_| panic!("stream {id}, round {r}: no echo within {LONG:?}"));
                            assert_eq!(back, msg, "stream {id}, round {r}: the echo differs");
                        }
                        let close = async {
                            s.shutdown_async(Shutdown::Write).await.expect("shutdown");
                            let mut rest = [0u8; 1];
                            s.read(&mut rest).await.expect("the server's close")
                        };
                        let n = tokio::time::timeout(LONG, close)
                            .await
                            .unwrap_or_else(|_| panic!("stream {id}: no close within {LONG:?}"));
                        assert_eq!(n, 0, "stream {id}: the end of the stream after the server's close");
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("a client");
            }
            eprintln!("{n} streams echoed {rounds} messages each in {:?}", start.elapsed());
            start.elapsed()
        })
    });
    // The server: every stream's task on this thread's runtime, in one LocalSet that runs
    // until the last of them has ended.
    let local = tokio::task::LocalSet::new();
    let (rss, pin, elapsed) = runtime().block_on(local.run_until(async {
        let mut served = Vec::with_capacity(n);
        for _ in 0..n {
            let mut s = tokio::time::timeout(LONG, listener.accept_async()).await.expect("accept in time").unwrap();
            served.push(tokio::task::spawn_local(async move {
                let mut buf = [0u8; 4096];
                loop {
                    let k = s.read(&mut buf).await.expect("the server's read");
                    if k == 0 {
                        break;
                    }
                    s.write_all(&buf[..k]).await.expect("the server's write");
                }
                s.shutdown_async(Shutdown::Write).await.expect("the server's shutdown");
            }));
        }
        // Every stream is open at both ends once the clients say so.
        tokio::task::spawn_blocking(move || opened_rx.recv().unwrap()).await.unwrap();
        let (rss, pin) = (status_kib("VmRSS:"), status_kib("VmPin:"));
        go_tx.send(()).unwrap();
        for task in served {
            tokio::time::timeout(LONG, task).await.expect("every server task ended").expect("a server task");
        }
        let elapsed = tokio::task::spawn_blocking(move || clients.join().expect("the clients")).await.unwrap();
        (rss, pin, elapsed)
    }));
    drop(listener);
    let rate = (n * rounds) as f64 / elapsed.as_secs_f64();
    let per = |now: u64, before: u64| now.saturating_sub(before) / n as u64;
    t.finish();
    (rate, per(rss, rss0), per(pin, pin0))
}

/// 1,000 streams open at once, every server end on one tokio runtime thread, each echoing 20
/// messages: every echo arrives intact, every stream closes in order. Prints the echo rate and
/// the memory per connection beside 10 streams' (the table in BENCHMARKS.md).
#[test]
fn tokio_thousand_streams_echo_on_one_runtime_thread() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    drop(t);
    let (rate10, rss10, pin10) = echo_many(7734, 10, 200);
    let (rate1000, rss1000, pin1000) = echo_many(7735, 1000, 20);
    println!("| streams | round trips / s | resident KiB / connection | pinned KiB / connection |");
    println!("|---:|---:|---:|---:|");
    println!("| 10 | {rate10:.0} | {rss10} | {pin10} |");
    println!("| 1000 | {rate1000:.0} | {rss1000} | {pin1000} |");
    assert!(pin1000 > 0, "the streams' buffers are registered (pinned)");
}

/// A pending read whose future is dropped (a timeout ran out) takes nothing: reads cancelled
/// again and again, before and while the data comes, lose no byte of it. A read polled on a
/// runtime without an IO driver fails that call with the cause, and the stream goes on.
#[test]
fn tokio_cancelled_reads_lose_nothing_and_a_runtime_without_io_fails_only_the_call() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let addr = SocketAddr::new(t.addr, 7736);
    let data = random_bytes(300_000);
    let listener = StreamListener::bind(addr).unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let sent = data.clone();
    let server = thread::spawn(move || {
        // The blocking traits, named: tokio's extension traits are in scope too.
        let mut s = listener.accept(T).expect("accept");
        go_rx.recv().unwrap();
        std::io::Write::write_all(&mut s, &sent).expect("the server's write");
        s.shutdown(Shutdown::Write).expect("the server's shutdown");
        let mut back = Vec::new();
        std::io::Read::read_to_end(&mut s, &mut back).expect("the server's read");
        back
    });
    let mut s = Stream::connect(addr, T).expect("connect");
    let no_io = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let err = no_io.block_on(s.read(&mut [0u8; 8])).expect_err("a read on a runtime without an IO driver");
    assert!(err.to_string().contains("IO driver"), "{err}");
    runtime().block_on(async {
        let mut buf = [0u8; 4096];
        for _ in 0..20 {
            let r = tokio::time::timeout(Duration::from_millis(5), s.read(&mut buf)).await;
            assert!(r.is_err(), "a read with nothing sent yet stays pending");
        }
        go_tx.send(()).unwrap();
        let mut got = Vec::new();
        let (mut cancelled, start) = (0usize, Instant::now());
        loop {
            assert!(start.elapsed() < LONG, "the data within {LONG:?}");
            match tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
                Err(_) => cancelled += 1,
                Ok(Ok(0)) => break,
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => panic!("read: {e}"),
            }
        }
        assert_eq!(got.len(), data.len(), "bytes read through {cancelled} cancelled reads");
        assert!(got == data, "the bytes differ after {cancelled} cancelled reads");
        s.write_all(b"back").await.expect("write");
        AsyncWriteExt::shutdown(&mut s).await.expect("shutdown");
        println!("{cancelled} reads cancelled while the data came");
    });
    assert_eq!(server.join().unwrap(), b"back", "what the server read");
    drop(s);
    t.finish();
}
