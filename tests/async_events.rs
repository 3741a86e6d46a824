//! Asynchronous device events on the device: each one provoked for real, seen by a source, and
//! delivered to the object it names. Every wait is bounded.

mod common;

use std::io::Read;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::lane::reap;
use common::{DeviceTest, T};
use rdma_cm::verbs::async_event::{AsyncElement, AsyncEvent, AsyncEventKind, AsyncEvents};
use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
use rdma_cm::verbs::qp::UnconnectedQp;
use rdma_cm::{
    ffi, AccessFlags, Client, CompletionQueue, ConnParam, Error, MemoryRegion, ProtectionDomain, QpInit, Server,
    VerbsContext, WcStatus,
};

/// Reads `events` (bounded by `within`) until one satisfies `want`; returns it and the others.
fn wait_event(
    events: &mut AsyncEvents,
    within: Duration,
    want: impl Fn(&AsyncEvent) -> bool,
) -> (AsyncEvent, Vec<AsyncEvent>) {
    let deadline = Instant::now() + within;
    let mut others = vec![];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.next(left) {
            Ok(ev) if want(&ev) => return (ev, others),
            Ok(ev) => others.push(ev),
            Err(e) => panic!("the expected event did not come within {within:?} ({e}); others seen: {others:?}"),
        }
    }
}

/// The device of the test address, opened directly.
fn open_device() -> VerbsContext {
    let devs = rdma_cm::devices().unwrap();
    let name = std::env::var("RDMA_VM_DEVICE").unwrap_or_else(|_| devs.first().expect("an RDMA device").name.clone());
    VerbsContext::open(&name).unwrap()
}

/// An RC QP made through the raw bindings on `cq` and connected to itself (loopback), for
/// provoking what the crate's own QPs never do (overrunning their CQ).
struct RawLoopQp(*mut ffi::ibv_qp);

// SAFETY: verbs on a QP may be called from any thread (libibverbs locks what it shares).
unsafe impl Sync for RawLoopQp {}

impl RawLoopQp {
    fn new(ctx: &VerbsContext, pd: &ProtectionDomain, cq: &CompletionQueue, addr: std::net::IpAddr) -> RawLoopQp {
        Self::on_raw_cq(ctx, pd, cq.as_raw(), addr)
    }

    /// The same on a CQ given by its raw handle (which must outlive the QP).
    fn on_raw_cq(ctx: &VerbsContext, pd: &ProtectionDomain, cq: *mut ffi::ibv_cq, addr: std::net::IpAddr) -> RawLoopQp {
        let std::net::IpAddr::V4(v4) = addr else { panic!("this test needs an IPv4 device address") };
        let gid = ctx
            .gid_table(1)
            .unwrap()
            .into_iter()
            .find(|g| g.gid.ipv4() == Some(v4) && g.gid_type == rdma_cm::verbs::port::GidType::RoceV2)
            .expect("a RoCE v2 GID for the device address");
        // SAFETY: plain old data, zero is valid; the CQ and PD outlive the QP (it is destroyed
        // in Drop, before them: the test drops it first).
        let qp = unsafe {
            let mut a: ffi::ibv_qp_init_attr = std::mem::zeroed();
            a.send_cq = cq;
            a.recv_cq = cq;
            a.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            a.cap.max_send_wr = 64;
            a.cap.max_recv_wr = 1;
            a.cap.max_send_sge = 1;
            a.cap.max_recv_sge = 1;
            ffi::ibv_create_qp(pd.as_raw(), &mut a)
        };
        assert!(!qp.is_null(), "ibv_create_qp: {}", std::io::Error::last_os_error());
        let qp = RawLoopQp(qp);
        // SAFETY: the QP is valid; each attribute set is plain data with the mask naming it.
        unsafe {
            use ffi::ibv_qp_attr_mask as m;
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
            a.port_num = 1;
            a.qp_access_flags =
                (ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE | ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE).0;
            let mask = m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS;
            assert_eq!(ffi::ibv_modify_qp(qp.0, &mut a, mask.0 as i32), 0, "INIT");
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = ffi::ibv_mtu::IBV_MTU_1024;
            a.dest_qp_num = (*qp.0).qp_num;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = 12;
            a.ah_attr.is_global = 1;
            a.ah_attr.port_num = 1;
            a.ah_attr.grh.dgid.raw = gid.gid.0;
            a.ah_attr.grh.sgid_index = gid.index as u8;
            a.ah_attr.grh.hop_limit = 64;
            let mask = m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER;
            assert_eq!(ffi::ibv_modify_qp(qp.0, &mut a, mask.0 as i32), 0, "RTR");
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.max_rd_atomic = 1;
            let mask = m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC;
            assert_eq!(ffi::ibv_modify_qp(qp.0, &mut a, mask.0 as i32), 0, "RTS");
        }
        qp
    }

