//! Polls and waits: no completion lost, delivered twice, reordered or misrouted, and no wait blind, on private and shared CQs.

use crate::common::{out_of_reach, pair, pattern, DeviceTest, PairSpec, T};
use crate::support::{
    accept_senders, eventually, is_child, reap_all, reap_until, recvs, run_child, shared_cq_stress, stress,
    two_kept_and_one_stalled, writable_pair, Mode, MSGS,
};
use rdma_cm::{
    ffi, AccessFlags, Client, CmEventType, CompletionQueue, ConnParam, Error, EventChannel, MemoryRegion, QpInit,
    QpState, RecvWr, SendWr, Server, WcOpcode, WcStatus, WorkCompletion, WorkQueue, FOREVER,
};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

/// Immediate data round-trips through the raw field: 0 is `Some(0)` (not `None`), a plain send
/// is `None`, an RDMA WRITE with immediate consumes an empty single receive and reports its
/// data and length.
#[test]
fn immediate_data_round_trips_and_zero_is_not_none() {
    let t = DeviceTest::start();
    let sspec = PairSpec {
        mr_sizes: vec![256, 64],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), sspec);
    for (id, r) in [(1u64, 0..64), (2, 64..128), (3, 128..192), (4, 256..256)] {
        s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], r).wr_id(id)]).unwrap();
    }
    let remote = s.mrs[1].remote();
    c.mrs[0].as_mut_slice().unwrap()[..16].copy_from_slice(&pattern(16, 44));
    let q = c.conn.qp_mut();
    q.post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(11).imm(0)]).unwrap();
    q.post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(12)]).unwrap();
    q.post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(13).imm(0xdead_beef)]).unwrap();
    q.post_send(&[SendWr::write(&c.mrs[0], 0..16, &remote, 0).unwrap().wr_id(14).imm(0x0102_0304)]).unwrap();
    let w1 = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    let w2 = s.conn.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap();
    let w3 = s.conn.qp_mut().wait_for(WorkQueue::Recv, 3, T).unwrap();
    let w4 = s.conn.qp_mut().wait_for(WorkQueue::Recv, 4, T).unwrap();
    assert_eq!((w1.imm_data(), w1.opcode(), w1.byte_len()), (Some(0), Some(WcOpcode::Recv), 8), "{w1:?}");
    assert_eq!((w2.imm_data(), w2.opcode()), (None, Some(WcOpcode::Recv)), "{w2:?}");
    assert_eq!(w3.imm_data(), Some(0xdead_beef), "{w3:?}");
    assert!(format!("{w3:?}").contains(&format!("imm: Some({})", 0xdead_beefu32)), "{w3:?}");
    assert_eq!(
        (w4.imm_data(), w4.opcode(), w4.byte_len()),
        (Some(0x0102_0304), Some(WcOpcode::RecvRdmaWithImm), 16),
        "{w4:?}"
    );
    let mut b = [0u8; 16];
    s.mrs[1].read_at(0, &mut b).unwrap();
    assert_eq!(&b[..], &pattern(16, 44)[..]);
    for (id, op) in [(11, WcOpcode::Send), (12, WcOpcode::Send), (13, WcOpcode::Send), (14, WcOpcode::RdmaWrite)] {
        let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, id, T).unwrap();
        assert_eq!((wc.wr_id(), wc.opcode()), (id, Some(op)), "{wc:?}");
    }
    drop((c, s));
    t.finish();
}

/// FAILS on rxe (a wrong value, not a soundness bug; the same before this diff): the sender's
/// completion of a SEND or WRITE with immediate data. rxe sets `IBV_WC_WITH_IMM` in it but
/// leaves `imm_data` 0, so `imm_data()` reports `Some(0)` for a send whose immediate was
/// 0xdeadbeef: data "the peer sent" that nobody sent. Gating on `queue() == Recv` would fix it.
#[test]
fn a_send_completion_reports_no_immediate_data_it_does_not_have() {
    let t = DeviceTest::start();
    let sspec = PairSpec { pre_recv: vec![(1, 64)], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), sspec);
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(13).imm(0xdead_beef)]).unwrap();
    let r = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    assert_eq!(r.imm_data(), Some(0xdead_beef), "the receiver's side is right");
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 13, T).unwrap();
    assert!(
        wc.imm_data().is_none() || wc.imm_data() == Some(0xdead_beef),
        "a send completion reports immediate data {:?}, but 0xdeadbeef was sent: {wc:?}",
        wc.imm_data()
    );
    drop((c, s));
    t.finish();
}

/// Failed completions: an RNR with no retries and an RDMA READ with a wrong rkey report their
/// status, hide the opcode, keep the caller's wr_id whole (tag-like high bits included),
/// become `Error::WorkCompletion` through `ok()`; the READ's target stays out of reach until
/// the failure is reaped.
#[test]
fn failed_completions_report_status_hide_opcode_and_keep_wr_ids() {
    let t = DeviceTest::start();
    // The accept's rnr_retry_count applies to the client's QP: no retries.
    let sspec = PairSpec { param: ConnParam::new().rnr_retry_count(0), ..PairSpec::default() };
    let (mut c, s) = pair(t.addr, PairSpec::default(), sspec);
    let id = 0xc000_0000_0000_0007;
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(id)]).unwrap();
    let (wc, _) = reap_until(c.conn.qp_mut(), id);
    assert_eq!((wc.wr_id(), wc.queue(), wc.status()), (id, WorkQueue::Send, WcStatus::RnrRetryExcErr), "{wc:?}");
    assert!(!wc.is_ok());
    assert_eq!(wc.opcode(), None);
    assert_eq!(wc.imm_data(), None);
    match wc.ok() {
        Err(Error::WorkCompletion { wr_id, status: WcStatus::RnrRetryExcErr, .. }) => assert_eq!(wr_id, id),
        other => panic!("expected Error::WorkCompletion, got {other:?}"),
    }
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    assert!(c.mrs[0].as_mut_slice().is_ok());
    drop((c, s));

    let sspec = PairSpec { access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, ..PairSpec::default() };
    let (mut c, s) = pair(t.addr, PairSpec::default(), sspec);
    let good = s.mrs[0].remote();
    let wrong = rdma_cm::RemoteRegion::new(good.addr, good.rkey ^ 0x5a5a_0000, good.len);
    let mut chunks = c.mrs.remove(0).split(1024).unwrap();
    chunks[1].as_mut_slice().unwrap().fill(0x33);
    let id = u64::MAX;
    c.conn.qp_mut().post_send(&[SendWr::read(&chunks[1], 0..64, &wrong, 0).unwrap().wr_id(id)]).unwrap();
    out_of_reach(&mut chunks[1], "a READ target before its failure is reaped");
    assert!(chunks[0].as_mut_slice().is_ok(), "a sibling stays free");
    let (wc, _) = reap_until(c.conn.qp_mut(), id);
    assert_eq!((wc.wr_id(), wc.status(), wc.opcode()), (id, WcStatus::RemAccessErr, None), "{wc:?}");
    assert!(chunks[1].as_mut_slice().is_ok(), "the failed READ was reaped");
    drop((c, s, chunks));
    t.finish();
}

