//! Unreliable datagrams: address handles and regions held until the completion, datagrams parsed and refused safely.

use crate::common::ud::{ud_pair, UdPair};
use crate::common::{pattern, require, Cap, DeviceTest, T};
use rdma_cm::{
    AccessFlags, AddressHandle, Datagram, Error, Grh, MemoryRegion, ProtectionDomain, QpInit, RecvWr, UdDest, UdSendWr,
    VerbsContext, WorkCompletion, WorkQueue, GRH_LEN,
};
use std::sync::Arc;

use crate::support::LW;

/// A second receive still posted on the same region keeps `Datagram::parse` (and the region's
/// bytes) out of reach even once the first receive's completion is reaped: the device may
/// still write the other range.
#[test]
fn parse_refuses_a_region_another_posted_receive_still_uses() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7401, QpInit::new());
    let slot = GRH_LEN + 64;
    let mut rbuf = MemoryRegion::new(server.qp().pd(), 2 * slot, AccessFlags::LOCAL_WRITE).unwrap();
    server
        .qp_mut()
        .post_recv(&[RecvWr::new(&rbuf, 0..slot).wr_id(1), RecvWr::new(&rbuf, slot..2 * slot).wr_id(2)])
        .unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[0xa5; 64]).wr_id(10)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 10, T).unwrap();
    let wc1 = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    assert!(
        matches!(Datagram::parse(&wc1, &mut rbuf, 0), Err(Error::InFlight { .. })),
        "the second receive still lets the device write the region"
    );
    assert!(matches!(rbuf.as_slice(), Err(Error::InFlight { .. })));
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[0x5a; 64]).wr_id(11)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 11, T).unwrap();
    let wc2 = server.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap();
    let d1 = Datagram::parse(&wc1, &mut rbuf, 0).unwrap();
    let d2 = Datagram::parse(&wc2, &mut rbuf, slot).unwrap();
    let bytes = rbuf.as_slice().unwrap();
    assert!(bytes[d1.payload()].iter().all(|&b| b == 0xa5));
    assert!(bytes[d2.payload()].iter().all(|&b| b == 0x5a));
    drop((client, server, to_server, to_client, rbuf));
    t.finish();
}

/// A peer's datagram larger than the receive buffer: the completion is an error (or the
/// message is cut to the buffer), or the datagram is dropped, `Datagram::parse` never names
/// bytes past the buffer, and the neighbouring chunk of the same registration is untouched.
///
/// Both outcomes are real: Debian 12's rxe (6.1) completes the receive with an error, and
/// Debian 13's (6.12) drops the datagram silently, as hardware does (IBA C9-92's length check,
/// rxe's `check_length`). A datagram that fits, sent right after, tells them apart without
/// waiting for nothing: a drop leaves the receive to it.
#[test]
fn a_datagram_larger_than_the_buffer_writes_nothing_past_it() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7402, QpInit::new());
    let chunk = GRH_LEN + 32;
    let mut chunks =
        MemoryRegion::new(server.qp().pd(), 2 * chunk, AccessFlags::LOCAL_WRITE).unwrap().split(chunk).unwrap();
    let canary = pattern(chunk, 77);
    chunks[1].as_mut_slice().unwrap().copy_from_slice(&canary);
    server.qp_mut().post_recv(&[RecvWr::new(&chunks[0], 0..chunk).wr_id(1)]).unwrap();
    let big = pattern(512, 5);
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &big[..200]).wr_id(2)]).ok();
    if client.qp().outstanding_sends() == 0 {
        // Inline capacity too small: send from a region instead.
        let mut s = MemoryRegion::new(client.qp().pd(), 512, AccessFlags::LOCAL_WRITE).unwrap();
        s.as_mut_slice().unwrap().copy_from_slice(&big);
        client.qp_mut().post_send(&[UdSendWr::send(&to_server, &s, 0..512).wr_id(2)]).unwrap();
    }
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    let fits = pattern(8, 6);
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &fits).wr_id(3)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    let mut wcs = [WorkCompletion::default(); 1];
    let n = server.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
    assert_eq!(n, 1, "the receive completes: with the too-long datagram, or with the one that fits after it");
    let wc = wcs[0];
    eprintln!(
        "measured: a 200/512-byte datagram into a {chunk}-byte receive, then an 8-byte one: {} byte_len {}",
        wc.status(),
        wc.byte_len()
    );
    match Datagram::parse(&wc, &mut chunks[0], 0) {
        Err(Error::WorkCompletion { .. }) => {}
        // Dropped: the receive holds the datagram that fits, whole.
        Ok(d) if wc.byte_len() as usize == GRH_LEN + fits.len() => {
            assert_eq!(&chunks[0].as_slice().unwrap()[d.payload()], &fits[..], "the datagram after the dropped one")
        }
        Ok(d) => assert!(d.payload().end <= chunk, "payload {:?} past the {chunk}-byte buffer", d.payload()),
        Err(e) => panic!("unexpected error: {e}"),
    }
    assert_eq!(chunks[1].as_slice().unwrap(), &canary[..], "the neighbouring chunk was written");
    assert_eq!(server.qp().outstanding_recvs(), 0);
    drop((client, server, to_server, to_client, chunks));
    t.finish();
}

