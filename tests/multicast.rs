//! Multicast through rdma_cm on the device: a `McastEndpoint` attached to a lane, its groups
//! joined with `Multicast::join_on` (which registers the group's destination with the lane),
//! datagrams sent to the group and received through the lanes with every byte checked,
//! loopback, a send-only member that receives nothing, and leaving the group in either order
//! with the lane's teardown (the kernel's IGMP membership shows it); the bad inputs (a unicast
//! address as the group, loopback-off where the device cannot, an IPv6 group over RoCE v2, a
//! join past the device's attach limit); no allocation per send, receive and parse; and
//! `examples/mckey` against itself and against rdma-core's `mckey` in both directions.

mod common;
#[path = "common/counting.rs"]
mod counting;

use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::lane::reap;
use common::{lines_of, pattern, require, Cap, DeviceTest, T};
use rdma_cm::cm::multicast::{JoinKind, McastClient, Multicast, MULTICAST_QPN};
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{Completion, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::verbs::ud::{Datagram, RDMA_UDP_QKEY};
use rdma_cm::{AccessFlags, Error, MemoryRegion, ProtectionDomain, QpInit, WorkQueue};
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
    let wc = *c;
    let mut buf = c.take_region().expect("the receive's region back");
    let d = Datagram::parse(&wc, &mut buf, 0).unwrap();
    let bytes = buf.as_slice().unwrap()[d.payload()].to_vec();
    (d, bytes)
}

#[test]
fn multicast_two_members_exchange_datagrams_every_byte_checked() {
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
fn multicast_a_send_only_member_sends_but_receives_nothing() {
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
fn multicast_leaves_the_group_in_either_order_with_the_lane() {
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
fn multicast_join_on_refuses_bad_groups_and_other_qps() {
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
        let ud = rdma_cm::verbs::ud::UdQp::new(&pd, lane.qp_init_from(QpInit::new()), 1, RDMA_UDP_QKEY)
            .expect("a UD QP on the lane's CQ");
        let uq = lane.attach(ud).map_err(|r| r.into_parts().0).unwrap();
        let e = Multicast::join_on(&mut lane, uq, group("239.1.3.4"), JoinKind::FullMember, T).unwrap_err();
        assert!(e.to_string().contains("not a multicast endpoint"), "{e}");
        drop((lane, pd));
    }
    t.finish();
}

#[test]
fn a_unicast_address_as_the_group_is_refused_naming_it() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    for bad in [t.addr, group("127.0.0.1"), group("fd77::1")] {
        let src = if bad.is_ipv4() { t.addr } else { group("fd77::1") };
        let e = McastClient::new().unwrap().resolve(Some(src), bad, T).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let m = e.to_string();
        assert!(m.contains(&bad.to_string()) && m.contains("is not a multicast address"), "{m}");
    }
    // A join of a unicast address on an endpoint bound through a real group, and of a group
    // of the other family: `multicast_join_on_refuses_bad_groups_and_other_qps`.
    t.finish();
}

#[test]
fn an_ipv6_group_over_roce_v2_is_refused_with_the_cause() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let Ok(src6) = std::env::var("RDMA_VM_ADDR6").map(|a| a.parse::<IpAddr>().unwrap()) else {
        panic!("this test needs the guest's IPv6 address (RDMA_VM_ADDR6): run it through harness/runner");
    };
    let g = group("ff0e::1:6");
    let r = McastClient::new().unwrap().resolve(Some(src6), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    let mut ep = r.create_qp(&pd, QpInit::new()).unwrap();
    match ep.join(JoinKind::FullMember, T) {
        Err(e) => {
            // Linux joins only IPv4 groups over RoCE v2 (cma_iboe_join_multicast: ENOTSUPP).
            assert_eq!(e.errno(), Some(524), "{e}");
            let m = e.to_string();
            assert!(m.contains("rdma_join_multicast_ex") && m.contains("ff0e::1:6"), "{m}");
            assert!(m.contains("only IPv4 groups over RoCE v2"), "{m}");
        }
        Ok(m) => {
            // A kernel that joins IPv6 groups: the membership names its group.
            assert_eq!(m.mgid().to_ipv6(), "ff0e::1:6".parse::<std::net::Ipv6Addr>().unwrap());
        }
    }
    drop((ep, pd));
    t.finish();
}

/// rxe attaches at most `max_mcast_qp_attach` (56) QPs to one group: the join past that gets a
/// `MULTICAST_ERROR` event (librdmacm turns the JOIN into one when `ibv_attach_mcast` fails),
/// which the join reports naming the group, and leaves the group behind it.
#[test]
fn a_join_whose_qp_cannot_be_attached_is_a_multicast_error_naming_the_group() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let g = group("239.1.2.13");
    let mut members = vec![];
    let mut failed = None;
    for i in 0..80 {
        let r = McastClient::new().unwrap().resolve(Some(t.addr), g, T).unwrap();
        let pd = r.alloc_pd().unwrap();
        let mut ep = r.create_qp(&pd, QpInit::new().max_send_wr(1).max_recv_wr(1)).unwrap();
        match ep.join(JoinKind::FullMember, T) {
            Ok(m) => members.push((m, ep)),
            Err(e) => {
                failed = Some((i, e));
                break;
            }
        }
    }
    let Some((i, e)) = failed else { panic!("80 QPs attached to one group: the device has no attach limit below 80") };
    assert!(i >= 1, "the first join failed: {e}");
    match &e {
        Error::UnexpectedEvent { got, expected, .. } => {
            assert_eq!(*got, rdma_cm::CmEventType::MulticastError, "{e}");
            assert_eq!(*expected, rdma_cm::CmEventType::MulticastJoin, "{e}");
        }
        e => panic!("expected a MULTICAST_ERROR, got {e:?}"),
    }
    let m = e.to_string();
    assert!(m.contains("MULTICAST_ERROR") && m.contains("239.1.2.13"), "{m}");
    assert!(m.contains("could not attach the QP") && m.contains("max_mcast_qp_attach"), "{m}");
    eprintln!("join {i} failed (rxe's max_mcast_qp_attach): {m}");
    assert!(igmp_member(g), "the {i} members before it are still joined");
    drop(members);
    assert!(!igmp_member(g), "every member left");
    t.finish();
}

