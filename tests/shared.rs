//! The shapes servers at scale use, on the device: one CQ shared by many QPs, one shared
//! receive queue, one event channel for every connection.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{DeviceTest, T};
use rdma_cm::{
    Accepting, AccessFlags, Client, CmEventType, CompletionQueue, ConnParam, ConnectRequest, Connection, EventChannel,
    MemoryRegion, QpInit, RecvWr, SendWr, Server, SharedReceiveQueue, WorkCompletion, WorkQueue,
};

const SLOT: usize = 64;

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

/// One thread serves N clients on one event channel, one CQ and one SRQ: it echoes every
/// message from the receive slot it landed in (zero copy), reposting the slot once the echo
/// is sent. Clients come and go (each sends its own number of messages, then leaves), so
/// server QPs are dropped in random order while the others keep working. Every byte is checked
/// on both sides, and every completion is accounted for.
#[test]
fn hundred_clients_one_thread_one_cq_one_srq() {
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
        let mut pd = None;
        let mut cq: Option<Arc<CompletionQueue>> = None;
        let mut srq: Option<SharedReceiveQueue> = None;
        let mut slots: Vec<MemoryRegion> = vec![];
        let mut accepting: HashMap<_, Accepting> = HashMap::new();
        let mut conns: HashMap<u32, Connection> = HashMap::new(); // by qp_num
        let mut by_id = HashMap::new(); // id handle -> qp_num
        let mut early: HashMap<u32, Vec<usize>> = HashMap::new(); // receives before ESTABLISHED
        let (mut echoed, mut gone, mut max_live) = (0u64, 0u64, 0usize);
        let mut wcs = [WorkCompletion::default(); 32];
        let deadline = Instant::now() + Duration::from_secs(300);
        while gone < N {
            assert!(Instant::now() < deadline, "served {echoed} of {total}, {gone} of {N} gone");
            // Connection events, without blocking.
            while let Some(ev) = ch.try_get_event().unwrap() {
                match ev.event_type() {
                    CmEventType::ConnectRequest => {
                        let req = ConnectRequest::from_event(ev).unwrap();
                        if pd.is_none() {
                            let ctx = req.context().unwrap();
                            let p = req.alloc_pd().unwrap();
                            let c = CompletionQueue::new(&ctx, 16 * N as u32 + SRQ_DEPTH).unwrap();
                            let s = SharedReceiveQueue::new(&p, SRQ_DEPTH).unwrap();
                            let region =
                                MemoryRegion::new(&p, SLOT * SRQ_DEPTH as usize, AccessFlags::LOCAL_WRITE).unwrap();
                            slots = region.split(SLOT).unwrap();
                            let recvs: Vec<RecvWr> = slots
                                .iter()
                                .enumerate()
                                .map(|(i, m)| RecvWr::new(m, 0..SLOT).wr_id(i as u64))
                                .collect();
                            s.post_recv(&recvs).unwrap();
                            assert_eq!(s.outstanding(), SRQ_DEPTH as usize);
                            pd = Some(p);
                            cq = Some(c);
                            srq = Some(s);
                        }
                        let init = QpInit::new()
                            .send_cq(Arc::clone(cq.as_ref().unwrap()))
                            .recv_cq(Arc::clone(cq.as_ref().unwrap()))
                            .srq(srq.as_ref().unwrap());
                        let q = req.create_qp(pd.as_ref().unwrap(), init).unwrap();
                        let acc = q.start_accept(&ConnParam::new()).unwrap();
                        early.insert(acc.qp().qp_num(), vec![]);
                        accepting.insert(acc.handle(), acc);
                    }
                    CmEventType::Established => {
                        let acc = accepting.remove(&ev.id()).expect("ESTABLISHED of a known id");
                        let conn = acc.complete(ev).unwrap();
                        let q = conn.qp().qp_num();
                        by_id.insert(conn.id().handle(), q);
                        let conn = conns.entry(q).or_insert(conn);
                        // A client may send before this side sees ESTABLISHED: echo those now.
                        for slot in early.remove(&q).unwrap_or_default() {
                            conn.qp_mut().post_send(&[SendWr::send(&slots[slot], 0..SLOT).wr_id(slot as u64)]).unwrap();
                            echoed += 1;
                        }
                        max_live = max_live.max(conns.len());
                    }
                    CmEventType::Disconnected => {
                        let qp_num = by_id.remove(&ev.id()).expect("DISCONNECTED of a known id");
                        let mut conn = conns.remove(&qp_num).unwrap();
                        conn.handle_event(&ev);
                        drop(conn); // its QP leaves the shared CQ; the others go on
                        gone += 1;
                    }
                    CmEventType::TimewaitExit => {}
                    other => panic!("unexpected {other}"),
                }
            }
            let Some(cq) = &cq else { continue };
            let n = cq.wait(&mut wcs, Duration::from_millis(20)).unwrap();
            for wc in &wcs[..n] {
                let slot = wc.wr_id() as usize;
                match wc.queue() {
                    WorkQueue::Recv => {
                        let wc = wc.ok().expect("receive failed");
                        assert_eq!(wc.byte_len() as usize, SLOT);
                        let m = slots[slot].as_slice().unwrap();
                        let client = u64::from_be_bytes(m[..8].try_into().unwrap());
                        let seq = u64::from_be_bytes(m[8..16].try_into().unwrap());
                        assert_eq!(m, &message(client, seq)[..], "bytes of client {client} message {seq}");
                        match conns.get_mut(&wc.qp_num()) {
                            Some(conn) => {
                                conn.qp_mut()
                                    .post_send(&[SendWr::send(&slots[slot], 0..SLOT).wr_id(slot as u64)])
                                    .unwrap();
                                echoed += 1;
                            }
                            None => early.get_mut(&wc.qp_num()).expect("a receive of a known QP").push(slot),
                        }
                    }
                    WorkQueue::Send => {
                        // The echo left: the slot goes back to the SRQ. (Echoes are counted when
                        // posted: a client may see its echo and leave before this loop reaps the
                        // send's completion, which the QP's drop then reaps itself.)
                        srq.as_ref()
                            .unwrap()
                            .post_recv(&[RecvWr::new(&slots[slot], 0..SLOT).wr_id(slot as u64)])
                            .unwrap();
                    }
                }
            }
        }
        assert!(conns.is_empty() && accepting.is_empty());
        drop((listener, slots, srq, cq, pd));
        (echoed, max_live)
    });

    // Ten threads of ten clients each: connect all, then ping-pong, then leave.
    let clients: Vec<_> = (0..10u64)
        .map(|th| {
            let counts = counts.clone();
            thread::spawn(move || {
                let mut mine = vec![];
                for k in 0..10 {
                    let id = th * 10 + k;
                    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
                    let pd = route.alloc_pd().unwrap();
                    let mr = MemoryRegion::new(&pd, 2 * SLOT, AccessFlags::LOCAL_WRITE).unwrap();
                    let q = route.create_qp(&pd, QpInit::new()).unwrap();
                    mine.push((id, q.connect(&ConnParam::new(), T).unwrap(), mr, pd));
                }
                let mut sent = 0;
                for (id, conn, mr, _) in &mut mine {
                    for seq in 0..counts[*id as usize] {
                        mr.as_mut_slice().unwrap()[..SLOT].copy_from_slice(&message(*id, seq));
                        let qp = conn.qp_mut();
                        qp.post_recv(&[RecvWr::new(mr, SLOT..2 * SLOT).wr_id(1)]).unwrap();
                        qp.post_send(&[SendWr::send(mr, 0..SLOT).wr_id(2)]).unwrap();
                        qp.wait_for(WorkQueue::Send, 2, T).unwrap();
                        let wc = qp.wait_for(WorkQueue::Recv, 1, T).expect("echo");
                        assert_eq!(wc.byte_len() as usize, SLOT);
                        let b = mr.as_slice().unwrap();
                        assert_eq!(&b[SLOT..], &message(*id, seq)[..], "echo of client {id} message {seq}");
                        sent += 1;
                    }
                }
                for (_, conn, mr, pd) in mine {
                    conn.disconnect(T).unwrap();
                    drop((mr, pd));
                }
                sent
            })
        })
        .collect();
    let sent: u64 = clients.into_iter().map(|h| h.join().unwrap()).sum();
    let (echoed, max_live) = server.join().unwrap();
    assert_eq!(sent, total, "every client message got its echo");
    assert_eq!(echoed, total, "the server's count agrees");
    assert!(max_live >= 10, "connections overlapped ({max_live} at most)");
    t.finish();
}

