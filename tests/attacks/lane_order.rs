//! The order in which a lane retires a queue's slots, against a device that completes a later
//! request before an earlier RDMA READ's data has landed (iWARP completes a send once TCP has
//! it): every region comes back once, with its own completion or a later one that proves the
//! device is done with it, in posting order, and a READ's region only with all its bytes.
//!
//! Each attempt puts a large READ in front of other work, and has the peer flood the READ's
//! direction with a larger WRITE first, so that the READ's response waits behind it while the
//! requests posted after the READ complete: on iWARP their completions come first and the lane
//! must hold them. Then it interleaves the lane's other calls (polls of 0, 1 and 16, a panicking
//! poll closure, the removal of another QP, the error state, the lane's drop, prepared requests,
//! inline sends, batches, lists, a second QP) and checks what comes back. Every assertion holds
//! on any device; on Soft-RoCE the completions already come in order.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use crate::common::lane::{attached_pair, lane_pair, LaneSide};
use crate::common::{caps, pattern, DeviceTest, PairSpec};
use crate::shared::{region, LW};
use rdma_cm::verbs::lane::{Completion, InlineWr, LaneQp, PreparedSend, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Error, MemoryRegion, RemoteRegion, WcOpcode, WcStatus};

/// The READ's size.
const BIG: usize = 512 << 10;
/// The peer's WRITE that the READ's response waits behind.
const FLOOD: usize = 2 << 20;
/// The `wr_id` of the peer's flooding WRITE.
const FLOOD_ID: u64 = 9999;
/// A message's size.
const MSG: usize = 64;
/// How long a READ behind the flood may take (Soft-iWARP in a loaded guest moves a few MB/s).
const LONG: Duration = Duration::from_secs(60);

/// A connected pair on lanes, with the regions the attempts use.
struct Rig {
    a: LaneSide,
    b: LaneSide,
    /// a: where the READ lands (moved into the READ while it is posted).
    target: Option<MemoryRegion>,
    /// b: what the READ reads (readable by the peer, not writable).
    source_mr: MemoryRegion,
    source: RemoteRegion,
    /// b: the flood's source (moved into the WRITE while it is posted).
    flood_src: Option<MemoryRegion>,
    /// a: where the flood lands (a.mrs keeps the region).
    flood_to: RemoteRegion,
    /// b: a small region a's WRITEs may land in (b.mrs keeps it).
    scratch: RemoteRegion,
}

/// A pair whose lanes' CQs are `depth` deep: a's region 0 takes the flood, b's region 0 a's
/// WRITEs; the READ's target and source are regions no peer can write, so their bytes can be
/// read.
fn rig(t: &DeviceTest, depth: u32) -> Rig {
    let writable = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let client = PairSpec { mr_sizes: vec![FLOOD], access: writable, ..PairSpec::default() };
    let server = PairSpec { mr_sizes: vec![4096], access: writable, ..PairSpec::default() };
    let (a, b) = lane_pair(t.addr, client, server, depth);
    let flood_to = a.mrs[0].remote();
    let target = MemoryRegion::new(&a.pd, BIG, LW).unwrap();
    let scratch = b.mrs[0].remote();
    let flood_src = MemoryRegion::new(&b.pd, FLOOD, LW).unwrap();
    let source_mr = MemoryRegion::new(&b.pd, BIG, LW | AccessFlags::REMOTE_READ).unwrap();
    let source = source_mr.remote();
    Rig { a, b, target: Some(target), source_mr, source, flood_src: Some(flood_src), flood_to, scratch }
}

impl Rig {
    /// Fills the READ's source with round `seed`'s bytes and zeroes its target.
    fn fill(&mut self, seed: u8) {
        self.source_mr.write_at(0, &pattern(BIG, seed)).unwrap();
        self.target.as_mut().unwrap().write_at(0, &vec![0u8; BIG]).unwrap();
    }

    /// The peer starts its flood toward a: the READ's response, which the peer sends on the same
    /// stream, waits behind it.
    fn flood(&mut self) {
        let src = self.flood_src.take().expect("the flood's source is back");
        self.b.lane.post_send(self.b.qp, SendWr::write(src, 0..FLOOD, &self.flood_to, 0).wr_id(FLOOD_ID)).unwrap();
    }

    /// The READ of round `seed` into the target, as `wr_id`.
    fn read(&mut self, wr_id: u64) -> SendWr {
        SendWr::read(self.target.take().expect("the target is back"), 0..BIG, &self.source, 0).wr_id(wr_id)
    }

