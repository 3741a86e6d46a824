//! Shared receive queues on the lane (`rdma_cm::verbs::lane::srq`): several clients' messages
//! land in one SRQ of a server lane, each completion naming the QP it arrived on and handing
//! its region back; a QP removed while the SRQ holds receives leaves them posted (and a
//! message it had taken still comes back); the lane's drop with receives on its SRQ releases
//! everything, after the SRQ; the SRQ's refusals say what was wrong; a replayed or forged
//! completion retires nothing; the limit event comes when receives run low; posting and polling
//! allocate nothing. Reading a region while the SRQ holds it does not compile (the
//! `compile_fail` example in the module's docs).

mod common;
#[path = "common/counting.rs"]
mod counting;

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use common::lane::{lane_on, reap};
use common::{mr_count, pattern, require, Cap, DeviceTest, T};
use counting::watched;
use rdma_cm::cm::ud_cm::{UdClient, UdServer};
use rdma_cm::verbs::ah::GRH_LEN;
use rdma_cm::verbs::lane::{Lane, LaneQp, LaneSrq, RecvWr, SendWr};
use rdma_cm::{
    AccessFlags, Client, ConnParam, Error, MemoryRegion, ProtectionDomain, QpInit, Server, SharedReceiveQueue,
    WcStatus, WorkQueue,
};

const LEN: usize = 64;

fn recv_buf(pd: &Arc<ProtectionDomain>) -> MemoryRegion {
    MemoryRegion::new(pd, 4096, AccessFlags::LOCAL_WRITE).unwrap()
}

fn message(pd: &Arc<ProtectionDomain>, seed: u8) -> MemoryRegion {
    let mut m = MemoryRegion::new(pd, LEN, AccessFlags::empty()).unwrap();
    m.as_mut_slice().unwrap().copy_from_slice(&pattern(LEN, seed));
    m
}

/// The server: one lane, one SRQ, the QPs of the connections it accepted (in the clients'
/// order), and the listener.
struct ServerSide {
    lane: Lane,
    pd: Arc<ProtectionDomain>,
    srq: LaneSrq,
    qps: Vec<LaneQp>,
    _listener: rdma_cm::Listener,
}

/// The clients: one lane for all, a QP and a PD each.
struct Clients {
    lane: Lane,
    qps: Vec<(LaneQp, Arc<ProtectionDomain>)>,
}

/// `n` clients connected, one after another, to a server lane whose QPs all take their
/// receives from one SRQ of `depth`, on which `wr_ids` are posted before the first accept.
/// Before it accepts the first, the server checks that a receive posted to that QP itself is
/// refused, saying where receives go.
fn connect(addr: IpAddr, n: usize, depth: u32, wr_ids: std::ops::Range<u64>) -> (Clients, ServerSide) {
    let listener = Server::new().unwrap().bind(SocketAddr::new(addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let ctx = listener.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        // Deep enough for the SRQ and every QP's sends up front (siw cannot grow a CQ).
        let mut lane = Lane::new(&ctx, depth + 8 * n as u32).unwrap();
        let srq = lane.create_srq(&pd, depth).expect("Lane::create_srq");
        for id in wr_ids {
            lane.post_srq_recv(srq, RecvWr::new(recv_buf(&pd)).wr_id(id)).expect("post_srq_recv");
        }
        let mut qps = Vec::new();
        for k in 0..n {
            let init = lane.srq_qp_init(srq, QpInit::new().max_send_wr(4)).unwrap();
            let s = listener.get_request(T).unwrap().lane_qp(&mut lane, &pd, init).expect("ConnectRequest::lane_qp");
            let qp = s.qp();
            if k == 0 {
                let r = lane.post_recv(qp, RecvWr::new(recv_buf(&pd))).expect_err("a receive on an SRQ's QP");
                assert!(
                    matches!(r.error(), Error::InvalidArgument(m) if m.contains("Lane::post_srq_recv")),
                    "{}",
                    r.error()
                );
                assert!(r.into_inner().is_some(), "the region comes back");
            }
            s.accept(&mut lane, &ConnParam::new(), T).unwrap_or_else(|e| panic!("accept {k}: {e}"));
            qps.push(qp);
        }
        assert_eq!(lane.srq_users(srq).unwrap(), n as u32);
        ServerSide { lane, pd, srq, qps, _listener: listener }
    });
    let mut lane = lane_on(addr, 64);
    let mut qps = Vec::new();
    for k in 0..n {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let c = route.lane_qp(&mut lane, &pd, QpInit::new().max_send_wr(8).max_recv_wr(1)).unwrap();
        let qp = c.qp();
        c.connect(&mut lane, &ConnParam::new(), T).unwrap_or_else(|e| panic!("connect {k}: {e}"));
        qps.push((qp, pd));
    }
    (Clients { lane, qps }, server.join().expect("the server thread"))
}

