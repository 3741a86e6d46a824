//! Verbs without the connection manager: RC QPs made on a protection domain
//! alone and connected from each other's `PeerInfo` exchanged in-process, UD QPs made from a
//! port and a Q_Key, and what bad peer info gives: a clear error, not a hang. Each attempt to
//! break the API with safe code stays here as a test.

mod common;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::lane::reap;
use common::{DeviceTest, T};
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{InlineWr, Lane, RecvWr, SendWr};
use rdma_cm::verbs::peer::PeerInfo;
use rdma_cm::verbs::port::{Gid, GidType};
use rdma_cm::verbs::qp::{RcParams, UnconnectedQp};
use rdma_cm::verbs::ud::{Datagram, UdQp};
use rdma_cm::{
    devices, AccessFlags, Error, MemoryRegion, ProtectionDomain, QpInit, QpState, Transport, VerbsContext, WcStatus,
    WorkQueue,
};

/// The device's context and the index of the RoCE v2 GID of its IPv4 address (what
/// `ibv_rc_pingpong -g` is given). An iWARP device has no such entry (its peers are found by IP
/// address, through the CM): its first valid entry is taken, which is all a QP made there
/// without the CM needs (it is never connected: see `Cap::ConnectWithoutCm`).
fn open(addr: IpAddr) -> (VerbsContext, u8) {
    let name =
        devices().expect("ibv_get_device_list").into_iter().next().expect("a device (this is a device test)").name;
    let ctx = VerbsContext::open(&name).expect("ibv_open_device");
    let table = ctx.gid_table(1).expect("gid table");
    let entry = if ctx.transport() == Transport::Iwarp {
        table.into_iter().next().unwrap_or_else(|| panic!("no valid GID on {name} port 1"))
    } else {
        table
            .into_iter()
            .find(|e| e.gid.ipv4().map(IpAddr::V4) == Some(addr) && e.gid_type == GidType::RoceV2)
            .unwrap_or_else(|| panic!("no RoCE v2 GID of {addr} on port 1"))
    };
    (ctx, u8::try_from(entry.index).expect("a GID index under 256"))
}

/// Two verbs-only QPs on `lane`'s CQ, in INIT.
fn pair(pd: &Arc<ProtectionDomain>, lane: &Lane, params: RcParams) -> (UnconnectedQp, UnconnectedQp) {
    let a = UnconnectedQp::new(pd, lane.qp_init(), params.clone()).expect("create QP a");
    let b = UnconnectedQp::new(pd, lane.qp_init(), params).expect("create QP b");
    (a, b)
}

