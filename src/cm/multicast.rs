//! Multicast over UD through rdma_cm: join a group ([`McastEndpoint::join`], which returns a
//! [`Multicast`] membership once the `MULTICAST_JOIN` event arrives), send to it with the
//! group's address handle, receive its datagrams, and leave when the membership is dropped.
//!
//! ```text
//!  McastClient::new        (rdma_create_id, RDMA_PS_UDP)
//!   │ resolve               (rdma_resolve_addr to the group: binds the id to a device)
//!  McastResolved  ── alloc_pd, loopback(false)
//!   │ create_qp             (rdma_create_qp, or rdma_create_qp_ex with
//!   │                        IBV_QP_CREATE_BLOCK_SELF_MCAST_LB: a UD QP in RTS)
//!  McastEndpoint  ── Lane::attach: posts and polls  (its UdQp)
//!   │ join(kind)            (rdma_join_multicast_ex → MULTICAST_JOIN: the QP is attached)
//!   ▼
//!  Multicast      ── dest(): the group's UdDest (AH, QPN 0xFFFFFF, the join's QKey)
//!                    drop / leave(): rdma_leave_multicast (detaches the QP)
//! ```
//!
//! This is what rdma-core's `mckey` does; `examples/mckey.rs` is it, flag for flag.
//!
//! On a [`Lane`](crate::verbs::lane::Lane): create the QP with the lane's CQ
//! (`lane.qp_init_from(init)`), attach the endpoint ([`Lane::attach`](crate::verbs::lane::Lane::attach)),
//! and join with [`Multicast::join_on`], which also registers the group's destination with
//! the lane for its sends.
//!
//! The QP comes before the join, so librdmacm attaches it when the `MULTICAST_JOIN` event
//! arrives: joining from an id without a QP does not compile.
//!
//! ```compile_fail
//! # fn f(r: rdma_cm::cm::multicast::McastResolved) -> rdma_cm::Result<()> {
//! let m = r.join(rdma_cm::cm::multicast::JoinKind::FullMember, std::time::Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! # Joins
//!
//! - A [`JoinKind::FullMember`] join attaches the id's QP to the group: it receives what
//!   anyone sends to the group (and, unless loopback is blocked, what it sends itself).
//! - A [`JoinKind::SendOnlyFullMember`] join only sends: librdmacm does not attach the QP, and
//!   on RoCE the kernel sends no IGMP report.
//!
//! The group must be a multicast address (`224.0.0.0/4`, `ff00::/8`): any other is refused
//! before any call, naming it. On RoCE v2 (rxe) the kernel joins IPv4 groups only; an IPv6
//! group fails with errno 524 (`ENOTSUPP`), reported with that cause.
//!
//! A `MULTICAST_ERROR` event in answer to a join (the SA refused it on InfiniBand, or
//! librdmacm could not attach the QP) becomes [`Error::UnexpectedEvent`] naming the group. One
//! that comes later, for a group already joined (an InfiniBand SA re-registration, say),
//! arrives on the id's channel like any event: read it with
//! [`EventChannel::try_get_event_for`]`(ep.id().handle())` (or the channel's event loop).
//!
//! # Loopback
//!
//! By default a member's own sends to the group come back to it (the IP stack loops them
//! back). [`McastResolved::loopback`]`(false)` creates the QP with
//! `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB`, as `mckey -l` does. Not every device offers it: rxe
//! refuses the flag (`EOPNOTSUPP`), and so does `mckey -l` there; the crate reports that as
//! [`Error::Call`] naming the flag, with the hint to filter on [`Datagram::src_qp`](crate::verbs::ud::Datagram::src_qp).
//!
//! # Leaving, and the order of things
//!
//! A [`Multicast`] holds the id (an `Arc` of the [`CmId`]), so the id outlives every
//! membership, and its group's [`AddressHandle`](crate::verbs::ah::AddressHandle) (through its
//! [`UdDest`]; every posted send to the group holds a clone until its completion is reaped).
//! Dropping it calls `rdma_leave_multicast`, which detaches the id's QP (`ibv_detach_mcast`)
//! when there is one, and tells the kernel to leave. That happens under the id's channel lock,
//! which the QP's destruction takes too: the QP is either alive while librdmacm detaches it,
//! or already destroyed and the id's `qp` field cleared. The kernel refuses to destroy a QP
//! that is still attached to a group (`EBUSY`), so a [`McastEndpoint`] dropped before its
//! memberships first detaches its QP from the groups they joined (it shares that list with
//! them). So memberships and the endpoint may be dropped in any order.
//! `rdma_leave_multicast` waits for the acks of the events it reported for the group; the
//! crate acks every event as it reads it, under that same lock, so the wait is short.

