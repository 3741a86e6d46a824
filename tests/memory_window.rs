//! Memory windows (`Lane::bind_window`, `Lane::invalidate_window`, `Lane::window_unbound`,
//! `SendWr::send_with_invalidate`) on the device. A window's rkey grants exactly its range and rights for as
//! long as it is bound, and a new rkey with each bind; after a local invalidation, an unbind or
//! the peer's send with invalidate, the peer's access fails (`REM_ACCESS_ERR`) and the memory
//! is unchanged. And the attempts to break it with safe code: the region taken back from the
//! bind's completion while the window is bound, dropped, or posted again; the window dropped
//! before its bind completed; an invalidation asked to release before it completed, on another
//! lane, or after it was flushed; a window invalidated through another QP, or again after the
//! peer's send with invalidate; the lane dropped under a bound window; a bound window
//! forgotten. And `examples/memory_window` as a process. Every test name contains `memory_window`.
//!
//! Each pair is a loopback RC connection through the device, each side on a lane of its own:
//! the server owns the region and its windows, the client writes through the rkeys it is
//! handed.

mod common;

use std::ops::Range;

use common::lane::{lane_pair, reap, LaneSide};
use common::{mr_count, pattern, DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{BindWr, Completion, Invalidating, Lane, RecvWr, SendWr};
use rdma_cm::verbs::mw::{BoundWindow, MemoryWindow, WindowType};
use rdma_cm::{AccessFlags, Error, MemoryRegion, ProtectionDomain, RemoteRegion, WcOpcode, WcStatus};

const MIB: usize = 1 << 20;
const WIN: Range<usize> = 4096..8192;

/// The region's registration: it takes windows, and no peer may write it through its own rkey.
fn window_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND
}

/// A connected pair on lanes: the client with an 8 KiB buffer, the server with a 1 MiB region
/// that takes windows. `None` (after a `skipped:` line) where the device has no windows of
/// `kind`.
fn window_pair(t: &DeviceTest, kind: WindowType) -> Option<(LaneSide, LaneSide)> {
    let client = PairSpec { mr_sizes: vec![8192], ..PairSpec::default() };
    let server = PairSpec { mr_sizes: vec![MIB], access: window_access(), ..PairSpec::default() };
    let (c, s) = lane_pair(t.addr, client, server, 64);
    match MemoryWindow::new(&s.pd, kind) {
        Ok(_) => Some((c, s)),
        Err(e @ Error::Unsupported { .. }) => {
            common::skipped(&format!("memory windows of {kind}"), &e.to_string());
            None
        }
        Err(e) => panic!("ibv_alloc_mw: {e}"),
    }
}

/// One completion of `lane`, within `T`, whatever its status.
fn next(lane: &mut Lane) -> Completion {
    reap(lane, 1).pop().unwrap()
}

/// Binds `mw` on the server's region 0 at `range` with `rights`, reaps the bind's completion
/// and puts the region it hands back where it was.
fn bind_with(s: &mut LaneSide, mw: MemoryWindow, range: Range<usize>, rights: AccessFlags, wr_id: u64) -> BoundWindow {
    let mr = s.mrs.remove(0);
    let w = s.lane.bind_window(s.qp, BindWr::new(mw, mr, range, rights).wr_id(wr_id)).expect("bind_window");
    let mut c = next(&mut s.lane);
    assert!(c.is_ok(), "the bind completes: {c:?}");
    assert_eq!((c.wr_id(), c.opcode()), (wr_id, Some(WcOpcode::BindMw)));
    s.mrs.insert(0, c.take_region().expect("the bind's completion hands the region back"));
    w
}

/// A new window of `kind`, bound as `bind_with` does.
fn bind(s: &mut LaneSide, kind: WindowType, range: Range<usize>, rights: AccessFlags, wr_id: u64) -> BoundWindow {
    let mw = MemoryWindow::new(&s.pd, kind).expect("ibv_alloc_mw");
    bind_with(s, mw, range, rights, wr_id)
}

