//! Device tests: every public type against a real RDMA device (Soft-RoCE `rxe0` in the guest).
//!
//! Each test starts with `DeviceTest::start()`, which fails when no device is present, and ends
//! with `finish()`, which fails when the kernel's resource tracking still lists a QP, CQ, MR, PD
//! or CM id of this process. A test that needs what not every device has (atomics, immediate
//! data, a scattered READ, RNR retries: Soft-iWARP has none of them) asks the device first
//! (`common::require`) and, when it lacks it, prints one `skipped: ` line and returns. Data moves
//! through lanes (`rdma_cm::verbs::lane`): the regions move in with each post and come back with
//! the completions.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::caps::{device_under_test, iwarp};
use common::lane::{lane_on, lane_pair, reap, LaneSide};
use common::{pair, pattern, require, Cap, DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{Completion, Lane, RecvWr, SendWr};
use rdma_cm::{
    AccessFlags, Client, CmEventType, ConnParam, ConnectRequest, Error, EventChannel, MemoryRegion, QpInfo, QpInit,
    Server, WcStatus, WorkQueue,
};

const SIZES: [usize; 4] = [1, 1024, 64 * 1024, 1 << 20];

/// The next completion on `lane` (waited for up to `T`), which must have succeeded.
fn ok(lane: &mut Lane) -> Completion {
    let c = lane.wait(T).expect("a completion within T");
    c.ok().unwrap_or_else(|e| panic!("{e}"))
}

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

/// The event channel, the device context, a PD, a region and a lane (its CQ, and the QP of a
/// connection to be, with a receive in flight holding a second region) are dropped in each of
/// the 120 orders: each keeps what it needs alive, the lane flushes its receive before the
/// region is released, and nothing is left in the kernel.
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
        let mut lane = Lane::new(&ctx, 32).unwrap();
        let client = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        // Leave work in flight too: the lane must flush it before releasing the region.
        let held = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        lane.post_recv(client.qp(), RecvWr::new(held)).unwrap();
        assert_eq!(lane.outstanding(client.qp()).unwrap(), (0, 1));
        assert!(common::resource_total() >= 6, "objects should be visible to the kernel");
        let mut items: Vec<Option<Box<dyn std::any::Any>>> =
            vec![Some(Box::new(ch)), Some(Box::new(ctx)), Some(Box::new(pd)), Some(Box::new(mr)), Some(Box::new(lane))];
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
    let (mut c, mut s) = lane_pair(t.addr, spec.clone(), spec, 64);
    let (mut msg, mut buf) = (c.mrs.remove(0), s.mrs.remove(0));
    for (i, &n) in SIZES.iter().enumerate() {
        let want = pattern(n, i as u8);
        s.lane.post_recv(s.qp, RecvWr::new(buf).wr_id(i as u64)).unwrap();
        msg.as_mut_slice().unwrap()[..n].copy_from_slice(&want);
        c.lane.post_send(c.qp, SendWr::send(msg, 0..n).wr_id(100 + i as u64)).unwrap();
        let mut sent = ok(&mut c.lane);
        assert_eq!((sent.wr_id(), sent.queue()), (100 + i as u64, WorkQueue::Send));
        msg = sent.take_region().unwrap();
        let mut got = ok(&mut s.lane);
        assert_eq!((got.wr_id(), got.queue()), (i as u64, WorkQueue::Recv));
        assert_eq!(got.byte_len() as usize, n, "size {n}");
        buf = got.take_region().unwrap();
        assert_eq!(&buf.as_slice().unwrap()[..n], &want[..], "payload of {n} bytes");
    }
    drop((c, s, msg, buf));
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
    let addr = t.addr;
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mut lane = lane_on(addr, 64);
        let region = MemoryRegion::new(&pd, max, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        let q = req.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        let qp = q.qp();
        let info = QpInfo {
            qp_num: lane.qp_num(qp).unwrap(),
            psn: 0,
            rkey: region.rkey(),
            vaddr: region.addr(),
            len: max as u64,
        };
        for i in 0..SIZES.len() as u64 {
            let ctl = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
            lane.post_recv(qp, RecvWr::new(ctl).wr_id(i)).unwrap();
        }
        q.accept(&mut lane, &ConnParam::new().private_data(&info.encode()).unwrap(), T).unwrap();
        (lane, qp, region, pd)
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
    let mut src = MemoryRegion::new(&pd, max, client.access).unwrap();
    let mut sig = MemoryRegion::new(&pd, 4, AccessFlags::LOCAL_WRITE).unwrap();
    let q = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
    let qp = q.qp();
    let private = q.connect(&mut lane, &ConnParam::new(), T).unwrap();
    let (mut slane, sqp, mut region, spd) = srv.join().unwrap();
    let (info, _) = QpInfo::decode(&private).expect("server's qp_info");
    assert_eq!(info.qp_num, slane.qp_num(sqp).unwrap());
    let remote = info.region().unwrap();
    // A slice of a remotely writable region is never handed out.
    assert!(matches!(region.as_slice(), Err(Error::RemotelyWritable)));
    for (i, &n) in SIZES.iter().enumerate() {
        let want = pattern(n, 40 + i as u8);
        src.as_mut_slice().unwrap()[..n].copy_from_slice(&want);
        sig.as_mut_slice().unwrap().copy_from_slice(&(i as u32).to_be_bytes());
        // The WRITE and the SEND that signals it under one doorbell.
        let mut wrs = [
            Some(SendWr::write(src, 0..n, &remote, 0).wr_id(i as u64)),
            Some(SendWr::send(sig, 0..4).wr_id(100 + i as u64)),
        ];
        assert_eq!(lane.post_send_list(qp, &mut wrs).unwrap(), 2);
        let [mut w, mut m]: [Completion; 2] = reap(&mut lane, 2).try_into().unwrap();
        assert!(w.is_ok() && m.is_ok(), "{w:?} {m:?}");
        assert_eq!((w.wr_id(), m.wr_id()), (i as u64, 100 + i as u64), "in posting order");
        (src, sig) = (w.take_region().unwrap(), m.take_region().unwrap());
        let got = ok(&mut slane);
        assert_eq!((got.wr_id(), got.byte_len()), (i as u64, 4), "the SEND after WRITE {i}");
        let mut got = vec![0u8; n];
        region.read_at(0, &mut got).unwrap();
        assert_eq!(got, want, "RDMA WRITE of {n} bytes");
    }
    // Writing past the advertised region is refused before anything is posted.
    let r = lane.post_send(qp, SendWr::write(src, 0..2, &remote, max as u64 - 1)).unwrap_err();
    assert!(matches!(r.error(), Error::OutOfBounds { what: "remote region", .. }), "{r}");
    let src = r.into_inner().expect("the refused WRITE's region comes back");
    assert_eq!(lane.outstanding(qp).unwrap(), (0, 0));
    drop((lane, slane, region, spd, src, sig, pd));
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
        ..PairSpec::default()
    };
    let (mut c, mut s) = lane_pair(t.addr, spec_c, spec_s, 64);
    // The WRITE with immediate consumes a receive, which takes no bytes.
    let slot = MemoryRegion::new(&s.pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
    s.lane.post_recv(s.qp, RecvWr::range(slot, 0..0).wr_id(5)).unwrap();
    let remote = s.mrs[0].remote();
    let want = pattern(4096, 44);
    let mut src = c.mrs.remove(0);
    src.as_mut_slice().unwrap().copy_from_slice(&want);
    c.lane.post_send(c.qp, SendWr::write(src, 0..4096, &remote, 0).imm(0xfeed_f00d).wr_id(1)).unwrap();
    assert_eq!(ok(&mut c.lane).wr_id(), 1);
    let wc = ok(&mut s.lane);
    assert_eq!((wc.wr_id(), wc.imm_data()), (5, Some(0xfeed_f00d)));
    let mut got = vec![0u8; 4096];
    s.mrs[0].read_at(0, &mut got).unwrap();
    assert_eq!(got, want, "the WRITE's bytes");
    drop((c, s, wc));
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
    let (mut c, mut s) = lane_pair(t.addr, spec_c, spec_s, 64);
    let remote = s.mrs[0].remote();
    let mut dst = c.mrs.remove(0);
    for (i, &n) in SIZES.iter().enumerate() {
        let want = pattern(n, 80 + i as u8);
        s.mrs[0].as_mut_slice().unwrap()[..n].copy_from_slice(&want);
        // The destination is in the lane while the READ is in flight.
        c.lane.post_send(c.qp, SendWr::read(dst, 0..n, &remote, 0).wr_id(i as u64)).unwrap();
        let mut wc = ok(&mut c.lane);
        assert_eq!((wc.wr_id(), wc.byte_len() as usize), (i as u64, n));
        dst = wc.take_region().unwrap();
        assert_eq!(&dst.as_slice().unwrap()[..n], &want[..], "RDMA READ of {n} bytes");
    }
    drop((c, s, dst));
    t.finish();
}

/// Sixteen receives posted as one list (the queue's whole depth, in 64-byte chunks of one
/// registration) take 15 unsignaled sends and one signaled inline send, in order: the one
/// signaled completion retires the 15 before it, each handed back with its region, and every
/// receive holds its message; a 17th receive is refused with its region back.
#[test]
fn unsignaled_and_inline_sends_fill_a_listed_post_of_receives_in_order() {
    let t = DeviceTest::start();
    let spec_c = PairSpec { mr_sizes: vec![16 * 64], ..PairSpec::default() };
    let spec_s = PairSpec { mr_sizes: vec![16 * 64, 64], ..PairSpec::default() };
    let (mut c, mut s) = lane_pair(t.addr, spec_c, spec_s, 64);
    let extra = s.mrs.pop().unwrap();
    let slots = s.mrs.remove(0).split(64).unwrap();
    assert_eq!(slots.len(), 16);
    let mut recvs: Vec<Option<RecvWr>> =
        slots.into_iter().enumerate().map(|(k, mr)| Some(RecvWr::new(mr).wr_id(k as u64))).collect();
    assert_eq!(s.lane.post_recv_list(s.qp, &mut recvs).unwrap(), 16);
    assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 16));
    let r = s.lane.post_recv(s.qp, RecvWr::new(extra)).unwrap_err();
    assert!(matches!(r.error(), Error::QueueFull { queue: "receive", depth: 16 }), "{r:?}");
    let extra = r.into_inner().expect("the refused receive's region comes back");
    // 15 unsignaled sends, one chunk each, under one doorbell, then one signaled inline send.
    let mut chunks = c.mrs.remove(0).split(64).unwrap();
    let inline = pattern(40, 2);
    for chunk in &mut chunks {
        chunk.as_mut_slice().unwrap().copy_from_slice(&pattern(64, 1));
    }
    chunks.truncate(15);
    let mut wrs: Vec<Option<SendWr>> = chunks
        .into_iter()
        .enumerate()
        .map(|(k, mr)| Some(SendWr::send(mr, 0..64).wr_id(k as u64).unsignaled()))
        .collect();
    assert_eq!(c.lane.post_send_list(c.qp, &mut wrs).unwrap(), 15);
    c.lane.post_inline(c.qp, rdma_cm::verbs::lane::InlineWr::send(&inline).wr_id(15)).unwrap();
    assert_eq!(c.lane.outstanding(c.qp).unwrap(), (16, 0));
    // One signaled completion: it retires the 15 before it, each handed out in order.
    let sent = reap(&mut c.lane, 16);
    assert_eq!(sent.iter().map(|w| w.wr_id()).collect::<Vec<_>>(), (0..16).collect::<Vec<_>>());
    // (iWARP signals every request: there each comes signaled.)
    let iwarp = common::caps::iwarp();
    assert!(sent[..15].iter().all(|w| w.is_ok() && w.is_signaled() == iwarp), "{sent:?}");
    assert!(sent[15].is_ok() && sent[15].is_signaled(), "{:?}", sent[15]);
    assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
    let mut back = 0;
    for mut w in sent {
        if let Some(mut mr) = w.take_region() {
            assert!(mr.as_mut_slice().is_ok(), "region usable again after retirement");
            back += 1;
        }
    }
    assert_eq!(back, 15, "every unsignaled send's region comes back; the inline send has none");
    let got = reap(&mut s.lane, 16);
    for (k, mut wc) in got.into_iter().enumerate() {
        assert!(wc.is_ok(), "{wc:?}");
        assert_eq!(wc.wr_id(), k as u64, "receives complete in order");
        let mut mr = wc.take_region().unwrap();
        let buf = mr.as_slice().unwrap();
        if k < 15 {
            assert_eq!((wc.byte_len(), buf), (64, &pattern(64, 1)[..]), "unsignaled send {k}");
        } else {
            assert_eq!((wc.byte_len(), &buf[..40]), (40, &inline[..]), "inline send");
        }
    }
    drop((c, s, extra));
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
    let (mut c, s) = lane_pair(t.addr, PairSpec::default(), spec_s, 64);
    // The server posted no receive.
    c.lane.post_send(c.qp, SendWr::send(c.mrs.remove(0), 0..8).wr_id(1)).unwrap();
    let mut wc = reap(&mut c.lane, 1).pop().unwrap();
    assert_eq!((wc.wr_id(), wc.status()), (1, WcStatus::RnrRetryExcErr), "{wc:?}");
    let err = wc.error().unwrap();
    assert!(matches!(err, Error::WorkCompletion { status: WcStatus::RnrRetryExcErr, wr_id: 1, .. }), "{err:?}");
    assert!(err.to_string().contains("no receive posted"), "{err}");
    assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
    let mut mr = wc.take_region().expect("the failed send's region comes back");
    assert!(mr.as_mut_slice().is_ok());
    drop((c, s, mr));
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
    let (mut c, mut s) = lane_pair(t.addr, spec_c, spec_s, 64);
    assert_eq!(c.lane.attributes(c.qp).unwrap().min_rnr_timer, 3, "client");
    assert_eq!(s.lane.attributes(s.qp).unwrap().min_rnr_timer, 1, "server");
    let counter = format!("/sys/class/infiniband/{}/ports/1/hw_counters/rcvd_rnr_err", device_under_test());
    let rnr = || std::fs::read_to_string(&counter).ok().and_then(|v| v.trim().parse::<u64>().ok());
    let Some(before) = rnr() else {
        common::caps::skipped("the RNR wait", &format!("the device has no {counter}"));
        return;
    };
    let mut msg = c.mrs.remove(0);
    msg.as_mut_slice().unwrap()[..64].copy_from_slice(&pattern(64, 4));
    c.lane.post_send(c.qp, SendWr::send(msg, 0..64).wr_id(1)).unwrap();
    let deadline = Instant::now() + T;
    while rnr().unwrap_or(0) == before {
        assert!(Instant::now() < deadline, "no RNR NAK counted in {T:?} ({counter})");
        std::thread::yield_now();
    }
    s.lane.post_recv(s.qp, RecvWr::range(s.mrs.remove(0), 0..64).wr_id(2)).unwrap();
    let mut wc = s.lane.wait(T).expect("server: the retried send arrives").ok().unwrap();
    assert_eq!((wc.wr_id(), wc.byte_len()), (2, 64));
    let mut buf = wc.take_region().unwrap();
    assert_eq!(&buf.as_slice().unwrap()[..64], &pattern(64, 4)[..]);
    let sent = c.lane.wait(T).expect("client: the send completes");
    assert!(sent.is_ok() && sent.wr_id() == 1, "{sent:?}");
    drop((c, s, buf, sent));
    t.finish();
}

