//! Helpers that several subjects' attacks share.
#![allow(dead_code)]

use crate::common::{pair, resources, DeviceTest, PairSpec, T};
use rdma_cm::{
    AccessFlags, Client, CompletionQueue, ConnParam, Connection, Listener, MemoryRegion, ProtectionDomain, QpInit,
    QueuePair, RecvWr, SendWr, Server, SharedReceiveQueue, WorkCompletion, WorkQueue,
};
use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

pub(crate) const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

pub(crate) const MSGS: u32 = 150;

/// How a receiving thread waits in [`shared_cq_stress`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mode {
    /// `wait_for(Recv, wr_id)` (needs known wr_ids: QPs without an SRQ).
    WaitFor,
    /// `wait`, both queues.
    Wait,
    /// `wait_queue(Recv)`.
    WaitQueue,
    /// `wait_for` with `set_busy_poll(true)`.
    BusyWaitFor,
    /// `wait` with `set_busy_poll(true)`.
    BusyWait,
    /// `wait_async` on a runtime of the thread's own.
    AsyncWait,
    /// `wait_for_async` on a runtime of the thread's own.
    AsyncWaitFor,
    /// `wait_async` cancelled every 2 ms (a `tokio::time::timeout` that runs out) until it
    /// returns something.
    AsyncCancelled,
}

