//! Device tests of unreliable datagrams (UD) through rdma_cm: the UD "connect", addressed
//! sends, receives with the GRH accounted for, and the bad inputs (a message over the MTU, a
//! receive without room for the GRH, an address handle nobody can reach).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::thread;

use common::lane::{lane_on, reap};
use common::{pattern, require, Cap, DeviceTest, T};
use rdma_cm::cm::ud_cm::{UdClient, UdServer};
use rdma_cm::verbs::ah::{AddressHandle, AhAttr, GRH_LEN};
use rdma_cm::verbs::lane::{InlineWr, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::verbs::port::Gid;
use rdma_cm::verbs::ud::{Datagram, UdDest, RDMA_UDP_QKEY};
use rdma_cm::{AccessFlags, Error, MemoryRegion, ProtectionDomain, QpInit, WorkQueue};

/// A UD server on `port` in a thread: accepts one request, attaches its endpoint to a lane of
/// its own, posts `count` receives of up to `size` bytes (then says so on `posted`), receives
/// `count` datagrams, and echoes each back to its sender (address handle made from the
/// datagram). Sends on `ready` once it listens; returns what it received.
fn echo_server(
    addr: IpAddr,
    port: u16,
    size: usize,
    count: usize,
    ready: mpsc::Sender<()>,
    posted: mpsc::Sender<()>,
) -> Vec<Vec<u8>> {
    let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, port), 8).unwrap();
    ready.send(()).unwrap();
    let req = l.get_request(T).unwrap();
    let pd = req.alloc_pd().unwrap();
    let mut lane = Lane::new(&req.context().unwrap(), 4 * count as u32).unwrap();
    let init = lane.qp_init_from(QpInit::new().max_send_wr(count as u32).max_recv_wr(count as u32));
    let ep = req.create_qp(&pd, init).unwrap().accept(&[]).unwrap();
    let port_num = ep.qp().port_num();
    let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("attach the server's endpoint");
    for i in 0..count {
        let buf = MemoryRegion::new(&pd, GRH_LEN + size, AccessFlags::LOCAL_WRITE).unwrap();
        lane.post_recv(qp, RecvWr::new(buf).wr_id(i as u64)).unwrap();
    }
    posted.send(()).unwrap();
    let mut got = vec![];
    // Receives that completed before the echo's send did: the client sends its next datagram
    // as soon as it has the echo, and the CQ may hold that receive before the send's
    // completion (rxe completes a UD send from a task of its own).
    let mut early = std::collections::VecDeque::new();
    for i in 0..count {
        let next = early.pop_front().unwrap_or_else(|| lane.wait(T).expect("a datagram"));
        let mut c = next.ok().expect("received");
        assert_eq!((c.wr_id(), c.queue()), (i as u64, WorkQueue::Recv), "the receives complete in order");
        let mut buf = c.take_region().unwrap();
        let wc = *c;
        let d = Datagram::parse(&wc, &mut buf, 0).unwrap();
        let grh = d.grh().expect("RoCE datagrams carry a GRH");
        let ah = AddressHandle::reply_to(&pd, port_num, &wc, grh).unwrap();
        let to = lane.add_dest(qp, &UdDest::new(ah, d.src_qp(), RDMA_UDP_QKEY)).unwrap();
        got.push(buf.as_slice().unwrap()[d.payload()].to_vec());
        let len = d.len();
        lane.post_send(qp, SendWr::send(buf, GRH_LEN..GRH_LEN + len).to(to).wr_id(100 + i as u64)).unwrap();
        let sent = loop {
            let c = lane.wait(T).expect("the echo's completion");
            if c.queue() == WorkQueue::Recv {
                early.push_back(c);
                continue;
            }
            break c;
        };
        assert!(sent.is_ok() && sent.wr_id() == 100 + i as u64, "{sent:?}");
    }
    got
}