#[test]
fn message_larger_than_receive_buffer_fails_cleanly() {
    let t = DeviceTest::start();
    let (mut c, mut s) = lane_pair(t.addr, PairSpec::default(), PairSpec::default(), 64);
    s.lane.post_recv(s.qp, RecvWr::range(s.mrs.remove(0), 0..16).wr_id(7)).unwrap();
    c.lane.post_send(c.qp, SendWr::send(c.mrs.remove(0), 0..64).wr_id(1)).unwrap();
    let mut got = reap(&mut s.lane, 1).pop().unwrap();
    // rxe reports LOC_QP_OP_ERR here; hardware usually reports LOC_LEN_ERR.
    assert_eq!(got.wr_id(), 7);
    assert!(matches!(got.status(), WcStatus::LocLenErr | WcStatus::LocQpOpErr), "{got:?}");
    assert!(got.take_region().is_some(), "the failed receive's region comes back");
    match c.lane.wait(T) {
        // iWARP: a send completes once TCP has its data, before the peer has placed it; the
        // peer's failure then ends the connection (the receiver's QP terminates it), which the
        // sender learns from its DISCONNECTED.
        Ok(wc) if wc.is_ok() && iwarp() => {
            assert!(c.lane.wait_peer_left(c.qp, T).unwrap(), "the sender learns that the connection ended");
        }
        Ok(wc) if wc.is_ok() => panic!("the sender's send succeeded into a too-small receive: {wc:?}"),
        Ok(wc) => assert_eq!(wc.wr_id(), 1, "{wc:?}"),
        Err(e) => assert!(matches!(e, Error::QpInError { .. }), "{e:?}"),
    }
    drop((c, s));
    t.finish();
}

