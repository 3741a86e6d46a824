//! Attempts to break the fast path's promises (`rdma_cm::verbs::lane`) with the API a user has, on the
//! device, as an attacker would: dropping or forgetting a lane or a QP with work in
//! flight, a post the provider half-takes, posting past the queue depth, a region of another
//! protection domain, a stale QP handle after removal, a panic in the middle of handing out a
//! batch, and completions of other QPs met while one is torn down. Reusing a region while it is
//! posted does not compile (the region moved into the lane; see the `compile_fail` example in
//! the `lane` module's docs). Where an attempt needs the raw escape hatch, the unsafe block
//! says so.

mod common;

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use common::lane::{
    after_back_to_init, attached_pair, back_to_init, lane_on, lane_pair, posts_fail_naming_none, reap,
    wait_until_the_closure_panics, LaneSide,
};
use common::{mr_count, pair, DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{Lane, LaneQp, PreparedSend, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Error, MemoryRegion};

fn spec() -> PairSpec {
    PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    }
}

fn region(side: &LaneSide) -> MemoryRegion {
    MemoryRegion::new(&side.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap()
}

/// Dropping a lane whose QPs have receives (never matched) and WRITEs posted: the drop moves the
/// QPs to the error state, reaps the flush within its bound, destroys them and only then frees
/// the regions; nothing leaks.
#[test]
fn dropping_a_lane_with_work_in_flight_frees_everything_after_the_qps() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        for k in 0..8 {
            a.lane.post_recv(a.qp, RecvWr::new(region(&a)).wr_id(k)).unwrap();
        }
        let pd = a.pd.clone();
        let wrs = (0..8).map(|k| {
            let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
            SendWr::write(mr, 0..4096, &remote, 0).wr_id(k).unsignaled()
        });
        assert_eq!(a.lane.post_send_iter(a.qp, wrs).unwrap(), 8);
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (8, 8));
        let started = Instant::now();
        drop(a);
        // The flush is reaped within 2 s; the bound leaves room for a guest on a busy host, and
        // still catches a teardown that waits for the kernel (tens of seconds, or minutes).
        assert!(started.elapsed() < Duration::from_secs(15), "teardown is bounded: {:?}", started.elapsed());
        drop((b, pd));
    }
    t.finish();
}

/// Forgetting a lane with a receive posted leaks the region (and the QP) instead of freeing
/// memory the device may still write. Run in a child process, whose exit releases what the
/// leak kept (the kernel tears down its RDMA objects).
#[test]
fn forgetting_a_lane_with_a_receive_posted_leaks_the_region() {
    const CHILD: &str = "RDMA_CM_LANE_FORGET_CHILD";
    let t = DeviceTest::start();
    if std::env::var_os(CHILD).is_some() {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let before = mr_count();
        a.lane.post_recv(a.qp, RecvWr::new(region(&a)).wr_id(1)).unwrap();
        std::mem::forget(a);
        // The region is still registered, and the peer may still write it: the memory was not
        // freed, so its write lands in leaked memory, not in anything Rust reuses.
        if let Some(n) = before {
            assert_eq!(mr_count(), Some(n + 1), "the posted region stays registered");
        }
        let msg = b.mrs.remove(0);
        b.lane.post_send(b.qp, SendWr::send(msg, 0..64)).unwrap();
        let c = reap(&mut b.lane, 1).pop().unwrap();
        assert!(c.is_ok(), "{c:?}");
        std::mem::forget(b);
        return;
    }
    let me = std::env::current_exe().unwrap();
    let st = std::process::Command::new(me)
        .args(["--exact", "forgetting_a_lane_with_a_receive_posted_leaks_the_region", "--test-threads=1"])
        .env(CHILD, "1")
        .status()
        .unwrap();
    assert!(st.success(), "the child failed: {st}");
    t.finish();
}

/// A post the provider refuses without saying how far it got (rxe: a send while the QP is not
/// ready returns EINVAL with `bad_wr` NULL, yet keeps the WQE): the lane keeps the region, moves
/// the QP to the error state, and the flush hands the region back.
#[test]
fn a_post_that_fails_without_bad_wr_keeps_the_region_until_the_flush() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        back_to_init(&mut a);
        let wr = SendWr::send(region(&a), 0..64).wr_id(5);
        let r = posts_fail_naming_none(&mut a, |a| a.lane.post_send(a.qp, wr)).unwrap_err();
        assert!(r.to_string().contains("without saying"), "{r}");
        assert!(r.into_inner().is_none(), "the region is not given back: the provider may have it");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (1, 0));
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.wr_id() == 5 && after_back_to_init(c.status()), "{c:?}");
        assert!(c.take_region().is_some(), "the flush hands it back");
        // Posts are refused from then on (nothing posted to a QP in error can run).
        let r = a.lane.post_recv(a.qp, RecvWr::new(region(&a))).unwrap_err();
        assert!(matches!(r.error(), Error::QpInError { .. }), "{r}");
        drop((a, b, r));
    }
    t.finish();
}

/// The prepared twin of the test above, after the prepared post began to put its region into
/// the queue's next slot *before* calling the provider (so nothing holds it across the call):
/// a post the provider refuses without saying how far it got must leave the region in that
/// slot, committed, and not back in the request; the flush hands it back, once, and the
/// request re-arms with it. A second post is refused with the region kept in the request.
#[test]
fn a_prepared_post_that_fails_without_bad_wr_keeps_the_region_until_the_flush() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let mut p = a.lane.prepare_send(a.qp, SendWr::send(region(&a), 0..64).wr_id(7)).unwrap();
        back_to_init(&mut a);
        let e = posts_fail_naming_none(&mut a, |a| a.lane.post_prepared(&mut p)).unwrap_err();
        assert!(e.to_string().contains("without saying"), "{e}");
        assert!(!p.is_armed(), "the region is not given back: the provider may have it");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (1, 0), "held in its slot, committed");
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.wr_id() == 7 && after_back_to_init(c.status()), "{c:?}");
        p.rearm(c.take_region().expect("the flush hands it back")).map_err(|r| r.into_parts().0).unwrap();
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        let e = a.lane.post_prepared(&mut p).unwrap_err();
        assert!(matches!(e, Error::QpInError { .. }), "{e}");
        assert!(p.is_armed(), "refused before the provider: the region stays in the request");
        assert!(a.lane.poll().unwrap().is_none(), "nothing else comes out");
        drop((a, b, p));
    }
    t.finish();
}