/// A UD client of `port`, not connected yet, its endpoint made with `lane`'s CQ.
fn client(lane: &Lane, addr: IpAddr, port: u16) -> (rdma_cm::cm::ud_cm::UdEndpoint, std::sync::Arc<ProtectionDomain>) {
    let route =
        UdClient::new().unwrap().resolve_addr(None, SocketAddr::new(addr, port), T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    (route.create_qp(&pd, lane.qp_init()).unwrap(), pd)
}

/// The echo server in a thread: its handle, and the word that its receives are posted.
#[allow(clippy::type_complexity)]
fn start_echo(
    addr: IpAddr,
    port: u16,
    size: usize,
    count: usize,
) -> (thread::JoinHandle<Vec<Vec<u8>>>, mpsc::Receiver<()>) {
    let (ready, listening) = mpsc::channel();
    let (posted, receives) = mpsc::channel();
    let server = thread::spawn(move || echo_server(addr, port, size, count, ready, posted));
    listening.recv_timeout(T).unwrap();
    (server, receives)
}

#[test]
fn ud_connect_send_and_echo_with_grh_and_bytes_checked() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let (port, size, count) = (7301, 512, 4);
    let (server, receives) = start_echo(t.addr, port, size, count);
    let mut lane = lane_on(t.addr, 64);
    let (mut ep, pd) = client(&lane, t.addr, port);
    assert!(ep.qp().mtu() >= 1024, "rxe's active MTU: {}", ep.qp().mtu());
    assert_eq!(ep.qp().qkey(), RDMA_UDP_QKEY);
    let dest = ep.connect(b"hello", T).unwrap();
    assert_eq!(dest.qkey(), RDMA_UDP_QKEY, "the server's QKey comes with the ESTABLISHED event");
    assert_ne!(dest.qpn(), 0);
    let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("attach the client's endpoint");
    let to_server = lane.add_dest(qp, &dest).unwrap();
    receives.recv_timeout(T).expect("the server's receives are posted");
    let mut out = Some(MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE).unwrap());
    let mut back = Some(MemoryRegion::new(&pd, GRH_LEN + size, AccessFlags::LOCAL_WRITE).unwrap());
    for i in 0..count {
        let msg = pattern(size - i, i as u8);
        let mut o = out.take().unwrap();
        o.as_mut_slice().unwrap()[..msg.len()].copy_from_slice(&msg);
        lane.post_recv(qp, RecvWr::new(back.take().unwrap()).wr_id(50)).unwrap();
        lane.post_send(qp, SendWr::send(o, 0..msg.len()).imm(7).to(to_server).wr_id(1)).unwrap();
        for mut c in reap(&mut lane, 2) {
            assert!(c.is_ok(), "{c:?}");
            let mut region = c.take_region().unwrap();
            if c.wr_id() == 1 {
                out = Some(region);
                continue;
            }
            assert_eq!((c.wr_id(), c.queue()), (50, WorkQueue::Recv));
            let wc = *c;
            let d = Datagram::parse(&wc, &mut region, 0).unwrap();
            assert_eq!(d.payload(), GRH_LEN..GRH_LEN + msg.len(), "the payload follows the 40-byte GRH area");
            assert_eq!(d.src_qp(), dest.qpn(), "the echo comes from the server's QP");
            assert!(wc.has_grh(), "RoCE datagrams carry a GRH");
            assert_eq!(d.src_ip(), Some(t.addr), "the sender's address from the GRH");
            assert_eq!(&region.as_slice().unwrap()[d.payload()], &msg[..], "echo {i} differs");
            back = Some(region);
        }
    }
    let got = server.join().unwrap();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g, &pattern(size - i, i as u8), "server got message {i} wrong");
    }
    drop((lane, out, back, dest, pd));
    t.finish();
}

