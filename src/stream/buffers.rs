//! What a stream registers and how large its queues are: the receive buffer and target SGL the
//! peer writes into, the send buffer in pieces, one tiny region per receive, and the QP's and
//! CQ's sizes that follow from them.

use std::sync::Arc;

use crate::error::Result;
use crate::stream::wire::{ConnData, Sge, SGE_LEN, SGL_SLOTS};
use crate::verbs::lane::{Lane, LaneQp, RecvWr};
use crate::verbs::mr::{AccessFlags, MemoryRegion};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::QpInit;

/// Data messages the peer may have unread at once: the credits this side advertises (rsocket's
/// `rq_size`).
pub(super) const CREDITS: u16 = 128;
/// Receives posted beyond the credits, for the peer's control messages (grants, credit
/// updates, shutdown), which the protocol does not count: with them the peer's messages find
/// a receive posted without leaning on RNR retries.
pub(super) const SPARE_RECVS: u32 = 16;
/// Send-queue entries reserved for control messages (rsocket's `RS_QP_CTRL_SIZE`).
pub(super) const CTRL_SLOTS: usize = 4;
/// The receive buffer: two halves, each granted to the peer as a whole.
pub(super) const RBUF_SIZE: usize = 256 * 1024;
/// One piece of the send buffer: the most one data WRITE carries.
pub(super) const SEND_CHUNK: usize = 16 * 1024;
/// Pieces of the send buffer, so data WRITEs in flight at once.
pub(super) const SEND_CHUNKS: usize = 16;
/// Send-queue depth: every data WRITE in flight, and the control slots.
pub(super) const SQ_SIZE: u32 = (SEND_CHUNKS + CTRL_SLOTS) as u32;
/// Inline bytes asked of the QP: a grant (16 bytes) and control messages go inline.
pub(super) const INLINE: u32 = 64;
/// Minimum RNR NAK timer this side's QP asks of a peer whose message found no receive (IB
/// code 12, 0.64 ms): never needed while the spare receives last, short if it is.
pub(super) const MIN_RNR_TIMER: u8 = 12;
/// `wr_id` of a receive.
pub(super) const WR_RECV: u64 = 1;
/// `wr_id` of a data WRITE.
pub(super) const WR_DATA: u64 = 2;
/// `wr_id` of a control message or grant.
pub(super) const WR_CTRL: u64 = 3;

/// What a stream registers: its receive buffer and target SGL (remotely writable, read only
/// with volatile copies), its send buffer in pieces, and one tiny region per receive.
pub(super) struct Buffers {
    pub(super) rbuf: MemoryRegion,
    pub(super) sgl: MemoryRegion,
    pub(super) send: Vec<MemoryRegion>,
    recvs: Vec<MemoryRegion>,
}

impl Buffers {
    pub(super) fn new(pd: &Arc<ProtectionDomain>) -> Result<Buffers> {
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rbuf = MemoryRegion::new(pd, RBUF_SIZE, remote)?;
        let sgl = MemoryRegion::new(pd, SGL_SLOTS as usize * SGE_LEN, remote)?;
        let send = MemoryRegion::new(pd, SEND_CHUNK * SEND_CHUNKS, AccessFlags::empty())?.split(SEND_CHUNK)?;
        // Receives carry no scatter list (`num_sge` 0): every message is immediate data. A
        // receive still moves a region into the lane; one byte each, never touched.
        let n = usize::from(CREDITS) + SPARE_RECVS as usize;
        let recvs = MemoryRegion::new(pd, n, AccessFlags::LOCAL_WRITE)?.split(1)?;
        Ok(Buffers { rbuf, sgl, send, recvs })
    }

    /// This side's connection data: its credits, its target SGL, the first half of its
    /// receive buffer.
    pub(super) fn conn_data(&self) -> ConnData {
        let sgl = Sge { addr: self.sgl.addr(), key: self.sgl.rkey(), length: SGL_SLOTS };
        let half = Sge { addr: self.rbuf.addr(), key: self.rbuf.rkey(), length: (RBUF_SIZE / 2) as u32 };
        ConnData::new(CREDITS, sgl, half)
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

/// The QP's capabilities: rsocket's shape (one RC QP, every send signaled, inline control
/// messages), sized to this stream's buffers.
pub(super) fn qp_init() -> QpInit {
    QpInit::new().max_send_wr(SQ_SIZE).max_recv_wr(u32::from(CREDITS) + SPARE_RECVS).max_inline_data(INLINE)
}

/// The lane's CQ depth: both queues.
pub(super) fn cq_depth() -> u32 {
    SQ_SIZE + u32::from(CREDITS) + SPARE_RECVS
}