#[test]
fn loopback_off_is_a_clear_error_where_the_device_cannot_block_it() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let g = group("239.1.2.5");
    let r = McastClient::new().unwrap().resolve(Some(t.addr), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    let mut lane = Lane::new(&r.context().unwrap(), 64).unwrap();
    match r.loopback(false).create_qp(&pd, lane.qp_init_from(QpInit::new())) {
        Err(e @ Error::Call { .. }) => {
            // rxe: the flag is refused (as `mckey -l` is there).
            assert_eq!(e.errno(), Some(libc::EOPNOTSUPP), "{e}");
            let m = e.to_string();
            assert!(
                m.contains("IBV_QP_CREATE_BLOCK_SELF_MCAST_LB") && m.contains("cannot block multicast loopback"),
                "{m}"
            );
        }
        Err(e) => panic!("expected a Call error naming the flag, got {e:?}"),
        Ok(ep) => {
            // A device that blocks it: the sender's own datagram does not come back, while
            // another member gets it.
            assert!(!ep.loopback());
            let qp = lane.attach(ep).map_err(|r| r.into_parts().0).unwrap();
            let (mut ol, oq, opd) = endpoint(t.addr, g);
            post_recv(&mut ol, oq, &opd, 8, 1);
            post_recv(&mut lane, qp, &pd, 8, 1);
            let (om, _) = Multicast::join_on(&mut ol, oq, g, JoinKind::FullMember, T).unwrap();
            let (m, to_group) = Multicast::join_on(&mut lane, qp, g, JoinKind::FullMember, T).unwrap();
            let out = MemoryRegion::new(&pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
            lane.post_send(qp, SendWr::send(out, 0..8).to(to_group).wr_id(2)).unwrap();
            let (sent, met) = reap_until(&mut lane, WorkQueue::Send, 2);
            assert!(sent.is_ok() && met.is_empty(), "{sent:?} {met:?}");
            let (d, _) = datagram(reap_until(&mut ol, WorkQueue::Recv, 1).0);
            assert_eq!(d.src_qp(), lane.qp_num(qp).unwrap());
            // The other member has it, so the device has delivered it everywhere it goes.
            assert!(lane.poll().unwrap().is_none(), "loopback was not blocked");
            drop((m, om, ol, opd));
        }
    }
    drop((lane, pd));
    t.finish();
}

/// Polls `lane` until one completion arrives (bounded), counting only the polls.
fn poll_one(lane: &mut Lane) -> Completion {
    let deadline = std::time::Instant::now() + T;
    loop {
        if let Some(c) = counting::watched(|| lane.poll()).unwrap() {
            return c;
        }
        assert!(std::time::Instant::now() < deadline, "no completion within {T:?}");
    }
}

#[test]
fn posting_to_the_group_and_polling_allocate_nothing() {
    const N: u64 = 2_000;
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    {
        let g = group("239.1.2.11");
        let (mut rl, rq, rpd) = endpoint(t.addr, g);
        let (mut tl, tq, tpd) = endpoint(t.addr, g);
        let mut rbuf = Some(MemoryRegion::new(&rpd, GRH_LEN + 256, AccessFlags::LOCAL_WRITE).unwrap());
        let mut out = Some(MemoryRegion::new(&tpd, 256, AccessFlags::LOCAL_WRITE).unwrap());
        let (rm, _) = Multicast::join_on(&mut rl, rq, g, JoinKind::FullMember, T).unwrap();
        let (tm, to_group) = Multicast::join_on(&mut tl, tq, g, JoinKind::SendOnlyFullMember, T).unwrap();
        counting::assert_it_counts();
        for i in 0..N {
            let len = 1 + (i as usize % 256);
            let r = rbuf.take().unwrap();
            counting::watched(|| rl.post_recv(rq, RecvWr::new(r).wr_id(i))).unwrap();
            let o = out.take().unwrap();
            counting::watched(|| tl.post_send(tq, SendWr::send(o, 0..len).to(to_group).wr_id(i))).unwrap();
            let mut sent = poll_one(&mut tl);
            assert!(sent.is_ok() && sent.wr_id() == i, "{sent:?}");
            out = sent.take_region();
            let mut got = poll_one(&mut rl);
            assert_eq!((got.wr_id(), got.byte_len() as usize), (i, GRH_LEN + len));
            let wc = *got;
            let mut r = got.take_region().expect("the receive's region back");
            assert_eq!(counting::watched(|| Datagram::parse(&wc, &mut r, 0)).unwrap().len(), len);
            rbuf = Some(r);
        }
        let (allocs, _) = counting::counts();
        assert_eq!(allocs, 0, "{allocs} allocations in {N} multicast sends and receives (post, poll, parse)");
        drop((tm, rm, rl, tl, rbuf, out));
    }
    t.finish();
}

/// Leaving the group while a send to it is posted: the lane keeps the group's address handle
/// (it holds the destination for as long as the QP is attached), so the send completes, and
/// the handle goes when the QP leaves the lane.
#[test]
fn leaving_with_a_send_in_flight_keeps_the_groups_address_handle_until_the_qp_leaves_the_lane() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    {
        let g = group("239.1.2.12");
        let (mut lane, qp, pd) = endpoint(t.addr, g);
        let out = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let (m, to_group) = Multicast::join_on(&mut lane, qp, g, JoinKind::SendOnlyFullMember, T).unwrap();
        let ah = Arc::downgrade(m.dest().ah());
        lane.post_send(qp, SendWr::send(out, 0..64).to(to_group).wr_id(5)).unwrap();
        m.leave().unwrap();
        // The membership and its destination are gone; the lane still holds the handle.
        assert!(ah.upgrade().is_some(), "the group's AH was destroyed under a posted send");
        let (sent, _) = reap_until(&mut lane, WorkQueue::Send, 5);
        assert!(sent.is_ok(), "{sent:?}");
        assert!(ah.upgrade().is_some(), "the lane keeps its destinations while the QP is attached");
        lane.remove(qp).unwrap();
        assert!(ah.upgrade().is_none(), "the AH outlived the QP's place in the lane");
        drop((lane, sent, pd));
    }
    t.finish();
}

