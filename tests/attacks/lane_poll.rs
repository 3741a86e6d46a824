//! Completions and waits on the lane: immediate data and `wr_id`s round-trip unchanged, a
//! failed completion keeps its `wr_id` and its region and makes an RC QP refuse later posts,
//! work the peer's departure flushes is reported once each, and the waits take every timeout
//! from zero to `FOREVER`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::common::lane::{lane_on, lane_pair, reap, LaneSide};
use crate::common::{pattern, require, Cap, DeviceTest, T};
use crate::shared::{region, spec};
use rdma_cm::verbs::lane::{RecvWr, SendWr};
use rdma_cm::{
    Client, ConnParam, Error, MemoryRegion, ProtectionDomain, QpInit, RemoteRegion, Server, WcOpcode, WcStatus,
    WorkQueue, FOREVER,
};

fn message(pd: &Arc<ProtectionDomain>, seed: u8) -> MemoryRegion {
    let mut m = region(pd, 64);
    m.as_mut_slice().unwrap().copy_from_slice(&pattern(64, seed));
    m
}

/// Immediate data round-trips: 0 is `Some(0)`, not `None`; a plain send is `None`; an RDMA
/// WRITE with immediate consumes an empty receive and reports its data and length; the
/// sender's completions report no immediate data (rxe sets `IBV_WC_WITH_IMM` in them but leaves
/// the value 0, which would read as data the peer sent).
#[test]
fn immediate_data_zero_is_not_none_and_every_value_round_trips() {
    let t = DeviceTest::start();
    if !require(Cap::ImmediateData) {
        return t.finish();
    }
    {
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        for id in 1..=3 {
            s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, 64)).wr_id(id)).unwrap();
        }
        s.lane.post_recv(s.qp, RecvWr::range(region(&s.pd, 64), 64..64).wr_id(4)).unwrap();
        let remote = s.mrs[0].remote();
        let wrs = [
            SendWr::send(message(&c.pd, 44), 0..8).wr_id(11).imm(0),
            SendWr::send(message(&c.pd, 44), 0..8).wr_id(12),
            SendWr::send(message(&c.pd, 44), 0..8).wr_id(13).imm(0xdead_beef),
            SendWr::write(message(&c.pd, 44), 0..16, &remote, 0).wr_id(14).imm(0x0102_0304),
        ];
        assert_eq!(c.lane.post_send_iter(c.qp, wrs).unwrap(), 4);
        let got = reap(&mut s.lane, 4);
        let seen: Vec<_> = got.iter().map(|g| (g.wr_id(), g.imm_data(), g.opcode(), g.byte_len())).collect();
        assert_eq!(
            seen,
            [
                (1, Some(0), Some(WcOpcode::Recv), 8),
                (2, None, Some(WcOpcode::Recv), 8),
                (3, Some(0xdead_beef), Some(WcOpcode::Recv), 8),
                (4, Some(0x0102_0304), Some(WcOpcode::RecvRdmaWithImm), 16),
            ]
        );
        let mut landed = [0u8; 16];
        s.mrs[0].read_at(0, &mut landed).unwrap();
        assert_eq!(&landed[..], &pattern(64, 44)[..16], "the WRITE landed");
        let sent = reap(&mut c.lane, 4);
        let seen: Vec<_> = sent.iter().map(|g| (g.wr_id(), g.opcode(), g.imm_data())).collect();
        assert_eq!(
            seen,
            [
                (11, Some(WcOpcode::Send), None),
                (12, Some(WcOpcode::Send), None),
                (13, Some(WcOpcode::Send), None),
                (14, Some(WcOpcode::RdmaWrite), None),
            ],
            "a sender's completion carries no immediate data"
        );
        drop((c, s));
    }
    t.finish();
}

