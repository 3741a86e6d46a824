//! Chunks of one registration reshaped without allocating (crate-internal): a chunk split in
//! two, the second part taking a [`Spare`] handle; two adjacent chunks joined into one, the
//! second's handle becoming a spare. The stream's send buffer is a ring of such chunks
//! (`src/stream/engine.rs`): a data WRITE takes exactly the bytes it sends, and its chunk joins
//! the free space again when it completes, with no allocation per message.
//!
//! Sound for the reason [`MemoryRegion::split`] is: chunks of a registration never overlap,
//! and a chunk's bytes are reached only through its handle, with `&mut` on a unique handle,
//! or by posted work requests, which hold clones of it. Both calls take unique handles only
//! (no work request holds either), and the ranges after them are exactly a partition of the
//! ranges before, so chunks still never overlap and nothing posted sees its range change.
//! (A peer given the registration's rkey reaches its bytes too; the only registration
//! reshaped, the stream's send buffer, is registered for local access only.)
//! Each reshaped handle takes a new serial: a prepared work request that recorded the old
//! range by its region's serial does not match the new one.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{MemoryRegion, MrInner, Part, NEXT_SERIAL};
use crate::error::Result;

/// A handle of a registration that covers no bytes: what [`MemoryRegion::split_off`] turns
/// into the second chunk, so that splitting allocates nothing. Offers no access.
pub(crate) struct Spare {
    inner: Arc<MrInner>,
}

impl MrInner {
    /// Makes this chunk cover `len` bytes from `offset` of its registration, under a new serial.
    /// The caller holds it uniquely and keeps chunks disjoint.
    fn cover(&mut self, offset: usize, len: usize) {
        let Part::Chunk { reg, offset: o, len: l } = &mut self.part else {
            unreachable!("only chunks are reshaped");
        };
        (*o, *l) = (offset, len);
        self.addr = reg.iova + offset as u64;
        self.len = len;
        self.serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
    }

    /// The registration and range of a chunk; `None` for a whole registration.
    fn chunk(&self) -> Option<(&Arc<super::Registration>, usize, usize)> {
        match &self.part {
            Part::Chunk { reg, offset, len } => Some((reg, *offset, *len)),
            Part::Whole(_) => None,
        }
    }
}

impl MemoryRegion {
    /// This region as one chunk of its registration, and `n` spare handles of it (the
    /// allocations are all made here).
    ///
    /// # Errors
    /// [`Error::InFlight`](crate::Error::InFlight) while a work request uses the region.
    pub(crate) fn with_spares(self, n: usize) -> Result<(MemoryRegion, Vec<Spare>)> {
        let len = self.len();
        let whole = self.split(len)?.pop().expect("a region of at least one byte splits into one chunk");
        let (reg, _, _) = whole.inner.chunk().expect("split makes chunks");
        let spares = (0..n)
            .map(|_| Spare { inner: MrInner::new(Part::Chunk { reg: Arc::clone(reg), offset: 0, len: 0 }) })
            .collect();
        Ok((whole, spares))
    }

    /// Another handle of this region, for a work request that only reads it (the source of an
    /// RDMA WRITE): what a posted request holds, as the module docs of `mr` describe, so the
    /// region stays registered and Rust code cannot change its bytes (that needs a unique
    /// handle) until the request's completion drops the handle.
    ///
    /// The caller must keep `self` out of user code's reach until every such handle is gone:
    /// a user holding `self` could post it where the device writes it (a receive, a READ
    /// target, a writable window: those posts assume the handle outside a lane is the only
    /// one), under the WRITE that reads it. The stream's `write_region` takes the region by
    /// value and gives it back only once its WRITEs' completions dropped their handles.
    pub(crate) fn share_for_reading(&self) -> MemoryRegion {
        MemoryRegion { inner: Arc::clone(&self.inner) }
    }

    /// Splits off the bytes from `at` on into `spare`, which becomes a chunk covering them;
    /// this region keeps the first `at` bytes. Gives the spare back unchanged when `at` is not
    /// inside the region, when a work request uses the region, or when the spare is of another
    /// registration.
    pub(crate) fn split_off(&mut self, at: usize, mut spare: Spare) -> std::result::Result<MemoryRegion, Spare> {
        let (Some(this), Some(other)) = (Arc::get_mut(&mut self.inner), Arc::get_mut(&mut spare.inner)) else {
            return Err(spare);
        };
        let (Some((reg, offset, len)), Some((spare_reg, _, _))) = (this.chunk(), other.chunk()) else {
            return Err(spare);
        };
        if at == 0 || at >= len || !Arc::ptr_eq(reg, spare_reg) {
            return Err(spare);
        }
        // Unique handles (no work request holds either; a spare is never posted), one
        // registration, and [offset, offset + len) parted at `at`: the two stay disjoint.
        other.cover(offset + at, len - at);
        this.cover(offset, at);
        Ok(MemoryRegion { inner: spare.inner })
    }

    /// Joins `next`, the chunk of this registration that starts where this one ends, onto
    /// this one; `next`'s handle becomes a spare. Gives `next` back unchanged when the two are
    /// not adjacent chunks of one registration, or a work request uses either.
    pub(crate) fn join(&mut self, mut next: MemoryRegion) -> std::result::Result<Spare, MemoryRegion> {
        let (Some(this), Some(other)) = (Arc::get_mut(&mut self.inner), Arc::get_mut(&mut next.inner)) else {
            return Err(next);
        };
        let (Some((reg, offset, len)), Some((next_reg, next_offset, next_len))) = (this.chunk(), other.chunk()) else {
            return Err(next);
        };
        if !Arc::ptr_eq(reg, next_reg) || offset + len != next_offset {
            return Err(next);
        }
        // Unique handles, one registration, adjacent ranges: this one covers both, the other
        // none.
        other.cover(next_offset, 0);
        this.cover(offset, len + next_len);
        Ok(Spare { inner: next.inner })
    }
}
