//! Drops, forgets and panics with work in flight: nothing freed under the device.

use crate::common::ud::{ud_pair, UdPair};
use crate::common::{out_of_reach, pair, pattern, require, Cap, DeviceTest, PairSpec, T};
use crate::support::{count, is_child, run_child, wait_count};
use rdma_cm::{AccessFlags, AddressHandle, Error, MemoryRegion, QpInit, RecvWr, SendWr, UdSendWr, WorkQueue, GRH_LEN};
use std::sync::Arc;
use std::time::Duration;

/// A panic right after posting (the endpoint unwinds with a receive and a send posted): the
/// QP's drop reaps or outlives them, and afterwards both regions are back with one owner and
/// readable; nothing is leaked on the device.
#[test]
fn a_panic_with_work_posted_leaves_the_regions_whole() {
    let t = DeviceTest::start();
    let UdPair { client, to_server, server, to_client } = ud_pair(t.addr, 7407, QpInit::new());
    let mut rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut sbuf = MemoryRegion::new(client.qp().pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
    sbuf.as_mut_slice().unwrap().fill(3);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (mut client, mut server) = (client, server);
        server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 64).wr_id(1)]).unwrap();
        client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..64).wr_id(2)]).unwrap();
        assert_eq!(rbuf.outstanding(), 1);
        panic!("a caller's bug, mid-flight");
    }));
    assert!(r.is_err());
    assert_eq!(rbuf.outstanding(), 0, "the receive's slot went with the QP");
    assert_eq!(sbuf.outstanding(), 0);
    assert!(rbuf.as_slice().is_ok() && rbuf.as_mut_slice().is_ok());
    assert!(sbuf.as_slice().unwrap().iter().all(|&b| b == 3));
    drop((to_server, to_client, rbuf, sbuf));
    t.finish();
}

/// A region dropped by its owner while a single receive names it stays registered until the
/// completion is reaped; a QP dropped with a single receive posted on a chunk releases the
/// chunk (writable again), and the registration goes when the last chunk does.
#[test]
fn regions_and_qps_dropped_with_a_single_receive_posted() {
    let t = DeviceTest::start();
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    let mrs = count("mr");
    let r = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    assert_eq!(count("mr"), mrs + 1);
    s.conn.qp_mut().post_recv(&[RecvWr::new(&r, 0..64).wr_id(1)]).unwrap();
    drop(r);
    assert_eq!(count("mr"), mrs + 1, "a region a posted receive names stays registered");
    c.mrs[0].as_mut_slice().unwrap()[..64].copy_from_slice(&pattern(64, 3));
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(1)]).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    assert_eq!(wc.byte_len(), 64);
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    wait_count("mr", mrs, "reaping the receive releases the dropped region");

    // A QP dropped with a single receive on a chunk.
    let mut chunks = MemoryRegion::new(&s.pd, 128, AccessFlags::LOCAL_WRITE).unwrap().split(64).unwrap();
    chunks[1].as_mut_slice().unwrap().fill(0x5c);
    s.conn.qp_mut().post_recv(&[RecvWr::new(&chunks[1], 0..64).wr_id(2)]).unwrap();
    out_of_reach(&mut chunks[1], "chunk with a receive, QP alive");
    drop(s.conn);
    assert_eq!(chunks[1].outstanding(), 0, "the dropped QP's receive released its hold");
    assert!(chunks[1].as_slice().unwrap().iter().all(|&b| b == 0x5c));
    assert!(chunks[1].as_mut_slice().is_ok());
    let one = chunks.pop().unwrap();
    drop(chunks);
    assert_eq!(count("mr"), mrs + 1, "one chunk keeps the registration");
    drop(one);
    wait_count("mr", mrs, "the last chunk deregisters");
    drop((c, s.mrs, s.pd));
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