use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::cm::cm_id::{std_to_sockaddr, CmId};
use crate::cm::event_channel::{CmEventType, EventChannel};
use crate::cm::expect::{context_of, expect};
use crate::cm::ud_cm::create_ud_qp;
use crate::cm::ud_cm::PortSpace;
use crate::error::{check_rdma, errno, Error, Result};
use crate::verbs::device::VerbsContext;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::QpInit;
use crate::verbs::ud::{UdDest, UdQp};

/// The QP number that addresses a multicast group (`0xFFFFFF`).
pub const MULTICAST_QPN: u32 = 0x00ff_ffff;

/// How to join a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum JoinKind {
    /// Send and receive (`RDMA_MC_JOIN_FLAG_FULLMEMBER`): the id's QP is attached to the group.
    #[default]
    FullMember,
    /// Send only (`RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER`): the QP is not attached, and
    /// receives nothing from the group.
    SendOnlyFullMember,
}

impl JoinKind {
    fn raw(self) -> u32 {
        match self {
            JoinKind::FullMember => ffi::rdma_cm_mc_join_flags::RDMA_MC_JOIN_FLAG_FULLMEMBER.0,
            JoinKind::SendOnlyFullMember => ffi::rdma_cm_mc_join_flags::RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER.0,
        }
    }
}

/// Refuses an address that is not a multicast group, naming it.
pub(crate) fn check_group(group: IpAddr) -> Result<()> {
    if group.is_multicast() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{group} is not a multicast address: a group is in 224.0.0.0/4 (IPv4, e.g. 239.1.1.1) or ff00::/8 (IPv6); \
         a unicast address names one host, which UD reaches through UdClient instead"
    )))
}

fn group_sockaddr(group: IpAddr) -> SocketAddr {
    match group {
        IpAddr::V4(a) => SocketAddr::new(IpAddr::V4(a), 0),
        IpAddr::V6(a) => SocketAddr::V6(SocketAddrV6::new(a, 0, 0, 0)),
    }
}

/// The usual cause of a join failure, by errno.
fn join_hint(group: IpAddr, errno: i32) -> Option<&'static str> {
    Some(match errno {
        // The kernel's ENOTSUPP (not in libc): cma_iboe_join_multicast on an IPv6 group over RoCE v2.
        524 if group.is_ipv6() => {
            "the kernel joins only IPv4 groups over RoCE v2 (rxe and RoCE NICs): use an IPv4 group such as 239.1.1.1"
        }
        libc::EADDRINUSE => "this id has already joined the group",
        libc::ENODEV => "the id is not bound to an RDMA device: resolve the group's address first",
        libc::EINVAL => "the id is not in a state to join: it must be address-resolved",
        _ => return None,
    })
}

/// A fresh multicast id, not yet resolved.
#[derive(Debug)]
pub struct McastClient {
    id: CmId,
}

impl McastClient {
    /// Creates a UD id (`RDMA_PS_UDP`) on its own event channel.
    ///
    /// # Errors
    /// [`Error::NoDevice`] without RDMA support; [`Error::Call`] otherwise.
    pub fn new() -> Result<McastClient> {
        McastClient::on_channel(&EventChannel::new()?, PortSpace::Udp)
    }

    /// Creates a UD id of port space `ps` on `channel`.
    ///
    /// # Errors
    /// As for [`McastClient::new`].
    pub fn on_channel(channel: &EventChannel, ps: PortSpace) -> Result<McastClient> {
        let ps = match ps {
            PortSpace::Udp => ffi::rdma_port_space::RDMA_PS_UDP,
            PortSpace::Ipoib => ffi::rdma_port_space::RDMA_PS_IPOIB,
        };
        Ok(McastClient { id: CmId::with_port_space(channel, ps)? })
    }

