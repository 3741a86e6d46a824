//! Memory windows: revocable remote access to a part of a memory region.
//!
//! ```no_run
//! use rdma_cm::verbs::lane::{BindWr, Lane, LaneQp};
//! use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain};
//! use rdma_cm::verbs::mw::{MemoryWindow, WindowType};
//! use std::sync::Arc;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! # let (lane, qp, pd): (&mut Lane, LaneQp, Arc<ProtectionDomain>) = unimplemented!();
//! let mr = MemoryRegion::new(&pd, 1 << 20, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
//! let mw = MemoryWindow::new(&pd, WindowType::Two)?;
//! // Grant the peer READs of the first 4 KiB only, until the window is invalidated.
//! let bound = lane.bind_window(qp, BindWr::new(mw, mr, 0..4096, AccessFlags::REMOTE_READ).wr_id(7))?;
//! let remote = bound.remote(); // send this to the peer
//! # let _ = remote;
//! # Ok(()) }
//! ```
//!
//! A region's own rkey opens all of it for as long as it lives. A [`MemoryWindow`] is
//! allocated on a protection domain and bound to a range of a region with chosen remote rights;
//! its rkey then grants exactly that range and those rights, until the window is invalidated
//! (locally, or by the peer's send with invalidate) or unbound:
//!
//! ```text
//!  MemoryWindow::new(pd, Type1 | Type2)        (ibv_alloc_mw)       unbound
//!   │ Lane::bind_window(qp, BindWr::new(mw, mr, range, rights))     type 1: ibv_bind_mw
//!   ▼                                                              type 2: IBV_WR_BIND_MW
//!  BoundWindow ── rkey(), remote(): hand them to the peer
//!   │ Lane::invalidate_window(qp, bound, wr_id)                    type 1: a zero-length bind
//!   │                                                              type 2: IBV_WR_LOCAL_INV
//!   │ BoundWindow::invalidated_by(wc)   (the peer's IBV_WR_SEND_WITH_INV, type 2)
//!   ▼
//!  MemoryWindow (unbound again; bind it anew)          drop: ibv_dealloc_mw (invalidates)
//! ```
//!
//! The bind and the invalidation are work requests on the QP's send queue, posted signaled with
//! the caller's `wr_id`: their completions come back through the lane's polls and waits like
//! any other (`IBV_WC_BIND_MW`, `IBV_WC_LOCAL_INV`); see [`crate::verbs::lane`] for what the
//! lane adds. The QP's send queue is ordered, so a send of
//! the rkey posted after the bind on the same QP reaches the peer after the bind took effect.
//!
//! # Soundness
//!
//! - **The region outlives every window bound to it.** A [`BoundWindow`] holds the region it
//!   was bound to, so `ibv_dereg_mr` waits until the window is unbound or dropped (which
//!   deallocates it first).
//! - **Memory a peer may write is never lent to Rust.** A window bound with remote write or
//!   atomic rights counts as a writer of the region while it is bound: the region's
//!   accessors ([`MemoryRegion::as_slice`] and the others) refuse (`Error::InFlight`) until it
//!   is unbound. A region needs [`AccessFlags::MW_BIND`] to take windows at all.
//! - **Revocation is not assumed before it happens.** Invalidating posts the invalidation and
//!   hands the window back at once, but the region stays held, as written to, until the
//!   invalidation's *successful* completion is reaped: a peer's access that
//!   raced it can never reach memory Rust reads or has freed. An invalidation that fails or
//!   never runs (flushed, or its QP destroyed first) may leave the window bound, a type 1
//!   window reachable through any QP of the protection domain: its region is then leaked,
//!   never released. A peer's send with invalidate ([`BoundWindow::invalidated_by`]) names an
//!   rkey, not a binding, and an rkey can come back with a later binding, so the window it
//!   returns keeps holding the region until it is deallocated (dropped), and is not bound
//!   again.
//! - **A window's deallocation is what releases its region** when nothing else proves the
//!   binding gone: a [`BoundWindow`] dropped deallocates its window first; a deallocation that
//!   fails leaks the region.
//! - **A window's rkey grants only its rights, and never more than its region.** The range is
//!   checked against the region before the bind, the rights against the region's registration
//!   (remote write and atomic rights need `LOCAL_WRITE`), and the window, the region and the QP
//!   must share one protection domain. The device enforces the window's range, on hardware; rxe
//!   checks accesses through a window against the bounds of its region only (measured on
//!   rxe/6.1: a write 4 KiB past a window's end, inside its region, succeeds). So a bound
//!   window holds its whole region (out of Rust's reach if it grants writes), and windows are
//!   refused in chunks of a split registration, whose siblings Rust may be reading.
//! - `mem::forget` of a bound window leaks its hold: the region is never freed, and stays out
//!   of reach if the window could write it. Safe.
//!
//! # Providers
//!
//! - Soft-RoCE (`rxe`) has type 1 and type 2B windows. Two quirks, measured on rxe/6.1:
//!   - the receive completion of the peer's send with invalidate carries the kernel's
//!     `IB_WC_WITH_INVALIDATE` bit (`1 << 2`, which libibverbs reads as `IBV_WC_IP_CSUM_OK`)
//!     instead of `IBV_WC_WITH_INV` (`1 << 3`). The invalidation itself takes effect (the peer's
//!     next access fails), but [`BoundWindow::invalidated_by`] trusts only `IBV_WC_WITH_INV` and
//!     so keeps the window bound there; drop it (deallocation invalidates) to release the region;
//!   - destroying a QP while a type 2 window it bound is still bound makes the kernel wait
//!     about 50 s for the window's reference (51 s measured). Invalidate or drop type 2 windows
//!     before their QP.
//! - Soft-iWARP (`siw`) has none: `ibv_alloc_mw` fails, reported as [`Error::Unsupported`].

