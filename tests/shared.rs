//! The shapes servers at scale use, on the device: one lane (one CQ) for many QPs, one shared
//! receive queue, one event channel for every connection, and one thread waiting on the
//! channel and the lane together.

mod common;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::thread;
use std::time::{Duration, Instant};

use common::lane::{lane_on, reap};
use common::{DeviceTest, T};
use rdma_cm::verbs::async_event::AsyncElement;
use rdma_cm::verbs::lane::{Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::{
    Accepting, AccessFlags, Client, CmEventType, ConnParam, ConnectRequest, Error, EventChannel, MemoryRegion,
    ProtectionDomain, QpInit, Readiness, Server, WcStatus, WorkQueue,
};

const SLOT: usize = 64;

/// How long a client of the hundred waits for an echo.
const ECHO_WITHIN: Duration = Duration::from_secs(120);

/// A deterministic generator (xorshift), for sizes and orders.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// A message: (client, sequence number) and a pattern derived from them.
fn message(client: u64, seq: u64) -> [u8; SLOT] {
    let mut m = [0u8; SLOT];
    m[..8].copy_from_slice(&client.to_be_bytes());
    m[8..16].copy_from_slice(&seq.to_be_bytes());
    for (i, b) in m[16..].iter_mut().enumerate() {
        *b = (client as u8).wrapping_mul(31).wrapping_add(seq as u8).wrapping_add(i as u8);
    }
    m
}

/// One thread serves N clients on one event channel, one lane and one SRQ, waiting on the
/// channel and the lane's CQ together (`Readiness`, `Lane::arm`): it echoes every message from
/// the region it landed in (zero copy), and posts the region to the SRQ again once the echo is
/// sent. Clients come and go (each sends its own number of messages, then leaves), so server
/// QPs leave the lane in random order while the others keep working. Every byte is checked on
/// both sides, and every completion is accounted for.
#[test]
fn hundred_clients_one_thread_one_lane_one_srq() {
    const N: u64 = 100;
    const SRQ_DEPTH: u32 = 256;
    let t = DeviceTest::start();
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(128).unwrap();
    let dst = listener.local_addr().unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let counts: Vec<u64> = (0..N).map(|_| 3 + next(&mut seed) % 20).collect();
    let total: u64 = counts.iter().sum();

    let server = thread::spawn(move || {
        #[derive(Clone, Copy, PartialEq, Debug)]
        enum Source {
            Cm,
            Lane,
        }
        let ctx = listener.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 16 * N as u32 + SRQ_DEPTH).unwrap();
        let srq = lane.create_srq(&pd, SRQ_DEPTH).unwrap();
        let region = MemoryRegion::new(&pd, SLOT * SRQ_DEPTH as usize, AccessFlags::LOCAL_WRITE).unwrap();
        for (i, slot) in region.split(SLOT).unwrap().into_iter().enumerate() {
            lane.post_srq_recv(srq, RecvWr::new(slot).wr_id(i as u64)).unwrap();
        }
        assert_eq!(lane.srq_outstanding(srq).unwrap(), SRQ_DEPTH as usize);
        let mut accepting: HashMap<_, Accepting> = HashMap::new();
        let mut qps: HashMap<u32, LaneQp> = HashMap::new(); // by qp_num
        let mut by_id = HashMap::new(); // id handle -> LaneQp
        let mut early: HashMap<u32, Vec<MemoryRegion>> = HashMap::new(); // messages before ESTABLISHED
        let (mut echoed, mut gone, mut max_live) = (0u64, 0u64, 0usize);
        let cq = lane.cq();
        let mut ready = Readiness::new().channel(&ch, Source::Cm).cq(&cq, Source::Lane);
        let deadline = Instant::now() + Duration::from_secs(300);
        while gone < N {
            assert!(Instant::now() < deadline, "served {echoed} of {total}, {gone} of {N} gone");
            // Armed before the poll that empties the lane: a completion after it wakes the wait.
            lane.arm().unwrap();
            while let Some(mut c) = lane.poll().unwrap() {
                assert_eq!(c.status(), WcStatus::Success, "{c:?}");
                let slot = c.wr_id();
                let mut buf = c.take_region().expect("the region comes back");
                match c.queue() {
                    WorkQueue::Recv => {
                        assert!(c.is_srq());
                        assert_eq!(c.byte_len() as usize, SLOT);
                        let m = buf.as_slice().unwrap();
                        let client = u64::from_be_bytes(m[..8].try_into().unwrap());
                        let seq = u64::from_be_bytes(m[8..16].try_into().unwrap());
                        assert_eq!(m, &message(client, seq)[..], "bytes of client {client} message {seq}");
                        match c.qp().and_then(|q| qps.get(&c.qp_num()).filter(|&&k| k == q)) {
                            Some(&qp) => {
                                lane.post_send(qp, SendWr::send(buf, 0..SLOT).wr_id(slot)).unwrap();
                                echoed += 1;
                            }
                            None => early.get_mut(&c.qp_num()).expect("a receive of a known QP").push(buf),
                        }
                    }
                    WorkQueue::Send => {
                        // The echo left: the region goes back to the SRQ. (Echoes are counted
                        // when posted: a client may see its echo and leave before this loop
                        // reaps the send's completion; the removal of its QP then releases it.)
                        lane.post_srq_recv(srq, RecvWr::new(buf).wr_id(slot)).unwrap();
                    }
                }
            }
            for source in ready.wait(T).unwrap() {
                if source != Source::Cm {
                    continue;
                }
                while let Some(ev) = ch.try_get_event().unwrap() {
                    match ev.event_type() {
                        CmEventType::ConnectRequest => {
                            let req = ConnectRequest::from_event(ev).unwrap();
                            let init = lane.srq_qp_init(srq, QpInit::new()).unwrap();
                            let q = req.create_qp(&pd, init).unwrap();
                            let acc = q.start_accept(&ConnParam::new()).unwrap();
                            early.insert(acc.qp().qp_num(), vec![]);
                            accepting.insert(acc.handle(), acc);
                        }
                        CmEventType::Established => {
                            let acc = accepting.remove(&ev.id()).expect("ESTABLISHED of a known id");
                            let conn = acc.complete(ev).unwrap();
                            let (num, handle) = (conn.qp().qp_num(), conn.id().handle());
                            let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("attach");
                            qps.insert(num, qp);
                            by_id.insert(handle, qp);
                            // A client may send before this side sees ESTABLISHED: echo those now.
                            for buf in early.remove(&num).unwrap_or_default() {
                                lane.post_send(qp, SendWr::send(buf, 0..SLOT).wr_id(u64::MAX)).unwrap();
                                echoed += 1;
                            }
                            max_live = max_live.max(qps.len());
                        }
                        CmEventType::Disconnected => {
                            let qp = by_id.remove(&ev.id()).expect("DISCONNECTED of a known id");
                            lane.handle_event(qp, &ev).unwrap();
                            let num = lane.qp_num(qp).unwrap();
                            // Its QP leaves the lane; the others go on.
                            lane.remove(qp).unwrap();
                            qps.remove(&num);
                            gone += 1;
                        }
                        CmEventType::TimewaitExit => {}
                        other => panic!("unexpected {other}"),
                    }
                }
            }
        }
        assert!(qps.is_empty() && accepting.is_empty());
        drop(ready);
        drop((lane, cq, listener, pd));
        (echoed, max_live)
    });

    // Ten threads of ten clients each, one lane a thread: connect all, then ping-pong, then leave.
    let addr = t.addr;
    let clients: Vec<_> = (0..10u64)
        .map(|th| {
            let counts = counts.clone();
            thread::spawn(move || client_thread(addr, dst, th, &counts))
        })
        .collect();
    let sent: u64 = clients.into_iter().map(|h| h.join().unwrap()).sum();
    let (echoed, max_live) = server.join().unwrap();
    assert_eq!(sent, total, "every client message got its echo");
    assert_eq!(echoed, total, "the server's count agrees");
    assert!(max_live >= 10, "connections overlapped ({max_live} at most)");
    t.finish();
}

