//! A UD pair in one process, for measurements that post with the raw verbs beside the lane: a
//! client endpoint with the server's destination (from the UD connect) and the server's
//! endpoint. Neither is on a lane; nothing is posted here.

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::thread;

use rdma_cm::cm::ud_cm::{UdClient, UdEndpoint, UdServer};
use rdma_cm::verbs::ud::UdDest;
use rdma_cm::QpInit;

use super::setup_timeout;

pub struct UdPair {
    pub client: UdEndpoint,
    /// The server's QP, from the client.
    pub to_server: UdDest,
    pub server: UdEndpoint,
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
        req.create_qp(&pd, sinit).unwrap().accept(&[]).unwrap()
    });
    rx.recv_timeout(t).unwrap();
    let route =
        UdClient::new().unwrap().resolve_addr(None, SocketAddr::new(addr, port), t).unwrap().resolve_route(t).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut client = route.create_qp(&pd, init).unwrap();
    let to_server = client.connect(&[], t).unwrap();
    let server = server.join().unwrap();
    UdPair { client, to_server, server }
}
