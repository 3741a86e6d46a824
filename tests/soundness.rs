//! Regression tests for the outside audit's findings (issue: "Soundness and correctness, second
//! pass"), each an attempt to break the crate's promises with the API a user has, on the device.
//! Where an attempt needs the raw escape hatch (`as_raw`, to stand in for a provider or a user
//! of raw verbs), the unsafe block says so.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{out_of_reach, pair, DeviceTest, PairSpec, T};
use rdma_cm::{
    ffi, AccessFlags, Client, CmEventType, CompletionQueue, ConnParam, Error, EventChannel, MemoryRegion, QpInit,
    RecvWr, SendWr, Server, WcOpcode, WcStatus, WorkCompletion, WorkQueue, FOREVER,
};

/// Moves a QP to `state` through the raw handle (standing in for a provider or a raw-verbs user).
fn raw_modify(qp: *mut ffi::ibv_qp, state: ffi::ibv_qp_state::Type, extra: impl FnOnce(&mut ffi::ibv_qp_attr) -> i32) {
    // SAFETY: zeroed ibv_qp_attr is valid; the QP is alive (the caller holds its owner) and only
    // the attributes named in the mask are read.
    unsafe {
        let mut attr: ffi::ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = state;
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32 | extra(&mut attr);
        assert_eq!(ffi::ibv_modify_qp(qp, &mut attr, mask), 0, "ibv_modify_qp({state})");
    }
}

/// Item 1: a post that fails without saying how far it got (rxe: a send while the QP is not
/// ready returns EINVAL with bad_wr NULL, but keeps the WQE and runs it later) must release
/// nothing: the region stays held until the flush retires the work request.
#[test]
fn a_post_that_fails_without_bad_wr_releases_nothing_and_flushes() {
    let t = DeviceTest::start();
    let (mut c, s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    let qp = c.conn.qp().as_raw();
    // Back to INIT, as a QP is before connect (RTS -> RESET -> INIT).
    raw_modify(qp, ffi::ibv_qp_state::IBV_QPS_RESET, |_| 0);
    raw_modify(qp, ffi::ibv_qp_state::IBV_QPS_INIT, |a| {
        a.pkey_index = 0;
        a.port_num = 1;
        a.qp_access_flags = 0;
        (ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT.0
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0) as i32
    });
    let err = c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(5)]).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("ibv_post_send") && msg.contains("without saying"), "{msg}");
    // Nothing was released: the region is still held by the QP.
    assert_eq!(c.conn.qp().outstanding_sends(), 1);
    assert!(matches!(c.mrs[0].as_mut_slice(), Err(Error::InFlight { .. })), "the region must stay held");
    // The QP went to the error state: the flush retires the work request with its own wr_id.
    let err = c.conn.qp_mut().wait_for(WorkQueue::Send, 5, T).unwrap_err();
    assert!(
        matches!(err, Error::WorkCompletion { wr_id: 5, status: WcStatus::WrFlushErr, .. }),
        "expected the flush of wr 5, got {err:?}"
    );
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    assert!(c.mrs[0].as_mut_slice().is_ok(), "released once the flush is reaped");
    drop((c, s));
    t.finish();
}

/// Item 4: a CQ of another device must be refused (the kernel would resolve its handle in the
/// QP's device file, where the number names some other CQ).
#[test]
fn guest_only_a_cq_of_another_device_is_refused() {
    let t = DeviceTest::start();
    assert!(
        std::env::var_os("RDMA_VM").is_some(),
        "this test adds a second Soft-RoCE device: it runs in the harness guest; elsewhere skip it with \
         `cargo test -- --skip guest_only`"
    );
    let sh = |cmd: &str| {
        let st = Command::new("sh").args(["-c", cmd]).status().unwrap();
        assert!(st.success(), "{cmd}");
    };
    sh("ip link add rdma1 type dummy && ip link set rdma1 mtu 9000 && ip addr add 10.78.0.1/24 dev rdma1 && \
        ip link set rdma1 up && rdma link add rxe1 type rxe netdev rdma1");
    let deadline = Instant::now() + T;
    while !std::fs::read_to_string("/sys/class/infiniband/rxe1/ports/1/state").unwrap_or_default().contains("ACTIVE") {
        assert!(Instant::now() < deadline, "rxe1 never became ACTIVE");
        thread::sleep(Duration::from_millis(20));
    }
    {
        let other = Client::new()
            .unwrap()
            .resolve_addr(None, "10.78.0.1:7999".parse().unwrap(), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let other_ctx = other.context().unwrap();
        assert_eq!(other_ctx.device_name(), "rxe1");
        let foreign_cq = CompletionQueue::new(&other_ctx, 32).unwrap();
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, 7999), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let pd = route.alloc_pd().unwrap();
        let err = route.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&foreign_cq))).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidArgument(_)) && msg.contains("rxe1") && msg.contains("device"), "{msg}");
        // The dangerous case: the foreign CQ's handle number equals that of a CQ of the QP's
        // own device, so the kernel would resolve it to *that* CQ rather than fail. Make the
        // numbers collide, and check the crate still refuses.
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, 7999), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let own_cq = CompletionQueue::new(&route.context().unwrap(), 32).unwrap();
        // SAFETY: reading the handle field of a live CQ.
        let own_handle = unsafe { (*own_cq.as_raw()).handle };
        let mut spare = vec![];
        let colliding = loop {
            let cq = CompletionQueue::new(&other_ctx, 32).unwrap();
            // SAFETY: as above.
            let h = unsafe { (*cq.as_raw()).handle };
            if h == own_handle {
                break cq;
            }
            assert!(h < own_handle, "cannot make the handles collide ({h} > {own_handle})");
            spare.push(cq);
        };
        let r = route.create_qp(&pd, QpInit::new().send_cq(colliding).recv_cq(own_cq));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "a QP was created with a CQ of another device");
        drop(spare);
        // A PD of the other device is refused too.
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, 7999), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let foreign_pd = other.alloc_pd().unwrap();
        assert!(route.create_qp(&foreign_pd, QpInit::new()).is_err());
    }
    // rxe1 stays: librdmacm keeps every device context it opened until the process exits, so
    // deleting the link here would wait for this process. The guest is thrown away after.
    t.finish();
}

