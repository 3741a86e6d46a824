//! An outside review of debafe3 ("no completion lost, no wait blind", issue 20): attempts to
//! break its promises with safe code, on the device. Each test asserts the promised behaviour,
//! so it fails if the promise breaks.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{pair, DeviceTest, PairSpec, T};
use rdma_cm::{
    AccessFlags, Client, CompletionQueue, ConnParam, Connection, MemoryRegion, ProtectionDomain, QpInit, QpState,
    RecvWr, SendWr, Server, SharedReceiveQueue, WorkCompletion, WorkQueue,
};

/// A client connected to `dst`, on its own PD, with a 4 KiB region.
fn client_to(dst: SocketAddr, init: QpInit) -> (Connection, MemoryRegion, Arc<ProtectionDomain>) {
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let conn = route.create_qp(&pd, init).unwrap().connect(&ConnParam::new(), T).unwrap();
    (conn, mr, pd)
}

/// Review of debafe3, promise 2 ("an RC QP refuses posts after a failed completion"), through
/// an SRQ: a message longer than the SRQ receive it lands in fails that receive with
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

/// Review of debafe3, promise 2, false positives: `Connection::start_disconnect` moves the QP
/// to ERR (`rdma_disconnect`), by the caller's own doing, as `set_error` does. A later wait
/// that runs out with nothing outstanding must return 0, not `QpInError` blaming "no
/// completion saying why ... a wrong rkey". The server's connection shares the listener's
/// channel, so no link watch sets `peer_left` (src/qp.rs `check_silent_error` only skips
/// `peer_left` and `errored`, and start_disconnect sets neither).
#[test]
fn a_wait_after_start_disconnect_is_not_reported_as_a_silent_error() {
    let t = DeviceTest::start();
    let (c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    assert!(s.conn.start_disconnect().unwrap(), "the disconnect was sent");
    let mut wcs = [WorkCompletion::default(); 4];
    let got = s.conn.qp_mut().wait(&mut wcs, Duration::from_millis(300));
    let waited = format!("{got:?}");
    let ok = matches!(got, Ok(0));
    drop((c, s));
    t.finish();
    assert!(ok, "a wait after our own disconnect, with nothing outstanding, returns 0: {waited}");
}

/// Review of debafe3, promise 2: the same from the client side, whose channel is its own (so
/// its waits watch the link): the DISCONNECTED answering our own disconnect sets `peer_left`
/// if it is read in time. Also a wait_for right after: not `QpInError`.
#[test]
fn a_client_wait_after_start_disconnect_is_not_a_silent_error() {
    let t = DeviceTest::start();
    let (mut c, s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    assert!(c.conn.start_disconnect().unwrap());
    let got = c.conn.qp_mut().wait_for(WorkQueue::Recv, 42, Duration::from_millis(300));
    let waited = format!("{got:?}");
    let ok = !matches!(got, Err(rdma_cm::Error::QpInError { .. }));
    drop((c, s));
    t.finish();
    assert!(ok, "our own disconnect is not an unexplained error state: {waited}");
}
