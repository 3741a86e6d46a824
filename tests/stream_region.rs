//! The stream's writes straight from the caller's registered memory (`Stream::write_region`,
//! feature `stream`) on the device: in order with copied writes, through grants smaller than
//! the region, refused for a foreign region or range, the region kept unchangeable while its
//! WRITEs are in flight (attacked with safe code: a peer that posts no receive keeps them in
//! flight), given back by the stream's drop, without allocation per WRITE, and under tokio.

mod common;
#[path = "common/counting.rs"]
mod counting;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::mpsc;
use std::thread;

use common::{Cap, DeviceTest, T};
use rdma_cm::stream::wire::{ConnData, Sge};
use rdma_cm::stream::{Stream, StreamConfig, StreamListener};
use rdma_cm::verbs::lane::{Lane, RecvWr};
use rdma_cm::{AccessFlags, Client, ConnParam, Error, MemoryRegion, ProtectionDomain, QpInit, VerbsContext};

/// Bytes that differ at every offset of a long run.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// `data` registered on the stream's protection domain (its buffer comes back with
/// `into_buffer`).
fn region_of(s: &Stream, data: &[u8]) -> MemoryRegion {
    MemoryRegion::register(s.pd(), data.to_vec().into_boxed_slice(), AccessFlags::LOCAL_WRITE).unwrap()
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

/// Ranges of a 3 MiB region (whole WRITEs of 64 KiB and less, across grants) between copied
/// writes: the server reads them all, in order and byte-exact. The region's bytes are
/// unchanged, it is whole again after `flush`, and gives its buffer back. Once with the
/// default sizes, once through a 4 KiB receive buffer and one credit at each end, so that
/// every WRITE is cut at a 2 KiB grant.
#[test]
fn region_ranges_arrive_in_order_with_copied_writes() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    for (port, cfg) in [(7761u16, StreamConfig::new()), (7762, StreamConfig::new().recv_buffer(4096).credits(1))] {
        let server = reader(cfg.bind(SocketAddr::new(t.addr, port)).unwrap());
        let mut c = cfg.connect(SocketAddr::new(t.addr, port), T).expect("connect");
        let data = pattern((3 << 20) + 7, 3);
        let mr = region_of(&c, &data);
        let mut sent = Vec::new();
        let ranges = [5..data.len() - 2, 0..1, 64..128, 1000..1000 + 65_536, 7..7, 0..data.len()];
        for (k, r) in ranges.into_iter().enumerate() {
            let head = pattern(k * 37 + 1, k as u32);
            c.write_all(&head).unwrap();
            sent.extend_from_slice(&head);
            c.write_region(&mr, r.clone()).unwrap_or_else(|e| panic!("write_region({r:?}): {e}: {c:?}"));
            sent.extend_from_slice(&data[r]);
        }
        c.flush().unwrap();
        let mut mr = mr;
        assert_eq!(mr.outstanding(), 0, "every WRITE's handle of the region is dropped once flush returns");
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

/// A range outside the region and a region of another protection domain are refused with
/// `InvalidInput`, naming what was wrong; the stream goes on.
#[test]
fn a_foreign_region_or_a_range_outside_is_refused() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7763u16;
    let server = reader(StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap());
    let mut c = Stream::connect(SocketAddr::new(t.addr, port), T).expect("connect");
    let mr = region_of(&c, &pattern(4096, 1));
    for r in [0..4097, 4096..4097, 5000..6000] {
        let e = c.write_region(&mr, r.clone()).expect_err("a range outside the region");
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("not inside the region's 4096 bytes"), "{r:?}: {e}");
    }
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 10..5;
    assert_eq!(c.write_region(&mr, backwards).unwrap_err().kind(), ErrorKind::InvalidInput);
    let ctx = VerbsContext::open(&common::caps::device_under_test()).unwrap();
    let other = ProtectionDomain::new(&ctx).unwrap();
    let foreign = MemoryRegion::new(&other, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let e = c.write_region(&foreign, 0..16).expect_err("a region of another protection domain");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("Stream::pd()"), "the error says which PD to use: {e}");
    c.write_region(&mr, 0..4096).expect("the stream goes on after the refusals");
    c.shutdown(Shutdown::Write).unwrap();
    assert!(server.join().unwrap() == pattern(4096, 1), "the server read the region's bytes");
    drop((c, mr, foreign, other, ctx));
    t.finish();
}

/// A client speaking the verbs itself, with valid connection data and no receive posted: the
/// server's WRITEs with immediate data find none and wait on RNR retries (infinite, as the
/// stream asks), so they stay in flight until [`SilentPeer::post_receives`].
struct SilentPeer {
    lane: Lane,
    qp: rdma_cm::verbs::lane::LaneQp,
    pd: std::sync::Arc<ProtectionDomain>,
    rbuf: MemoryRegion,
    _sgl: MemoryRegion,
}

impl SilentPeer {
    fn connect(t: &DeviceTest, port: u16) -> SilentPeer {
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, port), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = Lane::new(&route.context().unwrap(), 256).unwrap();
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rbuf = MemoryRegion::new(&pd, 4096, remote).unwrap();
        let sgl = MemoryRegion::new(&pd, 32, remote).unwrap();
        let client = route.lane_qp(&mut lane, &pd, QpInit::new().max_recv_wr(32).max_send_wr(16)).unwrap();
        let qp = client.qp();
        let mine = ConnData::new(
            16,
            Sge { addr: sgl.addr(), key: sgl.rkey(), length: 2 },
            Sge { addr: rbuf.addr(), key: rbuf.rkey(), length: 2048 },
        );
        client.connect(&mut lane, &ConnParam::new().private_data(&mine.encode()).unwrap(), T).unwrap();
        SilentPeer { lane, qp, pd, rbuf, _sgl: sgl }
    }

    /// Posts `n` receives: the server's waiting WRITEs land.
    fn post_receives(&mut self, n: usize) {
        for r in MemoryRegion::new(&self.pd, n, AccessFlags::LOCAL_WRITE).unwrap().split(1).unwrap() {
            self.lane.post_recv(self.qp, RecvWr::range(r, 0..0).wr_id(1)).unwrap();
        }
    }
}

