//! The async path (feature `tokio`) and the non-blocking descriptors, on the device: async
//! connect and accept with the data path on lanes (`Lane::wait_async`, cancel-safe), lanes
//! awaited across runtimes, two QPs of one lane awaited together, a forgotten wait.

mod common;

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::Duration;

use common::lane::{lane_pair, LaneSide};
use common::{DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{Completion, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Client, CmEventType, ConnParam, EventChannel, MemoryRegion, QpInit, Server, WorkQueue};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(T, f).await.expect("no progress within the test's bound")
}

/// Hands `conn` (connected, with `lane`'s CQ) to `lane`.
fn attach(lane: &mut Lane, conn: rdma_cm::Connection) -> LaneQp {
    lane.attach(conn).map_err(|r| r.into_parts().0).expect("Lane::attach")
}

/// Async connect and accept, each side's connection then attached to a lane of its own; an
/// echo through `Lane::wait_async`. The client first cancels a wait for a receive that has not
/// arrived (the future is dropped at its timer): the receive stays posted, its region in the
/// lane, and the echo lands in it later. Each side's disconnect is a blocking call, run off the
/// runtime's one thread.
#[test]
fn async_connect_accept_ping_pong_and_cancelled_receive() {
    let t = DeviceTest::start();
    let addr = t.addr;
    rt().block_on(async move {
        let listener = Server::new().unwrap().bind(SocketAddr::new(addr, 0)).unwrap().listen(4).unwrap();
        let dst = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let req = within(listener.get_request_async()).await.unwrap();
            let pd = req.alloc_pd().unwrap();
            let mut lane = Lane::new(&req.context().unwrap(), 32).unwrap();
            let buf = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
            let q = req.create_qp(&pd, lane.qp_init()).unwrap();
            let conn = within(q.accept_async(&ConnParam::new())).await.unwrap();
            let qp = attach(&mut lane, conn);
            lane.post_recv(qp, RecvWr::new(buf).wr_id(0)).unwrap();
            let mut got = within(lane.wait_async(T)).await.unwrap().ok().unwrap();
            assert_eq!((got.wr_id(), got.queue()), (0, WorkQueue::Recv));
            let buf = got.take_region().unwrap();
            lane.post_send(qp, SendWr::send(buf, 0..got.byte_len() as usize).wr_id(1)).unwrap();
            let sent = within(lane.wait_async(T)).await.unwrap().ok().unwrap();
            assert_eq!((sent.wr_id(), sent.queue()), (1, WorkQueue::Send));
            // The client's disconnect, waited for off the runtime's thread.
            tokio::task::spawn_blocking(move || {
                assert!(lane.wait_peer_left(qp, T).unwrap(), "the client's disconnect was not seen within {T:?}");
                lane.disconnect(qp, T).unwrap();
                drop((lane, sent, pd));
            })
            .await
            .unwrap();
        });
        let route = within(Client::new().unwrap().resolve_addr_async(None, dst, T)).await.unwrap();
        let route = within(route.resolve_route_async(T)).await.unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = Lane::new(&route.context().unwrap(), 32).unwrap();
        let mut ping = MemoryRegion::new(&pd, 512, AccessFlags::LOCAL_WRITE).unwrap();
        let pong = MemoryRegion::new(&pd, 512, AccessFlags::LOCAL_WRITE).unwrap();
        let q = route.create_qp(&pd, lane.qp_init()).unwrap();
        let conn = within(q.connect_async(&ConnParam::new())).await.unwrap();
        let qp = attach(&mut lane, conn);

        // Cancel a wait for a receive that has not arrived: the future is dropped, the receive
        // stays posted and keeps the region.
        lane.post_recv(qp, RecvWr::new(pong).wr_id(5)).unwrap();
        let cancelled = tokio::time::timeout(Duration::from_millis(200), lane.wait_async(T)).await;
        assert!(cancelled.is_err(), "nothing was sent yet, so the wait must time out: {cancelled:?}");
        assert_eq!(
            lane.outstanding(qp).unwrap(),
            (0, 1),
            "the cancelled wait left the receive (and its region) in the lane"
        );

        ping.as_mut_slice().unwrap().copy_from_slice(&common::pattern(512, 77));
        lane.post_send(qp, SendWr::send(ping, 0..512).wr_id(6)).unwrap();
        let mut done: Vec<Completion> = Vec::new();
        while done.len() < 2 {
            done.push(within(lane.wait_async(T)).await.unwrap().ok().unwrap());
        }
        done.sort_by_key(|c| c.wr_id());
        let recv = &mut done[0];
        assert_eq!((recv.wr_id(), recv.queue(), recv.byte_len()), (5, WorkQueue::Recv, 512));
        let mut pong = recv.take_region().expect("the receive's region comes back");
        assert_eq!(pong.as_slice().unwrap(), &common::pattern(512, 77)[..], "the echo landed in live memory");
        assert_eq!((done[1].wr_id(), done[1].queue()), (6, WorkQueue::Send));
        let lane = tokio::task::spawn_blocking(move || {
            lane.disconnect(qp, T).unwrap();
            lane
        })
        .await
        .unwrap();
        server.await.unwrap();
        drop((done, pong, lane, pd));
    });
    t.finish();
}

