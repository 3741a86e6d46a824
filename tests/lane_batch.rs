//! The lane's prepared batches (`Lane::prepare_batch`, `Lane::post_batch`) on the device: work
//! requests over one region, one doorbell, one completion. What they do (WRITEs, a send after
//! WRITEs, READ, datagrams, a batch of one), and the attempts to break their promises with safe
//! code, as an attacker would: a batch failing in its middle, a post the provider
//! half-takes, posting it twice, re-arming it with another region, a build closure that swaps
//! the region or panics, a panic on its completion, forgetting it while posted, removing or
//! dropping its QP's lane with it in flight, and a batch behind unsignaled requests.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use common::lane::{
    after_back_to_init, back_to_init, lane_pair, lane_ud_pair, posts_fail_naming_none, reap,
    wait_until_the_closure_panics,
};
use common::{mr_count, pattern, DeviceTest, PairSpec, T};
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
use rdma_cm::verbs::ud::Datagram;
use rdma_cm::{AccessFlags, Error, MemoryRegion, QpInit, RemoteRegion, WcOpcode, WcStatus};

fn spec() -> PairSpec {
    PairSpec {
        mr_sizes: vec![4096, 4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    }
}

/// Sixteen 64-byte WRITEs of `mr`, piece `k` to `remote` at `k * 128`.
fn writes(
    lane: &mut Lane,
    qp: rdma_cm::verbs::lane::LaneQp,
    mr: MemoryRegion,
    remote: &RemoteRegion,
) -> rdma_cm::verbs::lane::PreparedBatch {
    lane.prepare_batch(qp, mr, 16, |k, mr| SendWr::write(mr, k * 64..(k + 1) * 64, remote, k as u64 * 128).wr_id(40))
        .map_err(|r| r.into_parts().0)
        .unwrap()
}

#[test]
fn a_batch_posts_under_one_doorbell_and_comes_back_as_one_completion_with_its_region() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut batch = writes(&mut a.lane, a.qp, a.mrs.remove(0), &remote);
        assert_eq!((batch.len(), batch.wr_id(), batch.is_armed()), (16, 40, true));
        for round in 0..3u8 {
            batch.write_at(0, &pattern(1024, round)).unwrap();
            a.lane.post_batch(&mut batch).unwrap();
            assert!(!batch.is_armed() && batch.region().is_none(), "posted: the lane holds the region");
            assert_eq!(a.lane.outstanding(a.qp).unwrap(), (16, 0), "sixteen work requests in the queue");
            let mut c = reap(&mut a.lane, 1).pop().unwrap();
            assert!(c.is_ok() && c.is_signaled(), "{c:?}");
            assert_eq!((c.wr_id(), c.opcode(), c.qp()), (40, Some(WcOpcode::RdmaWrite), Some(a.qp)));
            batch.rearm(c.take_region().expect("the batch's region comes back")).map_err(|r| r.into_parts().0).unwrap();
            assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0), "one completion retired all sixteen");
            assert!(a.lane.poll().unwrap().is_none(), "and nothing else comes out");
            let mut landed = vec![0u8; 2048];
            b.mrs[0].read_at(0, &mut landed).unwrap();
            let sent = pattern(1024, round);
            for k in 0..16 {
                assert_eq!(&landed[k * 128..k * 128 + 64], &sent[k * 64..(k + 1) * 64], "round {round}, piece {k}");
            }
        }
        // A batch of one is a prepared request that retires as usual.
        let one = MemoryRegion::new(&a.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut single =
            a.lane.prepare_batch(a.qp, one, 1, |_, mr| SendWr::write(mr, 0..64, &remote, 0).wr_id(9)).unwrap();
        for _ in 0..2 {
            a.lane.post_batch(&mut single).unwrap();
            let mut c = reap(&mut a.lane, 1).pop().unwrap();
            assert!(c.is_ok() && c.wr_id() == 9, "{c:?}");
            single.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        // With two completions asked for, a wait still hands the batch's one out (and ends).
        a.lane.post_batch(&mut batch).unwrap();
        let mut got = Vec::new();
        assert_eq!(a.lane.wait_with(2, T, |c, mr| got.push((c.wr_id(), mr))).unwrap(), 1);
        assert_eq!(got.len(), 1);
        let (id, mr) = got.pop().unwrap();
        assert_eq!(id, 40);
        batch.rearm(mr.unwrap()).map_err(|r| r.into_parts().0).unwrap();
        drop((a, b, batch, single));
    }
    t.finish();
}

