//! The spelling from before a CM id adopted verbs-wing QPs: [`UserQp`], a QP created in RESET
//! for [`RouteResolved::attach_qp`](crate::RouteResolved::attach_qp) or
//! [`ConnectRequest::attach_qp`](crate::ConnectRequest::attach_qp). It is now a thin,
//! deprecated wrapper of an [`UnconnectedQp`] made by
//! [`UnconnectedQp::new_reset`], and `attach_qp` is `adopt_qp`; see [`crate::cm::adopt`].
//!
//! It hands out no mutable QP, so nothing is posted to it before it is attached:
//!
//! ```compile_fail,E0599
//! # #![allow(deprecated)]
//! # fn f(mut q: rdma_cm::UserQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
//! q.qp_mut().post_recv(&[rdma_cm::RecvWr::new(&mr, 0..8)])?;
//! # Ok(()) }
//! ```
#![allow(deprecated)]

use std::sync::Arc;

use crate::error::Result;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::{QpInit, QueuePair, UnconnectedQp};

/// A queue pair the user creates on a protection domain, in the RESET state, for a connection
/// to drive by hand (`rping -q`'s way). Deprecated: it is an [`UnconnectedQp`] made by
/// [`UnconnectedQp::new_reset`], which [`RouteResolved::adopt_qp`](crate::RouteResolved::adopt_qp)
/// and [`ConnectRequest::adopt_qp`](crate::ConnectRequest::adopt_qp) take (as they take one in
/// INIT from [`UnconnectedQp::new`]).
///
/// The PD must be on the id's device context (allocate it from the route or request, or from
/// one of them earlier: contexts librdmacm opens are one per device).
#[deprecated(
    since = "0.1.0",
    note = "a CM id adopts a verbs QP now: UnconnectedQp::new_reset(pd, init) and RouteResolved::adopt_qp / ConnectRequest::adopt_qp"
)]
#[derive(Debug)]
pub struct UserQp(UnconnectedQp);

impl UserQp {
    /// Creates an RC QP on `pd` with `init`'s capabilities (`ibv_create_qp`), in the RESET
    /// state; its CQs are made on the PD's context unless `init` names them. Deprecated:
    /// [`UnconnectedQp::new_reset`].
    ///
    /// # Errors
    /// As for [`UnconnectedQp::new_reset`].
    pub fn new(pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<UserQp> {
        UnconnectedQp::new_reset(pd, init).map(UserQp)
    }

    /// The QP (its number, capabilities and state).
    pub fn qp(&self) -> &QueuePair {
        self.0.qp()
    }

    /// The QP number, which the connection sends in its parameters.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num()
    }

    /// The [`UnconnectedQp`] it wraps, for `adopt_qp`.
    pub fn into_unconnected(self) -> UnconnectedQp {
        self.0
    }
}

impl From<UserQp> for UnconnectedQp {
    fn from(q: UserQp) -> UnconnectedQp {
        q.0
    }
}