#[test]
fn peer_that_leaves_flushes_the_survivors_receive_quickly() {
    let t = DeviceTest::start();
    let (c, mut s) = lane_pair(t.addr, PairSpec::default(), PairSpec::default(), 64);
    s.lane.post_recv(s.qp, RecvWr::range(s.mrs.remove(0), 0..64).wr_id(3)).unwrap();
    let start = Instant::now();
    drop(c); // the client goes away without sending
             // One call sees the departure, answers it and moves the QP to the error state (on iWARP
             // the flush comes first, when TCP closes, and the CM's DISCONNECTED follows).
    assert!(s.lane.wait_peer_left(s.qp, T).unwrap(), "the survivor saw the peer leave");
    let mut wc = reap(&mut s.lane, 1).pop().unwrap();
    let took = start.elapsed();
    assert_eq!((wc.wr_id(), wc.status()), (3, WcStatus::WrFlushErr), "{wc:?}");
    eprintln!("measured: survivor's receive failed {took:?} after the peer left");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0), "the flush retired the receive");
    let mut buf = wc.take_region().expect("the flushed receive's region comes back");
    assert!(buf.as_mut_slice().is_ok());
    let r = s.lane.post_recv(s.qp, RecvWr::new(buf)).unwrap_err();
    assert!(matches!(r.error(), Error::QpInError { .. }), "posts are refused once the peer left: {r}");
    drop((s, r));
    t.finish();
}

#[test]
fn panic_with_work_in_flight_releases_everything() {
    let t = DeviceTest::start();
    let addr = t.addr;
    let r = std::panic::catch_unwind(move || {
        let (mut c, mut s) = lane_pair(addr, PairSpec::default(), PairSpec::default(), 64);
        for side in [&mut c, &mut s] {
            let mr = side.mrs.remove(0);
            side.lane.post_recv(side.qp, RecvWr::new(mr).wr_id(1)).unwrap();
            assert_eq!(side.lane.outstanding(side.qp).unwrap(), (0, 1));
        }
        panic!("user code panics while receives are posted");
    });
    assert!(r.is_err());
    t.finish();
}