/// A batch of two WRITEs, a READ back of the first into the region's tail, and a send: the
/// receiver gets the send after the WRITEs landed (a queue runs in order), and the READ's bytes
/// are the WRITE's. On iWARP the READ goes last (see inside).
#[test]
fn a_batch_mixes_operations_in_order() {
    let t = DeviceTest::start();
    // On iWARP a send can complete before an earlier READ's response has landed, and a batch
    // retires with its last completion: a READ before the last is refused there, saying why,
    // and its region comes back; the same operations with the READ last run.
    let read_at = if common::caps::iwarp() { 3 } else { 2 };
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[1].remote();
        let mut mr = a.mrs.remove(0);
        mr.write_at(0, &pattern(256, 9)).unwrap();
        let ops = |read_at: usize| {
            move |k: usize, mr: MemoryRegion| match k {
                0 => SendWr::write(mr, 0..128, &remote, 0),
                1 => SendWr::write(mr, 128..256, &remote, 128),
                k if k == read_at => SendWr::read(mr, 1024..1280, &remote, 0).wr_id(77),
                _ => SendWr::send(mr, 0..32).wr_id(77),
            }
        };
        if common::caps::iwarp() {
            let r = a.lane.prepare_batch(a.qp, mr, 4, ops(2)).unwrap_err();
            let (e, back) = r.into_parts();
            let said = e.to_string();
            assert!(said.contains("work request 2") && said.contains("iWARP"), "{said}");
            mr = back.expect("the refused batch gives its region back");
        }
        let mut batch = a.lane.prepare_batch(a.qp, mr, 4, ops(read_at)).map_err(|r| r.into_parts().0).unwrap();
        b.lane.post_recv(b.qp, RecvWr::new(b.mrs.remove(0)).wr_id(5)).unwrap();
        a.lane.post_batch(&mut batch).unwrap();
        let r = reap(&mut b.lane, 1).pop().unwrap();
        assert_eq!((r.wr_id(), r.byte_len()), (5, 32), "{r:?}");
        let mut landed = vec![0u8; 256];
        b.mrs[0].read_at(0, &mut landed).unwrap();
        assert_eq!(landed, pattern(256, 9), "both WRITEs landed before the send's receive completed");
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        let last = if read_at == 3 { WcOpcode::RdmaRead } else { WcOpcode::Send };
        assert!(c.is_ok() && c.wr_id() == 77 && c.opcode() == Some(last), "{c:?}");
        let mut mr = c.take_region().unwrap();
        let mut back = vec![0u8; 256];
        mr.read_at(1024, &mut back).unwrap();
        assert_eq!(back, pattern(256, 9), "the READ brought the WRITEs' bytes back");
        assert!(a.lane.poll().unwrap().is_none());
        drop((a, b, r, mr));
    }
    t.finish();
}

/// Four datagrams of one region in one batch, to one destination: each lands.
#[test]
fn a_batch_of_datagrams() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = lane_ud_pair(t.addr, 7681, QpInit::new(), 64);
        let mut msg = MemoryRegion::new(&p.client.pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
        msg.write_at(0, &pattern(256, 4)).unwrap();
        let to = p.to_server;
        let mut batch = p
            .client
            .lane
            .prepare_batch(p.client.qp, msg, 4, |k, mr| SendWr::send(mr, k * 64..(k + 1) * 64).to(to))
            .unwrap();
        for k in 0..4u64 {
            let buf = MemoryRegion::new(&p.server.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
            p.server.lane.post_recv(p.server.qp, RecvWr::new(buf).wr_id(k)).unwrap();
        }
        p.client.lane.post_batch(&mut batch).unwrap();
        let mut c = reap(&mut p.client.lane, 1).pop().unwrap();
        assert!(c.is_ok(), "{c:?}");
        batch.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        for (k, mut r) in reap(&mut p.server.lane, 4).into_iter().enumerate() {
            assert_eq!((r.wr_id(), r.byte_len() as usize), (k as u64, GRH_LEN + 64), "{r:?}");
            let wc = *r;
            let mut buf = r.take_region().unwrap();
            let d = Datagram::parse(&wc, &mut buf, 0).unwrap();
            assert_eq!(&buf.as_slice().unwrap()[d.payload()], &pattern(256, 4)[k * 64..(k + 1) * 64]);
        }
        drop((p, batch));
    }
    t.finish();
}