    /// Resolves the group's address within `timeout` (`rdma_resolve_addr` with the group as
    /// destination, from `src` when given): this binds the id to the device that reaches the
    /// group. Give `src`, the address of the RDMA netdev, unless a route covers the group
    /// (`ip route get 239.1.1.1`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `group` is not a multicast address, or `src` is of
    /// another family; [`Error::Call`] naming `rdma_resolve_addr` (`ENETUNREACH`: no route for
    /// the group, give `src`); [`Error::Timeout`].
    pub fn resolve(self, src: Option<IpAddr>, group: IpAddr, timeout: Duration) -> Result<McastResolved> {
        check_group(group)?;
        if let Some(s) = src {
            if s.is_ipv4() != group.is_ipv4() {
                return Err(Error::InvalidArgument(format!(
                    "the source address {s} and the group {group} are of different families"
                )));
            }
        }
        let dst = group_sockaddr(group);
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.id.resolve_addr(src.map(|s| SocketAddr::new(s, 0)), dst, timeout).map_err(resolve_hint)?;
        let wait = timeout.saturating_add(Duration::from_secs(1));
        expect(&self.id, CmEventType::AddrResolved, "rdma_resolve_addr", wait)
            .map_err(|e| resolve_hint(e.with_addr(dst)))?;
        Ok(McastResolved { id: Arc::new(self.id), group, block_loopback: false })
    }

    /// The id, for options to set first ([`CmId::set_tos`], ...).
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

fn resolve_hint(mut e: Error) -> Error {
    if let Error::Call { hint, source, .. } = &mut e {
        if source.raw_os_error() == Some(libc::ENETUNREACH) {
            *hint = Some(
                "no route covers the multicast group: give the RDMA netdev's address as the source (mckey -b), or add \
                 one (`ip route add 224.0.0.0/4 dev DEV`)",
            );
        }
    }
    e
}

/// A multicast id bound to a device: allocate the PD, then create the QP.
#[derive(Debug)]
pub struct McastResolved {
    id: Arc<CmId>,
    group: IpAddr,
    block_loopback: bool,
}

impl McastResolved {
    /// The device context.
    ///
    /// # Errors
    /// [`Error::NoDevice`] if the id has no device (cannot happen once resolved).
    pub fn context(&self) -> Result<VerbsContext> {
        context_of(&self.id)
    }

    /// Allocates a PD on the id's device.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_alloc_pd` fails.
    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>> {
        ProtectionDomain::new(&self.context()?)
    }

    /// The active MTU of the id's port: the largest datagram.
    ///
    /// # Errors
    /// As for [`VerbsContext::port`].
    pub fn mtu(&self) -> Result<u32> {
        Ok(self.context()?.port(self.id.port_num())?.active_mtu)
    }

    /// Whether the QP receives its own multicast sends (the default, `true`). `false` creates
    /// it with `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB` (`mckey -l`), which
    /// [`McastResolved::create_qp`] reports clearly where the device lacks it (rxe).
    pub fn loopback(mut self, on: bool) -> Self {
        self.block_loopback = !on;
        self
    }

    /// Creates the UD QP (in RTS at once, with the port space's QKey). Post receives before
    /// joining, so the group's first datagrams have somewhere to land.
    ///
    /// # Errors
    /// [`Error::Call`] naming `rdma_create_qp_ex(IBV_QP_CREATE_BLOCK_SELF_MCAST_LB)` when
    /// loopback is off and the device cannot block it (`EOPNOTSUPP` on rxe); otherwise as for
    /// [`UdRoute::create_qp`](crate::cm::ud_cm::UdRoute::create_qp).
    pub fn create_qp(self, pd: &Arc<ProtectionDomain>, mut init: QpInit) -> Result<McastEndpoint> {
        init.block_self_mcast_lb = self.block_loopback;
        let qp = create_ud_qp(&self.id, pd, init)?;
        Ok(McastEndpoint {
            qp,
            id: self.id,
            group: self.group,
            loopback: !self.block_loopback,
            attached: Arc::default(),
            joined: Arc::default(),
        })
    }

    /// The group resolved.
    pub fn group(&self) -> IpAddr {
        self.group
    }

