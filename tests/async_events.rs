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

use common::{DeviceTest, T};
use rdma_cm::{
    ffi, AccessFlags, AsyncElement, AsyncEvent, AsyncEventKind, AsyncEvents, Client, CompletionQueue, ConnParam, Error,
    MemoryRegion, ProtectionDomain, QpInit, RecvWr, SendWr, Server, SharedReceiveQueue, VerbsContext, WorkCompletion,
    WorkQueue,
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
            .find(|g| g.gid.ipv4() == Some(v4) && g.gid_type == rdma_cm::GidType::RoceV2)
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

impl Drop for RawLoopQp {
    fn drop(&mut self) {
        // SAFETY: created above, destroyed once.
        assert_eq!(unsafe { ffi::ibv_destroy_qp(self.0) }, 0);
    }
}

/// A CQ of one entry overrun by a raw QP: the device reports IBV_EVENT_CQ_ERR naming it, the
/// CQ learns of it (and its wait fails at once instead of sleeping), another CQ does not, and
/// a source whose descriptor safe code tampered with (reading it, clearing O_NONBLOCK) still
/// works without blocking.
#[test]
fn cq_overrun_is_delivered_to_the_cq_and_ends_its_wait() {
    let t = DeviceTest::start();
    let ctx = open_device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 1).unwrap();
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
        drop((events, early, cq, other, pd, ctx));
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
    // The CQ's wait fails at once, naming the event, instead of sleeping to its timeout.
    let mut wcs = [WorkCompletion::default(); 4];
    let start = Instant::now();
    let mut r = cq.wait(&mut wcs, T);
    while let Ok(n) = r {
        // The one completion that fit (a foreign one) retires nothing and is not returned.
        assert_eq!(n, 0, "{:?}", &wcs[..n]);
        r = cq.wait(&mut wcs, T);
    }
    let e = r.unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2), "the wait took {:?}", start.elapsed());
    assert!(matches!(e, Error::AsyncEvent { event: AsyncEventKind::CqError, object: "CQ", .. }), "{e:?}");
    eprintln!("error: {e}");
    drop(qp);
    drop((events, early, mr, cq, other, pd, ctx));
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

/// The SRQ limit event, delivered to the SRQ (and seen by a source made before it, and by one
/// made after a wait had read it already).
#[test]
fn srq_limit_event_is_delivered_to_the_srq() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(4).unwrap();
    let dst = listener.local_addr().unwrap();
    let client = thread::spawn(move || {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).unwrap();
        let wrs: Vec<SendWr> = (0..3).map(|i| SendWr::send(&mr, 0..8).wr_id(i)).collect();
        conn.qp_mut().post_send(&wrs).unwrap();
        for i in 0..3 {
            conn.qp_mut().wait_for(WorkQueue::Send, i, T).unwrap();
        }
        conn.next_event(T).unwrap();
        drop((conn, mr, pd));
    });
    let req = listener.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let mut before = ctx.async_events().unwrap();
    let pd = req.alloc_pd().unwrap();
    let srq = SharedReceiveQueue::new(&pd, 4).unwrap();
    let region = MemoryRegion::new(&pd, 4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let slots = region.split(64).unwrap();
    let recvs: Vec<RecvWr> = slots.iter().enumerate().map(|(i, m)| RecvWr::new(m, 0..64).wr_id(i as u64)).collect();
    srq.post_recv(&recvs).unwrap();
    srq.arm_limit(2).unwrap();
    assert!(!srq.limit_reached().unwrap());
    let mut conn = req.create_qp(&pd, QpInit::new().srq(&srq)).unwrap().accept(&ConnParam::new(), T).unwrap();
    let mut got = 0;
    while got < 3 {
        let mut wcs = [WorkCompletion::default(); 4];
        let n = conn.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
        assert!(n > 0, "only {got} of 3 receives completed");
        got += n;
    }
    // One receive left, below the limit of 2: the device says so.
    let (ev, _) = wait_event(&mut before, T, |e| e.is_srq_limit());
    assert!(srq.is_limit_event(&ev), "{ev}");
    assert_eq!(ev.element, AsyncElement::Srq(srq.as_raw() as usize));
    assert!(srq.limit_reached().unwrap());
    assert_eq!(srq.last_async_event().unwrap(), Some(AsyncEventKind::SrqLimitReached));
    // A source made now still finds it in the context's log.
    let (late, _) = wait_event(&mut ctx.async_events().unwrap(), T, |e| e.is_srq_limit());
    assert_eq!(late, ev);
    // Re-arming clears the flag; the QP saw nothing fatal.
    srq.arm_limit(1).unwrap();
    assert!(!srq.limit_reached().unwrap());
    assert_eq!(conn.qp().fatal_event().unwrap(), None);
    // A QP of an SRQ moved to the error state: what the provider says (kernels from 6.10 on
    // raise IBV_EVENT_QP_LAST_WQE_REACHED on rxe).
    conn.qp_mut().set_error().unwrap();
    let after: Vec<_> = std::iter::from_fn(|| before.next(Duration::from_millis(300)).ok()).collect();
    eprintln!("measured: after set_error on an SRQ's QP: {after:?}, the QP's last {:?}", conn.qp().last_async_event());
    let ours = conn.qp().as_raw() as usize;
    assert!(after.iter().all(|e| matches!(e.element, AsyncElement::Qp(p) if p == ours)), "{after:?}");
    let _ = conn.disconnect(T);
    client.join().unwrap();
    drop(recvs);
    drop((slots, srq, pd, before, ctx, listener));
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
    while ctx.port(1).unwrap().state != rdma_cm::PortState::Active {
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

/// A peer's RDMA WRITE with a bad rkey: what the responder's QP learns (rxe raises no QP event
/// for it; the test records what arrives and checks that nothing is misdelivered).
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
    let (mut c, s) = common::pair(t.addr, common::PairSpec::default(), spec);
    let ctx = s.pd.context().clone();
    let mut events = ctx.async_events().unwrap();
    let bad = rdma_cm::RemoteRegion::new(s.mrs[0].addr(), s.mrs[0].rkey() ^ 0x5a5a, 64);
    c.conn.qp_mut().post_send(&[SendWr::write(&c.mrs[0], 0..8, &bad, 0).unwrap().wr_id(9)]).unwrap();
    let r = c.conn.qp_mut().wait_for(WorkQueue::Send, 9, T);
    let e = if common::caps::iwarp_context(&ctx) {
        let wc = r.expect("on iWARP the write completes at the writer (TCP took it)");
        assert_eq!(wc.wr_id(), 9);
        let deadline = Instant::now() + T;
        let mut cm = vec![];
        while !c.conn.is_disconnected() {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "the writer's connection was not torn down within {T:?}; CM events: {cm:?}");
            if let Ok(ev) = c.conn.next_event(left) {
                cm.push(ev.event_type());
            }
        }
        format!("write completed (SUCCESS), then the connection was torn down; CM events {cm:?}")
    } else {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::WorkCompletion { .. } | Error::AsyncEvent { .. }), "{e:?}");
        e.to_string()
    };
    let mut seen = vec![];
    while let Ok(ev) = events.next(Duration::from_millis(500)) {
        seen.push(ev);
    }
    eprintln!("measured: writer's error {e}; async events after a bad-rkey write: {seen:?}");
    eprintln!(
        "responder QP: last {:?}, fatal {:?}; writer QP: last {:?}",
        s.conn.qp().last_async_event().unwrap(),
        s.conn.qp().fatal_event().unwrap(),
        c.conn.qp().last_async_event().unwrap()
    );
    for ev in &seen {
        if let AsyncElement::Qp(p) = ev.element {
            assert!(
                p == s.conn.qp().as_raw() as usize || p == c.conn.qp().as_raw() as usize,
                "an event names a QP that is not ours: {ev}"
            );
        }
    }
    drop(Arc::clone(&s.pd));
    drop((events, ctx, c, s));
    t.finish();
}

