//! The lane's three waits (`rdma_cm::verbs::lane`) on the device: the blocking `Lane::wait`
//! sleeps on the CQ's completion channel until the peer's send comes (its thread's CPU time
//! stays far below the wall time, where `Lane::spin`'s does not) and hands the right
//! completion; every wait ends within its bound on a lane where nothing comes, and names a QP
//! the peer's bad-rkey WRITE moved to the error state; `Lane::wait_async` (feature `tokio`)
//! wakes through the reactor, and a dropped one loses no completion.

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::lane::{lane_on, lane_pair, LaneSide};
use common::{pattern, DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{Completion, Lane, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Error, MemoryRegion, WorkQueue};

fn spec() -> PairSpec {
    PairSpec {
        mr_sizes: vec![4096, 4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    }
}

/// Regions for messages only: readable once back (a remotely writable one never is).
fn plain() -> PairSpec {
    PairSpec { mr_sizes: vec![4096, 4096], ..PairSpec::default() }
}

/// The calling thread's CPU time (user and system).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer for the call.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) }, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// How many times the calling thread gave up its CPU by itself (slept), so far.
fn sleeps() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").expect("/proc/thread-self/status");
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).expect("voluntary_ctxt_switches");
    line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("a count")
}

/// The waits under test.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Wait,
    Spin,
    #[cfg(feature = "tokio")]
    Async,
}

const KINDS: &[Kind] = &[
    Kind::Wait,
    Kind::Spin,
    #[cfg(feature = "tokio")]
    Kind::Async,
];

impl Kind {
    /// The name its errors carry.
    fn op(self) -> &'static str {
        match self {
            Kind::Wait => "Lane::wait",
            Kind::Spin => "Lane::spin",
            #[cfg(feature = "tokio")]
            Kind::Async => "Lane::wait_async",
        }
    }

    /// Waits on `lane` for one completion, this kind's way (the async one on a runtime of its
    /// own, blocked on).
    fn one(self, lane: &mut Lane, timeout: Duration) -> rdma_cm::Result<Completion> {
        match self {
            Kind::Wait => lane.wait(timeout),
            Kind::Spin => lane.spin(timeout),
            #[cfg(feature = "tokio")]
            Kind::Async => rt().block_on(lane.wait_async(timeout)),
        }
    }
}

#[cfg(feature = "tokio")]
fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// One message round on `(c, d)`: `d` posts a receive, `c` sends 64 bytes, and each waits for
/// its completion (the blocking wait), taking its region back.
fn round(c: &mut LaneSide, d: &mut LaneSide, regions: &mut (Option<MemoryRegion>, Option<MemoryRegion>)) {
    d.lane.post_recv(d.qp, RecvWr::new(regions.1.take().unwrap())).unwrap();
    c.lane.post_send(c.qp, SendWr::send(regions.0.take().unwrap(), 0..64)).unwrap();
    regions.0 = c.lane.wait(T).unwrap().ok().unwrap().take_region();
    regions.1 = d.lane.wait(T).unwrap().ok().unwrap().take_region();
}

