//! [`CompletionQueue`] with its completion channel, and the typed [`WorkCompletion`].
//!
//! A CQ holds the [`VerbsContext`] it was created on. A [`QueuePair`](crate::QueuePair) holds
//! an `Arc` of each of its CQs, so a CQ is destroyed only after every QP using it. The safe
//! data path needs each CQ to serve a single QP (the QP routes each completion back to the
//! buffer it posted), which the QP enforces when it claims the CQ.
//!
//! CQ events are acknowledged in batches (`ibv_ack_cq_events` takes a lock); the remainder is
//! acknowledged before the CQ is destroyed, as libibverbs requires.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use rdma_sys as ffi;

use crate::cm_id::VerbsContext;
use crate::error::{check_ibv, check_ptr, errno, Error, Result};

/// How many CQ events are collected before one `ibv_ack_cq_events` call.
const ACK_BATCH: u32 = 64;

/// A completion queue and the completion channel it reports events on.
pub struct CompletionQueue {
    raw: NonNull<ffi::ibv_cq>,
    channel: NonNull<ffi::ibv_comp_channel>,
    depth: u32,
    claimed: AtomicBool,
    /// Whether the channel's descriptor was made non-blocking (done at first use, to keep two
    /// syscalls off CQ creation).
    nonblocking: AtomicBool,
    unacked: AtomicU32,
    // Dropped after the CQ and channel are destroyed (Drop::drop runs first).
    ctx: VerbsContext,
}