    /// The id.
    pub fn id(&self) -> &CmId {
        &self.id
    }
}

/// A UD endpoint for multicast: its QP and its id, bound to a device. Join groups with
/// [`McastEndpoint::join`].
#[derive(Debug)]
pub struct McastEndpoint {
    // Dropped first (after Drop::drop detached it from its groups): the QP holds its own Arc
    // of the id.
    qp: UdQp,
    id: Arc<CmId>,
    group: IpAddr,
    loopback: bool,
    attached: Attached,
    joined: Joined,
}

/// The groups the id holds a membership of (joined and not yet left), shared with the
/// memberships: librdmacm accepts a second join of a group on one id, but its leave then
/// detaches the QP for both memberships, so the second join is refused instead.
type Joined = Arc<Mutex<Vec<IpAddr>>>;

/// The groups the endpoint's QP is attached to (full-member joins not yet left), shared with
/// their memberships: the kernel refuses to destroy a QP that is still attached (`EBUSY`), so
/// the endpoint detaches it from these before it goes.
type Attached = Arc<Mutex<Vec<Attachment>>>;

/// One attachment: the group's GID and LID, as librdmacm attached them (from the JOIN event).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Attachment {
    mgid: [u8; 16],
    mlid: u16,
}

impl Drop for McastEndpoint {
    fn drop(&mut self) {
        // Under the channel lock, which every leave takes too: a leave either ran before (and
        // took its attachment out of the list) or runs after this, when librdmacm's
        // ibv_detach_mcast of the still-live QP finds nothing to detach, harmlessly.
        let _lock = self.id.channel().lock();
        let list = std::mem::take(&mut *self.attached.lock().unwrap_or_else(|e| e.into_inner()));
        for a in list {
            let gid = ffi::ibv_gid { raw: a.mgid };
            // SAFETY: the QP is alive (it drops after this) and attached to the group; `gid`
            // lives through the call, which reads it.
            let ret = unsafe { ffi::ibv_detach_mcast(self.qp.as_raw(), &gid, a.mlid) };
            if ret != 0 {
                crate::error::report_leak("ibv_detach_mcast", ret);
            }
        }
    }
}

/// Tokens that tell a join's events from another's on the same id (the join's context).
static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(1);

impl McastEndpoint {
    /// The UD QP.
    pub fn qp(&self) -> &UdQp {
        &self.qp
    }

    /// The UD QP, for posting and polling.
    pub fn qp_mut(&mut self) -> &mut UdQp {
        &mut self.qp
    }

    /// The id.
    pub fn id(&self) -> &Arc<CmId> {
        &self.id
    }

    /// The group the id was resolved to.
    pub fn group(&self) -> IpAddr {
        self.group
    }

    /// Whether the QP receives its own sends to a group ([`McastResolved::loopback`]).
    pub fn loopback(&self) -> bool {
        self.loopback
    }

    /// Joins the group the id was resolved to; see [`McastEndpoint::join_group`].
    ///
    /// # Errors
    /// As for [`McastEndpoint::join_group`].
    pub fn join(&mut self, kind: JoinKind, timeout: Duration) -> Result<Multicast> {
        self.join_group(self.group, kind, timeout)
    }

