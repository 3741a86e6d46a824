//! Device tests of multicast through rdma_cm: joins (full member and send-only), sends to the
//! group with every byte checked, loopback, leave on drop (the kernel's IGMP membership shows
//! it), the bad inputs (a unicast address as the group, loopback-off where the device cannot,
//! an IPv6 group over RoCE v2); and `examples/mckey` against itself and against rdma-core's
//! `mckey` in both directions.

mod common;

use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{lines_of, pattern, require, Cap, DeviceTest, T};
use rdma_cm::{
    AccessFlags, Datagram, Error, JoinKind, McastClient, McastEndpoint, MemoryRegion, QpInit, RecvWr, UdSendWr,
    WorkCompletion, WorkQueue, GRH_LEN, MULTICAST_QPN, RDMA_UDP_QKEY,
};

fn group(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// An endpoint bound (through `src`) to the device, its QP created with loopback on.
fn endpoint(src: IpAddr, g: IpAddr) -> McastEndpoint {
    let r = McastClient::new().unwrap().resolve(Some(src), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    r.create_qp(&pd, QpInit::new().max_send_wr(8).max_recv_wr(8)).unwrap()
}

/// Whether the kernel holds an IGMP membership of `g` on some netdev (`ip maddr`): a full
/// member's join on RoCE v2 adds one, its leave removes it.
fn igmp_member(g: IpAddr) -> bool {
    let out = Command::new("ip").args(["maddr", "show"]).output().expect("run `ip maddr show`");
    assert!(out.status.success());
    // "inet  239.1.2.1" (with "users N" after it while several members share the group)
    let g = g.to_string();
    String::from_utf8_lossy(&out.stdout).lines().any(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.len() >= 2 && w[0] == "inet" && w[1] == g
    })
}

/// Reaps one receive completion within `T` and checks it is `wr_id`.
fn recv_one(ep: &mut McastEndpoint, wr_id: u64) -> WorkCompletion {
    ep.qp_mut().wait_for(WorkQueue::Recv, wr_id, T).unwrap()
}

#[test]
fn two_members_exchange_datagrams_through_the_group_every_byte_checked() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let g = group("239.1.2.1");
    let (size, count) = (700usize, 4usize);
    let mut rx = endpoint(t.addr, g);
    let mut tx = endpoint(t.addr, g);
    let rpd = Arc::clone(rx.qp().pd());
    let tpd = Arc::clone(tx.qp().pd());
    let mut bufs = MemoryRegion::new(&rpd, count * (GRH_LEN + size), AccessFlags::LOCAL_WRITE)
        .unwrap()
        .split(GRH_LEN + size)
        .unwrap();
    for (i, b) in bufs.iter().enumerate() {
        rx.qp_mut().post_recv(&[RecvWr::new(b, 0..GRH_LEN + size).wr_id(i as u64)]).unwrap();
    }
    // The sender is a full member too: with loopback on, its own QP gets what it sends.
    let mut own = MemoryRegion::new(&tpd, GRH_LEN + size, AccessFlags::LOCAL_WRITE).unwrap();
    tx.qp_mut().post_recv(&[RecvWr::new(&own, 0..GRH_LEN + size).wr_id(99)]).unwrap();
    let rm = rx.join(JoinKind::FullMember, T).unwrap();
    let tm = tx.join(JoinKind::FullMember, T).unwrap();
    assert!(igmp_member(g), "a full member's join adds the kernel's IGMP membership");
    for m in [&rm, &tm] {
        assert_eq!(m.group(), g);
        assert_eq!(m.kind(), JoinKind::FullMember);
        assert_eq!(m.dest().qpn(), MULTICAST_QPN, "the group is addressed as QPN 0xFFFFFF");
        assert_eq!(m.qkey(), RDMA_UDP_QKEY, "the join's QKey is the UDP port space's");
        assert_eq!(m.mgid().ipv4(), Some("239.1.2.1".parse().unwrap()), "the MGID is the IPv4-mapped group");
    }
    let mut out = MemoryRegion::new(&tpd, size, AccessFlags::LOCAL_WRITE).unwrap();
    let qpn = tx.qp().qp_num();
    for (i, buf) in bufs.iter_mut().enumerate() {
        let msg = pattern(size - i, i as u8 + 1);
        out.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(&msg);
        tx.qp_mut().post_send(&[UdSendWr::send(tm.dest(), &out, 0..msg.len()).imm(qpn).wr_id(i as u64)]).unwrap();
        tx.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap();
        let wc = recv_one(&mut rx, i as u64);
        let d = Datagram::parse(&wc, buf, 0).unwrap();
        assert_eq!(d.payload(), GRH_LEN..GRH_LEN + msg.len());
        assert_eq!(d.src_qp(), qpn, "the datagram names its sender's QP");
        assert_eq!(d.imm_data(), Some(qpn));
        assert_eq!(d.src_ip(), Some(t.addr), "the sender's address, from the GRH");
        assert_eq!(d.grh().unwrap().dgid().unwrap().ipv4(), Some("239.1.2.1".parse().unwrap()), "sent to the group");
        assert_eq!(&buf.as_slice().unwrap()[d.payload()], &msg[..], "datagram {i} differs");
        if i == 0 {
            // Loopback on: the sender's own QP received its first datagram too.
            let wc = recv_one(&mut tx, 99);
            let d = Datagram::parse(&wc, &mut own, 0).unwrap();
            assert_eq!(d.src_qp(), qpn);
            assert_eq!(&own.as_slice().unwrap()[d.payload()], &msg[..]);
        }
    }
    drop((rm, tm));
    assert!(!igmp_member(g), "dropping both memberships left the group");
    drop((rx, tx, bufs, out, own, rpd, tpd));
    t.finish();
}