/// The blocking wait sleeps while the peer is busy elsewhere: a thread waits on its lane for a
/// receive while the main thread runs message rounds on another pair for 300 ms and only then
/// sends. The wait hands out that receive (its `wr_id`, length and bytes), its thread slept,
/// and its CPU time is under a tenth of the wait's wall time. The same measurement of `Lane::spin`
/// (which also hands the right completion) shows a CPU time near its wall time: the
/// measurement sees spinning.
#[test]
fn the_blocking_wait_sleeps_until_the_peers_send_and_hands_its_completion() {
    const BUSY: Duration = Duration::from_millis(300);
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, plain(), plain(), 64);
        let (mut c, mut d) = lane_pair(t.addr, plain(), plain(), 64);
        let mut regions = (Some(c.mrs.remove(0)), Some(d.mrs.remove(0)));
        let mut b = Some(b);
        for (k, spin) in [(0u8, false), (1, true)] {
            let mut side = b.take().unwrap();
            let mut msg = a.mrs.remove(0);
            msg.write_at(0, &pattern(100, k)).unwrap();
            side.lane.post_recv(side.qp, RecvWr::new(side.mrs.remove(0)).wr_id(40 + k as u64)).unwrap();
            let (tx, rx) = mpsc::channel();
            let waiter = thread::spawn(move || {
                // A wait that finds nothing at once first: the code it runs is paged in, so
                // the measured wait's CPU time is its own.
                let warm = if spin { side.lane.spin(Duration::ZERO) } else { side.lane.wait(Duration::ZERO) };
                assert!(matches!(warm, Err(Error::Timeout { .. })), "{warm:?}");
                tx.send(()).unwrap();
                let slept = sleeps();
                let (cpu, wall) = (thread_cpu(), Instant::now());
                let got = if spin { side.lane.spin(T) } else { side.lane.wait(T) };
                let (wall, cpu) = (wall.elapsed(), thread_cpu() - cpu);
                let slept = sleeps() - slept;
                (side, got, wall, cpu, slept)
            });
            rx.recv_timeout(T).expect("the waiter started");
            let started = Instant::now();
            let mut rounds = 0;
            while started.elapsed() < BUSY {
                round(&mut c, &mut d, &mut regions);
                rounds += 1;
            }
            a.lane.post_send(a.qp, SendWr::send(msg, 0..100).wr_id(1)).unwrap();
            let (mut side, got, wall, cpu, slept) = waiter.join().expect("the waiter");
            let what = if spin { "Lane::spin" } else { "Lane::wait" };
            let mut got = got.unwrap_or_else(|e| panic!("{what} wakes for the peer's send: {e}"));
            assert!(got.is_ok(), "{got:?}");
            assert_eq!((got.wr_id(), got.queue(), got.byte_len()), (40 + k as u64, WorkQueue::Recv, 100));
            assert_eq!(got.qp(), Some(side.qp));
            let mut buf = got.take_region().expect("the receive's region comes back");
            assert_eq!(&buf.as_slice().unwrap()[..100], &pattern(100, k)[..]);
            let mut sent = a.lane.wait(T).unwrap();
            assert!(sent.is_ok() && sent.wr_id() == 1, "{sent:?}");
            a.mrs.push(sent.take_region().unwrap());
            side.mrs.insert(0, buf);
            println!(
                "{what}: waited {wall:?} over {rounds} rounds of the other pair, {cpu:?} of CPU, slept {slept} times"
            );
            assert!(wall >= BUSY / 2, "{what} returned after {wall:?}, before the peer sent");
            if spin {
                assert!(cpu * 3 > wall, "the measurement sees a spinning wait: {cpu:?} of CPU in {wall:?}");
            } else {
                assert!(cpu * 10 < wall, "Lane::wait spun: {cpu:?} of CPU in {wall:?}");
                assert!(slept >= 1, "Lane::wait never slept");
            }
            b = Some(side);
        }
        drop((a, b, c, d, regions));
    }
    t.finish();
}

/// Every wait on a lane where nothing can come ends with `Error::Timeout` naming the wait,
/// within its bound, for a zero timeout (a poll and nothing more) and a short one alike: on a
/// lane with no QP (the hint: nothing is outstanding) and on one whose QP has a receive
/// posted that no send matches (the hint: nothing completed, no QP in the error state).
#[test]
fn every_wait_on_a_lane_where_nothing_comes_times_out_within_its_bound() {
    let t = DeviceTest::start();
    {
        let mut empty = lane_on(t.addr, 16);
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        a.lane.post_recv(a.qp, RecvWr::new(a.mrs.remove(0)).wr_id(1)).unwrap();
        for &kind in KINDS {
            for (lane, hint) in [(&mut empty, "no work request is outstanding"), (&mut a.lane, "nothing completed")] {
                for timeout in [Duration::ZERO, Duration::from_millis(100)] {
                    let t0 = Instant::now();
                    let r = kind.one(lane, timeout);
                    let took = t0.elapsed();
                    match r {
                        Err(e @ Error::Timeout { .. }) => {
                            let text = e.to_string();
                            assert!(text.contains(kind.op()) && text.contains(hint), "{kind:?}: {text}");
                        }
                        r => panic!("{kind:?}, {timeout:?}: {r:?}"),
                    }
                    assert!(
                        took >= timeout && took < timeout + Duration::from_secs(2),
                        "{kind:?}, {timeout:?}: {took:?}"
                    );
                }
            }
        }
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 1), "the receive stays posted");
        drop((empty, a, b));
    }
    t.finish();
}