/// A completion of a dropped QP that is still in the shared CQ retires nobody else's slot.
#[test]
fn a_dropped_qps_late_completions_retire_nobody_elses_slots() {
    let t = DeviceTest::start();
    // Two client QPs on one CQ.
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let srv = thread::spawn(move || {
        (0..2)
            .map(|_| {
                let req = listener.get_request(T).unwrap();
                let pd = req.alloc_pd().unwrap();
                let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
                let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
                let recvs: Vec<RecvWr> =
                    (0..8).map(|i| RecvWr::new(&mr, i * 64..(i + 1) * 64).wr_id(i as u64)).collect();
                q.post_recv(&recvs).unwrap();
                (q.accept(&ConnParam::new(), T).unwrap(), mr, pd)
            })
            .collect::<Vec<_>>()
    });
    let route1 = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route1.context().unwrap();
    let pd = route1.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let init = || QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
    let mut c1 = route1.create_qp(&pd, init()).unwrap().connect(&ConnParam::new(), T).unwrap();
    // The second QP must come from the same device context (librdmacm opens one per device).
    let route2 = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    assert!(route2.context().unwrap().same_as(&ctx), "librdmacm shares one context per device");
    let mut c2 = route2.create_qp(&pd, init()).unwrap().connect(&ConnParam::new(), T).unwrap();
    let mut server = srv.join().unwrap();
    let mr1 = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut mr2 = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    // c1 sends four messages and is dropped without anyone polling the CQ: its completions (and
    // the flush's) stay in the shared CQ for a while, carrying sequence numbers 0..3, the same
    // numbers c2's work requests get.
    for i in 0..4 {
        c1.qp_mut().post_send(&[SendWr::send(&mr1, 0..64).wr_id(100 + i)]).unwrap();
    }
    c2.qp_mut().post_send(&[SendWr::send(&mr2, 0..64).wr_id(7)]).unwrap();
    drop(c1);
    // c2's send is retired by c2's own completion only.
    let wc = c2.qp_mut().wait_for(WorkQueue::Send, 7, T).unwrap();
    assert_eq!(wc.qp_num(), c2.qp().qp_num());
    // Until then, and after, the CQ's own poll never hands out c1's completions as c2's.
    let mut wcs = [WorkCompletion::default(); 16];
    let n = cq.poll(&mut wcs).unwrap();
    assert!(wcs[..n].iter().all(|w| w.qp_num() == c2.qp().qp_num()), "{:?}", &wcs[..n]);
    assert!(mr2.as_mut_slice().is_ok());
    // The server got c1's four and c2's one.
    let (s2, _, _) = &mut server[1];
    s2.qp_mut().wait_for(WorkQueue::Recv, 0, T).unwrap();
    drop((c2, server, mr1, mr2, cq, pd, ctx));
    t.finish();
}

