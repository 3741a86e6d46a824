//! Posting on the lane: what a post refuses, and that a refused post holds nothing: a post
//! after `Lane::set_error`, a list with one bad work request in its middle, a list the
//! provider takes only in part (the provider stood in for through its post entry), and odd
//! arguments, which are errors, never panics.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use crate::common::lane::{lane_pair, lane_ud_pair, original_post_send, reap, with_post_send};
use crate::common::lane::{original_post_recv, with_post_recv};
use crate::common::{pattern, require, Cap, DeviceTest, PairSpec, T};
use crate::shared::{region, spec, LW};
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{InlineWr, Lane, LaneQp, RecvWr, SendWr, MAX_LIST};
use rdma_cm::MAX_SGE;
use rdma_cm::{
    ffi, AccessFlags, Client, CompletionQueue, ConnParam, Error, MemoryRegion, ProtectionDomain, QpInit, RemoteRegion,
    VerbsContext, WcStatus,
};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Every way to post on `qp` is refused with `Error::QpInError` naming `cause`, each region
/// given back (the list entries stay where they were), and nothing is posted or completes.
fn every_post_refused(lane: &mut Lane, qp: LaneQp, pd: &Arc<ProtectionDomain>, len: usize, cause: &str) {
    let in_error = |e: &Error, what: &str| {
        assert!(matches!(e, Error::QpInError { cause: c, .. } if c.contains(cause)), "{what}: {e}");
    };
    let rej = lane.post_recv(qp, RecvWr::new(region(pd, len)).wr_id(3)).unwrap_err();
    in_error(rej.error(), "post_recv");
    assert!(rej.into_inner().is_some_and(|mut m| m.as_mut_slice().is_ok()), "the receive's region comes back");
    let rej = lane.post_send(qp, SendWr::send(region(pd, len), 0..8).wr_id(2)).unwrap_err();
    in_error(rej.error(), "post_send");
    assert!(rej.into_inner().is_some(), "the send's region comes back");
    let mut sends = [Some(SendWr::send(region(pd, len), 0..8)), Some(SendWr::send(region(pd, len), 0..8))];
    in_error(&lane.post_send_list(qp, &mut sends).unwrap_err(), "post_send_list");
    assert!(sends.iter().all(Option::is_some), "a refused list keeps its entries");
    let mut recvs = [Some(RecvWr::new(region(pd, len))), Some(RecvWr::new(region(pd, len)))];
    in_error(&lane.post_recv_list(qp, &mut recvs).unwrap_err(), "post_recv_list");
    assert!(recvs.iter().all(Option::is_some), "a refused list keeps its entries");
    let e = lane.post_send_iter(qp, [SendWr::send(region(pd, len), 0..8)]).unwrap_err();
    in_error(e.error(), "post_send_iter");
    in_error(&lane.post_inline(qp, InlineWr::send(b"x")).unwrap_err(), "post_inline");
    assert_eq!(lane.outstanding(qp).unwrap(), (0, 0), "nothing posted");
    assert!(lane.poll().unwrap().is_none(), "nothing refused completes later");
}

