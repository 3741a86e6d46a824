//! The lane's newer paths: connections whose QP joins the lane before the connect or accept
//! (`RouteResolved::lane_qp`, `ConnectRequest::lane_qp`, `into_lane`, `LaneClient::connect`,
//! `LaneServer::accept/reject`), the peer leaving and one member's disconnect, the waits
//! (`wait`, `spin`, `wait_async`), inline sends, re-aimed prepared requests and the CQ's growth
//! at attach. Each attempt asserts the safe outcome: a region comes back only with the
//! completion that retires it (once), a refusal names its cause and gives back what it took,
//! and every wait and teardown ends within its bound.

use std::net::SocketAddr;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use crate::common::lane::{lane_on, reap, LaneSide};
use crate::common::{pattern, require, Cap, DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{InlineWr, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::verbs::qp::UnconnectedQp;
use rdma_cm::{
    AccessFlags, Client, CmEventType, ConnParam, ConnectRequest, Error, EventChannel, Listener, MemoryRegion,
    ProtectionDomain, QpInit, Server, WcStatus, WorkQueue,
};

const LEN: usize = 64;

fn init() -> QpInit {
    QpInit::new().max_send_wr(4).max_recv_wr(4)
}

fn recv_buf(pd: &Arc<ProtectionDomain>) -> MemoryRegion {
    MemoryRegion::new(pd, 4096, AccessFlags::LOCAL_WRITE).unwrap()
}

fn message(pd: &Arc<ProtectionDomain>, seed: u8) -> MemoryRegion {
    let mut m = MemoryRegion::new(pd, LEN, AccessFlags::empty()).unwrap();
    m.as_mut_slice().unwrap().copy_from_slice(&pattern(LEN, seed));
    m
}

fn listener(t: &DeviceTest) -> (Listener, SocketAddr) {
    let l = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

/// A client connection on `lane` to `dst`, through the lane, not connected yet.
fn lane_client(lane: &mut Lane, dst: SocketAddr, init: QpInit) -> (rdma_cm::LaneClient, Arc<ProtectionDomain>) {
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    (route.lane_qp(lane, &pd, init).expect("RouteResolved::lane_qp"), pd)
}

/// A connection made through the lane on both sides (client, server), each on a lane of its
/// own `depth` deep, with `init`'s queues.
fn connected(t: &DeviceTest, init: QpInit, depth: u32) -> (LaneSide, LaneSide) {
    let (l, dst) = listener(t);
    let addr = t.addr;
    let sinit = init.clone();
    let server = thread::spawn(move || {
        let mut lane = lane_on(addr, depth);
        let req = l.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let s = req.lane_qp(&mut lane, &pd, sinit).unwrap();
        let qp = s.qp();
        s.accept(&mut lane, &ConnParam::new(), T).unwrap();
        LaneSide { lane, qp, pd, mrs: vec![] }
    });
    let mut lane = lane_on(t.addr, depth);
    let (c, pd) = lane_client(&mut lane, dst, init);
    let qp = c.qp();
    c.connect(&mut lane, &ConnParam::new(), T).expect("connect through the lane");
    let server = server.join().unwrap();
    (LaneSide { lane, qp, pd, mrs: vec![] }, server)
}

/// Calls `lane.peer_left(qp)` until it says so, for up to `T`.
fn until_peer_left(lane: &mut Lane, qp: LaneQp) {
    let deadline = Instant::now() + T;
    while !lane.peer_left(qp).expect("Lane::peer_left") {
        assert!(Instant::now() < deadline, "the peer's departure was not seen within {T:?}");
        thread::yield_now();
    }
}

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. })
}

/// A rejected request: the server's lane drops the request's QP with the receives posted on it
/// (flushed and released with it, never handed out), within the teardown's bound; the client's
/// connect fails naming the rejection and carrying its private data; the client's receive
/// posted before the connect comes back flushed, with its region, once; both QPs refuse posts
/// from then on, naming the failed connect.
#[test]
fn receive_posted_before_connect_comes_back_flushed_once_after_a_rejected_connect() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let addr = t.addr;
        let server = thread::spawn(move || {
            let mut lane = lane_on(addr, 16);
            let req = l.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let s = req.lane_qp(&mut lane, &pd, init()).unwrap();
            let qp = s.qp();
            lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(1)).unwrap();
            lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(2)).unwrap();
            let start = Instant::now();
            s.reject(&mut lane, b"go away").expect("reject");
            let took = start.elapsed();
            assert!(took < Duration::from_secs(4), "the reject's teardown took {took:?}");
            assert!(lane.outstanding(qp).is_err(), "the rejected request's QP left the lane");
            assert!(lane.poll().unwrap().is_none(), "nothing of the removed QP is handed out");
            let e = lane.wait(Duration::from_millis(50)).unwrap_err();
            assert!(is_timeout(&e), "{e}");
        });
        let mut lane = lane_on(t.addr, 16);
        let (c, pd) = lane_client(&mut lane, dst, init());
        let qp = c.qp();
        lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(7)).unwrap();
        let e = c.connect(&mut lane, &ConnParam::new(), T).unwrap_err();
        assert!(
            matches!(&e, Error::UnexpectedEvent { got: CmEventType::Rejected, private_data, .. }
                if private_data.starts_with(b"go away")),
            "{e:?}"
        );
        server.join().unwrap();
        let mut flushed = lane.wait(T).expect("the receive posted before the connect comes back");
        assert_eq!((flushed.wr_id(), flushed.status(), flushed.queue()), (7, WcStatus::WrFlushErr, WorkQueue::Recv));
        let mut region = flushed.take_region().expect("with its region");
        assert!(region.as_mut_slice().is_ok(), "the region is the caller's again");
        assert!(flushed.take_region().is_none(), "handed out once");
        assert!(lane.poll().unwrap().is_none(), "and only once");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 0));
        let e = lane.post_recv(qp, RecvWr::new(region)).unwrap_err().into_parts().0;
        assert!(matches!(&e, Error::QpInError { cause, .. } if cause.contains("connect")), "{e}");
        let e = lane.post_inline(qp, InlineWr::send(b"late")).unwrap_err();
        assert!(matches!(&e, Error::QpInError { cause, .. } if cause.contains("connect")), "{e}");
        assert!(!lane.peer_left(qp).unwrap(), "no connection, no peer to leave");
        let start = Instant::now();
        lane.disconnect(qp, T).expect("a member whose connect failed is removed");
        assert!(start.elapsed() < Duration::from_secs(4));
        drop((lane, pd));
    }
    t.finish();
}

