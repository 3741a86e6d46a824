//! The stream's writes straight from the caller's registered memory (`Stream::write_region`,
//! feature `stream`) on the device, attacked with safe code: in order with copied writes and
//! flushes, through grants smaller than the region, chunks and remotely writable regions,
//! refused for a foreign region or an odd range, after a shutdown and after the peer left, a
//! WRITE that a peer without receives never takes, a grant that never comes, without
//! allocation per WRITE, and under tokio (a future dropped half-way included). Every call
//! gives the region back once no WRITE holds it, its bytes unchanged.

mod common;
#[path = "common/counting.rs"]
mod counting;
#[path = "common/raw_peer.rs"]
mod raw_peer;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::{scrambled, Cap, DeviceTest, T};
use raw_peer::RawPeer;
use rdma_cm::stream::{Stream, StreamConfig, StreamListener};
use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, VerbsContext};

/// `data` registered on the stream's protection domain with `access` (its buffer comes back
/// with `into_buffer`).
fn region_with(s: &Stream, data: &[u8], access: AccessFlags) -> MemoryRegion {
    MemoryRegion::register(s.pd(), data.to_vec().into_boxed_slice(), access).unwrap()
}

fn region_of(s: &Stream, data: &[u8]) -> MemoryRegion {
    region_with(s, data, AccessFlags::LOCAL_WRITE)
}

/// The region a failed call gave back, checked: no WRITE holds it and its bytes are `data`.
fn given_back(e: rdma_cm::stream::WriteRegionError, data: &[u8]) -> (std::io::Error, MemoryRegion) {
    let (e, mr) = e.into_parts();
    let mut mr = mr.unwrap_or_else(|| panic!("the region did not come back with {e}"));
    assert_eq!(mr.outstanding(), 0, "a WRITE still holds the region given back with {e}");
    assert!(mr.as_mut_slice().unwrap() == data, "the region's bytes changed ({e})");
    (e, mr)
}

/// A server that reads everything to the end of the stream, then closes; what it read.
fn reader(listener: StreamListener) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("server read");
        s.shutdown(Shutdown::Both).expect("server shutdown");
        got
    })
}

/// Ranges of a region (WRITEs of 64 KiB and less, across grants) between copied writes: the
/// server reads them all, in order and byte-exact. Each call gives the region back with no
/// WRITE holding it, its bytes unchanged, and its buffer comes back at the end. Once with the default sizes and a
/// 3 MiB region, once through a 4 KiB receive buffer and one credit at each end, so that
/// every WRITE is cut at a 2 KiB grant.
#[test]
fn region_ranges_arrive_in_order_with_copied_writes() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    // Through 2 KiB grants and one credit each message waits for the peer's read: a smaller
    // region does, still many grants and more than a WRITE's 64 KiB.
    let small = StreamConfig::new().recv_buffer(4096).credits(1);
    for (port, cfg, len) in [(7761u16, StreamConfig::new(), (3 << 20) + 7), (7762, small, 300_007)] {
        let server = reader(cfg.bind(SocketAddr::new(t.addr, port)).unwrap());
        let mut c = cfg.connect(SocketAddr::new(t.addr, port), T).expect("connect");
        let data = scrambled(len, 3);
        let mut mr = region_of(&c, &data);
        let mut sent = Vec::new();
        let ranges = [5..data.len() - 2, 0..1, 64..128, 1000..1000 + 65_536, 7..7, 0..data.len()];
        for (k, r) in ranges.into_iter().enumerate() {
            let head = scrambled(k * 37 + 1, k as u32);
            c.write_all(&head).unwrap();
            sent.extend_from_slice(&head);
            mr = c.write_region(mr, r.clone()).unwrap_or_else(|e| panic!("write_region({r:?}): {e}"));
            assert_eq!(mr.outstanding(), 0, "a WRITE holds the region write_region gave back");
            sent.extend_from_slice(&data[r]);
        }
        assert!(mr.as_mut_slice().unwrap() == &data[..], "the region's bytes changed");
        c.shutdown(Shutdown::Write).unwrap();
        let got = server.join().unwrap();
        assert_eq!(got.len(), sent.len(), "bytes the server read ({cfg:?})");
        assert!(got == sent, "the server read other bytes than were sent ({cfg:?})");
        drop(c);
        let back = mr.into_buffer().expect("the caller's buffer comes back");
        assert!(back[..] == data[..], "the buffer's bytes changed");
    }
    t.finish();
}

