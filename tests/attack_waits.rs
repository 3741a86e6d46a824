//! An outside review of debafe3 ("no completion lost, no wait blind", issue 20): attempts to
//! break its promises with safe code, on the device. Each test asserts the promised behaviour,
//! so it fails if the promise breaks.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

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

/// How a receiving thread waits in [`shared_cq_stress`].
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// `wait_for(Recv, wr_id)` (needs known wr_ids: QPs without an SRQ).
    WaitFor,
    /// `wait`, both queues.
    Wait,
    /// `wait_queue(Recv)`.
    WaitQueue,
    /// `wait_for` with `set_busy_poll(true)`.
    BusyWaitFor,
    /// `wait` with `set_busy_poll(true)`.
    BusyWait,
    /// `wait_async` on a runtime of the thread's own.
    AsyncWait,
    /// `wait_for_async` on a runtime of the thread's own.
    AsyncWaitFor,
    /// `wait_async` cancelled every 2 ms (a `tokio::time::timeout` that runs out) until it
    /// returns something.
    AsyncCancelled,
}

/// Waits the async way for `mode`; None for the blocking modes.
#[cfg(feature = "tokio")]
fn async_wait(
    rt: &tokio::runtime::Runtime,
    conn: &mut Connection,
    mode: Mode,
    next: u32,
    wcs: &mut [WorkCompletion],
) -> Option<Result<Vec<WorkCompletion>, String>> {
    let qp = conn.qp_mut();
    Some(rt.block_on(async {
        match mode {
            Mode::AsyncWaitFor => {
                match tokio::time::timeout(T, qp.wait_for_async(WorkQueue::Recv, next as u64)).await {
                    Ok(Ok(wc)) => Ok(vec![wc]),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("timed out".into()),
                }
            }
            Mode::AsyncWait => match tokio::time::timeout(T, qp.wait_async(wcs)).await {
                Ok(Ok(n)) => Ok(wcs[..n].to_vec()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("timed out".into()),
            },
            Mode::AsyncCancelled => {
                let end = std::time::Instant::now() + T;
                loop {
                    match tokio::time::timeout(Duration::from_millis(2), qp.wait_async(wcs)).await {
                        Ok(Ok(n)) => break Ok(wcs[..n].to_vec()),
                        Ok(Err(e)) => break Err(e.to_string()),
                        Err(_) if std::time::Instant::now() < end => continue,
                        Err(_) => break Err("timed out, cancelled at every try".into()),
                    }
                }
            }
            _ => unreachable!(),
        }
    }))
}

#[cfg(not(feature = "tokio"))]
fn async_wait(
    _: &(),
    _: &mut Connection,
    _: Mode,
    _: u32,
    _: &mut [WorkCompletion],
) -> Option<Result<Vec<WorkCompletion>, String>> {
    panic!("the async modes need the tokio feature")
}

const MSGS: u32 = 150;

/// Many QPs on one CQ (that starts at depth 4 and grows as they join), each waited on by its
/// own thread in its own way, while a server sends `MSGS` messages with immediate data to
/// each, all connections at once. Every QP must receive every message of its own, once, in
/// order, each within the bound: a completion lost, delivered twice or to the wrong QP, or a
/// blind wait fails it. With `srq`, the client QPs take their receives from one SRQ that each
/// thread refills, and the SRQ's count must come back to its depth.
fn shared_cq_stress(modes: &[Mode], srq_depth: Option<u32>) {
    stress(modes, srq_depth, false, false)
}

/// [`shared_cq_stress`], with `own_send_cq`: each QP sends on a CQ of its own (the receive CQ
/// is the shared one); with `resizer`: a thread resizes the shared CQ back and forth meanwhile.
fn stress(modes: &[Mode], srq_depth: Option<u32>, own_send_cq: bool, resizer: bool) {
    let t = DeviceTest::start();
    let k = modes.len();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(16).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let mut conns: Vec<_> = (0..k)
            .map(|_| {
                let req = listener.get_request(T).unwrap();
                let pd = req.alloc_pd().unwrap();
                let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
                let conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
                (conn, mr, pd)
            })
            .collect();
        for i in 0..MSGS {
            for (conn, mr, _) in &mut conns {
                conn.qp_mut().post_send(&[SendWr::send(mr, 0..16).imm(i).wr_id(i as u64)]).unwrap();
            }
            for (j, (conn, _, _)) in conns.iter_mut().enumerate() {
                conn.qp_mut()
                    .wait_for(WorkQueue::Send, i as u64, T)
                    .unwrap_or_else(|e| panic!("server: send {i} to connection {j}: {e}"));
            }
        }
        (conns, listener)
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 4).unwrap();
    cq.set_auto_grow(true);
    let srq = srq_depth.map(|d| SharedReceiveQueue::new(&pd, d).unwrap());
    let shared_mr =
        Arc::new(MemoryRegion::new(&pd, 64 * srq_depth.unwrap_or(1) as usize, AccessFlags::LOCAL_WRITE).unwrap());
    if let (Some(srq), Some(d)) = (&srq, srq_depth) {
        let wrs: Vec<_> =
            (0..d as usize).map(|j| RecvWr::new(&shared_mr, j * 64..(j + 1) * 64).wr_id(j as u64)).collect();
        srq.post_recv(&wrs).unwrap();
    }
    let mut route = Some(route);
    let mut handles = Vec::new();
    for (n, &mode) in modes.iter().enumerate() {
        let r = match route.take() {
            Some(r) => r,
            None => Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap(),
        };
        let send_cq = if own_send_cq { CompletionQueue::new(&ctx, 64).unwrap() } else { Arc::clone(&cq) };
        let mut init = QpInit::new().send_cq(send_cq).recv_cq(Arc::clone(&cq));
        if let Some(srq) = &srq {
            init = init.srq(srq);
        }
        let mut q = r.create_qp(&pd, init).unwrap();
        let mr = MemoryRegion::new(&pd, 128, AccessFlags::LOCAL_WRITE).unwrap();
        if srq.is_none() {
            q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(0), RecvWr::new(&mr, 64..128).wr_id(1)]).unwrap();
        }
        let mut conn = q.connect(&ConnParam::new(), T).unwrap();
        let (srq, shared_mr) = (srq.clone(), Arc::clone(&shared_mr));
        handles.push(thread::spawn(move || {
            let me = conn.qp().qp_num();
            if matches!(mode, Mode::BusyWait | Mode::BusyWaitFor) {
                conn.qp_mut().set_busy_poll(true);
            }
            let mut next = 0u32;
            let mut seen: Vec<u32> = Vec::new();
            let mut wcs = [WorkCompletion::default(); 8];
            #[cfg(feature = "tokio")]
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            #[cfg(not(feature = "tokio"))]
            let rt = ();
            while next < MSGS {
                let got: Vec<WorkCompletion> = match mode {
                    Mode::AsyncWait | Mode::AsyncWaitFor | Mode::AsyncCancelled => {
                        async_wait(&rt, &mut conn, mode, next, &mut wcs)
                            .unwrap()
                            .unwrap_or_else(|e| panic!("QP {n} ({mode:?}): message {next}: {e}"))
                    }
                    Mode::WaitFor | Mode::BusyWaitFor => {
                        let wc = conn
                            .qp_mut()
                            .wait_for(WorkQueue::Recv, next as u64, T)
                            .unwrap_or_else(|e| panic!("QP {n} ({mode:?}): message {next}: {e}"));
                        vec![wc]
                    }
                    Mode::Wait | Mode::BusyWait | Mode::WaitQueue => {
                        let r = if let Mode::WaitQueue = mode {
                            conn.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T)
                        } else {
                            conn.qp_mut().wait(&mut wcs, T)
                        };
                        let got = r.unwrap_or_else(|e| panic!("QP {n} ({mode:?}): message {next}: {e}"));
                        assert!(got > 0, "QP {n} ({mode:?}): message {next} never came (the wait timed out)");
                        wcs[..got].to_vec()
                    }
                };
                for wc in got {
                    assert!(wc.is_ok(), "QP {n}: {wc:?}");
                    assert_eq!(wc.queue(), WorkQueue::Recv, "QP {n}: only receives complete here");
                    assert_eq!(wc.qp_num(), me, "QP {n} got another QP's completion: {wc:?}");
                    seen.push(wc.imm_data().expect("every message carries its number"));
                    next += 1;
                    match &srq {
                        Some(srq) => {
                            let j = wc.wr_id() as usize;
                            srq.post_recv(&[RecvWr::new(&shared_mr, j * 64..(j + 1) * 64).wr_id(j as u64)]).unwrap();
                        }
                        None => {
                            let id = wc.wr_id() + 2;
                            let half = (id % 2) as usize * 64;
                            conn.qp_mut().post_recv(&[RecvWr::new(&mr, half..half + 64).wr_id(id)]).unwrap();
                        }
                    }
                }
            }
            assert_eq!(conn.qp().undelivered(), 0, "QP {n}: nothing left kept");
            let mut sorted = seen.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..MSGS).collect::<Vec<_>>(), "QP {n} ({mode:?}): a message lost or delivered twice");
            let swapped: Vec<_> = seen.windows(2).filter(|w| w[0] > w[1]).map(|w| (w[0], w[1])).collect();
            assert!(swapped.is_empty(), "QP {n} ({mode:?}): an RC QP's receives delivered out of order: {swapped:?}");
            (conn, mr)
        }));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let resizing = resizer.then(|| {
        let (cq, stop) = (Arc::clone(&cq), Arc::clone(&stop));
        thread::spawn(move || {
            let base = cq.depth();
            let mut resizes = 0u32;
            let mut refused = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for d in [base * 2, base + 1, base] {
                    match cq.resize(d) {
                        Ok(()) => resizes += 1,
                        Err(_) => refused += 1,
                    }
                }
                thread::yield_now();
            }
            (resizes, refused)
        })
    });
    let mut failures = Vec::new();
    let mut clients = Vec::new();
    for h in handles {
        match h.join() {
            Ok(c) => clients.push(c),
            Err(e) => failures.push(e.downcast_ref::<String>().cloned().unwrap_or_else(|| "panic".into())),
        }
    }
    // A failed receiver stops taking messages: the server (RNR-retrying for ever) would hang, so
    // the failure is reported before it is joined.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(h) = resizing {
        let (resizes, refused) = h.join().unwrap();
        assert!(resizes > 0, "the CQ was resized under the traffic ({refused} refused)");
        assert_eq!(refused, 0, "resizes within what the queues reserved are all accepted");
    }
    assert!(failures.is_empty(), "receivers failed: {failures:#?}");
    let servers = server.join().unwrap();
    if let (Some(srq), Some(d)) = (&srq, srq_depth) {
        assert_eq!(srq.outstanding(), d as usize, "every receive reaped was posted again; none is held twice");
    }
    assert!(cq.depth() >= 4, "the CQ grew as QPs joined: {}", cq.depth());
    drop((clients, servers, srq, shared_mr, cq, pd, ctx));
    t.finish();
}