/// A connect that times out while the server sits on the request: the client's QP is moved to
/// the error state and its receive comes back flushed; the server's accept that comes later
/// fails within its bound (the client never completes the handshake), its own receive comes
/// back flushed, and neither side hands out anything twice or hangs in its teardown.
#[test]
fn a_connect_that_timed_out_is_not_revived_by_a_late_accept() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let addr = t.addr;
        let (got_tx, got_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let server = thread::spawn(move || {
            let mut lane = lane_on(addr, 16);
            let req = l.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let s = req.lane_qp(&mut lane, &pd, init()).unwrap();
            let qp = s.qp();
            lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(1)).unwrap();
            got_tx.send(()).unwrap();
            go_rx.recv_timeout(T).unwrap();
            let start = Instant::now();
            let r = s.accept(&mut lane, &ConnParam::new(), Duration::from_secs(2));
            assert!(start.elapsed() < Duration::from_secs(6), "the accept's bound: {:?}", start.elapsed());
            assert!(r.is_err(), "the client gave up: the accept cannot complete");
            let mut c = lane.wait(T).expect("the server's receive comes back");
            assert_eq!((c.wr_id(), c.status()), (1, WcStatus::WrFlushErr));
            assert!(c.take_region().is_some());
            assert!(lane.poll().unwrap().is_none());
            let e = lane.post_inline(qp, InlineWr::send(b"x")).unwrap_err();
            assert!(matches!(e, Error::QpInError { .. }), "{e}");
            lane.disconnect(qp, T).unwrap();
        });
        let mut lane = lane_on(t.addr, 16);
        let (c, pd) = lane_client(&mut lane, dst, init());
        let qp = c.qp();
        lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(9)).unwrap();
        // Connect only once the server holds the request, so the connect's wait is what runs out.
        let h = thread::spawn(move || got_rx.recv_timeout(T));
        let start = Instant::now();
        let e = c.connect(&mut lane, &ConnParam::new(), Duration::from_millis(500)).unwrap_err();
        assert!(is_timeout(&e), "{e:?}");
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
        h.join().unwrap().unwrap();
        let mut c = lane.wait(T).expect("the client's receive comes back");
        assert_eq!((c.wr_id(), c.status()), (9, WcStatus::WrFlushErr));
        assert!(c.take_region().is_some());
        go_tx.send(()).unwrap();
        server.join().unwrap();
        assert!(lane.poll().unwrap().is_none(), "nothing more, nothing twice");
        let e = lane.post_send(qp, SendWr::send(message(&pd, 1), 0..LEN)).unwrap_err().into_parts().0;
        assert!(matches!(e, Error::QpInError { .. }), "{e}");
        let start = Instant::now();
        lane.disconnect(qp, T).unwrap();
        assert!(start.elapsed() < Duration::from_secs(4));
        drop((lane, pd));
    }
    t.finish();
}

/// Before the connection exists, every send-queue path of the lane is refused saying so and
/// keeps (or gives back) its region: inline, prepared, a prepared list, a batch, an iterator.
/// Receives are taken by every receive path up to the queue's depth, and no further. The
/// connection's peer-left check and event hand-off say nothing yet. After the connect, the
/// same prepared send posts, and the receives posted before meet the peer's sends.
#[test]
fn every_send_path_is_refused_before_the_connect_and_keeps_its_region() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let addr = t.addr;
        let (tx, rx) = mpsc::channel::<()>();
        let server = thread::spawn(move || {
            let mut lane = lane_on(addr, 16);
            let req = l.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let s = req.lane_qp(&mut lane, &pd, init()).unwrap();
            let qp = s.qp();
            lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(1)).unwrap();
            s.accept(&mut lane, &ConnParam::new(), T).unwrap();
            rx.recv_timeout(T).unwrap();
            for k in 0..4u64 {
                lane.post_inline(qp, InlineWr::send(&k.to_ne_bytes()).wr_id(10 + k)).unwrap();
            }
            let mut got = reap(&mut lane, 5);
            got.sort_by_key(|c| c.wr_id());
            let mut first = got.remove(0);
            assert_eq!((first.wr_id(), first.byte_len()), (1, LEN as u32), "the client's prepared send");
            let mut buf = first.take_region().unwrap();
            assert_eq!(&buf.as_slice().unwrap()[..LEN], &pattern(LEN, 5)[..]);
            assert!(got.iter().all(|c| c.is_ok()));
            until_peer_left(&mut lane, qp);
            lane.disconnect(qp, T).unwrap();
        });
        let mut lane = lane_on(t.addr, 16);
        let (c, pd) = lane_client(&mut lane, dst, init());
        let qp = c.qp();
        let not_yet = |e: &Error| e.to_string().contains("not established");
        // Inline.
        let e = lane.post_inline(qp, InlineWr::send(b"early")).unwrap_err();
        assert!(not_yet(&e), "{e}");
        // Prepared: prepared before the connect, refused to post, still armed.
        let mut p = lane.prepare_send(qp, SendWr::send(message(&pd, 5), 0..LEN).wr_id(1)).unwrap();
        let e = lane.post_prepared(&mut p).unwrap_err();
        assert!(not_yet(&e) && p.is_armed(), "{e}");
        let mut list = [lane.prepare_send(qp, SendWr::send(message(&pd, 6), 0..LEN)).unwrap()];
        let e = lane.post_prepared_list(&mut list).unwrap_err();
        assert!(not_yet(&e) && list[0].is_armed(), "{e}");
        // A batch.
        let mut b = lane
            .prepare_batch(qp, message(&pd, 7), 2, |k, mr| SendWr::send(mr, k * 8..k * 8 + 8))
            .map_err(|r| r.into_parts().0)
            .unwrap();
        let e = lane.post_batch(&mut b).unwrap_err();
        assert!(not_yet(&e) && b.is_armed(), "{e}");
        // An iterator: nothing taken from it.
        let e = lane.post_send_iter(qp, [SendWr::send(message(&pd, 8), 0..LEN)]).unwrap_err();
        assert!(not_yet(e.error()), "{}", e.error());
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 0), "no send was taken");
        // Receives, by each path, up to the depth of 4.
        let mut pr = lane.prepare_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(20)).unwrap();
        lane.post_prepared_recv(&mut pr).unwrap();
        let mut rl = [Some(RecvWr::new(recv_buf(&pd)).wr_id(21)), Some(RecvWr::new(recv_buf(&pd)).wr_id(22))];
        assert_eq!(lane.post_recv_list(qp, &mut rl).unwrap(), 2);
        lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(23)).unwrap();
        let e = lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(24)).unwrap_err();
        let (e, back) = e.into_parts();
        assert!(matches!(e, Error::QueueFull { .. }) && back.is_some(), "{e}");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 4));
        assert!(!lane.peer_left(qp).unwrap());
        // Nothing to wait for yet: a wait runs out, saying no QP is in the error state.
        let e = lane.wait(Duration::from_millis(20)).unwrap_err();
        assert!(is_timeout(&e), "{e}");
        c.connect(&mut lane, &ConnParam::new(), T).unwrap();
        lane.post_prepared(&mut p).expect("the same prepared send, now connected");
        tx.send(()).unwrap();
        let mut ids: Vec<u64> = reap(&mut lane, 5).iter().map(|c| c.wr_id()).collect();
        ids.sort();
        assert_eq!(ids, [1, 20, 21, 22, 23]);
        lane.disconnect(qp, T).unwrap();
        server.join().unwrap();
        drop((lane, p, list, b, pr, pd));
    }
    t.finish();
}