/// Attack: the second of four WRITEs names a bad rkey. The first runs, the second fails, the
/// rest are flushed: the batch's one completion carries the second's failure (not the flush),
/// its region comes back once, nothing else comes out, and the QP refuses posts from then on
/// with the region staying in the batch.
#[test]
fn a_batch_failing_in_its_middle_reports_the_first_failure_once_with_its_region() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::RemoteWriteError) {
        return t.finish();
    }
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let real = b.mrs[0].remote();
        let bogus = RemoteRegion::new(real.addr, real.rkey ^ 0x5a5a_0000, 4096);
        let mut batch = a
            .lane
            .prepare_batch(a.qp, a.mrs.remove(0), 4, |k, mr| {
                SendWr::write(mr, 0..64, if k == 1 { &bogus } else { &real }, k as u64 * 64).wr_id(3)
            })
            .unwrap();
        let before = mr_count();
        a.lane.post_batch(&mut batch).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert_eq!((c.wr_id(), c.is_signaled()), (3, true), "{c:?}");
        assert_eq!(c.status(), WcStatus::RemAccessErr, "the interior failure, not the flush: {c:?}");
        let mr = c.take_region().expect("the region comes back with the batch's completion");
        assert!(a.lane.poll().unwrap().is_none(), "the interior failure and flushes hand nothing else out");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        batch.rearm(mr).map_err(|r| r.into_parts().0).unwrap();
        let e = a.lane.post_batch(&mut batch).unwrap_err();
        assert!(matches!(e, Error::QpInError { .. }), "{e}");
        assert!(batch.is_armed(), "refused before the provider: the region stays in the batch");
        assert_eq!(mr_count(), before, "no region was released or made along the way");
        drop((a, b, batch));
    }
    t.finish();
}

/// Attack: a batch the provider refuses without naming an entry (rxe, for a QP back in INIT,
/// yet it keeps the requests): the region stays held, committed, the QP is moved to the error
/// state, and the flush of the batch's last request hands it back, once.
#[test]
fn a_batch_refused_without_bad_wr_keeps_its_region_until_the_flush() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut batch = writes(&mut a.lane, a.qp, a.mrs.remove(0), &remote);
        back_to_init(&mut a);
        let e = posts_fail_naming_none(&mut a, |a| a.lane.post_batch(&mut batch)).unwrap_err();
        assert!(e.to_string().contains("without saying"), "{e}");
        assert!(!batch.is_armed(), "the region is not given back: the provider may have the requests");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (16, 0));
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.wr_id() == 40 && after_back_to_init(c.status()), "{c:?}");
        batch.rearm(c.take_region().expect("the flush hands it back")).map_err(|r| r.into_parts().0).unwrap();
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none(), "the interior flushes hand nothing out");
        drop((a, b, batch));
    }
    t.finish();
}