/// Waits the async way for `mode`; None for the blocking modes.
#[cfg(feature = "tokio")]
pub(crate) fn async_wait(
    rt: &tokio::runtime::Runtime,
    conn: &mut Connection,
    mode: Mode,
    next: u32,
    wcs: &mut [WorkCompletion],
) -> Option<Result<Vec<WorkCompletion>, String>> {
    let qp = conn.qp_mut();
    Some(rt.block_on(async {
        match mode {
            Mode::AsyncWaitFor => {
                match tokio::time::timeout(T, qp.wait_for_async(WorkQueue::Recv, next as u64)).await {
                    Ok(Ok(wc)) => Ok(vec![wc]),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("timed out".into()),
                }
            }
            Mode::AsyncWait => match tokio::time::timeout(T, qp.wait_async(wcs)).await {
                Ok(Ok(n)) => Ok(wcs[..n].to_vec()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("timed out".into()),
            },
            Mode::AsyncCancelled => {
                let end = std::time::Instant::now() + T;
                loop {
                    match tokio::time::timeout(Duration::from_millis(2), qp.wait_async(wcs)).await {
                        Ok(Ok(n)) => break Ok(wcs[..n].to_vec()),
                        Ok(Err(e)) => break Err(e.to_string()),
                        Err(_) if std::time::Instant::now() < end => continue,
                        Err(_) => break Err("timed out, cancelled at every try".into()),
                    }
                }
            }
            _ => unreachable!(),
        }
    }))
}

#[cfg(not(feature = "tokio"))]
pub(crate) fn async_wait(
    _: &(),
    _: &mut Connection,
    _: Mode,
    _: u32,
    _: &mut [WorkCompletion],
) -> Option<Result<Vec<WorkCompletion>, String>> {
    panic!("the async modes need the tokio feature")
}

pub(crate) fn count(kind: &str) -> usize {
    resources().into_iter().find(|(k, _)| *k == kind).map_or(0, |(_, n)| n)
}

/// Waits (bounded) for the completion with `wr_id` on any queue of `qp`, failed or not;
/// other completions met on the way are returned too, in order.
pub(crate) fn reap_until(qp: &mut QueuePair, wr_id: u64) -> (WorkCompletion, Vec<WorkCompletion>) {
    let deadline = Instant::now() + T;
    let mut others = vec![];
    let mut wcs = [WorkCompletion::default(); 8];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no completion for wr_id {wr_id:#x} within {T:?}; others: {others:?}");
        let n = match qp.wait(&mut wcs, left) {
            Ok(n) => n,
            Err(e) => panic!("waiting for wr_id {wr_id:#x}: {e}; others: {others:?}"),
        };
        let mut found = None;
        for wc in &wcs[..n] {
            if wc.wr_id() == wr_id && found.is_none() {
                found = Some(*wc);
            } else {
                others.push(*wc);
            }
        }
        if let Some(wc) = found {
            return (wc, others);
        }
    }
}

/// Many QPs on one CQ (that starts at depth 4 and grows as they join), each waited on by its
/// own thread in its own way, while a server sends `MSGS` messages with immediate data to
/// each, all connections at once. Every QP must receive every message of its own, once, in
/// order, each within the bound: a completion lost, delivered twice or to the wrong QP, or a
/// blind wait fails it. With `srq`, the client QPs take their receives from one SRQ that each
/// thread refills, and the SRQ's count must come back to its depth.
pub(crate) fn shared_cq_stress(modes: &[Mode], srq_depth: Option<u32>) {
    stress(modes, srq_depth, false, false)
}

/// The receives each QP of [`stress`] keeps posted (without an SRQ): its whole receive queue
/// (`QpInit`'s default 16), so that a receiving thread some messages behind the device does
/// not leave its queue empty. With two, a thread two messages behind made the sender meet an
/// RNR NAK, retried after the CM's `min_rnr_timer` (0: 655 ms) or more; the resize test then
/// took 56 to 186 s on rxe/6.1 and failed whenever one message's retries overran the 10 s
/// bound. (What kept the busy `wait_for` thread behind was a crate bug, fixed in
/// `QueuePair::spin_on`: it looked at completions other threads kept for it only once per 4096
/// polls. Before that fix this test failed with 16 receives too (once run, at message 16,
/// after 66 s); after it, it passed 5 of 5 in 12 to 15 s. Measured 2026-12-03.)
const RECVS: u64 = 16;

/// The 64 bytes of a QP's region that receive `wr_id` lands in.
fn recv_slot(wr_id: u64) -> std::ops::Range<usize> {
    let at = (wr_id % RECVS) as usize * 64;
    at..at + 64
}

/// [`shared_cq_stress`], with `own_send_cq`: each QP sends on a CQ of its own (the receive CQ
/// is the shared one); with `resizer`: a thread resizes the shared CQ back and forth meanwhile.
pub(crate) fn stress(modes: &[Mode], srq_depth: Option<u32>, own_send_cq: bool, resizer: bool) {
    let t = DeviceTest::start();
    let k = modes.len();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(16).unwrap();
    let dst = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let mut conns = accept_senders(&listener, k);
        for i in 0..MSGS {
            for (conn, mr, _) in &mut conns {
                conn.qp_mut().post_send(&[SendWr::send(mr, 0..16).imm(i).wr_id(i as u64)]).unwrap();
            }
            for (j, (conn, _, _)) in conns.iter_mut().enumerate() {
                conn.qp_mut()
                    .wait_for(WorkQueue::Send, i as u64, T)
                    .unwrap_or_else(|e| panic!("server: send {i} to connection {j}: {e}"));
            }
        }
        (conns, listener)
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let ctx = route.context().unwrap();
    let pd = route.alloc_pd().unwrap();
    let cq = CompletionQueue::new(&ctx, 4).unwrap();
    cq.set_auto_grow(true);
    let srq = srq_depth.map(|d| SharedReceiveQueue::new(&pd, d).unwrap());
    let shared_mr =
        Arc::new(MemoryRegion::new(&pd, 64 * srq_depth.unwrap_or(1) as usize, AccessFlags::LOCAL_WRITE).unwrap());
    if let (Some(srq), Some(d)) = (&srq, srq_depth) {
        let wrs: Vec<_> =
            (0..d as usize).map(|j| RecvWr::new(&shared_mr, j * 64..(j + 1) * 64).wr_id(j as u64)).collect();
        srq.post_recv(&wrs).unwrap();
    }
    let mut route = Some(route);
    let mut handles = Vec::new();
    for (n, &mode) in modes.iter().enumerate() {
        let r = match route.take() {
            Some(r) => r,
            None => Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap(),
        };
        let send_cq = if own_send_cq { CompletionQueue::new(&ctx, 64).unwrap() } else { Arc::clone(&cq) };
        let mut init = QpInit::new().send_cq(send_cq).recv_cq(Arc::clone(&cq));
        if let Some(srq) = &srq {
            init = init.srq(srq);
        }
        let mut q = r.create_qp(&pd, init).unwrap();
        let mr = MemoryRegion::new(&pd, 64 * RECVS as usize, AccessFlags::LOCAL_WRITE).unwrap();
        if srq.is_none() {
            let wrs: Vec<_> = (0..RECVS).map(|j| RecvWr::new(&mr, recv_slot(j)).wr_id(j)).collect();
            q.post_recv(&wrs).unwrap();
        }
        let mut conn = q.connect(&ConnParam::new(), T).unwrap();
        let (srq, shared_mr) = (srq.clone(), Arc::clone(&shared_mr));
        handles.push(thread::spawn(move || {
            let me = conn.qp().qp_num();
            if matches!(mode, Mode::BusyWait | Mode::BusyWaitFor) {
                conn.qp_mut().set_busy_poll(true);
            }
            let mut next = 0u32;
            let mut seen: Vec<u32> = Vec::new();
            let mut wcs = [WorkCompletion::default(); 8];
            #[cfg(feature = "tokio")]
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            #[cfg(not(feature = "tokio"))]
            let rt = ();
            while next < MSGS {
                let got: Vec<WorkCompletion> = match mode {
                    Mode::AsyncWait | Mode::AsyncWaitFor | Mode::AsyncCancelled => {
                        async_wait(&rt, &mut conn, mode, next, &mut wcs)
                            .unwrap()
                            .unwrap_or_else(|e| panic!("QP {n} ({mode:?}): message {next}: {e}"))
                    }
                    Mode::WaitFor | Mode::BusyWaitFor => {
                        let wc = conn
                            .qp_mut()
                            .wait_for(WorkQueue::Recv, next as u64, T)
                            .unwrap_or_else(|e| panic!("QP {n} ({mode:?}): message {next}: {e}"));
                        vec![wc]
                    }
                    Mode::Wait | Mode::BusyWait | Mode::WaitQueue => {
                        let r = if let Mode::WaitQueue = mode {
                            conn.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T)
                        } else {
                            conn.qp_mut().wait(&mut wcs, T)
                        };
                        let got = r.unwrap_or_else(|e| panic!("QP {n} ({mode:?}): message {next}: {e}"));
                        assert!(got > 0, "QP {n} ({mode:?}): message {next} never came (the wait timed out)");
                        wcs[..got].to_vec()
                    }
                };
                for wc in got {
                    assert!(wc.is_ok(), "QP {n}: {wc:?}");
                    assert_eq!(wc.queue(), WorkQueue::Recv, "QP {n}: only receives complete here");
                    assert_eq!(wc.qp_num(), me, "QP {n} got another QP's completion: {wc:?}");
                    seen.push(wc.imm_data().expect("every message carries its number"));
                    next += 1;
                    match &srq {
                        Some(srq) => {
                            let j = wc.wr_id() as usize;
                            srq.post_recv(&[RecvWr::new(&shared_mr, j * 64..(j + 1) * 64).wr_id(j as u64)]).unwrap();
                        }
                        None => {
                            let id = wc.wr_id() + RECVS;
                            conn.qp_mut().post_recv(&[RecvWr::new(&mr, recv_slot(id)).wr_id(id)]).unwrap();
                        }
                    }
                }
            }
            assert_eq!(conn.qp().undelivered(), 0, "QP {n}: nothing left kept");
            let mut sorted = seen.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..MSGS).collect::<Vec<_>>(), "QP {n} ({mode:?}): a message lost or delivered twice");
            let swapped: Vec<_> = seen.windows(2).filter(|w| w[0] > w[1]).map(|w| (w[0], w[1])).collect();
            assert!(swapped.is_empty(), "QP {n} ({mode:?}): an RC QP's receives delivered out of order: {swapped:?}");
            (conn, mr)
        }));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let resizing = resizer.then(|| {
        let (cq, stop) = (Arc::clone(&cq), Arc::clone(&stop));
        thread::spawn(move || {
            let base = cq.depth();
            let mut resizes = 0u32;
            let mut refused = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for d in [base * 2, base + 1, base] {
                    match cq.resize(d) {
                        Ok(()) => resizes += 1,
                        Err(_) => refused += 1,
                    }
                }
                thread::yield_now();
            }
            (resizes, refused)
        })
    });
    let mut failures = Vec::new();
    let mut clients = Vec::new();
    for h in handles {
        match h.join() {
            Ok(c) => clients.push(c),
            Err(e) => failures.push(e.downcast_ref::<String>().cloned().unwrap_or_else(|| "panic".into())),
        }
    }
    // A failed receiver stops taking messages: the server (RNR-retrying for ever) would hang, so
    // the failure is reported before it is joined.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(h) = resizing {
        let (resizes, refused) = h.join().unwrap();
        assert!(resizes > 0, "the CQ was resized under the traffic ({refused} refused)");
        assert_eq!(refused, 0, "resizes within what the queues reserved are all accepted");
    }
    assert!(failures.is_empty(), "receivers failed: {failures:#?}");
    let servers = server.join().unwrap();
    if let (Some(srq), Some(d)) = (&srq, srq_depth) {
        assert_eq!(srq.outstanding(), d as usize, "every receive reaped was posted again; none is held twice");
    }
    assert!(cq.depth() >= 4, "the CQ grew as QPs joined: {}", cq.depth());
    drop((clients, servers, srq, shared_mr, cq, pd, ctx));
    t.finish();
}

