//! [`MemoryRegion`]: an owned, registered buffer, and [`RemoteRegion`]: a peer's.
//!
//! ```no_run
//! use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain, VerbsContext};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let pd = ProtectionDomain::new(&VerbsContext::open("rxe0")?)?;
//! let mut mr = MemoryRegion::new(&pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
//! mr.write_at(0, b"hello")?; // fill it while no work request uses it
//! let remote = mr.remote(); // address, rkey, length: what a peer needs to READ it
//! println!("lkey {:#x}, rkey {:#x}, {} bytes", mr.lkey(), remote.rkey, remote.len);
//! // Posting moves it into a lane (`lane.post_send(qp, SendWr::send(mr, 0..5))`);
//! // the completion hands it back (`completion.take_region()`).
//! # Ok(()) }
//! ```
//!
//! # Soundness
//!
//! A `MemoryRegion` owns its memory, either allocated by [`MemoryRegion::new`] (page-aligned,
//! zero-initialised) or given by the caller to [`MemoryRegion::register`] (any
//! [`StableBuffer`]: a `Vec`, a boxed slice, a [`Mapping`] of huge pages, a file mapping),
//! which holds it until [`MemoryRegion::into_buffer_as`] gives it back. It is a handle to a
//! shared inner value. When a work request that uses the region is posted, the queue pair
//! stores a clone of that handle in its slot table until the work request's completion is
//! reaped: one clone per work request that names the region, however many of its pieces
//! ([scatter/gather](crate::verbs::wr#scattergather)) do. Local access to the bytes requires `&mut self` **and** that the handle be unique
//! (`Arc::get_mut`), so:
//!
//! - while the device may *write* the region for a local work request (a receive, or the
//!   target of an RDMA READ), Rust code cannot obtain a reference into it (the accessors return
//!   [`Error::InFlight`]);
//! - while the device only *reads* it (the source of a send or RDMA WRITE), Rust code may read
//!   it ([`MemoryRegion::as_slice`]) but not change it;
//! - the memory cannot be freed while a work request uses it, even if the user drops or
//!   `mem::forget`s the region or the queue pair: forgetting leaks, and leaking is safe.
//!
//! Memory registered with [`AccessFlags::REMOTE_WRITE`] or [`AccessFlags::REMOTE_ATOMIC`] can be
//! written by the peer at any moment, with nothing local to wait for. No slice of such a region
//! is ever handed out; [`MemoryRegion::read_at`] and [`MemoryRegion::write_at`] copy with
//! volatile accesses instead, so Rust code never holds a reference that the device could change
//! under it, and the compiler never assumes the bytes stable. A peer that knows the rkey can
//! overwrite any byte of such a region at any time: register remotely writable memory only for
//! data you validate after reading.
//!
//! Memory registered with [`AccessFlags::REMOTE_READ`] (and not remote write) is handed out as
//! slices: a peer that knows the rkey may *read* it at any moment, also while Rust code writes
//! it through [`MemoryRegion::as_mut_slice`]. That is no memory-safety issue (the device reads,
//! Rust's view never changes under it), but the peer may see a half-written buffer: tell it
//! when a buffer is ready, as the ping-pong examples do.
//!
//! # What is guaranteed, exactly
//!
//! - No safe call lets the device write memory that Rust code can read or write through a
//!   reference, or touch memory that was freed.
//! - Rust code may read memory the device reads (an in-flight send's source); it may not write
//!   it until the work request completes.
//! - A peer with the rkey may read `REMOTE_READ` memory at any time, and write `REMOTE_WRITE`
//!   or `REMOTE_ATOMIC` memory at any time; the latter is only ever copied, never referenced.

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bitflags::bitflags;
use rdma_sys as ffi;

use crate::error::{errno, Error, Result};
use crate::verbs::buffer::{Mapping, StableBuffer};
use crate::verbs::pd::ProtectionDomain;

