//! Device tests: every public type against a real RDMA device (Soft-RoCE `rxe0` in the guest).
//!
//! Each test starts with `DeviceTest::start()`, which fails when no device is present, and ends
//! with `finish()`, which fails when the kernel's resource tracking still lists a QP, CQ, MR, PD
//! or CM id of this process. A test that needs what not every device has (atomics, immediate
//! data, a scattered READ, RNR retries: Soft-iWARP has none of them) asks the device first
//! (`common::require`) and, when it lacks it, prints one `skipped: ` line and returns.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::caps::{device_under_test, iwarp};
use common::{pair, pattern, require, Cap, DeviceTest, PairSpec, T};
use rdma_cm::{
    AccessFlags, Client, CmEventType, CompletionQueue, ConnParam, ConnectRequest, Error, EventChannel, MemoryRegion,
    QpInfo, QpInit, RecvWr, SendWr, Server, WcStatus, WorkCompletion, WorkQueue,
};

const SIZES: [usize; 4] = [1, 1024, 64 * 1024, 1 << 20];

fn all_permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = vec![];
    for p in all_permutations(n - 1) {
        for i in 0..=p.len() {
            let mut q = p.clone();
            q.insert(i, n - 1);
            out.push(q);
        }
    }
    out
}

#[test]
fn every_object_opens_and_closes_in_every_drop_order() {
    let t = DeviceTest::start();
    let dst = SocketAddr::new(t.addr, 7999);
    let perms = all_permutations(5);
    assert_eq!(perms.len(), 120);
    for (k, order) in perms.iter().enumerate() {
        let ch = EventChannel::new().unwrap();
        let route = Client::on_channel(&ch).unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let ctx = route.context().unwrap();
        let pd = route.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let cq = CompletionQueue::new(&ctx, 32).unwrap();
        let mut qp = route.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq))).unwrap();
        // Leave work in flight too: the QP must flush it before releasing the region.
        qp.post_recv(&[RecvWr::new(&mr, 0..4096)]).unwrap();
        assert!(common::resource_total() >= 5, "objects should be visible to the kernel");
        let mut items: Vec<Option<Box<dyn std::any::Any>>> =
            vec![Some(Box::new(ch)), Some(Box::new(pd)), Some(Box::new(mr)), Some(Box::new(cq)), Some(Box::new(qp))];
        drop(ctx);
        for &i in order {
            drop(items[i].take());
        }
        if k % 20 == 0 || k == perms.len() - 1 {
            t.check(&format!("after drop order {order:?}"));
        }
    }
    t.finish();
}

#[test]
fn connect_and_accept_by_address_then_disconnect() {
    let t = DeviceTest::start();
    let (c, s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    assert_eq!(c.conn.peer_addr().map(|a| a.ip()), Some(t.addr));
    assert_eq!(s.conn.local_addr().map(|a| a.ip()), Some(t.addr));
    assert_eq!(c.conn.peer_addr().unwrap().port(), s.conn.local_addr().unwrap().port());
    assert_eq!(c.conn.local_addr(), s.conn.peer_addr());
    // The passive side must answer the disconnect (it does when it reads DISCONNECTED).
    let server = thread::spawn(move || {
        let mut s = s; // the whole side (not only the captured field) belongs to this thread
        let deadline = Instant::now() + T;
        while !s.conn.is_disconnected() {
            assert!(Instant::now() < deadline, "server never saw DISCONNECTED");
            if s.conn.try_event().unwrap().is_none() {
                thread::sleep(Duration::from_millis(5));
            }
        }
    });
    let common::Side { conn, pd, mrs } = c;
    conn.disconnect(T).expect("client disconnect");
    server.join().unwrap();
    drop((pd, mrs));
    t.finish();
}

#[test]
fn rejection_carries_private_data() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        assert_eq!(&req.private_data()[..5], b"hello");
        req.reject(b"go away: test").unwrap();
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    let err = q.connect(&ConnParam::new().private_data(b"hello").unwrap(), T).unwrap_err();
    srv.join().unwrap();
    match &err {
        Error::UnexpectedEvent { got: CmEventType::Rejected, private_data, status, .. } => {
            if iwarp() {
                // An MPA reject, which the iWARP CM reports as a negated errno.
                assert!(matches!(-*status, libc::ECONNRESET | libc::ECONNREFUSED), "MPA reject, status {status}");
            } else {
                assert_eq!(*status, 28, "consumer reject");
            }
            assert_eq!(&private_data[..13], b"go away: test");
        }
        e => panic!("expected REJECTED, got {e:?}"),
    }
    assert!(err.to_string().contains("REJECTED") && err.to_string().contains("refused"), "{err}");
    drop(pd);
    t.finish();
}

#[test]
fn connecting_where_nobody_listens_is_rejected_with_a_hint() {
    let t = DeviceTest::start();
    let dst = SocketAddr::new(t.addr, 7998);
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    let start = Instant::now();
    let err = q.connect(&ConnParam::new(), T).unwrap_err();
    assert!(start.elapsed() < T, "must fail before the timeout");
    let msg = err.to_string();
    if iwarp() {
        // iWARP makes the connection's TCP connect inside rdma_connect: the refusal is its error.
        assert!(matches!(err, Error::Call { op: "rdma_connect", .. }), "{err:?}");
        assert_eq!(err.errno(), Some(libc::ECONNREFUSED), "{err:?}");
    } else {
        assert!(matches!(err, Error::UnexpectedEvent { got: CmEventType::Rejected, .. }), "{err:?}");
    }
    assert!(msg.contains("nobody listens") && msg.contains(&dst.to_string()), "{msg}");
    drop(pd);
    t.finish();
}

#[test]
fn send_recv_is_byte_exact_at_1b_1k_64k_1m() {
    let t = DeviceTest::start();
    let max = *SIZES.last().unwrap();
    let spec = PairSpec { mr_sizes: vec![max], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, spec.clone(), spec);
    for (i, &n) in SIZES.iter().enumerate() {
        let want = pattern(n, i as u8);
        s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..max).wr_id(i as u64)]).unwrap();
        c.mrs[0].as_mut_slice().unwrap()[..n].copy_from_slice(&want);
        c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..n).wr_id(100 + i as u64)]).unwrap();
        let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 100 + i as u64, T).unwrap();
        assert_eq!(wc.queue(), WorkQueue::Send);
        let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, i as u64, T).unwrap();
        assert_eq!(wc.byte_len() as usize, n, "size {n}");
        assert_eq!(&s.mrs[0].as_slice().unwrap()[..n], &want[..], "payload of {n} bytes");
    }
    drop((c, s));
    t.finish();
}

