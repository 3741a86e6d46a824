//! [`RemoteRegion`]: a peer's region, as RDMA READ, WRITE and atomics address it.

use crate::error::{Error, Result};

/// A region of the peer's memory: what RDMA READ and WRITE address.
///
/// A peer running this crate sends [`MemoryRegion::remote`](crate::MemoryRegion::remote) (inside [`QpInfo`](crate::QpInfo),
/// say); other peers say it their own way. `rping`, for one, sends the address, the rkey and
/// the length as big-endian integers:
///
/// ```
/// # let msg = [0u8; 16];
/// let addr = u64::from_be_bytes(msg[0..8].try_into().unwrap());
/// let rkey = u32::from_be_bytes(msg[8..12].try_into().unwrap());
/// let len = u32::from_be_bytes(msg[12..16].try_into().unwrap());
/// let remote = rdma_cm::RemoteRegion::new(addr, rkey, len as u64);
/// # assert_eq!(remote.len, 0);
/// ```
///
/// It is the peer's word, not checked locally: a wrong address or rkey makes the work request
/// fail (`REM_ACCESS_ERR`), never touches local memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// The peer's virtual address.
    pub addr: u64,
    /// The peer's rkey.
    pub rkey: u32,
    /// Length in bytes the peer advertised.
    pub len: u64,
}

impl RemoteRegion {
    /// A region of `len` bytes at the peer's virtual address `addr`, under the peer's `rkey`.
    pub fn new(addr: u64, rkey: u32, len: u64) -> RemoteRegion {
        RemoteRegion { addr, rkey, len }
    }

    /// The address of `offset..offset+len`, checked against the advertised length.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the advertised region.
    #[inline]
    pub fn at(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr.wrapping_add(offset)),
            _ => Err(Error::OutOfBounds { what: "remote region", offset, len, size: self.len }),
        }
    }
}