/// Client `c` sends the messages of `seeds`, and waits for their completions.
fn send_all(clients: &mut Clients, c: usize, seeds: &[u8]) {
    let sized: Vec<(u8, usize)> = seeds.iter().map(|&s| (s, LEN)).collect();
    send_sized(clients, c, &sized);
}

/// Client `c` sends the messages of `seeds`, each of its length, and waits for their completions.
fn send_sized(clients: &mut Clients, c: usize, seeds: &[(u8, usize)]) {
    let (qp, pd) = clients.qps[c].clone();
    for &(s, len) in seeds {
        clients.lane.post_send(qp, SendWr::send(message(&pd, s), 0..len).wr_id(s as u64)).unwrap();
    }
    for done in reap(&mut clients.lane, seeds.len()) {
        assert_eq!(done.status(), WcStatus::Success, "client {c}'s send {}", done.wr_id());
    }
}

/// Three clients' messages land in one SRQ of the server's lane, over two rounds (the regions
/// handed back are posted again): each completion is the SRQ's, names the QP it arrived on (and
/// its number), carries that client's message, in that client's order, and hands back a region
/// posted to the SRQ, each once. The lane is then dropped with receives still on its SRQ:
/// every region, QP, CQ and PD is released (the SRQ first).
#[test]
fn clients_share_one_srq_on_a_server_lane() {
    const N: usize = 3;
    const M: usize = 4;
    let t = DeviceTest::start();
    {
        let (mut clients, mut server) = connect(t.addr, N, 16, 0..(N * M) as u64);
        let seed = |round: usize, c: usize, k: usize| (round * 64 + c * 16 + k) as u8;
        let mut posted: HashSet<u64> = (0..(N * M) as u64).collect();
        for round in 0..2 {
            assert_eq!(server.lane.srq_outstanding(server.srq).unwrap(), N * M);
            for c in 0..N {
                let seeds: Vec<u8> = (0..M).map(|k| seed(round, c, k)).collect();
                send_all(&mut clients, c, &seeds);
            }
            let mut next = [0usize; N];
            let mut back = Vec::new();
            for mut done in reap(&mut server.lane, N * M) {
                assert_eq!(done.status(), WcStatus::Success);
                assert!(done.is_srq() && done.is_signaled(), "{done:?}");
                assert_eq!(done.queue(), WorkQueue::Recv);
                let qp = done.qp().expect("the QP it arrived on");
                let c = server.qps.iter().position(|q| *q == qp).expect("one of the server's QPs");
                assert_eq!(done.qp_num(), server.lane.qp_num(qp).unwrap());
                assert_eq!(done.byte_len(), LEN as u32);
                assert!(posted.remove(&done.wr_id()), "wr_id {} handed back once, and only if posted", done.wr_id());
                let mut buf = done.take_region().expect("the region, back");
                assert_eq!(
                    &buf.as_slice().unwrap()[..LEN],
                    &pattern(LEN, seed(round, c, next[c]))[..],
                    "client {c}'s message {} in round {round}",
                    next[c]
                );
                next[c] += 1;
                back.push(buf);
            }
            assert_eq!(next, [M; N], "every client's messages, each on its own QP");
            assert!(posted.is_empty(), "every receive came back: {posted:?} did not");
            assert!(server.lane.poll().unwrap().is_none());
            assert_eq!(server.lane.srq_outstanding(server.srq).unwrap(), 0);
            // The same regions, posted again (a list and single posts), for the next round.
            let mut list: Vec<Option<RecvWr>> = Vec::new();
            for (k, buf) in back.into_iter().enumerate() {
                let id = 100 * (round as u64 + 1) + k as u64;
                posted.insert(id);
                if k % 2 == 0 {
                    list.push(Some(RecvWr::new(buf).wr_id(id)));
                } else {
                    server.lane.post_srq_recv(server.srq, RecvWr::new(buf).wr_id(id)).unwrap();
                }
            }
            assert_eq!(server.lane.post_srq_recv_list(server.srq, &mut list).unwrap(), list.len());
            assert!(list.iter().all(Option::is_none), "posted entries are taken");
        }
        // More receives than anyone sends: the SRQ holds them when the lane goes.
        for k in 0..4 {
            server.lane.post_srq_recv(server.srq, RecvWr::new(recv_buf(&server.pd)).wr_id(900 + k)).unwrap();
        }
        assert_eq!(server.lane.srq_outstanding(server.srq).unwrap(), N * M + 4);
        let before = mr_count();
        let ServerSide { lane, pd, _listener, .. } = server;
        drop(lane);
        if let (Some(before), Some(after)) = (before, mr_count()) {
            assert!(after + N * M + 4 <= before, "the SRQ's regions are released with the lane: {before} → {after}");
        }
        drop((clients, pd, _listener));
    }
    t.finish();
}