/// Waits (bounded) until `ch` has an event to read, without reading it.
fn wait_readable(ch: &EventChannel) {
    use std::os::fd::AsRawFd;
    let mut fds = [libc::pollfd { fd: ch.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
    // SAFETY: one valid pollfd for the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, T.as_millis() as i32) };
    assert_eq!(n, 1, "no event arrived on the channel");
}

/// Item 5: on a shared channel, one connection's events never tear down another, and a
/// listener's CONNECT_REQUEST is not eaten by a client's step.
#[test]
fn a_shared_channel_routes_every_event_to_its_id() {
    let t = DeviceTest::start();
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    // The peer: a blocking server on its own channels, in a thread.
    let srv_listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let srv_dst = srv_listener.local_addr().unwrap();
    let (leave_tx, leave_rx) = std::sync::mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let mut conns = vec![];
        for _ in 0..2 {
            let req = srv_listener.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
            q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(1)]).unwrap();
            conns.push((q.accept(&ConnParam::new(), T).unwrap(), mr, pd));
        }
        // On cue, leave the second client: its DISCONNECTED lands on the shared channel.
        leave_rx.recv().unwrap();
        drop(conns.pop());
        // The first client's message still arrives.
        let (c0, mr0, _) = &mut conns[0];
        let wc = c0.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
        assert_eq!(wc.byte_len(), 8);
        assert_eq!(mr0.as_slice().unwrap()[..8], *b"survivor");
        conns
    });
    // Two clients on the shared channel (which also carries the listener), with blocking steps.
    let connect = |ch: &EventChannel| {
        let route = Client::on_channel(ch).unwrap().resolve_addr(None, srv_dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let q = route.create_qp(&pd, QpInit::new()).unwrap();
        (q.connect(&ConnParam::new(), T).unwrap(), pd)
    };
    let (mut a, pda) = connect(&ch);
    let (mut b, pdb) = connect(&ch);
    // A third party knocks at the shared listener. Its CONNECT_REQUEST is read by B's step,
    // which must keep it for the listener.
    let knocker = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let q = route.create_qp(&pd, QpInit::new()).unwrap();
        let e = q.connect(&ConnParam::new(), T).unwrap_err();
        assert!(matches!(e, Error::UnexpectedEvent { got: CmEventType::Rejected, .. }), "{e:?}");
    });
    wait_readable(&ch);
    assert!(b.try_event().unwrap().is_none(), "B has no event of its own yet");
    let req = listener.get_request(T).expect("the listener's CONNECT_REQUEST was eaten");
    req.reject(b"no").unwrap();
    knocker.join().unwrap();
    // B's peer leaves; B's DISCONNECTED arrives on the shared channel while A works.
    leave_tx.send(()).unwrap();
    wait_readable(&ch);
    let mut mr = MemoryRegion::new(&pda, 64, AccessFlags::LOCAL_WRITE).unwrap();
    mr.as_mut_slice().unwrap()[..8].copy_from_slice(b"survivor");
    a.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(9)]).unwrap();
    a.qp_mut().wait_for(WorkQueue::Send, 9, T).expect("connection A was torn down by B's events");
    assert!(!a.is_disconnected(), "B's DISCONNECTED reached A");
    // And B still gets its own event: nothing was consumed on the way.
    assert_eq!(b.next_event(T).unwrap().event_type(), CmEventType::Disconnected);
    assert!(b.is_disconnected());
    let conns = server.join().unwrap();
    drop((a, b, pdb, conns, mr, pda, listener, ch));
    t.finish();
}

/// Item 5, event-loop side: connections whose ids share a channel read only their own events
/// through next_event/try_event.
#[test]
fn connections_on_one_channel_read_only_their_own_events() {
    let t = DeviceTest::start();
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().unwrap();
    let clients = thread::spawn(move || {
        (0..2)
            .map(|_| {
                let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
                let pd = route.alloc_pd().unwrap();
                let q = route.create_qp(&pd, QpInit::new()).unwrap();
                (q.connect(&ConnParam::new(), T).unwrap(), pd)
            })
            .collect::<Vec<_>>()
    });
    // The accepted ids stay on the shared channel (from_event does not move them).
    let mut conns = vec![];
    while conns.len() < 2 {
        let ev = ch.get_event(T).unwrap();
        let req = rdma_cm::ConnectRequest::from_event(ev).unwrap();
        let pd = req.alloc_pd().unwrap();
        let q = req.create_qp(&pd, QpInit::new()).unwrap();
        conns.push((q.accept(&ConnParam::new(), T).unwrap(), pd));
    }
    let mut clients = clients.join().unwrap();
    // Client 1 leaves (answered below by server connection 1's next_event).
    let (c1, pd1) = clients.pop().unwrap();
    let leaving = thread::spawn(move || c1.disconnect(T));
    let ev = conns[1].0.next_event(T).unwrap();
    assert_eq!(ev.event_type(), CmEventType::Disconnected);
    assert!(conns[1].0.is_disconnected());
    leaving.join().unwrap().unwrap();
    assert!(conns[0].0.try_event().unwrap().is_none(), "connection 0 must not see connection 1's event");
    assert!(!conns[0].0.is_disconnected());
    drop((clients, pd1, conns, listener, ch));
    t.finish();
}

