//! What a new user meets writing a ucmatose-style server and client in one event loop: device
//! contexts that pin no connection, accept parameters taken from the request, event
//! loop steps that hand their state back on an unexpected event, and `rdma_notify`.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::lane::{lane_on, reap};
use common::{DeviceTest, PairSpec, T};
use rdma_cm::verbs::async_event::{AsyncElement, AsyncEventKind};
use rdma_cm::verbs::lane::{Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::verbs::qp::UnconnectedQp;
use rdma_cm::{
    Accepting, AccessFlags, Client, CmEvent, CmEventType, ConnParam, ConnectRequest, Connecting, Connection, Error,
    EventChannel, IdHandle, MemoryRegion, ProtectionDomain, QpInit, ResolvingAddr, ResolvingRoute, Server, StepError,
    VerbsContext, WorkQueue,
};

/// The kernel's `rdma res show cm_id` lines.
fn cm_ids() -> Vec<String> {
    let out = Command::new("rdma").args(["res", "show", "cm_id"]).output().expect("run `rdma res show cm_id`");
    assert!(out.status.success(), "`rdma res show cm_id` failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect()
}

/// Waits (bounded) until no cm_id the kernel tracks names `addr`; panics with the list if one
/// still does.
fn wait_cm_id_gone(addr: SocketAddr, within: Duration) {
    let needle = format!("{addr} ");
    let deadline = Instant::now() + within;
    loop {
        let ids = cm_ids();
        if !ids.iter().any(|l| format!("{l} ").contains(&needle)) {
            return;
        }
        assert!(Instant::now() < deadline, "a cm_id with {addr} is still there after {within:?}:\n{}", ids.join("\n"));
        thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the kernel lists a cm_id that names `addr`.
fn cm_id_listed(addr: SocketAddr) -> bool {
    let needle = format!("{addr} ");
    cm_ids().iter().any(|l| format!("{l} ").contains(&needle))
}

/// One client connection to `dst` on a lane of its own, with a receive posted on the lane
/// before the connect for the server's message.
fn connect_client(dst: SocketAddr) -> (Lane, LaneQp, Arc<ProtectionDomain>) {
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
    let c = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
    let qp = c.qp();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    lane.post_recv(qp, RecvWr::new(mr).wr_id(1)).unwrap();
    c.connect(&mut lane, &ConnParam::new(), T).expect("client: connect");
    (lane, qp, pd)
}

/// The listener's device context, opened before any request (by the listener, by name and by
/// address: one `ibv_context`, librdmacm's), serves two connections in turn with one PD and one
/// lane (its CQ). Dropping the first connection destroys its id while the PD and the lane live
/// on (a context that held the first request's id kept it listed in `rdma res show cm_id` until
/// the CQ went), and the second connection still works on them.
#[test]
fn a_listener_context_pins_no_connection() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let ctx = listener.context().expect("the context of a listener bound to the device's address");
    let by_name = VerbsContext::cm_open(&ctx.device_name()).unwrap();
    let by_addr = VerbsContext::cm_for_addr(t.addr).unwrap();
    assert!(ctx.same_as(&by_name) && ctx.same_as(&by_addr), "librdmacm has one context per device");
    assert!(ctx.cm_id().is_none() && by_addr.cm_id().is_none(), "the contexts hold no id");
    let own = VerbsContext::open(&ctx.device_name()).unwrap();
    assert!(!own.same_as(&ctx), "VerbsContext::open opens a context of its own");
    assert!(VerbsContext::cm_open("no-such-device").is_err());
    // A wildcard listener is on no device until a request arrives, with the device healthy
    // beside it: its error says so and what to do, not "is rdma_rxe loaded?".
    for wildcard in ["0.0.0.0:0", "[::]:0"] {
        let any = Server::new().unwrap().bind(wildcard.parse().unwrap()).unwrap().listen(1).unwrap();
        let err = any.context().expect_err("a wildcard listener has no device");
        assert!(matches!(err, rdma_cm::Error::WildcardAddress { addr, .. } if addr.ip().is_unspecified()), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("is a wildcard address") && msg.contains("until a connection request arrives"), "{msg}");
        assert!(msg.contains("bind to the device's address") && msg.contains("ConnectRequest::context"), "{msg}");
        assert!(!msg.contains("rdma_rxe"), "{msg}");
    }
    let err = VerbsContext::cm_for_addr("0.0.0.0".parse().unwrap()).expect_err("0.0.0.0 is on no device");
    assert!(matches!(err, rdma_cm::Error::WildcardAddress { .. }), "{err:?}");

    // The shared objects, made on the contexts found by address and by the listener, before
    // any request.
    let pd = ProtectionDomain::new(&by_addr).unwrap();
    let lane = Lane::new(&ctx, 64).unwrap();
    let mut mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    mr.as_mut_slice().unwrap()[..5].copy_from_slice(b"hello");
    drop((ctx, by_name, by_addr, own));

    let pd2 = Arc::clone(&pd);
    let server = thread::spawn(move || {
        let req = listener.get_request(T).expect("server: get_request");
        assert!(req.context().unwrap().same_as(pd2.context()), "the request's context is the listener's");
        let q = req.create_qp(&pd2, lane.qp_init()).expect("server: create_qp on the shared PD and the lane's CQ");
        let conn = q.accept(&ConnParam::new(), T).expect("server: accept");
        // Handed back at once, so the test can drop it before the second.
        (listener, lane, conn)
    });
    let (mut c1, q1, pd1) = connect_client(dst);
    let (listener, lane, s1) = server.join().unwrap();
    let client1 = s1.peer_addr().expect("the first client's address");
    assert!(cm_id_listed(client1), "the first connection's ids are listed while it lives");
    // Both ends of the first connection go; the PD and the lane stay. (The server side goes
    // first: nothing reads its id's events, so it would answer the client's disconnect only
    // when its id is destroyed.)
    drop(s1);
    c1.disconnect(q1, T).unwrap();
    drop((c1, pd1));
    wait_cm_id_gone(client1, Duration::from_secs(5));

    // The second connection, on the same PD and lane.
    let pd2 = Arc::clone(&pd);
    let server = thread::spawn(move || {
        let mut lane = lane;
        let req = listener.get_request(T).expect("server: second get_request");
        assert!(req.context().unwrap().same_as(pd2.context()), "the request's context is the listener's");
        let conn = req.create_qp(&pd2, lane.qp_init()).unwrap().accept(&ConnParam::new(), T).expect("server: accept");
        let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("attach the second connection");
        (lane, qp)
    });
    let (mut c2, q2, cpd2) = connect_client(dst);
    let (mut lane, s2) = server.join().unwrap();
    lane.post_send(s2, SendWr::send(mr, 0..5).wr_id(7)).unwrap();
    let sent = lane.wait(T).expect("the send's completion on the shared lane");
    assert!(sent.is_ok() && sent.wr_id() == 7, "{sent:?}");
    let mut got = c2.wait(T).expect("the client's receive").ok().expect("received");
    let n = got.byte_len() as usize;
    assert_eq!(&got.take_region().unwrap().as_slice().unwrap()[..n], b"hello");
    drop(lane);
    c2.disconnect(q2, T).unwrap();
    drop((c2, sent, got, pd, cpd2));
    t.finish();
}

/// `ConnParam::from_request` accepts with the RDMA READ depths the request asks for, as
/// `rdma_accept(id, NULL)` does: the client's initiator depth becomes the server QP's
/// responder resources and its responder resources the server's initiator depth (not the
/// defaults, 1 and 1). With the client asking librdmacm for its device's limits
/// (`ConnParam::FROM_DEVICE`), the server gets them clamped to its own. (rxe rounds both up to
/// a power of two, so the values asked for are powers of two.) The same holds for a QP the id
/// adopts, which the crate moves to RTS before `rdma_accept` would clamp the depths: the crate
/// resolves `FROM_DEVICE` itself (the raw 255 failed the modify with `EINVAL`).
#[test]
fn accept_from_request_takes_the_request_depths() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let limits = listener.context().unwrap().limits().unwrap();
    let (max_resp, max_init) = (limits.max_qp_rd_atom.min(254) as u8, limits.max_qp_init_rd_atom.min(254) as u8);
    assert!(max_resp >= 4 && max_init >= 4, "the device allows 4 outstanding READs: {limits:?}");
    let cases = [
        // (client initiator_depth, client responder_resources) -> (server responder, server initiator)
        ((4u8, 2u8), (4u8, 2u8)),
        ((ConnParam::FROM_DEVICE, ConnParam::FROM_DEVICE), (max_resp.min(max_init), max_init.min(max_resp))),
    ];
    let server = thread::spawn(move || {
        let mut seen = vec![];
        for k in 0..2 * cases.len() {
            let req = listener.get_request(T).unwrap();
            let asked = (req.responder_resources(), req.initiator_depth());
            let param = ConnParam::from_request(&req);
            let pd = req.alloc_pd().unwrap();
            let qp = if k < cases.len() {
                req.create_qp(&pd, QpInit::new()).unwrap()
            } else {
                req.adopt_qp(UnconnectedQp::new_reset(&pd, QpInit::new()).unwrap()).unwrap()
            };
            let conn = qp.accept(&param, T).unwrap_or_else(|e| panic!("accept request {k} from the request: {e}"));
            let a = conn.qp().attributes().unwrap();
            seen.push((asked, (a.max_dest_rd_atomic, a.max_rd_atomic)));
            drop(conn); // answers the client's disconnect at once
        }
        seen
    });
    for ((init, resp), _) in cases.into_iter().chain(cases) {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let param = ConnParam::new().initiator_depth(init).responder_resources(resp);
        let mut conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&param, T).expect("connect");
        let _ = conn.next_event(T); // the server's disconnect
        drop(conn);
    }
    let seen = server.join().unwrap();
    // The first request, from this side: its responder resources are the client's initiator
    // depth (what the client will send us), its initiator depth the client's responder
    // resources (what we may send it).
    assert_eq!(seen[0].0, (4, 2), "the request's depths as the server sees them");
    assert_eq!(seen.len(), 2 * cases.len());
    assert_eq!(seen[cases.len()].0, (4, 2), "the same through an adopted QP");
    for (((_, want), (_, got)), i) in cases.iter().chain(&cases).zip(&seen).zip(0..) {
        let rounded = (want.0.next_power_of_two(), want.1.next_power_of_two()); // rxe's rounding
        assert!(
            *got == *want || *got == rounded,
            "case {i}: the server QP's (max_dest_rd_atomic, max_rd_atomic) are {got:?}, not {want:?}"
        );
        assert_ne!(*got, (1, 1), "case {i}: not the defaults");
    }
    t.finish();
}

/// One step of a connection in the event loop below.
enum State {
    Addr(ResolvingAddr),
    Route(ResolvingRoute),
    Connect(Connecting),
    Accept(Accepting),
}

impl State {
    fn handle(&self) -> IdHandle {
        match self {
            State::Addr(s) => s.handle(),
            State::Route(s) => s.handle(),
            State::Connect(s) => s.handle(),
            State::Accept(s) => s.handle(),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            State::Addr(_) => "ResolvingAddr",
            State::Route(_) => "ResolvingRoute",
            State::Connect(_) => "Connecting",
            State::Accept(_) => "Accepting",
        }
    }
}

/// What feeding an event to a state gives.
enum Outcome {
    Next(State),
    Done(Connection),
    /// The state back, with why it did not complete.
    Back(State, Error),
}

/// Feeds `ev` to `st`; a QP it creates completes on `lane`'s CQ.
fn step(st: State, ev: &CmEvent, lane: &Lane) -> Outcome {
    fn back<S>(e: StepError<S>, wrap: fn(S) -> State) -> Outcome {
        let (s, e) = e.into_parts();
        Outcome::Back(wrap(s), e)
    }
    match st {
        State::Addr(s) => match s.complete(ev) {
            Ok(a) => Outcome::Next(State::Route(a.start_resolve_route(T).unwrap())),
            Err(e) => back(e, State::Addr),
        },
        State::Route(s) => match s.complete(ev) {
            Ok(r) => {
                let pd = r.alloc_pd().unwrap();
                Outcome::Next(State::Connect(
                    r.create_qp(&pd, lane.qp_init()).unwrap().start(&ConnParam::new()).unwrap(),
                ))
            }
            Err(e) => back(e, State::Route),
        },
        State::Connect(s) => match s.complete(ev) {
            Ok(c) => Outcome::Done(c),
            Err(e) => back(e, State::Connect),
        },
        State::Accept(s) => match s.complete(ev) {
            Ok(c) => Outcome::Done(c),
            Err(e) => back(e, State::Accept),
        },
    }
}

/// Two clients and a server on one channel, in one thread, driven by the non-blocking steps.
/// Every event is first fed to a state it is not for (another id's, which is not waiting for
/// it) and to `ConnectRequest::from_event` when it is no request, and each connecting client
/// is first fed its own stale `ADDR_RESOLVED`: each time the state (or the event) comes back
/// with `UnexpectedEvent`, is put back, and still completes with the right event. Both
/// connections are established, and carry a message once attached to the loop's one lane.
#[test]
fn event_loop_steps_hand_their_state_back() {
    let t = DeviceTest::start();
    let mut lane = lane_on(t.addr, 256);
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let mut states: Vec<State> = vec![];
    for _ in 0..2 {
        states.push(State::Addr(Client::on_channel(&ch).unwrap().start_resolve(None, dst, T).unwrap()));
    }
    let clients: Vec<IdHandle> = states.iter().map(State::handle).collect();
    let mut stale: Vec<(IdHandle, CmEvent)> = vec![]; // each client's ADDR_RESOLVED, kept
    let (mut conns, mut refused, mut server_pds) = (vec![], 0, vec![]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while conns.len() < 4 {
        assert!(Instant::now() < deadline, "{} of 4 connections after 60 s", conns.len());
        let ev = ch.get_event(T).expect("the next event of the loop");
        // An event that is not a request comes back from ConnectRequest::from_event.
        let ev = if ev.event_type() == CmEventType::ConnectRequest {
            let req = ConnectRequest::from_event(ev).expect("a request");
            let pd = req.alloc_pd().unwrap();
            let acc = req.create_qp(&pd, lane.qp_init()).unwrap().start_accept(&ConnParam::new()).unwrap();
            server_pds.push(pd);
            states.push(State::Accept(acc));
            continue;
        } else {
            let kind = ev.event_type();
            let back = ConnectRequest::from_event(ev).expect_err("not a request");
            assert!(matches!(back.error(), Error::UnexpectedEvent { .. }), "{}", back.error());
            let ev = back.into_state();
            assert_eq!(ev.event_type(), kind, "the event comes back as it was");
            refused += 1;
            ev
        };
        // Fed first to a state of another id: refused, and given back.
        if let Some(i) = states.iter().position(|s| s.handle() != ev.id()) {
            let other = states.swap_remove(i);
            let (h, name) = (other.handle(), other.name());
            let Outcome::Back(other, e) = step(other, &ev, &lane) else {
                panic!("{name} took another id's {}", ev.event_type())
            };
            assert!(matches!(e, Error::UnexpectedEvent { .. }), "{name} given another id's event: {e}");
            assert_eq!((other.handle(), other.name()), (h, name), "the state comes back unchanged");
            states.push(other);
            refused += 1;
        }
        let i = states.iter().position(|s| s.handle() == ev.id()).expect("an event of a state in the loop");
        let mut st = states.swap_remove(i);
        // A connecting client is first fed its own stale ADDR_RESOLVED: same id, wrong kind.
        if let State::Connect(_) = st {
            let (_, old) = stale.iter().find(|(h, _)| *h == ev.id()).expect("the client's ADDR_RESOLVED");
            let Outcome::Back(back, e) = step(st, old, &lane) else { panic!("Connecting took ADDR_RESOLVED") };
            assert!(
                matches!(
                    e,
                    Error::UnexpectedEvent { expected: CmEventType::Established, got: CmEventType::AddrResolved, .. }
                ),
                "{e}"
            );
            st = back;
            refused += 1;
        }
        match step(st, &ev, &lane) {
            Outcome::Next(next) => states.push(next),
            Outcome::Done(conn) => conns.push(conn),
            Outcome::Back(st, e) => panic!("{} refused its own {}: {e}", st.name(), ev.event_type()),
        }
        if ev.event_type() == CmEventType::AddrResolved {
            stale.push((ev.id(), ev));
        }
    }
    assert!(states.is_empty());
    assert!(refused >= 8, "the wrong events were fed ({refused} times)");
    // Both pairs work, attached to the lane: each client sends to its server side.
    let (cl, sv): (Vec<_>, Vec<_>) = conns.into_iter().partition(|c| clients.contains(&c.id().handle()));
    assert_eq!((cl.len(), sv.len()), (2, 2));
    let mut attach = |c: Connection| {
        let (addrs, pd) = ((c.local_addr(), c.peer_addr()), Arc::clone(c.qp().pd()));
        (lane.attach(c).map_err(|r| r.into_parts().0).expect("attach"), addrs, pd)
    };
    let cl: Vec<_> = cl.into_iter().map(&mut attach).collect();
    let sv: Vec<_> = sv.into_iter().map(&mut attach).collect();
    for (k, (c, (local, _), cpd)) in cl.iter().enumerate() {
        let (s, _, spd) = sv.iter().find(|(_, (_, peer), _)| peer == local).expect("the client's server side");
        let rmr = MemoryRegion::new(spd, 16, AccessFlags::LOCAL_WRITE).unwrap();
        lane.post_recv(*s, RecvWr::new(rmr).wr_id(10 + k as u64)).unwrap();
        let mut smr = MemoryRegion::new(cpd, 16, AccessFlags::LOCAL_WRITE).unwrap();
        smr.as_mut_slice().unwrap()[..4].copy_from_slice(b"ping");
        lane.post_send(*c, SendWr::send(smr, 0..4).wr_id(20 + k as u64)).unwrap();
        let mut done = reap(&mut lane, 2);
        done.sort_by_key(|d| d.wr_id());
        assert!(done.iter().all(|d| d.is_ok()), "{done:?}");
        assert_eq!((done[0].wr_id(), done[0].qp(), done[0].queue()), (10 + k as u64, Some(*s), WorkQueue::Recv));
        assert_eq!(done[0].byte_len(), 4);
        assert_eq!(&done[0].take_region().unwrap().as_slice().unwrap()[..4], b"ping");
        assert_eq!((done[1].wr_id(), done[1].qp()), (20 + k as u64, Some(*c)));
    }
    for (s, _, _) in sv {
        lane.remove(s).unwrap();
    }
    drop((server_pds, stale));
    for (c, _, _) in cl {
        lane.disconnect(c, T).unwrap();
    }
    drop((lane, listener));
    t.finish();
}

/// `CmId::notify`: kinds the CM takes no notice of are refused before any call; on an
/// established id `rdma_notify(COMM_EST)` fails with the errno the kernel's CM gives
/// (`EISCONN`: nothing to do). Then, on lanes, the client sends its first message; rxe raises
/// no `COMM_EST` for it (its responder raises no such event), so on rxe no event names the
/// server's QP; elsewhere, one it reports was answered and the connection works.
#[test]
fn rdma_notify_on_an_established_id() {
    let t = DeviceTest::start();
    let (mut cl, mut sl) = (lane_on(t.addr, 64), lane_on(t.addr, 64));
    let client_spec = PairSpec { init: cl.qp_init(), ..PairSpec::default() };
    let server_spec = PairSpec { init: sl.qp_init(), ..PairSpec::default() };
    let (client, server) = common::pair(t.addr, client_spec, server_spec);
    let e = client.conn.id().notify(AsyncEventKind::QpFatal).expect_err("QP_FATAL is no notice");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    for (side, conn) in [("client", &client.conn), ("server", &server.conn)] {
        let e = conn.id().notify(AsyncEventKind::CommEstablished).expect_err("the connection is established");
        assert!(matches!(e, Error::Call { op: "rdma_notify", .. }), "{side}: {e}");
        assert_eq!(e.errno(), Some(libc::EISCONN), "{side}: {e}");
    }
    let ctx = server.pd.context().clone();
    let common::Side { conn, pd: spd, mrs: mut smrs } = server;
    let sq = sl.attach(conn).map_err(|r| r.into_parts().0).expect("attach the server");
    let server_raw = sl.qp_as_raw(sq).unwrap() as usize;
    sl.post_recv(sq, RecvWr::range(smrs.remove(0), 0..64).wr_id(1)).unwrap();
    let common::Side { conn, pd: cpd, mrs: mut cmrs } = client;
    let cq = cl.attach(conn).map_err(|r| r.into_parts().0).expect("attach the client");
    let mut first = cmrs.remove(0);
    first.as_mut_slice().unwrap()[..5].copy_from_slice(b"early");
    cl.post_send(cq, SendWr::send(first, 0..5).wr_id(9)).unwrap();
    let mut got = sl.wait(T).expect("the client's first message").ok().expect("received");
    assert_eq!((got.wr_id(), got.byte_len()), (1, 5));
    assert_eq!(&got.take_region().unwrap().as_slice().unwrap()[..5], b"early");
    let sent = cl.wait(T).unwrap();
    assert!(sent.is_ok() && sent.wr_id() == 9, "{sent:?}");
    // What the device reported about the server's QP (a source made now finds the context's
    // log of events read before).
    let mut events = ctx.async_events().unwrap();
    let mut seen = vec![];
    while let Some(ev) = events.try_next().unwrap() {
        if ev.element == AsyncElement::Qp(server_raw) {
            seen.push(ev.kind);
        }
    }
    if ctx.device_name().starts_with("rxe") {
        assert_eq!(seen, [], "rxe raised an async event for the server's QP");
    } else if seen.contains(&AsyncEventKind::CommEstablished) {
        eprintln!("the device raised COMM_EST; it was answered");
    }
    drop((events, ctx, sl, got, smrs, spd));
    cl.disconnect(cq, T).unwrap();
    drop((cl, sent, cmrs, cpd));
    t.finish();
}