/// Invalidates `w` on the server's QP, reaps the invalidation's completion (checked: its
/// opcode for the window's type), and takes the window back unbound.
fn invalidate(s: &mut LaneSide, w: BoundWindow, wr_id: u64) -> MemoryWindow {
    let kind = w.kind();
    let inv = s.lane.invalidate_window(s.qp, w, wr_id).map_err(|e| e.error).expect("invalidate_window");
    let c = next(&mut s.lane);
    assert!(c.is_ok(), "the invalidation completes: {c:?}");
    let want = if kind == WindowType::Two { WcOpcode::LocalInv } else { WcOpcode::BindMw };
    assert_eq!((c.wr_id(), c.opcode()), (wr_id, Some(want)));
    assert!(c.into_parts().1.is_none(), "an invalidation's completion carries no region");
    s.lane.window_unbound(inv).map_err(|r| r.into_parts().0).expect("the invalidation is done")
}

/// The client writes `data` at `remote` + `offset`: the completion's status.
fn client_write(c: &mut LaneSide, data: &[u8], remote: &RemoteRegion, offset: u64, wr_id: u64) -> WcStatus {
    let mut mr = c.mrs.remove(0);
    mr.write_at(0, data).expect("client buffer");
    c.lane.post_send(c.qp, SendWr::write(mr, 0..data.len(), remote, offset).wr_id(wr_id)).expect("post the write");
    let mut done = next(&mut c.lane);
    assert_eq!(done.wr_id(), wr_id);
    c.mrs.insert(0, done.take_region().expect("the write's region back"));
    done.status()
}

/// A window's bounds as a region the client may aim anywhere at (to reach past the window).
fn wide(w: &BoundWindow, len: u64) -> RemoteRegion {
    RemoteRegion::new(w.remote().addr, w.rkey(), len)
}

/// The server's region 0, copied out once nothing can write it.
fn contents(s: &mut LaneSide) -> Vec<u8> {
    let mut all = vec![0; MIB];
    s.mrs[0].read_at(0, &mut all).expect("the region is readable once no window may write it");
    all
}

fn in_flight(s: &mut LaneSide) -> bool {
    matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. }))
}

fn revoked_write_changes_nothing(kind: WindowType) {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, kind) else { return t.finish() };
    let w = bind(&mut s, kind, WIN, AccessFlags::REMOTE_WRITE, 1);
    assert_eq!(w.remote().len, 4096);
    assert_eq!(w.remote().addr, s.mrs[0].addr() + 4096, "the window starts at its offset in the region");
    assert_ne!(w.rkey(), s.mrs[0].rkey(), "the window has an rkey of its own");
    // The bind's completion handed the region back, but while the peer may write it, its bytes
    // stay out of Rust's reach.
    assert!(in_flight(&mut s), "a bound writable window keeps slices away");
    assert!(matches!(s.mrs[0].read_at(0, &mut [0; 4]), Err(Error::InFlight { .. })));
    let first = pattern(4096, 7);
    assert_eq!(client_write(&mut c, &first, &w.remote(), 0, 10), WcStatus::Success, "a write inside the window");
    let old = w.remote();
    // The invalidation releases nothing before its completion is handed out.
    let inv = s.lane.invalidate_window(s.qp, w, 2).map_err(|e| e.error).expect("invalidate_window");
    assert_eq!(inv.rkey(), old.rkey);
    let inv = match s.lane.window_unbound(inv) {
        Ok(_) => panic!("released before the invalidation's completion was handed out"),
        Err(r) => {
            assert!(r.error().to_string().contains("not been handed out"), "{r}");
            r.into_inner().expect("the invalidation back")
        }
    };
    assert!(in_flight(&mut s), "still held while the invalidation is in flight");
    let done = next(&mut s.lane);
    let want = if kind == WindowType::Two { WcOpcode::LocalInv } else { WcOpcode::BindMw };
    assert_eq!((done.wr_id(), done.opcode()), (2, Some(want)));
    let mw = s.lane.window_unbound(inv).map_err(|r| r.into_parts().0).expect("done");
    let all = contents(&mut s);
    assert_eq!(&all[WIN], &first[..], "the peer's write landed in the window, byte for byte");
    assert!(all[..4096].iter().chain(&all[8192..]).all(|&b| b == 0), "nothing outside the window changed");
    // The same window bound again, elsewhere: a new rkey, which opens the new range.
    let again = bind_with(&mut s, mw, 16384..20480, AccessFlags::REMOTE_WRITE, 3);
    assert_ne!(again.rkey(), old.rkey, "a window's rkey changes with each bind");
    let second = pattern(4096, 11);
    assert_eq!(client_write(&mut c, &second, &again.remote(), 0, 11), WcStatus::Success, "through the new rkey");
    let mw = invalidate(&mut s, again, 4);
    let all = contents(&mut s);
    assert_eq!(&all[16384..20480], &second[..]);
    // The rkeys the peer held and used now open nothing, and write nothing.
    assert_eq!(client_write(&mut c, &pattern(4096, 9), &old, 0, 12), WcStatus::RemAccessErr);
    assert_eq!(contents(&mut s), all, "the refused write changed no byte");
    drop(mw);
    drop((c, s));
    t.finish();
}

