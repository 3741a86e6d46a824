//! Multicast on a [`Lane`]: a [`McastEndpoint`] whose QP completes on the lane's CQ is an
//! owner the lane takes over ([`Lane::attach`]), and a membership joined for it hands the lane
//! the group's destination ([`Multicast::join_on`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
//! use rdma_cm::{AccessFlags, MemoryRegion, QpInit};
//! use rdma_cm::cm::multicast::{JoinKind, McastClient, Multicast};
//! use rdma_cm::verbs::ah::GRH_LEN;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let (src, group) = ("10.77.0.1".parse().unwrap(), "239.1.1.1".parse().unwrap());
//! let r = McastClient::new()?.resolve(Some(src), group, t)?;
//! let pd = r.alloc_pd()?;
//! let mut lane = Lane::new(&r.context()?, 64)?;
//! let ep = r.create_qp(&pd, lane.qp_init_from(QpInit::new()))?;
//! let qp = lane.attach(ep)?;
//! // Receives first, so the group's first datagrams have somewhere to land.
//! lane.post_recv(qp, RecvWr::new(MemoryRegion::new(&pd, GRH_LEN + 1024, AccessFlags::LOCAL_WRITE)?))?;
//! let (membership, to_group) = Multicast::join_on(&mut lane, qp, group, JoinKind::FullMember, t)?;
//! lane.post_send(qp, SendWr::send(MemoryRegion::new(&pd, 64, AccessFlags::empty())?, 0..64).to(to_group))?;
//! // ... poll the lane: the send's completion, and the group's datagrams (ours too: loopback) ...
//! drop(membership); // leaves the group (the QP stays in the lane, detached)
//! # Ok(()) }
//! ```
//!
//! The endpoint joins the groups; the lane posts and polls. A membership leaves its group when
//! dropped, before or after the lane lets the endpoint go: the endpoint's drop (when the lane removes the QP, or is dropped) detaches the QP from the
//! groups its memberships still hold, before the QP is destroyed.

use std::any::Any;
use std::net::IpAddr;
use std::time::Duration;

use crate::cm::multicast::{JoinKind, McastEndpoint, Multicast};
use crate::error::{Error, Result};
use crate::verbs::lane::{DestKey, Lane, LaneOwner, LaneQp, Sealed};
use crate::verbs::qp::QueuePair;

impl Sealed for McastEndpoint {}
impl LaneOwner for McastEndpoint {
    fn lane_qp(&self) -> &QueuePair {
        self.qp().qp()
    }
    fn lane_ud_mtu(&self) -> Option<u32> {
        Some(self.qp().mtu())
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Multicast {
    /// Joins `group` ([`McastEndpoint::join_group`]) for the multicast endpoint that `lane`
    /// owns as `qp` ([`Lane::attach`] of a [`McastEndpoint`] whose QP was made with the lane's
    /// CQ), and registers the group's destination with the lane for `qp`'s sends
    /// ([`Lane::add_dest`]): the membership, and the key to send to the group with
    /// ([`SendWr::to`](crate::verbs::lane::SendWr::to)). A full member's QP receives the
    /// group's datagrams on the lane.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `qp` is unknown to `lane` or not a multicast endpoint;
    /// otherwise as for [`McastEndpoint::join_group`] and [`Lane::add_dest`] (the membership is
    /// left again then).
    pub fn join_on(
        lane: &mut Lane,
        qp: LaneQp,
        group: IpAddr,
        kind: JoinKind,
        timeout: Duration,
    ) -> Result<(Multicast, DestKey)> {
        let ep = lane.owner_mut(qp)?.downcast_mut::<McastEndpoint>().ok_or_else(|| {
            Error::InvalidArgument(
                "Multicast::join_on: this LaneQp's QP is not a multicast endpoint's (McastResolved::create_qp)".into(),
            )
        })?;
        let m = ep.join_group(group, kind, timeout)?;
        let key = lane.add_dest(qp, m.dest())?;
        Ok((m, key))
    }
}