/// The peer's RDMA WRITE with a bad rkey moves the lane's (responder) QP to the error state
/// with no completion on its side (rxe). A receive posted then never completes; each wait
/// (a fresh pair for each) that runs out finds the QP there and says so (or the receive comes
/// back flushed, where a provider flushes it), and the lane's posts on that QP are refused
/// with the cause from then on: never a receive silently taken that never completes.
#[test]
fn every_wait_reports_a_qp_the_peers_bad_rkey_moved_to_the_error_state() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::RemoteWriteError) {
        return t.finish();
    }
    for &kind in KINDS {
        let (mut a, mut b) = lane_pair(t.addr, spec(), spec(), 64);
        let good = a.mrs[0].remote();
        let bad = rdma_cm::RemoteRegion::new(good.addr, good.rkey ^ 0x5a5a_0000, good.len);
        let src = MemoryRegion::new(&b.pd, 64, AccessFlags::empty()).unwrap();
        b.lane.post_send(b.qp, SendWr::write(src, 0..64, &bad, 0).wr_id(1)).unwrap();
        let c = kind.one(&mut b.lane, T).expect("the requester's completion");
        assert!(!c.is_ok(), "a WRITE with a bad rkey fails at the requester: {c:?}");
        // The responder has no completion of its own: a receive posted now is taken (nothing
        // says otherwise yet) and never completes.
        a.lane.post_recv(a.qp, RecvWr::new(a.mrs.remove(1)).wr_id(2)).unwrap();
        let t0 = Instant::now();
        match kind.one(&mut a.lane, Duration::from_secs(2)) {
            Err(e @ Error::QpInError { .. }) => {
                let text = e.to_string();
                assert!(text.contains("rkey") && text.contains(kind.op()), "{kind:?}: {text}");
            }
            Ok(c) => assert!(c.wr_id() == 2 && !c.is_ok(), "{kind:?}: only a flush may come: {c:?}"),
            Err(e) => panic!("{kind:?}: the wait must name the QP in the error state: {e}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(4), "{kind:?}: bounded: {:?}", t0.elapsed());
        let r = a.lane.post_recv(a.qp, RecvWr::new(a.mrs.remove(0)).wr_id(3)).expect_err("refused from then on");
        assert!(matches!(r.error(), Error::QpInError { .. }), "{}", r.error());
        assert!(r.into_inner().is_some(), "the region comes back");
        drop((a, b));
    }
    t.finish();
}

/// `Lane::wait_async` sleeps on the reactor and wakes for the peer's send: the wait is polled
/// first (nothing there: it arms the CQ and sleeps), and only then does the other branch of
/// the same task post the send.
#[cfg(feature = "tokio")]
#[test]
fn the_async_wait_wakes_through_the_reactor_for_the_peers_send() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, plain(), plain(), 64);
        let mut msg = a.mrs.remove(0);
        msg.write_at(0, &pattern(64, 5)).unwrap();
        b.lane.post_recv(b.qp, RecvWr::new(b.mrs.remove(0)).wr_id(7)).unwrap();
        let posted = std::cell::Cell::new(false);
        let (got, ()) = rt().block_on(async {
            let wait = async {
                let r = b.lane.wait_async(T).await;
                assert!(posted.get(), "the wait returned before the send was posted");
                r
            };
            let send = async {
                tokio::task::yield_now().await;
                a.lane.post_send(a.qp, SendWr::send(msg, 0..64).wr_id(8)).unwrap();
                posted.set(true);
            };
            tokio::join!(wait, send)
        });
        let mut got = got.expect("the async wait wakes for the peer's send");
        assert_eq!((got.wr_id(), got.byte_len(), got.qp()), (7, 64, Some(b.qp)));
        assert_eq!(&got.take_region().unwrap().as_slice().unwrap()[..64], &pattern(64, 5)[..]);
        assert!(a.lane.wait(T).unwrap().is_ok());
        // A runtime without timers: refused, not a panic.
        let no_time = tokio::runtime::Builder::new_current_thread().enable_io().build().unwrap();
        let e = no_time.block_on(b.lane.wait_async(T)).expect_err("no time driver");
        assert!(e.to_string().contains("time driver"), "{e}");
        drop((a, b));
    }
    t.finish();
}