/// Item 6: a send queue filled with unsignaled work requests drains: the one that takes the
/// last slot is signaled.
#[test]
fn a_send_queue_full_of_unsignaled_work_drains() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { mr_sizes: vec![16 * 64], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    let recvs: Vec<RecvWr> = (0..16).map(|k| RecvWr::new(&s.mrs[0], k * 64..(k + 1) * 64).wr_id(k as u64)).collect();
    s.conn.qp_mut().post_recv(&recvs).unwrap();
    // Sixteen unsignaled sends, one per post, filling the queue.
    for k in 0..16 {
        c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(k).unsignaled()]).unwrap();
    }
    assert_eq!(c.conn.qp().outstanding_sends(), 16);
    // The last one was signaled for us: waiting for it retires all sixteen.
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 15, T).expect("a full queue of unsignaled sends must drain");
    assert!(wc.is_ok());
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    assert!(c.mrs[0].as_mut_slice().is_ok());
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(99)]).expect("room again");
    drop((c, s));
    t.finish();
}

/// Item 7: Duration::MAX (FOREVER) waits without a bound instead of panicking.
#[test]
fn forever_is_a_timeout_everywhere() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let req = listener.get_request(FOREVER).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
        q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(1)]).unwrap();
        let mut conn = q.accept(&ConnParam::new(), FOREVER).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Recv, 1, FOREVER).unwrap();
        let ev = conn.next_event(FOREVER).unwrap();
        assert_eq!(ev.event_type(), CmEventType::Disconnected);
        drop((conn, mr, pd));
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, FOREVER).unwrap().resolve_route(FOREVER).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), FOREVER).unwrap();
    conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(2)]).unwrap();
    conn.qp_mut().wait_for(WorkQueue::Send, 2, FOREVER).unwrap();
    let mut wcs = [WorkCompletion::default(); 2];
    assert_eq!(conn.qp_mut().wait(&mut wcs, Duration::from_millis(1)).unwrap(), 0);
    conn.disconnect(FOREVER).unwrap();
    server.join().unwrap();
    drop((mr, pd));
    t.finish();
}

/// Item 8: wait_for keeps the completions it meets before its own; none is lost.
#[test]
fn wait_for_keeps_the_completions_it_passes() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { mr_sizes: vec![4 * 64], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    let recvs: Vec<RecvWr> = (0..4).map(|k| RecvWr::new(&s.mrs[0], k * 64..(k + 1) * 64).wr_id(k as u64)).collect();
    s.conn.qp_mut().post_recv(&recvs).unwrap();
    let wrs: Vec<SendWr> = (1..=3).map(|k| SendWr::send(&c.mrs[0], 0..8).wr_id(k)).collect();
    c.conn.qp_mut().post_send(&wrs).unwrap();
    // Wait for the last first: 1 and 2 complete before it and must be kept.
    assert_eq!(c.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap().wr_id(), 3);
    assert_eq!(c.conn.qp().undelivered(), 2);
    assert_eq!(c.conn.qp_mut().wait_for(WorkQueue::Send, 1, Duration::ZERO).unwrap().wr_id(), 1);
    let mut wcs = [WorkCompletion::default(); 4];
    assert_eq!(c.conn.qp_mut().poll(&mut wcs).unwrap(), 1);
    assert_eq!(wcs[0].wr_id(), 2, "the kept completion comes back from poll");
    assert_eq!(c.conn.qp().undelivered(), 0);
    // Receives, waited for out of order.
    for k in [2, 0, 1] {
        assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, k, T).unwrap().wr_id(), k);
    }
    drop((c, s));
    t.finish();
}

/// Item 8, shared CQ: wait_for works when both queues share one CQ and keeps the other queue's
/// completions.
#[test]
fn wait_for_on_a_shared_cq_keeps_the_other_queue() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
        q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(1)]).unwrap();
        let mut conn = q.accept(&ConnParam::new(), T).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
        conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(2)]).unwrap();
        conn.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
        conn.next_event(T).unwrap();
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&route.context().unwrap(), 64).unwrap();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut q = route.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(cq)).unwrap();
    q.post_recv(&[RecvWr::new(&mr, 0..64).wr_id(7)]).unwrap();
    let mut conn = q.connect(&ConnParam::new(), T).unwrap();
    conn.qp_mut().post_send(&[SendWr::send(&mr, 0..8).wr_id(8)]).unwrap();
    // The receive's completion arrives after the send's; waiting for it keeps the send's if
    // it is met first, and the other way round.
    assert_eq!(conn.qp_mut().wait_for(WorkQueue::Recv, 7, T).unwrap().wr_id(), 7);
    assert_eq!(conn.qp_mut().wait_for(WorkQueue::Send, 8, T).unwrap().wr_id(), 8);
    conn.disconnect(T).unwrap();
    server.join().unwrap();
    drop((mr, pd));
    t.finish();
}

