//! Posting and polling on the lane (`rdma_cm::verbs::lane`) allocate nothing: a counting global
//! allocator (`common/counting.rs`) watches 10,000 send/recv round trips and RDMA WRITEs whose
//! work requests are built at each post; prepared requests and batches; a lane with a shared
//! receive queue that echoes from it; work requests of several pieces (gathered sends, WRITEs
//! and READs, and scattered receives); UD datagrams both ways; the lane's waits, blocking, busy
//! and async (feature `tokio`: the waits, the reactor's wake-ups and the runtime's parking in
//! between); a lane waited on in a `Readiness` set; and the peer's disconnect seen and its
//! flush waited for.

mod common;
#[path = "common/counting.rs"]
mod counting;

use std::time::{Duration, Instant};

use common::lane::{lane_on, lane_pair};
use common::{pair, DeviceTest, PairSpec, T};
use counting::{count_allocs, counts, reset, watched};
use rdma_cm::verbs::lane::{Lane, RecvWr as LRecv, SendWr as LSend, Wc};
use rdma_cm::{AccessFlags, MemoryRegion, WcStatus, WorkQueue};

/// Polls `lane` (watched) until one completion comes (bounded): its fields and its region.
fn one(lane: &mut Lane) -> (Wc, MemoryRegion) {
    let deadline = Instant::now() + T;
    let mut back = None;
    while watched(|| lane.poll_with(16, |c, mr| back = Some((c, mr)))).unwrap() == 0 {
        assert!(Instant::now() < deadline, "no completion within {T:?}");
    }
    let (wc, mr) = back.unwrap();
    assert!(wc.is_ok(), "{wc:?}");
    (wc, mr.expect("a lane completion hands its region back"))
}

/// Work requests built at each post (`SendWr::send`, `RecvWr::range`, `SendWr::write`), each
/// posted and polled with the counter watching, the region handed back by the completion and
/// moved into the next request: 10,000 send/recv round trips, each followed by an RDMA WRITE.
#[test]
fn lane_posts_of_work_requests_built_each_time_allocate_nothing() {
    const N: u64 = 10_000;
    let t = DeviceTest::start();
    {
        let spec = PairSpec {
            mr_sizes: vec![4096, 4096],
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            ..PairSpec::default()
        };
        let (mut a, mut b) = lane_pair(t.addr, spec.clone(), spec, 64);
        let remote = b.mrs[0].remote();
        let mut msg = Some(a.mrs.remove(0));
        let mut buf = Some(b.mrs.remove(1));
        counting::assert_it_counts();
        for i in 0..N {
            let r = buf.take().unwrap();
            watched(|| b.lane.post_recv(b.qp, LRecv::range(r, 0..64).wr_id(i))).unwrap();
            let m = msg.take().unwrap();
            watched(|| a.lane.post_send(a.qp, LSend::send(m, 0..64).wr_id(i))).unwrap();
            let (wc, m) = one(&mut a.lane);
            assert_eq!((wc.queue(), wc.wr_id()), (WorkQueue::Send, i));
            let (wc, r) = one(&mut b.lane);
            assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 64));
            buf = Some(r);
            // An RDMA WRITE into the peer's remotely writable region.
            watched(|| a.lane.post_send(a.qp, LSend::write(m, 0..256, &remote, 512).wr_id(i))).unwrap();
            let (wc, m) = one(&mut a.lane);
            assert_eq!(wc.wr_id(), i);
            msg = Some(m);
        }
        let (allocs, bytes) = counts();
        assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} iterations of post and poll");
        drop((a, b, msg, buf));
    }
    t.finish();
}