/// Ten clients of one thread on one lane: each connects, sends its messages one at a time
/// (its receive posted first), checks each echo, and disconnects. Returns how many echoes came.
fn client_thread(addr: IpAddr, dst: SocketAddr, th: u64, counts: &[u64]) -> u64 {
    let mut lane = lane_on(addr, 64);
    let mut mine = vec![];
    for k in 0..10 {
        let id = th * 10 + k;
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let bufs = (
            MemoryRegion::new(&pd, SLOT, AccessFlags::LOCAL_WRITE).unwrap(),
            MemoryRegion::new(&pd, SLOT, AccessFlags::LOCAL_WRITE).unwrap(),
        );
        let c = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        let qp = c.qp();
        c.connect(&mut lane, &ConnParam::new(), T).unwrap();
        mine.push((id, qp, Some(bufs), pd));
    }
    let mut sent = 0;
    for (id, qp, bufs, _) in &mut mine {
        for seq in 0..counts[*id as usize] {
            let (mut out, back) = bufs.take().unwrap();
            out.write_at(0, &message(*id, seq)).unwrap();
            lane.post_recv(*qp, RecvWr::new(back).wr_id(1)).unwrap();
            lane.post_send(*qp, SendWr::send(out, 0..SLOT).wr_id(2)).unwrap();
            let (mut out, mut back) = (None, None);
            // The server's one thread sets up and tears down a hundred connections between
            // echoes (each QP's destroy takes a while on a loaded Soft-RoCE guest), so an echo
            // may wait for many of them: bounded by the test's own bound, not by `T`.
            let mut done = Vec::with_capacity(2);
            while done.len() < 2 {
                done.push(lane.wait(ECHO_WITHIN).unwrap_or_else(|e| panic!("client {id} message {seq}: {e}")));
            }
            for mut c in done {
                assert_eq!(c.status(), WcStatus::Success, "{c:?}");
                match c.wr_id() {
                    1 => {
                        assert_eq!(c.byte_len() as usize, SLOT);
                        back = c.take_region();
                    }
                    _ => out = c.take_region(),
                }
            }
            let mut back = back.expect("the echo");
            assert_eq!(back.as_slice().unwrap(), &message(*id, seq)[..], "echo of client {id} message {seq}");
            *bufs = Some((out.expect("the send's region"), back));
            sent += 1;
        }
    }
    for (_, qp, bufs, pd) in mine {
        lane.disconnect(qp, T).unwrap();
        drop((bufs, pd));
    }
    sent
}

