//! Shared helpers of the device suite: finding the device, serialising tests, connecting a
//! loopback pair, and proving through the kernel's accounting that nothing leaked.
//!
//! A device test never passes without a device: `DeviceTest::start` fails loudly when there is
//! none, naming the harness that provides one.
#![allow(dead_code)] // each test binary uses part of this module

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use rdma_cm::{AccessFlags, Client, ConnParam, Connection, MemoryRegion, ProtectionDomain, QpInit, Server};

pub mod caps;
mod device;
pub mod examples;
pub mod lane;
pub mod ud;
#[allow(unused_imports)] // (used by the tests that need what not every device has)
pub use caps::{require, skipped, Cap};
pub use device::device_addr;
#[allow(unused_imports)] // (used by the tests that look at the netdev: device.rs)
pub use device::{ipv4_of, ipv6_of, netdev_of};
#[allow(unused_imports)] // (used by the binaries that run the examples as processes)
pub use examples::example;

pub const T: Duration = Duration::from_secs(10);

/// The bound on a helper's set-up steps (a UD pair's listen, resolve and connect): `T`, or
/// `RDMA_CM_SETUP_TIMEOUT_SECS` when set. harness/bench-instr sets it: under valgrind, on a busy
/// machine, opening the device alone can outlast `T`.
pub fn setup_timeout() -> Duration {
    std::env::var("RDMA_CM_SETUP_TIMEOUT_SECS").ok().and_then(|s| s.parse().ok()).map_or(T, Duration::from_secs)
}

static SERIAL: Mutex<()> = Mutex::new(());

/// One running device test: holds the lock that serialises device tests (so the resource
/// counts belong to one test) and the device's address.
pub struct DeviceTest {
    _guard: MutexGuard<'static, ()>,
    pub addr: IpAddr,
    baseline: Vec<(&'static str, usize)>,
}

impl DeviceTest {
    /// Starts a device test: requires a device, and records the user-space RDMA objects that
    /// exist already (none in the guest, where this suite is alone).
    pub fn start() -> DeviceTest {
        let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let addr = device_addr();
        let baseline = resources();
        if std::env::var_os("RDMA_VM").is_some() && !device_shared() {
            assert!(baseline.iter().all(|(_, n)| *n == 0), "the guest has RDMA objects before the test: {baseline:?}");
        }
        DeviceTest { _guard: guard, addr, baseline }
    }

    /// Fails unless the counts are back to the baseline.
    pub fn check(&self, when: &str) {
        if !device_shared() {
            wait_resources(&self.baseline, when);
        }
    }

    /// Ends the test: every QP, CQ, MR, PD and CM id the test made must be gone.
    pub fn finish(self) {
        self.check("after the test dropped everything");
    }

    /// [`DeviceTest::finish`] for a test whose objects are released by a thread of the crate
    /// that waits for the kernel (a timed-out connect on iWARP waits for TCP to give up):
    /// the counts are waited for up to `bound`.
    #[allow(dead_code)] // one binary uses it
    pub fn finish_within(self, bound: Duration) {
        if !device_shared() {
            wait_resources_within(&self.baseline, "after the test dropped everything", bound);
        }
    }
}

/// Set (to anything) by a test that runs a whole device-test binary as its child while other
/// processes use the device too (the valgrind run in tests/examples.rs). The device-wide counts
/// of `rdma res` then belong to everyone, so they are neither required to start at zero nor
/// compared at the end; that binary's own run in the suite checks them.
pub const SHARED_DEVICE_ENV: &str = "RDMA_CM_TEST_SHARED_DEVICE";

fn device_shared() -> bool {
    std::env::var_os(SHARED_DEVICE_ENV).is_some()
}

/// User-space entries in the kernel's RDMA resource tracking, per type. The kernel records
/// the creating *thread* (and drops the pid once that thread exits), so entries are counted
/// as "not the kernel's" (kernel objects show `comm [module]`), not by our pid. Device tests
/// run one at a time, so the counts are the test's.
pub fn resources() -> Vec<(&'static str, usize)> {
    ["qp", "cq", "mr", "pd", "cm_id"]
        .into_iter()
        .map(|kind| {
            let out = Command::new("rdma").args(["res", "show", kind]).output().expect("run `rdma res show`");
            assert!(out.status.success(), "`rdma res show {kind}` failed: {}", String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8_lossy(&out.stdout);
            (kind, text.lines().filter(|l| !l.trim().is_empty() && !l.contains("comm [")).count())
        })
        .collect()
}

/// Waits (bounded) until something listens on RDMA port `port`, as the kernel's resource
/// tracking reports it: for servers that are not ours and print nothing to wait for.
pub fn wait_listening(port: u16, within: Duration) {
    let deadline = Instant::now() + within;
    let needle = format!(":{port} ");
    loop {
        let out = Command::new("rdma").args(["res", "show", "cm_id"]).output().expect("run `rdma res show cm_id`");
        let text = String::from_utf8_lossy(&out.stdout);
        if text.lines().any(|l| l.contains("LISTEN") && format!("{} ", l.trim_end()).contains(&needle)) {
            return;
        }
        assert!(Instant::now() < deadline, "nothing listened on port {port} within {within:?}:\n{text}");
        thread::sleep(Duration::from_millis(50));
    }
}

/// Waits up to `within` for `child` to exit, with its output; kills it (by its pid) and fails
/// past that.
pub fn wait_exit(child: std::process::Child, within: Duration, what: &str) -> (std::process::ExitStatus, String) {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(out) => {
            let out = out.unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            (out.status, text)
        }
        Err(_) => {
            // SAFETY: kill(2) on the pid of a child this test started and has not reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{what} did not exit within {within:?}");
        }
    }
}

/// Reads `child`'s stdout in a thread; returns a receiver of its lines.
pub fn lines_of(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    lines_from(child.stdout.take().expect("the child's stdout is piped"))
}

/// Reads `child`'s stderr in a thread; returns a receiver of its lines.
#[allow(dead_code)] // some binaries use it
pub fn stderr_lines_of(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    lines_from(child.stderr.take().expect("the child's stderr is piped"))
}

fn lines_from(r: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        for l in std::io::BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits (bounded) for a line containing `needle` from `lines`.
pub fn wait_for_line(lines: &std::sync::mpsc::Receiver<String>, needle: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) if l.contains(needle) => return,
            Ok(_) => {}
            Err(_) => panic!("no line containing {needle:?} within {within:?}"),
        }
    }
}