/// A QP removed while the SRQ holds receives leaves them posted: nothing comes back with the
/// removal, and the other client's messages take them. A message the removed QP had taken, not
/// yet reaped (met by the removal while it reaps the QP's own send), still comes back: it
/// retires its own slot and hands its region back, naming no QP (the QP is gone) but its
/// number. The removed QP's handle is refused from then on.
#[test]
fn a_qp_removed_with_srq_receives_in_flight_leaves_them_posted() {
    let t = DeviceTest::start();
    {
        let (mut clients, mut server) = connect(t.addr, 2, 8, 0..4);
        let (gone, stays) = (server.qps[0], server.qps[1]);
        let gone_num = server.lane.qp_num(gone).unwrap();
        send_all(&mut clients, 0, &[7]);
        // A send of the QP's own, which the client has no receive for (retried, on InfiniBand
        // and RoCE, until the removal flushes it), so the removal reaps the CQ while the
        // client's message waits there.
        server.lane.post_send(gone, SendWr::send(message(&server.pd, 9), 0..LEN)).unwrap();
        server.lane.remove(gone).expect("Lane::remove");
        assert_eq!(server.lane.srq_users(server.srq).unwrap(), 1);
        assert_eq!(server.lane.srq_outstanding(server.srq).unwrap(), 4, "the removal hands back no receive");
        let r = server.lane.post_send(gone, SendWr::send(message(&server.pd, 0), 0..LEN)).expect_err("removed");
        assert!(matches!(r.error(), Error::InvalidArgument(_)), "{}", r.error());
        let mut done = reap(&mut server.lane, 1).pop().unwrap();
        assert!(done.is_srq() && done.is_ok(), "{done:?}");
        assert_eq!((done.wr_id(), done.qp(), done.qp_num()), (0, None, gone_num), "{done:?}");
        assert_eq!(&done.take_region().unwrap().as_slice().unwrap()[..LEN], &pattern(LEN, 7)[..]);
        assert!(server.lane.poll().unwrap().is_none(), "the receives still posted stay in the SRQ");
        assert_eq!(server.lane.srq_outstanding(server.srq).unwrap(), 3);
        send_all(&mut clients, 1, &[11, 12, 13]);
        let mut ids = HashSet::new();
        for (k, mut done) in reap(&mut server.lane, 3).into_iter().enumerate() {
            assert_eq!((done.status(), done.qp()), (WcStatus::Success, Some(stays)), "{done:?}");
            assert_eq!(&done.take_region().unwrap().as_slice().unwrap()[..LEN], &pattern(LEN, 11 + k as u8)[..]);
            ids.insert(done.wr_id());
        }
        assert_eq!(ids, HashSet::from([1, 2, 3]));
        assert_eq!(server.lane.srq_outstanding(server.srq).unwrap(), 0);
        drop((clients, server));
    }
    t.finish();
}

