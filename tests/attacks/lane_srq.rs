//! Shared receive queues on the lane: a failed SRQ receive stops the QP it arrived on, a
//! receive's region is held until its message is delivered, and UD endpoints on an SRQ (their
//! own receives refused, the limit event seen by the lane and every event source, and not by a
//! later SRQ).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::common::lane::{lane_on, reap};
use crate::common::{mr_count, pattern, require, Cap, DeviceTest, T};
use rdma_cm::cm::ud_cm::{UdClient, UdServer};
use rdma_cm::status::WorkQueue;
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::async_event::{AsyncElement, AsyncEvent, AsyncEvents};
use rdma_cm::verbs::lane::{Lane, LaneQp, LaneSrq, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Client, ConnParam, Error, MemoryRegion, ProtectionDomain, QpInit, QpState, Server};

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

/// A region of `len` bytes on `pd` holding `bytes` at its start.
fn filled(pd: &Arc<ProtectionDomain>, len: usize, bytes: &[u8]) -> MemoryRegion {
    let mut mr = MemoryRegion::new(pd, len, LW).unwrap();
    mr.as_mut_slice().unwrap()[..bytes.len()].copy_from_slice(bytes);
    mr
}

/// One side of an RC connection made through a lane.
struct Side {
    lane: Lane,
    qp: LaneQp,
    pd: Arc<ProtectionDomain>,
}

/// An RC connection whose server QP takes its receives from an SRQ of the server's lane.
/// `fill` posts the SRQ's receives before the request is accepted. Returns (client, server,
/// the SRQ, the listener).
fn rc_on_srq(addr: IpAddr, fill: impl FnOnce(&mut Lane, &Arc<ProtectionDomain>, LaneSrq)) -> (Side, Side, LaneSrq) {
    let listener = Server::new().unwrap().bind(SocketAddr::new(addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let ctx = listener.context().unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let mut lane = Lane::new(&ctx, 64).unwrap();
    let srq = lane.create_srq(&pd, 8).unwrap();
    fill(&mut lane, &pd, srq);
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = lane_on(addr, 64);
        let c = route.lane_qp(&mut lane, &pd, QpInit::new().max_send_wr(8)).unwrap();
        let qp = c.qp();
        c.connect(&mut lane, &ConnParam::new(), T).expect("connect");
        Side { lane, qp, pd }
    });
    let init = lane.srq_qp_init(srq, QpInit::new().max_send_wr(8)).unwrap();
    let s = listener.get_request(T).unwrap().lane_qp(&mut lane, &pd, init).unwrap();
    let qp = s.qp();
    s.accept(&mut lane, &ConnParam::new(), T).expect("accept");
    let client = client.join().expect("the client thread");
    drop(listener);
    (client, Side { lane, qp, pd }, srq)
}

/// A message longer than the SRQ receive it lands in fails that receive (measured: rxe
/// `LOC_QP_OP_ERR`, the sender's `REM_OP_ERR`; siw `LOC_LEN_ERR`, the sender's a success) and
/// stops the RC QP it arrived on (rxe reports
/// it in the error state, siw in RESET), as any failed completion does.
/// The lane must then refuse that QP's posts with `QpInError` (giving the region back), as it
/// does after a failed completion of the QP's own queues; the receive's region comes back
/// with the failed completion, which names the QP.
#[test]
fn a_failed_srq_receive_makes_its_rc_qp_refuse_posts() {
    let t = DeviceTest::start();
    {
        let (mut client, mut server, srq) = rc_on_srq(t.addr, |lane, pd, srq| {
            let small = MemoryRegion::new(pd, 64, LW).unwrap();
            lane.post_srq_recv(srq, RecvWr::range(small, 0..8).wr_id(7)).unwrap();
        });
        let msg = filled(&client.pd, 64, &pattern(64, 1));
        client.lane.post_send(client.qp, SendWr::send(msg, 0..64).wr_id(1)).unwrap();
        // The responder refuses the message; on rxe the requester's completion fails too.
        let sent = reap(&mut client.lane, 1).pop().unwrap();
        eprintln!("measured: the sender's completion: {:?}", sent.status());
        let mut got = server.lane.wait(T).expect("the SRQ receive's completion");
        eprintln!("measured: a 64-byte message into an 8-byte SRQ receive: {:?}", got.status());
        assert!(got.is_srq() && !got.is_ok(), "the short SRQ receive fails: {got:?}");
        assert_eq!((got.wr_id(), got.qp()), (7, Some(server.qp)), "{got:?}");
        assert!(got.take_region().is_some(), "the region comes back with the failed completion");
        assert_eq!(server.lane.srq_outstanding(srq).unwrap(), 0);
        let state = server.lane.attributes(server.qp).unwrap().state;
        eprintln!("measured: the RC QP after its failed SRQ receive: {state:?}");
        // rxe reports ERR; siw (measured on 6.1) RESET, its connection torn down.
        assert!(matches!(state, QpState::Error | QpState::Reset), "the QP can still run work: {state:?}");
        let out = MemoryRegion::new(&server.pd, 64, LW).unwrap();
        let r = server.lane.post_send(server.qp, SendWr::send(out, 0..8).wr_id(2));
        let refused = match r {
            Err(r) => {
                let (e, back) = r.into_parts();
                assert!(back.is_some(), "a refused post gives the region back: {e}");
                matches!(e, Error::QpInError { .. }).then_some(()).ok_or(e)
            }
            Ok(()) => {
                // Reap what it did (a flush on rxe) so the teardown is clean, then report.
                let _ = server.lane.wait(Duration::from_secs(2));
                Err(Error::InvalidArgument("the post was taken".into()))
            }
        };
        assert!(
            refused.is_ok(),
            "a post to an RC QP whose SRQ receive failed must be refused (QpInError): {refused:?}"
        );
        drop((client, server, sent, got));
    }
    t.finish();
}