static ORIG_POST_RECV: std::sync::OnceLock<
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32,
> = std::sync::OnceLock::new();
static SEEN_NUM_SGE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Stands in for the provider's post_recv: records what it is handed, then calls the real one.
///
/// # Safety
/// As the provider's `post_recv`.
unsafe extern "C" fn recording_post_recv(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
) -> i32 {
    // SAFETY: `wr` is the list the crate passed, valid for the call.
    SEEN_NUM_SGE.store(unsafe { (*wr).num_sge }, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: forwarded unchanged to the provider's own entry point.
    unsafe { ORIG_POST_RECV.get().expect("set before the swap")(qp, wr, bad) }
}

/// Item 11: a zero-length receive reaches the provider with no scatter entry (some providers
/// read a 0 byte count as 2 GiB; rxe does not, so what the provider is handed is checked by
/// wrapping its post_recv entry), and completes with 0 bytes.
#[test]
fn zero_length_receives_reach_the_provider_without_sge() {
    let t = DeviceTest::start();
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    let qp = s.conn.qp().as_raw();
    // SAFETY: the QP and its context are alive; the context's ops table is the provider's,
    // swapped for this one call and restored; nothing else posts on this context meanwhile.
    unsafe {
        let ops = &mut (*(*qp).context).ops;
        let orig = ops.post_recv.expect("the provider's post_recv");
        let _ = ORIG_POST_RECV.set(orig);
        ops.post_recv = Some(recording_post_recv);
        let r = s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..0).wr_id(4)]);
        ops.post_recv = Some(orig);
        r.unwrap();
    }
    assert_eq!(
        SEEN_NUM_SGE.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a zero-length receive reached the provider with a (zero-length) scatter entry"
    );
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..0).wr_id(1)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 4, T).unwrap().byte_len(), 0);
    drop((c, s));
    t.finish();
}

/// Item 12: a completion of a raw post (a `wr_id` without the crate's tag) retires none of
/// the crate's slots, even when its number is one the crate uses.
#[test]
fn raw_posts_do_not_retire_the_crates_slots() {
    let t = DeviceTest::start();
    let spec_s = PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        pre_recv: vec![(1, 64)],
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, PairSpec { mr_sizes: vec![64, 64], ..PairSpec::default() }, spec_s);
    let raw_mr = &c.mrs[1];
    let remote = s.mrs[0].remote();
    // A raw RDMA WRITE with wr_id 0, the crate's first sequence number, posted first.
    // SAFETY: the raw-verbs user's side: the region (c.mrs[1]) stays alive and untouched until
    // the test ends, long after the work request completes; the list is well formed, and the
    // target is the peer's remotely writable region.
    unsafe {
        let mut sge = ffi::ibv_sge { addr: raw_mr.addr(), length: 8, lkey: raw_mr.lkey() };
        let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
        wr.wr_id = 0;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.wr.rdma = ffi::rdma_t { remote_addr: remote.addr + 1024, rkey: remote.rkey };
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        assert_eq!(ffi::ibv_post_send(c.conn.qp().as_raw(), &mut wr, &mut bad), 0);
    }
    // Then the crate's own send.
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(7)]).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap().byte_len(), 8);
    // Reap completions one at a time: the raw one must not retire the crate's work request.
    let mut wcs = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + T;
    loop {
        assert!(Instant::now() < deadline, "the crate's send never completed");
        let n = c.conn.qp_mut().wait(&mut wcs, T).unwrap();
        if n == 1 {
            assert_eq!(wcs[0].wr_id(), 7, "only the crate's own completion comes back");
            // The raw WRITE completes first; had it retired the crate's slot, this would be
            // its completion under the crate's wr_id.
            assert_eq!(wcs[0].opcode(), Some(WcOpcode::Send), "a raw completion retired the crate's send");
            break;
        }
        // n == 0 would be a timeout; a discarded raw completion returns nothing either, so
        // check that the crate's request is still held meanwhile.
        assert_eq!(c.conn.qp().outstanding_sends(), 1);
    }
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    drop((c, s));
    t.finish();
}

/// Sharper edge: REMOTE_WRITE without LOCAL_WRITE registers (LOCAL_WRITE is implied).
#[test]
fn remote_write_implies_local_write() {
    let t = DeviceTest::start();
    let route = Client::new().unwrap().resolve_addr(None, SocketAddr::new(t.addr, 7999), T).unwrap();
    let route = route.resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    for access in [AccessFlags::REMOTE_WRITE, AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ] {
        let mr = MemoryRegion::new(&pd, 4096, access).expect("remote write rights alone must register");
        assert!(mr.access().contains(AccessFlags::LOCAL_WRITE | access));
    }
    drop((pd, route));
    t.finish();
}

/// Sharper edge: a region the device only reads (an in-flight send's source) can be read, not
/// written; one it writes (a posted receive) can be neither.
#[test]
fn in_flight_sources_are_readable_and_targets_are_not() {
    let t = DeviceTest::start();
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    c.mrs[0].as_mut_slice().unwrap()[..4].copy_from_slice(b"ping");
    // No receive at the server yet, so the send stays in flight (RNR retries).
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..4).wr_id(1)]).unwrap();
    assert_eq!(&c.mrs[0].as_slice().expect("a send's source may be read")[..4], b"ping");
    let mut b = [0u8; 4];
    c.mrs[0].read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"ping");
    assert!(matches!(c.mrs[0].as_mut_slice(), Err(Error::InFlight { .. })), "but not written");
    assert!(matches!(c.mrs[0].write_at(0, b"x"), Err(Error::InFlight { .. })));
    // A posted receive: neither read nor written.
    s.conn.qp_mut().post_recv(&[RecvWr::new(&s.mrs[0], 0..64).wr_id(2)]).unwrap();
    let _ = s.conn.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap();
    let mut tgt = MemoryRegion::new(&s.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    s.conn.qp_mut().post_recv(&[RecvWr::new(&tgt, 0..64).wr_id(3)]).unwrap();
    assert!(matches!(tgt.as_slice(), Err(Error::InFlight { .. })));
    assert!(matches!(tgt.read_at(0, &mut b), Err(Error::InFlight { .. })));
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    drop((c, s, tgt));
    t.finish();
}