/// Posts on a QP the caller moved to the error state (`Lane::set_error`), on RC and on UD
/// (where rxe never flushes a receive posted in the error state, so a post taken there would
/// hold its region for good): each is refused naming the cause, with its region given back and
/// nothing posted; the receive posted before `set_error` comes back flushed, once.
#[test]
fn posts_after_set_error_are_refused_with_nothing_held() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(), spec(), 64);
        a.lane.post_recv(a.qp, RecvWr::new(region(&a.pd, 64)).wr_id(1)).unwrap();
        a.lane.set_error(a.qp).unwrap();
        let mut f = reap(&mut a.lane, 1).pop().unwrap();
        assert_eq!((f.wr_id(), f.status()), (1, WcStatus::WrFlushErr), "{f:?}");
        assert!(f.take_region().is_some(), "the flush hands the region back");
        every_post_refused(&mut a.lane, a.qp, &a.pd, 64, "Lane::set_error");
        drop((a, b));
    }
    if require(Cap::Ud) {
        let mut p = lane_ud_pair(t.addr, 7418, QpInit::new(), 64);
        let s = &mut p.server;
        s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, GRH_LEN + 64)).wr_id(1)).unwrap();
        s.lane.set_error(s.qp).unwrap();
        let mut f = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!((f.wr_id(), f.status()), (1, WcStatus::WrFlushErr), "{f:?}");
        assert!(f.take_region().is_some());
        every_post_refused(&mut s.lane, s.qp, &s.pd, GRH_LEN + 64, "Lane::set_error");
        let c = &mut p.client;
        c.lane.set_error(c.qp).unwrap();
        let rej = c.lane.post_send(c.qp, SendWr::send(region(&c.pd, 64), 0..8).to(p.to_server)).unwrap_err();
        assert!(matches!(rej.error(), Error::QpInError { .. }), "{rej}");
        assert!(rej.into_inner().is_some());
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
        drop(p);
    }
    t.finish();
}

/// A bad work request, named, made afresh for each post (its region moves into the post).
type Named<'a, W> = (&'static str, Box<dyn Fn() -> W + 'a>);

/// A receive posted after the peer left (its departure seen, the QP in the error state, where
/// rxe never flushes a receive posted): refused with its region given back, or, if taken,
/// flushed; either way nothing is left for the teardown, which ends at once.
#[test]
fn a_receive_posted_after_the_peer_left_is_refused_or_flushed() {
    let t = DeviceTest::start();
    {
        let (c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, 64)).wr_id(1)).unwrap();
        drop(c);
        assert!(s.lane.wait_peer_left(s.qp, T).unwrap(), "the peer's departure was not seen");
        let f = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!((f.wr_id(), f.status()), (1, WcStatus::WrFlushErr), "{f:?}");
        match s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, 64)).wr_id(9)) {
            Err(rej) => {
                assert!(matches!(rej.error(), Error::QpInError { .. }), "{rej}");
                assert!(rej.into_inner().is_some(), "the refused receive's region comes back");
            }
            Ok(()) => {
                let f =
                    s.lane.wait(Duration::from_secs(3)).expect("a receive taken after the peer left must be flushed");
                assert_eq!((f.wr_id(), f.status()), (9, WcStatus::WrFlushErr), "{f:?}");
            }
        }
        assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0), "a receive is left for the teardown to drain");
        let start = Instant::now();
        drop(s);
        assert!(start.elapsed() < Duration::from_secs(2), "the teardown took {:?}", start.elapsed());
    }
    t.finish();
}