/// `Connection::start_disconnect` moves the QP
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

/// The same from the client side, whose channel is its own (so
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

/// Five QPs on one auto-growing CQ, one thread each, waiting with
/// wait_for, wait, wait_queue, and busy-polled wait_for and wait, all at once.
#[test]
fn five_qps_on_one_cq_each_waited_on_differently_lose_nothing() {
    shared_cq_stress(&[Mode::WaitFor, Mode::Wait, Mode::WaitQueue, Mode::BusyWaitFor, Mode::BusyWait], None);
}

/// As the five-QP test, but each QP sends on a CQ of its own and
/// only the receive CQ is shared. `QueuePair::wait` (both queues) then delivers kept
/// completions under the send CQ's router lock and polls the receive CQ under the other, so a
/// receive kept for it by another thread in between could be overtaken by the next one.
#[test]
fn qps_with_their_own_send_cq_and_a_shared_recv_cq_keep_receive_order() {
    stress(&[Mode::Wait, Mode::Wait, Mode::BusyWait, Mode::WaitQueue, Mode::WaitFor], None, true, false);
}

/// Five QPs on one CQ under traffic while another thread resizes
/// it back and forth (never below what its queues reserved): every resize is accepted, and no
/// completion is lost, duplicated or reordered.
#[test]
fn resizing_a_shared_cq_under_traffic_loses_nothing() {
    stress(&[Mode::Wait, Mode::WaitFor, Mode::BusyWait, Mode::WaitQueue, Mode::BusyWaitFor], None, false, true);
}

/// The edges of `CompletionQueue::resize`. A CQ serving one QP of
/// depth 16/16 (32 reserved) with four receives completed in it and unpolled: a depth of 0,
/// above `i32::MAX`, or below the 32 reserved is refused before the call; one beyond the
/// device's `max_cqe` fails in the call and leaves the depth; shrinking to exactly 32 keeps
/// the four completions, in order; a second QP that could overrun it is refused, and with
/// auto-grow it is taken and the CQ grows.
#[test]
fn resize_refuses_what_could_overrun_and_keeps_what_the_cq_holds() {
    let t = DeviceTest::start();
    // A watchdog: a hang reports the last step reached instead of stalling the suite.
    let step = Arc::new(std::sync::Mutex::new("start"));
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let watched = Arc::clone(&step);
    let watchdog = thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(90)).is_err() {
            use std::io::Write;
            let _ = writeln!(std::io::stdout(), "HUNG after step: {}", watched.lock().unwrap());
            let _ = std::io::stdout().flush();
            std::process::exit(101);
        }
    });
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
        for i in 0..4u32 {
            conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).imm(i).wr_id(i as u64)]).unwrap();
            conn.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap();
        }
        (conn, mr, pd, listener)
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 48).unwrap();
    let mr = MemoryRegion::new(&pd, 4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let init = || QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
    let mut q = route.create_qp(&pd, init()).unwrap();
    let wrs: Vec<_> = (0..4).map(|i| RecvWr::new(&mr, i * 64..(i + 1) * 64).wr_id(i as u64)).collect();
    q.post_recv(&wrs).unwrap();
    let mut a = q.connect(&ConnParam::new(), T).unwrap();
    // Each send was acknowledged: all four receives sit completed in the CQ.
    let srv = server.join().unwrap();
    step.lock().unwrap().clone_from(&"joined server");
    let max = ctx.limits().unwrap().max_cqe;
    for bad in [0, 31, u32::MAX] {
        assert!(
            matches!(cq.resize(bad), Err(rdma_cm::Error::InvalidArgument(_))),
            "depth {bad} refused before the call"
        );
        assert_eq!(cq.depth(), 48);
    }
    if max < i32::MAX as u32 {
        assert!(cq.resize(max + 1).is_err(), "beyond max_cqe {max}");
        assert_eq!(cq.depth(), 48, "a failed resize leaves the depth");
    }
    cq.resize(32).unwrap();
    step.lock().unwrap().clone_from(&"resized to 32");
    assert_eq!(cq.depth(), 32);
    let new_route = || Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    // A second QP (32 more) could overrun it: refused, and nothing changed.
    assert!(new_route().create_qp(&pd, init()).is_err(), "a QP that could overrun the CQ is refused");
    step.lock().unwrap().clone_from(&"second QP refused");
    assert_eq!(cq.depth(), 32);
    cq.set_auto_grow(true);
    let b = new_route().create_qp(&pd, init()).unwrap();
    step.lock().unwrap().clone_from(&"auto-grown");
    assert!(cq.depth() >= 64, "auto-grow made room for both: {}", cq.depth());
    let mut wcs = [WorkCompletion::default(); 8];
    let n = a.qp_mut().wait(&mut wcs, T).unwrap();
    step.lock().unwrap().clone_from(&"waited");
    let imms: Vec<_> = wcs[..n].iter().map(|w| w.imm_data()).collect();
    assert_eq!(imms, (0..4).map(Some).collect::<Vec<_>>(), "the four completions survived the resizes, in order");
    drop((a, b, srv, cq, mr, pd, ctx));
    step.lock().unwrap().clone_from(&"dropped");
    t.finish();
    done_tx.send(()).unwrap();
    watchdog.join().unwrap();
}

