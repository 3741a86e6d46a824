//! The lane as the whole path of a connection (`rdma_cm::cm::lane_conn`): the QP joins the
//! lane before the connect or accept, so receives are posted before the peer can send and the
//! RNR timer is set at RTR; sends are refused until the connection is established; the peer
//! leaving is one non-blocking call and a disconnect of one member one bounded call, with the
//! other members (and their CM events on a shared channel) untouched.

mod common;

use std::net::SocketAddr;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use common::lane::{lane_on, reap};
use common::{pattern, require, Cap, DeviceTest, T};
use rdma_cm::verbs::lane::{Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::{
    AccessFlags, Client, ConnParam, ConnectRequest, Error, EventChannel, MemoryRegion, ProtectionDomain, QpInit,
    QpState, Server, WcStatus, WorkQueue,
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

/// Calls `lane.peer_left(qp)` until it says so, for up to `T` (yielding between calls).
fn until_peer_left(lane: &mut Lane, qp: LaneQp) {
    let deadline = Instant::now() + T;
    while !lane.peer_left(qp).expect("Lane::peer_left") {
        assert!(Instant::now() < deadline, "the peer's departure was not seen within {T:?}");
        thread::yield_now();
    }
}

/// Whether `ch` has an event pending within `within` (`poll(2)` on its descriptor; nothing is
/// read).
fn readable_within(ch: &EventChannel, within: Duration) -> bool {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd { fd: ch.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: `fd` is one valid pollfd for the call; the descriptor is open while `ch` lives.
    let n = unsafe { libc::poll(&mut fd, 1, within.as_millis().min(i32::MAX as u128) as i32) };
    n == 1
}

/// A client connection on `lane` to `dst`, not connected yet (on `channel` when given).
fn lane_client(
    lane: &mut Lane,
    dst: SocketAddr,
    channel: Option<&EventChannel>,
) -> (rdma_cm::LaneClient, Arc<ProtectionDomain>) {
    let client = match channel {
        Some(ch) => Client::on_channel(ch).unwrap(),
        None => Client::new().unwrap(),
    };
    let route = client.resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    (route.lane_qp(lane, &pd, init()).expect("RouteResolved::lane_qp"), pd)
}

/// Before the connection exists the lane takes receives and refuses sends, saying why and
/// giving the region back; a member that never connected is disconnected by removing it.
#[test]
fn before_the_connect_the_lane_takes_receives_and_refuses_sends() {
    let t = DeviceTest::start();
    {
        // Something to resolve the route to (nothing is connected).
        let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
        let mut lane = lane_on(t.addr, 16);
        let (client, pd) = lane_client(&mut lane, listener.local_addr().unwrap(), None);
        let qp = client.qp();
        lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(1)).expect("a receive before the connect");
        let refused = lane.post_send(qp, SendWr::send(message(&pd, 1), 0..LEN).wr_id(2)).unwrap_err();
        let (e, back) = refused.into_parts();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("not established")), "{e}");
        assert!(back.is_some(), "the refused send's region comes back");
        let mut list = [Some(SendWr::send(message(&pd, 2), 0..LEN))];
        let e = lane.post_send_list(qp, &mut list).unwrap_err();
        assert!(e.to_string().contains("not established"), "{e}");
        assert!(list[0].is_some(), "a refused list keeps its work requests");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 1));
        // (siw reports no QP state: its ibv_query_qp leaves it 0, RESET.)
        if !common::caps::iwarp() {
            assert_eq!(lane.attributes(qp).unwrap().state, QpState::Init, "adopted and in INIT before the connect");
        }
        lane.disconnect(qp, T).expect("a member that never connected is removed");
        assert!(lane.outstanding(qp).is_err(), "gone from the lane");
        drop((lane, listener));
    }
    t.finish();
}