/// Prepared requests: 2,000 rounds of a send/recv through prepared requests, an RDMA WRITE
/// built as a `SendWr` at each post, and a prepared batch of 16 WRITEs, each posted and
/// polled (the region handed back and re-armed) with the counter watching.
#[test]
fn lane_posts_and_polls_allocate_nothing() {
    const N: usize = 2_000;
    let t = DeviceTest::start();
    let spec = PairSpec {
        mr_sizes: vec![4096, 4096, 4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let (mut a, mut b) = lane_pair(t.addr, spec.clone(), spec, 64);
    let remote = b.mrs[0].remote();
    let mut send = a.lane.prepare_send(a.qp, LSend::send(a.mrs.remove(0), 0..64)).unwrap();
    let mut recv = b.lane.prepare_recv(b.qp, LRecv::range(b.mrs.remove(1), 0..64)).unwrap();
    let mut batch = a
        .lane
        .prepare_batch(a.qp, a.mrs.remove(0), 16, |k, mr| LSend::write(mr, 0..64, &remote, k as u64 * 64))
        .unwrap();
    let mut plain = Some(a.mrs.remove(0));
    reset();
    for _ in 0..N {
        watched(|| b.lane.post_prepared_recv(&mut recv)).unwrap();
        watched(|| a.lane.post_prepared(&mut send)).unwrap();
        send.rearm(one(&mut a.lane).1).unwrap();
        recv.rearm(one(&mut b.lane).1).unwrap();
        let wr = LSend::write(plain.take().unwrap(), 0..64, &remote, 1024);
        watched(|| a.lane.post_send(a.qp, wr)).unwrap();
        plain = Some(one(&mut a.lane).1);
        watched(|| a.lane.post_batch(&mut batch)).unwrap();
        batch.rearm(one(&mut a.lane).1).unwrap();
    }
    let (allocs, bytes) = counts();
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
    const N: usize = 300;
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut a, mut b) = lane_pair(t.addr, spec.clone(), spec, 64);
    let mut send = a.lane.prepare_send(a.qp, LSend::send(a.mrs.remove(0), 0..64)).unwrap();
    let mut recv = b.lane.prepare_recv(b.qp, LRecv::range(b.mrs.remove(0), 0..64)).unwrap();
    let (ready, go) = std::sync::mpsc::channel();
    reset();
    let waiter = std::thread::spawn(move || {
        for i in 0..N {
            b.lane.post_prepared_recv(&mut recv).unwrap();
            ready.send(()).unwrap();
            let mut back = None;
            let n = watched(|| {
                let f = |c: Wc, mr| back = Some((c.is_ok(), c.byte_len(), mr));
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
    let (allocs, bytes) = counts();
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} waits on the lane");
    drop((a, b, send, recv));
    t.finish();
}

/// The lane's async wait (`Lane::wait_async_with`) allocates nothing per wait either, after a
/// warm-up that makes the channel's lasting reactor registration: 2,000 send/recv round trips
/// on a current-thread runtime (the test's thread, which the counter watches), each end's
/// completion awaited (asleep on the reactor when it is not there yet), the timer of each wait
/// and the runtime's parking included.
#[cfg(feature = "tokio")]
#[test]
fn lane_async_waits_allocate_nothing() {
    const WARM: usize = 100;
    const N: usize = 2_000;
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut a, mut b) = lane_pair(t.addr, spec.clone(), spec, 64);
    let mut send = a.lane.prepare_send(a.qp, LSend::send(a.mrs.remove(0), 0..64)).unwrap();
    let mut recv = b.lane.prepare_recv(b.qp, LRecv::range(b.mrs.remove(0), 0..64)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (allocs, bytes) = rt.block_on(async {
        for i in 0..WARM + N {
            if i == WARM {
                reset();
                counting::watch(true);
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
        counting::watch(false);
        counts()
    });
    assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} async round trips on the lane");
    drop((a, b, send, recv));
    t.finish();
}

/// A lane with a shared receive queue allocates nothing either: the server's QP takes its
/// receives from the lane's SRQ; each message lands in the SRQ's region, whose completion (on
/// the lane's one CQ) names the QP, and the server echoes it from that same region on the QP's
/// send queue (polled through the same CQ) before posting the region to the SRQ again. The
/// client keeps one receive posted ahead (two regions in turn), so each echo finds one.
#[test]
fn a_lane_with_a_shared_receive_queue_posts_and_polls_allocating_nothing() {
    use rdma_cm::{Client, ConnParam, ProtectionDomain, QpInit, Server};
    const N: u64 = 5_000;
    let t = DeviceTest::start();
    {
        let listener = Server::new().unwrap().bind(std::net::SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
        let dst = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let pd = route.alloc_pd().unwrap();
            let mut lane = Lane::new(&route.context().unwrap(), 32).unwrap();
            let c = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
            let qp = c.qp();
            let region = || MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
            // The first echo's receive, posted before the connect.
            lane.post_recv(qp, LRecv::range(region(), 0..64).wr_id(0)).unwrap();
            c.connect(&mut lane, &ConnParam::new(), T).unwrap();
            (lane, qp, region(), region(), pd)
        });
        let ctx = listener.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut slane = Lane::new(&ctx, 64).unwrap();
        let srq = slane.create_srq(&pd, 16).unwrap();
        let init = slane.srq_qp_init(srq, QpInit::new()).unwrap();
        let s = listener.get_request(T).unwrap().lane_qp(&mut slane, &pd, init).unwrap();
        let sqp = s.qp();
        s.accept(&mut slane, &ConnParam::new(), T).unwrap();
        let server_qpn = slane.qp_num(sqp).unwrap();
        let (mut clane, cqp, mr, next_recv, cpd) = client.join().unwrap();
        let mut slot = Some(MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap());
        let (mut mr, mut next_recv) = (Some(mr), Some(next_recv));
        reset();
        for i in 0..N {
            let r = slot.take().unwrap();
            watched(|| slane.post_srq_recv(srq, LRecv::new(r).wr_id(i))).unwrap();
            let m = mr.take().unwrap();
            watched(|| clane.post_send(cqp, LSend::send(m, 0..64).wr_id(i))).unwrap();
            let (wc, m) = one(&mut clane);
            assert_eq!(wc.queue(), WorkQueue::Send);
            mr = Some(m);
            let (wc, r) = one(&mut slane);
            assert_eq!((wc.queue(), wc.wr_id(), wc.qp_num(), wc.is_srq()), (WorkQueue::Recv, i, server_qpn, true));
            // The echo, from the slot, polled through the lane's CQ; the client's receive for
            // the next one posted meanwhile.
            watched(|| slane.post_send(sqp, LSend::send(r, 0..64).wr_id(i))).unwrap();
            let n = next_recv.take().unwrap();
            watched(|| clane.post_recv(cqp, LRecv::range(n, 0..64).wr_id(i + 1))).unwrap();
            let (wc, r) = one(&mut slane);
            assert_eq!((wc.queue(), wc.qp()), (WorkQueue::Send, Some(sqp)));
            slot = Some(r);
            let (wc, n) = one(&mut clane);
            assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 64));
            next_recv = Some(n);
        }
        let (allocs, bytes) = counts();
        assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} iterations on a lane with an SRQ");
        drop((clane, mr, next_recv, cpd));
        drop((slane, slot, pd, ctx, listener));
    }
    t.finish();
}

/// Work requests of several pieces allocate nothing either: building them, posting them and
/// reaping them, for sends gathered from three pieces of a region, gathered WRITEs and
/// scattered READs (the lane's scatter/gather lists name pieces of one region).
#[test]
fn lane_scatter_gather_posts_and_polls_allocate_nothing() {
    use rdma_cm::QpInit;
    const N: u64 = 2_000;
    let t = DeviceTest::start();
    {
        let cspec = PairSpec {
            mr_sizes: vec![4096],
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
        let (mut c, mut s) = lane_pair(t.addr, cspec, sspec, 64);
        let remote = s.mrs[0].remote();
        let send_pieces = [0..16, 400..500, 200..264];
        // Where READs scatter into fewer than three pieces (siw: max_sge_rd 1), the same 180
        // bytes into one: the READ's allocations are still counted.
        let read_three = [1000..1100, 3000..3010, 2000..2070];
        #[allow(clippy::single_range_in_vec_init)] // one piece: a list of one range
        let read_one = [1000..1180];
        let read_pieces: &[_] = if common::caps::has(common::Cap::ReadScatter(3)) { &read_three } else { &read_one };
        let mut mr = Some(c.mrs.remove(0));
        let mut buf = Some(s.mrs.remove(1));
        reset();
        for i in 0..N {
            let r = buf.take().unwrap();
            watched(|| s.lane.post_recv(s.qp, LRecv::range(r, 0..512).wr_id(i))).unwrap();
            let m = mr.take().unwrap();
            watched(|| c.lane.post_send(c.qp, LSend::send_sg(m, &send_pieces).wr_id(i))).unwrap();
            let (wc, m) = one(&mut c.lane);
            assert_eq!(wc.queue(), WorkQueue::Send);
            let (wc, r) = one(&mut s.lane);
            assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 180));
            buf = Some(r);
            watched(|| c.lane.post_send(c.qp, LSend::write_sg(m, &send_pieces, &remote, 1024).wr_id(i))).unwrap();
            let (wc, m) = one(&mut c.lane);
            assert_eq!(wc.wr_id(), i);
            watched(|| c.lane.post_send(c.qp, LSend::read_sg(m, read_pieces, &remote, 1024).wr_id(i))).unwrap();
            let (wc, m) = one(&mut c.lane);
            assert_eq!((wc.wr_id(), wc.byte_len()), (i, 180));
            mr = Some(m);
        }
        let (allocs, bytes) = counts();
        assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} iterations of scatter/gather post and poll");
        drop((c, s, mr, buf));
    }
    t.finish();
}