/// Attack: posting a batch twice (while posted, and unarmed), re-arming it with a chunk of
/// another region or while it is armed, posting past the queue's room, and batches longer than
/// the queue or empty. Each is refused, and each region stays where it was.
#[test]
fn a_batch_posts_once_and_takes_back_only_its_own_region() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut chunks = a.mrs.remove(0).split(2048).unwrap();
        let sibling = chunks.pop().unwrap();
        let mut batch = writes(&mut a.lane, a.qp, chunks.pop().unwrap(), &remote);
        let r = batch.rearm(sibling).unwrap_err();
        assert!(r.to_string().contains("already holds"), "{r}");
        let sibling = r.into_inner().unwrap();
        a.lane.post_batch(&mut batch).unwrap();
        let e = a.lane.post_batch(&mut batch).unwrap_err();
        assert!(matches!(e, Error::QueueFull { .. }), "posted, it fills the queue: {e}");
        let r = batch.rearm(sibling).unwrap_err();
        assert!(r.to_string().contains("not the region"), "{r}");
        let sibling = r.into_inner().unwrap();
        // The queue (16 deep) is full: a single request is refused with its region.
        let r = a.lane.post_send(a.qp, SendWr::write(sibling, 0..64, &remote, 0)).unwrap_err();
        assert!(matches!(r.error(), Error::QueueFull { .. }), "{r}");
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        let mut mr = c.take_region().unwrap();
        mr.write_at(0, b"the region is ours again").unwrap();
        // Unarmed, with room in the queue: refused for what it lacks.
        let e = a.lane.post_batch(&mut batch).unwrap_err();
        assert!(e.to_string().contains("holds no region"), "{e}");
        batch.rearm(mr).map_err(|r| r.into_parts().0).unwrap();
        // A batch longer than the queue is refused when it is prepared.
        let big = MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let r = a.lane.prepare_batch(a.qp, big, 17, |_, mr| SendWr::write(mr, 0..64, &remote, 0)).unwrap_err();
        assert!(r.to_string().contains("depth"), "{r}");
        let big = r.into_inner().expect("its region comes back");
        let r = a.lane.prepare_batch(a.qp, big, 0, |_, mr| SendWr::write(mr, 0..64, &remote, 0)).unwrap_err();
        assert!(r.into_inner().is_some());
        drop((a, b, batch));
    }
    t.finish();
}

/// Attack on `prepare_batch`'s closure: it swaps in another region for one request (refused,
/// with that region back), builds one that fails its checks (refused, region back), or
/// panics (the region goes with the panic; nothing leaks, the lane carries on).
#[test]
fn prepare_batch_refuses_a_swapped_region_a_bad_request_and_survives_a_panic() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut other = Some(MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap());
        let other_addr = other.as_ref().unwrap().addr();
        let mut stolen = None;
        let mine = MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let r = a
            .lane
            .prepare_batch(a.qp, mine, 4, |k, mr| {
                if k == 2 {
                    stolen = Some(mr);
                    SendWr::write(other.take().unwrap(), 0..64, &remote, 0)
                } else {
                    SendWr::write(mr, 0..64, &remote, 0)
                }
            })
            .unwrap_err();
        assert!(r.to_string().contains("another region"), "{r}");
        assert_eq!(r.into_inner().unwrap().addr(), other_addr, "the swapped-in region comes back");
        assert!(stolen.is_some(), "the batch's own stayed where the closure put it");
        let mine = stolen.take().unwrap();
        let r = a
            .lane
            .prepare_batch(a.qp, mine, 4, |k, mr| {
                let end = if k == 3 { 5000 } else { 64 };
                SendWr::write(mr, 0..end, &remote, 0)
            })
            .unwrap_err();
        assert!(matches!(r.error(), Error::OutOfBounds { .. }), "{r}");
        let mine = r.into_inner().expect("region back");
        let before = mr_count();
        let p = catch_unwind(AssertUnwindSafe(|| {
            a.lane.prepare_batch(a.qp, mine, 4, |k, mr| {
                assert!(k < 2, "the closure fails at request {k}");
                SendWr::write(mr, 0..64, &remote, 0)
            })
        }));
        assert!(p.is_err());
        if let Some(n) = before {
            assert_eq!(mr_count(), Some(n - 1), "the region went with the panic");
        }
        let mut batch =
            writes(&mut a.lane, a.qp, MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap(), &remote);
        a.lane.post_batch(&mut batch).unwrap();
        assert!(reap(&mut a.lane, 1).pop().unwrap().is_ok(), "the lane carries on");
        drop((a, b, batch));
    }
    t.finish();
}

