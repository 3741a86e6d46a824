//! Shared receive queues: their room, their counts, and the QPs that share them.

use crate::common::{mr_count, out_of_reach, pattern, DeviceTest, T};
use crate::support::{shared_cq_stress, Mode, LW};
use rdma_cm::{
    AccessFlags, AsyncElement, AsyncEvent, AsyncEvents, Client, CompletionQueue, ConnParam, Connection, Datagram,
    Error, MemoryRegion, ProtectionDomain, QpInit, QpState, RecvWr, SendWr, Server, SharedReceiveQueue, UdClient,
    UdDest, UdSendWr, UdServer, VerbsContext, WorkCompletion, WorkQueue, GRH_LEN,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// A UD server QP that takes its receives from an SRQ, and the regions posted there.
struct SrqServer {
    ep: rdma_cm::UdEndpoint,
    srq: SharedReceiveQueue,
    chunks: Vec<MemoryRegion>,
    ctx: VerbsContext,
}

/// Accepts one connection on `listener` whose QP takes receives from `srq` and completes on
/// `cq` (send and receive), and returns it.
fn accept_on(
    listener: &rdma_cm::Listener,
    pd: &Arc<ProtectionDomain>,
    cq: &Arc<CompletionQueue>,
    srq: &SharedReceiveQueue,
) -> Connection {
    let req = listener.get_request(T).unwrap();
    let init = QpInit::new().send_cq(Arc::clone(cq)).recv_cq(Arc::clone(cq)).srq(srq);
    req.create_qp(pd, init).unwrap().accept(&ConnParam::new(), T).unwrap()
}

/// A client connected to `dst` that sends `n` 64-byte messages and waits for each to be
/// acknowledged (so each has landed in one of the server's receives).
fn client_sends(dst: SocketAddr, n: u64) -> (Connection, MemoryRegion) {
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
    for i in 0..n {
        conn.qp_mut().post_send(&[SendWr::send(&mr, 0..64).wr_id(i)]).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Send, i, T).unwrap();
    }
    (conn, mr)
}

/// A client connected to `dst`, on its own PD, with a 4 KiB region.
fn client_to(dst: SocketAddr, init: QpInit) -> (Connection, MemoryRegion, Arc<ProtectionDomain>) {
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let conn = route.create_qp(&pd, init).unwrap().connect(&ConnParam::new(), T).unwrap();
    (conn, mr, pd)
}

/// A UD client connected to a UD server whose QP draws on an SRQ of `n` receives of `slot`
/// bytes each (all posted, and the limit armed when given, before the accept).
fn ud_srq_pair(
    addr: std::net::IpAddr,
    port: u16,
    n: usize,
    slot: usize,
    limit: Option<u32>,
) -> (rdma_cm::UdEndpoint, UdDest, SrqServer) {
    let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, port), 4).unwrap();
    let client = std::thread::spawn(move || {
        let route = UdClient::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(addr, port), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut ep = route.create_qp(&pd, QpInit::new()).unwrap();
        let dest = ep.connect(&[], T).unwrap();
        (ep, dest)
    });
    let req = l.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let chunks = MemoryRegion::new(&pd, n * slot, AccessFlags::LOCAL_WRITE).unwrap().split(slot).unwrap();
    let srq = SharedReceiveQueue::new(&pd, n as u32).unwrap();
    let recvs: Vec<RecvWr> =
        chunks.iter().enumerate().map(|(i, m)| RecvWr::new(m, 0..slot).wr_id(100 + i as u64)).collect();
    srq.post_recv(&recvs).unwrap();
    drop(recvs);
    if let Some(k) = limit {
        srq.arm_limit(k).unwrap();
    }
    let sq = req.create_qp(&pd, QpInit::new().srq(&srq)).unwrap();
    let ep = sq.accept(&[]).unwrap();
    let (cep, dest) = client.join().unwrap();
    drop(l);
    (cep, dest, SrqServer { ep, srq, chunks, ctx })
}

/// Reads `events` (bounded by `within`) until one satisfies `want`.
fn wait_event(events: &mut AsyncEvents, within: Duration, want: impl Fn(&AsyncEvent) -> bool) -> AsyncEvent {
    let deadline = Instant::now() + within;
    let mut others = vec![];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.next(left) {
            Ok(ev) if want(&ev) => return ev,
            Ok(ev) => others.push(ev),
            Err(e) => panic!("the expected event did not come within {within:?} ({e}); others seen: {others:?}"),
        }
    }
}