/// The poll's common case tests one flag (`backlog`) instead of the poll buffer, the retiring
/// completion and the kept ones. Attempts to leave something buffered with the flag clear
/// (debug builds also assert the flag against the state at every poll):
/// - four receive completions taken by one `ibv_poll_cq` (on rxe the responder writes a
///   receive's completion before it acknowledges the send, so once the sender has all four
///   send completions, the receiver's CQ holds all four) and handed out one per poll, with a
///   panic in the closure on the second;
/// - a signaled WRITE that retires seven unsignaled ones, handed out one per poll.
///
/// Every completion comes out once, in order, with its region. (A QP torn down while another's
/// completions sit in the buffer: `removing_one_qp_keeps_the_other_qps_completions`.)
#[test]
fn the_polls_one_flag_never_hides_a_buffered_or_retiring_completion() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let pd = a.pd.clone();
        let mr = || MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap();
        for k in 0..4 {
            b.lane.post_recv(b.qp, RecvWr::new(region(&b)).wr_id(k)).unwrap();
        }
        for k in 0..4 {
            a.lane.post_send(a.qp, SendWr::send(mr(), 0..64).wr_id(k)).unwrap();
        }
        assert!(reap(&mut a.lane, 4).iter().all(|c| c.is_ok()));
        let mut seen = Vec::new();
        let poll = |lane: &mut rdma_cm::verbs::lane::Lane, seen: &mut Vec<(u64, bool)>| {
            lane.wait_with(1, T, |c, r| seen.push((c.wr_id(), c.is_ok() && r.is_some()))).unwrap();
        };
        poll(&mut b.lane, &mut seen);
        let r = catch_unwind(AssertUnwindSafe(|| {
            b.lane.poll_with(1, |c, _| panic!("the caller fails on completion {}", c.wr_id())).unwrap()
        }));
        assert!(r.is_err(), "the second receive's completion was there and handed to the closure");
        poll(&mut b.lane, &mut seen);
        poll(&mut b.lane, &mut seen);
        assert_eq!(seen, vec![(0, true), (2, true), (3, true)], "completion 1 went with the panic");
        assert!(b.lane.poll().unwrap().is_none());
        assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 0));

        for k in 10..18 {
            let w = SendWr::write(mr(), 0..64, &remote, 0).wr_id(k);
            a.lane.post_send(a.qp, if k < 17 { w.unsignaled() } else { w }).unwrap();
        }
        let mut ids = Vec::new();
        for _ in 0..8 {
            poll(&mut a.lane, &mut ids);
        }
        assert_eq!(ids, (10..18).map(|k| (k, true)).collect::<Vec<_>>());
        assert!(a.lane.poll().unwrap().is_none());
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b, pd));
    }
    t.finish();
}

/// The list twin: a prepared list the provider refuses without naming an entry (its regions
/// were put into their slots before the call) keeps every region as posted, in order, moves
/// the QP to the error state, and the flush hands each region back to re-arm its own request.
#[test]
fn a_prepared_list_that_fails_without_bad_wr_keeps_every_region_until_the_flush() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let mut ps: Vec<_> =
            (0..4).map(|k| a.lane.prepare_send(a.qp, SendWr::send(region(&a), 0..64).wr_id(k)).unwrap()).collect();
        back_to_init(&mut a);
        let e = posts_fail_naming_none(&mut a, |a| a.lane.post_prepared_list(&mut ps)).unwrap_err();
        assert!(e.to_string().contains("without saying"), "{e}");
        assert!(ps.iter().all(|p| !p.is_armed()), "no region given back: the provider may have them");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (4, 0));
        let flushed = reap(&mut a.lane, 4);
        assert_eq!(flushed.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        for mut c in flushed {
            assert!(after_back_to_init(c.status()), "{c:?}");
            let k = c.wr_id() as usize;
            ps[k].rearm(c.take_region().expect("the flush hands it back")).map_err(|r| r.into_parts().0).unwrap();
        }
        let e = a.lane.post_prepared_list(&mut ps).unwrap_err();
        assert!(matches!(e, Error::QpInError { .. }), "{e}");
        assert!(ps.iter().all(|p| p.is_armed()), "refused before the provider: every region stays");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b, ps));
    }
    t.finish();
}

/// A panic in the closure on a lone completion, which
/// is deterministically the poll's straight-line case (one work request outstanding, so
/// `ibv_poll_cq` can find at most one): the region goes with the panic, nothing is left
/// buffered or flagged, and the lane carries on.
#[test]
fn a_panic_on_a_lone_completion_leaves_the_lane_usable() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let before = mr_count();
        a.lane.post_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(1)).unwrap();
        wait_until_the_closure_panics(&mut a.lane, 4);
        if let Some(n) = before {
            assert_eq!(mr_count(), Some(n), "its region went with the panic");
        }
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none());
        a.lane.post_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(2)).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 2 && c.take_region().is_some(), "{c:?}");
        drop((a, b));
    }
    t.finish();
}

/// A signaled WRITE that retires seven unsignaled ones, reached from the
/// poll's straight-line case (its completion is the only one the CQ will hold: the other QP's
/// receives never complete); the closure panics on the first retired slot; two more are handed
/// out; then the other QP is removed while the completion is still retiring (its teardown
/// keeps the half-retired completion). The rest come out in order, each once, with regions.
#[test]
fn a_retiring_completion_survives_a_panic_and_another_qps_removal() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 256);
        let (q1, pd1, b1) = attached_pair(&mut lane, t.addr, spec());
        let (q2, pd2, b2) = attached_pair(&mut lane, t.addr, spec());
        let remote = b2.mrs[0].remote();
        let mr = |pd: &std::sync::Arc<rdma_cm::ProtectionDomain>| {
            MemoryRegion::new(pd, 64, AccessFlags::LOCAL_WRITE).unwrap()
        };
        for k in 0..4 {
            lane.post_recv(q1, RecvWr::new(mr(&pd1)).wr_id(100 + k)).unwrap();
        }
        for k in 0..8 {
            let w = SendWr::write(mr(&pd2), 0..64, &remote, 0).wr_id(k);
            lane.post_send(q2, if k < 7 { w.unsignaled() } else { w }).map_err(|r| r.into_parts().0).unwrap();
        }
        wait_until_the_closure_panics(&mut lane, 1);
        let mut seen = Vec::new();
        assert_eq!(lane.poll_with(2, |c, m| seen.push((c.wr_id(), m.is_some(), c.qp()))).unwrap(), 2);
        lane.remove(q1).unwrap();
        let rest = reap(&mut lane, 5);
        seen.extend(rest.into_iter().map(|mut c| (c.wr_id(), c.take_region().is_some(), c.qp())));
        assert_eq!(seen, (1..8).map(|k| (k, true, Some(q2))).collect::<Vec<_>>());
        assert_eq!(lane.outstanding(q2).unwrap(), (0, 0));
        assert!(lane.poll().unwrap().is_none());
        drop((lane, b1, b2, pd1, pd2));
    }
    t.finish();
}

/// The one-pass list over the slot a panicked `post_send_iter` left staged.
/// A list that fails its check at entry 2 (a QP of the same lane at another place), then one
/// whose entry 2 is unarmed: each of entries 0 and 1 gets back *its own* region (`rearm`
/// refuses any other, so swapped slots would show), and the staged region is released once.
#[test]
fn a_prepared_list_failing_its_check_after_a_staged_leftover_returns_each_own_region() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 256);
        let (qa, pda, ba) = attached_pair(&mut lane, t.addr, spec());
        let (qb, pdb, bb) = attached_pair(&mut lane, t.addr, spec());
        let (ra, rb) = (ba.mrs[0].remote(), bb.mrs[0].remote());
        let mk = |lane: &mut Lane, q, pd, remote: &rdma_cm::RemoteRegion, k| {
            let mr = MemoryRegion::new(pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            lane.prepare_send(q, SendWr::write(mr, 0..64, remote, 0).wr_id(k)).map_err(|r| r.into_parts().0).unwrap()
        };
        let before = mr_count();
        let (pd, rc) = (pda.clone(), ra);
        let mut once = false;
        let wrs = std::iter::from_fn(move || {
            assert!(!once, "the caller's iterator fails on its second call");
            once = true;
            Some(SendWr::write(MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap(), 0..64, &rc, 0))
        });
        assert!(catch_unwind(AssertUnwindSafe(|| lane.post_send_iter(qa, wrs))).is_err());
        let mut ps =
            vec![mk(&mut lane, qa, &pda, &ra, 0), mk(&mut lane, qa, &pda, &ra, 1), mk(&mut lane, qb, &pdb, &rb, 2)];
        let e = lane.post_prepared_list(&mut ps).expect_err("two QPs");
        assert!(e.to_string().contains("one QP"), "{e}");
        if let Some(n) = before {
            assert_eq!(mr_count(), Some(n + 3), "the staged leftover released, the three held");
        }
        for p in ps.iter_mut() {
            let own = p.take_region().expect("armed");
            p.rearm(own).map_err(|r| r.into_parts().0).expect("its own region came back");
        }
        ps[2] = mk(&mut lane, qa, &pda, &ra, 2);
        let third = ps[2].take_region().unwrap();
        let e = lane.post_prepared_list(&mut ps).expect_err("entry 2 unarmed");
        assert!(e.to_string().contains("holds no region"), "{e}");
        ps[2].rearm(third).map_err(|r| r.into_parts().0).unwrap();
        for p in ps.iter_mut().take(2) {
            let own = p.take_region().expect("armed");
            p.rearm(own).map_err(|r| r.into_parts().0).expect("its own region came back");
        }
        assert_eq!(lane.outstanding(qa).unwrap(), (0, 0));
        assert_eq!(lane.post_prepared_list(&mut ps).unwrap(), 3);
        for mut c in reap(&mut lane, 3) {
            assert!(c.is_ok() && c.qp() == Some(qa), "{c:?}");
            ps[c.wr_id() as usize].rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        assert!(lane.poll().unwrap().is_none());
        drop((lane, ba, bb, ps, pda, pdb));
    }
    t.finish();
}