/// Scatter/gather: while a receive or an RDMA READ of several pieces is outstanding, every
/// region of every piece (the second and third especially: they live in the ring's side table)
/// refuses every accessor; the regions of an outstanding gathered send may be read, not
/// written; a region named by two pieces of one work request is held once for it. Once reaped, all is reachable and right.
#[test]
fn every_piece_of_an_outstanding_scatter_is_out_of_reach() {
    let t = DeviceTest::start();
    let cspec = PairSpec { mr_sizes: vec![], init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        init: QpInit::new().max_recv_sge(3),
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let lw = AccessFlags::LOCAL_WRITE;
    // A gathered send the peer has no receive for yet: it stays in flight (RNR retries).
    let mut g0 = MemoryRegion::new(&c.pd, 64, lw).unwrap();
    let mut g1 = MemoryRegion::new(&c.pd, 64, lw).unwrap();
    g0.as_mut_slice().unwrap().copy_from_slice(&[1; 64]);
    g1.as_mut_slice().unwrap().copy_from_slice(&[2; 64]);
    let pieces = [(&g0, 0..64), (&g1, 0..64), (&g0, 0..22)];
    c.conn.qp_mut().post_send(&[SendWr::send_sg(&pieces).unwrap().wr_id(1)]).unwrap();
    assert_eq!((g0.outstanding(), g1.outstanding()), (1, 1), "one hold per work request naming the region");
    for (mr, what) in [(&mut g0, "first/third send piece"), (&mut g1, "second send piece")] {
        assert!(mr.as_slice().is_ok(), "{what}: a send's source may be read");
        assert!(mr.read_at(0, &mut [0u8; 4]).is_ok(), "{what}: read_at");
        assert!(matches!(mr.as_mut_slice(), Err(Error::InFlight { .. })), "{what}: but not written");
        assert!(matches!(mr.write_at(0, b"x"), Err(Error::InFlight { .. })), "{what}: write_at");
    }
    // A receive of 3 pieces: 3 regions, the second and third chunks of one registration.
    let mut a = MemoryRegion::new(&s.pd, 64, lw).unwrap();
    let mut bc = MemoryRegion::new(&s.pd, 128, lw).unwrap().split(64).unwrap();
    let mut cc = bc.pop().unwrap();
    let mut b = bc.pop().unwrap();
    let pieces = [(&a, 0..64), (&b, 0..64), (&cc, 0..64)];
    s.conn.qp_mut().post_recv(&[RecvWr::sg(&pieces).unwrap().wr_id(2)]).unwrap();
    out_of_reach(&mut a, "first receive piece");
    out_of_reach(&mut b, "second receive piece");
    out_of_reach(&mut cc, "third receive piece");
    // A READ scattered into 3 pieces, one region named twice.
    let mut x = MemoryRegion::new(&c.pd, 128, lw).unwrap();
    let mut y = MemoryRegion::new(&c.pd, 64, lw).unwrap();
    let remote = s.mrs[0].remote();
    s.mrs[0].as_mut_slice().unwrap()[..160].copy_from_slice(&common::pattern(160, 7));
    let pieces = [(&x, 0..32), (&y, 0..64), (&x, 64..128)];
    c.conn.qp_mut().post_send(&[SendWr::read_sg(&pieces, &remote, 0).unwrap().wr_id(3)]).unwrap();
    assert_eq!((x.outstanding(), y.outstanding()), (1, 1));
    out_of_reach(&mut x, "first and third READ piece");
    out_of_reach(&mut y, "second READ piece");
    // Reaped: everything is reachable again, with the right bytes.
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    assert_eq!(wc.byte_len(), 160);
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap().byte_len(), 150);
    assert_eq!(a.as_slice().unwrap(), &[1; 64]);
    assert_eq!(b.as_slice().unwrap(), &[2; 64]);
    assert_eq!(&cc.as_slice().unwrap()[..22], &[1; 22]);
    let want = common::pattern(160, 7);
    assert_eq!(&x.as_slice().unwrap()[..32], &want[..32]);
    assert_eq!(y.as_slice().unwrap(), &want[32..96]);
    assert_eq!(&x.as_slice().unwrap()[64..], &want[96..]);
    for mr in [&mut g0, &mut g1, &mut a, &mut b, &mut cc, &mut x, &mut y] {
        assert_eq!(mr.outstanding(), 0);
        assert!(mr.as_mut_slice().is_ok());
    }
    drop((g0, g1, a, b, cc, x, y, bc, c, s));
    t.finish();
}

/// Scatter/gather: dropping the handles of every piece of an outstanding receive and READ
/// keeps the memory registered (the kernel still lists it) and usable by the device (the work
/// completes successfully, which it could not on a deregistered region) until the completions
/// are reaped; then it goes.
#[test]
fn dropped_pieces_stay_registered_until_their_completion() {
    let t = DeviceTest::start();
    let cspec = PairSpec { init: QpInit::new().max_send_sge(3), ..PairSpec::default() };
    let sspec = PairSpec {
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        init: QpInit::new().max_recv_sge(3),
        ..PairSpec::default()
    };
    let (mut c, mut s) = pair(t.addr, cspec, sspec);
    let before = common::mr_count();
    let lw = AccessFlags::LOCAL_WRITE;
    let recv: Vec<MemoryRegion> = (0..3).map(|_| MemoryRegion::new(&s.pd, 64, lw).unwrap()).collect();
    let pieces = [(&recv[0], 0..64), (&recv[1], 0..64), (&recv[2], 0..64)];
    s.conn.qp_mut().post_recv(&[RecvWr::sg(&pieces).unwrap().wr_id(1)]).unwrap();
    let read: Vec<MemoryRegion> = (0..3).map(|_| MemoryRegion::new(&c.pd, 64, lw).unwrap()).collect();
    let pieces = [(&read[0], 0..64), (&read[1], 0..64), (&read[2], 0..64)];
    let remote = s.mrs[0].remote();
    c.conn.qp_mut().post_send(&[SendWr::read_sg(&pieces, &remote, 0).unwrap().wr_id(2)]).unwrap();
    drop((recv, read));
    if let Some(n) = before {
        assert_eq!(common::mr_count(), Some(n + 6), "the dropped regions must stay registered");
    }
    c.mrs[0].as_mut_slice().unwrap()[..192].copy_from_slice(&common::pattern(192, 3));
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..192).wr_id(3)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).expect("the device wrote every dropped piece");
    assert_eq!(wc.byte_len(), 192);
    let wc = c.conn.qp_mut().wait_for(WorkQueue::Send, 2, T).expect("the READ landed in the dropped pieces");
    assert_eq!(wc.byte_len(), 192);
    if let Some(n) = before {
        assert_eq!(common::mr_count(), Some(n), "reaping released (and deregistered) all six");
    }
    drop((c, s));
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