/// An SRQ that runs dry makes senders retry (RNR) until it is refilled, and its limit event
/// arrives when it falls below the armed limit.
#[test]
fn srq_exhaustion_is_rnr_and_the_limit_event_arrives() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
        // Six sends into an SRQ of four: the last two wait for room (RNR retries).
        let wrs: Vec<SendWr> = (0..6).map(|i| SendWr::send(&mr, 0..8).wr_id(i)).collect();
        conn.qp_mut().post_send(&wrs).unwrap();
        for i in 0..6 {
            conn.qp_mut().wait_for(WorkQueue::Send, i, T).expect("every send lands once the SRQ is refilled");
        }
        conn.next_event(T).unwrap();
        drop((conn, mr, pd));
    });
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let srq = SharedReceiveQueue::new(&pd, 4).unwrap();
    let region = MemoryRegion::new(&pd, 4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let slots = region.split(64).unwrap();
    let recvs: Vec<RecvWr> = slots.iter().enumerate().map(|(i, m)| RecvWr::new(m, 0..64).wr_id(i as u64)).collect();
    srq.post_recv(&recvs).unwrap();
    assert!(matches!(srq.post_recv(&recvs[..1]), Err(rdma_cm::Error::QueueFull { .. })));
    srq.arm_limit(2).unwrap();
    let mut conn = req.create_qp(&pd, QpInit::new().srq(&srq)).unwrap().accept(&ConnParam::new(), T).unwrap();
    // Four receives complete; the queue is dry.
    let mut got = vec![];
    while got.len() < 4 {
        let mut wcs = [WorkCompletion::default(); 4];
        let n = conn.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
        assert!(n > 0, "only {} of 4 receives completed", got.len());
        got.extend(wcs[..n].iter().map(|w| w.ok().unwrap().wr_id()));
    }
    got.sort();
    assert_eq!(got, vec![0, 1, 2, 3]);
    assert_eq!(srq.outstanding(), 0);
    // The limit (2) was crossed: the device said so, naming this SRQ, and the SRQ knows. A
    // source made now still sees the event if a wait above has read it already (the log).
    let ev = ctx.async_events().unwrap().next(T).expect("the SRQ limit event");
    assert!(srq.is_limit_event(&ev), "{ev:?}");
    assert!(srq.limit_reached().unwrap());
    // Refill: the two waiting sends land.
    srq.post_recv(&recvs[..2]).unwrap();
    let mut n = 0;
    while n < 2 {
        let mut wcs = [WorkCompletion::default(); 2];
        n += conn.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
    }
    conn.disconnect(T).unwrap();
    client.join().unwrap();
    drop(recvs);
    drop((slots, srq, pd, ctx, listener));
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

/// A shared CQ need not be sized up front: `resize` changes its depth (refusing one
/// below what its queues may have outstanding), completions in it survive a resize, and with
/// `set_auto_grow` it grows as QPs join instead of refusing them.
#[test]
fn a_shared_cq_is_resized_and_grows_as_qps_join() {
    let t = DeviceTest::start();
    const QPS: usize = 3;
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let srv = thread::spawn(move || {
        (0..QPS + 1)
            .map(|_| {
                let req = listener.get_request(T).unwrap();
                let pd = req.alloc_pd().unwrap();
                let mr = MemoryRegion::new(&pd, 8 * 64, AccessFlags::LOCAL_WRITE).unwrap();
                let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
                let recvs: Vec<_> =
                    (0..8).map(|i| RecvWr::new(&mr, i * 64..(i + 1) * 64).wr_id(i as u64 + 1)).collect();
                q.post_recv(&recvs).unwrap();
                (q.accept(&ConnParam::new(), T).unwrap(), mr, pd)
            })
            .collect::<Vec<_>>()
    });
    let route = || Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let r0 = route();
    let ctx = r0.context().unwrap();
    let pd = r0.alloc_pd().unwrap();
    // Depth 16 cannot serve a QP of 16 sends and 16 receives: refused, with the way out named.
    let cq = CompletionQueue::new(&ctx, 16).unwrap();
    let init = |cq: &Arc<CompletionQueue>| QpInit::new().send_cq(Arc::clone(cq)).recv_cq(Arc::clone(cq));
    let e = route().create_qp(&pd, init(&cq)).unwrap_err().to_string();
    assert!(e.contains("resize") && e.contains("set_auto_grow"), "{e}");
    cq.resize(32).unwrap();
    assert_eq!(cq.depth(), 32);
    let mut c0 = route().create_qp(&pd, init(&cq)).unwrap().connect(&ConnParam::new(), T).unwrap();
    let e = cq.resize(31).unwrap_err().to_string();
    assert!(e.contains("32 completions its queues may have outstanding"), "{e}");
    // Completions in the CQ survive a resize.
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..4 {
        c0.qp_mut().post_send(&[SendWr::send_inline(b"x").wr_id(i)]).unwrap();
    }
    // Grown (not yet polled) with the four completions arriving in it meanwhile.
    cq.resize(64).unwrap();
    let mut got = Vec::new();
    while got.len() < 4 {
        got.push(c0.qp_mut().wait_for(WorkQueue::Send, got.len() as u64, T).unwrap().wr_id());
    }
    assert_eq!(got, [0, 1, 2, 3]);

    // Auto-grow: a CQ of depth 1 takes QPS QPs of 16/16.
    let grow = CompletionQueue::new(&ctx, 1).unwrap();
    assert!(!grow.auto_grow());
    grow.set_auto_grow(true);
    let mut conns: Vec<_> =
        (0..QPS).map(|_| route().create_qp(&pd, init(&grow)).unwrap().connect(&ConnParam::new(), T).unwrap()).collect();
    assert!(grow.depth() as usize >= 32 * QPS, "grew to {}", grow.depth());
    for (i, c) in conns.iter_mut().enumerate() {
        c.qp_mut().post_send(&[SendWr::send(&mr, 0..64).wr_id(i as u64)]).unwrap();
        assert_eq!(c.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap().qp_num(), c.qp().qp_num());
    }
    let mut servers = srv.join().unwrap();
    // The first connection's server got the four, every other one its one.
    for (k, (s, _, _)) in servers.iter_mut().enumerate() {
        for id in 1..=if k == 0 { 4 } else { 1 } {
            s.qp_mut().wait_for(WorkQueue::Recv, id, T).unwrap();
        }
    }
    drop((conns, c0, servers, mr, grow, cq, pd, ctx, r0));
    t.finish();
}
