//! A refused [`MemoryRegion::into_buffer_as`], and the error of a registration that failed.

use std::fmt;

use super::MemoryRegion;
use crate::error::Error;

/// A refused [`MemoryRegion::into_buffer_as`]: the error, and the region, given back untouched
/// (`None` only when deregistration failed, and the buffer was leaked).
pub struct IntoBufferError {
    pub(super) error: Error,
    pub(super) region: Option<MemoryRegion>,
}

impl IntoBufferError {
    /// The error.
    pub fn error(&self) -> &Error {
        &self.error
    }
    /// The region, still registered and holding its buffer.
    pub fn into_region(self) -> Option<MemoryRegion> {
        self.region
    }
    /// The error and the region.
    pub fn into_parts(self) -> (Error, Option<MemoryRegion>) {
        (self.error, self.region)
    }
}

impl From<IntoBufferError> for Error {
    fn from(e: IntoBufferError) -> Error {
        e.error
    }
}

impl fmt::Debug for IntoBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IntoBufferError").field("error", &self.error).field("region", &self.region).finish()
    }
}

impl fmt::Display for IntoBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for IntoBufferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The error of an `ibv_reg_mr` that failed with `e` for `len` bytes: [`Error::MemLock`] when
/// the locked-memory limit is the likely cause, naming it.
pub(super) fn reg_error(len: usize, e: i32) -> Error {
    if e == libc::ENOMEM || e == libc::EPERM || e == libc::EAGAIN {
        let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: rl is a valid out-pointer for getrlimit.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } == 0;
        if ok && rl.rlim_cur != libc::RLIM_INFINITY && (len as u64) > rl.rlim_cur / 2 {
            return Error::MemLock { len, limit: Some(rl.rlim_cur), source: std::io::Error::from_raw_os_error(e) };
        }
    }
    Error::call("ibv_reg_mr", e, None)
}