#[test]
fn memory_window_type2_grants_its_range_until_invalidated() {
    revoked_write_changes_nothing(WindowType::Two);
}

#[test]
fn memory_window_type1_grants_its_range_until_unbound() {
    revoked_write_changes_nothing(WindowType::One);
}

/// A window's rights hold, and nothing past its region is ever reached (see
/// `memory_window.rs` for rxe, which checks a window's accesses against its region's bounds
/// only: a bound window therefore holds its whole region).
#[test]
fn memory_window_grants_only_its_rights_and_never_more_than_its_region() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let far = wide(&w, 2 * MIB as u64);
    let past_region = (MIB - 4096 - 4) as u64;
    assert_eq!(client_write(&mut c, &[0xee; 8], &far, past_region, 10), WcStatus::RemAccessErr);
    drop(w);
    assert!(contents(&mut s).iter().all(|&b| b == 0), "a write that left the region wrote nothing");
    drop((c, s));
    // A window bound for remote read refuses a write, and leaves the bytes readable.
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let r = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_READ, 1);
    assert!(s.mrs[0].as_slice().is_ok(), "a read-only window leaves the bytes readable");
    assert!(s.mrs[0].as_mut_slice().is_err(), "but not writable in place: the window holds the region");
    assert_eq!(client_write(&mut c, &[1; 8], &r.remote(), 0, 10), WcStatus::RemAccessErr);
    assert!(contents(&mut s).iter().all(|&b| b == 0));
    drop(r);
    assert!(s.mrs[0].as_mut_slice().is_ok(), "the window's drop released the region");
    drop((c, s));
    t.finish();
}