/// A UD QP on an SRQ: posting receives to the QP itself is refused; a datagram lands in an SRQ
/// chunk, which `Datagram::parse` reads only once its completion is reaped, while the chunks
/// still posted stay unreadable; the SRQ's limit event reaches the SRQ and every source (two
/// of them, each its own copy); and an SRQ made after the first is gone (possibly at the same
/// address) is not told about the old one's event.
#[test]
fn ud_on_an_srq_two_sources_and_a_reused_address() {
    let t = DeviceTest::start();
    let slot = GRH_LEN + 64;
    let (mut client, to_server, mut s) = ud_srq_pair(t.addr, 7409, 4, slot, Some(2));
    let mut a = s.ctx.async_events().unwrap();
    let mut b = s.ctx.async_events().unwrap();
    let spare = MemoryRegion::new(client.qp().pd(), slot, AccessFlags::LOCAL_WRITE).unwrap();
    drop(spare);
    let r = MemoryRegion::new(s.srq.pd(), slot, AccessFlags::LOCAL_WRITE).unwrap();
    let e = s.ep.qp_mut().post_recv(&[RecvWr::new(&r, 0..slot)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(r.outstanding(), 0);
    for i in 0..3u8 {
        client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[i; 64]).wr_id(i as u64)]).unwrap();
        client.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap();
    }
    let mut got = vec![];
    while got.len() < 3 {
        let mut wcs = [WorkCompletion::default(); 4];
        let n = s.ep.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
        assert!(n > 0, "only {} of 3 datagrams arrived", got.len());
        got.extend_from_slice(&wcs[..n]);
    }
    let mut seen = [false; 4];
    for wc in &got {
        let k = (wc.wr_id() - 100) as usize;
        seen[k] = true;
        let d = Datagram::parse(wc, &mut s.chunks[k], 0).unwrap();
        let v = s.chunks[k].as_slice().unwrap()[d.payload()].to_vec();
        assert!(v.len() == 64 && v.iter().all(|&x| x == v[0]) && v[0] < 3, "{v:?}");
    }
    let posted = seen.iter().position(|&x| !x).unwrap();
    assert!(matches!(Datagram::parse(&got[0], &mut s.chunks[posted], 0), Err(Error::InFlight { .. })));
    assert!(matches!(s.chunks[posted].as_slice(), Err(Error::InFlight { .. })));
    // The limit event: both sources get it; the SRQ is marked.
    let old_raw = s.srq.as_raw() as usize;
    let ea = wait_event(&mut a, T, |e| e.is_srq_limit());
    let eb = wait_event(&mut b, T, |e| e.is_srq_limit());
    assert_eq!(ea, eb);
    assert_eq!(ea.element, AsyncElement::Srq(old_raw));
    assert!(s.srq.limit_reached().unwrap());
    // Tear the server down, then make a fresh SRQ on a fresh PD of the same context.
    let SrqServer { ep, srq, chunks, ctx } = s;
    drop(ep);
    drop(srq);
    assert!(chunks.iter().all(|c| c.outstanding() == 0), "the SRQ's receives went with it");
    drop(chunks);
    let pd2 = ProtectionDomain::new(&ctx).unwrap();
    let fresh: Vec<SharedReceiveQueue> = (0..4).map(|_| SharedReceiveQueue::new(&pd2, 4).unwrap()).collect();
    let reused = fresh.iter().any(|q| q.as_raw() as usize == old_raw);
    eprintln!("measured: a fresh SRQ reused the old one's address: {reused}");
    for q in &fresh {
        assert!(!q.limit_reached().unwrap(), "a new SRQ was told about the old one's limit event");
        assert_eq!(q.last_async_event().unwrap(), None);
    }
    drop((fresh, pd2, a, b, ctx, client, to_server, r));
    t.finish();
}