/// A `LaneClient` whose QP was removed cannot reach the QP attached after it at the same place
/// (the handle names the attach, not the place): its connect is refused, and the later QP is
/// untouched (still connecting: sends refused, its receive in place), then connects itself.
#[test]
fn a_lane_client_of_a_removed_qp_cannot_connect_the_qp_attached_after_it() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let addr = t.addr;
        let server = thread::spawn(move || {
            let mut lane = lane_on(addr, 16);
            let req = l.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let s = req.lane_qp(&mut lane, &pd, init()).unwrap();
            let qp = s.qp();
            s.accept(&mut lane, &ConnParam::new(), T).unwrap();
            lane.post_inline(qp, InlineWr::send(b"hello").wr_id(3)).unwrap();
            assert!(reap(&mut lane, 1)[0].is_ok());
            until_peer_left(&mut lane, qp);
            lane.disconnect(qp, T).unwrap();
        });
        let mut lane = lane_on(t.addr, 16);
        let (first, pd1) = lane_client(&mut lane, dst, init());
        let stale = first.qp();
        lane.remove(stale).unwrap();
        let (second, pd2) = lane_client(&mut lane, dst, init());
        let qp = second.qp();
        assert_ne!(stale, qp);
        lane.post_recv(qp, RecvWr::new(recv_buf(&pd2)).wr_id(5)).unwrap();
        let e = first.connect(&mut lane, &ConnParam::new(), T).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("not attached")), "{e}");
        let e = lane.post_inline(qp, InlineWr::send(b"x")).unwrap_err();
        assert!(e.to_string().contains("not established"), "the later QP still connecting: {e}");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 1));
        second.connect(&mut lane, &ConnParam::new(), T).expect("the later QP connects");
        let mut c = reap(&mut lane, 1).pop().unwrap();
        assert_eq!((c.wr_id(), c.byte_len(), c.status()), (5, 5, WcStatus::Success));
        let mut r = c.take_region().unwrap();
        assert_eq!(&r.as_slice().unwrap()[..5], b"hello");
        lane.disconnect(qp, T).unwrap();
        server.join().unwrap();
        drop((lane, pd1, pd2, r));
    }
    t.finish();
}

/// A `LaneServer` handed to another lane's accept is refused there; the request stays on its
/// own lane (connecting), the client's bounded connect ends, and dropping that lane releases
/// the request's QP, id and receive within the teardown's bound.
#[test]
fn a_lane_server_accepted_on_another_lane_is_refused_and_its_lane_drops_cleanly() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let addr = t.addr;
        let server = thread::spawn(move || {
            let mut own = lane_on(addr, 16);
            let mut other = lane_on(addr, 16);
            let req = l.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let s = req.lane_qp(&mut own, &pd, init()).unwrap();
            let qp = s.qp();
            own.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(1)).unwrap();
            let e = s.accept(&mut other, &ConnParam::new(), T).unwrap_err();
            assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("not attached")), "{e}");
            assert_eq!(own.outstanding(qp).unwrap(), (0, 1), "the request stays on its own lane");
            let e = own.post_inline(qp, InlineWr::send(b"x")).unwrap_err();
            assert!(e.to_string().contains("not established"), "{e}");
            let start = Instant::now();
            drop(own);
            assert!(start.elapsed() < Duration::from_secs(4), "the lane's drop took {:?}", start.elapsed());
            drop((other, pd, l));
        });
        let mut lane = lane_on(t.addr, 16);
        let (c, pd) = lane_client(&mut lane, dst, init());
        let qp = c.qp();
        let start = Instant::now();
        let r = c.connect(&mut lane, &ConnParam::new(), Duration::from_secs(3));
        assert!(r.is_err(), "nobody accepted");
        assert!(start.elapsed() < Duration::from_secs(8), "{:?}", start.elapsed());
        server.join().unwrap();
        lane.disconnect(qp, T).unwrap();
        drop((lane, pd));
    }
    t.finish();
}

/// A disconnect bounded by zero: it returns (timed out: the peer has not answered yet) within
/// the teardown's bound, the member is gone (a second disconnect is refused), the peer sees the
/// departure with one call and disconnects without waiting, and nothing leaks.
#[test]
fn a_disconnect_with_no_time_to_wait_returns_and_releases_everything() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = connected(&t, init(), 16);
        a.lane.post_recv(a.qp, RecvWr::new(recv_buf(&a.pd)).wr_id(1)).unwrap();
        let start = Instant::now();
        let r = a.lane.disconnect(a.qp, Duration::ZERO);
        assert!(start.elapsed() < Duration::from_secs(4), "{:?}", start.elapsed());
        if let Err(e) = &r {
            assert!(is_timeout(e), "{e}");
        }
        let e = a.lane.disconnect(a.qp, T).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(a.lane.poll().unwrap().is_none(), "the removed member's receive was released, not handed out");
        until_peer_left(&mut b.lane, b.qp);
        let start = Instant::now();
        b.lane.disconnect(b.qp, T).unwrap();
        assert!(start.elapsed() < Duration::from_secs(4));
        drop((a, b));
    }
    t.finish();
}

/// The caller's own event loop reads the server's channel and hands one member's
/// `DISCONNECTED` to the lane: given to another member it changes nothing there; given to its
/// own member (twice) it flushes that member's receive once and refuses its posts, and that
/// member's disconnect does not wait. The other member goes on.
#[test]
fn handle_event_moves_only_the_member_the_event_names() {
    let t = DeviceTest::start();
    {
        let ch = EventChannel::new().unwrap();
        let l = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
        let dst = l.local_addr().unwrap();
        let (tx, rx) = mpsc::channel::<&'static str>();
        let (back_tx, back_rx) = mpsc::channel::<&'static str>();
        let addr = t.addr;
        let client = thread::spawn(move || {
            let mut lane = lane_on(addr, 16);
            let mut qps = vec![];
            for _ in 0..2 {
                let (c, pd) = lane_client(&mut lane, dst, init());
                let qp = c.qp();
                c.connect(&mut lane, &ConnParam::new(), T).unwrap();
                qps.push((qp, pd));
            }
            assert_eq!(rx.recv_timeout(T).unwrap(), "accepted");
            // A leaves.
            lane.disconnect(qps[0].0, T).expect("A's disconnect, answered by the server's handle_event");
            back_tx.send("a left").unwrap();
            // B still sends.
            assert_eq!(rx.recv_timeout(T).unwrap(), "b ready");
            lane.post_send(qps[1].0, SendWr::send(message(&qps[1].1, 3), 0..LEN).wr_id(1)).unwrap();
            assert!(reap(&mut lane, 1)[0].is_ok());
            until_peer_left(&mut lane, qps[1].0);
            lane.disconnect(qps[1].0, T).unwrap();
        });
        let ctx = l.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 16).unwrap();
        let mut qps = vec![];
        for k in 0..2u64 {
            let ev = ch.get_event_for(l.handle(), T).unwrap();
            let s = ConnectRequest::from_event(ev).unwrap().lane_qp(&mut lane, &pd, init()).unwrap();
            lane.post_recv(s.qp(), RecvWr::new(recv_buf(&pd)).wr_id(k)).unwrap();
            qps.push(s.qp());
            s.accept(&mut lane, &ConnParam::new(), T).unwrap();
        }
        let (a, b) = (qps[0], qps[1]);
        tx.send("accepted").unwrap();
        // The caller's loop: A's DISCONNECTED, read from the shared channel untargeted.
        let ev = ch.get_event(T).unwrap();
        assert_eq!(ev.event_type(), CmEventType::Disconnected, "{ev:?}");
        lane.handle_event(b, &ev).unwrap();
        lane.post_recv(b, RecvWr::new(recv_buf(&pd)).wr_id(5)).expect("B is untouched by A's event");
        lane.handle_event(a, &ev).unwrap();
        lane.handle_event(a, &ev).unwrap();
        assert!(lane.peer_left(a).unwrap());
        let mut f = lane.wait(T).unwrap();
        assert_eq!((f.wr_id(), f.status(), f.qp()), (0, WcStatus::WrFlushErr, Some(a)));
        assert!(f.take_region().is_some());
        let e = lane.post_recv(a, RecvWr::new(recv_buf(&pd))).unwrap_err().into_parts().0;
        assert!(matches!(&e, Error::QpInError { cause, .. } if cause.contains("peer disconnected")), "{e}");
        let start = Instant::now();
        lane.disconnect(a, T).unwrap();
        assert!(start.elapsed() < Duration::from_secs(4), "the peer left: nothing to wait for");
        assert_eq!(back_rx.recv_timeout(T).unwrap(), "a left");
        tx.send("b ready").unwrap();
        let mut got = reap(&mut lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.status(), got.qp()), (1, WcStatus::Success, Some(b)));
        let mut buf = got.take_region().unwrap();
        assert_eq!(&buf.as_slice().unwrap()[..LEN], &pattern(LEN, 3)[..]);
        lane.disconnect(b, T).unwrap();
        client.join().unwrap();
        assert!(lane.poll().unwrap().is_none());
        drop((lane, buf, pd, l, ch));
    }
    t.finish();
}

