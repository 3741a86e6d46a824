//! The extended poll: a CQ made by `ibv_create_cq_ex` ([`CompletionQueue::new_extended`]) and
//! read with `ibv_start_poll`/`ibv_end_poll`
//! ([`CompletionQueue::poll_extended`]), each completion routed as the classic poll routes it.

use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{check_ptr, Error, Result};
use crate::verbs::cq::{CompletionQueue, POLL_CHUNK};
use crate::verbs::device::VerbsContext;
use crate::verbs::wc::WorkCompletion;

/// The fields every extended CQ of this crate carries: those of an `ibv_wc`, which the routing
/// table and [`WorkCompletion`] read.
const STANDARD: u64 = {
    use ffi::ibv_create_cq_wc_flags as f;
    (f::IBV_WC_EX_WITH_BYTE_LEN.0
        | f::IBV_WC_EX_WITH_IMM.0
        | f::IBV_WC_EX_WITH_QP_NUM.0
        | f::IBV_WC_EX_WITH_SRC_QP.0
        | f::IBV_WC_EX_WITH_SLID.0
        | f::IBV_WC_EX_WITH_SL.0
        | f::IBV_WC_EX_WITH_DLID_PATH_BITS.0) as u64
};
/// The device's completion timestamp.
const TIMESTAMP: u64 = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP.0 as u64;

/// A completion read by [`CompletionQueue::poll_extended`]: the [`WorkCompletion`] (which it
/// dereferences to) and, on a CQ made with timestamps, when the device completed it.
#[derive(Clone, Copy, Default, Debug)]
pub struct ExtendedCompletion {
    wc: WorkCompletion,
    timestamp: Option<u64>,
}

impl ExtendedCompletion {
    /// The completion.
    pub fn completion(&self) -> &WorkCompletion {
        &self.wc
    }

    /// When the device completed the work request, in ticks of its clock
    /// (`ibv_wc_read_completion_ts`; the tick rate is the device's `hca_core_clock`, in kHz):
    /// on a CQ made with timestamps, and `None` for a completion that a classic poll met first
    /// and kept for this one (it was read without its timestamp).
    pub fn timestamp(&self) -> Option<u64> {
        self.timestamp
    }
}

impl Deref for ExtendedCompletion {
    type Target = WorkCompletion;
    fn deref(&self) -> &WorkCompletion {
        &self.wc
    }
}

