//! Drops and forgets on the lane with work in flight: nothing is freed under the device. A
//! lane forgotten with an RDMA READ and a receive in flight keeps both regions registered; a
//! lane dropped with work of several pieces outstanding releases every region once its QPs are
//! destroyed; a QP removed with a receive on a chunk releases the chunk, and the registration
//! goes with its last chunk; a UD destination outlives the datagrams posted to it.

use std::sync::Arc;

use crate::common::lane::{lane_pair, lane_ud_pair, reap};
use crate::common::{pattern, require, Cap, DeviceTest, PairSpec};
use crate::shared::{count, spec, LW};
use rdma_cm::verbs::ah::{AddressHandle, GRH_LEN};
use rdma_cm::verbs::lane::{RecvWr, SendWr};
use rdma_cm::verbs::ud::UdDest;
use rdma_cm::{MemoryRegion, QpInit, WcStatus};

/// A lane forgotten with an RDMA READ in flight (on the client) and one with a receive posted
/// (on the server) leak their regions, which stay registered: the device may still write
/// them, so the memory must not go back to the allocator. The READ's data is in place when the
/// client's completion is reaped by nobody; the server's receive is still posted. Run in a
/// child process, whose exit releases what the leak kept (the kernel tears down its RDMA
/// objects).
#[test]
fn a_forgotten_lane_keeps_the_regions_of_a_read_and_a_receive_registered() {
    const CHILD: &str = "RDMA_CM_ATTACKS_LANE_FORGET_CHILD";
    const NAME: &str = "lane_drop::a_forgotten_lane_keeps_the_regions_of_a_read_and_a_receive_registered";
    let t = DeviceTest::start();
    if std::env::var_os(CHILD).is_some() {
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        s.mrs[0].write_at(0, &pattern(64, 0x5a)).unwrap();
        let remote = s.mrs[0].remote();
        let before = count("mr");
        let target = MemoryRegion::new(&c.pd, 64, LW).unwrap();
        let recv = MemoryRegion::new(&s.pd, 64, LW).unwrap();
        assert_eq!(count("mr"), before + 2);
        c.lane.post_send(c.qp, SendWr::read(target, 0..64, &remote, 0).wr_id(2)).unwrap();
        s.lane.post_recv(s.qp, RecvWr::new(recv).wr_id(1)).unwrap();
        std::mem::forget(c);
        std::mem::forget(s);
        assert_eq!(count("mr"), before + 2, "the READ's target and the receive's region stay registered");
        println!("LANE-FORGET: the regions stayed registered");
        // No finish(): the forgotten lanes are leaked on purpose; the process exit releases them.
        return;
    }
    let me = std::env::current_exe().unwrap();
    let out = std::process::Command::new(me)
        .args(["--exact", NAME, "--test-threads=1", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("LANE-FORGET: the regions stayed registered"),
        "the child failed: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    t.finish();
}

/// A lane dropped with work of several pieces outstanding (an RDMA READ scattered into three
/// pieces of one region, a send gathered from three, receives, none reaped) releases every
/// region once its QPs are destroyed, and the kernel's count of regions ends where it began.
#[test]
fn a_lane_dropped_with_multi_piece_work_outstanding_releases_every_region() {
    let t = DeviceTest::start();
    if !require(Cap::ReadScatter(3)) {
        return t.finish();
    }
    {
        let init = QpInit::new().max_send_sge(3);
        let (mut c, mut s) =
            lane_pair(t.addr, PairSpec { init: init.clone(), ..spec() }, PairSpec { init, ..spec() }, 64);
        let before = count("mr");
        for k in 0..2 {
            s.lane.post_recv(s.qp, RecvWr::new(MemoryRegion::new(&s.pd, 128, LW).unwrap()).wr_id(k)).unwrap();
        }
        let remote = s.mrs[0].remote();
        let pieces = [0..64, 128..192, 256..320];
        let read = SendWr::read_sg(MemoryRegion::new(&c.pd, 512, LW).unwrap(), &pieces, &remote, 0).wr_id(1);
        let send = SendWr::send_sg(MemoryRegion::new(&c.pd, 512, LW).unwrap(), &[0..8, 64..72, 128..136]).wr_id(2);
        assert_eq!(c.lane.post_send_iter(c.qp, [read, send]).unwrap(), 2);
        // A receive the peer never matches, on the client.
        c.lane.post_recv(c.qp, RecvWr::new(MemoryRegion::new(&c.pd, 64, LW).unwrap()).wr_id(3)).unwrap();
        assert_eq!(count("mr"), before + 5);
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (2, 1));
        drop(c);
        assert_eq!(
            count("mr"),
            before + 1,
            "the client's four regions went with it; the server's two receives and its region stay"
        );
        drop(s);
    }
    t.finish();
}

/// A region moved into a receive stays registered until its completion hands it back; a QP
/// removed from its lane with a receive posted on a chunk releases the chunk (the flush is
/// reaped by the removal), while the sibling chunk keeps the registration until it goes too.
#[test]
fn a_removed_qp_releases_its_chunk_and_the_registration_goes_with_the_last_chunk() {
    let t = DeviceTest::start();
    {
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        let mrs = count("mr");
        s.lane.post_recv(s.qp, RecvWr::new(MemoryRegion::new(&s.pd, 64, LW).unwrap()).wr_id(1)).unwrap();
        assert_eq!(count("mr"), mrs + 1, "the posted receive's region is registered");
        let mut m = MemoryRegion::new(&c.pd, 64, LW).unwrap();
        m.as_mut_slice().unwrap().copy_from_slice(&pattern(64, 3));
        c.lane.post_send(c.qp, SendWr::send(m, 0..64).wr_id(1)).unwrap();
        let mut got = reap(&mut s.lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.byte_len(), got.status()), (1, 64, WcStatus::Success));
        let mut sent = reap(&mut c.lane, 1).pop().unwrap();
        assert_eq!(count("mr"), mrs + 2, "both regions are registered until their completions are dropped");
        drop((got.take_region().unwrap(), sent.take_region().unwrap()));
        assert_eq!(count("mr"), mrs, "dropping the regions handed back deregisters them");

        // A QP removed with a receive posted on a chunk.
        let mut chunks = MemoryRegion::new(&s.pd, 128, LW).unwrap().split(64).unwrap();
        chunks[0].as_mut_slice().unwrap().fill(0x5c);
        let ch1 = chunks.pop().unwrap();
        s.lane.post_recv(s.qp, RecvWr::new(ch1).wr_id(2)).unwrap();
        assert_eq!(count("mr"), mrs + 1);
        s.lane.remove(s.qp).unwrap();
        assert_eq!(count("mr"), mrs + 1, "the removed QP's chunk was released; its sibling keeps the registration");
        assert!(chunks[0].as_slice().unwrap().iter().all(|&b| b == 0x5c));
        drop(chunks);
        assert_eq!(count("mr"), mrs, "the last chunk deregisters");
        drop((c, s));
    }
    t.finish();
}