/// A wait that runs out, then the completion arrives: the next wait hands it out, once, with
/// its region; the region was not reachable meanwhile (still counted outstanding). For `wait`,
/// `spin` and (with tokio) `wait_async`.
#[test]
fn a_wait_that_ran_out_hands_the_late_completion_once() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = connected(&t, init(), 16);
        #[cfg(feature = "tokio")]
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for (k, how) in ["wait", "spin", "wait_async"].into_iter().enumerate() {
            if how == "wait_async" && !cfg!(feature = "tokio") {
                continue;
            }
            let k = k as u64;
            let one = |lane: &mut Lane, timeout: Duration| match how {
                "wait" => lane.wait(timeout),
                "spin" => lane.spin(timeout),
                #[cfg(feature = "tokio")]
                _ => rt.block_on(lane.wait_async(timeout)),
                #[cfg(not(feature = "tokio"))]
                _ => unreachable!(),
            };
            b.lane.post_recv(b.qp, RecvWr::new(recv_buf(&b.pd)).wr_id(100 + k)).unwrap();
            let start = Instant::now();
            let e = one(&mut b.lane, Duration::from_millis(50)).unwrap_err();
            assert!(is_timeout(&e) && e.to_string().contains("nothing completed"), "{how}: {e}");
            assert!(start.elapsed() < Duration::from_secs(3), "{how}: {:?}", start.elapsed());
            assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 1), "{how}: still held by the lane");
            a.lane.post_send(a.qp, SendWr::send(message(&a.pd, k as u8), 0..LEN).wr_id(k)).unwrap();
            let start = Instant::now();
            let mut c = one(&mut b.lane, T).expect("the late completion");
            assert!(start.elapsed() < T / 2, "{how}: {:?}", start.elapsed());
            assert_eq!((c.wr_id(), c.byte_len()), (100 + k, LEN as u32), "{how}");
            let mut r = c.take_region().unwrap();
            assert_eq!(&r.as_slice().unwrap()[..LEN], &pattern(LEN, k as u8)[..], "{how}");
            assert!(b.lane.poll().unwrap().is_none(), "{how}: handed out once");
            let e = one(&mut b.lane, Duration::from_millis(20)).unwrap_err();
            assert!(is_timeout(&e) && e.to_string().contains("no work request is outstanding"), "{how}: {e}");
            assert!(reap(&mut a.lane, 1)[0].is_ok());
        }
        drop((a, b));
    }
    t.finish();
}

/// One lane, two connections: the peer's send to B completed (its completion sits in the CQ),
/// then A is removed with a receive posted, which reaps the CQ and keeps B's completion. Every
/// wait then hands B's completion out at once, without sleeping on the channel (no event is
/// coming for it: it was already taken from the CQ).
#[test]
fn a_wait_after_another_members_removal_hands_its_kept_completion_at_once() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 64);
        #[cfg(feature = "tokio")]
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for (round, how) in ["wait", "spin", "wait_async"].into_iter().enumerate() {
            if how == "wait_async" && !cfg!(feature = "tokio") {
                continue;
            }
            let (qa, pda, _sa) = crate::common::lane::attached_pair(&mut lane, t.addr, PairSpec::default());
            let (qb, pdb, mut sb) = crate::common::lane::attached_pair(&mut lane, t.addr, PairSpec::default());
            lane.post_recv(qa, RecvWr::new(recv_buf(&pda)).wr_id(1)).unwrap();
            lane.post_recv(qb, RecvWr::new(recv_buf(&pdb)).wr_id(2)).unwrap();
            sb.mrs[0].write_at(0, &pattern(LEN, round as u8)).unwrap();
            crate::common::raw::send(&sb.conn, &sb.mrs[0], 0..LEN, 9);
            lane.remove(qa).unwrap();
            let start = Instant::now();
            let mut c = match how {
                "wait" => lane.wait(T),
                "spin" => lane.spin(T),
                #[cfg(feature = "tokio")]
                _ => rt.block_on(lane.wait_async(T)),
                #[cfg(not(feature = "tokio"))]
                _ => unreachable!(),
            }
            .expect("B's kept completion");
            assert!(start.elapsed() < Duration::from_secs(3), "{how} slept: {:?}", start.elapsed());
            assert_eq!((c.wr_id(), c.qp(), c.status()), (2, Some(qb), WcStatus::Success), "{how}");
            let mut r = c.take_region().unwrap();
            assert_eq!(&r.as_slice().unwrap()[..LEN], &pattern(LEN, round as u8)[..]);
            assert!(lane.poll().unwrap().is_none(), "{how}: once");
            lane.remove(qb).unwrap();
            drop(sb);
        }
        drop(lane);
    }
    t.finish();
}

