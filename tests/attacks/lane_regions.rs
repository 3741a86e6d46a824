//! Regions on the lane: a receive is bounded by the range it names, not by its registration; a
//! region of another protection domain (of the same context, of one the caller dropped, of
//! another context) is refused with the region given back and nothing posted; a zero-length
//! receive reaches the provider without a scatter entry; a READ scattered into (and a WRITE
//! gathered from) pieces of one region touches those pieces only.

use std::ops::Range;
use std::sync::Arc;

use crate::common::lane::{
    lane_pair, original_post_recv, original_post_send, reap, with_post_recv, with_post_send, LaneSide,
};
use crate::common::{caps, pattern, require, Cap, DeviceTest, PairSpec};
use crate::shared::{count, spec, LW};
use rdma_cm::verbs::lane::{Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::{ffi, AccessFlags, Error, MemoryRegion, ProtectionDomain, QpInit, VerbsContext, WcOpcode, WcStatus};

/// A region of `pd` holding `bytes`.
fn filled(pd: &Arc<ProtectionDomain>, bytes: &[u8]) -> MemoryRegion {
    let mut m = MemoryRegion::new(pd, bytes.len().max(1), LW).unwrap();
    m.as_mut_slice().unwrap()[..bytes.len()].copy_from_slice(bytes);
    m
}

/// Sends `bytes` from `c` and reaps the send's completion, asserting how it ended.
fn send(c: &mut LaneSide, bytes: &[u8], wr_id: u64) -> WcStatus {
    let m = filled(&c.pd, bytes);
    c.lane.post_send(c.qp, SendWr::send(m, 0..bytes.len()).wr_id(wr_id)).unwrap();
    let done = reap(&mut c.lane, 1).pop().unwrap();
    assert_eq!(done.wr_id(), wr_id, "{done:?}");
    done.status()
}

/// A receive on a chunk of a registration, at an offset, is checked against its own range in
/// the chunk, not the registration: every range leaving the chunk (one past, straddling, empty
/// past its end, the next chunk's, at `usize::MAX`) and a reversed one are refused with the
/// chunk given back, writable, and nothing posted, although the registration has room. A good
/// one lands at its offset only; an empty one at the chunk's very end completes with 0 bytes
/// writing nothing; a message one byte longer than a range in the middle of a chunk fails and
/// writes nothing outside the range (neither in its chunk nor the next), and the failure makes
/// the QP refuse later posts with the region given back.
#[test]
fn a_receive_on_an_offset_range_is_bounded_by_its_range() {
    let t = DeviceTest::start();
    {
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        let mut chunks: Vec<Option<MemoryRegion>> =
            MemoryRegion::new(&s.pd, 256, LW).unwrap().split(64).unwrap().into_iter().map(Some).collect();
        assert_eq!(chunks.len(), 4);
        let canaries: Vec<Vec<u8>> = (0..4).map(|i| pattern(64, 100 + i as u8)).collect();
        for (ch, can) in chunks.iter_mut().zip(&canaries) {
            ch.as_mut().unwrap().as_mut_slice().unwrap().copy_from_slice(can);
        }
        let base = chunks[0].as_ref().unwrap().addr();
        assert_eq!(chunks[2].as_ref().unwrap().addr(), base + 128);

        let mut ch2 = chunks[2].take().unwrap();
        #[allow(clippy::reversed_empty_ranges)]
        let bad: [(Range<usize>, &str, bool); 6] = [
            (0..65, "one past", true),
            (60..70, "straddles", true),
            (65..65, "empty past", true),
            (64..128, "next chunk", true),
            (usize::MAX..usize::MAX, "huge", true),
            (10..5, "reversed", false),
        ];
        for (r, what, bounds) in bad {
            let rej = s.lane.post_recv(s.qp, RecvWr::range(ch2, r.clone()).wr_id(7)).unwrap_err();
            if bounds {
                assert!(matches!(rej.error(), Error::OutOfBounds { size: 64, .. }), "{what} {r:?}: {rej:?}");
            } else {
                assert!(matches!(rej.error(), Error::InvalidArgument(_)), "{what}: {rej:?}");
            }
            ch2 = rej.into_inner().expect("a refused receive gives its region back");
            assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0), "{what}: nothing posted");
            assert!(ch2.as_mut_slice().is_ok(), "{what}: the chunk stays writable");
        }

        // A good one at an offset inside the chunk.
        let id = u64::MAX - 2;
        s.lane.post_recv(s.qp, RecvWr::range(ch2, 8..64).wr_id(id)).unwrap();
        for i in [0, 1, 3] {
            let sib = chunks[i].as_mut().unwrap();
            assert_eq!(sib.as_slice().expect("a sibling stays readable"), &canaries[i][..]);
        }
        let payload = pattern(56, 9);
        assert_eq!(send(&mut c, &payload, 1), WcStatus::Success);
        let mut got = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!(
            (got.wr_id(), got.byte_len(), got.opcode(), got.imm_data()),
            (id, 56, Some(WcOpcode::Recv), None),
            "{got:?}"
        );
        let mut ch2 = got.take_region().expect("the receive's chunk comes back");
        let bytes = ch2.as_slice().unwrap();
        assert_eq!(&bytes[..8], &canaries[2][..8], "bytes before the range untouched");
        assert_eq!(&bytes[8..], &payload[..], "the data lands at the chunk's offset + 8");
        for i in [0, 1, 3] {
            assert_eq!(chunks[i].as_mut().unwrap().as_slice().unwrap(), &canaries[i][..], "chunk {i} untouched");
        }

        // An empty receive at the chunk's very end: allowed, writes nothing.
        let ch3 = chunks[3].take().unwrap();
        let mut ch3 = if caps::iwarp() {
            // siw refuses a receive with no scatter entry (EINVAL, naming it): it comes back.
            let rej = s.lane.post_recv(s.qp, RecvWr::range(ch3, 64..64).wr_id(33)).unwrap_err();
            assert!(matches!(rej.error(), Error::Call { op: "ibv_post_recv", .. }), "{rej}");
            rej.into_inner().expect("a receive the provider refused by name comes back")
        } else {
            s.lane.post_recv(s.qp, RecvWr::range(ch3, 64..64).wr_id(33)).unwrap();
            assert_eq!(send(&mut c, &[], 2), WcStatus::Success);
            let mut got = reap(&mut s.lane, 1).pop().unwrap();
            assert_eq!((got.wr_id(), got.byte_len(), got.status()), (33, 0, WcStatus::Success), "{got:?}");
            got.take_region().unwrap()
        };
        assert_eq!(ch3.as_slice().unwrap(), &canaries[3][..]);

        // A range in the middle of chunk 1 (16..48), and a message one byte longer than it.
        let before2 = ch2.as_slice().unwrap().to_vec();
        let ch1 = chunks[1].take().unwrap();
        s.lane.post_recv(s.qp, RecvWr::range(ch1, 16..48).wr_id(44)).unwrap();
        let sent = send(&mut c, &[0xee; 33], 3);
        let mut got = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!(got.wr_id(), 44);
        assert!(!got.is_ok(), "a 33-byte message into a 32-byte receive must fail: {got:?}");
        assert_eq!(got.opcode(), None, "a failed completion hides its opcode");
        if !caps::iwarp() {
            // rxe reports LOC_QP_OP_ERR for it; LOC_LEN_ERR is what the spec suggests.
            assert!(matches!(got.status(), WcStatus::LocLenErr | WcStatus::LocQpOpErr), "{got:?}");
            assert_ne!(sent, WcStatus::Success, "the sender learns of it");
        }
        let mut ch1 = got.take_region().expect("a failed receive gives its region back");
        let b1 = ch1.as_slice().unwrap();
        assert_eq!(&b1[..16], &canaries[1][..16], "nothing before the range");
        assert_eq!(&b1[48..], &canaries[1][48..], "nothing after the range");
        assert_eq!(ch2.as_slice().unwrap(), &before2[..], "nothing spilled into the next chunk");
        assert_eq!(chunks[0].as_mut().unwrap().as_slice().unwrap(), &canaries[0][..]);
        // The failed completion moved the RC QP to the error state: posts are refused, and
        // the region comes back.
        let rej = s.lane.post_recv(s.qp, RecvWr::new(ch3)).unwrap_err();
        assert!(matches!(rej.error(), Error::QpInError { .. }), "{rej}");
        assert!(rej.into_inner().is_some());
        assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0));
        drop((c, s, chunks, ch1, ch2));
    }
    t.finish();
}