    /// A round: the READ's source filled with `seed`'s pattern and its target zeroed, `n`
    /// receives on the peer, and the peer's flood started.
    fn start_round(&mut self, seed: u8, n: u64) {
        self.fill(seed);
        self.peer_receives(n);
        self.flood();
    }

    /// Round `seed`: the peer's flood, then a READ (`wr_id` 0) and three sends (1 to 3) behind
    /// it, the peer's three receives taken; returns what one poll for 16 handed out then.
    fn read_then_three_sends(&mut self, seed: u8) -> Vec<Got> {
        self.start_round(seed, 3);
        let read = self.read(0);
        self.a.lane.post_send(self.a.qp, read).unwrap();
        for k in 1..=3u64 {
            let m = message(&self.a, k as u8);
            self.a.lane.post_send(self.a.qp, SendWr::send(m, 0..MSG).wr_id(k)).unwrap();
        }
        self.peer_settles(3, false);
        let mut got: Vec<Got> = Vec::new();
        self.a
            .lane
            .poll_with(16, |wc, mr| got.push((wc.wr_id(), wc.is_signaled(), wc.status(), wc.opcode(), mr)))
            .unwrap();
        got
    }

    /// `n` receives on the peer for a's sends.
    fn peer_receives(&mut self, n: u64) {
        for k in 0..n {
            self.b.lane.post_recv(self.b.qp, RecvWr::new(region(&self.b.pd, MSG)).wr_id(100 + k)).unwrap();
        }
    }

    /// Waits on the peer's lane until `n` receives have come, and the flood's completion too
    /// when `flood_too` (its region goes back; it may come earlier, and is kept then).
    fn peer_settles(&mut self, n: usize, flood_too: bool) {
        let mut recvs = 0;
        while recvs < n || (flood_too && self.flood_src.is_none()) {
            let mut c = self.b.lane.wait(LONG).unwrap_or_else(|e| panic!("the peer: {recvs} of {n} receives: {e}"));
            assert!(c.is_ok(), "the peer: {c:?}");
            if c.wr_id() == FLOOD_ID {
                assert!(self.flood_src.is_none(), "the flood's completion came twice");
                self.flood_src = Some(c.take_region().expect("the flood's region comes back"));
            } else {
                assert_eq!(c.wr_id(), 100 + recvs as u64, "the peer's receives in order");
                recvs += 1;
            }
        }
    }

    /// Takes the READ's region back from its completion `c` and checks every byte of round
    /// `seed` landed.
    fn read_back(&mut self, c: &mut Completion, seed: u8, what: &str) {
        assert!(c.is_ok(), "{what}: {c:?}");
        assert_eq!(c.opcode(), Some(WcOpcode::RdmaRead), "{what}: the READ's own completion: {c:?}");
        let mut mr = c.take_region().unwrap_or_else(|| panic!("{what}: the READ's region comes back"));
        let landed = mr.as_slice().unwrap();
        let want = pattern(BIG, seed);
        if landed != &want[..] {
            let first = landed.iter().zip(&want).position(|(x, y)| x != y).unwrap();
            panic!("{what}: the READ's region came back before its data landed: first wrong byte at {first} of {BIG}");
        }
        self.target = Some(mr);
    }
}

/// Waits on `lane` (`Lane::wait`, a poll of one, up to `LONG` each) until `n` completions came.
fn reap(lane: &mut rdma_cm::verbs::lane::Lane, n: usize) -> Vec<Completion> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let got = out.len();
        out.push(lane.wait(LONG).unwrap_or_else(|e| panic!("only {got} of {n} completions: {e}")));
    }
    out
}

/// A message region of `MSG` bytes on `side`'s PD.
fn message(side: &LaneSide, seed: u8) -> MemoryRegion {
    let mut m = region(&side.pd, MSG);
    m.write_at(0, &pattern(MSG, seed)).unwrap();
    m
}

/// A completion handed out through `poll_with`: (wr_id, signaled, status, opcode, region).
type Got = (u64, bool, WcStatus, Option<WcOpcode>, Option<MemoryRegion>);

/// Polls `lane` with `poll_with(max)` until `n` completions came, within `LONG`.
fn poll_until(lane: &mut rdma_cm::verbs::lane::Lane, max: usize, n: usize) -> Vec<Got> {
    let deadline = Instant::now() + LONG;
    let mut got: Vec<Got> = Vec::new();
    while got.len() < n {
        let before = got.len();
        let handed = lane
            .poll_with(max, |wc, mr| got.push((wc.wr_id(), wc.is_signaled(), wc.status(), wc.opcode(), mr)))
            .unwrap();
        assert_eq!(handed, got.len() - before, "poll_with counts what it handed");
        assert!(handed <= max, "poll_with({max}) handed {handed}");
        assert!(Instant::now() < deadline, "only {} of {n} completions within {LONG:?}", got.len());
    }
    got
}