/// An empty list posts nothing; a list whose *first* entry is another lane's
/// is refused with every region in place; `poll_with(0, ..)` hands out nothing even with a
/// completion waiting.
#[test]
fn empty_lists_foreign_first_entries_and_zero_polls_change_nothing() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let (mut c, d) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        assert_eq!(a.lane.post_prepared_list(&mut []).unwrap(), 0);
        let foreign = c.lane.prepare_send(c.qp, SendWr::write(region(&c), 0..64, &remote, 0)).unwrap();
        let own = a.lane.prepare_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(5)).unwrap();
        let mut ps = vec![foreign, own];
        let e = a.lane.post_prepared_list(&mut ps).expect_err("first entry of another lane");
        assert!(e.to_string().contains("not attached"), "{e}");
        assert!(ps.iter().all(|p| p.is_armed()));
        let mut own = ps.pop().unwrap();
        a.lane.post_prepared(&mut own).unwrap();
        assert_eq!(a.lane.poll_with(0, |_, _| panic!("max 0 hands out nothing")).unwrap(), 0);
        let mut done = reap(&mut a.lane, 1).pop().unwrap();
        assert_eq!(done.wr_id(), 5);
        own.rearm(done.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b, c, d, ps, own));
    }
    t.finish();
}

/// `LaneQp`'s hand-written equality and hash (the attach number alone): handles of two lanes,
/// and of two QPs attached at one place one after the other, are distinct members of a set,
/// and a completion's `qp()` finds its handle there.
#[test]
fn lane_handles_hash_as_they_compare() {
    let t = DeviceTest::start();
    {
        let mut l1 = lane_on(t.addr, 128);
        let mut l2 = lane_on(t.addr, 128);
        let (a, _pa, sa) = attached_pair(&mut l1, t.addr, spec());
        let (b, _pb, sb) = attached_pair(&mut l2, t.addr, spec());
        l1.remove(a).unwrap();
        let (a2, pa2, sa2) = attached_pair(&mut l1, t.addr, spec());
        let set: HashSet<LaneQp> = [a, b, a2, a2].into_iter().collect();
        assert_eq!(set.len(), 3, "{a:?} {b:?} {a2:?}");
        let remote = sa2.mrs[0].remote();
        let mr = MemoryRegion::new(&pa2, 64, AccessFlags::empty()).unwrap();
        l1.post_send(a2, SendWr::write(mr, 0..64, &remote, 0)).unwrap();
        let c = reap(&mut l1, 1).pop().unwrap();
        let q = c.qp().unwrap();
        assert!(set.contains(&q) && q == a2 && q != a && q != b, "{q:?}");
        drop((l1, l2, sa, sb, sa2, c));
    }
    t.finish();
}

/// Sixteen unsignaled single sends fill the send queue: the one that takes the last slot is
/// signaled whatever it asked, so the queue drains; the seventeenth is refused with its region.
#[test]
fn posting_past_the_queue_depth_is_refused_and_a_full_unsignaled_queue_drains() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        for k in 0..16 {
            a.lane.post_send(a.qp, SendWr::write(region(&a), 0..8, &remote, 0).wr_id(k).unsignaled()).unwrap();
        }
        let r = a.lane.post_send(a.qp, SendWr::write(region(&a), 0..8, &remote, 0).unsignaled()).unwrap_err();
        assert!(matches!(r.error(), Error::QueueFull { queue: "send", .. }), "{r}");
        assert!(r.into_inner().is_some());
        let done = reap(&mut a.lane, 16);
        assert_eq!(done.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), (0..16).collect::<Vec<_>>());
        assert!(done[15].is_signaled(), "the last slot's work request was signaled");
        assert!(done.into_iter().all(|mut c| c.take_region().is_some()));
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b));
    }
    t.finish();
}

/// A region of another protection domain (the peer's) is refused before posting, and given
/// back.
#[test]
fn a_region_of_another_protection_domain_is_refused() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let theirs = region(&b);
        let r = a.lane.post_recv(a.qp, RecvWr::new(theirs)).unwrap_err();
        assert!(r.to_string().contains("another protection domain"), "{r}");
        let theirs = r.into_inner().unwrap();
        let r = a.lane.post_send(a.qp, SendWr::send(theirs, 0..8)).unwrap_err();
        assert!(r.to_string().contains("another protection domain"), "{r}");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b, r));
    }
    t.finish();
}

/// After `remove`, the old handle is refused everywhere, and a QP attached at the same place
/// gets another handle (a new attach number), so nothing addressed to the old one
/// (a post, or a late completion carrying its tag) reaches the new one.
#[test]
fn a_removed_qps_handle_and_completions_reach_nothing() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 128);
        let (old, pd1, b1) = attached_pair(&mut lane, t.addr, spec());
        for k in 0..4 {
            lane.post_recv(old, RecvWr::new(MemoryRegion::new(&pd1, 64, AccessFlags::LOCAL_WRITE).unwrap()).wr_id(k))
                .unwrap();
        }
        lane.remove(old).unwrap();
        assert!(lane.outstanding(old).is_err());
        let r = lane.post_recv(old, RecvWr::new(MemoryRegion::new(&pd1, 64, AccessFlags::LOCAL_WRITE).unwrap()));
        assert!(r.unwrap_err().to_string().contains("not attached"));
        let (new, pd2, b2) = attached_pair(&mut lane, t.addr, spec());
        assert_ne!(old, new, "a new handle for the same place");
        assert!(lane.outstanding(old).is_err(), "the old one stays refused");
        // The new QP works, and the lane hands out nothing of the old one's.
        let remote = b2.mrs[0].remote();
        let mr = MemoryRegion::new(&pd2, 64, AccessFlags::empty()).unwrap();
        lane.post_send(new, SendWr::write(mr, 0..64, &remote, 0).wr_id(9)).unwrap();
        let c = reap(&mut lane, 1).pop().unwrap();
        assert_eq!((c.wr_id(), c.qp()), (9, Some(new)), "{c:?}");
        assert!(lane.poll().unwrap().is_none());
        drop((lane, b1, b2, pd1, pd2, c));
    }
    t.finish();
}