    /// How many completions `cq` really holds (the provider may round the depth up).
    fn capacity(cq: &CompletionQueue) -> u64 {
        // SAFETY: the CQ is valid; `cqe` is plain data set at creation.
        unsafe { (*cq.as_raw()).cqe as u64 }
    }

    /// Posts `n` (at most 64) signaled 8-byte RDMA WRITEs from `mr` into itself (wr_ids with bit 62 clear:
    /// foreign to the crate's CQ, which retires nothing for them).
    fn write_self(&self, mr: &MemoryRegion, n: u64) {
        for i in 0..n {
            let mut sge = ffi::ibv_sge { addr: mr.addr(), length: 8, lkey: mr.lkey() };
            // SAFETY: plain old data; the sge and region outlive the post (the region outlives
            // the QP, and the test waits for the writes' effect before dropping anything).
            unsafe {
                let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
                wr.wr_id = i;
                wr.sg_list = &mut sge;
                wr.num_sge = 1;
                wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                wr.wr.rdma.remote_addr = mr.addr() + 32;
                wr.wr.rdma.rkey = mr.rkey();
                let mut bad = std::ptr::null_mut();
                assert_eq!(ffi::ibv_post_send(self.0, &mut wr, &mut bad), 0, "post {i}");
            }
        }
    }
}

/// The CQ of `lane`, reached through a QP made with the lane's capabilities (and never
/// attached), for what the lane does not offer: its raw handle, and the marks the device's
/// events leave on it.
fn lane_cq(lane: &Lane, pd: &Arc<ProtectionDomain>) -> Arc<CompletionQueue> {
    let qp = UnconnectedQp::new_reset(pd, lane.qp_init().max_send_wr(1).max_recv_wr(1)).unwrap();
    Arc::clone(qp.qp().send_cq())
}

impl Drop for RawLoopQp {
    fn drop(&mut self) {
        // SAFETY: created above, destroyed once.
        assert_eq!(unsafe { ffi::ibv_destroy_qp(self.0) }, 0);
    }
}

