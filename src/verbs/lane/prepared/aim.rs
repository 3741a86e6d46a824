//! Re-aiming a prepared send-queue work request: the remote offset of an RDMA WRITE, READ or
//! atomic within the remote region it was checked against, an atomic's operands, and the one
//! piece of its region it moves.
//!
//! A one-sided store reads (or writes) another slot of the peer's table each time. Preparing a
//! request per slot would cost a request per slot; re-aiming one costs a compare and two
//! stores: the request keeps the bounds it was checked against, and a post takes whatever it
//! is aimed at then.
//!
//! ```text
//! let mut read = lane.prepare_send(qp, SendWr::read(mr, 0..64, &table, 0))?;
//! for slot in slots {
//!     read.aim(slot * 64)?;                  // within `table`, or refused
//!     lane.post_prepared(&mut read)?;
//!     // … poll, rearm
//! }
//! ```
//!
//! Re-aiming is allowed whether the request is armed or posted: the provider copies a work
//! request into its queue during `ibv_post_send`, so what a posted request is aimed at is
//! already the device's, and the next post takes the new aim.

use super::PreparedSend;
use crate::error::Error;
use crate::error::Result;
use crate::verbs::lane::refused::{bad_request, out_of_region, out_of_remote, too_long, unaligned_atomic};
use crate::verbs::lane::wr::piece;
use crate::verbs::lane::{Member, SendWr};
use ffi::ibv_wr_opcode::*;
use rdma_sys as ffi;
use std::ops::Range;

/// What a prepared send-queue request was checked against, kept to re-aim it.
pub(super) struct Bounds {
    /// Offsets below this one are re-aimed with one compare ([`PreparedSend::aim`]): the
    /// remote region's length less the bytes it moves, plus one, for an RDMA WRITE or READ;
    /// 0 (nothing takes the fast way) for a send or an atomic.
    fast_end: u64,
    /// The remote region's address, length, and the offset it is aimed at now (0 for a send).
    remote_base: u64,
    remote_len: u64,
    offset: u64,
    /// The bytes it moves.
    len: u64,
    /// Its region's address and length (its one piece is re-aimed within them).
    local_addr: u64,
    local_len: u64,
    /// The most bytes one post of it may move: a UD QP's MTU, else 4 GiB - 1.
    max_len: u32,
    /// It names one piece of its region (a gathered one keeps its pieces).
    single: bool,
}

impl Bounds {
    /// The bounds `wr`, lowered for `m`, was checked against.
    pub(super) fn of(wr: &SendWr, m: &Member) -> Bounds {
        let mut b = Bounds {
            fast_end: 0,
            remote_base: wr.remote_addr.wrapping_sub(wr.remote_offset),
            remote_len: wr.remote_len,
            offset: wr.remote_offset,
            len: wr.total,
            local_addr: wr.mr.addr(),
            local_len: wr.mr.len() as u64,
            max_len: if m.is_ud() { m.mtu } else { u32::MAX },
            single: wr.n == 1,
        };
        b.set_fast_end(wr.opcode);
        b
    }

    fn set_fast_end(&mut self, opcode: u32) {
        self.fast_end = match opcode {
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM | IBV_WR_RDMA_READ => {
                // `len <= remote_len` was checked when it was built; a region of 2^64 - 1 bytes
                // leaves its last offset to the slow path.
                (self.remote_len - self.len.min(self.remote_len)).saturating_add(1)
            }
            _ => 0,
        };
    }
}

impl PreparedSend {
    /// Aims an RDMA WRITE or READ at `offset` of the remote region it was prepared against
    /// (an atomic at the 8 bytes there), for its next posts: a compare and two stores.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] naming the offset, the length and the remote region's size
    /// when the range leaves that region; [`Error::InvalidArgument`] for an atomic target
    /// that is not 8-byte aligned, or for a send (it has no remote address). The request is
    /// unchanged then, and stays usable.
    #[inline(always)]
    pub fn aim(&mut self, offset: u64) -> Result<()> {
        if offset < self.bounds.fast_end {
            self.raw.wr.rdma.remote_addr = self.bounds.remote_base.wrapping_add(offset);
            self.bounds.offset = offset;
            return Ok(());
        }
        self.aim_slow(offset)
    }