/// RDMA WRITEs of 1 B to 1 MiB into a region the server advertises in its accept's private
/// data (`QpInfo`), each signalled by a SEND (RC places in order, so the
/// WRITE is in place once the SEND is received; on iWARP a WRITE completes at its sender once
/// TCP has it). Writing past the advertised region is refused before posting.
#[test]
fn rdma_write_with_qp_info_exchange_is_byte_exact() {
    let t = DeviceTest::start();
    let max = *SIZES.last().unwrap();
    let client = PairSpec { mr_sizes: vec![max], ..PairSpec::default() };
    // The server's region is remotely writable; it advertises it in the accept private data.
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let region = MemoryRegion::new(&pd, max, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        let ctl = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
        let info =
            QpInfo { qp_num: q.qp().qp_num(), psn: 0, rkey: region.rkey(), vaddr: region.addr(), len: max as u64 };
        for i in 0..SIZES.len() as u64 {
            q.post_recv(&[RecvWr::new(&ctl, 0..16).wr_id(i)]).unwrap();
        }
        let conn = q.accept(&ConnParam::new().private_data(&info.encode()).unwrap(), T).unwrap();
        (conn, region, ctl, pd)
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut src = MemoryRegion::new(&pd, max, client.access).unwrap();
    let mut sig = MemoryRegion::new(&pd, 4, AccessFlags::LOCAL_WRITE).unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    let mut conn = q.connect(&ConnParam::new(), T).unwrap();
    let (mut sconn, mut region, ctl, spd) = srv.join().unwrap();
    let (info, _) = QpInfo::decode(conn.peer_private_data()).expect("server's qp_info");
    assert_eq!(info.qp_num, sconn.qp().qp_num());
    let remote = info.region().unwrap();
    // A slice of a remotely writable region is never handed out.
    assert!(matches!(region.as_slice(), Err(Error::RemotelyWritable)));
    for (i, &n) in SIZES.iter().enumerate() {
        let want = pattern(n, 40 + i as u8);
        src.as_mut_slice().unwrap()[..n].copy_from_slice(&want);
        sig.as_mut_slice().unwrap().copy_from_slice(&(i as u32).to_be_bytes());
        let wr = SendWr::write(&src, 0..n, &remote, 0).unwrap().wr_id(i as u64);
        conn.qp_mut().post_send(&[wr, SendWr::send(&sig, 0..4).wr_id(100 + i as u64)]).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Send, 100 + i as u64, T).unwrap();
        let wc = sconn.qp_mut().wait_for(WorkQueue::Recv, i as u64, T).unwrap();
        assert_eq!(wc.byte_len(), 4, "the SEND after WRITE {i}");
        let mut got = vec![0u8; n];
        region.read_at(0, &mut got).unwrap();
        assert_eq!(got, want, "RDMA WRITE of {n} bytes");
    }
    // Writing past the advertised region is refused before anything is posted.
    assert!(matches!(SendWr::write(&src, 0..2, &remote, max as u64 - 1), Err(Error::OutOfBounds { .. })));
    drop((conn, sconn, region, ctl, spd, src, sig, pd));
    t.finish();
}

/// An RDMA WRITE with immediate data: the value reaches the peer's receive completion, and the
/// bytes its region.
#[test]
fn rdma_write_with_immediate_data_delivers_the_value() {
    let t = DeviceTest::start();
    if !require(Cap::ImmediateData) {
        return;
    }
    let spec_c = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let spec_s = PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        pre_recv: vec![(5, 0)],
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, spec_c, spec_s);
    let remote = s.mrs[0].remote();
    let want = pattern(4096, 44);
    c.mrs[0].as_mut_slice().unwrap().copy_from_slice(&want);
    let wr = SendWr::write(&c.mrs[0], 0..4096, &remote, 0).unwrap().imm(0xfeed_f00d).wr_id(1);
    c.conn.qp_mut().post_send(&[wr]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 5, T).unwrap();
    assert_eq!(wc.imm_data(), Some(0xfeed_f00d));
    let mut got = vec![0u8; 4096];
    s.mrs[0].read_at(0, &mut got).unwrap();
    assert_eq!(got, want, "the WRITE's bytes");
    drop((c, s));
    t.finish();
}

#[test]
fn rdma_read_is_byte_exact() {
    let t = DeviceTest::start();
    let max = *SIZES.last().unwrap();
    let spec_c = PairSpec { mr_sizes: vec![max], ..PairSpec::default() };
    let spec_s = PairSpec {
        mr_sizes: vec![max],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, spec_c, spec_s);
    let remote = s.mrs[0].remote();
    for (i, &n) in SIZES.iter().enumerate() {
        let want = pattern(n, 80 + i as u8);
        s.mrs[0].as_mut_slice().unwrap()[..n].copy_from_slice(&want);
        c.conn.qp_mut().post_send(&[SendWr::read(&c.mrs[0], 0..n, &remote, 0).unwrap().wr_id(i as u64)]).unwrap();
        // The destination is locked while the READ is in flight.
        let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap();
        assert_eq!(wc.byte_len() as usize, n);
        assert_eq!(&c.mrs[0].as_slice().unwrap()[..n], &want[..], "RDMA READ of {n} bytes");
    }
    drop((c, s));
    t.finish();
}

#[test]
fn inline_and_unsignaled_sends_and_batched_posts() {
    let t = DeviceTest::start();
    let spec_c = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let spec_s = PairSpec { mr_sizes: vec![16 * 64], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, spec_c, spec_s);
    // 16 receives in one batched post (the queue's whole depth), in 64-byte slots.
    let recvs: Vec<RecvWr> = (0..16).map(|k| RecvWr::new(&s.mrs[0], k * 64..(k + 1) * 64).wr_id(k as u64)).collect();
    s.conn.qp_mut().post_recv(&recvs).unwrap();
    assert_eq!(s.conn.qp().outstanding_recvs(), 16);
    assert!(matches!(s.conn.qp_mut().post_recv(&recvs[..1]), Err(Error::QueueFull { .. })));
    c.mrs[0].as_mut_slice().unwrap()[..64].copy_from_slice(&pattern(64, 1));
    let inline = pattern(40, 2);
    // 15 unsignaled sends from the region, then one signaled inline send: one batch.
    let mut wrs: Vec<SendWr> = (0..15).map(|k| SendWr::send(&c.mrs[0], 0..64).wr_id(k).unsignaled()).collect();
    wrs.push(SendWr::send_inline(&inline).wr_id(15));
    c.conn.qp_mut().post_send(&wrs).unwrap();
    assert_eq!(c.conn.qp().outstanding_sends(), 16);
    assert_eq!(c.mrs[0].outstanding(), 15, "each unsignaled send holds the region");
    assert!(matches!(c.mrs[0].as_mut_slice(), Err(Error::InFlight { outstanding: 15 })));
    // Exactly one completion: the signaled one retires the 15 before it.
    let mut wcs = [WorkCompletion::default(); 16];
    let n = c.conn.qp_mut().wait_queue(WorkQueue::Send, &mut wcs, T).unwrap();
    assert_eq!(n, 1);
    assert_eq!(wcs[0].wr_id(), 15);
    assert!(wcs[0].is_ok());
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    assert_eq!(c.mrs[0].outstanding(), 0);
    assert!(c.mrs[0].as_mut_slice().is_ok(), "region usable again after retirement");
    let mut got = 0;
    let deadline = Instant::now() + T;
    while got < 16 {
        assert!(Instant::now() < deadline, "only {got} of 16 receives completed");
        let n = s.conn.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
        for wc in &wcs[..n] {
            let wc = wc.ok().unwrap();
            assert_eq!(wc.wr_id(), got as u64, "receives complete in order");
            got += 1;
        }
    }
    let buf = s.mrs[0].as_slice().unwrap();
    for k in 0..15 {
        assert_eq!(&buf[k * 64..k * 64 + 64], &pattern(64, 1)[..], "unsignaled send {k}");
    }
    assert_eq!(&buf[15 * 64..15 * 64 + 40], &inline[..], "inline send");
    // Inline data beyond the QP's limit is refused up front.
    let big = vec![0u8; c.conn.qp().max_inline_data() as usize + 1];
    assert!(matches!(c.conn.qp_mut().post_send(&[SendWr::send_inline(&big)]), Err(Error::InvalidArgument(_))));
    // The send queue refuses more work than it holds, without posting any of it.
    let wrs: Vec<SendWr> = (0..17).map(|k| SendWr::send(&c.mrs[0], 0..1).wr_id(k)).collect();
    assert!(matches!(c.conn.qp_mut().post_send(&wrs), Err(Error::QueueFull { depth: 16, .. })));
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    drop((c, s));
    t.finish();
}

#[test]
fn receive_queue_exhaustion_gives_rnr_error() {
    let t = DeviceTest::start();
    if !require(Cap::RnrRetry) {
        return;
    }
    // The accepting side sets how often the connecting side retries on RNR.
    let spec_s = PairSpec { param: ConnParam::new().rnr_retry_count(0), ..PairSpec::default() };
    let (mut c, s) = pair(t.addr, PairSpec::default(), spec_s);
    // The server posted no receive.
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(1)]).unwrap();
    let err = c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap_err();
    match &err {
        Error::WorkCompletion { status: WcStatus::RnrRetryExcErr, wr_id: 1, .. } => {}
        e => panic!("expected RNR_RETRY_EXC_ERR, got {e:?}"),
    }
    assert!(err.to_string().contains("no receive posted"), "{err}");
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    assert!(c.mrs[0].as_mut_slice().is_ok());
    drop((c, s));
    t.finish();
}