use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use rdma_sys as ffi;

use crate::error::{errno, Error, Result};
use crate::verbs::hold::Hold;
use crate::verbs::lane::Wc;
use crate::verbs::mr::{check_range, AccessFlags, MemoryRegion, RemoteRegion};
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::Parked;

/// The two kinds of memory window (`enum ibv_mw_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WindowType {
    /// Type 1: bound with `ibv_bind_mw` (a work request the library builds); not tied to a QP.
    One,
    /// Type 2 (2B on rxe): bound with a bind work request, tied to the QP that bound it, and
    /// invalidated by a local invalidation or the peer's send with invalidate.
    Two,
}

/// "type 1" or "type 2", as the verbs documentation names them.
impl fmt::Display for WindowType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WindowType::One => "type 1",
            WindowType::Two => "type 2",
        })
    }
}

impl WindowType {
    fn raw(self) -> ffi::ibv_mw_type::Type {
        match self {
            WindowType::One => ffi::ibv_mw_type::IBV_MW_TYPE_1,
            WindowType::Two => ffi::ibv_mw_type::IBV_MW_TYPE_2,
        }
    }
}

/// An unbound memory window on a protection domain (`ibv_alloc_mw`). Its rkey opens nothing.
pub struct MemoryWindow {
    raw: NonNull<ffi::ibv_mw>,
    kind: WindowType,
    /// The region it is bound to ([`BoundWindow`]), or was bound to when the peer's send with
    /// invalidate unbound it ([`BoundWindow::invalidated_by`]): released once the window is
    /// deallocated (leaked if that fails).
    held: Option<Hold>,
    // Dropped after the window is deallocated (Drop::drop runs before fields drop).
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the window is owned uniquely by this value; libibverbs' window calls are thread-safe,
// and the only field read through `&self` (`rkey`) is written by binds, which take `self` by
// value or through the QP's `&mut`.
unsafe impl Send for MemoryWindow {}
// SAFETY: as above: nothing reachable through `&MemoryWindow` changes the window.
unsafe impl Sync for MemoryWindow {}

impl MemoryWindow {
    /// Allocates a window of `kind` on `pd` (`ibv_alloc_mw`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the device has no memory windows (of that type);
    /// [`Error::Call`] naming `ibv_alloc_mw` otherwise.
    pub fn new(pd: &Arc<ProtectionDomain>, kind: WindowType) -> Result<MemoryWindow> {
        // SAFETY: the PD is valid while `pd` lives; ibv_alloc_mw only reads it.
        let raw = unsafe { ffi::ibv_alloc_mw(pd.as_raw(), kind.raw()) };
        let raw = match raw {
            Some(p) => NonNull::new(p),
            None => None,
        };
        let Some(raw) = raw else {
            let e = errno();
            return Err(if e == libc::EOPNOTSUPP || e == libc::ENOSYS || e == 0 {
                Error::Unsupported {
                    what: "memory windows",
                    why: format!(
                        "device {} has no memory windows of {kind} (ibv_alloc_mw: {}); Soft-iWARP has none",
                        pd.context().device_name(),
                        crate::error::errno_name(if e == 0 { libc::EOPNOTSUPP } else { e })
                    ),
                }
            } else {
                Error::call("ibv_alloc_mw", e, None)
            });
        };
        Ok(MemoryWindow { raw, kind, held: None, pd: Arc::clone(pd) })
    }