    /// Joins `group` (`rdma_join_multicast_ex`) and waits up to `timeout` for the
    /// `MULTICAST_JOIN` event; by then librdmacm has attached the QP (for a full member).
    /// Returns the membership, with the group's destination made on the QP's PD from the
    /// event's `ud` parameters.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `group` is not a multicast address or not of the id's
    /// family; [`Error::Call`] naming `rdma_join_multicast_ex` with the group when the kernel
    /// refuses (errno 524 for an IPv6 group over RoCE v2); [`Error::UnexpectedEvent`] naming
    /// `MULTICAST_ERROR` and the group when the join fails later (status -1 when librdmacm could
    /// not attach the QP, past the device's `max_mcast_qp_attach` say);
    /// [`Error::Timeout`] (the join is then cancelled); [`Error::Call`] when the address
    /// handle cannot be made.
    pub fn join_group(&mut self, group: IpAddr, kind: JoinKind, timeout: Duration) -> Result<Multicast> {
        check_group(group)?;
        if lock_joined(&self.joined).contains(&group) {
            return Err(Error::InvalidArgument(format!(
                "this endpoint already holds a membership of {group}: keep using it (Multicast::dest), \
                 or drop it before joining again (one leave would end both)"
            )));
        }
        if group.is_ipv4() != self.group.is_ipv4() {
            return Err(Error::InvalidArgument(format!(
                "the group {group} is not of the family of the id's address ({}): resolve an id for it",
                self.group
            )));
        }
        let addr = group_sockaddr(group);
        let (ss, _) = std_to_sockaddr(addr);
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        let mut sockaddr = ss;
        let _expecting = self.id.channel().expecting(self.id.handle());
        let mut attr = ffi::rdma_cm_join_mc_attr_ex {
            comp_mask: (ffi::rdma_cm_join_mc_attr_mask::RDMA_CM_JOIN_MC_ATTR_ADDRESS
                | ffi::rdma_cm_join_mc_attr_mask::RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS)
                .0,
            join_flags: kind.raw(),
            addr: (&mut sockaddr as *mut libc::sockaddr_storage).cast(),
        };
        // SAFETY: the id is valid and address-resolved (the typestate); `attr` and the address
        // it points to live through the call, which copies the address; the context is a
        // token librdmacm stores and hands back in the events, never dereferenced.
        let ret = unsafe { ffi::rdma_join_multicast_ex(self.id.as_raw(), &mut attr, token as *mut libc::c_void) };
        if ret != 0 {
            let e = errno();
            return Err(Error::Call {
                op: "rdma_join_multicast_ex",
                addr: Some(addr),
                hint: join_hint(group, e),
                source: std::io::Error::from_raw_os_error(e),
            });
        }
        // From here on the membership leaves the group when dropped, on every error path too.
        lock_joined(&self.joined).push(group);
        let mut membership = Membership {
            id: Arc::clone(&self.id),
            group,
            sockaddr: ss,
            attached: None,
            joined: Arc::clone(&self.joined),
        };
        let end = Instant::now().checked_add(timeout);
        loop {
            let left = end.map_or(timeout, |end| end.saturating_duration_since(Instant::now()));
            let ev =
                match self.id.channel().get_event_for(self.id.handle(), left) {
                    Ok(ev) => ev,
                    Err(Error::Timeout { .. }) => return Err(Error::Timeout {
                        op: "rdma_join_multicast_ex",
                        timeout,
                        addr: Some(addr),
                        hint: Some(
                            "no MULTICAST_JOIN event: on InfiniBand the subnet manager did not answer; on RoCE check \
                             `rdma link` (port ACTIVE?)",
                        ),
                    }),
                    Err(e) => return Err(e),
                };
            let multicast = matches!(ev.event_type(), CmEventType::MulticastJoin | CmEventType::MulticastError);
            if multicast && ev.mc_context() != token {
                // An event of another membership of this id (an earlier join that timed out
                // and was left): not ours.
                continue;
            }
            if ev.event_type() == CmEventType::MulticastJoin {
                let Some(ud) = ev.ud() else {
                    return Err(ev.unexpected("rdma_join_multicast_ex: no ud parameters", CmEventType::MulticastJoin));
                };
                if kind == JoinKind::FullMember {
                    // librdmacm attached the QP while it processed the event: record it.
                    let attr = ud.ah_attr();
                    let a = Attachment { mgid: attr.dgid().0, mlid: attr.dlid() };
                    self.attached.lock().unwrap_or_else(|e| e.into_inner()).push(a);
                    membership.attached = Some((Arc::clone(&self.attached), a));
                }
                let dest = UdDest::from_ud_param(self.qp.pd(), ud)?;
                return Ok(Multicast { dest, kind, membership });
            }
            let mut e = ev.unexpected("rdma_join_multicast_ex", CmEventType::MulticastJoin).with_addr(addr);
            if let Error::UnexpectedEvent { hint, got: CmEventType::MulticastError, .. } = &mut e {
                *hint = Some(
                    "the subnet manager refused the join (InfiniBand), or librdmacm could not attach the QP to the group: \
                     ibv_attach_mcast failed, which librdmacm reports as status -1 (shown as EPERM), e.g. past the \
                     device's max_mcast_qp_attach (56 QPs per group on rxe; `ibv_devinfo -v`)",
                );
            }
            return Err(e);
        }
    }
}

/// A multicast membership: the group's destination for sends, and the leave on drop.
///
/// Sends to the group go to [`Multicast::dest`], registered with the endpoint's lane
/// ([`Multicast::join_on`] does both). Dropping it leaves the group (`rdma_leave_multicast`); [`Multicast::leave`]
/// does so and returns the error, if any.
#[derive(Debug)]
pub struct Multicast {
    /// The group's address handle, QPN and QKey.
    dest: UdDest,
    kind: JoinKind,
    membership: Membership,
}

