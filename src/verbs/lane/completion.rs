use super::*;

/// The fields of an `ibv_wc` after its `wr_id`, as the provider wrote them: a completion is
/// copied in one piece and decoded only when asked.
#[repr(C)]
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

// `Fields` is `ibv_wc` from `status` on, field for field.
const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(ffi::ibv_wc, status) == 8);
    assert!(offset_of!(ffi::ibv_wc, qp_num) == 8 + offset_of!(Fields, qp_num));
    assert!(offset_of!(ffi::ibv_wc, wc_flags) == 8 + offset_of!(Fields, wc_flags));
    assert!(offset_of!(ffi::ibv_wc, pkey_index) == 8 + offset_of!(Fields, pkey_index));
    assert!(offset_of!(ffi::ibv_wc, dlid_path_bits) == 8 + offset_of!(Fields, dlid_path_bits));
    assert!(mem::size_of::<ffi::ibv_wc>() >= 8 + mem::size_of::<Fields>());
};

impl Fields {
    /// The fields of `wc`.
    #[inline(always)]
    pub(super) fn of(wc: &ffi::ibv_wc) -> Fields {
        // SAFETY: `Fields` is laid out as `ibv_wc` from offset 8 on (checked above), every field
        // an integer, and `wc` is initialised; offset 8 of an 8-aligned `ibv_wc` is aligned for
        // `Fields`. Its padding may read the C struct's padding, which it never looks at.
        unsafe { std::ptr::read((wc as *const ffi::ibv_wc).cast::<u8>().add(8).cast::<Fields>()) }
    }
}

/// Flags of a [`Completion`].
pub(super) const RECV: u8 = 1;
pub(super) const SIGNALED: u8 = 2;
pub(super) const LANE: u8 = 4;

/// A completion reaped by [`Lane::poll`]: the work request's region, handed back, and the
/// completion's fields as the provider wrote them (decoded by the accessors).
pub struct Completion {
    pub(super) mr: Option<MemoryRegion>,
    pub(super) wr_id: u64,
    pub(super) f: Fields,
    pub(super) place: u16,
    pub(super) gen: u16,
    pub(super) lane: u32,
    pub(super) flags: u8,
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("qp", &self.qp())
            .field("wc", &self.work_completion())
            .field("signaled", &self.is_signaled())
            .field("region", &self.mr.is_some())
            .finish()
    }
}

impl Completion {
    /// The region of the work request, handed back (once; `None` afterwards, and for
    /// completions of the convenient path).
    #[inline(always)]
    pub fn take_region(&mut self) -> Option<MemoryRegion> {
        self.mr.take()
    }

    /// The `wr_id` the work request was given.
    #[inline(always)]
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The QP it belongs to (`None` for a completion of the convenient path of a QP that is
    /// not attached: see [`Completion::qp_num`]).
    pub fn qp(&self) -> Option<LaneQp> {
        self.is_lane().then_some(LaneQp { place: self.place, gen: self.gen, lane: self.lane })
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.f.qp_num
    }

    /// Whether it came from a work request posted through the lane (false: through the
    /// convenient path of a QP made with [`Lane::qp_init`]; it carries no region).
    pub fn is_lane(&self) -> bool {
        self.flags & LANE != 0
    }

    /// False for an unsignaled work request retired by a later signaled completion of its
    /// queue (it succeeded: its fields other than the status, `wr_id` and queue say nothing).
    pub fn is_signaled(&self) -> bool {
        self.flags & SIGNALED != 0
    }

    /// The queue it completed on.
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
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.f.status)
    }

    /// `Ok(self)` on success.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] with the status, its usual cause and the vendor error. The
    /// region is dropped with the completion: call [`Completion::take_region`] first to keep
    /// it.
    pub fn ok(self) -> Result<Completion> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion { wr_id: self.wr_id, status: self.status(), vendor_err: self.f.vendor_err })
        }
    }

    /// The operation, for successful signaled completions.
    pub fn opcode(&self) -> Option<WcOpcode> {
        (self.is_signaled() && self.is_ok()).then(|| WcOpcode::from_raw(self.f.opcode))
    }

    /// Bytes received (receives) or transferred (RDMA READ).
    pub fn byte_len(&self) -> u32 {
        self.f.byte_len
    }

    /// Immediate data of a receive, in host order, when the peer sent any.
    pub fn imm_data(&self) -> Option<u32> {
        self.work_completion().imm_data()
    }

    /// The sender's QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.f.src_qp
    }

    /// The completion as the convenient path reports it (for
    /// [`Datagram::parse`](crate::Datagram::parse), say).
    pub fn work_completion(&self) -> WorkCompletion {
        let f = &self.f;
        WorkCompletion {
            wr_id: self.wr_id,
            status: f.status,
            opcode: f.opcode,
            vendor_err: f.vendor_err,
            byte_len: f.byte_len,
            imm: f.imm,
            qp_num: f.qp_num,
            src_qp: f.src_qp,
            wc_flags: f.wc_flags,
            pkey_index: f.pkey_index,
            slid: f.slid,
            sl: f.sl,
            dlid_path_bits: f.dlid_path_bits,
            queue: self.queue(),
        }
    }
}