/// Dropping a `Lane::wait_async` future loses no completion: one polled once (asleep on the
/// reactor) is dropped after the receive it waits for has completed (the peer's send is
/// acknowledged), and the next poll hands that receive out; the wait after it sleeps and wakes
/// as usual, the event the dropped one left behind notwithstanding.
#[cfg(feature = "tokio")]
#[test]
fn a_dropped_async_wait_loses_no_completion() {
    use std::future::Future;
    use std::task::Poll;
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, plain(), plain(), 64);
        let rt = rt();
        let mut msg = Some(a.mrs.remove(0));
        b.lane.post_recv(b.qp, RecvWr::new(b.mrs.remove(0)).wr_id(1)).unwrap();
        {
            let mut wait = std::pin::pin!(b.lane.wait_async(T));
            rt.block_on(std::future::poll_fn(|cx| {
                assert!(wait.as_mut().poll(cx).is_pending(), "nothing has been sent yet");
                Poll::Ready(())
            }));
            a.lane.post_send(a.qp, SendWr::send(msg.take().unwrap(), 0..64).wr_id(2)).unwrap();
            let mut sent = a.lane.wait(T).unwrap();
            assert!(sent.is_ok(), "{sent:?}");
            msg = sent.take_region();
        }
        let mut got = b.lane.poll().unwrap().expect("the receive the dropped wait was waiting for");
        assert!(got.is_ok() && got.wr_id() == 1, "{got:?}");
        b.lane.post_recv(b.qp, RecvWr::new(got.take_region().unwrap()).wr_id(3)).unwrap();
        let (got, ()) = rt.block_on(async {
            let send = async {
                tokio::task::yield_now().await;
                a.lane.post_send(a.qp, SendWr::send(msg.take().unwrap(), 0..64).wr_id(4)).unwrap();
            };
            tokio::join!(b.lane.wait_async(T), send)
        });
        assert_eq!(got.expect("the next wait").wr_id(), 3);
        drop((a, b));
    }
    t.finish();
}

/// The async wait's future can be spawned on a multi-threaded runtime: it is `Send`.
#[cfg(feature = "tokio")]
#[allow(dead_code)]
fn the_async_wait_is_send(lane: &mut Lane) {
    fn send<F: Send>(_: &F) {}
    send(&lane.wait_async(T));
    send(&lane.wait_async_with(4, T, |_, _| {}));
}

/// A lane in a caller's own loop: its CQ in a `Readiness` set is not ready before it is armed
/// (even with a completion in it), becomes ready at the completion that comes after
/// `Lane::arm`, and once armed and polled empty it is quiet again. Nothing is lost: the
/// completion that came before the arming is found by the poll after it.
#[test]
fn an_armed_lane_in_a_readiness_set_is_ready_at_its_next_completion_and_loses_none() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, plain(), plain(), 64);
        let cq = b.lane.cq();
        let mut ready = rdma_cm::Readiness::new().cq(&cq, "lane");
        // Before any arming: a completion in the CQ makes nothing ready.
        for k in 0..2u64 {
            b.lane.post_recv(b.qp, RecvWr::new(b.mrs.remove(0)).wr_id(10 + k)).unwrap();
        }
        let mut msgs = (a.mrs.remove(0), a.mrs.remove(0));
        msgs.0.write_at(0, &pattern(64, 1)).unwrap();
        msgs.1.write_at(0, &pattern(64, 2)).unwrap();
        a.lane.post_send(a.qp, SendWr::send(msgs.0, 0..64).wr_id(1)).unwrap();
        let sent = a.lane.wait(T).unwrap();
        assert!(sent.is_ok(), "{sent:?}");
        assert_eq!(ready.wait(Duration::ZERO).unwrap().count(), 0, "ready before the CQ was armed");
        // Arm, then poll: the completion from before the arming is there.
        b.lane.arm().unwrap();
        let mut first = b.lane.poll().unwrap().expect("the completion that came before the arming");
        assert_eq!((first.wr_id(), first.byte_len()), (10, 64));
        assert_eq!(&first.take_region().unwrap().as_slice().unwrap()[..64], &pattern(64, 1)[..]);
        assert!(b.lane.poll().unwrap().is_none());
        assert_eq!(ready.wait(Duration::ZERO).unwrap().count(), 0, "ready with nothing new");
        // The next completion makes it ready.
        a.lane.post_send(a.qp, SendWr::send(msgs.1, 0..64).wr_id(2)).unwrap();
        let woke: Vec<_> = ready.wait(T).unwrap().collect();
        assert_eq!(woke, ["lane"], "the completion after the arming makes the lane's CQ ready");
        b.lane.arm().unwrap();
        let mut second = b.lane.poll().unwrap().expect("the completion that made it ready");
        assert_eq!((second.wr_id(), second.byte_len()), (11, 64));
        assert_eq!(&second.take_region().unwrap().as_slice().unwrap()[..64], &pattern(64, 2)[..]);
        assert!(b.lane.poll().unwrap().is_none());
        assert_eq!(ready.wait(Duration::ZERO).unwrap().count(), 0, "quiet once armed and drained");
        assert!(a.lane.wait(T).unwrap().is_ok());
        drop(ready);
        drop((cq, a, b));
    }
    t.finish();
}