impl Multicast {
    /// Where sends to the group go: the group's address handle, QPN `0xFFFFFF` and the join's
    /// QKey.
    pub fn dest(&self) -> &UdDest {
        &self.dest
    }

    /// The group.
    pub fn group(&self) -> IpAddr {
        self.membership.group
    }

    /// How it was joined.
    pub fn kind(&self) -> JoinKind {
        self.kind
    }

    /// The QKey datagrams to the group carry (from the `MULTICAST_JOIN` event).
    pub fn qkey(&self) -> u32 {
        self.dest.qkey()
    }

    /// The group's GID, from the `MULTICAST_JOIN` event (`::ffff:239.1.1.1` for the IPv4
    /// group 239.1.1.1 on RoCE v2).
    pub fn mgid(&self) -> crate::verbs::port::Gid {
        self.dest.ah().attr().dgid()
    }

    /// Leaves the group now (`rdma_leave_multicast`), returning any error. Sends posted to
    /// the group still hold its address handle until their completions are reaped.
    ///
    /// # Errors
    /// [`Error::Call`] naming `rdma_leave_multicast` and the group.
    pub fn leave(self) -> Result<()> {
        let mut m = self.membership;
        m.leave()
    }
}

/// The joined state of one group on one id: leaves it when dropped.
#[derive(Debug)]
struct Membership {
    // Held until after the leave (Drop::drop runs before fields drop).
    id: Arc<CmId>,
    group: IpAddr,
    // The address exactly as joined: librdmacm finds the membership by comparing its bytes.
    sockaddr: libc::sockaddr_storage,
    // Where the QP's attachment to the group is recorded (full members).
    attached: Option<(Attached, Attachment)>,
    // The endpoint's list of groups joined, which this membership leaves when it leaves.
    joined: Joined,
}

fn lock_joined(j: &Joined) -> std::sync::MutexGuard<'_, Vec<IpAddr>> {
    j.lock().unwrap_or_else(|e| e.into_inner())
}

impl Membership {
    fn leave(&mut self) -> Result<()> {
        if self.sockaddr.ss_family == 0 {
            return Ok(());
        }
        let mut ss = self.sockaddr;
        self.sockaddr.ss_family = 0; // left (or failed to): nothing more to do in Drop
        {
            let mut joined = lock_joined(&self.joined);
            if let Some(i) = joined.iter().position(|g| *g == self.group) {
                joined.swap_remove(i);
            }
        }
        let ret = {
            // Serialises with the QP's destruction (which clears id->qp under this lock) and
            // with event processing (which reads id->qp on a JOIN).
            let _lock = self.id.channel().lock();
            if let Some((list, a)) = &self.attached {
                let mut list = list.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(i) = list.iter().position(|x| x == a) {
                    list.swap_remove(i);
                }
            }
            // SAFETY: id valid (held); id->qp is the live QP or NULL (the lock); `ss` is the
            // joined address, alive through the call; the group's events, which librdmacm waits
            // to be acked, were all acked when read, under the lock held here.
            unsafe { ffi::rdma_leave_multicast(self.id.as_raw(), (&mut ss as *mut libc::sockaddr_storage).cast()) }
        };
        check_rdma(ret, "rdma_leave_multicast").map_err(|e| e.with_addr(group_sockaddr(self.group)))
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Err(e) = self.leave() {
            crate::error::report_leak("rdma_leave_multicast", e.errno().unwrap_or(libc::EIO));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unicast_groups_are_refused_by_name() {
        for a in ["10.77.0.1", "127.0.0.1", "fd77::1", "0.0.0.0"] {
            let e = check_group(a.parse().unwrap()).unwrap_err().to_string();
            assert!(e.contains(a) && e.contains("not a multicast address"), "{e}");
        }
        for a in ["239.1.1.1", "224.0.0.1", "ff0e::1:2"] {
            check_group(a.parse().unwrap()).unwrap();
        }
    }

    #[test]
    fn join_flags_match_librdmacm() {
        assert_eq!(JoinKind::FullMember.raw(), 0);
        assert_eq!(JoinKind::SendOnlyFullMember.raw(), 1);
    }
}