/// Posts a receive and a send of `mr` on `qp`, expecting both refused as a region of another
/// protection domain, the region given back writable and nothing posted; returns it.
fn refused(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion, what: &str) -> MemoryRegion {
    let rej = lane.post_recv(qp, RecvWr::new(mr).wr_id(5)).unwrap_err();
    assert!(
        matches!(rej.error(), Error::InvalidArgument(m) if m.contains("another protection domain")),
        "{what}: {rej}"
    );
    let mr = rej.into_inner().expect("the receive's region comes back");
    let rej = lane.post_send(qp, SendWr::send(mr, 0..8).wr_id(6)).unwrap_err();
    assert!(
        matches!(rej.error(), Error::InvalidArgument(m) if m.contains("another protection domain")),
        "{what}: {rej}"
    );
    let mr = rej.into_inner().expect("the send's region comes back");
    let mut sends = [Some(SendWr::send(mr, 0..8)), None];
    let e = lane.post_send_list(qp, &mut sends).unwrap_err();
    assert!(e.to_string().contains("another protection domain"), "{what}: {e}");
    let mr = sends[0].take().expect("a refused list keeps its entries").into_region();
    let mut recvs = [Some(RecvWr::new(mr)), None];
    let e = lane.post_recv_list(qp, &mut recvs).unwrap_err();
    assert!(e.to_string().contains("another protection domain"), "{what}: {e}");
    let mut mr = recvs[0].take().expect("a refused list keeps its entries").into_region();
    assert_eq!(lane.outstanding(qp).unwrap(), (0, 0), "{what}: nothing posted");
    assert!(mr.as_mut_slice().is_ok(), "{what}: still writable");
    mr
}