/// Waits (bounded) until the kernel's count of `kind` is `want`.
pub(crate) fn wait_count(kind: &str, want: usize, when: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = count(kind);
        if n == want {
            return;
        }
        assert!(Instant::now() < deadline, "{when}: {n} {kind}s, expected {want}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client and a server whose regions the peer may write, connected.
pub(crate) fn writable_pair(addr: std::net::IpAddr) -> (crate::common::Side, crate::common::Side) {
    let spec = PairSpec { access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE, ..PairSpec::default() };
    pair(addr, spec.clone(), spec)
}

/// The server side of the shared-CQ attacks: `k` connections accepted on `listener`, each with
/// its own PD and a 64-byte region to send from.
pub(crate) fn accept_senders(listener: &Listener, k: usize) -> Vec<(Connection, MemoryRegion, Arc<ProtectionDomain>)> {
    (0..k)
        .map(|_| {
            let req = listener.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            let conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
            (conn, mr, pd)
        })
        .collect()
}

pub(crate) const CHILD_ENV: &str = "RDMA_CM_ATTACKS_CHILD";

/// Whether this process is the child started by `run_child(name, …)`.
pub(crate) fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).as_deref() == Ok(name)
}

/// Runs the (ignored) test `name` of this binary in a child process and returns its exit
/// status (`None` when it had to be killed after `within`) and its output. For attacks whose
/// failure mode is a crash, a hang or a leak of device objects.
pub(crate) fn run_child(name: &str, within: Duration) -> (Option<std::process::ExitStatus>, String) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = Command::new(exe)
        .args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the child");
    let drain = |mut r: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let text = format!("--- stdout\n{}--- stderr\n{}", out.join().unwrap(), err.join().unwrap());
    (status, text)
}