/// QPs A and B
/// on one CQ. One thread owns A and waits only through `CompletionQueue::wait` (with the full
/// bound); another thread waits on B with `QueuePair::wait`, whose poll reaps A's receives and
/// keeps them for A: each keep must wake the CQ's wait at once. The CQ's wait also gets B's
/// completions (whoever polls the CQ gets them): it hands them to B's thread. Every message
/// must arrive once, A's in order, and no CQ wait may sleep through a kept completion (none may
/// take anywhere near the bound).
#[test]
fn a_cq_wait_is_woken_by_a_qp_wait_that_keeps_completions_for_others() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let mut conns = accept_senders(&listener, 2);
        for i in 0..MSGS {
            for (conn, mr, _) in &mut conns {
                conn.qp_mut().post_send(&[SendWr::send(mr, 0..16).imm(i).wr_id(i as u64)]).unwrap();
            }
            for (conn, _, _) in &mut conns {
                conn.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap();
            }
        }
        (conns, listener)
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let init = || QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
    let connect = |r: rdma_cm::RouteResolved| {
        let mr = MemoryRegion::new(&pd, 128, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = r.create_qp(&pd, init()).unwrap();
        q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(0), RecvWr::new(&mr, 64..128).wr_id(1)]).unwrap();
        (q.connect(&ConnParam::new(), T).unwrap(), mr)
    };
    let (mut a, amr) = connect(route);
    let (mut b, bmr) = connect(Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap());
    let (a_num, b_num) = (a.qp().qp_num(), b.qp().qp_num());
    let (tx, rx) = std::sync::mpsc::channel::<WorkCompletion>();
    let cq2 = Arc::clone(&cq);
    let a_thread = thread::spawn(move || {
        let mut seen = Vec::new();
        let mut longest = Duration::ZERO;
        let mut wcs = [WorkCompletion::default(); 8];
        while seen.len() < MSGS as usize {
            let started = std::time::Instant::now();
            let n = cq2.wait(&mut wcs, T).unwrap();
            longest = longest.max(started.elapsed());
            assert!(n > 0, "A's message {} never came: the CQ's wait timed out", seen.len());
            for wc in &wcs[..n] {
                assert!(wc.is_ok(), "{wc:?}");
                if wc.qp_num() == b_num {
                    tx.send(*wc).unwrap();
                    continue;
                }
                assert_eq!(wc.qp_num(), a_num, "a completion of neither QP: {wc:?}");
                seen.push(wc.imm_data().unwrap());
                let id = wc.wr_id() + 2;
                let half = (id % 2) as usize * 64;
                a.qp_mut().post_recv(&[RecvWr::new(&amr, half..half + 64).wr_id(id)]).unwrap();
            }
        }
        (a, amr, seen, longest)
    });
    let mut b_seen = Vec::new();
    let mut wcs = [WorkCompletion::default(); 8];
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while b_seen.len() < MSGS as usize {
        assert!(std::time::Instant::now() < deadline, "B got {} of {MSGS}", b_seen.len());
        let n = b.qp_mut().wait(&mut wcs, Duration::from_millis(50)).unwrap();
        let forwarded: Vec<_> = rx.try_iter().collect();
        for wc in wcs[..n].iter().chain(&forwarded) {
            assert_eq!(wc.qp_num(), b_num, "B got another QP's completion: {wc:?}");
            b_seen.push(wc.imm_data().unwrap());
            let id = wc.wr_id() + 2;
            let half = (id % 2) as usize * 64;
            b.qp_mut().post_recv(&[RecvWr::new(&bmr, half..half + 64).wr_id(id)]).unwrap();
        }
    }
    let (a, amr, a_seen, longest) = a_thread.join().expect("the CQ's waiter failed");
    b_seen.sort_unstable();
    assert_eq!(b_seen, (0..MSGS).collect::<Vec<_>>(), "B: every message once");
    assert_eq!(a_seen, (0..MSGS).collect::<Vec<_>>(), "A (through the CQ's wait): every message once, in order");
    assert!(longest < Duration::from_secs(5), "a CQ wait slept through a kept completion: {longest:?}");
    let servers = server.join().unwrap();
    drop((a, b, amr, bmr, servers, cq, pd, ctx));
    t.finish();
}