/// A lane's CQ of one entry overrun by a raw QP: the device reports IBV_EVENT_CQ_ERR naming
/// it, the CQ learns of it (and the lane's wait fails at once instead of sleeping), another CQ
/// does not, and a source whose descriptor safe code tampered with (reading it, clearing
/// O_NONBLOCK) still works without blocking.
#[test]
fn cq_overrun_is_delivered_to_the_cq_and_ends_the_lanes_wait() {
    let t = DeviceTest::start();
    let ctx = open_device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let mut lane = Lane::new(&ctx, 1).unwrap();
    let cq = lane_cq(&lane, &pd);
    let other = CompletionQueue::new(&ctx, 4).unwrap();
    let mut events = ctx.async_events().unwrap();
    let mut early = ctx.async_events().unwrap();

    // Safe code with the source's descriptor can neither read events from it nor make the
    // source block.
    let mut f = std::fs::File::from(events.as_fd().try_clone_to_owned().unwrap());
    let read = f.read(&mut [0u8; 64]);
    assert!(read.is_err(), "reading the source's descriptor must fail, got {read:?}");
    // SAFETY: fcntl on a descriptor this test owns (a duplicate of the source's).
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, 0) };
    let start = Instant::now();
    assert!(events.try_next().unwrap().is_none());
    assert!(matches!(events.next(Duration::from_millis(200)), Err(Error::Timeout { .. })));
    assert!(start.elapsed() < Duration::from_secs(2), "an empty source blocked for {:?}", start.elapsed());
    drop(f);
    // The overrun comes from a raw RC QP connected to itself by hand (RawLoopQp); the part
    // above (the descriptor) ran on every device.
    if !common::require(common::Cap::ConnectWithoutCm) {
        drop((events, early, lane, cq, other, pd, ctx));
        return t.finish();
    }

    assert!(!cq.has_error().unwrap());
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let qp = RawLoopQp::new(&ctx, &pd, &cq, t.addr);
    qp.write_self(&mr, 4);
    let (ev, others) = wait_event(&mut events, T, |e| e.kind == AsyncEventKind::CqError);
    eprintln!("measured: events besides the CQ error: {others:?}");
    assert_eq!(ev.element, AsyncElement::Cq(cq.as_raw() as usize), "{ev}");
    assert!(ev.to_string().contains("overran"), "{ev}");
    // Delivered to the CQ, not to the other one; the second source saw it too.
    assert!(cq.has_error().unwrap());
    assert_eq!(cq.last_async_event().unwrap(), Some(AsyncEventKind::CqError));
    assert!(!other.has_error().unwrap());
    assert_eq!(other.last_async_event().unwrap(), None);
    let (ev2, _) = wait_event(&mut early, T, |e| e.kind == AsyncEventKind::CqError);
    assert_eq!(ev2, ev);
    // The lane's wait fails at once, naming the event, instead of sleeping to its timeout.
    // The one completion that fit (a foreign one) retires nothing and is not handed out.
    let start = Instant::now();
    let e = lane.wait(T).expect_err("the wait of a lane whose CQ overran");
    assert!(start.elapsed() < Duration::from_secs(2), "the wait took {:?}", start.elapsed());
    assert!(matches!(e, Error::AsyncEvent { event: AsyncEventKind::CqError, object: "CQ", .. }), "{e:?}");
    eprintln!("error: {e}");
    drop(qp);
    drop((events, early, mr, lane, cq, other, pd, ctx));
    t.finish();
}

