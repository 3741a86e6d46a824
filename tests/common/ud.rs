//! A UD pair in one process: a server endpoint and a client endpoint, each with the other's
//! destination (the client's from the UD connect, the server's from the client's first
//! datagram).

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::thread;

use rdma_cm::{
    AccessFlags, Datagram, MemoryRegion, QpInit, RecvWr, UdClient, UdDest, UdEndpoint, UdSendWr, UdServer, WorkQueue,
    GRH_LEN,
};

use super::setup_timeout;

pub struct UdPair {
    pub client: UdEndpoint,
    /// The server's QP, from the client.
    pub to_server: UdDest,
    pub server: UdEndpoint,
    /// The client's QP, from the server (made from the client's first datagram).
    pub to_client: UdDest,
}

/// Sets up a UD pair on `port` with `init` on both sides.
pub fn ud_pair(addr: IpAddr, port: u16, init: QpInit) -> UdPair {
    let t = setup_timeout();
    let (tx, rx) = mpsc::channel();
    let sinit = init.clone();
    let server = thread::spawn(move || {
        let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, port), 8).unwrap();
        tx.send(()).unwrap();
        let req = l.get_request(t).unwrap();
        let pd = req.alloc_pd().unwrap();
        let mut hello = MemoryRegion::new(&pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut sq = req.create_qp(&pd, sinit).unwrap();
        sq.post_recv(&[RecvWr::new(&hello, 0..GRH_LEN + 64).wr_id(u64::MAX)]).unwrap();
        let mut ep = sq.accept(&[]).unwrap();
        let wc = ep.qp_mut().wait_for(WorkQueue::Recv, u64::MAX, t).unwrap();
        let d = Datagram::parse(&wc, &mut hello, 0).unwrap();
        let to_client = UdDest::reply_to(ep.qp(), &d, rdma_cm::RDMA_UDP_QKEY).unwrap();
        (ep, to_client)
    });
    rx.recv_timeout(t).unwrap();
    let route =
        UdClient::new().unwrap().resolve_addr(None, SocketAddr::new(addr, port), t).unwrap().resolve_route(t).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut client = route.create_qp(&pd, init).unwrap();
    let to_server = client.connect(&[], t).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, b"hello").wr_id(u64::MAX)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, u64::MAX, t).unwrap();
    let (server, to_client) = server.join().unwrap();
    UdPair { client, to_server, server, to_client }
}
