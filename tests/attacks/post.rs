//! Posting: what a post refuses, and that a refused post holds nothing.

use crate::common::ud::{ud_pair, UdPair};
use crate::common::{out_of_reach, pair, pattern, DeviceTest, PairSpec, T};
use rdma_cm::{
    AccessFlags, AddressHandle, Error, MemoryRegion, ProtectionDomain, QpInit, QpState, QueuePair, RecvWr, SendWr,
    UdDest, UdSendWr, VerbsContext, WcOpcode, WcStatus, WorkCompletion, WorkQueue, GRH_LEN,
};
use std::sync::Arc;

use crate::support::{count, reap_until, wait_count, writable_pair};

/// Posting on a UD QP the caller moved to the error state. Measured on rxe before the fix: a
/// send posted then is flushed, but a receive posted then is never flushed: it stayed held
/// (region unreadable), its wait ran to the timeout, and the QP's drop waited out its drain
/// bound. Now both are refused with nothing held; work posted before `set_error` still flushes
/// and is released when reaped.
///
/// Origin: the round-4 outside-style review (UD, multicast, async events), formerly in `tests/attack_r4.rs`.
#[test]
fn posts_after_set_error_are_refused_with_nothing_held() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7408, QpInit::new());
    let mut before = MemoryRegion::new(server.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&before, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
    client.qp_mut().set_error().unwrap();
    server.qp_mut().set_error().unwrap();
    let flushed = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap_err();
    assert!(matches!(flushed, Error::WorkCompletion { wr_id: 1, .. }), "{flushed}");
    assert!(before.as_slice().is_ok(), "the flushed receive's region is back");
    let ah = AddressHandle::new(client.qp().pd(), to_server.ah().attr()).unwrap();
    let weak = Arc::downgrade(&ah);
    let dest = UdDest::new(ah, to_server.qpn(), to_server.qkey());
    let sbuf = MemoryRegion::new(client.qp().pd(), 32, AccessFlags::LOCAL_WRITE).unwrap();
    let e = client.qp_mut().post_send(&[UdSendWr::send(&dest, &sbuf, 0..32).wr_id(2)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("error state"), "{e}");
    assert!(sbuf.outstanding() == 0 && client.qp().outstanding_sends() == 0);
    drop(dest);
    assert!(weak.upgrade().is_none());
    let rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    let e = server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 8).wr_id(3)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("ibv_post_recv"), "{e}");
    assert!(rbuf.outstanding() == 0 && server.qp().outstanding_recvs() == 0);
    drop((client, server, to_server, to_client, sbuf, rbuf, before));
    t.finish();
}