/// Inline sends at the edges: exactly the granted limit arrives whole, so does an empty one;
/// one byte more is refused. An inline WRITE whose offset overflows is refused; an empty one at
/// the remote region's very end is taken.
#[test]
fn inline_sends_of_exactly_the_limit_and_of_nothing_arrive_whole() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = connected(&t, init().max_inline_data(200), 16);
        let max = a.lane.max_inline_data(a.qp).unwrap() as usize;
        assert!(max >= 200, "asked for 200 bytes inline, granted {max}");
        assert!(max < 4096, "the receive buffer holds the whole limit: {max}");
        b.lane.post_recv(b.qp, RecvWr::new(recv_buf(&b.pd)).wr_id(1)).unwrap();
        b.lane.post_recv(b.qp, RecvWr::new(recv_buf(&b.pd)).wr_id(2)).unwrap();
        let bytes = pattern(max, 77);
        a.lane.post_inline(a.qp, InlineWr::send(&bytes).wr_id(1)).unwrap();
        a.lane.post_inline(a.qp, InlineWr::send(&[]).wr_id(2)).unwrap();
        let big = vec![0u8; max + 1];
        let e = a.lane.post_inline(a.qp, InlineWr::send(&big)).unwrap_err();
        assert!(e.to_string().contains("inline limit"), "{e}");
        assert!(reap(&mut a.lane, 2).iter().all(|c| c.is_ok()));
        let mut got = reap(&mut b.lane, 2);
        assert_eq!((got[0].wr_id(), got[0].byte_len() as usize), (1, max));
        assert_eq!((got[1].wr_id(), got[1].byte_len()), (2, 0));
        let mut r = got[0].take_region().unwrap();
        assert_eq!(&r.as_slice().unwrap()[..max], &bytes[..]);
        let table = MemoryRegion::new(&b.pd, 256, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        let remote = table.remote();
        for offset in [u64::MAX, u64::MAX - 2, 257] {
            let e = a.lane.post_inline(a.qp, InlineWr::write(b"abc", &remote, offset)).unwrap_err();
            assert!(matches!(e, Error::OutOfBounds { what: "remote region", .. }), "{offset}: {e:?}");
        }
        a.lane.post_inline(a.qp, InlineWr::write(&[], &remote, 256).wr_id(3)).unwrap();
        assert!(reap(&mut a.lane, 1)[0].is_ok());
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b, r, table));
    }
    t.finish();
}

/// An unsignaled send with a region, then a signaled inline send: the region is not handed out
/// before the inline one completes (a wait meanwhile runs out, the slot still held), then
/// comes back first, unsignaled, whole; and the other way round (an unsignaled inline send,
/// then a signaled one with a region), each once, in order.
#[test]
fn an_unsignaled_region_comes_back_only_with_the_signaled_inline_after_it() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = connected(&t, init(), 16);
        for k in 0..4u64 {
            b.lane.post_recv(b.qp, RecvWr::new(recv_buf(&b.pd)).wr_id(k)).unwrap();
        }
        a.lane.post_send(a.qp, SendWr::send(message(&a.pd, 1), 0..LEN).wr_id(1).unsignaled()).unwrap();
        // The receive completes, but the unsignaled send leaves no completion of its own.
        assert!(reap(&mut b.lane, 1)[0].is_ok());
        let e = a.lane.wait(Duration::from_millis(50)).unwrap_err();
        assert!(is_timeout(&e), "{e}");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (1, 0), "its slot still holds the region");
        a.lane.post_inline(a.qp, InlineWr::send(b"sig").wr_id(2)).unwrap();
        let mut done = reap(&mut a.lane, 2);
        assert_eq!((done[0].wr_id(), done[0].is_signaled(), done[0].is_ok()), (1, false, true));
        let mut r = done[0].take_region().expect("the unsignaled send's region");
        assert_eq!(r.as_slice().unwrap(), &pattern(LEN, 1)[..]);
        assert_eq!((done[1].wr_id(), done[1].is_signaled()), (2, true));
        assert!(done[1].take_region().is_none());
        a.lane.post_inline(a.qp, InlineWr::send(b"quiet").wr_id(3).unsignaled()).unwrap();
        a.lane.post_send(a.qp, SendWr::send(r, 0..LEN).wr_id(4)).unwrap();
        let mut done = reap(&mut a.lane, 2);
        assert_eq!((done[0].wr_id(), done[0].is_signaled()), (3, false));
        assert!(done[0].take_region().is_none());
        assert_eq!((done[1].wr_id(), done[1].is_signaled()), (4, true));
        assert!(done[1].take_region().is_some());
        assert!(a.lane.poll().unwrap().is_none());
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert_eq!(reap(&mut b.lane, 2).len(), 2);
        drop((a, b));
    }
    t.finish();
}

/// Re-aiming at the edges of the arithmetic: offsets whose end overflows `u64` are refused for
/// a READ and an atomic (and change nothing); an empty READ may aim at the table's very end but
/// not past it; an atomic's alignment is the remote address's, not the offset's (a table that
/// starts 4 bytes off alignment takes offset 4, refuses 0); an atomic's local piece is 8
/// bytes; a READ has no atomic operands. Each accepted aim posts and lands where it says.
#[test]
fn aim_refuses_overflowing_and_misaligned_targets_and_changes_nothing() {
    let t = DeviceTest::start();
    {
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | if crate::common::caps::has(Cap::Atomics) { AccessFlags::REMOTE_ATOMIC } else { AccessFlags::empty() };
        let (mut a, b) = connected(&t, init(), 16);
        let mut table = MemoryRegion::new(&b.pd, 4096, access).unwrap();
        table.write_at(0, &pattern(4096, 3)).unwrap();
        let remote = table.remote();
        let local = MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let mut read = a.lane.prepare_send(a.qp, SendWr::read(local, 0..LEN, &remote, 0).wr_id(1)).unwrap();
        read.aim(128).unwrap();
        for offset in [u64::MAX, u64::MAX - (LEN as u64 - 1), u64::MAX - LEN as u64 + 2, 4096 - LEN as u64 + 1] {
            let e = read.aim(offset).unwrap_err();
            assert!(matches!(e, Error::OutOfBounds { what: "remote region", .. }), "{offset}: {e:?}");
            assert_eq!(read.remote_offset(), 128, "a refused aim changes nothing");
        }
        let e = read.set_atomic_operands(1, 2).unwrap_err();
        assert!(e.to_string().contains("not an atomic"), "{e}");
        // An empty READ at the very end, not past it.
        read.aim_local(0..0).unwrap();
        read.aim(4096).unwrap();
        assert!(read.aim(4097).is_err());
        assert_eq!(read.remote_offset(), 4096);
        a.lane.post_prepared(&mut read).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert_eq!((c.is_ok(), c.byte_len()), (true, 0), "{c:?}");
        read.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        // Back to 64 bytes: the aim at the end must be undone first.
        let e = read.aim_local(0..LEN).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { what: "remote region", .. }), "{e:?}");
        read.aim(4096 - LEN as u64).unwrap();
        read.aim_local(8..8 + LEN).unwrap();
        a.lane.post_prepared(&mut read).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok(), "{c:?}");
        read.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        let mut got = [0u8; LEN];
        read.read_at(8, &mut got).unwrap();
        assert_eq!(&got[..], &pattern(4096, 3)[4096 - LEN..]);
        if crate::common::caps::has(Cap::Atomics) {
            // A table 4 bytes off alignment: a piece of a region that starts 4 bytes in.
            let mut pieces = MemoryRegion::new(&b.pd, 4096, access).unwrap().split(1028).unwrap();
            let off = pieces.remove(1);
            let shifted = off.remote();
            assert_eq!(shifted.addr % 8, 4, "the second piece starts 1028 bytes in");
            let result = MemoryRegion::new(&a.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            let r = a.lane.prepare_send(a.qp, SendWr::fetch_add(result, 0, &shifted, 0, 1));
            let result = match r {
                Ok(_) => panic!("an atomic at an unaligned remote address was prepared"),
                Err(r) => r.into_inner().expect("the region comes back"),
            };
            let mut fa = a.lane.prepare_send(a.qp, SendWr::fetch_add(result, 0, &shifted, 4, 5).wr_id(2)).unwrap();
            for offset in [0u64, 2, 6, 1016, 1024, u64::MAX - 7, u64::MAX - 3] {
                assert!(fa.aim(offset).is_err(), "atomic aim at {offset}");
                assert_eq!(fa.remote_offset(), 4);
            }
            fa.aim(1028 - 8).unwrap(); // the last aligned 8 bytes of the piece
            for bad in [0..4, 0..16, 60..68] {
                assert!(fa.aim_local(bad.clone()).is_err(), "atomic local piece {bad:?}");
            }
            fa.aim_local(56..64).unwrap();
            fa.set_atomic_operands(7, 0).unwrap();
            a.lane.post_prepared(&mut fa).unwrap();
            let c = reap(&mut a.lane, 1).pop().unwrap();
            assert!(c.is_ok(), "{c:?}");
            drop(c);
            drop(fa);
            let mut off = off;
            let mut v = [0u8; 8];
            off.read_at(1028 - 8, &mut v).unwrap();
            assert_eq!(u64::from_ne_bytes(v), 7, "added where it was aimed");
            drop((pieces, off));
        }
        drop((a, b, read, table));
    }
    t.finish();
}

