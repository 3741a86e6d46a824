//! Regions in flight: every region a work request names (each piece of a scatter/gather list, chunks of one registration) stays registered and out of Rust's reach until its completion.

use crate::common::{mr_count, out_of_reach, pair, pattern, DeviceTest, PairSpec, T};
use rdma_cm::{AccessFlags, Error, MemoryRegion, QpInit, RecvWr, SendWr, WcOpcode, WorkCompletion, WorkQueue};

use crate::support::LW;

/// Many rounds of seven unsignaled RDMA READs (each posted alone, each into its own chunk)
/// closed by one signaled send, on a send queue of 8: the ring's indices wrap many times, and
/// each signaled completion retires every READ before it (outstanding 0, nothing kept), after
/// which every chunk holds what the peer had at the time.
///
/// Origin: the round-5 outside-style review (the single-receive fast path, the raw-field WorkCompletion, cached region attributes, retirement of unsignaled work), formerly in `tests/attack_r5.rs`.
#[test]
fn unsignaled_reads_into_chunks_retire_with_the_next_signaled_send_across_wraps() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![7 * 64, 64], init: QpInit::new().max_send_wr(8), ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![7 * 64, 64],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let remote = s.mrs[0].remote();
    let mut targets = c.mrs.remove(0).split(64).unwrap();
    for round in 0..24u64 {
        let src = pattern(7 * 64, round as u8);
        s.mrs[0].as_mut_slice().unwrap().copy_from_slice(&src);
        s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[1], 0..64).wr_id(round)]).unwrap();
        for (k, tgt) in targets.iter().enumerate() {
            let w = SendWr::read(tgt, 0..64, &remote, (k * 64) as u64).unwrap().wr_id(5000 + k as u64).unsignaled();
            c.conn.qp_mut().post_send(&[w]).unwrap();
        }
        for tgt in targets.iter_mut() {
            out_of_reach(tgt, "an unsignaled READ target");
        }
        let sig = 1000 + round;
        c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(sig)]).unwrap();
        assert_eq!(c.conn.qp().outstanding_sends(), 8);
        let e = c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(1)]).unwrap_err();
        assert!(matches!(e, Error::QueueFull { queue: "send", .. }), "{e:?}");
        let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, sig, T).unwrap();
        assert_eq!(wc.opcode(), Some(WcOpcode::Send));
        assert_eq!(
            (c.conn.qp().outstanding_sends(), c.conn.qp().undelivered()),
            (0, 0),
            "round {round}: the signaled completion retires every READ before it, and none comes back"
        );
        for (k, tgt) in targets.iter_mut().enumerate() {
            assert_eq!(tgt.as_slice().unwrap(), &src[k * 64..(k + 1) * 64], "round {round}, chunk {k}");
            assert!(tgt.as_mut_slice().is_ok());
        }
        s.conn.qp_mut().wait_for(WorkQueue::Recv, round, T).unwrap();
    }
    let mut wcs = [WorkCompletion::default(); 8];
    assert_eq!(c.conn.qp_mut().poll(&mut wcs).unwrap(), 0, "no unsignaled READ ever completes on its own");
    drop((c, s, targets));
    t.finish();
}

/// A READ scattered into four pieces of one region (and a second READ into pieces of two
/// regions, alternating A B A B) whose caller drops every handle of the regions before the
/// completion: the regions stay registered (the kernel's MR count does not move) until the
/// completions are reaped, and are deregistered then. While they are alive and in flight,
/// nothing of them is reachable.
///
/// Origin: the round-6 outside-style review (one hold per region per scatter/gather work request), formerly in `tests/attack_r6.rs`.
#[test]
fn regions_named_by_several_pieces_stay_registered_until_the_completion_when_dropped() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![], init: QpInit::new().max_send_sge(4), ..PairSpec::default() };
    let sspec = PairSpec { mr_sizes: vec![4096], access: LW | AccessFlags::REMOTE_READ, ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let src = pattern(512, 41);
    s.mrs[0].as_mut_slice().unwrap()[..512].copy_from_slice(&src);
    let remote = s.mrs[0].remote();

    let mut one = MemoryRegion::new(&c.pd, 256, LW).unwrap();
    let mut a = MemoryRegion::new(&c.pd, 128, LW).unwrap();
    let mut b = MemoryRegion::new(&c.pd, 128, LW).unwrap();
    let four = [(&one, 0..32), (&one, 64..96), (&one, 128..160), (&one, 192..224)];
    let abab = [(&a, 0..32), (&b, 0..32), (&a, 64..96), (&b, 64..96)];
    // Unsignaled first: only the signaled second READ's completion retires it.
    let wrs = [
        SendWr::read_sg(&four, &remote, 0).unwrap().wr_id(1).unsignaled(),
        SendWr::read_sg(&abab, &remote, 128).unwrap().wr_id(2),
    ];
    c.conn.qp_mut().post_send(&wrs).unwrap();
    assert_eq!((one.outstanding(), a.outstanding(), b.outstanding()), (1, 1, 1), "one hold per work request");
    out_of_reach(&mut one, "a region named by four pieces of a READ");
    out_of_reach(&mut a, "region A of an A B A B READ");
    out_of_reach(&mut b, "region B of an A B A B READ");
    let before = mr_count();
    drop((one, a, b));
    assert_eq!(mr_count(), before, "dropping the caller's handles deregisters nothing while the READs are posted");
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    assert!(wc.is_ok(), "{wc:?}");
    assert_eq!(wc.byte_len(), 128);
    // Deregistration is synchronous: the last hold went with the completion just reaped.
    assert_eq!(mr_count(), before.map(|n| n - 3), "all three regions deregistered with the completion");
    drop((c, s));
    t.finish();
}

