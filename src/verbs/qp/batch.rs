//! [`WrBatch`]: send-queue work requests written straight into the provider's queue
//! (`ibv_wr_start`, `ibv_wr_*`, `ibv_wr_complete`), checked and held exactly as
//! [`QueuePair::post_send`] does. See [`crate::verbs::extended`] for when to use it and why it
//! is sound.

use std::ptr::NonNull;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::extended::{refused, SendOps};
use crate::verbs::ring::{tag, Hold};
use crate::verbs::wr::{hold_rest, needs_rest_holds, SendOp, SendWr, MAX_SGE};
use crate::wait::lock;

use super::{QpInit, QueuePair};

impl QpInit {
    /// Creates the QP with `ibv_create_qp_ex` for the extended send path
    /// ([`QueuePair::start_batch`]), for every operation of [`SendOps`] (atomics included; a
    /// device without atomics may refuse that: ask for [`SendOps::STANDARD`] with
    /// [`QpInit::extended_ops`]). Works through the connection manager (`rdma_create_qp_ex`)
    /// and without it ([`UnconnectedQp`](crate::UnconnectedQp)); RC only. The classic
    /// [`QueuePair::post_send`] keeps working on such a QP.
    ///
    /// Where the provider has no extended QP (Soft-iWARP), creating the QP fails with
    /// [`Error::Unsupported`] naming the capability.
    pub fn extended(self) -> Self {
        self.extended_ops(SendOps::all())
    }

    /// [`QpInit::extended`] for the operations `ops` only; [`WrBatch::add`] refuses others.
    /// Empty `ops`: a classic QP.
    pub fn extended_ops(mut self, ops: SendOps) -> Self {
        self.send_ops = ops;
        self
    }
}

/// A QP's extended send path: its `ibv_qp_ex`, the operations it was created for, and whether
/// a batch is open.
#[derive(Clone, Copy)]
pub(super) struct Extended {
    /// `None` when the provider made no usable extended QP (no `ibv_qp_ex`, or one lacking a
    /// call a batch makes): [`QueuePair::start_batch`] then says so.
    qpx: Option<NonNull<ffi::ibv_qp_ex>>,
    ops: SendOps,
    /// A batch is open (`ibv_wr_start` called, neither `ibv_wr_complete` nor `ibv_wr_abort`
    /// yet). Outside a batch's life this means the batch was leaked (`mem::forget`), and the
    /// provider's send queue may still be locked by it: every later send is refused.
    pub(super) open: bool,
}

impl Extended {
    /// The extended path of the QP just created as `raw` for `ops` (`None` for a classic QP).
    pub(super) fn of(raw: NonNull<ffi::ibv_qp>, ops: SendOps) -> Option<Extended> {
        if ops.is_empty() {
            return None;
        }
        // SAFETY: `raw` is a valid QP; ibv_qp_to_qp_ex only reads whether it was created
        // extended, and returns NULL when it was not (a UD QP, made by the classic call).
        let qpx = NonNull::new(unsafe { ffi::ibv_qp_to_qp_ex(raw.as_ptr()) }).filter(|qpx| {
            // SAFETY: an extended QP's ibv_qp_ex is valid for the QP's life; only its function
            // pointers are read.
            let q = unsafe { qpx.as_ref() };
            let mut have = q.wr_start.is_some()
                && q.wr_complete.is_some()
                && q.wr_abort.is_some()
                && q.wr_set_sge_list.is_some()
                && q.wr_set_inline_data.is_some();
            for (op, set) in [
                (SendOps::SEND, q.wr_send.is_some()),
                (SendOps::SEND_WITH_IMM, q.wr_send_imm.is_some()),
                (SendOps::SEND_WITH_INV, q.wr_send_inv.is_some()),
                (SendOps::RDMA_WRITE, q.wr_rdma_write.is_some()),
                (SendOps::RDMA_WRITE_WITH_IMM, q.wr_rdma_write_imm.is_some()),
                (SendOps::RDMA_READ, q.wr_rdma_read.is_some()),
                (SendOps::ATOMIC_CMP_AND_SWP, q.wr_atomic_cmp_swp.is_some()),
                (SendOps::ATOMIC_FETCH_AND_ADD, q.wr_atomic_fetch_add.is_some()),
            ] {
                have &= !ops.contains(op) || set;
            }
            have
        });
        Some(Extended { qpx, ops, open: false })
    }
}