/// An SRQ receive naming a range inside one region (the caller gives up its only handle when
/// it posts): the region stays registered while the receive is posted, counted by the SRQ, and
/// the message lands in that range alone (the bytes around it untouched). The completion hands
/// the region back, once; dropping it then deregisters it.
#[test]
fn an_srq_receive_holds_its_region_until_the_message_is_delivered() {
    let t = DeviceTest::start();
    {
        let mut before = None;
        let (mut client, mut server, srq) = rc_on_srq(t.addr, |lane, pd, srq| {
            let x = MemoryRegion::new(pd, 160, LW).unwrap();
            before = mr_count();
            lane.post_srq_recv(srq, RecvWr::range(x, 32..128).wr_id(9)).unwrap();
        });
        assert_eq!(server.lane.srq_outstanding(srq).unwrap(), 1);
        assert_eq!(mr_count(), before, "the posted receive keeps the region registered");
        let msg = pattern(96, 17);
        let m = filled(&client.pd, 96, &msg);
        client.lane.post_send(client.qp, SendWr::send(m, 0..96).wr_id(1)).unwrap();
        let sent = reap(&mut client.lane, 1).pop().unwrap();
        assert!(sent.is_ok(), "{sent:?}");
        drop(sent);
        let mut got = server.lane.wait(T).expect("the message");
        assert!(got.is_ok() && got.is_srq(), "{got:?}");
        assert_eq!((got.wr_id(), got.byte_len(), got.qp()), (9, 96, Some(server.qp)));
        assert_eq!(server.lane.srq_outstanding(srq).unwrap(), 0);
        let mut x = got.take_region().expect("the region comes back with the completion");
        assert!(got.take_region().is_none() && server.lane.poll().unwrap().is_none(), "once");
        let bytes = x.as_slice().unwrap();
        assert_eq!(&bytes[32..128], &msg[..], "the message landed in the receive's range");
        assert!(bytes[..32].iter().chain(&bytes[128..]).all(|&b| b == 0), "outside the range: untouched");
        assert_eq!(mr_count(), before, "the region handed back is the one registered");
        drop(x);
        assert_eq!(mr_count(), before.map(|n| n - 1), "dropping the region handed back deregisters it");
        drop((client, server, got));
    }
    t.finish();
}

/// Reads `events` (bounded by `within`) until one satisfies `want`.
fn wait_event(events: &mut AsyncEvents, within: Duration, want: impl Fn(&AsyncEvent) -> bool) -> AsyncEvent {
    let deadline = Instant::now() + within;
    let mut others = vec![];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.next(left) {
            Ok(ev) if want(&ev) => return ev,
            Ok(ev) => others.push(ev),
            Err(e) => panic!("the expected event did not come within {within:?} ({e}); others seen: {others:?}"),
        }
    }
}

