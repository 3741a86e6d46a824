//! Async waits (feature `tokio`) beside blocking ones on one CQ.

use crate::common::{pair, resources, DeviceTest, PairSpec, T};
use crate::support::{eventually, is_child, reap_all, run_child, shared_cq_stress, two_kept_and_one_stalled, Mode};
use rdma_cm::{Client, ConnParam, QpInit, RecvWr, Server, WorkQueue};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

/// Blocking and async waits on one CQ from six threads,
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

/// The same with the receives from one SRQ.
#[cfg(feature = "tokio")]
#[test]
fn async_and_blocking_waits_of_srq_qps_share_a_cq() {
    shared_cq_stress(&[Mode::AsyncWait, Mode::AsyncCancelled, Mode::Wait, Mode::AsyncWait], Some(16));
}

/// How many QPs the kernel tracks (user space ones).
fn qp_count() -> usize {
    resources().into_iter().find(|(k, _)| *k == "qp").map_or(0, |(_, n)| n)
}

/// HOLE 1 (async). Same with `wait_for_async` under `tokio::time::timeout`, which its docs
/// recommend as the bound: the future never returns Pending, so the timeout never fires and the
/// runtime thread is stuck.
#[test]
fn wait_for_async_yields_while_it_keeps_other_completions() {
    let t = DeviceTest::start();
    let (mut c, mut s) = two_kept_and_one_stalled(&t);
    let (tx, rx) = mpsc::channel();
    let waiter = thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let start = Instant::now();
        let r = rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(300), c.conn.qp_mut().wait_for_async(WorkQueue::Send, 4)).await
        });
        let _ = tx.send(());
        (format!("{r:?}"), r.is_err(), start.elapsed(), c)
    });
    let returned_in_time = rx.recv_timeout(Duration::from_secs(5)).is_ok();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 192..256).wr_id(3)]).unwrap();
    let (r, elapsed, took, mut c) = waiter.join().unwrap();
    assert!(
        returned_in_time && elapsed,
        "timeout(300 ms, wait_for_async(send 4)) returned {r} after {took:?}: the future never yielded"
    );
    let mut rest: Vec<u64> = reap_all(c.conn.qp_mut(), T).into_iter().map(|(id, _, _)| id).collect();
    rest.sort();
    assert_eq!(rest, [1, 2, 4]);
    drop((c, s));
    t.finish();
}

/// Child: drops a connection with a receive in flight inside a runtime, and reports whether its
/// QP is destroyed within 10 s (Drop's own bound is 2 s); with `shutdown`, drops the runtime
/// right after.
fn tokio_drop_child(shutdown: bool) {
    let t = DeviceTest::start();
    let spec = PairSpec { pre_recv: vec![(1, 64)], ..PairSpec::default() };
    let (c, s) = pair(t.addr, spec, PairSpec::default());
    let before = qp_count();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move { drop(c) });
    if shutdown {
        drop(rt);
        println!("ADV: runtime dropped");
        let gone = eventually(Duration::from_secs(10), || qp_count() < before);
        println!("ADV: client QP destroyed: {gone}");
    } else {
        let gone = eventually(Duration::from_secs(10), || qp_count() < before);
        println!("ADV: client QP destroyed: {gone}");
        if !gone {
            // Do not unwind into the runtime's shutdown (see the other test).
            std::process::exit(2);
        }
        drop(rt);
    }
    drop(s);
    t.finish();
    println!("ADV: clean exit");
}

#[test]
#[ignore = "child process of a_qp_dropped_on_a_tokio_runtime_is_destroyed"]
fn child_tokio_drop() {
    if is_child("asynchronous::child_tokio_drop") {
        tokio_drop_child(false);
    }
}

#[test]
#[ignore = "child process of a_qp_dropped_just_before_runtime_shutdown_is_destroyed"]
fn child_tokio_drop_then_shutdown() {
    if is_child("asynchronous::child_tokio_drop_then_shutdown") {
        tokio_drop_child(true);
    }
}

/// HOLE 2. A QP dropped on a runtime thread with work in flight hands its teardown to the
/// blocking pool (`detach_to_blocking_pool`). The copy it hands over has `detached: false`, and
/// the blocking pool's threads are inside the runtime too, so that copy's Drop detaches again,
/// and so on: the QP is never destroyed, two blocking threads bounce it back and forth at full
/// speed, and its regions stay held for ever.
#[test]
fn a_qp_dropped_on_a_tokio_runtime_is_destroyed() {
    let t = DeviceTest::start();
    let (status, out) = run_child("asynchronous::child_tokio_drop", Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()) && out.contains("client QP destroyed: true"),
        "the child's QP was not destroyed (status {status:?}):\n{out}"
    );
    t.finish();
}

/// HOLE 2, runtime shutdown. When the runtime shuts down, the blocking pool drops the task that
/// holds the detached QP; that Drop detaches again into the shutting-down pool, which drops the
/// new task at once, inside the same call: unbounded recursion, the process dies of a stack
/// overflow (SIGABRT) instead of destroying the QP.
#[test]
fn a_qp_dropped_just_before_runtime_shutdown_is_destroyed() {
    let t = DeviceTest::start();
    let (status, out) = run_child("asynchronous::child_tokio_drop_then_shutdown", Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()) && out.contains("client QP destroyed: true"),
        "the child did not destroy its QP and exit cleanly (status {status:?}):\n{out}"
    );
    t.finish();
}

#[test]
fn async_connects_cancelled_mid_handshake_leave_nothing_behind() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(16).unwrap();
    let dst = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut established = 0;
            while !stop.load(Ordering::Relaxed) {
                let Ok(req) = listener.get_request(Duration::from_millis(200)) else { continue };
                let pd = req.alloc_pd().unwrap();
                // The client may have given up (and its id be gone) by now: then the request's
                // QP or accept fails, which is the point of this test, not a server failure.
                let Ok(q) = req.create_qp(&pd, QpInit::new()) else { continue };
                if let Ok(mut conn) = q.accept(&ConnParam::new(), Duration::from_secs(3)) {
                    established += 1;
                    let deadline = Instant::now() + T;
                    while !conn.is_disconnected() && Instant::now() < deadline {
                        let _ = conn.next_event(Duration::from_millis(200));
                    }
                }
            }
            established
        })
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let delays = [0, 50, 200, 1_000, 5_000, 20_000].map(Duration::from_micros);
    let mut completed = 0;
    for d in delays {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        // No work posted: a QP with work in flight dropped on the runtime would hit HOLE 2.
        let q = route.create_qp(&pd, QpInit::new()).unwrap();
        let r = rt.block_on(async { tokio::time::timeout(d, q.connect_async(&ConnParam::new())).await });
        if let Ok(conn) = r {
            completed += 1;
            drop(conn.expect("a completed connect_async must have succeeded"));
        }
        drop(pd);
    }
    // A connection after all that works end to end.
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    let conn = rt.block_on(async { tokio::time::timeout(T, q.connect_async(&ConnParam::new())).await });
    let conn = conn.expect("connect_async within the bound").expect("connect_async");
    rt.block_on(async { tokio::time::timeout(T, conn.disconnect_async()).await }).unwrap().unwrap();
    stop.store(true, Ordering::Relaxed);
    let established = server.join().unwrap();
    assert!(established > completed, "the last connection was established ({established}, {completed} early)");
    drop((pd, rt));
    t.finish();
}