bitflags! {
    /// Access rights of a memory region (`enum ibv_access_flags`). Remote rights are opt-in.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// The local device may write (needed for receives and RDMA READ targets).
        const LOCAL_WRITE = 1;
        /// A peer may RDMA WRITE into the region. Verbs require `LOCAL_WRITE` with it, so this
        /// crate adds `LOCAL_WRITE` when registering.
        const REMOTE_WRITE = 1 << 1;
        /// A peer may RDMA READ the region.
        const REMOTE_READ = 1 << 2;
        /// A peer may run atomics on the region. Like `REMOTE_WRITE`, it needs (and gets)
        /// `LOCAL_WRITE`.
        const REMOTE_ATOMIC = 1 << 3;
        /// Memory-window binding is allowed.
        const MW_BIND = 1 << 4;
        /// On-demand paging: the pages are not pinned; the device faults them in at first touch
        /// (see [`crate::verbs::odp`]). Refused where the device has no ODP.
        const ON_DEMAND = 1 << 6;
        /// Relaxed ordering of PCI writes.
        const RELAXED_ORDERING = 1 << 20;
    }
}

impl AccessFlags {
    /// Whether a peer may change the region's contents at any time.
    pub fn remotely_writable(self) -> bool {
        self.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
    }

    /// The flags as registered: `ibv_reg_mr` fails with a bare `EINVAL` for remote write or
    /// atomic rights without `LOCAL_WRITE`, so those imply it.
    pub fn effective(self) -> AccessFlags {
        if self.remotely_writable() {
            self | AccessFlags::LOCAL_WRITE
        } else {
            self
        }
    }
}

/// Page alignment of the buffers [`MemoryRegion::new`] allocates.
const ALIGN: usize = 4096;