/// Attack: two unsignaled prepared WRITEs, then a batch of four: a batch of sixteen no longer
/// fits (refused, region kept); the small batch's completion retires the two first, each with
/// its own region, in order, then the batch, whole. In the second round a panic on the first of
/// the three loses neither of the others.
#[test]
fn a_batch_behind_unsignaled_requests_retires_them_first_in_order() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut big = writes(&mut a.lane, a.qp, a.mrs.remove(0), &remote);
        let region = MemoryRegion::new(&a.pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
        let mut small = a
            .lane
            .prepare_batch(a.qp, region, 4, |k, mr| SendWr::write(mr, k * 64..(k + 1) * 64, &remote, 0).wr_id(50))
            .unwrap();
        for round in 0..2 {
            let mut singles: Vec<_> = (0..2u64)
                .map(|k| {
                    let mr = MemoryRegion::new(&a.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
                    a.lane.prepare_send(a.qp, SendWr::write(mr, 0..64, &remote, 0).wr_id(k).unsignaled()).unwrap()
                })
                .collect();
            for s in singles.iter_mut() {
                a.lane.post_prepared(s).unwrap();
            }
            let e = a.lane.post_batch(&mut big).unwrap_err();
            assert!(matches!(e, Error::QueueFull { .. }), "two of sixteen slots taken: {e}");
            assert!(big.is_armed());
            a.lane.post_batch(&mut small).unwrap();
            let mut seen = Vec::new();
            if round == 1 {
                wait_until_the_closure_panics(&mut a.lane, 1);
                seen.push((0, false, false)); // single 0, whose region went with the panic
            }
            for mut c in reap(&mut a.lane, 3 - seen.len()) {
                assert!(c.is_ok(), "{c:?}");
                seen.push((c.wr_id(), c.is_signaled(), c.take_region().is_some()));
            }
            // iWARP signals every request (a later completion may come before an earlier
            // READ's data): the singles there come signaled.
            let iwarp = common::caps::iwarp();
            if round == 1 {
                seen[0].1 = iwarp;
            }
            let want = vec![(0, iwarp, round == 0), (1, iwarp, true), (50, true, true)];
            assert_eq!(seen, want, "round {round}");
            assert!(a.lane.poll().unwrap().is_none());
            assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
            assert!(singles.iter().all(|s| !s.is_armed()));
            // The small batch's region came back and was dropped above: arm a new one.
            let region = MemoryRegion::new(&a.pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
            small = a
                .lane
                .prepare_batch(a.qp, region, 4, |k, mr| SendWr::write(mr, k * 64..(k + 1) * 64, &remote, 0).wr_id(50))
                .unwrap();
        }
        drop((a, b, big, small));
    }
    t.finish();
}

/// Attack: a batch forgotten while posted (the lane holds its region, not the batch), a panic
/// on a batch's completion (the region goes with it), then the lane's QP removed and the lane
/// dropped with batches in flight: the region is released only after the flush or the QP's
/// destruction, the teardown is bounded, and nothing leaks.
#[test]
fn forgetting_panicking_removing_and_dropping_with_a_batch_in_flight() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut region = MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        region.write_at(0, &pattern(64, 1)).unwrap();
        let mut batch = writes(&mut a.lane, a.qp, region, &remote);
        a.lane.post_batch(&mut batch).unwrap();
        std::mem::forget(batch);
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        let mut mr = c.take_region().expect("the lane, not the forgotten batch, held the region");
        assert_eq!(mr.as_slice().unwrap()[..64], pattern(64, 1)[..]);

        let before = mr_count();
        let mut batch = writes(&mut a.lane, a.qp, mr, &remote);
        a.lane.post_batch(&mut batch).unwrap();
        wait_until_the_closure_panics(&mut a.lane, 16);
        if let Some(n) = before {
            assert_eq!(mr_count(), Some(n - 1), "the batch's region went with the panic");
        }
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none());

        let mut batch =
            writes(&mut a.lane, a.qp, MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap(), &remote);
        a.lane.post_batch(&mut batch).unwrap();
        a.lane.remove(a.qp).unwrap();
        let e = a.lane.post_batch(&mut batch).unwrap_err();
        assert!(e.to_string().contains("not attached"), "{e}");
        assert!(!batch.is_armed(), "the region went with the QP's teardown, not back to the batch");
        drop(batch);

        let (mut a, b2) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b2.mrs[0].remote();
        let mut batch = writes(&mut a.lane, a.qp, a.mrs.remove(0), &remote);
        for k in 0..4 {
            let buf = MemoryRegion::new(&a.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            a.lane.post_recv(a.qp, RecvWr::new(buf).wr_id(k)).unwrap();
        }
        a.lane.post_batch(&mut batch).unwrap();
        let started = Instant::now();
        drop(a);
        assert!(started.elapsed() < Duration::from_secs(5), "teardown is bounded: {:?}", started.elapsed());
        drop((b, b2, batch));
    }
    t.finish();
}