/// A hundred connections, made by ten client threads at once, all accepted through one event
/// channel (the accepts started on CONNECT_REQUEST and completed on ESTABLISHED, whatever the
/// order). Then each client sends its number, every QP on one lane per side: every message
/// arrives once.
#[test]
fn hundred_connections_through_one_event_channel() {
    const N: usize = 100;
    let t = DeviceTest::start();
    // Each QP maps its queues in the provider's library: 2N QPs hold at least as many as 2N
    // one-entry CQs, which Soft-iWARP's library cannot map in one process.
    if !require(Cap::CompletionQueues(2 * N)) {
        return;
    }
    // One lane per side, each CQ with room for all of its QPs' queues (2 + 2 deep each).
    let (mut slane, mut clane) = (lane_on(t.addr, 8 * N as u32), lane_on(t.addr, 8 * N as u32));
    let init = QpInit::new().max_send_wr(2).max_recv_wr(2);
    let (sinit, cinit) = (slane.qp_init_from(init.clone()), clane.qp_init_from(init));
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
                    let q = req.create_qp(&pd, sinit.clone()).unwrap();
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
            let cinit = cinit.clone();
            thread::spawn(move || {
                (0..10)
                    .map(|k| {
                        let route =
                            Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
                        let pd = route.alloc_pd().unwrap();
                        let mut mr = MemoryRegion::new(&pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
                        mr.as_mut_slice().unwrap().copy_from_slice(&((th * 10 + k) as u64).to_be_bytes());
                        let q = route.create_qp(&pd, cinit.clone()).unwrap();
                        (q.connect(&ConnParam::new(), T).expect("client connect"), mr)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let client_conns: Vec<_> = clients.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let server_conns = server.join().unwrap();
    assert_eq!(client_conns.len(), N);
    assert_eq!(server_conns.len(), N);
    assert!(common::resources().iter().any(|(k, n)| *k == "qp" && *n >= 2 * N), "{:?}", common::resources());
    // Every server QP joins its lane with a receive posted before any client sends.
    for (conn, mr) in server_conns {
        let qp = slane.attach(conn).map_err(|r| r.into_parts().0).expect("attach (server)");
        slane.post_recv(qp, RecvWr::new(mr).wr_id(0)).unwrap();
    }
    for (conn, mr) in client_conns {
        let qp = clane.attach(conn).map_err(|r| r.into_parts().0).expect("attach (client)");
        clane.post_send(qp, SendWr::send(mr, 0..8).wr_id(1)).unwrap();
    }
    for wc in reap(&mut clane, N) {
        assert!(wc.is_ok() && wc.wr_id() == 1, "{wc:?}");
    }
    let mut seen = [false; N];
    for mut wc in reap(&mut slane, N) {
        assert!(wc.is_ok() && wc.wr_id() == 0, "{wc:?}");
        assert_eq!(wc.byte_len(), 8);
        let mut b = [0u8; 8];
        wc.take_region().unwrap().read_at(0, &mut b).unwrap();
        let idx = u64::from_be_bytes(b) as usize;
        assert!(idx < N && !seen[idx], "message {idx} duplicated or out of range");
        seen[idx] = true;
    }
    assert!(seen.iter().all(|&s| s));
    // (The client QPs' capabilities hold the client lane's CQ.)
    drop((clane, cinit));
    drop(slane);
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
    use rdma_cm::verbs::port::{GidType, LinkLayer, PortState};
    use rdma_cm::VerbsContext;
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
/// value it found, the result region is in the lane while the device may write it, the peer
/// sees the final value; misaligned and out-of-range targets, a result outside the local region
/// and immediate data on an atomic are refused before posting (the region given back), and a
/// region without REMOTE_ATOMIC fails with a remote access error.
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
    let (mut c, mut s) = lane_pair(t.addr, cspec, sspec, 64);
    s.mrs[0].write_at(8, &100u64.to_ne_bytes()).unwrap();
    let remote = s.mrs[0].remote();
    let mut result = Some(c.mrs.remove(0));
    // Posts one atomic on the 8 bytes at offset 8 of the peer's region, result into 16..24.
    let mut run = |c: &mut LaneSide, id: u64, compare_swap: Option<(u64, u64)>, add: u64| -> u64 {
        let mr = result.take().unwrap();
        let wr = match compare_swap {
            Some((cmp, swap)) => SendWr::compare_swap(mr, 16, &remote, 8, cmp, swap),
            None => SendWr::fetch_add(mr, 16, &remote, 8, add),
        };
        c.lane.post_send(c.qp, wr.wr_id(id)).unwrap();
        // The device writes the original value into the result range: the region is the lane's.
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (1, 0), "the result region is held");
        let mut wc = ok(&mut c.lane);
        assert_eq!(wc.wr_id(), id);
        assert!(matches!(wc.opcode(), Some(WcOpcode::FetchAdd | WcOpcode::CompSwap)), "{wc:?}");
        let mut mr = wc.take_region().unwrap();
        let mut v = [0u8; 8];
        mr.read_at(16, &mut v).unwrap();
        result = Some(mr);
        u64::from_ne_bytes(v)
    };
    assert_eq!(run(&mut c, 1, None, 5), 100);
    assert_eq!(run(&mut c, 2, None, 7), 105);
    assert_eq!(run(&mut c, 3, Some((112, 42)), 0), 112, "compare matched: swapped");
    assert_eq!(run(&mut c, 4, Some((999, 1)), 0), 42, "compare did not match: left alone");
    let mut v = [0u8; 8];
    s.mrs[0].read_at(8, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 42, "the peer's integer after add 5, add 7, swap to 42, failed swap");
    // Bad input, refused before posting, each giving the region back.
    let mut mr = result.take().unwrap();
    let refused = |c: &mut LaneSide, wr: SendWr, what: &str, ok: &dyn Fn(&Error) -> bool| -> MemoryRegion {
        let r = c.lane.post_send(c.qp, wr).unwrap_err();
        assert!(ok(r.error()), "{what}: {r:?}");
        r.into_inner().unwrap_or_else(|| panic!("{what}: the region comes back"))
    };
    mr = refused(&mut c, SendWr::fetch_add(mr, 16, &remote, 4, 1), "unaligned", &|e| {
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("8-byte aligned")
    });
    mr = refused(&mut c, SendWr::fetch_add(mr, 60, &remote, 8, 1), "result past the region", &|e| {
        matches!(e, Error::OutOfBounds { what: "memory region", .. })
    });
    mr = refused(&mut c, SendWr::compare_swap(mr, 16, &remote, 60, 0, 1), "target past the region", &|e| {
        matches!(e, Error::OutOfBounds { what: "remote region", .. })
    });
    mr = refused(&mut c, SendWr::fetch_add(mr, 16, &remote, 8, 1).imm(7), "immediate data", &|e| {
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("no immediate data")
    });
    assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0), "nothing was posted");
    // A region the peer did not open to atomics: the device refuses at the peer.
    let mut plain = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    c.lane.post_send(c.qp, SendWr::fetch_add(mr, 16, &plain.remote(), 8, 1).wr_id(9)).unwrap();
    let mut wc = reap(&mut c.lane, 1).pop().unwrap();
    assert_eq!((wc.wr_id(), wc.status()), (9, WcStatus::RemAccessErr), "{wc:?}");
    assert!(wc.take_region().is_some(), "the failed atomic's region comes back");
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

/// A gathered RDMA WRITE: 3 pieces of a region land, in order, at an offset of the peer's
/// region, and nothing around them; a list that would overrun the remote region is refused.
/// The peer learns that the WRITE is placed from a SEND posted after it (RC places in order;
/// on iWARP a WRITE completes at its sender once TCP has it, before it is placed).
#[test]
fn rdma_write_gathered_from_3_pieces() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![8192, 64], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![8192, 64],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let (mut c, mut s) = lane_pair(t.addr, cspec, sspec, 64);
    let remote = s.mrs[0].remote();
    // WRITE: 64 + 1000 + 7 bytes gathered, out of order within the region, landing at offset
    // 512 of the peer's region.
    let (mut src, sig) = (c.mrs.remove(0), c.mrs.remove(0));
    let a = pattern(8192, 3);
    src.as_mut_slice().unwrap().copy_from_slice(&a);
    let want = [&a[7000..7064], &a[10..1010], &a[4096..4103]].concat();
    let pieces = [7000..7064, 10..1010, 4096..4103];
    s.lane.post_recv(s.qp, RecvWr::new(s.mrs.remove(1)).wr_id(7)).unwrap();
    let mut wrs = [Some(SendWr::write_sg(src, &pieces, &remote, 512).wr_id(1)), Some(SendWr::send(sig, 0..8).wr_id(2))];
    assert_eq!(c.lane.post_send_list(c.qp, &mut wrs).unwrap(), 2);
    let [mut w, m]: [Completion; 2] = reap(&mut c.lane, 2).try_into().unwrap();
    assert!(w.is_ok() && m.is_ok() && (w.wr_id(), m.wr_id()) == (1, 2), "{w:?} {m:?}");
    let got = ok(&mut s.lane);
    assert_eq!((got.wr_id(), got.byte_len()), (7, 8));
    let mut seen = vec![0u8; 8192];
    s.mrs[0].read_at(0, &mut seen).unwrap();
    assert_eq!(&seen[512..512 + 1071], &want[..], "the gathered WRITE");
    assert!(seen[..512].iter().chain(&seen[512 + 1071..]).all(|&b| b == 0), "nothing written around it");
    // The whole list must fit the remote region.
    let src = w.take_region().unwrap();
    let r = c.lane.post_send(c.qp, SendWr::write_sg(src, &pieces, &remote, 8192 - 1070)).unwrap_err();
    assert!(matches!(r.error(), Error::OutOfBounds { what: "remote region", len: 1071, .. }), "{r:?}");
    assert!(r.into_inner().is_some(), "the refused WRITE's region comes back");
    drop((c, s, m, got));
    t.finish();
}

/// A scattered RDMA READ: 4096 bytes of the peer's region land in 96 + 3000 + 1000 bytes of 3
/// pieces of a region, in order, and nothing around them.
#[test]
fn rdma_read_scattered_into_3_pieces() {
    let t = DeviceTest::start();
    if !require(Cap::ReadScatter(3)) {
        return;
    }
    let cspec = PairSpec { mr_sizes: vec![8192], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    };
    let (mut c, mut s) = lane_pair(t.addr, cspec, sspec, 64);
    let remote = s.mrs[0].remote();
    let src = pattern(8192, 5);
    s.mrs[0].write_at(0, &src).unwrap();
    let mut dst = c.mrs.remove(0);
    dst.as_mut_slice().unwrap().fill(0);
    let pieces = [4000..4096, 5000..8000, 0..1000];
    c.lane.post_send(c.qp, SendWr::read_sg(dst, &pieces, &remote, 1000).wr_id(2)).unwrap();
    let mut wc = ok(&mut c.lane);
    assert_eq!((wc.wr_id(), wc.byte_len()), (2, 4096));
    let mut dst = wc.take_region().unwrap();
    let a = dst.as_slice().unwrap();
    assert_eq!(&a[4000..4096], &src[1000..1096], "first READ piece");
    assert_eq!(&a[5000..8000], &src[1096..4096], "second READ piece");
    assert_eq!(&a[..1000], &src[4096..5096], "third READ piece");
    let around = a[1000..4000].iter().chain(&a[4096..5000]).chain(&a[8000..]);
    assert!(around.into_iter().all(|&x| x == 0), "nothing read around the pieces");
    drop((c, s, dst));
    t.finish();
}

/// A send gathered from 3 pieces of a region lands in a receive scattered over 2 pieces of the
/// peer's region (the second before the first in it): the first piece holds the first 200
/// bytes, the second the other 250, in order, and the bytes around the pieces are untouched.
#[test]
fn scatter_gather_send_of_3_pieces_into_a_2_piece_receive() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![4096], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec { mr_sizes: vec![4096], init: QpInit::new().max_recv_sge(2), ..PairSpec::default() };
    let (mut c, mut s) = lane_pair(t.addr, cspec, sspec, 64);
    let a = pattern(4096, 1);
    let mut src = c.mrs.remove(0);
    src.as_mut_slice().unwrap().copy_from_slice(&a);
    let want = [&a[0..100], &a[1000..1300], &a[2000..2050]].concat();
    assert_eq!(want.len(), 450);
    // 200 + 300 bytes of room for 450.
    let mut dst = s.mrs.remove(0);
    dst.write_at(0, &[0u8; 4096]).unwrap();
    s.lane.post_recv(s.qp, RecvWr::scatter(dst, &[2100..2300, 100..400]).wr_id(5)).unwrap();
    c.lane.post_send(c.qp, SendWr::send_sg(src, &[0..100, 1000..1300, 2000..2050]).wr_id(6)).unwrap();
    assert_eq!(ok(&mut c.lane).wr_id(), 6);
    let mut got = ok(&mut s.lane);
    assert_eq!((got.wr_id(), got.byte_len()), (5, 450));
    let mut dst = got.take_region().unwrap();
    let mut seen = vec![0u8; 4096];
    dst.read_at(0, &mut seen).unwrap();
    assert_eq!(&seen[2100..2300], &want[..200], "the first receive piece holds the first 200 bytes");
    assert_eq!(&seen[100..350], &want[200..], "the second holds the other 250");
    let around = seen[..100].iter().chain(&seen[350..2100]).chain(&seen[2300..]);
    assert!(around.into_iter().all(|&b| b == 0), "bytes around the pieces untouched");
    assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0));
    drop((c, s, dst));
    t.finish();
}