/// While a WRITE from the region is in flight (held there by a peer without receives), safe
/// code cannot change the region: `as_mut_slice`, `write_at` and `into_buffer` are refused
/// with `InFlight` (the last giving the region back), reading it works and shows the bytes
/// sent; once the peer takes the WRITE and `flush` returns, the region can be changed, and
/// the peer holds exactly the bytes sent.
#[test]
fn a_region_in_flight_cannot_be_changed() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7764u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (posted_tx, posted) = mpsc::channel();
    let (landed_tx, landed) = mpsc::channel();
    let data = pattern(1500, 9);
    let sent = data.clone();
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut mr = region_of(&s, &data);
        s.write_region(&mr, 0..1500).expect("the WRITE is posted (the grant holds it)");
        assert!(mr.outstanding() >= 1, "the in-flight WRITE holds the region");
        assert!(matches!(mr.as_mut_slice(), Err(Error::InFlight { .. })), "as_mut_slice while in flight");
        assert!(matches!(mr.write_at(0, b"changed"), Err(Error::InFlight { .. })), "write_at while in flight");
        let refused = mr.into_buffer_as::<Box<[u8]>>().expect_err("into_buffer while in flight");
        assert!(matches!(refused.error(), Error::InFlight { .. }), "{refused}");
        let mut mr = refused.into_region().expect("the refusal gives the region back");
        assert!(mr.as_slice().unwrap() == &data[..], "reading the region while the device reads it");
        posted_tx.send(()).unwrap();
        s.flush().expect("the WRITEs complete once the peer has receives");
        assert_eq!(mr.outstanding(), 0);
        mr.write_at(0, b"changed").expect("the region is the caller's again");
        landed.recv().unwrap();
        drop(s);
    });
    let mut peer = SilentPeer::connect(&t, port);
    posted.recv().unwrap();
    // The server's credit update and its data WRITE, each waiting for a receive.
    peer.post_receives(4);
    let mut got = 0;
    while got < 2 {
        let c = peer.lane.wait(T).expect("the server's messages land");
        assert!(c.is_ok(), "{:?}", c.status());
        got += 1;
    }
    let mut at_peer = vec![0u8; 1500];
    peer.rbuf.read_at(0, &mut at_peer).unwrap();
    assert!(at_peer == sent, "the peer's buffer holds other bytes than were sent");
    landed_tx.send(()).unwrap();
    server.join().unwrap();
    let _ = peer.lane.disconnect(peer.qp, std::time::Duration::from_secs(2));
    drop(peer);
    t.finish();
}

/// A stream dropped while WRITEs from the region are still in flight (the peer never posts a
/// receive): the drop gives up on them within its bound, and the region is then the caller's
/// alone again (its buffer comes back), its bytes unchanged.
#[test]
fn dropping_the_stream_gives_an_in_flight_region_back() {
    let t = DeviceTest::start();
    if !common::require(Cap::ImmediateData) {
        return t.finish();
    }
    let port = 7765u16;
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let (done_tx, done) = mpsc::channel();
    let data = pattern(2000, 13);
    let server = thread::spawn(move || {
        let mut s = listener.accept(T).expect("accept");
        let mut mr = region_of(&s, &data);
        s.write_region(&mr, 0..2000).expect("posted");
        assert!(matches!(mr.as_mut_slice(), Err(Error::InFlight { .. })), "as_mut_slice while in flight");
        drop(s);
        assert_eq!(mr.outstanding(), 0, "the dropped stream still holds the region");
        assert!(mr.as_mut_slice().unwrap() == &data[..], "the region's bytes changed");
        done_tx.send(()).unwrap();
        mr.into_buffer().expect("the buffer comes back")
    });
    let peer = SilentPeer::connect(&t, port);
    done.recv().unwrap();
    assert_eq!(server.join().unwrap().len(), 2000);
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
    let mr = region_of(&c, &pattern(1 << 20, 2));
    let ranges = [0..1 << 20, 3..70_003, 65_536..1 << 20, 1..2, 100..(1 << 20) - 100];
    let mut total = 0;
    counting::watched(|| {
        while total < 8 << 20 {
            for r in ranges.clone() {
                total += r.len();
                c.write_region(&mr, r).expect("write_region");
            }
        }
        c.flush().expect("flush");
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
    let data = pattern(1 << 20, 5);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let sent = rt.block_on(async {
        use tokio::io::AsyncWriteExt;
        let mut c = Stream::connect_async(SocketAddr::new(t.addr, port), T).await.expect("connect");
        let mr = region_of(&c, &data);
        AsyncWriteExt::write_all(&mut c, b"async head").await.unwrap();
        c.write_region_async(&mr, 10..data.len()).await.expect("write_region_async");
        AsyncWriteExt::shutdown(&mut c).await.unwrap();
        drop(c);
        let mut sent = b"async head".to_vec();
        sent.extend_from_slice(&data[10..]);
        sent
    });
    assert!(server.join().unwrap() == sent, "the server read other bytes than were sent");
    t.finish();
}
