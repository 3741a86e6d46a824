//! Memory windows on the device: a window's rkey grants exactly its range and rights, for as
//! long as it is bound; after a local invalidation, an unbind or the peer's send with
//! invalidate, the peer's access fails (`REM_ACCESS_ERR`) and the memory is unchanged. And the
//! attempts to break it with safe code: a region dropped under a bound window, a window or a
//! region of another protection domain, reading memory a bound window lets the peer write,
//! forgetting a bound window. Every test name contains `memory_window`.
//!
//! Each pair is a loopback RC connection through the device: the server owns the region and
//! its windows, the client writes, reads or invalidates through the rkeys it is handed.

mod common;

use std::sync::Arc;

use common::{mr_count, pair, pattern, DeviceTest, PairSpec, Side, T};
use rdma_cm::{
    AccessFlags, BoundWindow, Error, MemoryRegion, MemoryWindow, ProtectionDomain, RecvWr, RemoteRegion, SendWr,
    WcOpcode, WcStatus, WindowType, WorkQueue,
};

const MIB: usize = 1 << 20;
const WIN: std::ops::Range<usize> = 4096..8192;

/// The region's registration: it takes windows, and no peer may write it through its own rkey.
fn window_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND
}

/// A connected pair: the client with a 8 KiB buffer, the server with a 1 MiB region that takes
/// windows. `None` (after a `skipped:` line) where the device has no windows of `kind`.
fn window_pair(t: &DeviceTest, kind: WindowType) -> Option<(Side, Side)> {
    let client = PairSpec { mr_sizes: vec![8192], ..PairSpec::default() };
    let server = PairSpec { mr_sizes: vec![MIB], access: window_access(), ..PairSpec::default() };
    let (c, s) = pair(t.addr, client, server);
    match MemoryWindow::new(&s.pd, kind) {
        Ok(_) => Some((c, s)),
        Err(e @ Error::Unsupported { .. }) => {
            common::skipped(&format!("memory windows of {kind}"), &e.to_string());
            None
        }
        Err(e) => panic!("ibv_alloc_mw: {e}"),
    }
}

/// Binds a new window of `kind` on the server's region at `range` with `rights`, and reaps the
/// bind's completion.
fn bind(s: &mut Side, kind: WindowType, range: std::ops::Range<usize>, rights: AccessFlags, wr_id: u64) -> BoundWindow {
    let mw = MemoryWindow::new(&s.pd, kind).expect("ibv_alloc_mw");
    let w = s.conn.qp_mut().bind_window(mw, &s.mrs[0], range, rights, wr_id).expect("bind_window");
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Send, wr_id, T).expect("the bind completes");
    assert_eq!(wc.opcode(), Some(WcOpcode::BindMw));
    w
}

/// The client writes `data` at `remote` + `offset` and reports the completion's status.
fn client_write(c: &mut Side, data: &[u8], remote: &RemoteRegion, offset: u64, wr_id: u64) -> Result<(), WcStatus> {
    c.mrs[0].write_at(0, data).expect("client buffer");
    let w = SendWr::write(&c.mrs[0], 0..data.len(), remote, offset).expect("write in bounds").wr_id(wr_id);
    c.conn.qp_mut().post_send(&[w]).expect("post the write");
    match c.conn.qp_mut().wait_for(WorkQueue::Send, wr_id, T) {
        Ok(_) => Ok(()),
        Err(Error::WorkCompletion { status, .. }) => Err(status),
        Err(e) => panic!("client write {wr_id}: {e}"),
    }
}

/// A window's bounds as a region the client may aim anywhere at (to reach past the window).
fn wide(w: &BoundWindow, len: u64) -> RemoteRegion {
    RemoteRegion::new(w.remote().addr, w.rkey(), len)
}

/// The server's region, copied out once nothing can write it.
fn contents(s: &mut Side) -> Vec<u8> {
    let mut all = vec![0; MIB];
    s.mrs[0].read_at(0, &mut all).expect("the region is readable once no window may write it");
    all
}