/// An SRQ that runs dry makes senders retry (RNR) until it is refilled, and its limit event
/// arrives, naming the SRQ, when it falls below the armed limit.
#[test]
fn srq_exhaustion_is_rnr_and_the_limit_event_arrives() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::RnrRetry) {
        return t.finish();
    }
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let addr = t.addr;
    let client = thread::spawn(move || {
        let mut lane = lane_on(addr, 64);
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let c = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        let qp = c.qp();
        c.connect(&mut lane, &ConnParam::new(), T).unwrap();
        // Six sends into an SRQ of four: the last two wait for room (RNR retries).
        for i in 0..6 {
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            lane.post_send(qp, SendWr::send(mr, 0..8).wr_id(i)).unwrap();
        }
        let mut done: Vec<u64> = reap(&mut lane, 6)
            .into_iter()
            .map(|c| {
                assert_eq!(c.status(), WcStatus::Success, "every send lands once the SRQ is refilled: {c:?}");
                c.wr_id()
            })
            .collect();
        done.sort();
        assert_eq!(done, [0, 1, 2, 3, 4, 5]);
        assert!(lane.wait_peer_left(qp, T).unwrap(), "the server's disconnect");
        drop((lane, pd));
    });
    let ctx = listener.context().unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let mut lane = Lane::new(&ctx, 64).unwrap();
    let srq = lane.create_srq(&pd, 4).unwrap();
    let region = MemoryRegion::new(&pd, 5 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut slots = region.split(64).unwrap();
    let spare = slots.pop().unwrap();
    for (i, m) in slots.into_iter().enumerate() {
        lane.post_srq_recv(srq, RecvWr::new(m).wr_id(i as u64)).unwrap();
    }
    let r = lane.post_srq_recv(srq, RecvWr::new(spare).wr_id(4)).unwrap_err();
    assert!(matches!(r.error(), Error::QueueFull { .. }), "{}", r.error());
    assert!(r.into_inner().is_some(), "the refused receive's region comes back");
    lane.srq_arm_limit(srq, 2).unwrap();
    let init = lane.srq_qp_init(srq, QpInit::new()).unwrap();
    let s = listener.get_request(T).unwrap().lane_qp(&mut lane, &pd, init).unwrap();
    let qp = s.qp();
    s.accept(&mut lane, &ConnParam::new(), T).unwrap();
    // Four receives complete; the queue is dry.
    let mut got = vec![];
    let mut back = vec![];
    for mut c in reap(&mut lane, 4) {
        assert_eq!((c.status(), c.queue()), (WcStatus::Success, WorkQueue::Recv), "{c:?}");
        got.push(c.wr_id());
        back.push(c.take_region().unwrap());
    }
    got.sort();
    assert_eq!(got, vec![0, 1, 2, 3]);
    assert_eq!(lane.srq_outstanding(srq).unwrap(), 0);
    // The limit (2) was crossed: the device said so, naming this SRQ, and the lane knows.
    let ev = ctx.async_events().unwrap().next(T).expect("the SRQ limit event");
    assert!(ev.is_srq_limit(), "{ev:?}");
    assert_eq!(ev.element, AsyncElement::Srq(lane.srq_as_raw(srq).unwrap() as usize));
    assert!(lane.srq_limit_reached(srq).unwrap());
    // Refill: the two waiting sends land.
    for (i, m) in back.into_iter().take(2).enumerate() {
        lane.post_srq_recv(srq, RecvWr::new(m).wr_id(10 + i as u64)).unwrap();
    }
    let mut refilled: Vec<u64> = reap(&mut lane, 2).into_iter().map(|c| c.wr_id()).collect();
    refilled.sort();
    assert_eq!(refilled, [10, 11]);
    lane.disconnect(qp, T).unwrap();
    client.join().unwrap();
    drop((lane, pd, ctx, listener));
    t.finish();
}

