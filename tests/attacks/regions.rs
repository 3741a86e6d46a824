//! Regions in flight: every region a work request names (each piece of a scatter/gather list, chunks of one registration) stays registered and out of Rust's reach until its completion.

use crate::common::{mr_count, out_of_reach, pair, pattern, DeviceTest, PairSpec, T};
use crate::support::{reap_all, LW};
use rdma_cm::{AccessFlags, Client, Error, MemoryRegion, QpInit, RecvWr, SendWr, WcOpcode, WorkCompletion, WorkQueue};
use std::net::SocketAddr;

/// Many rounds of seven unsignaled RDMA READs (each posted alone, each into its own chunk)
/// closed by one signaled send, on a send queue of 8: the ring's indices wrap many times, and
/// each signaled completion retires every READ before it (outstanding 0, nothing kept), after
/// which every chunk holds what the peer had at the time.
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

/// Sharper edge: REMOTE_WRITE without LOCAL_WRITE registers (LOCAL_WRITE is implied).
#[test]
fn remote_write_implies_local_write() {
    let t = DeviceTest::start();
    let route = Client::new().unwrap().resolve_addr(None, SocketAddr::new(t.addr, 7999), T).unwrap();
    let route = route.resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    for access in [AccessFlags::REMOTE_WRITE, AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ] {
        let mr = MemoryRegion::new(&pd, 4096, access).expect("remote write rights alone must register");
        assert!(mr.access().contains(AccessFlags::LOCAL_WRITE | access));
    }
    drop((pd, route));
    t.finish();
}

/// Sharper edge: a region the device only reads (an in-flight send's source) can be read, not
/// written; one it writes (a posted receive) can be neither.
#[test]
fn in_flight_sources_are_readable_and_targets_are_not() {
    let t = DeviceTest::start();
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    c.mrs[0].as_mut_slice().unwrap()[..4].copy_from_slice(b"ping");
    // No receive at the server yet, so the send stays in flight (RNR retries).
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..4).wr_id(1)]).unwrap();
    assert_eq!(&c.mrs[0].as_slice().expect("a send's source may be read")[..4], b"ping");
    let mut b = [0u8; 4];
    c.mrs[0].read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"ping");
    assert!(matches!(c.mrs[0].as_mut_slice(), Err(Error::InFlight { .. })), "but not written");
    assert!(matches!(c.mrs[0].write_at(0, b"x"), Err(Error::InFlight { .. })));
    // A posted receive: neither read nor written.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(2)]).unwrap();
    let _ = s.conn.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap();
    let mut tgt = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&tgt, 0..64).wr_id(3)]).unwrap();
    assert!(matches!(tgt.as_slice(), Err(Error::InFlight { .. })));
    assert!(matches!(tgt.read_at(0, &mut b), Err(Error::InFlight { .. })));
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    drop((c, s, tgt));
    t.finish();
}

