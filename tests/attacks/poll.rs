//! Polls and waits: no completion lost, delivered twice, reordered or misrouted, and no wait blind, on private and shared CQs.

use crate::common::{out_of_reach, pair, pattern, DeviceTest, PairSpec, T};
use rdma_cm::{
    AccessFlags, Client, CompletionQueue, ConnParam, Error, MemoryRegion, QpInit, QpState, RecvWr, SendWr, Server,
    WcOpcode, WcStatus, WorkCompletion, WorkQueue,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::support::{accept_senders, reap_until, shared_cq_stress, stress, writable_pair, Mode, MSGS};

/// Immediate data round-trips through the raw field: 0 is `Some(0)` (not `None`), a plain send
/// is `None`, an RDMA WRITE with immediate consumes an empty single receive and reports its
/// data and length.
///
/// Origin: the round-5 outside-style review (the single-receive fast path, the raw-field WorkCompletion, cached region attributes, retirement of unsignaled work), formerly in `tests/attack_r5.rs`.
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
///
/// Origin: the round-5 outside-style review (the single-receive fast path, the raw-field WorkCompletion, cached region attributes, retirement of unsignaled work), formerly in `tests/attack_r5.rs`.
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
///
/// Origin: the round-5 outside-style review (the single-receive fast path, the raw-field WorkCompletion, cached region attributes, retirement of unsignaled work), formerly in `tests/attack_r5.rs`.
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

/// Review of debafe3, promise 2, false positives: `Connection::start_disconnect` moves the QP
/// to ERR (`rdma_disconnect`), by the caller's own doing, as `set_error` does. A later wait
/// that runs out with nothing outstanding must return 0, not `QpInError` blaming "no
/// completion saying why ... a wrong rkey". The server's connection shares the listener's
/// channel, so no link watch sets `peer_left` (src/qp.rs `check_silent_error` only skips
/// `peer_left` and `errored`, and start_disconnect sets neither).
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
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
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
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

/// Review of debafe3, promise 1: five QPs on one auto-growing CQ, one thread each, waiting with
/// wait_for, wait, wait_queue, and busy-polled wait_for and wait, all at once.
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
#[test]
fn five_qps_on_one_cq_each_waited_on_differently_lose_nothing() {
    shared_cq_stress(&[Mode::WaitFor, Mode::Wait, Mode::WaitQueue, Mode::BusyWaitFor, Mode::BusyWait], None);
}

/// Review of debafe3, promise 1: as the five-QP test, but each QP sends on a CQ of its own and
/// only the receive CQ is shared. `QueuePair::wait` (both queues) then delivers kept
/// completions under the send CQ's router lock and polls the receive CQ under the other, so a
/// receive kept for it by another thread in between could be overtaken by the next one.
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
#[test]
fn qps_with_their_own_send_cq_and_a_shared_recv_cq_keep_receive_order() {
    stress(&[Mode::Wait, Mode::Wait, Mode::BusyWait, Mode::WaitQueue, Mode::WaitFor], None, true, false);
}

/// Review of debafe3, promise 4: five QPs on one CQ under traffic while another thread resizes
/// it back and forth (never below what its queues reserved): every resize is accepted, and no
/// completion is lost, duplicated or reordered.
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
#[test]
fn resizing_a_shared_cq_under_traffic_loses_nothing() {
    stress(&[Mode::Wait, Mode::WaitFor, Mode::BusyWait, Mode::WaitQueue, Mode::BusyWaitFor], None, false, true);
}

/// Review of debafe3, promise 4: the edges of `CompletionQueue::resize`. A CQ serving one QP of
/// depth 16/16 (32 reserved) with four receives completed in it and unpolled: a depth of 0,
/// above `i32::MAX`, or below the 32 reserved is refused before the call; one beyond the
/// device's `max_cqe` fails in the call and leaves the depth; shrinking to exactly 32 keeps
/// the four completions, in order; a second QP that could overrun it is refused, and with
/// auto-grow it is taken and the CQ grows.
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
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

/// Review of debafe3, promise 1 (`CompletionQueue::wait` is woken like a QP's wait): QPs A and B
/// on one CQ. One thread owns A and waits only through `CompletionQueue::wait` (with the full
/// bound); another thread waits on B with `QueuePair::wait`, whose poll reaps A's receives and
/// keeps them for A: each keep must wake the CQ's wait at once. The CQ's wait also gets B's
/// completions (whoever polls the CQ gets them): it hands them to B's thread. Every message
/// must arrive once, A's in order, and no CQ wait may sleep through a kept completion (none may
/// take anywhere near the bound).
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
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

/// Review of debafe3, promise 4 ("the crate refuses QPs that could overrun it"): one CQ of
/// depth 24 for both queues of a QP of depth 16/16. The send queue's 16 fit, the receive
/// queue's 16 more do not: the QP must be refused. It hangs for ever instead:
/// `QueuePair::create` (src/qp.rs) runs
/// `if let Err(e) = recv_cq.reserve(&mut recv_cq.router(), recv_reserved) { undo_send(); ... }`,
/// where the router's guard, a temporary of the `if let` scrutinee, lives through the block,
/// and `undo_send` locks `send_cq.router()`, the same mutex when the CQs are one: a self
/// deadlock (std's Mutex is not reentrant), with the CQ's router locked for good, so every
/// other poll and wait on that CQ hangs too. (Auto-grow reaches it the same way: a send queue
/// that fits after growing and a receive queue beyond `max_cqe`.)
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
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
///
/// Origin: the regression tests of the third outside audit's findings (issue 20), formerly in `tests/completions.rs`.
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
///
/// Origin: the regression tests of the third outside audit's findings (issue 20), formerly in `tests/completions.rs`.
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