fn ids(got: &[Got]) -> Vec<u64> {
    got.iter().map(|g| g.0).collect()
}

/// A READ, then four sends, polled one at a time (`Lane::wait`, a poll of one): the READ comes
/// first with every byte, then the sends in order, each once with its region; nothing after.
#[test]
fn sends_behind_a_large_read_come_back_after_it_in_order_polled_one_at_a_time() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        for round in 0..3u8 {
            r.start_round(round, 4);
            let read = r.read(0);
            r.a.lane.post_send(r.a.qp, read).unwrap();
            for k in 1..=4u64 {
                let m = message(&r.a, k as u8);
                r.a.lane.post_send(r.a.qp, SendWr::send(m, 0..MSG).wr_id(k)).unwrap();
            }
            let mut got = reap(&mut r.a.lane, 5);
            assert_eq!(got.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [0, 1, 2, 3, 4], "round {round}");
            r.read_back(&mut got[0], round, &format!("round {round}"));
            for c in &mut got[1..] {
                assert!(c.is_ok() && c.is_signaled(), "round {round}: {c:?}");
                assert!(c.take_region().is_some(), "round {round}: each send's region comes back");
            }
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            assert_eq!(r.a.lane.outstanding(r.a.qp).unwrap(), (0, 0));
            r.peer_settles(4, true);
        }
        drop(r);
    }
    t.finish();
}

/// The same, reaped by polls of 0 (which must hand nothing out, held completions or not)
/// alternating with polls of 16 and of 1.
#[test]
fn sends_behind_a_large_read_come_back_in_order_through_polls_of_zero_one_and_sixteen() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        for round in 0..4u8 {
            r.start_round(round, 6);
            let read = r.read(0);
            r.a.lane.post_send(r.a.qp, read).unwrap();
            let sends: Vec<SendWr> =
                (1..=6u64).map(|k| SendWr::send(message(&r.a, k as u8), 0..MSG).wr_id(k)).collect();
            assert_eq!(r.a.lane.post_send_iter(r.a.qp, sends).unwrap(), 6);
            // The sends have landed at the peer: on iWARP their completions are on a's CQ now,
            // and the READ's response still waits behind the flood.
            r.peer_settles(6, false);
            let deadline = Instant::now() + LONG;
            let mut got: Vec<Got> = Vec::new();
            let mut polls = 0usize;
            while got.len() < 7 {
                let zero = r.a.lane.poll_with(0, |wc, _| panic!("a poll of 0 handed {wc:?}")).unwrap();
                assert_eq!(zero, 0, "round {round}: a poll of 0");
                let max = if polls % 2 == 0 { 16 } else { 1 };
                polls += 1;
                let before = got.len();
                let n =
                    r.a.lane
                        .poll_with(max, |wc, mr| got.push((wc.wr_id(), wc.is_signaled(), wc.status(), wc.opcode(), mr)))
                        .unwrap();
                assert!(n <= max && n == got.len() - before, "round {round}: poll_with({max}) said {n}");
                assert!(Instant::now() < deadline, "round {round}: only {:?} within {LONG:?}", ids(&got));
            }
            assert_eq!(ids(&got), [0, 1, 2, 3, 4, 5, 6], "round {round}");
            for g in &got[1..] {
                assert!(g.2 == WcStatus::Success && g.4.is_some(), "round {round}: {:?}", (g.0, g.2));
            }
            let mut read = got.remove(0);
            assert_eq!((read.2, read.3), (WcStatus::Success, Some(WcOpcode::RdmaRead)), "round {round}");
            let mut c = ReadBack(read.4.take());
            r.target = c.check(round, &format!("round {round}"));
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            assert_eq!(r.a.lane.outstanding(r.a.qp).unwrap(), (0, 0));
            r.peer_settles(0, true);
        }
        drop(r);
    }
    t.finish();
}

/// A READ's region handed out through `poll_with`, checked for every byte.
struct ReadBack(Option<MemoryRegion>);