/// A UD receive scattered over 2 pieces: the device writes the 40-byte GRH at the start of the
/// first piece, and the datagram after it, continuing into the second piece; a first piece
/// with no room for the GRH is refused at the post, the region given back.
#[test]
fn ud_receive_scattered_over_2_pieces_takes_the_grh_in_the_first() {
    use rdma_cm::verbs::ah::GRH_LEN;
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = common::lane::lane_ud_pair(t.addr, 7331, QpInit::new().max_recv_sge(2), 64);
        let (c, s) = (&mut p.client, &mut p.server);
        let msg = pattern(64, 9);
        let mut src = MemoryRegion::new(&c.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        src.write_at(0, &msg).unwrap();
        let mut dst = MemoryRegion::new(&s.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        dst.write_at(0, &[0u8; 4096]).unwrap();
        // A first piece shorter than the GRH is refused.
        let r = s.lane.post_recv(s.qp, RecvWr::scatter(dst, &[0..GRH_LEN - 1, 1000..1200])).unwrap_err();
        assert!(
            matches!(r.error(), Error::InvalidArgument(m) if m.contains("GRH") && m.contains(&format!("{}", GRH_LEN - 1))),
            "{r:?}"
        );
        let dst = r.into_inner().expect("the refused receive's region comes back");
        // Room for the GRH and 16 bytes in the first piece; the other 48 go to the second.
        s.lane.post_recv(s.qp, RecvWr::scatter(dst, &[0..GRH_LEN + 16, 1000..1200]).wr_id(3)).unwrap();
        c.lane.post_send(c.qp, SendWr::send(src, 0..64).to(p.to_server).wr_id(4)).unwrap();
        assert_eq!(ok(&mut c.lane).wr_id(), 4);
        let mut got = ok(&mut s.lane);
        assert_eq!((got.wr_id(), got.byte_len() as usize), (3, GRH_LEN + 64));
        let mut dst = got.take_region().unwrap();
        let mut seen = vec![0u8; 4096];
        dst.read_at(0, &mut seen).unwrap();
        assert_eq!(&seen[GRH_LEN..GRH_LEN + 16], &msg[..16], "the datagram starts after the GRH");
        assert_eq!(&seen[1000..1048], &msg[16..], "and continues in the second piece");
        let around = seen[GRH_LEN + 16..1000].iter().chain(&seen[1048..]);
        assert!(around.into_iter().all(|&b| b == 0), "bytes around the pieces untouched");
    }
    t.finish();
}

/// A receive of 4 pieces of one region posted on a lane's shared receive queue made for 4
/// (`Lane::create_srq_with_sge`), taken by a connection's QP: every byte in its piece, in
/// order. Before that, the SRQ's refusals: a receive of 2 pieces on an SRQ made for 1 names the
/// limit and `Lane::create_srq_with_sge`, and a list post takes receives of one piece only,
/// both giving the regions back.
#[test]
fn srq_receive_of_4_pieces() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let want = pattern(3000, 6);
    let sent = want.clone();
    let client = thread::spawn(move || {
        let mut lane = lane_on(dst.ip(), 64);
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        mr.write_at(0, &sent).unwrap();
        let c = route.lane_qp(&mut lane, &pd, QpInit::new().max_send_wr(8).max_recv_wr(1)).unwrap();
        let qp = c.qp();
        c.connect(&mut lane, &ConnParam::new(), T).unwrap();
        lane.post_send(qp, SendWr::send(mr, 0..3000).wr_id(1)).unwrap();
        let done = ok(&mut lane);
        assert_eq!(done.wr_id(), 1);
        (lane, done, pd)
    });
    let ctx = listener.context().unwrap();
    let pd = rdma_cm::ProtectionDomain::new(&ctx).unwrap();
    // Deep enough for both SRQs and the QP's sends up front (siw cannot grow a CQ).
    let mut lane = Lane::new(&ctx, 64).unwrap();
    let mut buf = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    buf.write_at(0, &[0u8; 4096]).unwrap();
    // An SRQ made for one piece refuses two, naming its limit and the way to raise it.
    let one = lane.create_srq(&pd, 4).unwrap();
    let r = lane.post_srq_recv(one, RecvWr::scatter(buf, &[0..8, 8..16])).unwrap_err();
    assert!(
        matches!(r.error(), Error::InvalidArgument(m) if m.contains("limit of 1") && m.contains("Lane::create_srq_with_sge")),
        "{r:?}"
    );
    let buf = r.into_inner().expect("the refused receive's region comes back");
    let srq = lane.create_srq_with_sge(&pd, 4, 4).unwrap();
    // A list takes receives of one piece only.
    let mut list = [Some(RecvWr::scatter(buf, &[0..8, 8..16]))];
    let e = lane.post_srq_recv_list(srq, &mut list).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("RecvWr::scatter")), "{e:?}");
    assert_eq!(lane.srq_outstanding(srq).unwrap(), 0, "nothing was posted");
    let buf = list[0].take().expect("a refused list keeps its receives").into_region();
    // 1000 + 1000 + 96 + 924 bytes of room for 3000, out of order in the region.
    let pieces = [24..1024, 3000..4000, 2000..2096, 1050..1974];
    lane.post_srq_recv(srq, RecvWr::scatter(buf, &pieces).wr_id(9)).unwrap();
    assert_eq!(lane.srq_outstanding(srq).unwrap(), 1);
    let init = lane.srq_qp_init(srq, QpInit::new().max_send_wr(4)).unwrap();
    let s = listener.get_request(T).unwrap().lane_qp(&mut lane, &pd, init).unwrap();
    s.accept(&mut lane, &ConnParam::new(), T).unwrap();
    let mut got = ok(&mut lane);
    assert_eq!((got.wr_id(), got.byte_len()), (9, 3000));
    assert_eq!(lane.srq_outstanding(srq).unwrap(), 0);
    let mut buf = got.take_region().unwrap();
    let mut seen = vec![0u8; 4096];
    buf.read_at(0, &mut seen).unwrap();
    let mut landed = Vec::new();
    for r in [24..1024, 3000..4000, 2000..2096, 1050..1954] {
        landed.extend_from_slice(&seen[r]);
    }
    assert_eq!(landed, want, "every byte in its piece, in order");
    let around = seen[..24].iter().chain(&seen[1024..1050]).chain(&seen[1954..2000]).chain(&seen[2096..3000]);
    assert!(around.into_iter().all(|&x| x == 0), "bytes around the pieces, and the last piece's tail, untouched");
    let peer = client.join().unwrap();
    drop((peer, lane, buf, pd, ctx, listener));
    t.finish();
}