    /// The window's type.
    pub fn kind(&self) -> WindowType {
        self.kind
    }

    /// The protection domain it is on.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The raw window. Binding it through `ffi` bypasses the holds above: see the module docs.
    pub fn as_raw(&self) -> *mut ffi::ibv_mw {
        self.raw.as_ptr()
    }

    /// The rkey the window has now (a bind gives it a new one).
    pub(crate) fn current_rkey(&self) -> u32 {
        // SAFETY: the window is valid while `self` lives; `rkey` is plain data that only binds
        // change, and those need `self` (or the QP's `&mut`).
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// Records `rkey` as the key a type 2 window has now, once the provider took a bind that
    /// gives it that key. A type 2 bind names the window's key and the next one
    /// (`ibv_inc_rkey`); the library does not update `ibv_mw::rkey` for it (as `ibv_bind_mw`
    /// does for type 1), so the next bind would name the stale key, which rxe fails with
    /// `MW_BIND_ERR` (measured on rxe/6.1).
    pub(crate) fn record_rkey(&mut self, rkey: u32) {
        // SAFETY: the window is valid while `self` lives, and `&mut self` excludes every
        // reader of `rkey` (`current_rkey` takes `&self`); the provider copied the key into
        // the bind when it was posted, and reads this one at the next.
        unsafe { (*self.raw.as_ptr()).rkey = rkey };
    }

    /// Checks a bind of this window to `mr[range]` with `rights`, before anything is posted.
    pub(crate) fn check_bind(
        &self,
        qp_pd: &Arc<ProtectionDomain>,
        mr: &MemoryRegion,
        range: &Range<usize>,
        rights: AccessFlags,
    ) -> Result<()> {
        if !Arc::ptr_eq(&self.pd, qp_pd) {
            return Err(Error::InvalidArgument(
                "the memory window is on another protection domain than the QP that would bind it".into(),
            ));
        }
        if self.held.is_some() {
            return Err(Error::InvalidArgument(
                "the memory window still holds the region of its last binding, which the peer invalidated (BoundWindow::invalidated_by): a send with invalidate cannot be told apart from an older one that named the same rkey, so only deallocating the window releases that region; drop this window and bind a new one".into(),
            ));
        }
        if !mr.inner().on_pd(qp_pd) {
            return Err(Error::InvalidArgument(
                "the memory region is on another protection domain than the window and the QP".into(),
            ));
        }
        if !mr.inner().is_whole() {
            return Err(Error::InvalidArgument(
                "a window is bound in a whole registration, not in a chunk of a split one: some devices (rxe) check a window's accesses against the bounds of the region it is in, not its own, so the crate holds the whole region while the window is bound".into(),
            ));
        }
        let reg = mr.access();
        if !reg.contains(AccessFlags::MW_BIND) {
            return Err(Error::InvalidArgument(
                "the memory region takes no windows: register it with AccessFlags::MW_BIND".into(),
            ));
        }
        let allowed = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        if !allowed.contains(rights) || rights.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "a window grants remote rights only (REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC), at least one; got {rights:?}"
            )));
        }
        if rights.remotely_writable() && !reg.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "a window with remote write or atomic rights needs a region registered with LOCAL_WRITE".into(),
            ));
        }
        if range.start >= range.end {
            return Err(Error::InvalidArgument(format!("window range {range:?} is empty or reversed")));
        }
        check_range(range.start, range.len(), mr.len())
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_mw and deallocated once, here.
        let ret = unsafe { ffi::ibv_dealloc_mw(self.raw.as_ptr()) };
        if ret != 0 {
            crate::error::report_leak("ibv_dealloc_mw", ret);
            // Still allocated, perhaps still bound: the region it held stays held, for good.
            std::mem::forget(self.held.take());
        }
        // Deallocated: no rkey of it opens anything now, and the region it held (dropped with
        // the fields, after this) is released.
    }
}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow").field("kind", &self.kind).field("rkey", &self.current_rkey()).finish()
    }
}

