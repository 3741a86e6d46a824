//! Device tests of connection paths: closing with the QP destroyed before the peer's
//! `DISCONNECTED` ([`Connection::shutdown`]); a verbs-wing QP ([`UnconnectedQp`]) that an id
//! adopts (`adopt_qp`) and the crate drives through `rdma_init_qp_attr`, `ibv_modify_qp` and
//! `rdma_establish`, against ourselves and against rdma-core's `rping -q`; and a connect that
//! nobody answers, which returns at its timeout, its teardown included.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::mpsc;
use std::thread;

use common::lane::reap;
use common::{pair, pattern, DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{Completion, InlineWr, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::verbs::port::GidType;
use rdma_cm::verbs::qp::{RcParams, UnconnectedQp};
use rdma_cm::{
    AccessFlags, Client, CmEventType, ConnParam, Error, MemoryRegion, QpInit, QpState, RouteResolved, Server,
    VerbsContext, WorkQueue,
};

fn count(kind: &str) -> usize {
    common::resources().into_iter().find(|(k, _)| *k == kind).map_or(0, |(_, n)| n)
}

/// The next completion on `lane` (up to `T`), which must have succeeded.
fn next_ok(lane: &mut Lane, what: &str) -> Completion {
    let c = lane.wait(T).unwrap_or_else(|e| panic!("{what}: {e}"));
    c.ok().unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// The client shuts down: its QP is gone before the server has even read the disconnect, and
/// the wait for `DISCONNECTED` completes once the server answers. The server, whose peer left
/// first, gets a `Disconnecting` that is complete at once.
#[test]
fn shutdown_destroys_the_qp_before_the_peer_answers() {
    let t = DeviceTest::start();
    let (c, s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    let common::Side { conn, pd, mrs } = c;
    assert_eq!(count("qp"), 2);

    let (go, go_rx) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let common::Side { mut conn, pd, mrs } = s;
        // No bound here: the go-ahead comes after the client's shutdown (the flush reaped, up
        // to 2 s) and its `rdma res show` runs, which took over 10 s (T) in a loaded guest, and
        // this thread's timeout then failed the test. If the client fails before giving it,
        // `go` drops with it, and this returns.
        if go_rx.recv().is_err() {
            return; // the client's side failed, and says why
        }
        let ev = conn.next_event(T).expect("server: DISCONNECTED");
        assert_eq!(ev.event_type(), CmEventType::Disconnected);
        let d = conn.shutdown().expect("server shutdown after the peer left");
        assert!(d.is_complete(), "the peer left first: no event is to come");
        d.wait(T).expect("a complete disconnect returns at once");
        drop((pd, mrs));
    });

    let d = conn.shutdown().expect("client shutdown");
    assert!(!d.is_complete(), "the server has not answered yet");
    // The client's QP is gone before the peer has answered (it waits for `go`).
    assert_eq!(count("qp"), 1, "the client's QP is destroyed at once");
    go.send(()).unwrap();
    d.wait(T).expect("the server's answer completes the disconnect");
    server.join().unwrap();
    drop((pd, mrs));
    t.finish();
}

/// On a channel other ids share, the event loop feeds the `DISCONNECTED` to
/// `Disconnecting::complete`: another id's event is refused (and leaves it waiting), the
/// right one completes it.
#[test]
fn disconnecting_completes_only_with_its_own_disconnected() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mut conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
        let ev = conn.next_event(T).expect("server: DISCONNECTED");
        assert_eq!(ev.event_type(), CmEventType::Disconnected);
    });
    let ch = rdma_cm::EventChannel::new().unwrap();
    let route = Client::on_channel(&ch).unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
    let mut d = conn.shutdown().unwrap();
    // Another id on the same channel: its ADDR_RESOLVED is not this disconnect's event.
    let other = Client::on_channel(&ch).unwrap().start_resolve(None, dst, T).unwrap();
    let mut theirs = None;
    let mut done = false;
    while theirs.is_none() || !done {
        let ev = ch.get_event(T).expect("an event of either id");
        if ev.id() == other.handle() {
            // The two ids' events may come in either order: another id's event changes nothing,
            // whether this disconnect is still waiting or already complete.
            let before = d.is_complete();
            assert_eq!(before, done);
            let err = d.complete(&ev).unwrap_err();
            assert!(matches!(err, Error::UnexpectedEvent { got: CmEventType::AddrResolved, .. }), "{err:?}");
            assert_eq!(d.is_complete(), before, "another id's event leaves it as it was");
            theirs = Some(ev);
        } else if ev.event_type() == CmEventType::Disconnected {
            d.complete(&ev).expect("its own DISCONNECTED");
            assert!(d.is_complete());
            done = true;
        }
    }
    assert_eq!(d.peer_addr(), Some(dst), "the id is still there");
    drop(d);
    srv.join().unwrap();
    drop((other, theirs, pd));
    t.finish();
}