impl CompletionQueue {
    /// Creates a CQ with `ibv_create_cq_ex`, for [`CompletionQueue::poll_extended`], with room
    /// for `depth` completions and its own completion channel; `timestamps`: each completion
    /// carries the device's time of completion ([`ExtendedCompletion::timestamp`]). Everything
    /// else a CQ does works on it too (QPs, SRQs, waits, [`CompletionQueue::poll`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero depth; [`Error::Unsupported`] where the provider
    /// has no extended CQ, or no timestamps (Soft-RoCE has none: `EOPNOTSUPP`);
    /// [`Error::Call`] when a verb fails otherwise.
    pub fn new_extended(ctx: &VerbsContext, depth: u32, timestamps: bool) -> Result<Arc<CompletionQueue>> {
        if depth == 0 || depth > i32::MAX as u32 {
            return Err(Error::InvalidArgument(format!("CQ depth {depth} must be between 1 and {}", i32::MAX)));
        }
        let wc_flags = STANDARD | if timestamps { TIMESTAMP } else { 0 };
        // SAFETY: the context is open while `ctx` lives; NULL is checked.
        let channel = check_ptr(unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) }, "ibv_create_comp_channel")?;
        // SAFETY: ibv_cq_init_attr_ex is plain old data; zero means "not given" for every field
        // not set below.
        let mut attr: ffi::ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
        attr.cqe = depth;
        attr.channel = channel.as_ptr();
        attr.wc_flags = wc_flags;
        crate::error::clear_errno();
        // SAFETY: context and channel valid; `attr` is fully initialised and lives for the call.
        let raw = unsafe { ffi::ibv_create_cq_ex(ctx.as_raw(), &mut attr) };
        let cqx = match raw.and_then(NonNull::new) {
            Some(c) => c,
            None => {
                let e = crate::error::errno();
                // SAFETY: the channel has no CQ attached; destroy it once.
                unsafe { ffi::ibv_destroy_comp_channel(channel.as_ptr()) };
                return Err(refused(e, ctx, timestamps));
            }
        };
        // SAFETY: an ibv_cq_ex begins with the ibv_cq it extends (libibverbs' own cast).
        let raw = unsafe { NonNull::new_unchecked(ffi::ibv_cq_ex_to_cq(cqx.as_ptr())) };
        // From here on the value owns the CQ and the channel (its drop destroys both).
        let cq = Arc::new(CompletionQueue::from_parts(ctx, raw, channel, depth, Some((cqx, wc_flags))));
        // SAFETY: the CQ is valid while `cq` lives; only its function pointers are read.
        let c = unsafe { cqx.as_ref() };
        let have = c.start_poll.is_some()
            && c.next_poll.is_some()
            && c.end_poll.is_some()
            && c.read_opcode.is_some()
            && c.read_vendor_err.is_some()
            && c.read_byte_len.is_some()
            && c.read_imm_data.is_some()
            && c.read_qp_num.is_some()
            && c.read_src_qp.is_some()
            && c.read_wc_flags.is_some()
            && c.read_slid.is_some()
            && c.read_sl.is_some()
            && c.read_dlid_path_bits.is_some()
            && (!timestamps || c.read_completion_ts.is_some());
        if !have {
            return Err(refused(libc::EOPNOTSUPP, ctx, timestamps));
        }
        Ok(cq)
    }

    /// Polls up to `out.len()` completions of every QP and SRQ this CQ serves, without
    /// waiting, through `ibv_start_poll`/`ibv_end_poll` (one completion per poll section: see
    /// the body for why `ibv_next_poll` is not used): as
    /// [`CompletionQueue::poll`] does (each retires its slot, releasing what its work request
    /// held; completions a QP's poll kept for others come first, without a timestamp), with
    /// the completion timestamp where the CQ was made with them. Allocates nothing.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a CQ not made by [`CompletionQueue::new_extended`];
    /// [`Error::Call`] when `ibv_start_poll` fails.
    pub fn poll_extended(&self, out: &mut [ExtendedCompletion]) -> Result<usize> {
        let Some((cqx, wc_flags)) = self.extended() else {
            return Err(Error::InvalidArgument(
                "poll_extended: the CQ was made by ibv_create_cq, not CompletionQueue::new_extended: use poll".into(),
            ));
        };
        let mut router = self.router();
        let mut filled = 0;
        // Completions kept by QPs' polls for this CQ's poll, through a stack buffer.
        if router.has_kept() {
            let mut kept = [WorkCompletion::default(); POLL_CHUNK];
            while filled < out.len() {
                let want = (out.len() - filled).min(POLL_CHUNK);
                let n = router.deliver_kept(&mut kept[..want]);
                for wc in &kept[..n] {
                    out[filled] = ExtendedCompletion { wc: *wc, timestamp: None };
                    filled += 1;
                }
                if n < want {
                    break;
                }
            }
        }
        if filled == out.len() {
            return Ok(filled);
        }
        let x = cqx.as_ptr();
        let timestamps = wc_flags & TIMESTAMP != 0;
        // One completion per poll section: `ibv_start_poll`, read, `ibv_end_poll`. The
        // sequence the man page also allows, `ibv_next_poll` until it returns `ENOENT` and then
        // `ibv_end_poll`, advances rdma-core 44's Soft-RoCE consumer index twice (and unlocks
        // its CQ twice): the next poll then hands out a whole lap of old completions again, and
        // the kernel, seeing the CQ full, drops the later ones (fixed in rdma-core 55). Ending
        // each section before asking for more never takes that path on any provider; a section
        // costs the provider's CQ lock, which a classic poll takes per call as well.
        while filled < out.len() {
            let mut attr = ffi::ibv_poll_cq_attr { comp_mask: 0 };
            // The routing table's lock is held across the section: no other poll of this CQ
            // (every one takes it) runs inside it, and no resize.
            // SAFETY: the CQ is extended and valid while `self` lives; no poll section is open
            // on it (each one below is closed before the next starts); `attr` lives for the call.
            match unsafe { ffi::ibv_start_poll(x, &mut attr) } {
                0 => {}
                libc::ENOENT => break,
                // What was delivered is returned; the error comes back on the next poll.
                _ if filled > 0 => break,
                e => return Err(Error::call("ibv_start_poll", e, None)),
            }
            // SAFETY: the poll section is open and at a completion (start returned 0); every
            // field read was asked for at creation and its reader checked to be set.
            let (wc, ts) = unsafe { read_current(x, timestamps) };
            // SAFETY: closes the section `ibv_start_poll` opened above, once.
            unsafe { ffi::ibv_end_poll(x) };
            if let Some((done, _)) = router.route(&wc) {
                out[filled] = ExtendedCompletion { wc: done, timestamp: ts };
                filled += 1;
            }
        }
        Ok(filled)
    }
}