/// One CQ of
/// depth 24 for both queues of a QP of depth 16/16. The send queue's 16 fit, the receive
/// queue's 16 more do not: the QP must be refused. It hangs for ever instead:
/// `QueuePair::create` (src/qp.rs) runs
/// `if let Err(e) = recv_cq.reserve(&mut recv_cq.router(), recv_reserved) { undo_send(); ... }`,
/// where the router's guard, a temporary of the `if let` scrutinee, lives through the block,
/// and `undo_send` locks `send_cq.router()`, the same mutex when the CQs are one: a self
/// deadlock (std's Mutex is not reentrant), with the CQ's router locked for good, so every
/// other poll and wait on that CQ hangs too. (Auto-grow reaches it the same way: a send queue
/// that fits after growing and a receive queue beyond `max_cqe`.)
#[test]
fn a_qp_whose_receive_queue_overruns_a_shared_cq_is_refused_not_hung() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 24).unwrap();
    let init = QpInit::new().max_send_wr(16).max_recv_wr(16).send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
    let (tx, rx) = std::sync::mpsc::channel();
    let pd2 = Arc::clone(&pd);
    thread::spawn(move || {
        let r = route.create_qp(&pd2, init).map(drop).map_err(|e| e.to_string());
        let _ = tx.send(r);
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(r) => {
            assert!(r.is_err(), "a QP of 16 + 16 on a CQ of 24 must be refused");
            drop((cq, pd, ctx, listener));
            t.finish();
        }
        // The creating thread is stuck holding the CQ's router lock: nothing can be torn down.
        Err(_) => panic!("QueuePair::create deadlocked refusing a receive queue the shared CQ has no room for"),
    }
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
        let mut conns = accept_senders(&listener, 2);
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

/// Item 4: a CQ of another device must be refused (the kernel would resolve its handle in the
/// QP's device file, where the number names some other CQ).
#[test]
fn guest_only_a_cq_of_another_device_is_refused() {
    let t = DeviceTest::start();
    assert!(
        std::env::var_os("RDMA_VM").is_some(),
        "this test adds a second Soft-RoCE device: it runs in the harness guest; elsewhere skip it with \
         `cargo test -- --skip guest_only`"
    );
    let sh = |cmd: &str| {
        let st = Command::new("sh").args(["-c", cmd]).status().unwrap();
        assert!(st.success(), "{cmd}");
    };
    sh("ip link add rdma1 type dummy && ip link set rdma1 mtu 9000 && ip addr add 10.78.0.1/24 dev rdma1 && \
        ip link set rdma1 up && rdma link add rxe1 type rxe netdev rdma1");
    let deadline = Instant::now() + T;
    while !std::fs::read_to_string("/sys/class/infiniband/rxe1/ports/1/state").unwrap_or_default().contains("ACTIVE") {
        assert!(Instant::now() < deadline, "rxe1 never became ACTIVE");
        thread::sleep(Duration::from_millis(20));
    }
    {
        let other = Client::new()
            .unwrap()
            .resolve_addr(None, "10.78.0.1:7999".parse().unwrap(), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let other_ctx = other.context().unwrap();
        assert_eq!(other_ctx.device_name(), "rxe1");
        let foreign_cq = CompletionQueue::new(&other_ctx, 32).unwrap();
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, 7999), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let pd = route.alloc_pd().unwrap();
        let err = route.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&foreign_cq))).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidArgument(_)) && msg.contains("rxe1") && msg.contains("device"), "{msg}");
        // The dangerous case: the foreign CQ's handle number equals that of a CQ of the QP's
        // own device, so the kernel would resolve it to *that* CQ rather than fail. Make the
        // numbers collide, and check the crate still refuses.
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, 7999), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let own_cq = CompletionQueue::new(&route.context().unwrap(), 32).unwrap();
        // SAFETY: reading the handle field of a live CQ.
        let own_handle = unsafe { (*own_cq.as_raw()).handle };
        let mut spare = vec![];
        let colliding = loop {
            let cq = CompletionQueue::new(&other_ctx, 32).unwrap();
            // SAFETY: as above.
            let h = unsafe { (*cq.as_raw()).handle };
            if h == own_handle {
                break cq;
            }
            assert!(h < own_handle, "cannot make the handles collide ({h} > {own_handle})");
            spare.push(cq);
        };
        let r = route.create_qp(&pd, QpInit::new().send_cq(colliding).recv_cq(own_cq));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "a QP was created with a CQ of another device");
        drop(spare);
        // A PD of the other device is refused too.
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, 7999), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let foreign_pd = other.alloc_pd().unwrap();
        assert!(route.create_qp(&foreign_pd, QpInit::new()).is_err());
    }
    // rxe1 stays: librdmacm keeps every device context it opened until the process exits, so
    // deleting the link here would wait for this process. The guest is thrown away after.
    t.finish();
}

/// Item 7: Duration::MAX (FOREVER) waits without a bound instead of panicking.
#[test]
fn forever_is_a_timeout_everywhere() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let req = listener.get_request(FOREVER).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
        q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(1)]).unwrap();
        let mut conn = q.accept(&ConnParam::new(), FOREVER).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Recv, 1, FOREVER).unwrap();
        let ev = conn.next_event(FOREVER).unwrap();
        assert_eq!(ev.event_type(), CmEventType::Disconnected);
        drop((conn, mr, pd));
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, FOREVER).unwrap().resolve_route(FOREVER).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), FOREVER).unwrap();
    conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(2)]).unwrap();
    conn.qp_mut().wait_for(WorkQueue::Send, 2, FOREVER).unwrap();
    let mut wcs = [WorkCompletion::default(); 2];
    assert_eq!(conn.qp_mut().wait(&mut wcs, Duration::from_millis(1)).unwrap(), 0);
    conn.disconnect(FOREVER).unwrap();
    server.join().unwrap();
    drop((mr, pd));
    t.finish();
}

/// Item 8: wait_for keeps the completions it meets before its own; none is lost.
#[test]
fn wait_for_keeps_the_completions_it_passes() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { mr_sizes: vec![4 * 64], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    let recvs: Vec<RecvWr> = (0..4).map(|k| RecvWr::new(&s.mrs[0], k * 64..(k + 1) * 64).wr_id(k as u64)).collect();
    s.conn.qp_mut().post_recv(&recvs).unwrap();
    let wrs: Vec<SendWr> = (1..=3).map(|k| SendWr::send(&c.mrs[0], 0..8).wr_id(k)).collect();
    c.conn.qp_mut().post_send(&wrs).unwrap();
    // Wait for the last first: 1 and 2 complete before it and must be kept.
    assert_eq!(c.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap().wr_id(), 3);
    assert_eq!(c.conn.qp().undelivered(), 2);
    assert_eq!(c.conn.qp_mut().wait_for(WorkQueue::Send, 1, Duration::ZERO).unwrap().wr_id(), 1);
    let mut wcs = [WorkCompletion::default(); 4];
    assert_eq!(c.conn.qp_mut().poll(&mut wcs).unwrap(), 1);
    assert_eq!(wcs[0].wr_id(), 2, "the kept completion comes back from poll");
    assert_eq!(c.conn.qp().undelivered(), 0);
    // Receives, waited for out of order.
    for k in [2, 0, 1] {
        assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, k, T).unwrap().wr_id(), k);
    }
    drop((c, s));
    t.finish();
}