/// Tearing one QP down while another's completions are in the CQ: those completions are kept
/// and handed out afterwards, in order, each with its region.
#[test]
fn removing_one_qp_keeps_the_other_qps_completions() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 128);
        let client = |lane: &rdma_cm::verbs::lane::Lane| PairSpec { init: lane.qp_init(), ..spec() };
        let (a1, b1) = pair(t.addr, client(&lane), spec());
        let (a2, b2) = pair(t.addr, client(&lane), spec());
        let (pd1, pd2) = (a1.pd.clone(), a2.pd.clone());
        let q1 = lane.attach(a1.conn).unwrap();
        let q2 = lane.attach(a2.conn).unwrap();
        let remote = b2.mrs[0].remote();
        for k in 0..8 {
            lane.post_recv(q1, RecvWr::new(MemoryRegion::new(&pd1, 64, AccessFlags::LOCAL_WRITE).unwrap()).wr_id(k))
                .unwrap();
        }
        let wrs = (0..8).map(|k| {
            SendWr::write(MemoryRegion::new(&pd2, 64, AccessFlags::empty()).unwrap(), 0..64, &remote, 0).wr_id(k)
        });
        assert_eq!(lane.post_send_iter(q2, wrs).unwrap(), 8);
        // The removal reaps the CQ until q1's flush is in; q2's WRITEs completing meanwhile are
        // kept (however many that is: the property holds either way).
        lane.remove(q1).unwrap();
        let done = reap(&mut lane, 8);
        assert_eq!(done.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        assert!(done.iter().all(|c| c.qp() == Some(q2) && c.is_ok()));
        assert!(done.into_iter().all(|mut c| c.take_region().is_some()));
        assert_eq!(lane.outstanding(q2).unwrap(), (0, 0));
        drop((lane, b1, b2, pd1, pd2));
    }
    t.finish();
}

/// A panic in the closure that takes the completions, in the middle of a batch: the completion
/// it held is dropped (the device is done with its region), and every other one is still handed
/// out by the next poll, in order.
#[test]
fn a_panic_while_handing_out_a_batch_loses_no_completion() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let pd = a.pd.clone();
        let wrs = (0..16).map(|k| {
            let w =
                SendWr::write(MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap(), 0..64, &remote, 0).wr_id(k);
            if k < 15 {
                w.unsignaled()
            } else {
                w
            }
        });
        assert_eq!(a.lane.post_send_iter(a.qp, wrs).unwrap(), 16);
        // Wait for the signaled completion, which retires all sixteen, until the closure
        // panics on completion 3 (a wait may end with fewer than three handed out first).
        let mut seen = Vec::new();
        loop {
            let r = catch_unwind(AssertUnwindSafe(|| {
                a.lane
                    .wait_with(16, T, |c, _region| {
                        if c.wr_id() == 3 {
                            panic!("the caller fails while taking completion 3");
                        }
                        seen.push(c.wr_id());
                    })
                    .unwrap()
            }));
            if r.is_err() {
                break;
            }
        }
        assert_eq!(seen, vec![0, 1, 2]);
        let rest = reap(&mut a.lane, 12);
        assert_eq!(rest.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), (4..16).collect::<Vec<_>>());
        assert!(rest.into_iter().all(|mut c| c.take_region().is_some()));
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b, pd));
    }
    t.finish();
}

/// A panic in the closure on the first completion a poll finds (the poll's straight-line case
/// when `ibv_poll_cq` finds just one, the general loop when it finds several: four WRITEs
/// complete at their own pace; the lone case alone is
/// `a_panic_on_a_lone_completion_leaves_the_lane_usable`): the region given to the closure is
/// dropped with it (deregistered: the device is done with it), and the completions that poll
/// reaped with it, or left in the CQ, come out of the next polls in order.
#[test]
fn a_panic_on_the_first_completion_of_a_poll_loses_no_other() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let pd = a.pd.clone();
        let before = mr_count();
        for k in 0..4 {
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap();
            a.lane.post_send(a.qp, SendWr::write(mr, 0..64, &remote, 0).wr_id(k)).unwrap();
        }
        wait_until_the_closure_panics(&mut a.lane, 1);
        if let Some(before) = before {
            assert_eq!(mr_count(), Some(before + 3), "the panicking closure's region is deregistered, the others held");
        }
        let rest = reap(&mut a.lane, 3);
        assert_eq!(rest.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert!(rest.into_iter().all(|mut c| c.is_ok() && c.take_region().is_some()));
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b, pd));
    }
    t.finish();
}

/// A batch whose iterator panics after yielding one request leaves that request staged, never
/// posted; the next post takes the same slot. It must neither free a region the device is using
/// nor lose the next request's completion (a debug
/// assertion on the staged slot panicked after the provider had taken the request, dropping its
/// region under the device).
#[test]
fn a_post_after_a_panicking_batch_iterator_loses_nothing() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let pd = a.pd.clone();
        let first = SendWr::write(region(&a), 0..64, &remote, 0).wr_id(1);
        let mut yielded = false;
        let wrs = std::iter::from_fn(move || {
            assert!(!yielded, "the iterator panics on its second call");
            yielded = true;
            Some(SendWr::write(MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap(), 0..64, &remote, 0))
        });
        let r = catch_unwind(AssertUnwindSafe(|| a.lane.post_send_iter(a.qp, wrs)));
        assert!(r.is_err(), "the iterator's panic reaches the caller");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0), "nothing was posted");
        a.lane.post_send(a.qp, first).map_err(|r| r.into_parts().0).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 1, "{c:?}");
        assert!(c.take_region().is_some(), "the posted region comes back with its completion");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b));
    }
    t.finish();
}

/// An iterator that yields two requests and then
/// panics in its own drop, after the post's loop has staged both: the staged regions are
/// released (never posted, so nothing of the device's), nothing is posted, and the queue takes
/// the next post as if nothing had happened.
#[test]
fn an_iterator_panicking_in_its_drop_leaves_nothing_staged() {
    struct Bomb(Vec<SendWr>);
    impl Iterator for Bomb {
        type Item = SendWr;
        fn next(&mut self) -> Option<SendWr> {
            self.0.pop()
        }
    }
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("the iterator's drop panics");
        }
    }
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let before = mr_count();
        let wrs = Bomb((0..2).map(|k| SendWr::write(region(&a), 0..64, &remote, 64 * k).wr_id(k)).collect());
        let r = catch_unwind(AssertUnwindSafe(|| a.lane.post_send_iter(a.qp, wrs)));
        assert!(r.is_err(), "the drop's panic reaches the caller");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0), "nothing was posted");
        if let Some(n) = before {
            assert_eq!(mr_count(), Some(n), "both staged regions were released (deregistered)");
        }
        // The slots the two were staged in take the next posts, which come back whole.
        for k in 0..3 {
            a.lane
                .post_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(10 + k))
                .map_err(|r| r.into_parts().0)
                .unwrap();
        }
        let done = reap(&mut a.lane, 3);
        assert_eq!(done.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [10, 11, 12]);
        assert!(done.into_iter().all(|mut c| c.is_ok() && c.take_region().is_some()));
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b));
    }
    t.finish();
}

/// The CQ is asked for no more than the caller's `max`: ten completions reaped three at a time
/// come in order, none lost and none handed out twice, each call handing out at most three.
#[test]
fn a_burst_reaped_a_few_at_a_time_loses_nothing() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        for k in 0..10 {
            a.lane
                .post_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(k))
                .map_err(|r| r.into_parts().0)
                .unwrap();
        }
        let (mut ids, mut regions) = (Vec::new(), 0);
        while ids.len() < 10 {
            let n = a
                .lane
                .wait_with(3, T, |wc, mr| {
                    assert!(wc.is_ok(), "{wc:?}");
                    ids.push(wc.wr_id());
                    regions += mr.is_some() as usize;
                })
                .unwrap();
            assert!(n <= 3, "{n} handed out by a wait for 3");
        }
        assert_eq!(ids, (0..10).collect::<Vec<_>>());
        assert_eq!(regions, 10, "every region back once");
        assert_eq!(a.lane.poll_with(3, |_, _| panic!("nothing is left")).unwrap(), 0);
        drop((a, b));
    }
    t.finish();
}