fn revoked_write_changes_nothing(kind: WindowType) {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, kind) else { return t.finish() };
    let w = bind(&mut s, kind, WIN, AccessFlags::REMOTE_WRITE, 1);
    assert_eq!(w.remote().len, 4096);
    assert_eq!(w.remote().addr, s.mrs[0].addr() + 4096, "the window starts at its offset in the region");
    assert_ne!(w.rkey(), s.mrs[0].rkey(), "the window has an rkey of its own");
    // While the peer may write it, the region is out of Rust's reach.
    assert!(matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. })), "a bound writable window keeps slices away");
    assert!(matches!(s.mrs[0].read_at(0, &mut [0; 4]), Err(Error::InFlight { .. })));
    let first = pattern(4096, 7);
    assert_eq!(client_write(&mut c, &first, &w.remote(), 0, 10), Ok(()), "a write inside the window succeeds");
    let remote = w.remote();
    let mw = match kind {
        WindowType::Two | WindowType::One => s.conn.qp_mut().invalidate_window(w, 2).expect("invalidate"),
    };
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).expect("the invalidation completes");
    let want = if kind == WindowType::Two { WcOpcode::LocalInv } else { WcOpcode::BindMw };
    assert_eq!(wc.opcode(), Some(want));
    let all = contents(&mut s);
    assert_eq!(&all[WIN], &first[..], "the peer's write landed in the window, byte for byte");
    assert!(all[..4096].iter().chain(&all[8192..]).all(|&b| b == 0), "nothing outside the window changed");
    // The rkey the peer already holds and used now opens nothing, and writes nothing.
    assert_eq!(client_write(&mut c, &pattern(4096, 9), &remote, 0, 11), Err(WcStatus::RemAccessErr));
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

/// One window bound, invalidated and bound again: each bind gives it a new rkey, the new one
/// opens the new range, and the old one opens nothing. (A type 2 bind names the window's
/// current key; before the window recorded the key of its last bind, rxe failed the second
/// bind with `MW_BIND_ERR`.)
#[test]
fn memory_window_bound_again_gets_a_new_rkey() {
    let t = DeviceTest::start();
    for kind in [WindowType::Two, WindowType::One] {
        let Some((mut c, mut s)) = window_pair(&t, kind) else { return t.finish() };
        let w = bind(&mut s, kind, WIN, AccessFlags::REMOTE_WRITE, 1);
        let old = w.remote();
        let mw = s.conn.qp_mut().invalidate_window(w, 2).map_err(|e| e.error).expect("invalidate");
        s.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).expect("the invalidation completes");
        let again = s.conn.qp_mut().bind_window(mw, &s.mrs[0], 16384..20480, AccessFlags::REMOTE_WRITE, 3).unwrap();
        let wc = s.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).expect("the second bind of one window succeeds");
        assert_eq!(wc.opcode(), Some(WcOpcode::BindMw));
        assert_ne!(again.rkey(), old.rkey, "{kind}: a new rkey with each bind");
        let data = pattern(4096, 5);
        assert_eq!(client_write(&mut c, &data, &again.remote(), 0, 10), Ok(()), "{kind}: through the new rkey");
        let mw = s.conn.qp_mut().invalidate_window(again, 4).map_err(|e| e.error).expect("invalidate");
        s.conn.qp_mut().wait_for(WorkQueue::Send, 4, T).expect("the invalidation completes");
        assert_eq!(client_write(&mut c, &pattern(4096, 6), &old, 0, 11), Err(WcStatus::RemAccessErr));
        let all = contents(&mut s);
        assert_eq!(&all[16384..20480], &data[..]);
        assert_eq!(all.iter().filter(|&&b| b != 0).count(), data.iter().filter(|&&b| b != 0).count(), "nowhere else");
        drop((mw, c, s));
    }
    t.finish();
}