/// 120 connections set up and torn down on one event channel, by clients whose blocking steps
/// share it: every step meets the others' events and keeps them for their owners.
#[test]
fn many_connections_set_up_and_torn_down_on_one_channel() {
    const N: usize = 120;
    let t = DeviceTest::start();
    let listener_ch = EventChannel::new().unwrap();
    let listener =
        Server::on_channel(&listener_ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(128).unwrap();
    let dst = listener.local_addr().unwrap();
    // The server: one event loop on its own shared channel, answering every disconnect as it
    // comes.
    let server = thread::spawn(move || {
        let ch = listener_ch;
        let (mut accepting, mut conns, mut gone) = (HashMap::new(), HashMap::new(), 0);
        while gone < N {
            let ev = ch.get_event(T).unwrap();
            match ev.event_type() {
                CmEventType::ConnectRequest => {
                    let req = ConnectRequest::from_event(ev).unwrap();
                    let pd = req.alloc_pd().unwrap();
                    let q = req.create_qp(&pd, QpInit::new().max_send_wr(1).max_recv_wr(1)).unwrap();
                    let acc = q.start_accept(&ConnParam::new()).unwrap();
                    accepting.insert(acc.handle(), (acc, pd));
                }
                CmEventType::Established => {
                    let (acc, pd) = accepting.remove(&ev.id()).unwrap();
                    let c = acc.complete(ev).unwrap();
                    conns.insert(c.id().handle(), (c, pd));
                }
                CmEventType::Disconnected => {
                    let (mut c, pd) = conns.remove(&ev.id()).unwrap();
                    c.handle_event(&ev);
                    drop((c, pd));
                    gone += 1;
                }
                other => panic!("unexpected {other}"),
            }
        }
        drop(listener);
    });
    let ch = EventChannel::new().unwrap();
    // Four threads, each connecting its share on the one channel, interleaved.
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let ch = ch.clone();
            thread::spawn(move || {
                (0..N / 4)
                    .map(|_| {
                        let route = Client::on_channel(&ch)
                            .unwrap()
                            .resolve_addr(None, dst, T)
                            .unwrap()
                            .resolve_route(T)
                            .unwrap();
                        let pd = route.alloc_pd().unwrap();
                        let q = route.create_qp(&pd, QpInit::new().max_send_wr(1).max_recv_wr(1)).unwrap();
                        (q.connect(&ConnParam::new(), T).unwrap(), pd)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let conns: Vec<_> = threads.into_iter().flat_map(|h| h.join().unwrap()).collect();
    assert_eq!(conns.len(), N);
    // Tear down from four threads too.
    let mut chunks: Vec<Vec<_>> = (0..4).map(|_| vec![]).collect();
    for (i, c) in conns.into_iter().enumerate() {
        chunks[i % 4].push(c);
    }
    let threads: Vec<_> = chunks
        .into_iter()
        .map(|cs| {
            thread::spawn(move || {
                for (c, pd) in cs {
                    c.disconnect(T).expect("each disconnect gets its own DISCONNECTED");
                    drop(pd);
                }
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    server.join().unwrap();
    drop(ch);
    t.finish();
}
