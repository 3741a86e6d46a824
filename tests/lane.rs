//! The fast path (`rdma_cm::verbs::lane`) on the device: RC send/recv, WRITE, READ and fetch-and-add,
//! selective signaling and post lists, UD datagrams, and the refusals a post makes before it
//! reaches the provider (each giving the region back). Attacks on its soundness are in
//! `tests/lane_soundness.rs`.

mod common;

use common::lane::{lane_on, lane_pair, lane_ud_pair, reap};
use common::{pair, pattern, DeviceTest, PairSpec};
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{RecvWr, SendWr};
use rdma_cm::verbs::ud::Datagram;
use rdma_cm::{AccessFlags, Error, MemoryRegion, QpInit, RemoteRegion, WcOpcode, WorkQueue};

fn spec(access: AccessFlags) -> PairSpec {
    PairSpec { mr_sizes: vec![4096, 4096], access, ..PairSpec::default() }
}

#[test]
fn rc_send_and_recv_hand_the_regions_back_with_the_data() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(AccessFlags::LOCAL_WRITE), spec(AccessFlags::LOCAL_WRITE), 64);
        let mut msg = a.mrs.remove(0);
        msg.as_mut_slice().unwrap()[..100].copy_from_slice(&pattern(100, 7));
        let buf = b.mrs.remove(0);
        b.lane.post_recv(b.qp, RecvWr::new(buf).wr_id(11)).unwrap();
        assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 1));
        a.lane.post_send(a.qp, SendWr::send(msg, 0..100).wr_id(22)).unwrap();
        let mut sent = reap(&mut a.lane, 1).pop().unwrap();
        assert!(sent.is_ok() && sent.is_signaled(), "{sent:?}");
        assert_eq!((sent.wr_id(), sent.queue(), sent.qp()), (22, WorkQueue::Send, Some(a.qp)));
        assert_eq!(sent.opcode(), Some(WcOpcode::Send));
        assert!(sent.take_region().is_some(), "the send's region comes back");
        assert!(sent.take_region().is_none(), "once");
        let mut got = reap(&mut b.lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.queue(), got.byte_len()), (11, WorkQueue::Recv, 100));
        assert_eq!(got.opcode(), Some(WcOpcode::Recv));
        let mut buf = got.take_region().expect("the receive's region comes back");
        assert_eq!(&buf.as_slice().unwrap()[..100], &pattern(100, 7)[..]);
        assert_eq!(b.lane.outstanding(b.qp).unwrap(), (0, 0));
        assert!(b.lane.poll().unwrap().is_none(), "nothing more");
        drop((a, b, buf));
    }
    t.finish();
}