/// A handle of another lane names nothing here, even where its place and generation match one
/// of this lane's QPs.
#[test]
fn another_lanes_handle_is_refused() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let r = a.lane.post_recv(b.qp, RecvWr::new(region(&a)));
        let e = r.expect_err("b's handle on a's lane");
        assert!(e.to_string().contains("not attached"), "{e}");
        assert!(e.into_inner().is_some(), "the region comes back");
        assert!(a.lane.outstanding(b.qp).is_err());
        drop((a, b));
    }
    t.finish();
}

/// A prepared work request was checked against one region: re-arming it with another region
/// (same PD, same size), or while it still holds its own, is refused with the region given
/// back; and once the region it was prepared with is dropped, no new region re-arms it, even
/// one the allocator places at the old one's address (regions are recognised by a number that
/// is never reused). While posted it holds no region: nothing reaches the memory, and a
/// second post of it is refused.
#[test]
fn a_prepared_request_takes_back_only_its_own_region() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let mut recv = b.lane.prepare_recv(b.qp, RecvWr::new(region(&b)).wr_id(3)).unwrap();
        let other = region(&b);
        let r = recv.rearm(other).expect_err("already armed");
        assert!(r.to_string().contains("already holds"), "{r}");
        let other = r.into_inner().expect("given back");
        b.lane.post_prepared_recv(&mut recv).unwrap();
        let r = recv.rearm(other).expect_err("a region it was not prepared with");
        assert!(r.to_string().contains("not the region"), "{r}");
        let other = r.into_inner().expect("given back");
        // Nothing reaches the receive's memory while it is posted: the request is unarmed.
        assert!(recv.region().is_none() && recv.take_region().is_none());
        let e = recv.as_mut_slice().expect_err("no bytes while posted");
        assert!(e.to_string().contains("as_mut_slice") && e.to_string().contains("holds no region"), "{e}");
        assert!(recv.read_at(0, &mut [0; 4]).is_err() && recv.write_at(0, &[1]).is_err() && recv.as_slice().is_err());
        let e = b.lane.post_prepared_recv(&mut recv).expect_err("posting it twice");
        assert!(e.to_string().contains("holds no region"), "{e}");
        assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 1), "posted once");
        a.lane.post_send(a.qp, SendWr::send(region(&a), 0..64)).unwrap();
        reap(&mut a.lane, 1);
        let mut c = reap(&mut b.lane, 1).pop().unwrap();
        let own = c.take_region().unwrap();
        // Dropped, then registered anew: whatever address the allocator hands out, the request
        // refuses it.
        drop(own);
        let fresh: Vec<MemoryRegion> = (0..8).map(|_| region(&b)).collect();
        for f in fresh {
            let r = recv.rearm(f).expect_err("a new region, maybe at the old one's address");
            assert!(r.to_string().contains("not the region"), "{r}");
        }
        drop((a, b, other, recv));
    }
    t.finish();
}

/// A prepared request outlives its QP: after `remove`, and after another QP is attached at
/// the same place, its post is refused (the place's generation moved on), and another lane
/// refuses it too; the region stays in the request.
#[test]
fn a_prepared_request_of_a_removed_qp_or_another_lane_is_refused() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 128);
        let (old, pd1, b1) = attached_pair(&mut lane, t.addr, spec());
        let remote = b1.mrs[0].remote();
        let mr = MemoryRegion::new(&pd1, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut p = lane.prepare_send(old, SendWr::write(mr, 0..64, &remote, 0)).unwrap();
        lane.remove(old).unwrap();
        let e = lane.post_prepared(&mut p).expect_err("its QP is gone");
        assert!(e.to_string().contains("not attached"), "{e}");
        let (new, _pd2, b2) = attached_pair(&mut lane, t.addr, spec());
        let place = |q: rdma_cm::verbs::lane::LaneQp| format!("{q:?}").split(',').next().unwrap().to_string();
        assert_eq!(place(p.qp()), place(new), "the same place: {:?} {new:?}", p.qp());
        assert_ne!(p.qp(), new);
        let e = lane.post_prepared(&mut p).expect_err("a new QP at the same place");
        assert!(e.to_string().contains("not attached"), "{e}");
        assert!(p.is_armed(), "the region stays in the request");
        assert_eq!(lane.outstanding(new).unwrap(), (0, 0));
        // Another lane refuses it as well.
        let (mut c, d) = lane_pair(t.addr, spec(), spec(), 64);
        let e = c.lane.post_prepared(&mut p).expect_err("another lane's request");
        assert!(e.to_string().contains("not attached"), "{e}");
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
        drop((lane, b1, b2, c, d, p, pd1));
    }
    t.finish();
}

/// A list of prepared requests is all or nothing before the provider: one unarmed entry, or
/// entries for two QPs, post none of them and leave every region where it was; a list longer
/// than the free slots is refused the same way.
#[test]
fn a_prepared_list_checks_every_entry_before_posting_any() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let (mut c, d) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let prep = |side: &mut LaneSide, k: u64| {
            let mr = region(side);
            side.lane.prepare_send(side.qp, SendWr::write(mr, 0..64, &remote, 0).wr_id(k)).unwrap()
        };
        let mut ps: Vec<_> = (0..4).map(|k| prep(&mut a, k)).collect();
        let taken = ps[2].take_region().unwrap();
        let e = a.lane.post_prepared_list(&mut ps).expect_err("one is not armed");
        assert!(e.to_string().contains("holds no region"), "{e}");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert_eq!(ps.iter().filter(|p| p.is_armed()).count(), 3, "the others keep their regions");
        ps[2].rearm(taken).unwrap();
        ps.push(prep(&mut c, 9));
        let e = a.lane.post_prepared_list(&mut ps).expect_err("two QPs in one list");
        assert!(e.to_string().contains("one QP"), "{e}");
        assert!(ps.iter().all(|p| p.is_armed()));
        ps.pop();
        let mut many: Vec<_> = (0..17).map(|k| prep(&mut a, k)).collect();
        let e = a.lane.post_prepared_list(&mut many).expect_err("17 requests, 16 slots");
        assert!(matches!(e, Error::QueueFull { .. }), "{e}");
        assert!(many.iter().all(|p| p.is_armed()));
        assert_eq!(a.lane.post_prepared_list(&mut ps).unwrap(), 4);
        assert!(ps.iter().all(|p| !p.is_armed()), "posted: the lane holds the regions");
        let done = reap(&mut a.lane, 4);
        assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
        drop((a, b, c, d, ps, many, done));
    }
    t.finish();
}

/// A region derived from the one a request was
/// prepared with is still another region. Its chunks (`split`), a sibling chunk of the same
/// registration, and the same buffer registered again after `into_buffer` are all refused by
/// `rearm`, each given back; the request takes its own region back.
#[test]
fn a_prepared_request_refuses_chunks_siblings_and_reregistrations_of_its_region() {
    let t = DeviceTest::start();
    {
        let (_a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let refused = |p: &mut rdma_cm::verbs::lane::PreparedRecv, mr: MemoryRegion| {
            let r = p.rearm(mr).expect_err("a region it was not prepared with");
            assert!(r.to_string().contains("not the region"), "{r}");
            r.into_inner().expect("given back")
        };
        // A chunk of a split registration; its sibling is refused.
        let mut chunks = region(&b).split(1024).unwrap();
        let sibling = chunks.pop().unwrap();
        let mut p = b.lane.prepare_recv(b.qp, RecvWr::new(chunks.remove(0)).wr_id(1)).unwrap();
        let own = p.take_region().unwrap();
        let sibling = refused(&mut p, sibling);
        // The chunk split again: same memory, new regions.
        let pieces = own.split(256).unwrap();
        let pieces: Vec<_> = pieces.into_iter().map(|c| refused(&mut p, c)).collect();
        assert!(!p.is_armed());
        drop((pieces, sibling, chunks));
        // A buffer given back by `into_buffer` and registered again.
        let buf = vec![0u8; 4096].into_boxed_slice();
        let mr = MemoryRegion::register(&b.pd, buf, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = b.lane.prepare_recv(b.qp, RecvWr::new(mr).wr_id(2)).unwrap();
        let buf = q.take_region().unwrap().into_buffer().unwrap();
        let again = MemoryRegion::register(&b.pd, buf, AccessFlags::LOCAL_WRITE).unwrap();
        let again = refused(&mut q, again);
        // A request never holds a region it was not checked against: nothing was posted.
        assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 0));
        drop((again, p, q));
    }
    t.finish();
}