#[test]
fn nonblocking_channel_drains_until_empty() {
    let t = DeviceTest::start();
    // Three clients resolving on one shared channel: wait for readability once, then drain
    // until try_get_event says there is nothing left (what an edge-triggered loop must do).
    let ch = EventChannel::new().unwrap();
    // SAFETY: fcntl(F_GETFL) on the channel's open descriptor.
    let flags = unsafe { libc::fcntl(ch.as_raw_fd(), libc::F_GETFL) };
    assert_ne!(flags & libc::O_NONBLOCK, 0, "the channel is non-blocking from birth");
    assert!(ch.try_get_event().unwrap().is_none(), "an empty channel returns None at once");
    let dst = SocketAddr::new(t.addr, 7990);
    let ids: Vec<_> = (0..3).map(|_| rdma_cm::CmId::new(&ch).unwrap()).collect();
    for id in &ids {
        let mut sa = common::sockaddr_v4(dst);
        let sa_ptr: *mut libc::sockaddr = (&mut sa as *mut libc::sockaddr_storage).cast();
        // SAFETY: the id is valid and `sa` outlives the call, which copies it.
        let ret = unsafe { rdma_cm::ffi::rdma_resolve_addr(id.as_raw(), std::ptr::null_mut(), sa_ptr, 5000) };
        assert_eq!(ret, 0, "rdma_resolve_addr");
    }
    let mut seen = 0;
    let deadline = std::time::Instant::now() + T;
    while seen < 3 {
        assert!(std::time::Instant::now() < deadline, "only {seen} of 3 events");
        let mut pfd = libc::pollfd { fd: ch.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, 1000) };
        while let Some(ev) = ch.try_get_event().unwrap() {
            assert_eq!(ev.event_type(), CmEventType::AddrResolved);
            assert!(ids.iter().any(|id| id.handle() == ev.id()));
            seen += 1;
        }
    }
    assert!(ch.try_get_event().unwrap().is_none());
    drop(ids);
    t.finish();
}