/// [`ConnParam::min_rnr_timer`] on a connection the CM sets up (connect and accept, waited
/// for): unset, each QP keeps the CM's 0 (655 ms); set, each side's QP has its own code. A send
/// that meets no receive is NAKed (the device's RNR counter says so), and goes through, intact,
/// once the receive is posted.
#[test]
fn min_rnr_timer_is_each_sides_and_a_send_waits_for_its_receive() {
    let t = DeviceTest::start();
    if !require(Cap::RnrRetry) {
        return;
    }
    let (c, s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    assert_eq!(c.conn.qp().attributes().unwrap().min_rnr_timer, 0, "client: the CM's value");
    assert_eq!(s.conn.qp().attributes().unwrap().min_rnr_timer, 0, "server: the CM's value");
    drop((c, s));
    let spec_c = PairSpec { param: ConnParam::new().min_rnr_timer(3), ..PairSpec::default() };
    let spec_s = PairSpec { param: ConnParam::new().min_rnr_timer(1), ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, spec_c, spec_s);
    assert_eq!(c.conn.qp().attributes().unwrap().min_rnr_timer, 3, "client");
    assert_eq!(s.conn.qp().attributes().unwrap().min_rnr_timer, 1, "server");
    let counter = format!("/sys/class/infiniband/{}/ports/1/hw_counters/rcvd_rnr_err", device_under_test());
    let rnr = || std::fs::read_to_string(&counter).ok().and_then(|v| v.trim().parse::<u64>().ok());
    let Some(before) = rnr() else {
        common::caps::skipped("the RNR wait", &format!("the device has no {counter}"));
        return;
    };
    c.mrs[0].as_mut_slice().unwrap()[..64].copy_from_slice(&pattern(64, 4));
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(1)]).unwrap();
    let deadline = Instant::now() + T;
    while rnr().unwrap_or(0) == before {
        assert!(Instant::now() < deadline, "no RNR NAK counted in {T:?} ({counter})");
        std::thread::yield_now();
    }
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(2)]).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 2, T).expect("server: the retried send arrives");
    assert_eq!(wc.byte_len(), 64);
    assert_eq!(&s.mrs[0].as_slice().unwrap()[..64], &pattern(64, 4)[..]);
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).expect("client: the send completes");
    drop((c, s));
    t.finish();
}

#[test]
fn message_larger_than_receive_buffer_fails_cleanly() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { pre_recv: vec![(7, 16)], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(1)]).unwrap();
    let serr = s.conn.qp_mut().wait_for(WorkQueue::Recv, 7, T).unwrap_err();
    // rxe reports LOC_QP_OP_ERR here; hardware usually reports LOC_LEN_ERR.
    assert!(
        matches!(serr, Error::WorkCompletion { status: WcStatus::LocLenErr | WcStatus::LocQpOpErr, .. }),
        "{serr:?}"
    );
    match c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T) {
        // iWARP: a send completes once TCP has its data, before the peer has placed it; the
        // peer's failure then ends the connection (the receiver's QP terminates it), which the
        // sender learns from its DISCONNECTED.
        Ok(_) if iwarp() => {
            let ev = c.conn.next_event(T).expect("the sender learns that the connection ended");
            assert_eq!(ev.event_type(), CmEventType::Disconnected);
            assert!(c.conn.is_disconnected());
        }
        Ok(wc) => panic!("the sender's send succeeded into a too-small receive: {wc:?}"),
        Err(cerr) => assert!(matches!(cerr, Error::WorkCompletion { .. } | Error::Disconnected { .. }), "{cerr:?}"),
    }
    drop((c, s));
    t.finish();
}

#[test]
fn peer_that_leaves_flushes_the_survivors_receive_quickly() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { pre_recv: vec![(3, 64)], ..PairSpec::default() };
    let (c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    let start = Instant::now();
    drop(c); // the client goes away without sending
    let err = s.conn.qp_mut().wait_for(WorkQueue::Recv, 3, T).unwrap_err();
    let took = start.elapsed();
    if iwarp() && !s.conn.is_disconnected() {
        // iWARP flushes the QP when its TCP connection closes, which comes before the CM's
        // DISCONNECTED: the wait ends on the flush, and the event follows.
        assert!(matches!(err, Error::WorkCompletion { status: WcStatus::WrFlushErr, wr_id: 3, .. }), "{err:?}");
        let ev = s.conn.next_event(T).expect("DISCONNECTED follows the flush");
        assert_eq!(ev.event_type(), CmEventType::Disconnected);
        assert!(s.conn.is_disconnected());
    } else {
        assert!(matches!(err, Error::Disconnected { .. }), "{err:?}");
    }
    eprintln!("measured: survivor's receive failed {took:?} after the peer left");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(s.conn.qp().outstanding_recvs(), 0, "the flush retired the receive");
    assert!(s.mrs[0].as_mut_slice().is_ok());
    drop(s);
    t.finish();
}

#[test]
fn region_stays_owned_by_the_qp_while_in_flight_even_if_dropped() {
    let t = DeviceTest::start();
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    let mut target = MemoryRegion::new(&s.pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&target, 0..256).wr_id(9)]).unwrap();
    assert!(matches!(target.as_slice(), Err(Error::InFlight { outstanding: 1 })));
    assert!(matches!(target.read_at(0, &mut [0u8; 4]), Err(Error::InFlight { .. })));
    drop(target); // the receive still holds the memory
    c.mrs[0].as_mut_slice().unwrap()[..256].copy_from_slice(&pattern(256, 9));
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..256).wr_id(1)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 9, T).unwrap();
    assert_eq!(wc.byte_len(), 256);
    drop((c, s));
    t.finish();
}

#[test]
fn panic_with_work_in_flight_releases_everything() {
    let t = DeviceTest::start();
    let addr = t.addr;
    let r = std::panic::catch_unwind(move || {
        let spec = PairSpec { pre_recv: vec![(1, 4096)], ..PairSpec::default() };
        let (_c, _s) = pair(addr, spec.clone(), spec);
        panic!("user code panics while receives are posted");
    });
    assert!(r.is_err());
    t.finish();
}