/// A datagram over the MTU, a receive without room for the GRH, and a batch whose second send
/// names an address handle of another PD: each refused before posting, with nothing held
/// (regions and handles back to one owner, no outstanding work).
#[test]
fn refused_ud_posts_hold_nothing() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7403, QpInit::new());
    let pd = Arc::clone(client.qp().pd());
    let mtu = client.qp().mtu() as usize;
    let sbuf = MemoryRegion::new(&pd, mtu + 1, AccessFlags::LOCAL_WRITE).unwrap();
    let e = client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..mtu + 1)]).unwrap_err();
    assert!(matches!(e, Error::MessageTooLong { .. }), "{e}");
    assert!(e.to_string().contains(&mtu.to_string()), "the error names the MTU: {e}");
    // Another PD on the same context.
    let other_pd = ProtectionDomain::new(pd.context()).unwrap();
    let foreign =
        UdDest::new(AddressHandle::new(&other_pd, to_server.ah().attr()).unwrap(), to_server.qpn(), to_server.qkey());
    let e = client
        .qp_mut()
        .post_send(&[UdSendWr::send(&to_server, &sbuf, 0..8).wr_id(1), UdSendWr::send(&foreign, &sbuf, 0..8).wr_id(2)])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(client.qp().outstanding_sends(), 0, "a refused batch posts none of its sends");
    assert_eq!(sbuf.outstanding(), 0);
    assert_eq!(Arc::strong_count(foreign.ah()), 1);
    // A receive with no room for the GRH.
    let rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let e = server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN - 1)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("GRH"), "{e}");
    assert_eq!(rbuf.outstanding(), 0);
    assert_eq!(server.qp().outstanding_recvs(), 0);
    // After all that, the QP still works.
    client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..8).wr_id(3)]).unwrap();
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap().is_ok());
    drop((client, server, to_server, to_client, sbuf, rbuf, foreign, other_pd, pd));
    t.finish();
}

/// An address handle made on a PD of a context the caller opened itself (not librdmacm's):
/// refused by the UD QP, never handed to the provider.
#[test]
fn an_address_handle_of_another_context_is_refused() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, server, to_client } = ud_pair(t.addr, 7404, QpInit::new());
    let name = client.qp().pd().context().device_name();
    let ctx = VerbsContext::open(&name).unwrap();
    assert!(!ctx.same_as(client.qp().pd().context()), "a context of our own, not librdmacm's");
    let pd2 = ProtectionDomain::new(&ctx).unwrap();
    let dest = UdDest::new(AddressHandle::new(&pd2, to_server.ah().attr()).unwrap(), to_server.qpn(), to_server.qkey());
    let e = client.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"x")]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(client.qp().outstanding_sends(), 0);
    drop((client, server, to_server, to_client, dest, pd2, ctx));
    t.finish();
}