/// The CQ grows at a later attach through the lane's own connect path (`lane_qp`) while the
/// completions of the first connection's receives, posted before its connect, sit in it: each
/// comes out once, in order, whole, and a wait after the growth still wakes for a later
/// completion (not left to its timeout).
#[test]
fn receives_posted_before_connect_survive_the_cq_growing_at_a_later_lane_qp() {
    let t = DeviceTest::start();
    if !require(Cap::CqResize) {
        return t.finish();
    }
    {
        let (l, dst) = listener(&t);
        let addr = t.addr;
        let (tx, rx) = mpsc::channel::<&'static str>();
        let (go_tx, go_rx) = mpsc::channel::<&'static str>();
        let server = thread::spawn(move || {
            let mut lane = lane_on(addr, 64);
            let mut qps = vec![];
            for _ in 0..2 {
                let req = l.get_request(T).unwrap();
                let pd = req.alloc_pd().unwrap();
                let s = req.lane_qp(&mut lane, &pd, init()).unwrap();
                let qp = s.qp();
                s.accept(&mut lane, &ConnParam::new(), T).unwrap();
                qps.push((qp, pd));
                if qps.len() == 1 {
                    for k in 0..4u8 {
                        lane.post_inline(qp, InlineWr::send(&[k; 16]).wr_id(k as u64)).unwrap();
                    }
                    assert!(reap(&mut lane, 4).iter().all(|c| c.is_ok()), "acknowledged: the receives completed");
                    tx.send("sent").unwrap();
                }
            }
            assert_eq!(go_rx.recv_timeout(T).unwrap(), "go");
            lane.post_inline(qps[1].0, InlineWr::send(b"after").wr_id(9)).unwrap();
            assert!(reap(&mut lane, 1)[0].is_ok());
            for (qp, _) in &qps {
                until_peer_left(&mut lane, *qp);
                lane.disconnect(*qp, T).unwrap();
            }
        });
        // Room for one QP of 4 + 4.
        let mut lane = lane_on(t.addr, 8);
        let (first, pd1) = lane_client(&mut lane, dst, init());
        let qa = first.qp();
        for k in 0..4u64 {
            let mr = MemoryRegion::new(&pd1, 64, AccessFlags::LOCAL_WRITE).unwrap();
            lane.post_recv(qa, RecvWr::new(mr).wr_id(k)).unwrap();
        }
        first.connect(&mut lane, &ConnParam::new(), T).unwrap();
        assert_eq!(rx.recv_timeout(T).unwrap(), "sent");
        let c = lane.poll().unwrap().expect("a receive that completed");
        assert_eq!(c.wr_id(), 0);
        drop(c);
        let depth = lane.cq_depth();
        let (second, pd2) = lane_client(&mut lane, dst, init());
        let qb = second.qp();
        assert!(lane.cq_depth() >= 16 && lane.cq_depth() > depth, "grown: {} from {depth}", lane.cq_depth());
        for (k, mut c) in reap(&mut lane, 3).into_iter().enumerate() {
            let k = k as u64 + 1;
            assert_eq!((c.wr_id(), c.qp(), c.byte_len(), c.is_ok()), (k, Some(qa), 16, true), "{c:?}");
            let mut got = [0u8; 16];
            c.take_region().unwrap().read_at(0, &mut got).unwrap();
            assert_eq!(got, [k as u8; 16]);
        }
        assert!(lane.poll().unwrap().is_none(), "nothing handed out twice");
        second.connect(&mut lane, &ConnParam::new(), T).unwrap();
        lane.post_recv(qb, RecvWr::new(recv_buf(&pd2)).wr_id(20)).unwrap();
        go_tx.send("go").unwrap();
        let start = Instant::now();
        let c = lane.wait(T).expect("the wait after the growth wakes");
        assert!(start.elapsed() < T / 2, "{:?}", start.elapsed());
        assert_eq!((c.wr_id(), c.byte_len()), (20, 5));
        drop(c);
        lane.disconnect(qa, T).unwrap();
        lane.disconnect(qb, T).unwrap();
        server.join().unwrap();
        drop((lane, pd1, pd2));
    }
    t.finish();
}

/// Dropping a lane whose members never connected, each holding receives (two clients resolved
/// to a listener, and a request the server never answered): the drop ends within the
/// teardown's bound, the client that asked gets its answer within its own bound, and every
/// QP, CQ, region, PD and id is released.
#[test]
fn dropping_a_lane_of_unconnected_members_holding_receives_releases_everything() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let addr = t.addr;
        let (tx, rx) = mpsc::channel::<()>();
        let asker = thread::spawn(move || {
            let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let pd = route.alloc_pd().unwrap();
            let q = route.create_qp(&pd, QpInit::new()).unwrap();
            let start = Instant::now();
            let r = q.connect(&ConnParam::new(), Duration::from_secs(5));
            assert!(r.is_err(), "the request was never accepted");
            assert!(start.elapsed() < Duration::from_secs(9), "{:?}", start.elapsed());
            rx.recv_timeout(T).unwrap();
        });
        let mut server_lane = lane_on(addr, 16);
        let req = l.get_request(T).unwrap();
        let spd = req.alloc_pd().unwrap();
        let s = req.lane_qp(&mut server_lane, &spd, init()).unwrap();
        for k in 0..4 {
            server_lane.post_recv(s.qp(), RecvWr::new(recv_buf(&spd)).wr_id(k)).unwrap();
        }
        let mut lane = lane_on(t.addr, 16);
        let mut pds = vec![];
        for _ in 0..2 {
            let (c, pd) = lane_client(&mut lane, dst, init());
            for k in 0..4 {
                lane.post_recv(c.qp(), RecvWr::new(recv_buf(&pd)).wr_id(k)).unwrap();
            }
            pds.push(pd);
        }
        let start = Instant::now();
        drop(lane);
        drop(server_lane);
        assert!(start.elapsed() < Duration::from_secs(6), "the lanes' drops took {:?}", start.elapsed());
        tx.send(()).unwrap();
        asker.join().unwrap();
        drop((pds, spd, s, l));
    }
    t.finish();
}