/// Every refused bind gives the window and the region back, and posts nothing.
#[test]
fn memory_window_refused_binds_give_everything_back_and_post_nothing() {
    let t = DeviceTest::start();
    let Some((c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let refused = |s: &mut LaneSide, b: BindWr, what: &str| -> (MemoryWindow, MemoryRegion) {
        let r = s.lane.bind_window(s.qp, b).expect_err(what);
        assert!(r.error().to_string().contains(what), "{what}: {r}");
        r.into_inner().expect("everything back").into_parts()
    };
    let other_pd = ProtectionDomain::new(s.pd.context()).expect("a second PD");
    let region = s.mrs.remove(0);
    let foreign = MemoryWindow::new(&other_pd, WindowType::Two).unwrap();
    let (_, region) =
        refused(&mut s, BindWr::new(foreign, region, WIN, AccessFlags::REMOTE_WRITE), "another protection domain");
    let foreign_mr = MemoryRegion::new(&other_pd, 8192, window_access()).unwrap();
    let mw = MemoryWindow::new(&s.pd, WindowType::Two).unwrap();
    let (mw, foreign_mr) =
        refused(&mut s, BindWr::new(mw, foreign_mr, 0..4096, AccessFlags::REMOTE_WRITE), "another protection domain");
    let plain = MemoryRegion::new(&s.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
    let (mw, plain) = refused(&mut s, BindWr::new(mw, plain, 0..4096, AccessFlags::REMOTE_WRITE), "MW_BIND");
    let mut chunks = MemoryRegion::new(&s.pd, 2 * 8192, window_access()).unwrap().split(8192).unwrap();
    let chunk = chunks.remove(0);
    let (mut mw, chunk) = refused(&mut s, BindWr::new(mw, chunk, 0..4096, AccessFlags::REMOTE_WRITE), "chunk");
    assert!(chunks[0].as_slice().is_ok(), "the sibling chunk stays readable: no window can reach it");
    let mut region = region;
    for (range, rights) in [
        (0..0, AccessFlags::REMOTE_WRITE),
        (MIB - 10..MIB + 10, AccessFlags::REMOTE_WRITE),
        (0..4096, AccessFlags::LOCAL_WRITE),
        (0..4096, AccessFlags::empty()),
    ] {
        let r = s.lane.bind_window(s.qp, BindWr::new(mw, region, range.clone(), rights)).expect_err("refused");
        assert!(
            matches!(r.error(), Error::InvalidArgument(_) | Error::OutOfBounds { .. }),
            "{range:?} {rights:?}: {r}"
        );
        (mw, region) = r.into_inner().unwrap().into_parts();
    }
    assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0), "nothing was posted by any refused bind");
    assert!(region.as_mut_slice().is_ok(), "and the region is whole again");
    // A window of the lane's own PD still binds afterwards.
    s.mrs.insert(0, region);
    let w = bind_with(&mut s, mw, WIN, AccessFlags::REMOTE_WRITE, 5);
    drop(w);
    drop((c, s, plain, chunk, chunks, foreign_mr, other_pd));
    t.finish();
}

/// The region is held by the bound window, not by its handle: dropped after the bind's
/// completion handed it back, it stays registered (and the peer's writes land in memory that
/// was not freed) until the window goes.
#[test]
fn memory_window_holds_its_region_when_every_handle_is_dropped() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let before = mr_count().expect("rdma res");
    drop(s.mrs.remove(0));
    assert_eq!(mr_count(), Some(before), "a region a bound window names stays registered");
    assert_eq!(client_write(&mut c, &pattern(4096, 3), &w.remote(), 0, 10), WcStatus::Success);
    let mw = invalidate(&mut s, w, 2);
    assert_eq!(mr_count(), Some(before - 1), "the region goes with the invalidation's release");
    drop(mw);
    drop((c, s));
    t.finish();
}

/// The region handed back by the bind's completion, posted again while a writable window is
/// bound: the device may write it either way, and when the receive hands it back its bytes are
/// still out of reach, until the window is unbound.
#[test]
fn memory_window_region_posted_again_while_bound_stays_out_of_reach() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let region = s.mrs.remove(0);
    s.lane.post_recv(s.qp, RecvWr::range(region, MIB - 64..MIB).wr_id(5)).expect("a receive into it");
    let mut msg = c.mrs.remove(0);
    msg.write_at(0, b"hello").unwrap();
    c.lane.post_send(c.qp, SendWr::send(msg, 0..5).wr_id(6)).unwrap();
    c.mrs.insert(0, next(&mut c.lane).take_region().unwrap());
    let mut got = next(&mut s.lane);
    assert_eq!((got.wr_id(), got.byte_len(), got.status()), (5, 5, WcStatus::Success));
    s.mrs.insert(0, got.take_region().unwrap());
    assert!(in_flight(&mut s), "the receive is done, the window is not: still out of reach");
    let mw = invalidate(&mut s, w, 2);
    let mut tail = [0; 5];
    s.mrs[0].read_at(MIB - 64, &mut tail).unwrap();
    assert_eq!(&tail, b"hello");
    drop((mw, c, s));
    t.finish();
}