/// Review of debafe3, promise 1: five QPs on one auto-growing CQ, one thread each, waiting with
/// wait_for, wait, wait_queue, and busy-polled wait_for and wait, all at once.
#[test]
fn five_qps_on_one_cq_each_waited_on_differently_lose_nothing() {
    shared_cq_stress(&[Mode::WaitFor, Mode::Wait, Mode::WaitQueue, Mode::BusyWaitFor, Mode::BusyWait], None);
}

/// Review of debafe3, promises 1 and 3: four QPs on one CQ taking receives from one SRQ that
/// each thread refills, waited on with wait, wait_queue and busy-polled wait.
#[test]
fn four_srq_qps_on_one_cq_lose_nothing_and_the_srq_count_holds() {
    shared_cq_stress(&[Mode::Wait, Mode::WaitQueue, Mode::BusyWait, Mode::Wait], Some(16));
}

/// Review of debafe3, promise 1: as the five-QP test, but each QP sends on a CQ of its own and
/// only the receive CQ is shared. `QueuePair::wait` (both queues) then delivers kept
/// completions under the send CQ's router lock and polls the receive CQ under the other, so a
/// receive kept for it by another thread in between could be overtaken by the next one.
#[test]
fn qps_with_their_own_send_cq_and_a_shared_recv_cq_keep_receive_order() {
    stress(&[Mode::Wait, Mode::Wait, Mode::BusyWait, Mode::WaitQueue, Mode::WaitFor], None, true, false);
}