/// Odd ranges never panic: empty ones anywhere inside (the end included) send nothing; ranges
/// past the end (up to `usize::MAX`) and backwards are refused with `InvalidInput` naming the
/// region's size. A region of another protection domain, or of another stream's, is refused
/// naming `Stream::pd()`. Each refusal gives the region back; the stream goes on, and the
/// reader gets exactly what was accepted.
#[test]
fn odd_ranges_and_foreign_regions_are_refused() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let (p1, p2) = (7763u16, 7768u16);
    let s1 = reader(StreamListener::bind(SocketAddr::new(t.addr, p1)).unwrap());
    let s2 = reader(StreamListener::bind(SocketAddr::new(t.addr, p2)).unwrap());
    let mut c = Stream::connect(SocketAddr::new(t.addr, p1), T).expect("connect");
    let mut d = Stream::connect(SocketAddr::new(t.addr, p2), T).expect("connect");
    let data = scrambled(4096, 1);
    let mut mr = region_of(&c, &data);
    let mut sent = Vec::new();
    for r in [0..0, 4096..4096, 17..17, 0..1, 4095..4096] {
        mr = c.write_region(mr, r.clone()).unwrap_or_else(|e| panic!("{r:?}: {e}"));
        sent.extend_from_slice(&data[r]);
    }
    #[allow(clippy::reversed_empty_ranges)]
    let bad = [0..4097, 4096..4097, 4097..4097, usize::MAX..usize::MAX, 3..usize::MAX, 4096..0, 10..5];
    for r in bad {
        let e = c.write_region(mr, r.clone()).expect_err("a range outside the region");
        let (e, back) = given_back(e, &data);
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{r:?}: {e}");
        assert!(e.to_string().contains("not inside the region's 4096 bytes"), "{r:?}: {e}");
        mr = back;
    }
    let ctx = VerbsContext::open(&common::caps::device_under_test()).unwrap();
    let other = ProtectionDomain::new(&ctx).unwrap();
    let foreign = MemoryRegion::register(&other, data.clone().into_boxed_slice(), AccessFlags::empty()).unwrap();
    let (e, foreign) = given_back(c.write_region(foreign, 0..16).expect_err("a region of another PD"), &data);
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("Stream::pd()"), "the error says which PD to use: {e}");
    let (e, mr) = given_back(d.write_region(mr, 0..16).expect_err("a region of the other stream's PD"), &data);
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    d.write_all(b"d goes on").unwrap();
    c.write_region(mr, 0..4096).expect("the stream goes on after the refusals");
    sent.extend_from_slice(&data);
    c.shutdown(Shutdown::Write).unwrap();
    d.shutdown(Shutdown::Write).unwrap();
    assert!(s1.join().unwrap() == sent, "the reader got other bytes than were accepted");
    assert_eq!(s2.join().unwrap(), b"d goes on");
    drop((c, d, foreign, other, ctx));
    t.finish();
}

/// Copied writes (inline and not), region writes (a plain region, a remotely writable one,
/// chunks of a split one) and flushes in a random order, through an 8 KiB receive buffer and
/// 2 credits (every WRITE cut at a 4 KiB grant): the reader gets every byte in order, and no
/// region changed.
#[test]
fn mixed_writes_regions_and_flushes_keep_their_order() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7769u16;
    let cfg = StreamConfig::new().recv_buffer(8192).credits(2);
    let server = reader(cfg.bind(SocketAddr::new(t.addr, port)).unwrap());
    let mut c = cfg.connect(SocketAddr::new(t.addr, port), T).expect("connect");
    let (plain, remote, split) = (scrambled(300_000, 51), scrambled(70_001, 52), scrambled(200_000, 53));
    let mut regions = vec![
        (Some(region_of(&c, &plain)), plain.clone()),
        (Some(region_with(&c, &remote, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)), remote.clone()),
    ];
    for (k, ch) in region_of(&c, &split).split(70_000).unwrap().into_iter().enumerate() {
        regions.push((Some(ch), split[k * 70_000..((k + 1) * 70_000).min(split.len())].to_vec()));
    }
    let mut sent = Vec::new();
    let mut x = 0x9E37_79B9u32;
    let mut next = |m: u32| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x % m
    };
    for step in 0..150 {
        match next(5) {
            0 | 1 => {
                let len = [1, 63, 64, 65, 4095, 4097, 40_000][next(7) as usize];
                let bytes = scrambled(len, step);
                c.write_all(&bytes).unwrap();
                sent.extend_from_slice(&bytes);
            }
            2 | 3 => {
                let n = regions.len() as u32;
                let (slot, bytes) = &mut regions[next(n) as usize];
                let a = next(bytes.len() as u32 + 1) as usize;
                let b = a + next((bytes.len() - a) as u32 + 1).min(50_000) as usize;
                let mr = slot.take().unwrap();
                *slot = Some(c.write_region(mr, a..b).unwrap_or_else(|e| panic!("step {step}: {a}..{b}: {e}")));
                sent.extend_from_slice(&bytes[a..b]);
            }
            _ => c.flush().unwrap(),
        }
    }
    for (k, (mr, bytes)) in regions.iter_mut().enumerate() {
        let mr = mr.as_mut().unwrap();
        assert_eq!(mr.outstanding(), 0, "region {k} held");
        let mut now = vec![0u8; bytes.len()];
        mr.read_at(0, &mut now).unwrap();
        assert!(now == *bytes, "region {k}'s bytes changed");
    }
    c.shutdown(Shutdown::Write).unwrap();
    let got = server.join().unwrap();
    assert_eq!(got.len(), sent.len(), "bytes the server read");
    let first = got.iter().zip(&sent).position(|(a, b)| a != b);
    assert!(first.is_none(), "the server read other bytes than were sent, first at {first:?}");
    drop((c, regions));
    t.finish();
}