impl QueuePair {
    /// A [`WrBatch`] of this QP was leaked (`mem::forget`) while open: the provider's send
    /// queue may still be locked by it, so a post through any path could wait for ever.
    pub(crate) fn batch_leaked(&self) -> bool {
        self.ex.is_some_and(|e| e.open)
    }
}

/// The refusal of a send on a QP whose batch was leaked.
pub(super) fn leaked(op: &'static str) -> Error {
    Error::InvalidArgument(format!(
        "{op}: a WrBatch of this QP was leaked (mem::forget) before complete() or its drop: the provider's send \
         queue may still be locked by it, so nothing more can be posted; its work requests stay held until the QP \
         is dropped"
    ))
}

/// The extended operation a work request needs, or why the batch cannot post it.
fn needed_op(w: &SendWr<'_>) -> Result<SendOps> {
    Ok(match (w.op, w.imm.is_some()) {
        (SendOp::Send, false) => SendOps::SEND,
        (SendOp::Send, true) => SendOps::SEND_WITH_IMM,
        (SendOp::SendInv { .. }, _) => SendOps::SEND_WITH_INV,
        (SendOp::Write { .. }, false) => SendOps::RDMA_WRITE,
        (SendOp::Write { .. }, true) => SendOps::RDMA_WRITE_WITH_IMM,
        (SendOp::Read { .. }, _) => SendOps::RDMA_READ,
        (SendOp::FetchAdd { .. }, _) => SendOps::ATOMIC_FETCH_AND_ADD,
        (SendOp::CompareSwap { .. }, _) => SendOps::ATOMIC_CMP_AND_SWP,
        (SendOp::BindMw { .. } | SendOp::LocalInv { .. }, _) => {
            return Err(Error::InvalidArgument(
                "memory-window binds and local invalidations go through QueuePair::bind_window / invalidate_window, \
                 not a batch"
                    .into(),
            ))
        }
    })
}

/// Send-queue work requests added one by one to the provider's queue and handed to the device
/// together, with one doorbell ([`WrBatch::complete`]); made by [`QueuePair::start_batch`].
///
/// Each [`WrBatch::add`] checks the work request as [`QueuePair::post_send`] does and holds
/// every region it names until its completion is reaped. Dropped without `complete`, the batch
/// is aborted (`ibv_wr_abort`): nothing of it reaches the device, and its holds are released.
/// It borrows the QP mutably, so nothing else is posted, polled or dropped meanwhile:
///
/// ```compile_fail,E0499
/// # fn f(qp: &mut rdma_cm::QueuePair) -> rdma_cm::Result<()> {
/// let batch = qp.start_batch()?;
/// qp.post_send(&[])?; // the QP is borrowed by the batch
/// batch.complete()
/// # }
/// ```
pub struct WrBatch<'q> {
    qp: &'q mut QueuePair,
    qpx: *mut ffi::ibv_qp_ex,
    ops: SendOps,
    /// Work requests added (committed to the ring, held, written to the provider's queue).
    added: u64,
    /// `ibv_wr_complete` was called: the drop aborts nothing.
    done: bool,
}