// ---- examples/mckey against itself and rdma-core's mckey ----

fn mckey_example() -> String {
    common::example("mckey").to_string_lossy().into_owned()
}

const WITHIN: Duration = Duration::from_secs(90);

/// Waits for `child`, bounded; kills it (and panics) past `within`.
fn wait_output(mut child: std::process::Child, within: Duration, what: &str) -> std::process::Output {
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("{what} did not end within {within:?}: killed. It said:\n{}", text(&out));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Runs `receiver` until it prints `receiving data transfers` (rdma-core's `mckey` under
/// `stdbuf -oL`, so its lines arrive as printed): both mckeys print it once every one of their
/// ids has joined and attached its QP, whereas the first `joined` line may come while a second
/// id is still joining. Then runs `sender` to completion; returns both outputs after checking
/// both succeeded.
fn run_pair(receiver: &[&str], sender: &[&str]) -> (String, String) {
    let mut rcmd = Command::new(receiver[0]);
    rcmd.args(&receiver[1..]).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut rchild = rcmd.spawn().unwrap_or_else(|e| panic!("spawn {receiver:?}: {e}"));
    let lines = lines_of(&mut rchild);
    let mut seen = vec![];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !seen.iter().any(|l: &String| l.starts_with("receiving data transfers")) {
        match lines.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
            Ok(l) => seen.push(l),
            Err(_) => {
                let _ = rchild.kill();
                panic!("{receiver:?} was not receiving within 60 s; it said:\n{}", seen.join("\n"));
            }
        }
    }
    let mut scmd = Command::new(sender[0]);
    scmd.args(&sender[1..]).stdout(Stdio::piped()).stderr(Stdio::piped());
    let s = wait_output(scmd.spawn().unwrap(), WITHIN, "the sender");
    let st = text(&s);
    let r = wait_output(rchild, WITHIN, "the receiver");
    // The reader thread ends with the receiver's stdout: every line is in the channel now.
    seen.extend(lines.iter());
    seen.push(text(&r));
    let rt = seen.join("\n");
    assert!(s.status.success(), "sender {sender:?} failed:\n{st}\nreceiver said:\n{rt}");
    assert!(r.status.success(), "receiver {receiver:?} failed:\n{rt}\nsender said:\n{st}");
    (rt, st)
}

fn assert_lines(out: &str, lines: &[&str]) {
    let got: Vec<&str> = out.lines().collect();
    let mut at = 0;
    for want in lines {
        match got[at..].iter().position(|l| l.starts_with(want)) {
            Some(k) => at += k + 1,
            None => panic!("no line {want:?} (in order) in:\n{out}"),
        }
    }
}

const SENDER_LINES: [&str; 7] = [
    "mckey: starting client",
    "mckey: joining",
    "mckey: joined dgid: ::ffff:",
    "initiating data transfers",
    "data transfers complete",
    "test complete",
    "return status 0",
];

#[test]
fn mckey_example_against_itself_two_receiving_ids_every_byte_checked() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let common = ["-m", "239.1.2.7", "-b", a.as_str(), "-C", "6", "-S", "1000"];
    let mut rx = vec![me.as_str(), "-c", "2", "--verify"];
    rx.extend_from_slice(&common);
    let mut tx = vec![me.as_str(), "-s", "--settle", "0"];
    tx.extend_from_slice(&common);
    let (r, s) = run_pair(&rx, &tx);
    assert_lines(&s, &SENDER_LINES);
    assert_lines(
        &r,
        &[
            "mckey: starting server",
            "mckey: joined dgid: ::ffff:239.1.2.7 mlid 0x0 sl 0",
            "mckey: joined dgid: ::ffff:239.1.2.7 mlid 0x0 sl 0",
            "receiving data transfers",
            "mckey: 12 datagrams checked: 1000 bytes each, sent to the group, immediate data = the sender's QP number, every byte",
            "data transfers complete",
            "return status 0",
        ],
    );
    t.finish();
}