/// A failed completion keeps the caller's `wr_id` whole (bits 61 to 63 included), hides its
/// opcode and immediate data, hands the region back, becomes `Error::WorkCompletion` naming the
/// `wr_id` through `ok()`, and makes the RC QP refuse every later post naming the failure,
/// with the region given back: a WRITE and a READ through a wrong rkey.
#[test]
fn a_failed_completion_keeps_its_wr_id_and_makes_an_rc_qp_refuse_later_posts() {
    let t = DeviceTest::start();
    if !require(Cap::RemoteWriteError) {
        return t.finish();
    }
    for (read, id) in [(false, 0xe000_0000_0000_0007u64), (true, u64::MAX)] {
        let (mut c, s) = lane_pair(t.addr, spec(), spec(), 64);
        let good = s.mrs[0].remote();
        let bad = RemoteRegion::new(good.addr, good.rkey ^ 0x5a5a_0000, good.len);
        let mr = message(&c.pd, 3);
        let wr = if read { SendWr::read(mr, 0..64, &bad, 0) } else { SendWr::write(mr, 0..64, &bad, 0) };
        c.lane.post_send(c.qp, wr.wr_id(id)).unwrap();
        let mut f = reap(&mut c.lane, 1).pop().unwrap();
        let what = if read { "READ" } else { "WRITE" };
        assert_eq!((f.wr_id(), f.queue(), f.status()), (id, WorkQueue::Send, WcStatus::RemAccessErr), "{what}: {f:?}");
        assert!(!f.is_ok() && f.opcode().is_none() && f.imm_data().is_none(), "{what}: {f:?}");
        let mut back = f.take_region().expect("a failed completion hands its region back");
        if read {
            assert_eq!(back.as_slice().unwrap(), &pattern(64, 3)[..], "the failed READ wrote nothing");
        }
        match f.ok() {
            Err(Error::WorkCompletion { wr_id, status: WcStatus::RemAccessErr, .. }) => assert_eq!(wr_id, id),
            other => panic!("{what}: expected Error::WorkCompletion, got {other:?}"),
        }
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
        let rej = c.lane.post_recv(c.qp, RecvWr::new(back)).unwrap_err();
        let m = rej.to_string();
        assert!(matches!(rej.error(), Error::QpInError { .. }), "{what}: {m}");
        assert!(m.contains("REM_ACCESS_ERR"), "{what}: the refusal names the failure: {m}");
        let back = rej.into_inner().expect("the refused receive's region comes back");
        let rej = c.lane.post_send(c.qp, SendWr::send(back, 0..8)).unwrap_err();
        assert!(matches!(rej.error(), Error::QpInError { .. }), "{what}: {rej}");
        assert!(rej.into_inner().is_some());
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0), "{what}: nothing posted");
        drop((c, s));
    }
    t.finish();
}

/// The caller's `wr_id`s come back unchanged, also those with the high bits a lane's tag uses
/// (61 to 63) set, and 0, through every post path, on both queues, in order.
#[test]
fn wr_ids_with_the_high_bits_set_round_trip() {
    let t = DeviceTest::start();
    {
        let (mut c, mut s) = lane_pair(t.addr, spec(), spec(), 64);
        let ids = [u64::MAX, 1 << 63, 1 << 62, 1 << 61, 0, (7 << 61) | 5];
        let mut recvs: Vec<Option<RecvWr>> =
            ids.iter().map(|&id| Some(RecvWr::new(region(&s.pd, 64)).wr_id(id))).collect();
        assert_eq!(s.lane.post_recv_list(s.qp, &mut recvs).unwrap(), ids.len());
        for &id in &ids {
            s.lane.post_recv(s.qp, RecvWr::new(region(&s.pd, 64)).wr_id(id)).unwrap();
        }
        let pd = c.pd.clone();
        assert_eq!(
            c.lane.post_send_iter(c.qp, ids.map(|id| SendWr::send(message(&pd, 1), 0..8).wr_id(id))).unwrap(),
            6
        );
        let mut list: Vec<Option<SendWr>> =
            ids.iter().map(|&id| Some(SendWr::send(message(&pd, 1), 0..8).wr_id(id).unsignaled())).collect();
        list.last_mut().unwrap().replace(SendWr::send(message(&pd, 1), 0..8).wr_id(ids[5]));
        assert_eq!(c.lane.post_send_list(c.qp, &mut list).unwrap(), 6);
        let sent: Vec<(u64, bool)> = reap(&mut c.lane, 12).iter().map(|g| (g.wr_id(), g.is_ok())).collect();
        let got: Vec<(u64, bool)> = reap(&mut s.lane, 12).iter().map(|g| (g.wr_id(), g.is_ok())).collect();
        let want: Vec<(u64, bool)> = ids.iter().chain(&ids).map(|&id| (id, true)).collect();
        assert_eq!(sent, want, "the sends' completions (the unsignaled ones retired by the last)");
        assert_eq!(got, want, "the receives' completions");
        assert!(c.lane.poll().unwrap().is_none() && s.lane.poll().unwrap().is_none(), "each once");
        drop((c, s));
    }
    t.finish();
}

