use super::LaneQp;
use crate::error::Error;
use crate::error::Result;
use crate::status::WcOpcode;
use crate::status::WcStatus;
use crate::status::WorkQueue;
use crate::verbs::mr::MemoryRegion;
use rdma_sys as ffi;
use std::fmt;

/// The fields of an `ibv_wc` after its `wr_id`, as the provider wrote them, decoded only when
/// asked.
#[derive(Clone, Copy, Default)]
pub(super) struct Fields {
    pub(super) status: u32,
    pub(super) opcode: u32,
    pub(super) vendor_err: u32,
    pub(super) byte_len: u32,
    pub(super) imm: u32,
    pub(super) qp_num: u32,
    pub(super) src_qp: u32,
    pub(super) wc_flags: u32,
    pub(super) pkey_index: u16,
    pub(super) slid: u16,
    pub(super) sl: u8,
    pub(super) dlid_path_bits: u8,
}

impl Fields {
    /// The fields of `wc`, read one by one: where the caller of [`Lane::poll_with`](crate::verbs::lane::Lane::poll_with) reads only
    /// some of them, the others are never loaded (a copy of the whole would be kept in memory).
    #[inline(always)]
    pub(super) fn of(wc: &ffi::ibv_wc) -> Fields {
        Fields {
            status: wc.status,
            opcode: wc.opcode,
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            // SAFETY: both members of the union are a `u32` (immediate data or an invalidated
            // rkey, as the flags say): any bits are a valid value.
            imm: unsafe { wc.imm_data_invalidated_rkey_union.imm_data },
            qp_num: wc.qp_num,
            src_qp: wc.src_qp,
            wc_flags: wc.wc_flags,
            pkey_index: wc.pkey_index,
            slid: wc.slid,
            sl: wc.sl,
            dlid_path_bits: wc.dlid_path_bits,
        }
    }
}

/// Flags of a [`Completion`].
pub(super) const RECV: u8 = 1;
pub(super) const SIGNALED: u8 = 2;
/// A receive of one of the lane's shared receive queues.
pub(super) const SRQ: u8 = 8;

/// A completion as [`Lane::poll_with`](crate::verbs::lane::Lane::poll_with) hands it out: the completion's fields as the provider
/// wrote them (decoded by the accessors), and nothing to drop. The region of its work request
/// comes beside it. [`Completion`] is the two together, as [`Lane::poll`](crate::verbs::lane::Lane::poll) returns them.
#[derive(Clone, Copy)]
pub struct Wc {
    pub(super) wr_id: u64,
    pub(super) f: Fields,
    pub(super) place: u16,
    /// Its QP's attach number (`LaneQp`); 0 for an SRQ receive of a QP removed since.
    pub(super) attach: u64,
    pub(super) flags: u8,
}

/// A completion reaped by [`Lane::poll`](crate::verbs::lane::Lane::poll): its fields ([`Wc`], whose accessors it shares) and the
/// work request's region, handed back ([`Completion::take_region`]).
pub struct Completion {
    wc: Wc,
    mr: Option<MemoryRegion>,
}

impl fmt::Debug for Wc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wc")
            .field("qp", &self.qp())
            .field("wr_id", &self.wr_id())
            .field("queue", &self.queue())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("qp_num", &self.qp_num())
            .field("signaled", &self.is_signaled())
            .finish()
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion").field("wc", &self.wc).field("region", &self.mr.is_some()).finish()
    }
}

impl std::ops::Deref for Completion {
    type Target = Wc;
    #[inline(always)]
    fn deref(&self) -> &Wc {
        &self.wc
    }
}

impl Completion {
    #[inline(always)]
    pub(super) fn new(wc: Wc, mr: Option<MemoryRegion>) -> Completion {
        Completion { wc, mr }
    }

    /// The region of the work request, handed back (once; `None` afterwards, and for work that
    /// named no region, such as an inline send).
    #[inline(always)]
    pub fn take_region(&mut self) -> Option<MemoryRegion> {
        self.mr.take()
    }

    /// Its fields and its region, apart.
    #[inline(always)]
    pub fn into_parts(self) -> (Wc, Option<MemoryRegion>) {
        (self.wc, self.mr)
    }

    /// `Ok(self)` on success.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] with the status, its usual cause and the vendor error. The
    /// region is dropped with the completion: call [`Completion::take_region`] first to keep
    /// it.
    pub fn ok(self) -> Result<Completion> {
        match self.wc.error() {
            None => Ok(self),
            Some(e) => Err(e),
        }
    }
}