/// An event about a CQ the crate does not own (made through ffi) is returned with its handle,
/// marks none of the crate's objects, and is acknowledged: the raw CQ's destroy, which waits
/// for the acknowledgement of every event read about it, returns.
#[test]
fn events_about_foreign_objects_are_returned_acked_and_mark_nothing() {
    let t = DeviceTest::start();
    // The overrun comes from a raw RC QP connected to itself by hand (RawLoopQp).
    if !common::require(common::Cap::ConnectWithoutCm) {
        return t.finish();
    }
    let ctx = open_device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let ours = CompletionQueue::new(&ctx, 4).unwrap();
    let mut events = ctx.async_events().unwrap();
    // SAFETY: the context is open; a CQ of one entry without a channel; destroyed below.
    let raw_cq = unsafe { ffi::ibv_create_cq(ctx.as_raw(), 1, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
    assert!(!raw_cq.is_null());
    let target = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let qp = RawLoopQp::on_raw_cq(&ctx, &pd, raw_cq, t.addr);
    qp.write_self(&target, 4);
    let (ev, _) = wait_event(&mut events, T, |e| e.kind == AsyncEventKind::CqError);
    assert_eq!(ev.element, AsyncElement::Cq(raw_cq as usize));
    assert!(!ours.has_error().unwrap());
    assert_eq!(ours.last_async_event().unwrap(), None);
    drop(qp);
    // More CQ_ERR events may have been read meanwhile; all were acknowledged, or this hangs.
    while events.try_next().unwrap().is_some() {}
    let start = Instant::now();
    // SAFETY: its only QP is destroyed; destroyed once.
    assert_eq!(unsafe { ffi::ibv_destroy_cq(raw_cq) }, 0);
    assert!(start.elapsed() < Duration::from_secs(2), "ibv_destroy_cq took {:?}", start.elapsed());
    drop((events, target, ours, pd, ctx));
    t.finish();
}

/// The SRQ limit event, delivered to a lane's SRQ (and seen by a source made before it, and by
/// one made after a wait had read it already).
#[test]
fn srq_limit_event_is_delivered_to_the_srq() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = Lane::new(&route.context().unwrap(), 32).unwrap();
        let c = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        let qp = c.qp();
        c.connect(&mut lane, &ConnParam::new(), T).unwrap();
        for i in 0..3 {
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            lane.post_send(qp, SendWr::send(mr, 0..8).wr_id(i)).unwrap();
        }
        for c in reap(&mut lane, 3) {
            assert!(c.is_ok(), "{c:?}");
        }
        assert!(lane.wait_peer_left(qp, T).unwrap(), "the server's disconnect");
        drop((lane, pd));
    });
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let mut before = ctx.async_events().unwrap();
    let pd = req.alloc_pd().unwrap();
    let mut lane = Lane::new(&ctx, 32).unwrap();
    let srq = lane.create_srq(&pd, 4).unwrap();
    for i in 0..4 {
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        lane.post_srq_recv(srq, RecvWr::new(mr).wr_id(i)).unwrap();
    }
    lane.srq_arm_limit(srq, 2).unwrap();
    assert!(!lane.srq_limit_reached(srq).unwrap());
    let init = lane.srq_qp_init(srq, QpInit::new().max_send_wr(4)).unwrap();
    let s = req.lane_qp(&mut lane, &pd, init).unwrap();
    let qp = s.qp();
    s.accept(&mut lane, &ConnParam::new(), T).unwrap();
    for c in reap(&mut lane, 3) {
        assert!(c.is_ok() && c.is_srq(), "{c:?}");
    }
    // One receive left, below the limit of 2: the device says so.
    let srq_raw = lane.srq_as_raw(srq).unwrap() as usize;
    let (ev, others) = wait_event(&mut before, T, |e| e.is_srq_limit());
    assert_eq!((ev.kind, ev.element), (AsyncEventKind::SrqLimitReached, AsyncElement::Srq(srq_raw)), "{ev}");
    assert!(lane.srq_limit_reached(srq).unwrap());
    // A source made now still finds it in the context's log.
    let (late, _) = wait_event(&mut ctx.async_events().unwrap(), T, |e| e.is_srq_limit());
    assert_eq!(late, ev);
    // Re-arming clears the flag; the QP saw nothing (no event named it).
    lane.srq_arm_limit(srq, 1).unwrap();
    assert!(!lane.srq_limit_reached(srq).unwrap());
    let ours = lane.qp_as_raw(qp).unwrap() as usize;
    assert!(others.iter().all(|e| e.element != AsyncElement::Qp(ours)), "{others:?}");
    // A QP of an SRQ moved to the error state: what the provider says (kernels from 6.10 on
    // raise IBV_EVENT_QP_LAST_WQE_REACHED on rxe).
    lane.set_error(qp).unwrap();
    let after: Vec<_> = std::iter::from_fn(|| before.next(Duration::from_millis(300)).ok()).collect();
    eprintln!("measured: after set_error on an SRQ's QP: {after:?}");
    assert!(after.iter().all(|e| matches!(e.element, AsyncElement::Qp(p) if p == ours)), "{after:?}");
    let _ = lane.disconnect(qp, T);
    client.join().unwrap();
    drop((lane, pd, before, ctx, listener));
    t.finish();
}

/// Downs the guest's RDMA netdev, and brings it back up even on panic.
struct LinkDown(String);

impl LinkDown {
    fn new() -> LinkDown {
        let netdev = std::env::var("RDMA_VM_NETDEV").or_else(|_| std::env::var("RDMA_CM_TEST_NETDEV")).expect(
            "this test takes the RDMA netdev down: it runs in the harness guest (RDMA_VM_NETDEV), or on a host that \
             opts in with RDMA_CM_TEST_NETDEV=<netdev>; elsewhere skip it with `cargo test -- --skip guest_only`",
        );
        let l = LinkDown(netdev);
        l.set("down");
        l
    }
    fn set(&self, state: &str) {
        let st = Command::new("ip").args(["link", "set", &self.0, state]).status().unwrap();
        assert!(st.success(), "ip link set {} {state}", self.0);
    }
}