impl ReadBack {
    fn check(&mut self, seed: u8, what: &str) -> Option<MemoryRegion> {
        let mut mr = self.0.take().unwrap_or_else(|| panic!("{what}: the READ's region comes back"));
        let landed = mr.as_slice().unwrap();
        let want = pattern(BIG, seed);
        if landed != &want[..] {
            let first = landed.iter().zip(&want).position(|(x, y)| x != y).unwrap();
            panic!("{what}: the READ's region came back before its data landed: first wrong byte at {first} of {BIG}");
        }
        Some(mr)
    }
}

/// The poll closure panics on the first completion it is handed, then (another round) on the
/// second: the completion it panicked on is gone with its region, every other comes back once,
/// in order, the READ's with every byte.
#[test]
fn a_panic_in_the_poll_closure_while_sends_wait_behind_a_read_loses_and_repeats_nothing() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        for (round, panic_on) in [(0u8, 1usize), (1, 2), (2, 3)] {
            r.start_round(round, 4);
            let read = r.read(0);
            r.a.lane.post_send(r.a.qp, read).unwrap();
            for k in 1..=4u64 {
                let m = message(&r.a, k as u8);
                r.a.lane.post_send(r.a.qp, SendWr::send(m, 0..MSG).wr_id(k)).unwrap();
            }
            r.peer_settles(4, false);
            // Polls of 16 until the closure has panicked on the `panic_on`-th completion handed.
            let deadline = Instant::now() + LONG;
            let mut got: Vec<Got> = Vec::new();
            let mut handed = 0usize;
            let mut panicked_on = None;
            while panicked_on.is_none() {
                let p = catch_unwind(AssertUnwindSafe(|| {
                    r.a.lane.poll_with(16, |wc, mr| {
                        handed += 1;
                        if handed == panic_on {
                            panicked_on = Some(wc.wr_id());
                            panic!("the poll closure panics on completion {}", wc.wr_id());
                        }
                        got.push((wc.wr_id(), wc.is_signaled(), wc.status(), wc.opcode(), mr));
                    })
                }));
                if let Ok(n) = p {
                    n.unwrap();
                }
                assert!(Instant::now() < deadline, "round {round}: no panic within {LONG:?}: {:?}", ids(&got));
            }
            let panicked_on = panicked_on.unwrap();
            assert_eq!(panicked_on, panic_on as u64 - 1, "round {round}: handed in order up to the panic");
            let rest = poll_until(&mut r.a.lane, 16, 4 - got.len());
            got.extend(rest);
            let want: Vec<u64> = (0..5u64).filter(|&k| k != panicked_on).collect();
            assert_eq!(ids(&got), want, "round {round}: every other completion once, in order");
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            assert_eq!(r.a.lane.outstanding(r.a.qp).unwrap(), (0, 0));
            if panicked_on == 0 {
                // The READ's region went with the panic: a new target.
                r.target = Some(MemoryRegion::new(&r.a.pd, BIG, LW).unwrap());
            } else {
                let mut read = got.remove(0);
                assert_eq!((read.0, read.2, read.3), (0, WcStatus::Success, Some(WcOpcode::RdmaRead)));
                r.target = ReadBack(read.4.take()).check(round, &format!("round {round}"));
            }
            r.peer_settles(0, true);
        }
        drop(r);
    }
    t.finish();
}

/// Another QP of the lane is removed while sends wait behind a READ: the removal reaps the
/// CQ itself (its own flushes) and keeps the other QP's completions; they come back afterwards,
/// once each, in order, the READ's with every byte.
#[test]
fn removing_another_qp_while_sends_wait_behind_a_read_keeps_them_in_order() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        for round in 0..2u8 {
            let (q2, pd2, peer2) = attached_pair(&mut r.a.lane, t.addr, PairSpec::default());
            for k in 0..4u64 {
                r.a.lane.post_recv(q2, RecvWr::new(region(&pd2, MSG)).wr_id(50 + k)).unwrap();
            }
            r.start_round(round, 3);
            let read = r.read(0);
            r.a.lane.post_send(r.a.qp, read).unwrap();
            for k in 1..=3u64 {
                let m = message(&r.a, k as u8);
                r.a.lane.post_send(r.a.qp, SendWr::send(m, 0..MSG).wr_id(k)).unwrap();
            }
            r.peer_settles(3, false);
            let mut got: Vec<Got> = Vec::new();
            r.a.lane
                .poll_with(16, |wc, mr| got.push((wc.wr_id(), wc.is_signaled(), wc.status(), wc.opcode(), mr)))
                .unwrap();
            r.a.lane.remove(q2).unwrap();
            let rest = poll_until(&mut r.a.lane, 1, 4 - got.len());
            got.extend(rest);
            assert_eq!(ids(&got), [0, 1, 2, 3], "round {round}: the first QP's, once each, in order");
            let mut read = got.remove(0);
            assert_eq!((read.2, read.3), (WcStatus::Success, Some(WcOpcode::RdmaRead)), "round {round}");
            r.target = ReadBack(read.4.take()).check(round, &format!("round {round}"));
            assert!(got.iter().all(|g| g.2 == WcStatus::Success && g.4.is_some()), "round {round}");
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice, nothing of the removed QP");
            r.peer_settles(0, true);
            drop(peer2);
        }
        drop(r);
    }
    t.finish();
}

