//! Inline sends: small messages whose bytes the provider copies into its work queue during the
//! post (`IBV_SEND_INLINE`), so they need no [`MemoryRegion`].
//!
//! An [`InlineWr`] borrows a plain `&[u8]` for the post only: the provider copies the bytes
//! before `ibv_post_send` returns (that is what `IBV_SEND_INLINE` means, and why the lkey is not
//! checked), so the device never reads them afterwards, and the borrow may end when
//! [`Lane::post_inline`] returns. The request still takes a slot of the send queue, which holds
//! no region: its completion hands out `None` as the region. Unsignaled, it is retired by the
//! next signaled completion of the queue like any other (and the one that takes the queue's
//! last free slot is signaled whatever it asks), so nothing is left that the lane cannot
//! retire.
//!
//! ```no_run
//! # fn f(lane: &mut rdma_cm::verbs::lane::Lane, qp: rdma_cm::verbs::lane::LaneQp) -> rdma_cm::Result<()> {
//! use rdma_cm::verbs::lane::InlineWr;
//! let reply = *b"ok";
//! lane.post_inline(qp, InlineWr::send(&reply).wr_id(7).unsignaled())?;
//! # Ok(()) }
//! ```

use super::refused::{post_list_failed, refusal, too_long, ud_needs_dest};
use super::wr::Defect;
use super::{tag, DestKey, Lane, LaneQp, Member};
use crate::error::Error;
use crate::error::Result;
use crate::verbs::mr::RemoteRegion;
use ffi::ibv_wr_opcode::*;
use rdma_sys as ffi;
use std::mem;

/// A send or RDMA WRITE whose bytes, a borrowed slice, the provider copies at post time
/// ([`Lane::post_inline`]): no region needed. At most the QP's `max_inline_data` bytes
/// ([`QpInit::max_inline_data`](crate::QpInit::max_inline_data); [`QueuePair::max_inline_data`](crate::QueuePair::max_inline_data) says what the provider granted).
#[derive(Debug)]
pub struct InlineWr<'a> {
    data: &'a [u8],
    opcode: u32,
    flags: u32,
    imm: u32,
    remote_addr: u64,
    rkey: u32,
    defect: Option<Defect>,
    wr_id: u64,
    signaled: bool,
    dest: Option<DestKey>,
}

impl<'a> InlineWr<'a> {
    fn new(data: &'a [u8], opcode: u32) -> InlineWr<'a> {
        InlineWr {
            data,
            opcode,
            flags: 0,
            imm: 0,
            remote_addr: 0,
            rkey: 0,
            defect: None,
            wr_id: 0,
            signaled: true,
            dest: None,
        }
    }

    /// Sends `data`.
    #[inline(always)]
    pub fn send(data: &'a [u8]) -> InlineWr<'a> {
        Self::new(data, IBV_WR_SEND)
    }

    /// Writes `data` to `remote` at `offset` (RDMA WRITE), checked against the remote region.
    #[inline(always)]
    pub fn write(data: &'a [u8], remote: &RemoteRegion, offset: u64) -> InlineWr<'a> {
        let mut w = Self::new(data, IBV_WR_RDMA_WRITE);
        let len = data.len() as u64;
        match offset.checked_add(len) {
            Some(end) if end <= remote.len => {
                w.remote_addr = remote.addr.wrapping_add(offset);
                w.rkey = remote.rkey;
            }
            _ => w.defect = Some(Defect::OutOfRemote { offset, len, size: remote.len }),
        }
        w
    }

    /// Sets the `wr_id` its completion carries.
    #[inline(always)]
    pub fn wr_id(mut self, id: u64) -> InlineWr<'a> {
        self.wr_id = id;
        self
    }

    /// Adds 32 bits of immediate data (a send or WRITE with immediate).
    pub fn imm(mut self, imm: u32) -> InlineWr<'a> {
        self.opcode = if self.opcode == IBV_WR_SEND { IBV_WR_SEND_WITH_IMM } else { IBV_WR_RDMA_WRITE_WITH_IMM };
        self.imm = imm.to_be();
        self
    }

    /// Asks for no completion on success, as [`SendWr::unsignaled`](crate::verbs::lane::SendWr::unsignaled) does: the next signaled
    /// completion of the queue retires its slot.
    #[inline(always)]
    pub fn unsignaled(mut self) -> InlineWr<'a> {
        self.signaled = false;
        self
    }