/// What [`MemoryRegion::new`] allocates: zeroed, page-aligned bytes from the global allocator.
struct PageAligned {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is owned by this value alone, like a `Box<[u8]>`'s.
unsafe impl Send for PageAligned {}

impl PageAligned {
    fn zeroed(len: usize) -> Result<PageAligned> {
        let layout = Layout::from_size_align(len, ALIGN)
            .map_err(|_| Error::InvalidArgument(format!("memory region size {len} is too large")))?;
        // SAFETY: the caller checked `len > 0`, so the layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
            .ok_or_else(|| Error::call("alloc", libc::ENOMEM, None))?;
        Ok(PageAligned { ptr, layout })
    }
}

impl Drop for PageAligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the bytes are a heap allocation this value owns alone and frees once, in Drop; moving
// it moves the pointer only. Bytes have no invalid patterns.
unsafe impl StableBuffer for PageAligned {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn stable_len(&self) -> usize {
        self.layout.size()
    }
}

/// What [`Error::WrongBuffer`] says a region made by [`MemoryRegion::new`] holds.
const NEW_OWNER: &str = "memory allocated by MemoryRegion::new (no buffer of the caller's)";

/// One registration: the ibv_mr and the memory behind it, whose owner it holds. Freed when its
/// last holder goes.
pub(crate) struct Registration {
    mr: NonNull<ffi::ibv_mr>,
    /// Whether `mr` is still registered (cleared by the one `deregister` that runs).
    registered: bool,
    buf: NonNull<u8>,
    len: usize,
    /// The address the device knows the buffer by: its virtual address, or the I/O virtual
    /// address chosen at registration ([`MemoryRegion::register_at`]).
    iova: u64,
    /// The buffer's owner, type-erased (one box per registration: registering is not the data
    /// path). `None` once given back, or leaked after a failed deregistration. Dropped after
    /// `Drop::drop` has deregistered the MR (fields drop after it).
    owner: Option<Box<dyn Any + Send>>,
    /// The owner's type name, for [`Error::WrongBuffer`].
    owner_type: &'static str,
    access: AccessFlags,
    // Dropped after the MR is deregistered (Drop::drop runs first).
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the buffer is only touched through `&mut MemoryRegion` with a unique chunk handle, or
// by the device; ibv_mr is deregistered once. The owner is `Send`, and is only ever moved out
// (given back) or dropped, never accessed through `&Registration`. Moving or sharing it between
// threads is therefore fine.
unsafe impl Send for Registration {}
// SAFETY: `&Registration` gives access only to immutable fields (keys, address, length), never to
// the owner.
unsafe impl Sync for Registration {}

impl Registration {
    /// Deregisters the MR, once. When that fails the device may still reach the memory, so the
    /// owner is leaked (never dropped, never given back) and the error returned.
    fn deregister(&mut self) -> Result<()> {
        if !std::mem::replace(&mut self.registered, false) {
            return Ok(());
        }
        // SAFETY: the MR is deregistered exactly once (the flag); every chunk, and so every
        // posted work request (which holds a chunk), is gone (we are being dropped or given
        // back by the last holder), so the device has no pending use of it.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if ret != 0 {
            std::mem::forget(self.owner.take());
        }
        crate::error::check_ibv(ret, "ibv_dereg_mr")
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Err(e) = self.deregister() {
            // The device may still map the pages: the owner was leaked rather than dropped.
            crate::error::report_leak("ibv_dereg_mr", e.errno().unwrap_or(libc::EIO));
        }
        // The owner (if any) drops with the fields, after deregistration.
    }
}

/// The unit that posting locks: a whole registration (one allocation, the common case) or a
/// chunk of a shared one, and how many posted work requests the device writes it for.
pub(crate) struct MrInner {
    part: Part,
    /// Posted work requests that let the device write this region (receives, RDMA READ
    /// targets); maintained by the QP's slot holds.
    pub(crate) writers: AtomicUsize,
    /// Copies of what every post reads (the registration's fields never change), so that a
    /// post reads them here rather than through the part and the `ibv_mr`.
    addr: u64,
    len: usize,
    lkey: u32,
    access: AccessFlags,
    /// The address of the PD's `Arc` allocation, compared by [`MrInner::on_pd`].
    pd: usize,
    /// This region's number, unique in the process (never reused, unlike an address): what a
    /// prepared work request of a lane recognises its region by.
    serial: u64,
}

/// The numbers regions are given, one each.
static NEXT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

enum Part {
    Whole(Registration),
    Chunk { reg: Arc<Registration>, offset: usize, len: usize },
}

impl MrInner {
    fn new(part: Part) -> Arc<MrInner> {
        let (reg, offset, len) = match &part {
            Part::Whole(r) => (r, 0, r.len),
            Part::Chunk { reg, offset, len } => (&**reg, *offset, *len),
        };
        // SAFETY: the MR is registered for as long as the registration exists; lkey is immutable.
        let lkey = unsafe { (*reg.mr.as_ptr()).lkey };
        let addr = reg.iova + offset as u64;
        let (access, pd) = (reg.access, Arc::as_ptr(&reg.pd) as usize);
        let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
        Arc::new(MrInner { part, writers: AtomicUsize::new(0), addr, len, lkey, access, pd, serial })
    }
    /// This region's number, unique in the process.
    #[inline]
    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }
    fn reg(&self) -> &Registration {
        match &self.part {
            Part::Whole(r) => r,
            Part::Chunk { reg, .. } => reg,
        }
    }
    #[inline]
    pub(crate) fn lkey(&self) -> u32 {
        self.lkey
    }
    fn offset(&self) -> usize {
        match &self.part {
            Part::Whole(_) => 0,
            Part::Chunk { offset, .. } => *offset,
        }
    }
    #[inline]
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    /// Whether the region is registered on `pd`.
    #[inline]
    pub(crate) fn on_pd(&self, pd: &Arc<ProtectionDomain>) -> bool {
        self.pd == Arc::as_ptr(pd) as usize
    }
    /// Whether this is a whole registration, not a chunk of a split one.
    pub(crate) fn is_whole(&self) -> bool {
        matches!(self.part, Part::Whole(_))
    }

    /// The registration's `ibv_mr` (a chunk's is its registration's).
    pub(crate) fn raw_mr(&self) -> *mut ffi::ibv_mr {
        self.reg().mr.as_ptr()
    }
    fn ptr(&self) -> *mut u8 {
        // SAFETY: offset + len lies within the registration (checked when the chunk was made).
        unsafe { self.reg().buf.as_ptr().add(self.offset()) }
    }
}

/// An owned buffer registered on a [`ProtectionDomain`], or a chunk of one (see
/// [`MemoryRegion::split`]).
///
/// The lock that posting takes is per `MemoryRegion` value: while any work request uses this
/// region, its bytes are out of reach. To read one buffer while others are in flight, split a
/// registration into chunks, or register several regions.
pub struct MemoryRegion {
    inner: Arc<MrInner>,
}

impl MemoryRegion {
    fn from_registration(reg: Registration) -> MemoryRegion {
        MemoryRegion { inner: MrInner::new(Part::Whole(reg)) }
    }