/// Item 8, shared CQ: wait_for works when both queues share one CQ and keeps the other queue's
/// completions.
#[test]
fn wait_for_on_a_shared_cq_keeps_the_other_queue() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
        q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(1)]).unwrap();
        let mut conn = q.accept(&ConnParam::new(), T).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
        conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(2)]).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
        conn.next_event(T).unwrap();
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&route.context().unwrap(), 64).unwrap();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut q = route.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(cq)).unwrap();
    q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(7)]).unwrap();
    let mut conn = q.connect(&ConnParam::new(), T).unwrap();
    conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(8)]).unwrap();
    // The receive's completion arrives after the send's; waiting for it keeps the send's if
    // it is met first, and the other way round.
    assert_eq!(conn.qp_mut().wait_for(WorkQueue::Recv, 7, T).unwrap().wr_id(), 7);
    assert_eq!(conn.qp_mut().wait_for(WorkQueue::Send, 8, T).unwrap().wr_id(), 8);
    conn.disconnect(T).unwrap();
    server.join().unwrap();
    drop((mr, pd));
    t.finish();
}

/// Item 12: a completion of a raw post (a `wr_id` without the crate's tag) retires none of
/// the crate's slots, even when its number is one the crate uses.
#[test]
fn raw_posts_do_not_retire_the_crates_slots() {
    let t = DeviceTest::start();
    let spec_s = PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        pre_recv: vec![(1, 64)],
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, PairSpec { mr_sizes: vec![64, 64], ..PairSpec::default() }, spec_s);
    let raw_mr = &c.mrs[1];
    let remote = s.mrs[0].remote();
    // A raw RDMA WRITE with wr_id 0, the crate's first sequence number, posted first.
    // SAFETY: the raw-verbs user's side: the region (c.mrs[1]) stays alive and untouched until
    // the test ends, long after the work request completes; the list is well formed, and the
    // target is the peer's remotely writable region.
    unsafe {
        let mut sge = ffi::ibv_sge { addr: raw_mr.addr(), length: 8, lkey: raw_mr.lkey() };
        let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
        wr.wr_id = 0;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.wr.rdma = ffi::rdma_t { remote_addr: remote.addr + 1024, rkey: remote.rkey };
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        assert_eq!(ffi::ibv_post_send(c.conn.qp().as_raw(), &mut wr, &mut bad), 0);
    }
    // Then the crate's own send.
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(7)]).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap().byte_len(), 8);
    // Reap completions one at a time: the raw one must not retire the crate's work request.
    let mut wcs = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + T;
    loop {
        assert!(Instant::now() < deadline, "the crate's send never completed");
        let n = c.conn.qp_mut().wait(&mut wcs, T).unwrap();
        if n == 1 {
            assert_eq!(wcs[0].wr_id(), 7, "only the crate's own completion comes back");
            // The raw WRITE completes first; had it retired the crate's slot, this would be
            // its completion under the crate's wr_id.
            assert_eq!(wcs[0].opcode(), Some(WcOpcode::Send), "a raw completion retired the crate's send");
            break;
        }
        // n == 0 would be a timeout; a discarded raw completion returns nothing either, so
        // check that the crate's request is still held meanwhile.
        assert_eq!(c.conn.qp().outstanding_sends(), 1);
    }
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    drop((c, s));
    t.finish();
}

/// HOLE 1 (sync). `wait_for` with completions kept from an earlier `wait_for` must still time
/// out. It does not: `wait_on` hands the kept completions back (n > 0, so the deadline is never
/// looked at), `pick` keeps them again, and the loop spins at full speed for as long as the
/// awaited completion does not come; with four kept completions it never polls the CQ again
/// and spins for ever even after its completion arrived.
#[test]
fn wait_for_honours_its_timeout_while_it_keeps_other_completions() {
    let t = DeviceTest::start();
    let (mut c, mut s) = two_kept_and_one_stalled(&t);
    let (tx, rx) = mpsc::channel();
    let waiter = thread::spawn(move || {
        let start = Instant::now();
        let r = c.conn.qp_mut().wait_for(WorkQueue::Send, 4, Duration::from_millis(300));
        let _ = tx.send(());
        (r, start.elapsed(), c)
    });
    let returned_in_time = rx.recv_timeout(Duration::from_secs(5)).is_ok();
    // Either way, let send 4 complete, so that a waiter stuck in the loop gets out.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 192..256).wr_id(3)]).unwrap();
    let (r, took, mut c) = waiter.join().unwrap();
    assert!(
        returned_in_time && matches!(r, Err(Error::Timeout { .. })),
        "wait_for(send 4, 300 ms) with two kept completions returned {r:?} after {took:?}: it ignored its \
         timeout and returned only once send 4 completed"
    );
    let mut rest: Vec<u64> = reap_all(c.conn.qp_mut(), T).into_iter().map(|(id, _, _)| id).collect();
    rest.sort();
    assert_eq!(rest, [1, 2, 4]);
    drop((c, s));
    t.finish();
}

