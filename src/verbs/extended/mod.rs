//! The extended verbs: batch posting through `ibv_wr_start` … `ibv_wr_complete` on a QP made
//! with `ibv_create_qp_ex` ([`WrBatch`](crate::WrBatch)), and completion polling through
//! `ibv_start_poll`/`ibv_end_poll` on a CQ made with `ibv_create_cq_ex`
//! ([`CompletionQueue::poll_extended`](crate::CompletionQueue::poll_extended)), with
//! completion timestamps where the device offers them.
//!
//! # When to use it
//!
//! The classic path ([`QueuePair::post_send`](crate::QueuePair::post_send),
//! [`CompletionQueue::poll`](crate::CompletionQueue::poll)) builds an `ibv_send_wr` list and
//! hands it over in one call; a provider then copies each into its queue. The extended path
//! writes each work request straight into the provider's queue as it is added, and rings the
//! doorbell once for the batch; its poll reads only the fields of a completion it asks for, and
//! can read the time the device completed it. On hardware (mlx5 and its kin) this is the path
//! new operations arrive on, and the cheaper one for batches; on Soft-RoCE each added work
//! request costs an indirect call, so compare in `BENCHMARKS.md` before choosing. Ask for it
//! when the QP is made ([`QpInit::extended`](crate::QpInit::extended)), through the connection
//! manager or without it, and for the CQ
//! ([`CompletionQueue::new_extended`](crate::CompletionQueue::new_extended)). Both classic
//! calls keep working on an extended QP and CQ.
//!
//! ```no_run
//! # fn f(qp: &mut rdma_cm::QueuePair, mr: &rdma_cm::MemoryRegion, remote: &rdma_cm::RemoteRegion)
//! # -> rdma_cm::Result<()> {
//! use rdma_cm::SendWr;
//! // The QP was created with QpInit::new().extended().
//! let mut batch = qp.start_batch()?;
//! batch.add(&SendWr::write(mr, 0..64, remote, 0)?.unsignaled())?;
//! batch.add(&SendWr::write(mr, 64..128, remote, 64)?.imm(7))?;
//! batch.add(&SendWr::send_inline(b"done").wr_id(9))?;
//! batch.complete()?; // one doorbell for all three
//! # Ok(()) }
//! ```
//!
//! # Providers
//!
//! Soft-RoCE has both, without completion timestamps; Soft-iWARP has neither (creating either
//! fails with [`Error::Unsupported`]). rxe's `ibv_wr_set_sge_list`
//! in rdma-core 44 (fixed upstream in rdma-core PR 1744) counts a work request of several
//! pieces as the first piece's length times their number, so a gathered send or WRITE through
//! a batch moves the wrong number of bytes there, or fails with `LOC_PROT_ERR` (never outside
//! the pieces named, which stay held as usual); post gathered work requests with `post_send`
//! on such a provider.
//!
//! # Why it is sound
//!
//! It is the classic path's model, unchanged:
//!
//! - [`WrBatch::add`](crate::WrBatch::add) takes the same [`SendWr`](crate::SendWr) as
//!   `post_send`, checks it the same way (PD, bounds, `LOCAL_WRITE`, inline size, pieces,
//!   queue room), and stages it in the same slot ring, holding every region it names: a region
//!   the device writes is unreadable from Rust until the completion is reaped, and none can be
//!   freed meanwhile. The slot is committed before the provider sees the work request, so a
//!   batch forgotten with `mem::forget` leaves its work requests held like posted ones (the QP
//!   then refuses every later send, naming the leak, since the provider's send queue may still
//!   be locked by the unfinished batch).
//! - Dropping a batch without [`WrBatch::complete`](crate::WrBatch::complete) calls
//!   `ibv_wr_abort`, which discards its work requests; their slots are voided and their holds
//!   released at once.
//! - When `ibv_wr_complete` fails, the extent of what the provider took is unknown: as for a
//!   classic post that fails without naming its `bad_wr`, every work request of the batch stays
//!   held and the QP is moved to the error state, so the flush (or the QP's drop) retires them.
//! - The batch borrows the QP mutably: no classic post, poll or drop of the QP can run inside
//!   it. A batch exists only on a connected QP (RTS), as sends do.
//! - The extended poll runs between `ibv_start_poll` and `ibv_end_poll` under the CQ's routing
//!   table's lock (every poll of this crate takes it), turns each completion into the same
//!   `ibv_wc` the classic poll reads, and routes it through the same table, so each retires
//!   its slot in the QP or SRQ that posted it, on a private or a shared CQ, and a completion of
//!   another QP, of a QP that is gone or of a raw post retires nothing. It allocates nothing.