    /// `aim` for an atomic, the last offset of a region of 2^64 - 1 bytes, or a refusal.
    #[cold]
    #[inline(never)]
    fn aim_slow(&mut self, offset: u64) -> Result<()> {
        let b = &mut self.bounds;
        let fits = |len: u64| offset.checked_add(len).is_some_and(|end| end <= b.remote_len);
        match self.raw.opcode {
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM | IBV_WR_RDMA_READ => {
                if !fits(b.len) {
                    return Err(out_of_remote(offset, b.len, b.remote_len));
                }
                self.raw.wr.rdma.remote_addr = b.remote_base.wrapping_add(offset);
            }
            IBV_WR_ATOMIC_FETCH_AND_ADD | IBV_WR_ATOMIC_CMP_AND_SWP => {
                if !fits(8) {
                    return Err(out_of_remote(offset, 8, b.remote_len));
                }
                let addr = b.remote_base.wrapping_add(offset);
                if addr % 8 != 0 {
                    return Err(unaligned_atomic(addr));
                }
                self.raw.wr.atomic.remote_addr = addr;
            }
            _ => return Err(no_remote("aim")),
        }
        b.offset = offset;
        Ok(())
    }

    /// The offset of the remote region it is aimed at (0 for a send).
    pub fn remote_offset(&self) -> u64 {
        self.bounds.offset
    }

    /// Sets an atomic's operands for its next posts: what a fetch-and-add adds (`swap`
    /// ignored), or what a compare-and-swap compares with and swaps in.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it is not an atomic (it is unchanged then).
    pub fn set_atomic_operands(&mut self, compare_add: u64, swap: u64) -> Result<()> {
        match self.raw.opcode {
            IBV_WR_ATOMIC_FETCH_AND_ADD | IBV_WR_ATOMIC_CMP_AND_SWP => {
                self.raw.wr.atomic.compare_add = compare_add;
                self.raw.wr.atomic.swap = swap;
                Ok(())
            }
            _ => Err(Error::InvalidArgument(
                "set_atomic_operands: not an atomic (SendWr::fetch_add, SendWr::compare_swap)".into(),
            )),
        }
    }

    /// Moves its one piece to `range` of the region it was prepared with, for its next posts
    /// (what a send sends, a WRITE writes, a READ or an atomic's result lands in). The remote
    /// range keeps its offset and takes the new length.
    ///
    /// # Errors
    /// The request is unchanged, and stays usable: [`Error::OutOfBounds`] when `range` leaves
    /// the region, or the remote range at the current offset, with the new length, leaves the
    /// remote region; [`Error::MessageTooLong`] for a UD send over the MTU;
    /// [`Error::InvalidArgument`] for a reversed range, a request of several pieces, or an
    /// atomic's range that is not 8 bytes.
    pub fn aim_local(&mut self, range: Range<usize>) -> Result<()> {
        let (start, len) = piece(&range).map_err(|why| bad_request("aim_local", why))?;
        let b = &mut self.bounds;
        if !b.single {
            return Err(Error::InvalidArgument(
                "aim_local: a request of several pieces keeps them (prepare one request per layout)".into(),
            ));
        }
        let len64 = len as u64;
        if start.checked_add(len64).is_none_or(|end| end > b.local_len) {
            return Err(out_of_region(start, len, b.local_len));
        }
        match self.raw.opcode {
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM | IBV_WR_RDMA_READ
                if b.offset.checked_add(len64).is_none_or(|end| end > b.remote_len) =>
            {
                return Err(out_of_remote(b.offset, len64, b.remote_len));
            }
            IBV_WR_ATOMIC_FETCH_AND_ADD | IBV_WR_ATOMIC_CMP_AND_SWP if len != 8 => {
                return Err(Error::InvalidArgument(format!("aim_local: an atomic's result takes 8 bytes, not {len}")));
            }
            _ if len > b.max_len => return Err(too_long(len64, b.max_len)),
            _ => {}
        }
        let sge = &mut self.sge.get_mut()[0];
        // SAFETY: a request of one piece had its first entry written when it was lowered
        // (`SendWr::lower`), and every write since (here) keeps it initialised.
        let lkey = unsafe { sge.assume_init_ref() }.lkey;
        sge.write(ffi::ibv_sge { addr: b.local_addr + start, length: len, lkey });
        // A zero-length one has no scatter entry, as `SendWr::lower` says.
        self.raw.num_sge = (len != 0) as i32;
        b.len = len64;
        b.set_fast_end(self.raw.opcode);
        Ok(())
    }
}

#[cold]
fn no_remote(op: &str) -> Error {
    Error::InvalidArgument(format!(
        "{op}: a send has no remote address: only an RDMA WRITE or READ, or an atomic, is aimed at a remote offset"
    ))
}