/// A memory window bound to a range of a region: its [`rkey`](BoundWindow::rkey) grants the
/// peer that range with the rights it was bound with. It holds the region (see the module
/// docs); unbind it with [`Lane::invalidate_window`](crate::verbs::lane::Lane::invalidate_window)
/// or drop it (which deallocates the window).
pub struct BoundWindow {
    /// The window, holding the region (`MemoryWindow::held`) while it is bound: dropped, it is
    /// deallocated before the region is released.
    mw: MemoryWindow,
    rkey: u32,
    addr: u64,
    len: u64,
    rights: AccessFlags,
    /// The QP that posted the bind (its identity): only that QP's send queue orders an
    /// invalidation after the bind.
    bound_on: Weak<Mutex<Parked>>,
}

impl BoundWindow {
    pub(crate) fn new(
        mw: MemoryWindow,
        hold: Hold,
        rkey: u32,
        addr: u64,
        len: u64,
        rights: AccessFlags,
        bound_on: &Arc<Mutex<Parked>>,
    ) -> BoundWindow {
        let mut mw = mw;
        mw.held = Some(hold);
        BoundWindow { mw, rkey, addr, len, rights, bound_on: Arc::downgrade(bound_on) }
    }

    /// Whether the QP of this identity posted the bind.
    pub(crate) fn bound_on(&self, queues: &Arc<Mutex<Parked>>) -> bool {
        std::ptr::eq(self.bound_on.as_ptr(), Arc::as_ptr(queues))
    }

    /// The rkey that opens the window.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// What the peer needs to reach the window: its address (the region's address plus the
    /// offset it was bound at), its rkey and its length.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion::new(self.addr, self.rkey, self.len)
    }

    /// The rights it was bound with.
    pub fn rights(&self) -> AccessFlags {
        self.rights
    }

    /// The window's type.
    pub fn kind(&self) -> WindowType {
        self.mw.kind
    }

    /// The window underneath, for its raw handle.
    pub fn window(&self) -> &MemoryWindow {
        &self.mw
    }

    /// The window back, unbound, when `wc` is a successful receive completion of a send with
    /// invalidate that named this window's rkey (`IBV_WC_WITH_INV`), on the QP a type 2 window
    /// is bound to. Any other completion, and any completion for a type 1 window (which no
    /// send invalidates), gives the bound window back unchanged.
    ///
    /// The window it returns **still holds the region** (as written to, if it granted writes)
    /// until it is dropped, which deallocates it; it cannot be bound again. A completion names
    /// an rkey, not a binding: a rebound window can have its old rkey again (a provider that
    /// keeps a type 2 window's key, or the key byte's 256 values come round), and a completion
    /// of an earlier binding, kept by the caller or polled late, would then pass for this one's
    /// while the window is bound. Only the deallocation is proof. To bind again without
    /// deallocating, invalidate locally ([`Lane::invalidate_window`](crate::verbs::lane::Lane::invalidate_window)),
    /// whose own completion confirms it.
    ///
    /// # Errors
    /// The bound window itself, when `wc` did not invalidate it.
    pub fn invalidated_by(self, wc: &Wc) -> std::result::Result<MemoryWindow, BoundWindow> {
        if self.mw.kind == WindowType::Two && wc.is_ok() && wc.invalidated_rkey() == Some(self.rkey) {
            // `held` stays with the window, released by its deallocation.
            Ok(self.mw)
        } else {
            Err(self)
        }
    }

    /// The window (holding nothing) and the region's hold, apart.
    pub(crate) fn into_parts(self) -> (MemoryWindow, Hold) {
        let mut mw = self.mw;
        let hold = mw.held.take().expect("a bound window holds its region");
        (mw, hold)
    }

    /// The region it is bound to, for the invalidation's hold.
    pub(crate) fn hold(&self) -> &Hold {
        self.mw.held.as_ref().expect("a bound window holds its region")
    }
}

impl fmt::Debug for BoundWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundWindow")
            .field("kind", &self.mw.kind)
            .field("rkey", &self.rkey)
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("rights", &self.rights)
            .finish()
    }
}

/// An invalidation that was refused before it was posted, or that the provider refused: the
/// error, and the window, still bound (and still holding its region).
#[derive(Debug)]
pub struct InvalidateError {
    /// Why.
    pub error: Error,
    /// The window, as it was.
    pub window: BoundWindow,
}

impl fmt::Display for InvalidateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalidating memory window {:#x}: {}", self.window.rkey, self.error)
    }
}

impl std::error::Error for InvalidateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
