//! [`ProtectionDomain`]: an owned `ibv_pd`.
//!
//! ```no_run
//! use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, VerbsContext};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let ctx = VerbsContext::open("rxe0")?;
//! let pd = ProtectionDomain::new(&ctx)?; // an Arc: regions and QPs hold it
//! let mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//! // With the CM, `route.alloc_pd()` or `request.alloc_pd()` gives a PD on the connection's device.
//! # let _ = mr;
//! # Ok(()) }
//! ```
//!
//! A PD holds the [`VerbsContext`] it was allocated on, so the context (and the id that keeps
//! it open) outlives it. Memory regions and queue pairs hold an `Arc` of their PD, so the PD is
//! deallocated only after all of them are gone.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{check_ibv, check_ptr, Result};
use crate::verbs::device::VerbsContext;

/// An owned protection domain.
pub struct ProtectionDomain {
    raw: NonNull<ffi::ibv_pd>,
    // Dropped after `raw` is deallocated (Drop::drop runs before fields drop).
    ctx: VerbsContext,
}

// SAFETY: ibv_pd is used only through thread-safe verbs (reg_mr, create_qp, dealloc_pd), and
// is deallocated once, by Drop, when no other reference exists.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see the Send impl.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a PD on `ctx` (`ibv_alloc_pd`).
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `ibv_alloc_pd` fails.
    pub fn new(ctx: &VerbsContext) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: the context is open while `ctx` lives; the result is checked for NULL.
        let raw = check_ptr(unsafe { ffi::ibv_alloc_pd(ctx.as_raw()) }, "ibv_alloc_pd")?;
        Ok(Arc::new(ProtectionDomain { raw, ctx: ctx.clone() }))
    }

    /// The raw PD, for calls this crate does not wrap. It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.raw.as_ptr()
    }

    /// The context this PD was allocated on.
    pub fn context(&self) -> &VerbsContext {
        &self.ctx
    }

    /// Deallocates the PD now and reports failure, instead of reporting it on stderr in Drop.
    ///
    /// # Errors
    /// [`Error::Call`](crate::Error::Call) when `ibv_dealloc_pd` fails (the PD is then leaked).
    pub fn close(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: we own the PD (by value, so no MR or QP holds it) and free it exactly once;
        // Drop will not run. The context is released afterwards by reading it out.
        let ret = unsafe { ffi::ibv_dealloc_pd(this.raw.as_ptr()) };
        // SAFETY: `this` is never used again, so moving the field out is a plain move.
        drop(unsafe { std::ptr::read(&this.ctx) });
        check_ibv(ret, "ibv_dealloc_pd")
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every MR and QP on this PD holds an Arc of it, so none is alive now; the PD
        // is freed exactly once.
        let ret = unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
        if ret != 0 {
            crate::error::report_leak("ibv_dealloc_pd", ret);
        }
    }
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain").field("context", &self.ctx).finish()
    }
}