/// The server posts its receive on the lane before it accepts, and the client sends the moment
/// its connect returns. The client's QP is given no RNR retries (the server's accept says 0),
/// so had the receive come late the send would fail with RNR_RETRY_EXC_ERR at once: a last
/// connection whose server posts nothing shows it does (where RNR exists: not on iWARP, whose
/// receiver breaks the connection instead). Each side's QP has the RNR timer its own
/// parameters asked for, set at RTR (not on iWARP, which has no RNR), and by default READ
/// depths above 1 (what the devices allow).
#[test]
fn receives_posted_before_accept_meet_the_clients_first_send() {
    const N: usize = 20;
    let t = DeviceTest::start();
    let rnr = common::caps::has(Cap::RnrRetry);
    let control = require(Cap::RnrRetry); // prints why it is skipped where there is no RNR
    let rounds = N + usize::from(control);
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let ctx = listener.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 16).unwrap();
        for k in 0..rounds {
            let s = listener.get_request(T).unwrap().lane_qp(&mut lane, &pd, init()).unwrap();
            let qp = s.qp();
            let post = k < N;
            if post {
                lane.post_recv(qp, RecvWr::new(recv_buf(&pd)).wr_id(k as u64)).unwrap();
            }
            let param = ConnParam::new().rnr_retry_count(0).min_rnr_timer(1);
            s.accept(&mut lane, &param, T).unwrap_or_else(|e| panic!("accept {k}: {e}"));
            let a = lane.attributes(qp).unwrap();
            if rnr {
                assert_eq!(a.state, QpState::ReadyToSend);
                assert_eq!(a.min_rnr_timer, 1, "server {k}: the RNR timer its accept asked for");
            }
            assert!(a.max_dest_rd_atomic > 1, "server {k}: READ depth {} by default", a.max_dest_rd_atomic);
            if post {
                let mut c = reap(&mut lane, 1).pop().unwrap();
                assert_eq!((c.status(), c.wr_id(), c.byte_len()), (WcStatus::Success, k as u64, LEN as u32));
                let mut buf = c.take_region().unwrap();
                assert_eq!(&buf.as_slice().unwrap()[..LEN], &pattern(LEN, k as u8)[..], "connection {k}");
            }
            until_peer_left(&mut lane, qp);
            lane.disconnect(qp, T).unwrap();
        }
    });
    let mut lane = lane_on(t.addr, 16);
    for k in 0..rounds {
        let (client, pd) = lane_client(&mut lane, dst, None);
        let qp = client.qp();
        client.connect(&mut lane, &ConnParam::new().min_rnr_timer(3), T).unwrap_or_else(|e| panic!("connect {k}: {e}"));
        lane.post_send(qp, SendWr::send(message(&pd, k as u8), 0..LEN).wr_id(100 + k as u64)).unwrap();
        let a = lane.attributes(qp).unwrap();
        let sent = reap(&mut lane, 1).pop().unwrap();
        assert_eq!(sent.wr_id(), 100 + k as u64);
        if k < N {
            assert_eq!(sent.status(), WcStatus::Success, "connection {k}: the server's receive was late");
        } else {
            assert_eq!(sent.status(), WcStatus::RnrRetryExcErr, "with no receive posted, the send fails at once");
        }
        if rnr {
            assert_eq!((a.min_rnr_timer, a.rnr_retry), (3, 0), "client {k}: its own timer, the server's retries");
        }
        assert!(a.max_rd_atomic > 1, "client {k}: READ depth {} by default", a.max_rd_atomic);
        lane.disconnect(qp, T).unwrap_or_else(|e| panic!("disconnect {k}: {e}"));
    }
    server.join().unwrap();
    drop(lane);
    t.finish();
}