/// Sends to a QP number nobody has, and with a QKey the receiver does not accept: UD loses them
/// (no hang, no error), and each send's address handle is released once its completion is
/// reaped. A zero-byte datagram is all GRH: its payload is empty and in bounds.
#[test]
fn sends_to_nowhere_complete_and_release_their_handles_and_an_empty_datagram_parses() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7405, QpInit::new());
    let pd = Arc::clone(client.qp().pd());
    let ah = AddressHandle::new(&pd, to_server.ah().attr()).unwrap();
    let weak = Arc::downgrade(&ah);
    let nobody = UdDest::new(Arc::clone(&ah), 0x00ab_cdef, to_server.qkey());
    let bad_qkey = UdDest::new(ah, to_server.qpn(), to_server.qkey() ^ 0x0f0f);
    client
        .qp_mut()
        .post_send(&[
            UdSendWr::send_inline(&nobody, b"lost").wr_id(1),
            UdSendWr::send_inline(&bad_qkey, b"lost").wr_id(2),
        ])
        .unwrap();
    drop((nobody, bad_qkey));
    assert!(weak.upgrade().is_some());
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap().is_ok());
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap().is_ok());
    assert!(weak.upgrade().is_none(), "reaping both completions releases the handle");
    // The empty datagram: the receive's first completion must be it (the lost ones never came).
    let mut rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 8).wr_id(5)]).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, b"").wr_id(3)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 5, T).unwrap();
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    assert!(d.is_empty() && d.payload() == (GRH_LEN..GRH_LEN), "{:?}", d.payload());
    assert_eq!(d.src_qp(), client.qp().qp_num());
    drop((client, server, to_server, to_client, rbuf, pd));
    t.finish();
}

/// A forged GRH (what a hostile peer controls: every byte of the header area as the provider
/// hands it up) fed to the reply helpers: random bytes, IPv4 headers naming the unspecified,
/// broadcast, multicast and loopback addresses as the sender. Never a panic; either a clear
/// error naming the verb, or a handle for exactly the address the header claims.
#[test]
fn forged_grh_gives_an_error_or_the_claimed_address_never_a_panic() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7406, QpInit::new());
    let spd = Arc::clone(server.qp().pd());
    let mut rbuf = MemoryRegion::new(&spd, GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, b"hi").wr_id(2)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    let real = *Datagram::parse(&wc, &mut rbuf, 0).unwrap().grh().unwrap();
    let mut forged: Vec<[u8; GRH_LEN]> = (0u8..32).map(|s| pattern(GRH_LEN, s).try_into().unwrap()).collect();
    for src in [[0, 0, 0, 0], [255, 255, 255, 255], [239, 1, 1, 1], [127, 0, 0, 1], [10, 77, 0, 99]] {
        let mut b = *real.as_bytes();
        b[32..36].copy_from_slice(&src);
        forged.push(b);
    }
    forged.push([0xff; GRH_LEN]);
    let (mut ok, mut refused) = (0, 0);
    for b in forged {
        let g = Grh::from_bytes(b);
        let _ = (g.is_ipv4(), g.is_ipv6(), g.sgid(), g.dgid(), g.src_ip(), format!("{g:?}"));
        match AddressHandle::reply_to(&spd, server.qp().port_num(), &wc, &g) {
            Ok(ah) => {
                ok += 1;
                if let Some(sgid) = g.sgid() {
                    assert_eq!(ah.attr().dgid(), sgid, "the handle answers the claimed sender");
                }
            }
            Err(Error::Call { op, .. }) => {
                refused += 1;
                assert!(op.starts_with("ibv_"), "{op}");
            }
            Err(e) => panic!("unexpected error kind for a forged GRH: {e}"),
        }
    }
    eprintln!("measured: forged GRHs: {ok} gave a handle, {refused} refused");
    drop((client, server, to_server, to_client, rbuf, spd));
    t.finish();
}