/// A list with one bad work request in its middle posts nothing, through every list path
/// (`post_send_list`, `post_recv_list`, `post_send_iter`): the entries stay where they were (the
/// iterator's come back in the error, in order), nothing is posted, and the queue is usable
/// after with the caller's `wr_id`s intact.
#[test]
fn a_bad_work_request_in_the_middle_of_a_list_posts_nothing() {
    let t = DeviceTest::start();
    {
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        let other_pd = ProtectionDomain::new(c.pd.context()).unwrap();
        let pd = c.pd.clone();
        let remote = s.mrs[0].remote();
        let g = || region(&pd, 4096);
        #[allow(clippy::reversed_empty_ranges)]
        let bad_recvs: Vec<Named<'_, RecvWr>> = vec![
            ("no LOCAL_WRITE", Box::new(|| RecvWr::new(MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap()))),
            ("out of bounds", Box::new(|| RecvWr::range(g(), 4090..4097))),
            ("reversed", Box::new(|| RecvWr::range(g(), 9..3))),
            ("at usize::MAX", Box::new(|| RecvWr::range(g(), usize::MAX - 1..usize::MAX))),
            ("another PD", Box::new(|| RecvWr::new(MemoryRegion::new(&other_pd, 64, LW).unwrap()))),
        ];
        for (what, bad) in &bad_recvs {
            let mut list = [Some(RecvWr::new(g()).wr_id(1)), Some(bad().wr_id(2)), Some(RecvWr::new(g()).wr_id(3))];
            let e = c.lane.post_recv_list(c.qp, &mut list).expect_err(what);
            assert!(matches!(e, Error::InvalidArgument(_) | Error::OutOfBounds { .. }), "{what}: {e:?}");
            assert!(list.iter().all(Option::is_some), "{what}: the entries stay");
            assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0), "{what}: nothing posted");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let bad_sends: Vec<Named<'_, SendWr>> = vec![
            ("READ into a read-only region", {
                let pd = pd.clone();
                Box::new(move || {
                    SendWr::read(MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap(), 0..8, &remote, 0)
                })
            }),
            ("reversed", Box::new(|| SendWr::send(g(), 9..3))),
            ("remote range past its region", Box::new(move || SendWr::write(g(), 0..64, &remote, 4090))),
            ("another PD", Box::new(|| SendWr::send(MemoryRegion::new(&other_pd, 64, LW).unwrap(), 0..8))),
            (
                "more pieces than a work request names",
                Box::new(|| SendWr::send_sg(g(), &[0..1, 1..2, 2..3, 3..4, 4..5])),
            ),
            ("immediate data on a READ", Box::new(move || SendWr::read(g(), 0..8, &remote, 0).imm(1))),
        ];
        for (what, bad) in &bad_sends {
            let mut list =
                [Some(SendWr::send(g(), 0..8).wr_id(1)), Some(bad().wr_id(2)), Some(SendWr::send(g(), 0..8))];
            let e = c.lane.post_send_list(c.qp, &mut list).expect_err(what);
            assert!(matches!(e, Error::InvalidArgument(_) | Error::OutOfBounds { .. }), "{what}: {e:?}");
            assert!(list.iter().all(Option::is_some), "{what}: the entries stay");
            let wrs = [SendWr::send(g(), 0..8).wr_id(1), bad().wr_id(2), SendWr::send(g(), 0..8).wr_id(3)];
            let (e, back) = c.lane.post_send_iter(c.qp, wrs).expect_err(what).into_parts();
            assert!(matches!(e, Error::InvalidArgument(_) | Error::OutOfBounds { .. }), "{what}: {e:?}");
            let ids: Vec<u64> = back.iter().map(|(id, _)| *id).collect();
            assert_eq!(ids, [1, 2], "{what}: the taken ones come back, in order (the third was never taken)");
            assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0), "{what}: nothing posted");
        }
        // More than a list takes.
        let mut many: Vec<Option<SendWr>> =
            (0..=MAX_LIST).map(|k| Some(SendWr::send(g(), 0..8).wr_id(k as u64))).collect();
        assert!(matches!(c.lane.post_send_list(c.qp, &mut many), Err(Error::InvalidArgument(_))));
        assert!(many.iter().all(Option::is_some));
        let mut many: Vec<Option<RecvWr>> = (0..=MAX_LIST).map(|_| Some(RecvWr::new(g()))).collect();
        assert!(matches!(c.lane.post_recv_list(c.qp, &mut many), Err(Error::InvalidArgument(_))));
        assert!(many.iter().all(Option::is_some));
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
        // The queues still work, with the caller's wr_ids intact.
        s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, 64)).wr_id(5)).unwrap();
        c.lane.post_send(c.qp, SendWr::send(g(), 0..8).wr_id(6)).unwrap();
        let sent = reap(&mut c.lane, 1).pop().unwrap();
        assert_eq!((sent.wr_id(), sent.status()), (6, WcStatus::Success));
        let got = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.status(), got.byte_len()), (5, WcStatus::Success, 8));
        drop((c, s, bad_recvs, bad_sends));
    }
    t.finish();
}

/// How many work requests of a list the stand-in providers below take before refusing one.
static TAKE: AtomicUsize = AtomicUsize::new(0);