/// The QP is moved to the error state while sends wait behind a READ: every slot comes back
/// once, in posting order; the READ's either with all its bytes or flushed; nothing hangs.
#[test]
fn the_error_state_while_sends_wait_behind_a_read_hands_each_slot_back_once_in_order() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        let mut got = r.read_then_three_sends(7);
        r.a.lane.set_error(r.a.qp).unwrap();
        let rest = poll_until(&mut r.a.lane, 1, 4 - got.len());
        got.extend(rest);
        assert_eq!(ids(&got), [0, 1, 2, 3], "each slot once, in posting order");
        assert!(got.iter().all(|g| g.1 && g.4.is_some()), "each with its own completion and its region");
        let mut read = got.remove(0);
        match read.2 {
            WcStatus::Success => {
                r.target = ReadBack(read.4.take()).check(7, "the READ that completed");
            }
            WcStatus::WrFlushErr => {}
            other => panic!("the READ: {other:?}"),
        }
        assert!(r.a.lane.poll().unwrap().is_none(), "nothing twice");
        assert_eq!(r.a.lane.outstanding(r.a.qp).unwrap(), (0, 0));
        drop(r);
    }
    t.finish();
}

/// The lane is dropped while sends wait behind a READ (perhaps held, unhanded): its drop
/// returns within its bound and destroys everything (`finish` counts the QPs, CQs and MRs).
#[test]
fn dropping_the_lane_while_sends_wait_behind_a_read_returns_and_releases_everything() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        let got = r.read_then_three_sends(3);
        let handed = ids(&got);
        assert_eq!(handed, (0..handed.len() as u64).collect::<Vec<_>>(), "in order");
        drop(got);
        let Rig { a, b, .. } = r;
        let start = Instant::now();
        drop(a);
        // The lane's drain is bounded by 2 s, then one emptying of the CQ.
        assert!(start.elapsed() < Duration::from_secs(8), "the lane's drop took {:?}", start.elapsed());
        drop(b);
    }
    t.finish();
}

/// Prepared requests: a READ and sends, each `set_signaled(false)` but the last, posted as one
/// list, three times: in order, the READ's bytes all there; on iWARP each comes signaled (the
/// lane signals every request there, and holds a later completion for an earlier one's).
#[test]
fn prepared_unsignaled_sends_behind_a_prepared_read_retire_in_order_with_its_bytes() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        let iwarp = caps::iwarp();
        let read = r.read(0);
        let mut ps: Vec<PreparedSend> =
            vec![r.a.lane.prepare_send(r.a.qp, read).map_err(|e| e.into_parts().0).unwrap()];
        for k in 1..=3u64 {
            let m = message(&r.a, k as u8);
            ps.push(
                r.a.lane.prepare_send(r.a.qp, SendWr::send(m, 0..MSG).wr_id(k)).map_err(|e| e.into_parts().0).unwrap(),
            );
        }
        for p in &mut ps[..3] {
            p.set_signaled(false);
        }
        for round in 0..3u8 {
            // The READ's region is in the prepared READ: fill it there.
            r.source_mr.write_at(0, &pattern(BIG, round)).unwrap();
            ps[0].write_at(0, &vec![0u8; BIG]).unwrap();
            r.peer_receives(3);
            r.flood();
            assert_eq!(r.a.lane.post_prepared_list(&mut ps).unwrap(), 4);
            let mut got = reap(&mut r.a.lane, 4);
            assert_eq!(got.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [0, 1, 2, 3], "round {round}");
            for (k, c) in got.iter().enumerate() {
                assert!(c.is_ok(), "round {round}: {c:?}");
                assert_eq!(c.is_signaled(), iwarp || k == 3, "round {round}: {c:?}");
            }
            let mut mr = got[0].take_region().expect("the READ's region");
            assert!(mr.as_slice().unwrap() == &pattern(BIG, round)[..], "round {round}: the READ's bytes all landed");
            ps[0].rearm(mr).map_err(|e| e.into_parts().0).unwrap();
            for (k, c) in got.iter_mut().enumerate().skip(1) {
                ps[k].rearm(c.take_region().unwrap()).map_err(|e| e.into_parts().0).unwrap();
            }
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            r.peer_settles(3, true);
        }
        drop(ps);
        drop(r);
    }
    t.finish();
}