/// The kernel's count of user-space memory regions (registered and not yet deregistered), or
/// `None` when the device is shared with other processes (see [`SHARED_DEVICE_ENV`]).
/// The index, on port 1 of `ctx`, of the RoCE v2 GID of `addr` (what a QP connected without
/// the CM is given, as `ibv_rc_pingpong -g` is).
pub fn rocev2_gid_index(ctx: &rdma_cm::VerbsContext, addr: IpAddr) -> u32 {
    ctx.gid_table(1)
        .expect("the GID table of port 1")
        .into_iter()
        .find(|e| e.gid.ipv4().map(IpAddr::V4) == Some(addr) && e.gid_type == rdma_cm::verbs::port::GidType::RoceV2)
        .unwrap_or_else(|| panic!("no RoCE v2 GID of {addr} on port 1"))
        .index
}

pub fn mr_count() -> Option<usize> {
    (!device_shared()).then(|| resources().into_iter().find(|(k, _)| *k == "mr").map_or(0, |(_, n)| n))
}

pub fn resource_total() -> usize {
    resources().iter().map(|(_, n)| n).sum()
}

/// Waits (bounded) until the counts are back to `baseline`; panics with the counts if not.
pub fn wait_resources(baseline: &[(&'static str, usize)], when: &str) {
    wait_resources_within(baseline, when, Duration::from_secs(5))
}

/// [`wait_resources`] with its bound.
pub fn wait_resources_within(baseline: &[(&'static str, usize)], when: &str, bound: Duration) {
    let deadline = Instant::now() + bound;
    loop {
        let r = resources();
        if r.iter().zip(baseline).all(|((_, n), (_, b))| n <= b) {
            return;
        }
        if Instant::now() > deadline {
            panic!("RDMA resources leaked {when}: {r:?}, baseline {baseline:?} (from `rdma res show`)");
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// One side of a connected loopback pair, with the regions it registered.
pub struct Side {
    pub conn: Connection,
    pub pd: Arc<ProtectionDomain>,
    pub mrs: Vec<MemoryRegion>,
}

/// How to set up each side of a pair.
#[derive(Clone)]
pub struct PairSpec {
    pub mr_sizes: Vec<usize>,
    pub access: AccessFlags,
    pub init: QpInit,
    pub param: ConnParam,
}

impl Default for PairSpec {
    fn default() -> Self {
        PairSpec {
            mr_sizes: vec![4096],
            access: AccessFlags::LOCAL_WRITE,
            init: QpInit::new(),
            param: ConnParam::new(),
        }
    }
}

/// Connects a client and a server over the device at `addr`, the server accepting in a thread.
/// Returns (client, server).
pub fn pair(addr: IpAddr, client: PairSpec, server: PairSpec) -> (Side, Side) {
    let listener = Server::new().unwrap().bind(SocketAddr::new(addr, 0)).unwrap().listen(8).unwrap();
    let dst = listener.local_addr().expect("listener has an address");
    assert_ne!(dst.port(), 0, "bind to port 0 must pick a port");
    let srv = thread::spawn(move || {
        let req = listener.get_request(T).expect("server: get_request");
        let pd = req.alloc_pd().expect("server: alloc_pd");
        let mrs: Vec<_> =
            server.mr_sizes.iter().map(|&n| MemoryRegion::new(&pd, n, server.access).expect("server: mr")).collect();
        let q = req.create_qp(&pd, server.init.clone()).expect("server: create_qp");
        let conn = q.accept(&server.param, T).expect("server: accept");
        Side { conn, pd, mrs }
    });
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mrs: Vec<_> = client.mr_sizes.iter().map(|&n| MemoryRegion::new(&pd, n, client.access).unwrap()).collect();
    let q = route.create_qp(&pd, client.init.clone()).unwrap();
    let conn = q.connect(&client.param, T).expect("client: connect");
    let server = srv.join().expect("server thread panicked");
    (Side { conn, pd, mrs }, server)
}

/// An IPv4 socket address as a `sockaddr_storage`, for raw librdmacm calls.
pub fn sockaddr_v4(a: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let SocketAddr::V4(v4) = a else { panic!("IPv4 only") };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*v4.ip()).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
    unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
    ss
}

/// The four octets of an IPv4 address.
pub struct IpV4(pub u8, pub u8, pub u8, pub u8);

impl IpV4 {
    pub fn of(a: IpAddr) -> IpV4 {
        match a {
            IpAddr::V4(v) => {
                let [a, b, c, d] = v.octets();
                IpV4(a, b, c, d)
            }
            IpAddr::V6(_) => panic!("the device tests need an IPv4 address"),
        }
    }
}

/// Bytes that differ at every offset of a long run (xorshift), unlike [`pattern`], which
/// repeats every 256 bytes: what a stream's tests send, so that no offset or order mistake
/// reproduces them.
pub fn scrambled(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// A deterministic pattern distinct per `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(131).wrapping_add(seed as u32 * 17 + 3) as u8).collect()
}

/// Every accessor of `mr` refuses while the device may write it.
pub fn out_of_reach(mr: &mut MemoryRegion, what: &str) {
    let mut b = [0u8; 4];
    assert!(matches!(mr.as_slice(), Err(rdma_cm::Error::InFlight { .. })), "{what}: as_slice");
    assert!(matches!(mr.as_mut_slice(), Err(rdma_cm::Error::InFlight { .. })), "{what}: as_mut_slice");
    assert!(matches!(mr.read_at(0, &mut b), Err(rdma_cm::Error::InFlight { .. })), "{what}: read_at");
    assert!(matches!(mr.write_at(0, b"x"), Err(rdma_cm::Error::InFlight { .. })), "{what}: write_at");
}

/// The peer of a lane test as plain libibverbs, as a C program would drive it: posts and
/// polls straight on a connection's QP and its own CQs, beside the crate.
pub mod raw {
    use super::T;
    use rdma_cm::ffi;
    use rdma_cm::{Connection, MemoryRegion};
    use std::ops::Range;
    use std::time::Instant;

    fn sge(mr: &MemoryRegion, range: Range<usize>) -> ffi::ibv_sge {
        assert!(range.end <= mr.len(), "the range is inside the region");
        ffi::ibv_sge { addr: mr.addr() + range.start as u64, length: range.len() as u32, lkey: mr.lkey() }
    }

    /// Sends `mr[range]` and waits for the send's completion.
    pub fn send(conn: &Connection, mr: &MemoryRegion, range: Range<usize>, wr_id: u64) {
        let mut sge = sge(mr, range);
        // SAFETY: ibv_send_wr is plain old data; all-zero is a valid start.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive (held by `conn`); `wr` and `sge` outlive the call, which
        // copies them; `mr` stays registered until the completion is reaped below (it is
        // borrowed until then), and the device only reads it.
        let ret = unsafe { ffi::ibv_post_send(conn.qp().as_raw(), &mut wr, &mut bad) };
        assert_eq!(ret, 0, "ibv_post_send");
        let (status, _) = wait(conn, true, wr_id);
        assert_eq!(status, ffi::ibv_wc_status::IBV_WC_SUCCESS, "the peer's send");
    }

    /// Posts a receive on `mr[range]`. The caller keeps `mr` alive and reads it only after
    /// [`wait`] returned this receive's completion.
    pub fn post_recv(conn: &Connection, mr: &MemoryRegion, range: Range<usize>, wr_id: u64) {
        let mut sge = sge(mr, range);
        // SAFETY: ibv_recv_wr is plain old data; all-zero is a valid start.
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = std::ptr::null_mut();
        // SAFETY: as in `send`; the device writes `mr`, which the caller keeps registered and
        // reads only after the completion (see above).
        let ret = unsafe { ffi::ibv_post_recv(conn.qp().as_raw(), &mut wr, &mut bad) };
        assert_eq!(ret, 0, "ibv_post_recv");
    }

    /// Polls the send (`send == true`) or receive CQ of `conn` until the completion of
    /// `wr_id`, within [`T`]; returns its status and byte count.
    pub fn wait(conn: &Connection, send: bool, wr_id: u64) -> (u32, u32) {
        let qp = conn.qp();
        let cq = if send { qp.send_cq() } else { qp.recv_cq() };
        let deadline = Instant::now() + T;
        loop {
            // SAFETY: ibv_wc is plain old data.
            let mut wc: ffi::ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: the CQ is alive and polled by nobody else (the peer's own); `wc` has room
            // for the one entry asked for.
            let n = unsafe { ffi::ibv_poll_cq(cq.as_raw(), 1, &mut wc) };
            assert!(n >= 0, "ibv_poll_cq: {n}");
            if n == 1 && wc.wr_id == wr_id {
                return (wc.status, wc.byte_len);
            }
            assert!(Instant::now() < deadline, "no completion of {wr_id} within {T:?}");
            std::hint::spin_loop();
        }
    }
}
