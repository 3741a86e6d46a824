//! Multicast: sends after leave, and memberships and endpoints dropped or forgotten in any order.

use crate::common::{DeviceTest, T};
use rdma_cm::{
    AccessFlags, Datagram, Error, JoinKind, McastClient, McastEndpoint, MemoryRegion, QpInit, RecvWr, UdSendWr,
    WorkQueue, GRH_LEN,
};
use std::sync::Arc;

/// A multicast endpoint bound to the device, loopback on.
fn mcast_endpoint(src: std::net::IpAddr, g: std::net::IpAddr) -> McastEndpoint {
    let r = McastClient::new().unwrap().resolve(Some(src), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    r.create_qp(&pd, QpInit::new().max_send_wr(8).max_recv_wr(8)).unwrap()
}

/// A send to the group after leaving it, through a clone of the membership's destination: the
/// handle lives in the send's slot until its completion, the send completes, and nothing is
/// left behind. The clone is refused by another endpoint (another PD).
#[test]
fn a_multicast_send_after_leave_and_on_another_endpoint() {
    let t = DeviceTest::start();
    let g: std::net::IpAddr = "239.1.4.1".parse().unwrap();
    let mut ep = mcast_endpoint(t.addr, g);
    let mut other = mcast_endpoint(t.addr, g);
    let m = ep.join(JoinKind::FullMember, T).unwrap();
    let dest = m.dest().clone();
    m.leave().unwrap();
    let weak = Arc::downgrade(dest.ah());
    ep.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"after leave").wr_id(1)]).unwrap();
    let e = other.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"x").wr_id(2)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(other.qp().outstanding_sends(), 0);
    drop(dest);
    assert!(weak.upgrade().is_some(), "the posted send holds the group's handle");
    assert!(ep.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap().is_ok());
    assert!(weak.upgrade().is_none());
    drop((ep, other));
    t.finish();
}

/// Every drop order of endpoint and membership, a membership forgotten (its leave never runs),
/// and the same group joined twice on one endpoint: the QP is always destroyed when the
/// endpoint goes (the kernel refuses while it is attached: that would leak it), nothing hangs,
/// and a fresh member receives through the group afterwards.
#[test]
fn memberships_and_endpoints_dropped_in_any_order_or_forgotten() {
    let t = DeviceTest::start();
    let g: std::net::IpAddr = "239.1.4.2".parse().unwrap();
    let qps = || crate::common::resources().into_iter().find(|(k, _)| *k == "qp").unwrap().1;
    let base = qps();
    // Endpoint first, membership after.
    let mut ep = mcast_endpoint(t.addr, g);
    let m = ep.join(JoinKind::FullMember, T).unwrap();
    drop(ep);
    assert_eq!(qps(), base, "the endpoint's QP is destroyed while its membership lives");
    drop(m);
    // Membership forgotten (ManuallyDrop, undone at the end).
    let mut ep = mcast_endpoint(t.addr, g);
    let kept = std::mem::ManuallyDrop::new(ep.join(JoinKind::FullMember, T).unwrap());
    drop(ep);
    assert_eq!(qps(), base, "a forgotten membership does not keep the QP attached");
    // Joined twice on one endpoint.
    let mut ep = mcast_endpoint(t.addr, g);
    let m1 = ep.join(JoinKind::FullMember, T).unwrap();
    let second = ep.join(JoinKind::FullMember, T);
    // A second join on one id would share the first's attachment, and one leave would end both
    // (librdmacm leaves the first it finds): refused, naming the group.
    let err = second.as_ref().expect_err("a second join of a group on one endpoint is refused").to_string();
    assert!(err.contains("239.1.4.2") && err.contains("already holds a membership"), "{err}");
    drop(m1);
    // Once the first membership has left, the group can be joined again.
    let again = ep.join(JoinKind::FullMember, T).expect("the group is joined again after the leave");
    drop(again);
    drop(ep);
    assert_eq!(qps(), base, "the twice-joined endpoint's QP is destroyed");
    drop(second);
    drop(std::mem::ManuallyDrop::into_inner(kept));
    // A fresh member still receives through the group.
    let mut rx = mcast_endpoint(t.addr, g);
    let mut rbuf = MemoryRegion::new(rx.qp().pd(), GRH_LEN + 16, AccessFlags::LOCAL_WRITE).unwrap();
    rx.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 16).wr_id(1)]).unwrap();
    let m = rx.join(JoinKind::FullMember, T).unwrap();
    let dest = m.dest().clone();
    rx.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"still works").wr_id(2)]).unwrap();
    rx.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    let wc = rx.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    assert_eq!(&rbuf.as_slice().unwrap()[d.payload()], b"still works");
    drop((dest, m, rx, rbuf));
    t.finish();
}