/// Receives scattered over 3 pieces of one region (`RecvWr::scatter`) allocate nothing:
/// building them, posting them and reaping them, with the region handed back by each
/// completion and moved into the next receive.
#[test]
fn scattered_receives_allocate_nothing() {
    use rdma_cm::QpInit;
    const N: u64 = 2_000;
    let t = DeviceTest::start();
    {
        let spec = PairSpec {
            mr_sizes: vec![4096],
            init: QpInit::new().max_send_sge(3).max_recv_sge(3),
            ..PairSpec::default()
        };
        let (mut c, mut s) = lane_pair(t.addr, spec.clone(), spec, 64);
        let recv_pieces = [0..64, 1024..1088, 128..192];
        let mut mr = Some(c.mrs.remove(0));
        let mut buf = Some(s.mrs.remove(0));
        reset();
        for i in 0..N {
            let r = buf.take().unwrap();
            watched(|| s.lane.post_recv(s.qp, LRecv::scatter(r, &recv_pieces).wr_id(i))).unwrap();
            let m = mr.take().unwrap();
            watched(|| c.lane.post_send(c.qp, LSend::send(m, 0..180).wr_id(i))).unwrap();
            let (wc, m) = one(&mut c.lane);
            assert_eq!(wc.queue(), WorkQueue::Send);
            let (wc, r) = one(&mut s.lane);
            assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 180));
            mr = Some(m);
            buf = Some(r);
        }
        let (allocs, bytes) = counts();
        assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} scattered receives");
        drop((c, s, mr, buf));
    }
    t.finish();
}

