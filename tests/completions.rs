//! No completion is lost and no wait is blind: regression tests for the third outside audit's
//! six findings (issue 20), on the device.
//!
//! - a QP that a failed completion moved to the error state refuses receives (RC, as UD did);
//! - the responder of a bad-rkey RDMA WRITE, moved to the error state with nothing saying so,
//!   finds out when a wait runs out, and says so instead of timing out blind;
//! - an SRQ receive that a dropped QP consumed and nobody polled does not hold the SRQ's room;
//! - a wait for one `wr_id` notices a completion that another thread's poll kept for it.
//!
//! The two tokio findings (a second runtime, a forgotten wait) are in tests/tokio.rs.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{pair, DeviceTest, PairSpec, T};
use rdma_cm::{
    AccessFlags, Client, CompletionQueue, ConnParam, Connection, MemoryRegion, ProtectionDomain, QpInit, QpState,
    RecvWr, SendWr, Server, SharedReceiveQueue, WcStatus, WorkQueue,
};

/// A client and a server whose regions the peer may write, connected.
fn writable_pair(addr: std::net::IpAddr) -> (common::Side, common::Side) {
    let spec = PairSpec { access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE, ..PairSpec::default() };
    pair(addr, spec.clone(), spec)
}

/// Finding 1: a WRITE with a wrong rkey fails with REM_ACCESS_ERR, which moves the RC QP to the
/// error state; rxe never flushes a receive posted then, so the crate must refuse it (it did on
/// UD and after `set_error`, not after a failed completion on RC).
#[test]
fn a_failed_completion_makes_an_rc_qp_refuse_receives_and_sends() {
    let t = DeviceTest::start();
    let (mut c, s) = writable_pair(t.addr);
    let remote = s.mrs[0].remote();
    let bad = rdma_cm::RemoteRegion::new(remote.addr, remote.rkey ^ 0x5a5a, remote.len);
    c.conn.qp_mut().post_send(&[SendWr::write(&c.mrs[0], 0..64, &bad, 0).unwrap().wr_id(1)]).unwrap();
    let e = c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap_err();
    assert!(
        matches!(e, rdma_cm::Error::WorkCompletion { status: WcStatus::RemAccessErr, .. }),
        "the bad rkey must fail the WRITE: {e}"
    );
    assert_eq!(c.conn.qp().state().unwrap(), QpState::Error, "a failed completion moves an RC QP to ERR");
    let e = c.conn.qp_mut().post_recv(&[RecvWr::new(&c.mrs[0], 0..64).wr_id(2)]).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, rdma_cm::Error::QpInError { .. }), "{m}");
    assert!(m.contains("error state") && m.contains("REM_ACCESS_ERR"), "the refusal names the failure: {m}");
    assert_eq!(c.mrs[0].outstanding(), 0, "the refused receive holds nothing");
    let e = c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(3)]).unwrap_err();
    assert!(matches!(e, rdma_cm::Error::QpInError { .. }), "{e}");
    drop((c, s));
    t.finish();
}