/// A peer's datagram longer than the posted receive. Measured on rxe (6.1): the receive fails
/// (`LOC_QP_OP_ERR`) and the UD QP goes to the error state, so one hostile datagram stops it
/// receiving; before the fix, the next receive was accepted and never completed (its wait
/// timed out blaming the peer). Now the QP refuses posts with an error that names the cause
/// and `UdQp::recv_len`, and holds nothing. On rxe 6.12 (as on hardware) the datagram is
/// dropped instead and the QP lives on: a datagram that fits, sent after it, then completes
/// the receive, and the QP still takes receives. Then, on the healthy QP: gathered sends
/// naming a region of another PD, and a batch of receives whose second has no room for the
/// GRH, are refused whole.
#[test]
fn a_too_long_datagram_stops_the_qp_and_posts_then_say_why() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7410, QpInit::new());
    let spd = Arc::clone(server.qp().pd());
    let small = MemoryRegion::new(&spd, GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    let mut ok = MemoryRegion::new(&spd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&small, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[1; 64]).wr_id(2)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[2; 8]).wr_id(4)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 4, T).unwrap();
    match server.qp_mut().wait_for(WorkQueue::Recv, 1, T) {
        Err(e) => {
            assert!(matches!(e, Error::WorkCompletion { wr_id: 1, .. }), "{e}");
            let state = server.qp().qp().attributes().unwrap().state;
            eprintln!("measured: the UD QP after a too-long datagram: {state:?}");
            assert_eq!(state, rdma_cm::QpState::Error, "if the QP survives, the refusal below is too strict");
            let e = server.qp_mut().post_recv(&[RecvWr::new(&ok, 0..GRH_LEN + 64).wr_id(3)]).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("recv_len"), "{e}");
            assert!(ok.outstanding() == 0 && server.qp().outstanding_recvs() == 0);
            assert!(ok.as_mut_slice().is_ok());
        }
        Ok(wc) => {
            // Dropped: the receive took the datagram that fits, and the QP lives on.
            assert_eq!(wc.byte_len() as usize, GRH_LEN + 8, "the datagram after the dropped one");
            let state = server.qp().qp().attributes().unwrap().state;
            eprintln!("measured: the too-long datagram was dropped; the UD QP is {state:?}");
            assert_eq!(state, rdma_cm::QpState::ReadyToSend);
            server.qp_mut().post_recv(&[RecvWr::new(&ok, 0..GRH_LEN + 64).wr_id(3)]).unwrap();
            assert_eq!((ok.outstanding(), server.qp().outstanding_recvs()), (1, 1));
            // The receive is reaped by the QP's drop below (its flush); the region goes with it.
        }
    }
    // Gathered sends naming a region of another PD are refused before posting.
    let other = ProtectionDomain::new(client.qp().pd().context()).unwrap();
    let a = MemoryRegion::new(client.qp().pd(), 8, AccessFlags::LOCAL_WRITE).unwrap();
    let b = MemoryRegion::new(&other, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let pieces = [(&a, 0..8), (&b, 0..8)];
    let r = UdSendWr::send_sg(&to_server, &pieces).and_then(|w| client.qp_mut().post_send(&[w]));
    assert!(r.is_err(), "a piece on another PD was posted");
    assert!(a.outstanding() == 0 && b.outstanding() == 0 && client.qp().outstanding_sends() == 0);
    // A batch of receives whose second has no room for the GRH: none is posted.
    let c = MemoryRegion::new(client.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    let e = client
        .qp_mut()
        .post_recv(&[RecvWr::new(&c, 0..GRH_LEN + 8).wr_id(5), RecvWr::new(&a, 0..8).wr_id(6)])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("GRH"), "{e}");
    assert!(c.outstanding() == 0 && a.outstanding() == 0 && client.qp().outstanding_recvs() == 0);
    // The healthy QP still sends.
    client.qp_mut().post_send(&[UdSendWr::send_sg(&to_server, &pieces[..1]).unwrap().wr_id(7)]).unwrap();
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 7, T).unwrap().is_ok());
    drop((client, server, to_server, to_client, small, ok, a, b, c, other, spd));
    t.finish();
}

