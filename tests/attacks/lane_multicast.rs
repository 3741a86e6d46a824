//! Multicast on the lane: a send after leaving, through a cloned destination; and multicast
//! endpoints with work posted, removed from their lane or dropped with it, under a membership
//! that lives on or is forgotten.

use std::mem::ManuallyDrop;
use std::net::IpAddr;
use std::sync::Arc;

use crate::common::lane::reap;
use crate::common::{require, resources, Cap, DeviceTest, T};
use rdma_cm::cm::multicast::{JoinKind, McastClient, Multicast};
use rdma_cm::status::WorkQueue;
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{Completion, InlineWr, Lane, LaneQp, RecvWr};
use rdma_cm::{AccessFlags, Error, MemoryRegion, ProtectionDomain, QpInit};

/// A multicast endpoint bound (through `src`) to the device, its QP made with a new lane's CQ
/// and attached to it; loopback on.
fn endpoint(src: IpAddr, g: IpAddr) -> (Lane, LaneQp, Arc<ProtectionDomain>) {
    let r = McastClient::new().unwrap().resolve(Some(src), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    let mut lane = Lane::new(&r.context().unwrap(), 64).unwrap();
    let ep = r.create_qp(&pd, lane.qp_init_from(QpInit::new().max_send_wr(8).max_recv_wr(8))).unwrap();
    let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("a multicast endpoint joins a lane");
    (lane, qp, pd)
}

/// Posts a receive of `len` bytes after the GRH on `qp`.
fn post_recv(lane: &mut Lane, qp: LaneQp, pd: &Arc<ProtectionDomain>, len: usize, wr_id: u64) {
    let buf = MemoryRegion::new(pd, GRH_LEN + len, AccessFlags::LOCAL_WRITE).unwrap();
    lane.post_recv(qp, RecvWr::new(buf).wr_id(wr_id)).expect("post_recv");
}

/// Reaps `lane` until the completion of `queue` with `wr_id` (within `T` each); the others met
/// on the way are dropped (callers expect none they care about).
fn reap_until(lane: &mut Lane, queue: WorkQueue, wr_id: u64) -> Completion {
    loop {
        let c = reap(lane, 1).pop().unwrap();
        if c.queue() == queue && c.wr_id() == wr_id {
            return c;
        }
    }
}

/// The payload of a received datagram.
fn payload(mut c: Completion) -> Vec<u8> {
    assert!(c.is_ok(), "{c:?}");
    let mut buf = c.take_region().expect("the receive's region back");
    buf.as_slice().unwrap()[GRH_LEN..c.byte_len() as usize].to_vec()
}

/// User-space QPs the kernel tracks.
fn qps() -> usize {
    resources().into_iter().find(|(k, _)| *k == "qp").map_or(0, |(_, n)| n)
}

/// A send to the group after leaving it, through a clone of the membership's destination
/// registered again with the lane: the send completes and another member receives it (the
/// group's address handle is the lane's to keep, not the membership's). The same clone is
/// refused by another endpoint's lane (another protection domain), which holds nothing
/// after. The handle goes when the sender's QP leaves its lane.
#[test]
fn a_send_after_leave_through_a_cloned_destination_and_on_another_endpoint() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    {
        let g: IpAddr = "239.1.5.1".parse().unwrap();
        let (mut la, qa, _pa) = endpoint(t.addr, g);
        let (mut lb, qb, pb) = endpoint(t.addr, g);
        post_recv(&mut lb, qb, &pb, 64, 1);
        let (mb, _) = Multicast::join_on(&mut lb, qb, g, JoinKind::FullMember, T).unwrap();
        let (m, _) = Multicast::join_on(&mut la, qa, g, JoinKind::SendOnlyFullMember, T).unwrap();
        let dest = m.dest().clone();
        m.leave().unwrap();
        let weak = Arc::downgrade(dest.ah());
        let again = la.add_dest(qa, &dest).expect("the clone registers after the leave");
        let e = lb.add_dest(qb, &dest).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "another endpoint's PD: {e}");
        drop(dest);
        assert!(weak.upgrade().is_some(), "the lane keeps the group's handle");
        la.post_inline(qa, InlineWr::send(b"after leave").to(again).wr_id(2)).unwrap();
        let sent = reap_until(&mut la, WorkQueue::Send, 2);
        assert!(sent.is_ok(), "{sent:?}");
        assert_eq!(payload(reap_until(&mut lb, WorkQueue::Recv, 1)), b"after leave", "B is a member: it receives");
        assert_eq!(lb.outstanding(qb).unwrap(), (0, 0), "the refused destination left nothing in B's lane");
        la.remove(qa).unwrap();
        assert!(weak.upgrade().is_none(), "the handle goes with the sender's QP");
        drop((la, lb, mb, sent));
    }
    t.finish();
}

/// Multicast endpoints with work posted (a receive, and a send to the group), each joined to
/// the group: one removed from its lane while its membership lives, one whose lane is dropped
/// while its membership is forgotten (its leave never runs until the end). Each QP is
/// destroyed at once (the kernel refuses to destroy a QP still attached to a group: that would
/// leak it), nothing hangs, and a fresh member still receives through the group afterwards.
#[test]
fn multicast_endpoints_with_posted_work_go_under_a_living_or_forgotten_membership() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    {
        let g: IpAddr = "239.1.5.2".parse().unwrap();
        let base = qps();
        // Removed from its lane while the membership lives.
        let (mut lane, qp, pd) = endpoint(t.addr, g);
        post_recv(&mut lane, qp, &pd, 64, 1);
        let (m, to) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
        lane.post_inline(qp, InlineWr::send(b"in flight").to(to).wr_id(2)).unwrap();
        lane.remove(qp).unwrap();
        assert_eq!(qps(), base, "the endpoint's QP is destroyed while its membership lives");
        drop(m);
        // The removal reaped the QP's own work: nothing of it is handed out later.
        assert!(lane.poll().unwrap().is_none(), "a removed QP's completion came out of its lane");
        drop((lane, pd));
        // Its lane dropped while the membership is forgotten.
        let (mut lane, qp, pd) = endpoint(t.addr, g);
        post_recv(&mut lane, qp, &pd, 64, 1);
        let (m, to) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
        let kept = ManuallyDrop::new(m);
        lane.post_inline(qp, InlineWr::send(b"in flight").to(to).wr_id(2)).unwrap();
        drop(lane);
        assert_eq!(qps(), base, "a forgotten membership does not keep the QP attached");
        drop(ManuallyDrop::into_inner(kept));
        drop(pd);
        // A fresh member still receives through the group.
        let (mut lane, qp, pd) = endpoint(t.addr, g);
        post_recv(&mut lane, qp, &pd, 16, 1);
        let (m, to) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
        lane.post_inline(qp, InlineWr::send(b"still works").to(to).wr_id(2)).unwrap();
        let mut two = reap(&mut lane, 2);
        two.sort_by_key(|c| c.queue() == WorkQueue::Send);
        let (recv, sent) = (two.remove(0), two.remove(0));
        assert!(sent.is_ok() && sent.wr_id() == 2, "{sent:?}");
        assert_eq!(recv.wr_id(), 1);
        assert_eq!(payload(recv), b"still works", "loopback: the sender is a member too");
        drop((m, lane, pd, sent));
        assert_eq!(qps(), base);
    }
    t.finish();
}
