//! Typed views of a region's bytes (feature `bytemuck`).

use super::MemoryRegion;
use crate::error::{Error, Result};

/// Typed views: the region's bytes as a slice of plain-old-data `T` (feature `bytemuck`).
#[cfg(feature = "bytemuck")]
impl MemoryRegion {
    /// The region as `&[T]`: [`MemoryRegion::as_slice`], typed. The same rules hold: allowed
    /// while posted work only reads the region, refused while the device may write it or a
    /// peer may.
    ///
    /// # Errors
    /// As for [`MemoryRegion::as_slice`], and [`Error::TypedView`] when the region's address
    /// is not a multiple of `T`'s alignment or its length is not a multiple of `T`'s size (or
    /// `T` is zero-sized); the error names both numbers.
    pub fn as_slice_of<T: bytemuck::Pod>(&mut self) -> Result<&[T]> {
        let (addr, len) = (self.addr(), self.len());
        let bytes = self.as_slice()?;
        check_view::<T>(bytes.as_ptr(), addr, len)?;
        bytemuck::try_cast_slice(bytes).map_err(|_| view_error::<T>(addr, len))
    }

    /// The region as `&mut [T]`: [`MemoryRegion::as_mut_slice`], typed. Refused while any
    /// work request holds the region, or a peer may write it.
    ///
    /// # Errors
    /// As for [`MemoryRegion::as_mut_slice`], and [`Error::TypedView`] as for
    /// [`MemoryRegion::as_slice_of`].
    pub fn as_mut_slice_of<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        let (addr, len) = (self.addr(), self.len());
        let bytes = self.as_mut_slice()?;
        check_view::<T>(bytes.as_ptr(), addr, len)?;
        bytemuck::try_cast_slice_mut(bytes).map_err(|_| view_error::<T>(addr, len))
    }
}

/// Whether `len` bytes at `ptr` (the region's address `addr`, as a peer sees it) can be viewed
/// as `[T]`. The alignment is the local pointer's (what a reference needs); it equals `addr`
/// modulo any alignment, except for a region at a chosen I/O address.
#[cfg(feature = "bytemuck")]
fn check_view<T>(ptr: *const u8, addr: u64, len: usize) -> Result<()> {
    let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
    if size == 0 || (ptr as usize) % align != 0 || len % size != 0 {
        let addr = if (ptr as usize) % align != 0 { ptr as u64 } else { addr };
        return Err(view_error::<T>(addr, len));
    }
    Ok(())
}

#[cfg(feature = "bytemuck")]
fn view_error<T>(addr: u64, len: usize) -> Error {
    Error::TypedView {
        ty: std::any::type_name::<T>(),
        addr,
        len,
        size: std::mem::size_of::<T>(),
        align: std::mem::align_of::<T>(),
    }
}