impl Wc {
    /// The `wr_id` the work request was given.
    #[inline(always)]
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The QP it belongs to (`None` for an SRQ receive taken by a QP removed from the lane
    /// since: see [`Wc::qp_num`]).
    #[inline]
    pub fn qp(&self) -> Option<LaneQp> {
        (self.attach != 0).then_some(LaneQp { attach: self.attach, place: self.place })
    }

    /// Whether it is a receive posted to one of the lane's shared receive queues
    /// ([`Lane::post_srq_recv`](super::Lane::post_srq_recv)).
    #[inline]
    pub fn is_srq(&self) -> bool {
        self.flags & SRQ != 0
    }

    /// The QP number.
    #[inline]
    pub fn qp_num(&self) -> u32 {
        self.f.qp_num
    }

    /// False for an unsignaled work request retired by a later signaled completion of its
    /// queue (it succeeded: its fields other than the status, `wr_id` and queue say nothing).
    #[inline]
    pub fn is_signaled(&self) -> bool {
        self.flags & SIGNALED != 0
    }

    /// The queue it completed on.
    #[inline]
    pub fn queue(&self) -> WorkQueue {
        if self.flags & RECV != 0 {
            WorkQueue::Recv
        } else {
            WorkQueue::Send
        }
    }

    /// Whether it succeeded.
    #[inline(always)]
    pub fn is_ok(&self) -> bool {
        self.f.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The status.
    #[inline]
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.f.status)
    }

    /// `None` on success; otherwise [`Error::WorkCompletion`] with the status, its usual cause
    /// and the vendor error.
    #[inline]
    pub fn error(&self) -> Option<Error> {
        (!self.is_ok()).then(|| Error::WorkCompletion {
            wr_id: self.wr_id,
            status: self.status(),
            vendor_err: self.f.vendor_err,
        })
    }

    /// The operation, for successful signaled completions.
    #[inline]
    pub fn opcode(&self) -> Option<WcOpcode> {
        (self.is_signaled() && self.is_ok()).then(|| WcOpcode::from_raw(self.f.opcode))
    }

    /// Bytes received (receives) or transferred (RDMA READ).
    #[inline]
    pub fn byte_len(&self) -> u32 {
        self.f.byte_len
    }

    /// Immediate data of a receive, in host order, when the peer sent any.
    #[inline]
    pub fn imm_data(&self) -> Option<u32> {
        (self.flags & RECV != 0 && self.f.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            .then(|| u32::from_be(self.f.imm))
    }

    /// The sender's QP number (UD receives).
    #[inline]
    pub fn src_qp(&self) -> u32 {
        self.f.src_qp
    }

    /// Whether the received packet carried a GRH (`IBV_WC_GRH`): on RoCE every datagram does,
    /// and the first 40 bytes of the receive buffer hold it ([`crate::verbs::ah::Grh`]). On a UD QP those
    /// 40 bytes are taken whether or not a GRH was present.
    #[inline]
    pub fn has_grh(&self) -> bool {
        self.f.wc_flags & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0
    }

    /// The sender's LID (InfiniBand; 0 on RoCE).
    #[inline]
    pub fn slid(&self) -> u16 {
        self.f.slid
    }

    /// The service level of the received packet.
    #[inline]
    pub fn sl(&self) -> u8 {
        self.f.sl
    }

    /// The partition key index of the received packet (UD).
    #[inline]
    pub fn pkey_index(&self) -> u16 {
        self.f.pkey_index
    }

    /// The provider-specific error code.
    #[inline]
    pub fn vendor_err(&self) -> u32 {
        self.f.vendor_err
    }

    /// The completion's flags as the provider wrote them (`ibv_wc_flags`: `IBV_WC_GRH`,
    /// `IBV_WC_WITH_IMM`, `IBV_WC_WITH_INV`, …).
    #[inline]
    pub fn wc_flags(&self) -> u32 {
        self.f.wc_flags
    }

    /// The completion as libibverbs lays it out (for `ibv_init_ah_from_wc`).
    pub(crate) fn to_raw(self) -> ffi::ibv_wc {
        let f = self.f;
        ffi::ibv_wc {
            wr_id: self.wr_id,
            status: f.status,
            opcode: f.opcode,
            vendor_err: f.vendor_err,
            byte_len: f.byte_len,
            imm_data_invalidated_rkey_union: ffi::imm_data_invalidated_rkey_union_t { imm_data: f.imm },
            qp_num: f.qp_num,
            src_qp: f.src_qp,
            wc_flags: f.wc_flags,
            pkey_index: f.pkey_index,
            slid: f.slid,
            sl: f.sl,
            dlid_path_bits: f.dlid_path_bits,
        }
    }
}