/// Every refusal of a receive says what was wrong and gives the region back: a full SRQ (its
/// depth), a list with more than it has room for (what it holds), a region of another
/// protection domain, one without LOCAL_WRITE, a range outside the region, another lane's
/// SRQ; and a QP on an SRQ that is not the lane's is refused at attach.
#[test]
fn srq_refusals_say_what_was_wrong() {
    let t = DeviceTest::start();
    {
        let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
        let dst = listener.local_addr().unwrap();
        let ctx = listener.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let mut lane = Lane::new(&ctx, 64).unwrap();
        let srq = lane.create_srq(&pd, 4).unwrap();
        assert_eq!(lane.srq_depth(srq).unwrap(), 4);
        let small = |pd: &Arc<ProtectionDomain>, access| MemoryRegion::new(pd, 64, access).unwrap();
        for k in 0..4 {
            lane.post_srq_recv(srq, RecvWr::new(small(&pd, AccessFlags::LOCAL_WRITE)).wr_id(k)).unwrap();
        }
        let r = lane.post_srq_recv(srq, RecvWr::new(small(&pd, AccessFlags::LOCAL_WRITE))).expect_err("full");
        assert!(matches!(r.error(), Error::QueueFull { queue: "shared receive", depth: 4 }), "{}", r.error());
        assert!(r.error().to_string().contains("4 work requests outstanding"), "{}", r.error());
        assert_eq!(r.into_inner().map(|m| m.len()), Some(64));

        let other = lane.create_srq(&pd, 4).unwrap();
        let mut list: Vec<Option<RecvWr>> =
            (0..3).map(|_| Some(RecvWr::new(small(&pd, AccessFlags::LOCAL_WRITE)))).collect();
        assert_eq!(lane.post_srq_recv_list(other, &mut list).unwrap(), 3);
        let mut list: Vec<Option<RecvWr>> =
            (0..2).map(|_| Some(RecvWr::new(small(&pd, AccessFlags::LOCAL_WRITE)))).collect();
        let e = lane.post_srq_recv_list(other, &mut list).expect_err("no room for two");
        assert!(e.to_string().contains("holds 3 of its 4, room for 1"), "{e}");
        assert!(list.iter().all(Option::is_some), "nothing was taken");
        let mut long: Vec<Option<RecvWr>> = (0..17).map(|_| None).collect();
        assert!(lane.post_srq_recv_list(other, &mut long).unwrap_err().to_string().contains("at most 16"));
        assert_eq!(lane.srq_outstanding(other).unwrap(), 3);

        let fresh = lane.create_srq(&pd, 4).unwrap();
        let pd2 = ProtectionDomain::new(&ctx).unwrap();
        let cases: [(RecvWr, &str); 4] = [
            (RecvWr::new(small(&pd2, AccessFlags::LOCAL_WRITE)), "another protection domain than the SRQ"),
            (RecvWr::new(small(&pd, AccessFlags::empty())), "LOCAL_WRITE"),
            (RecvWr::range(small(&pd, AccessFlags::LOCAL_WRITE), 0..65), "memory region"),
            (RecvWr::range(small(&pd, AccessFlags::LOCAL_WRITE), 8..65), "memory region"),
        ];
        for (wr, says) in cases {
            let r = lane.post_srq_recv(fresh, wr).expect_err(says);
            assert!(r.error().to_string().contains(says), "{says}: {}", r.error());
            assert!(r.into_inner().is_some(), "{says}: the region comes back");
        }
        assert_eq!(lane.srq_outstanding(fresh).unwrap(), 0);

        let mut elsewhere = Lane::new(&ctx, 16).unwrap();
        let r = elsewhere.post_srq_recv(srq, RecvWr::new(small(&pd, AccessFlags::LOCAL_WRITE))).expect_err("another's");
        assert!(r.error().to_string().contains("not one of this lane's"), "{}", r.error());
        assert!(r.into_inner().is_some());
        assert!(elsewhere.srq_qp_init(srq, QpInit::new()).is_err());
        assert!(elsewhere.srq_outstanding(srq).is_err() && elsewhere.srq_arm_limit(srq, 1).is_err());

        // A QP on an SRQ of the convenient path (not the lane's) is refused at attach.
        let foreign = SharedReceiveQueue::new(&pd, 4).unwrap();
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let Err(e) = route.lane_qp(&mut lane, &pd, QpInit::new().srq(&foreign)) else {
            panic!("a QP on another SRQ was attached")
        };
        assert!(e.to_string().contains("SRQ that is not this lane's"), "{e}");
        drop((lane, elsewhere, foreign, pd, pd2, listener));
    }
    t.finish();
}