/// A datagram gathered from three pieces of two regions (the first region named twice) on a
/// UD QP, to a destination whose caller drops it at once: the address handle and both regions
/// are held until the send's completion (one hold each), the sources stay readable and not
/// writable meanwhile, and the peer receives the pieces' bytes in order after the GRH.
#[test]
fn a_gathered_datagram_holds_its_regions_once_and_its_address_handle_until_the_completion() {
    use rdma_cm::{Datagram, UdDest, UdSendWr, GRH_LEN};
    let t = DeviceTest::start();
    let crate::common::ud::UdPair { mut client, to_server, mut server, to_client } =
        crate::common::ud::ud_pair(t.addr, 7461, QpInit::new().max_send_sge(3));
    let mut rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 64, LW).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 64).wr_id(3)]).unwrap();
    let mut a = MemoryRegion::new(client.qp().pd(), 64, LW).unwrap();
    let mut b = MemoryRegion::new(client.qp().pd(), 64, LW).unwrap();
    a.as_mut_slice().unwrap().copy_from_slice(&pattern(64, 5));
    b.as_mut_slice().unwrap().copy_from_slice(&pattern(64, 6));
    let ah = std::sync::Arc::clone(to_server.ah());
    let handles = std::sync::Arc::strong_count(&ah);
    {
        let dest = UdDest::new(std::sync::Arc::clone(&ah), to_server.qpn(), to_server.qkey());
        let pieces = [(&a, 0..16), (&b, 16..32), (&a, 48..64)];
        client.qp_mut().post_send(&[UdSendWr::send_sg(&dest, &pieces).unwrap().wr_id(9)]).unwrap();
        // `dest` goes here, with the caller's handle of it.
    }
    assert_eq!(std::sync::Arc::strong_count(&ah), handles + 1, "the posted datagram holds its address handle");
    assert_eq!((a.outstanding(), b.outstanding()), (1, 1), "one hold per region");
    for (m, what) in [(&mut a, "region a, two pieces"), (&mut b, "region b")] {
        assert!(m.as_slice().is_ok(), "{what}: a send's source may be read");
        assert!(matches!(m.as_mut_slice(), Err(Error::InFlight { .. })), "{what}: but not written");
    }
    let wc = client.qp_mut().wait_for(WorkQueue::Send, 9, T).unwrap();
    assert!(wc.is_ok(), "{wc:?}");
    assert_eq!(std::sync::Arc::strong_count(&ah), handles, "released with the completion");
    assert_eq!((a.outstanding(), b.outstanding()), (0, 0));
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 3, T).unwrap();
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    let (sa, sb) = (a.as_slice().unwrap().to_vec(), b.as_slice().unwrap().to_vec());
    let want: Vec<u8> = [&sa[..16], &sb[16..32], &sa[48..]].concat();
    assert_eq!(&rbuf.as_slice().unwrap()[d.payload()], &want[..], "the three pieces, in order");
    assert!(a.as_mut_slice().is_ok() && b.as_mut_slice().is_ok());
    drop((client, server, to_server, to_client, ah, a, b, rbuf));
    t.finish();
}

/// Dropping every handle the caller has of an address handle while a send uses it: the QP's
/// send slot keeps it alive until the completion is reaped, then it goes.
#[test]
fn an_address_handle_dropped_while_a_send_is_posted_lives_until_the_completion() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7311, QpInit::new());
    let pd = Arc::clone(client.qp().pd());
    let mut rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 256, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 256).wr_id(1)]).unwrap();
    let mut sbuf = MemoryRegion::new(&pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
    let msg = pattern(256, 9);
    sbuf.as_mut_slice().unwrap().copy_from_slice(&msg);
    // A fresh AH of our own for the server, so the pair's does not keep it alive.
    let ah = AddressHandle::new(&pd, to_server.ah().attr()).unwrap();
    let weak = Arc::downgrade(&ah);
    let dest = rdma_cm::UdDest::new(ah, to_server.qpn(), to_server.qkey());
    client.qp_mut().post_send(&[UdSendWr::send(&dest, &sbuf, 0..256).wr_id(2)]).unwrap();
    drop(dest);
    assert!(weak.upgrade().is_some(), "the posted send must hold the address handle");
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    assert!(weak.upgrade().is_none(), "reaping the completion releases it");
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    assert_eq!(&rbuf.as_slice().unwrap()[d.payload()], &msg[..]);
    drop((client, server, to_server, to_client, sbuf, rbuf, pd));
    t.finish();
}

