//! Multicast on the lane: a `McastEndpoint` attached to a lane, its groups joined with
//! `Multicast::join_on` (which registers the group's destination with the lane), datagrams
//! sent to the group and received through the lanes with every byte checked, loopback, a
//! send-only member that receives nothing, and leaving the group in either order with the
//! lane's teardown (the kernel's IGMP membership shows it). What `multicast.rs` proves of the
//! convenient path, on the lane.

mod common;

use std::net::IpAddr;
use std::process::Command;

use common::lane::reap;
use common::{pattern, require, Cap, DeviceTest, T};
use rdma_cm::verbs::lane::{Completion, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::{
    AccessFlags, Datagram, Error, JoinKind, McastClient, MemoryRegion, Multicast, ProtectionDomain, QpInit, WorkQueue,
    GRH_LEN, MULTICAST_QPN, RDMA_UDP_QKEY,
};
use std::sync::Arc;

fn group(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A multicast endpoint bound (through `src`) to the device, its QP made with a new lane's CQ
/// and attached to it.
fn endpoint(src: IpAddr, g: IpAddr) -> (Lane, LaneQp, Arc<ProtectionDomain>) {
    let r = McastClient::new().unwrap().resolve(Some(src), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    let mut lane = Lane::new(&r.context().unwrap(), 64).unwrap();
    let ep = r.create_qp(&pd, lane.qp_init_from(QpInit::new().max_send_wr(8).max_recv_wr(8))).unwrap();
    let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("a multicast endpoint joins a lane");
    (lane, qp, pd)
}

/// Whether the kernel holds an IGMP membership of `g` on some netdev (`ip maddr`).
fn igmp_member(g: IpAddr) -> bool {
    let out = Command::new("ip").args(["maddr", "show"]).output().expect("run `ip maddr show`");
    assert!(out.status.success());
    let g = g.to_string();
    String::from_utf8_lossy(&out.stdout).lines().any(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.len() >= 2 && w[0] == "inet" && w[1] == g
    })
}

/// Reaps `lane` until the completion of `queue` with `wr_id` comes (within `T` each): it, and
/// the others met on the way.
fn reap_until(lane: &mut Lane, queue: WorkQueue, wr_id: u64) -> (Completion, Vec<Completion>) {
    let mut others = Vec::new();
    loop {
        let c = reap(lane, 1).pop().unwrap();
        if c.queue() == queue && c.wr_id() == wr_id {
            return (c, others);
        }
        others.push(c);
    }
}

/// Posts a receive of a new region of `len` bytes plus the GRH on `qp`.
fn post_recv(lane: &mut Lane, qp: LaneQp, pd: &Arc<ProtectionDomain>, len: usize, wr_id: u64) {
    let buf = MemoryRegion::new(pd, GRH_LEN + len, AccessFlags::LOCAL_WRITE).unwrap();
    lane.post_recv(qp, RecvWr::new(buf).wr_id(wr_id)).expect("post_recv");
}

/// A receive's datagram: its completion parsed, and the payload's bytes.
fn datagram(mut c: Completion) -> (Datagram, Vec<u8>) {
    assert!(c.is_ok(), "{c:?}");
    let wc = c.work_completion();
    let mut buf = c.take_region().expect("the receive's region back");
    let d = Datagram::parse(&wc, &mut buf, 0).unwrap();
    let bytes = buf.as_slice().unwrap()[d.payload()].to_vec();
    (d, bytes)
}

#[test]
fn lane_multicast_two_members_exchange_datagrams_every_byte_checked() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    {
        let g = group("239.1.3.1");
        let (size, count) = (700usize, 4u64);
        let (mut rl, rq, rpd) = endpoint(t.addr, g);
        let (mut tl, tq, tpd) = endpoint(t.addr, g);
        for i in 0..count {
            post_recv(&mut rl, rq, &rpd, size, i);
        }
        // The sender is a full member too: with loopback on, its own QP gets what it sends.
        post_recv(&mut tl, tq, &tpd, size, 99);
        let (rm, _) = Multicast::join_on(&mut rl, rq, g, JoinKind::FullMember, T).unwrap();
        let (tm, to_group) = Multicast::join_on(&mut tl, tq, g, JoinKind::FullMember, T).unwrap();
        assert!(igmp_member(g), "a full member's join adds the kernel's IGMP membership");
        for m in [&rm, &tm] {
            assert_eq!(m.group(), g);
            assert_eq!(m.kind(), JoinKind::FullMember);
            assert_eq!(m.dest().qpn(), MULTICAST_QPN, "the group is addressed as QPN 0xFFFFFF");
            assert_eq!(m.qkey(), RDMA_UDP_QKEY, "the join's QKey is the UDP port space's");
            assert_eq!(m.mgid().ipv4(), Some("239.1.3.1".parse().unwrap()), "the MGID is the IPv4-mapped group");
        }
        let qpn = tl.qp_num(tq).unwrap();
        let mut out = Some(MemoryRegion::new(&tpd, size, AccessFlags::LOCAL_WRITE).unwrap());
        for i in 0..count {
            let msg = pattern(size - i as usize, i as u8 + 1);
            let mut buf = out.take().unwrap();
            buf.write_at(0, &msg).unwrap();
            let w = SendWr::send(buf, 0..msg.len()).imm(qpn).to(to_group).wr_id(i);
            tl.post_send(tq, w).expect("a send to the group");
            let (mut sent, mut met) = reap_until(&mut tl, WorkQueue::Send, i);
            assert!(sent.is_ok(), "{sent:?}");
            out = sent.take_region();
            let (c, _) = reap_until(&mut rl, WorkQueue::Recv, i);
            let (d, bytes) = datagram(c);
            assert_eq!(d.payload(), GRH_LEN..GRH_LEN + msg.len());
            assert_eq!(d.src_qp(), qpn, "the datagram names its sender's QP");
            assert_eq!(d.imm_data(), Some(qpn));
            assert_eq!(d.src_ip(), Some(t.addr), "the sender's address, from the GRH");
            assert_eq!(
                d.grh().unwrap().dgid().unwrap().ipv4(),
                Some("239.1.3.1".parse().unwrap()),
                "sent to the group"
            );
            assert_eq!(bytes, msg, "datagram {i} differs");
            if i == 0 {
                // Loopback on: the sender's own QP received its first datagram too.
                let own = match met.pop() {
                    Some(c) => c,
                    None => reap_until(&mut tl, WorkQueue::Recv, 99).0,
                };
                assert_eq!((own.queue(), own.wr_id()), (WorkQueue::Recv, 99));
                let (d, bytes) = datagram(own);
                assert_eq!(d.src_qp(), qpn);
                assert_eq!(bytes, msg);
            }
            assert!(met.is_empty(), "nothing else on the sender's lane: {met:?}");
        }
        assert_eq!(rl.outstanding(rq).unwrap(), (0, 0), "every receive retired");
        drop((rm, tm));
        assert!(!igmp_member(g), "dropping both memberships left the group");
        drop((rl, tl, out));
    }
    t.finish();
}

#[test]
fn lane_multicast_a_send_only_member_sends_but_receives_nothing() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    {
        let g = group("239.1.3.2");
        let (mut rl, rq, rpd) = endpoint(t.addr, g);
        let (mut sl, sq, spd) = endpoint(t.addr, g);
        for i in 0..2 {
            post_recv(&mut rl, rq, &rpd, 64, i);
        }
        post_recv(&mut sl, sq, &spd, 64, 7);
        let (sm, to_group) = Multicast::join_on(&mut sl, sq, g, JoinKind::SendOnlyFullMember, T).unwrap();
        assert_eq!(sm.kind(), JoinKind::SendOnlyFullMember);
        assert!(!igmp_member(g), "a send-only join sends no IGMP report");
        let (rm, rx_to_group) = Multicast::join_on(&mut rl, rq, g, JoinKind::FullMember, T).unwrap();
        let mut out = MemoryRegion::new(&spd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        out.write_at(0, &pattern(64, 9)).unwrap();
        sl.post_send(sq, SendWr::send(out, 0..64).to(to_group).wr_id(1)).unwrap();
        let (sent, _) = reap_until(&mut sl, WorkQueue::Send, 1);
        assert!(sent.is_ok(), "{sent:?}");
        let (d, bytes) = datagram(reap_until(&mut rl, WorkQueue::Recv, 0).0);
        assert_eq!(d.src_qp(), sl.qp_num(sq).unwrap());
        assert_eq!(bytes, pattern(64, 9), "the send-only member's datagram");
        // The full member sends too, and gets its own datagram back (loopback): by then the
        // group's datagrams have reached every attached QP, and the send-only member is not one.
        let out2 = MemoryRegion::new(&rpd, 8, AccessFlags::LOCAL_WRITE).unwrap();
        rl.post_send(rq, SendWr::send(out2, 0..8).to(rx_to_group).wr_id(2)).unwrap();
        let (own, met) = reap_until(&mut rl, WorkQueue::Recv, 1);
        assert!(own.is_ok());
        if met.is_empty() {
            assert!(reap_until(&mut rl, WorkQueue::Send, 2).0.is_ok());
        }
        assert!(sl.poll().unwrap().is_none(), "the send-only member received");
        assert_eq!(sl.outstanding(sq).unwrap(), (0, 1), "its receive is still posted");
        drop((sm, rm, rl, sl, sent));
    }
    t.finish();
}

#[test]
fn lane_multicast_leaves_the_group_in_either_order_with_the_lane() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let g = group("239.1.3.3");
    // Membership first, then the lane (and its endpoint).
    let (mut lane, qp, pd) = endpoint(t.addr, g);
    let (m, _) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
    assert!(igmp_member(g));
    drop(m);
    assert!(!igmp_member(g), "the membership's drop left the group (rdma_leave_multicast)");
    // The same endpoint joins again after leaving, and leaves explicitly.
    let (m, _) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
    assert!(igmp_member(g), "a re-join after the leave joins again");
    m.leave().unwrap();
    assert!(!igmp_member(g));
    // A second membership of the same group on one endpoint is refused (one leave would end
    // both).
    let (m, _) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
    let e = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap_err();
    assert!(e.to_string().contains("already holds a membership"), "{e}");
    // The endpoint removed from the lane (its QP detached and destroyed) with the membership
    // alive: still joined until the membership goes.
    lane.remove(qp).unwrap();
    assert!(igmp_member(g), "the membership holds the id: still joined");
    let e = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap_err();
    assert!(e.to_string().contains("not attached to this lane"), "{e}");
    drop(m);
    assert!(!igmp_member(g), "the membership's drop after the endpoint's left the group");
    drop(lane);
    // And the lane dropped whole under a membership.
    let (mut lane, qp, pd2) = endpoint(t.addr, g);
    let (m, _) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
    drop(lane);
    assert!(igmp_member(g));
    drop(m);
    assert!(!igmp_member(g));
    drop((pd, pd2));
    t.finish();
}

#[test]
fn lane_multicast_join_on_refuses_bad_groups_and_other_qps() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    {
        let (mut lane, qp, pd) = endpoint(t.addr, group("239.1.3.4"));
        let e = Multicast::join_on(&mut lane, qp, t.addr, JoinKind::FullMember, T).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(e.to_string().contains(&format!("{} is not a multicast address", t.addr)), "{e}");
        let e = Multicast::join_on(&mut lane, qp, group("ff0e::1:4"), JoinKind::FullMember, T).unwrap_err();
        assert!(e.to_string().contains("not of the family"), "{e}");
        // A QP of the lane that is no multicast endpoint's (a plain UD QP).
        let ud = rdma_cm::UdQp::new(&pd, lane.qp_init_from(QpInit::new()), 1, RDMA_UDP_QKEY)
            .expect("a UD QP on the lane's CQ");
        let uq = lane.attach(ud).map_err(|r| r.into_parts().0).unwrap();
        let e = Multicast::join_on(&mut lane, uq, group("239.1.3.4"), JoinKind::FullMember, T).unwrap_err();
        assert!(e.to_string().contains("not a multicast endpoint"), "{e}");
        drop((lane, pd));
    }
    t.finish();
}