/// The same region named in every piece of work requests posted in a batch, unsignaled, on a
/// send queue of 4 that wraps many times: after each round's signaled completion, every region
/// is free again and holds what was read; before it, none is reachable.
///
/// Origin: the round-6 outside-style review (one hold per region per scatter/gather work request), formerly in `tests/attack_r6.rs`.
#[test]
fn repeated_pieces_of_unsignaled_reads_retire_with_the_signaled_one_across_wraps() {
    let t = DeviceTest::start();
    let cspec =
        PairSpec { mr_sizes: vec![], init: QpInit::new().max_send_wr(4).max_send_sge(4), ..PairSpec::default() };
    let sspec = PairSpec { mr_sizes: vec![4096], access: LW | AccessFlags::REMOTE_READ, ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let remote = s.mrs[0].remote();
    let mut targets: Vec<MemoryRegion> = (0..4).map(|_| MemoryRegion::new(&c.pd, 64, LW).unwrap()).collect();
    for round in 0..20u8 {
        let src = pattern(4 * 64, round);
        s.mrs[0].as_mut_slice().unwrap()[..256].copy_from_slice(&src);
        {
            // Work request k reads 64 bytes into target k, as four 16-byte pieces of it, in
            // order, so that every byte can be checked.
            let lists: Vec<[(&MemoryRegion, std::ops::Range<usize>); 4]> =
                targets.iter().map(|m| [(m, 0..16), (m, 16..32), (m, 32..48), (m, 48..64)]).collect();
            let wrs: Vec<SendWr<'_>> = lists
                .iter()
                .enumerate()
                .map(|(k, l)| {
                    let w = SendWr::read_sg(l, &remote, (k * 64) as u64).unwrap().wr_id(100 + k as u64);
                    if k < 3 {
                        w.unsignaled()
                    } else {
                        w
                    }
                })
                .collect();
            c.conn.qp_mut().post_send(&wrs).unwrap();
        }
        assert_eq!(c.conn.qp().outstanding_sends(), 4);
        for (k, m) in targets.iter_mut().enumerate() {
            assert_eq!(m.outstanding(), 1, "round {round}, target {k}: one hold for four pieces");
            out_of_reach(m, "a target of an unsignaled scattered READ");
        }
        let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 103, T).unwrap();
        assert!(wc.is_ok(), "round {round}: {wc:?}");
        assert_eq!(c.conn.qp().outstanding_sends(), 0, "round {round}: the signaled READ retired the others");
        for (k, m) in targets.iter_mut().enumerate() {
            assert_eq!(m.outstanding(), 0, "round {round}, target {k}");
            assert_eq!(m.as_slice().unwrap(), &src[k * 64..(k + 1) * 64], "round {round}, target {k}: the bytes read");
            assert!(m.as_mut_slice().is_ok());
        }
    }
    drop((c, s, targets));
    t.finish();
}