#[test]
#[ignore = "child process of waiting_for_the_last_of_five_sends_returns"]
fn child_five_sends() {
    if !is_child("poll::child_five_sends") {
        return;
    }
    let t = DeviceTest::start();
    let spec_s = PairSpec { mr_sizes: vec![5 * 64], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    s.conn.qp_mut().post_recv(&recvs(&s.mrs[0], 0..5, 64)).unwrap();
    let wrs: Vec<SendWr> = (1..=5).map(|k| SendWr::send(&c.mrs[0], 0..8).wr_id(k)).collect();
    c.conn.qp_mut().post_send(&wrs).unwrap();
    println!("ADV: waiting for send 5");
    let r = c.conn.qp_mut().wait_for(WorkQueue::Send, 5, T);
    println!("ADV: wait_for returned {r:?}");
    assert_eq!(r.unwrap().wr_id(), 5);
    assert_eq!(c.conn.qp().undelivered(), 4);
    drop((c, s));
    t.finish();
}

/// HOLE 1, worst case, in the plainest use: post five sends, wait for the fifth. `wait_for`
/// reads completions four at a time; sends 1 to 4 fill its batch and are kept, and from then
/// on every turn hands the same four kept completions back (filling the batch), so the CQ is
/// never polled again: send 5, long completed, is never seen, and the call spins for ever
/// (its timeout ignored). Run in a child process, killed after 60 s (the child's own setup and
/// checks take several seconds in a loaded guest: the bound is for the spin, not for them).
#[test]
fn waiting_for_the_last_of_five_sends_returns() {
    let t = DeviceTest::start();
    let (status, out) = run_child("poll::child_five_sends", Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "wait_for(send 5) never returned (status {status:?}, None = killed after 60 s):\n{out}"
    );
    t.finish();
}

/// HOLE 3. When the peer leaves, `wait_for` answers with `Error::Disconnected` for the first
/// failed completion of its queue, whichever work request that was, and that completion's
/// `wr_id` is gone: no poll returns it, no error names it. Every posted work request must be
/// reported exactly once.
#[test]
fn a_disconnect_does_not_swallow_the_completion_of_another_work_request() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { mr_sizes: vec![4 * 64], ..PairSpec::default() };
    let (c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    s.conn.qp_mut().post_recv(&recvs(&s.mrs[0], 1..4, 64)).unwrap();
    drop(c); // the client leaves: the server's three receives flush
    let mut reported = vec![];
    match s.conn.qp_mut().wait_for(WorkQueue::Recv, 3, T) {
        Err(Error::WorkCompletion { wr_id, .. }) => reported.push(wr_id),
        Ok(wc) => reported.push(wc.wr_id()),
        Err(e @ Error::Disconnected { .. }) => eprintln!("wait_for(3) said: {e}"),
        Err(e) => panic!("unexpected {e:?}"),
    }
    reported.extend(reap_all(s.conn.qp_mut(), T).into_iter().map(|(id, _, _)| id));
    reported.sort();
    assert_eq!(reported, [1, 2, 3], "each of the three receives must be reported once");
    drop(s);
    t.finish();
}

/// HOLE 8 (minor). On a CQ shared by both queues, `poll_queue(Send)` returns receive
/// completions straight from the CQ while older receive completions are still kept (by an
/// earlier `wait_for`): the receive queue's completions come back out of order.
#[test]
fn completions_of_one_queue_come_back_in_order_on_a_shared_cq() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (sent_tx, sent_rx) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
        q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(1)]).unwrap();
        let mut conn = q.accept(&ConnParam::new(), T).unwrap();
        for k in 0..2 {
            go_rx.recv().unwrap();
            conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(10 + k)]).unwrap();
            conn.qp_mut().wait_for(WorkQueue::Send, 10 + k, T).unwrap();
            sent_tx.send(()).unwrap();
        }
        conn.next_event(T).unwrap();
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&route.context().unwrap(), 64).unwrap();
    let mr = MemoryRegion::new(&pd, 128, AccessFlags::LOCAL_WRITE).unwrap();
    let mut q = route.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(cq)).unwrap();
    q.post_recv(&recvs(&mr, 0..2, 64)).unwrap();
    let mut conn = q.connect(&ConnParam::new(), T).unwrap();
    // Receive 0 completes; then our send's wait meets it first and keeps it.
    go_tx.send(()).unwrap();
    sent_rx.recv().unwrap();
    conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(7)]).unwrap();
    assert_eq!(conn.qp_mut().wait_for(WorkQueue::Send, 7, T).unwrap().wr_id(), 7);
    assert_eq!(conn.qp().undelivered(), 1, "receive 0 is kept");
    // Receive 1 completes; it is still in the CQ.
    go_tx.send(()).unwrap();
    sent_rx.recv().unwrap();
    let mut order = vec![];
    let mut wcs = [WorkCompletion::default(); 4];
    let n = conn.qp_mut().poll_queue(WorkQueue::Send, &mut wcs).unwrap();
    order.extend(wcs[..n].iter().filter(|w| w.queue() == WorkQueue::Recv).map(|w| w.wr_id()));
    let n = conn.qp_mut().poll(&mut wcs).unwrap();
    order.extend(wcs[..n].iter().filter(|w| w.queue() == WorkQueue::Recv).map(|w| w.wr_id()));
    assert_eq!(order, [0, 1], "receive completions must come back in posting order");
    conn.disconnect(T).unwrap();
    server.join().unwrap();
    drop((mr, pd));
    t.finish();
}

/// A CQ serves one QP at a time, whichever queue it is given for; a refused creation leaves
/// the other CQ free; and a CQ handed from a dropped QP (with work in flight) to a new one
/// carries none of the old QP's completions over.
#[test]
fn a_cq_moves_between_qps_without_sharing_or_stale_completions() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let mut out = vec![];
        for round in 0..2u64 {
            let req = listener.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
            let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
            q.post_recv(&recvs(&mr, 0..4, 64)).unwrap();
            let mut conn = q.accept(&ConnParam::new(), T).unwrap();
            if round == 1 {
                conn.qp_mut().wait_for(WorkQueue::Recv, 0, T).unwrap();
                conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(50)]).unwrap();
                conn.qp_mut().wait_for(WorkQueue::Send, 50, T).unwrap();
            }
            out.push((conn, mr, pd));
        }
        out
    });
    let route = || Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let r1 = route();
    let pd = r1.alloc_pd().unwrap();
    let ctx = r1.context().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let spare = CompletionQueue::new(&ctx, 64).unwrap();
    let mut q1 = r1.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq))).unwrap();
    // A CQ may serve several QPs (its routing table keeps them apart); one that would overrun
    // it is refused, and a refused creation reserves nothing.
    let r2 = route();
    let pd2 = r2.alloc_pd().unwrap();
    let q2 = r2.create_qp(&pd2, QpInit::new().send_cq(Arc::clone(&spare)).recv_cq(Arc::clone(&cq))).unwrap();
    let r3 = route();
    let e = r3.create_qp(&pd2, QpInit::new().max_send_wr(40).send_cq(Arc::clone(&cq))).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("overrun")), "{e:?}");
    drop(q2);
    let r3 = route();
    let q3 = r3.create_qp(&pd2, QpInit::new().send_cq(Arc::clone(&spare))).expect("the refusal reserved nothing");
    drop(q3);
    // q1 connects, leaves receives and sends in flight, and is dropped: they flush into `cq`.
    let mr1 = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    q1.post_recv(&recvs(&mr1, 0..4, 64)).unwrap();
    let mut conn1 = q1.connect(&ConnParam::new(), T).unwrap();
    conn1.qp_mut().post_send(&[SendWr::send(&mr1, 0..8).wr_id(0).unsignaled()]).unwrap();
    drop(conn1);
    // q4 gets the same CQ; its sequence numbers start again at 0, like q1's did.
    let r4 = route();
    let mut q4 = r4.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq))).unwrap();
    let mr4 = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    q4.post_recv(&recvs(&mr4, 0..2, 64)).unwrap();
    let mut conn4 = q4.connect(&ConnParam::new(), T).unwrap();
    conn4.qp_mut().post_send(&[SendWr::send(&mr4, 0..8).wr_id(0)]).unwrap();
    // Exactly our send 0 and receive 0 (the server's message) complete, successfully.
    let mut got = vec![];
    let mut wcs = [WorkCompletion::default(); 8];
    let deadline = Instant::now() + T;
    while got.len() < 2 && Instant::now() < deadline {
        let n = conn4.qp_mut().wait(&mut wcs, Duration::from_millis(200)).unwrap();
        got.extend(wcs[..n].iter().map(|w| (w.wr_id(), w.queue(), w.status())));
    }
    got.sort_by_key(|g| g.1 == WorkQueue::Recv);
    assert_eq!(got, [(0, WorkQueue::Send, WcStatus::Success), (0, WorkQueue::Recv, WcStatus::Success)]);
    assert_eq!(conn4.qp().outstanding_recvs(), 1);
    assert_eq!(conn4.qp_mut().poll(&mut wcs).unwrap(), 0, "no stale completion of q1");
    let srv = server.join().unwrap();
    drop((conn4, srv, mr1, mr4, pd, pd2, cq, spare, ctx));
    t.finish();
}