/// A window's rights hold everywhere; its range is enforced by the device only up to the
/// region it is bound in on rxe: a write through the window's rkey outside the window but
/// inside the region succeeds there (measured on rxe/6.1; the kernel checks the access against
/// the region's bounds, not the window's). That is why a bound window holds its whole region,
/// and why a window cannot be bound in a chunk of a split registration: memory outside the
/// region is never reached, and memory inside it is out of Rust's reach while the window is
/// bound.
#[test]
fn memory_window_grants_only_its_rights_and_never_more_than_its_region() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let far = wide(&w, 2 * MIB as u64);
    // Past the region's end, through the window's rkey: refused, on every provider.
    let past_region = (MIB - 4096 - 4) as u64;
    assert_eq!(client_write(&mut c, &[0xee; 8], &far, past_region, 10), Err(WcStatus::RemAccessErr));
    drop(w);
    assert!(contents(&mut s).iter().all(|&b| b == 0), "a write that left the region wrote nothing");
    drop((c, s));
    // Outside the window, inside the region.
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    assert!(matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. })), "the whole region is held");
    match client_write(&mut c, &[0xee; 8], &wide(&w, 8192), 4092, 10) {
        Err(WcStatus::RemAccessErr) => {
            drop(w);
            assert!(contents(&mut s).iter().all(|&b| b == 0));
        }
        Ok(()) => {
            // rxe: the bytes land in the region, which the window held all along.
            drop(w);
            let all = contents(&mut s);
            assert_eq!(&all[8188..8196], &[0xee; 8], "the write landed where it was aimed");
            assert_eq!(all.iter().filter(|&&b| b != 0).count(), 8, "and nowhere else");
            eprintln!("note: this device does not enforce a memory window's bounds inside its region");
        }
        Err(st) => panic!("a write straddling the window's end: {st}"),
    }
    drop((c, s));
    // A window bound for remote read refuses a write.
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let r = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_READ, 1);
    // A read-only window lets Rust read the region meanwhile (the peer only reads it).
    assert!(s.mrs[0].as_slice().is_ok(), "a read-only window leaves the bytes readable");
    assert_eq!(client_write(&mut c, &[1; 8], &r.remote(), 0, 10), Err(WcStatus::RemAccessErr));
    drop(r);
    assert!(contents(&mut s).iter().all(|&b| b == 0));
    drop((c, s));
    t.finish();
}

#[test]
fn memory_window_is_refused_in_a_chunk_of_a_split_registration() {
    let t = DeviceTest::start();
    let Some((c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let whole = s.mrs.pop().unwrap();
    let mut chunks = whole.split(MIB / 2).expect("split");
    let mw = MemoryWindow::new(&s.pd, WindowType::Two).unwrap();
    let e = s.conn.qp_mut().bind_window(mw, &chunks[0], WIN, AccessFlags::REMOTE_WRITE, 1).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("chunk")), "{e}");
    assert!(chunks[1].as_slice().is_ok(), "the sibling chunk stays readable: no window can reach it");
    chunks.clear();
    drop((c, s));
    t.finish();
}

#[test]
fn memory_window_invalidated_by_the_peers_send_with_invalidate() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let rkey = w.rkey();
    let remote = w.remote();
    // The server's receive lands outside the window's range (its last 64 bytes of the region).
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], MIB - 64..MIB).wr_id(5)]).unwrap();
    c.mrs[0].write_at(0, b"revoke").unwrap();
    c.conn.qp_mut().post_send(&[SendWr::send_with_invalidate(&c.mrs[0], 0..6, rkey).wr_id(20)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 20, T).expect("the send with invalidate completes");
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 5, T).expect("the server receives it");
    assert_eq!(wc.imm_data(), None, "an invalidation is no immediate data");
    // The peer's invalidation took effect either way: its next write through the rkey fails.
    assert_eq!(client_write(&mut c, &[3; 16], &remote, 0, 21), Err(WcStatus::RemAccessErr));
    let mw: Option<MemoryWindow> = match wc.invalidated_rkey() {
        Some(k) => {
            assert_eq!(k, rkey, "the receive names the rkey the peer invalidated: {wc:?}");
            let mw = w.invalidated_by(&wc).expect("the completion invalidated this window");
            // A completion names an rkey, not a binding: the window keeps the region until it
            // is deallocated, and is not bound again.
            assert!(matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. })), "held until dropped");
            let e = s.conn.qp_mut().bind_window(mw, &s.mrs[0], WIN, AccessFlags::REMOTE_WRITE, 2).unwrap_err();
            assert!(e.to_string().contains("drop this window"), "{e}");
            None
        }
        None => {
            // rxe (6.1 and 6.12) marks the completion with the kernel's IB_WC_WITH_INVALIDATE
            // (1 << 2), which libibverbs reads as IBV_WC_IP_CSUM_OK, not IBV_WC_WITH_INV
            // (1 << 3). The crate does not guess: the window stays bound, and holds its region,
            // until it is dropped (deallocated).
            assert_eq!(wc.wc_flags() & (1 << 3), 0, "{wc:?}");
            let still = w.invalidated_by(&wc).expect_err("without IBV_WC_WITH_INV nothing is assumed");
            assert!(matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. })), "still held");
            drop(still);
            None
        }
    };
    assert!(contents(&mut s)[WIN].iter().all(|&b| b == 0), "the window's bytes never changed");
    // Any other completion leaves a bound window bound.
    drop((c, s));
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let other = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], MIB - 64..MIB).wr_id(5)]).unwrap();
    c.mrs[0].write_at(0, b"plain").unwrap();
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..5).wr_id(20)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 20, T).expect("the plain send completes");
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 5, T).unwrap();
    let still = other.invalidated_by(&wc).expect_err("a plain send invalidates nothing");
    assert_eq!(client_write(&mut c, &[4; 16], &still.remote(), 0, 21), Ok(()), "the window still grants its range");
    drop((mw, still, c, s));
    t.finish();
}