#[test]
fn hundred_connections_through_one_event_channel() {
    const N: usize = 100;
    let t = DeviceTest::start();
    // Both ends of every connection are in this process, each QP with its CQ.
    if !require(Cap::CompletionQueues(2 * N)) {
        return;
    }
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(128).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let mut accepting = HashMap::new();
        let mut conns = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        while conns.len() < N {
            assert!(Instant::now() < deadline, "only {} of {N} established", conns.len());
            let ev = ch.get_event(T).expect("server event");
            match ev.event_type() {
                CmEventType::ConnectRequest => {
                    let req = ConnectRequest::from_event(ev).unwrap();
                    let pd = req.alloc_pd().unwrap();
                    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
                    let mut q = req.create_qp(&pd, QpInit::new().max_send_wr(2).max_recv_wr(2)).unwrap();
                    q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(0)]).unwrap();
                    let acc = q.start_accept(&ConnParam::new()).unwrap();
                    accepting.insert(acc.handle(), (acc, mr));
                }
                CmEventType::Established => {
                    let (acc, mr) = accepting.remove(&ev.id()).expect("ESTABLISHED for a known id");
                    conns.push((acc.complete(ev).unwrap(), mr));
                }
                other => panic!("unexpected {other} on the shared channel"),
            }
        }
        drop(listener);
        conns
    });
    // 10 client threads connect 10 times each.
    let clients: Vec<_> = (0..10)
        .map(|th| {
            thread::spawn(move || {
                (0..10)
                    .map(|k| {
                        let route =
                            Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
                        let pd = route.alloc_pd().unwrap();
                        let mut mr = MemoryRegion::new(&pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
                        mr.as_mut_slice().unwrap().copy_from_slice(&((th * 10 + k) as u64).to_be_bytes());
                        let q = route.create_qp(&pd, QpInit::new().max_send_wr(2).max_recv_wr(2)).unwrap();
                        (q.connect(&ConnParam::new(), T).expect("client connect"), mr)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut client_conns: Vec<_> = clients.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let mut server_conns = server.join().unwrap();
    assert_eq!(client_conns.len(), N);
    assert_eq!(server_conns.len(), N);
    assert!(common::resources().iter().any(|(k, n)| *k == "qp" && *n >= 2 * N), "{:?}", common::resources());
    for (conn, mr) in &mut client_conns {
        conn.qp_mut().post_send(&[SendWr::send(mr, 0..8).wr_id(1)]).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    }
    let mut seen = [false; N];
    for (conn, mr) in &mut server_conns {
        let wc = conn.qp_mut().wait_for(WorkQueue::Recv, 0, T).unwrap();
        assert_eq!(wc.byte_len(), 8);
        let mut b = [0u8; 8];
        mr.read_at(0, &mut b).unwrap();
        let idx = u64::from_be_bytes(b) as usize;
        assert!(idx < N && !seen[idx], "message {idx} duplicated or out of range");
        seen[idx] = true;
    }
    assert!(seen.iter().all(|&s| s));
    drop(client_conns);
    drop(server_conns);
    t.finish();
}

/// Connects a client whose id has type of service 32, ACK timeout 14 and retry count 5 to
/// `listener` (at `at`), whose accepted id gets ACK timeout 16. Returns (client, server, and
/// the PDs to drop after them).
fn connect_with_options(
    listener: &rdma_cm::Listener,
    at: SocketAddr,
) -> (rdma_cm::Connection, rdma_cm::Connection, Arc<rdma_cm::ProtectionDomain>, Arc<rdma_cm::ProtectionDomain>) {
    let client = thread::spawn(move || {
        let c = Client::new().unwrap();
        c.id().set_tos(32).unwrap();
        let route = c.resolve_addr(None, at, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let q = route.create_qp(&pd, QpInit::new()).unwrap();
        q.id().set_ack_timeout(14).unwrap();
        let conn = q.connect(&ConnParam::new().retry_count(5), T).unwrap();
        (conn, pd)
    });
    let req = listener.get_request(T).unwrap();
    let pd = req.alloc_pd().unwrap();
    let sq = req.create_qp(&pd, QpInit::new()).unwrap();
    sq.id().set_ack_timeout(16).unwrap();
    let server = sq.accept(&ConnParam::new(), T).unwrap();
    let (conn, cpd) = client.join().unwrap();
    (conn, server, cpd, pd)
}

/// The id options every transport takes: address reuse lets two ids bind one port while an id
/// without it is refused; a bad ACK timeout exponent is refused before any call; an id with a
/// type of service, an ACK timeout and a retry count connects, and its QP reports a valid path
/// MTU. (What those options become in the QP: `ack_timeout_retry_count_and_tos_reach_the_qp`.)
#[test]
fn cm_options_reach_the_kernel_and_bad_values_are_refused() {
    let t = DeviceTest::start();
    // Address reuse: two ids with it share a port (until one listens); one without it is refused.
    let at = SocketAddr::new(t.addr, 7993);
    let first = Server::new().unwrap();
    first.id().set_reuse_addr(true).unwrap();
    let first = first.bind(at).unwrap();
    let second = Server::new().unwrap();
    second.id().set_reuse_addr(true).unwrap();
    let second = second.bind(at).expect("a second id with REUSEADDR binds the same address");
    let err = Server::new().unwrap().bind(at).expect_err("an id without REUSEADDR must be refused");
    assert_eq!(err.errno(), Some(libc::EADDRINUSE), "{err}");
    drop(second);
    let listener = first.listen(4).unwrap();
    let err = listener.id().set_ack_timeout(32).expect_err("exponent 32 is out of range");
    assert!(matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("0..=31"), "{err}");
    let (conn, server, cpd, spd) = connect_with_options(&listener, at);
    let c = conn.qp().attributes().unwrap();
    assert!((256..=4096).contains(&c.path_mtu) && c.path_mtu.is_power_of_two(), "{c:?}");
    drop((conn, server, cpd, spd, listener));
    t.finish();
}

/// What the id options become in an InfiniBand-transport QP (`ibv_query_qp`): the ACK timeout
/// and retry count are what the QPs run with, and the type of service is the path's traffic
/// class.
#[test]
fn ack_timeout_retry_count_and_tos_reach_the_qp() {
    use rdma_cm::QpState;
    let t = DeviceTest::start();
    if !require(Cap::IbQpAttributes) {
        return;
    }
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let at = listener.local_addr().unwrap();
    let (conn, server, cpd, spd) = connect_with_options(&listener, at);
    let (c, s) = (conn.qp().attributes().unwrap(), server.qp().attributes().unwrap());
    assert_eq!((c.state, s.state), (QpState::ReadyToSend, QpState::ReadyToSend));
    assert_eq!((c.ack_timeout, s.ack_timeout), (14, 16), "client {c:?}\nserver {s:?}");
    assert_eq!(c.retry_count, 5, "{c:?}");
    assert_eq!((c.dest_qp_num, s.dest_qp_num), (server.qp().qp_num(), conn.qp().qp_num()));
    assert!((256..=4096).contains(&c.path_mtu) && c.path_mtu.is_power_of_two(), "{c:?}");
    // The type of service the client's id was given is its path's traffic class (RoCE).
    assert_eq!(c.traffic_class, 32, "{c:?}");
    drop((conn, server, cpd, spd, listener));
    t.finish();
}

/// Ports and GID tables, typed, agree with what sysfs shows: the state, link layer and MTU of
/// each port, and every valid GID with its type and netdev; the device's address is a RoCE v2
/// GID (on an iWARP device, whose GIDs are not IP addresses, its netdev's MAC is GID 0); a port
/// the device lacks is refused naming the ones it has.
#[test]
fn ports_and_gid_tables_match_sysfs() {
    use rdma_cm::{GidType, LinkLayer, PortState, VerbsContext};
    let t = DeviceTest::start();
    let devices = rdma_cm::devices().unwrap();
    assert!(!devices.is_empty());
    let mut found_addr = false;
    for d in &devices {
        let ctx = VerbsContext::open(&d.name).unwrap();
        let iwarp = common::caps::iwarp_context(&ctx);
        let ports = ctx.ports().unwrap();
        assert_eq!(ports.len(), usize::from(ctx.port_count().unwrap()));
        let sys = std::path::Path::new("/sys/class/infiniband").join(&d.name).join("ports");
        let read = |p: std::path::PathBuf| std::fs::read_to_string(&p).map(|s| s.trim().to_string()).ok();
        for p in &ports {
            let dir = sys.join(p.port.to_string());
            let state = read(dir.join("state")).unwrap();
            assert!(state.ends_with(&p.state.to_string()), "{}: sysfs {state:?}, verbs {}", d.name, p.state);
            let ll = read(dir.join("link_layer")).unwrap();
            assert_eq!(ll, p.link_layer.to_string(), "{}", d.name);
            // Each an IB MTU. (Not active <= max: siw on 6.12 says max_mtu 256 with active_mtu
            // 4096 on the guest's dummy netdev; on 6.1 it says 4096 for both.)
            let ib_mtu = |m: u32| (256..=4096).contains(&m) && m.is_power_of_two();
            assert!(ib_mtu(p.active_mtu) && ib_mtu(p.max_mtu), "{p:?}");
            let gids = ctx.gid_table(p.port).unwrap();
            assert!(!gids.is_empty() || p.state != PortState::Active, "an active port has GIDs: {p:?}");
            for g in &gids {
                assert_eq!(read(dir.join("gids").join(g.index.to_string())).unwrap(), g.gid.to_string());
                let ty = read(dir.join("gid_attrs/types").join(g.index.to_string())).unwrap();
                let expect = match g.gid_type {
                    GidType::RoceV2 => "RoCE v2",
                    GidType::RoceV1 | GidType::Ib => "IB/RoCE v1",
                    other => panic!("unexpected GID type {other}"),
                };
                assert_eq!(ty, expect, "{g:?}");
                let ndev = read(dir.join("gid_attrs/ndevs").join(g.index.to_string()));
                assert_eq!(ndev, g.netdev, "{g:?}");
                if p.link_layer == LinkLayer::Ethernet
                    && g.gid_type == GidType::RoceV2
                    && g.gid.ipv4() == Some(ipv4(t.addr))
                {
                    found_addr = true;
                }
            }
            // iWARP: GID 0 is the netdev's MAC address (the rest zero), on the device's netdev.
            let netdev = common::netdev_of(&d.name, p.port);
            if iwarp
                && p.state == PortState::Active
                && netdev.as_deref().and_then(common::ipv4_of) == Some(ipv4(t.addr))
            {
                let mac = read(std::path::Path::new("/sys/class/net").join(netdev.unwrap()).join("address")).unwrap();
                let g0 = gids.iter().find(|g| g.index == 0).expect("an active iWARP port has GID 0");
                let hex: Vec<String> = g0.gid.0[..6].iter().map(|b| format!("{b:02x}")).collect();
                assert_eq!(hex.join(":"), mac, "{g0:?}");
                assert!(g0.gid.0[6..].iter().all(|&b| b == 0), "{g0:?}");
                found_addr = true;
            }
        }
        let n = ports.len();
        let err = ctx.port(n as u8 + 1).expect_err("a port beyond the last");
        assert!(matches!(err, Error::InvalidArgument(_)) && err.to_string().contains(&format!("1..={n}")), "{err}");
        assert!(matches!(ctx.port(0), Err(Error::InvalidArgument(_))));
    }
    assert!(found_addr, "the device address {} should be a RoCE v2 GID of some port (iWARP: its netdev's MAC)", t.addr);
    t.finish();
}

fn ipv4(a: std::net::IpAddr) -> std::net::Ipv4Addr {
    match a {
        std::net::IpAddr::V4(v) => v,
        std::net::IpAddr::V6(v) => v.to_ipv4_mapped().expect("an IPv4 device address"),
    }
}

/// Fetch-and-add and compare-and-swap on the peer's REMOTE_ATOMIC region: each returns the
/// value it found, the result region stays out of reach while the device may write it, the
/// peer sees the final value; misaligned, wrongly sized and out-of-range targets are refused
/// before posting, and a region without REMOTE_ATOMIC fails with a remote access error.
#[test]
fn atomics_fetch_add_and_compare_swap_on_the_peer() {
    use rdma_cm::WcOpcode;
    let t = DeviceTest::start();
    if !require(Cap::Atomics) {
        return;
    }
    let cspec = PairSpec { mr_sizes: vec![64], access: AccessFlags::LOCAL_WRITE, ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![64],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    s.mrs[0].write_at(8, &100u64.to_ne_bytes()).unwrap();
    let remote = s.mrs[0].remote();
    // Posts one atomic on the 8 bytes at offset 8 of the peer's region, result into 16..24.
    let run = |c: &mut common::Side, id: u64, compare_swap: Option<(u64, u64)>, add: u64| -> u64 {
        let wr = match compare_swap {
            Some((cmp, swap)) => SendWr::compare_swap(&c.mrs[0], 16..24, &remote, 8, cmp, swap),
            None => SendWr::fetch_add(&c.mrs[0], 16..24, &remote, 8, add),
        };
        c.conn.qp_mut().post_send(&[wr.unwrap().wr_id(id)]).unwrap();
        // The device writes the original value into the result range: no slice meanwhile.
        assert!(matches!(c.mrs[0].as_slice(), Err(Error::InFlight { .. })), "result region must be held");
        let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, id, T).unwrap();
        assert!(matches!(wc.opcode(), Some(WcOpcode::FetchAdd | WcOpcode::CompSwap)), "{wc:?}");
        let mut v = [0u8; 8];
        c.mrs[0].read_at(16, &mut v).unwrap();
        u64::from_ne_bytes(v)
    };
    assert_eq!(run(&mut c, 1, None, 5), 100);
    assert_eq!(run(&mut c, 2, None, 7), 105);
    assert_eq!(run(&mut c, 3, Some((112, 42)), 0), 112, "compare matched: swapped");
    assert_eq!(run(&mut c, 4, Some((999, 1)), 0), 42, "compare did not match: left alone");
    let mut v = [0u8; 8];
    s.mrs[0].read_at(8, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 42, "the peer's integer after add 5, add 7, swap to 42, failed swap");
    // Bad input, refused before posting.
    let e = SendWr::fetch_add(&c.mrs[0], 16..24, &remote, 4, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("8-byte aligned"), "{e}");
    let e = SendWr::fetch_add(&c.mrs[0], 16..20, &remote, 8, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("8 bytes"), "{e}");
    let e = SendWr::compare_swap(&c.mrs[0], 16..24, &remote, 60, 0, 1).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    let wr = SendWr::fetch_add(&c.mrs[0], 16..24, &remote, 8, 1).unwrap().imm(7);
    let e = c.conn.qp_mut().post_send(&[wr]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A region the peer did not open to atomics: the device refuses at the peer.
    let mut plain = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let wr = SendWr::fetch_add(&c.mrs[0], 16..24, &plain.remote(), 8, 1).unwrap().wr_id(9);
    c.conn.qp_mut().post_send(&[wr]).unwrap();
    match c.conn.qp_mut().wait_for(WorkQueue::Send, 9, T) {
        Err(Error::WorkCompletion { status, .. }) => assert_eq!(status, WcStatus::RemAccessErr),
        other => panic!("expected REM_ACCESS_ERR, got {other:?}"),
    }
    plain.read_at(8, &mut v).unwrap();
    assert_eq!(v, [0; 8], "the refused atomic changed nothing");
    drop((c, s, plain));
    t.finish();
}

/// Names through `rdma_getaddrinfo`: a numeric address and port come back as themselves, a
/// name resolves (localhost), a listener bound to what `lookup_passive` gives is reached at
/// what `lookup` gives, and a name that does not exist is an error that names it.
#[test]
fn lookup_resolves_names_for_connecting_and_listening() {
    let t = DeviceTest::start();
    let host = t.addr.to_string();
    assert_eq!(rdma_cm::lookup(&host, "7994").unwrap(), vec![SocketAddr::new(t.addr, 7994)]);
    let local = rdma_cm::lookup("localhost", "7994").unwrap();
    assert!(local.iter().all(|a| a.ip().is_loopback() && a.port() == 7994) && !local.is_empty(), "{local:?}");
    let bind = rdma_cm::lookup_passive(Some(&host), "7994").unwrap()[0];
    assert_eq!(bind, SocketAddr::new(t.addr, 7994));
    let wildcard = rdma_cm::lookup_passive(None, "7994").unwrap();
    assert!(wildcard.iter().all(|a| a.ip().is_unspecified()), "{wildcard:?}");
    let listener = Server::new().unwrap().bind(bind).unwrap().listen(1).unwrap();
    let dst = rdma_cm::lookup(&host, "7994").unwrap()[0];
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
        (conn, pd)
    });
    let req = listener.get_request(T).unwrap();
    let pd = req.alloc_pd().unwrap();
    let server = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
    let (conn, _cpd) = client.join().unwrap();
    assert_eq!(conn.peer_addr(), Some(dst));
    let err = rdma_cm::lookup("no-such-host.invalid", "7994").unwrap_err();
    assert!(matches!(err, Error::Lookup { .. }) && err.to_string().contains("no-such-host.invalid:7994"), "{err}");
    let err = rdma_cm::lookup("a\0b", "1").unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    drop((conn, server, _cpd, pd, listener));
    t.finish();
}

/// A send gathered from 3 pieces of 2 regions lands in a receive scattered over 2 pieces of the
/// peer's 2 regions: every byte checked in place, the bytes around the pieces untouched.
#[test]
fn scatter_gather_send_of_3_pieces_into_a_2_piece_receive() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![4096, 4096], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec { mr_sizes: vec![4096, 4096], init: QpInit::new().max_recv_sge(2), ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    assert_eq!((c.conn.qp().max_send_sge(), s.conn.qp().max_recv_sge()), (3, 2));
    assert_eq!((c.conn.qp().max_recv_sge(), s.conn.qp().max_send_sge()), (1, 1), "the defaults are one piece");
    c.mrs[0].as_mut_slice().unwrap().copy_from_slice(&pattern(4096, 1));
    c.mrs[1].as_mut_slice().unwrap().copy_from_slice(&pattern(4096, 2));
    let (a, b) = (pattern(4096, 1), pattern(4096, 2));
    let want = [&a[0..100], &b[1000..1300], &a[2000..2050]].concat();
    assert_eq!(want.len(), 450);
    // 200 + 300 bytes of room for 450.
    let rpieces = [(&s.mrs[0], 100..300), (&s.mrs[1], 0..300)];
    let recv = RecvWr::sg(&rpieces).unwrap().wr_id(5);
    assert_eq!(recv.num_pieces(), 2);
    s.conn.qp_mut().post_recv(&[recv]).unwrap();
    let spieces = [(&c.mrs[0], 0..100), (&c.mrs[1], 1000..1300), (&c.mrs[0], 2000..2050)];
    let send = SendWr::send_sg(&spieces).unwrap().wr_id(6);
    assert_eq!(send.num_pieces(), 3);
    c.conn.qp_mut().post_send(&[send]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 6, T).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 5, T).unwrap();
    assert_eq!(wc.byte_len(), 450);
    let s0 = s.mrs[0].as_slice().unwrap().to_vec();
    let s1 = s.mrs[1].as_slice().unwrap().to_vec();
    assert_eq!(&s0[100..300], &want[..200], "the first receive piece holds the first 200 bytes");
    assert_eq!(&s1[..250], &want[200..], "the second holds the other 250");
    assert!(s0[..100].iter().chain(&s0[300..]).all(|&b| b == 0), "bytes around the first piece untouched");
    assert!(s1[250..].iter().all(|&b| b == 0), "the rest of the second piece untouched");
    drop((c, s));
    t.finish();
}

/// A gathered RDMA WRITE: 3 pieces of 2 regions land, in order, at an offset of the peer's
/// region, and nothing around them; a list that would overrun the remote region is refused.
/// The peer learns that the WRITE is placed from a SEND posted after it (RC places in order;
/// on iWARP a WRITE completes at its sender once TCP has it, before it is placed).
#[test]
fn rdma_write_gathered_from_3_pieces() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![4096, 4096], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![8192, 64],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let remote = s.mrs[0].remote();
    // WRITE: 64 + 1000 + 7 bytes gathered, landing at offset 512 of the peer's region.
    c.mrs[0].as_mut_slice().unwrap().copy_from_slice(&pattern(4096, 3));
    c.mrs[1].as_mut_slice().unwrap().copy_from_slice(&pattern(4096, 4));
    let (a, b) = (pattern(4096, 3), pattern(4096, 4));
    let want = [&b[3000..3064], &a[10..1010], &b[0..7]].concat();
    let pieces = [(&c.mrs[1], 3000..3064), (&c.mrs[0], 10..1010), (&c.mrs[1], 0..7)];
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[1], 0..64).wr_id(7)]).unwrap();
    let wr = SendWr::write_sg(&pieces, &remote, 512).unwrap().wr_id(1);
    c.conn.qp_mut().post_send(&[wr, SendWr::send(&c.mrs[0], 0..8).wr_id(2)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 7, T).unwrap().byte_len(), 8);
    let mut got = vec![0u8; 8192];
    s.mrs[0].read_at(0, &mut got).unwrap();
    assert_eq!(&got[512..512 + 1071], &want[..], "the gathered WRITE");
    assert!(got[..512].iter().chain(&got[512 + 1071..]).all(|&b| b == 0), "nothing written around it");
    // The whole list must fit the remote region.
    let e = SendWr::write_sg(&pieces, &remote, 8192 - 1070).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { len: 1071, .. }), "{e:?}");
    drop((c, s));
    t.finish();
}