/// One server lane, three connections, one event channel for the listener and all of them
/// (and one for the three clients). The server disconnects one member: its client notices
/// with one call, its posted receive comes back flushed, and posts there are refused, while
/// the other two go on. A client's departure is noticed through the channel they share: the
/// check of another member reads that event and keeps it, and the leaving member's own check
/// finds it.
#[test]
fn one_lane_serves_many_connections_on_one_channel() {
    let t = DeviceTest::start();
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let (step_tx, step_rx) = mpsc::channel::<&'static str>();
    let (back_tx, back_rx) = mpsc::channel::<&'static str>();
    let server = thread::spawn(move || {
        let ctx = listener.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 32).unwrap();
        let mut qps = vec![];
        for k in 0..3u64 {
            let ev = ch.get_event_for(listener.handle(), T).unwrap();
            let s = ConnectRequest::from_event(ev).unwrap().lane_qp(&mut lane, &pd, init()).unwrap();
            lane.post_recv(s.qp(), RecvWr::new(recv_buf(&pd)).wr_id(k)).unwrap();
            qps.push(s.qp());
            s.accept(&mut lane, &ConnParam::new(), T).unwrap();
        }
        let (a, b, c) = (qps[0], qps[1], qps[2]);
        back_tx.send("accepted").unwrap();
        assert_eq!(step_rx.recv_timeout(T).unwrap(), "connected");
        // The disconnect's answer comes when B's client reads its events (Lane::peer_left).
        back_tx.send("b going").unwrap();
        lane.disconnect(b, T).expect("the disconnect of one member");
        // The two others still receive.
        let mut got: Vec<_> = reap(&mut lane, 2).into_iter().map(|c| (c.status(), c.wr_id())).collect();
        got.sort_by_key(|g| g.1);
        assert_eq!(got, [(WcStatus::Success, 0), (WcStatus::Success, 2)]);
        // Client A leaves; once its DISCONNECTED is pending on the shared channel, C's check
        // reads it (and keeps it), and A's own check finds it.
        assert!(readable_within(&ch, T), "A's DISCONNECTED did not arrive within {T:?}");
        assert!(!lane.peer_left(c).unwrap(), "C is still there");
        assert!(lane.peer_left(a).unwrap(), "A's departure, read by C's check, is kept for A");
        lane.disconnect(a, T).unwrap();
        // C still works.
        lane.post_recv(c, RecvWr::new(recv_buf(&pd)).wr_id(7)).unwrap();
        back_tx.send("c posted").unwrap();
        let m = reap(&mut lane, 1).pop().unwrap();
        assert_eq!((m.status(), m.wr_id(), m.queue()), (WcStatus::Success, 7, WorkQueue::Recv));
        until_peer_left(&mut lane, c);
        lane.disconnect(c, T).unwrap();
    });
    let cch = EventChannel::new().unwrap();
    let mut lane = lane_on(t.addr, 32);
    let mut qps = vec![];
    let mut pds = vec![];
    for k in 0..3u64 {
        let (client, pd) = lane_client(&mut lane, dst, Some(&cch));
        lane.post_recv(client.qp(), RecvWr::new(recv_buf(&pd)).wr_id(10 + k)).unwrap();
        qps.push(client.qp());
        client.connect(&mut lane, &ConnParam::new(), T).unwrap_or_else(|e| panic!("connect {k}: {e}"));
        pds.push(pd);
    }
    let (a, b, c) = (qps[0], qps[1], qps[2]);
    assert_eq!(back_rx.recv_timeout(T).unwrap(), "accepted");
    step_tx.send("connected").unwrap();
    assert_eq!(back_rx.recv_timeout(T).unwrap(), "b going");
    until_peer_left(&mut lane, b);
    let mut flushed = reap(&mut lane, 1).pop().unwrap();
    assert_eq!((flushed.status(), flushed.wr_id()), (WcStatus::WrFlushErr, 11), "B's receive comes back flushed");
    assert!(flushed.take_region().is_some(), "with its region");
    let e = lane.post_recv(b, RecvWr::new(recv_buf(&pds[1]))).unwrap_err().into_parts().0;
    assert!(matches!(e, Error::QpInError { .. }), "posts after the peer left are refused: {e}");
    lane.disconnect(b, T).expect("the peer left: nothing to wait for");
    // The two others still send.
    lane.post_send(a, SendWr::send(message(&pds[0], 1), 0..LEN)).unwrap();
    lane.post_send(c, SendWr::send(message(&pds[2], 3), 0..LEN)).unwrap();
    assert!(reap(&mut lane, 2).iter().all(|s| s.status() == WcStatus::Success));
    lane.disconnect(a, T).expect("A's disconnect, answered by the server's check");
    assert_eq!(back_rx.recv_timeout(T).unwrap(), "c posted");
    lane.post_send(c, SendWr::send(message(&pds[2], 4), 0..LEN)).unwrap();
    assert_eq!(reap(&mut lane, 1).pop().unwrap().status(), WcStatus::Success);
    lane.disconnect(c, T).unwrap();
    server.join().unwrap();
    drop((lane, pds, cch));
    t.finish();
}