#[test]
fn mckey_example_receives_from_rdma_cores_mckey_sender() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let common = ["-m", "239.1.2.8", "-b", a.as_str(), "-C", "5", "-S", "300"];
    let mut rx = vec![me.as_str()];
    rx.extend_from_slice(&common);
    let mut tx = vec!["mckey", "-s"];
    tx.extend_from_slice(&common);
    let (r, s) = run_pair(&rx, &tx);
    assert_lines(&s, &SENDER_LINES);
    // mckey sends uninitialised bytes: the checks are the size, the group and the immediate
    // data (mckey's QP number, which the completion names as the source).
    assert_lines(
        &r,
        &[
            "mckey: joined dgid: ::ffff:239.1.2.8 mlid 0x0 sl 0",
            "receiving data transfers",
            "mckey: 5 datagrams checked: 300 bytes each, sent to the group, immediate data = the sender's QP number",
            "data transfers complete",
            "return status 0",
        ],
    );
    t.finish();
}

#[test]
fn rdma_cores_mckey_receives_from_the_mckey_example() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let common = ["-m", "239.1.2.9", "-b", a.as_str(), "-C", "5", "-S", "300"];
    // mckey's stdout is a pipe here: line-buffer it so its joined line arrives as printed.
    let mut rx = vec!["stdbuf", "-oL", "mckey"];
    rx.extend_from_slice(&common);
    let mut tx = vec![me.as_str(), "-s", "--settle", "0"];
    tx.extend_from_slice(&common);
    let (r, s) = run_pair(&rx, &tx);
    assert_lines(&s, &SENDER_LINES);
    // mckey's receiver returns only after it has reaped all five receives.
    assert_lines(
        &r,
        &[
            "mckey: starting server",
            "mckey: joined dgid: ::ffff:239.1.2.9 mlid 0x0 sl 0",
            "receiving data transfers",
            "data transfers complete",
            "return status 0",
        ],
    );
    t.finish();
}

#[test]
fn mckey_example_and_mckey_refuse_loopback_off_alike_on_rxe() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return t.finish();
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let args = ["-m", "239.1.2.10", "-b", a.as_str(), "-s", "-l", "-C", "1"];
    for prog in [me.as_str(), "mckey"] {
        let mut cmd = Command::new(prog);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        if prog == me {
            cmd.args(["--settle", "0"]);
        }
        let out = wait_output(cmd.spawn().unwrap(), WITHIN, prog);
        let o = text(&out);
        assert!(!out.status.success(), "{prog} -l succeeded:\n{o}");
        let line =
            o.lines().find(|l| l.starts_with("mckey: unable to create QP: ")).unwrap_or_else(|| panic!("{prog}: {o}"));
        assert!(line.contains("Operation not supported"), "{prog}: {line}");
        assert!(!o.contains("initiating data transfers"), "{prog} went on:\n{o}");
    }
    t.finish();
}
