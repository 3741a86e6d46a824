//! On-demand paging (ODP): memory regions whose pages are not pinned.
//!
//! A region registered the ordinary way pins its pages: the kernel faults every page in and
//! locks it in RAM at registration, charges it to the locked-memory limit (`ulimit -l`), and
//! the device keeps its own copy of the page table for as long as the region lives. With
//! [`AccessFlags::ON_DEMAND`] (`IBV_ACCESS_ON_DEMAND`), registration only records the range and
//! the rights: the device asks the kernel for a page's translation the first time it touches
//! it, and the kernel withdraws it again when the page is swapped, migrated or unmapped (the
//! driver follows the process's page tables through MMU notifiers).
//!
//! ```no_run
//! use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, VerbsContext};
//! use rdma_cm::verbs::odp::{AdviseFlags, Advice};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let ctx = VerbsContext::open("rxe0")?;
//! let odp = ctx.limits()?.odp;
//! println!("ODP: {}, implicit: {}, RC serves {:?}", odp.supported, odp.implicit, odp.rc);
//! let pd = ProtectionDomain::new(&ctx)?;
//! // 1 GiB registered at once, without pinning a page of it (refused with
//! // `Error::Unsupported` where the device has no ODP).
//! let mr = MemoryRegion::register(&pd, vec![0u8; 1 << 30], AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND)?;
//! // Take the first-touch faults of the first 64 KiB now, off the data path.
//! mr.prefetch(0..64 << 10)?;
//! mr.advise(Advice::PrefetchNoFault, 64 << 10..1 << 20, AdviseFlags::empty())?;
//! # Ok(()) }
//! ```
//!
//! # What it is for
//!
//! - Regions far larger than what is in use at a time (a sparse address space, a large file
//!   mapping, a cache), or larger than the locked-memory limit: nothing is pinned, so nothing is
//!   charged to `ulimit -l`, and the kernel may reclaim pages the device is not using.
//! - Registering early and cheaply: registration walks no page, so registering a large region
//!   costs about as little as a small one.
//! - Memory the kernel may move (transparent huge pages being collapsed, NUMA migration):
//!   the device sees the move instead of holding the old page.
//!
//! # What it costs
//!
//! The first access of the device to each page that it has no translation for is a page fault.
//! On a NIC (mlx5) the hardware stops the QP, raises the fault to the driver, the kernel maps
//! the page and the QP resumes: microseconds to milliseconds per fault, against nanoseconds for
//! a pinned page; a fault on the responder side can make the peer's request time out and be
//! retried. Soft-RoCE (rxe) resolves the fault inline in its kernel path. Each page the kernel
//! later reclaims or moves costs an invalidation, and a fault at its next use. So ODP trades
//! the pinning cost at registration for a cost at first touch: [`MemoryRegion::prefetch`]
//! (`ibv_advise_mr`) moves that cost to a moment of the caller's choosing, e.g. right after
//! registering, or before a burst over a range.
//!
//! # Capabilities
//!
//! What a device offers is in [`DeviceLimits::odp`](crate::DeviceLimits::odp)
//! ([`OdpCaps`]): whether it has ODP at all, whether it has implicit ODP, and which operations
//! of each transport may use ODP memory ([`OdpOps`]). A registration with `ON_DEMAND` is
//! refused with [`Error::Unsupported`] when the device has no ODP, or when a remote right asked
//! for (`REMOTE_WRITE`, `REMOTE_READ`, `REMOTE_ATOMIC`) is an operation that ODP serves on none
//! of its transports; the error names what is missing. The local operations a region will be
//! used for (send, receive) are the caller's to check against [`OdpCaps::rc`] or
//! [`OdpCaps::ud`]: a work request that the transport's ODP does not serve fails in its
//! completion. Soft-RoCE has ODP from about Linux 6.14 (prefetching from about 6.16); Debian
//! 12's 6.1 and Debian 13's 6.12 have none. Prefetching also needs the provider library's
//! `advise_mr`, which rdma-core's rxe provider has only in releases from mid-2025.
//!
//! # Soundness
//!
//! An ODP region over memory the crate or the caller owns keeps every guarantee of a pinned one
//! (see [`crate::verbs::mr`]): it owns its buffer exactly as a pinned region does, posting moves
//! or holds it the same way, remotely writable ODP regions are only ever copied, and the buffer
//! is freed only after `ibv_dereg_mr`. The only difference is that the pages are not pinned;
//! that changes when the device finds them, never which memory it may reach. Prefetching reads
//! and writes no byte, so [`MemoryRegion::advise`] takes `&self`.
//!
//! Implicit ODP is another matter: one registration of the whole address space, whose keys
//! reach every byte of the process. It is offered only as an `unsafe` constructor,
//! [`ImplicitOdpRegion::register`]; its documentation says why no safe one is possible.