impl QueuePair {
    /// Opens a batch of send-queue work requests (`ibv_wr_start`) on a QP created with
    /// [`QpInit::extended`]. Only a connected QP sends, as for [`QueuePair::post_send`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a QP created without [`QpInit::extended`], or whose
    /// earlier batch was leaked; as for [`QueuePair::post_send`] once the peer left or the QP
    /// is in the error state.
    pub fn start_batch(&mut self) -> Result<WrBatch<'_>> {
        let Some(ex) = self.ex else {
            return Err(Error::InvalidArgument(
                "start_batch: the QP was created without QpInit::extended (ibv_create_qp_ex): post with post_send, \
                 or create it extended"
                    .into(),
            ));
        };
        let Some(qpx) = ex.qpx else {
            return Err(refused("ibv_qp_to_qp_ex", libc::EOPNOTSUPP, &self.pd.context().device_name(), ex.ops));
        };
        self.check_send_queue_open("ibv_wr_start")?;
        if let Some(f) = lock(&self.queues).failed {
            return Err(self.failed_error(f, "ibv_wr_start"));
        }
        // SAFETY: the QP is valid and extended (its ibv_qp_ex lives as long as it); no batch is
        // open on it (checked above: a leaked one refuses, a live one borrows the QP).
        unsafe { ffi::ibv_wr_start(qpx.as_ptr()) };
        if let Some(e) = self.ex.as_mut() {
            e.open = true;
        }
        Ok(WrBatch { qpx: qpx.as_ptr(), ops: ex.ops, qp: self, added: 0, done: false })
    }

    /// The operations the QP was created for ([`QpInit::extended_ops`]); empty for a classic
    /// QP.
    pub fn send_ops(&self) -> SendOps {
        self.ex.map_or(SendOps::empty(), |e| e.ops)
    }
}

