//! What a refused post gives back ([`Rejected`], [`RejectedList`]), and the errors that say
//! why: built out of line, so that a post's path makes no call while it holds a region.

use super::{Fault, Member};
use crate::error::Error;
use crate::status::WcStatus;
use crate::verbs::ah::GRH_LEN;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::qp::connect::KnownError;
use rdma_sys as ffi;
use std::fmt;

/// A refused post: the error, and what is given back (the work request's region, for a post
/// the provider did not take; `None` when it may have: the lane then keeps the region until the
/// flush retires it).
pub struct Rejected<T> {
    // Boxed: a post that succeeds then returns one word, and only a refusal allocates.
    inner: Box<(Error, Option<T>)>,
}

impl<T> Rejected<T> {
    #[cold]
    pub(super) fn new(error: Error, returned: T) -> Rejected<T> {
        Rejected { inner: Box::new((error, Some(returned))) }
    }
    #[cold]
    pub(crate) fn with(error: Error, returned: Option<T>) -> Rejected<T> {
        Rejected { inner: Box::new((error, returned)) }
    }
    #[cold]
    pub(super) fn kept(error: Error) -> Rejected<T> {
        Rejected { inner: Box::new((error, None)) }
    }
    /// The error.
    pub fn error(&self) -> &Error {
        &self.inner.0
    }
    /// What was given back (the region, when the work request was not posted).
    pub fn into_inner(self) -> Option<T> {
        self.inner.1
    }
    /// The error and what was given back.
    pub fn into_parts(self) -> (Error, Option<T>) {
        let (e, t) = *self.inner;
        (e, t)
    }
}

impl<T> From<Rejected<T>> for Error {
    fn from(r: Rejected<T>) -> Error {
        r.inner.0
    }
}

impl<T> fmt::Debug for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejected").field("error", &self.inner.0).field("returned", &self.inner.1.is_some()).finish()
    }
}

impl<T> fmt::Display for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner.0, f)
    }
}

impl<T> std::error::Error for Rejected<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.inner.0)
    }
}

/// A refused [`Lane::post_send_iter`](crate::verbs::lane::Lane::post_send_iter): the error, and the regions (with their `wr_id`s) of
/// the work requests it took from the iterator and did not post, in order. Regions the
/// provider may have taken are not among them: the lane keeps those until the flush retires
/// them.
#[derive(Debug)]
pub struct RejectedList {
    pub(super) error: Error,
    pub(super) returned: Vec<(u64, MemoryRegion)>,
}

impl RejectedList {
    /// The error.
    pub fn error(&self) -> &Error {
        &self.error
    }
    /// The error and the regions given back, as (`wr_id`, region).
    pub fn into_parts(self) -> (Error, Vec<(u64, MemoryRegion)>) {
        (self.error, self.returned)
    }
}

impl From<RejectedList> for Error {
    fn from(r: RejectedList) -> Error {
        r.error
    }
}

