//! Attempts to break the UD data path with safe code, each kept as a test: dropping the
//! address handle or the region while a send is posted, dropping or forgetting the QP with
//! work in flight, reading a receive buffer the device may still write, and feeding the
//! datagram and reply helpers completions that are not what they claim.

mod common;

use std::sync::Arc;

use common::ud::{ud_pair, UdPair};
use common::{pattern, require, Cap, DeviceTest, T};
use rdma_cm::{
    AccessFlags, AddressHandle, Datagram, Error, Grh, MemoryRegion, QpInit, RecvWr, UdSendWr, WorkCompletion,
    WorkQueue, GRH_LEN,
};

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

/// Dropping the QP with sends posted releases their address handles only after the QP is
/// destroyed; forgetting it leaks them (safe): the handle outlives the unreleased QP.
#[test]
fn dropping_or_forgetting_the_qp_with_sends_posted() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    for forget in [false, true] {
        let UdPair { mut client, to_server, server, to_client } = ud_pair(t.addr, 7313 + forget as u16, QpInit::new());
        let ah = AddressHandle::new(client.qp().pd(), to_server.ah().attr()).unwrap();
        let weak = Arc::downgrade(&ah);
        let dest = rdma_cm::UdDest::new(ah, to_server.qpn(), to_server.qkey());
        let sbuf = MemoryRegion::new(client.qp().pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
        client.qp_mut().post_send(&[UdSendWr::send(&dest, &sbuf, 0..64).wr_id(1)]).unwrap();
        drop((dest, sbuf));
        if forget {
            // What mem::forget does, undone at the end so later tests start clean.
            let kept = std::mem::ManuallyDrop::new(client);
            assert!(weak.upgrade().is_some(), "a forgotten QP leaks its address handles");
            drop(std::mem::ManuallyDrop::into_inner(kept));
            assert!(weak.upgrade().is_none());
        } else {
            drop(client);
            assert!(weak.upgrade().is_none(), "dropping the QP releases them after destroying it");
        }
        drop((server, to_server, to_client));
    }
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
    let before = common::mr_count();
    {
        let mut sbuf = MemoryRegion::new(client.qp().pd(), 512, AccessFlags::LOCAL_WRITE).unwrap();
        sbuf.as_mut_slice().unwrap().copy_from_slice(&msg);
        client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..512).wr_id(2)]).unwrap();
    } // the caller's handle is gone
    if let (Some(b), Some(now)) = (before, common::mr_count()) {
        assert_eq!(now, b + 1, "the dropped region stays registered while the send is posted");
    }
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    if let (Some(b), Some(now)) = (before, common::mr_count()) {
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