/// A region of another PD is refused whatever that PD became: a PD of the same context, one
/// whose last handle the caller dropped (the region keeps it allocated, so no new PD can take
/// its address), one allocated after that one was freed, and one of another context of the
/// same device. A region on the QP's own PD, made through a cloned handle, is taken.
#[test]
fn a_region_of_another_pd_of_a_dropped_pd_or_of_another_context_is_refused() {
    let t = DeviceTest::start();
    {
        let (c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        let ctx = s.pd.context().clone();

        let pds = count("pd");
        let pd2 = ProtectionDomain::new(&ctx).unwrap();
        let mr2 = MemoryRegion::new(&pd2, 64, LW).unwrap();
        let mr2 = refused(&mut s.lane, s.qp, mr2, "a PD of the same context");
        let pd2_addr = Arc::as_ptr(&pd2) as usize;
        drop(pd2);
        assert_eq!(count("pd"), pds + 1, "the region keeps its PD allocated after the caller's handle is gone");
        assert_eq!(Arc::as_ptr(mr2.pd()) as usize, pd2_addr);
        let fresh: Vec<_> = (0..8).map(|_| ProtectionDomain::new(&ctx).unwrap()).collect();
        assert!(fresh.iter().all(|p| Arc::as_ptr(p) as usize != pd2_addr));
        let mr2 = refused(&mut s.lane, s.qp, mr2, "a PD whose caller's handle was dropped");
        drop((fresh, mr2));
        assert_eq!(count("pd"), pds, "dropping the region releases its PD");
        // After it is freed, a PD that may reuse its address is still another PD.
        let pd4 = ProtectionDomain::new(&ctx).unwrap();
        let mr4 = refused(&mut s.lane, s.qp, MemoryRegion::new(&pd4, 64, LW).unwrap(), "a PD allocated after");

        // Another context of the same device.
        let ctx2 = VerbsContext::open(&ctx.device_name()).unwrap();
        assert!(!ctx2.same_as(&ctx));
        let pd5 = ProtectionDomain::new(&ctx2).unwrap();
        let mr5 = refused(&mut s.lane, s.qp, MemoryRegion::new(&pd5, 64, LW).unwrap(), "a PD of another context");

        // The QP's own PD through another handle: taken.
        let own = Arc::clone(&s.pd);
        s.lane.post_recv(s.qp, RecvWr::new(MemoryRegion::new(&own, 64, LW).unwrap()).wr_id(6)).unwrap();
        assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 1));
        s.lane.set_error(s.qp).unwrap();
        let mut f = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!((f.wr_id(), f.status()), (6, WcStatus::WrFlushErr));
        assert!(f.take_region().is_some_and(|mut m| m.as_mut_slice().is_ok()));
        drop((c, s, mr4, pd4, mr5, pd5, ctx2, own, ctx));
    }
    t.finish();
}