/// Finding 2: the peer's bad-rkey WRITE moves *this* QP (the responder) to the error state with
/// no completion and no async event. A receive posted afterwards never completes; the wait for
/// it must find out from the QP's state and say so, and later posts are refused.
#[test]
fn the_responder_of_a_bad_rkey_write_is_told_when_its_wait_runs_out() {
    let t = DeviceTest::start();
    let (mut c, mut s) = writable_pair(t.addr);
    let remote = s.mrs[0].remote();
    let bad = rdma_cm::RemoteRegion::new(remote.addr, remote.rkey ^ 0x5a5a, remote.len);
    c.conn.qp_mut().post_send(&[SendWr::write(&c.mrs[0], 0..64, &bad, 0).unwrap().wr_id(1)]).unwrap();
    // The requester's completion comes once the responder refused the access: by then the
    // responder is in ERR.
    assert!(c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).is_err());
    assert_eq!(s.conn.qp().state().unwrap(), QpState::Error, "the responder went to ERR");
    assert!(!s.conn.qp().peer_left(), "nothing told the responder");
    // Nothing told the crate either, so the receive is accepted (and stays held: rxe never
    // flushes it); the wait for it is what finds out.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(7)]).unwrap();
    let started = Instant::now();
    let e = s.conn.qp_mut().wait_for(WorkQueue::Recv, 7, Duration::from_secs(1)).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, rdma_cm::Error::QpInError { .. }), "not a bare timeout: {m}");
    assert!(m.contains("no completion saying why") && m.contains("rkey"), "the usual cause is named: {m}");
    assert!(started.elapsed() < Duration::from_secs(5), "the wait kept its bound");
    let e = s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 64..128).wr_id(8)]).unwrap_err();
    assert!(matches!(e, rdma_cm::Error::QpInError { .. }), "posts are refused once it is known: {e}");
    // The plain wait says so too.
    let mut wcs = [rdma_cm::WorkCompletion::default(); 4];
    assert!(matches!(
        s.conn.qp_mut().wait(&mut wcs, Duration::from_millis(100)),
        Err(rdma_cm::Error::QpInError { .. })
    ));
    drop((c, s));
    t.finish();
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

/// Finding 4: two QPs on one CQ, each waited on by its own thread. Each thread's poll reaps
/// the other's completions and keeps them for it; a wait for one `wr_id` must notice a
/// completion kept for it while it sleeps (it polled without looking at kept ones, and timed
/// out even after a later completion of its own woke it). Every message must be received,
/// each within the bound.
#[test]
fn a_wait_for_one_wr_id_notices_what_another_threads_poll_kept_for_it() {
    let t = DeviceTest::start();
    const N: u64 = 200;
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    // The server: two connections, N messages to each, interleaved.
    let server = thread::spawn(move || {
        let mut conns: Vec<_> = (0..2)
            .map(|_| {
                let req = listener.get_request(T).unwrap();
                let pd = req.alloc_pd().unwrap();
                let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
                let conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
                (conn, mr, pd)
            })
            .collect();
        for i in 0..N {
            for (conn, mr, _) in &mut conns {
                // RNR retries (7: for ever) wait for the client's next receive.
                conn.qp_mut().post_send(&[SendWr::send(mr, 0..64).wr_id(i)]).unwrap();
                conn.qp_mut().wait_for(WorkQueue::Send, i, T).unwrap();
            }
        }
        conns
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let init = || QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
    let c1 = route.create_qp(&pd, init()).unwrap();
    let route2 = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let c2 = route2.create_qp(&pd, init()).unwrap();
    let param = ConnParam::new();
    let waiters: Vec<_> = [c1, c2]
        .into_iter()
        .map(|q| {
            let pd = Arc::clone(&pd);
            let mut q = q;
            let mr = MemoryRegion::new(&pd, 2 * 64, AccessFlags::LOCAL_WRITE).unwrap();
            q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(0)]).unwrap();
            let mut conn = q.connect(&param, T).unwrap();
            thread::spawn(move || {
                for i in 0..N {
                    // The next receive first, so the sender never waits on this one.
                    let half = ((i + 1) % 2) as usize * 64;
                    conn.qp_mut().post_recv(&[RecvWr::new(&mr, half..half + 64).wr_id(i + 1)]).unwrap();
                    let wc = conn
                        .qp_mut()
                        .wait_for(WorkQueue::Recv, i, T)
                        .unwrap_or_else(|e| panic!("message {i} of {N}: {e}"));
                    assert_eq!(wc.byte_len(), 64);
                }
                (conn, mr)
            })
        })
        .collect();
    let clients: Vec<_> = waiters.into_iter().map(|h| h.join().expect("a waiter missed a message")).collect();
    let servers = server.join().unwrap();
    drop((clients, servers, cq, pd, ctx));
    t.finish();
}