/// After `shutdown(Write)` a `write_region` fails with `BrokenPipe`; after the peer dropped
/// its stream, calls fail within a bounded number (no hang, no timeout, no panic). Each
/// failure gives the region back unchanged (or, on a broken stream, none if the flush did not
/// come).
#[test]
fn write_region_after_shutdown_and_after_the_peer_left() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7770u16;
    let server = reader(StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap());
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    let data = scrambled(4096, 71);
    let mr = c.write_region(region_of(&c, &data), 0..100).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let (e, mr) = given_back(c.write_region(mr, 0..10).expect_err("after shutdown(Write)"), &data);
    assert_eq!(e.kind(), ErrorKind::BrokenPipe, "{e}");
    assert!(server.join().unwrap() == data[..100], "the reader got the 100 bytes");
    drop((c, mr));

    let port = 7771u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (gone_tx, gone) = mpsc::channel();
    let server = thread::spawn(move || {
        drop(listener.accept(T).expect("accept"));
        gone_tx.send(()).unwrap();
    });
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    c.set_write_timeout(Duration::from_secs(20));
    let mut mr = region_of(&c, &data);
    gone.recv().unwrap();
    server.join().unwrap();
    let mut oks = 0;
    let e = loop {
        match c.write_region(mr, 0..4096) {
            Ok(back) => mr = back,
            Err(e) => break e,
        }
        oks += 1;
        assert!(oks < 1000, "write_region went on succeeding after the peer left");
    };
    assert_ne!(e.error().kind(), ErrorKind::TimedOut, "write_region after the peer left timed out: {e}");
    println!("after the peer left: {oks} write_region calls OK, then {e}");
    if let (_, Some(mut back)) = e.into_parts() {
        assert_eq!(back.outstanding(), 0, "a WRITE still holds the region given back");
        assert!(back.as_mut_slice().unwrap() == &data[..], "the region's bytes changed");
    }
    drop(c);
    t.finish();
}

/// A peer without receives never takes the WRITE (it waits on RNR retries): with a 1 s write
/// timeout, `write_region` fails with `TimedOut` saying the WRITEs did not complete, the
/// stream is closed (a later write fails with the same cause), and the region comes back once
/// the flush released it, its bytes unchanged. The peer's buffer holds nothing of it.
#[test]
fn a_write_the_peer_never_takes_times_out_and_gives_the_region_back() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7764u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (done_tx, done) = mpsc::channel();
    let data = scrambled(1500, 9);
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        s.set_write_timeout(Duration::from_secs(1));
        let e = s.write_region(region_of(&s, &data), 0..1500).expect_err("the peer takes nothing");
        let (e, mr) = given_back(e, &data);
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("did not complete"), "{e}");
        let later = s.write(b"x").expect_err("the stream is closed");
        assert!(later.to_string().contains("did not complete"), "{later}");
        done_tx.send(()).unwrap();
        drop(s);
        mr.into_buffer().expect("the buffer comes back")
    });
    let mut peer = RawPeer::connect(&t, port, 0);
    done.recv().unwrap();
    assert_eq!(server.join().unwrap().len(), 1500);
    let mut at_peer = vec![0u8; 1500];
    peer.rbuf.read_at(0, &mut at_peer).unwrap();
    assert!(at_peer.iter().all(|&b| b == 0), "the peer's buffer holds bytes of a WRITE it never took");
    let _ = peer.lane.disconnect(peer.qp, Duration::from_secs(2));
    drop(peer);
    t.finish();
}