/// A single receive on a chunk at an offset in its registration is checked against the
/// chunk, not the registration: every range leaving the chunk (past its end, reversed, empty
/// past its end) is refused with nothing posted or held, although the registration has room.
/// A good one lands at the chunk's offset only; a message longer than the chunk fails and
/// writes nothing into the next chunk; an empty receive at the chunk's very end is allowed,
/// holds the chunk, and completes with 0 bytes writing nothing.
///
/// Origin: the round-5 outside-style review (the single-receive fast path, the raw-field WorkCompletion, cached region attributes, retirement of unsignaled work), formerly in `tests/attack_r5.rs`.
#[test]
fn a_single_receive_on_an_offset_chunk_is_bounded_by_the_chunk() {
    let t = DeviceTest::start();
    let sspec = PairSpec { mr_sizes: vec![256], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), sspec);
    let mut chunks = s.mrs.remove(0).split(64).unwrap();
    assert_eq!(chunks.len(), 4);
    let canaries: Vec<Vec<u8>> = (0..4).map(|i| pattern(64, 100 + i as u8)).collect();
    for (ch, can) in chunks.iter_mut().zip(&canaries) {
        ch.as_mut_slice().unwrap().copy_from_slice(can);
    }
    assert_eq!(chunks[2].addr(), chunks[0].addr() + 128);

    let bad: [(std::ops::Range<usize>, &str); 5] = [
        (0..65, "one past"),
        (60..70, "straddles"),
        (65..65, "empty past"),
        (64..128, "next chunk"),
        (usize::MAX..usize::MAX, "huge"),
    ];
    for (r, what) in bad {
        let e = s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[2], r.clone()).wr_id(7)]).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { size: 64, .. }), "{what} {r:?}: {e:?}");
        assert_eq!(s.conn.qp().outstanding_recvs(), 0, "{what}: nothing posted");
        assert_eq!(chunks[2].outstanding(), 0, "{what}: nothing held");
        assert!(chunks[2].as_mut_slice().is_ok(), "{what}: the chunk stays writable");
    }
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 10..5;
    let e = s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[2], reversed).wr_id(7)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "reversed: {e:?}");
    assert_eq!(s.conn.qp().outstanding_recvs(), 0);
    let ro = MemoryRegion::new(&s.pd, 64, AccessFlags::REMOTE_READ).unwrap();
    let e = s.conn.qp_mut().post_recv(&[RecvWr::new(&ro, 0..64).wr_id(7)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("LOCAL_WRITE")), "no LOCAL_WRITE: {e:?}");
    assert_eq!((s.conn.qp().outstanding_recvs(), ro.outstanding()), (0, 0));

    // A good one at an offset inside the offset chunk.
    let id = u64::MAX - 2;
    s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[2], 8..64).wr_id(id)]).unwrap();
    assert_eq!(chunks[2].outstanding(), 1);
    out_of_reach(&mut chunks[2], "chunk 2 with a receive posted");
    for i in [0, 1, 3] {
        assert_eq!(chunks[i].as_slice().expect("a sibling stays readable"), &canaries[i][..]);
    }
    let payload = pattern(56, 9);
    c.mrs[0].as_mut_slice().unwrap()[..56].copy_from_slice(&payload);
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..56).wr_id(1)]).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, id, T).unwrap();
    assert_eq!((wc.wr_id(), wc.byte_len(), wc.opcode(), wc.imm_data()), (id, 56, Some(WcOpcode::Recv), None));
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    let got = chunks[2].as_slice().unwrap();
    assert_eq!(&got[..8], &canaries[2][..8], "bytes before the range untouched");
    assert_eq!(&got[8..], &payload[..], "the data lands at the chunk's offset + 8");
    for i in [0, 1, 3] {
        assert_eq!(chunks[i].as_slice().unwrap(), &canaries[i][..], "chunk {i} untouched");
    }

    // An empty receive at the chunk's very end: allowed, holds the chunk, writes nothing.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[3], 64..64).wr_id(33)]).unwrap();
    out_of_reach(&mut chunks[3], "chunk 3 with an empty receive posted");
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..0).wr_id(2)]).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 33, T).unwrap();
    assert_eq!(wc.byte_len(), 0);
    c.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    assert_eq!(chunks[3].as_slice().unwrap(), &canaries[3][..]);

    // One byte more than chunk 1 holds: the receive fails; chunk 2 (next in the registration)
    // keeps what it had.
    let before2 = chunks[2].as_slice().unwrap().to_vec();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[1], 0..64).wr_id(44)]).unwrap();
    c.mrs[0].as_mut_slice().unwrap()[..65].fill(0xee);
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..65).wr_id(3)]).unwrap();
    let (wc, _) = reap_until(s.conn.qp_mut(), 44);
    assert!(!wc.is_ok(), "a 65-byte message into a 64-byte receive must fail: {wc:?}");
    assert_eq!(wc.opcode(), None, "a failed completion hides its opcode");
    // rxe reports LOC_QP_OP_ERR for it; LOC_LEN_ERR is what the spec suggests.
    assert!(matches!(wc.status(), WcStatus::LocLenErr | WcStatus::LocQpOpErr), "{wc:?}");
    let (cwc, _) = reap_until(c.conn.qp_mut(), 3);
    assert!(!cwc.is_ok(), "the sender learns of it: {cwc:?}");
    assert_eq!(chunks[2].as_slice().unwrap(), &before2[..], "nothing spilled into the next chunk");
    assert_eq!(chunks[0].as_slice().unwrap(), &canaries[0][..]);
    assert_eq!(chunks[3].as_slice().unwrap(), &canaries[3][..]);
    assert!(chunks[1].as_mut_slice().is_ok(), "the failed receive was reaped: chunk 1 is free");
    drop((c, s, chunks, ro));
    t.finish();
}