/// Scatter/gather: a QP dropped with work of several pieces outstanding (a receive, a READ, a
/// gathered send, none reaped) releases every piece once it is destroyed, and the kernel's
/// accounting ends clean.
#[test]
fn a_qp_dropped_with_multi_piece_work_outstanding_releases_every_piece() {
    let t = DeviceTest::start();
    let spec = PairSpec {
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        init: QpInit::new().max_send_sge(3).max_recv_sge(3),
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, spec.clone(), spec);
    let lw = AccessFlags::LOCAL_WRITE;
    let mut r: Vec<MemoryRegion> = (0..3).map(|_| MemoryRegion::new(&s.pd, 128, lw).unwrap()).collect();
    let p0 = [(&r[0], 0..64), (&r[1], 0..64), (&r[2], 0..64)];
    let p1 = [(&r[0], 64..128), (&r[1], 64..128), (&r[2], 64..128)];
    s.conn.qp_mut().post_recv(&[RecvWr::sg(&p0).unwrap().wr_id(0), RecvWr::sg(&p1).unwrap().wr_id(1)]).unwrap();
    let mut x: Vec<MemoryRegion> = (0..3).map(|_| MemoryRegion::new(&c.pd, 64, lw).unwrap()).collect();
    let remote = s.mrs[0].remote();
    let read = [(&x[0], 0..64), (&x[1], 0..64), (&x[2], 0..64)];
    let send = [(&x[0], 0..8), (&x[1], 0..8), (&x[2], 0..8)];
    let wrs = [SendWr::read_sg(&read, &remote, 0).unwrap().wr_id(1), SendWr::send_sg(&send).unwrap().wr_id(2)];
    c.conn.qp_mut().post_send(&wrs).unwrap();
    assert!(x.iter().all(|m| m.outstanding() == 2) && r.iter().all(|m| m.outstanding() == 2));
    drop(c.conn);
    for (k, m) in x.iter_mut().enumerate() {
        assert_eq!(m.outstanding(), 0, "READ/send piece {k}");
        assert!(m.as_mut_slice().is_ok(), "READ/send piece {k} is released with the QP");
    }
    drop(s.conn);
    for (k, m) in r.iter_mut().enumerate() {
        assert_eq!(m.outstanding(), 0, "receive piece {k}");
        assert!(m.as_mut_slice().is_ok(), "receive piece {k} is released with the QP");
    }
    drop((x, r, c.mrs, c.pd, s.mrs, s.pd));
    t.finish();
}

#[test]
#[ignore = "child process of a_forgotten_connection_keeps_its_buffers_out_of_reach"]
fn child_forget() {
    if !is_child("drop::child_forget") {
        return;
    }
    let t = DeviceTest::start();
    let spec_s = PairSpec {
        mr_sizes: vec![64],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, PairSpec { mr_sizes: vec![64, 64], ..PairSpec::default() }, spec_s);
    s.mrs[0].as_mut_slice().unwrap().fill(0x5a);
    let remote = s.mrs[0].remote();
    let mut target = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&target, 0..64).wr_id(1)]).unwrap();
    // The client forgets its connection with an RDMA READ of the server's region in flight.
    c.conn.qp_mut().post_send(&[SendWr::read(&c.mrs[1], 0..64, &remote, 0).unwrap().wr_id(2)]).unwrap();
    let mut read_target = c.mrs.pop().unwrap();
    std::mem::forget(c.conn);
    // The server forgets its connection with a receive posted.
    std::mem::forget(s.conn);
    let mut b = [0u8; 4];
    for (what, mr) in [("receive target", &mut target), ("READ target", &mut read_target)] {
        assert!(matches!(mr.as_slice(), Err(Error::InFlight { .. })), "{what}");
        assert!(matches!(mr.as_mut_slice(), Err(Error::InFlight { .. })), "{what}");
        assert!(matches!(mr.read_at(0, &mut b), Err(Error::InFlight { .. })), "{what}");
        assert!(matches!(mr.write_at(0, &b), Err(Error::InFlight { .. })), "{what}");
    }
    assert!(matches!(target.split(8), Err(Error::InFlight { .. })));
    drop((read_target, c.mrs, c.pd, s.mrs, s.pd));
    println!("ADV: forgotten buffers stayed out of reach");
    // No finish(): the forgotten QPs are leaked on purpose; the process exit releases them.
}

/// `mem::forget` on connections with a receive and an RDMA READ in flight: the regions stay
/// held (no slice, no copy, no split) for ever, since the device may still write them.
#[test]
fn a_forgotten_connection_keeps_its_buffers_out_of_reach() {
    let t = DeviceTest::start();
    let (status, out) = run_child("drop::child_forget", Duration::from_secs(60));
    assert!(status.is_some_and(|s| s.success()) && out.contains("stayed out of reach"), "status {status:?}:\n{out}");
    t.finish();
}