/// Scattered receives that cannot be posted are refused before the provider sees them, the
/// region given back and nothing posted: more pieces than the QP's `max_recv_sge` (the message
/// names the limit and the setter), no piece or more than `MAX_SGE`, an empty piece among
/// several, a piece out of the region; a list post or a prepared receive of several pieces.
/// A scatter of one range is a plain receive, posted on a QP of one piece.
#[test]
fn scattered_receive_limits_are_checked_before_posting() {
    use rdma_cm::MAX_SGE;
    let t = DeviceTest::start();
    let sspec = PairSpec { mr_sizes: vec![4096, 4096], init: QpInit::new().max_recv_sge(2), ..PairSpec::default() };
    let (mut c, mut s) = lane_pair(t.addr, PairSpec::default(), sspec, 64);
    let invalid = |e: &Error, needle: &str| match e {
        Error::InvalidArgument(m) => assert!(m.contains(needle), "{m:?} should mention {needle:?}"),
        other => panic!("expected InvalidArgument mentioning {needle:?}, got {other:?}"),
    };
    // Posts `wr` on `side`, which must refuse it before the provider; checks the error with
    // `check` and gives the region back.
    let refused = |side: &mut LaneSide, wr: RecvWr, check: &dyn Fn(&Error)| -> MemoryRegion {
        let r = side.lane.post_recv(side.qp, wr).unwrap_err();
        check(r.error());
        let mr = r.into_inner().expect("the refused receive's region comes back");
        assert_eq!(side.lane.outstanding(side.qp).unwrap(), (0, 0), "nothing was posted");
        mr
    };
    let mut mr = s.mrs.remove(0);
    // More pieces than the QP takes: 3 on a QP of 2, and 2 on the client's QP of 1.
    mr = refused(&mut s, RecvWr::scatter(mr, &[0..8, 8..16, 16..24]), &|e| {
        invalid(e, "QpInit::max_recv_sge");
        invalid(e, "limit of 2");
    });
    let cmr = MemoryRegion::new(&c.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let cmr = refused(&mut c, RecvWr::scatter(cmr, &[0..8, 8..16]), &|e| invalid(e, "limit of 1"));
    // No piece, more than MAX_SGE, an empty piece among several (first or later).
    mr = refused(&mut s, RecvWr::scatter(mr, &[]), &|e| invalid(e, "1 to 4 pieces"));
    let many: Vec<_> = (0..MAX_SGE + 1).map(|i| i * 8..i * 8 + 8).collect();
    mr = refused(&mut s, RecvWr::scatter(mr, &many), &|e| invalid(e, "MAX_SGE"));
    mr = refused(&mut s, RecvWr::scatter(mr, &[0..8, 8..8]), &|e| invalid(e, "non-empty"));
    mr = refused(&mut s, RecvWr::scatter(mr, &[0..0, 8..16]), &|e| invalid(e, "non-empty"));
    // A piece out of the region, first or later.
    mr = refused(&mut s, RecvWr::scatter(mr, &[0..8, 4090..4100]), &|e| {
        assert!(matches!(e, Error::OutOfBounds { offset: 4090, len: 10, size: 4096, .. }), "{e:?}")
    });
    mr = refused(&mut s, RecvWr::scatter(mr, &[4095..4097, 0..8]), &|e| {
        assert!(matches!(e, Error::OutOfBounds { offset: 4095, len: 2, size: 4096, .. }), "{e:?}")
    });
    // A list post, and a prepared receive, take receives of one piece only.
    let other = s.mrs.remove(0);
    let mut list = [Some(RecvWr::range(other, 0..64)), Some(RecvWr::scatter(mr, &[0..8, 8..16]))];
    let e = s.lane.post_recv_list(s.qp, &mut list).unwrap_err();
    invalid(&e, "RecvWr::scatter");
    assert!(list.iter().all(Option::is_some), "a refused list keeps its receives");
    assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0), "nothing was posted");
    let mr = list[1].take().unwrap().into_region();
    let r = s.lane.prepare_recv(s.qp, RecvWr::scatter(mr, &[0..8, 8..16])).unwrap_err();
    invalid(r.error(), "prepare_recv");
    let mr = r.into_inner().expect("the refused receive's region comes back");
    // A scatter of one range is a receive of that range, on a QP of one piece too.
    c.lane.post_recv(c.qp, RecvWr::scatter(cmr, std::slice::from_ref(&(8..40))).wr_id(1)).unwrap();
    s.lane.post_send(s.qp, SendWr::send(mr, 0..32).wr_id(2)).unwrap();
    assert_eq!(ok(&mut s.lane).wr_id(), 2);
    let got = ok(&mut c.lane);
    assert_eq!((got.wr_id(), got.byte_len()), (1, 32));
    drop((c, s, got, list));
    t.finish();
}

