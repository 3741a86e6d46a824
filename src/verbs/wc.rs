//! [`WorkCompletion`]: a completion as the provider wrote it, decoded on demand.

use std::fmt;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::status::{WcOpcode, WcStatus, WorkQueue};

/// A work completion, copied out of the CQ.
///
/// Kept as the provider wrote it (`ibv_wc`'s fields in `ibv_wc`'s order, the `wr_id` the
/// caller's), so that reaping one is a plain copy; the accessors decode.
#[derive(Clone, Copy, Default)]
pub struct WorkCompletion {
    pub(crate) wr_id: u64,
    /// `ibv_wc_status`, as the provider wrote it ([`WorkCompletion::status`] decodes it).
    pub(crate) status: u32,
    pub(crate) opcode: u32,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    /// The immediate data in network order, when `wc_flags` has `IBV_WC_WITH_IMM`.
    pub(crate) imm: u32,
    pub(crate) qp_num: u32,
    /// The sender's QP number (UD receives).
    pub(crate) src_qp: u32,
    pub(crate) wc_flags: u32,
    pub(crate) pkey_index: u16,
    pub(crate) slid: u16,
    pub(crate) sl: u8,
    pub(crate) dlid_path_bits: u8,
    pub(crate) queue: WorkQueue,
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id)
            .field("status", &self.status())
            .field("opcode", &self.opcode)
            .field("vendor_err", &self.vendor_err)
            .field("byte_len", &self.byte_len)
            .field("imm", &self.imm_data())
            .field("qp_num", &self.qp_num)
            .field("queue", &self.queue)
            .field("src_qp", &self.src_qp)
            .field("wc_flags", &self.wc_flags)
            .field("pkey_index", &self.pkey_index)
            .field("slid", &self.slid)
            .field("sl", &self.sl)
            .field("dlid_path_bits", &self.dlid_path_bits)
            .finish()
    }
}

impl WorkCompletion {
    #[inline(always)]
    pub(crate) fn from_raw(wc: &ffi::ibv_wc, wr_id: u64, queue: WorkQueue) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status: wc.status,
            opcode: wc.opcode,
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            // SAFETY: both members of the union are u32s, so either reads a valid value; it
            // is read as immediate data only when IBV_WC_WITH_IMM says it is one.
            imm: unsafe { wc.imm_data_invalidated_rkey_union.imm_data },
            qp_num: wc.qp_num,
            src_qp: wc.src_qp,
            wc_flags: wc.wc_flags,
            pkey_index: wc.pkey_index,
            slid: wc.slid,
            sl: wc.sl,
            dlid_path_bits: wc.dlid_path_bits,
            queue,
        }
    }

    /// The completion as libibverbs lays it out (for `ibv_init_ah_from_wc`); `wr_id` is the
    /// caller's, the opcode and status as received.
    pub(crate) fn to_raw(self) -> ffi::ibv_wc {
        ffi::ibv_wc {
            wr_id: self.wr_id,
            status: self.status,
            opcode: self.opcode,
            vendor_err: self.vendor_err,
            byte_len: self.byte_len,
            imm_data_invalidated_rkey_union: ffi::imm_data_invalidated_rkey_union_t { imm_data: self.imm },
            qp_num: self.qp_num,
            src_qp: self.src_qp,
            wc_flags: self.wc_flags,
            pkey_index: self.pkey_index,
            slid: self.slid,
            sl: self.sl,
            dlid_path_bits: self.dlid_path_bits,
        }
    }

    /// The sender's QP number (a UD receive's; meaningless for RC and for sends).
    pub fn src_qp(&self) -> u32 {
        self.src_qp
    }

    /// Whether the received packet carried a GRH (`IBV_WC_GRH`): on RoCE every datagram does,
    /// and the first 40 bytes of the receive buffer hold it ([`crate::Grh`]). On a UD QP those
    /// 40 bytes are taken whether or not a GRH was present.
    pub fn has_grh(&self) -> bool {
        self.wc_flags & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0
    }

    /// The sender's LID (InfiniBand; 0 on RoCE).
    pub fn slid(&self) -> u16 {
        self.slid
    }

    /// The service level of the received packet.
    pub fn sl(&self) -> u8 {
        self.sl
    }

    /// The partition key index of the received packet (UD).
    pub fn pkey_index(&self) -> u16 {
        self.pkey_index
    }

    /// The `wr_id` the caller gave the work request.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.status)
    }

    /// Whether it succeeded.
    #[inline]
    pub fn is_ok(&self) -> bool {
        self.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// `Ok(self)` on success, else [`Error::WorkCompletion`] with the status and vendor error.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] when the status is not `SUCCESS`.
    pub fn ok(self) -> Result<WorkCompletion> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion { wr_id: self.wr_id, status: self.status(), vendor_err: self.vendor_err })
        }
    }

    /// The operation, for successful completions (`None` otherwise: the field is undefined
    /// for errors).
    pub fn opcode(&self) -> Option<WcOpcode> {
        self.is_ok().then(|| WcOpcode::from_raw(self.opcode))
    }

    /// Bytes received (receives) or transferred (RDMA READ).
    pub fn byte_len(&self) -> u32 {
        self.byte_len
    }

    /// The provider-specific error code.
    pub fn vendor_err(&self) -> u32 {
        self.vendor_err
    }

    /// Immediate data in host order, when the peer sent any: on a receive's completion only.
    /// (`IBV_WC_WITH_IMM` is defined for receives; rxe also sets it on the sender's completion
    /// of a send or WRITE with immediate, with the value 0, which is not data anyone sent.)
    pub fn imm_data(&self) -> Option<u32> {
        (self.queue == WorkQueue::Recv && self.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            .then(|| u32::from_be(self.imm))
    }

    /// The completion's flags as the provider wrote them (`ibv_wc_flags`: `IBV_WC_GRH`,
    /// `IBV_WC_WITH_IMM`, `IBV_WC_WITH_INV`, …).
    pub fn wc_flags(&self) -> u32 {
        self.wc_flags
    }

    /// The rkey the peer's send with invalidate invalidated (`IBV_WC_WITH_INV`, on a receive).
    pub fn invalidated_rkey(&self) -> Option<u32> {
        (self.queue == WorkQueue::Recv && self.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_INV.0 != 0).then_some(self.imm)
    }

    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The queue the work request was posted to.
    pub fn queue(&self) -> WorkQueue {
        self.queue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping() {
        use ffi::ibv_wc_status::*;
        assert_eq!(WcStatus::from_raw(IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(WcStatus::from_raw(IBV_WC_RNR_RETRY_EXC_ERR), WcStatus::RnrRetryExcErr);
        assert_eq!(WcStatus::from_raw(IBV_WC_WR_FLUSH_ERR).to_string(), "WR_FLUSH_ERR");
        assert_eq!(WcStatus::from_raw(4242), WcStatus::Other(4242));
        assert!(WcStatus::RnrRetryExcErr.hint().unwrap().contains("no receive posted"));
    }

    #[test]
    fn failed_completion_becomes_error_and_hides_opcode() {
        let wc = WorkCompletion {
            status: ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
            vendor_err: 0x81,
            wr_id: 9,
            ..Default::default()
        };
        assert_eq!(wc.opcode(), None);
        let e = wc.ok().unwrap_err();
        let m = e.to_string();
        assert!(m.contains("REM_ACCESS_ERR") && m.contains("0x81") && m.contains("rkey"), "{m}");
        let ok = WorkCompletion { opcode: ffi::ibv_wc_opcode::IBV_WC_RECV, ..Default::default() };
        assert_eq!(ok.opcode(), Some(WcOpcode::Recv));
    }
}