/// The peer's send with invalidate: the receive names the rkey where the device says so
/// (`Wc::invalidated_rkey`), and either way the rkey opens nothing afterwards; the window keeps
/// its region until it is dropped, and refuses a new bind meanwhile. Then the attempt to
/// invalidate it again locally: whatever the device answers, nothing is released that the
/// peer might still write.
#[test]
fn memory_window_invalidated_by_the_peers_send_with_invalidate() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let (rkey, remote) = (w.rkey(), w.remote());
    let inbox = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    s.lane.post_recv(s.qp, RecvWr::new(inbox).wr_id(5)).unwrap();
    let mut msg = c.mrs.remove(0);
    msg.write_at(0, b"revoke").unwrap();
    c.lane.post_send(c.qp, SendWr::send_with_invalidate(msg, 0..6, rkey).wr_id(20)).unwrap();
    let mut sent = next(&mut c.lane);
    assert!(sent.is_ok(), "the send with invalidate completes: {sent:?}");
    c.mrs.insert(0, sent.take_region().unwrap());
    let got = next(&mut s.lane);
    assert!(got.is_ok() && got.wr_id() == 5, "{got:?}");
    assert_eq!(got.imm_data(), None, "an invalidation is no immediate data");
    assert_eq!(client_write(&mut c, &[3; 16], &remote, 0, 21), WcStatus::RemAccessErr, "the rkey opens nothing");
    let wc = *got;
    let still = match got.invalidated_rkey() {
        Some(k) => {
            assert_eq!(k, rkey, "the receive names the rkey the peer invalidated");
            let mw = w.invalidated_by(&wc).expect("the completion invalidated this window");
            assert!(in_flight(&mut s), "held until the window is dropped");
            let region = s.mrs.remove(0);
            let r = s.lane.bind_window(s.qp, BindWr::new(mw, region, WIN, AccessFlags::REMOTE_WRITE)).unwrap_err();
            assert!(r.error().to_string().contains("drop this window"), "{r}");
            let (mw, region) = r.into_inner().unwrap().into_parts();
            s.mrs.insert(0, region);
            drop(mw);
            None
        }
        None => {
            // rxe flags it with the kernel's IB_WC_WITH_INVALIDATE bit, not IBV_WC_WITH_INV
            // (see memory_window.rs): nothing is assumed, the window stays bound.
            let still = w.invalidated_by(&wc).expect_err("without IBV_WC_WITH_INV nothing is assumed");
            assert!(in_flight(&mut s), "still held");
            Some(still)
        }
    };
    if let Some(still) = still {
        // Invalidated again, locally, after the peer did: the device may take or refuse it.
        let inv = s.lane.invalidate_window(s.qp, still, 7).map_err(|e| e.error).expect("posted");
        let done = next(&mut s.lane);
        match s.lane.window_unbound(inv) {
            Ok(mw) => {
                assert!(done.is_ok(), "released only on success: {done:?}");
                drop(mw);
            }
            Err(r) => {
                assert!(!done.is_ok(), "refused although the invalidation succeeded: {done:?}");
                assert!(matches!(r.error(), Error::QpInError { .. }), "{r}");
                assert!(in_flight(&mut s), "a failed invalidation releases nothing");
                drop(r.into_inner().expect("the invalidation back"));
            }
        }
    }
    assert!(contents(&mut s).iter().all(|&b| b == 0), "the window's bytes never changed");
    drop((got, c, s));
    t.finish();
}

/// Any other receive leaves a bound window bound.
#[test]
fn memory_window_survives_a_plain_send() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let inbox = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    s.lane.post_recv(s.qp, RecvWr::new(inbox).wr_id(5)).unwrap();
    let msg = c.mrs.remove(0);
    c.lane.post_send(c.qp, SendWr::send(msg, 0..5).wr_id(20)).unwrap();
    c.mrs.insert(0, next(&mut c.lane).take_region().unwrap());
    let got = next(&mut s.lane);
    assert_eq!(got.invalidated_rkey(), None);
    let still = w.invalidated_by(&got).expect_err("a plain send invalidates nothing");
    assert_eq!(client_write(&mut c, &[4; 16], &still.remote(), 0, 21), WcStatus::Success, "still grants its range");
    let mw = invalidate(&mut s, still, 2);
    drop((got, mw, c, s));
    t.finish();
}