use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use bitflags::bitflags;
use rdma_sys as ffi;

use crate::error::{check_ibv, errno, Error, Result};
use crate::verbs::mr::{check_range, AccessFlags, MemoryRegion};
use crate::verbs::pd::ProtectionDomain;

pub use crate::verbs::odp_caps::{OdpCaps, OdpOps};

/// What to tell the device about a range of an ODP region (`enum ibv_advise_mr_advice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Advice {
    /// Fault the pages in and map them for the device to read (`IBV_ADVISE_MR_ADVICE_PREFETCH`).
    Prefetch,
    /// Fault the pages in and map them writable (`IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE`): for
    /// a range the device will write (a receive, an RDMA READ's target, a peer's WRITE). The
    /// region needs [`AccessFlags::LOCAL_WRITE`].
    PrefetchWrite,
    /// Map only the pages the process has present already, faulting none in
    /// (`IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT`): cheap, and never allocates memory.
    PrefetchNoFault,
}

impl Advice {
    fn raw(self) -> ffi::ibv_advise_mr_advice {
        use ffi::ib_uverbs_advise_mr_advice as a;
        match self {
            Advice::Prefetch => a::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH,
            Advice::PrefetchWrite => a::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE,
            Advice::PrefetchNoFault => a::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT,
        }
    }
}

bitflags! {
    /// Flags of an advice (`enum ibv_advise_mr_flag`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AdviseFlags: u32 {
        /// Wait until the advice is carried out (`IBV_ADVISE_MR_FLAG_FLUSH`): the call returns
        /// once the pages are mapped. Without it the kernel does the work in the background,
        /// and the call returns at once.
        const FLUSH = 1;
    }
}

/// The most bytes one scatter/gather entry of an advice covers (its length is 32 bits): longer
/// ranges are advised piece by piece.
const ADVISE_PIECE: usize = 1 << 30;

/// `ibv_advise_mr` over `len` bytes at the device address `addr` of the region keyed `lkey`
/// (registered on `pd`, and kept registered by the caller across the call).
fn advise_range(
    pd: &ProtectionDomain,
    lkey: u32,
    advice: Advice,
    flags: AdviseFlags,
    mut addr: u64,
    mut len: usize,
) -> Result<()> {
    while len > 0 {
        let n = len.min(ADVISE_PIECE);
        let mut sge = ffi::ibv_sge { addr, length: n as u32, lkey };
        // SAFETY: `pd` is a live PD, and so is its context (the PD holds it); rdma-sys's
        // ibv_advise_mr is the header's inline: it calls the provider's `advise_mr` only when
        // the extended context is large enough to hold it and it is set, and answers EOPNOTSUPP
        // otherwise. `sge` is one valid entry, read during the call only. The advice maps
        // pages, it reads and writes no byte; the MR it names stays registered (the caller
        // holds it).
        let ret = unsafe { ffi::ibv_advise_mr(pd.as_raw(), advice.raw(), flags.bits(), &mut sge, 1) };
        match ret {
            0 => {}
            libc::EOPNOTSUPP | libc::ENOSYS => {
                return Err(Error::Unsupported {
                    what: "prefetching on-demand-paging memory (ibv_advise_mr)",
                    why: format!(
                        "{} refuses it (EOPNOTSUPP): the provider library has no advise_mr, or its kernel driver \
                         none. rdma-core's rxe provider has it only in releases from mid-2025 (Debian 12 ships \
                         rdma-core 44), the rxe kernel driver from about Linux 6.16; the first touch faults the \
                         pages in anyway",
                        pd.context().device_name()
                    ),
                })
            }
            e => return check_ibv(e, "ibv_advise_mr"),
        }
        addr += n as u64;
        len -= n;
    }
    Ok(())
}