/// Inline sends (no region) behind an unsignaled READ, all unsignaled but the last: in order,
/// each once, the READ's region with every byte.
#[test]
fn inline_sends_behind_an_unsignaled_read_retire_after_it_in_order() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        let iwarp = caps::iwarp();
        for round in 0..3u8 {
            r.start_round(round, 4);
            let read = r.read(0).unsignaled();
            r.a.lane.post_send(r.a.qp, read).unwrap();
            for k in 1..=4u64 {
                let data = [k as u8; 32];
                let w = InlineWr::send(&data).wr_id(k);
                let w = if k < 4 { w.unsignaled() } else { w };
                r.a.lane.post_inline(r.a.qp, w).unwrap();
            }
            let mut got = reap(&mut r.a.lane, 5);
            assert_eq!(got.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [0, 1, 2, 3, 4], "round {round}");
            for (k, c) in got.iter().enumerate() {
                assert!(c.is_ok(), "round {round}: {c:?}");
                assert_eq!(c.is_signaled(), iwarp || k == 4, "round {round}: {c:?}");
            }
            let mut mr = got[0].take_region().expect("the READ's region");
            assert!(mr.as_slice().unwrap() == &pattern(BIG, round)[..], "round {round}: the READ's bytes all landed");
            r.target = Some(mr);
            assert!(got[1..].iter_mut().all(|c| c.take_region().is_none()), "inline sends have no region");
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            r.peer_settles(4, true);
        }
        drop(r);
    }
    t.finish();
}

/// A READ, then a batch of two WRITEs and a send, then a batch ending in a READ, then a send:
/// the batches retire whole, in order, after the READ, and the second batch's READ bytes are
/// all there.
#[test]
fn batches_behind_a_read_and_a_batch_ending_in_a_read_retire_in_order() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        let (scratch, source) = (r.scratch, r.source);
        let mut b1 =
            r.a.lane
                .prepare_batch(r.a.qp, region(&r.a.pd, 4096), 3, |k, mr| match k {
                    0 => SendWr::write(mr, 0..64, &scratch, 0),
                    1 => SendWr::write(mr, 64..128, &scratch, 64),
                    _ => SendWr::send(mr, 0..32).wr_id(1),
                })
                .map_err(|e| e.into_parts().0)
                .unwrap();
        let mut b2 =
            r.a.lane
                .prepare_batch(r.a.qp, region(&r.a.pd, 4096), 2, |k, mr| match k {
                    0 => SendWr::write(mr, 0..64, &scratch, 128),
                    _ => SendWr::read(mr, 1024..3072, &source, 0).wr_id(2),
                })
                .map_err(|e| e.into_parts().0)
                .unwrap();
        for round in 0..3u8 {
            r.fill(round);
            b2.write_at(1024, &[0u8; 2048]).unwrap();
            r.peer_receives(2);
            r.flood();
            let read = r.read(0);
            r.a.lane.post_send(r.a.qp, read).unwrap();
            r.a.lane.post_batch(&mut b1).unwrap();
            r.a.lane.post_batch(&mut b2).unwrap();
            let m = message(&r.a, 3);
            r.a.lane.post_send(r.a.qp, SendWr::send(m, 0..MSG).wr_id(3)).unwrap();
            let mut got = reap(&mut r.a.lane, 4);
            assert_eq!(got.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [0, 1, 2, 3], "round {round}");
            assert!(got.iter().all(|c| c.is_ok() && c.is_signaled()), "round {round}: {got:?}");
            r.read_back(&mut got[0], round, &format!("round {round}"));
            b1.rearm(got[1].take_region().unwrap()).map_err(|e| e.into_parts().0).unwrap();
            let mut back = got[2].take_region().expect("the second batch's region");
            let mut bytes = vec![0u8; 2048];
            back.read_at(1024, &mut bytes).unwrap();
            assert!(bytes == pattern(BIG, round)[..2048], "round {round}: the batch's READ bytes all landed");
            b2.rearm(back).map_err(|e| e.into_parts().0).unwrap();
            assert!(got[3].take_region().is_some());
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            assert_eq!(r.a.lane.outstanding(r.a.qp).unwrap(), (0, 0));
            r.peer_settles(2, true);
        }
        drop((b1, b2));
        drop(r);
    }
    t.finish();
}