/// Stands in for a provider that takes the first `TAKE` work requests of `wr` (posting them
/// through `real`) and refuses the next with ENOMEM, naming it in `bad` as verbs do.
///
/// # Safety
/// `wr` is a well-formed list with more than `TAKE` entries; `real` is the provider's post.
unsafe fn take_some<W>(
    qp: *mut ffi::ibv_qp,
    wr: *mut W,
    bad: *mut *mut W,
    next: impl Fn(*mut W) -> *mut *mut W,
    real: unsafe extern "C" fn(*mut ffi::ibv_qp, *mut W, *mut *mut W) -> i32,
) -> i32 {
    let take = TAKE.load(SeqCst);
    let (mut last, mut refused) = (std::ptr::null_mut::<W>(), wr);
    for _ in 0..take {
        last = refused;
        // SAFETY: the list has more than `take` entries (the caller's promise).
        refused = unsafe { *next(refused) };
    }
    if !last.is_null() {
        // SAFETY: cut the list after the last one taken, post that much, and mend it again: the
        // lane's list, valid for the call.
        unsafe {
            *next(last) = std::ptr::null_mut();
            let ret = real(qp, wr, bad);
            *next(last) = refused;
            if ret != 0 {
                return ret;
            }
        }
    }
    // SAFETY: `bad` is the caller's out-pointer.
    unsafe { *bad = refused };
    libc::ENOMEM
}

unsafe extern "C" fn partial_post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    // SAFETY: forwarded from the lane's post (see take_some); the entries' `next` fields are
    // valid to read and write.
    unsafe { take_some(qp, wr, bad, |w| &raw mut (*w).next, original_post_send()) }
}

unsafe extern "C" fn partial_post_recv(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
) -> i32 {
    // SAFETY: as in partial_post_send.
    unsafe { take_some(qp, wr, bad, |w| &raw mut (*w).next, original_post_recv()) }
}