/// On-demand paging: advice over ranges of an ODP region.
impl MemoryRegion {
    /// Gives the device `advice` about `range` (offsets into this region) of an on-demand-paging
    /// region (`ibv_advise_mr`): typically to fault pages in before work requests use them, so
    /// that the first touch does not stall the QP. With [`AdviseFlags::FLUSH`] the call
    /// returns once the pages are mapped; without it, at once.
    ///
    /// It neither reads nor writes the bytes, so it is allowed whatever work requests use the
    /// region. A chunk of a split region advises its own range.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a region registered without [`AccessFlags::ON_DEMAND`]
    /// (a pinned region has every page mapped already), for an empty range, and for
    /// [`Advice::PrefetchWrite`] on a region without [`AccessFlags::LOCAL_WRITE`];
    /// [`Error::OutOfBounds`] for a range that leaves the region; [`Error::Unsupported`] when
    /// the provider library or the driver cannot advise (`EOPNOTSUPP`); [`Error::Call`] when
    /// `ibv_advise_mr` fails otherwise.
    pub fn advise(&self, advice: Advice, range: Range<usize>, flags: AdviseFlags) -> Result<()> {
        let access = self.access();
        if !access.contains(AccessFlags::ON_DEMAND) {
            return Err(Error::InvalidArgument(format!(
                "advice (ibv_advise_mr) is for on-demand-paging regions, and this one is pinned (registered with \
                 {access:?}, without AccessFlags::ON_DEMAND): its pages are all mapped already"
            )));
        }
        if advice == Advice::PrefetchWrite && !access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(format!(
                "Advice::PrefetchWrite maps pages writable, and this region is registered without \
                 AccessFlags::LOCAL_WRITE ({access:?}): use Advice::Prefetch"
            )));
        }
        if range.start >= range.end {
            return Err(Error::InvalidArgument(format!("the range {range:?} to advise is empty")));
        }
        check_range(range.start, range.end - range.start, self.len())?;
        let addr = self.addr() + range.start as u64;
        advise_range(self.pd(), self.lkey(), advice, flags, addr, range.end - range.start)
    }

    /// Faults `range` (offsets into this on-demand-paging region) in now, and returns once the
    /// device can use it without a page fault: [`MemoryRegion::advise`] with
    /// [`Advice::PrefetchWrite`] (or [`Advice::Prefetch`] for a region the device may only
    /// read) and [`AdviseFlags::FLUSH`].
    ///
    /// # Errors
    /// As for [`MemoryRegion::advise`].
    pub fn prefetch(&self, range: Range<usize>) -> Result<()> {
        let advice =
            if self.access().contains(AccessFlags::LOCAL_WRITE) { Advice::PrefetchWrite } else { Advice::Prefetch };
        self.advise(advice, range, AdviseFlags::FLUSH)
    }
}