/// Scatter/gather limits, each refused with `InvalidArgument` (or `OutOfBounds`) before
/// anything is posted, the region given back: more pieces than the queue takes (alone or in a
/// list, whose valid requests are not posted either), no piece, more than `MAX_SGE`, an empty
/// piece among several, a region on another PD, a piece out of bounds, or a READ into a region
/// without LOCAL_WRITE; a gathered send of one empty piece, or from a region without
/// LOCAL_WRITE, goes through; and queue sizes the crate cannot take.
#[test]
fn scatter_gather_limits_are_checked_before_posting() {
    use rdma_cm::{ProtectionDomain, SharedReceiveQueue, MAX_SGE};
    let t = DeviceTest::start();
    let cspec =
        PairSpec { mr_sizes: vec![4096, 4096, 4096], init: QpInit::new().max_send_sge(2), ..PairSpec::default() };
    let (mut c, mut s) = lane_pair(t.addr, cspec, PairSpec::default(), 64);
    let invalid = |e: &Error, needle: &str| match e {
        Error::InvalidArgument(m) => assert!(m.contains(needle), "{m:?} should mention {needle:?}"),
        other => panic!("expected InvalidArgument mentioning {needle:?}, got {other:?}"),
    };
    // Posts `wr` on the client, which must refuse it before the provider; checks the error
    // with `check` and gives the region back.
    let refused = |c: &mut LaneSide, wr: SendWr, check: &dyn Fn(&Error)| -> MemoryRegion {
        let r = c.lane.post_send(c.qp, wr).unwrap_err();
        check(r.error());
        let mr = r.into_inner().expect("the refused request's region comes back");
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0), "nothing was posted");
        mr
    };
    let mut mr = c.mrs.remove(0);
    // More pieces than the QP takes: 3 on a queue of 2 (the message names the limit and the setter).
    mr = refused(&mut c, SendWr::send_sg(mr, &[0..8, 8..16, 16..24]), &|e| {
        invalid(e, "QpInit::max_send_sge");
        invalid(e, "limit of 2");
    });
    // In a list: the valid ones before it are not posted either, and every request is kept.
    let (b, d) = (c.mrs.remove(0), c.mrs.remove(0));
    let mut list = [
        Some(SendWr::send_sg(b, &[0..8, 8..16])),
        Some(SendWr::send(d, 0..8)),
        Some(SendWr::send_sg(mr, &[0..8, 8..16, 16..24])),
    ];
    let e = c.lane.post_send_list(c.qp, &mut list).unwrap_err();
    invalid(&e, "max_send_sge");
    assert!(list.iter().all(Option::is_some), "a refused list keeps its work requests");
    assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0), "nothing was posted");
    let mut mr = list[2].take().unwrap().into_region();
    // No piece, more than MAX_SGE, an empty piece among several.
    mr = refused(&mut c, SendWr::send_sg(mr, &[]), &|e| invalid(e, "1 to 4 pieces"));
    let many: Vec<_> = (0..MAX_SGE + 1).map(|i| i * 8..i * 8 + 8).collect();
    mr = refused(&mut c, SendWr::send_sg(mr, &many), &|e| invalid(e, "MAX_SGE"));
    let remote = s.mrs[0].remote();
    mr = refused(&mut c, SendWr::read_sg(mr, &many, &remote, 0), &|e| invalid(e, "MAX_SGE"));
    mr = refused(&mut c, SendWr::send_sg(mr, &[0..8, 8..8]), &|e| invalid(e, "non-empty"));
    // A region on another PD than the QP's.
    let other_pd = ProtectionDomain::new(c.pd.context()).unwrap();
    let foreign = MemoryRegion::new(&other_pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let foreign =
        refused(&mut c, SendWr::send_sg(foreign, &[0..8, 8..16]), &|e| invalid(e, "another protection domain"));
    // A later piece out of bounds.
    mr = refused(&mut c, SendWr::send_sg(mr, &[0..8, 4090..4100]), &|e| {
        assert!(matches!(e, Error::OutOfBounds { offset: 4090, len: 10, size: 4096, .. }), "{e:?}")
    });
    // A scattered READ into a region the device may not write.
    let c_read_only = MemoryRegion::new(&c.pd, 64, AccessFlags::REMOTE_READ).unwrap();
    let c_read_only =
        refused(&mut c, SendWr::read_sg(c_read_only, &[0..8, 8..16], &remote, 0), &|e| invalid(e, "LOCAL_WRITE"));
    // ... but a gathered send may read it; and one empty piece is an empty message.
    let buf = s.mrs.remove(0);
    s.lane.post_recv(s.qp, RecvWr::new(buf).wr_id(1)).unwrap();
    c.lane.post_send(c.qp, SendWr::send_sg(c_read_only, &[0..8, 8..16]).wr_id(2)).unwrap();
    assert_eq!(ok(&mut c.lane).wr_id(), 2);
    let mut got = ok(&mut s.lane);
    assert_eq!((got.wr_id(), got.byte_len()), (1, 16));
    s.lane.post_recv(s.qp, RecvWr::new(got.take_region().unwrap()).wr_id(3)).unwrap();
    c.lane.post_send(c.qp, SendWr::send_sg(mr, std::slice::from_ref(&(0..0))).wr_id(4)).unwrap();
    assert_eq!(ok(&mut c.lane).wr_id(), 4);
    let got = ok(&mut s.lane);
    assert_eq!((got.wr_id(), got.byte_len()), (3, 0), "one empty piece: an empty message");
    assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
    assert_eq!(s.lane.outstanding(s.qp).unwrap(), (0, 0));
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
    invalid(&SharedReceiveQueue::with_sge(&pd, 4, 0).map(drop).unwrap_err(), "with_sge(0)");
    invalid(&SharedReceiveQueue::with_sge(&pd, 4, MAX_SGE as u32 + 1).map(drop).unwrap_err(), "MAX_SGE");
    drop((pd, foreign, other_pd, got, list));
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
    use rdma_cm::verbs::port::GidType;
    use rdma_cm::VerbsContext;
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
    // A connection over IPv6, its QPs on lanes of the device at that address; data checked.
    let (mut la, mut lb) = (lane_on(IpAddr::V6(a6), 64), lane_on(IpAddr::V6(a6), 64));
    let spec = PairSpec { mr_sizes: vec![4096], ..PairSpec::default() };
    let (cspec, sspec) = (PairSpec { init: la.qp_init(), ..spec.clone() }, PairSpec { init: lb.qp_init(), ..spec });
    let (c, s) = pair(IpAddr::V6(a6), cspec, sspec);
    assert!(matches!(c.conn.peer_addr(), Some(SocketAddr::V6(p)) if *p.ip() == a6), "{:?}", c.conn.peer_addr());
    assert!(matches!(s.conn.local_addr(), Some(SocketAddr::V6(p)) if *p.ip() == a6), "{:?}", s.conn.local_addr());
    let (common::Side { conn: cc, mrs: mut cm, .. }, common::Side { conn: sc, mrs: mut sm, .. }) = (c, s);
    let cq = la.attach(cc).map_err(|r| r.into_parts().0).expect("attach (client)");
    let sq = lb.attach(sc).map_err(|r| r.into_parts().0).expect("attach (server)");
    let expect = pattern(4096, 6);
    let mut msg = cm.remove(0);
    msg.as_mut_slice().unwrap().copy_from_slice(&expect);
    lb.post_recv(sq, RecvWr::new(sm.remove(0)).wr_id(1)).unwrap();
    la.post_send(cq, SendWr::send(msg, 0..4096).wr_id(1)).unwrap();
    assert_eq!(ok(&mut la).wr_id(), 1);
    let mut got = ok(&mut lb);
    assert_eq!((got.wr_id(), got.byte_len()), (1, 4096));
    assert_eq!(got.take_region().unwrap().as_slice().unwrap(), &expect[..], "the IPv6 send arrived intact");
    drop((la, lb, got));

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

/// Spinning waits (`Lane::spin`, which never sleeps): round trips complete as with sleeping
/// waits, a spin with nothing coming still ends at its timeout, and a peer that leaves while
/// its receive is awaited is seen between spins (`Lane::peer_left`), which moves the QP to the
/// error state: the receive comes back flushed and posts are refused.
#[test]
fn spinning_waits_complete_time_out_and_see_the_peer_leaving() {
    let t = DeviceTest::start();
    let spec = PairSpec { mr_sizes: vec![64, 64], ..PairSpec::default() };
    let (mut c, mut s) = lane_pair(t.addr, spec.clone(), spec, 64);
    // Each side's message and receive regions, between posts.
    let mut cm = (Some(c.mrs.remove(0)), Some(c.mrs.remove(0)));
    let mut sm = (Some(s.mrs.remove(0)), Some(s.mrs.remove(0)));
    // Spins for `n` completions on `side`, putting each region back where it belongs.
    let settle = |side: &mut LaneSide, regions: &mut (Option<MemoryRegion>, Option<MemoryRegion>), n: usize, i: u64| {
        for _ in 0..n {
            let mut wc = side.lane.spin(T).expect("a completion within T").ok().unwrap();
            assert_eq!(wc.wr_id(), i);
            let mr = wc.take_region();
            match wc.queue() {
                WorkQueue::Send => regions.0 = mr,
                WorkQueue::Recv => {
                    assert_eq!(wc.byte_len(), 64);
                    regions.1 = mr;
                }
            }
        }
    };
    for i in 0..200u64 {
        s.lane.post_recv(s.qp, RecvWr::new(sm.1.take().unwrap()).wr_id(i)).unwrap();
        c.lane.post_recv(c.qp, RecvWr::new(cm.1.take().unwrap()).wr_id(i)).unwrap();
        c.lane.post_send(c.qp, SendWr::send(cm.0.take().unwrap(), 0..64).wr_id(i)).unwrap();
        settle(&mut s, &mut sm, 1, i);
        s.lane.post_send(s.qp, SendWr::send(sm.0.take().unwrap(), 0..64).wr_id(i)).unwrap();
        settle(&mut c, &mut cm, 2, i);
        settle(&mut s, &mut sm, 1, i);
    }
    assert!(cm.0.is_some() && cm.1.is_some() && sm.0.is_some() && sm.1.is_some(), "every region came back");
    // Nothing posted by the peer: the spin ends at its timeout, not before, not long after.
    c.lane.post_recv(c.qp, RecvWr::new(cm.1.take().unwrap()).wr_id(500)).unwrap();
    let started = Instant::now();
    let e = c.lane.spin(Duration::from_millis(300)).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, Error::Timeout { op: "Lane::spin", .. }), "{e}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(5), "{took:?}");
    // The peer leaves while we spin for its message: a look between spins sees it.
    let waiter = thread::spawn(move || {
        let deadline = Instant::now() + T;
        loop {
            match c.lane.spin(Duration::from_millis(20)) {
                Ok(wc) => return (wc, c),
                Err(Error::Timeout { .. }) => {}
                Err(e) => panic!("spin: {e}"),
            }
            c.lane.peer_left(c.qp).expect("Lane::peer_left");
            assert!(Instant::now() < deadline, "the spinning side never saw the peer leave");
        }
    });
    drop(s);
    let (mut wc, mut c) = waiter.join().unwrap();
    // (iWARP flushes the QP when TCP closes, ahead of the CM's DISCONNECTED, which follows.)
    assert_eq!((wc.wr_id(), wc.status()), (500, WcStatus::WrFlushErr), "{wc:?}");
    assert!(c.lane.wait_peer_left(c.qp, T).unwrap(), "the spinning side noticed the peer leaving");
    let r = c.lane.post_recv(c.qp, RecvWr::new(wc.take_region().unwrap())).unwrap_err();
    assert!(matches!(r.error(), Error::QpInError { .. }), "{r}");
    drop((c, cm, sm, r));
    t.finish();
}