impl Drop for LinkDown {
    fn drop(&mut self) {
        self.set("up");
    }
}

/// `ip link set down/up` under the device: PORT_ERR then PORT_ACTIVE, naming port 1.
#[test]
fn guest_only_link_flap_reports_port_error_then_active() {
    let t = DeviceTest::start();
    let ctx = open_device();
    let mut events = ctx.async_events().unwrap();
    // Nothing is pending before the flap (a leftover would make this test vacuous).
    while let Some(ev) = events.try_next().unwrap() {
        eprintln!("before the flap: {ev}");
    }
    // The guest's kernel reports port changes from a work queue: on a loaded host, seconds.
    const PORT_BOUND: Duration = Duration::from_secs(30);
    let start = Instant::now();
    let down = LinkDown::new();
    let (ev, _) = wait_event(&mut events, PORT_BOUND, |e| e.kind == AsyncEventKind::PortError);
    let took_down = start.elapsed();
    assert_eq!(ev.element, AsyncElement::Port(1), "{ev}");
    assert!(ev.to_string().contains("ip link"), "{ev}");
    let start = Instant::now();
    drop(down);
    let (ev, others) = wait_event(&mut events, PORT_BOUND, |e| e.kind == AsyncEventKind::PortActive);
    let took_up = start.elapsed();
    assert_eq!(ev.element, AsyncElement::Port(1), "{ev}");
    eprintln!(
        "measured: PORT_ERR {took_down:?} after `ip link set down`, PORT_ACTIVE {took_up:?} after up; also {others:?}"
    );
    // The port is back for the next test.
    let deadline = Instant::now() + T;
    while ctx.port(1).unwrap().state != rdma_cm::verbs::port::PortState::Active {
        assert!(Instant::now() < deadline, "port 1 did not come back");
        thread::sleep(Duration::from_millis(50));
    }
    drop((events, ctx));
    t.finish();
}