/// An implicit on-demand-paging region: one registration of the process's whole address space
/// (`ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND | …)`). Its lkey addresses any
/// virtual address of the process in a scatter/gather entry, its rkey any address for a peer,
/// with the rights it was registered with; the device faults pages in as they are touched.
///
/// It owns no buffer and hands out no bytes: it is keys, for raw work requests
/// ([`QueuePair::as_raw`](crate::QueuePair::as_raw)) and for peers. Deregistered when
/// dropped (or by [`ImplicitOdpRegion::close`]); it holds its PD.
pub struct ImplicitOdpRegion {
    mr: NonNull<ffi::ibv_mr>,
    access: AccessFlags,
    // Dropped after the MR is deregistered (Drop::drop runs first).
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the value holds the MR's pointer and keys only, and deregisters it once (in Drop or
// close, both with the value owned); verbs on an MR are thread-safe.
unsafe impl Send for ImplicitOdpRegion {}
// SAFETY: `&ImplicitOdpRegion` reads immutable fields (keys, rights) and advises, which
// libibverbs allows from any thread.
unsafe impl Sync for ImplicitOdpRegion {}

impl ImplicitOdpRegion {
    /// Registers the whole address space on `pd` with `access` (to which
    /// [`AccessFlags::ON_DEMAND`] is added, and `LOCAL_WRITE` where a remote write right asks
    /// for it, as [`AccessFlags::effective`] says).
    ///
    /// # Why this is `unsafe`
    ///
    /// Every other region of this crate owns the memory it registers, and the crate's locks keep
    /// the device off any byte Rust code holds a reference to. This one registers memory the
    /// crate does not own: the stack, the heap and its allocator's bookkeeping, every `Vec` and
    /// `Box`, the code. With `LOCAL_WRITE`, a local work request through its lkey may write any
    /// of it; with `REMOTE_WRITE` or `REMOTE_ATOMIC`, so may any peer that learns the rkey, at
    /// any moment, and the crate's own safe RDMA WRITE to a [`RemoteRegion`](crate::RemoteRegion)
    /// (which is the peer's word, and unchecked) does it on a connection to this very process.
    /// Either can change memory that Rust code reads through a shared reference, or that the
    /// compiler assumes unchanged: undefined behaviour that no check of the crate could rule
    /// out, since the key covers every address. A safe constructor is therefore impossible for
    /// the writable rights. With read rights alone it would be memory-safe, but it would hand
    /// every byte of the process (keys, passwords) to whoever learns the rkey, and the crate's
    /// safe posts cannot use its lkey anyway (they take a [`MemoryRegion`]): the only users post
    /// raw scatter/gather entries, in `unsafe` code already. So the crate offers no safe
    /// variant at all.
    ///
    /// # Safety
    ///
    /// For as long as the region lives, the caller must ensure that
    /// - no work request through its lkey writes memory that Rust code may access through a
    ///   reference or that the allocator manages, unless that memory is the caller's to hand to
    ///   the device (e.g. a raw mapping it reaches only through raw pointers while the device
    ///   may write it), and is not freed or reused until the work request completes;
    /// - if it is registered with `REMOTE_WRITE` or `REMOTE_ATOMIC`, the rkey goes only to
    ///   peers trusted to write exactly such memory, and no RDMA WRITE or atomic of this process
    ///   names it;
    /// - if it is registered with `REMOTE_READ`, the caller accepts that a peer with the rkey
    ///   may read any byte of the process.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no implicit ODP (see
    /// [`OdpCaps::implicit`]), naming what it lacks; [`Error::Call`] when `ibv_reg_mr` fails.
    pub unsafe fn register(pd: &Arc<ProtectionDomain>, access: AccessFlags) -> Result<ImplicitOdpRegion> {
        let access = (access | AccessFlags::ON_DEMAND).effective();
        crate::verbs::mr::check_odp_registration(pd, access, true)?;
        // SAFETY: pd is valid; NULL with SIZE_MAX is the documented form of an implicit ODP
        // registration, which pins and touches nothing. What the device may then do with the
        // keys is the caller's contract (above). The MR is deregistered once, in Drop or close.
        let mr = unsafe { ffi::ibv_reg_mr(pd.as_raw(), std::ptr::null_mut(), usize::MAX, access.bits() as i32) };
        let mr = NonNull::new(mr).ok_or_else(|| Error::call("ibv_reg_mr", errno(), None))?;
        Ok(ImplicitOdpRegion { mr, access, pd: Arc::clone(pd) })
    }