static SEEN_RECV_SGE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
static SEEN_SEND_SGE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Stands in for the provider's `post_recv`: records the first work request's scatter count,
/// then calls the provider's.
unsafe extern "C" fn recording_post_recv(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
) -> i32 {
    // SAFETY: `wr` is the list the lane passed, valid for the call.
    SEEN_RECV_SGE.store(unsafe { (*wr).num_sge }, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: forwarded unchanged to the provider's own entry point.
    unsafe { original_post_recv()(qp, wr, bad) }
}

/// As [`recording_post_recv`], for sends.
unsafe extern "C" fn recording_post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    // SAFETY: `wr` is the list the lane passed, valid for the call.
    SEEN_SEND_SGE.store(unsafe { (*wr).num_sge }, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: forwarded unchanged to the provider's own entry point.
    unsafe { original_post_send()(qp, wr, bad) }
}

/// A zero-length receive (and send) reaches the provider with no scatter entry: some providers
/// read a byte count of 0 as 2 GiB. rxe does not, so what the provider is handed is checked by
/// standing in for its post entry; a receive and a send of 8 bytes, through the same stand-in,
/// show it records. The empty receive (also one at its region's very end) completes with 0
/// bytes, writing nothing (siw refuses a receive without scatter entry: it comes back).
#[test]
fn a_zero_length_receive_reaches_the_provider_without_sge() {
    use std::sync::atomic::Ordering::SeqCst;
    let t = DeviceTest::start();
    {
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        let seen = |s: &mut LaneSide, wr: RecvWr| {
            SEEN_RECV_SGE.store(-1, SeqCst);
            with_post_recv(s, recording_post_recv, |s| {
                if let Err(rej) = s.lane.post_recv(s.qp, wr) {
                    // siw refuses a receive with no scatter entry (EINVAL, naming it).
                    assert!(caps::iwarp() && matches!(rej.error(), Error::Call { op: "ibv_post_recv", .. }), "{rej}");
                    assert!(rej.into_inner().is_some(), "a receive the provider refused by name comes back");
                }
            });
            SEEN_RECV_SGE.load(SeqCst)
        };
        let canary = pattern(4096, 3);
        let spd = s.pd.clone();
        assert_eq!(seen(&mut s, RecvWr::new(filled(&spd, &canary)).wr_id(1)), 1, "the stand-in records");
        assert_eq!(seen(&mut s, RecvWr::range(filled(&spd, &canary), 0..0).wr_id(2)), 0, "an empty receive");
        assert_eq!(seen(&mut s, RecvWr::range(filled(&spd, &canary), 4096..4096).wr_id(3)), 0, "one at the end");
        if caps::iwarp() {
            // The empty receives were refused: no message can meet them.
            drop((c, s, spd));
            return t.finish();
        }
        let sent = |c: &mut LaneSide, len: usize, id: u64| {
            SEEN_SEND_SGE.store(-1, SeqCst);
            let m = filled(&c.pd, &pattern(64, 5));
            with_post_send(c, recording_post_send, |c| {
                c.lane.post_send(c.qp, SendWr::send(m, 0..len).wr_id(id)).unwrap()
            });
            let done = reap(&mut c.lane, 1).pop().unwrap();
            assert_eq!((done.wr_id(), done.status()), (id, WcStatus::Success));
            SEEN_SEND_SGE.load(SeqCst)
        };
        assert_eq!(sent(&mut c, 8, 11), 1, "the stand-in records");
        assert_eq!(sent(&mut c, 0, 12), 0, "an empty send");
        assert_eq!(sent(&mut c, 0, 13), 0, "an empty send");
        let got = reap(&mut s.lane, 3);
        let ids: Vec<(u64, u32, WcStatus)> = got.iter().map(|g| (g.wr_id(), g.byte_len(), g.status())).collect();
        assert_eq!(ids, [(1, 8, WcStatus::Success), (2, 0, WcStatus::Success), (3, 0, WcStatus::Success)]);
        for mut g in got.into_iter().skip(1) {
            let mut r = g.take_region().unwrap();
            assert_eq!(r.as_slice().unwrap(), &canary[..], "an empty receive writes nothing");
        }
        drop((c, s, spd));
    }
    t.finish();
}

/// A READ scattered into three pieces of one region, and a WRITE gathered from three pieces
/// of one region: each lands piece by piece, in order, and nothing between the pieces changes;
/// each region comes back with its completion.
#[test]
fn pieces_of_one_region_scatter_and_gather_in_order_and_touch_nothing_else() {
    let t = DeviceTest::start();
    if !require(Cap::ReadScatter(3)) {
        return t.finish();
    }
    {
        let init = QpInit::new().max_send_sge(3);
        let (mut c, mut s) =
            lane_pair(t.addr, PairSpec { init: init.clone(), ..spec() }, PairSpec { init, ..spec() }, 64);
        let src = pattern(96, 21);
        s.mrs[0].write_at(0, &src).unwrap();
        let remote = s.mrs[0].remote();
        let canary = pattern(512, 77);
        let target = filled(&c.pd, &canary);
        let pieces = [0..32, 100..132, 300..332];
        c.lane.post_send(c.qp, SendWr::read_sg(target, &pieces, &remote, 0).wr_id(1)).unwrap();
        let mut done = reap(&mut c.lane, 1).pop().unwrap();
        assert_eq!((done.wr_id(), done.status(), done.byte_len()), (1, WcStatus::Success, 96), "{done:?}");
        let mut target = done.take_region().unwrap();
        let mut want = canary.clone();
        for (k, p) in pieces.iter().enumerate() {
            want[p.clone()].copy_from_slice(&src[k * 32..(k + 1) * 32]);
        }
        assert_eq!(target.as_slice().unwrap(), &want[..], "the READ lands piece by piece, nothing between");

        // Gathered back: the three pieces, in order, to offset 1024 of the peer's region.
        c.lane.post_send(c.qp, SendWr::write_sg(target, &pieces, &remote, 1024).wr_id(2)).unwrap();
        let mut done = reap(&mut c.lane, 1).pop().unwrap();
        assert_eq!((done.wr_id(), done.status()), (2, WcStatus::Success), "{done:?}");
        assert!(done.take_region().is_some());
        let mut gathered = [0u8; 96];
        s.mrs[0].read_at(1024, &mut gathered).unwrap();
        assert_eq!(&gathered[..], &src[..], "the WRITE gathers in order");
        drop((c, s));
    }
    t.finish();
}

/// REMOTE_WRITE (or REMOTE_ATOMIC) without LOCAL_WRITE registers: LOCAL_WRITE is implied.
#[test]
fn remote_write_implies_local_write() {
    let t = DeviceTest::start();
    {
        let ctx = VerbsContext::cm_for_addr(t.addr).unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        for access in [AccessFlags::REMOTE_WRITE, AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ] {
            let mr = MemoryRegion::new(&pd, 4096, access).expect("remote write rights alone must register");
            assert!(mr.access().contains(AccessFlags::LOCAL_WRITE | access));
        }
        drop((pd, ctx));
    }
    t.finish();
}