/// A connected QP whose send CQ overruns (a raw QP shares it) stops waiting for a receive at
/// once, with the event named, instead of sleeping to its timeout: its wait watches the
/// context's events. The wait is on the QP's own receive CQ, so it cannot reap the raw QP's
/// completions from the shared CQ and so prevent the overrun (an earlier version shared the
/// receive CQ, and the wait's polls sometimes kept up with the raw writes).
#[test]
fn qp_whose_cq_overran_fails_its_wait_at_once() {
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
    let cq = CompletionQueue::new(&ctx, 16).unwrap();
    let buf = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut qp = route.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&cq))).unwrap();
    qp.post_recv(&[RecvWr::new(&buf, 0..64).wr_id(1)]).unwrap();
    let mut conn = qp.connect(&ConnParam::new(), T).unwrap();
    let mut events = ctx.async_events().unwrap();
    let target = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let raw = RawLoopQp::new(&ctx, &pd, &cq, t.addr);
    let n = RawLoopQp::capacity(&cq) + 2;
    assert!(n <= 64, "CQ capacity {n}");
    // The overrun happens while (or before) the QP waits for a receive that never comes.
    let start = Instant::now();
    thread::scope(|s| {
        s.spawn(|| raw.write_self(&target, n));
        let r = conn.qp_mut().wait_for(WorkQueue::Recv, 1, T);
        let took = start.elapsed();
        let e = r.unwrap_err();
        assert!(matches!(e, Error::AsyncEvent { event: AsyncEventKind::CqError, object: "CQ", .. }), "{e:?}");
        assert!(took < T / 2, "the wait took {took:?}");
        eprintln!("measured: the QP's wait ended {took:?} after the overrun started: {e}");
    });
    let (ev, others) = wait_event(&mut events, T, |e| e.kind == AsyncEventKind::CqError);
    assert_eq!(ev.element, AsyncElement::Cq(cq.as_raw() as usize));
    eprintln!("events besides: {others:?}; QP's own: {:?}", conn.qp().last_async_event().unwrap());
    drop(raw);
    let _ = conn.disconnect(T);
    server.join().unwrap();
    drop((events, target, buf, cq, pd, ctx));
    t.finish();
}