/// `doctor --watch` prints the port's events while the link flaps (as `ibv_asyncwatch` does).
#[test]
fn guest_only_doctor_watch_prints_port_events() {
    let t = DeviceTest::start();
    let doctor = common::example("doctor");
    let mut child = Command::new(doctor)
        .args(["--watch", "60"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = common::lines_of(&mut child);
    common::wait_for_line(&lines, "watching", Duration::from_secs(60));
    // The doctor watches every device and prefixes each event with its device's name: the lines
    // awaited are those of the device under test's port 1 (another device's, e.g. an rxe beside
    // the siw under test on the same netdev, would make this pass without it).
    let dev = common::caps::device_under_test();
    let down = LinkDown::new();
    common::wait_for_line(&lines, &format!("{dev}: port 1: IBV_EVENT_PORT_ERR"), Duration::from_secs(30));
    drop(down);
    common::wait_for_line(&lines, &format!("{dev}: port 1: IBV_EVENT_PORT_ACTIVE"), Duration::from_secs(30));
    child.kill().unwrap();
    child.wait().unwrap();
    common::caps::wait_port_active(T);
    t.finish();
}

/// The same CQ overrun, awaited through tokio.
#[cfg(feature = "tokio")]
#[test]
fn tokio_next_async_receives_the_cq_error() {
    let t = DeviceTest::start();
    // The overrun comes from a raw RC QP connected to itself by hand (RawLoopQp).
    if !common::require(common::Cap::ConnectWithoutCm) {
        return t.finish();
    }
    let ctx = open_device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 1).unwrap();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let mut events = ctx.async_events().unwrap();
    let qp = RawLoopQp::new(&ctx, &pd, &cq, t.addr);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let ev = rt.block_on(async {
        // Nothing yet: the future waits (bounded here), and dropping it loses nothing.
        let idle = tokio::time::timeout(Duration::from_millis(100), events.next_async()).await;
        assert!(idle.is_err(), "{idle:?}");
        qp.write_self(&mr, 4);
        loop {
            let ev = tokio::time::timeout(T, events.next_async()).await.expect("bounded").unwrap();
            if ev.kind == AsyncEventKind::CqError {
                return ev;
            }
        }
    });
    assert_eq!(ev.element, AsyncElement::Cq(cq.as_raw() as usize));
    assert!(cq.has_error().unwrap());
    drop(qp);
    drop((events, mr, cq, pd, ctx, rt));
    t.finish();
}

/// The same CQ overrun, awaited by one thread through a `Readiness` set (no runtime): the
/// source is not ready while the device is quiet, and becomes ready with the CQ error, beside
/// a CQ whose own channel stays quiet (nothing armed it).
#[test]
fn readiness_reports_the_source_ready_with_the_cq_error() {
    let t = DeviceTest::start();
    // The overrun comes from a raw RC QP connected to itself by hand (RawLoopQp).
    if !common::require(common::Cap::ConnectWithoutCm) {
        return t.finish();
    }
    let ctx = open_device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 1).unwrap();
    let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let mut events = ctx.async_events().unwrap();
    let qp = RawLoopQp::new(&ctx, &pd, &cq, t.addr);
    let ev = {
        let mut set = rdma_cm::Readiness::new().async_events(&events, "events").cq(&cq, "cq");
        let idle = set.wait(Duration::from_millis(100)).unwrap();
        assert_eq!(idle.len(), 0, "the device reported nothing yet, but {idle:?} was ready");
        qp.write_self(&mr, 4);
        let ready: Vec<&str> = set.wait(T).unwrap().collect();
        assert_eq!(ready, ["events"], "the source, and not the unarmed CQ");
        drop(set);
        // Drain it as the set's docs say; the CQ error is among what it holds.
        let mut seen = vec![];
        let deadline = Instant::now() + T;
        loop {
            while let Some(ev) = events.try_next().unwrap() {
                seen.push(ev);
            }
            if let Some(ev) = seen.iter().find(|e| e.kind == AsyncEventKind::CqError) {
                break *ev;
            }
            assert!(Instant::now() < deadline, "no CQ error within {T:?}; seen: {seen:?}");
            let mut set = rdma_cm::Readiness::new().async_events(&events, ());
            set.wait(deadline.saturating_duration_since(Instant::now())).unwrap();
        }
    };
    assert_eq!(ev.element, AsyncElement::Cq(cq.as_raw() as usize));
    assert!(cq.has_error().unwrap());
    drop(qp);
    drop((events, mr, cq, pd, ctx));
    t.finish();
}

/// A peer's RDMA WRITE with a bad rkey, the pair on lanes: what the responder's QP learns (rxe
/// raises no QP event for it; the test records what arrives and checks that nothing is
/// misdelivered).
///
/// The writer's outcome is the transport's. InfiniBand and RoCE: the responder NAKs the write
/// and the writer's completion fails. iWARP: the write completes with SUCCESS at the writer
/// once TCP has it (there is no NAK), the responder finds the bad rkey, sends a TERMINATE and
/// closes the stream, and the writer's connection is torn down: its `DISCONNECTED` comes
/// (measured on siw, 6.1 and 6.12).
#[test]
fn bad_rkey_write_fails_the_writer_and_marks_no_other_object() {
    let t = DeviceTest::start();
    let spec = common::PairSpec { access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE, ..Default::default() };
    let (mut c, mut s) = common::lane::lane_pair(t.addr, common::PairSpec::default(), spec, 64);
    let ctx = s.pd.context().clone();
    let mut events = ctx.async_events().unwrap();
    let bad = rdma_cm::RemoteRegion::new(s.mrs[0].addr(), s.mrs[0].rkey() ^ 0x5a5a, 64);
    c.lane.post_send(c.qp, SendWr::write(c.mrs.remove(0), 0..8, &bad, 0).wr_id(9)).unwrap();
    let wc = c.lane.wait(T).expect("the write's completion");
    assert_eq!(wc.wr_id(), 9, "{wc:?}");
    let e = if common::caps::iwarp_context(&ctx) {
        assert!(wc.is_ok(), "on iWARP the write completes at the writer (TCP took it): {wc:?}");
        assert!(c.lane.wait_peer_left(c.qp, T).unwrap(), "the writer's connection was not torn down within {T:?}");
        "write completed (SUCCESS), then the connection was torn down".to_string()
    } else {
        let e = wc.error().expect("the write fails at the writer");
        assert!(matches!(e, Error::WorkCompletion { .. }), "{e:?}");
        assert_ne!(wc.status(), WcStatus::WrFlushErr, "the write's own failure, not a flush: {e}");
        e.to_string()
    };
    let mut seen = vec![];
    while let Ok(ev) = events.next(Duration::from_millis(500)) {
        seen.push(ev);
    }
    eprintln!("measured: writer's error {e}; async events after a bad-rkey write: {seen:?}");
    let (responder, writer) = (s.lane.qp_as_raw(s.qp).unwrap() as usize, c.lane.qp_as_raw(c.qp).unwrap() as usize);
    eprintln!(
        "responder QP: state {:?}; writer QP: state {:?}",
        s.lane.attributes(s.qp).map(|a| a.state),
        c.lane.attributes(c.qp).map(|a| a.state)
    );
    for ev in &seen {
        if let AsyncElement::Qp(p) = ev.element {
            assert!(p == responder || p == writer, "an event names a QP that is not ours: {ev}");
        }
    }
    drop((events, ctx, wc, c, s));
    t.finish();
}