    /// Allocates `len` zeroed bytes (page-aligned) and registers them with `access`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::MemLock`] when the locked-memory
    /// limit is too small; [`Error::Call`] when `ibv_reg_mr` fails otherwise.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("memory region size must be at least 1 byte".into()));
        }
        Self::register_owner(pd, PageAligned::zeroed(len)?, NEW_OWNER, access, None)
    }

    /// Maps `len` zeroed bytes in 2 MiB huge pages ([`Mapping::huge_pages`]) and registers them
    /// with `access`: as [`MemoryRegion::new`], in far fewer pages for the device to translate.
    /// [`MemoryRegion::into_buffer_as::<Mapping>`](MemoryRegion::into_buffer_as) gives the
    /// mapping back.
    ///
    /// # Errors
    /// [`Error::HugePages`] when the kernel has too few free huge pages (see
    /// `/proc/sys/vm/nr_hugepages`); otherwise as for [`MemoryRegion::new`].
    pub fn with_huge_pages(pd: &Arc<ProtectionDomain>, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::register(pd, Mapping::huge_pages(len)?, access)
    }

    /// Registers a buffer the caller owns, in place (zero-copy): a `Vec<u8>`, a `Box<[u8]>`, a
    /// [`Mapping`], with the features `bytemuck` and `memmap2` a `Vec<T>`/`Box<[T]>` of `Pod`
    /// `T` or a `memmap2::MmapMut`, or any other [`StableBuffer`]. The region owns it, so
    /// nothing can free, grow or unmap it while the device may use it, until
    /// [`MemoryRegion::into_buffer_as`] gives it back, at the same address. Of a `Vec`, its
    /// `len` bytes are registered; its capacity is kept for when it comes back.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer of 0 bytes (empty, or of a zero-sized element
    /// type); otherwise as for [`MemoryRegion::new`]. The buffer is dropped on failure.
    pub fn register<B: StableBuffer>(pd: &Arc<ProtectionDomain>, buf: B, access: AccessFlags) -> Result<MemoryRegion> {
        Self::register_owner(pd, buf, std::any::type_name::<B>(), access, None)
    }

    /// [`MemoryRegion::register`] at a chosen I/O virtual address (`ibv_reg_mr_iova2`): the
    /// device, and so work requests and peers, address the region's first byte as `iova`
    /// instead of its virtual address. [`MemoryRegion::addr`] and [`MemoryRegion::remote`] then
    /// say `iova`, and the lane's scatter/gather entries use it. A peer can be given the same
    /// addresses whatever memory backs them, e.g. 0-based offsets (`iova` 0).
    ///
    /// Not every device honours it: Soft-iWARP (siw) ignores the address asked for (its kernel
    /// driver documents the argument as "not used by siw") and keeps addressing the region by
    /// its virtual address, so work requests at `iova` fail there with an access error.
    ///
    /// The kernel maps whole pages, so `iova` must lie as far into its page as the buffer's
    /// first byte lies into its own (`iova % page == addr % page`); for a page-aligned buffer
    /// such as a [`Mapping`], any page-aligned `iova`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the two offsets in a page differ (naming both), or when
    /// `iova + len` passes the end of the 64-bit address space; otherwise as for
    /// [`MemoryRegion::register`].
    pub fn register_at<B: StableBuffer>(
        pd: &Arc<ProtectionDomain>,
        buf: B,
        access: AccessFlags,
        iova: u64,
    ) -> Result<MemoryRegion> {
        Self::register_owner(pd, buf, std::any::type_name::<B>(), access, Some(iova))
    }

    fn register_owner<B: StableBuffer>(
        pd: &Arc<ProtectionDomain>,
        buf: B,
        owner_type: &'static str,
        access: AccessFlags,
        iova: Option<u64>,
    ) -> Result<MemoryRegion> {
        let access = access.effective();
        let len = buf.stable_len();
        if len == 0 {
            return Err(Error::InvalidArgument(format!(
                "{owner_type} of 0 bytes cannot be registered (it is empty, or its elements are zero-sized)"
            )));
        }
        if access.contains(AccessFlags::ON_DEMAND) {
            errors::check_odp_registration(pd, access, false)?;
        }
        if let Some(iova) = iova {
            if iova.checked_add(len as u64).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "a region of {len} bytes at I/O address {iova:#x} passes the end of the address space"
                )));
            }
        }
        // The owner goes to where it stays before its address is taken, so that every access
        // derives from a pointer taken from it in place; moving the box later moves no byte
        // (the trait's promise), nor does moving the owner out of it when it is given back.
        let mut owner = Box::new(buf);
        let ptr = NonNull::new(owner.stable_mut_ptr())
            .ok_or_else(|| Error::InvalidArgument(format!("{owner_type} gave a NULL address to register")))?;
        if let Some(iova) = iova {
            // The kernel maps whole pages: it refuses (with a bare EINVAL) an I/O address whose
            // offset in its page differs from the buffer's.
            // SAFETY: sysconf has no preconditions.
            let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
            let (at, off) = (ptr.as_ptr() as u64 % page, iova % page);
            if at != off {
                return Err(Error::InvalidArgument(format!(
                    "I/O address {iova:#x} is {off} bytes into its page, but the buffer starts {at} bytes into \
                     its page of {page}: the two offsets must be equal"
                )));
            }
        }
        // SAFETY: pd is valid; `ptr` points to `len` bytes that `owner` owns and nothing else
        // reaches (StableBuffer's contract), which stay where they are until `owner` is dropped:
        // the registration drops it only after ibv_dereg_mr succeeds, and leaks it otherwise.
        let mr = unsafe {
            match iova {
                None => ffi::ibv_reg_mr(pd.as_raw(), ptr.as_ptr().cast(), len, access.bits() as i32),
                Some(iova) => ffi::ibv_reg_mr_iova2(pd.as_raw(), ptr.as_ptr().cast(), len, iova, access.bits()),
            }
        };
        let Some(mr) = NonNull::new(mr) else {
            // (errno is read before `owner` is dropped, whose free may change it.)
            return Err(reg_error(len, errno()));
        };
        Ok(Self::from_registration(Registration {
            mr,
            registered: true,
            buf: ptr,
            len,
            iova: iova.unwrap_or(ptr.as_ptr() as u64),
            owner: Some(owner),
            owner_type,
            access,
            pd: Arc::clone(pd),
        }))
    }

    /// Deregisters the region and gives back the `Box<[u8]>` given to
    /// [`MemoryRegion::register`]: [`MemoryRegion::into_buffer_as`] for that type.
    ///
    /// # Errors
    /// As for [`MemoryRegion::into_buffer_as`] (without the region back).
    pub fn into_buffer(self) -> Result<Box<[u8]>> {
        self.into_buffer_as::<Box<[u8]>>().map_err(Error::from)
    }

    /// Deregisters the region and gives back the buffer given to [`MemoryRegion::register`]
    /// (or the [`Mapping`] of [`MemoryRegion::with_huge_pages`]), as it was: the same
    /// address, length and capacity, holding what the device and Rust code last wrote.
    ///
    /// # Errors
    /// Each refusal gives the region back ([`IntoBufferError::into_region`]), untouched:
    /// [`Error::InFlight`] while a work request holds the region; [`Error::WrongBuffer`] when
    /// `B` is not the type registered (a region of [`MemoryRegion::new`] holds none of the
    /// caller's); [`Error::InvalidArgument`] for a chunk whose siblings still exist (they
    /// share the registration). [`Error::Call`] when `ibv_dereg_mr` fails: the device may
    /// still reach the memory, so the buffer is leaked, and nothing is given back.
    pub fn into_buffer_as<B: StableBuffer>(mut self) -> std::result::Result<B, IntoBufferError> {
        let refuse = |error: Error, region: MemoryRegion| IntoBufferError { error, region: Some(region) };
        let outstanding = self.outstanding();
        let Some(inner) = Arc::get_mut(&mut self.inner) else {
            return Err(refuse(Error::InFlight { outstanding }, self));
        };
        let reg = match &mut inner.part {
            Part::Whole(reg) => reg,
            Part::Chunk { reg, .. } => {
                let siblings = Arc::strong_count(reg) - 1;
                match Arc::get_mut(reg) {
                    Some(reg) => reg,
                    None => {
                        let msg = format!(
                            "into_buffer_as needs the whole registration, and {siblings} other chunk(s) of it still \
                             exist: drop them first"
                        );
                        return Err(refuse(Error::InvalidArgument(msg), self));
                    }
                }
            }
        };
        if !reg.owner.as_ref().is_some_and(|o| o.is::<B>()) {
            let (held, wanted) = (reg.owner_type, std::any::type_name::<B>());
            return Err(refuse(Error::WrongBuffer { held, wanted }, self));
        }
        if let Err(error) = reg.deregister() {
            return Err(IntoBufferError { error, region: None });
        }
        let owner = reg.owner.take().and_then(|o| o.downcast::<B>().ok());
        // Checked above: the owner is there and of type `B`.
        owner.map(|b| *b).ok_or(IntoBufferError {
            error: Error::InvalidArgument("the region's buffer was already given back".into()),
            region: None,
        })
    }

    /// Splits the region into chunks of `chunk_len` bytes (the last may be shorter), each
    /// locked on its own: a chunk can be read while work requests use its siblings. The
    /// registration lives until every chunk is dropped. All chunks share the rkey, so a peer
    /// given one chunk's [`RemoteRegion`] can in fact address the whole registration.
    ///
    /// # Errors
    /// [`Error::InFlight`] while a work request uses the region; [`Error::InvalidArgument`] for
    /// a zero `chunk_len`.
    pub fn split(self, chunk_len: usize) -> Result<Vec<MemoryRegion>> {
        if chunk_len == 0 {
            return Err(Error::InvalidArgument("chunk length must be at least 1 byte".into()));
        }
        let outstanding = self.outstanding();
        let (reg, base, len) = match Arc::try_unwrap(self.inner).map_err(|_| Error::InFlight { outstanding })?.part {
            Part::Whole(reg) => {
                let len = reg.len;
                (Arc::new(reg), 0, len)
            }
            Part::Chunk { reg, offset, len } => (reg, offset, len),
        };
        Ok((0..len)
            .step_by(chunk_len)
            .map(|off| MemoryRegion {
                inner: MrInner::new(Part::Chunk {
                    reg: Arc::clone(&reg),
                    offset: base + off,
                    len: chunk_len.min(len - off),
                }),
            })
            .collect())
    }

    pub(crate) fn inner(&self) -> &Arc<MrInner> {
        &self.inner
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Always false: a region has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The local key.
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.inner.lkey()
    }

    /// The remote key a peer uses for RDMA READ/WRITE.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is registered while `self` exists; rkey is immutable.
        unsafe { (*self.inner.reg().mr.as_ptr()).rkey }
    }

    /// The region's address as the device, work requests and peers address it: its virtual
    /// address, or the I/O virtual address it was registered at ([`MemoryRegion::register_at`]).
    #[inline]
    pub fn addr(&self) -> u64 {
        self.inner.addr()
    }

    /// The access rights it was registered with ([`AccessFlags::effective`] of those asked for).
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }

    /// The PD it is registered on.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.inner.reg().pd
    }

    /// The raw `ibv_mr` (shared by all chunks of a registration). It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.inner.reg().mr.as_ptr()
    }

    /// How many holds posted work requests have on this region: one per work request that
    /// names it, however many of that work request's pieces do (they are released together,
    /// when its completion is reaped).
    pub fn outstanding(&self) -> usize {
        Arc::strong_count(&self.inner) - 1
    }

    /// What a peer needs to address this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.addr(), rkey: self.rkey(), len: self.len() as u64 }
    }

    fn unique(&mut self) -> Result<&mut MrInner> {
        let outstanding = self.outstanding();
        Arc::get_mut(&mut self.inner).ok_or(Error::InFlight { outstanding })
    }

    /// The bytes, for a region the device does not write and no peer can write: allowed while
    /// posted work only reads it (the source of a send or RDMA WRITE). The `&mut self` borrow
    /// keeps new work off the region while the slice lives.
    ///
    /// # Errors
    /// [`Error::InFlight`] while a posted work request lets the device write it (a receive, an
    /// RDMA READ target); [`Error::RemotelyWritable`] for a region registered with remote write
    /// or atomic rights.
    pub fn as_slice(&mut self) -> Result<&[u8]> {
        let writers = self.inner.writers.load(Ordering::Acquire);
        if writers > 0 {
            return Err(Error::InFlight { outstanding: self.outstanding() });
        }
        if self.inner.reg().access.remotely_writable() {
            return Err(Error::RemotelyWritable);
        }
        // The writer count is raised before a post that lets the device write this chunk and
        // lowered only once its completion is reaped or the QP is gone.
        // SAFETY: no posted work lets the device write the chunk (the count), no peer may, chunks
        // never overlap, and `&mut self` keeps new posts away while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.inner.ptr(), self.inner.len()) })
    }

    /// The bytes, mutably: for a region no work request uses at all and no peer can write.
    ///
    /// # Errors
    /// [`Error::InFlight`] while any posted work request uses it; [`Error::RemotelyWritable`]
    /// as for [`MemoryRegion::as_slice`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        let inner = self.unique()?;
        if inner.reg().access.remotely_writable() {
            return Err(Error::RemotelyWritable);
        }
        // SAFETY: the chunk handle is unique (no posted WR holds it), chunks never overlap, and
        // no peer may write the registration, so nothing but this `&mut` borrow can access the
        // bytes while it lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(inner.ptr(), inner.len()) })
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region, with volatile reads.
    /// Works for remotely writable regions; the copy may observe a concurrent remote write
    /// partially. Allowed while posted work only reads the region.
    ///
    /// # Errors
    /// [`Error::InFlight`] while a local work request lets the device write it;
    /// [`Error::OutOfBounds`].
    pub fn read_at(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if self.inner.writers.load(Ordering::Acquire) > 0 {
            return Err(Error::InFlight { outstanding: self.outstanding() });
        }
        check_range(offset, dst.len(), self.inner.len())?;
        // A peer may write the region meanwhile: hence volatile reads, never a reference.
        // SAFETY: in bounds; no local work lets the device write it (checked above; `&mut self`
        // keeps new posts away); `dst` is a distinct Rust buffer.
        unsafe { volatile_copy_from(self.inner.ptr().add(offset), dst) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`, with volatile writes. Works for remotely
    /// writable regions.
    ///
    /// # Errors
    /// [`Error::InFlight`] while a local work request uses it; [`Error::OutOfBounds`].
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let inner = self.unique()?;
        check_range(offset, src.len(), inner.len())?;
        // SAFETY: in bounds; no posted work request uses the region (the handle is unique);
        // the destination is written only through volatile accesses, never a reference.
        unsafe { volatile_copy_to(src, inner.ptr().add(offset)) };
        Ok(())
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("access", &self.access())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

pub(crate) fn check_range(offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => {
            Err(Error::OutOfBounds { what: "memory region", offset: offset as u64, len: len as u64, size: size as u64 })
        }
    }
}

mod errors;
mod remote;
#[cfg(feature = "stream")]
mod reshape;
#[cfg(feature = "bytemuck")]
mod view;
mod volatile;

pub(crate) use errors::check_odp_registration;
use errors::reg_error;
pub use errors::IntoBufferError;
pub use remote::RemoteRegion;
#[cfg(feature = "stream")]
pub(crate) use reshape::Spare;
use volatile::{volatile_copy_from, volatile_copy_to};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_match_verbs() {
        use ffi::ibv_access_flags as f;
        assert_eq!(AccessFlags::LOCAL_WRITE.bits(), f::IBV_ACCESS_LOCAL_WRITE.0);
        assert_eq!(AccessFlags::REMOTE_WRITE.bits(), f::IBV_ACCESS_REMOTE_WRITE.0);
        assert_eq!(AccessFlags::REMOTE_READ.bits(), f::IBV_ACCESS_REMOTE_READ.0);
        assert_eq!(AccessFlags::REMOTE_ATOMIC.bits(), f::IBV_ACCESS_REMOTE_ATOMIC.0);
        assert_eq!(AccessFlags::MW_BIND.bits(), f::IBV_ACCESS_MW_BIND.0);
        assert_eq!(AccessFlags::RELAXED_ORDERING.bits(), f::IBV_ACCESS_RELAXED_ORDERING.0);
        assert!((AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).remotely_writable());
        assert!(!(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).remotely_writable());
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(10, 0, 10).is_ok());
        assert!(check_range(1, 10, 10).is_err());
        assert!(check_range(usize::MAX, 2, 10).is_err());
        let r = RemoteRegion { addr: 0x1000, rkey: 7, len: 100 };
        assert_eq!(r.at(10, 90).unwrap(), 0x100a);
        assert!(r.at(10, 91).is_err());
        assert!(r.at(u64::MAX, 1).is_err());
    }
}