#[test]
fn a_send_only_member_sends_to_the_group_but_receives_nothing_from_it() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let g = group("239.1.2.2");
    let mut rx = endpoint(t.addr, g);
    let mut so = endpoint(t.addr, g);
    let rpd = Arc::clone(rx.qp().pd());
    let spd = Arc::clone(so.qp().pd());
    let rbuf =
        MemoryRegion::new(&rpd, 2 * (GRH_LEN + 64), AccessFlags::LOCAL_WRITE).unwrap().split(GRH_LEN + 64).unwrap();
    for (i, b) in rbuf.iter().enumerate() {
        rx.qp_mut().post_recv(&[RecvWr::new(b, 0..GRH_LEN + 64).wr_id(i as u64)]).unwrap();
    }
    let sbuf = MemoryRegion::new(&spd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    so.qp_mut().post_recv(&[RecvWr::new(&sbuf, 0..GRH_LEN + 64).wr_id(7)]).unwrap();
    let sm = so.join(JoinKind::SendOnlyFullMember, T).unwrap();
    assert_eq!(sm.kind(), JoinKind::SendOnlyFullMember);
    assert!(!igmp_member(g), "a send-only join sends no IGMP report");
    let rm = rx.join(JoinKind::FullMember, T).unwrap();
    let mut out = MemoryRegion::new(&spd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    out.as_mut_slice().unwrap().copy_from_slice(&pattern(64, 9));
    so.qp_mut().post_send(&[UdSendWr::send(sm.dest(), &out, 0..64).wr_id(1)]).unwrap();
    so.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    let wc = recv_one(&mut rx, 0);
    let mut rbuf = rbuf;
    let d = Datagram::parse(&wc, &mut rbuf[0], 0).unwrap();
    assert_eq!(d.src_qp(), so.qp().qp_num());
    assert_eq!(&rbuf[0].as_slice().unwrap()[d.payload()], &pattern(64, 9)[..], "the send-only member's datagram");
    // The full member sends too, and gets its own datagram back (loopback): by then the
    // group's datagrams have reached every attached QP, and the send-only member is not one.
    let mut out2 = MemoryRegion::new(&rpd, 8, AccessFlags::LOCAL_WRITE).unwrap();
    out2.as_mut_slice().unwrap().fill(3);
    rx.qp_mut().post_send(&[UdSendWr::send(rm.dest(), &out2, 0..8).wr_id(2)]).unwrap();
    rx.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    recv_one(&mut rx, 1);
    let mut wcs = [WorkCompletion::default(); 2];
    assert_eq!(so.qp_mut().poll_queue(WorkQueue::Recv, &mut wcs).unwrap(), 0, "the send-only member received");
    assert_eq!(so.qp().outstanding_recvs(), 1);
    drop((sm, rm));
    drop((rx, so, rbuf, sbuf, out, out2, rpd, spd));
    t.finish();
}

#[test]
fn dropping_the_membership_leaves_the_group_in_either_order_with_the_endpoint() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let g = group("239.1.2.3");
    // Membership first, then the endpoint.
    let mut ep = endpoint(t.addr, g);
    let m = ep.join(JoinKind::FullMember, T).unwrap();
    assert!(igmp_member(g));
    drop(m);
    assert!(!igmp_member(g), "the membership's drop left the group (rdma_leave_multicast)");
    // The same endpoint joins again after leaving, and leaves explicitly.
    let m = ep.join(JoinKind::FullMember, T).unwrap();
    assert!(igmp_member(g), "a re-join after the leave joins again");
    m.leave().unwrap();
    assert!(!igmp_member(g));
    // The endpoint (its QP) first, then the membership: the leave still happens, with the
    // QP already gone (librdmacm then has no QP to detach).
    let m = ep.join(JoinKind::FullMember, T).unwrap();
    drop(ep);
    assert!(igmp_member(g), "the membership holds the id: still joined");
    drop(m);
    assert!(!igmp_member(g), "the membership's drop after the endpoint's left the group");
    t.finish();
}