type PostSend = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_send_wr, *mut *mut ffi::ibv_send_wr) -> i32;
type PostRecv = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32;
type PostSrqRecv = unsafe extern "C" fn(*mut ffi::ibv_srq, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32;
static REAL_POST_SEND: std::sync::OnceLock<PostSend> = std::sync::OnceLock::new();
static REAL_POST_RECV: std::sync::OnceLock<PostRecv> = std::sync::OnceLock::new();
static REAL_POST_SRQ_RECV: std::sync::OnceLock<PostSrqRecv> = std::sync::OnceLock::new();
/// How many work requests of a list the stand-in providers below take before refusing one.
static TAKE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Stands in for a provider that takes the first `TAKE` work requests of `wr` (posting them
/// through `real`) and refuses the next with ENOMEM, naming it in `bad` as verbs do.
///
/// # Safety
/// `wr` is a well-formed list with more than `TAKE` entries; `real` is the provider's post.
unsafe fn take_some<Q, W>(
    q: *mut Q,
    wr: *mut W,
    bad: *mut *mut W,
    next: impl Fn(*mut W) -> *mut *mut W,
    real: unsafe extern "C" fn(*mut Q, *mut W, *mut *mut W) -> i32,
) -> i32 {
    let take = TAKE.load(std::sync::atomic::Ordering::SeqCst);
    let (mut last, mut refused) = (std::ptr::null_mut::<W>(), wr);
    for _ in 0..take {
        last = refused;
        // SAFETY: the list has more than `take` entries (the caller's promise).
        refused = unsafe { *next(refused) };
    }
    if !last.is_null() {
        // SAFETY: cut the list after the last one taken, post that much, and mend it again: the
        // crate's list, valid for the call.
        unsafe {
            *next(last) = std::ptr::null_mut();
            let ret = real(q, wr, bad);
            *next(last) = refused;
            if ret != 0 {
                return ret;
            }
        }
    }
    // SAFETY: `bad` is the caller's out-pointer.
    unsafe { *bad = refused };
    libc::ENOMEM
}

unsafe extern "C" fn partial_post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    // SAFETY: forwarded from the crate's post (see take_some); the entries' `next` fields are
    // valid to read and write.
    unsafe { take_some(qp, wr, bad, |w| &raw mut (*w).next, *REAL_POST_SEND.get().expect("set before the swap")) }
}

unsafe extern "C" fn partial_post_recv(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
) -> i32 {
    // SAFETY: as in partial_post_send.
    unsafe { take_some(qp, wr, bad, |w| &raw mut (*w).next, *REAL_POST_RECV.get().expect("set before the swap")) }
}

unsafe extern "C" fn partial_post_srq_recv(
    srq: *mut ffi::ibv_srq,
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
) -> i32 {
    // SAFETY: as in partial_post_send.
    unsafe { take_some(srq, wr, bad, |w| &raw mut (*w).next, *REAL_POST_SRQ_RECV.get().expect("set before the swap")) }
}

/// Scatter/gather: a refused post releases every piece of the refused work requests, and only
/// those: refused by the crate (one work request of a batch names more pieces than the queue
/// takes: nothing is posted), or by the provider part-way through a batch (sends, receives and
/// SRQ receives, the provider stood in for by wrapping its post entry). A region named both by a
/// taken and a refused work request keeps exactly the taken one's hold.
#[test]
fn a_refused_post_releases_the_pieces_of_the_refused_work_requests_only() {
    use rdma_cm::SharedReceiveQueue;
    use std::sync::atomic::Ordering::SeqCst;
    let t = DeviceTest::start();
    let spec =
        PairSpec { mr_sizes: vec![64; 6], init: QpInit::new().max_send_sge(3).max_recv_sge(3), ..PairSpec::default() };
    // The server has one receive (on its region 0) posted before connecting.
    let (mut c, mut s) = pair(t.addr, spec.clone(), PairSpec { pre_recv: vec![(100, 64)], ..spec });
    let holds = |m: &[MemoryRegion]| m.iter().map(|m| m.outstanding()).collect::<Vec<_>>();
    // Refused by the crate: one work request of the batch is too long for a queue of 3.
    let m = &c.mrs;
    let (p0, p1) = ([(&m[0], 0..8), (&m[1], 0..8)], [(&m[2], 0..8), (&m[3], 0..8), (&m[4], 0..8), (&m[5], 0..8)]);
    let r = c.conn.qp_mut().post_send(&[SendWr::send_sg(&p0).unwrap(), SendWr::send_sg(&p1).unwrap()]);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert_eq!(holds(&c.mrs), [0; 6], "nothing posted, nothing held");
    assert_eq!(c.conn.qp().outstanding_sends(), 0);
    // Refused by the provider: it takes the first of three sends and refuses the second.
    let qp = c.conn.qp().as_raw();
    let m = &c.mrs;
    let p0 = [(&m[0], 0..8), (&m[1], 0..8)];
    let p1 = [(&m[2], 0..8), (&m[3], 0..8), (&m[4], 0..8)];
    let p2 = [(&m[5], 0..8), (&m[1], 8..16)];
    let wrs = [
        SendWr::send_sg(&p0).unwrap().wr_id(1),
        SendWr::send_sg(&p1).unwrap().wr_id(2),
        SendWr::send_sg(&p2).unwrap().wr_id(3),
    ];
    TAKE.store(1, SeqCst);
    // SAFETY: the QP and its context are alive; the context's ops table is the provider's,
    // swapped for this one call and restored; nothing else posts on this context meanwhile
    // (device tests run one at a time, and this one posts from this thread only).
    let r = unsafe {
        let ops = &mut (*(*qp).context).ops;
        let real = ops.post_send.expect("the provider's post_send");
        let _ = REAL_POST_SEND.set(real);
        ops.post_send = Some(partial_post_send);
        let r = c.conn.qp_mut().post_send(&wrs);
        ops.post_send = Some(real);
        r
    };
    assert!(matches!(&r, Err(Error::Call { op: "ibv_post_send", .. })), "{r:?}");
    assert_eq!(holds(&c.mrs), [1, 1, 0, 0, 0, 0], "the taken send's pieces only (m1 is in a refused one too)");
    assert!(matches!(c.mrs[0].as_mut_slice(), Err(Error::InFlight { .. })));
    assert!(matches!(c.mrs[1].as_mut_slice(), Err(Error::InFlight { .. })));
    for k in 2..6 {
        assert!(c.mrs[k].as_mut_slice().is_ok(), "piece region {k} of a refused send is released at once");
    }
    // The taken one completes into the receive posted before connecting.
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 100, T).unwrap().byte_len(), 16);
    assert_eq!(holds(&c.mrs), [0; 6]);
    // Receives: the provider takes the first of two and refuses the second.
    let qp = s.conn.qp().as_raw();
    let m = &s.mrs;
    let p0 = [(&m[0], 0..64), (&m[1], 0..64), (&m[2], 0..64)];
    let p1 = [(&m[3], 0..64), (&m[0], 0..64)];
    let wrs = [RecvWr::sg(&p0).unwrap().wr_id(1), RecvWr::sg(&p1).unwrap().wr_id(2)];
    // SAFETY: as above, for the provider's post_recv.
    let r = unsafe {
        let ops = &mut (*(*qp).context).ops;
        let real = ops.post_recv.expect("the provider's post_recv");
        let _ = REAL_POST_RECV.set(real);
        ops.post_recv = Some(partial_post_recv);
        let r = s.conn.qp_mut().post_recv(&wrs);
        ops.post_recv = Some(real);
        r
    };
    assert!(matches!(&r, Err(Error::Call { op: "ibv_post_recv", .. })), "{r:?}");
    assert_eq!(holds(&s.mrs), [1, 1, 1, 0, 0, 0]);
    for k in 0..3 {
        assert!(matches!(s.mrs[k].as_slice(), Err(Error::InFlight { .. })), "the taken receive's piece {k}");
    }
    assert!(s.mrs[3].as_mut_slice().is_ok(), "the refused receive's own region is released");
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(4)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 4, T).unwrap();
    s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    assert_eq!(holds(&s.mrs), [0; 6]);
    // An SRQ (not attached: the device never consumes its receives): the same, on its slots.
    let srq = SharedReceiveQueue::with_sge(&s.pd, 4, 3).unwrap();
    let m = &s.mrs;
    let p0 = [(&m[0], 0..8), (&m[1], 0..8)];
    let p1 = [(&m[2], 0..8), (&m[0], 8..16), (&m[3], 0..8)];
    let p2 = [(&m[4], 0..8)];
    let wrs = [RecvWr::sg(&p0).unwrap(), RecvWr::sg(&p1).unwrap(), RecvWr::sg(&p2).unwrap()];
    // SAFETY: as above, for the provider's post_srq_recv.
    let r = unsafe {
        let ops = &mut (*(*srq.as_raw()).context).ops;
        let real = ops.post_srq_recv.expect("the provider's post_srq_recv");
        let _ = REAL_POST_SRQ_RECV.set(real);
        ops.post_srq_recv = Some(partial_post_srq_recv);
        let r = srq.post_recv(&wrs);
        ops.post_srq_recv = Some(real);
        r
    };
    assert!(matches!(&r, Err(Error::Call { op: "ibv_post_srq_recv", .. })), "{r:?}");
    assert_eq!(srq.outstanding(), 1);
    assert_eq!(holds(&s.mrs), [1, 1, 0, 0, 0, 0]);
    // The freed slots take new receives (their side-table entries were cleared).
    let p3 = [(&m[5], 0..8), (&m[5], 8..16), (&m[5], 16..24)];
    srq.post_recv(&vec![RecvWr::sg(&p3).unwrap(); 3]).unwrap();
    assert_eq!((srq.outstanding(), s.mrs[5].outstanding()), (4, 3), "one hold per receive, not per piece");
    // The SRQ goes, and every piece with it.
    drop(srq);
    assert_eq!(holds(&s.mrs), [0; 6]);
    assert!(s.mrs.iter_mut().all(|m| m.as_mut_slice().is_ok()));
    drop((c, s));
    t.finish();
}