/// A single receive on a region of another PD is refused, whatever it looks like: a PD of the
/// same context, one of another context of the same device, and one whose last handle the
/// caller dropped (the region keeps it allocated, so no new PD can take its address); a
/// region on the QP's own PD through a cloned handle is accepted.
///
/// Origin: the round-5 outside-style review (the single-receive fast path, the raw-field WorkCompletion, cached region attributes, retirement of unsignaled work), formerly in `tests/attack_r5.rs`.
#[test]
fn a_single_receive_on_a_region_of_another_pd_is_refused_whatever_its_pd_became() {
    let t = DeviceTest::start();
    let (c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    let ctx = s.pd.context().clone();
    let refused = |qp: &mut QueuePair, mr: &mut MemoryRegion, what: &str| {
        let e = qp.post_recv(&[RecvWr::new(mr, 0..64).wr_id(5)]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("another protection domain")), "{what}: {e:?}");
        assert_eq!(qp.outstanding_recvs(), 0, "{what}: nothing posted");
        assert_eq!(mr.outstanding(), 0, "{what}: nothing held");
        assert!(mr.as_mut_slice().is_ok(), "{what}: still writable");
    };

    let pds = count("pd");
    let pd2 = ProtectionDomain::new(&ctx).unwrap();
    let mut mr2 = MemoryRegion::new(&pd2, 64, AccessFlags::LOCAL_WRITE).unwrap();
    assert_eq!(mr2.access(), s.mrs[0].access());
    refused(s.conn.qp_mut(), &mut mr2, "a PD of the same context");
    let pd2_addr = Arc::as_ptr(&pd2) as usize;
    drop(pd2);
    assert_eq!(count("pd"), pds + 1, "the region keeps its PD allocated after the caller's handle is gone");
    assert_eq!(Arc::as_ptr(mr2.pd()) as usize, pd2_addr);
    // New PDs while the old one lives: none can be at its address.
    let fresh: Vec<_> = (0..8).map(|_| ProtectionDomain::new(&ctx).unwrap()).collect();
    assert!(fresh.iter().all(|p| Arc::as_ptr(p) as usize != pd2_addr));
    refused(s.conn.qp_mut(), &mut mr2, "a PD whose caller's handle was dropped");
    drop(fresh);
    drop(mr2);
    wait_count("pd", pds, "dropping the region releases its PD");
    // And after it is freed, a PD that may reuse its address is still another PD.
    let pd4 = ProtectionDomain::new(&ctx).unwrap();
    let mut mr4 = MemoryRegion::new(&pd4, 64, AccessFlags::LOCAL_WRITE).unwrap();
    refused(s.conn.qp_mut(), &mut mr4, "a PD allocated after the other's was freed");

    // Another context of the same device.
    let ctx2 = VerbsContext::open(&ctx.device_name()).unwrap();
    assert!(!ctx2.same_as(&ctx));
    let pd5 = ProtectionDomain::new(&ctx2).unwrap();
    let mut mr5 = MemoryRegion::new(&pd5, 64, AccessFlags::LOCAL_WRITE).unwrap();
    refused(s.conn.qp_mut(), &mut mr5, "a PD of another context");

    // The QP's own PD through another handle: accepted.
    let own = Arc::clone(s.conn.qp().pd());
    let mut mine = MemoryRegion::new(&own, 64, AccessFlags::LOCAL_WRITE).unwrap();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&mine, 0..64).wr_id(6)]).unwrap();
    assert_eq!(s.conn.qp().outstanding_recvs(), 1);
    out_of_reach(&mut mine, "a receive on the QP's own PD");
    drop((c, s));
    assert!(mine.as_mut_slice().is_ok(), "dropping the QP released the receive's hold");
    drop((mine, own, mr4, pd4, mr5, pd5, ctx2, ctx));
    t.finish();
}