/// `post_send_list` and `post_send_iter` with an unsignaled READ in the middle of unsignaled
/// sends, the last one signaled: in order, each once, the READ's bytes all there.
#[test]
fn a_read_in_the_middle_of_a_posted_list_retires_in_order_with_its_bytes() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        let iwarp = caps::iwarp();
        for round in 0..4u8 {
            r.start_round(round, 3);
            let read = r.read(2).unsignaled();
            let s = |k: u64, r: &Rig| SendWr::send(message(&r.a, k as u8), 0..MSG).wr_id(k);
            let wrs = [s(1, &r).unsignaled(), read, s(3, &r).unsignaled(), s(4, &r)];
            if round % 2 == 0 {
                let mut list: Vec<Option<SendWr>> = wrs.into_iter().map(Some).collect();
                assert_eq!(r.a.lane.post_send_list(r.a.qp, &mut list).unwrap(), 4);
            } else {
                assert_eq!(r.a.lane.post_send_iter(r.a.qp, wrs).unwrap(), 4);
            }
            let mut got = reap(&mut r.a.lane, 4);
            assert_eq!(got.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [1, 2, 3, 4], "round {round}");
            for (k, c) in got.iter().enumerate() {
                assert!(c.is_ok(), "round {round}: {c:?}");
                assert_eq!(c.is_signaled(), iwarp || k == 3, "round {round}: {c:?}");
            }
            let mut mr = got[1].take_region().expect("the READ's region");
            assert!(mr.as_slice().unwrap() == &pattern(BIG, round)[..], "round {round}: the READ's bytes all landed");
            r.target = Some(mr);
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            r.peer_settles(3, true);
        }
        drop(r);
    }
    t.finish();
}

/// Two QPs on one lane: one has sends waiting behind its READ, the other streams sends. Each
/// QP's completions come back once each, in its own posting order, whatever is held.
#[test]
fn two_qps_on_one_lane_one_waiting_behind_a_read_each_come_back_once_in_order() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        let (q2, pd2, peer2) = attached_pair(&mut r.a.lane, t.addr, PairSpec::default());
        for round in 0..3u8 {
            for k in 0..8u64 {
                crate::common::raw::post_recv(
                    &peer2.conn,
                    &peer2.mrs[0],
                    (k as usize) * MSG..(k as usize + 1) * MSG,
                    k,
                );
            }
            r.start_round(round, 3);
            let read = r.read(0);
            r.a.lane.post_send(r.a.qp, read).unwrap();
            for k in 1..=3u64 {
                let m = message(&r.a, k as u8);
                r.a.lane.post_send(r.a.qp, SendWr::send(m, 0..MSG).wr_id(k)).unwrap();
            }
            for k in 0..8u64 {
                let m = region(&pd2, MSG);
                r.a.lane.post_send(q2, SendWr::send(m, 0..MSG).wr_id(10 + k)).unwrap();
            }
            let got = poll_until(&mut r.a.lane, if round == 1 { 1 } else { 16 }, 12);
            assert_eq!(got.len(), 12);
            let mine =
                |q: LaneQp| -> Vec<u64> { got.iter().filter(|g| (g.0 >= 10) == (q == q2)).map(|g| g.0).collect() };
            assert_eq!(mine(r.a.qp), [0, 1, 2, 3], "round {round}: the READ's QP, in order");
            assert_eq!(mine(q2), (10..18).collect::<Vec<_>>(), "round {round}: the other QP, in order");
            let mut got = got;
            let at = got.iter().position(|g| g.0 == 0).unwrap();
            let mut read = got.remove(at);
            assert_eq!((read.2, read.3), (WcStatus::Success, Some(WcOpcode::RdmaRead)), "round {round}");
            r.target = ReadBack(read.4.take()).check(round, &format!("round {round}"));
            assert!(got.iter().all(|g| g.2 == WcStatus::Success && g.4.is_some()), "round {round}");
            assert!(r.a.lane.poll().unwrap().is_none(), "round {round}: nothing twice");
            r.peer_settles(3, true);
            // The other peer's receives: all eight came.
            for k in 0..8u64 {
                let (status, _) = crate::common::raw::wait(&peer2.conn, false, k);
                assert_eq!(status, rdma_cm::ffi::ibv_wc_status::IBV_WC_SUCCESS);
            }
        }
        r.a.lane.remove(q2).unwrap();
        drop(peer2);
        drop(r);
    }
    t.finish();
}