/// A UD endpoint of a server lane on the lane's SRQ of 4 receives, its limit armed at 2: a
/// receive posted to the endpoint itself is refused, saying where receives go, and its region
/// comes back; three datagrams land in the SRQ, each naming the endpoint, payload after the
/// GRH; the limit event reaches the lane and each of two event sources (each its own copy,
/// naming the SRQ). Once that lane is gone, fresh SRQs of a fresh lane on the same context
/// (perhaps at the old one's address) are not told about the old one's event.
#[test]
fn a_ud_endpoint_on_a_lane_srq_and_the_limit_event_of_an_srq_that_is_gone() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let addr = t.addr;
        let listener = UdServer::new().unwrap().listen(SocketAddr::new(addr, 0), 8).unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            let req = listener.get_request(T).unwrap();
            let ctx = req.context().unwrap();
            let pd = ProtectionDomain::new(&ctx).unwrap();
            let mut lane = Lane::new(&ctx, 64).unwrap();
            let srq = lane.create_srq(&pd, 4).unwrap();
            for k in 0..4 {
                let buf = MemoryRegion::new(&pd, GRH_LEN + 64, LW).unwrap();
                lane.post_srq_recv(srq, RecvWr::new(buf).wr_id(100 + k)).unwrap();
            }
            lane.srq_arm_limit(srq, 2).unwrap();
            let init = lane.srq_qp_init(srq, QpInit::new().max_send_wr(4)).unwrap();
            let ep = req.create_qp(&pd, init).unwrap().accept(&[]).unwrap();
            let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("a UD endpoint on the SRQ");
            (lane, pd, srq, qp, ctx, listener)
        });
        let mut lane = lane_on(addr, 64);
        let route = UdClient::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(addr, port), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let cpd = route.alloc_pd().unwrap();
        let mut ep = route.create_qp(&cpd, lane.qp_init()).unwrap();
        let dest = ep.connect(&[], T).unwrap();
        let cqp = lane.attach(ep).map_err(|r| r.into_parts().0).unwrap();
        let to = lane.add_dest(cqp, &dest).unwrap();
        let (mut slane, spd, srq, sqp, ctx, listener) = server.join().unwrap();
        let (mut a, mut b) = (ctx.async_events().unwrap(), ctx.async_events().unwrap());
        // The endpoint's own receive queue is the SRQ's.
        let r = slane.post_recv(sqp, RecvWr::new(MemoryRegion::new(&spd, GRH_LEN + 64, LW).unwrap())).unwrap_err();
        assert!(matches!(r.error(), Error::InvalidArgument(m) if m.contains("Lane::post_srq_recv")), "{}", r.error());
        assert!(r.into_inner().is_some(), "the region comes back");
        assert_eq!(slane.outstanding(sqp).unwrap(), (0, 0));
        for i in 0..3u8 {
            let m = filled(&cpd, 64, &[i; 64]);
            lane.post_send(cqp, SendWr::send(m, 0..64).to(to).wr_id(i as u64)).unwrap();
        }
        assert!(reap(&mut lane, 3).iter().all(|c| c.is_ok()));
        let mut ids = vec![];
        for mut c in reap(&mut slane, 3) {
            assert!(c.is_ok() && c.is_srq() && c.qp() == Some(sqp), "{c:?}");
            assert_eq!((c.queue(), c.byte_len() as usize), (WorkQueue::Recv, GRH_LEN + 64));
            let mut buf = c.take_region().unwrap();
            let v = buf.as_slice().unwrap()[GRH_LEN..GRH_LEN + 64].to_vec();
            assert!(v.iter().all(|&x| x == v[0]) && v[0] < 3, "{v:?}");
            ids.push(c.wr_id());
        }
        ids.sort();
        ids.dedup();
        assert!(ids.len() == 3 && ids.iter().all(|i| (100..104).contains(i)), "{ids:?}");
        assert_eq!(slane.srq_outstanding(srq).unwrap(), 1);
        // The limit event: both sources get it, naming the SRQ; the lane's SRQ is marked.
        let old_raw = slane.srq_as_raw(srq).unwrap() as usize;
        let ea = wait_event(&mut a, T, |e| e.is_srq_limit());
        let eb = wait_event(&mut b, T, |e| e.is_srq_limit());
        assert_eq!(ea, eb);
        assert_eq!(ea.element, AsyncElement::Srq(old_raw));
        let deadline = Instant::now() + T;
        while !slane.srq_limit_reached(srq).unwrap() {
            assert!(Instant::now() < deadline, "the lane did not see the limit event within {T:?}");
            thread::yield_now();
        }
        // The server's lane goes (its endpoint, then the SRQ); fresh SRQs on the same context.
        drop(slane);
        drop(spd);
        let pd2 = ProtectionDomain::new(&ctx).unwrap();
        let mut fresh_lane = Lane::new(&ctx, 64).unwrap();
        let fresh: Vec<LaneSrq> = (0..4).map(|_| fresh_lane.create_srq(&pd2, 4).unwrap()).collect();
        let mut reused = false;
        for q in &fresh {
            reused |= fresh_lane.srq_as_raw(*q).unwrap() as usize == old_raw;
            assert!(!fresh_lane.srq_limit_reached(*q).unwrap(), "a new SRQ was told about the old one's limit event");
        }
        eprintln!("measured: a fresh SRQ reused the old one's address: {reused}");
        drop((fresh_lane, pd2, a, b, ctx, lane, dest, cpd, listener));
    }
    t.finish();
}