#[test]
fn memory_window_holds_its_region_when_every_handle_is_dropped() {
    let t = DeviceTest::start();
    let Some((mut c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let w = bind(&mut s, WindowType::Two, WIN, AccessFlags::REMOTE_WRITE, 1);
    let before = mr_count().expect("rdma res");
    drop(s.mrs.pop());
    assert_eq!(mr_count(), Some(before), "a region a bound window names stays registered");
    // The peer still writes through the window, into memory that was not freed.
    assert_eq!(client_write(&mut c, &pattern(4096, 3), &w.remote(), 0, 10), Ok(()));
    drop(w);
    assert_eq!(mr_count(), Some(before - 1), "the region goes with the window's deallocation");
    drop((c, s));
    t.finish();
}

/// Set in the child process that forgets a bound window (its leak ends with the process).
const FORGET_CHILD: &str = "RDMA_CM_MW_FORGET_CHILD";

/// A window bound through one QP and invalidated through another
/// on the same protection domain. Two send queues are not ordered, so the bind could run after
/// the invalidation succeeded and bind the window again: the invalidation is refused (the
/// window given back, still bound), and goes through the QP that bound it.
#[test]
fn memory_window_is_invalidated_only_through_the_qp_that_bound_it() {
    use rdma_cm::{devices, PeerInfo, QpInit, RcParams, UnconnectedQp, VerbsContext};
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
        let params = RcParams::new().gid_index(u8::try_from(gid_index).unwrap());
        let a = UnconnectedQp::new(&pd, QpInit::new(), params.clone()).unwrap();
        let b = UnconnectedQp::new(&pd, QpInit::new(), params).unwrap();
        let (ia, ib): (PeerInfo, PeerInfo) = (a.local(), b.local());
        let (mut qa, mut qb) = (a.connect(&ib).unwrap(), b.connect(&ia).unwrap());
        let mr = MemoryRegion::new(&pd, MIB, window_access()).unwrap();
        let w = qa.bind_window(mw, &mr, WIN, AccessFlags::REMOTE_WRITE, 1).unwrap();
        let e = qb.invalidate_window(w, 2).expect_err("another QP's send queue is not ordered after the bind");
        assert!(e.error.to_string().contains("bound through another QP"), "{}", e.error);
        let w = e.window;
        assert_eq!(qa.wait_for(WorkQueue::Send, 1, T).unwrap().opcode(), Some(WcOpcode::BindMw));
        let mw = qa.invalidate_window(w, 3).map_err(|e| e.error).expect("through the QP that bound it");
        qa.wait_for(WorkQueue::Send, 3, T).expect("the invalidation succeeds");
        let mut mr = mr;
        assert!(mr.as_slice().is_ok(), "released by the invalidation's success");
        drop((mw, qa, qb, mr, pd));
    }
    t.finish();
}

/// Runs this binary's test `name` again in a child process (with `FORGET_CHILD` set) and
/// asserts that it passed: for the tests whose leak is the point, which would outlive them
/// here; the child's exit gives everything back to the kernel.
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

/// An invalidation that is posted but does not succeed
/// (here flushed: the QP failed a WRITE posted just before it) may leave the window bound, and
/// a type 1 window is reachable through any QP of its protection domain. So its region is
/// never released: not when the flush is reaped, not when the window is dropped (a leak, which
/// ends with the process). Before, reaping the flush released it, and Rust could read memory
/// the peer could still write.
#[test]
fn memory_window_whose_invalidation_is_flushed_keeps_the_region_held() {
    if std::env::var_os(FORGET_CHILD).is_none() {
        let t = DeviceTest::start();
        in_child("memory_window_whose_invalidation_is_flushed_keeps_the_region_held");
        return t.finish();
    }
    let t = DeviceTest::start();
    let Some((c, mut s)) = window_pair(&t, WindowType::One) else { return };
    let w = bind(&mut s, WindowType::One, WIN, AccessFlags::REMOTE_WRITE, 1);
    // A WRITE through an rkey the peer does not have fails and moves the QP to the error state;
    // the invalidation posted right behind it is flushed.
    let src = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let bogus = RemoteRegion::new(0, 0x5a5a_5a00, 64);
    s.conn.qp_mut().post_send(&[SendWr::write(&src, 0..64, &bogus, 0).unwrap().wr_id(2)]).unwrap();
    let mw = s.conn.qp_mut().invalidate_window(w, 3).map_err(|e| e.error).expect("posted");
    let status = |r: rdma_cm::Result<rdma_cm::WorkCompletion>| match r {
        Ok(wc) => wc.status(),
        Err(Error::WorkCompletion { status, .. }) => status,
        Err(e) => panic!("{e}"),
    };
    assert_ne!(status(s.conn.qp_mut().wait_for(WorkQueue::Send, 2, T)), WcStatus::Success, "the WRITE fails");
    assert_eq!(status(s.conn.qp_mut().wait_for(WorkQueue::Send, 3, T)), WcStatus::WrFlushErr, "the invalidation");
    assert!(
        matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. })),
        "the region of a window whose invalidation was flushed is still held"
    );
    drop(mw);
    assert!(matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. })), "and stays held: leaked");
    drop((c, s, src));
    std::mem::forget(t);
}

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
    // destruction wait 50 s for it (measured: 51 s on rxe/6.1), for nothing this test checks.
    let Some((c, mut s)) = window_pair(&t, WindowType::One) else { return };
    let w = bind(&mut s, WindowType::One, WIN, AccessFlags::REMOTE_WRITE, 1);
    std::mem::forget(w);
    assert!(matches!(s.mrs[0].as_slice(), Err(Error::InFlight { .. })), "a forgotten writable window still counts");
    assert!(s.mrs[0].as_mut_slice().is_err());
    assert!(s.mrs[0].outstanding() >= 1);
    drop((c, s));
    // The window, and so the region, stay: their leak ends with this child process.
    std::mem::forget(t);
}