/// A list the provider takes only in part (it takes the first and refuses the second, naming
/// it): the lane holds exactly what the provider took. `post_send_list` and `post_recv_list`
/// leave the refused entries where they were, `post_send_iter` gives their regions back, a
/// single post refused by the provider gives its region back, and the taken work requests
/// complete with their regions; the QP is not in error (the provider said what it took), and the
/// next post gets its own completion.
#[test]
fn a_list_the_provider_takes_in_part_holds_exactly_what_it_took() {
    let t = DeviceTest::start();
    {
        let init = QpInit::new().max_send_sge(3);
        let (mut c, mut s) =
            lane_pair(t.addr, PairSpec { init: init.clone(), ..spec() }, PairSpec { init, ..spec() }, 64);
        for k in 0..8 {
            s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, 64)).wr_id(100 + k)).unwrap();
        }
        let pd = c.pd.clone();
        let msg = |seed: u8| {
            let mut m = region(&pd, 64);
            m.as_mut_slice().unwrap().copy_from_slice(&pattern(64, seed));
            m
        };
        TAKE.store(1, SeqCst);
        let mut list = [
            Some(SendWr::send_sg(msg(1), &[0..8, 16..24]).wr_id(1)),
            Some(SendWr::send(msg(2), 0..8).wr_id(2)),
            Some(SendWr::send(msg(3), 0..8).wr_id(3)),
        ];
        let e = with_post_send(&mut c, partial_post_send, |c| c.lane.post_send_list(c.qp, &mut list)).unwrap_err();
        assert!(matches!(e, Error::Call { op: "ibv_post_send", .. }), "{e:?}");
        assert!(list[0].is_none(), "the taken one is in the lane");
        assert!(list[1].is_some() && list[2].is_some(), "the refused ones stay with the caller");
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (1, 0), "the lane holds the taken one only");
        let mut done = reap(&mut c.lane, 1).pop().unwrap();
        assert_eq!((done.wr_id(), done.status()), (1, WcStatus::Success));
        assert!(done.take_region().is_some());
        let got = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.byte_len()), (100, 16), "only the taken one arrived");

        let wrs = [
            SendWr::send(msg(4), 0..8).wr_id(4),
            SendWr::send(msg(5), 0..8).wr_id(5),
            SendWr::send(msg(6), 0..8).wr_id(6),
        ];
        let r = with_post_send(&mut c, partial_post_send, |c| c.lane.post_send_iter(c.qp, wrs));
        let (e, back) = r.unwrap_err().into_parts();
        assert!(matches!(e, Error::Call { op: "ibv_post_send", .. }), "{e:?}");
        let ids: Vec<u64> = back.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [5, 6], "the refused ones' regions come back, in order");
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (1, 0));
        assert_eq!(reap(&mut c.lane, 1).pop().unwrap().wr_id(), 4);
        assert_eq!(reap(&mut s.lane, 1).pop().unwrap().wr_id(), 101);

        TAKE.store(0, SeqCst);
        let r = with_post_send(&mut c, partial_post_send, |c| c.lane.post_send(c.qp, SendWr::send(msg(7), 0..8)));
        let rej = r.unwrap_err();
        assert!(matches!(rej.error(), Error::Call { op: "ibv_post_send", .. }), "{rej:?}");
        assert!(rej.into_inner().is_some(), "a post the provider refused by name gives its region back");
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));

        // Receives: the provider takes the first of two.
        TAKE.store(1, SeqCst);
        let mut recvs =
            [Some(RecvWr::new(region(&c.pd, 64)).wr_id(50)), Some(RecvWr::new(region(&c.pd, 64)).wr_id(51))];
        let e = with_post_recv(&mut c, partial_post_recv, |c| c.lane.post_recv_list(c.qp, &mut recvs)).unwrap_err();
        assert!(matches!(e, Error::Call { op: "ibv_post_recv", .. }), "{e:?}");
        assert!(recvs[0].is_none() && recvs[1].is_some());
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 1));
        s.lane.post_send(s.qp, SendWr::send(region(&s.pd, 64), 0..8).wr_id(60)).unwrap();
        assert_eq!(reap(&mut s.lane, 1).pop().unwrap().status(), WcStatus::Success);
        let mut got = reap(&mut c.lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.byte_len()), (50, 8));
        assert!(got.take_region().is_some());

        // Not in error: the next posts go through, each with its own completion.
        c.lane.post_send(c.qp, SendWr::send(msg(8), 0..8).wr_id(9)).unwrap();
        let done = reap(&mut c.lane, 1).pop().unwrap();
        assert_eq!((done.wr_id(), done.status()), (9, WcStatus::Success));
        assert_eq!(reap(&mut s.lane, 1).pop().unwrap().wr_id(), 102);
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
        drop((c, s, list, recvs));
    }
    t.finish();
}