/// A prepared request's region taken out and posted through the ordinary path
/// leaves the request unarmed (its post is refused, nothing doubly posted); the completion
/// hands the region back, the request re-arms with it and posts again.
#[test]
fn a_prepared_requests_region_posted_through_the_ordinary_path_comes_back_once() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut p = a.lane.prepare_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(7)).unwrap();
        let mr = p.take_region().unwrap();
        a.lane.post_send(a.qp, SendWr::write(mr, 0..128, &remote, 0).wr_id(8)).map_err(|r| r.into_parts().0).unwrap();
        let e = a.lane.post_prepared(&mut p).expect_err("its region is in the lane");
        assert!(e.to_string().contains("holds no region"), "{e}");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (1, 0), "posted once");
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 8, "{c:?}");
        p.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        a.lane.post_prepared(&mut p).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 7, "{c:?}");
        assert!(c.take_region().is_some());
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b, p));
    }
    t.finish();
}

/// A `post_send_iter` whose iterator panics leaves a request staged beyond the
/// tail; a prepared post (one, then a list) takes that slot. Nothing may be freed under the
/// device, and every posted region comes back with its completion.
#[test]
fn a_prepared_post_after_a_panicking_batch_iterator_loses_nothing() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let panicking = |a: &mut LaneSide| {
            let pd = a.pd.clone();
            let mut yielded = false;
            let wrs = std::iter::from_fn(move || {
                assert!(!yielded, "the iterator panics on its second call");
                yielded = true;
                Some(SendWr::write(MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap(), 0..64, &remote, 0))
            });
            assert!(catch_unwind(AssertUnwindSafe(|| a.lane.post_send_iter(a.qp, wrs))).is_err());
            assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0), "nothing was posted");
        };
        let mut p = a.lane.prepare_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(1)).unwrap();
        panicking(&mut a);
        a.lane.post_prepared(&mut p).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 1, "{c:?}");
        p.rearm(c.take_region().expect("the posted region comes back")).map_err(|r| r.into_parts().0).unwrap();
        let mut ps = vec![p, a.lane.prepare_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(2)).unwrap()];
        panicking(&mut a);
        assert_eq!(a.lane.post_prepared_list(&mut ps).unwrap(), 2);
        let done = reap(&mut a.lane, 2);
        assert_eq!(done.iter().map(|c| (c.is_ok(), c.wr_id())).collect::<Vec<_>>(), [(true, 1), (true, 2)]);
        for (p, mut c) in ps.iter_mut().zip(done) {
            p.rearm(c.take_region().expect("back")).map_err(|r| r.into_parts().0).unwrap();
        }
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b, ps));
    }
    t.finish();
}

/// A whole queue of unsignaled prepared requests, posted one by one and then
/// as one list, still drains: the one that takes the last free slot is signaled (the
/// `free == 1` and `k + 1 == free` edges), and every region comes back.
#[test]
fn a_full_queue_of_unsignaled_prepared_requests_drains() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut ps: Vec<_> = (0..64)
            .map_while(|k| {
                let mut p = a.lane.prepare_send(a.qp, SendWr::write(region(&a), 0..64, &remote, 0).wr_id(k)).ok()?;
                p.set_signaled(false);
                Some(p)
            })
            .collect();
        // The queue's depth: as many as post before a refusal.
        let mut depth = 0;
        for p in ps.iter_mut() {
            match a.lane.post_prepared(p) {
                Ok(()) => depth += 1,
                Err(e) => {
                    assert!(matches!(e, Error::QueueFull { .. }), "{e}");
                    assert!(p.is_armed(), "a refused one keeps its region");
                    break;
                }
            }
        }
        assert!(depth > 1 && depth < ps.len(), "depth {depth}");
        // iWARP signals every request (a later completion may come before an earlier READ's
        // data), so there every one comes signaled.
        let iwarp = common::caps::iwarp();
        let signaled_count = if iwarp { depth } else { 1 };
        let done = reap(&mut a.lane, depth);
        assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
        assert_eq!(done.iter().filter(|c| c.is_signaled()).count(), signaled_count, "only the last is signaled");
        assert!(done.last().unwrap().is_signaled());
        for (p, mut c) in ps.iter_mut().zip(done) {
            assert_eq!(p.wr_id(), c.wr_id());
            p.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        // Again as one list of the whole depth.
        assert_eq!(a.lane.post_prepared_list(&mut ps[..depth]).unwrap(), depth);
        let done = reap(&mut a.lane, depth);
        assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
        assert_eq!(done.iter().filter(|c| c.is_signaled()).count(), signaled_count, "only the last is signaled");
        for (p, mut c) in ps.iter_mut().zip(done) {
            assert_eq!(p.wr_id(), c.wr_id());
            p.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        assert!(ps.iter().all(|p| p.is_armed()));
        // One by one again, the list's last first: the list signaled that one (it took the last
        // slot) and must have put its flags back, so only the last posted is signaled now.
        for p in ps[..depth].iter_mut().rev() {
            a.lane.post_prepared(p).unwrap();
        }
        let done = reap(&mut a.lane, depth);
        assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
        let signaled: Vec<u64> = done.iter().filter(|c| c.is_signaled()).map(|c| c.wr_id()).collect();
        if !iwarp {
            assert_eq!(signaled, [0], "only the one that took the last slot (wr_id 0) is signaled");
        } else {
            assert_eq!(signaled.len(), depth, "iWARP: every one is signaled");
        }
        for mut c in done {
            ps[c.wr_id() as usize].rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b, ps));
    }
    t.finish();
}