#[test]
fn rdma_write_read_and_fetch_add_through_the_lane() {
    let t = DeviceTest::start();
    let atomics = common::require(common::Cap::Atomics);
    {
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC;
        let (mut a, mut b) = lane_pair(t.addr, spec(access), spec(access), 64);
        let remote = b.mrs[0].remote();
        let mut src = a.mrs.remove(0);
        src.write_at(0, &pattern(64, 3)).unwrap();
        a.lane.post_send(a.qp, SendWr::write(src, 0..64, &remote, 128).wr_id(1)).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok(), "{c:?}");
        let src = c.take_region().unwrap();
        let mut seen = [0u8; 64];
        b.mrs[0].read_at(128, &mut seen).unwrap();
        assert_eq!(&seen[..], &pattern(64, 3)[..], "the WRITE landed");
        // READ it back into another region, at an offset.
        let dst = a.mrs.remove(0);
        a.lane.post_send(a.qp, SendWr::read(dst, 256..320, &remote, 128).wr_id(2)).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert_eq!((c.wr_id(), c.byte_len(), c.opcode()), (2, 64, Some(WcOpcode::RdmaRead)));
        let mut dst = c.take_region().unwrap();
        let mut back = [0u8; 64];
        dst.read_at(256, &mut back).unwrap();
        assert_eq!(back, seen);
        if !atomics {
            drop((a, b, src, dst));
            return t.finish();
        }
        // Three fetch-and-adds on the peer's first 8 bytes: each returns the value before it.
        b.mrs[0].write_at(0, &40u64.to_ne_bytes()).unwrap();
        let counter = RemoteRegion { len: 8, ..remote };
        let mut region = Some(dst);
        for (i, expect) in [40u64, 42, 44].into_iter().enumerate() {
            let w = SendWr::fetch_add(region.take().unwrap(), 8, &counter, 0, 2).wr_id(10 + i as u64);
            a.lane.post_send(a.qp, w).unwrap();
            let mut c = reap(&mut a.lane, 1).pop().unwrap();
            assert!(c.is_ok(), "{c:?}");
            let mut r = c.take_region().unwrap();
            let mut v = [0u8; 8];
            r.read_at(8, &mut v).unwrap();
            assert_eq!(u64::from_ne_bytes(v), expect, "fetch-and-add {i}");
            region = Some(r);
        }
        let mut v = [0u8; 8];
        b.mrs[0].read_at(0, &mut v).unwrap();
        assert_eq!(u64::from_ne_bytes(v), 46);
        drop((a, b, src, region));
    }
    t.finish();
}

/// Selective signaling: a list of 15 unsignaled WRITEs and one signaled, under one doorbell;
/// the one completion retires all 16, each handed out with its own region, in posting order.
#[test]
fn one_signaled_completion_retires_every_earlier_unsignaled_slot_in_order() {
    let t = DeviceTest::start();
    {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let (mut a, b) = lane_pair(t.addr, spec(access), spec(access), 64);
        let remote = b.mrs[0].remote();
        let mut regions = a.mrs.remove(0).split(256).unwrap();
        assert_eq!(regions.len(), 16);
        for _round in 0..3 {
            let wrs = std::mem::take(&mut regions).into_iter().enumerate().map(|(k, mr)| {
                let w = SendWr::write(mr, 0..64, &remote, 64 * k as u64).wr_id(100 + k as u64);
                if k < 15 {
                    w.unsignaled()
                } else {
                    w
                }
            });
            assert_eq!(a.lane.post_send_iter(a.qp, wrs).unwrap(), 16);
            assert_eq!(a.lane.outstanding(a.qp).unwrap(), (16, 0));
            let done = reap(&mut a.lane, 16);
            let ids: Vec<u64> = done.iter().map(|c| c.wr_id()).collect();
            assert_eq!(ids, (100..116).collect::<Vec<_>>(), "in posting order");
            // (iWARP signals every request: there each comes signaled.)
            let iwarp = common::caps::iwarp();
            assert!(done[..15].iter().all(|c| c.is_signaled() == iwarp && c.is_ok()));
            assert!(done[15].is_signaled() && done[15].is_ok());
            assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
            regions.extend(done.into_iter().map(|mut c| c.take_region().expect("every region comes back")));
        }
        drop(regions);
        drop((a, b));
    }
    t.finish();
}

#[test]
fn a_full_queue_refuses_and_gives_the_region_back() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lane_pair(t.addr, spec(AccessFlags::LOCAL_WRITE), spec(AccessFlags::LOCAL_WRITE), 64);
        let pd = a.pd.clone();
        // 16 receives fill the receive queue (QpInit's default depth).
        for k in 0..16 {
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            a.lane.post_recv(a.qp, RecvWr::new(mr).wr_id(k)).unwrap();
        }
        let extra = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let r = a.lane.post_recv(a.qp, RecvWr::new(extra)).unwrap_err();
        assert!(matches!(r.error(), Error::QueueFull { queue: "receive", depth: 16 }), "{r:?}");
        let mut extra = r.into_inner().expect("the region comes back");
        assert!(extra.as_mut_slice().is_ok(), "and is ours again");
        // A list longer than the send queue's room: nothing posted, every region back.
        let remote = b.mrs[0].remote();
        let wrs = (0..17).map(|_| SendWr::send(MemoryRegion::new(&pd, 64, AccessFlags::empty()).unwrap(), 0..8));
        let (e, back) = a.lane.post_send_iter(a.qp, wrs).unwrap_err().into_parts();
        assert!(matches!(e, Error::QueueFull { queue: "send", .. }), "{e}");
        assert_eq!(back.len(), 17, "16 staged and the one that did not fit");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 16));
        let _ = remote;
        drop((a, b, extra, back));
    }
    t.finish();
}