/// Unsignaled sends stuck at the peer (no receive posted, so they wait on receiver-not-ready
/// retries) are flushed when the peer leaves: each is reported once, with its own `wr_id` and
/// its region, and none succeeded.
#[test]
fn unsignaled_sends_flushed_by_the_peer_leaving_are_each_reported_once() {
    let t = DeviceTest::start();
    if !require(Cap::RnrRetry) {
        return t.finish();
    }
    {
        let (mut c, s) = lane_pair(t.addr, spec(), spec(), 64);
        let pd = c.pd.clone();
        let wrs = (1..=3).map(|k| SendWr::send(message(&pd, k as u8), 0..8).wr_id(k).unsignaled());
        assert_eq!(c.lane.post_send_iter(c.qp, wrs).unwrap(), 3);
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (3, 0));
        drop(s);
        // The departure is read (a lane reads its members' CM events when asked), which moves
        // the QP to the error state and so flushes what it holds.
        assert!(c.lane.wait_peer_left(c.qp, T).unwrap(), "the peer's departure was not seen");
        let mut got: Vec<(u64, bool)> = reap(&mut c.lane, 3)
            .into_iter()
            .map(|mut g| (g.wr_id(), !g.is_ok() && g.take_region().is_some()))
            .collect();
        got.sort();
        assert_eq!(got, [(1, true), (2, true), (3, true)], "each failed once, with its region");
        assert_eq!(c.lane.outstanding(c.qp).unwrap(), (0, 0));
        assert!(c.lane.poll().unwrap().is_none(), "nothing twice");
        drop(c);
    }
    t.finish();
}

