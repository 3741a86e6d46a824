//! What a stream registers: the receive buffer and target SGL the peer writes into, the send
//! buffer (a ring of chunks), one tiny region per receive (their sizes: [`StreamConfig`]).

use std::sync::Arc;

use crate::error::Result;
use crate::stream::config::StreamConfig;
use crate::stream::wire::{ConnData, Sge, SGE_LEN, SGL_SLOTS};
use crate::verbs::lane::{Lane, LaneQp, RecvWr};
use crate::verbs::mr::{AccessFlags, MemoryRegion, Spare};
use crate::verbs::pd::ProtectionDomain;

/// Minimum RNR NAK timer this side's QP asks of a peer whose message found no receive (IB
/// code 12, 0.64 ms): never needed while the spare receives last, short if it is.
pub(super) const MIN_RNR_TIMER: u8 = 12;
/// `wr_id` of a receive.
pub(super) const WR_RECV: u64 = 1;
/// `wr_id` of a data WRITE.
pub(super) const WR_DATA: u64 = 2;
/// `wr_id` of a control message or grant.
pub(super) const WR_CTRL: u64 = 3;
/// `wr_id` of a data WRITE straight from a caller's region ([`Stream::write_region`]).
///
/// [`Stream::write_region`]: crate::stream::Stream::write_region
pub(super) const WR_REGION: u64 = 4;

/// What a stream registers: its receive buffer and target SGL (remotely writable, read only
/// with volatile copies), its send buffer (one chunk, and the spare handles its ring splits
/// into), and one tiny region per receive.
pub(super) struct Buffers {
    pub(super) rbuf: MemoryRegion,
    pub(super) sgl: MemoryRegion,
    pub(super) send: MemoryRegion,
    pub(super) spares: Vec<Spare>,
    recvs: Vec<MemoryRegion>,
    pub(super) cfg: StreamConfig,
}

impl Buffers {
    pub(super) fn new(pd: &Arc<ProtectionDomain>, cfg: &StreamConfig) -> Result<Buffers> {
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rbuf = MemoryRegion::new(pd, cfg.rbuf_size(), remote)?;
        let sgl = MemoryRegion::new(pd, SGL_SLOTS as usize * SGE_LEN, remote)?;
        // The ring holds a chunk per WRITE in flight and at most two free ones (the free space
        // may wrap around the end); two more for slack.
        let (send, spares) =
            MemoryRegion::new(pd, cfg.sbuf_size(), AccessFlags::empty())?.with_spares(cfg.data_slots() + 4)?;
        // Receives carry no scatter list (`num_sge` 0): every message is immediate data. A
        // receive still moves a region into the lane; one byte each, never touched.
        let recvs = MemoryRegion::new(pd, cfg.recvs() as usize, AccessFlags::LOCAL_WRITE)?.split(1)?;
        Ok(Buffers { rbuf, sgl, send, spares, recvs, cfg: *cfg })
    }

    /// This side's connection data: its credits, its target SGL, the first half of its
    /// receive buffer.
    pub(super) fn conn_data(&self) -> ConnData {
        let sgl = Sge { addr: self.sgl.addr(), key: self.sgl.rkey(), length: SGL_SLOTS };
        let half = Sge { addr: self.rbuf.addr(), key: self.rbuf.rkey(), length: self.cfg.half() as u32 };
        ConnData::new(self.cfg.credits_given(), sgl, half)
    }

    /// Posts every receive on `qp` (before the connect or accept: in place before the peer
    /// can send).
    pub(super) fn post_recvs(&mut self, lane: &mut Lane, qp: LaneQp) -> Result<()> {
        while let Some(r) = self.recvs.pop() {
            lane.post_recv(qp, RecvWr::range(r, 0..0).wr_id(WR_RECV))?;
        }
        Ok(())
    }
}