/// An invalidation flushed (the QP failed a WRITE posted just before it) may leave the window
/// bound: `window_unbound` refuses, the region stays held, and dropping the invalidation
/// (which deallocates the window, unbinding it) is what releases it.
#[test]
fn memory_window_whose_invalidation_is_flushed_keeps_the_region_until_dropped() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::RemoteWriteError) {
        return t.finish();
    }
    for kind in [WindowType::One, WindowType::Two] {
        let Some((c, mut s)) = window_pair(&t, kind) else { return t.finish() };
        let w = bind(&mut s, kind, WIN, AccessFlags::REMOTE_WRITE, 1);
        let src = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let bogus = RemoteRegion::new(0, 0x5a5a_5a00, 64);
        s.lane.post_send(s.qp, SendWr::write(src, 0..64, &bogus, 0).wr_id(2)).unwrap();
        let inv = s.lane.invalidate_window(s.qp, w, 3).map_err(|e| e.error).expect("posted");
        let failed = next(&mut s.lane);
        assert_eq!(failed.wr_id(), 2);
        assert_ne!(failed.status(), WcStatus::Success, "the WRITE fails");
        let flushed = next(&mut s.lane);
        assert_eq!((flushed.wr_id(), flushed.status()), (3, WcStatus::WrFlushErr), "{kind}: the invalidation");
        let r = s.lane.window_unbound(inv).expect_err("a flushed invalidation releases nothing");
        assert!(matches!(r.error(), Error::QpInError { .. }), "{r}");
        assert!(in_flight(&mut s), "{kind}: the region of a window whose invalidation was flushed is still held");
        let before = mr_count().expect("rdma res");
        let region = s.mrs.remove(0);
        drop(region);
        assert_eq!(mr_count(), Some(before), "{kind}: still registered");
        drop(r.into_inner().expect("the invalidation back"));
        assert_eq!(mr_count(), Some(before - 1), "{kind}: deallocating the window released the region");
        drop((c, s));
    }
    t.finish();
}

/// An invalidation is released only by the lane that posted it, and a window only invalidated
/// through the QP that bound it.
#[test]
fn memory_window_is_invalidated_only_through_the_qp_that_bound_it() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    // The client's QP is on another PD: refused as such, the window back.
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let e = c.lane.invalidate_window(c.qp, w, 2).expect_err("another QP");
    assert!(e.error.to_string().contains("another protection domain"), "{}", e.error);
    let w = e.window;
    // The server's lane with the client's LaneQp: not its QP.
    let e = s.lane.invalidate_window(c.qp, w, 2).expect_err("another lane's QP");
    assert!(e.error.to_string().contains("not attached to this lane"), "{}", e.error);
    let w = e.window;
    let inv = s.lane.invalidate_window(s.qp, w, 3).map_err(|e| e.error).unwrap();
    // Asked of another lane: refused, the invalidation back.
    let r = c.lane.window_unbound(inv).expect_err("another lane");
    assert!(r.error().to_string().contains("not attached to this lane"), "{r}");
    let inv: Invalidating = r.into_inner().unwrap();
    assert_eq!(next(&mut s.lane).opcode(), Some(WcOpcode::LocalInv));
    let mw = s.lane.window_unbound(inv).map_err(|r| r.into_parts().0).expect("through its own lane");
    assert!(s.mrs[0].as_mut_slice().is_ok(), "released by the invalidation's success");
    drop((mw, c, s));
    t.finish();
}