/// `Duration::ZERO` and 1 ns on every lane wait return at once (a timeout, or what is already
/// there); `FOREVER` and huge finite timeouts wait without a bound and without panicking, in
/// the lane's connect and accept, its waits and `disconnect` (`wait_peer_left`: see the test
/// after this one).
#[test]
fn zero_tiny_huge_and_forever_timeouts_on_lane_waits() {
    let t = DeviceTest::start();
    {
        let quick = Duration::from_secs(2);
        let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
        let dst = listener.local_addr().unwrap();
        let addr = t.addr;
        let server = thread::spawn(move || {
            let mut lane = lane_on(addr, 32);
            let req = listener.get_request(FOREVER).unwrap();
            let pd = req.alloc_pd().unwrap();
            let srv = req.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
            let qp = srv.qp();
            srv.accept(&mut lane, &ConnParam::new(), FOREVER).unwrap();
            LaneSide { lane, qp, pd, mrs: vec![] }
        });
        let mut lane = lane_on(t.addr, 32);
        let route = Client::new().unwrap().resolve_addr(None, dst, FOREVER).unwrap().resolve_route(FOREVER).unwrap();
        let pd = route.alloc_pd().unwrap();
        let cl = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        let qp = cl.qp();
        cl.connect(&mut lane, &ConnParam::new(), FOREVER).unwrap();
        let mut c = LaneSide { lane, qp, pd, mrs: vec![] };
        let mut s = server.join().unwrap();

        c.lane.post_recv(c.qp, RecvWr::new(region(&c.pd, 64)).wr_id(1)).unwrap();
        for d in [Duration::ZERO, Duration::from_nanos(1)] {
            let start = Instant::now();
            assert!(matches!(c.lane.wait(d), Err(Error::Timeout { .. })), "wait({d:?})");
            assert!(matches!(c.lane.spin(d), Err(Error::Timeout { .. })), "spin({d:?})");
            assert!(matches!(c.lane.wait_with(4, d, |_, _| ()), Err(Error::Timeout { .. })), "wait_with({d:?})");
            assert!(!c.lane.wait_peer_left(c.qp, d).unwrap(), "wait_peer_left({d:?})");
            assert!(matches!(s.lane.wait(d), Err(Error::Timeout { .. })), "nothing posted: wait({d:?})");
            assert!(start.elapsed() < quick, "{d:?} took {:?}", start.elapsed());
        }
        assert_eq!(c.lane.wait_with(0, FOREVER, |_, _| ()).unwrap(), 0, "nothing asked for, at once");
        // Huge and unbounded timeouts: the answer arrives, the wait returns it.
        let huge = [FOREVER, Duration::from_secs(u64::MAX), Duration::MAX - Duration::from_nanos(1)];
        for (k, d) in huge.into_iter().enumerate() {
            let k = k as u64;
            if k > 0 {
                c.lane.post_recv(c.qp, RecvWr::new(region(&c.pd, 64)).wr_id(1 + k)).unwrap();
            }
            s.lane.post_send(s.qp, SendWr::send(message(&s.pd, 1), 0..8).wr_id(100 + k)).unwrap();
            assert_eq!(s.lane.wait(d).unwrap().wr_id(), 100 + k, "wait({d:?})");
            let got = if k == 1 { c.lane.spin(d) } else { c.lane.wait(d) };
            assert_eq!(got.unwrap().wr_id(), 1 + k, "{d:?}");
        }
        // A zero timeout hands out what is already there: the receive completed before its
        // send's completion came back to the peer.
        c.lane.post_recv(c.qp, RecvWr::new(region(&c.pd, 64)).wr_id(9)).unwrap();
        s.lane.post_send(s.qp, SendWr::send(message(&s.pd, 1), 0..8).wr_id(109)).unwrap();
        assert_eq!(s.lane.wait(T).unwrap().wr_id(), 109);
        let start = Instant::now();
        let got = loop {
            match c.lane.wait(Duration::ZERO) {
                Ok(g) => break g,
                Err(Error::Timeout { .. }) if start.elapsed() < T => continue,
                Err(e) => panic!("a zero wait never handed the receive out: {e}"),
            }
        };
        assert_eq!(got.wr_id(), 9);
        c.lane.disconnect(c.qp, FOREVER).unwrap();
        assert!(s.lane.wait_peer_left(s.qp, T).unwrap());
        let start = Instant::now();
        let r = s.lane.disconnect(s.qp, Duration::ZERO);
        assert!(r.is_ok() || matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(3), "disconnect(ZERO) took {:?}", start.elapsed());
        drop((c, s));
    }
    t.finish();
}

/// `Lane::wait_peer_left` with `FOREVER`, and with a huge finite timeout, waits until the peer
/// leaves and says so, as every other wait of the crate takes those timeouts.
#[test]
fn wait_peer_left_takes_forever_and_huge_timeouts() {
    let t = DeviceTest::start();
    for d in [FOREVER, Duration::from_secs(u64::MAX)] {
        let (c, mut s) = lane_pair(t.addr, spec(), spec(), 32);
        drop(c);
        assert!(s.lane.wait_peer_left(s.qp, d).unwrap(), "wait_peer_left({d:?})");
        drop(s);
    }
    t.finish();
}