/// An adopted QP (made in RESET by the verbs wing, handed to a lane before the connect or
/// accept) on each side, on one side only, or on neither (librdmacm's QP, attached to the lane
/// once connected): every combination connects, its states are the ones librdmacm's rules
/// require at each step, and data flows both ways.
#[test]
fn user_qps_connect_to_ours_and_carry_data() {
    let t = DeviceTest::start();
    // Soft-iWARP's ibv_query_qp reports no QP state (it reads RESET on a working QP, MATRIX.md):
    // the states are checked where the device reports them; the data everywhere.
    let states = !common::caps::iwarp();
    for (client_user, server_user) in [(true, true), (true, false), (false, true)] {
        let what = format!("client user QP {client_user}, server user QP {server_user}");
        let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
        let dst = listener.local_addr().unwrap();
        // The server's word that its receive is posted: the client sends only then.
        let (posted_tx, posted) = mpsc::channel::<()>();
        let srv = thread::spawn(move || {
            let req = listener.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let mut lane = Lane::new(&req.context().unwrap(), 64).unwrap();
            let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
            let qp = if server_user {
                let uqp = UnconnectedQp::new_reset(&pd, lane.qp_init()).unwrap();
                if states {
                    assert_eq!(uqp.qp().attributes().unwrap().state, QpState::Reset);
                }
                let q = req.adopt_qp(uqp).expect("server: adopt_qp");
                if states {
                    assert_eq!(q.qp().attributes().unwrap().state, QpState::Init);
                }
                let s = q.into_lane(&mut lane).map_err(|r| r.into_parts().0).expect("server: into_lane");
                let qp = s.qp();
                lane.post_recv(qp, RecvWr::new(mr).wr_id(1)).unwrap();
                s.accept(&mut lane, &ConnParam::new(), T).expect("server: accept");
                qp
            } else {
                let q = req.create_qp(&pd, lane.qp_init()).unwrap();
                if states {
                    assert_eq!(q.qp().attributes().unwrap().state, QpState::Init);
                }
                let conn = q.accept(&ConnParam::new(), T).expect("server: accept");
                let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("server: attach");
                lane.post_recv(qp, RecvWr::new(mr).wr_id(1)).unwrap();
                qp
            };
            posted_tx.send(()).unwrap();
            if states {
                assert_eq!(lane.attributes(qp).unwrap().state, QpState::ReadyToSend);
            }
            let mut c = next_ok(&mut lane, "server: receive");
            assert_eq!((c.wr_id(), c.byte_len()), (1, 1000));
            let mut mr = c.take_region().unwrap();
            let got = mr.as_slice().unwrap()[..1000].to_vec();
            assert_eq!(got, pattern(1000, 3), "server: the client's bytes");
            // Echo them back, reversed.
            let back: Vec<u8> = got.iter().rev().copied().collect();
            mr.as_mut_slice().unwrap()[..1000].copy_from_slice(&back);
            lane.post_send(qp, SendWr::send(mr, 0..1000).wr_id(2)).unwrap();
            assert_eq!(next_ok(&mut lane, "server: send").wr_id(), 2);
            assert!(lane.wait_peer_left(qp, T).unwrap(), "server: DISCONNECTED");
            // The peer left: whoever made the QP, it is in the error state now (librdmacm moves
            // only its own there; the crate moves a user QP itself).
            if states {
                assert_eq!(lane.attributes(qp).unwrap().state, QpState::Error);
            }
            drop(lane);
        });
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
        let mut mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let rx = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let qp = if client_user {
            let uqp = UnconnectedQp::new_reset(&pd, lane.qp_init()).unwrap();
            let n = uqp.qp_num();
            let q = route.adopt_qp(uqp).expect("client: adopt_qp");
            assert_eq!(q.qp().qp_num(), n);
            if states {
                assert_eq!(q.qp().attributes().unwrap().state, QpState::Init, "{what}");
            }
            let c = q.into_lane(&mut lane).map_err(|r| r.into_parts().0).expect("client: into_lane");
            let qp = c.qp();
            lane.post_recv(qp, RecvWr::range(rx, 1024..2048).wr_id(1)).unwrap();
            // Naming the QP's own number is allowed.
            c.connect(&mut lane, &ConnParam::new().qp_num(n), T).expect(&what);
            qp
        } else {
            let q = route.create_qp(&pd, lane.qp_init()).unwrap();
            if states {
                assert_eq!(q.qp().attributes().unwrap().state, QpState::Init, "{what}");
            }
            // Naming the QP's own number is allowed.
            let n = q.qp().qp_num();
            let conn = q.connect(&ConnParam::new().qp_num(n), T).expect(&what);
            let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect(&what);
            lane.post_recv(qp, RecvWr::range(rx, 1024..2048).wr_id(1)).unwrap();
            qp
        };
        let a = lane.attributes(qp).unwrap();
        if states {
            assert_eq!(a.state, QpState::ReadyToSend, "{what}");
            assert_ne!(a.dest_qp_num, 0, "{what}");
        }
        mr.as_mut_slice().unwrap()[..1000].copy_from_slice(&pattern(1000, 3));
        posted.recv_timeout(T).expect("the server's receive is posted");
        lane.post_send(qp, SendWr::send(mr, 0..1000).wr_id(2)).unwrap();
        let mut done = reap(&mut lane, 2);
        done.sort_by_key(|c| c.wr_id());
        assert!(done.iter().all(|c| c.is_ok()), "{what}: {done:?}");
        assert_eq!((done[0].wr_id(), done[0].queue(), done[0].byte_len()), (1, WorkQueue::Recv, 1000), "{what}");
        let mut rx = done[0].take_region().unwrap();
        let want: Vec<u8> = pattern(1000, 3).into_iter().rev().collect();
        assert_eq!(&rx.as_slice().unwrap()[1024..2024], &want[..], "{what}: the echo");
        lane.disconnect(qp, T).expect(&what);
        srv.join().unwrap();
        drop((lane, done, rx, pd));
        t.check(&what);
    }
    t.finish();
}