impl WrBatch<'_> {
    /// Adds one work request to the batch: a send (also inline, with immediate data or with
    /// invalidate), an RDMA WRITE (also with immediate data), an RDMA READ or an atomic, of one
    /// piece or several, signaled or not, exactly as [`QueuePair::post_send`] takes it. The
    /// device sees it at [`WrBatch::complete`].
    ///
    /// # Errors
    /// Before anything is added: as [`QueuePair::post_send`] refuses a work request
    /// ([`Error::InvalidArgument`], [`Error::OutOfBounds`]); [`Error::QueueFull`] when the
    /// send queue has no room for one more; [`Error::QpInError`] once a completion of the QP
    /// failed; [`Error::InvalidArgument`] for an operation the QP was not created for. A
    /// refused work request leaves the batch as it was: the ones added stay in it.
    pub fn add(&mut self, w: &SendWr<'_>) -> Result<()> {
        let qp = &*self.qp;
        qp.check_send_wr(w)?;
        let op = needed_op(w)?;
        if !self.ops.contains(op) {
            return Err(Error::InvalidArgument(format!(
                "{op:?} is not among the operations the QP was created for ({:?}): create it with QpInit::extended \
                 or QpInit::extended_ops including it",
                self.ops
            )));
        }
        let mut q = lock(&qp.queues);
        if let Some(f) = q.failed {
            return Err(qp.failed_error(f, "ibv_wr_complete"));
        }
        let free = q.send.free();
        if free == 0 {
            return Err(Error::QueueFull { queue: "send", depth: q.send.cap() as u32 });
        }
        // Taking the last free slot makes it signaled (see QueuePair::post_send).
        let signaled = w.signaled || free == 1;
        let writes = w.op.writes_local();
        let first = w.local.as_ref().map(|(m, _)| m.inner());
        let seq = q.send.stage(0, w.wr_id, first.map(|m| Hold::new(m, writes)));
        if needs_rest_holds(first, w.rest) {
            q.send.stage_rest(seq, hold_rest(first, w.rest, writes));
        }
        // Committed before the provider sees it: a leaked batch leaves it held like posted
        // work (see the module docs of crate::verbs::extended).
        q.send.commit(1, 1);
        drop(q);
        let mut sge = [ffi::ibv_sge { addr: 0, length: 0, lkey: 0 }; MAX_SGE];
        let tag = tag::encode(qp.send_slot.index, seq, false, false);
        // SAFETY: `sge` has room for MAX_SGE entries, the most a checked work request has, and
        // lives until the provider has copied them (below).
        let r = unsafe { w.lower(tag, signaled, None, sge.as_mut_ptr()) };
        self.added += 1;
        let x = self.qpx;
        // Every piece was checked against a region on this PD (check_send_wr), and the slot
        // committed above (with its side table) holds each region named until the completion
        // is reaped, or until the abort releases it; the provider copies the work request, its
        // scatter entries and its inline data into its queue during these calls.
        // SAFETY: a batch is open on this extended QP (start_batch), whose function pointers for
        // the operations it was created for were checked to be set (Extended::of), and `op` is
        // among them; the union fields read are the ones `lower` wrote for this opcode.
        unsafe {
            (*x).wr_id = r.wr_id;
            // IBV_SEND_INLINE stays: rxe reads it to find the data that ibv_wr_set_inline_data
            // copied (without it the send fails with LOC_QP_OP_ERR).
            (*x).wr_flags = r.send_flags;
            use ffi::ibv_wr_opcode::*;
            match r.opcode {
                IBV_WR_SEND => ffi::ibv_wr_send(x),
                IBV_WR_SEND_WITH_IMM => ffi::ibv_wr_send_imm(x, r.imm_data_invalidated_rkey_union.imm_data),
                IBV_WR_SEND_WITH_INV => ffi::ibv_wr_send_inv(x, r.imm_data_invalidated_rkey_union.invalidated_rkey),
                IBV_WR_RDMA_WRITE => ffi::ibv_wr_rdma_write(x, r.wr.rdma.rkey, r.wr.rdma.remote_addr),
                IBV_WR_RDMA_WRITE_WITH_IMM => ffi::ibv_wr_rdma_write_imm(
                    x,
                    r.wr.rdma.rkey,
                    r.wr.rdma.remote_addr,
                    r.imm_data_invalidated_rkey_union.imm_data,
                ),
                IBV_WR_RDMA_READ => ffi::ibv_wr_rdma_read(x, r.wr.rdma.rkey, r.wr.rdma.remote_addr),
                IBV_WR_ATOMIC_FETCH_AND_ADD => {
                    ffi::ibv_wr_atomic_fetch_add(x, r.wr.atomic.rkey, r.wr.atomic.remote_addr, r.wr.atomic.compare_add)
                }
                // The last opcode needed_op admits.
                _ => ffi::ibv_wr_atomic_cmp_swp(
                    x,
                    r.wr.atomic.rkey,
                    r.wr.atomic.remote_addr,
                    r.wr.atomic.compare_add,
                    r.wr.atomic.swap,
                ),
            }
            match w.inline {
                Some(data) => ffi::ibv_wr_set_inline_data(x, data.as_ptr() as *mut _, data.len()),
                None => ffi::ibv_wr_set_sge_list(x, r.num_sge as usize, r.sg_list),
            }
        }
        Ok(())
    }

    /// Work requests added so far.
    pub fn len(&self) -> usize {
        self.added as usize
    }

    /// Whether nothing was added yet.
    pub fn is_empty(&self) -> bool {
        self.added == 0
    }

    /// Hands every work request added to the device, with one doorbell (`ibv_wr_complete`).
    /// Their completions come as for [`QueuePair::post_send`].
    ///
    /// # Errors
    /// [`Error::Call`] naming `ibv_wr_complete` when the provider refuses the batch (a work
    /// request it could not build). How much of it the provider took is then unknown: every
    /// work request of the batch stays held, and the QP is moved to the error state, so the
    /// flush (or dropping the QP) retires them.
    pub fn complete(mut self) -> Result<()> {
        self.done = true;
        // SAFETY: the batch opened by start_batch is still open (neither completed nor
        // aborted: `done` was false).
        let ret = unsafe { ffi::ibv_wr_complete(self.qpx) };
        if let Some(e) = self.qp.ex.as_mut() {
            e.open = false;
        }
        if ret == 0 {
            return Ok(());
        }
        let flushed = self.qp.set_error_state().is_ok();
        Err(Error::Call {
            op: "ibv_wr_complete",
            addr: None,
            hint: Some(if flushed {
                "the provider refused the batch without saying which work requests it took: they are kept until the flush retires them, and the QP was moved to the error state"
            } else {
                "the provider refused the batch without saying which work requests it took, and the QP could not be moved to the error state: its regions stay held until the QP is dropped"
            }),
            source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
        })
    }
}

impl Drop for WrBatch<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // SAFETY: the batch opened by start_batch is still open; the abort discards every work
        // request added, so the device never sees them.
        unsafe { ffi::ibv_wr_abort(self.qpx) };
        if let Some(e) = self.qp.ex.as_mut() {
            e.open = false;
        }
        // No completion can name them now: release their holds.
        lock(&self.qp.queues).send.revoke_last(self.added);
    }
}

impl std::fmt::Debug for WrBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WrBatch").field("qp_num", &self.qp.qp_num).field("added", &self.added).finish()
    }
}