/// The caller's wr_ids come back unchanged, also those with the bits the crate uses for its
/// own tag (62, 63) or equal to the crate's own sequence numbers.
#[test]
fn wr_ids_with_the_crates_tag_bits_round_trip() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { mr_sizes: vec![4 * 64], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    let ids = [u64::MAX, 1 << 62, 1 << 63, 0];
    let rs: Vec<RecvWr> =
        ids.iter().enumerate().map(|(k, &id)| RecvWr::new(&s.mrs[0], k * 64..(k + 1) * 64).wr_id(id)).collect();
    s.conn.qp_mut().post_recv(&rs).unwrap();
    let ss: Vec<SendWr> = ids.iter().map(|&id| SendWr::send(&c.mrs[0], 0..8).wr_id(id)).collect();
    c.conn.qp_mut().post_send(&ss).unwrap();
    let sent: Vec<u64> = reap_all(c.conn.qp_mut(), T).into_iter().map(|(id, _, ok)| if ok { id } else { 7 }).collect();
    let got: Vec<u64> = reap_all(s.conn.qp_mut(), T).into_iter().map(|(id, _, ok)| if ok { id } else { 7 }).collect();
    assert_eq!(sent, ids);
    assert_eq!(got, ids);
    // wait_for on such ids works too.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(u64::MAX)]).unwrap();
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(1 << 62)]).unwrap();
    assert_eq!(c.conn.qp_mut().wait_for(WorkQueue::Send, 1 << 62, T).unwrap().wr_id(), 1 << 62);
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, u64::MAX, T).unwrap().wr_id(), u64::MAX);
    drop((c, s));
    t.finish();
}

/// Unsignaled sends stuck at the peer (no receive) are flushed when the peer leaves: each is
/// reported once, with its own wr_id, and its region is released.
#[test]
fn unsignaled_sends_flushed_by_the_peer_leaving_are_each_reported_once() {
    let t = DeviceTest::start();
    let (mut c, s) = pair(t.addr, PairSpec { mr_sizes: vec![64, 64, 64], ..PairSpec::default() }, PairSpec::default());
    let wrs: Vec<SendWr> = (0..3).map(|k| SendWr::send(&c.mrs[k], 0..8).wr_id(k as u64 + 1).unsignaled()).collect();
    c.conn.qp_mut().post_send(&wrs).unwrap();
    assert_eq!(c.conn.qp().outstanding_sends(), 3);
    drop(s);
    let mut got = reap_all(c.conn.qp_mut(), T);
    got.sort_by_key(|g| g.0);
    assert_eq!(got, [(1, WorkQueue::Send, false), (2, WorkQueue::Send, false), (3, WorkQueue::Send, false)]);
    for mr in &mut c.mrs {
        assert!(mr.as_mut_slice().is_ok());
    }
    drop(c);
    t.finish();
}

/// Duration::ZERO and 1 ns everywhere a timeout is taken: each call returns at once (a timeout
/// error, or the result when it is already there), none panics; huge finite timeouts wait
/// like FOREVER.
#[test]
fn zero_tiny_and_huge_timeouts_are_handled_everywhere() {
    let t = DeviceTest::start();
    let quick = Duration::from_secs(2);
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    for d in [Duration::ZERO, Duration::from_nanos(1)] {
        let start = Instant::now();
        assert!(matches!(listener.get_request(d), Err(Error::Timeout { .. })));
        let ev = EventChannel::new().unwrap().get_event(d);
        assert!(matches!(ev, Err(Error::Timeout { .. })), "{ev:?}");
        assert!(start.elapsed() < quick);
        // Resolution gets librdmacm's 1 ms minimum, and an extra second to report it.
        let start = Instant::now();
        let _ = Client::new().unwrap().resolve_addr(None, SocketAddr::new(t.addr, 7999), d);
        assert!(start.elapsed() < Duration::from_secs(3));
    }
    drop(listener);
    let spec = PairSpec { pre_recv: vec![(1, 64)], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, spec.clone(), spec);
    let mut wcs = [WorkCompletion::default(); 4];
    for d in [Duration::ZERO, Duration::from_nanos(1)] {
        let start = Instant::now();
        assert!(matches!(c.conn.qp_mut().wait_for(WorkQueue::Recv, 1, d), Err(Error::Timeout { .. })));
        assert_eq!(c.conn.qp_mut().wait(&mut wcs, d).unwrap(), 0);
        assert_eq!(c.conn.qp_mut().wait_queue(WorkQueue::Send, &mut wcs, d).unwrap(), 0);
        assert!(matches!(c.conn.next_event(d), Err(Error::Timeout { .. })));
        let h = c.conn.id().handle();
        assert!(matches!(c.conn.id().channel().get_event_for(h, d), Err(Error::Timeout { .. })));
        assert!(matches!(c.conn.id().channel().get_event(d), Err(Error::Timeout { .. })));
        assert!(start.elapsed() < quick);
    }
    // Huge finite timeouts: the answer arrives, the call returns it.
    for (k, d) in [Duration::from_secs(u64::MAX), Duration::MAX - Duration::from_nanos(1)].into_iter().enumerate() {
        let k = k as u64;
        s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(100 + k)]).unwrap();
        c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(200 + k)]).unwrap();
        assert!(c.conn.qp_mut().wait_for(WorkQueue::Send, 200 + k, d).is_ok());
    }
    // wait_for with ZERO returns a completion that is already there.
    let got = eventually(T, || s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, Duration::ZERO).is_ok());
    assert!(got, "the server's receive 1 (first message) was never returned with a zero timeout");
    let start = Instant::now();
    let r = c.conn.disconnect(Duration::ZERO);
    assert!(r.is_ok() || matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(start.elapsed() < quick);
    drop((c.mrs, c.pd, s));
    t.finish();
}