/// The same through the event-loop steps: `Connecting::complete` takes the user QP's
/// `CONNECT_RESPONSE` (librdmacm reports no `ESTABLISHED` for a QP it did not make; iWARP's
/// kernel CM moves the QP to RTS itself and reports `ESTABLISHED`), and the server's accept is
/// started without waiting and completed with its `ESTABLISHED`, each with the minimum RNR
/// timer it asked for ([`ConnParam::min_rnr_timer`]). Each connection the steps give is then
/// attached to a lane, and carries a message.
#[test]
fn user_qp_connects_through_the_event_loop_steps() {
    let t = DeviceTest::start();
    let iwarp = common::caps::iwarp();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    // The client's word that its receive is posted (the steps give the connection before any
    // receive can be posted on a lane): the server sends only then.
    let (posted_tx, posted) = mpsc::channel::<()>();
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mut lane = Lane::new(&req.context().unwrap(), 64).unwrap();
        let mut mr = MemoryRegion::new(&pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
        let q = req.adopt_qp(UnconnectedQp::new_reset(&pd, lane.qp_init()).unwrap()).unwrap();
        let ch = q.id().channel().clone();
        let acc = q.start_accept(&ConnParam::new().min_rnr_timer(5)).unwrap();
        // Ready to send before the accept went out, as librdmacm's rules for a user QP say
        // (where the device reports QP states: not Soft-iWARP), with the RNR timer asked for.
        if !iwarp {
            let a = acc.qp().attributes().unwrap();
            assert_eq!((a.state, a.min_rnr_timer), (QpState::ReadyToSend, 5));
        }
        let ev = ch.get_event_for(acc.handle(), T).unwrap();
        assert_eq!(ev.event_type(), CmEventType::Established);
        let conn = acc.complete(ev).unwrap();
        let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("server: attach");
        mr.as_mut_slice().unwrap()[..100].copy_from_slice(&pattern(100, 9));
        posted.recv_timeout(T).expect("the client's receive is posted");
        lane.post_send(qp, SendWr::send(mr, 0..100).wr_id(5)).unwrap();
        assert_eq!(next_ok(&mut lane, "server: send").wr_id(), 5);
        assert!(lane.wait_peer_left(qp, T).unwrap(), "server: DISCONNECTED");
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ch = route.id().channel().clone();
    let pd = route.alloc_pd().unwrap();
    let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
    let mr = MemoryRegion::new(&pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
    let q = route.adopt_qp(UnconnectedQp::new_reset(&pd, lane.qp_init()).unwrap()).unwrap();
    let connecting = q.start(&ConnParam::new().min_rnr_timer(40)).unwrap();
    let ev = ch.get_event(T).unwrap();
    let answer = if iwarp { CmEventType::Established } else { CmEventType::ConnectResponse };
    assert_eq!(ev.event_type(), answer);
    let conn = connecting.complete(ev).expect("RTR, RTS and rdma_establish");
    if !iwarp {
        // The RNR timer asked for, capped at the largest code.
        let a = conn.qp().attributes().unwrap();
        assert_eq!((a.state, a.min_rnr_timer), (QpState::ReadyToSend, 31));
    }
    let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("client: attach");
    lane.post_recv(qp, RecvWr::new(mr).wr_id(1)).unwrap();
    posted_tx.send(()).unwrap();
    let mut c = next_ok(&mut lane, "client: receive");
    assert_eq!((c.wr_id(), c.byte_len()), (1, 100));
    assert_eq!(&c.take_region().unwrap().as_slice().unwrap()[..100], &pattern(100, 9)[..]);
    lane.disconnect(qp, T).unwrap();
    srv.join().unwrap();
    drop((lane, c, pd));
    t.finish();
}

/// An [`UnconnectedQp`] made in INIT by the verbs wing alone (its own port, GID index and
/// access rights), on a lane's CQ, is adopted by a client's route: INIT again with the CM's
/// attributes; on the lane, a receive posted before the connect takes the server's first
/// message, and the peer leaving moves the QP to the error state. A QP made in RESET for
/// adoption refuses the verbs-only connect, naming why.
#[test]
fn an_unconnected_qp_in_init_is_adopted_with_its_receives() {
    let t = DeviceTest::start();
    // Soft-iWARP's ibv_query_qp reports no QP state (it reads RESET on a working QP, MATRIX.md):
    // the states are checked where the device reports them; the adoption and the data everywhere.
    let states = !common::caps::iwarp();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mut lane = Lane::new(&req.context().unwrap(), 64).unwrap();
        let mut mr = MemoryRegion::new(&pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
        let q = req.create_qp(&pd, lane.qp_init()).unwrap();
        let conn = q.accept(&ConnParam::new(), T).expect("server: accept");
        let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("server: attach");
        mr.as_mut_slice().unwrap()[..200].copy_from_slice(&pattern(200, 5));
        lane.post_send(qp, SendWr::send(mr, 0..200).wr_id(7)).unwrap();
        assert_eq!(next_ok(&mut lane, "server: send").wr_id(), 7);
        lane.disconnect(qp, T).expect("server: disconnect");
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    // The RoCE v2 entry of the address (rxe); elsewhere the table's first (iWARP: the CM's
    // attributes replace the port and address at adoption anyway).
    let table = ctx.gid_table(1).expect("gid table");
    let gidx = table
        .iter()
        .find(|e| e.gid.ipv4().map(IpAddr::V4) == Some(t.addr) && e.gid_type == GidType::RoceV2)
        .or(table.first())
        .map(|e| u8::try_from(e.index).expect("a GID index under 256"));
    let pd = route.alloc_pd().unwrap();
    let mr = MemoryRegion::new(&pd, 256, AccessFlags::LOCAL_WRITE).unwrap();

    // Made for adoption, a RESET QP is refused by the verbs-only connect.
    let reset = UnconnectedQp::new_reset(&pd, QpInit::new()).unwrap();
    let info = reset.local();
    let err = reset.connect(&info).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("new_reset"), "{err}");

    let params = match gidx {
        Some(g) => RcParams::new().gid_index(g),
        None => RcParams::new(), // no GID at all: InfiniBand within one subnet
    };
    let mut lane = Lane::new(&ctx, 64).unwrap();
    let uqp = UnconnectedQp::new(&pd, lane.qp_init(), params).expect("a verbs-only QP in INIT");
    if states {
        assert_eq!(uqp.qp().attributes().unwrap().state, QpState::Init);
    }
    let n = uqp.qp_num();
    let q = route.adopt_qp(uqp).expect("client: adopt an INIT QP");
    assert_eq!(q.qp().qp_num(), n);
    if states {
        assert_eq!(q.qp().attributes().unwrap().state, QpState::Init);
    }
    let client = q.into_lane(&mut lane).map_err(|r| r.into_parts().0).expect("client: onto the lane");
    let qp = client.qp();
    lane.post_recv(qp, RecvWr::new(mr).wr_id(3)).unwrap();
    client.connect(&mut lane, &ConnParam::new(), T).expect("client: connect");
    if states {
        assert_eq!(lane.attributes(qp).unwrap().state, QpState::ReadyToSend);
    }
    let mut c = next_ok(&mut lane, "the receive posted before the connect");
    assert_eq!((c.wr_id(), c.byte_len()), (3, 200));
    let mut mr = c.take_region().expect("the receive's region");
    assert_eq!(&mr.as_slice().unwrap()[..200], &pattern(200, 5)[..]);
    let deadline = std::time::Instant::now() + T;
    while !lane.peer_left(qp).expect("Lane::peer_left") {
        assert!(std::time::Instant::now() < deadline, "the server's disconnect within {T:?}");
        thread::yield_now();
    }
    if states {
        assert_eq!(lane.attributes(qp).unwrap().state, QpState::Error, "the peer left: the adopted QP is in ERR");
    }
    srv.join().unwrap();
    drop(lane);
    drop((mr, pd, ctx));
    t.finish();
}

/// Bad input: an adopted QP whose PD is on another context than the id's, and a `qp_num` in the
/// connection parameters that is not the QP's, for a user QP and for one librdmacm made.
#[test]
fn user_qp_bad_input_is_refused_with_a_clear_error() {
    let t = DeviceTest::start();
    // Address and route resolution need no listener.
    let dst = SocketAddr::new(t.addr, 7990);
    let route =
        || -> RouteResolved { Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap() };

    // A PD on a context this test opened itself: same device, not the id's context.
    let r = route();
    let own = VerbsContext::open(&r.context().unwrap().device_name()).unwrap();
    let pd = rdma_cm::ProtectionDomain::new(&own).unwrap();
    let err = r.adopt_qp(UnconnectedQp::new_reset(&pd, QpInit::new()).unwrap()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("context"), "{err}");
    drop(pd);
    drop(own);

    // A qp_num that is not the QP's.
    for user in [true, false] {
        let r = route();
        let pd = r.alloc_pd().unwrap();
        let q = if user {
            r.adopt_qp(UnconnectedQp::new_reset(&pd, QpInit::new()).unwrap()).unwrap()
        } else {
            r.create_qp(&pd, QpInit::new()).unwrap()
        };
        let wrong = q.qp().qp_num() + 1;
        let err = q.connect(&ConnParam::new().qp_num(wrong), T).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "user {user}: {err:?}");
        assert!(err.to_string().contains("qp_num") && err.to_string().contains(&wrong.to_string()), "{err}");
        drop(pd);
    }
    t.finish();
}

/// rping's advertisement: buffer address, rkey and length, big-endian.
fn rping_info(mr: &MemoryRegion, len: u32) -> [u8; 16] {
    let mut m = [0u8; 16];
    m[..8].copy_from_slice(&mr.addr().to_be_bytes());
    m[8..12].copy_from_slice(&mr.rkey().to_be_bytes());
    m[12..].copy_from_slice(&len.to_be_bytes());
    m
}

/// rdma-core's `rping -s -q` (its own QP, driven by hand) serves our client, whose QP is an
/// adopted QP on a lane (`RouteResolved::lane_qp`: `UnconnectedQp::new_reset`, `adopt_qp`):
/// each round, the server RDMA-READs our start buffer and RDMA-WRITEs it back into our sink
/// buffer, which must then hold the same bytes.
#[test]
fn user_qp_client_interoperates_with_rping_q() {
    let t = DeviceTest::start();
    const SIZE: usize = 64;
    const ROUNDS: usize = 5;
    let port = 7661u16;
    let addr = t.addr.to_string();
    let server = Command::new("rping")
        .args(["-s", "-q", "-V", "-a", &addr, "-p", &port.to_string(), "-S", &SIZE.to_string()])
        .spawn()
        .expect("run rping (rdmacm-utils)");
    common::wait_listening(port, std::time::Duration::from_secs(60));

    let route =
        Client::new().unwrap().resolve_addr(None, SocketAddr::new(t.addr, port), T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
    let mut start = MemoryRegion::new(&pd, SIZE, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
    let mut sink = MemoryRegion::new(&pd, SIZE, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let recv = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
    let client = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
    let qp = client.qp();
    lane.post_recv(qp, RecvWr::new(recv).wr_id(1)).unwrap();
    client.connect(&mut lane, &ConnParam::new(), T).expect("connect to rping -s -q");
    // Sends `info` and waits for its completion and rping's go-ahead (the receive's, whose
    // region is posted again).
    let advertise = |lane: &mut Lane, info: [u8; 16], id: u64, what: &str| {
        lane.post_inline(qp, InlineWr::send(&info).wr_id(id)).unwrap();
        let mut done = reap(lane, 2);
        done.sort_by_key(|c| c.wr_id());
        assert!(done.iter().all(|c| c.is_ok()), "{what}: {done:?}");
        assert_eq!((done[0].wr_id(), done[0].queue()), (1, WorkQueue::Recv), "{what}: rping's go-ahead");
        assert_eq!(done[1].wr_id(), id, "{what}: the advertisement's send");
        let region = done[0].take_region().unwrap();
        lane.post_recv(qp, RecvWr::new(region).wr_id(1)).unwrap();
    };
    for round in 0..ROUNDS {
        // A NUL-terminated string, as rping's: the server writes back strlen + 1 bytes.
        let mut text: Vec<u8> = (0..SIZE - 1).map(|k| b'a' + ((round + k) % 26) as u8).collect();
        text.push(0);
        start.as_mut_slice().unwrap().copy_from_slice(&text);
        sink.write_at(0, &[0u8; SIZE]).unwrap();
        advertise(&mut lane, rping_info(&start, SIZE as u32), 10, "the read advertisement");
        advertise(&mut lane, rping_info(&sink, SIZE as u32), 11, "the write advertisement");
        let mut got = [0u8; SIZE];
        sink.read_at(0, &mut got).unwrap();
        assert_eq!(&got[..], &text[..], "round {round}: rping's echo of our buffer");
    }
    lane.disconnect(qp, T).expect("disconnect from rping");
    let status = wait_exit(server);
    assert!(status.success(), "rping -s -q exited with {status}");
    drop((lane, start, sink, pd));
    t.finish();
}

fn wait_exit(child: std::process::Child) -> std::process::ExitStatus {
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut child = child;
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(T) {
        Ok(st) => st.unwrap(),
        Err(_) => {
            // SAFETY: kill(2) on the pid of a child this test started and has not reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("rping did not exit within {T:?} after the disconnect");
        }
    }
}

/// rping's next advertisement on `qp` (address, rkey and length, big-endian), its receive's
/// region posted again; `None` once rping has disconnected (after its last round).
fn rping_advert(lane: &mut Lane, qp: LaneQp, size: usize) -> Option<rdma_cm::RemoteRegion> {
    let deadline = std::time::Instant::now() + T;
    let mut c = loop {
        // Bounded waits, with a look between them at whether rping left: its disconnect
        // moves the QP to the error state only once this side reads it.
        match lane.wait(std::time::Duration::from_millis(200)) {
            Ok(c) if c.is_ok() => break c,
            // The receive ends, flushed, once the peer's departure moved the QP to ERR.
            Ok(c) if c.status() == rdma_cm::WcStatus::WrFlushErr && lane.peer_left(qp).unwrap() => return None,
            Ok(c) => panic!("waiting for rping's advertisement: {c:?}"),
            // Nothing came, or the wait found the QP in ERR: rping may have left.
            Err(Error::Timeout { .. } | Error::QpInError { .. }) if lane.peer_left(qp).unwrap() => return None,
            Err(Error::Timeout { .. }) => {
                assert!(std::time::Instant::now() < deadline, "no advertisement from rping within {T:?}")
            }
            Err(e) => panic!("waiting for rping's advertisement: {e}"),
        }
    };
    assert_eq!((c.wr_id(), c.byte_len()), (1, 16));
    let mut recv = c.take_region().unwrap();
    let m = recv.as_slice().unwrap();
    let (addr, rkey, len) = (
        u64::from_be_bytes(m[..8].try_into().unwrap()),
        u32::from_be_bytes(m[8..12].try_into().unwrap()),
        u32::from_be_bytes(m[12..].try_into().unwrap()),
    );
    assert_eq!(len as usize, size);
    lane.post_recv(qp, RecvWr::new(recv).wr_id(1)).unwrap();
    Some(rdma_cm::RemoteRegion::new(addr, rkey, len as u64))
}

/// Our server, with an adopted QP on a lane (`ConnectRequest::lane_qp`), serves rdma-core's
/// `rping -c -q -V`: each round it RDMA-READs the client's start buffer and RDMA-WRITEs it back
/// into the client's sink buffer, which rping compares (`-V`: a mismatch makes it exit with an
/// error). This needs the remote access rights the CM grants at the accept's INIT (not the
/// ones before the request).
#[test]
fn user_qp_server_interoperates_with_rping_c_q() {
    let t = DeviceTest::start();
    if common::caps::iwarp() {
        // The peer cannot run here, whoever serves it: measured on siw/6.1 against rdma-core's
        // own `rping -s`, `rping -c -q` prints "rdma_establish: Invalid argument" and hangs.
        common::skipped(
            "rping -c -q as the peer",
            "rdma-core 44's rping -q client calls rdma_establish, which an iWARP id refuses (EINVAL)",
        );
        return;
    }
    const SIZE: usize = 64;
    const ROUNDS: usize = 4;
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let port = listener.local_addr().unwrap().port();
    let client = Command::new("rping")
        .args(["-c", "-q", "-V", "-a", &t.addr.to_string(), "-p", &port.to_string()])
        .args(["-S", &SIZE.to_string(), "-C", &ROUNDS.to_string()])
        .spawn()
        .expect("run rping (rdmacm-utils)");
    let req = listener.get_request(T).expect("rping's request");
    let pd = req.alloc_pd().unwrap();
    let mut lane = Lane::new(&req.context().unwrap(), 64).unwrap();
    let mut buf = Some(MemoryRegion::new(&pd, SIZE, AccessFlags::LOCAL_WRITE).unwrap());
    let recv = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
    let server = req.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
    let qp = server.qp();
    lane.post_recv(qp, RecvWr::new(recv).wr_id(1)).unwrap();
    server.accept(&mut lane, &ConnParam::new(), T).expect("accept rping -c -q");
    let mut rounds = 0;
    while let Some(start) = rping_advert(&mut lane, qp, SIZE) {
        lane.post_send(qp, SendWr::read(buf.take().unwrap(), 0..SIZE, &start, 0).wr_id(2)).unwrap();
        let mut c = next_ok(&mut lane, "RDMA READ of rping's start buffer");
        assert_eq!(c.wr_id(), 2);
        let mut b = c.take_region().unwrap();
        let text = b.as_slice().unwrap().to_vec();
        assert_eq!(text[SIZE - 1], 0, "rping's buffer is a NUL-terminated string");
        assert!(text.starts_with(b"rdma-ping-"), "round {rounds}: {:?}", String::from_utf8_lossy(&text));
        lane.post_inline(qp, InlineWr::send(&[0u8; 16]).wr_id(3)).unwrap();
        assert_eq!(next_ok(&mut lane, "go-ahead").wr_id(), 3);
        let sink = rping_advert(&mut lane, qp, SIZE).expect("rping's sink advertisement");
        lane.post_send(qp, SendWr::write(b, 0..SIZE, &sink, 0).wr_id(4)).unwrap();
        let mut c = next_ok(&mut lane, "RDMA WRITE into rping's sink buffer");
        assert_eq!(c.wr_id(), 4);
        buf = c.take_region();
        lane.post_inline(qp, InlineWr::send(&[0u8; 16]).wr_id(5)).unwrap();
        assert_eq!(next_ok(&mut lane, "go-ahead").wr_id(), 5);
        rounds += 1;
    }
    assert_eq!(rounds, ROUNDS, "rping's rounds");
    let status = wait_exit(client);
    assert!(status.success(), "rping -c -q -V exited with {status}: it found a mismatch, or failed");
    lane.disconnect(qp, T).expect("rping left first: the disconnect only destroys");
    drop((lane, buf, pd, listener));
    t.finish();
}

/// `ClientQp::connect` to an address nobody answers returns `Error::Timeout` at its bound, and
/// everything is released afterwards. Before, a wait that repeated could last twice its bound
/// (measured: 4.03 s of waiting with a 2 s bound). On iWARP, where `rdma_connect` is
/// Soft-iWARP's blocking TCP connect (about two minutes of SYN retries), the call itself is
/// bounded (measured before: 150 s for the client example with `--timeout 2`): the QP goes to
/// the helper thread that still holds the id in `rdma_connect`. (`LaneClient::connect` leaves
/// that QP on the lane, whose removal then waits until the kernel's TCP connect gives up:
/// 138 s on siw/6.1; its twin below checks the bound where it holds, not on iWARP.)
#[test]
fn connect_nobody_answers_returns_at_its_timeout() {
    let t = DeviceTest::start();
    let common::IpV4(a, b, c, _) = common::IpV4::of(t.addr);
    // The guest's netdev is a NOARP dummy: any address of its subnet resolves, and nobody
    // answers there.
    let ghost: SocketAddr = format!("{a}.{b}.{c}.214:7616").parse().unwrap();
    let route = Client::new().unwrap().resolve_addr(None, ghost, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    let bound = std::time::Duration::from_secs(3);
    let start = std::time::Instant::now();
    let e = q.connect(&ConnParam::new(), bound).expect_err("nobody answers there");
    let took = start.elapsed();
    assert!(matches!(e, Error::Timeout { op: "rdma_connect", .. }), "{e:?}");
    // The bound and 3 s of slack; a doubled wait (6 s) exceeds it.
    assert!(took < bound + std::time::Duration::from_secs(3), "connect returned after {took:?} (bound {bound:?}): {e}");
    eprintln!("measured: connect returned after {took:?} with a {bound:?} bound");
    drop(pd);
    finish_after_a_connect_nobody_answered(t);
}

/// `LaneClient::connect` to an address nobody answers, with a receive posted on the lane,
/// returns `Error::Timeout` at its bound, and removing the QP (its receive flushed and reaped
/// within 2 s; rxe never delivers that flush for a QP that did not connect) is bounded too;
/// everything is released afterwards. Before, a wait that repeated could last twice its bound
/// (measured: 4.03 s of waiting with a 2 s bound). On iWARP, where `rdma_connect` is
/// Soft-iWARP's blocking TCP connect (about two minutes of SYN retries), the call itself is
/// bounded (measured before: 150 s for the client example with `--timeout 2`).
#[test]
fn connect_nobody_answers_returns_at_its_timeout_and_the_teardown_is_bounded() {
    let t = DeviceTest::start();
    let common::IpV4(a, b, c, _) = common::IpV4::of(t.addr);
    // The guest's netdev is a NOARP dummy: any address of its subnet resolves, and nobody
    // answers there.
    let ghost: SocketAddr = format!("{a}.{b}.{c}.214:7616").parse().unwrap();
    let route = Client::new().unwrap().resolve_addr(None, ghost, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
    let rx = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let client = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
    let qp = client.qp();
    lane.post_recv(qp, RecvWr::new(rx).wr_id(1)).unwrap();
    let bound = std::time::Duration::from_secs(3);
    let start = std::time::Instant::now();
    let e = client.connect(&mut lane, &ConnParam::new(), bound).expect_err("nobody answers there");
    let took = start.elapsed();
    assert!(matches!(e, Error::Timeout { op: "rdma_connect", .. }), "{e:?}");
    // The bound and 3 s of slack, as for the convenient path's twin (measured 4.97 s on a loaded
    // host); a doubled wait (6 s) exceeds it.
    assert!(took < bound + std::time::Duration::from_secs(3), "connect returned after {took:?} (bound {bound:?}): {e}");
    eprintln!("measured: connect returned after {took:?} with a {bound:?} bound");
    // The failed connect left the QP on the lane, in ERR, refusing posts.
    let refused = lane.post_recv(qp, RecvWr::new(MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap()));
    assert!(refused.is_err(), "a QP whose connect failed takes no receive");
    let start = std::time::Instant::now();
    lane.remove(qp).unwrap();
    let took = start.elapsed();
    eprintln!("measured: the removal took {took:?}");
    if common::caps::iwarp() {
        // Not bounded there yet: see the needs note on the test above.
        common::skipped(
            "a bounded removal of a timed-out iWARP connect's QP from a lane",
            "the lane keeps the QP while rdma_connect still runs on its helper thread, so its teardown waits for \
             TCP to give up",
        );
    } else {
        // The drain (2 s at most) and 1 s of slack.
        assert!(took < std::time::Duration::from_secs(3), "the removal took {took:?}");
    }
    drop((lane, refused, pd));
    finish_after_a_connect_nobody_answered(t);
}

/// Waits (bounded) for everything to be released; on iWARP the connect's helper thread first
/// waits for the kernel's TCP connect to give up (Linux's SYN retries: about 127 s).
fn finish_after_a_connect_nobody_answered(t: DeviceTest) {
    if common::caps::iwarp() {
        let start = std::time::Instant::now();
        t.finish_within(std::time::Duration::from_secs(200));
        eprintln!(
            "measured: the iWARP connect's objects were released {:?} after the test dropped its own",
            start.elapsed()
        );
    } else {
        t.finish();
    }
}