/// A scattered RDMA READ: 4096 bytes of the peer's region land in 96 + 3000 + 1000 bytes of 2
/// regions, in order, and nothing around them.
#[test]
fn rdma_read_scattered_into_3_pieces() {
    let t = DeviceTest::start();
    if !require(Cap::ReadScatter(3)) {
        return;
    }
    let cspec = PairSpec { mr_sizes: vec![4096, 4096], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    assert!(c.conn.qp().max_read_sge() >= 3, "the device reads into 3 pieces: {}", c.conn.qp().max_read_sge());
    let remote = s.mrs[0].remote();
    let src = pattern(8192, 5);
    s.mrs[0].write_at(0, &src).unwrap();
    c.mrs[0].as_mut_slice().unwrap().fill(0);
    c.mrs[1].as_mut_slice().unwrap().fill(0);
    let pieces = [(&c.mrs[0], 4000..4096), (&c.mrs[1], 50..3050), (&c.mrs[0], 0..1000)];
    let wr = SendWr::read_sg(&pieces, &remote, 1000).unwrap().wr_id(2);
    c.conn.qp_mut().post_send(&[wr]).unwrap();
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    assert_eq!(wc.byte_len(), 4096);
    let (a, b) = (c.mrs[0].as_slice().unwrap().to_vec(), c.mrs[1].as_slice().unwrap().to_vec());
    assert_eq!(&a[4000..4096], &src[1000..1096], "first READ piece");
    assert_eq!(&b[50..3050], &src[1096..4096], "second READ piece");
    assert_eq!(&a[..1000], &src[4096..5096], "third READ piece");
    assert!(a[1000..4000].iter().all(|&x| x == 0) && b[..50].iter().chain(&b[3050..]).all(|&x| x == 0));
    drop((c, s));
    t.finish();
}

/// A receive of 4 pieces (3 regions, one of them chunks of a split registration) posted on a
/// shared receive queue, consumed by an attached QP.
#[test]
fn srq_receive_of_4_pieces() {
    use rdma_cm::SharedReceiveQueue;
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let want = pattern(3000, 6);
    let sent = want.clone();
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        mr.as_mut_slice().unwrap()[..3000].copy_from_slice(&sent);
        let mut conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
        conn.qp_mut().post_send(&[SendWr::send(&mr, 0..3000).wr_id(1)]).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
        (conn, mr, pd)
    });
    let req = listener.get_request(T).unwrap();
    let pd = req.alloc_pd().unwrap();
    let srq = SharedReceiveQueue::with_sge(&pd, 4, 4).unwrap();
    assert_eq!(srq.max_sge(), 4);
    let mut a = MemoryRegion::new(&pd, 1024, AccessFlags::LOCAL_WRITE).unwrap();
    let mut b = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mut chunks = MemoryRegion::new(&pd, 2048, AccessFlags::LOCAL_WRITE).unwrap().split(1024).unwrap();
    {
        // 1000 + 1000 + 96 + 924 bytes of room for 3000.
        let pieces = [(&a, 24..1024), (&chunks[1], 0..1000), (&b, 4000..4096), (&chunks[0], 100..1024)];
        srq.post_recv(&[RecvWr::sg(&pieces).unwrap().wr_id(9)]).unwrap();
    }
    assert_eq!(srq.outstanding(), 1);
    let mut conn = req.create_qp(&pd, QpInit::new().srq(&srq)).unwrap().accept(&ConnParam::new(), T).unwrap();
    let wc = conn.qp_mut().wait_for(WorkQueue::Recv, 9, T).unwrap();
    assert_eq!(wc.byte_len(), 3000);
    assert_eq!(srq.outstanding(), 0);
    let mut got = a.as_slice().unwrap()[24..1024].to_vec();
    got.extend_from_slice(&chunks[1].as_slice().unwrap()[..1000]);
    got.extend_from_slice(&b.as_slice().unwrap()[4000..4096]);
    got.extend_from_slice(&chunks[0].as_slice().unwrap()[100..1004]);
    assert_eq!(got, want, "every byte in its piece, in order");
    assert!(a.as_slice().unwrap()[..24].iter().all(|&x| x == 0));
    assert!(chunks[0].as_slice().unwrap()[1004..].iter().all(|&x| x == 0), "the last piece's tail untouched");
    assert!(chunks[0].as_mut_slice().is_ok() && b.as_mut_slice().is_ok() && a.as_mut_slice().is_ok());
    let peer = client.join().unwrap();
    drop((peer, conn, srq, a, b, chunks, pd, listener));
    t.finish();
}

