//! Faults on the device: a peer that dies, a link that drops, a panic with work in flight,
//! and a soak of random-size messages with every byte checked. Each ends with the kernel's
//! resource accounting back where it started.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use common::{pair, pattern, DeviceTest, PairSpec, T};
use rdma_cm::{
    AccessFlags, Client, ConnParam, Error, MemoryRegion, QpInit, RecvWr, SendWr, Server, WorkCompletion, WorkQueue,
};

/// The bound within which a survivor must notice a dead peer.
const NOTICE: Duration = Duration::from_secs(5);

use common::example;

#[test]
fn server_killed_mid_transfer_fails_the_client_quickly() {
    let t = DeviceTest::start();
    let addr = t.addr.to_string();
    let mut server = Command::new(example("perf_server"))
        .args(["-a", &addr, "-p", "7701", "--count", "1"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_listening(7701, Duration::from_secs(60));
    let started = Instant::now();
    let mut client = Command::new(example("perf_client"))
        .args(["-a", &addr, "-p", "7701", "--iters", "10000000", "--size", "64", "--timeout", "30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = common::lines_of(&mut client);
    common::wait_for_line(&lines, "[EVENT] Connection established", Duration::from_secs(60));
    server.kill().unwrap(); // SIGKILL mid-transfer
    let killed = Instant::now();
    server.wait().unwrap();
    let out = client.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let noticed = killed.elapsed();
    eprintln!("measured: the client exited {noticed:?} after the server was killed");
    assert!(noticed < NOTICE, "client took {noticed:?} to notice (started {:?} ago)", started.elapsed());
    assert!(err.contains("peer disconnected") && err.lines().count() == 1, "{err}");
    t.finish();
}

#[test]
fn panic_with_work_in_flight_leaves_no_memory_the_device_can_write() {
    let t = DeviceTest::start();
    let (c, s) = pair(t.addr, PairSpec::default(), PairSpec::default());
    let mut target = MemoryRegion::new(&s.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    target.as_mut_slice().unwrap().fill(0xAB);
    let shared = &target;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let mut s = s;
        s.conn.qp_mut().post_recv(&[RecvWr::new(shared, 0..4096).wr_id(1)]).unwrap();
        assert_eq!(shared.outstanding(), 1);
        panic!("user code panics while the device owns a receive buffer");
    }));
    assert!(r.is_err());
    // Unwinding dropped the connection: its QP flushed the receive and released the region.
    assert_eq!(target.outstanding(), 0);
    assert!(target.as_slice().unwrap().iter().all(|&b| b == 0xAB), "nothing was written");
    // The peer is gone: the survivor's send fails instead of hanging.
    let mut c = c;
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..16).wr_id(1)]).unwrap();
    let start = Instant::now();
    let r = c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T);
    if common::caps::iwarp() {
        // iWARP (measured on siw, 6.1): the server's drop does disconnect (the client reads
        // DISCONNECTED within milliseconds of it; the crate's drop path is not at fault), so
        // the peer's close reaches this side's kernel before this side reads that event. A send posted then is
        // never completed: not within the 10 s wait, in which the crate reads the DISCONNECTED
        // and calls rdma_disconnect (which on iWARP asks for SQD, not ERR), nor 3 s after.
        // The likely cause, from siw's source (not measured): siw flushes a user QP's send
        // ring when the QP enters the error state (the peer's close), and a doorbell rung
        // after that flushes nothing; siw's ibv_query_qp says RESET, so the crate cannot tell
        // the QP is dead. So the wait learns the peer left and ends at its own bound, and the
        // send's region is released when the connection is dropped (drain bound, then destroy).
        assert!(
            matches!(
                r,
                Err(Error::Disconnected { .. }) | Err(Error::WorkCompletion { .. }) | Err(Error::Timeout { .. })
            ),
            "{r:?}"
        );
        assert!(start.elapsed() < T + Duration::from_secs(2), "the wait took {:?}", start.elapsed());
        assert!(c.conn.is_disconnected(), "the survivor learnt that its peer left: {r:?}");
        eprintln!("measured (iWARP): the survivor's send after the peer's panic: {r:?} after {:?}", start.elapsed());
    } else {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Disconnected { .. } | Error::WorkCompletion { .. }), "{e:?}");
    }
    let start = Instant::now();
    drop(c);
    assert!(start.elapsed() < Duration::from_secs(5), "the survivor's drop took {:?}", start.elapsed());
    drop(target);
    t.finish();
}

/// Downs the guest's RDMA netdev for the duration, and brings it back up even on panic.
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
        // Wait for the port of the device under test to come back (bounded; no assertion, as
        // this may run while a failed test unwinds).
        common::caps::port_active_within(Duration::from_secs(10));
    }
}