/// How many requests of a list `half_taking` lets through.
const TAKEN: usize = 5;

/// A provider that takes the first `TAKEN` requests of a list and refuses the next one, naming
/// it in `bad_wr` (ENOMEM, as a full queue would): the provider half-taking a batch.
unsafe extern "C" fn half_taking(
    qp: *mut rdma_cm::ffi::ibv_qp,
    wr: *mut rdma_cm::ffi::ibv_send_wr,
    bad: *mut *mut rdma_cm::ffi::ibv_send_wr,
) -> std::os::raw::c_int {
    // SAFETY: the list has more than TAKEN entries (the test's batch has 16), so the walk stays
    // on it; its links are restored before returning; the provider's own `post_send` is called
    // with a list cut after TAKEN entries.
    unsafe {
        let mut last = wr;
        for _ in 1..TAKEN {
            last = (*last).next;
        }
        let rest = (*last).next;
        (*last).next = std::ptr::null_mut();
        let ret = common::lane::original_post_send()(qp, wr, bad);
        (*last).next = rest;
        assert_eq!(ret, 0, "the provider took the first {TAKEN}");
        *bad = rest;
        libc::ENOMEM
    }
}

/// Attack: a provider that takes the first five WRITEs
/// of a batch of sixteen and names the sixth as refused. The batch's last request, whose
/// completion would hand the region back, was never posted, and the five taken are unsignaled:
/// once they ran, nothing will ever complete for them. The region stays held (never handed
/// back while one of them may run), the QP is moved to the error state and refuses posts, and
/// the region is released once: by the flush of the fifth when they had not all run yet, or
/// when the QP is destroyed (`remove`). The eleven others never ran; the five ran, unless the
/// fifth's flush came (then each ran or was flushed: rxe/6.12 often flushes them all).
#[test]
fn a_batch_the_provider_takes_only_part_of_keeps_its_region_until_it_is_done() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let mut region = a.mrs.remove(0);
        region.write_at(0, &pattern(1024, 6)).unwrap();
        let mut batch = writes(&mut a.lane, a.qp, region, &remote);
        let r = common::lane::with_post_send(&mut a, half_taking, |a| a.lane.post_batch(&mut batch));
        let e = r.unwrap_err();
        assert!(e.to_string().contains("only part of the batch"), "{e}");
        assert!(!batch.is_armed(), "the region is not given back: five requests may run");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (TAKEN, 0), "the batch holds the five slots it took");
        let e = a.lane.post_batch(&mut batch).unwrap_err();
        assert!(matches!(e, Error::QpInError { .. }), "{e}");
        let mut other = MemoryRegion::new(&a.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        other.write_at(0, b"x").unwrap();
        let r = a.lane.post_send(a.qp, SendWr::write(other, 0..64, &remote, 0)).unwrap_err();
        assert!(matches!(r.error(), Error::QpInError { .. }), "{r}");
        drop(r);
        // Whatever came (the fifth's flush, if the five had not all run), the batch's region
        // comes out once at most, and only as the batch's.
        let mut back = Vec::new();
        while let Some(mut c) = a.lane.poll().unwrap() {
            assert_eq!((c.wr_id(), c.status()), (40, WcStatus::WrFlushErr), "{c:?}");
            back.push(c.take_region().expect("the batch's region"));
        }
        assert!(back.len() <= 1, "{} regions", back.len());
        let before = mr_count();
        a.lane.remove(a.qp).unwrap();
        if let Some(n) = before {
            let released = if back.is_empty() { 1 } else { 0 };
            assert_eq!(mr_count(), Some(n - released), "the region is released once, with the QP if not before");
        }
        let mut landed = vec![0u8; 2048];
        b.mrs[0].read_at(0, &mut landed).unwrap();
        let sent = pattern(1024, 6);
        for k in 0..16 {
            let piece = &landed[k * 128..k * 128 + 64];
            if k < TAKEN && back.is_empty() {
                // No flush came: the five had all run before the error state.
                assert_eq!(piece, &sent[k * 64..(k + 1) * 64], "piece {k} was taken and no flush came: it ran");
            } else if k < TAKEN {
                // The fifth's flush came: each of the five ran before the error state, or was
                // flushed (rxe/6.12 runs sends on a work queue, and often flushes them all).
                let ran = piece == &sent[k * 64..(k + 1) * 64];
                assert!(ran || piece.iter().all(|&x| x == 0), "piece {k} ran whole or not at all");
            } else {
                assert!(piece.iter().all(|&x| x == 0), "piece {k} was never posted");
            }
        }
        drop((a, b, batch, back));
    }
    t.finish();
}