/// `into_lane` refuses a QP librdmacm made (its RTR is librdmacm's, where the RNR timer cannot
/// be set) and one on another CQ, and gives each back whole: both then connect the ordinary
/// way. The lane's CQ, reached through a QP made for it, refuses the CQ's own poll, event
/// drain, so nothing but the lane reads its channel.
#[test]
fn into_lane_refusals_give_the_qp_back_and_the_lanes_cq_has_no_other_reader() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let server = thread::spawn(move || {
            let mut conns = vec![];
            for _ in 0..2 {
                let req = l.get_request(T).unwrap();
                let pd = req.alloc_pd().unwrap();
                let conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
                conns.push((conn, MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap()));
            }
            conns
        });
        let mut lane = lane_on(t.addr, 64);
        let route = || Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        // librdmacm's QP, on the lane's CQ.
        let r = route();
        let pd = r.alloc_pd().unwrap();
        let q = r.create_qp(&pd, lane.qp_init()).unwrap();
        let cq = Arc::clone(q.qp().send_cq());
        let e = cq.drain_events().unwrap_err();
        assert!(e.to_string().contains("Lane"), "{e}");
        let refused = q.into_lane(&mut lane).unwrap_err();
        let (e, back) = refused.into_parts();
        assert!(e.to_string().contains("adopt"), "{e}");
        let q = back.expect("the librdmacm QP comes back");
        let conn = q.connect(&ConnParam::new(), T).expect("and connects the ordinary way");
        let qa = lane.attach(conn).map_err(|r| r.into_parts().0).expect("attached once established");
        // An adopted QP on another CQ.
        let r = route();
        let pd2 = r.alloc_pd().unwrap();
        let q = r.adopt_qp(UnconnectedQp::new_reset(&pd2, QpInit::new()).unwrap()).unwrap();
        let refused = q.into_lane(&mut lane).unwrap_err();
        let (e, back) = refused.into_parts();
        assert!(e.to_string().contains("another CQ"), "{e}");
        let conn2 = back.expect("comes back").connect(&ConnParam::new(), T).expect("connects without the lane");
        let mut conns = server.join().unwrap();
        // The QP librdmacm made works on the lane once attached.
        let (peer, buf) = &mut conns[0];
        crate::common::raw::post_recv(peer, buf, 0..64, 3);
        lane.post_inline(qa, InlineWr::send(b"ok").wr_id(1)).unwrap();
        assert!(reap(&mut lane, 1)[0].is_ok());
        assert_eq!(crate::common::raw::wait(peer, false, 3), (0, 2), "the peer's receive: success, 2 bytes");
        drop((lane, conn2, conns, cq, pd, pd2));
    }
    t.finish();
}

/// A member moved to the error state before its connect: the connect fails (the QP cannot be
/// brought back to INIT) without reviving it, its receive comes back flushed once, and posts
/// keep being refused with the first cause; the server's accept ends within its bound.
#[test]
fn a_member_set_to_error_before_its_connect_stays_failed() {
    let t = DeviceTest::start();
    {
        let (l, dst) = listener(&t);
        let server = thread::spawn(move || {
            let req = l.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let start = Instant::now();
            let r = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), Duration::from_secs(2));
            assert!(start.elapsed() < Duration::from_secs(6), "{:?}", start.elapsed());
            r.is_ok()
        });
        let mut lane = lane_on(t.addr, 16);
        let (c, pd) = lane_client(&mut lane, dst, init());
        let qp = c.qp();
        lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(4)).unwrap();
        lane.set_error(qp).unwrap();
        let r = c.connect(&mut lane, &ConnParam::new(), Duration::from_secs(5));
        let accepted = server.join().unwrap();
        assert!(r.is_err(), "a QP in the error state was connected (server accepted: {accepted})");
        let mut f = lane.wait(T).expect("the receive comes back");
        assert_eq!((f.wr_id(), f.status()), (4, WcStatus::WrFlushErr));
        assert!(f.take_region().is_some());
        assert!(lane.poll().unwrap().is_none());
        let e = lane.post_recv(qp, RecvWr::new(recv_buf(&pd))).unwrap_err().into_parts().0;
        assert!(matches!(&e, Error::QpInError { cause, .. } if cause.contains("Lane::set_error")), "{e}");
        let e = lane.post_inline(qp, InlineWr::send(b"x")).unwrap_err();
        assert!(matches!(e, Error::QpInError { .. }), "{e}");
        lane.disconnect(qp, T).unwrap();
        drop((lane, pd));
    }
    t.finish();
}

/// A disconnect whose member's last send was unsignaled (it ran, and so leaves no completion,
/// not even a flush): the teardown waits for it once, for the 2 s its docs give, and the
/// disconnect as a whole keeps to that (it is given no time to wait for the peer's answer, so
/// it times out), rather than waiting for the same slot a second time when it removes the QP.
#[test]
fn a_disconnect_after_an_unsignaled_send_waits_for_its_flush_once() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = connected(&t, init(), 16);
        b.lane.post_recv(b.qp, RecvWr::new(recv_buf(&b.pd)).wr_id(1)).unwrap();
        a.lane.post_send(a.qp, SendWr::send(message(&a.pd, 1), 0..LEN).wr_id(2).unsignaled()).unwrap();
        assert!(reap(&mut b.lane, 1)[0].is_ok(), "the unsignaled send ran");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (1, 0));
        let start = Instant::now();
        let r = a.lane.disconnect(a.qp, Duration::ZERO);
        let took = start.elapsed();
        assert!(r.as_ref().is_err_and(is_timeout), "no time to wait for the peer's answer: {r:?}");
        // One wait of 2 s for the slot, with room for a loaded machine; twice is 4 s at least.
        assert!(took < Duration::from_millis(3500), "the disconnect took {took:?}");
        until_peer_left(&mut b.lane, b.qp);
        b.lane.disconnect(b.qp, T).unwrap();
        drop((a, b));
    }
    t.finish();
}