/// Outside review (SRQ routing): an SRQ's completions are routed by its 16-bit id and the slot's
/// 13-bit generation only; nothing ties them to a QP that is still attached. A completion of a
/// receive of SRQ A, left in a shared CQ when A's last QP on that CQ is dropped, stays in the
/// CQ; once 65536 SRQs later another SRQ B gets A's id and is attached to the same CQ, that stale
/// completion names B's slot 0 under the same generation (1: the first post of each), and
/// polling the CQ retires B's receive while it is still posted. Its region then hands out a
/// `&mut [u8]` that the device writes when a message arrives for B's QP.
#[test]
fn a_stale_srq_completion_does_not_retire_a_later_srqs_receive() {
    use rdma_cm::{Connection, SharedReceiveQueue};
    use std::sync::mpsc;
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let (up_tx, up) = mpsc::channel::<()>();
    let (down, down_rx) = mpsc::channel::<()>();
    let client = thread::spawn(move || {
        let connect = || {
            let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let pd = route.alloc_pd().unwrap();
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            let conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
            (conn, mr, pd)
        };
        let send = |conn: &mut Connection, mr: &mut MemoryRegion, msg: &[u8]| {
            mr.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(msg);
            conn.qp_mut().post_send(&[SendWr::send(mr, 0..msg.len()).wr_id(1)]).unwrap();
            conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
        };
        let (mut c1, mut m1, p1) = connect();
        send(&mut c1, &mut m1, b"stale");
        up_tx.send(()).unwrap();
        if down_rx.recv().is_err() {
            return;
        }
        let (mut c2, mut m2, p2) = connect();
        if down_rx.recv().is_err() {
            return;
        }
        send(&mut c2, &mut m2, b"OVERWRITTEN");
        up_tx.send(()).unwrap();
        let _ = down_rx.recv();
        drop((c1, m1, p1, c2, m2, p2));
    });
    let lw = AccessFlags::LOCAL_WRITE;
    // SRQ A, its receives completing on `cq`, which outlives A's QP.
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    // Armed, so its descriptor says when a completion is in it, without polling it out.
    cq.req_notify(false).unwrap();
    let srq_a = SharedReceiveQueue::new(&pd, 4).unwrap();
    let mr_a = MemoryRegion::new(&pd, 64, lw).unwrap();
    srq_a.post_recv(&[RecvWr::new(&mr_a, 0..64).wr_id(100)]).unwrap();
    let init = QpInit::new().srq(&srq_a).recv_cq(Arc::clone(&cq));
    let conn1 = req.create_qp(&pd, init).unwrap().accept(&ConnParam::new(), T).unwrap();
    // The client's send completed: A's receive (slot 0, generation 1) completed into `cq`.
    up.recv_timeout(T).unwrap();
    let mut pfd = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&*cq), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the call.
    let ready = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(ready, 1, "A's receive completion should be in the CQ (its channel fired)");
    // A's QP goes (nothing of its own outstanding, so its drop polls nothing), then A: the
    // completion stays in `cq`, unpolled.
    drop(conn1);
    drop(srq_a);
    // 65535 more SRQs: the next one gets A's 16-bit id again.
    let t0 = Instant::now();
    for _ in 0..u16::MAX {
        drop(SharedReceiveQueue::new(&pd, 1).unwrap());
    }
    eprintln!("65535 SRQs created and destroyed in {:?}", t0.elapsed());
    down.send(()).unwrap();
    let req2 = listener.get_request(T).unwrap();
    let srq_b = SharedReceiveQueue::new(&pd, 4).unwrap();
    let mut mr_b = MemoryRegion::new(&pd, 64, lw).unwrap();
    srq_b.post_recv(&[RecvWr::new(&mr_b, 0..64).wr_id(200)]).unwrap();
    let init = QpInit::new().srq(&srq_b).recv_cq(Arc::clone(&cq));
    let conn2 = req2.create_qp(&pd, init).unwrap().accept(&ConnParam::new(), T).unwrap();
    let qp2 = conn2.qp().qp_num();
    // Nothing was sent to B's QP yet: polling must retire nothing of B.
    let mut wcs = [WorkCompletion::default(); 4];
    let stolen = cq.poll(&mut wcs).unwrap();
    let held = mr_b.outstanding();
    match mr_b.as_mut_slice() {
        Ok(buf) => {
            buf.fill(0);
            // The receive is still posted on B: a message for B's QP lands in `buf`.
            down.send(()).unwrap();
            up.recv_timeout(T).unwrap();
            thread::sleep(Duration::from_millis(200));
            // SAFETY (of the demonstration): reads through the live slice the crate handed out.
            let seen: Vec<u8> = (0..11).map(|i| unsafe { std::ptr::read_volatile(buf.as_ptr().add(i)) }).collect();
            let w = &wcs[..stolen];
            panic!(
                "HOLE: cq.poll() returned {stolen} completion(s) {:?} (qp_num {:?}; B's QP is {qp2}) although nothing \
                 reached B's QP; the region of B's still-posted receive then had {held} hold(s), as_mut_slice handed \
                 out a &mut [u8], and the device wrote {:?} into it while it was borrowed",
                w.iter().map(|c| c.wr_id()).collect::<Vec<_>>(),
                w.iter().map(|c| c.qp_num()).collect::<Vec<_>>(),
                String::from_utf8_lossy(&seen),
            );
        }
        Err(Error::InFlight { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    assert_eq!(stolen, 0, "a stale completion of a destroyed SRQ retired something");
    assert_eq!(held, 1);
    down.send(()).unwrap();
    up.recv_timeout(T).unwrap();
    let wc = loop {
        let n = cq.wait(&mut wcs, T).unwrap();
        assert!(n > 0, "B's receive never completed");
        if let Some(wc) = wcs[..n].iter().find(|w| w.wr_id() == 200) {
            break *wc;
        }
    };
    assert_eq!(wc.qp_num(), qp2);
    assert_eq!(&mr_b.as_slice().unwrap()[..11], b"OVERWRITTEN");
    down.send(()).unwrap();
    client.join().unwrap();
    drop((conn2, srq_b, mr_a, mr_b, cq, pd, ctx, listener));
    t.finish();
}