/// An SRQ receive naming one region in three pieces (and a second region once), whose caller
/// drops the region's handle: it stays registered and unreachable while the receive is posted,
/// and the message lands in it; the hold goes with the completion (or with the SRQ).
#[test]
fn an_srq_receive_naming_one_region_thrice_holds_it_until_delivered() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(std::net::SocketAddr::new(t.addr, 0)).unwrap().listen(1).unwrap();
    let dst = listener.local_addr().unwrap();
    let msg = pattern(96, 17);
    let sent = msg.clone();
    let client = std::thread::spawn(move || {
        let (mut c, _) = {
            let route = rdma_cm::Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let pd = route.alloc_pd().unwrap();
            let mut mr = MemoryRegion::new(&pd, 96, LW).unwrap();
            mr.as_mut_slice().unwrap().copy_from_slice(&sent);
            // The server checks its receive and counts regions between the request and its
            // accept, which can outlast `T` on a loaded machine. The CM retries its request
            // for about a minute, so waiting that long loses nothing.
            let patient = Duration::from_secs(60);
            let conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), patient).unwrap();
            ((conn, mr), pd)
        };
        c.0.qp_mut().post_send(&[SendWr::send(&c.1, 0..96).wr_id(1)]).unwrap();
        c.0.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
        c
    });
    let req = listener.get_request(T).unwrap();
    let pd = req.alloc_pd().unwrap();
    let srq = SharedReceiveQueue::with_sge(&pd, 4, 4).unwrap();
    let mut x = MemoryRegion::new(&pd, 128, LW).unwrap();
    let mut y = MemoryRegion::new(&pd, 64, LW).unwrap();
    {
        let pieces = [(&x, 0..32), (&y, 0..32), (&x, 64..96), (&x, 96..128)];
        srq.post_recv(&[RecvWr::sg(&pieces).unwrap().wr_id(9)]).unwrap();
    }
    assert_eq!((srq.outstanding(), x.outstanding(), y.outstanding()), (1, 1, 1));
    out_of_reach(&mut x, "a region named by three pieces of an SRQ receive");
    out_of_reach(&mut y, "the other region of that receive");
    // The second region's handle goes now: the receive keeps it registered.
    let before = mr_count();
    drop(y);
    assert_eq!(mr_count(), before, "the posted receive keeps the dropped region registered");
    let mut conn = req.create_qp(&pd, QpInit::new().srq(&srq)).unwrap().accept(&ConnParam::new(), T).unwrap();
    let wc = conn.qp_mut().wait_for(WorkQueue::Recv, 9, T).unwrap();
    assert_eq!(wc.byte_len(), 96);
    assert_eq!((srq.outstanding(), x.outstanding()), (0, 0));
    assert_eq!(mr_count(), before.map(|n| n - 1), "the dropped region deregistered with the completion");
    let got = x.as_slice().unwrap();
    // 96 bytes: x's first piece, y's (dropped, not checkable), x's second; x's third gets none.
    assert_eq!((&got[..32], &got[64..96]), (&msg[..32], &msg[64..96]));
    assert!(got[32..64].iter().chain(&got[96..]).all(|&b| b == 0), "outside what landed in x: untouched");
    assert!(x.as_mut_slice().is_ok());
    let peer = client.join().unwrap();
    drop((peer, conn, srq, x, pd, listener));
    t.finish();
}

/// "An RC QP refuses posts after a failed completion", through an SRQ: a message longer than the SRQ receive it lands in fails that receive with
/// LOC_LEN_ERR and moves the RC QP to the error state, like any failed completion. The crate
/// notes a failure in `Router::route` only for a QP's own queues: an SRQ completion returns
/// early (src/cq.rs, the `if t.srq` branch) without `note_status`, so the QP's posts are still
/// accepted.
#[test]
fn a_failed_srq_receive_makes_its_rc_qp_refuse_posts() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let client = thread::spawn(move || {
        let (mut conn, mr, pd) = client_to(dst, QpInit::new());
        conn.qp_mut().post_send(&[SendWr::send(&mr, 0..64).wr_id(1)]).unwrap();
        // The responder refuses the message; the requester's completion fails too.
        let _ = conn.qp_mut().wait_for(WorkQueue::Send, 1, T);
        (conn, mr, pd)
    });
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let srq = SharedReceiveQueue::new(&pd, 4).unwrap();
    let small = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    srq.post_recv(&[RecvWr::new(&small, 0..8).wr_id(7)]).unwrap();
    let init = QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq)).srq(&srq);
    let mut s = req.create_qp(&pd, init).unwrap().accept(&ConnParam::new(), T).unwrap();
    let e = s.qp_mut().wait_for(WorkQueue::Recv, 7, T).unwrap_err();
    assert!(matches!(e, rdma_cm::Error::WorkCompletion { .. }), "the short SRQ receive fails: {e}");
    let (c, cmr, cpd) = client.join().unwrap();
    assert_eq!(s.qp().state().unwrap(), QpState::Error, "a failed SRQ receive moves the RC QP to ERR");
    let out = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let posted = s.qp_mut().post_send(&[SendWr::send(&out, 0..8).wr_id(2)]);
    let refused = matches!(posted, Err(rdma_cm::Error::QpInError { .. }));
    if posted.is_ok() {
        // Reap what it did (a flush on rxe) so the teardown is clean, then report.
        let _ = s.qp_mut().wait_for(WorkQueue::Send, 2, Duration::from_secs(2));
    }
    drop((s, c, cmr, cpd, srq, cq, small, out, pd, ctx, listener));
    t.finish();
    assert!(refused, "a post to an RC QP whose SRQ receive failed must be refused (QpInError): {posted:?}");
}