/// A type 1 window bound through one QP of a protection domain and invalidated through
/// another of the same domain, on one lane: two send queues are not ordered, so the bind could
/// run after the invalidation: refused, the window back, still bound.
#[test]
fn memory_window_of_type1_is_invalidated_only_through_its_own_qp_on_a_shared_pd() {
    use rdma_cm::verbs::peer::PeerInfo;
    use rdma_cm::verbs::qp::{RcParams, UnconnectedQp};
    use rdma_cm::{devices, VerbsContext};
    let t = DeviceTest::start();
    if !common::require(common::Cap::ConnectWithoutCm) {
        return t.finish();
    }
    {
        let name = devices().unwrap().into_iter().next().expect("a device (this is a device test)").name;
        let ctx = VerbsContext::open(&name).unwrap();
        let gid_index = common::rocev2_gid_index(&ctx, t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mw = match MemoryWindow::new(&pd, WindowType::One) {
            Ok(mw) => mw,
            Err(e @ Error::Unsupported { .. }) => {
                common::skipped("memory windows of type 1", &e.to_string());
                return t.finish();
            }
            Err(e) => panic!("ibv_alloc_mw: {e}"),
        };
        let mut lane = Lane::new(&ctx, 64).unwrap();
        let params = RcParams::new().gid_index(u8::try_from(gid_index).unwrap());
        let a = UnconnectedQp::new(&pd, lane.qp_init(), params.clone()).unwrap();
        let b = UnconnectedQp::new(&pd, lane.qp_init(), params).unwrap();
        let (ia, ib): (PeerInfo, PeerInfo) = (a.local(), b.local());
        let (qa, qb) = (a.connect(&ib).unwrap(), b.connect(&ia).unwrap());
        let qa = lane.attach(qa).map_err(|r| r.into_parts().0).unwrap();
        let qb = lane.attach(qb).map_err(|r| r.into_parts().0).unwrap();
        let mr = MemoryRegion::new(&pd, MIB, window_access()).unwrap();
        let w = lane.bind_window(qa, BindWr::new(mw, mr, WIN, AccessFlags::REMOTE_WRITE).wr_id(1)).unwrap();
        let e = lane.invalidate_window(qb, w, 2).expect_err("another QP's send queue is not ordered after the bind");
        assert!(e.error.to_string().contains("bound through another QP"), "{}", e.error);
        let w = e.window;
        let mut bound = next(&mut lane);
        assert_eq!((bound.wr_id(), bound.opcode()), (1, Some(WcOpcode::BindMw)));
        let mut mr = bound.take_region().unwrap();
        let inv = lane.invalidate_window(qa, w, 3).map_err(|e| e.error).expect("through the QP that bound it");
        assert!(next(&mut lane).is_ok());
        let mw = lane.window_unbound(inv).map_err(|r| r.into_parts().0).unwrap();
        assert!(mr.as_slice().is_ok(), "released by the invalidation's success");
        drop((mw, lane, mr, pd));
    }
    t.finish();
}

/// Things dropped in the wrong order: the window before its bind completed (the region, in the
/// bind's slot, comes back with the completion; the rkey opens nothing), and an invalidation
/// before its completion (the window deallocated, the region released).
#[test]
fn memory_window_dropped_before_its_completions_releases_only_what_is_safe() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let before = mr_count().expect("rdma res");
    let mw = MemoryWindow::new(&s.pd, WindowType::Two).unwrap();
    let region = s.mrs.remove(0);
    let w = s.lane.bind_window(s.qp, BindWr::new(mw, region, WIN, AccessFlags::REMOTE_WRITE).wr_id(1)).unwrap();
    let remote = w.remote();
    drop(w);
    assert_eq!(mr_count(), Some(before), "the region sits in the bind's slot");
    let mut done = next(&mut s.lane);
    assert_eq!(done.wr_id(), 1);
    let mut region = done.take_region().expect("the bind's completion hands the region back, whatever its status");
    assert!(region.as_mut_slice().is_ok(), "nothing holds it now");
    s.mrs.insert(0, region);
    if done.is_ok() {
        // The bind ran before the window was deallocated, which unbound it.
        assert_eq!(client_write(&mut c, &[5; 16], &remote, 0, 10), WcStatus::RemAccessErr);
    }
    assert!(contents(&mut s).iter().all(|&b| b == 0));
    drop((c, s));
    // An invalidation dropped before its completion.
    let Some((c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let inv = s.lane.invalidate_window(s.qp, w, 2).map_err(|e| e.error).unwrap();
    drop(inv);
    assert!(s.mrs[0].as_mut_slice().is_ok(), "the window's deallocation released the region");
    let done = next(&mut s.lane);
    assert_eq!(done.wr_id(), 2, "the invalidation still completes, carrying nothing: {done:?}");
    assert!(done.into_parts().1.is_none());
    drop((c, s));
    t.finish();
}

/// The lane (and so the QP that bound it) dropped under a bound type 1 window, whose binding
/// does not depend on its QP: the region stays registered until the window is dropped. (A type
/// 2 window is tied to its QP; rxe makes the QP's destruction wait about 50 s for a type 2
/// window still bound: invalidate or drop those first.)
#[test]
fn memory_window_of_type1_outlives_its_lane_and_holds_the_region() {
    let t = DeviceTest::start();
    let Some((c, mut s)) = window_pair(&t, WindowType::One) else { return t.finish() };
    let w = bind(&mut s, WindowType::One, WIN, AccessFlags::REMOTE_WRITE, 1);
    let before = mr_count().expect("rdma res");
    let LaneSide { lane, qp: _, pd, mrs } = s;
    drop((lane, mrs, c));
    assert_eq!(mr_count(), Some(before - 1), "the client's region is gone, the window's is not");
    drop(w);
    assert_eq!(mr_count(), Some(before - 2), "the window's deallocation released it");
    drop(pd);
    t.finish();
}

/// Set in the child process that forgets a bound window (its leak ends with the process).
const FORGET_CHILD: &str = "RDMA_CM_LANE_MW_FORGET_CHILD";

/// A bound window forgotten: its region is never freed, and its bytes stay out of reach.
#[test]
fn memory_window_forgotten_while_bound_keeps_the_region_out_of_reach() {
    let name = "memory_window_forgotten_while_bound_keeps_the_region_out_of_reach";
    if std::env::var_os(FORGET_CHILD).is_none() {
        let t = DeviceTest::start();
        in_child(name);
        return t.finish();
    }
    let t = DeviceTest::start();
    // Type 1: a forgotten type 2 window stays bound to its QP, and rxe then makes the QP's
    // destruction wait 50 s for it.
    let Some((c, mut s)) = window_pair(&t, WindowType::One) else { return };
    let w = bind(&mut s, WindowType::One, WIN, AccessFlags::REMOTE_WRITE, 1);
    std::mem::forget(w);
    assert!(in_flight(&mut s), "a forgotten writable window still counts");
    assert!(s.mrs[0].as_mut_slice().is_err());
    drop((c, s));
    std::mem::forget(t);
}

/// Runs this binary's test `name` again in a child process (with `FORGET_CHILD` set) and
/// asserts that it passed; the child's exit gives its leak back to the kernel.
fn in_child(name: &str) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(FORGET_CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the child");
    let deadline = std::time::Instant::now() + 6 * T;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(std::time::Instant::now() < deadline, "the child did not finish within {:?}", 6 * T);
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    assert!(status.success() && out.contains("1 passed"), "the child failed ({status}):\n{out}");
}

/// `examples/memory_window`, as a process, with either type of window: the peer's write lands
/// in the window, the revocation refuses its next one, and no other byte changed.
#[test]
fn memory_window_example_revokes_the_peers_write() {
    let t = DeviceTest::start();
    if MemoryWindow::new(
        &rdma_cm::ProtectionDomain::new(&rdma_cm::VerbsContext::cm_for_addr(t.addr).unwrap()).unwrap(),
        WindowType::One,
    )
    .is_err()
    {
        common::skipped("memory windows", "ibv_alloc_mw refused");
        return t.finish();
    }
    let example = common::example("memory_window");
    for kind in ["1", "2"] {
        let out = std::process::Command::new(&example)
            .args(["-a", &t.addr.to_string(), "-p", "7479", "-t", kind])
            .output()
            .expect("run examples/memory_window");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "type {kind}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
        for line in [
            "[CLIENT] wrote 4096 bytes through the window",
            "[SERVER] window revoked",
            "[CLIENT] write after revocation refused: REM_ACCESS_ERR",
            "[SERVER] region: 4096 bytes written, all inside the window: true",
        ] {
            assert!(text.contains(line), "type {kind}: no {line:?} in:\n{text}");
        }
    }
    t.finish();
}