/// A completion that names an SRQ receive the lane no longer holds retires nothing, even when
/// the slot it names holds a receive posted since: the tag of an earlier posting of that slot
/// (a completion handed out again), a sequence number not posted yet, and an SRQ the lane does
/// not have. The three are made real through the raw escape hatch: receives posted on the
/// lane's SRQ directly with those tags (the layout the `srq` module documents:
/// `RECV(63) | INTERIOR(61) | index(60..45) | seq(44..0)`), consumed before the lane's own,
/// each by a message of its own length, so the completion handed out is seen to be the lane's.
#[test]
fn a_replayed_or_forged_srq_completion_retires_nothing() {
    const SRQ_TAG: u64 = 1 << 63 | 1 << 61;
    let t = DeviceTest::start();
    {
        let (mut clients, mut server) = connect(t.addr, 1, 4, 0..0);
        let (srq, qp) = (server.srq, server.qps[0]);
        // Receives 0 to 7, one at a time: the table has 8 slots (twice the depth), so receive
        // 8 takes receive 0's slot.
        for k in 0..8u64 {
            server.lane.post_srq_recv(srq, RecvWr::new(recv_buf(&server.pd)).wr_id(100 + k)).unwrap();
            send_all(&mut clients, 0, &[k as u8]);
            let done = reap(&mut server.lane, 1).pop().unwrap();
            assert_eq!((done.wr_id(), done.qp()), (100 + k, Some(qp)));
        }
        let raw_buf = MemoryRegion::new(&server.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let raw_srq = server.lane.srq_as_raw(srq).unwrap();
        let post_raw = |wr_id: u64| {
            let mut sge = rdma_cm::ffi::ibv_sge { addr: raw_buf.addr(), length: 4096, lkey: raw_buf.lkey() };
            let mut wr = rdma_cm::ffi::ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
            let mut bad = std::ptr::null_mut();
            // SAFETY: the raw escape hatch: `raw_srq` is the lane's live SRQ; the receive is one
            // NULL-terminated work request over `raw_buf`, which this test keeps registered and
            // reads no more (it outlives the lane, which the SRQ does not).
            let ret = unsafe { rdma_cm::ffi::ibv_post_srq_recv(raw_srq, &mut wr, &mut bad) };
            assert_eq!(ret, 0, "ibv_post_srq_recv");
        };
        post_raw(SRQ_TAG); // receive 0 again: handed out long ago
        post_raw(SRQ_TAG | 9); // receive 9: not posted yet
        post_raw(SRQ_TAG | 5 << 45 | 8); // an SRQ index the lane never made
        server.lane.post_srq_recv(srq, RecvWr::new(recv_buf(&server.pd)).wr_id(200)).unwrap();
        // The raw receives take 32, 33 and 34 bytes; the lane's own, 64.
        send_sized(&mut clients, 0, &[(50, 32), (51, 33), (52, 34), (53, LEN)]);
        let mut done = reap(&mut server.lane, 1).pop().unwrap();
        assert_eq!((done.wr_id(), done.qp()), (200, Some(qp)), "only the lane's own receive is handed out: {done:?}");
        assert_eq!(done.byte_len(), LEN as u32, "its own completion, not a raw receive's: {done:?}");
        assert_eq!(&done.take_region().unwrap().as_slice().unwrap()[..LEN], &pattern(LEN, 53)[..]);
        assert!(server.lane.poll().unwrap().is_none());
        assert_eq!(server.lane.srq_outstanding(srq).unwrap(), 0);
        drop((clients, server));
        drop(raw_buf);
    }
    t.finish();
}

/// The limit event: armed at 2 with 4 receives posted, it has not come; once 3 are taken it
/// comes (read through the context's registry, as for the convenient path's SRQ).
#[test]
fn the_srq_limit_event_comes_when_receives_run_low() {
    let t = DeviceTest::start();
    {
        let (mut clients, mut server) = connect(t.addr, 1, 8, 0..4);
        server.lane.srq_arm_limit(server.srq, 2).expect("srq_arm_limit");
        assert!(!server.lane.srq_limit_reached(server.srq).unwrap());
        send_all(&mut clients, 0, &[1, 2, 3]);
        assert_eq!(reap(&mut server.lane, 3).len(), 3);
        let deadline = Instant::now() + T;
        while !server.lane.srq_limit_reached(server.srq).unwrap() {
            assert!(Instant::now() < deadline, "no limit event within {T:?} with 1 receive left of a limit of 2");
            thread::yield_now();
        }
        drop((clients, server));
    }
    t.finish();
}

/// Posting to the lane's SRQ (alone and as a list) and polling its completions allocate
/// nothing: 1,000 messages from a client, each received into a region posted to the SRQ and
/// posted again when it comes back.
#[test]
fn srq_posts_and_polls_allocate_nothing() {
    const N: usize = 1000;
    let t = DeviceTest::start();
    {
        let (mut clients, mut server) = connect(t.addr, 1, 4, 0..0);
        let (cqp, cpd) = clients.qps[0].clone();
        let mut msg = Some(message(&cpd, 1));
        let mut buf = Some(recv_buf(&server.pd));
        // Polls `lane` (watched) until one completion comes: its region.
        fn one(lane: &mut Lane) -> MemoryRegion {
            let mut back = None;
            let deadline = Instant::now() + T;
            while watched(|| lane.poll_with(16, |c, mr| back = Some((c.is_ok(), mr)))).unwrap() == 0 {
                assert!(Instant::now() < deadline, "no completion within {T:?}");
            }
            let (ok, mr) = back.unwrap();
            assert!(ok);
            mr.expect("the region, back")
        }
        counting::reset();
        for k in 0..N {
            let b = RecvWr::new(buf.take().unwrap()).wr_id(k as u64);
            if k % 2 == 0 {
                watched(|| server.lane.post_srq_recv(server.srq, b)).unwrap();
            } else {
                let mut list = [Some(b)];
                assert_eq!(watched(|| server.lane.post_srq_recv_list(server.srq, &mut list)).unwrap(), 1);
            }
            let m = SendWr::send(msg.take().unwrap(), 0..LEN);
            watched(|| clients.lane.post_send(cqp, m)).unwrap();
            buf = Some(one(&mut server.lane));
            msg = Some(one(&mut clients.lane));
        }
        let (allocs, _) = counting::counts();
        assert_eq!(allocs, 0, "{allocs} allocations in {N} receives through the lane's SRQ");
        drop((clients, server, msg, buf));
    }
    t.finish();
}

/// Two UD endpoints of a server lane take their receives from one SRQ: each client's
/// datagrams land there, each completion naming the endpoint it arrived on, the payload after
/// the GRH. UD needs a device that has it (not iWARP).
#[test]
fn ud_endpoints_share_one_srq() {
    const N: usize = 2;
    const M: usize = 3;
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    {
        let addr = t.addr;
        let listener = UdServer::new().unwrap().listen(SocketAddr::new(addr, 0), 8).unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            let mut side: Option<(Lane, Arc<ProtectionDomain>, LaneSrq)> = None;
            let mut qps = Vec::new();
            for _ in 0..N {
                let req = listener.get_request(T).unwrap();
                let (lane, pd, srq) = side.get_or_insert_with(|| {
                    let ctx = req.context().unwrap();
                    let pd = ProtectionDomain::new(&ctx).unwrap();
                    let mut lane = Lane::new(&ctx, 64).unwrap();
                    let srq = lane.create_srq(&pd, 8).unwrap();
                    for k in 0..(N * M) as u64 {
                        let buf = MemoryRegion::new(&pd, GRH_LEN + LEN, AccessFlags::LOCAL_WRITE).unwrap();
                        lane.post_srq_recv(srq, RecvWr::new(buf).wr_id(k)).unwrap();
                    }
                    (lane, pd, srq)
                });
                let init = lane.srq_qp_init(*srq, QpInit::new().max_send_wr(4)).unwrap();
                let ep = req.create_qp(pd, init).unwrap().accept(&[]).unwrap();
                qps.push(lane.attach(ep).map_err(|r| r.into_parts().0).expect("attach a UD endpoint on the SRQ"));
            }
            let (lane, pd, srq) = side.unwrap();
            (lane, pd, srq, qps, listener)
        });
        let mut lane = lane_on(addr, 64);
        let mut clients = Vec::new();
        for _ in 0..N {
            let route = UdClient::new()
                .unwrap()
                .resolve_addr(None, SocketAddr::new(addr, port), T)
                .unwrap()
                .resolve_route(T)
                .unwrap();
            let pd = route.alloc_pd().unwrap();
            let mut ep = route.create_qp(&pd, lane.qp_init_from(QpInit::new())).unwrap();
            let dest = ep.connect(&[], T).unwrap();
            let qp = lane.attach(ep).map_err(|r| r.into_parts().0).unwrap();
            let to = lane.add_dest(qp, &dest).unwrap();
            clients.push((qp, to, pd));
        }
        let (mut slane, spd, srq, sqps, listener) = server.join().unwrap();
        assert_eq!(slane.srq_users(srq).unwrap(), N as u32);
        for (c, (qp, to, pd)) in clients.iter().enumerate() {
            for k in 0..M {
                let wr = SendWr::send(message(pd, (c * 16 + k) as u8), 0..LEN).to(*to).wr_id(k as u64);
                lane.post_send(*qp, wr).unwrap();
            }
        }
        for done in reap(&mut lane, N * M) {
            assert_eq!(done.status(), WcStatus::Success);
        }
        let mut next = [0usize; N];
        for mut done in reap(&mut slane, N * M) {
            assert!(done.is_srq() && done.is_ok(), "{done:?}");
            let c = sqps.iter().position(|q| Some(*q) == done.qp()).expect("one of the server's endpoints");
            assert_eq!(done.byte_len(), (GRH_LEN + LEN) as u32);
            let mut buf = done.take_region().unwrap();
            let payload = &buf.as_slice().unwrap()[GRH_LEN..GRH_LEN + LEN];
            assert_eq!(payload, &pattern(LEN, (c * 16 + next[c]) as u8)[..], "client {c}'s datagram {}", next[c]);
            next[c] += 1;
        }
        assert_eq!(next, [M; N]);
        assert_eq!(slane.srq_outstanding(srq).unwrap(), 0);
        drop((lane, clients, slane, spd, listener));
    }
    t.finish();
}