#[test]
fn posts_are_checked_before_the_provider_and_give_the_region_back() {
    let t = DeviceTest::start();
    {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let (mut a, b) = lane_pair(t.addr, spec(access), spec(access), 64);
        let remote = b.mrs[0].remote();
        let mr = a.mrs.remove(0);
        // The local range leaves the region.
        let r = a.lane.post_send(a.qp, SendWr::send(mr, 4000..4200)).unwrap_err();
        assert!(matches!(r.error(), Error::OutOfBounds { what: "memory region", .. }), "{r}");
        let mr = r.into_inner().unwrap();
        // The remote range leaves the remote region.
        let r = a.lane.post_send(a.qp, SendWr::write(mr, 0..64, &remote, 4090)).unwrap_err();
        assert!(matches!(r.error(), Error::OutOfBounds { what: "remote region", .. }), "{r}");
        let mr = r.into_inner().unwrap();
        let mut lane2 = lane_on(t.addr, 8);
        // A READ target without LOCAL_WRITE.
        let ro = MemoryRegion::new(&a.pd, 64, AccessFlags::REMOTE_READ).unwrap();
        let r = a.lane.post_send(a.qp, SendWr::read(ro, 0..8, &remote, 0)).unwrap_err();
        assert!(r.to_string().contains("LOCAL_WRITE"), "{r}");
        // A receive without LOCAL_WRITE.
        let ro = r.into_inner().unwrap();
        let r = a.lane.post_recv(a.qp, RecvWr::new(ro)).unwrap_err();
        assert!(r.to_string().contains("LOCAL_WRITE"), "{r}");
        // An unaligned atomic target.
        let r = a.lane.post_send(a.qp, SendWr::fetch_add(mr, 0, &remote, 3, 1)).unwrap_err();
        assert!(r.to_string().contains("aligned"), "{r}");
        let mr = r.into_inner().unwrap();
        // More pieces than the QP takes (created with one).
        let r = a.lane.post_send(a.qp, SendWr::send_sg(mr, &[0..8, 8..16])).unwrap_err();
        assert!(r.to_string().contains("max_send_sge"), "{r}");
        let mr = r.into_inner().unwrap();
        // A LaneQp of another lane (or none).
        let r = lane2.post_send(a.qp, SendWr::send(mr, 0..8)).unwrap_err();
        assert!(r.to_string().contains("not attached"), "{r}");
        let mr = r.into_inner().unwrap();
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0), "nothing reached the provider");
        drop((a, b, mr, lane2));
    }
    t.finish();
}

#[test]
fn attach_refuses_a_qp_of_another_cq_and_gives_the_connection_back() {
    let t = DeviceTest::start();
    {
        let mut lane = lane_on(t.addr, 64);
        let (a, b) = pair(t.addr, PairSpec::default(), PairSpec::default());
        let r = lane.attach(a.conn).unwrap_err();
        assert!(r.to_string().contains("Lane::qp_init"), "{r}");
        let conn = r.into_inner().expect("the connection comes back");
        // Soft-iWARP's ibv_query_qp reports no QP state (MATRIX.md).
        if !common::caps::iwarp() {
            assert_eq!(conn.qp().state().unwrap(), rdma_cm::QpState::ReadyToSend, "whole, and still connected");
        }
        drop((conn, b, lane));
    }
    t.finish();
}