use std::ptr::NonNull;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::pd::ProtectionDomain;

pub mod poll;

pub use poll::ExtendedCompletion;

bitflags::bitflags! {
    /// The operations an extended QP is created for (`ibv_create_qp_ex`'s `send_ops_flags`):
    /// [`WrBatch::add`](crate::WrBatch::add) refuses any other.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct SendOps: u64 {
        /// RDMA WRITE.
        const RDMA_WRITE = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0 as u64;
        /// RDMA WRITE with immediate data.
        const RDMA_WRITE_WITH_IMM = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0 as u64;
        /// Send.
        const SEND = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0 as u64;
        /// Send with immediate data.
        const SEND_WITH_IMM = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_IMM.0 as u64;
        /// RDMA READ.
        const RDMA_READ = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0 as u64;
        /// Atomic compare-and-swap.
        const ATOMIC_CMP_AND_SWP = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP.0 as u64;
        /// Atomic fetch-and-add.
        const ATOMIC_FETCH_AND_ADD = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.0 as u64;
        /// Send with invalidate.
        const SEND_WITH_INV = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_INV.0 as u64;
    }
}

impl SendOps {
    /// What [`QpInit::extended`](crate::QpInit::extended) asks for: every operation above but
    /// the atomics, which not every device has.
    pub const STANDARD: SendOps = SendOps::RDMA_WRITE
        .union(SendOps::RDMA_WRITE_WITH_IMM)
        .union(SendOps::SEND)
        .union(SendOps::SEND_WITH_IMM)
        .union(SendOps::RDMA_READ)
        .union(SendOps::SEND_WITH_INV);
}

/// The extended attributes for a QP of `attr`'s capabilities on `pd`, created for `ops`.
pub(crate) fn qp_init_attr_ex(
    attr: &ffi::ibv_qp_init_attr,
    pd: &ProtectionDomain,
    ops: SendOps,
) -> ffi::ibv_qp_init_attr_ex {
    // SAFETY: ibv_qp_init_attr_ex is plain old data (integers, pointers, a hash config); zero
    // is valid and means "not given" for every field not set below.
    let mut ex: ffi::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    ex.qp_context = attr.qp_context;
    ex.send_cq = attr.send_cq;
    ex.recv_cq = attr.recv_cq;
    ex.srq = attr.srq;
    ex.cap = attr.cap;
    ex.qp_type = attr.qp_type;
    ex.sq_sig_all = attr.sq_sig_all;
    ex.comp_mask = (ffi::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD
        | ffi::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
        .0;
    ex.pd = pd.as_raw();
    ex.send_ops_flags = ops.bits();
    ex
}

/// The refusal of an extended QP by the provider (`errno` from `op`), naming the capability.
pub(crate) fn refused(op: &'static str, errno: i32, device: &str, ops: SendOps) -> Error {
    match errno {
        libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL | libc::EPROTONOSUPPORT => Error::Unsupported {
            what: "extended QPs (ibv_create_qp_ex with send_ops_flags)",
            why: format!(
                "device {device} refused a QP for {ops:?} ({op}: {}); Soft-iWARP has no extended QP, and some \
                 devices have no atomics (ask for SendOps::STANDARD then); the classic post_send works everywhere",
                crate::error::errno_name(errno)
            ),
        },
        e => Error::call(op, e, None),
    }
}

/// Creates a verbs-only QP for `ops` (`ibv_create_qp_ex`); `attr.cap` gets what the provider
/// gave.
pub(crate) fn create_qp_ex(
    pd: &ProtectionDomain,
    attr: &mut ffi::ibv_qp_init_attr,
    ops: SendOps,
) -> Result<NonNull<ffi::ibv_qp>> {
    let mut ex = qp_init_attr_ex(attr, pd, ops);
    crate::error::clear_errno();
    // SAFETY: the context is the PD's, open while `pd` lives; the PD and the CQs in `ex` are
    // valid and on that context (checked by QueuePair::create); `ex` is fully initialised and
    // lives for the call.
    let raw = unsafe { ffi::ibv_create_qp_ex(pd.context().as_raw(), &mut ex) };
    match raw.and_then(NonNull::new) {
        Some(qp) => {
            attr.cap = ex.cap;
            Ok(qp)
        }
        None => {
            let e = crate::error::errno();
            Err(refused(
                "ibv_create_qp_ex",
                if e == 0 { libc::EOPNOTSUPP } else { e },
                &pd.context().device_name(),
                ops,
            ))
        }
    }
}