/// A connection attached once established (the older way, `Lane::attach`) answers the same
/// two calls: the server's check sees the client's disconnect, which then completes.
#[test]
fn an_attached_connection_answers_peer_left_and_disconnect() {
    let t = DeviceTest::start();
    {
        let spec = common::PairSpec::default();
        let (mut a, mut b) = common::lane::lane_pair(t.addr, spec.clone(), spec, 64);
        let leaving = thread::spawn(move || {
            let r = a.lane.disconnect(a.qp, T);
            (r, a)
        });
        until_peer_left(&mut b.lane, b.qp);
        let (r, a) = leaving.join().unwrap();
        r.expect("the client's disconnect, answered");
        b.lane.disconnect(b.qp, Duration::from_secs(1)).expect("the peer left: nothing to wait for");
        drop((a, b));
    }
    t.finish();
}

/// The server's usual end, on a connection made through the lane: `wait_peer_left` returns
/// false once its bound has passed while the client stays, and true once the client
/// disconnects; posts are refused from then on, and the server's own disconnect only destroys.
#[test]
fn wait_peer_left_is_bounded_and_sees_the_clients_disconnect() {
    let t = DeviceTest::start();
    {
        let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(1).unwrap();
        let dst = listener.local_addr().unwrap();
        let (go, leave) = mpsc::channel::<()>();
        let client = thread::spawn(move || {
            let mut lane = lane_on(t.addr, 16);
            let (client, _pd) = lane_client(&mut lane, dst, None);
            let qp = client.qp();
            client.connect(&mut lane, &ConnParam::new(), T).expect("connect");
            leave.recv_timeout(T).expect("the server's go-ahead to leave");
            lane.disconnect(qp, T).expect("the client's disconnect, answered");
        });
        let ctx = listener.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 16).unwrap();
        let s = listener.get_request(T).unwrap().lane_qp(&mut lane, &pd, init()).unwrap();
        let qp = s.qp();
        s.accept(&mut lane, &ConnParam::new(), T).expect("accept");
        let bound = Duration::from_millis(300);
        let start = Instant::now();
        assert!(!lane.wait_peer_left(qp, bound).expect("Lane::wait_peer_left"), "the client has not left");
        let waited = start.elapsed();
        assert!(
            waited >= bound && waited < bound + Duration::from_secs(5),
            "waited {waited:?} on a bound of {bound:?}"
        );
        go.send(()).unwrap();
        assert!(lane.wait_peer_left(qp, T).expect("Lane::wait_peer_left"), "the client's disconnect not seen in {T:?}");
        assert!(lane.peer_left(qp).unwrap(), "peer_left agrees");
        let e = lane.post_send(qp, SendWr::send(message(&pd, 1), 0..LEN)).expect_err("a send after the peer left");
        assert!(e.to_string().contains("left") || e.to_string().contains("disconnect"), "the refusal says why: {e}");
        lane.disconnect(qp, Duration::from_secs(1)).expect("the peer left: nothing to wait for");
        client.join().unwrap();
        drop(lane);
    }
    t.finish();
}