#[test]
fn ud_datagrams_through_lanes() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = lane_ud_pair(t.addr, 7611, QpInit::new(), 64);
        let mut msg = MemoryRegion::new(&p.client.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        msg.as_mut_slice().unwrap()[..32].copy_from_slice(&pattern(32, 9));
        for k in 0..4 {
            let buf = MemoryRegion::new(&p.server.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
            p.server.lane.post_recv(p.server.qp, RecvWr::new(buf).wr_id(k)).unwrap();
        }
        let client_qpn = p.client.lane.qp_num(p.client.qp).unwrap();
        let mut msg = Some(msg);
        for k in 0..4u64 {
            let w = SendWr::send(msg.take().unwrap(), 0..32).to(p.to_server).wr_id(k);
            p.client.lane.post_send(p.client.qp, w).unwrap();
            let mut c = reap(&mut p.client.lane, 1).pop().unwrap();
            assert!(c.is_ok(), "{c:?}");
            msg = c.take_region();
            let mut r = reap(&mut p.server.lane, 1).pop().unwrap();
            assert_eq!((r.wr_id(), r.byte_len() as usize, r.src_qp()), (k, GRH_LEN + 32, client_qpn));
            let wc = *r;
            let mut buf = r.take_region().unwrap();
            let d = Datagram::parse(&wc, &mut buf, 0).unwrap();
            assert_eq!(d.len(), 32);
            assert_eq!(&buf.as_slice().unwrap()[d.payload()], &pattern(32, 9)[..]);
        }
        // Over the MTU: refused before posting.
        let big = MemoryRegion::new(&p.client.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
        let r = p.client.lane.post_send(p.client.qp, SendWr::send(big, 0..8192).to(p.to_server)).unwrap_err();
        assert!(matches!(r.error(), Error::MessageTooLong { len: 8192, .. }), "{r}");
        // No destination on UD; no room for the GRH.
        let big = r.into_inner().unwrap();
        let r = p.client.lane.post_send(p.client.qp, SendWr::send(big, 0..8)).unwrap_err();
        assert!(r.to_string().contains("destination"), "{r}");
        let small = MemoryRegion::new(&p.server.pd, GRH_LEN - 1, AccessFlags::LOCAL_WRITE).unwrap();
        let r = p.server.lane.post_recv(p.server.qp, RecvWr::new(small)).unwrap_err();
        assert!(r.to_string().contains("GRH"), "{r}");
        drop((p, msg));
    }
    t.finish();
}

/// Prepared work requests, checked and lowered once: a send and a receive posted 50 times each,
/// every completion's region re-arming its request, the data checked each time; then a list of
/// eight prepared WRITEs under one doorbell, seven unsignaled, retired by the eighth.
#[test]
fn prepared_requests_post_again_and_again_with_their_own_regions() {
    let t = DeviceTest::start();
    {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let (mut a, mut b) = lane_pair(t.addr, spec(access), spec(access), 64);
        let mut send = a.lane.prepare_send(a.qp, SendWr::send(a.mrs.remove(0), 0..256).wr_id(1)).unwrap();
        let mut recv = b.lane.prepare_recv(b.qp, RecvWr::range(b.mrs.remove(0), 0..256).wr_id(2)).unwrap();
        for k in 0..50u8 {
            send.write_at(0, &pattern(256, k)).unwrap();
            b.lane.post_prepared_recv(&mut recv).unwrap();
            a.lane.post_prepared(&mut send).unwrap();
            assert!(send.region().is_none() && recv.region().is_none(), "posted: the lane holds them");
            let mut s = reap(&mut a.lane, 1).pop().unwrap();
            assert!(s.is_ok() && s.wr_id() == 1, "{s:?}");
            send.rearm(s.take_region().unwrap()).unwrap();
            let mut r = reap(&mut b.lane, 1).pop().unwrap();
            assert_eq!((r.wr_id(), r.byte_len(), r.opcode()), (2, 256, Some(WcOpcode::Recv)), "{r:?}");
            recv.rearm(r.take_region().unwrap()).unwrap();
            let mut got = [0u8; 256];
            recv.read_at(0, &mut got).unwrap();
            assert_eq!(&got[..], &pattern(256, k)[..], "message {k}");
        }
        // A list of eight prepared WRITEs of 512-byte chunks, one doorbell, only the last signaled.
        let remote = b.mrs[0].remote();
        let chunks = a.mrs.remove(0).split(512).unwrap();
        let mut ws: Vec<_> = chunks
            .into_iter()
            .enumerate()
            .map(|(k, mut c)| {
                c.write_at(0, &pattern(512, k as u8)).unwrap();
                let w = SendWr::write(c, 0..512, &remote, k as u64 * 512).wr_id(k as u64);
                a.lane.prepare_send(a.qp, if k < 7 { w.unsignaled() } else { w }).unwrap()
            })
            .collect();
        assert_eq!(a.lane.post_prepared_list(&mut ws).unwrap(), 8);
        let done = reap(&mut a.lane, 8);
        assert_eq!(done.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        // (iWARP signals every request: there each retires its own.)
        let signaled = if common::caps::iwarp() { 8 } else { 1 };
        assert_eq!(done.iter().filter(|c| c.is_signaled()).count(), signaled, "one completion retired all eight");
        for mut c in done {
            assert!(c.is_ok(), "{c:?}");
            ws[c.wr_id() as usize].rearm(c.take_region().unwrap()).unwrap();
        }
        let mut landed = vec![0u8; 4096];
        b.mrs[0].read_at(0, &mut landed).unwrap();
        for k in 0..8 {
            assert_eq!(&landed[k * 512..(k + 1) * 512], &pattern(512, k as u8)[..], "chunk {k}");
        }
        drop((a, b, send, recv, ws));
    }
    t.finish();
}

/// A prepared datagram and receive on UD lanes: posted four times, each landing after the GRH.
#[test]
fn prepared_datagrams_through_lanes() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = lane_ud_pair(t.addr, 7612, QpInit::new(), 64);
        let mut msg = MemoryRegion::new(&p.client.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        msg.as_mut_slice().unwrap()[..32].copy_from_slice(&pattern(32, 5));
        let mut send = p.client.lane.prepare_send(p.client.qp, SendWr::send(msg, 0..32).to(p.to_server)).unwrap();
        let buf = MemoryRegion::new(&p.server.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut recv = p.server.lane.prepare_recv(p.server.qp, RecvWr::new(buf)).unwrap();
        for _ in 0..4 {
            p.server.lane.post_prepared_recv(&mut recv).unwrap();
            p.client.lane.post_prepared(&mut send).unwrap();
            let mut c = reap(&mut p.client.lane, 1).pop().unwrap();
            assert!(c.is_ok(), "{c:?}");
            send.rearm(c.take_region().unwrap()).unwrap();
            let mut r = reap(&mut p.server.lane, 1).pop().unwrap();
            assert_eq!(r.byte_len() as usize, GRH_LEN + 32, "{r:?}");
            let wc = *r;
            let mut buf = r.take_region().unwrap();
            let d = Datagram::parse(&wc, &mut buf, 0).unwrap();
            assert_eq!(&buf.as_slice().unwrap()[d.payload()], &pattern(32, 5)[..]);
            recv.rearm(buf).unwrap();
        }
        // Checked once, at prepare: over the MTU is refused there, with the region back.
        let big = MemoryRegion::new(&p.client.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
        let r = p.client.lane.prepare_send(p.client.qp, SendWr::send(big, 0..8192).to(p.to_server)).unwrap_err();
        assert!(matches!(r.error(), Error::MessageTooLong { len: 8192, .. }), "{r}");
        assert!(r.into_inner().is_some());
        drop((p, send, recv));
    }
    t.finish();
}