/// Four QPs on one CQ taking receives from one SRQ that
/// each thread refills, waited on with wait, wait_queue and busy-polled wait.
#[test]
fn four_srq_qps_on_one_cq_lose_nothing_and_the_srq_count_holds() {
    shared_cq_stress(&[Mode::Wait, Mode::WaitQueue, Mode::BusyWait, Mode::Wait], Some(16));
}

/// `SharedReceiveQueue::outstanding()` across QPs on separate
/// CQs dropped in turn: A (on CQ a) and B (on CQ b) each consume two receives of one SRQ of 8.
/// B polls its two; A is dropped with its two unpolled (its CQ's sweep reaps them for a QP that
/// is gone); then B goes. The count must follow exactly, and the room must be usable again.
#[test]
fn srq_count_follows_qps_on_separate_cqs_dropped_in_turn() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let sends = move || {
        let (mut conn, mr, pd) = client_to(dst, QpInit::new());
        for i in 0..2 {
            conn.qp_mut().post_send(&[SendWr::send(&mr, 0..32).wr_id(i)]).unwrap();
            conn.qp_mut().wait_for(WorkQueue::Send, i, T).unwrap();
        }
        (conn, mr, pd)
    };
    let c1 = thread::spawn(sends);
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let srq = SharedReceiveQueue::new(&pd, 8).unwrap();
    let mr = MemoryRegion::new(&pd, 12 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let wrs: Vec<_> = (0..8).map(|i| RecvWr::new(&mr, i * 64..(i + 1) * 64).wr_id(i as u64)).collect();
    srq.post_recv(&wrs).unwrap();
    let (cqa, cqb) = (CompletionQueue::new(&ctx, 32).unwrap(), CompletionQueue::new(&ctx, 32).unwrap());
    let on = |cq: &Arc<CompletionQueue>| QpInit::new().send_cq(Arc::clone(cq)).recv_cq(Arc::clone(cq)).srq(&srq);
    let a = req.create_qp(&pd, on(&cqa)).unwrap().accept(&ConnParam::new(), T).unwrap();
    let k1 = c1.join().unwrap();
    let c2 = thread::spawn(sends);
    let req = listener.get_request(T).unwrap();
    let mut b = req.create_qp(&pd, on(&cqb)).unwrap().accept(&ConnParam::new(), T).unwrap();
    let k2 = c2.join().unwrap();
    assert_eq!(srq.outstanding(), 8, "eight posted; four consumed, none polled");
    let mut wcs = [WorkCompletion::default(); 8];
    let mut got = 0;
    while got < 2 {
        let n = b.qp_mut().wait(&mut wcs[got..], T).unwrap();
        assert!(n > 0, "B's receives");
        got += n;
    }
    assert!(wcs[..2].iter().all(|w| w.is_ok() && w.qp_num() == b.qp().qp_num()));
    assert_eq!(srq.outstanding(), 6, "B's two reaped");
    drop(a);
    assert_eq!(srq.outstanding(), 4, "A's two unpolled receives are released with A");
    assert_eq!(cqa.poll(&mut wcs).unwrap(), 0, "nothing left in A's CQ");
    drop(b);
    assert_eq!(srq.outstanding(), 4, "B held nothing more");
    let more: Vec<_> = (8..12).map(|i| RecvWr::new(&mr, i * 64..(i + 1) * 64).wr_id(i as u64)).collect();
    srq.post_recv(&more).unwrap();
    assert_eq!(srq.outstanding(), 8);
    assert!(matches!(srq.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(99)]), Err(rdma_cm::Error::QueueFull { .. })));
    drop((k1, k2, cqa, cqb, srq, mr, pd, ctx, listener));
    t.finish();
}