/// Attempt: a prepared list links its requests for its one `ibv_post_send`. A request of that
/// list, posted alone afterwards, must post itself only: were the link left in place, the
/// provider would also run the requests after it, whose regions are back in Rust's hands, and
/// their completions would pass for later posts'. Each request WRITEs its own byte to its own
/// place of the peer's region; after the single posts, the place of the one not posted again is
/// still zero.
#[test]
fn a_prepared_request_posted_alone_after_its_list_posts_only_itself() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut ps: Vec<_> = (0..3u8)
            .map(|k| {
                let mut mr = region(&a);
                mr.as_mut_slice().unwrap()[..64].fill(k + 1);
                let wr = SendWr::write(mr, 0..64, &remote, 64 * k as u64).wr_id(k as u64);
                a.lane.prepare_send(a.qp, wr).map_err(|r| r.into_parts().0).unwrap()
            })
            .collect();
        assert_eq!(a.lane.post_prepared_list(&mut ps).unwrap(), 3);
        for mut c in reap(&mut a.lane, 3) {
            assert!(c.is_ok(), "{c:?}");
            ps[c.wr_id() as usize].rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        // The peer's region is remotely writable: read and cleared by copies.
        let mut peer = [0u8; 192];
        b.mrs[0].read_at(0, &mut peer).unwrap();
        assert!(peer.chunks(64).zip(1u8..).all(|(c, k)| c.iter().all(|&x| x == k)), "the list wrote all three");
        b.mrs[0].write_at(0, &[0; 192]).unwrap();
        // The first alone, then the last alone: an RC queue runs in order, so once the last
        // one's completion is in, anything the first one's post ran with it has run too.
        let mut alone_then_check = |a: &mut LaneSide, b: &mut LaneSide, ps: &mut [PreparedSend], what: &str| {
            for k in [0, 2] {
                a.lane.post_prepared(&mut ps[k]).unwrap();
                let mut c = reap(&mut a.lane, 1).pop().unwrap();
                assert!(c.is_ok() && c.wr_id() == k as u64, "{what}: {c:?}");
                ps[k].rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
            }
            b.mrs[0].read_at(0, &mut peer).unwrap();
            assert!(peer[..64].iter().all(|&x| x == 1), "{what}: the first one's WRITE");
            assert!(
                peer[64..128].iter().all(|&x| x == 0),
                "{what}: the middle one ran again: the first one's post ran a list"
            );
            assert!(peer[128..192].iter().all(|&x| x == 3), "{what}: the last one's WRITE");
            assert!(a.lane.poll().unwrap().is_none(), "{what}: no completion beyond the two posts");
            assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
            b.mrs[0].write_at(0, &[0; 192]).unwrap();
        };
        alone_then_check(&mut a, &mut b, &mut ps, "after a list posted");
        // A list refused at its check of the last entry (not armed), after the first two were
        // linked: they are unlinked too.
        let spare = ps[2].take_region().unwrap();
        let e = a.lane.post_prepared_list(&mut ps).expect_err("the last entry holds no region");
        assert!(e.to_string().contains("holds no region"), "{e}");
        assert!(ps[0].is_armed() && ps[1].is_armed(), "the refused list's regions are back");
        ps[2].rearm(spare).map_err(|r| r.into_parts().0).unwrap();
        alone_then_check(&mut a, &mut b, &mut ps, "after a list refused");
        drop((a, b, ps));
    }
    t.finish();
}

/// A prepared WRITE with a remote key the peer does not have fails and moves
/// the QP to the error state; its region still comes back with that completion, and a later
/// post of the re-armed request is either refused (region kept) or flushed (region back):
/// never lost, never posted twice.
#[test]
fn a_prepared_request_of_a_qp_in_error_keeps_or_returns_its_region() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::RemoteWriteError) {
        return t.finish();
    }
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let real = b.mrs[0].remote();
        let bogus = rdma_cm::RemoteRegion::new(real.addr, real.rkey ^ 0x5a5a_0000, 4096);
        let mut p = a.lane.prepare_send(a.qp, SendWr::write(region(&a), 0..64, &bogus, 0).wr_id(5)).unwrap();
        a.lane.post_prepared(&mut p).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(!c.is_ok(), "a bad rkey fails: {c:?}");
        p.rearm(c.take_region().expect("a failed completion hands the region back"))
            .map_err(|r| r.into_parts().0)
            .unwrap();
        match a.lane.post_prepared(&mut p) {
            Ok(()) => {
                let mut c = reap(&mut a.lane, 1).pop().unwrap();
                assert!(!c.is_ok() && c.wr_id() == 5, "flushed: {c:?}");
                p.rearm(c.take_region().expect("the flush hands it back")).map_err(|r| r.into_parts().0).unwrap();
            }
            Err(e) => assert!(p.is_armed(), "refused ({e}): the region stays in the request"),
        }
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b, p));
    }
    t.finish();
}

/// Prepared requests swapped (`mem::swap`) while one is posted, moved to
/// another thread with their lane, and the lane dropped with both posted (receives never
/// matched): the drop reaps or destroys before freeing, and the requests, dropped after their
/// lane, free nothing the device holds.
#[test]
fn prepared_requests_swapped_moved_and_outliving_their_lane() {
    let t = DeviceTest::start();
    {
        let (a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let (mut b, other) = (b, a);
        let mut x = b.lane.prepare_recv(b.qp, RecvWr::new(region(&b)).wr_id(1)).unwrap();
        let mut y = b.lane.prepare_recv(b.qp, RecvWr::new(region(&b)).wr_id(2)).unwrap();
        b.lane.post_prepared_recv(&mut x).unwrap();
        std::mem::swap(&mut x, &mut y);
        assert!(x.is_armed() && !y.is_armed() && x.wr_id() == 2);
        let e = b.lane.post_prepared_recv(&mut y).expect_err("the posted one, swapped, is still unarmed");
        assert!(e.to_string().contains("holds no region"), "{e}");
        // The lane and both requests go to another thread, which posts the armed one.
        let (mut b, x, y) = std::thread::spawn(move || {
            let (mut b, mut x, y) = (b, x, y);
            b.lane.post_prepared_recv(&mut x).unwrap();
            (b, x, y)
        })
        .join()
        .unwrap();
        assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 2));
        assert!(!x.is_armed() && !y.is_armed());
        drop(b);
        drop((x, y, other));
    }
    t.finish();
}

/// A prepared UD send keeps a raw address handle. The caller's own copy of the
/// destination dropped, the destination's QP (and lane) gone, the send still posts and
/// completes (the lane's copy keeps the address handle); once its QP is removed, with the send
/// still posted, the request is refused and holds its region no more.
#[test]
fn a_prepared_ud_send_outlives_its_destination_and_not_its_qp() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::Ud) {
        return t.finish();
    }
    {
        let p = common::lane::lane_ud_pair(t.addr, 7671, rdma_cm::QpInit::new(), 64);
        let common::lane::LaneUdPair { client: mut c, to_server, server_dest, server } = p;
        drop(server_dest);
        let msg = MemoryRegion::new(&c.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut s = c.lane.prepare_send(c.qp, SendWr::send(msg, 0..32).to(to_server).wr_id(4)).unwrap();
        drop(server);
        for _ in 0..3 {
            c.lane.post_prepared(&mut s).unwrap();
            let mut done = reap(&mut c.lane, 1).pop().unwrap();
            assert!(done.is_ok() && done.wr_id() == 4, "a datagram to nobody still completes: {done:?}");
            s.rearm(done.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        c.lane.post_prepared(&mut s).unwrap();
        c.lane.remove(c.qp).unwrap();
        assert!(!s.is_armed(), "the region went with the QP's teardown, not back to the request");
        let e = c.lane.post_prepared(&mut s).expect_err("its QP is gone");
        assert!(e.to_string().contains("not attached"), "{e}");
        drop((c, s));
    }
    t.finish();
}

/// A QP already in the error state when it is attached: whether its own path knew it (moved
/// there by `QueuePair::set_error`) or only the device does (moved there by a raw call), the
/// lane carries the failure and refuses its posts with the cause, instead of taking a receive
/// that would never complete.
#[test]
fn a_qp_attached_in_the_error_state_has_its_posts_refused_with_the_cause() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 64);
        // Known to its own path.
        let (mut a, b) = pair(t.addr, PairSpec { init: lane.qp_init(), ..spec() }, spec());
        a.conn.qp_mut().set_error().unwrap();
        let q = lane.attach(a.conn).map_err(|r| r.into_parts().0).expect("attach");
        let r = lane.post_recv(q, RecvWr::new(MemoryRegion::new(&a.pd, 64, AccessFlags::LOCAL_WRITE).unwrap()));
        let r = r.expect_err("a receive on a QP in the error state is refused");
        assert!(matches!(r.error(), Error::QpInError { .. }), "{}", r.error());
        assert!(r.error().to_string().contains("before it was attached"), "{}", r.error());
        assert!(r.into_inner().is_some(), "the region comes back");
        let s = lane.post_send(q, SendWr::send(MemoryRegion::new(&a.pd, 64, AccessFlags::empty()).unwrap(), 0..64));
        assert!(matches!(s.unwrap_err().error(), Error::QpInError { .. }));
        assert_eq!(lane.outstanding(q).unwrap(), (0, 0));
        drop(b);
        // Known to the device only: found by `ibv_query_qp` at attach, where the device
        // reports QP states (Soft-iWARP's reads RESET on any QP; it flushes a receive posted in
        // the error state instead, so none is taken silently there either).
        if common::caps::iwarp() {
            common::skipped("a QP's state from ibv_query_qp", "the iWARP device reports none: RESET on any QP");
            drop((lane, a.pd, a.mrs));
            return t.finish();
        }
        let (c, d) = pair(t.addr, PairSpec { init: lane.qp_init(), ..spec() }, spec());
        // SAFETY: ibv_qp_attr is plain old data (all-zero is valid); the QP is alive (owned by
        // `c.conn`) and only its state changes, as the mask says: the raw escape hatch, used
        // to put the QP in the error state behind the crate's back.
        let ret = unsafe {
            let mut attr: rdma_cm::ffi::ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = rdma_cm::ffi::ibv_qp_state::IBV_QPS_ERR;
            rdma_cm::ffi::ibv_modify_qp(
                c.conn.qp().as_raw(),
                &mut attr,
                rdma_cm::ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
            )
        };
        assert_eq!(ret, 0, "ibv_modify_qp(ERR)");
        let q = lane.attach(c.conn).map_err(|r| r.into_parts().0).expect("attach");
        let r = lane.post_recv(q, RecvWr::new(MemoryRegion::new(&c.pd, 64, AccessFlags::LOCAL_WRITE).unwrap()));
        let r = r.expect_err("a receive on a QP the device has in the error state is refused");
        assert!(matches!(r.error(), Error::QpInError { .. }), "{}", r.error());
        assert!(r.error().to_string().contains("no completion saying why"), "{}", r.error());
        drop((lane, d, a.pd, c.pd));
    }
    t.finish();
}

