//! Work requests: [`SendWr`] (send, RDMA WRITE, RDMA READ, atomics) and [`RecvWr`]. They borrow the
//! region they name; posting them ([`QueuePair::post_send`](crate::QueuePair::post_send))
//! takes a handle of it for as long as the device may use it.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::mr::{MemoryRegion, RemoteRegion};

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SendOp {
    Send,
    Write { addr: u64, rkey: u32 },
    Read { addr: u64, rkey: u32 },
    FetchAdd { addr: u64, rkey: u32, add: u64 },
    CompareSwap { addr: u64, rkey: u32, compare: u64, swap: u64 },
}

impl SendOp {
    /// Whether the device writes the local range (READ targets, atomics' original values).
    pub(crate) fn writes_local(&self) -> bool {
        matches!(self, SendOp::Read { .. } | SendOp::FetchAdd { .. } | SendOp::CompareSwap { .. })
    }

    pub(crate) fn is_atomic(&self) -> bool {
        matches!(self, SendOp::FetchAdd { .. } | SendOp::CompareSwap { .. })
    }
}

/// A send-queue work request: a send, an RDMA WRITE, an RDMA READ, or an atomic.
#[derive(Clone, Debug)]
pub struct SendWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) local: Option<(&'a MemoryRegion, Range<usize>)>,
    pub(crate) inline: Option<&'a [u8]>,
    pub(crate) imm: Option<u32>,
    pub(crate) signaled: bool,
    pub(crate) solicited: bool,
}

impl<'a> SendWr<'a> {
    fn new(op: SendOp, local: Option<(&'a MemoryRegion, Range<usize>)>) -> Self {
        SendWr { wr_id: 0, op, local, inline: None, imm: None, signaled: true, solicited: false }
    }

    /// Sends `mr[range]`.
    pub fn send(mr: &'a MemoryRegion, range: Range<usize>) -> Self {
        Self::new(SendOp::Send, Some((mr, range)))
    }

    /// Sends `data` inline: the provider copies it during the post, so it needs no memory
    /// region and may be any buffer. At most the QP's `max_inline_data` bytes.
    pub fn send_inline(data: &'a [u8]) -> Self {
        SendWr { inline: Some(data), ..Self::new(SendOp::Send, None) }
    }

    /// Writes `mr[range]` to `remote` at `remote_offset` (RDMA WRITE).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the target range leaves the remote region.
    pub fn write(mr: &'a MemoryRegion, range: Range<usize>, remote: &RemoteRegion, remote_offset: u64) -> Result<Self> {
        let len = range.len() as u64;
        let addr = remote.at(remote_offset, len)?;
        Ok(Self::new(SendOp::Write { addr, rkey: remote.rkey }, Some((mr, range))))
    }

    /// Reads `remote` at `remote_offset` into `mr[range]` (RDMA READ). The region needs
    /// [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the source range leaves the remote region.
    pub fn read(mr: &'a MemoryRegion, range: Range<usize>, remote: &RemoteRegion, remote_offset: u64) -> Result<Self> {
        let len = range.len() as u64;
        let addr = remote.at(remote_offset, len)?;
        Ok(Self::new(SendOp::Read { addr, rkey: remote.rkey }, Some((mr, range))))
    }

    /// Atomically adds `add` to the 8-byte integer at `remote_offset` of `remote` and returns
    /// the value it had into `mr[range]` (RDMA fetch-and-add). `range` is 8 bytes of a region
    /// with [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE), held (no slice of
    /// it is handed out) until the completion is reaped; read the original value then, e.g.
    /// with [`MemoryRegion::read_at`]. The peer's region needs
    /// [`AccessFlags::REMOTE_ATOMIC`](crate::AccessFlags::REMOTE_ATOMIC) (otherwise the
    /// completion is [`WcStatus::RemAccessErr`](crate::WcStatus::RemAccessErr)),
    /// and the connection an initiator depth of at least 1 ([`ConnParam`](crate::ConnParam)'s
    /// default). The original value is written in the byte order the device uses: the host's
    /// on Soft-RoCE; compare against a known value on other hardware.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `range` is not 8 bytes
    /// or the target address is not 8-byte aligned (the device would fail the request);
    /// [`Error::OutOfBounds`] when the target leaves the remote
    /// region.
    pub fn fetch_add(
        mr: &'a MemoryRegion,
        range: Range<usize>,
        remote: &RemoteRegion,
        remote_offset: u64,
        add: u64,
    ) -> Result<Self> {
        let addr = atomic_target(&range, remote, remote_offset)?;
        Ok(Self::new(SendOp::FetchAdd { addr, rkey: remote.rkey, add }, Some((mr, range))))
    }

    /// Atomically replaces the 8-byte integer at `remote_offset` of `remote` with `swap` if it
    /// equals `compare`, and returns the value it had into `mr[range]` either way (RDMA
    /// compare-and-swap: the swap happened when the returned value equals `compare`). As for
    /// [`SendWr::fetch_add`] otherwise.
    ///
    /// # Errors
    /// As for [`SendWr::fetch_add`].
    pub fn compare_swap(
        mr: &'a MemoryRegion,
        range: Range<usize>,
        remote: &RemoteRegion,
        remote_offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<Self> {
        let addr = atomic_target(&range, remote, remote_offset)?;
        Ok(Self::new(SendOp::CompareSwap { addr, rkey: remote.rkey, compare, swap }, Some((mr, range))))
    }

    /// Sets the `wr_id` returned in the completion.
    pub fn wr_id(mut self, id: u64) -> Self {
        self.wr_id = id;
        self
    }

    /// Adds 32 bits of immediate data (a send or WRITE with immediate; the WRITE then consumes
    /// a receive at the peer).
    pub fn imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }

    /// Generates no completion on success. The work request (and the region it holds) is
    /// retired by the next signaled completion on this queue.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// Sets the solicited-event bit.
    pub fn solicited(mut self) -> Self {
        self.solicited = true;
        self
    }
}

/// Checks an atomic's local range and remote target; returns the target address.
fn atomic_target(range: &Range<usize>, remote: &RemoteRegion, remote_offset: u64) -> Result<u64> {
    if range.len() != 8 || range.start > range.end {
        return Err(Error::InvalidArgument(format!(
            "an atomic's local range must be 8 bytes (the original value lands there), not {range:?}"
        )));
    }
    let addr = remote.at(remote_offset, 8)?;
    if addr % 8 != 0 {
        return Err(Error::InvalidArgument(format!(
            "atomic target {addr:#x} (offset {remote_offset} of the remote region) is not 8-byte aligned: the device fails such a request with a remote error"
        )));
    }
    Ok(addr)
}

/// A receive-queue work request: receive into `mr[range]`.
#[derive(Clone, Debug)]
pub struct RecvWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) mr: &'a MemoryRegion,
    pub(crate) range: Range<usize>,
}

impl<'a> RecvWr<'a> {
    /// Receives into `mr[range]`. The region needs [`AccessFlags::LOCAL_WRITE`](crate::AccessFlags::LOCAL_WRITE).
    pub fn new(mr: &'a MemoryRegion, range: Range<usize>) -> Self {
        RecvWr { wr_id: 0, mr, range }
    }
    /// Sets the `wr_id` returned in the completion.
    pub fn wr_id(mut self, id: u64) -> Self {
        self.wr_id = id;
        self
    }
}