#[test]
fn a_unicast_address_as_the_group_is_refused_naming_it() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    for bad in [t.addr, group("127.0.0.1"), group("fd77::1")] {
        let src = if bad.is_ipv4() { t.addr } else { group("fd77::1") };
        let e = McastClient::new().unwrap().resolve(Some(src), bad, T).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let m = e.to_string();
        assert!(m.contains(&bad.to_string()) && m.contains("is not a multicast address"), "{m}");
    }
    // And a join of a unicast address on an endpoint bound through a real group.
    let mut ep = endpoint(t.addr, group("239.1.2.4"));
    let e = ep.join_group(t.addr, JoinKind::FullMember, T).unwrap_err();
    assert!(e.to_string().contains(&format!("{} is not a multicast address", t.addr)), "{e}");
    // A group of the other family than the id's.
    let e = ep.join_group(group("ff0e::1:4"), JoinKind::FullMember, T).unwrap_err();
    assert!(e.to_string().contains("not of the family"), "{e}");
    drop(ep);
    t.finish();
}

#[test]
fn loopback_off_is_a_clear_error_where_the_device_cannot_block_it() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let g = group("239.1.2.5");
    let r = McastClient::new().unwrap().resolve(Some(t.addr), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    match r.loopback(false).create_qp(&pd, QpInit::new()) {
        Err(e @ Error::Call { .. }) => {
            // rxe: the flag is refused (as `mckey -l` is there).
            assert_eq!(e.errno(), Some(libc::EOPNOTSUPP), "{e}");
            let m = e.to_string();
            assert!(
                m.contains("IBV_QP_CREATE_BLOCK_SELF_MCAST_LB") && m.contains("cannot block multicast loopback"),
                "{m}"
            );
        }
        Err(e) => panic!("expected a Call error naming the flag, got {e:?}"),
        Ok(mut ep) => {
            // A device that blocks it: the sender's own datagram does not come back, while
            // another member gets it.
            assert!(!ep.loopback());
            let mut other = endpoint(t.addr, g);
            let opd = Arc::clone(other.qp().pd());
            let mut ob = MemoryRegion::new(&opd, GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
            other.qp_mut().post_recv(&[RecvWr::new(&ob, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
            let own = MemoryRegion::new(&pd, GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
            ep.qp_mut().post_recv(&[RecvWr::new(&own, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
            let om = other.join(JoinKind::FullMember, T).unwrap();
            let m = ep.join(JoinKind::FullMember, T).unwrap();
            let out = MemoryRegion::new(&pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
            ep.qp_mut().post_send(&[UdSendWr::send(m.dest(), &out, 0..8).wr_id(2)]).unwrap();
            ep.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
            let wc = recv_one(&mut other, 1);
            assert_eq!(Datagram::parse(&wc, &mut ob, 0).unwrap().src_qp(), ep.qp().qp_num());
            let mut wcs = [WorkCompletion::default(); 1];
            assert_eq!(ep.qp_mut().poll_queue(WorkQueue::Recv, &mut wcs).unwrap(), 0, "loopback was not blocked");
            drop((m, om, ep, other, ob, own, out, opd));
        }
    }
    drop(pd);
    t.finish();
}

#[test]
fn an_ipv6_group_over_roce_v2_is_refused_with_the_cause() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let Ok(src6) = std::env::var("RDMA_VM_ADDR6").map(|a| a.parse::<IpAddr>().unwrap()) else {
        panic!("this test needs the guest's IPv6 address (RDMA_VM_ADDR6): run it through harness/runner");
    };
    let g = group("ff0e::1:6");
    let r = McastClient::new().unwrap().resolve(Some(src6), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    let mut ep = r.create_qp(&pd, QpInit::new()).unwrap();
    match ep.join(JoinKind::FullMember, T) {
        Err(e) => {
            // Linux joins only IPv4 groups over RoCE v2 (cma_iboe_join_multicast: ENOTSUPP).
            assert_eq!(e.errno(), Some(524), "{e}");
            let m = e.to_string();
            assert!(m.contains("rdma_join_multicast_ex") && m.contains("ff0e::1:6"), "{m}");
            assert!(m.contains("only IPv4 groups over RoCE v2"), "{m}");
        }
        Ok(m) => {
            // A kernel that joins IPv6 groups: the membership names its group.
            assert_eq!(m.mgid().to_ipv6(), "ff0e::1:6".parse::<std::net::Ipv6Addr>().unwrap());
        }
    }
    drop((ep, pd));
    t.finish();
}

// ---- examples/mckey against itself and rdma-core's mckey ----

fn mckey_example() -> String {
    common::example("mckey").to_string_lossy().into_owned()
}

const WITHIN: Duration = Duration::from_secs(90);

/// Waits for `child`, bounded; kills it (and panics) past `within`.
fn wait_output(mut child: std::process::Child, within: Duration, what: &str) -> std::process::Output {
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("{what} did not end within {within:?}: killed. It said:\n{}", text(&out));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Runs `receiver` until it prints `receiving data transfers` (rdma-core's `mckey` under
/// `stdbuf -oL`, so its lines arrive as printed): both mckeys print it once every one of their
/// ids has joined and attached its QP, whereas the first `joined` line may come while a second
/// id is still joining. Then runs `sender` to completion; returns both outputs after checking
/// both succeeded.
fn run_pair(receiver: &[&str], sender: &[&str]) -> (String, String) {
    let mut rcmd = Command::new(receiver[0]);
    rcmd.args(&receiver[1..]).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut rchild = rcmd.spawn().unwrap_or_else(|e| panic!("spawn {receiver:?}: {e}"));
    let lines = lines_of(&mut rchild);
    let mut seen = vec![];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !seen.iter().any(|l: &String| l.starts_with("receiving data transfers")) {
        match lines.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
            Ok(l) => seen.push(l),
            Err(_) => {
                let _ = rchild.kill();
                panic!("{receiver:?} was not receiving within 60 s; it said:\n{}", seen.join("\n"));
            }
        }
    }
    let mut scmd = Command::new(sender[0]);
    scmd.args(&sender[1..]).stdout(Stdio::piped()).stderr(Stdio::piped());
    let s = wait_output(scmd.spawn().unwrap(), WITHIN, "the sender");
    let st = text(&s);
    let r = wait_output(rchild, WITHIN, "the receiver");
    // The reader thread ends with the receiver's stdout: every line is in the channel now.
    seen.extend(lines.iter());
    seen.push(text(&r));
    let rt = seen.join("\n");
    assert!(s.status.success(), "sender {sender:?} failed:\n{st}\nreceiver said:\n{rt}");
    assert!(r.status.success(), "receiver {receiver:?} failed:\n{rt}\nsender said:\n{st}");
    (rt, st)
}

fn assert_lines(out: &str, lines: &[&str]) {
    let got: Vec<&str> = out.lines().collect();
    let mut at = 0;
    for want in lines {
        match got[at..].iter().position(|l| l.starts_with(want)) {
            Some(k) => at += k + 1,
            None => panic!("no line {want:?} (in order) in:\n{out}"),
        }
    }
}

const SENDER_LINES: [&str; 7] = [
    "mckey: starting client",
    "mckey: joining",
    "mckey: joined dgid: ::ffff:",
    "initiating data transfers",
    "data transfers complete",
    "test complete",
    "return status 0",
];

#[test]
fn mckey_example_against_itself_two_receiving_ids_every_byte_checked() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let common = ["-m", "239.1.2.7", "-b", a.as_str(), "-C", "6", "-S", "1000"];
    let mut rx = vec![me.as_str(), "-c", "2", "--verify"];
    rx.extend_from_slice(&common);
    let mut tx = vec![me.as_str(), "-s", "--settle", "0"];
    tx.extend_from_slice(&common);
    let (r, s) = run_pair(&rx, &tx);
    assert_lines(&s, &SENDER_LINES);
    assert_lines(
        &r,
        &[
            "mckey: starting server",
            "mckey: joined dgid: ::ffff:239.1.2.7 mlid 0x0 sl 0",
            "mckey: joined dgid: ::ffff:239.1.2.7 mlid 0x0 sl 0",
            "receiving data transfers",
            "mckey: 12 datagrams checked: 1000 bytes each, sent to the group, immediate data = the sender's QP number, every byte",
            "data transfers complete",
            "return status 0",
        ],
    );
    t.finish();
}

#[test]
fn mckey_example_receives_from_rdma_cores_mckey_sender() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let common = ["-m", "239.1.2.8", "-b", a.as_str(), "-C", "5", "-S", "300"];
    let mut rx = vec![me.as_str()];
    rx.extend_from_slice(&common);
    let mut tx = vec!["mckey", "-s"];
    tx.extend_from_slice(&common);
    let (r, s) = run_pair(&rx, &tx);
    assert_lines(&s, &SENDER_LINES);
    // mckey sends uninitialised bytes: the checks are the size, the group and the immediate
    // data (mckey's QP number, which the completion names as the source).
    assert_lines(
        &r,
        &[
            "mckey: joined dgid: ::ffff:239.1.2.8 mlid 0x0 sl 0",
            "receiving data transfers",
            "mckey: 5 datagrams checked: 300 bytes each, sent to the group, immediate data = the sender's QP number",
            "data transfers complete",
            "return status 0",
        ],
    );
    t.finish();
}

#[test]
fn rdma_cores_mckey_receives_from_the_mckey_example() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let common = ["-m", "239.1.2.9", "-b", a.as_str(), "-C", "5", "-S", "300"];
    // mckey's stdout is a pipe here: line-buffer it so its joined line arrives as printed.
    let mut rx = vec!["stdbuf", "-oL", "mckey"];
    rx.extend_from_slice(&common);
    let mut tx = vec![me.as_str(), "-s", "--settle", "0"];
    tx.extend_from_slice(&common);
    let (r, s) = run_pair(&rx, &tx);
    assert_lines(&s, &SENDER_LINES);
    // mckey's receiver returns only after it has reaped all five receives.
    assert_lines(
        &r,
        &[
            "mckey: starting server",
            "mckey: joined dgid: ::ffff:239.1.2.9 mlid 0x0 sl 0",
            "receiving data transfers",
            "data transfers complete",
            "return status 0",
        ],
    );
    t.finish();
}

#[test]
fn mckey_example_and_mckey_refuse_loopback_off_alike_on_rxe() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let (me, a) = (mckey_example(), t.addr.to_string());
    let args = ["-m", "239.1.2.10", "-b", a.as_str(), "-s", "-l", "-C", "1"];
    for prog in [me.as_str(), "mckey"] {
        let mut cmd = Command::new(prog);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        if prog == me {
            cmd.args(["--settle", "0"]);
        }
        let out = wait_output(cmd.spawn().unwrap(), WITHIN, prog);
        let o = text(&out);
        assert!(!out.status.success(), "{prog} -l succeeded:\n{o}");
        let line =
            o.lines().find(|l| l.starts_with("mckey: unable to create QP: ")).unwrap_or_else(|| panic!("{prog}: {o}"));
        assert!(line.contains("Operation not supported"), "{prog}: {line}");
        assert!(!o.contains("initiating data transfers"), "{prog} went on:\n{o}");
    }
    t.finish();
}

// ---- soundness and allocation on the multicast data path ----

struct Counting;

static ALLOCS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    // const-initialised and without a destructor: reading it never allocates.
    static WATCH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

// SAFETY: every call forwards to the system allocator unchanged; the counter is an atomic.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if WATCH.with(|w| w.get()) {
            ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: forwarded; `p` came from System.alloc with `l`.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        if WATCH.with(|w| w.get()) {
            ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // SAFETY: forwarded.
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn watched<T>(f: impl FnOnce() -> T) -> T {
    WATCH.with(|w| w.set(true));
    let r = f();
    WATCH.with(|w| w.set(false));
    r
}

/// Polls `queue` of `ep` until one completion arrives (bounded), counting only the polls.
fn poll_one(ep: &mut McastEndpoint, queue: WorkQueue, wcs: &mut [WorkCompletion; 4]) -> WorkCompletion {
    let deadline = std::time::Instant::now() + T;
    loop {
        let n = watched(|| ep.qp_mut().poll_queue(queue, wcs)).unwrap();
        if n > 0 {
            assert_eq!(n, 1);
            return wcs[0].ok().unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "no completion within {T:?}");
    }
}

#[test]
fn posting_to_the_group_and_polling_allocate_nothing() {
    const N: u64 = 2_000;
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let g = group("239.1.2.11");
    let mut rx = endpoint(t.addr, g);
    let mut tx = endpoint(t.addr, g);
    let rpd = Arc::clone(rx.qp().pd());
    let tpd = Arc::clone(tx.qp().pd());
    let mut rbuf = MemoryRegion::new(&rpd, GRH_LEN + 256, AccessFlags::LOCAL_WRITE).unwrap();
    let out = MemoryRegion::new(&tpd, 256, AccessFlags::LOCAL_WRITE).unwrap();
    let _rm = rx.join(JoinKind::FullMember, T).unwrap();
    let tm = tx.join(JoinKind::SendOnlyFullMember, T).unwrap();
    let mut wcs = [WorkCompletion::default(); 4];
    ALLOCS.store(0, std::sync::atomic::Ordering::SeqCst);
    drop(watched(|| std::hint::black_box(Vec::<u8>::with_capacity(10))));
    assert_eq!(ALLOCS.load(std::sync::atomic::Ordering::SeqCst), 1, "the counting allocator must see allocations");
    ALLOCS.store(0, std::sync::atomic::Ordering::SeqCst);
    for i in 0..N {
        let len = 1 + (i as usize % 256);
        watched(|| rx.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 256).wr_id(i)])).unwrap();
        watched(|| tx.qp_mut().post_send(&[UdSendWr::send(tm.dest(), &out, 0..len).wr_id(i)])).unwrap();
        assert_eq!(poll_one(&mut tx, WorkQueue::Send, &mut wcs).wr_id(), i);
        let wc = poll_one(&mut rx, WorkQueue::Recv, &mut wcs);
        assert_eq!((wc.wr_id(), wc.byte_len() as usize), (i, GRH_LEN + len));
        assert_eq!(watched(|| Datagram::parse(&wc, &mut rbuf, 0)).unwrap().len(), len);
    }
    let allocs = ALLOCS.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(allocs, 0, "{allocs} allocations in {N} multicast sends and receives (post, poll, parse)");
    drop((tm, _rm, rx, tx, rbuf, out, rpd, tpd));
    t.finish();
}

#[test]
fn leaving_with_a_send_in_flight_keeps_the_groups_address_handle_until_the_completion() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let g = group("239.1.2.12");
    let mut tx = endpoint(t.addr, g);
    let pd = Arc::clone(tx.qp().pd());
    let out = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let m = tx.join(JoinKind::SendOnlyFullMember, T).unwrap();
    let ah = Arc::downgrade(m.dest().ah());
    tx.qp_mut().post_send(&[UdSendWr::send(m.dest(), &out, 0..64).wr_id(5)]).unwrap();
    m.leave().unwrap();
    // The membership and its destination are gone; the posted send still holds the handle.
    assert!(ah.upgrade().is_some(), "the group's AH was destroyed under a posted send");
    let wc = tx.qp_mut().wait_for(WorkQueue::Send, 5, T).unwrap();
    assert!(wc.is_ok());
    assert!(ah.upgrade().is_none(), "the AH outlived the completion that retired its slot");
    drop((tx, out, pd));
    t.finish();
}

/// rxe attaches at most `max_mcast_qp_attach` (56) QPs to one group: the join past that gets a
/// `MULTICAST_ERROR` event (librdmacm turns the JOIN into one when `ibv_attach_mcast` fails),
/// which the join reports naming the group, and leaves the group behind it.
#[test]
fn a_join_whose_qp_cannot_be_attached_is_a_multicast_error_naming_the_group() {
    let t = DeviceTest::start();
    if !require(Cap::Multicast) {
        return;
    }
    let g = group("239.1.2.13");
    let mut members = vec![];
    let mut failed = None;
    for i in 0..80 {
        let r = McastClient::new().unwrap().resolve(Some(t.addr), g, T).unwrap();
        let pd = r.alloc_pd().unwrap();
        let mut ep = r.create_qp(&pd, QpInit::new().max_send_wr(1).max_recv_wr(1)).unwrap();
        match ep.join(JoinKind::FullMember, T) {
            Ok(m) => members.push((m, ep)),
            Err(e) => {
                failed = Some((i, e));
                break;
            }
        }
    }
    let Some((i, e)) = failed else { panic!("80 QPs attached to one group: the device has no attach limit below 80") };
    assert!(i >= 1, "the first join failed: {e}");
    match &e {
        Error::UnexpectedEvent { got, expected, .. } => {
            assert_eq!(*got, rdma_cm::CmEventType::MulticastError, "{e}");
            assert_eq!(*expected, rdma_cm::CmEventType::MulticastJoin, "{e}");
        }
        e => panic!("expected a MULTICAST_ERROR, got {e:?}"),
    }
    let m = e.to_string();
    assert!(m.contains("MULTICAST_ERROR") && m.contains("239.1.2.13"), "{m}");
    assert!(m.contains("could not attach the QP") && m.contains("max_mcast_qp_attach"), "{m}");
    eprintln!("join {i} failed (rxe's max_mcast_qp_attach): {m}");
    assert!(igmp_member(g), "the {i} members before it are still joined");
    drop(members);
    assert!(!igmp_member(g), "every member left");
    t.finish();
}