/// Attack: two batches in flight; the first fails in its middle (a bad rkey). The first's
/// completion carries that failure, the second's the flush that followed: a failure is
/// reported once, with its own batch, and each region comes back once.
#[test]
fn two_batches_in_flight_each_report_their_own_status() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::RemoteWriteError) {
        return t.finish();
    }
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let real = b.mrs[0].remote();
        let bogus = RemoteRegion::new(real.addr, real.rkey ^ 0x5a5a_0000, 4096);
        let mut first = a
            .lane
            .prepare_batch(a.qp, a.mrs.remove(0), 4, |k, mr| {
                SendWr::write(mr, 0..64, if k == 2 { &bogus } else { &real }, 0).wr_id(1)
            })
            .unwrap();
        let region = MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let mut second =
            a.lane.prepare_batch(a.qp, region, 4, |_, mr| SendWr::write(mr, 0..64, &real, 0).wr_id(2)).unwrap();
        a.lane.post_batch(&mut first).unwrap();
        a.lane.post_batch(&mut second).unwrap();
        let done = reap(&mut a.lane, 2);
        let seen: Vec<_> = done.iter().map(|c| (c.wr_id(), c.status())).collect();
        assert_eq!(seen, vec![(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)]);
        for (mut c, batch) in done.into_iter().zip([&mut first, &mut second]) {
            batch.rearm(c.take_region().expect("each batch's region, once")).map_err(|r| r.into_parts().0).unwrap();
        }
        assert!(a.lane.poll().unwrap().is_none());
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        drop((a, b, first, second));
    }
    t.finish();
}

/// A panic on a prepared
/// batch's own completion polled one at a time (`poll_with(1, ..)`, whose straight-line case
/// hands the batch out through `start_rare`, the closure moved there and back): the region goes
/// with the panic, nothing is outstanding or left to hand out, and the next batch comes back
/// whole, once, with its region.
#[test]
fn a_panic_on_a_batch_polled_one_at_a_time_leaves_nothing_behind() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        let remote = b.mrs[0].remote();
        let before = mr_count();
        let mut batch =
            writes(&mut a.lane, a.qp, MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap(), &remote);
        a.lane.post_batch(&mut batch).unwrap();
        wait_until_the_closure_panics(&mut a.lane, 1);
        if let Some(n) = before {
            assert_eq!(mr_count(), Some(n), "the batch's region went with the panic");
        }
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none(), "nothing left to hand out");

        let mut region = MemoryRegion::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        region.write_at(0, &pattern(64, 5)).unwrap();
        let mut batch = writes(&mut a.lane, a.qp, region, &remote);
        a.lane.post_batch(&mut batch).unwrap();
        let mut got = reap(&mut a.lane, 1);
        let mut c = got.pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 40, "{c:?}");
        let mut mr = c.take_region().expect("the batch's completion hands its region back");
        assert_eq!(mr.as_slice().unwrap()[..64], pattern(64, 5)[..]);
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        assert!(a.lane.poll().unwrap().is_none(), "the batch came back once");
        drop((a, b, batch, mr));
    }
    t.finish();
}