/// A datagram one byte over the MTU is refused before anything is posted, naming both sizes,
/// and its region comes back; exactly the MTU goes.
#[test]
fn a_datagram_over_the_mtu_is_refused_before_posting() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let (server, receives) = start_echo(t.addr, 7302, 16, 1);
    let mut lane = lane_on(t.addr, 64);
    let (mut ep, pd) = client(&lane, t.addr, 7302);
    let mtu = ep.qp().mtu() as usize;
    let big = MemoryRegion::new(&pd, mtu + 1, AccessFlags::LOCAL_WRITE).unwrap();
    let dest = ep.connect(&[], T).unwrap();
    let qp: LaneQp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("attach");
    let to = lane.add_dest(qp, &dest).unwrap();
    let (e, big) = lane.post_send(qp, SendWr::send(big, 0..mtu + 1).to(to)).unwrap_err().into_parts();
    match &e {
        Error::MessageTooLong { len, mtu: m } => assert_eq!((*len as usize, *m as usize), (mtu + 1, mtu)),
        e => panic!("expected MessageTooLong, got {e}"),
    }
    let m = e.to_string();
    assert!(m.contains(&format!("{}", mtu + 1)) && m.contains(&format!("{mtu}")), "{m}");
    assert_eq!(lane.outstanding(qp).unwrap(), (0, 0), "nothing was posted");
    let big = big.expect("the refused datagram's region comes back");
    // Exactly the MTU goes (the server echoes it: 16 bytes fit its buffer, so send 16).
    receives.recv_timeout(T).expect("the server's receive is posted");
    lane.post_recv(qp, RecvWr::range(big, 0..GRH_LEN + 16).wr_id(2)).unwrap();
    let small = MemoryRegion::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
    lane.post_send(qp, SendWr::send(small, 0..16).to(to).wr_id(1)).unwrap();
    let mut done = reap(&mut lane, 2);
    done.sort_by_key(|c| c.wr_id());
    assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
    assert_eq!((done[1].wr_id(), done[1].byte_len() as usize), (2, GRH_LEN + 16), "the echo");
    server.join().unwrap();
    drop((lane, done, dest, pd));
    t.finish();
}

/// A UD receive without room for the 40-byte GRH is refused, naming both, and its region comes
/// back; exactly 40 bytes takes an empty datagram.
#[test]
fn a_receive_without_room_for_the_grh_is_refused() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return;
    }
    let (tx, rx) = mpsc::channel();
    let (posted_tx, posted) = mpsc::channel();
    let addr = t.addr;
    let server = thread::spawn(move || {
        let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, 7303), 8).unwrap();
        tx.send(()).unwrap();
        let req = l.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mut lane = Lane::new(&req.context().unwrap(), 64).unwrap();
        let ep = req.create_qp(&pd, lane.qp_init()).unwrap().accept(&[]).unwrap();
        let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("attach");
        let mr = MemoryRegion::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let (e, mr) = lane.post_recv(qp, RecvWr::range(mr, 0..GRH_LEN - 1)).unwrap_err().into_parts();
        let m = e.to_string();
        assert!(m.contains("39 bytes") && m.contains("40-byte GRH"), "{m}");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 0));
        // Exactly 40 bytes takes an empty datagram.
        let mr = mr.expect("the refused receive's region comes back");
        lane.post_recv(qp, RecvWr::range(mr, 0..GRH_LEN).wr_id(3)).unwrap();
        posted_tx.send(()).unwrap();
        let mut c = lane.wait(T).expect("the empty datagram").ok().expect("received");
        assert_eq!(c.wr_id(), 3);
        let mut mr = c.take_region().unwrap();
        let d = Datagram::parse(&c, &mut mr, 0).unwrap();
        assert!(d.is_empty());
    });
    rx.recv_timeout(T).unwrap();
    let mut lane = lane_on(t.addr, 64);
    let (mut ep, pd) = client(&lane, t.addr, 7303);
    let dest = ep.connect(&[], T).unwrap();
    let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("attach");
    let to = lane.add_dest(qp, &dest).unwrap();
    posted.recv_timeout(T).expect("the server's receive is posted");
    lane.post_inline(qp, InlineWr::send(&[]).to(to).wr_id(1)).unwrap();
    let sent = lane.wait(T).unwrap();
    assert!(sent.is_ok() && sent.wr_id() == 1, "{sent:?}");
    server.join().unwrap();
    drop((lane, dest, pd));
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
    let mut lane = lane_on(t.addr, 64);
    let (ep, pd) = client(&lane, t.addr, 7304);
    let port = ep.qp().port_num();
    let qp = lane.attach(ep).map_err(|r| r.into_parts().0).expect("attach");
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
    let to = lane.add_dest(qp, &dest).unwrap();
    lane.post_inline(qp, InlineWr::send(b"anyone?").to(to).wr_id(9)).unwrap();
    let c = lane.wait(T).unwrap();
    assert_eq!(c.wr_id(), 9);
    assert!(c.is_ok(), "{:?}", c.status());
    drop((lane, pd, dest));
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
    let lane = lane_on(t.addr, 64);
    let (mut ep, pd) = client(&lane, t.addr, 7305);
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
    drop((ep, pd, lane));
    t.finish();
}
