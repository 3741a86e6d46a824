//! `Readiness`: one thread waiting on a CM event channel, a lane's CQ and a descriptor of its
//! own together (`src/ready.rs`), on the device. The descriptor-only cases are the module's unit
//! tests.

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{DeviceTest, T};
use rdma_cm::verbs::lane::{InlineWr, Lane, RecvWr};
use rdma_cm::{
    AccessFlags, Client, CmEventType, ConnParam, ConnectRequest, EventChannel, MemoryRegion, ProtectionDomain, QpInit,
    Readiness, Server, WcStatus, WorkQueue,
};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Src {
    Cm,
    Cq,
    Own,
}

/// The client's thread waits on its channel, its lane's CQ (`Lane::cq`, armed with
/// `Lane::arm`) and a socket of its own with one `Readiness`: it sees the channel ready with
/// `ESTABLISHED` (and nothing else), then the CQ ready with the server's send (and nothing
/// else), then a bounded wait with nothing ready (the arming read the CQ's event), then its own
/// socket. The server sends only when told, so each step has one cause.
#[test]
fn one_thread_sees_the_connect_event_then_the_completion_then_nothing() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(1).unwrap();
    let dst = listener.local_addr().expect("the listener has an address");
    let (go, told) = mpsc::channel::<()>();
    let srv = thread::spawn(move || {
        let ctx = listener.context().expect("server: the device's context");
        let pd = ProtectionDomain::new(&ctx).expect("server: a PD");
        let mut lane = Lane::new(&ctx, 32).expect("server: Lane::new");
        let req = listener.get_request(T).expect("server: get_request");
        let s = req.lane_qp(&mut lane, &pd, QpInit::new()).expect("server: lane_qp");
        let qp = s.qp();
        s.accept(&mut lane, &ConnParam::new(), T).expect("server: accept");
        told.recv_timeout(T).expect("server: the client never asked for the send");
        lane.post_inline(qp, InlineWr::send(b"ready?").wr_id(9)).expect("server: post_inline");
        let c = lane.wait(T).expect("server: the send's completion");
        assert_eq!((c.status(), c.wr_id()), (WcStatus::Success, 9), "server: the send failed");
        told.recv_timeout(T).expect("server: the client never said it was done");
        lane.disconnect(qp, T).expect("server: disconnect");
    });

    let ch = EventChannel::new().unwrap();
    let route = Client::on_channel(&ch).unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
    let pd = route.alloc_pd().unwrap();
    let buf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let q = route.create_qp(&pd, lane.qp_init()).unwrap();
    lane.arm().unwrap();
    let connecting = q.start(&ConnParam::new()).unwrap();
    let (own, mut own_peer) = UnixStream::pair().unwrap();
    let cq = lane.cq();
    let mut set = Readiness::new().channel(&ch, Src::Cm).cq(&cq, Src::Cq).fd(&own, Src::Own);

    // 1. The connect: the channel, alone.
    let ready: Vec<Src> = set.wait(T).unwrap().collect();
    assert_eq!(ready, [Src::Cm], "the connect's event, and nothing else");
    let ev = ch.try_get_event().unwrap().expect("the channel was reported ready: an event");
    assert_eq!(ev.event_type(), CmEventType::Established);
    let conn = connecting.complete(ev).expect("ESTABLISHED completes the connect");
    assert!(ch.try_get_event().unwrap().is_none(), "the channel is drained");
    // The connection joins the lane, and its receive is posted before the server is told to send.
    let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("Lane::attach");
    lane.post_recv(qp, RecvWr::new(buf).wr_id(1)).unwrap();

    // 2. The completion: the CQ, alone.
    go.send(()).unwrap();
    let ready: Vec<Src> = set.wait(T).unwrap().collect();
    assert_eq!(ready, [Src::Cq], "the receive's completion, and nothing else");
    lane.arm().unwrap();
    let mut c = lane.poll().unwrap().expect("the CQ was reported ready: a completion");
    assert_eq!((c.status(), c.queue(), c.wr_id(), c.byte_len()), (WcStatus::Success, WorkQueue::Recv, 1, 6));
    assert!(lane.poll().unwrap().is_none(), "one completion: the receive");
    let mut buf = c.take_region().expect("the receive's region comes back");
    assert_eq!(&buf.as_slice().unwrap()[..6], b"ready?");

    // 3. Nothing is ready (the arming read the CQ's event): a bounded wait returns nothing,
    // after its timeout.
    let timeout = Duration::from_millis(200);
    let start = Instant::now();
    let ready = set.wait(timeout).unwrap();
    assert_eq!(ready.len(), 0, "nothing happened, yet {:?} was reported ready", ready);
    assert!(start.elapsed() >= timeout, "returned after {:?}, before the timeout", start.elapsed());

    // 4. The caller's own descriptor, among the RDMA sources.
    own_peer.write_all(b"x").unwrap();
    let ready: Vec<Src> = set.wait(T).unwrap().collect();
    assert_eq!(ready, [Src::Own]);

    drop(set);
    go.send(()).unwrap();
    lane.disconnect(qp, T).expect("client: disconnect");
    srv.join().expect("server thread panicked");
    drop((buf, lane, cq, pd, ch));
    t.finish();
}

/// An event that a targeted wait kept in the channel's queue is no longer in the kernel's, so
/// `poll(2)` cannot see it: the set reports the channel ready at once all the same.
#[test]
fn an_event_kept_by_a_targeted_wait_makes_the_channel_ready() {
    let t = DeviceTest::start();
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(1).unwrap();
    let dst = listener.local_addr().expect("the listener has an address");
    // Another id on the same channel, whose targeted wait reads (and keeps) the listener's
    // CONNECT_REQUEST while waiting for its own ADDR_RESOLVED.
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        // Rejected or timed out: either way the request was sent.
        let _ = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), Duration::from_secs(5));
    });
    let (keeper, _keeper_peer) = UnixStream::pair().unwrap();
    let mut set = Readiness::new().channel(&ch, 0u8).fd(&keeper, 1);
    // Wait until the request is in the kernel's queue, then let a targeted wait of another id
    // read it into the channel's queue (it times out waiting for an event of its own).
    let ready: Vec<u8> = set.wait(T).unwrap().collect();
    assert_eq!(ready, [0], "the connect request");
    let other = Client::on_channel(&ch).unwrap();
    let own = ch.get_event_for(other.id().handle(), Duration::from_millis(100));
    assert!(own.is_err(), "the other id has no event of its own: {own:?}");
    let start = Instant::now();
    let ready: Vec<u8> = set.wait(T).unwrap().collect();
    assert_eq!(ready, [0], "the kept request is reported");
    assert!(start.elapsed() < Duration::from_secs(1), "reported only after {:?}", start.elapsed());
    let ev = ch.try_get_event().unwrap().expect("the kept event");
    assert_eq!(ev.event_type(), CmEventType::ConnectRequest);
    drop(set);
    ConnectRequest::from_event(ev).expect("a request").reject(&[]).expect("reject");
    client.join().expect("client thread panicked");
    drop((other, listener, ch));
    t.finish();
}