/// Finding 3: an SRQ QP dropped before anyone polled its completed receive. The completion was
/// kept "for its owner", which is gone: it counted against the SRQ's room for good
/// (`outstanding()` 4 with 3 receives posted). Both ways it can be met: the CQ's last user's
/// sweep, and another QP's poll on the shared CQ.
#[test]
fn an_srq_receive_of_a_dropped_qp_does_not_hold_the_srqs_room() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    // The server side's device context: that of the connection requests (librdmacm opens one
    // per device), taken from a first request's id.
    let client = thread::spawn(move || client_sends(dst, 1));
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let srq = SharedReceiveQueue::new(&pd, 8).unwrap();
    let mr = MemoryRegion::new(&pd, 8 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let recvs: Vec<_> = (0..4).map(|i| RecvWr::new(&mr, i * 64..(i + 1) * 64).wr_id(i as u64)).collect();
    srq.post_recv(&recvs).unwrap();
    let init = QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq)).srq(&srq);
    let a = req.create_qp(&pd, init).unwrap().accept(&ConnParam::new(), T).unwrap();
    let (c1, m1) = client.join().unwrap();
    assert_eq!(srq.outstanding(), 4, "four posted; one consumed, not yet polled");
    // The CQ's only user goes: its sweep reaps the completion of a QP that is gone.
    drop(a);
    assert_eq!(srq.outstanding(), 3, "three receives remain posted; the reaped one holds no place");

    // The same through another QP's poll: B and C share the CQ and the SRQ; C is dropped with
    // its receive completed and unpolled, and B's poll meets it.
    let client = thread::spawn(move || client_sends(dst, 0));
    let mut b = accept_on(&listener, &pd, &cq, &srq);
    let (c2, m2) = client.join().unwrap();
    let client = thread::spawn(move || client_sends(dst, 1));
    let c = accept_on(&listener, &pd, &cq, &srq);
    let (c3, m3) = client.join().unwrap();
    assert_eq!(srq.outstanding(), 3);
    drop(c);
    let mut wcs = [rdma_cm::WorkCompletion::default(); 8];
    assert_eq!(b.qp_mut().poll(&mut wcs).unwrap(), 0, "nothing of B's");
    assert_eq!(srq.outstanding(), 2, "C's reaped receive is neither delivered nor held");
    assert_eq!(cq.poll(&mut wcs).unwrap(), 0, "and the CQ's own poll has nothing kept for a dead QP");
    drop((b, c1, c2, c3, m1, m2, m3, srq, cq, mr, pd, ctx, listener));
    t.finish();
}