/// Odd arguments are errors, never panics, and leave the lane usable: a lane or CQ of depth 0
/// or beyond any CQ, QP capabilities beyond reason (also for a QP joining a lane), private data
/// too long for a connect, regions of odd sizes, a remote range overflowing, more pieces than a
/// work request names and none, a wait for nothing, empty lists, inline data over the limit.
#[test]
fn odd_arguments_are_errors_not_panics() {
    let t = DeviceTest::start();
    {
        let ctx = VerbsContext::cm_for_addr(t.addr).unwrap();
        for depth in [0, u32::MAX, i32::MAX as u32] {
            assert!(Lane::new(&ctx, depth).is_err(), "a lane of depth {depth}");
        }
        assert!(CompletionQueue::new(&ctx, 0).is_err());
        assert!(CompletionQueue::new(&ctx, u32::MAX).is_err());
        assert!(CompletionQueue::new(&ctx, i32::MAX as u32).is_err());
        assert!(ConnParam::new().private_data(&[0; 197]).is_err());
        // QP capabilities beyond reason, on fresh routes, also with a lane's CQ.
        let dst = SocketAddr::new(t.addr, 7999);
        let route = || Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let mut lane = Lane::new(&ctx, 32).unwrap();
        for init in [
            QpInit::new().max_send_wr(0),
            QpInit::new().max_recv_wr(0),
            QpInit::new().max_send_wr(u32::MAX),
            QpInit::new().max_recv_wr(i32::MAX as u32),
            QpInit::new().max_inline_data(u32::MAX),
            QpInit::new().max_send_sge(u32::MAX),
        ] {
            let r = route();
            let pd = r.alloc_pd().unwrap();
            assert!(r.create_qp(&pd, init.clone()).is_err(), "{init:?}");
            let r = route();
            let pd = r.alloc_pd().unwrap();
            assert!(r.lane_qp(&mut lane, &pd, init.clone()).is_err(), "on a lane: {init:?}");
        }
        // A send queue of 16 on a CQ of one entry (a lane puts its own CQ in instead).
        let r = route();
        let pd = r.alloc_pd().unwrap();
        assert!(r.create_qp(&pd, QpInit::new().send_cq(CompletionQueue::new(&ctx, 1).unwrap())).is_err());
        assert!(lane.poll().unwrap().is_none(), "the refused QPs left nothing on the lane");
        // Private data too long for connect (56) but fine for accept (196).
        let r = route();
        let pd = r.alloc_pd().unwrap();
        let p = ConnParam::new().private_data(&[1; 100]).unwrap();
        let cl = r.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        assert!(matches!(cl.connect(&mut lane, &p, T), Err(Error::InvalidArgument(_))));
        drop((lane, pd));
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        let pd = c.pd.clone();
        assert!(MemoryRegion::new(&pd, 0, LW).is_err());
        assert!(MemoryRegion::new(&pd, usize::MAX, LW).is_err());
        assert!(MemoryRegion::new(&pd, 64, AccessFlags::from_bits_retain(u32::MAX)).is_err());
        assert!(RemoteRegion::new(u64::MAX, 1, u64::MAX).at(u64::MAX, 1).is_err());
        let remote = s.mrs[0].remote();
        for offset in [u64::MAX, u64::MAX - 7, 4096] {
            let rej = c.lane.post_send(c.qp, SendWr::read(region(&pd, 64), 0..8, &remote, offset)).unwrap_err();
            assert!(matches!(rej.error(), Error::OutOfBounds { .. }), "READ at {offset}: {rej}");
            assert!(rej.into_inner().is_some());
        }
        let pieces: Vec<_> = (0..MAX_SGE + 1).map(|k| k..k + 1).collect();
        let rej = c.lane.post_send(c.qp, SendWr::send_sg(region(&pd, 64), &pieces)).unwrap_err();
        assert!(matches!(rej.error(), Error::InvalidArgument(_)), "{rej}");
        let rej = c.lane.post_send(c.qp, SendWr::send_sg(region(&pd, 64), &[])).unwrap_err();
        assert!(matches!(rej.error(), Error::InvalidArgument(_)), "no piece at all: {rej}");
        assert_eq!(c.lane.post_send_list(c.qp, &mut []).unwrap(), 0);
        assert_eq!(c.lane.post_recv_list(c.qp, &mut [None, None]).unwrap(), 0);
        assert_eq!(c.lane.post_send_iter(c.qp, std::iter::empty()).unwrap(), 0);
        assert_eq!(c.lane.wait_with(0, T, |_, _| unreachable!()).unwrap(), 0);
        assert_eq!(c.lane.poll_with(0, |_, _| unreachable!()).unwrap(), 0);
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
        let mut big = vec![0u8; c.lane.max_inline_data(c.qp).unwrap() as usize + 1];
        big[0] = 1;
        assert!(c.lane.post_inline(c.qp, InlineWr::send(&big)).is_err(), "inline data over the QP's limit");
        // The connection still works.
        s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, 64)).wr_id(1)).unwrap();
        c.lane.post_inline(c.qp, InlineWr::send(&[]).wr_id(2)).unwrap();
        assert_eq!(reap(&mut c.lane, 1).pop().unwrap().wr_id(), 2);
        let got = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.byte_len(), got.status()), (1, 0, WcStatus::Success));
        drop((c, s, pd, ctx));
    }
    t.finish();
}
