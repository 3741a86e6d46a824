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
            Mode::AsyncWaitFor => match tokio::time::timeout(T, qp.wait_for_async(WorkQueue::Recv, next as u64)).await {
                Ok(Ok(wc)) => Ok(vec![wc]),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("timed out".into()),
            },
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
fn async_wait(_: &(), _: &mut Connection, _: Mode, _: u32, _: &mut [WorkCompletion]) -> Option<Result<Vec<WorkCompletion>, String>> {
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
    let shared_mr = Arc::new(MemoryRegion::new(&pd, 64 * srq_depth.unwrap_or(1) as usize, AccessFlags::LOCAL_WRITE).unwrap());
    if let (Some(srq), Some(d)) = (&srq, srq_depth) {
        let wrs: Vec<_> = (0..d as usize).map(|j| RecvWr::new(&shared_mr, j * 64..(j + 1) * 64).wr_id(j as u64)).collect();
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