impl fmt::Display for RejectedList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for RejectedList {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

#[cold]
#[inline(never)]
pub(super) fn one_piece_only(op: &str) -> Error {
    Error::InvalidArgument(format!(
        "{op}: takes receives of one range only; post a scattered receive (RecvWr::scatter) on its own, with \
         Lane::post_recv or Lane::post_srq_recv"
    ))
}

#[cold]
#[inline(never)]
pub(super) fn out_of_remote(offset: u64, len: u64, size: u64) -> Error {
    Error::OutOfBounds { what: "remote region", offset, len, size }
}

#[cold]
#[inline(never)]
pub(super) fn out_of_region(offset: u64, len: u32, size: u64) -> Error {
    Error::OutOfBounds { what: "memory region", offset, len: len as u64, size }
}

#[cold]
#[inline(never)]
pub(super) fn bad_request(op: &str, why: &str) -> Error {
    Error::InvalidArgument(format!("{op}: {why}"))
}

#[cold]
#[inline(never)]
pub(super) fn unaligned_atomic(addr: u64) -> Error {
    Error::InvalidArgument(format!(
        "post_send: an atomic's target {addr:#x} is not 8-byte aligned (the device would fail it)"
    ))
}

#[cold]
pub(super) fn no_room_for_grh(len: u32) -> Error {
    Error::InvalidArgument(format!(
        "post_recv: a UD receive of {len} bytes has no room for the {GRH_LEN}-byte GRH the device writes first"
    ))
}

#[cold]
pub(super) fn too_long(len: u64, mtu: u32) -> Error {
    Error::MessageTooLong { len, mtu }
}

#[cold]
pub(super) fn other_pd() -> Error {
    Error::InvalidArgument("post: the memory region is registered on another protection domain than the QP".into())
}

#[cold]
#[inline(never)]
pub(super) fn needs_local_write() -> Error {
    Error::InvalidArgument(
        "post: the device writes this region (receive, RDMA READ target or atomic result): register it with LOCAL_WRITE"
            .into(),
    )
}

#[cold]
pub(super) fn too_many_pieces(n: usize, max: u32, read: bool) -> Error {
    Error::InvalidArgument(if read {
        format!(
            "post_send: an RDMA READ into {n} pieces exceeds the {max} the device scatters a READ into \
             (max_sge_rd, see `ibv_devinfo -v`): read into fewer pieces, or READ twice"
        )
    } else {
        format!(
            "post_send: a work request of {n} pieces exceeds the QP's limit of {max}: create it with QpInit::max_send_sge"
        )
    })
}

#[cold]
pub(super) fn too_many_recv_pieces(n: u32, max: u32, srq: bool) -> Error {
    Error::InvalidArgument(if srq {
        format!(
            "post_srq_recv: a receive of {n} pieces exceeds the SRQ's limit of {max}: create it with \
             Lane::create_srq_with_sge"
        )
    } else {
        format!(
            "post_recv: a receive of {n} pieces exceeds the QP's limit of {max}: create it with QpInit::max_recv_sge"
        )
    })
}

#[cold]
pub(super) fn ud_needs_dest(missing: bool) -> Error {
    Error::InvalidArgument(if missing {
        "post_send: a UD QP sends datagrams only, each to a destination (SendWr::to, Lane::add_dest)".into()
    } else {
        "post_send: an RC QP takes no destination, and a UD QP no RDMA or atomic".into()
    })
}

/// Why a post is refused before it reaches the provider: a full send queue, or a QP in error.
#[cold]
pub(super) fn refusal(m: &Member, op: &'static str) -> Error {
    match m.failed {
        Some(Fault::Connecting) => super::lifecycle::not_connected(m, op),
        Some(fault) => qp_in_error(m, fault, op),
        None => Error::QueueFull { queue: "send", depth: m.send.depth },
    }
}

#[cold]
pub(super) fn refusal_recv(m: &Member) -> Error {
    if m.recv.depth == 0 && m.owner.lane_qp().srq().is_some() {
        return Error::InvalidArgument(
            "post_recv: this QP takes its receives from a shared receive queue: post them with Lane::post_srq_recv"
                .into(),
        );
    }
    match m.failed {
        Some(Fault::Connecting) | None => Error::QueueFull { queue: "receive", depth: m.recv.depth },
        Some(fault) => qp_in_error(m, fault, "ibv_post_recv"),
    }
}

pub(super) fn qp_in_error(m: &Member, fault: Fault, op: &'static str) -> Error {
    let addr = m.owner.lane_peer();
    let failed = |status: u32| {
        let st = WcStatus::from_raw(status);
        format!("a completion failed with {st}{}", st.hint().map(|h| format!(" ({h})")).unwrap_or_default())
    };
    let cause = match fault {
        Fault::Completion(ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR) => {
            "a completion of it came flushed (the lane moved it there, or the peer disconnected)".to_string()
        }
        Fault::Completion(status) => failed(status),
        Fault::Moved => "the lane moved it there (Lane::set_error, or a post the provider failed)".to_string(),
        Fault::PeerLeft => "the peer disconnected".to_string(),
        Fault::BeforeAttach(k) => {
            let why = match k {
                KnownError::SetError => "it had been moved there (QueuePair::set_error)".to_string(),
                KnownError::Disconnected => "its connection was gone".to_string(),
            };
            format!("it was in the error state before it was attached to the lane: {why}")
        }
        Fault::Silent => format!("it went there with no completion saying why: {SILENT}"),
        Fault::Connecting => "its connection is not established yet".to_string(),
        Fault::ConnectFailed => "its connect or accept failed".to_string(),
        Fault::Async(kind) => format!("the device reported {kind} about it"),
    };
    Error::QpInError { op, addr, cause }
}

/// The usual causes of a QP found in the error state with no completion of its own.
const SILENT: &str = "on RC the usual cause is the peer's RDMA WRITE, READ or atomic naming a wrong rkey or a range \
                      outside the region (the responder's QP fails silently), or a local catastrophic error (see `dmesg`)";

#[cold]
pub(super) fn poll_failed(ret: i32) -> Error {
    Error::call("ibv_poll_cq", if ret == -1 { libc::EIO } else { ret.saturating_neg() }, None)
}

/// What is left to do when the provider refused a single work request: give it back when the
/// provider named it (`named`), or keep it (it may run) and move the QP to the error state.
#[cold]
#[inline(never)]
pub(super) fn post_failed_one(
    m: &mut Member,
    ret: i32,
    named: bool,
    (wr_id, mr): (u64, MemoryRegion),
    send: bool,
) -> std::result::Result<(), Rejected<MemoryRegion>> {
    let op = if send { "ibv_post_send" } else { "ibv_post_recv" };
    if named {
        return Err(Rejected::new(Error::call(op, ret, None), mr));
    }
    let slots = if send { &mut m.send } else { &mut m.recv };
    slots.put(0, mr, wr_id);
    slots.commit(1);
    Err(Rejected::kept(post_list_failed(m, ret, false, op)))
}

/// The error of a post the provider refused; when it did not say how far it got (`known`
/// false), everything staged was kept as posted and the QP is moved to the error state, so the
/// flush retires it.
#[cold]
pub(super) fn post_list_failed(m: &mut Member, ret: i32, known: bool, op: &'static str) -> Error {
    if known {
        return Error::call(op, ret, None);
    }
    let flushed = m.set_error().is_ok();
    Error::Call {
        op,
        addr: None,
        hint: Some(if flushed {
            "the provider failed the post without saying which work requests it took: they are kept until the flush retires them, and the QP was moved to the error state"
        } else {
            "the provider failed the post without saying which work requests it took, and the QP could not be moved to the error state: its regions stay held until the QP is destroyed"
        }),
        source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
    }
}
