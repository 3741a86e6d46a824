//! Device tests of unreliable datagrams (UD) through rdma_cm: the UD "connect", addressed
//! sends, receives with the GRH accounted for, and the bad inputs (a message over the MTU, a
//! receive without room for the GRH, an address handle nobody can reach).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;

use common::{pattern, require, Cap, DeviceTest, T};
use rdma_cm::{
    AccessFlags, AddressHandle, AhAttr, Datagram, Error, Gid, MemoryRegion, QpInit, RecvWr, UdClient, UdDest,
    UdEndpoint, UdSendWr, UdServer, WorkQueue, GRH_LEN, RDMA_UDP_QKEY,
};

/// A UD server on `port` in a thread: accepts one request, receives `count` datagrams of up
/// to `size` bytes, and echoes each back to its sender (address handle made from the
/// datagram). Sends on `ready` once it listens; returns what it received.
fn echo_server(addr: IpAddr, port: u16, size: usize, count: usize, ready: mpsc::Sender<()>) -> Vec<Vec<u8>> {
    let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, port), 8).unwrap();
    ready.send(()).unwrap();
    let req = l.get_request(T).unwrap();
    let pd = req.alloc_pd().unwrap();
    let mut bufs = MemoryRegion::new(&pd, count * (GRH_LEN + size), AccessFlags::LOCAL_WRITE)
        .unwrap()
        .split(GRH_LEN + size)
        .unwrap();
    let mut sq = req.create_qp(&pd, QpInit::new().max_send_wr(count as u32).max_recv_wr(count as u32)).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        sq.post_recv(&[RecvWr::new(b, 0..GRH_LEN + size).wr_id(i as u64)]).unwrap();
    }
    let mut ep = sq.accept(&[]).unwrap();
    let mut got = vec![];
    for (i, buf) in bufs.iter_mut().enumerate() {
        let wc = ep.qp_mut().wait_for(WorkQueue::Recv, i as u64, T).unwrap();
        let d = Datagram::parse(&wc, buf, 0).unwrap();
        let dest = UdDest::reply_to(ep.qp(), &d, RDMA_UDP_QKEY).unwrap();
        let payload = buf.as_slice().unwrap()[d.payload()].to_vec();
        got.push(payload);
        let len = d.len();
        ep.qp_mut().post_send(&[UdSendWr::send(&dest, buf, GRH_LEN..GRH_LEN + len).wr_id(100 + i as u64)]).unwrap();
        ep.qp_mut().wait_for(WorkQueue::Send, 100 + i as u64, T).unwrap();
    }
    got
}

fn client(addr: IpAddr, port: u16) -> UdEndpoint {
    let route =
        UdClient::new().unwrap().resolve_addr(None, SocketAddr::new(addr, port), T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    route.create_qp(&pd, QpInit::new()).unwrap()
}

#[test]
fn ud_connect_send_and_echo_with_grh_and_bytes_checked() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let (port, size, count) = (7301, 512, 4);
    let (tx, rx) = mpsc::channel();
    let addr = t.addr;
    let server = thread::spawn(move || echo_server(addr, port, size, count, tx));
    rx.recv_timeout(T).unwrap();
    let mut ep = client(t.addr, port);
    let pd = Arc::clone(ep.qp().pd());
    assert!(ep.qp().mtu() >= 1024, "rxe's active MTU: {}", ep.qp().mtu());
    assert_eq!(ep.qp().qkey(), RDMA_UDP_QKEY);
    let mut out = MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE).unwrap();
    let mut back = MemoryRegion::new(&pd, GRH_LEN + size, AccessFlags::LOCAL_WRITE).unwrap();
    let dest = ep.connect(b"hello", T).unwrap();
    assert_eq!(dest.qkey(), RDMA_UDP_QKEY, "the server's QKey comes with the ESTABLISHED event");
    assert_ne!(dest.qpn(), 0);
    for i in 0..count {
        let msg = pattern(size - i, i as u8);
        out.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(&msg);
        ep.qp_mut().post_recv(&[RecvWr::new(&back, 0..GRH_LEN + size).wr_id(50)]).unwrap();
        ep.qp_mut().post_send(&[UdSendWr::send(&dest, &out, 0..msg.len()).imm(7).wr_id(1)]).unwrap();
        ep.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
        let wc = ep.qp_mut().wait_for(WorkQueue::Recv, 50, T).unwrap();
        let d = Datagram::parse(&wc, &mut back, 0).unwrap();
        assert_eq!(d.payload(), GRH_LEN..GRH_LEN + msg.len(), "the payload follows the 40-byte GRH area");
        assert_eq!(d.src_qp(), dest.qpn(), "the echo comes from the server's QP");
        assert!(wc.has_grh(), "RoCE datagrams carry a GRH");
        assert_eq!(d.src_ip(), Some(t.addr), "the sender's address from the GRH");
        assert_eq!(&back.as_slice().unwrap()[d.payload()], &msg[..], "echo {i} differs");
    }
    let got = server.join().unwrap();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g, &pattern(size - i, i as u8), "server got message {i} wrong");
    }
    drop((ep, out, back, dest, pd));
    t.finish();
}