/// An RDMA READ scattered into more pieces than the device reads into (`max_sge_rd`: 1 on siw)
/// is refused before posting, naming the limit, with its region given back; where the device
/// takes two pieces, the READ lands in both, in order.
#[test]
fn a_read_of_more_pieces_than_the_device_reads_into_is_refused() {
    let t = DeviceTest::start();
    {
        let cspec = PairSpec { init: QpInit::new().max_send_sge(2), ..PairSpec::default() };
        let sspec = PairSpec { access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, ..PairSpec::default() };
        let (mut c, mut s) = lane_pair(t.addr, cspec, sspec, 64);
        s.mrs[0].write_at(0, &pattern(16, 3)).unwrap();
        let remote = s.mrs[0].remote();
        let max_sge_rd = c.pd.context().limits().unwrap().max_sge_rd;
        let mr = c.mrs.remove(0);
        let wr = SendWr::read_sg(mr, &[0..8, 64..72], &remote, 0).wr_id(5);
        if max_sge_rd == 1 {
            let r = c.lane.post_send(c.qp, wr).unwrap_err();
            assert!(r.to_string().contains("max_sge_rd"), "{r}");
            let mr = r.into_inner().expect("the region comes back");
            assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0), "nothing posted");
            drop(mr);
        } else {
            c.lane.post_send(c.qp, wr).unwrap();
            let mut wc = ok(&mut c.lane);
            assert_eq!((wc.wr_id(), wc.byte_len()), (5, 16));
            let mut mr = wc.take_region().unwrap();
            let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
            mr.read_at(0, &mut a).unwrap();
            mr.read_at(64, &mut b).unwrap();
            assert_eq!([a, b].concat(), pattern(16, 3), "the READ lands in both pieces, in order");
        }
        drop((c, s));
    }
    t.finish();
}