/// The RDMA netdev set down under a connected pair: the sender's work ends in bounded time and
/// the receiver's wait at its own timeout; after the link is up again a new connection works.
///
/// What ends the send is the transport's. InfiniBand and RoCE: it fails (rxe fails it at once
/// while its port is down; hardware after its retry budget). iWARP: the send is handed to TCP,
/// which neither fails it nor gives up while the netdev is down: measured on siw, 6.1, the send
/// neither completes nor fails within 30 s (the crate's wait times out; the receiver's QP
/// flushes its receive), and on 6.12 it completes and the message arrives while the netdev is
/// down (the peer is on this host). So on iWARP the assertion is that the
/// crate's wait ends within its bound (the send completes, fails, or the wait times out), and
/// that after the link is up the old connection delivers the message or fails cleanly
/// (bounded), and a new one works.
#[test]
fn guest_only_link_down_fails_in_bounded_time_and_recovers() {
    let t = DeviceTest::start();
    let spec_s = PairSpec { pre_recv: vec![(1, 4096)], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    if common::caps::iwarp() {
        link_down_on_iwarp(c, s);
        return recovers(t);
    }
    let down = LinkDown::new();
    let start = Instant::now();
    // The sender's work fails (retries exhausted or flushed) rather than hanging.
    let r = send_64_and_wait(&mut c, Duration::from_secs(30));
    let send_took = start.elapsed();
    // The receiver has nothing to notice but silence: its wait ends at its own timeout.
    let recv = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, Duration::from_secs(2));
    assert!(matches!(recv, Err(Error::Timeout { .. }) | Err(Error::WorkCompletion { .. })), "{recv:?}");
    drop(down);
    match &r {
        Err(Error::WorkCompletion { .. }) | Err(Error::Disconnected { .. }) => {}
        other => panic!("expected a failed send with the link down, got {other:?} after {send_took:?}"),
    }
    eprintln!("measured: with the link down the send failed after {send_took:?}: {r:?}");
    assert!(send_took < Duration::from_secs(30), "send took {send_took:?}");
    drop((c, s));
    recovers(t);
}

/// Posts a 64-byte send (wr_id 7) on `c` and waits for it, up to `bound`.
fn send_64_and_wait(c: &mut common::Side, bound: Duration) -> rdma_cm::Result<rdma_cm::WorkCompletion> {
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(7)])?;
    c.conn.qp_mut().wait_for(WorkQueue::Send, 7, bound)
}

/// The iWARP half of `guest_only_link_down_fails_in_bounded_time_and_recovers` (see there).
fn link_down_on_iwarp(mut c: common::Side, mut s: common::Side) {
    let down = LinkDown::new();
    let start = Instant::now();
    let r = send_64_and_wait(&mut c, T);
    let send_took = start.elapsed();
    assert!(send_took < T + Duration::from_secs(2), "the send's wait took {send_took:?}");
    assert!(
        matches!(
            r,
            Ok(_) | Err(Error::Timeout { .. }) | Err(Error::WorkCompletion { .. }) | Err(Error::Disconnected { .. })
        ),
        "{r:?}"
    );
    let recv = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, Duration::from_secs(2));
    assert!(matches!(recv, Ok(_) | Err(Error::Timeout { .. }) | Err(Error::WorkCompletion { .. })), "{recv:?}");
    eprintln!("measured (iWARP): with the link down, after {send_took:?} the send: {r:?}; the receive: {recv:?}");
    drop(down);
    // The link is up: a message that did arrive is the one sent; one that did not arrives now or
    // the connection fails cleanly, within the bound.
    let recv = match recv {
        // Not yet: still posted.
        Err(Error::Timeout { .. }) => {
            let start = Instant::now();
            let late = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T);
            assert!(start.elapsed() < T + Duration::from_secs(2), "the receive's wait took {:?}", start.elapsed());
            eprintln!("measured (iWARP): after the link came up, {:?} later the receive: {late:?}", start.elapsed());
            late
        }
        // Arrived, or flushed (measured on siw/6.1: the receive fails with WR_FLUSH_ERR while
        // the netdev is down).
        other => other,
    };
    if let Ok(wc) = recv {
        assert_eq!(wc.byte_len(), 64, "the message sent while the link was down");
    }
    drop((c, s));
}

/// After the link is back, a new connection works end to end; nothing leaked.
fn recovers(t: DeviceTest) {
    let spec_s = PairSpec { pre_recv: vec![(1, 4096)], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec::default(), spec_s);
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..64).wr_id(1)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    assert_eq!(s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap().byte_len(), 64);
    drop((c, s));
    t.finish();
}