/// Waits (bounded) until `cond` holds; returns whether it did.
pub(crate) fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Reaps every completion of `qp` until nothing is outstanding or kept (bounded); returns
/// (wr_id, ok) of each, in the order they came back.
pub(crate) fn reap_all(qp: &mut rdma_cm::QueuePair, within: Duration) -> Vec<(u64, WorkQueue, bool)> {
    let deadline = Instant::now() + within;
    let mut got = vec![];
    let mut wcs = [WorkCompletion::default(); 8];
    while qp.outstanding_sends() + qp.outstanding_recvs() + qp.undelivered() > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "completions still outstanding after {within:?}: got {got:?}");
        let n = qp.wait(&mut wcs, left).unwrap();
        got.extend(wcs[..n].iter().map(|w| (w.wr_id(), w.queue(), w.is_ok())));
    }
    got
}

pub(crate) fn recvs(mr: &MemoryRegion, ids: std::ops::Range<u64>, len: usize) -> Vec<RecvWr<'_>> {
    ids.map(|k| RecvWr::new(mr, k as usize * len..(k as usize + 1) * len).wr_id(k)).collect()
}

/// Sets up a connected pair where the client's `wait_for` has kept two completions (sends 1 and
/// 2, met while it waited for send 3) and send 4 is in flight towards a server that has no
/// receive for it (with rnr_retry 7 it waits for one for ever). Returns (client, server).
pub(crate) fn two_kept_and_one_stalled(t: &DeviceTest) -> (crate::common::Side, crate::common::Side) {
    let spec_s = PairSpec { mr_sizes: vec![4 * 64], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    s.conn.qp_mut().post_recv(&recvs(&s.mrs[0], 0..3, 64)).unwrap();
    let wrs: Vec<SendWr> = (1..=3).map(|k| SendWr::send(&c.mrs[0], 0..8).wr_id(k)).collect();
    c.conn.qp_mut().post_send(&wrs).unwrap();
    assert_eq!(c.conn.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap().wr_id(), 3);
    assert_eq!(c.conn.qp().undelivered(), 2, "sends 1 and 2 are kept");
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(4)]).unwrap();
    (c, s)
}