/// Scatter/gather: while a receive or an RDMA READ of several pieces is outstanding, every
/// region of every piece (the second and third especially: they live in the ring's side table)
/// refuses every accessor; the regions of an outstanding gathered send may be read, not
/// written; a region named by two pieces of one work request is held once for it. Once reaped, all is reachable and right.
#[test]
fn every_piece_of_an_outstanding_scatter_is_out_of_reach() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        init: QpInit::new().max_recv_sge(3),
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let lw = AccessFlags::LOCAL_WRITE;
    // A gathered send the peer has no receive for yet: it stays in flight (RNR retries).
    let mut g0 = MemoryRegion::new(&c.pd, 64, lw).unwrap();
    let mut g1 = MemoryRegion::new(&c.pd, 64, lw).unwrap();
    g0.as_mut_slice().unwrap().copy_from_slice(&[1; 64]);
    g1.as_mut_slice().unwrap().copy_from_slice(&[2; 64]);
    let pieces = [(&g0, 0..64), (&g1, 0..64), (&g0, 0..22)];
    c.conn.qp_mut().post_send(&[SendWr::send_sg(&pieces).unwrap().wr_id(1)]).unwrap();
    assert_eq!((g0.outstanding(), g1.outstanding()), (1, 1), "one hold per work request naming the region");
    for (mr, what) in [(&mut g0, "first/third send piece"), (&mut g1, "second send piece")] {
        assert!(mr.as_slice().is_ok(), "{what}: a send's source may be read");
        assert!(mr.read_at(0, &mut [0u8; 4]).is_ok(), "{what}: read_at");
        assert!(matches!(mr.as_mut_slice(), Err(Error::InFlight { .. })), "{what}: but not written");
        assert!(matches!(mr.write_at(0, b"x"), Err(Error::InFlight { .. })), "{what}: write_at");
    }
    // A receive of 3 pieces: 3 regions, the second and third chunks of one registration.
    let mut a = MemoryRegion::new(&s.pd, 64, lw).unwrap();
    let mut bc = MemoryRegion::new(&s.pd, 128, lw).unwrap().split(64).unwrap();
    let mut cc = bc.pop().unwrap();
    let mut b = bc.pop().unwrap();
    let pieces = [(&a, 0..64), (&b, 0..64), (&cc, 0..64)];
    s.conn.qp_mut().post_recv(&[RecvWr::sg(&pieces).unwrap().wr_id(2)]).unwrap();
    out_of_reach(&mut a, "first receive piece");
    out_of_reach(&mut b, "second receive piece");
    out_of_reach(&mut cc, "third receive piece");
    // A READ scattered into 3 pieces, one region named twice.
    let mut x = MemoryRegion::new(&c.pd, 128, lw).unwrap();
    let mut y = MemoryRegion::new(&c.pd, 64, lw).unwrap();
    let remote = s.mrs[0].remote();
    s.mrs[0].as_mut_slice().unwrap()[..160].copy_from_slice(&crate::common::pattern(160, 7));
    let pieces = [(&x, 0..32), (&y, 0..64), (&x, 64..128)];
    c.conn.qp_mut().post_send(&[SendWr::read_sg(&pieces, &remote, 0).unwrap().wr_id(3)]).unwrap();
    assert_eq!((x.outstanding(), y.outstanding()), (1, 1));
    out_of_reach(&mut x, "first and third READ piece");
    out_of_reach(&mut y, "second READ piece");
    // Reaped: everything is reachable again, with the right bytes.
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    assert_eq!(wc.byte_len(), 160);
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap().byte_len(), 150);
    assert_eq!(a.as_slice().unwrap(), &[1; 64]);
    assert_eq!(b.as_slice().unwrap(), &[2; 64]);
    assert_eq!(&cc.as_slice().unwrap()[..22], &[1; 22]);
    let want = crate::common::pattern(160, 7);
    assert_eq!(&x.as_slice().unwrap()[..32], &want[..32]);
    assert_eq!(y.as_slice().unwrap(), &want[32..96]);
    assert_eq!(&x.as_slice().unwrap()[64..], &want[96..]);
    for mr in [&mut g0, &mut g1, &mut a, &mut b, &mut cc, &mut x, &mut y] {
        assert_eq!(mr.outstanding(), 0);
        assert!(mr.as_mut_slice().is_ok());
    }
    drop((g0, g1, a, b, cc, x, y, bc, c, s));
    t.finish();
}

/// Scatter/gather: dropping the handles of every piece of an outstanding receive and READ
/// keeps the memory registered (the kernel still lists it) and usable by the device (the work
/// completes successfully, which it could not on a deregistered region) until the completions
/// are reaped; then it goes.
#[test]
fn dropped_pieces_stay_registered_until_their_completion() {
    let t = DeviceTest::start();
    let cspec = PairSpec { init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        init: QpInit::new().max_recv_sge(3),
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let before = crate::common::mr_count();
    let lw = AccessFlags::LOCAL_WRITE;
    let recv: Vec<MemoryRegion> = (0..3).map(|_| MemoryRegion::new(&s.pd, 64, lw).unwrap()).collect();
    let pieces = [(&recv[0], 0..64), (&recv[1], 0..64), (&recv[2], 0..64)];
    s.conn.qp_mut().post_recv(&[RecvWr::sg(&pieces).unwrap().wr_id(1)]).unwrap();
    let read: Vec<MemoryRegion> = (0..3).map(|_| MemoryRegion::new(&c.pd, 64, lw).unwrap()).collect();
    let pieces = [(&read[0], 0..64), (&read[1], 0..64), (&read[2], 0..64)];
    let remote = s.mrs[0].remote();
    c.conn.qp_mut().post_send(&[SendWr::read_sg(&pieces, &remote, 0).unwrap().wr_id(2)]).unwrap();
    drop((recv, read));
    if let Some(n) = before {
        assert_eq!(crate::common::mr_count(), Some(n + 6), "the dropped regions must stay registered");
    }
    c.mrs[0].as_mut_slice().unwrap()[..192].copy_from_slice(&crate::common::pattern(192, 3));
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..192).wr_id(3)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).expect("the device wrote every dropped piece");
    assert_eq!(wc.byte_len(), 192);
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).expect("the READ landed in the dropped pieces");
    assert_eq!(wc.byte_len(), 192);
    if let Some(n) = before {
        assert_eq!(crate::common::mr_count(), Some(n), "reaping released (and deregistered) all six");
    }
    drop((c, s));
    t.finish();
}

