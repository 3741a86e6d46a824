//! Posting and polling on a connected QP allocate nothing: a counting global allocator watches
//! 10,000 send/recv round trips and 10,000 RDMA WRITEs on the device, the shared CQ and SRQ
//! shapes, work requests of several pieces (scatter/gather), and async round trips on tokio
//! (feature `tokio`: the waits, the reactor's wake-ups and the runtime's parking in between);
//! the lane's waits, blocking, busy and async; and a wait woken by the peer's disconnect (here
//! for this binary's allocator).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{pair, DeviceTest, PairSpec, T};
use rdma_cm::{AccessFlags, QueuePair, RecvWr, SendWr, WcStatus, WorkCompletion, WorkQueue};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    // const-initialised and without a destructor: reading it never allocates.
    static WATCH: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: every call forwards to the system allocator unchanged; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if WATCH.with(|w| w.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(l.size(), Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded; `p` came from System.alloc with `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if WATCH.with(|w| w.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(n, Ordering::Relaxed);
        }
        // SAFETY: forwarded.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn watched<T>(f: impl FnOnce() -> T) -> T {
    WATCH.with(|w| w.set(true));
    let r = f();
    WATCH.with(|w| w.set(false));
    r
}

/// Polls `qp` until one completion arrives (bounded), counting only the poll itself.
fn poll_one(qp: &mut QueuePair, wcs: &mut [WorkCompletion; 4]) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = watched(|| qp.poll(wcs)).unwrap();
        if n > 0 {
            assert_eq!(n, 1);
            return wcs[0].ok().unwrap();
        }
        assert!(Instant::now() < deadline, "no completion within 10 s");
    }
}

#[test]
fn post_and_poll_allocate_nothing() {
    const N: u64 = 10_000;
    let t = DeviceTest::start();
    let spec = PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, spec.clone(), spec);
    let remote = s.mrs[0].remote();
    let mut wcs = [WorkCompletion::default(); 4];
    // The counter itself works: one watched allocation is seen.
    ALLOCS.store(0, Ordering::SeqCst);
    drop(watched(|| std::hint::black_box(Vec::<u8>::with_capacity(10))));
    assert_eq!(ALLOCS.load(Ordering::SeqCst), 1, "the counting allocator must see allocations");
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    for i in 0..N {
        let recv = RecvWr::new(&s.mrs[0], 0..64).wr_id(i);
        watched(|| s.conn.qp_mut().post_recv(&[recv])).unwrap();
        let send = SendWr::send(&c.mrs[0], 0..64).wr_id(i);
        watched(|| c.conn.qp_mut().post_send(&[send])).unwrap();
        assert_eq!(poll_one(c.conn.qp_mut(), &mut wcs).queue(), WorkQueue::Send);
        let wc = poll_one(s.conn.qp_mut(), &mut wcs);
        assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 64));
        // An RDMA WRITE into the peer's remotely writable region.
        let wr = SendWr::write(&c.mrs[0], 0..256, &remote, 512).unwrap().wr_id(i);
        watched(|| c.conn.qp_mut().post_send(&[wr])).unwrap();
        assert_eq!(poll_one(c.conn.qp_mut(), &mut wcs).wr_id(), i);
    }
    let (allocs, bytes) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} iterations of post and poll");
    drop((c, s));
    t.finish();
}

/// The fast path (`rdma_cm::verbs::lane`): 2,000 rounds of a send/recv through prepared requests, an
/// RDMA WRITE built as a `SendWr` at each post, and a prepared batch of 16 WRITEs, each posted
/// and polled (the region handed back and re-armed) with the counter watching.
#[test]
fn lane_posts_and_polls_allocate_nothing() {
    use rdma_cm::verbs::lane::{Lane, RecvWr as LRecv, SendWr as LSend};
    const N: usize = 2_000;
    let t = DeviceTest::start();
    let spec = PairSpec {
        mr_sizes: vec![4096, 4096, 4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let (mut a, mut b) = common::lane::lane_pair(t.addr, spec.clone(), spec, 64);
    let remote = b.mrs[0].remote();
    // Polls `lane` (watched) until one completion comes; its region.
    fn one(lane: &mut Lane) -> rdma_cm::MemoryRegion {
        let deadline = Instant::now() + T;
        let mut back = None;
        while watched(|| lane.poll_with(16, |c, mr| back = Some((c.is_ok(), mr)))).unwrap() == 0 {
            assert!(Instant::now() < deadline, "no completion within {T:?}");
        }
        let (ok, mr) = back.unwrap();
        assert!(ok);
        mr.expect("a lane completion hands its region back")
    }
    let mut send = a.lane.prepare_send(a.qp, LSend::send(a.mrs.remove(0), 0..64)).unwrap();
    let mut recv = b.lane.prepare_recv(b.qp, LRecv::range(b.mrs.remove(1), 0..64)).unwrap();
    let mut batch = a
        .lane
        .prepare_batch(a.qp, a.mrs.remove(0), 16, |k, mr| LSend::write(mr, 0..64, &remote, k as u64 * 64))
        .unwrap();
    let mut plain = Some(a.mrs.remove(0));
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    for _ in 0..N {
        watched(|| b.lane.post_prepared_recv(&mut recv)).unwrap();
        watched(|| a.lane.post_prepared(&mut send)).unwrap();
        send.rearm(one(&mut a.lane)).unwrap();
        recv.rearm(one(&mut b.lane)).unwrap();
        let wr = LSend::write(plain.take().unwrap(), 0..64, &remote, 1024);
        watched(|| a.lane.post_send(a.qp, wr)).unwrap();
        plain = Some(one(&mut a.lane));
        watched(|| a.lane.post_batch(&mut batch)).unwrap();
        batch.rearm(one(&mut a.lane)).unwrap();
    }
    let (allocs, bytes) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} rounds on the lane");
    drop((a, b, send, recv, batch, plain));
    t.finish();
}

/// The lane's waits allocate nothing per wait, asleep or not: 300 receives, each waited for on a
/// thread the counter watches (`Lane::wait_with`, and every other one `Lane::spin_with`), while
/// the main thread sends only once that thread says it is about to wait, so most blocking waits
/// find the CQ empty, arm it and sleep on its channel (whose events are read, and acknowledged
/// in batches).
#[test]
fn lane_waits_allocate_nothing() {
    use rdma_cm::verbs::lane::{RecvWr as LRecv, SendWr as LSend};
    const N: usize = 300;
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut a, mut b) = common::lane::lane_pair(t.addr, spec.clone(), spec, 64);
    let mut send = a.lane.prepare_send(a.qp, LSend::send(a.mrs.remove(0), 0..64)).unwrap();
    let mut recv = b.lane.prepare_recv(b.qp, LRecv::range(b.mrs.remove(0), 0..64)).unwrap();
    let (ready, go) = std::sync::mpsc::channel();
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    let waiter = std::thread::spawn(move || {
        for i in 0..N {
            b.lane.post_prepared_recv(&mut recv).unwrap();
            ready.send(()).unwrap();
            let mut back = None;
            let n = watched(|| {
                let f = |c: rdma_cm::verbs::lane::Wc, mr| back = Some((c.is_ok(), c.byte_len(), mr));
                if i % 2 == 0 {
                    b.lane.wait_with(16, T, f)
                } else {
                    b.lane.spin_with(16, T, f)
                }
            });
            assert_eq!(n.unwrap(), 1);
            let (ok, len, mr) = back.unwrap();
            assert!(ok && len == 64);
            recv.rearm(mr.unwrap()).unwrap();
        }
        (b, recv)
    });
    for _ in 0..N {
        go.recv_timeout(T).expect("the waiter is about to wait");
        a.lane.post_prepared(&mut send).unwrap();
        send.rearm(a.lane.wait(T).unwrap().take_region().unwrap()).unwrap();
    }
    let (b, recv) = waiter.join().unwrap();
    let (allocs, bytes) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} waits on the lane");
    drop((a, b, send, recv));
    t.finish();
}

/// The lane's async wait (`Lane::wait_async_with`) allocates nothing per wait either, after a
/// warm-up that makes the channel's lasting reactor registration: 2,000 send/recv round trips
/// on a current-thread runtime, each end's completion awaited (asleep on the reactor when it is
/// not there yet), the timer of each wait and the runtime's parking included.
#[cfg(feature = "tokio")]
#[test]
fn lane_async_waits_allocate_nothing() {
    use rdma_cm::verbs::lane::{RecvWr as LRecv, SendWr as LSend};
    const WARM: usize = 100;
    const N: usize = 2_000;
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut a, mut b) = common::lane::lane_pair(t.addr, spec.clone(), spec, 64);
    let mut send = a.lane.prepare_send(a.qp, LSend::send(a.mrs.remove(0), 0..64)).unwrap();
    let mut recv = b.lane.prepare_recv(b.qp, LRecv::range(b.mrs.remove(0), 0..64)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (allocs, bytes) = rt.block_on(async {
        for i in 0..WARM + N {
            if i == WARM {
                ALLOCS.store(0, Ordering::SeqCst);
                BYTES.store(0, Ordering::SeqCst);
                WATCH.with(|w| w.set(true));
            }
            b.lane.post_prepared_recv(&mut recv).unwrap();
            a.lane.post_prepared(&mut send).unwrap();
            let mut back = None;
            a.lane.wait_async_with(16, T, |c, mr| back = Some((c.is_ok(), mr))).await.unwrap();
            let (ok, mr) = back.take().unwrap();
            assert!(ok);
            send.rearm(mr.unwrap()).unwrap();
            b.lane.wait_async_with(16, T, |c, mr| back = Some((c.is_ok(), mr))).await.unwrap();
            let (ok, mr) = back.take().unwrap();
            assert!(ok);
            recv.rearm(mr.unwrap()).unwrap();
        }
        WATCH.with(|w| w.set(false));
        (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst))
    });
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} async round trips on the lane");
    drop((a, b, send, recv));
    t.finish();
}

/// Async send/recv round trips on a current-thread runtime (the test's thread, which the
/// counter watches): after a warm-up that makes the lasting reactor registrations, 2,000 round
/// trips of post, `wait_for_async` on both ends (each sleeping on tokio's reactor when the
/// completion is not there yet) allocate nothing, the runtime's own parking included.
#[cfg(feature = "tokio")]
#[test]
fn async_round_trips_allocate_nothing() {
    const WARM: u64 = 100;
    const N: u64 = 2_000;
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, spec.clone(), spec);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let bound = Duration::from_secs(10);
    let (allocs, bytes) = rt.block_on(async {
        for i in 0..WARM + N {
            if i == WARM {
                ALLOCS.store(0, Ordering::SeqCst);
                BYTES.store(0, Ordering::SeqCst);
                WATCH.with(|w| w.set(true));
            }
            s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(i)]).unwrap();
            c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(i)]).unwrap();
            let send = c.conn.qp_mut().wait_for_async(WorkQueue::Send, i);
            let wc = tokio::time::timeout(bound, send).await.expect("no send completion within 10 s").unwrap();
            assert_eq!(wc.wr_id(), i);
            let recv = s.conn.qp_mut().wait_for_async(WorkQueue::Recv, i);
            let wc = tokio::time::timeout(bound, recv).await.expect("no receive within 10 s").unwrap();
            assert_eq!((wc.wr_id(), wc.byte_len()), (i, 64));
        }
        WATCH.with(|w| w.set(false));
        (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst))
    });
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} async round trips");
    drop((c, s));
    t.finish();
}

/// Polls `cq` until one completion arrives (bounded), counting only the poll itself.
fn poll_cq_one(cq: &rdma_cm::CompletionQueue, wcs: &mut [WorkCompletion; 4]) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = watched(|| cq.poll(wcs)).unwrap();
        if n > 0 {
            assert_eq!(n, 1);
            return wcs[0].ok().unwrap();
        }
        assert!(Instant::now() < deadline, "no completion within 10 s");
    }
}

/// The shared shapes allocate nothing either: a server QP on a CQ it shares and on an SRQ,
/// polled through the CQ, posting receives to the SRQ and echoes from its QP.
#[test]
fn shared_cq_and_srq_post_and_poll_allocate_nothing() {
    use rdma_cm::{Client, CompletionQueue, ConnParam, MemoryRegion, QpInit, Server, SharedReceiveQueue};
    use std::sync::Arc;
    const N: u64 = 5_000;
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(std::net::SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let client = std::thread::spawn(move || {
        let tt = Duration::from_secs(10);
        let route = Client::new().unwrap().resolve_addr(None, dst, tt).unwrap().resolve_route(tt).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = route.create_qp(&pd, QpInit::new()).unwrap();
        q.post_recv(&[RecvWr::new(&mr, 2048..2112).wr_id(0)]).unwrap();
        let conn = q.connect(&ConnParam::new(), tt).unwrap();
        (conn, mr, pd)
    });
    let req = listener.get_request(Duration::from_secs(10)).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let srq = SharedReceiveQueue::new(&pd, 16).unwrap();
    let slot = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let init = QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq)).srq(&srq);
    let mut server = req.create_qp(&pd, init).unwrap().accept(&ConnParam::new(), Duration::from_secs(10)).unwrap();
    let (mut conn, mr, _cpd) = client.join().unwrap();
    let mut wcs = [WorkCompletion::default(); 4];
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    for i in 0..N {
        watched(|| srq.post_recv(&[RecvWr::new(&slot, 0..64).wr_id(i)])).unwrap();
        watched(|| conn.qp_mut().post_send(&[SendWr::send(&mr, 0..64).wr_id(i)])).unwrap();
        assert_eq!(poll_one(conn.qp_mut(), &mut wcs).queue(), WorkQueue::Send);
        let wc = poll_cq_one(&cq, &mut wcs);
        assert_eq!((wc.queue(), wc.wr_id(), wc.qp_num()), (WorkQueue::Recv, i, server.qp().qp_num()));
        // The echo, from the slot, polled through the shared CQ.
        watched(|| server.qp_mut().post_send(&[SendWr::send(&slot, 0..64).wr_id(i)])).unwrap();
        watched(|| conn.qp_mut().post_recv(&[RecvWr::new(&mr, 2048..2112).wr_id(i + 1)])).unwrap();
        assert_eq!(poll_cq_one(&cq, &mut wcs).queue(), WorkQueue::Send);
        let wc = poll_one(conn.qp_mut(), &mut wcs);
        assert_eq!((wc.queue(), wc.wr_id()), (WorkQueue::Recv, i));
    }
    let (allocs, bytes) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} iterations on a shared CQ and an SRQ");
    drop((conn, mr, _cpd));
    drop((server, slot, srq, cq, pd, ctx, listener));
    t.finish();
}

/// Work requests of several pieces allocate nothing either: building them, posting them (every
/// piece held in the ring's side table) and reaping them, for gathered sends into scattered
/// receives, gathered WRITEs and scattered READs.
#[test]
fn scatter_gather_post_and_poll_allocate_nothing() {
    use rdma_cm::QpInit;
    const N: u64 = 2_000;
    let t = DeviceTest::start();
    let cspec = PairSpec {
        mr_sizes: vec![4096, 4096],
        init: QpInit::new().max_send_sge(3).max_recv_sge(3),
        // An RDMA READ's sink needs remote write access on iWARP.
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let sspec = PairSpec {
        mr_sizes: vec![4096, 4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ..cspec.clone()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let remote = s.mrs[0].remote();
    let recv_pieces = [(&s.mrs[0], 0..64), (&s.mrs[1], 0..64), (&s.mrs[0], 64..128)];
    let send_pieces = [(&c.mrs[0], 0..16), (&c.mrs[1], 0..100), (&c.mrs[0], 200..264)];
    // Where READs scatter into fewer than three pieces (siw: max_sge_rd 1), the same 180 bytes
    // into one: the READ's allocations are still counted.
    let read_three = [(&c.mrs[1], 1000..1100), (&c.mrs[0], 3000..3010), (&c.mrs[1], 2000..2070)];
    let read_one = [(&c.mrs[1], 1000..1180)];
    let read_pieces: &[_] = if common::caps::has(common::Cap::ReadScatter(3)) { &read_three } else { &read_one };
    let mut wcs = [WorkCompletion::default(); 4];
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    for i in 0..N {
        watched(|| s.conn.qp_mut().post_recv(&[RecvWr::sg(&recv_pieces)?.wr_id(i)])).unwrap();
        watched(|| c.conn.qp_mut().post_send(&[SendWr::send_sg(&send_pieces)?.wr_id(i)])).unwrap();
        assert_eq!(poll_one(c.conn.qp_mut(), &mut wcs).queue(), WorkQueue::Send);
        let wc = poll_one(s.conn.qp_mut(), &mut wcs);
        assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 180));
        let wr = || SendWr::write_sg(&send_pieces, &remote, 1024).map(|w| w.wr_id(i));
        watched(|| c.conn.qp_mut().post_send(&[wr()?])).unwrap();
        assert_eq!(poll_one(c.conn.qp_mut(), &mut wcs).wr_id(), i);
        let wr = || SendWr::read_sg(read_pieces, &remote, 1024).map(|w| w.wr_id(i));
        watched(|| c.conn.qp_mut().post_send(&[wr()?])).unwrap();
        let wc = poll_one(c.conn.qp_mut(), &mut wcs);
        assert_eq!((wc.wr_id(), wc.byte_len()), (i, 180));
    }
    let (allocs, bytes) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} iterations of scatter/gather post and poll");
    drop((c, s));
    t.finish();
}

/// Polls a UD QP until one completion arrives (bounded), counting only the poll itself.
fn poll_ud_one(qp: &mut rdma_cm::UdQp, wcs: &mut [WorkCompletion; 4]) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = watched(|| qp.poll(wcs)).unwrap();
        if n > 0 {
            assert_eq!(n, 1);
            return wcs[0].ok().unwrap();
        }
        assert!(Instant::now() < deadline, "no completion within 10 s");
    }
}

/// UD allocates nothing either: a datagram each way per iteration, each send holding its
/// address handle in the send ring's table, and the receive read as a `Datagram`.
#[test]
fn ud_post_and_poll_allocate_nothing() {
    use rdma_cm::{Datagram, MemoryRegion, QpInit, UdSendWr, GRH_LEN};
    const N: u64 = 5_000;
    let t = DeviceTest::start();
    if !common::require(common::Cap::Ud) {
        return;
    }
    let common::ud::UdPair { mut client, to_server, mut server, to_client } =
        common::ud::ud_pair(t.addr, 7321, QpInit::new());
    let cbuf = MemoryRegion::new(client.qp().pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut crecv = MemoryRegion::new(client.qp().pd(), GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut srecv = MemoryRegion::new(server.qp().pd(), GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut wcs = [WorkCompletion::default(); 4];
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    for i in 0..N {
        let r = RecvWr::new(&srecv, 0..GRH_LEN + 64).wr_id(i);
        watched(|| server.qp_mut().post_recv(&[r])).unwrap();
        let r = RecvWr::new(&crecv, 0..GRH_LEN + 64).wr_id(i);
        watched(|| client.qp_mut().post_recv(&[r])).unwrap();
        let s = UdSendWr::send(&to_server, &cbuf, 0..64).wr_id(i);
        watched(|| client.qp_mut().post_send(&[s])).unwrap();
        assert_eq!(poll_ud_one(client.qp_mut(), &mut wcs).queue(), WorkQueue::Send);
        let wc = poll_ud_one(server.qp_mut(), &mut wcs);
        let d = watched(|| Datagram::parse(&wc, &mut srecv, 0)).unwrap();
        assert_eq!(d.len(), 64);
        let s = UdSendWr::send_inline(&to_client, b"pong").wr_id(i);
        watched(|| server.qp_mut().post_send(&[s])).unwrap();
        assert_eq!(poll_ud_one(server.qp_mut(), &mut wcs).queue(), WorkQueue::Send);
        let wc = poll_ud_one(client.qp_mut(), &mut wcs);
        assert_eq!(watched(|| Datagram::parse(&wc, &mut crecv, 0)).unwrap().len(), 4);
    }
    let (allocs, bytes) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} UD round trips");
    drop((client, server, to_server, to_client, cbuf, crecv, srecv));
    t.finish();
}

/// One thread waiting on a connection's channel and CQ through a `Readiness` allocates
/// nothing per wait: 300 receives (few: the whole binary also runs under valgrind), each waited
/// for (`poll(2)` on both descriptors, the channel's queue looked at), its CQ event drained, the
/// CQ re-armed and polled. The CQ is armed before each send, so every receive's completion makes
/// it ready.
#[test]
fn readiness_waits_allocate_nothing() {
    use rdma_cm::Readiness;
    const N: u64 = 300;
    let t = DeviceTest::start();
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    // Clones, so that the set's borrows leave the connection free for posting.
    let ch = s.conn.id().channel().clone();
    let cq = std::sync::Arc::clone(s.conn.qp().recv_cq());
    let mut set = Readiness::with_capacity(2).channel(&ch, 0u8).cq(&cq, 1);
    let mut wcs = [WorkCompletion::default(); 4];
    cq.req_notify(false).unwrap();
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    for i in 0..N {
        watched(|| s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(i)])).unwrap();
        watched(|| c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(i)])).unwrap();
        let (first, second) = watched(|| {
            let mut ready = set.wait(Duration::from_secs(10)).unwrap();
            (ready.next(), ready.next())
        });
        assert_eq!((first, second), (Some(1), None), "receive {i}: the CQ, and only the CQ, becomes ready");
        assert_eq!(watched(|| cq.drain_events()).unwrap(), 1, "receive {i}: one CQ event");
        watched(|| cq.req_notify(false)).unwrap();
        let wc = poll_cq_one(&cq, &mut wcs);
        assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 64));
        assert_eq!(poll_one(c.conn.qp_mut(), &mut wcs).queue(), WorkQueue::Send);
    }
    let (allocs, bytes) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} waits");
    drop(set);
    drop((ch, cq, c, s));
    t.finish();
}

/// Runs `f` counting the allocations this thread makes meanwhile.
fn count_allocs<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = ALLOCS.load(Ordering::SeqCst);
    let r = watched(f);
    (r, ALLOCS.load(Ordering::SeqCst) - before)
}

/// HOLE 6 (minor). Polling allocates nothing, the docs say; `wait` is a poll that sleeps. When
/// the wait watches the connection's channel and the peer's DISCONNECTED wakes it, it queues
/// the event in the channel's `VecDeque`, whose first push allocates.
#[test]
fn waiting_through_the_peers_disconnect_allocates_nothing() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { pre_recv: vec![(1, 64)], ..PairSpec::default() };
    let (c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    drop(c);
    let mut wcs = [WorkCompletion::default(); 4];
    let (n, allocs) = count_allocs(|| s.conn.qp_mut().wait(&mut wcs, T));
    let n = n.unwrap();
    assert_eq!(n, 1);
    assert_eq!(wcs[0].status(), WcStatus::WrFlushErr);
    assert_eq!(allocs, 0, "wait() allocated {allocs} times while it saw the peer leave");
    drop(s);
    t.finish();
}