/// What a [`Peer`] does next.
pub(crate) enum Step {
    /// Connect (a connector) or accept (an acceptor) one more connection (a connector's refused
    /// connection still takes its number).
    Connect,
    /// Send these bytes on connection `i` (in the order they were made) and wait for the send's
    /// completion, so that the message has landed in the other side's receive.
    Send(usize, Vec<u8>),
}

/// A peer on a thread of its own that takes [`Step`]s one at a time and says when each is done:
/// the other side of attacks that must place each message, and each connection, exactly.
pub(crate) struct Peer {
    steps: Option<std::sync::mpsc::Sender<Step>>,
    done: std::sync::mpsc::Receiver<()>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Peer {
    /// A peer that connects to `dst` (each connection on its own PD, with a 4 KiB region).
    pub(crate) fn connector(dst: SocketAddr) -> Peer {
        Peer::spawn(move || {
            let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
            let pd = route.alloc_pd().unwrap();
            let mr = MemoryRegion::new(&pd, 4096, LW).unwrap();
            // A connection the other side refuses is no connection (the attack says so itself).
            let conn = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), T).ok()?;
            Some((conn, mr, pd))
        })
    }

    /// A peer that accepts on `listener` (each connection on its own PD, with a 4 KiB region).
    pub(crate) fn acceptor(listener: Listener) -> Peer {
        Peer::spawn(move || {
            let req = listener.get_request(T).unwrap();
            let pd = req.alloc_pd().unwrap();
            let mr = MemoryRegion::new(&pd, 4096, LW).unwrap();
            let conn = req.create_qp(&pd, QpInit::new()).unwrap().accept(&ConnParam::new(), T).unwrap();
            Some((conn, mr, pd))
        })
    }

    fn spawn(
        mut connect: impl FnMut() -> Option<(Connection, MemoryRegion, Arc<ProtectionDomain>)> + Send + 'static,
    ) -> Peer {
        let (steps, rx) = std::sync::mpsc::channel::<Step>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let thread = thread::spawn(move || {
            let mut conns = Vec::new();
            let mut wr_id = 0u64;
            while let Ok(step) = rx.recv() {
                match step {
                    Step::Connect => conns.push(connect()),
                    Step::Send(i, msg) => {
                        let Some((conn, mr, _)) = &mut conns[i] else { panic!("connection {i} was refused") };
                        mr.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(&msg);
                        wr_id += 1;
                        conn.qp_mut().post_send(&[SendWr::send(mr, 0..msg.len()).wr_id(wr_id)]).unwrap();
                        let wc = conn.qp_mut().wait_for(WorkQueue::Send, wr_id, T).unwrap();
                        assert!(wc.is_ok(), "the peer's send on connection {i}: {wc:?}");
                    }
                }
                if done_tx.send(()).is_err() {
                    break;
                }
            }
        });
        Peer { steps: Some(steps), done, thread: Some(thread) }
    }

    /// Starts `step` without waiting for it (a connection the caller's side completes).
    pub(crate) fn start(&self, step: Step) {
        self.steps.as_ref().unwrap().send(step).unwrap();
    }

    /// Waits (bounded) for the step started last.
    pub(crate) fn wait(&self) {
        self.done.recv_timeout(T + T).expect("the peer's step did not finish in time");
    }

    /// Does `step` and waits for it.
    pub(crate) fn step(&self, step: Step) {
        self.start(step);
        self.wait();
    }

    /// Ends the peer (its connections go with it).
    pub(crate) fn finish(mut self) {
        drop(self.steps.take());
        self.thread.take().unwrap().join().unwrap();
    }
}