/// A UD destination whose caller dropped every handle, with a datagram posted to it, lives as
/// long as its lane: dropping the lane releases the address handle (after the QP is
/// destroyed); forgetting it leaks the handle (safe: it outlives the QP that may still use it).
#[test]
fn dropping_or_forgetting_a_lane_with_datagrams_posted_releases_the_destination_only_after_the_qp() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    for forget in [false, true] {
        let mut p = lane_ud_pair(t.addr, 7423 + forget as u16, QpInit::new(), 64);
        let c = &mut p.client;
        let ah = AddressHandle::new(&c.pd, p.server_dest.ah().attr()).unwrap();
        let weak = Arc::downgrade(&ah);
        let dest = UdDest::new(ah, p.server_dest.qpn(), p.server_dest.qkey());
        let key = c.lane.add_dest(c.qp, &dest).unwrap();
        drop(dest);
        assert!(weak.upgrade().is_some(), "the lane holds the destination");
        let mut m = MemoryRegion::new(&c.pd, 64, LW).unwrap();
        m.as_mut_slice().unwrap().fill(9);
        c.lane.post_send(c.qp, SendWr::send(m, 0..64).to(key).wr_id(1)).unwrap();
        let s = &mut p.server;
        s.lane.post_recv(s.qp, RecvWr::new(MemoryRegion::new(&s.pd, GRH_LEN + 64, LW).unwrap())).unwrap();
        let crate::common::lane::LaneUdPair { client, server, .. } = p;
        if forget {
            // What mem::forget does, undone at the end so later tests start clean.
            let kept = std::mem::ManuallyDrop::new(client);
            assert!(weak.upgrade().is_some(), "a forgotten lane leaks its destinations");
            drop(std::mem::ManuallyDrop::into_inner(kept));
        } else {
            drop(client);
        }
        assert!(weak.upgrade().is_none(), "dropping the lane releases the destination after destroying the QP");
        drop(server);
    }
    t.finish();
}