/// Scatter/gather limits, each refused with `InvalidArgument` (or `OutOfBounds`) before
/// anything is posted: more pieces than the queue takes (alone or in a batch), an empty list,
/// more than `MAX_SGE`, an empty piece among several, a piece on another PD, out of bounds, or
/// without LOCAL_WRITE where the device writes; and queue sizes the crate cannot take.
#[test]
fn scatter_gather_limits_are_checked_before_posting() {
    use rdma_cm::{ProtectionDomain, SharedReceiveQueue, MAX_SGE};
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![4096, 4096], init: QpInit::new().max_send_sge(2), ..PairSpec::default() };
    let sspec = PairSpec { mr_sizes: vec![4096, 4096], init: QpInit::new().max_recv_sge(2), ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let invalid = |r: rdma_cm::Result<()>, needle: &str| match r {
        Err(Error::InvalidArgument(m)) => assert!(m.contains(needle), "{m:?} should mention {needle:?}"),
        other => panic!("expected InvalidArgument mentioning {needle:?}, got {other:?}"),
    };
    let held = |c: &common::Side, s: &common::Side| {
        (
            c.conn.qp().outstanding_sends(),
            s.conn.qp().outstanding_recvs(),
            c.mrs[0].outstanding() + c.mrs[1].outstanding(),
        )
    };
    // More pieces than the QP takes: 3 on a queue of 2 (the message names the limit and the setter).
    let three = [(&c.mrs[0], 0..8), (&c.mrs[1], 0..8), (&c.mrs[0], 8..16)];
    let two = [(&c.mrs[0], 0..8), (&c.mrs[1], 0..8)];
    invalid(c.conn.qp_mut().post_send(&[SendWr::send_sg(&three).unwrap()]), "QpInit::max_send_sge");
    invalid(c.conn.qp_mut().post_send(&[SendWr::send_sg(&three).unwrap()]), "limit of 2");
    // In a batch: the valid ones before it are not posted either.
    let batch = [SendWr::send_sg(&two).unwrap(), SendWr::send(&c.mrs[0], 0..8), SendWr::send_sg(&three).unwrap()];
    invalid(c.conn.qp_mut().post_send(&batch), "max_send_sge");
    assert_eq!(held(&c, &s), (0, 0, 0), "nothing was posted or held");
    let rthree = [(&s.mrs[0], 0..8), (&s.mrs[1], 0..8), (&s.mrs[0], 8..16)];
    invalid(s.conn.qp_mut().post_recv(&[RecvWr::sg(&rthree).unwrap()]), "QpInit::max_recv_sge");
    // The receive queue of the sender was left at one piece.
    let rtwo = [(&c.mrs[0], 0..8), (&c.mrs[1], 0..8)];
    invalid(c.conn.qp_mut().post_recv(&[RecvWr::sg(&rtwo).unwrap()]), "limit of 1");
    assert_eq!(held(&c, &s), (0, 0, 0));
    // Lists the constructors refuse: empty, beyond MAX_SGE, an empty piece among several.
    invalid(SendWr::send_sg(&[]).map(drop), "no pieces");
    invalid(RecvWr::sg(&[]).map(drop), "no pieces");
    let many: Vec<_> = (0..MAX_SGE + 1).map(|i| (&c.mrs[0], i * 8..i * 8 + 8)).collect();
    invalid(SendWr::send_sg(&many).map(drop), &format!("at most {MAX_SGE}"));
    invalid(RecvWr::sg(&many).map(drop), "MAX_SGE");
    invalid(SendWr::read_sg(&many, &s.mrs[0].remote(), 0).map(drop), "MAX_SGE");
    invalid(SendWr::send_sg(&[(&c.mrs[0], 0..8), (&c.mrs[1], 8..8)]).map(drop), "piece 1");
    invalid(RecvWr::sg(&[(&c.mrs[0], 0..0), (&c.mrs[1], 0..8)]).map(drop), "piece 0");
    // One piece of one length 0 is the single-piece request (an empty message).
    assert_eq!(SendWr::send_sg(&[(&c.mrs[0], 0..0)]).unwrap().num_pieces(), 1);
    // A later piece on another PD, out of bounds, or (for a receive) without LOCAL_WRITE.
    let other_pd = ProtectionDomain::new(c.pd.context()).unwrap();
    let foreign = MemoryRegion::new(&other_pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let wr = [(&c.mrs[0], 0..8), (&foreign, 0..8)];
    invalid(c.conn.qp_mut().post_send(&[SendWr::send_sg(&wr).unwrap()]), "another protection domain");
    let wr = [(&c.mrs[0], 0..8), (&c.mrs[1], 4090..4100)];
    let e = c.conn.qp_mut().post_send(&[SendWr::send_sg(&wr).unwrap()]).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { offset: 4090, len: 10, size: 4096, .. }), "{e:?}");
    let read_only = MemoryRegion::new(&s.pd, 64, AccessFlags::REMOTE_READ).unwrap();
    let wr = [(&s.mrs[0], 0..8), (&read_only, 0..8)];
    invalid(s.conn.qp_mut().post_recv(&[RecvWr::sg(&wr).unwrap()]), "LOCAL_WRITE");
    let remote = s.mrs[0].remote();
    let wr = [(&c.mrs[0], 0..8), (&read_only, 0..8)];
    // A READ of 2 pieces where the device reads into 2 (else refused for that first, e.g. on
    // siw, whose max_sge_rd is 1); read_only is on the server's PD: refused for that first.
    let read_in_two = c.conn.qp().max_read_sge() >= 2;
    let first = if read_in_two { "protection domain" } else { "max_sge_rd" };
    invalid(c.conn.qp_mut().post_send(&[SendWr::read_sg(&wr, &remote, 0).unwrap()]), first);
    let c_read_only = MemoryRegion::new(&c.pd, 64, AccessFlags::REMOTE_READ).unwrap();
    let wr = [(&c.mrs[0], 0..8), (&c_read_only, 0..8)];
    let first = if read_in_two { "LOCAL_WRITE" } else { "max_sge_rd" };
    invalid(c.conn.qp_mut().post_send(&[SendWr::read_sg(&wr, &remote, 0).unwrap()]), first);
    // ... but a gathered send may read it.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(1)]).unwrap();
    c.conn.qp_mut().post_send(&[SendWr::send_sg(&wr).unwrap().wr_id(2)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap().byte_len(), 16);
    assert_eq!(held(&c, &s), (0, 0, 0));
    // Queue sizes: 0 and more than MAX_SGE are refused when the QP or SRQ is made.
    let route = || {
        let r = Client::new().unwrap().resolve_addr(None, SocketAddr::new(t.addr, 7999), T).unwrap();
        r.resolve_route(T).unwrap()
    };
    let pd = ProtectionDomain::new(c.pd.context()).unwrap();
    for (init, needle) in [
        (QpInit::new().max_send_sge(0), "QpInit::max_send_sge(0)"),
        (QpInit::new().max_recv_sge(MAX_SGE as u32 + 1), "QpInit::max_recv_sge(5)"),
    ] {
        let e = match route().create_qp(&pd, init) {
            Err(e) => e,
            Ok(_) => panic!("a QP of {needle} was created"),
        };
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains(needle) && m.contains("MAX_SGE")), "{e:?}");
    }
    invalid(SharedReceiveQueue::with_sge(&pd, 4, 0).map(drop), "with_sge(0)");
    invalid(SharedReceiveQueue::with_sge(&pd, 4, MAX_SGE as u32 + 1).map(drop), "MAX_SGE");
    // An SRQ of one piece refuses two.
    let srq = SharedReceiveQueue::new(&pd, 4).unwrap();
    let m = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let wr = [(&m, 0..8), (&m, 8..16)];
    invalid(srq.post_recv(&[RecvWr::sg(&wr).unwrap()]), "SharedReceiveQueue::with_sge");
    assert_eq!((srq.outstanding(), m.outstanding()), (0, 0));
    drop((srq, m, pd, foreign, other_pd, read_only, c_read_only));
    drop((c, s));
    t.finish();
}

