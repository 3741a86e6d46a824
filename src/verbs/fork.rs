//! `fork()` and registered memory.
//!
//! ```no_run
//! use rdma_cm::verbs::fork::{fork_init, ForkStatus};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! // In a program that forks: before the first region is registered.
//! match fork_init()? {
//!     ForkStatus::Unneeded => {} // the kernel copies pinned pages at fork(): nothing to do
//!     ForkStatus::Enabled => println!("libibverbs keeps registered ranges out of children"),
//!     ForkStatus::Disabled => println!("do not fork while regions exist"),
//! }
//! # Ok(()) }
//! ```
//!
//! A registered region's pages are pinned for the device. What a child process made by
//! `fork()` sees of them depends on the kernel, and [`fork_status`] says which case this
//! process is in:
//!
//! - [`ForkStatus::Unneeded`]: the kernel copies pinned pages at `fork()` (Linux 5.13 and later;
//!   both of Debian's kernels here, 6.1 and 6.12). The parent keeps the pages the device uses;
//!   the child gets copies. Nothing the child writes reaches the parent's regions, and nothing
//!   it frees is the parent's. This is the case measured by the device suite
//!   (`tests/faults.rs`).
//! - [`ForkStatus::Enabled`]: an older kernel, with libibverbs' fork support turned on
//!   ([`fork_init`], or `RDMAV_FORK_SAFE=1` in the environment): registered ranges are marked
//!   `MADV_DONTFORK`, so the child has no mapping of them at all (touching one there faults).
//! - [`ForkStatus::Disabled`]: an older kernel without it: a page the parent and a child share
//!   copy-on-write may be copied for the *parent* when either writes it, and the device then
//!   keeps using the old page: the parent's received data is lost. Call [`fork_init`] before
//!   registering anything, or do not fork while regions exist.
//!
//! Either way the child must not use the parent's RDMA objects: it inherits the descriptors,
//! so a destroy there would destroy the parent's object. In safe Rust a child never does: safe
//! code makes processes only through `std::process::Command`, whose child runs `exec` at once
//! and no Rust code, and a raw `fork()` is `unsafe` (a child of one must leave with `_exit`,
//! running no destructor, as the test does).

use crate::error::{Error, Result};
use rdma_sys as ffi;

/// How this process handles `fork()` with registered memory (`ibv_is_fork_initialized`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ForkStatus {
    /// No fork support: see the module docs before forking while regions exist.
    Disabled,
    /// libibverbs' own fork support is on (`MADV_DONTFORK` on registered ranges).
    Enabled,
    /// The kernel copies pinned pages at `fork()`: nothing to do.
    Unneeded,
}

/// How this process handles `fork()` with registered memory now.
pub fn fork_status() -> ForkStatus {
    // SAFETY: reads libibverbs' process-wide state (and the kernel's, once); no arguments.
    match unsafe { ffi::ibv_is_fork_initialized() } {
        ffi::IBV_FORK_UNNEEDED => ForkStatus::Unneeded,
        ffi::IBV_FORK_ENABLED => ForkStatus::Enabled,
        _ => ForkStatus::Disabled,
    }
}

/// Turns on libibverbs' fork support (`ibv_fork_init`) where the kernel needs it, and says what
/// the process has then. Must come before the first registration of the process.
///
/// # Errors
/// [`Error::Call`] naming `ibv_fork_init`: `EINVAL` when a region was registered already (too
/// late: it must be the first verbs call that registers memory), `ENOSYS` without
/// `MADV_DONTFORK`.
pub fn fork_init() -> Result<ForkStatus> {
    // SAFETY: no arguments; libibverbs guards its own state.
    let ret = unsafe { ffi::ibv_fork_init() };
    if ret != 0 {
        return Err(Error::call("ibv_fork_init", ret, None));
    }
    Ok(fork_status())
}