/// UD on lanes allocates nothing either: a datagram each way per iteration (the client's from
/// a region to its registered destination, the server's an inline reply), each receive read
/// as a `Datagram`.
#[test]
fn lane_ud_posts_and_polls_allocate_nothing() {
    use rdma_cm::verbs::ah::{AddressHandle, GRH_LEN};
    use rdma_cm::verbs::lane::InlineWr;
    use rdma_cm::verbs::ud::{Datagram, UdDest, RDMA_UDP_QKEY};
    use rdma_cm::QpInit;
    const N: u64 = 5_000;
    let t = DeviceTest::start();
    if !common::require(common::Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = common::lane::lane_ud_pair(t.addr, 7321, QpInit::new(), 64);
        let (c, s) = (&mut p.client, &mut p.server);
        let mut msg = Some(MemoryRegion::new(&c.pd, 64, AccessFlags::LOCAL_WRITE).unwrap());
        let mut crecv = Some(MemoryRegion::new(&c.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap());
        let mut srecv = Some(MemoryRegion::new(&s.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap());
        // The client's address, from a first datagram (as a UD server learns it).
        s.lane.post_recv(s.qp, LRecv::new(srecv.take().unwrap())).unwrap();
        c.lane.post_send(c.qp, LSend::send(msg.take().unwrap(), 0..8).to(p.to_server)).unwrap();
        msg = Some(common::lane::reap(&mut c.lane, 1).pop().unwrap().ok().unwrap().take_region().unwrap());
        let mut hello = common::lane::reap(&mut s.lane, 1).pop().unwrap().ok().unwrap();
        let mut region = hello.take_region().unwrap();
        let d = Datagram::parse(&hello, &mut region, 0).unwrap();
        let ah = AddressHandle::reply_to(&s.pd, 1, &hello, d.grh().expect("a GRH")).unwrap();
        let to_client = s.lane.add_dest(s.qp, &UdDest::new(ah, d.src_qp(), RDMA_UDP_QKEY)).unwrap();
        srecv = Some(region);
        reset();
        for i in 0..N {
            let r = srecv.take().unwrap();
            watched(|| s.lane.post_recv(s.qp, LRecv::new(r).wr_id(i))).unwrap();
            let r = crecv.take().unwrap();
            watched(|| c.lane.post_recv(c.qp, LRecv::new(r).wr_id(i))).unwrap();
            let m = msg.take().unwrap();
            watched(|| c.lane.post_send(c.qp, LSend::send(m, 0..64).to(p.to_server).wr_id(i))).unwrap();
            let (wc, m) = one(&mut c.lane);
            assert_eq!(wc.queue(), WorkQueue::Send);
            msg = Some(m);
            let (wc, mut r) = one(&mut s.lane);
            let d = watched(|| Datagram::parse(&wc, &mut r, 0)).unwrap();
            assert_eq!((wc.wr_id(), d.len()), (i, 64));
            srecv = Some(r);
            watched(|| s.lane.post_inline(s.qp, InlineWr::send(b"pong").to(to_client).wr_id(i))).unwrap();
            let mut sent = None;
            let deadline = Instant::now() + T;
            while watched(|| s.lane.poll_with(16, |c, _| sent = Some(c))).unwrap() == 0 {
                assert!(Instant::now() < deadline, "no completion within {T:?}");
            }
            let sent = sent.unwrap();
            assert!(sent.is_ok() && sent.queue() == WorkQueue::Send, "{sent:?}");
            let (wc, mut r) = one(&mut c.lane);
            assert_eq!(watched(|| Datagram::parse(&wc, &mut r, 0)).unwrap().len(), 4);
            crecv = Some(r);
        }
        let (allocs, bytes) = counts();
        assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} UD round trips");
        drop((p, msg, crecv, srecv));
    }
    t.finish();
}

/// One thread waiting on a connection's channel and a lane's CQ through a `Readiness`
/// allocates nothing per wait: 300 receives (few: the whole binary also runs under valgrind),
/// each waited for (`poll(2)` on both descriptors, the channel's queue looked at), the lane
/// re-armed (its CQ event read) and polled. The CQ is armed before each send, so every
/// receive's completion makes it ready, and once re-armed and polled it is quiet again.
#[test]
fn readiness_waits_on_a_lane_allocate_nothing() {
    use rdma_cm::Readiness;
    const N: u64 = 300;
    let t = DeviceTest::start();
    {
        let (mut la, mut lb) = (lane_on(t.addr, 64), lane_on(t.addr, 64));
        let cspec = PairSpec { init: la.qp_init(), ..PairSpec::default() };
        let sspec = PairSpec { init: lb.qp_init(), ..PairSpec::default() };
        let (mut c, mut s) = pair(t.addr, cspec, sspec);
        // The server connection's channel, before the lane takes the connection.
        let ch = s.conn.id().channel().clone();
        let (mut msg, mut buf) = (Some(c.mrs.remove(0)), Some(s.mrs.remove(0)));
        let qa = la.attach(c.conn).map_err(|r| r.into_parts().0).unwrap();
        let qb = lb.attach(s.conn).map_err(|r| r.into_parts().0).unwrap();
        let cq = lb.cq();
        let mut set = Readiness::with_capacity(2).channel(&ch, 0u8).cq(&cq, 1);
        lb.arm().unwrap();
        reset();
        for i in 0..N {
            let r = buf.take().unwrap();
            watched(|| lb.post_recv(qb, LRecv::range(r, 0..64).wr_id(i))).unwrap();
            let m = msg.take().unwrap();
            watched(|| la.post_send(qa, LSend::send(m, 0..64).wr_id(i))).unwrap();
            let (first, second) = watched(|| {
                let mut ready = set.wait(T).unwrap();
                (ready.next(), ready.next())
            });
            assert_eq!((first, second), (Some(1), None), "receive {i}: the lane's CQ, and only it, becomes ready");
            watched(|| lb.arm()).unwrap();
            let (wc, r) = one(&mut lb);
            assert_eq!((wc.queue(), wc.wr_id(), wc.byte_len()), (WorkQueue::Recv, i, 64));
            assert!(watched(|| lb.poll_with(16, |_, _| {})).unwrap() == 0, "receive {i}: one completion");
            let ready = watched(|| set.wait(Duration::ZERO).unwrap().len());
            assert_eq!(ready, 0, "receive {i}: the CQ's event was read by the arming");
            buf = Some(r);
            let (wc, m) = one(&mut la);
            assert_eq!(wc.queue(), WorkQueue::Send);
            msg = Some(m);
        }
        let (allocs, bytes) = counts();
        assert_eq!(allocs, 0, "{allocs} allocations ({bytes} bytes) in {N} waits");
        drop(set);
        drop((cq, ch, la, lb, msg, buf, c.pd, s.pd));
    }
    t.finish();
}

/// Seeing the peer leave and waiting for what it flushed allocate nothing: the peer drops its
/// connection while a receive is posted; `Lane::wait_peer_left` reads its `DISCONNECTED` (the
/// event queued on the way) and moves the QP to the error state, and `Lane::wait` hands out the
/// receive, flushed.
#[test]
fn waiting_through_the_peers_disconnect_allocates_nothing() {
    let t = DeviceTest::start();
    {
        let (a, mut b) = lane_pair(t.addr, PairSpec::default(), PairSpec::default(), 64);
        b.lane.post_recv(b.qp, LRecv::range(b.mrs.remove(0), 0..64).wr_id(1)).unwrap();
        drop(a);
        let ((left, c), allocs) = count_allocs(|| {
            let left = b.lane.wait_peer_left(b.qp, T);
            (left, b.lane.wait(T))
        });
        assert!(left.unwrap(), "the peer's departure was not seen within {T:?}");
        let c = c.unwrap();
        assert_eq!((c.status(), c.wr_id()), (WcStatus::WrFlushErr, 1));
        assert_eq!(allocs, 0, "seeing the peer leave and waiting for the flush allocated {allocs} times");
        drop((c, b));
    }
    t.finish();
}