/// xorshift64*: a tiny deterministic PRNG, so the receiver can regenerate what was sent.
fn next(x: &mut u64) -> u64 {
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

const SLOT: usize = 64 * 1024;
const DEPTH: usize = 16;

/// The size of message `i` of connection `conn` (1..=64 KiB), and its bytes.
fn message(conn: u64, i: u64) -> (usize, u8) {
    let mut x = (conn << 40) ^ i ^ 0x9E37_79B9_7F4A_7C15;
    let size = (next(&mut x) % SLOT as u64) as usize + 1;
    (size, (next(&mut x) >> 56) as u8)
}

/// How many messages each connection's receiver has taken, counted once the receive for
/// message `taken + DEPTH - 1` is posted again: the soak's senders on iWARP read it (below).
static RECEIVED: [std::sync::atomic::AtomicU64; 10] = [const { std::sync::atomic::AtomicU64::new(0) }; 10];

/// Soak: 10 connections, each streaming random-size messages (up to 64 KiB) with 16 in
/// flight; the receiver checks every byte. `RDMA_CM_SOAK_MSGS` scales it (default 2,000 per
/// connection; the full soak is 100000).
///
/// A sender on InfiniBand or RoCE runs up to 16 sends ahead of its send completions, and a
/// receiver that has not yet posted the next receive again answers with RNR NAKs, which
/// the sender retries. iWARP has no RNR: a send that finds no receive posted ends the
/// connection (siw: a DDP terminate, "no buffer"; seen on siw/6.1 and 6.12 as a stall, then
/// `DISCONNECTED` on both sides), and a send completes at the sender once TCP has it, before
/// the receiver has seen it. So there each sender also waits until the receive for its next
/// message is posted (`RECEIVED`, shared in this process), as a protocol's credits would.
#[test]
fn soak_ten_connections_random_sizes_no_loss_no_corruption() {
    let msgs: u64 = std::env::var("RDMA_CM_SOAK_MSGS").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(16).unwrap();
    let dst = listener.local_addr().unwrap();
    let receivers = thread::spawn(move || {
        let mut handles = vec![];
        for _ in 0..10 {
            let req = listener.get_request(T).unwrap();
            let conn_no = u64::from(req.private_data()[0]);
            let pd = req.alloc_pd().unwrap();
            // One registration, split into 16 slots that lock independently.
            let slots = MemoryRegion::new(&pd, SLOT * DEPTH, AccessFlags::LOCAL_WRITE).unwrap().split(SLOT).unwrap();
            let mut q = req.create_qp(&pd, QpInit::new()).unwrap();
            let recvs: Vec<_> =
                slots.iter().enumerate().map(|(k, m)| RecvWr::new(m, 0..SLOT).wr_id(k as u64)).collect();
            q.post_recv(&recvs).unwrap();
            let conn = q.accept(&ConnParam::new(), T).unwrap();
            handles.push(thread::spawn(move || receive_all(conn, slots, conn_no, msgs)));
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<u64>>()
    });
    let credits = common::caps::iwarp();
    let senders: Vec<_> = (0..10u8)
        .map(|conn_no| {
            thread::spawn(move || {
                let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
                let pd = route.alloc_pd().unwrap();
                let mut slots =
                    MemoryRegion::new(&pd, SLOT * DEPTH, AccessFlags::LOCAL_WRITE).unwrap().split(SLOT).unwrap();
                let q = route.create_qp(&pd, QpInit::new()).unwrap();
                let mut conn = q.connect(&ConnParam::new().private_data(&[conn_no]).unwrap(), T).unwrap();
                let mut wcs = [WorkCompletion::default(); DEPTH];
                let (mut posted, mut done) = (0u64, 0u64);
                let received = &RECEIVED[conn_no as usize];
                // The receive for message k is posted once the receiver took k - DEPTH.
                let has_receive = |k: u64| !credits || k < received.load(Ordering::Acquire) + DEPTH as u64;
                while done < msgs {
                    if credits && posted == done && posted < msgs && !has_receive(posted) {
                        // Nothing in flight to wait for: the receiver's progress is, bounded.
                        let deadline = Instant::now() + T;
                        while !has_receive(posted) {
                            assert!(
                                Instant::now() < deadline,
                                "connection {conn_no}: the receiver took nothing more within {T:?}"
                            );
                            thread::yield_now();
                        }
                    }
                    while posted < msgs && posted - done < DEPTH as u64 && has_receive(posted) {
                        let slot = &mut slots[(posted % DEPTH as u64) as usize];
                        let (size, seed) = message(conn_no as u64, posted);
                        slot.as_mut_slice().unwrap()[..size].copy_from_slice(&pattern(size, seed));
                        conn.qp_mut().post_send(&[SendWr::send(slot, 0..size).wr_id(posted)]).unwrap();
                        posted += 1;
                    }
                    let n = conn.qp_mut().wait_queue(WorkQueue::Send, &mut wcs, T).unwrap();
                    assert!(n > 0, "connection {conn_no}: no send completion within {T:?}");
                    for wc in &wcs[..n] {
                        assert_eq!(wc.ok().unwrap().wr_id(), done, "send completions in order");
                        done += 1;
                    }
                }
                conn.disconnect(T).unwrap();
                drop((slots, pd));
                done
            })
        })
        .collect();
    let sent: Vec<u64> = senders.into_iter().map(|h| h.join().unwrap()).collect();
    let received = receivers.join().unwrap();
    assert_eq!(sent, vec![msgs; 10]);
    assert_eq!(received, vec![msgs; 10]);
    t.finish();
}

fn receive_all(mut conn: rdma_cm::Connection, mut slots: Vec<MemoryRegion>, conn_no: u64, msgs: u64) -> u64 {
    let mut wcs = [WorkCompletion::default(); DEPTH];
    let mut got = 0u64;
    while got < msgs {
        let n = conn.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
        assert!(n > 0, "connection {conn_no}: no message within {T:?} after {got}");
        for wc in &wcs[..n] {
            let wc = wc.ok().unwrap();
            let slot = &mut slots[wc.wr_id() as usize];
            let (size, seed) = message(conn_no, got);
            assert_eq!(wc.byte_len() as usize, size, "connection {conn_no} message {got}: size");
            // This slot's receive is retired, so its bytes are ours, while the others stay posted.
            assert!(
                slot.as_slice().unwrap()[..size] == pattern(size, seed)[..],
                "connection {conn_no} message {got}: bytes"
            );
            got += 1;
            if got + DEPTH as u64 <= msgs {
                conn.qp_mut().post_recv(&[RecvWr::new(slot, 0..SLOT).wr_id(wc.wr_id())]).unwrap();
            }
            RECEIVED[conn_no as usize].store(got, Ordering::Release);
        }
    }
    // Wait for the sender's disconnect so teardown is orderly (bounded).
    let deadline = Instant::now() + T;
    while !conn.is_disconnected() && Instant::now() < deadline {
        let _ = conn.next_event(Duration::from_millis(200));
    }
    got
}

/// A raw `fork()` while the device may write one region and read another: the child writes its
/// copy of both and leaves with `_exit`; the parent then writes its send buffer, sends it, and
/// the receive that was posted before the fork gets exactly the parent's bytes. So the child
/// neither corrupted what the device uses (its writes reached its own copies) nor freed it (the
/// kernel's resource counts are unchanged, and the parent's objects keep working).
#[test]
fn a_forked_child_neither_corrupts_nor_frees_the_parents_registered_memory() {
    let t = DeviceTest::start();
    let status = rdma_cm::fork_status();
    if status != rdma_cm::ForkStatus::Unneeded {
        // Only a kernel without copy-on-fork for pinned pages (before 5.13) gets here.
        common::skipped("fork with registered memory", &format!("fork_status is {status:?}: see rdma_cm::verbs::fork"));
        return t.finish();
    }
    let server = PairSpec { mr_sizes: vec![4096], pre_recv: vec![(1, 4096)], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec { mr_sizes: vec![4096], ..PairSpec::default() }, server);
    let before = common::resources();
    let (recv_buf, send_buf) = (s.mrs[0].addr() as *mut u8, c.mrs[0].addr() as *mut u8);
    // SAFETY: the child runs only async-signal-safe code: two writes through raw pointers into
    // its own copy of the address space, then _exit (no destructor, no allocation, no lock).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: both buffers are 4096 bytes, mapped in the child's copy of the address space.
        unsafe {
            std::ptr::write_bytes(recv_buf, 0x5a, 4096);
            std::ptr::write_bytes(send_buf, 0xa5, 4096);
            libc::_exit(0);
        }
    }
    let mut wstatus = 0;
    // SAFETY: waits for our own child; `wstatus` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut wstatus, 0) }, pid);
    assert!(libc::WIFEXITED(wstatus) && libc::WEXITSTATUS(wstatus) == 0, "child status {wstatus:#x}");
    assert_eq!(common::resources(), before, "the child's exit freed none of the parent's RDMA objects");
    // The parent writes its send buffer after the fork (where a shared copy-on-write page would
    // be copied for the parent, away from the device), and sends it.
    let data = pattern(4096, 77);
    c.mrs[0].write_at(0, &data).unwrap();
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..4096).wr_id(7)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 7, T).expect("the send completes");
    let wc = s.conn.qp_mut().wait_for(WorkQueue::Recv, 1, T).expect("the receive posted before the fork completes");
    assert_eq!(wc.byte_len(), 4096);
    assert_eq!(
        s.mrs[0].as_slice().unwrap(),
        &data[..],
        "the device read and wrote the parent's pages, not the child's"
    );
    drop((c, s));
    t.finish();
}
