//! Lanes and tokio runtimes (feature `tokio`): a lane whose CQ channel a runtime's reactor
//! holds (`Lane::wait_async` registered it), dropped with a receive in flight on a runtime
//! thread, after the runtime, or by the runtime's shutdown (a task that owned it). Its QP is destroyed
//! each time, within the teardown's bound, and the process carries on.

use std::time::Duration;

use crate::common::lane::{lane_pair, LaneSide};
use crate::common::{resources, DeviceTest, PairSpec};
use rdma_cm::verbs::lane::RecvWr;
use rdma_cm::{AccessFlags, MemoryRegion};

/// User-space QPs and CQs the kernel tracks.
fn qps_and_cqs() -> (usize, usize) {
    let r = resources();
    let n = |kind| r.iter().find(|(k, _)| *k == kind).map_or(0, |(_, n)| *n);
    (n("qp"), n("cq"))
}

/// A runtime of one thread.
fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Posts a receive on `side`'s lane and waits for it on `rt` until the wait runs out: the
/// receive stays posted (in flight), and the runtime's reactor now holds the lane's channel.
fn receive_in_flight(side: &mut LaneSide, rt: &tokio::runtime::Runtime) {
    let buf = MemoryRegion::new(&side.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    side.lane.post_recv(side.qp, RecvWr::new(buf).wr_id(1)).unwrap();
    let r = rt.block_on(side.lane.wait_async(Duration::from_millis(50)));
    assert!(r.is_err(), "nothing was sent: {r:?}");
    assert_eq!(side.lane.outstanding(side.qp).unwrap(), (0, 1));
}

/// The convenient path's QP, dropped on a runtime thread with work in flight, handed its
/// teardown to the blocking pool, which handed it on for ever (and, at the runtime's shutdown,
/// recursed until the stack overflowed). A lane tears down where it is dropped: on the runtime
/// thread, after the runtime, or by its shutdown (the task that owned it dropped), the QP and
/// CQ are destroyed at once.
#[test]
fn a_lane_with_a_receive_in_flight_dropped_on_after_or_by_a_runtime_is_destroyed() {
    let t = DeviceTest::start();
    for (k, when) in
        ["on the runtime's thread", "after the runtime", "by the runtime's shutdown"].into_iter().enumerate()
    {
        let (mut c, s) = lane_pair(t.addr, PairSpec::default(), PairSpec::default(), 64);
        let before = qps_and_cqs();
        let rt = rt();
        receive_in_flight(&mut c, &rt);
        let LaneSide { lane, qp: _, pd, mrs } = c;
        let gone = |when: &str| {
            let (q, cq) = qps_and_cqs();
            assert_eq!((q, cq), (before.0 - 1, before.1 - 1), "a lane dropped {when}: its QP and CQ are destroyed");
        };
        match k {
            0 => {
                rt.block_on(async move { drop(lane) });
                gone(when);
                drop(rt);
            }
            1 => {
                drop(rt);
                drop(lane);
                gone(when);
            }
            _ => {
                // A task that owns the lane and never finishes: the shutdown drops it.
                rt.spawn(async move {
                    let _lane = lane;
                    std::future::pending::<()>().await
                });
                drop(rt);
                gone(when);
            }
        }
        drop((s, pd, mrs));
    }
    t.finish();
}