/// An SRQ's completions are routed by its 16-bit id and the slot's
/// 13-bit generation only; nothing ties them to a QP that is still attached. A completion of a
/// receive of SRQ A, left in a shared CQ when A's last QP on that CQ is dropped, stays in the
/// CQ; once 65536 SRQs later another SRQ B gets A's id and is attached to the same CQ, that stale
/// completion names B's slot 0 under the same generation (1: the first post of each), and
/// polling the CQ retires B's receive while it is still posted. Its region then hands out a
/// `&mut [u8]` that the device writes when a message arrives for B's QP.
#[test]
fn a_stale_srq_completion_does_not_retire_a_later_srqs_receive() {
    use rdma_cm::{Connection, SharedReceiveQueue};
    use std::sync::mpsc;
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let (up_tx, up) = mpsc::channel::<()>();
    let (down, down_rx) = mpsc::channel::<()>();
    let client = thread::spawn(move || {
        let connect = || {
            let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let pd = route.alloc_pd().unwrap();
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            let conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
            (conn, mr, pd)
        };
        let send = |conn: &mut Connection, mr: &mut MemoryRegion, msg: &[u8]| {
            mr.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(msg);
            conn.qp_mut().post_send(&[SendWr::send(mr, 0..msg.len()).wr_id(1)]).unwrap();
            conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
        };
        let (mut c1, mut m1, p1) = connect();
        send(&mut c1, &mut m1, b"stale");
        up_tx.send(()).unwrap();
        if down_rx.recv().is_err() {
            return;
        }
        let (mut c2, mut m2, p2) = connect();
        if down_rx.recv().is_err() {
            return;
        }
        send(&mut c2, &mut m2, b"OVERWRITTEN");
        up_tx.send(()).unwrap();
        let _ = down_rx.recv();
        drop((c1, m1, p1, c2, m2, p2));
    });
    let lw = AccessFlags::LOCAL_WRITE;
    // SRQ A, its receives completing on `cq`, which outlives A's QP.
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    // Armed, so its descriptor says when a completion is in it, without polling it out.
    cq.req_notify(false).unwrap();
    let srq_a = SharedReceiveQueue::new(&pd, 4).unwrap();
    let mr_a = MemoryRegion::new(&pd, 64, lw).unwrap();
    srq_a.post_recv(&[RecvWr::new(&mr_a, 0..64).wr_id(100)]).unwrap();
    let init = QpInit::new().srq(&srq_a).recv_cq(Arc::clone(&cq));
    let conn1 = req.create_qp(&pd, init).unwrap().accept(&ConnParam::new(), T).unwrap();
    // The client's send completed: A's receive (slot 0, generation 1) completed into `cq`.
    up.recv_timeout(T).unwrap();
    let mut pfd = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&*cq), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the call.
    let ready = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(ready, 1, "A's receive completion should be in the CQ (its channel fired)");
    // A's QP goes (nothing of its own outstanding, so its drop polls nothing), then A: the
    // completion stays in `cq`, unpolled.
    drop(conn1);
    drop(srq_a);
    // 65535 more SRQs: the next one gets A's 16-bit id again.
    let t0 = Instant::now();
    for _ in 0..u16::MAX {
        drop(SharedReceiveQueue::new(&pd, 1).unwrap());
    }
    eprintln!("65535 SRQs created and destroyed in {:?}", t0.elapsed());
    down.send(()).unwrap();
    let req2 = listener.get_request(T).unwrap();
    let srq_b = SharedReceiveQueue::new(&pd, 4).unwrap();
    let mut mr_b = MemoryRegion::new(&pd, 64, lw).unwrap();
    srq_b.post_recv(&[RecvWr::new(&mr_b, 0..64).wr_id(200)]).unwrap();
    let init = QpInit::new().srq(&srq_b).recv_cq(Arc::clone(&cq));
    let conn2 = req2.create_qp(&pd, init).unwrap().accept(&ConnParam::new(), T).unwrap();
    let qp2 = conn2.qp().qp_num();
    // Nothing was sent to B's QP yet: polling must retire nothing of B.
    let mut wcs = [WorkCompletion::default(); 4];
    let stolen = cq.poll(&mut wcs).unwrap();
    let held = mr_b.outstanding();
    match mr_b.as_mut_slice() {
        Ok(buf) => {
            buf.fill(0);
            // The receive is still posted on B: a message for B's QP lands in `buf`.
            down.send(()).unwrap();
            up.recv_timeout(T).unwrap();
            thread::sleep(Duration::from_millis(200));
            // SAFETY (of the demonstration): reads through the live slice the crate handed out.
            let seen: Vec<u8> = (0..11).map(|i| unsafe { std::ptr::read_volatile(buf.as_ptr().add(i)) }).collect();
            let w = &wcs[..stolen];
            panic!(
                "HOLE: cq.poll() returned {stolen} completion(s) {:?} (qp_num {:?}; B's QP is {qp2}) although nothing \
                 reached B's QP; the region of B's still-posted receive then had {held} hold(s), as_mut_slice handed \
                 out a &mut [u8], and the device wrote {:?} into it while it was borrowed",
                w.iter().map(|c| c.wr_id()).collect::<Vec<_>>(),
                w.iter().map(|c| c.qp_num()).collect::<Vec<_>>(),
                String::from_utf8_lossy(&seen),
            );
        }
        Err(Error::InFlight { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    assert_eq!(stolen, 0, "a stale completion of a destroyed SRQ retired something");
    assert_eq!(held, 1);
    down.send(()).unwrap();
    up.recv_timeout(T).unwrap();
    let wc = loop {
        let n = cq.wait(&mut wcs, T).unwrap();
        assert!(n > 0, "B's receive never completed");
        if let Some(wc) = wcs[..n].iter().find(|w| w.wr_id() == 200) {
            break *wc;
        }
    };
    assert_eq!(wc.qp_num(), qp2);
    assert_eq!(&mr_b.as_slice().unwrap()[..11], b"OVERWRITTEN");
    down.send(()).unwrap();
    client.join().unwrap();
    drop((conn2, srq_b, mr_a, mr_b, cq, pd, ctx, listener));
    t.finish();
}

/// Receives a CQ's next completions (bounded): at least one.
fn next_completions(cq: &CompletionQueue) -> Vec<WorkCompletion> {
    let mut wcs = [WorkCompletion::default(); 8];
    let n = cq.wait(&mut wcs, T).unwrap();
    assert!(n > 0, "no completion within {T:?}");
    wcs[..n].to_vec()
}

/// An SRQ's `wr_id`s carry a 16-bit id of the SRQ that the routing table finds it by, and the
/// ids come from a process-wide counter: the 65,536th SRQ after A gets A's id while A lives.
/// With both SRQs' QPs receiving on one CQ, a completion of B's receive (slot 0, first posting)
/// names A's receive (slot 0, first posting) just as well. It must retire B's receive, never
/// A's: A's receive is still posted, so a retired A would hand its region back (writable
/// through `as_mut_slice`) while the device still writes into it when A's QP gets a message.
/// (Refusing B's QP on that CQ is safe too: then A's receive must still complete as A's, and
/// B's stay posted and held.)
#[test]
#[ignore = "child process of two_live_srqs_with_one_id_on_one_cq_never_retire_each_others_receives"]
fn child_srq_id_alias() {
    use crate::support::{Peer, Step};
    if !crate::support::is_child("srq::child_srq_id_alias") {
        return;
    }
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let peer = Peer::connector(listener.local_addr().unwrap());
    let lw = AccessFlags::LOCAL_WRITE;
    peer.start(Step::Connect);
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let srq_a = SharedReceiveQueue::new(&pd, 4).unwrap();
    let mut mr_a = MemoryRegion::new(&pd, 64, lw).unwrap();
    srq_a.post_recv(&[RecvWr::new(&mr_a, 0..64).wr_id(100)]).unwrap();
    let conn_a =
        req.create_qp(&pd, QpInit::new().srq(&srq_a).recv_cq(Arc::clone(&cq))).unwrap().accept(&ConnParam::new(), T);
    let conn_a = conn_a.unwrap();
    peer.wait();
    // No other SRQ is made in this process meanwhile: the next after these has A's id.
    let t0 = Instant::now();
    for _ in 0..u16::MAX {
        drop(SharedReceiveQueue::new(&pd, 1).unwrap());
    }
    eprintln!("65535 SRQs created and destroyed in {:?}", t0.elapsed());
    let srq_b = SharedReceiveQueue::new(&pd, 4).unwrap();
    let mut mr_b = MemoryRegion::new(&pd, 64, lw).unwrap();
    srq_b.post_recv(&[RecvWr::new(&mr_b, 0..64).wr_id(200)]).unwrap();
    peer.start(Step::Connect);
    let req = listener.get_request(T).unwrap();
    let conn_b = match req.create_qp(&pd, QpInit::new().srq(&srq_b).recv_cq(Arc::clone(&cq))) {
        Ok(q) => q.accept(&ConnParam::new(), T).unwrap(),
        Err(Error::InvalidArgument(why)) => {
            // Refused: B's receives cannot complete on this CQ, so none can be taken for A's.
            // A's receive still completes as A's, and B's stays posted, its region held.
            eprintln!("B's QP refused on A's CQ: {why}");
            peer.wait();
            peer.step(Step::Send(0, b"for A".to_vec()));
            let got = next_completions(&cq);
            assert_eq!(got.iter().map(|w| (w.wr_id(), w.qp_num())).collect::<Vec<_>>(), [(100, conn_a.qp().qp_num())]);
            assert_eq!(&mr_a.as_slice().unwrap()[..5], b"for A");
            assert_eq!((srq_b.outstanding(), mr_b.outstanding()), (1, 1), "B's receive is still posted, and held");
            assert!(matches!(mr_b.as_slice(), Err(Error::InFlight { .. })));
            println!("each SRQ's completion retired its own receive (B's QP refused)");
            drop(conn_a);
            peer.finish();
            drop((srq_a, srq_b, mr_a, mr_b, cq, pd, ctx, listener));
            t.finish();
            return;
        }
        Err(e) => panic!("unexpected {e}"),
    };
    peer.wait();
    let (qp_a, qp_b) = (conn_a.qp().qp_num(), conn_b.qp().qp_num());
    // A message for B's QP: B's receive takes it.
    peer.step(Step::Send(1, b"for B".to_vec()));
    let got = next_completions(&cq);
    let held_a = mr_a.outstanding();
    match mr_a.as_mut_slice() {
        Ok(buf) => {
            buf.fill(0);
            peer.step(Step::Send(0, b"for A".to_vec()));
            thread::sleep(Duration::from_millis(200));
            // Reads through the slice the crate handed out, as the program holding it would.
            // SAFETY: within the slice's bounds (5 of 64 bytes); volatile, as the device may write.
            let seen: Vec<u8> = (0..5).map(|i| unsafe { std::ptr::read_volatile(buf.as_ptr().add(i)) }).collect();
            panic!(
                "B's receive completed as {:?} (wr_id, qp_num; A's QP is {qp_a}, B's {qp_b}); A's receive, still \
                 posted, then had {held_a} hold(s) on its region, as_mut_slice handed it out, and the device wrote \
                 {:?} into it while it was borrowed",
                got.iter().map(|w| (w.wr_id(), w.qp_num())).collect::<Vec<_>>(),
                String::from_utf8_lossy(&seen),
            );
        }
        Err(Error::InFlight { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    assert_eq!(got.len(), 1, "one message, one completion: {got:?}");
    assert_eq!((got[0].wr_id(), got[0].qp_num()), (200, qp_b), "B's receive retires, on B's QP");
    assert_eq!(&mr_b.as_slice().unwrap()[..5], b"for B");
    assert_eq!(srq_b.outstanding(), 0, "B's receive is retired");
    assert_eq!(srq_a.outstanding(), 1, "A's receive is still posted");
    peer.step(Step::Send(0, b"for A".to_vec()));
    let got = next_completions(&cq);
    assert_eq!(got.iter().map(|w| (w.wr_id(), w.qp_num())).collect::<Vec<_>>(), [(100, qp_a)]);
    assert_eq!(&mr_a.as_slice().unwrap()[..5], b"for A");
    println!("each SRQ's completion retired its own receive");
    drop((conn_a, conn_b));
    peer.finish();
    drop((srq_a, srq_b, mr_a, mr_b, cq, pd, ctx, listener));
    t.finish();
}

/// [`child_srq_id_alias`], in a process of its own (no other SRQ may be made between A and B).
#[test]
fn two_live_srqs_with_one_id_on_one_cq_never_retire_each_others_receives() {
    let t = DeviceTest::start();
    let (status, out) = crate::support::run_child("srq::child_srq_id_alias", Duration::from_secs(400));
    assert!(
        status.is_some_and(|s| s.success()) && out.contains("retired its own receive"),
        "status {status:?}:\n{out}"
    );
    t.finish();
}

/// One SRQ serves QPs on two receive CQs: QP 1 and QP 3 complete on CQ 1, QP 2 on CQ 2. QP 1's
/// wait meets QP 3's receive on CQ 1 and keeps it (in the SRQ, under QP 3's number). Polling
/// CQ 2 must not hand it out: it never completed there, and whoever polls CQ 2 (a thread that
/// serves only CQ 2's QPs) would take from QP 3 a message its own wait then never sees. It must
/// reach QP 3's wait, once.
#[test]
fn an_srq_receive_kept_on_one_cq_is_not_handed_out_by_another_cq_of_the_srq() {
    use crate::support::{Peer, Step};
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let peer = Peer::connector(listener.local_addr().unwrap());
    peer.start(Step::Connect);
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let (cq1, cq2) = (CompletionQueue::new(&ctx, 64).unwrap(), CompletionQueue::new(&ctx, 64).unwrap());
    let srq = SharedReceiveQueue::new(&pd, 4).unwrap();
    let mrs: Vec<MemoryRegion> = (0..4).map(|_| MemoryRegion::new(&pd, 64, LW).unwrap()).collect();
    let wrs: Vec<RecvWr> = mrs.iter().enumerate().map(|(i, mr)| RecvWr::new(mr, 0..64).wr_id(i as u64)).collect();
    srq.post_recv(&wrs).unwrap();
    drop(wrs);
    let on = |cq: &Arc<CompletionQueue>| QpInit::new().srq(&srq).recv_cq(Arc::clone(cq));
    let mut c1 = req.create_qp(&pd, on(&cq1)).unwrap().accept(&ConnParam::new(), T).unwrap();
    peer.wait();
    let mut conns = vec![];
    for cq in [&cq2, &cq1] {
        peer.start(Step::Connect);
        let req = listener.get_request(T).unwrap();
        conns.push(req.create_qp(&pd, on(cq)).unwrap().accept(&ConnParam::new(), T).unwrap());
        peer.wait();
    }
    let (c2, mut c3) = (conns.remove(0), conns.remove(0));
    let qp3 = c3.qp().qp_num();
    peer.step(Step::Send(2, b"for QP 3".to_vec()));
    let mut wcs = [WorkCompletion::default(); 4];
    // QP 1's wait finds nothing of its own; it keeps QP 3's receive.
    assert_eq!(c1.qp_mut().wait(&mut wcs, Duration::from_millis(300)).unwrap(), 0);
    let on_cq2 = cq2.poll(&mut wcs).unwrap();
    assert_eq!(
        on_cq2,
        0,
        "CQ 2 handed out {:?} (wr_id, qp_num; QP 3 is {qp3}, which completes on CQ 1)",
        wcs[..on_cq2].iter().map(|w| (w.wr_id(), w.qp_num())).collect::<Vec<_>>()
    );
    let n = c3.qp_mut().wait(&mut wcs, T).unwrap();
    assert_eq!(n, 1, "QP 3's receive reaches QP 3's wait");
    assert_eq!((wcs[0].qp_num(), wcs[0].queue()), (qp3, WorkQueue::Recv));
    assert_eq!(c3.qp_mut().wait(&mut wcs, Duration::from_millis(100)).unwrap(), 0, "once");
    drop((c1, c2, c3));
    peer.finish();
    drop((srq, mrs, cq1, cq2, pd, ctx, listener));
    t.finish();
}