/// Unsignaled sends hold their address handles too, until a later signaled completion retires
/// them.
#[test]
fn unsignaled_sends_hold_their_address_handles_until_retired() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let UdPair { mut client, to_server, server, to_client } = ud_pair(t.addr, 7312, QpInit::new());
    let pd = Arc::clone(client.qp().pd());
    let mut weaks = vec![];
    for k in 0..3 {
        let ah = AddressHandle::new(&pd, to_server.ah().attr()).unwrap();
        weaks.push(Arc::downgrade(&ah));
        let dest = rdma_cm::UdDest::new(ah, to_server.qpn(), to_server.qkey());
        let wr = UdSendWr::send_inline(&dest, b"x").wr_id(k);
        client.qp_mut().post_send(&[if k < 2 { wr.unsignaled() } else { wr }]).unwrap();
    }
    assert!(weaks.iter().all(|w| w.upgrade().is_some()), "every posted send holds its AH");
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    assert!(weaks.iter().all(|w| w.upgrade().is_none()), "the signaled completion retires all three");
    drop((client, server, to_server, to_client, pd));
    t.finish();
}

/// A region dropped while a send from it is posted stays registered until the completion, and
/// the receiver gets its bytes; a posted receive's region is out of reach until reaped.
#[test]
fn regions_of_posted_datagrams_are_held_and_out_of_reach() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7315, QpInit::new());
    let mut rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 512, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 512).wr_id(1)]).unwrap();
    assert!(matches!(rbuf.as_slice(), Err(Error::InFlight { .. })), "a posted receive's buffer is unreadable");
    assert!(matches!(Datagram::parse(&WorkCompletion::default(), &mut rbuf, 0), Err(Error::InvalidArgument(_))));
    let msg = pattern(512, 3);
    let before = crate::common::mr_count();
    {
        let mut sbuf = MemoryRegion::new(client.qp().pd(), 512, AccessFlags::LOCAL_WRITE).unwrap();
        sbuf.as_mut_slice().unwrap().copy_from_slice(&msg);
        client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..512).wr_id(2)]).unwrap();
    } // the caller's handle is gone
    if let (Some(b), Some(now)) = (before, crate::common::mr_count()) {
        assert_eq!(now, b + 1, "the dropped region stays registered while the send is posted");
    }
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    if let (Some(b), Some(now)) = (before, crate::common::mr_count()) {
        assert_eq!(now, b, "reaping the completion deregisters it");
    }
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    assert_eq!(&rbuf.as_slice().unwrap()[d.payload()], &msg[..]);
    drop((client, server, to_server, to_client, rbuf));
    t.finish();
}

/// Completions that are not what the helpers need: a send's, a receive read against a
/// region too small for it or at an offset past it, and an address handle asked to answer a
/// send's completion or a datagram without a usable GRH. Each is a clear error, never a
/// panic or an out-of-bounds read.
#[test]
fn forged_or_mismatched_completions_are_refused() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7316, QpInit::new());
    let spd = Arc::clone(server.qp().pd());
    let mut rbuf = MemoryRegion::new(&spd, GRH_LEN + 100, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 100).wr_id(1)]).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[7; 60]).wr_id(2)]).unwrap();
    let send_wc = client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    assert_eq!(wc.byte_len() as usize, GRH_LEN + 60, "byte_len counts the GRH area");
    // A send's completion is no datagram.
    assert!(matches!(Datagram::parse(&send_wc, &mut rbuf, 0), Err(Error::InvalidArgument(_))));
    // The receive against a region that cannot hold it, or past its end.
    let mut small = MemoryRegion::new(&spd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(matches!(Datagram::parse(&wc, &mut small, 0), Err(Error::OutOfBounds { .. })));
    assert!(matches!(Datagram::parse(&wc, &mut rbuf, usize::MAX - 10), Err(Error::OutOfBounds { .. })));
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    assert_eq!(d.len(), 60);
    // An address handle answers receives only; a zeroed GRH names no sender.
    let grh = *d.grh().unwrap();
    assert!(matches!(
        AddressHandle::reply_to(&spd, server.qp().port_num(), &send_wc, &grh),
        Err(Error::InvalidArgument(_))
    ));
    let r = AddressHandle::reply_to(&spd, server.qp().port_num(), &wc, &Grh::from_bytes([0; GRH_LEN]));
    assert!(r.is_err(), "an all-zero GRH gives no address: {r:?}");
    // A port that does not exist.
    assert!(AddressHandle::reply_to(&spd, 9, &wc, &grh).is_err());
    drop((client, server, to_server, to_client, rbuf, small, spd));
    t.finish();
}
