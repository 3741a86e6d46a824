//! `Readiness`: one thread waiting on a CM event channel, a CQ and a descriptor of its own
//! together (`src/ready.rs`), on the device. The descriptor-only cases are the module's unit
//! tests.

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{DeviceTest, T};
use rdma_cm::{
    AccessFlags, Client, CmEventType, CompletionQueue, ConnParam, ConnectRequest, EventChannel, MemoryRegion, QpInit,
    Readiness, RecvWr, SendWr, Server, WcStatus, WorkCompletion, WorkQueue,
};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Src {
    Cm,
    Cq,
    Own,
}

/// The client's thread waits on its channel, its CQ and a socket of its own with one
/// `Readiness`: it sees the channel ready with `ESTABLISHED` (and nothing else), then the CQ
/// ready with the server's send (and nothing else), then a bounded wait with nothing ready,
/// then its own socket. The server sends only when told, so each step has one cause.
#[test]
fn one_thread_sees_the_connect_event_then_the_completion_then_nothing() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(1).unwrap();
    let dst = listener.local_addr().expect("the listener has an address");
    let (go, told) = mpsc::channel::<()>();
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).expect("server: get_request");
        let pd = req.alloc_pd().expect("server: alloc_pd");
        let mut conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).expect("server: accept");
        told.recv_timeout(T).expect("server: the client never asked for the send");
        conn.qp_mut().post_send(&[SendWr::send_inline(b"ready?").wr_id(9)]).expect("server: post_send");
        let wc = conn.qp_mut().wait_for(WorkQueue::Send, 9, T).expect("server: the send's completion");
        assert_eq!(wc.status(), WcStatus::Success, "server: the send failed");
        told.recv_timeout(T).expect("server: the client never said it was done");
        conn.disconnect(T).expect("server: disconnect");
    });

    let ch = EventChannel::new().unwrap();
    let route = Client::on_channel(&ch).unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let cq = CompletionQueue::new(&route.context().unwrap(), 64).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut buf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut q = route.create_qp(&pd, QpInit::new().send_cq(cq.clone()).recv_cq(cq.clone())).unwrap();
    q.post_recv(&[RecvWr::new(&buf, 0..64).wr_id(1)]).unwrap();
    cq.req_notify(false).unwrap();
    let connecting = q.start(&ConnParam::new()).unwrap();
    let (own, mut own_peer) = UnixStream::pair().unwrap();
    let mut set = Readiness::new().channel(&ch, Src::Cm).cq(&cq, Src::Cq).fd(&own, Src::Own);

    // 1. The connect: the channel, alone.
    let ready: Vec<Src> = set.wait(T).unwrap().collect();
    assert_eq!(ready, [Src::Cm], "the connect's event, and nothing else");
    let ev = ch.try_get_event().unwrap().expect("the channel was reported ready: an event");
    assert_eq!(ev.event_type(), CmEventType::Established);
    let conn = connecting.complete(ev).expect("ESTABLISHED completes the connect");
    assert!(ch.try_get_event().unwrap().is_none(), "the channel is drained");

    // 2. The completion: the CQ, alone.
    go.send(()).unwrap();
    let ready: Vec<Src> = set.wait(T).unwrap().collect();
    assert_eq!(ready, [Src::Cq], "the receive's completion, and nothing else");
    assert!(cq.drain_events().unwrap() >= 1, "the CQ's channel held an event");
    cq.req_notify(false).unwrap();
    let mut wcs = [WorkCompletion::default(); 4];
    let n = cq.poll(&mut wcs).unwrap();
    assert_eq!(n, 1, "one completion: the receive");
    let wc = &wcs[0];
    assert_eq!((wc.status(), wc.queue(), wc.wr_id(), wc.byte_len()), (WcStatus::Success, WorkQueue::Recv, 1, 6));
    assert_eq!(&buf.as_slice().unwrap()[..6], b"ready?");

    // 3. Nothing is ready: a bounded wait returns nothing, after its timeout.
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
    conn.disconnect(T).expect("client: disconnect");
    srv.join().expect("server thread panicked");
    drop((buf, pd, cq, ch));
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