/// The completion the open poll section is at, as the `ibv_wc` the classic poll would have
/// read, and its timestamp when `timestamps`.
///
/// # Safety
/// A poll section of `x` is open and at a completion; `x` was made with the standard fields
/// (and the timestamp when `timestamps`), whose readers are set.
#[inline(always)]
unsafe fn read_current(x: *mut ffi::ibv_cq_ex, timestamps: bool) -> (ffi::ibv_wc, Option<u64>) {
    // SAFETY: the caller's contract: each reader reads the current completion.
    unsafe {
        let status = (*x).status;
        let wc_flags = ffi::ibv_wc_read_wc_flags(x);
        let imm = if wc_flags & (ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 | ffi::ibv_wc_flags::IBV_WC_WITH_INV.0) != 0 {
            ffi::ibv_wc_read_imm_data(x)
        } else {
            0
        };
        let wc = ffi::ibv_wc {
            wr_id: (*x).wr_id,
            status,
            opcode: ffi::ibv_wc_read_opcode(x),
            vendor_err: if status == ffi::ibv_wc_status::IBV_WC_SUCCESS { 0 } else { ffi::ibv_wc_read_vendor_err(x) },
            byte_len: ffi::ibv_wc_read_byte_len(x),
            imm_data_invalidated_rkey_union: ffi::imm_data_invalidated_rkey_union_t { imm_data: imm },
            qp_num: ffi::ibv_wc_read_qp_num(x),
            src_qp: ffi::ibv_wc_read_src_qp(x),
            wc_flags,
            pkey_index: 0,
            slid: ffi::ibv_wc_read_slid(x) as u16,
            sl: ffi::ibv_wc_read_sl(x),
            dlid_path_bits: ffi::ibv_wc_read_dlid_path_bits(x),
        };
        (wc, timestamps.then(|| ffi::ibv_wc_read_completion_ts(x)))
    }
}

/// The refusal of an extended CQ (`errno` from `ibv_create_cq_ex`), naming the capability.
fn refused(errno: i32, ctx: &VerbsContext, timestamps: bool) -> Error {
    match errno {
        libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL | 0 => Error::Unsupported {
            what: if timestamps {
                "completion timestamps (ibv_create_cq_ex)"
            } else {
                "extended CQs (ibv_create_cq_ex)"
            },
            why: format!(
                "device {} refused {} ({}); Soft-RoCE has extended CQs without timestamps",
                ctx.device_name(),
                if timestamps { "an extended CQ with completion timestamps" } else { "an extended CQ" },
                crate::error::errno_name(if errno == 0 { libc::EOPNOTSUPP } else { errno })
            ),
        },
        e => Error::call("ibv_create_cq_ex", e, None),
    }
}
