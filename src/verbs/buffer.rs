//! Memory the caller owns, registered in place: [`StableBuffer`] says which owned buffers keep
//! their bytes at one address, and [`Mapping`] is an anonymous mapping (optionally of 2 MiB huge
//! pages) to register.
//!
//! ```no_run
//! use rdma_cm::{AccessFlags, Mapping, MemoryRegion, ProtectionDomain, VerbsContext};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let pd = ProtectionDomain::new(&VerbsContext::open("rxe0")?)?;
//! // A Vec: only its `len` bytes are registered; its spare capacity is kept, untouched.
//! let mut v = Vec::with_capacity(8192);
//! v.extend_from_slice(b"hello");
//! let at = v.as_ptr();
//! let mr = MemoryRegion::register(&pd, v, AccessFlags::LOCAL_WRITE)?;
//! // ... post it, reap its completions ...
//! let v: Vec<u8> = mr.into_buffer_as().map_err(rdma_cm::Error::from)?;
//! assert_eq!((v.as_ptr(), v.capacity()), (at, 8192)); // the same bytes, never copied
//!
//! // 2 MiB huge pages (the kernel must have some: /proc/sys/vm/nr_hugepages).
//! let huge = Mapping::huge_pages(4 << 20)?;
//! let mr = MemoryRegion::register(&pd, huge, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
//! # drop(mr);
//! # Ok(()) }
//! ```
//!
//! # Why the trait is `unsafe`, and what it asks
//!
//! Registration hands the buffer's address to the device, which reads and writes it long after
//! the borrow that produced the address has ended, while the owner sits, moved and type-erased,
//! inside the [`MemoryRegion`](crate::MemoryRegion). The compiler cannot check that the bytes
//! are still there; if they were not (freed, reallocated, or inside the owner that was moved),
//! the device would write memory that Rust code owns for something else. That obligation is on
//! whoever says "this type's bytes are stable": hence an `unsafe trait`, as tokio-uring's
//! `IoBuf` is for the same reason (the kernel holds the address while the operation runs).
//!
//! Moving the owner must not move the bytes: they live behind a pointer (on the heap, or in a
//! mapping), never inline in the owner. A `Vec<u8>` qualifies (moving it moves three words, not
//! its allocation); a `[u8; 4096]` does not (its bytes are the value). The region moves the
//! owner into a box of its own when it registers it, and again when it gives it back, and the
//! lane moves regions into its slot table and out: none of these may change the address.
//!
//! Owners are `'static` and owned: a borrowed buffer would be released when its borrow ends,
//! and a region can outlive any borrow (`mem::forget` is safe, and a region forgotten while
//! registered keeps the device's access to the memory). With ownership, forgetting leaks, and a
//! leak is safe.
//!
//! # Heap buffers and `fork()`
//!
//! Registration pins whole pages. A `Vec` or a boxed slice shares its first and last pages
//! with other allocations, and on a kernel older than 5.13 with libibverbs' fork support on
//! ([`ForkStatus::Enabled`](crate::verbs::fork::ForkStatus::Enabled)) those whole pages are kept out of a
//! forked child, neighbours included. A program that forks on such a kernel registers a
//! [`Mapping`] instead, which has pages of its own. See [`crate::verbs::fork`].

use std::ptr::NonNull;

use crate::error::{errno, Error, Result};

/// An owned buffer whose bytes stay at one address, for as long as it is owned and not
/// touched: what [`MemoryRegion::register`](crate::MemoryRegion::register) registers in place
/// (zero-copy) and [`MemoryRegion::into_buffer_as`](crate::MemoryRegion::into_buffer_as) gives
/// back.
///
/// Implemented for `Vec<u8>` and `Box<[u8]>`, and, with the feature `bytemuck`, for `Vec<T>` and
/// `Box<[T]>` of any `bytemuck::Pod` `T` (which covers `u8`); for [`Mapping`]; with the
/// feature `memmap2`, for `memmap2::MmapMut`. For a `Vec`, the `len` initialised elements are
/// registered, and its spare capacity is kept as it is, unregistered.
///
/// # Safety
///
/// An implementor promises, for every value `b` of its type:
///
/// - `b.stable_mut_ptr()` points to `b.stable_len()` bytes that are valid for reads and writes,
///   that `b` owns, and that nothing else reaches: no clone, second handle or other mapping
///   that safe code elsewhere could read or write (for a file mapping, the user promised that
///   when making it, as `memmap2` asks);
/// - those bytes stay valid, and at the same address, until `b` is dropped, however often `b`
///   itself is moved, provided that no method of `b` other than these two is called (the
///   region calls nothing else on it, and drops it only after the device can no longer reach
///   it): the bytes live behind a pointer, never inline in `b`;
/// - called again on the same value, both methods give the same answers;
/// - any bytes at all may be written there (the device writes whatever arrives, and a peer
///   may too): `b` stays a valid value whatever they are, so its element type has no invalid
///   bit patterns (that is why `Vec<T>` needs `T: Pod`);
/// - its drop frees the bytes at most once, and nothing else does.
///
/// The region takes the pointer only after moving `b` to where it stays (a box of its own),
/// and keeps deriving every access from that one pointer.
pub unsafe trait StableBuffer: Send + 'static {
    /// The first byte. The `&mut` receiver is where write access to the bytes comes from.
    fn stable_mut_ptr(&mut self) -> *mut u8;
    /// How many bytes, from [`StableBuffer::stable_mut_ptr`], are registered.
    fn stable_len(&self) -> usize;
}