/// `wait_async` registers the CQ's channel with each runtime it runs on: after the first
/// runtime is dropped, a wait on a second one still wakes for the peer's
/// send rather than running to its timeout, and so does one on a third while the second is
/// alive.
#[cfg(feature = "tokio")]
#[test]
fn wait_async_wakes_on_a_new_runtime_after_the_first_was_dropped() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = connected(&t, init(), 16);
        let (tx, rx) = mpsc::channel::<u8>();
        let sender = thread::spawn(move || {
            let mut b = b;
            while let Ok(k) = rx.recv_timeout(T) {
                b.lane.post_send(b.qp, SendWr::send(message(&b.pd, k), 0..LEN).wr_id(k as u64)).unwrap();
                assert!(reap(&mut b.lane, 1)[0].is_ok());
            }
            b
        });
        let rt1 = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let e = rt1.block_on(a.lane.wait_async(Duration::from_millis(20))).unwrap_err();
        assert!(is_timeout(&e), "{e}");
        drop(rt1);
        let rt2 = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let rt3 = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for (k, rt) in [(1u8, &rt2), (2, &rt3)] {
            a.lane.post_recv(a.qp, RecvWr::new(recv_buf(&a.pd)).wr_id(k as u64)).unwrap();
            let start = Instant::now();
            let got = rt.block_on(async {
                tx.send(k).unwrap();
                a.lane.wait_async(T).await
            });
            let mut c = got.unwrap_or_else(|e| panic!("runtime {k}: {e}"));
            assert!(start.elapsed() < T / 2, "runtime {k} slept to its timeout: {:?}", start.elapsed());
            assert_eq!(c.wr_id(), k as u64);
            let mut r = c.take_region().unwrap();
            assert_eq!(&r.as_slice().unwrap()[..LEN], &pattern(LEN, k)[..]);
        }
        drop(tx);
        let b = sender.join().unwrap();
        drop((rt2, rt3, a, b));
    }
    t.finish();
}

/// A completion that retires several slots is half handed out (the poll asked for one) when a
/// second QP's attach grows the CQ: the rest come out after the growth, in order, once, and
/// the CQ's own completions behind it too.
#[test]
fn a_half_retired_completion_survives_the_cq_growing() {
    let t = DeviceTest::start();
    if !require(Cap::CqResize) {
        return t.finish();
    }
    {
        let mut lane = lane_on(t.addr, 8);
        let spec = PairSpec {
            init: QpInit::new().max_send_wr(4).max_recv_wr(4),
            mr_sizes: vec![4096, 4096],
            ..PairSpec::default()
        };
        let (qa, pda, mut peer) = crate::common::lane::attached_pair(&mut lane, t.addr, spec);
        for k in 0..3u64 {
            let (buf, range) = (&peer.mrs[0], (k as usize) * LEN..(k as usize + 1) * LEN);
            crate::common::raw::post_recv(&peer.conn, buf, range, k);
        }
        lane.post_send(qa, SendWr::send(message(&pda, 1), 0..LEN).wr_id(1).unsignaled()).unwrap();
        lane.post_send(qa, SendWr::send(message(&pda, 2), 0..LEN).wr_id(2).unsignaled()).unwrap();
        lane.post_send(qa, SendWr::send(message(&pda, 3), 0..LEN).wr_id(3)).unwrap();
        lane.post_recv(qa, RecvWr::new(recv_buf(&pda)).wr_id(4)).unwrap();
        assert_eq!(crate::common::raw::wait(&peer.conn, false, 2).0, 0, "the peer's third receive");
        let first = lane.wait(T).unwrap();
        assert_eq!((first.wr_id(), first.is_signaled()), (1, false), "{first:?}");
        drop(first);
        // The peer answers, so a completion sits behind the half-retired one.
        peer.mrs[1].write_at(0, &pattern(LEN, 9)).unwrap();
        crate::common::raw::send(&peer.conn, &peer.mrs[1], 0..LEN, 5);
        let depth = lane.cq_depth();
        let other =
            PairSpec { init: lane.qp_init_from(QpInit::new().max_send_wr(4).max_recv_wr(4)), ..PairSpec::default() };
        let (c, _d) = crate::common::pair(t.addr, other, PairSpec::default());
        let qc = lane.attach(c.conn).map_err(|r| r.into_parts().0).expect("attach grows the CQ");
        assert!(lane.cq_depth() > depth, "grown from {depth}");
        let rest = reap(&mut lane, 3);
        let seen: Vec<(u64, bool)> = rest.iter().map(|c| (c.wr_id(), c.is_signaled())).collect();
        assert_eq!(seen, [(2, false), (3, true), (4, true)]);
        let mut rest = rest;
        for (k, c) in rest.iter_mut().enumerate() {
            let mut r = c.take_region().unwrap();
            if k < 2 {
                assert_eq!(r.as_slice().unwrap(), &pattern(LEN, k as u8 + 2)[..]);
            } else {
                assert_eq!(&r.as_slice().unwrap()[..LEN], &pattern(LEN, 9)[..]);
            }
        }
        assert!(lane.poll().unwrap().is_none(), "nothing twice");
        assert_eq!(lane.outstanding(qa).unwrap(), (0, 0));
        lane.remove(qc).unwrap();
        drop((lane, peer, c.mrs));
    }
    t.finish();
}

/// The peer sends a burst and disconnects at once: every receive posted comes back exactly
/// once, those the burst filled first (in order, whole) and the rest flushed, and nothing
/// more; the departure is seen with one call.
#[test]
fn every_receive_comes_back_once_when_the_peer_leaves_mid_burst() {
    const POSTED: u64 = 8;
    const SENT: u8 = 4;
    let t = DeviceTest::start();
    {
        let spec = init().max_send_wr(8).max_recv_wr(8);
        let (a, mut b) = connected(&t, spec, 32);
        for k in 0..POSTED {
            b.lane.post_recv(b.qp, RecvWr::new(recv_buf(&b.pd)).wr_id(k)).unwrap();
        }
        let leaving = thread::spawn(move || {
            let mut a = a;
            for k in 0..SENT {
                a.lane.post_inline(a.qp, InlineWr::send(&[k; 32]).wr_id(k as u64)).unwrap();
            }
            let r = a.lane.disconnect(a.qp, T);
            (r, a)
        });
        until_peer_left(&mut b.lane, b.qp);
        let got = reap(&mut b.lane, POSTED as usize);
        let ids: Vec<u64> = got.iter().map(|c| c.wr_id()).collect();
        assert_eq!(ids, (0..POSTED).collect::<Vec<_>>(), "each receive once, in order");
        let filled = got.iter().take_while(|c| c.status() == WcStatus::Success).count();
        assert!(filled <= SENT as usize, "{filled} filled by {SENT} sends");
        for (k, mut c) in got.into_iter().enumerate() {
            let mut r = c.take_region().expect("each with its region");
            if k < filled {
                assert_eq!(c.byte_len(), 32);
                assert_eq!(&r.as_slice().unwrap()[..32], &[k as u8; 32]);
            } else {
                assert_eq!(c.status(), WcStatus::WrFlushErr, "receive {k} after the filled ones: {c:?}");
            }
        }
        assert!(b.lane.poll().unwrap().is_none(), "nothing more");
        assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 0));
        let (r, a) = leaving.join().unwrap();
        r.expect("the leaving side's disconnect, answered by peer_left");
        b.lane.disconnect(b.qp, T).unwrap();
        drop((a, b));
    }
    t.finish();
}