/// Chunks of one registration are regions of their own: a receive scattered into chunk 0,
/// chunk 1 and chunk 0 again holds each named chunk (once) and leaves chunk 2 free; the message
/// lands piece by piece, in order, and nothing outside the pieces changes.
///
/// Origin: the round-6 outside-style review (one hold per region per scatter/gather work request), formerly in `tests/attack_r6.rs`.
#[test]
fn chunks_of_one_registration_named_twice_in_a_receive_are_each_held() {
    let t = DeviceTest::start();
    let sspec = PairSpec { mr_sizes: vec![], init: QpInit::new().max_recv_sge(3), ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), sspec);
    let mut chunks = MemoryRegion::new(&s.pd, 3 * 64, LW).unwrap().split(64).unwrap();
    for ch in chunks.iter_mut() {
        ch.as_mut_slice().unwrap().fill(0xEE);
    }
    {
        let pieces = [(&chunks[0], 0..16), (&chunks[1], 0..16), (&chunks[0], 32..48)];
        s.conn.qp_mut().post_recv(&[RecvWr::sg(&pieces).unwrap().wr_id(7)]).unwrap();
    }
    assert_eq!(chunks.iter().map(|m| m.outstanding()).collect::<Vec<_>>(), [1, 1, 0]);
    out_of_reach(&mut chunks[0], "chunk 0, named by two pieces");
    out_of_reach(&mut chunks[1], "chunk 1");
    assert!(chunks[2].as_mut_slice().is_ok(), "chunk 2 is named by no piece");
    let msg = pattern(48, 3);
    c.mrs[0].as_mut_slice().unwrap()[..48].copy_from_slice(&msg);
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..48).wr_id(1)]).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 7, T).unwrap();
    assert_eq!(wc.byte_len(), 48);
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    let c0 = chunks[0].as_slice().unwrap();
    assert_eq!((&c0[..16], &c0[32..48]), (&msg[..16], &msg[32..48]));
    assert!(c0[16..32].iter().chain(&c0[48..]).all(|&x| x == 0xEE), "chunk 0 outside its pieces untouched");
    let c1 = chunks[1].as_slice().unwrap();
    assert_eq!(&c1[..16], &msg[16..32]);
    assert!(c1[16..].iter().all(|&x| x == 0xEE));
    assert!(chunks[2].as_slice().unwrap().iter().all(|&x| x == 0xEE));
    assert!(chunks.iter_mut().all(|m| m.as_mut_slice().is_ok()));
    drop((c, s, chunks));
    t.finish();
}

/// A gathered WRITE from one region named in every piece: the region may be read while the
/// WRITE is in flight (the device only reads it) but not changed, also not through a second
/// handle made from the region's chunks (it cannot be split while held); after the completion
/// the peer holds the four pieces, in order.
///
/// Origin: the round-6 outside-style review (one hold per region per scatter/gather work request), formerly in `tests/attack_r6.rs`.
#[test]
fn a_write_gathered_from_one_region_keeps_it_read_only_until_the_completion() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![256], init: QpInit::new().max_send_sge(4), ..PairSpec::default() };
    let sspec = PairSpec { mr_sizes: vec![256], access: LW | AccessFlags::REMOTE_WRITE, ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let src = pattern(256, 77);
    c.mrs[0].as_mut_slice().unwrap().copy_from_slice(&src);
    let remote = s.mrs[0].remote();
    {
        let m = &c.mrs[0];
        let pieces = [(m, 192..256), (m, 0..64), (m, 128..192), (m, 64..128)];
        let wr = SendWr::write_sg(&pieces, &remote, 0).unwrap().wr_id(5).unsignaled();
        // Unsignaled, and then a signaled one of one piece: the first retires with the second.
        c.conn.qp_mut().post_send(&[wr, SendWr::write(m, 0..8, &remote, 0).unwrap().wr_id(6)]).unwrap();
    }
    let mr = &mut c.mrs[0];
    assert_eq!(mr.outstanding(), 2, "one hold for the four pieces, one for the second WRITE");
    assert_eq!(mr.as_slice().unwrap(), &src[..], "a WRITE's source may be read");
    assert!(matches!(mr.as_mut_slice(), Err(Error::InFlight { .. })), "but not written");
    assert!(matches!(mr.write_at(0, b"x"), Err(Error::InFlight { .. })));
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 6, T).unwrap();
    assert!(wc.is_ok(), "{wc:?}");
    assert_eq!(c.mrs[0].outstanding(), 0);
    let mut got = vec![0u8; 256];
    s.mrs[0].read_at(0, &mut got).unwrap();
    let want: Vec<u8> = [&src[192..256], &src[0..64], &src[128..192], &src[64..128]].concat();
    // The second WRITE rewrote the first 8 bytes with the source's first 8.
    assert_eq!(&got[8..], &want[8..], "the gathered pieces, in order");
    assert_eq!(&got[..8], &src[..8]);
    assert!(c.mrs[0].as_mut_slice().is_ok());
    drop((c, s));
    t.finish();
}