/// The single path's queue check counts completions reaped but not yet delivered: with a
/// receive queue of 4 whose completions a wait passed (kept, undelivered), only the free
/// room is taken; a refused post holds nothing; delivering the kept ones frees the room.
///
/// Origin: the round-5 outside-style review (the single-receive fast path, the raw-field WorkCompletion, cached region attributes, retirement of unsignaled work), formerly in `tests/attack_r5.rs`.
#[test]
fn a_single_receive_on_a_full_queue_is_refused_counting_undelivered_completions() {
    let t = DeviceTest::start();
    let sspec = PairSpec { mr_sizes: vec![256], init: QpInit::new().max_recv_wr(4), ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), sspec);
    let mut chunks = s.mrs.remove(0).split(64).unwrap();
    let mut extra = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    for (k, ch) in chunks.iter().enumerate() {
        s.conn.qp_mut().post_recv(&[RecvWr::new(ch, 0..64).wr_id(k as u64)]).unwrap();
    }
    let e = s.conn.qp_mut().post_recv(&[RecvWr::new(&extra, 0..64).wr_id(4)]).unwrap_err();
    assert!(matches!(e, Error::QueueFull { queue: "receive", depth: 4 }), "{e:?}");
    assert_eq!((s.conn.qp().outstanding_recvs(), extra.outstanding()), (4, 0));
    assert!(extra.as_mut_slice().is_ok());
    for k in 0..4u64 {
        c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(10 + k)]).unwrap();
    }
    c.conn.qp_mut().wait_for(WorkQueue::Send, 13, T).unwrap();
    // Waiting for the last receive keeps the three before it.
    s.conn.qp_mut().wait_for(WorkQueue::Recv, 3, T).unwrap();
    assert_eq!((s.conn.qp().outstanding_recvs(), s.conn.qp().undelivered()), (0, 3));
    for ch in chunks.iter_mut() {
        assert!(ch.as_mut_slice().is_ok(), "reaped receives hold nothing, delivered or not");
    }
    // Room for one: 4 - 0 outstanding - 3 undelivered.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&extra, 0..64).wr_id(4)]).unwrap();
    let e = s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[0], 0..64).wr_id(5)]).unwrap_err();
    assert!(matches!(e, Error::QueueFull { .. }), "undelivered completions take room: {e:?}");
    assert_eq!(chunks[0].outstanding(), 0);
    assert!(chunks[0].as_mut_slice().is_ok());
    let mut wcs = [WorkCompletion::default(); 8];
    let n = s.conn.qp_mut().poll(&mut wcs).unwrap();
    let ids: Vec<u64> = wcs[..n].iter().map(|w| w.wr_id()).collect();
    assert_eq!(ids, vec![0, 1, 2], "the kept completions come back in order");
    s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[0], 0..64).wr_id(5)]).unwrap();
    assert_eq!(s.conn.qp().outstanding_recvs(), 2);
    for k in 0..2u64 {
        c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(20 + k)]).unwrap();
    }
    s.conn.qp_mut().wait_for(WorkQueue::Recv, 4, T).unwrap();
    s.conn.qp_mut().wait_for(WorkQueue::Recv, 5, T).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 21, T).unwrap();
    assert!(extra.as_mut_slice().is_ok() && chunks[0].as_mut_slice().is_ok());
    drop((c, s, chunks, extra));
    t.finish();
}

/// Finding 1: a WRITE with a wrong rkey fails with REM_ACCESS_ERR, which moves the RC QP to the
/// error state; rxe never flushes a receive posted then, so the crate must refuse it (it did on
/// UD and after `set_error`, not after a failed completion on RC).
///
/// Origin: the regression tests of the third outside audit's findings (issue 20), formerly in `tests/completions.rs`.
#[test]
fn a_failed_completion_makes_an_rc_qp_refuse_receives_and_sends() {
    let t = DeviceTest::start();
    let (mut c, s) = writable_pair(t.addr);
    let remote = s.mrs[0].remote();
    let bad = rdma_cm::RemoteRegion::new(remote.addr, remote.rkey ^ 0x5a5a, remote.len);
    c.conn.qp_mut().post_send(&[SendWr::write(&c.mrs[0], 0..64, &bad, 0).unwrap().wr_id(1)]).unwrap();
    let e = c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap_err();
    assert!(
        matches!(e, rdma_cm::Error::WorkCompletion { status: WcStatus::RemAccessErr, .. }),
        "the bad rkey must fail the WRITE: {e}"
    );
    assert_eq!(c.conn.qp().state().unwrap(), QpState::Error, "a failed completion moves an RC QP to ERR");
    let e = c.conn.qp_mut().post_recv(&[RecvWr::new(&c.mrs[0], 0..64).wr_id(2)]).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, rdma_cm::Error::QpInError { .. }), "{m}");
    assert!(m.contains("error state") && m.contains("REM_ACCESS_ERR"), "the refusal names the failure: {m}");
    assert_eq!(c.mrs[0].outstanding(), 0, "the refused receive holds nothing");
    let e = c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(3)]).unwrap_err();
    assert!(matches!(e, rdma_cm::Error::QpInError { .. }), "{e}");
    drop((c, s));
    t.finish();
}