/// A completion carrying a tag the lane gave an earlier QP at the same place, and one carrying
/// the tag of a receive already handed out (a completion the device hands out twice), retire
/// nothing: the place's sequence numbers continue across its QPs, so both fall outside the new
/// QP's window, and no region comes back before its own completion. Both completions are made
/// real through the raw escape hatch: receives posted on the lane's QP directly, with those
/// tags (the layout `lane`'s tag module documents: `RECV(63) | place(60..45) | seq(44..0)`).
#[test]
fn a_stale_or_repeated_completion_retires_nothing_at_its_place() {
    const RECV: u64 = 1 << 63;
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 128);
        // The earlier QP at place 0: receives 0, 1 and 2; one completes, the removal flushes
        // the others. The place's next receive sequence number is 3.
        let (old, pd1, mut b1) = attached_pair(&mut lane, t.addr, spec());
        for k in 0..3 {
            lane.post_recv(old, RecvWr::new(MemoryRegion::new(&pd1, 64, AccessFlags::LOCAL_WRITE).unwrap()).wr_id(k))
                .unwrap();
        }
        let send = |b: &mut common::Side, k: u64| common::raw::send(&b.conn, &b.mrs[0], 0..64, k);
        send(&mut b1, 0);
        assert_eq!(reap(&mut lane, 1).pop().unwrap().wr_id(), 0);
        lane.remove(old).unwrap();
        let (new, pd2, mut b2) = attached_pair(&mut lane, t.addr, spec());
        let raw_buf = MemoryRegion::new(&pd2, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let post_raw = |lane: &mut Lane, wr_id: u64| {
            let qp = lane.qp_as_raw(new).unwrap();
            let mut sge = rdma_cm::ffi::ibv_sge { addr: raw_buf.addr(), length: 64, lkey: raw_buf.lkey() };
            let mut wr = rdma_cm::ffi::ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
            let mut bad = std::ptr::null_mut();
            // SAFETY: the raw escape hatch: `qp` is the lane's live QP; the receive is one
            // NULL-terminated work request over `raw_buf`, which this test keeps registered and
            // reads no more (it outlives the lane, which destroys the QP first).
            let ret = unsafe { rdma_cm::ffi::ibv_post_recv(qp, &mut wr, &mut bad) };
            assert_eq!(ret, 0, "ibv_post_recv");
        };
        // A completion with the earlier QP's tag (its receive 1), ahead of the lane's own.
        post_raw(&mut lane, RECV | 1);
        lane.post_recv(new, RecvWr::new(MemoryRegion::new(&pd2, 64, AccessFlags::LOCAL_WRITE).unwrap()).wr_id(7))
            .unwrap();
        send(&mut b2, 1);
        send(&mut b2, 2);
        let mut c = lane.wait(T).expect("the lane's receive");
        assert_eq!((c.wr_id(), c.qp()), (7, Some(new)), "only the lane's own receive is handed out: {c:?}");
        assert!(c.take_region().is_some());
        // The same tag again (the receive just handed out, sequence number 3), then a new one.
        post_raw(&mut lane, RECV | 3);
        lane.post_recv(new, RecvWr::new(MemoryRegion::new(&pd2, 64, AccessFlags::LOCAL_WRITE).unwrap()).wr_id(8))
            .unwrap();
        send(&mut b2, 3);
        assert!(lane.poll().unwrap().is_none(), "a tag handed out once retires nothing the second time");
        assert_eq!(lane.outstanding(new).unwrap(), (0, 1), "the lane's receive 8 stays posted, its region held");
        send(&mut b2, 4);
        let mut c = lane.wait(T).expect("the lane's second receive");
        assert_eq!((c.wr_id(), c.qp()), (8, Some(new)), "{c:?}");
        assert!(c.take_region().is_some());
        assert!(lane.poll().unwrap().is_none());
        assert_eq!(lane.outstanding(new).unwrap(), (0, 0));
        drop((lane, b1, b2, pd1, raw_buf, pd2));
    }
    t.finish();
}

/// An unsignaled RDMA READ followed by a signaled send: the send's completion retires the
/// READ's slot too, so the READ's region must come back with the peer's bytes in it, never
/// while the device may still be writing it. Soft-iWARP completes a send once TCP has it,
/// possibly before an earlier READ's response: there the lane signals every request and holds
/// the send's completion until the READ's own has come, so the READ comes back signaled.
#[test]
fn an_unsignaled_read_retired_by_a_later_send_comes_back_with_its_bytes() {
    let t = DeviceTest::start();
    {
        let spec = PairSpec { access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, ..spec() };
        let (mut a, mut b) = lane_pair(t.addr, spec.clone(), spec, 64);
        let remote = b.mrs[0].remote();
        for round in 0..20u8 {
            b.mrs[0].write_at(0, &common::pattern(2048, round)).unwrap();
            let target = region(&a);
            a.lane.post_send(a.qp, SendWr::read(target, 0..2048, &remote, 0).wr_id(1).unsignaled()).unwrap();
            let inbox = region(&b);
            b.lane.post_recv(b.qp, RecvWr::new(inbox).wr_id(2)).unwrap();
            a.lane.post_send(a.qp, SendWr::send(region(&a), 0..8).wr_id(3)).unwrap();
            let mut got = reap(&mut a.lane, 2);
            let ids: Vec<u64> = got.iter().map(|c| c.wr_id()).collect();
            assert_eq!(ids, [1, 3], "round {round}: the READ's slot, then the send's");
            let iwarp = common::caps::iwarp();
            assert_eq!(got[0].is_signaled(), iwarp, "round {round}: the READ is signaled on iWARP only");
            let mut back = got[0].take_region().expect("the READ's region comes back");
            let mut bytes = vec![0u8; 2048];
            back.read_at(0, &mut bytes).unwrap();
            assert!(bytes == common::pattern(2048, round), "round {round}: the READ's bytes are all there");
            assert!(reap(&mut b.lane, 1)[0].is_ok());
        }
        drop((a, b));
    }
    t.finish();
}