/// A lane's connected QP waiting for a receive that never comes, when the lane's CQ overruns
/// (a raw QP shares it): the lane's wait reads the device's events itself (nothing else reads
/// them here) and stops at once, with the event named, instead of sleeping to its timeout.
/// The raw QP overruns the CQ before the wait starts (the wait's polls, which take the raw
/// QP's completions from the shared CQ, could otherwise keep up with the writes and prevent
/// the overrun), and only the readiness of a source, not a read of it, says that the device
/// reported something.
#[test]
fn a_lane_whose_cq_overran_fails_its_wait_at_once() {
    let t = DeviceTest::start();
    // The overrun comes from a raw RC QP connected to itself by hand (RawLoopQp).
    if !common::require(common::Cap::ConnectWithoutCm) {
        return t.finish();
    }
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let req = listener.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mut conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
        // Until the client leaves.
        let _ = conn.next_event(T);
        drop((conn, pd, listener));
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut lane = Lane::new(&ctx, 2).unwrap();
    let c = route.lane_qp(&mut lane, &pd, QpInit::new().max_send_wr(1).max_recv_wr(1)).unwrap();
    let qp = c.qp();
    let buf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    lane.post_recv(qp, RecvWr::new(buf).wr_id(1)).unwrap();
    c.connect(&mut lane, &ConnParam::new(), T).unwrap();
    let cq = lane_cq(&lane, &pd);
    let events = ctx.async_events().unwrap();
    let target = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let raw = RawLoopQp::new(&ctx, &pd, &cq, t.addr);
    let n = RawLoopQp::capacity(&cq) + 2;
    assert!(n <= 64, "CQ capacity {n}");
    raw.write_self(&target, n);
    // The device reported something (the overrun): the source is readable; nothing read it.
    let mut set = rdma_cm::Readiness::new().async_events(&events, ());
    assert_eq!(set.wait(T).unwrap().count(), 1, "the device reported nothing within {T:?}");
    drop(set);
    let start = Instant::now();
    let e = lane.wait(T).expect_err("the wait of a lane whose CQ overran");
    let took = start.elapsed();
    assert!(matches!(e, Error::AsyncEvent { event: AsyncEventKind::CqError, object: "CQ", .. }), "{e:?}");
    assert!(took < T / 2, "the wait took {took:?}");
    eprintln!("measured: the lane's wait ended {took:?} after it started: {e}");
    assert!(cq.has_error().unwrap(), "the event was delivered to the lane's CQ");
    drop(raw);
    let _ = lane.disconnect(qp, T);
    server.join().unwrap();
    drop((events, target, lane, cq, pd, ctx));
    t.finish();
}