// SAFETY: CQ verbs (poll, req_notify, get/ack events, destroy) are thread-safe in libibverbs;
// the counters are atomics, and destruction happens once, in Drop, with no other reference.
unsafe impl Send for CompletionQueue {}
// SAFETY: see the Send impl.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Creates a CQ with room for `depth` completions, with its own completion channel (whose
    /// descriptor this crate makes non-blocking before it first reads it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero depth; [`Error::Call`] when a verb fails.
    pub fn new(ctx: &VerbsContext, depth: u32) -> Result<Arc<CompletionQueue>> {
        if depth == 0 || depth > i32::MAX as u32 {
            return Err(Error::InvalidArgument(format!("CQ depth {depth} must be between 1 and {}", i32::MAX)));
        }
        // SAFETY: the context is open while `ctx` lives; NULL is checked.
        let channel = check_ptr(unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) }, "ibv_create_comp_channel")?;
        // SAFETY: context and channel valid; cq_context unused (NULL).
        let raw = unsafe { ffi::ibv_create_cq(ctx.as_raw(), depth as i32, std::ptr::null_mut(), channel.as_ptr(), 0) };
        let raw = match check_ptr(raw, "ibv_create_cq") {
            Ok(r) => r,
            Err(e) => {
                // SAFETY: the channel has no CQ attached; destroy it once.
                unsafe { ffi::ibv_destroy_comp_channel(channel.as_ptr()) };
                return Err(e);
            }
        };
        let cq = CompletionQueue {
            raw,
            channel,
            depth,
            claimed: AtomicBool::new(false),
            nonblocking: AtomicBool::new(false),
            unacked: AtomicU32::new(0),
            ctx: ctx.clone(),
        };
        Ok(Arc::new(cq))
    }

    /// Makes the channel's descriptor non-blocking, once. Everything that reads the channel
    /// calls this first, so no read can block; [`AsFd`] users get it through
    /// [`CompletionQueue::drain_events`].
    fn ensure_nonblocking(&self) -> Result<()> {
        if self.nonblocking.load(Ordering::Acquire) {
            return Ok(());
        }
        // Idempotent, so a race between two threads here is harmless.
        crate::wait::set_nonblocking(self.as_raw_fd())?;
        self.nonblocking.store(true, Ordering::Release);
        Ok(())
    }

    /// The raw CQ. It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.raw.as_ptr()
    }

    /// The depth it was created with.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// The context it was created on.
    pub fn context(&self) -> &VerbsContext {
        &self.ctx
    }

    /// Reserves the CQ for one queue pair. Fails if another QP already uses it.
    pub(crate) fn claim(&self) -> Result<()> {
        if self.claimed.swap(true, Ordering::AcqRel) {
            Err(Error::CqInUse)
        } else {
            Ok(())
        }
    }

    pub(crate) fn unclaim(&self) {
        self.claimed.store(false, Ordering::Release);
    }

    /// Asks for an event on the channel at the next completion (`ibv_req_notify_cq`).
    ///
    /// # Errors
    /// [`Error::Call`] when the verb fails.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is valid while `self` lives.
        check_ibv(unsafe { ffi::ibv_req_notify_cq(self.as_raw(), solicited_only as i32) }, "ibv_req_notify_cq")
    }

    /// Reads every pending event from the non-blocking channel and returns how many there were.
    /// Acks are batched. Call after the descriptor became readable (edge-triggered safe).
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_cq_event` fails with anything but `EAGAIN`.
    pub fn drain_events(&self) -> Result<u32> {
        self.ensure_nonblocking()?;
        let mut n = 0;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut cq_ctx = std::ptr::null_mut();
            // SAFETY: channel valid; out-pointers valid. The fd is non-blocking, so this
            // returns -1/EAGAIN instead of waiting when no event is pending.
            let ret = unsafe { ffi::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut cq_ctx) };
            if ret != 0 {
                let e = errno();
                if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                    return Ok(n);
                }
                return Err(Error::call("ibv_get_cq_event", e, None));
            }
            n += 1;
            if self.unacked.fetch_add(1, Ordering::AcqRel) + 1 >= ACK_BATCH {
                self.ack_pending();
            }
        }
    }

    fn ack_pending(&self) {
        let n = self.unacked.swap(0, Ordering::AcqRel);
        if n > 0 {
            // SAFETY: we received `n` events for this CQ on its channel and ack each once.
            unsafe { ffi::ibv_ack_cq_events(self.as_raw(), n) };
        }
    }

    /// Polls up to `out.len()` raw completions (`ibv_poll_cq`).
    pub(crate) fn poll_raw(&self, out: &mut [std::mem::MaybeUninit<ffi::ibv_wc>]) -> Result<usize> {
        let n = out.len().min(i32::MAX as usize) as i32;
        // SAFETY: the CQ is valid; `out` has room for `n` entries that the provider writes.
        let ret = unsafe { ffi::ibv_poll_cq(self.as_raw(), n, out.as_mut_ptr().cast()) };
        if ret < 0 {
            // ibv_poll_cq's convention: a negative value, errno not reliably set.
            return Err(Error::call("ibv_poll_cq", if ret == -1 { libc::EIO } else { -ret }, None));
        }
        Ok(ret as usize)
    }
}

impl AsRawFd for CompletionQueue {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is valid while `self` lives; `fd` is plain data.
        unsafe { (*self.channel.as_ptr()).fd }
    }
}

impl AsFd for CompletionQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor stays open until `self` drops.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        self.ack_pending();
        // SAFETY: every QP using this CQ holds an Arc of it, so none is alive; all events are
        // acked above. The CQ and then its channel are destroyed exactly once.
        let ret = unsafe { ffi::ibv_destroy_cq(self.as_raw()) };
        if ret != 0 {
            crate::report_leak("ibv_destroy_cq", ret);
            return; // the channel is still in use by the leaked CQ
        }
        // SAFETY: no CQ is attached to the channel any more.
        let ret = unsafe { ffi::ibv_destroy_comp_channel(self.channel.as_ptr()) };
        if ret != 0 {
            crate::report_leak("ibv_destroy_comp_channel", ret);
        }
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("depth", &self.depth).field("fd", &self.as_raw_fd()).finish()
    }
}

macro_rules! wc_status {
    ($( $var:ident = $c:ident, $name:literal, $hint:expr; )*) => {
        /// The status of a work completion (`enum ibv_wc_status`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum WcStatus {
            $( #[doc = concat!("`IBV_WC_", $name, "`")] $var, )*
            /// A value this crate does not know.
            Other(u32),
        }
        impl WcStatus {
            /// Maps the raw value.
            pub fn from_raw(v: u32) -> WcStatus {
                use ffi::ibv_wc_status::*;
                match v { $( $c => WcStatus::$var, )* v => WcStatus::Other(v) }
            }
            /// The usual cause, when known.
            pub fn hint(self) -> Option<&'static str> {
                match self { $( WcStatus::$var => $hint, )* WcStatus::Other(_) => None }
            }
        }
        impl fmt::Display for WcStatus {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self { $( WcStatus::$var => f.write_str($name), )* WcStatus::Other(v) => write!(f, "status {v}") }
            }
        }
    };
}

wc_status! {
    Success = IBV_WC_SUCCESS, "SUCCESS", None;
    LocLenErr = IBV_WC_LOC_LEN_ERR, "LOC_LEN_ERR", Some("the message is larger than the posted receive buffer");
    LocQpOpErr = IBV_WC_LOC_QP_OP_ERR, "LOC_QP_OP_ERR", Some("the work request is invalid for this QP (e.g. inline data too long)");
    LocEecOpErr = IBV_WC_LOC_EEC_OP_ERR, "LOC_EEC_OP_ERR", None;
    LocProtErr = IBV_WC_LOC_PROT_ERR, "LOC_PROT_ERR", Some("a local buffer is not covered by its memory region or lacks LOCAL_WRITE");
    WrFlushErr = IBV_WC_WR_FLUSH_ERR, "WR_FLUSH_ERR", Some("the QP went to the error state (peer disconnected, or an earlier work request failed)");
    MwBindErr = IBV_WC_MW_BIND_ERR, "MW_BIND_ERR", None;
    BadRespErr = IBV_WC_BAD_RESP_ERR, "BAD_RESP_ERR", None;
    LocAccessErr = IBV_WC_LOC_ACCESS_ERR, "LOC_ACCESS_ERR", None;
    RemInvReqErr = IBV_WC_REM_INV_REQ_ERR, "REM_INV_REQ_ERR", Some("the peer rejected the request: message larger than its receive buffer, or an operation it does not allow");
    RemAccessErr = IBV_WC_REM_ACCESS_ERR, "REM_ACCESS_ERR", Some("the remote address, rkey or access rights do not allow this RDMA READ/WRITE");
    RemOpErr = IBV_WC_REM_OP_ERR, "REM_OP_ERR", Some("the peer could not complete the operation (e.g. its receive buffer is too small)");
    RetryExcErr = IBV_WC_RETRY_EXC_ERR, "RETRY_EXC_ERR", Some("the peer did not acknowledge: it is gone or the link is down (check `rdma link`)");
    RnrRetryExcErr = IBV_WC_RNR_RETRY_EXC_ERR, "RNR_RETRY_EXC_ERR", Some("the peer had no receive posted (receiver not ready)");
    LocRddViolErr = IBV_WC_LOC_RDD_VIOL_ERR, "LOC_RDD_VIOL_ERR", None;
    RemInvRdReqErr = IBV_WC_REM_INV_RD_REQ_ERR, "REM_INV_RD_REQ_ERR", None;
    RemAbortErr = IBV_WC_REM_ABORT_ERR, "REM_ABORT_ERR", None;
    InvEecnErr = IBV_WC_INV_EECN_ERR, "INV_EECN_ERR", None;
    InvEecStateErr = IBV_WC_INV_EEC_STATE_ERR, "INV_EEC_STATE_ERR", None;
    FatalErr = IBV_WC_FATAL_ERR, "FATAL_ERR", Some("the device reported a fatal error");
    RespTimeoutErr = IBV_WC_RESP_TIMEOUT_ERR, "RESP_TIMEOUT_ERR", Some("the peer did not respond in time");
    GeneralErr = IBV_WC_GENERAL_ERR, "GENERAL_ERR", None;
}

/// What a completed work request did (`enum ibv_wc_opcode`). Valid only for successful
/// completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A send.
    Send,
    /// An RDMA WRITE.
    RdmaWrite,
    /// An RDMA READ.
    RdmaRead,
    /// Compare-and-swap.
    CompSwap,
    /// Fetch-and-add.
    FetchAdd,
    /// A receive.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate data.
    RecvRdmaWithImm,
    /// A value this crate does not map.
    Other(u32),
}

impl WcOpcode {
    /// Maps the raw value.
    pub fn from_raw(v: u32) -> WcOpcode {
        use ffi::ibv_wc_opcode::*;
        match v {
            IBV_WC_SEND => WcOpcode::Send,
            IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
            IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            IBV_WC_RECV => WcOpcode::Recv,
            IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            v => WcOpcode::Other(v),
        }
    }
}

/// Which work queue a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WorkQueue {
    /// The send queue (sends, RDMA READ/WRITE).
    #[default]
    Send,
    /// The receive queue.
    Recv,
}

/// A work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub struct WorkCompletion {
    pub(crate) wr_id: u64,
    pub(crate) status: WcStatus,
    pub(crate) opcode: u32,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    pub(crate) imm: Option<u32>,
    pub(crate) qp_num: u32,
    pub(crate) queue: WorkQueue,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: 0,
            vendor_err: 0,
            byte_len: 0,
            imm: None,
            qp_num: 0,
            queue: WorkQueue::Send,
        }
    }
}

impl WorkCompletion {
    pub(crate) fn from_raw(wc: &ffi::ibv_wc, wr_id: u64, queue: WorkQueue) -> WorkCompletion {
        let with_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
        WorkCompletion {
            wr_id,
            status: WcStatus::from_raw(wc.status),
            opcode: wc.opcode,
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            // SAFETY: with IBV_WC_WITH_IMM set, the union holds imm_data (network order).
            imm: with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
            qp_num: wc.qp_num,
            queue,
        }
    }

    /// The `wr_id` the caller gave the work request.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The status.
    pub fn status(&self) -> WcStatus {
        self.status
    }

    /// Whether it succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }

    /// `Ok(self)` on success, else [`Error::WorkCompletion`] with the status and vendor error.
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] when the status is not `SUCCESS`.
    pub fn ok(self) -> Result<WorkCompletion> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion { wr_id: self.wr_id, status: self.status, vendor_err: self.vendor_err })
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

    /// Immediate data in host order, when the peer sent any.
    pub fn imm_data(&self) -> Option<u32> {
        self.imm
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
        let wc = WorkCompletion { status: WcStatus::RemAccessErr, vendor_err: 0x81, wr_id: 9, ..Default::default() };
        assert_eq!(wc.opcode(), None);
        let e = wc.ok().unwrap_err();
        let m = e.to_string();
        assert!(m.contains("REM_ACCESS_ERR") && m.contains("0x81") && m.contains("rkey"), "{m}");
        let ok = WorkCompletion { opcode: ffi::ibv_wc_opcode::IBV_WC_RECV, ..Default::default() };
        assert_eq!(ok.opcode(), Some(WcOpcode::Recv));
    }
}