#[test]
fn a_runtime_without_io_is_an_error_not_a_panic() {
    let t = DeviceTest::start();
    let no_io = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    // A wait that has to sleep needs the reactor: an event channel with nothing on it.
    // (A step whose event is there already completes without it, which is fine.)
    let ch = EventChannel::new().unwrap();
    match no_io.block_on(ch.get_event_async()) {
        Err(rdma_cm::Error::InvalidArgument(m)) => assert!(m.contains("IO driver"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    // So does a listener that no client calls.
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(1).unwrap();
    let r = no_io.block_on(listener.get_request_async());
    assert!(matches!(r, Err(rdma_cm::Error::InvalidArgument(_))), "{r:?}");
    drop(listener);
    drop(ch);
    t.finish();
}

/// A lane pair and the regions that travel between each side and its lane.
struct Pair {
    c: LaneSide,
    s: LaneSide,
    /// The client's message and the server's receive buffer, while in our hands.
    msg: Option<MemoryRegion>,
    buf: Option<MemoryRegion>,
}

/// One async round trip: the server's receive and the client's send, awaited on the current
/// runtime (each wait sleeps on the reactor until its completion arrives).
async fn async_round_trip(p: &mut Pair, i: u64) {
    p.s.lane.post_recv(p.s.qp, RecvWr::range(p.buf.take().unwrap(), 0..64).wr_id(i)).unwrap();
    p.c.lane.post_send(p.c.qp, SendWr::send(p.msg.take().unwrap(), 0..64).wr_id(i)).unwrap();
    let mut c = within(p.s.lane.wait_async(T)).await.unwrap();
    assert_eq!((c.wr_id(), c.queue(), c.byte_len()), (i, WorkQueue::Recv, 64));
    p.buf = c.take_region();
    let mut c = within(p.c.lane.wait_async(T)).await.unwrap();
    assert_eq!((c.wr_id(), c.queue()), (i, WorkQueue::Send));
    p.msg = c.take_region();
}

/// A lane's CQ channel stays registered with each runtime that waited on it, from its first
/// async wait on; waits on another runtime (while the first one lives, idle, and after it is
/// gone) use that runtime's own lasting registration instead of sleeping on a reactor nobody
/// drives, and the first runtime's registration still serves it afterwards.
#[test]
fn async_waits_work_across_runtimes() {
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut c, mut s) = lane_pair(t.addr, spec.clone(), spec, 64);
    let (msg, buf) = (c.mrs.pop(), s.mrs.pop());
    let mut p = Pair { c, s, msg, buf };
    let first = rt();
    let second = rt();
    let mut i = 0;
    for r in [&first, &second, &first, &second] {
        r.block_on(async {
            for _ in 0..50 {
                async_round_trip(&mut p, i).await;
                i += 1;
            }
        });
    }
    drop(first);
    second.block_on(async {
        for _ in 0..50 {
            async_round_trip(&mut p, i).await;
            i += 1;
        }
    });
    drop(p);
    t.finish();
}

/// Two client QPs on one lane (one CQ for both), each with its server connection (the server's
/// two on a lane of their own); the server sends one message to each when told to.
struct SharedLanePair {
    lane: Lane,
    qps: [LaneQp; 2],
    /// Each QP's receive buffer, while in our hands.
    bufs: [Option<MemoryRegion>; 2],
    ctx: rdma_cm::VerbsContext,
    go: std::sync::mpsc::Sender<u64>,
    server: std::thread::JoinHandle<()>,
}

fn shared_lane_pair(addr: std::net::IpAddr) -> SharedLanePair {
    let listener = Server::new().unwrap().bind(SocketAddr::new(addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let (go, told) = std::sync::mpsc::channel::<u64>();
    let server = std::thread::spawn(move || {
        let ctx = listener.context().unwrap();
        let pd = rdma_cm::ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 64).unwrap();
        let mut conns: Vec<(LaneQp, Option<MemoryRegion>)> = (0..2)
            .map(|_| {
                let s = listener.get_request(T).unwrap().lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
                let qp = s.qp();
                s.accept(&mut lane, &ConnParam::new(), T).unwrap();
                (qp, Some(MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap()))
            })
            .collect();
        // Each word from the test: one message to each client, with that wr_id.
        while let Ok(i) = told.recv_timeout(T) {
            for (qp, mr) in &mut conns {
                lane.post_send(*qp, SendWr::send(mr.take().unwrap(), 0..64).wr_id(i)).unwrap();
            }
            for mut c in common::lane::reap(&mut lane, 2) {
                assert!(c.is_ok() && c.wr_id() == i, "{c:?}");
                let (_, mr) = conns.iter_mut().find(|(qp, _)| Some(*qp) == c.qp()).expect("one of the two");
                *mr = c.take_region();
            }
        }
        drop(lane);
    });
    let ctx = rdma_cm::VerbsContext::cm_for_addr(addr).unwrap();
    let pd = rdma_cm::ProtectionDomain::new(&ctx).unwrap();
    let mut lane = Lane::new(&ctx, 64).unwrap();
    let qps = [0, 1].map(|_| {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let c = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        let qp = c.qp();
        c.connect(&mut lane, &ConnParam::new(), T).unwrap();
        qp
    });
    let bufs = [0, 1].map(|_| Some(MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap()));
    SharedLanePair { lane, qps, bufs, ctx, go, server }
}

impl SharedLanePair {
    fn post_recvs(&mut self, i: u64) {
        for (qp, buf) in self.qps.iter().zip(&mut self.bufs) {
            self.lane.post_recv(*qp, RecvWr::new(buf.take().unwrap()).wr_id(i)).unwrap();
        }
    }

    /// Takes one of round `i`'s receives back: which QP it came on.
    fn took(&mut self, c: rdma_cm::Result<Completion>, i: u64) -> usize {
        let mut c = c.unwrap_or_else(|e| panic!("round {i}: no receive: {e}"));
        assert_eq!((c.wr_id(), c.queue(), c.byte_len()), (i, WorkQueue::Recv, 64), "round {i}");
        let k = self.qps.iter().position(|qp| Some(*qp) == c.qp()).expect("one of the lane's two QPs");
        assert!(self.bufs[k].is_none(), "round {i}: QP {k}'s receive came back twice");
        self.bufs[k] = c.take_region();
        k
    }

    /// Waits (asleep, once both QPs' receives are posted) for both QPs' receives of round `i`,
    /// telling the server to send only once the first wait has been polled.
    async fn both(&mut self, i: u64) {
        let go = self.go.clone();
        let (first, ()) = tokio::join!(within(self.lane.wait_async(T)), async { go.send(i).unwrap() });
        let second = within(self.lane.wait_async(T)).await;
        let mut seen = [self.took(first, i), self.took(second, i)];
        seen.sort();
        assert_eq!(seen, [0, 1], "round {i}: one receive on each QP");
    }

    fn finish(self) {
        drop(self.go);
        self.server.join().unwrap();
        drop((self.lane, self.ctx));
    }
}

/// Two QPs completing on one CQ, awaited together on a runtime other than the one whose wait
/// registered the CQ's descriptor first: with one registration per wait, the second wait failed
/// at once with `AsyncFd::register` `EEXIST`. On a lane the two QPs share its CQ: each wait
/// sleeps before the server sends, and both QPs' receives are handed out, on either runtime.
#[test]
fn two_qps_on_one_lane_are_awaited_together_on_a_second_runtime() {
    let t = DeviceTest::start();
    let mut p = shared_lane_pair(t.addr);
    let (first, second) = (rt(), rt());
    for (i, r) in [(0, &first), (1, &second), (2, &first), (3, &second)] {
        p.post_recvs(i);
        r.block_on(p.both(i));
    }
    p.finish();
    t.finish();
}

/// A boxed wait polled once and then forgotten (`mem::forget` never runs its drop) left its
/// registration of the CQ's descriptor behind, and every later wait of that CQ that had to
/// sleep on that runtime failed with `EEXIST`. The same shape on an async-event source's
/// descriptor.
#[test]
fn a_forgotten_wait_leaves_no_registration_behind() {
    let t = DeviceTest::start();
    let mut p = shared_lane_pair(t.addr);
    let (first, second) = (rt(), rt());
    p.post_recvs(0);
    // The first runtime's registration exists; the forgotten wait is on the second.
    first.block_on(async {
        let cut = tokio::time::timeout(Duration::from_millis(50), p.lane.wait_async(T));
        assert!(cut.await.is_err(), "nothing was sent yet");
    });
    second.block_on(async {
        let mut f = Box::pin(p.lane.wait_async(T));
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut f).await.is_err(), "it sleeps");
        std::mem::forget(f);
    });
    p.go.send(0).unwrap();
    second.block_on(async {
        let mut seen = vec![];
        for _ in 0..2 {
            let c = within(p.lane.wait_async(T)).await;
            assert!(c.is_ok(), "no EEXIST after the forget: {c:?}");
            seen.push(p.took(c, 0));
        }
        seen.sort();
        assert_eq!(seen, [0, 1]);
        // And a wait that must sleep again (the next message is sent once it sleeps).
        p.post_recvs(1);
        p.both(1).await;
    });
    // An async-event source: a forgotten next_async, then another that must sleep.
    let mut events = p.ctx.async_events().unwrap();
    second.block_on(async {
        let mut f = Box::pin(events.next_async());
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut f).await.is_err(), "no device event");
        std::mem::forget(f);
        let r = tokio::time::timeout(Duration::from_millis(100), events.next_async()).await;
        assert!(r.is_err(), "the second wait sleeps until the bound (no EEXIST): {r:?}");
    });
    drop(events);
    p.finish();
    t.finish();
}