// SAFETY: a Vec's elements are on the heap (its pointer, length and capacity are what moves),
// owned by it alone; they move only when it grows or shrinks, which takes a method the region
// never calls. `len` elements of `u8` are initialised, and every byte pattern is a valid `u8`.
#[cfg(not(feature = "bytemuck"))]
unsafe impl StableBuffer for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: a boxed slice's bytes are on the heap, owned by the box alone (moving the box moves
// its pointer and length); every byte pattern is a valid `u8`.
#[cfg(not(feature = "bytemuck"))]
unsafe impl StableBuffer for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for `Vec<u8>`: the elements are on the heap, owned by the Vec alone, and move only
// through methods the region never calls. `T: Pod` has no padding and no invalid bit pattern,
// so the bytes are initialised and anything the device writes leaves valid `T`s. `len *
// size_of::<T>()` cannot overflow: it is the size of a live allocation (or 0 for a ZST).
#[cfg(feature = "bytemuck")]
unsafe impl<T: bytemuck::Pod + Send> StableBuffer for Vec<T> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr().cast()
    }
    fn stable_len(&self) -> usize {
        std::mem::size_of_val(self.as_slice())
    }
}

// SAFETY: as for `Vec<T>`: the box's elements are on the heap, owned by it alone; `T: Pod`
// makes every byte pattern valid.
#[cfg(feature = "bytemuck")]
unsafe impl<T: bytemuck::Pod + Send> StableBuffer for Box<[T]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr().cast()
    }
    fn stable_len(&self) -> usize {
        std::mem::size_of_val(&**self)
    }
}

/// A file mapping registered and then truncated (by anyone: `File::set_len` is safe, which is
/// why `MmapOptions::map_mut` is `unsafe` and its caller promises that it does not happen):
/// measured on Soft-RoCE (Linux 6.1, tmpfs), registration pins the pages, so the device goes
/// on reading and writing them (a peer's WRITE and READ complete) although the file no longer
/// has them, and what it writes never reaches the file; the CPU touching the mapping past the
/// file's new end gets `SIGBUS`. A mapping that already reaches a whole page past the file's
/// end is refused by registration (`EFAULT`: the kernel cannot pin a page the file does not
/// have). Kernels from 6.5 on refuse long-term pins of writable shared mappings of most file
/// systems altogether; tmpfs (`/dev/shm`) and anonymous mappings are exempt. The refusal is of
/// pins for writing: a registration with no write rights (`REMOTE_READ` alone, as
/// `examples/file_server.rs` does) is allowed; measured on Soft-RoCE with Linux 6.12, an ext4
/// file's mapping registers with `REMOTE_READ` and is refused (`EFAULT`) with `LOCAL_WRITE`.
// SAFETY: an `MmapMut` is a mapping made by its constructor and unmapped by its Drop; moving it
// moves its pointer and length, not the mapping. The only method that moves the mapping
// (`remap`) takes `&mut self`, which the region never calls. Whoever made a file mapping promised
// (`MmapOptions::map_mut` is unsafe) that no one else modifies the file meanwhile; bytes are
// bytes, so any pattern is valid.
#[cfg(feature = "memmap2")]
unsafe impl StableBuffer for memmap2::MmapMut {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len()
    }
}

/// The size of a huge page that [`Mapping::huge_pages`] asks for: 2 MiB.
pub const HUGE_PAGE_SIZE: usize = 2 << 20;

/// An anonymous private mapping (`mmap(MAP_ANONYMOUS | MAP_PRIVATE)`), zero-filled, owned and
/// unmapped on drop: memory to register, in ordinary pages ([`Mapping::anonymous`]) or in
/// 2 MiB huge pages ([`Mapping::huge_pages`]), where the device needs far fewer translations.
///
/// It reads and writes like a byte slice (`Deref<Target = [u8]>`). Registered, it is owned by
/// the region until [`MemoryRegion::into_buffer_as`](crate::MemoryRegion::into_buffer_as) gives
/// it back: nothing can unmap it while the device may use it.
pub struct Mapping {
    ptr: NonNull<u8>,
    /// The length asked for: what is registered and sliced.
    len: usize,
    /// The length mapped: `len` rounded up to whole pages.
    mapped: usize,
    huge: bool,
}