    /// The local key: a scatter/gather entry with it may name any address of the process.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered while `self` exists; lkey is immutable.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    /// The remote key: with it a peer may address any address of the process, with the rights
    /// registered.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as for lkey.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// The rights it was registered with (`ON_DEMAND` among them).
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The PD it is registered on.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The raw `ibv_mr`. It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.mr.as_ptr()
    }

    /// Gives the device `advice` about the `len` bytes at the process's virtual address
    /// `addr` (`ibv_advise_mr` through this region's lkey): as [`MemoryRegion::advise`], for
    /// memory that no explicit region covers. Mapping pages reads and writes no byte, so any
    /// range may be advised; one the process has not mapped fails.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0`, for a range past the end of the address
    /// space, and for [`Advice::PrefetchWrite`] without `LOCAL_WRITE`; otherwise as for
    /// [`MemoryRegion::advise`].
    pub fn advise(&self, advice: Advice, addr: u64, len: usize, flags: AdviseFlags) -> Result<()> {
        if len == 0 || addr.checked_add(len as u64).is_none() {
            return Err(Error::InvalidArgument(format!(
                "cannot advise {len} bytes at {addr:#x}: the range is empty or passes the end of the address space"
            )));
        }
        if advice == Advice::PrefetchWrite && !self.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "Advice::PrefetchWrite maps pages writable, and this region is registered without \
                 AccessFlags::LOCAL_WRITE: use Advice::Prefetch"
                    .into(),
            ));
        }
        advise_range(&self.pd, self.lkey(), advice, flags, addr, len)
    }

    /// Deregisters the region now and reports failure, instead of reporting it on stderr in
    /// Drop.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_dereg_mr` fails (the registration is then leaked).
    pub fn close(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: we own the region by value and deregister it exactly once; Drop will not run.
        let ret = unsafe { ffi::ibv_dereg_mr(this.mr.as_ptr()) };
        // SAFETY: `this` is never used again, so moving the field out is a plain move.
        drop(unsafe { std::ptr::read(&this.pd) });
        check_ibv(ret, "ibv_dereg_mr")
    }
}

impl Drop for ImplicitOdpRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered only here (close skips Drop).
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if ret != 0 {
            crate::error::report_leak("ibv_dereg_mr", ret);
        }
    }
}

impl fmt::Debug for ImplicitOdpRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImplicitOdpRegion")
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("access", &self.access)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odp_bits_match_verbs() {
        use ffi::ibv_odp_transport_cap_bits as t;
        assert_eq!(OdpOps::SEND.bits(), t::IBV_ODP_SUPPORT_SEND.0);
        assert_eq!(OdpOps::RECV.bits(), t::IBV_ODP_SUPPORT_RECV.0);
        assert_eq!(OdpOps::WRITE.bits(), t::IBV_ODP_SUPPORT_WRITE.0);
        assert_eq!(OdpOps::READ.bits(), t::IBV_ODP_SUPPORT_READ.0);
        assert_eq!(OdpOps::ATOMIC.bits(), t::IBV_ODP_SUPPORT_ATOMIC.0);
        assert_eq!(OdpOps::SRQ_RECV.bits(), t::IBV_ODP_SUPPORT_SRQ_RECV.0);
        assert_eq!(AccessFlags::ON_DEMAND.bits(), ffi::ibv_access_flags::IBV_ACCESS_ON_DEMAND.0);
        // ib_user_ioctl_verbs.h: IB_UVERBS_ADVISE_MR_FLAG_FLUSH = 1 << 0 (not in the bindings).
        assert_eq!(AdviseFlags::FLUSH.bits(), 1);
        assert_eq!(OdpOps::from_bits_retain(0x1_00ff).bits(), 0x1_00ff, "unknown bits are kept");
    }
}