/// A connect nobody answers, given up by the runtime's own timer, holds no worker thread on
/// the way: on iWARP `rdma_connect` blocks in the kernel for the TCP connect (about two
/// minutes of SYN retries), so `connect_async` makes that call on a helper thread. The
/// runtime here has one thread; a ticker task on it must keep running while the connect is
/// pending, and the timer must end the wait at its bound, not when the kernel gives up.
#[test]
fn a_connect_nobody_answers_leaves_the_runtime_free_and_is_given_up_at_its_timer() {
    let t = DeviceTest::start();
    let common::IpV4(a, b, c, _) = common::IpV4::of(t.addr);
    // The guest's netdev is a NOARP dummy: any address of its subnet resolves, and nobody
    // answers there.
    let ghost: SocketAddr = format!("{a}.{b}.{c}.215:7617").parse().unwrap();
    let bound = Duration::from_secs(2);
    let (took, ticks) = rt().block_on(async move {
        let route = within(Client::new().unwrap().resolve_addr_async(None, ghost, T)).await.unwrap();
        let route = within(route.resolve_route_async(T)).await.unwrap();
        let pd = route.alloc_pd().unwrap();
        let rx = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let q = route.create_qp(&pd, QpInit::new()).unwrap();
        let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let ticker = tokio::spawn({
            let ticks = ticks.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        let start = std::time::Instant::now();
        let r = tokio::time::timeout(bound, q.connect_async(&ConnParam::new())).await;
        let took = start.elapsed();
        ticker.abort();
        assert!(r.is_err(), "nobody answers there, so the timer must end the wait: {:?}", r.map(|c| c.is_ok()));
        drop((rx, pd));
        (took, ticks.load(std::sync::atomic::Ordering::Relaxed))
    });
    eprintln!(
        "measured: the connect was given up after {took:?} (timer {bound:?}); the ticker ran {ticks} times meanwhile"
    );
    assert!(took < bound + Duration::from_secs(3), "the wait outlived its timer: {took:?} against {bound:?}");
    // 40 ticks of 50 ms fit in the 2 s; a busy machine may run fewer, a blocked runtime none.
    assert!(ticks >= 10, "the runtime's one thread was held during the connect: {ticks} ticks of 50 ms in {took:?}");
    // Everything is released; on iWARP the helper thread first waits for the kernel's TCP
    // connect to give up (Linux's SYN retries: about 127 s).
    if common::caps::iwarp() {
        let start = std::time::Instant::now();
        t.finish_within(Duration::from_secs(200));
        eprintln!(
            "measured: the iWARP connect's objects were released {:?} after the test dropped its own",
            start.elapsed()
        );
    } else {
        t.finish();
    }
}