/// IPv6 end to end: a RoCE v2 GID of a global or unique-local IPv6 address (the guest gives its
/// netdev fd77::1; on iWARP, whose GIDs are not IP addresses, the netdev's own address) carries
/// a connection whose addresses are IPv6 and whose data arrives intact; a listener on `[::]`
/// with `set_afonly(false)` also takes IPv4 clients (on iWARP: serves IPv6 clients, and IPv4
/// ones find nobody), and with `set_afonly(true)` an IPv4 client finds nobody listening.
#[test]
fn ipv6_end_to_end_and_the_ipv6_only_option() {
    use rdma_cm::{GidType, VerbsContext};
    use std::net::{IpAddr, Ipv6Addr};
    let t = DeviceTest::start();
    let name = rdma_cm::devices().unwrap()[0].name.clone();
    let ctx = VerbsContext::open(&name).unwrap();
    let v6: Vec<Ipv6Addr> = if common::caps::iwarp_context(&ctx) {
        // iWARP's GIDs are not IP addresses: its connections are TCP's, over the netdev's own.
        common::netdev_of(&name, 1).and_then(|n| common::ipv6_of(&n)).into_iter().collect()
    } else {
        ctx.gid_table(1)
            .unwrap()
            .iter()
            .filter(|g| g.gid_type == GidType::RoceV2 && g.gid.ipv4().is_none())
            .map(|g| g.gid.to_ipv6())
            .filter(|a| (a.segments()[0] & 0xffc0) != 0xfe80) // not link-local: no scope id needed
            .collect()
    };
    drop(ctx);
    let Some(&a6) = v6.first() else {
        panic!("no global or unique-local IPv6 address on port 1 (a RoCE v2 GID; on iWARP, of its netdev): give the RDMA netdev one (`ip -6 addr add fd77::1/64 dev NETDEV nodad`; the guest harness does)")
    };
    if let Ok(expected) = std::env::var("RDMA_VM_ADDR6") {
        assert_eq!(a6.to_string(), expected, "the guest's IPv6 address is the GID found");
    }
    // A connection over IPv6, data checked both ways.
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut c, mut s) = pair(IpAddr::V6(a6), spec.clone(), spec);
    assert!(matches!(c.conn.peer_addr(), Some(SocketAddr::V6(p)) if *p.ip() == a6), "{:?}", c.conn.peer_addr());
    assert!(matches!(s.conn.local_addr(), Some(SocketAddr::V6(p)) if *p.ip() == a6), "{:?}", s.conn.local_addr());
    let expect = pattern(4096, 6);
    c.mrs[0].as_mut_slice().unwrap().copy_from_slice(&expect);
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..4096).wr_id(1)]).unwrap();
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..4096).wr_id(1)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap().byte_len(), 4096);
    assert_eq!(s.mrs[0].as_slice().unwrap(), &expect[..], "the IPv6 send arrived intact");
    drop((c, s));

    // [::] without IPv6-only: an IPv4 client is served. Not on iWARP (measured on siw): the
    // listener's TCP socket takes the IPv4 client, but the connection is dropped during the
    // MPA handshake (REJECTED, status -ECONNRESET) and the listener never sees a request; an
    // IPv6 client is served. With IPv6-only, the IPv4 client's TCP connect itself is refused.
    let any6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 7995);
    let srv = Server::new().unwrap();
    srv.id().set_afonly(false).unwrap();
    let listener = srv.bind(any6).unwrap().listen(2).unwrap();
    let v4 = SocketAddr::new(t.addr, 7995);
    let refused = |at: SocketAddr, afonly: bool| {
        let route = Client::new().unwrap().resolve_addr(None, at, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let err = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap_err();
        if iwarp() && afonly {
            assert!(matches!(err, Error::Call { op: "rdma_connect", .. }), "{err:?}");
            assert_eq!(err.errno(), Some(libc::ECONNREFUSED), "{err:?}");
        } else if iwarp() {
            let dropped_in_mpa = matches!(err, Error::UnexpectedEvent { got: CmEventType::Rejected, status, .. } if status == -libc::ECONNRESET);
            assert!(dropped_in_mpa, "{err:?}");
        } else {
            assert!(matches!(err, Error::UnexpectedEvent { got: CmEventType::Rejected, .. }), "{err}");
        }
    };
    let served = if iwarp() {
        refused(v4, false);
        SocketAddr::new(IpAddr::V6(a6), 7995)
    } else {
        v4
    };
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, served, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T);
        (conn, pd)
    });
    let req = listener.get_request(T).expect("a client reaches a [::] listener that is not IPv6-only");
    let pd = req.alloc_pd().unwrap();
    let server = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
    let (conn, cpd) = client.join().unwrap();
    let conn = conn.unwrap();
    drop((conn, server, cpd, pd, listener));

    // [::] IPv6-only: the IPv4 client finds nobody.
    let srv = Server::new().unwrap();
    srv.id().set_afonly(true).unwrap();
    let listener = srv.bind(any6).unwrap().listen(2).unwrap();
    refused(v4, true);
    drop(listener);
    t.finish();
}

