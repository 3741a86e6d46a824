//! A client speaking the verbs itself to one of the crate's stream servers, as a hostile or
//! an rsocket-like peer would: valid connection data (a grant of 2,048 bytes of its receive
//! buffer, 16 credits) and as many receives posted as a test asks. With none, the stream's
//! messages wait on RNR retries (each 0.01 ms here) until [`RawPeer::post_recvs`].
#![allow(dead_code)] // each stream test binary uses part of it

use std::net::SocketAddr;
use std::sync::Arc;

use rdma_cm::stream::wire::{ConnData, Sge};
use rdma_cm::verbs::lane::{Lane, LaneQp, RecvWr};
use rdma_cm::{AccessFlags, Client, ConnParam, MemoryRegion, ProtectionDomain, QpInit, RemoteRegion};

use crate::common::{DeviceTest, T};

pub struct RawPeer {
    pub lane: Lane,
    pub qp: LaneQp,
    pub pd: Arc<ProtectionDomain>,
    /// The first half the server granted.
    pub half: RemoteRegion,
    /// This side's receive buffer, whose first 2,048 bytes the server was granted.
    pub rbuf: MemoryRegion,
    _sgl: MemoryRegion,
}

impl RawPeer {
    /// Connected to the stream server on `port`, with `recvs` receives posted before.
    pub fn connect(t: &DeviceTest, port: u16, recvs: usize) -> RawPeer {
        let route = Client::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(t.addr, port), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = Lane::new(&route.context().unwrap(), 512).unwrap();
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rbuf = MemoryRegion::new(&pd, 4096, remote).unwrap();
        let sgl = MemoryRegion::new(&pd, 32, remote).unwrap();
        let client = route.lane_qp(&mut lane, &pd, QpInit::new().max_recv_wr(64).max_send_wr(256)).unwrap();
        let qp = client.qp();
        let mine = ConnData::new(
            16,
            Sge { addr: sgl.addr(), key: sgl.rkey(), length: 2 },
            Sge { addr: rbuf.addr(), key: rbuf.rkey(), length: 2048 },
        );
        let mut peer = RawPeer { lane, qp, pd, half: RemoteRegion::new(0, 0, 0), rbuf, _sgl: sgl };
        peer.post_recvs(recvs);
        let param = ConnParam::new().min_rnr_timer(1).private_data(&mine.encode()).unwrap();
        let reply = client.connect(&mut peer.lane, &param, T).unwrap();
        let theirs = ConnData::decode(&reply).expect("the server's connection data");
        peer.half = RemoteRegion::new(theirs.data_buf.addr, theirs.data_buf.key, u64::from(theirs.data_buf.length));
        peer
    }

    /// Posts `n` receives of no bytes (every stream message is immediate data).
    pub fn post_recvs(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        for r in MemoryRegion::new(&self.pd, n, AccessFlags::LOCAL_WRITE).unwrap().split(1).unwrap() {
            self.lane.post_recv(self.qp, RecvWr::range(r, 0..0).wr_id(1)).unwrap();
        }
    }
}
