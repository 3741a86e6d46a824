//! The provider's post and poll entry points, read once.
//!
//! libibverbs' `ibv_poll_cq`, `ibv_post_send` and `ibv_post_recv` are inline functions: each
//! loads the context from the CQ or QP, the provider's function from the context's table,
//! tests it for NULL and calls it. The table is filled when the device is opened and is not
//! written again while the context is open (libibverbs sets it in `verbs_set_ops`, from the
//! provider's `alloc_context`, before the context is handed out), so a lane reads each entry
//! once: its CQ's `poll_cq` when it is made, a QP's `post_send` and `post_recv` when the QP is
//! attached. A post or a poll then loads one pointer and calls it: four instructions fewer
//! each (callgrind), and two dependent loads fewer in front of the provider's own on a hardware NIC.

use std::os::raw::c_int;
use std::ptr::NonNull;

use super::{Lane, Member};
use crate::error::{Error, Result};
use crate::ffi;

/// The provider's `poll_cq`.
pub(super) type PollCq = unsafe extern "C" fn(*mut ffi::ibv_cq, c_int, *mut ffi::ibv_wc) -> c_int;
/// The provider's `post_send`.
pub(super) type PostSend =
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_send_wr, *mut *mut ffi::ibv_send_wr) -> c_int;
/// The provider's `post_recv`.
pub(super) type PostRecv =
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> c_int;

#[cold]
fn missing(what: &str) -> Error {
    Error::InvalidArgument(format!("the provider's context has no {what} (not a verbs device?)"))
}

/// The `poll_cq` of the context `cq` was made on.
///
/// # Safety
/// `cq` is a live CQ. The function returned may be called on it, and on any CQ of the same
/// context, while that context is open (the CQ holds it open).
pub(super) unsafe fn poll_cq_of(cq: NonNull<ffi::ibv_cq>) -> Result<PollCq> {
    // SAFETY: `cq` is live (the caller's promise), so is its context, whose table libibverbs
    // filled before handing the context out.
    unsafe { (*(*cq.as_ptr()).context).ops.poll_cq }.ok_or_else(|| missing("poll_cq"))
}

/// The `post_send` and `post_recv` of the context `qp` was made on; on an iWARP device
/// (`iwarp`) the `post_send` is `iwarp_post_send`, which calls the context's.
///
/// # Safety
/// `qp` is a live QP. The functions returned may be called on it while its context is open
/// (the QP holds it open).
pub(super) unsafe fn post_of(qp: NonNull<ffi::ibv_qp>, iwarp: bool) -> Result<(PostSend, PostRecv)> {
    // SAFETY: as in `poll_cq_of`, for the QP's context.
    let ops = unsafe { &(*(*qp.as_ptr()).context).ops };
    let post_send = ops.post_send.ok_or_else(|| missing("post_send"))?;
    let post_send = if iwarp { iwarp_post_send as PostSend } else { post_send };
    Ok((post_send, ops.post_recv.ok_or_else(|| missing("post_recv"))?))
}

/// The `post_send` a lane calls on an iWARP QP. iWARP has no immediate data, yet rdma-core
/// 44's Soft-iWARP library takes a send or WRITE that carries it, and the device then runs
/// nothing more on the QP: no completion, no flush. This refuses such a request as a provider
/// should (`EINVAL`, naming it in `bad`, after posting the ones before it) and hands everything
/// else to the provider's own `post_send`, read from the QP's context at each call.
///
/// # Safety
/// As for the provider's `post_send`: `qp` is live, `wr` a NULL-terminated list of valid work
/// requests, `bad` valid for a write.
unsafe extern "C" fn iwarp_post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> c_int {
    use ffi::ibv_wr_opcode::{IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND_WITH_IMM};
    // SAFETY: the caller's promises: the list's entries are valid and NULL-terminated, the QP
    // and its context live (the context's table was filled before it was handed out).
    unsafe {
        let Some(post) = (*(*qp).context).ops.post_send else { return libc::EINVAL };
        let (mut prev, mut w): (*mut ffi::ibv_send_wr, *mut ffi::ibv_send_wr) = (std::ptr::null_mut(), wr);
        while !w.is_null() {
            if (*w).opcode == IBV_WR_SEND_WITH_IMM || (*w).opcode == IBV_WR_RDMA_WRITE_WITH_IMM {
                if !prev.is_null() {
                    // The ones before it go to the provider, the list cut after them for the
                    // call and mended after it.
                    (*prev).next = std::ptr::null_mut();
                    let ret = post(qp, wr, bad);
                    (*prev).next = w;
                    if ret != 0 {
                        return ret;
                    }
                }
                *bad = w;
                return libc::EINVAL;
            }
            prev = w;
            w = (*w).next;
        }
        post(qp, wr, bad)
    }
}

impl Lane {
    /// Reads the provider's post and poll functions again, from the device context's table,
    /// for its CQ and every attached QP.
    ///
    /// The lane reads them once (its CQ's `poll_cq` when it is made, a QP's `post_send` and
    /// `post_recv` when it is attached) and calls them from then on, which saves each post and
    /// poll four instructions. A program that replaces entries of that table through the raw
    /// `ibv_context` (a fault injector, a tracer) calls this after each replacement, so that
    /// the lane calls what the table holds now.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when an entry is NULL; the lane then keeps what it had.
    pub fn reload_provider_functions(&mut self) -> Result<()> {
        // SAFETY: the CQ is alive (held by `self.cq`).
        let poll_cq = unsafe { poll_cq_of(self.cq_raw) }?;
        let mut posts = Vec::with_capacity(self.members.len());
        for m in self.members.iter().flatten() {
            // SAFETY: the member's QP is alive (its owner is kept in the member).
            posts.push(unsafe { post_of(m.raw, m.in_order()) }?);
        }
        self.poll_cq = poll_cq;
        for (m, (send, recv)) in self.members.iter_mut().flatten().zip(posts) {
            m.post_send = send;
            m.post_recv = recv;
        }
        Ok(())
    }
}

impl Member {
    /// Posts `wr` through the provider's `post_send` for this QP, as `ibv_post_send` would.
    ///
    /// # Safety
    /// As for `ibv_post_send`: `wr` is a NULL-terminated list, valid for the call, whose pieces
    /// stay allocated and out of Rust's reach until their completions; `bad` is writable.
    #[inline(always)]
    pub(super) unsafe fn provider_post_send(
        &self,
        wr: *mut ffi::ibv_send_wr,
        bad: *mut *mut ffi::ibv_send_wr,
    ) -> c_int {
        // SAFETY: `wr` and `bad` as the caller promises; `post_send` was read from this QP's own
        // context (at attach or reload), which the QP, kept by this member, holds open.
        unsafe { (self.post_send)(self.raw.as_ptr(), wr, bad) }
    }

    /// Posts `wr` through the provider's `post_recv` for this QP, as `ibv_post_recv` would.
    ///
    /// # Safety
    /// As for [`Member::provider_post_send`], for a list of receives.
    #[inline(always)]
    pub(super) unsafe fn provider_post_recv(
        &self,
        wr: *mut ffi::ibv_recv_wr,
        bad: *mut *mut ffi::ibv_recv_wr,
    ) -> c_int {
        // SAFETY: as in `provider_post_send`, with the QP's `post_recv`.
        unsafe { (self.post_recv)(self.raw.as_ptr(), wr, bad) }
    }
}