/// QPs taking turns at one routing index of a shared receive CQ: each posts four receives
/// (`wr_id`s 0 to 3, the same every time, so a stale completion would look plausible), gets two
/// messages, and is dropped with the completions unpolled and two receives still posted (their
/// flushes, on rxe, may come only as the QP is destroyed: after it left the table). On odd turns
/// the QP sends on a CQ of its own, so its send and receive indexes differ. The next QP at the
/// index must see nothing of its predecessors: no completion before its own messages arrive,
/// all four of its receives holding their regions until then, then exactly its four messages,
/// once each, on its own QP number. The regions the dropped QPs gave back keep their bytes.
#[test]
fn a_reused_routing_index_never_hands_an_old_completion_to_the_new_qp() {
    use crate::support::{Peer, Step};
    const TURNS: usize = 4;
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let peer = Peer::acceptor(listener);
    let resolve = || Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let first = resolve();
    let ctx = first.context().unwrap();
    let pd = first.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let mut route = Some(first);
    let mut given_back: Vec<(MemoryRegion, usize)> = Vec::new();
    let msg = |turn: usize, k: usize| format!("turn {turn} message {k}").into_bytes();
    let mut wcs = [WorkCompletion::default(); 8];
    for turn in 0..TURNS {
        let r = route.take().unwrap_or_else(resolve);
        let send_cq = if turn % 2 == 1 { CompletionQueue::new(&ctx, 16).unwrap() } else { Arc::clone(&cq) };
        let mut q = r.create_qp(&pd, QpInit::new().send_cq(send_cq).recv_cq(Arc::clone(&cq))).unwrap();
        let mut mr = MemoryRegion::new(&pd, 4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
        q.post_recv(&recvs(&mr, 0..4, 64)).unwrap();
        peer.start(Step::Connect);
        let mut conn = q.connect(&ConnParam::new(), T).unwrap();
        peer.wait();
        let me = conn.qp().qp_num();
        let n = cq.poll(&mut wcs).unwrap();
        assert_eq!(
            n,
            0,
            "turn {turn}: nothing arrived for QP {me} yet, but the CQ handed out {:?} (wr_id, qp_num)",
            wcs[..n].iter().map(|w| (w.wr_id(), w.qp_num())).collect::<Vec<_>>()
        );
        let n = conn.qp_mut().wait(&mut wcs, Duration::from_millis(50)).unwrap();
        assert_eq!(n, 0, "turn {turn}: QP {me}'s wait handed out {:?}", &wcs[..n]);
        assert_eq!(mr.outstanding(), 4, "turn {turn}: every receive of the new QP holds its region");
        assert!(matches!(mr.as_slice(), Err(Error::InFlight { .. })), "turn {turn}: the region is in reach");
        if turn + 1 < TURNS {
            for k in 0..2 {
                peer.step(Step::Send(turn, msg(turn, k)));
            }
            drop(conn);
            assert_eq!(mr.outstanding(), 0, "turn {turn}: the dropped QP gave its region back");
            given_back.push((mr, turn));
            continue;
        }
        for k in 0..4 {
            peer.step(Step::Send(turn, msg(turn, k)));
        }
        let mut got = vec![];
        let deadline = Instant::now() + T;
        while got.len() < 4 && Instant::now() < deadline {
            let n = conn.qp_mut().wait(&mut wcs, T).unwrap();
            got.extend_from_slice(&wcs[..n]);
        }
        let seen: Vec<_> = got.iter().map(|w| (w.wr_id(), w.qp_num(), w.queue(), w.is_ok())).collect();
        let want: Vec<_> = (0..4).map(|k| (k, me, WorkQueue::Recv, true)).collect();
        assert_eq!(seen, want, "turn {turn}: the new QP's four receives, in order, once each, nothing else");
        assert_eq!(conn.qp_mut().wait(&mut wcs, Duration::from_millis(100)).unwrap(), 0, "nothing twice");
        assert_eq!(cq.poll(&mut wcs).unwrap(), 0, "nothing left for anyone");
        let bytes = mr.as_slice().unwrap();
        for k in 0..4 {
            let m = msg(turn, k);
            assert_eq!(&bytes[k * 64..k * 64 + m.len()], &m[..], "turn {turn}: receive {k}'s bytes");
        }
        drop(conn);
    }
    for (mr, turn) in &mut given_back {
        let bytes = mr.as_slice().unwrap();
        for k in 0..2 {
            let m = msg(*turn, k);
            assert_eq!(&bytes[k * 64..k * 64 + m.len()], &m[..], "turn {turn}: a region given back kept its bytes");
        }
        assert!(bytes[128..].iter().all(|&b| b == 0), "turn {turn}: the receives never filled stayed empty");
    }
    peer.finish();
    drop((given_back, cq, pd, ctx));
    t.finish();
}