/// A READ, then a batch whose middle request is a send with immediate data, which iWARP does
/// not have. On Soft-RoCE the READ comes back first, with every byte, then the batch. On iWARP
/// (whose Soft-iWARP library takes such a request, after which the QP runs nothing more) the
/// batch is refused when it is prepared and a single send with immediate data when it is
/// posted, both naming what is wrong, and the QP goes on: a plain send behind them completes.
#[test]
fn a_batch_with_immediate_data_behind_a_read_comes_back_after_it_or_is_refused() {
    let t = DeviceTest::start();
    {
        let mut r = rig(&t, 128);
        r.fill(5);
        r.peer_receives(3);
        let ops = |k: usize, mr: MemoryRegion| match k {
            0 => SendWr::send(mr, 0..32),
            1 => SendWr::send(mr, 32..64).imm(7),
            _ => SendWr::send(mr, 64..96).wr_id(1),
        };
        if caps::iwarp() {
            let (e, back) = r.a.lane.prepare_batch(r.a.qp, region(&r.a.pd, 4096), 3, ops).unwrap_err().into_parts();
            assert!(e.to_string().contains("work request 1 carries immediate data"), "{e}");
            let mut back = back.expect("the refused batch's region comes back");
            let refused = r.a.lane.post_send(r.a.qp, SendWr::send(region(&r.a.pd, 64), 0..32).imm(7)).unwrap_err();
            assert!(refused.to_string().contains("immediate data"), "{refused}");
            assert!(matches!(refused.error(), Error::Call { .. }), "{refused}");
            back.write_at(0, b"plain").unwrap();
            r.a.lane.post_send(r.a.qp, SendWr::send(back, 0..32).wr_id(2)).unwrap();
            let c = r.a.lane.wait(LONG).unwrap();
            assert!(c.is_ok() && c.wr_id() == 2, "the QP goes on: {c:?}");
            r.peer_settles(1, false);
            drop((refused, c, r));
            return t.finish();
        }
        r.flood();
        let mut batch =
            r.a.lane.prepare_batch(r.a.qp, region(&r.a.pd, 4096), 3, ops).map_err(|e| e.into_parts().0).unwrap();
        let read = r.read(0);
        r.a.lane.post_send(r.a.qp, read).unwrap();
        let posted = r.a.lane.post_batch(&mut batch);
        let mut first = r.a.lane.wait(LONG).unwrap();
        assert_eq!(first.wr_id(), 0, "the READ comes back first: {first:?} (batch: {posted:?})");
        assert!(
            first.is_signaled(),
            "the READ comes back with its own completion, not retired by a later one: {first:?}"
        );
        match first.status() {
            WcStatus::Success => r.read_back(&mut first, 5, "the READ"),
            WcStatus::WrFlushErr => assert!(posted.is_err() && first.take_region().is_some(), "{first:?}"),
            other => panic!("the READ: {other:?}"),
        }
        match posted {
            Ok(()) => {
                // The batch's last request comes back, succeeded or flushed after an earlier one
                // failed (the module docs of `batch`: a failure puts the QP in the error state).
                let c = r.a.lane.wait(LONG);
                if let Err(e) = &c {
                    let state = r.a.lane.attributes(r.a.qp).map(|a| a.state);
                    let held = r.a.lane.outstanding(r.a.qp);
                    r.a.lane.set_error(r.a.qp).unwrap();
                    let after = r.a.lane.wait(LONG).map(|c| (c.wr_id(), c.status()));
                    panic!(
                        "the batch, taken whole, never came back: {e}; the QP is {state:?}, slots {held:?}; \
                         after set_error: {after:?}"
                    );
                }
                let mut c = c.unwrap();
                assert!(c.is_ok() && c.wr_id() == 1 && c.take_region().is_some(), "{c:?}");
                assert_eq!(r.a.lane.outstanding(r.a.qp).unwrap(), (0, 0));
                r.peer_settles(3, true);
            }
            Err(e) => {
                // The batch's region comes back with the flush of its first request, if that one
                // had not run; otherwise the removal releases it.
                assert!(caps::iwarp(), "only Soft-iWARP refuses the send with immediate data: {e}");
                while let Some(c) = r.a.lane.poll().unwrap() {
                    assert_eq!(c.wr_id(), 1, "only the batch is left: {c:?}");
                }
                r.a.lane.remove(r.a.qp).unwrap();
            }
        }
        drop(batch);
        drop(r);
    }
    t.finish();
}