/// Two verbs-only QPs, on a lane's CQ, connected to each other by their infos alone and
/// attached to the lane: a send arrives byte for byte, and an RDMA WRITE lands byte for byte in
/// the peer's region; both QPs are in INIT before and in RTS after the connect.
#[test]
fn rc_pair_connected_by_exchanged_info_sends_and_writes_byte_exact() {
    let t = DeviceTest::start();
    if common::require(common::Cap::ConnectWithoutCm) {
        let (ctx, gidx) = open(t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 64).unwrap();
        let (a, b) = pair(&pd, &lane, RcParams::new().gid_index(gidx));
        assert_eq!(a.qp().state().unwrap(), QpState::Init);
        let (ia, ib) = (a.local(), b.local());
        assert_eq!(ia.qp_num, a.qp_num());
        assert!(ia.has_gid() && ia.psn <= 0xff_ffff);
        // Through the pingpong wire form, as two processes would exchange them.
        let ib = PeerInfo::from_wire(&ib.to_wire().unwrap()).unwrap();
        let ia = PeerInfo::from_wire(&ia.to_wire().unwrap()).unwrap();

        let qa = a.connect(&ib).expect("connect a");
        let qb = b.connect(&ia).expect("connect b");
        assert_eq!(qa.state().unwrap(), QpState::ReadyToSend);
        let at = qa.attributes().unwrap();
        assert_eq!((at.dest_qp_num, at.path_mtu), (ib.qp_num, 1024));
        let qa = lane.attach(qa).map_err(|r| r.into_parts().0).expect("attach a");
        let qb = lane.attach(qb).map_err(|r| r.into_parts().0).expect("attach b");
        assert_eq!(lane.attributes(qb).unwrap().state, QpState::ReadyToSend);

        let rbuf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        lane.post_recv(qb, RecvWr::new(rbuf).wr_id(7)).unwrap();
        // An extra receive on a, still posted when the lane is dropped (the counts at the end
        // say it was released).
        let abuf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        lane.post_recv(qa, RecvWr::new(abuf).wr_id(8)).unwrap();

        let msg = b"verbs without the CM";
        let mut sbuf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        sbuf.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(msg);
        lane.post_send(qa, SendWr::send(sbuf, 0..msg.len()).wr_id(1)).unwrap();
        let mut done = reap(&mut lane, 2);
        done.sort_by_key(|c| c.wr_id());
        assert_eq!((done[0].wr_id(), done[0].qp(), done[0].queue()), (1, Some(qa), WorkQueue::Send), "{:?}", done[0]);
        assert_eq!((done[1].wr_id(), done[1].qp(), done[1].queue()), (7, Some(qb), WorkQueue::Recv), "{:?}", done[1]);
        assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
        assert_eq!(done[1].byte_len() as usize, msg.len());
        let mut rbuf = done[1].take_region().expect("the receive's region comes back");
        assert_eq!(&rbuf.as_slice().unwrap()[..msg.len()], msg);

        // RDMA WRITE into b's remotely writable region.
        let mut target = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        target.write_at(0, &[0u8; 4096]).unwrap();
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut src = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        src.as_mut_slice().unwrap().copy_from_slice(&pattern);
        let remote = target.remote();
        lane.post_send(qa, SendWr::write(src, 0..4096, &remote, 0).wr_id(2)).unwrap();
        let w = lane.wait(T).expect("the WRITE's completion").ok().expect("the WRITE succeeds");
        assert_eq!(w.wr_id(), 2);
        let mut got = vec![0u8; 4096];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern, "the RDMA WRITE's bytes");
        drop((lane, done, rbuf, w, target));
    } else {
        // Where the device cannot do it (iWARP), the crate says so, naming what is missing.
        let (ctx, gidx) = open(t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let lane = Lane::new(&ctx, 64).unwrap();
        let (a, b) = pair(&pd, &lane, RcParams::new().gid_index(gidx));
        let e = a.connect(&b.local()).expect_err("connect without the CM on iWARP");
        assert!(matches!(e, rdma_cm::Error::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("adopt_qp"), "{e}");
    }
    t.finish();
}

/// A UD QP without an id, from a port and a Q_Key: in RTS at once; attached to a lane, a
/// datagram to a second one, addressed by its `PeerInfo`, arrives with its bytes and its
/// sender's QP number.
#[test]
fn ud_qps_without_an_id_exchange_datagrams() {
    let t = DeviceTest::start();
    if common::require(common::Cap::Ud) {
        let (ctx, gidx) = open(t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 64).unwrap();
        let qkey = 0x1111_1111;
        let a = UdQp::new(&pd, lane.qp_init(), 1, qkey).expect("UD QP a");
        let b = UdQp::new(&pd, lane.qp_init(), 1, qkey).expect("UD QP b");
        assert_eq!(a.qp().state().unwrap(), QpState::ReadyToSend);
        assert_eq!(a.qkey(), qkey);
        let ib = b.local(Some(gidx)).unwrap();
        assert_eq!(ib.qp_num, b.qp_num());
        let (a_num, recv_len) = (a.qp_num(), b.recv_len());
        let dest = a.dest_to(&ib, Some(gidx), 0, qkey).unwrap();
        let wrong = a.dest_to(&ib, Some(gidx), 0, 0x2222_2222).unwrap();
        let la = lane.attach(a).map_err(|r| r.into_parts().0).expect("attach a");
        let lb = lane.attach(b).map_err(|r| r.into_parts().0).expect("attach b");
        let to_b = lane.add_dest(la, &dest).unwrap();

        let rbuf = MemoryRegion::new(&pd, recv_len, AccessFlags::LOCAL_WRITE).unwrap();
        lane.post_recv(lb, RecvWr::new(rbuf).wr_id(3)).unwrap();
        lane.post_inline(la, InlineWr::send(b"datagram, no id").to(to_b).wr_id(4)).unwrap();
        let mut done = reap(&mut lane, 2);
        done.sort_by_key(|c| c.wr_id());
        assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
        assert_eq!((done[0].wr_id(), done[0].queue()), (3, WorkQueue::Recv));
        let mut rbuf = done[0].take_region().unwrap();
        let d = Datagram::parse(&done[0], &mut rbuf, 0).unwrap();
        assert_eq!(d.src_qp(), a_num);
        let mut got = vec![0u8; d.len()];
        rbuf.read_at(d.payload().start, &mut got).unwrap();
        assert_eq!(got, b"datagram, no id");
        assert!(d.payload().start == GRH_LEN);

        // A Q_Key that is not b's: the datagram is dropped by b (no completion), the send
        // still completes.
        let to_b_wrong = lane.add_dest(la, &wrong).unwrap();
        lane.post_recv(lb, RecvWr::new(rbuf).wr_id(5)).unwrap();
        lane.post_inline(la, InlineWr::send(b"x").to(to_b_wrong).wr_id(6)).unwrap();
        let sent = lane.wait(T).expect("the send's completion");
        assert!(sent.is_ok() && sent.wr_id() == 6, "{sent:?}");
        let e = lane.wait(Duration::from_millis(300)).expect_err("b's receive takes nothing");
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert_eq!(lane.outstanding(lb).unwrap(), (0, 1), "b's receive is still posted");
        drop((lane, done, sent));
    }
    t.finish();
}

/// Bad peer info: what can be checked is refused before any call, naming the field; a QP
/// number that names no QP is accepted by RTR/RTS (nothing can check it) and the first send
/// fails with RETRY_EXC_ERR within the retry budget: a clear error, never a hang.
#[test]
fn bad_peer_info_gives_a_clear_error_not_a_hang() {
    let t = DeviceTest::start();
    {
        let (ctx, gidx) = open(t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let params = RcParams::new().gid_index(gidx).timeout(12).retry_count(2);
        let good = UnconnectedQp::new(&pd, QpInit::new(), params.clone()).unwrap().local();
        // Each case below spoils one field of otherwise good info. siw numbers its QPs from 1,
        // which `PeerInfo::check` refuses (QP 0 and 1 are InfiniBand's special QPs, never an RC
        // QP's; and an iWARP QP is never connected from a PeerInfo): the number is kept in the
        // range an RC QP has everywhere, so that each case is refused for its own field.
        let good = PeerInfo { qp_num: good.qp_num.max(2), ..good };

        let cases: [(PeerInfo, &str); 4] = [
            (PeerInfo { qp_num: 0, ..good }, "QP number"),
            (PeerInfo { qp_num: 1 << 24, ..good }, "QP number"),
            (PeerInfo { psn: 1 << 24, ..good }, "PSN"),
            (PeerInfo { gid: Gid::default(), lid: 5, ..good }, "GID"),
        ];
        for (peer, what) in cases {
            let q = UnconnectedQp::new(&pd, QpInit::new(), params.clone()).unwrap();
            let e = q.connect(&peer).expect_err("bad info must be refused");
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        // A zero message (what ibv_srq_pingpong sends for its unused QPs) parses and is refused.
        let zero = PeerInfo::from_wire(&PeerInfo::default().to_wire().unwrap()).unwrap();
        let q = UnconnectedQp::new(&pd, QpInit::new(), params.clone()).unwrap();
        assert!(q.connect(&zero).is_err());

        // A QP number that names nothing: connect succeeds, the send fails in bounded time. Only
        // where RTR/RTS by hand connects at all (not on iWARP).
        if common::require(common::Cap::ConnectWithoutCm) {
            let mut lane = Lane::new(&ctx, 64).unwrap();
            let q = UnconnectedQp::new(&pd, lane.qp_init(), params.clone()).unwrap();
            let ghost = PeerInfo { qp_num: (good.qp_num + 1000) & 0xff_ffff, ..good };
            let qp = q.connect(&ghost).expect("RTR/RTS cannot check the peer's QP number");
            let qp = lane.attach(qp).map_err(|r| r.into_parts().0).expect("attach");
            let rbuf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            lane.post_recv(qp, RecvWr::new(rbuf).wr_id(1)).unwrap();
            let started = Instant::now();
            lane.post_inline(qp, InlineWr::send(b"anyone?").wr_id(2)).unwrap();
            let c = lane.wait(T).expect("the send's completion, within the retry budget");
            assert!(started.elapsed() < T, "bounded: {:?}", started.elapsed());
            assert_eq!((c.wr_id(), c.queue()), (2, WorkQueue::Send), "{c:?}");
            let e = c.ok().expect_err("a send to no QP fails");
            match &e {
                Error::WorkCompletion { status, .. } => assert_eq!(*status, WcStatus::RetryExcErr, "{e}"),
                other => panic!("expected RETRY_EXC_ERR, got {other}"),
            }
            assert!(e.to_string().contains("did not acknowledge"), "the hint: {e}");
            // The failure moved the QP to the error state: the lane refuses its posts.
            let refused = lane.post_inline(qp, InlineWr::send(b"again?")).expect_err("a QP in the error state");
            assert!(matches!(refused, Error::QpInError { .. }), "{refused}");
            drop(lane);
        }
    }
    t.finish();
}

/// Local parameters no QP can use are refused before any QP exists, each naming the cause: an
/// empty GID index (the valid ones listed), no GID index on RoCE, a path MTU that is no MTU or
/// over the port's, a port the device lacks.
#[test]
fn bad_local_parameters_are_named() {
    let t = DeviceTest::start();
    {
        let (ctx, gidx) = open(t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let cases: [(RcParams, &str); 5] = [
            (RcParams::new().gid_index(250), "GID index 250 is empty"),
            (RcParams::new(), "(Ethernet link layer), where QPs are addressed by GID"),
            (RcParams::new().gid_index(gidx).mtu(3000), "not one of"),
            (RcParams::new().gid_index(gidx).mtu(8192), "not one of"),
            (RcParams::new().gid_index(gidx).port(9), "no port 9"),
        ];
        for (params, what) in cases {
            let e = UnconnectedQp::new(&pd, QpInit::new(), params).expect_err(what);
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        let e = UdQp::new(&pd, QpInit::new(), 7, 1).expect_err("UD on a port the device lacks");
        assert!(e.to_string().contains("no port 7"), "{e}");
    }
    t.finish();
}

/// A lane serves QPs made without the connection manager: two
/// `UnconnectedQp`s on the lane's CQ, connected by their infos and attached as the
/// `QueuePair`s `connect` hands back, exchange a send byte for byte, the regions coming back
/// with their completions; a UD `UdQp` attached the same way sends a datagram to a registered
/// destination. A QP on another CQ is refused, and the refusal gives the QP back whole.
#[test]
fn a_lane_serves_qps_made_without_the_cm() {
    let t = DeviceTest::start();
    {
        let (ctx, gidx) = open(t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        // Room for every queue it serves: two RC QPs and two UD QPs of 16 + 16.
        let mut lane = Lane::new(&ctx, 128).unwrap();
        let params = RcParams::new().gid_index(gidx);
        let a = UnconnectedQp::new(&pd, lane.qp_init(), params.clone()).expect("create QP a");
        let b = UnconnectedQp::new(&pd, lane.qp_init(), params).expect("create QP b");
        // A QP the lane's CQ has no room for does not grow it: the QP is created, and the lane
        // grows the CQ only when it attaches the QP.
        let cq = Arc::clone(a.qp().send_cq());
        let big = UnconnectedQp::new(
            &pd,
            QpInit::new().max_send_wr(64).max_recv_wr(64).send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq)),
            RcParams::new().gid_index(gidx),
        )
        .expect("created beyond the CQ's room");
        assert_eq!(cq.depth(), 128, "not grown by the QP's creation");
        drop(big);
        // The RC pair, connected by hand: not on iWARP (the UD part below needs UD only).
        if common::require(common::Cap::ConnectWithoutCm) {
            let (ia, ib) = (a.local(), b.local());
            let qa = lane.attach(a.connect(&ib).expect("connect a")).map_err(|r| r.into_parts().0).expect("attach a");
            let qb = lane.attach(b.connect(&ia).expect("connect b")).map_err(|r| r.into_parts().0).expect("attach b");
            assert_eq!(lane.qp_num(qa).unwrap(), ia.qp_num);

            let msg = b"a lane without the CM";
            let rbuf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            let mut sbuf = MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap();
            sbuf.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(msg);
            lane.post_recv(qb, RecvWr::new(rbuf).wr_id(1)).map_err(|r| r.into_parts().0).unwrap();
            lane.post_send(qa, SendWr::send(sbuf, 0..msg.len()).wr_id(2)).map_err(|r| r.into_parts().0).unwrap();
            let mut got = [false; 2];
            for mut c in common::lane::reap(&mut lane, 2) {
                assert!(c.is_ok(), "{c:?}");
                let mut region = c.take_region().expect("the region comes back with its completion");
                match c.wr_id() {
                    1 => {
                        assert_eq!((c.qp(), c.queue(), c.byte_len()), (Some(qb), WorkQueue::Recv, msg.len() as u32));
                        assert_eq!(&region.as_slice().unwrap()[..msg.len()], msg);
                        got[0] = true;
                    }
                    2 => {
                        assert_eq!((c.qp(), c.queue()), (Some(qa), WorkQueue::Send));
                        got[1] = true;
                    }
                    other => panic!("unexpected wr_id {other}"),
                }
            }
            assert_eq!(got, [true, true]);

            // A QP that completes on its own CQ: refused, and given back.
            let own = UnconnectedQp::new(&pd, QpInit::new(), RcParams::new().gid_index(gidx)).unwrap();
            let peer = lane.qp_num(qb).unwrap();
            let own = own.connect(&PeerInfo { qp_num: peer, ..ib }).expect("connect");
            let num = own.qp_num();
            let r = lane.attach(own).expect_err("a QP on another CQ must be refused");
            assert!(r.error().to_string().contains("another CQ"), "{}", r.error());
            assert_eq!(r.into_inner().expect("the QP comes back").qp_num(), num);
        }

        if common::require(common::Cap::Ud) {
            let qkey = 0x1111_1111;
            let ua = UdQp::new(&pd, lane.qp_init(), 1, qkey).expect("UD QP a");
            let ub = UdQp::new(&pd, lane.qp_init(), 1, qkey).expect("UD QP b");
            let dest = ua.dest_to(&ub.local(Some(gidx)).unwrap(), Some(gidx), 0, qkey).unwrap();
            let recv_len = ub.recv_len();
            let (la, lb) = (
                lane.attach(ua).map_err(|r| r.into_parts().0).expect("attach UD a"),
                lane.attach(ub).map_err(|r| r.into_parts().0).expect("attach UD b"),
            );
            let to_b = lane.add_dest(la, &dest).unwrap();
            // A destination registered for one QP is not another's, though both sit in one
            // lane.
            let b_key = lane.add_dest(lb, &dest).unwrap();
            let stray = MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap();
            let e = lane.post_send(la, SendWr::send(stray, 0..8).to(b_key)).expect_err("another QP's destination");
            assert!(e.to_string().contains("not this QP's"), "{e}");
            let rbuf = MemoryRegion::new(&pd, recv_len, AccessFlags::LOCAL_WRITE).unwrap();
            let mut sbuf = MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap();
            sbuf.as_mut_slice().unwrap()[..8].copy_from_slice(b"datagram");
            lane.post_recv(lb, RecvWr::new(rbuf).wr_id(3)).map_err(|r| r.into_parts().0).unwrap();
            lane.post_send(la, SendWr::send(sbuf, 0..8).to(to_b).wr_id(4)).map_err(|r| r.into_parts().0).unwrap();
            for mut c in common::lane::reap(&mut lane, 2) {
                assert!(c.is_ok(), "{c:?}");
                let mut region = c.take_region().unwrap();
                if c.wr_id() == 3 {
                    assert_eq!(c.byte_len() as usize, GRH_LEN + 8);
                    assert_eq!(&region.as_slice().unwrap()[GRH_LEN..GRH_LEN + 8], b"datagram");
                }
            }
        }
    }
    t.finish();
}

/// The lane reads the provider's post and poll functions once (its CQ's when it is made, a
/// QP's when it is attached) and calls them from then on. An attempt to leave them dangling
/// from safe code: the device's handle, the PD's handle and the QPs' owners all dropped (the
/// QPs moved into the lane) before anything is posted, on a context opened without the CM
/// (nothing but the lane's own references keeps it open). Prepared requests and plain ones
/// then post and poll, and the bytes arrive.
#[test]
fn a_lanes_provider_functions_outlive_every_handle_but_the_lanes() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::ConnectWithoutCm) {
        return t.finish();
    }
    let (mut lane, qa, qb, sbuf, rbuf) = {
        let (ctx, gidx) = open(t.addr);
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 64).unwrap();
        let params = RcParams::new().gid_index(gidx);
        let a = UnconnectedQp::new(&pd, lane.qp_init(), params.clone()).expect("create QP a");
        let b = UnconnectedQp::new(&pd, lane.qp_init(), params).expect("create QP b");
        let (ia, ib) = (a.local(), b.local());
        let qa = lane.attach(a.connect(&ib).expect("connect a")).map_err(|r| r.into_parts().0).expect("attach a");
        let qb = lane.attach(b.connect(&ia).expect("connect b")).map_err(|r| r.into_parts().0).expect("attach b");
        let rbuf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let sbuf = MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap();
        (lane, qa, qb, sbuf, rbuf)
        // `ctx` and `pd` are dropped here.
    };
    let mut send = lane.prepare_send(qa, SendWr::send(sbuf, 0..16)).map_err(|r| r.into_parts().0).unwrap();
    let mut recv = lane.prepare_recv(qb, RecvWr::range(rbuf, 0..16)).map_err(|r| r.into_parts().0).unwrap();
    for round in 0u8..3 {
        send.as_mut_slice().unwrap()[..16].fill(round + 1);
        lane.post_prepared_recv(&mut recv).unwrap();
        lane.post_prepared(&mut send).unwrap();
        let mut seen = 0;
        for mut c in common::lane::reap(&mut lane, 2) {
            assert!(c.is_ok(), "round {round}: {c:?}");
            let mut region = c.take_region().expect("the region comes back");
            if c.queue() == WorkQueue::Recv {
                assert_eq!(region.as_slice().unwrap()[..16], [round + 1; 16], "round {round}");
                recv.rearm(region).unwrap();
            } else {
                send.rearm(region).unwrap();
            }
            seen += 1;
        }
        assert_eq!(seen, 2);
    }
    drop((send, recv, lane));
    t.finish();
}