/// Review of debafe3, promise 4: five QPs on one CQ under traffic while another thread resizes
/// it back and forth (never below what its queues reserved): every resize is accepted, and no
/// completion is lost, duplicated or reordered.
#[test]
fn resizing_a_shared_cq_under_traffic_loses_nothing() {
    stress(&[Mode::Wait, Mode::WaitFor, Mode::BusyWait, Mode::WaitQueue, Mode::BusyWaitFor], None, false, true);
}

/// Review of debafe3, promises 1 and 5: blocking and async waits on one CQ from six threads,
/// each async one on a runtime of its own (so the CQ's channel gets a lasting registration with
/// three runtimes at once), one of them cancelling its wait every 2 ms.
#[cfg(feature = "tokio")]
#[test]
fn async_waits_on_three_runtimes_and_blocking_waits_share_a_cq() {
    shared_cq_stress(
        &[Mode::AsyncWait, Mode::AsyncWaitFor, Mode::AsyncCancelled, Mode::Wait, Mode::WaitFor, Mode::BusyWait],
        None,
    );
}

/// Review of debafe3, promises 1, 3 and 5: the same with the receives from one SRQ.
#[cfg(feature = "tokio")]
#[test]
fn async_and_blocking_waits_of_srq_qps_share_a_cq() {
    shared_cq_stress(&[Mode::AsyncWait, Mode::AsyncCancelled, Mode::Wait, Mode::AsyncWait], Some(16));
}

/// Review of debafe3, promise 4: the edges of `CompletionQueue::resize`. A CQ serving one QP of
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

/// Review of debafe3, promise 1 (`CompletionQueue::wait` is woken like a QP's wait): QPs A and B
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
        let mut conns: Vec<_> = (0..2)
            .map(|_| {
                let req = listener.get_request(T).unwrap();
                let pd = req.alloc_pd().unwrap();
                let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
                let conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
                (conn, mr, pd)
            })
            .collect();
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

/// Review of debafe3, promise 3: `SharedReceiveQueue::outstanding()` across QPs on separate
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