/// A range larger than the silent peer's one 2048-byte grant, with a 1 s write timeout: the
/// call ends with `TimedOut` saying 2048 bytes were posted (no hang), and the region comes
/// back once the flush released the WRITE in flight.
#[test]
fn write_region_times_out_when_no_grant_comes() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7765u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (done_tx, done) = mpsc::channel();
    let data = scrambled(10_000, 91);
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        s.set_write_timeout(Duration::from_secs(1));
        let e = s.write_region(region_of(&s, &data), 0..10_000).expect_err("no grant after the first");
        let (e, mr) = given_back(e, &data);
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("after 2048 of the range's 10000 bytes were posted"), "{e}");
        done_tx.send(()).unwrap();
        drop((s, mr));
    });
    let peer = RawPeer::connect(&t, port, 0);
    done.recv().unwrap();
    server.join().unwrap();
    drop(peer);
    t.finish();
}

/// `write_region` allocates nothing per WRITE: 8 MiB sent as ranges of a 1 MiB region
/// (whole, and cut at odd places), counted on the writing thread (`common/counting.rs`).
#[test]
fn region_writes_allocate_nothing() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    counting::assert_it_counts();
    let port = 7766u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0usize;
        loop {
            match s.read(&mut buf).expect("read") {
                0 => return total,
                n => total += n,
            }
        }
    });
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    let mut mr = Some(region_of(&c, &scrambled(1 << 20, 2)));
    let ranges = [0..1 << 20, 3..70_003, 65_536..1 << 20, 1..2, 100..(1 << 20) - 100];
    let mut total = 0;
    counting::watched(|| {
        while total < 8 << 20 {
            for r in ranges.clone() {
                total += r.len();
                mr = Some(c.write_region(mr.take().unwrap(), r).expect("write_region"));
            }
        }
    });
    let (allocs, bytes) = counting::counts();
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) writing {total} bytes from a region");
    c.shutdown(Shutdown::Both).unwrap();
    assert_eq!(server.join().unwrap(), total, "bytes the server read");
    drop((c, mr));
    t.finish();
}

/// `write_region_async` on one tokio thread, the server reading with blocking calls: the
/// bytes arrive in order with an async copied write.
#[cfg(feature = "tokio")]
#[test]
fn region_writes_under_tokio() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7767u16;
    let server = reader(StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap());
    let data = scrambled(1 << 20, 5);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let sent = rt.block_on(async {
        use tokio::io::AsyncWriteExt;
        let mut c = Stream::connect_async(SocketAddr::new(t.addr, port), T).await.expect("connect");
        let mr = region_of(&c, &data);
        AsyncWriteExt::write_all(&mut c, b"async head").await.unwrap();
        let mr = c.write_region_async(mr, 10..data.len()).await.expect("write_region_async");
        assert_eq!(mr.outstanding(), 0, "a WRITE holds the region write_region_async gave back");
        AsyncWriteExt::shutdown(&mut c).await.unwrap();
        drop(c);
        let mut sent = b"async head".to_vec();
        sent.extend_from_slice(&data[10..]);
        sent
    });
    assert!(server.join().unwrap() == sent, "the server read other bytes than were sent");
    t.finish();
}

/// A `write_region_async` future polled once (it posts what the grants allow, then waits: the
/// reader reads nothing yet) and dropped, the region with it; the stream is used on: the
/// reader gets the head, a prefix of the range (whatever was posted), then the tail and a
/// later region write, nothing lost, doubled or reordered.
#[cfg(feature = "tokio")]
#[test]
fn a_dropped_write_region_async_leaves_a_prefix() {
    use std::future::Future;
    use std::task::Poll;
    use tokio::io::AsyncWriteExt;
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7772u16;
    let listener = StreamConfig::new().recv_buffer(4096).bind(SocketAddr::new(t.addr, port)).unwrap();
    let (go_tx, go) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        go.recv().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("server read");
        got
    });
    let data = scrambled(100_000, 99);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = Stream::connect_async(SocketAddr::new(t.addr, port), T).await.expect("connect");
        AsyncWriteExt::write_all(&mut c, b"head").await.unwrap();
        {
            let mut fut = Box::pin(c.write_region_async(region_of(&c, &data), 0..100_000));
            let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
            assert!(first.is_pending(), "100000 bytes cannot all be posted while the reader reads nothing");
        }
        go_tx.send(()).unwrap();
        AsyncWriteExt::write_all(&mut c, b"tail").await.unwrap();
        let mr = c.write_region_async(region_of(&c, &data), 5..10).await.expect("the stream goes on");
        AsyncWriteExt::shutdown(&mut c).await.unwrap();
        drop((c, mr));
    });
    let got = server.join().unwrap();
    let mut end = b"tail".to_vec();
    end.extend_from_slice(&data[5..10]);
    assert!(got.starts_with(b"head") && got.ends_with(&end), "head and tail: {} bytes", got.len());
    let mid = &got[4..got.len() - end.len()];
    assert!(mid.len() < 100_000, "the dropped future's range was sent whole: {}", mid.len());
    assert!(mid == &data[..mid.len()], "the dropped future's bytes are not a prefix of its range");
    t.finish();
}