#[test]
fn a_datagram_over_the_mtu_is_refused_before_posting() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let (tx, rx) = mpsc::channel();
    let addr = t.addr;
    let server = thread::spawn(move || echo_server(addr, 7302, 16, 1, tx));
    rx.recv_timeout(T).unwrap();
    let mut ep = client(t.addr, 7302);
    let mtu = ep.qp().mtu() as usize;
    let pd = Arc::clone(ep.qp().pd());
    let big = MemoryRegion::new(&pd, mtu + 1, AccessFlags::LOCAL_WRITE).unwrap();
    let dest = ep.connect(&[], T).unwrap();
    let e = ep.qp_mut().post_send(&[UdSendWr::send(&dest, &big, 0..mtu + 1)]).unwrap_err();
    match &e {
        Error::MessageTooLong { len, mtu: m } => assert_eq!((*len as usize, *m as usize), (mtu + 1, mtu)),
        e => panic!("expected MessageTooLong, got {e}"),
    }
    let m = e.to_string();
    assert!(m.contains(&format!("{}", mtu + 1)) && m.contains(&format!("{mtu}")), "{m}");
    assert_eq!(ep.qp().outstanding_sends(), 0, "nothing was posted");
    // Exactly the MTU goes (the server echoes it: 16 bytes fit its buffer, so send 16).
    ep.qp_mut().post_recv(&[RecvWr::new(&big, 0..GRH_LEN + 16).wr_id(2)]).unwrap();
    let small = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
    ep.qp_mut().post_send(&[UdSendWr::send(&dest, &small, 0..16).wr_id(1)]).unwrap();
    ep.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap();
    server.join().unwrap();
    drop((ep, big, small, dest, pd));
    t.finish();
}

#[test]
fn a_receive_without_room_for_the_grh_is_refused() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let (tx, rx) = mpsc::channel();
    let addr = t.addr;
    let server = thread::spawn(move || {
        let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, 7303), 8).unwrap();
        tx.send(()).unwrap();
        let req = l.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut sq = req.create_qp(&pd, QpInit::new()).unwrap();
        let e = sq.post_recv(&[RecvWr::new(&mr, 0..GRH_LEN - 1)]).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("39 bytes") && m.contains("40-byte GRH"), "{m}");
        assert_eq!(sq.qp().outstanding_recvs(), 0);
        // Exactly 40 bytes takes an empty datagram.
        sq.post_recv(&[RecvWr::new(&mr, 0..GRH_LEN).wr_id(3)]).unwrap();
        let mut ep = sq.accept(&[]).unwrap();
        let wc = ep.qp_mut().wait_for(WorkQueue::Recv, 3, T).unwrap();
        let mut mr = mr;
        let d = Datagram::parse(&wc, &mut mr, 0).unwrap();
        assert!(d.is_empty());
    });
    rx.recv_timeout(T).unwrap();
    let mut ep = client(t.addr, 7303);
    let dest = ep.connect(&[], T).unwrap();
    ep.qp_mut().post_send(&[UdSendWr::send_inline(&dest, &[]).wr_id(1)]).unwrap();
    ep.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap();
    server.join().unwrap();
    drop((ep, dest));
    t.finish();
}

/// What rxe does, measured: a GID whose address has no route (IPv6 here: the guest has no
/// IPv6 default route) and a zero GID fail `ibv_create_ah` with EINVAL at once; a source GID
/// index outside the table with ENODATA. A routed IPv4 address where nobody answers gives an
/// AH, and a datagram sent with it completes at once and is lost: the bounded outcome UD allows.
#[test]
fn an_address_handle_for_an_unreachable_gid() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let mut ep = client(t.addr, 7304);
    let pd = Arc::clone(ep.qp().pd());
    let port = ep.qp().port_num();
    let refused: [(&str, Gid, u8, i32, &str); 3] = [
        (
            "an IPv6 GID without a route",
            Gid("2001:db8::9".parse::<std::net::Ipv6Addr>().unwrap().octets()),
            1,
            libc::EINVAL,
            "no route",
        ),
        ("the zero GID", Gid([0; 16]), 1, libc::EINVAL, "zero GID"),
        (
            "a source GID index outside the table",
            Gid(std::net::Ipv4Addr::new(10, 77, 0, 1).to_ipv6_mapped().octets()),
            200,
            libc::ENODATA,
            "GID table",
        ),
    ];
    for (what, gid, idx, errno, hint) in refused {
        let started = std::time::Instant::now();
        let e = AddressHandle::new(&pd, &AhAttr::global(gid, idx, port)).expect_err(what);
        assert!(started.elapsed() < T, "{what}: the failure is bounded");
        assert_eq!(e.errno(), Some(errno), "{what}: {e}");
        let m = e.to_string();
        assert!(m.contains("ibv_create_ah") && m.contains(hint), "{what}: {m}");
    }
    // Routed but nobody there: the AH is made, the datagram completes and is lost.
    let nowhere = Gid(std::net::Ipv4Addr::new(203, 0, 113, 9).to_ipv6_mapped().octets());
    let ah = AddressHandle::new(&pd, &AhAttr::global(nowhere, 1, port)).unwrap();
    assert_eq!(ah.attr().dgid(), nowhere);
    let dest = UdDest::new(ah, 0x1234, RDMA_UDP_QKEY);
    ep.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"anyone?").wr_id(9)]).unwrap();
    let wc = ep.qp_mut().wait_for(WorkQueue::Send, 9, T).unwrap();
    assert!(wc.is_ok(), "{:?}", wc.status());
    drop((ep, pd, dest));
    t.finish();
}

/// Nobody listening: the SIDR reply says so (UNREACHABLE, status 1), at once, and the error
/// says what that means.
#[test]
fn connecting_to_nobody_is_rejected_clearly() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let mut ep = client(t.addr, 7305);
    let started = std::time::Instant::now();
    let e = ep.connect(&[], T).unwrap_err();
    let m = e.to_string();
    match &e {
        Error::UnexpectedEvent { got, status, .. } => {
            assert_eq!((*got, *status), (rdma_cm::CmEventType::Unreachable, 1), "{m}");
        }
        e => panic!("expected UNREACHABLE, got {e}"),
    }
    assert!(m.contains("nobody listens there") && m.contains("7305"), "{m}");
    assert!(started.elapsed() < T, "answered within the bound");
    drop(ep);
    t.finish();
}