/// An RDMA READ's target is out of reach (no slice, no copy) until its completion is reaped,
/// also when the same region is the source of a send in the same batch; chunks of one
/// registration lock independently; `into_buffer` and `split` refuse regions in flight.
#[test]
fn read_targets_chunks_and_split_regions_stay_out_of_reach_while_in_flight() {
    let t = DeviceTest::start();
    let spec_s = PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    let pattern = crate::common::pattern(4096, 9);
    s.mrs[0].as_mut_slice().unwrap().copy_from_slice(&pattern);
    let remote = s.mrs[0].remote();
    let whole = MemoryRegion::new(&c.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mut chunks = whole.split(1024).unwrap();
    assert_eq!(chunks.len(), 4);
    // Chunk 1: the source of a send and the target of a READ, in one batch.
    let mut s_recv = MemoryRegion::new(&s.pd, 1024, AccessFlags::LOCAL_WRITE).unwrap();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s_recv, 0..1024).wr_id(2)]).unwrap();
    let batch = [
        SendWr::send(&chunks[1], 0..1024).wr_id(10),
        SendWr::read(&chunks[1], 0..1024, &remote, 1024).unwrap().wr_id(11),
    ];
    c.conn.qp_mut().post_send(&batch).unwrap();
    let mut b = [0u8; 8];
    assert!(matches!(chunks[1].as_slice(), Err(Error::InFlight { .. })), "a READ target has no slice");
    assert!(matches!(chunks[1].read_at(0, &mut b), Err(Error::InFlight { .. })), "nor a copy");
    assert!(matches!(chunks[1].as_mut_slice(), Err(Error::InFlight { .. })));
    // Its siblings are free.
    chunks[0].as_mut_slice().unwrap().fill(0xaa);
    assert!(chunks[2].as_slice().is_ok() && chunks[3].as_mut_slice().is_ok());
    // A chunk cannot give the registration back (its siblings, one in flight, share it).
    let c3 = chunks.pop().unwrap();
    assert!(matches!(c3.into_buffer(), Err(Error::InvalidArgument(_))));
    let got = reap_all(c.conn.qp_mut(), T);
    assert_eq!(got, [(10, WorkQueue::Send, true), (11, WorkQueue::Send, true)]);
    assert_eq!(chunks[1].as_slice().unwrap(), &pattern[1024..2048], "the READ landed in chunk 1");
    assert_eq!(chunks[0].as_slice().unwrap(), &[0xaa; 1024][..]);
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap().byte_len(), 1024);
    assert!(s_recv.as_slice().is_ok());
    // A boxed region in flight: into_buffer refuses and the QP keeps the memory alive.
    let boxed = MemoryRegion::register(&c.pd, vec![0u8; 256].into_boxed_slice(), AccessFlags::LOCAL_WRITE).unwrap();
    c.conn.qp_mut().post_send(&[SendWr::read(&boxed, 0..256, &remote, 0).unwrap().wr_id(12)]).unwrap();
    assert!(matches!(boxed.into_buffer(), Err(Error::InFlight { .. })));
    // split of a chunk in flight is refused likewise.
    c.conn.qp_mut().post_send(&[SendWr::read(&chunks[2], 0..512, &remote, 0).unwrap().wr_id(13)]).unwrap();
    let c2 = chunks.remove(2);
    assert!(matches!(c2.split(100), Err(Error::InFlight { .. })));
    assert_eq!(reap_all(c.conn.qp_mut(), T), [(12, WorkQueue::Send, true), (13, WorkQueue::Send, true)]);
    drop((c, s, chunks, s_recv));
    t.finish();
}