// SAFETY: the mapping is owned by this value alone (made private and anonymous by its
// constructor, unmapped once by its Drop); access goes through `&self`/`&mut self` as for a
// `Box<[u8]>`, so moving it between threads or sharing `&Mapping` is as safe as for a box.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` hands out only `&[u8]`, no interior mutability.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` zeroed bytes in the system's ordinary pages.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0` or a length past the address space;
    /// [`Error::Call`] when `mmap` fails.
    pub fn anonymous(len: usize) -> Result<Mapping> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
        Mapping::map(len, page, 0)
    }

    /// Maps `len` zeroed bytes in 2 MiB huge pages (`MAP_HUGETLB | MAP_HUGE_2MB`); the mapping
    /// is rounded up to whole huge pages, of which only `len` bytes are used.
    ///
    /// The kernel serves these from its reserved pool, which is empty unless an administrator
    /// filled it: `sysctl vm.nr_hugepages=64` (or `echo 64 > /proc/sys/vm/nr_hugepages`)
    /// reserves 64 pages of 2 MiB.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::HugePages`] when the kernel has too
    /// few free huge pages (it names the pool's numbers and how to reserve more); [`Error::Call`]
    /// when `mmap` fails otherwise.
    pub fn huge_pages(len: usize) -> Result<Mapping> {
        Mapping::map(len, HUGE_PAGE_SIZE, libc::MAP_HUGETLB | libc::MAP_HUGE_2MB)
    }

    fn map(len: usize, page: usize, flags: libc::c_int) -> Result<Mapping> {
        if len == 0 {
            return Err(Error::InvalidArgument("a mapping of 0 bytes cannot be made".into()));
        }
        let mapped = len
            .checked_next_multiple_of(page)
            .filter(|&m| m <= isize::MAX as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("a mapping of {len} bytes is too large")))?;
        let huge = flags & libc::MAP_HUGETLB != 0;
        // SAFETY: a new anonymous private mapping at an address of the kernel's choosing: it
        // overlaps nothing of ours, and no file or fd is involved.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = errno();
            if huge && e == libc::ENOMEM {
                let (total, free) = huge_page_pool();
                return Err(Error::HugePages {
                    len: mapped,
                    total,
                    free,
                    source: std::io::Error::from_raw_os_error(e),
                });
            }
            return Err(Error::call(if huge { "mmap(MAP_HUGETLB)" } else { "mmap" }, e, None));
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| Error::call("mmap", libc::ENOMEM, None))?;
        Ok(Mapping { ptr, len, mapped, huge })
    }

    /// Whether it is made of 2 MiB huge pages.
    pub fn is_huge(&self) -> bool {
        self.huge
    }

    /// Bytes mapped: the length rounded up to whole pages (huge pages for a huge mapping).
    pub fn mapped_len(&self) -> usize {
        self.mapped
    }
}

/// The kernel's pool of 2 MiB huge pages, as `/proc/meminfo` reports it: (total, free).
fn huge_page_pool() -> (Option<u64>, Option<u64>) {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next()?.parse().ok())
    };
    (field("HugePages_Total"), field("HugePages_Free"))
}

impl std::ops::Deref for Mapping {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable and owned by `self`; the `&self` borrow keeps
        // `&mut` access away while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for Mapping {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes mapped writable and owned by `self` alone; `&mut self` makes the
        // slice the only access while it lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` with exactly this address and length and is
        // unmapped only here; a region holding it drops it only after deregistering.
        let ret = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
        if ret != 0 {
            crate::error::report_leak("munmap", errno());
        }
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("mapped", &self.mapped)
            .field("huge", &self.huge)
            .finish()
    }
}

// SAFETY: the mapping lies behind a pointer the value owns alone (see `Send`); moving a
// `Mapping` moves that pointer, never the pages, which stay mapped until its Drop. Its only
// mutable access is `deref_mut`, which the region never calls while it holds it.
unsafe impl StableBuffer for Mapping {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_anonymous_mapping_is_zeroed_writable_and_rounded_to_pages() {
        let mut m = Mapping::anonymous(5000).unwrap();
        assert_eq!((m.len(), m.mapped_len() % 4096, m.is_huge()), (5000, 0, false));
        assert!(m.iter().all(|&b| b == 0));
        m[4999] = 7;
        let at = m.stable_mut_ptr();
        let mut moved = Box::new(m);
        assert_eq!((moved.stable_mut_ptr(), moved[4999]), (at, 7), "moving it moves no byte");
        assert!(matches!(Mapping::anonymous(0), Err(Error::InvalidArgument(_))));
        assert!(matches!(Mapping::anonymous(usize::MAX), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn a_vec_registers_its_length_not_its_capacity() {
        let mut v: Vec<u8> = Vec::with_capacity(100);
        v.extend_from_slice(&[1, 2, 3]);
        assert_eq!(v.stable_len(), 3);
        let b: Box<[u8]> = vec![0; 9].into_boxed_slice();
        assert_eq!(b.stable_len(), 9);
    }

    #[cfg(feature = "bytemuck")]
    #[test]
    fn typed_buffers_register_their_bytes_and_zsts_register_none() {
        let v: Vec<u64> = vec![0; 5];
        assert_eq!(v.stable_len(), 40);
        let b: Box<[u32]> = vec![0; 3].into_boxed_slice();
        assert_eq!(b.stable_len(), 12);
        let z: Vec<()> = vec![(); 10];
        assert_eq!(z.stable_len(), 0);
    }
}