    /// Sets the solicited-event bit.
    pub fn solicited(mut self) -> InlineWr<'a> {
        self.flags |= ffi::ibv_send_flags::IBV_SEND_SOLICITED.0;
        self
    }

    /// Addresses a send to a UD destination registered with [`Lane::add_dest`] (required on a
    /// UD QP, refused on RC).
    #[inline(always)]
    pub fn to(mut self, dest: DestKey) -> InlineWr<'a> {
        self.dest = Some(dest);
        self
    }

    /// Lowers it for `m` into `out` (zeroed) over `sge`: the checks that depend on the QP (its
    /// inline limit, a UD destination and MTU).
    #[inline(always)]
    fn lower(
        &self,
        m: &Member,
        wr_id: u64,
        signaled: bool,
        out: &mut ffi::ibv_send_wr,
        sge: &mut ffi::ibv_sge,
    ) -> Result<()> {
        if let Some(d) = self.defect {
            return Err(d.error("post_inline"));
        }
        let len = self.data.len();
        if len > m.max_inline as usize {
            return Err(too_long_for_inline(len, m.max_inline));
        }
        if m.is_ud() {
            let (IBV_WR_SEND | IBV_WR_SEND_WITH_IMM, Some(d)) = (self.opcode, self.dest) else {
                return Err(ud_needs_dest(self.dest.is_none()));
            };
            let Some(dest) = m.dests.get(d.index as usize).filter(|_| d.qp == m.key) else {
                return Err(Error::InvalidArgument(
                    "post_inline: the DestKey is not this QP's (Lane::add_dest)".into(),
                ));
            };
            if len as u64 > m.mtu as u64 {
                return Err(too_long(len as u64, m.mtu));
            }
            out.wr.ud = ffi::ud_t { ah: dest.ah, remote_qpn: dest.qpn, remote_qkey: dest.qkey };
        } else if self.dest.is_some() {
            return Err(ud_needs_dest(false));
        } else if self.opcode != IBV_WR_SEND && self.opcode != IBV_WR_SEND_WITH_IMM {
            out.wr.rdma = ffi::rdma_t { remote_addr: self.remote_addr, rkey: self.rkey };
        }
        // The provider reads the bytes through the scatter entry during the post (no lkey is
        // checked for inline data).
        *sge = ffi::ibv_sge { addr: self.data.as_ptr() as u64, length: len as u32, lkey: 0 };
        out.wr_id = wr_id;
        out.sg_list = sge;
        out.num_sge = (len != 0) as i32;
        out.opcode = self.opcode;
        out.imm_data_invalidated_rkey_union.imm_data = self.imm;
        out.send_flags = self.flags
            | m.always_flags
            | ffi::ibv_send_flags::IBV_SEND_INLINE.0
            | if signaled { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
        Ok(())
    }
}

impl Lane {
    /// Posts an inline send or WRITE: the provider copies `wr`'s bytes during the call, so
    /// they need no region and may be reused (or freed) as soon as it returns. It takes a slot
    /// of the send queue until its completion (or the next signaled one, when it is
    /// unsignaled) retires it; that completion carries no region.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for more bytes than the QP's inline limit (naming both; ask
    /// for more with [`QpInit::max_inline_data`](crate::QpInit::max_inline_data), or send from a region), a destination or
    /// operation the QP's type does not have, or an unknown `qp`; [`Error::OutOfBounds`] for a
    /// WRITE outside the remote region; [`Error::MessageTooLong`] for a datagram over the
    /// MTU; [`Error::QueueFull`]; [`Error::QpInError`]; [`Error::Call`] when `ibv_post_send`
    /// refuses it (when the provider did not say whether it took it, its slot stays taken
    /// until the flush retires it, and the QP is moved to the error state).
    #[inline(always)]
    pub fn post_inline(&mut self, qp: LaneQp, wr: InlineWr<'_>) -> Result<()> {
        let m = self.member(qp)?;
        let free = m.send.free();
        if free == 0 || m.failed.is_some() {
            return Err(refusal(m, "ibv_post_send"));
        }
        let seq = m.send.tail;
        let mut sge = ffi::ibv_sge { addr: 0, length: 0, lkey: 0 };
        // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of those): all-zero
        // is a valid value.
        let mut raw: ffi::ibv_send_wr = unsafe { mem::zeroed() };
        // The one that takes the last free slot is signaled, so a full queue drains.
        wr.lower(m, tag::encode(qp.place, seq, false), wr.signaled || free == 1, &mut raw, &mut sge)?;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (its owner is in `m`); `raw` is one NULL-terminated work
        // request over `sge`, both alive for the call. It is inline (`IBV_SEND_INLINE`, a send
        // or RDMA WRITE within the QP's `max_inline_data`, checked by `lower`): the provider
        // copies the `len` bytes at `sge.addr`, which `wr.data` borrows for this call, into its
        // queue before it returns, and the device never reads them from there. A WRITE's remote
        // range was checked against the remote region; a UD destination is kept by `m`.
        let ret = unsafe { m.provider_post_send(&mut raw, &mut bad) };
        if ret == 0 {
            m.send.put_none(wr.wr_id);
            m.send.tail = seq.wrapping_add(1);
            return Ok(());
        }
        Err(inline_refused(m, ret, std::ptr::eq(bad, &raw), wr.wr_id))
    }
}

impl Lane {
    /// The most bytes an inline post on `qp` may carry: its `max_inline_data`, as the provider
    /// granted it when the QP was created.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown `qp`.
    pub fn max_inline_data(&mut self, qp: LaneQp) -> Result<u32> {
        Ok(self.member(qp)?.max_inline)
    }
}

/// An inline post the provider refused: nothing to give back; when it did not name the
/// request, it may run, so its slot is taken and the QP moved to the error state (the flush
/// retires it).
#[cold]
#[inline(never)]
fn inline_refused(m: &mut Member, ret: i32, named: bool, wr_id: u64) -> Error {
    if named {
        return Error::call("ibv_post_send", ret, None);
    }
    m.send.put_none(wr_id);
    m.send.commit(1);
    post_list_failed(m, ret, false, "ibv_post_send")
}

#[cold]
fn too_long_for_inline(len: usize, max: u32) -> Error {
    Error::InvalidArgument(format!(
        "post_inline: {len} bytes exceed the QP's inline limit of {max} (max_inline_data as the provider granted it): \
         create the QP with a larger QpInit::max_inline_data (within the device's limit), or send from a MemoryRegion"
    ))
}