#[test]
fn memory_window_of_another_pd_or_on_a_region_without_mw_bind_is_refused() {
    let t = DeviceTest::start();
    let Some((c, mut s)) = window_pair(&t, WindowType::Two) else { return t.finish() };
    let other_pd: Arc<ProtectionDomain> = ProtectionDomain::new(s.pd.context()).expect("a second PD");
    let foreign = MemoryWindow::new(&other_pd, WindowType::Two).unwrap();
    let e = s.conn.qp_mut().bind_window(foreign, &s.mrs[0], WIN, AccessFlags::REMOTE_WRITE, 1).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("another protection domain")), "{e}");
    let foreign_mr = MemoryRegion::new(&other_pd, 8192, window_access()).unwrap();
    let mw = MemoryWindow::new(&s.pd, WindowType::Two).unwrap();
    let e = s.conn.qp_mut().bind_window(mw, &foreign_mr, 0..4096, AccessFlags::REMOTE_WRITE, 1).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("another protection domain")), "{e}");
    let plain = MemoryRegion::new(&s.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
    let mw = MemoryWindow::new(&s.pd, WindowType::Two).unwrap();
    let e = s.conn.qp_mut().bind_window(mw, &plain, 0..4096, AccessFlags::REMOTE_WRITE, 1).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("MW_BIND")), "{e}");
    for (range, rights) in [
        (0..0, AccessFlags::REMOTE_WRITE),
        (MIB - 10..MIB + 10, AccessFlags::REMOTE_WRITE),
        (0..4096, AccessFlags::LOCAL_WRITE),
        (0..4096, AccessFlags::empty()),
    ] {
        let mw = MemoryWindow::new(&s.pd, WindowType::Two).unwrap();
        let e = s.conn.qp_mut().bind_window(mw, &s.mrs[0], range.clone(), rights, 1).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_) | Error::OutOfBounds { .. }), "{range:?} {rights:?}: {e}");
    }
    // Nothing was posted by any refused bind: the send queue is empty.
    assert_eq!(s.conn.qp().outstanding_sends(), 0);
    drop((c, s, plain, foreign_mr, other_pd));
    t.finish();
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