/// Busy-poll waits: round trips complete as with sleeping waits, a wait with nothing coming
/// still ends at its timeout, and a peer that leaves during a busy wait is noticed.
#[test]
fn busy_poll_waits_complete_time_out_and_notice_the_peer_leaving() {
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, spec.clone(), spec);
    c.conn.qp_mut().set_busy_poll(true);
    s.conn.qp_mut().set_busy_poll(true);
    assert!(c.conn.qp().busy_poll());
    for i in 0..200u64 {
        s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(i)]).unwrap();
        c.conn.qp_mut().post_recv(&[RecvWr::new(&c.mrs[0], 64..128).wr_id(i)]).unwrap();
        c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(i)]).unwrap();
        assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, i, T).unwrap().byte_len(), 64);
        s.conn.qp_mut().post_send(&[SendWr::send(&s.mrs[0], 0..64).wr_id(i)]).unwrap();
        c.conn.qp_mut().wait_for(WorkQueue::Send, i, T).unwrap();
        assert_eq!(c.conn.qp_mut().wait_for(WorkQueue::Recv, i, T).unwrap().byte_len(), 64);
        s.conn.qp_mut().wait_for(WorkQueue::Send, i, T).unwrap();
    }
    // Nothing posted by the peer: the busy wait ends at its timeout, not before, not long after.
    c.conn.qp_mut().post_recv(&[RecvWr::new(&c.mrs[0], 64..128).wr_id(500)]).unwrap();
    let started = Instant::now();
    let e = c.conn.qp_mut().wait_for(WorkQueue::Recv, 500, Duration::from_millis(300)).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(5), "{took:?}");
    // The peer leaves while we busy-wait for its message: the wait ends with Disconnected.
    let waiter = thread::spawn(move || {
        let r = c.conn.qp_mut().wait_for(WorkQueue::Recv, 500, T);
        (r, c)
    });
    drop(s);
    let (r, mut c) = waiter.join().unwrap();
    assert!(matches!(r, Err(Error::Disconnected { .. }) | Err(Error::WorkCompletion { .. })), "{r:?}");
    if iwarp() && !c.conn.qp().peer_left() {
        // iWARP flushes the QP when TCP closes, ahead of the CM's DISCONNECTED (which follows).
        assert!(matches!(r, Err(Error::WorkCompletion { status: WcStatus::WrFlushErr, .. })), "{r:?}");
        assert_eq!(
            c.conn.next_event(T).expect("DISCONNECTED follows the flush").event_type(),
            CmEventType::Disconnected
        );
    }
    assert!(c.conn.qp().peer_left(), "the busy wait noticed the peer leaving");
    drop(c);
    t.finish();
}
