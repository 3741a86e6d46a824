//! [`CmId`]: an owned `rdma_cm_id`, and how a [`VerbsContext`] comes from one.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::Client;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(5);
//! let client = Client::new()?;
//! client.id().set_tos(32)?; // options go on the id before the address is resolved
//! let route = client.resolve_addr(None, "10.77.0.1:7471".parse().unwrap(), t)?.resolve_route(t)?;
//! let id = route.id();
//! println!("{:?} -> {:?} on port {}", id.local_addr(), id.peer_addr(), id.port_num());
//! let ctx = route.context()?; // the device the route goes through, for PDs and lanes
//! println!("device {}", ctx.device_name());
//! # Ok(()) }
//! ```
//!
//! A `CmId` holds a clone of its [`EventChannel`], so the channel cannot be destroyed under it.
//! Dropping a `CmId` calls `rdma_destroy_id`, which waits for the acks of the events reported
//! for the id; this crate acks every event before handing it out (see [`crate::cm::event_channel`]),
//! so that wait is always short.
//!
//! # Why PDs and CQs hold the id
//!
//! The verbs context (`id->verbs`) is opened and owned by librdmacm, which keeps a device open
//! while an id bound to it exists (it counts bound ids per device). A [`VerbsContext`] is
//! therefore an `Arc` of the id it came from: every [`ProtectionDomain`](crate::ProtectionDomain)
//! and [`CompletionQueue`](crate::CompletionQueue) built on the context holds it, so the
//! context outlives them whatever order the user drops things in.
//!
//! # Device contexts without an id
//!
//! librdmacm's own device contexts, without an id: [`VerbsContext::cm_open`] (by device name),
//! [`VerbsContext::cm_for_addr`] (the device a local address is on), and the contexts that
//! [`CmId::context`], [`crate::RouteResolved::context`], [`crate::ConnectRequest::context`] and
//! [`crate::Listener::context`] return.
//!
//! librdmacm opens each device once and gives every id on it the same `ibv_context`
//! (`id->verbs`); `rdma_create_qp` refuses a PD of any other context. So the PDs, CQs and SRQs
//! that the QPs of many connections share must be made on that context, and what keeps it open
//! must not be one of those connections' ids (a context that held the first connection's id
//! kept that id, and its `rdma res` entry, alive until the last CQ went).
//!
//! ## Why the context stays open (rdma-core 44, `librdmacm/cma.c`)
//!
//! - librdmacm keeps a `struct cma_device` per device, whose `verbs` is opened once
//!   (`ucma_init_device`) and reused by every id bound to the device.
//! - The only call that closes it is `remove_cma_dev`, and that returns without closing while
//!   the device's `refcnt` is not zero (it marks the device dead instead). It is called when
//!   the device leaves the system (`sync_devices_list`), or when the last reference of a dead
//!   device goes (`ucma_put_device`, `rdma_free_devices`). No destructor of the library closes
//!   devices.
//! - `rdma_get_devices` adds one to the `refcnt` of every device it lists, and
//!   `rdma_free_devices` takes it away again.
//!
//! So a context listed by `rdma_get_devices` stays open until that list is freed. Every context
//! made here holds such a list (shared by its handles) and frees it when its last handle goes;
//! every PD, CQ and SRQ holds a handle of its context, so the list outlives them. This holds no
//! id at all. The same functions (`rdma_get_devices`, `rdma_free_devices`, `remove_cma_dev`,
//! `ucma_put_device`) are unchanged in the current rdma-core. A context librdmacm no longer
//! lists (its device was removed while an id used it) falls back to being kept by that id
//! ([`CmId::context`]), as every context from an id used to be.
//!
//! ## librdmacm's own PD
//!
//! librdmacm allocates a PD per device for its ids (`id->pd`, made when the first id binds) and
//! deallocates it when the device's `refcnt` falls to zero in `ucma_put_device`, which only an
//! id's destruction calls; `rdma_free_devices` lowers the count without looking at that PD. So
//! when a list outlives the last id of a device, the PD would stay allocated (one `rdma res
//! show pd` entry per device) until the next id there is destroyed. To avoid that, freeing the
//! list is followed by one throw-away id bound to an address of each device it served (port 0,
//! destroyed at once), whose destruction lets librdmacm release the PD if nothing else uses the
//! device. The address is the one the context was found by (an id's local address, or
//! [`VerbsContext::cm_for_addr`]'s), or for [`VerbsContext::cm_open`] an IPv4 address from the
//! device's GID table; without one (an InfiniBand device opened by name only) the PD stays
//! until the device's next id goes.

use std::fmt;
use std::mem;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rdma_sys as ffi;

use crate::cm::event_channel::EventChannel;
use crate::error::{check_ptr, check_rdma, Error, Result};
use crate::verbs::device::VerbsContext;

/// An owned `rdma_cm_id`: on the RC port space (`RDMA_PS_TCP`), or for UD
/// ([`UdClient`](crate::cm::ud_cm::UdClient), [`UdServer`](crate::cm::ud_cm::UdServer)) on `RDMA_PS_UDP`/`RDMA_PS_IPOIB`.
pub struct CmId {
    raw: NonNull<ffi::rdma_cm_id>,
    // Dropped after `raw` is destroyed (Drop::drop runs before fields drop).
    channel: EventChannel,
}

// SAFETY: the id is owned uniquely by this value. The operations reachable through `&CmId`
// from several threads are reads of fields librdmacm fills before the id is shared (`verbs`,
// the addresses) and librdmacm calls that lock the id internally; the state-changing calls are
// made by the typestate that owns the id.
unsafe impl Send for CmId {}
// SAFETY: see the Send impl.
unsafe impl Sync for CmId {}

/// An opaque token naming a [`CmId`], used to match [`CmEvent`](crate::CmEvent)s to ids in an
/// event loop. It is only compared, never dereferenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdHandle(usize);

impl IdHandle {
    pub(crate) fn of(p: *mut ffi::rdma_cm_id) -> IdHandle {
        IdHandle(p as usize)
    }
}

impl CmId {
    /// Whether this id's device speaks iWARP (whose `rdma_connect` may block, and whose
    /// kernel CM moves a connecting QP to RTS itself). False before the id has a device.
    pub(crate) fn is_iwarp(&self) -> bool {
        // SAFETY: the id is valid while `self` lives. Its `verbs` is null until the id is bound
        // to a device (checked), and once set stays valid while the id lives, as does its
        // device; both are read as plain data.
        unsafe {
            let verbs = (*self.as_raw()).verbs;
            !verbs.is_null() && (*(*verbs).device).transport_type == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP
        }
    }

    /// Creates an RC id (`rdma_create_id`, `RDMA_PS_TCP`) on `channel`.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when no RDMA device exists; [`Error::Call`] otherwise.
    pub fn new(channel: &EventChannel) -> Result<CmId> {
        CmId::with_port_space(channel, ffi::rdma_port_space::RDMA_PS_TCP)
    }

    /// Creates an id on port space `ps` (`RDMA_PS_TCP` for RC, `RDMA_PS_UDP` or
    /// `RDMA_PS_IPOIB` for UD).
    pub(crate) fn with_port_space(channel: &EventChannel, ps: ffi::rdma_port_space::Type) -> Result<CmId> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: the channel is open for the call; `raw` is a valid out-pointer.
        let ret = unsafe { ffi::rdma_create_id(channel.raw(), &mut raw, std::ptr::null_mut(), ps) };
        check_rdma(ret, "rdma_create_id")?;
        let raw = NonNull::new(raw).ok_or_else(|| Error::call("rdma_create_id", libc::EIO, None))?;
        Ok(CmId { raw, channel: channel.clone() })
    }

    /// Wraps an id librdmacm created for us (a `CONNECT_REQUEST`'s new id).
    ///
    /// # Safety
    /// `raw` must be a valid id on `channel` that nothing else will destroy.
    pub(crate) unsafe fn from_raw(raw: NonNull<ffi::rdma_cm_id>, channel: EventChannel) -> CmId {
        CmId { raw, channel }
    }

    /// The raw id, for calls this crate does not wrap. It stays owned by `self`.
    pub fn as_raw(&self) -> *mut ffi::rdma_cm_id {
        self.raw.as_ptr()
    }

    /// The token that [`CmEvent::id`](crate::CmEvent::id) carries for events of this id.
    pub fn handle(&self) -> IdHandle {
        IdHandle::of(self.raw.as_ptr())
    }

    /// The channel this id reports events on.
    pub fn channel(&self) -> &EventChannel {
        &self.channel
    }

    /// The bound local address, once bound or resolved.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // librdmacm rewrites the addresses while it processes this id's events (inside
        // rdma_get_cm_event, maybe on another thread reading a shared channel): read them
        // under the channel's lock, which every event read holds.
        let _lock = self.channel.lock();
        // SAFETY: the id is valid; `route.addr` is plain data inside it that librdmacm fills
        // when the id is bound or resolved (all zero before, which maps to None); no event
        // processing writes it meanwhile (the lock).
        unsafe { sockaddr_to_std(&(*self.raw.as_ptr()).route.addr.src_addr_union.src_storage) }
    }

    /// The peer's address, once resolved or connected.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        let _lock = self.channel.lock();
        // SAFETY: as in local_addr.
        unsafe { sockaddr_to_std(&(*self.raw.as_ptr()).route.addr.dst_addr_union.dst_storage) }
    }

    /// The device port this id is bound to (0 before binding to a device).
    pub fn port_num(&self) -> u8 {
        // SAFETY: the id is valid; port_num is plain data.
        unsafe { (*self.raw.as_ptr()).port_num }
    }

    /// Sets the IP type of service (`RDMA_OPTION_ID_TOS`, RFC 2474: DSCP in the upper six
    /// bits, ECN in the lower two). On RoCE it becomes the packets' traffic class, which is
    /// what switches map to priorities (PFC, ECN marking). Set it on a client before resolving
    /// the route, which takes the class then ([`QpAttributes::traffic_class`](crate::QpAttributes::traffic_class)
    /// shows what the connected QP uses).
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_set_option` fails (`EINVAL` on a kernel without it).
    pub fn set_tos(&self, tos: u8) -> Result<()> {
        self.set_option(opt::ID_TOS, &tos, "rdma_set_option(RDMA_OPTION_ID_TOS)")
    }

    /// Allows binding to an address that another id (or one still closing) is bound to
    /// (`RDMA_OPTION_ID_REUSEADDR`, like `SO_REUSEADDR`): what a server that restarts at once
    /// needs. Set it before binding.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_set_option` fails; `EINVAL` after the id is bound.
    pub fn set_reuse_addr(&self, on: bool) -> Result<()> {
        self.set_option(opt::ID_REUSEADDR, &libc::c_int::from(on), "rdma_set_option(RDMA_OPTION_ID_REUSEADDR)")
    }

    /// Restricts an id bound to an IPv6 wildcard address to IPv6 (`RDMA_OPTION_ID_AFONLY`,
    /// like `IPV6_V6ONLY`); off, `[::]` also accepts IPv4 connections. Set it before binding.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_set_option` fails; `EINVAL` after the id is bound.
    pub fn set_afonly(&self, on: bool) -> Result<()> {
        self.set_option(opt::ID_AFONLY, &libc::c_int::from(on), "rdma_set_option(RDMA_OPTION_ID_AFONLY)")
    }

    /// Sets the local ACK timeout of the id's QP (`RDMA_OPTION_ID_ACK_TIMEOUT`): a request that
    /// is not acknowledged within 4.096 µs × 2^`exponent` is sent again, and after
    /// [`ConnParam::retry_count`](crate::ConnParam::retry_count) retries the QP fails with
    /// [`WcStatus::RetryExcErr`](crate::WcStatus::RetryExcErr). So a dead peer is noticed
    /// after about (retry_count + 1) × 4.096 µs × 2^`exponent`; the kernel's default, from the
    /// path's packet lifetime, is often exponent 18–19 (1–2 s per try). Set it before
    /// connecting or accepting: it is applied when the QP moves to RTS.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an exponent over 31 (the field has five bits);
    /// [`Error::Call`] when `rdma_set_option` fails (`ENOPROTOOPT` on kernels before 4.19).
    pub fn set_ack_timeout(&self, exponent: u8) -> Result<()> {
        if exponent > 31 {
            return Err(Error::InvalidArgument(format!(
                "ACK timeout exponent {exponent} is out of range: it is 0..=31 (4.096 µs × 2^exponent; 14 is 67 ms, 19 is 2.1 s)"
            )));
        }
        self.set_option(opt::ID_ACK_TIMEOUT, &exponent, "rdma_set_option(RDMA_OPTION_ID_ACK_TIMEOUT)")
    }

    fn set_option<T: Copy>(&self, name: libc::c_int, value: &T, what: &'static str) -> Result<()> {
        let mut v = *value;
        // SAFETY: id valid; `v` is a live value of the type and size the option expects
        // (librdmacm copies it into the request to the kernel during the call).
        let ret = unsafe {
            ffi::rdma_set_option(self.as_raw(), opt::LEVEL_ID, name, (&mut v as *mut T).cast(), mem::size_of::<T>())
        };
        check_rdma(ret, what)
    }

    /// Tells the connection manager of an asynchronous event of the id's QP (`rdma_notify`):
    /// [`AsyncEventKind::CommEstablished`](crate::verbs::async_event::AsyncEventKind::CommEstablished), when a
    /// message arrived on the QP before the CM's handshake completed (on InfiniBand the CM then
    /// moves the connection to established and reports `ESTABLISHED` at once, instead of
    /// after its RTU arrives or a retry), or
    /// [`AsyncEventKind::PathMigrated`](crate::verbs::async_event::AsyncEventKind::PathMigrated).
    ///
    /// The crate calls this itself for `COMM_EST` on a QP made through the connection
    /// typestates (or adopted by them: `adopt_qp`), whenever the context's
    /// events are read (see [`crate::verbs::async_event`]); call it directly for a QP it does not
    /// know. rxe never reports `COMM_EST`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for any other kind, before any call; [`Error::Call`] when
    /// `rdma_notify` fails: `EISCONN` once the connection is established (nothing to do),
    /// `EINVAL` when the id has no connection (or its transport, iWARP, takes no notice).
    pub fn notify(&self, event: crate::status::AsyncEventKind) -> Result<()> {
        use crate::status::AsyncEventKind as K;
        let raw = match event {
            K::CommEstablished => ffi::ibv_event_type::IBV_EVENT_COMM_EST,
            K::PathMigrated => ffi::ibv_event_type::IBV_EVENT_PATH_MIG,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "rdma_notify takes COMM_EST or PATH_MIG, not {other} (the CM acts on no other event)"
                )))
            }
        };
        // SAFETY: the id is valid for the call; rdma_notify writes one command to the id's
        // channel and touches nothing else of the id.
        check_rdma(unsafe { ffi::rdma_notify(self.as_raw(), raw) }, "rdma_notify")
    }

    pub(crate) fn verbs(&self) -> Option<NonNull<ffi::ibv_context>> {
        // SAFETY: the id is valid; verbs is set by librdmacm once the id is bound to a device.
        NonNull::new(unsafe { (*self.raw.as_ptr()).verbs })
    }

    pub(crate) fn bind(&self, addr: SocketAddr) -> Result<()> {
        let (mut sa, _) = std_to_sockaddr(addr);
        // SAFETY: id valid; `sa` is a properly initialised sockaddr of the right family.
        let ret = unsafe { ffi::rdma_bind_addr(self.as_raw(), (&mut sa as *mut libc::sockaddr_storage).cast()) };
        check_rdma(ret, "rdma_bind_addr").map_err(|e| e.with_addr(addr))
    }

    pub(crate) fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: id valid and bound (the typestate guarantees bind came first).
        check_rdma(unsafe { ffi::rdma_listen(self.as_raw(), backlog) }, "rdma_listen")
    }

    pub(crate) fn resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<()> {
        let (mut d, _) = std_to_sockaddr(dst);
        let mut s = src.map(|s| std_to_sockaddr(s).0);
        let sp = s.as_mut().map_or(std::ptr::null_mut(), |s| (s as *mut libc::sockaddr_storage).cast());
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: id valid; `d` and `s` outlive the call (librdmacm copies them).
        let ret =
            unsafe { ffi::rdma_resolve_addr(self.as_raw(), sp, (&mut d as *mut libc::sockaddr_storage).cast(), ms) };
        check_rdma(ret, "rdma_resolve_addr").map_err(|e| e.with_addr(dst))
    }

    pub(crate) fn resolve_route(&self, timeout: Duration) -> Result<()> {
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: id valid and address-resolved (guaranteed by the typestate).
        check_rdma(unsafe { ffi::rdma_resolve_route(self.as_raw(), ms) }, "rdma_resolve_route")
    }

    pub(crate) fn migrate(&self, channel: &EventChannel) -> Result<()> {
        // SAFETY: id and channel valid; the id's old channel stays alive through our field
        // until we replace it (the caller swaps `self.channel` after success).
        check_rdma(unsafe { ffi::rdma_migrate_id(self.as_raw(), channel.raw()) }, "rdma_migrate_id")
    }

    pub(crate) fn set_channel(&mut self, channel: EventChannel) {
        self.channel = channel;
    }

    /// `rdma_disconnect`, held first while the id's port is down (bounded: see
    /// [`crate::cm::hold`]).
    pub(crate) fn disconnect(&self) -> Result<()> {
        self.hold_while_port_down();
        self.disconnect_now()
    }

    /// The hold of [`CmId::disconnect`] alone.
    pub(crate) fn hold_while_port_down(&self) -> super::hold::Hold {
        super::hold::while_port_down(self.verbs(), self.port_num(), || self.peer_addr())
    }

    /// Whether [`CmId::disconnect`] would be held now (one `ibv_query_port`).
    #[cfg(feature = "tokio")]
    pub(crate) fn port_is_down(&self) -> bool {
        super::hold::is_down(self.verbs(), self.port_num())
    }

    /// `rdma_disconnect` at once, held or not.
    pub(crate) fn disconnect_now(&self) -> Result<()> {
        // SAFETY: id valid; rdma_disconnect is allowed in any connected or connecting state
        // and fails harmlessly (EINVAL) otherwise.
        check_rdma(unsafe { ffi::rdma_disconnect(self.as_raw()) }, "rdma_disconnect")
    }

    /// The verbs context librdmacm opened for this id's device, or `None` before the id is
    /// bound to a device (a listener on `0.0.0.0` never is).
    ///
    /// The context holds no id: it is kept open by librdmacm's device list, so PDs and CQs
    /// made on it may outlive this id and serve other connections on the device (see
    /// [`crate::cm::cm_id`]). Only where librdmacm no longer lists the device (it was removed
    /// while this id used it) does the context hold this id instead (as every context from an id used to).
    pub fn context(self: &Arc<Self>) -> Option<VerbsContext> {
        let raw = self.verbs()?;
        match context_of_raw(raw, self.local_addr().map(|a| a.ip())) {
            Ok(Some(ctx)) => Some(ctx),
            // librdmacm keeps the context open while this id is bound to it: the handle holds
            // the id.
            _ => Some(VerbsContext::kept_by(raw, Arc::clone(self) as Arc<dyn std::any::Any + Send + Sync>)),
        }
    }

    /// The id-free context of this id's device (see [`CmId::context`]), for an id that is not
    /// in an `Arc` (a listener's).
    pub(crate) fn device_context(&self) -> Result<VerbsContext> {
        let raw = self.verbs().ok_or_else(|| no_device("rdma_cm_id.verbs", self.local_addr()))?;
        context_of_raw(raw, self.local_addr().map(|a| a.ip()))?
            .ok_or(Error::NoDevice { op: "rdma_get_devices", addr: self.local_addr() })
    }
}

/// The error for an id that has no device: bound to a wildcard address, it is on none until a
/// connection request arrives (which says nothing about the devices); otherwise none serves it.
fn no_device(op: &'static str, addr: Option<SocketAddr>) -> Error {
    match addr {
        Some(addr) if addr.ip().is_unspecified() => Error::WildcardAddress { op, addr },
        addr => Error::NoDevice { op, addr },
    }
}

/// `rdma_set_option` levels and names of <rdma/rdma_cma.h> (enums the bindings leave out).
mod opt {
    pub const LEVEL_ID: libc::c_int = 0; // RDMA_OPTION_ID
    pub const ID_TOS: libc::c_int = 0;
    pub const ID_REUSEADDR: libc::c_int = 1;
    pub const ID_AFONLY: libc::c_int = 2;
    pub const ID_ACK_TIMEOUT: libc::c_int = 3;
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: `raw` is owned by us and destroyed exactly once, here. Any QP on it was
        // destroyed first (a QueuePair holds an Arc of its CmId), and every event of the id
        // was acked when it was read, so rdma_destroy_id cannot deadlock waiting for acks.
        let ret = unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
        if ret != 0 {
            crate::error::report_leak("rdma_destroy_id", crate::error::errno());
            return;
        }
        // No event of the id can be read any more (reads and queueing happen under the
        // channel's lock, and rdma_destroy_id waited for the acks of every event read): drop
        // the ones queued for it, so a later id at the same address cannot receive them.
        self.channel.purge(self.handle());
    }
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("handle", &self.handle())
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .finish()
    }
}

impl VerbsContext {
    /// The connection-manager id that keeps this context open, if one does: only a context
    /// of a device librdmacm no longer lists ([`CmId::context`]). Contexts of librdmacm's
    /// devices are kept by its device list and have none, as have contexts from
    /// [`VerbsContext::open`].
    pub fn cm_id(&self) -> Option<Arc<CmId>> {
        Arc::clone(self.keeper()).downcast::<CmId>().ok()
    }
}

/// Converts a Rust socket address into a `sockaddr_storage` and its length.
pub(crate) fn std_to_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Reads a `sockaddr_storage` as a Rust socket address (`None` for an unset or non-IP family).
///
/// # Safety
/// `ss` must be an initialised `sockaddr_storage`.
pub(crate) unsafe fn sockaddr_to_std(ss: *const libc::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: caller guarantees `ss` is initialised; the family field decides which layout
    // the storage holds, and sockaddr_storage is large and aligned enough for either.
    unsafe {
        match (*ss).ss_family as i32 {
            libc::AF_INET => {
                let sin = &*ss.cast::<libc::sockaddr_in>();
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                let s6 = &*ss.cast::<libc::sockaddr_in6>();
                let ip = Ipv6Addr::from(s6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    ip,
                    u16::from_be(s6.sin6_port),
                    s6.sin6_flowinfo,
                    s6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// A list from `rdma_get_devices`: while it lives, librdmacm keeps every context in it open.
/// Freed (`rdma_free_devices`) when the last context made from it goes.
pub(crate) struct CmDevices {
    list: NonNull<*mut ffi::ibv_context>,
    len: usize,
    /// An address of each device a context was made for, to let librdmacm release its PD of
    /// the device once the list is freed (see the module docs).
    addrs: Mutex<Vec<IpAddr>>,
}

// SAFETY: the list is an array of pointers that is only read, and freed once, by Drop; the
// contexts it names may be used from any thread.
unsafe impl Send for CmDevices {}
// SAFETY: see the Send impl; &CmDevices only reads the array.
unsafe impl Sync for CmDevices {}

impl CmDevices {
    /// The live list that holds `wanted`, or a fresh one. One list is cached (weakly), so that
    /// a server taking a context per request does not scan the devices each time.
    fn holding(wanted: impl Fn(*mut ffi::ibv_context) -> bool) -> Result<Arc<CmDevices>> {
        static LAST: Mutex<Weak<CmDevices>> = Mutex::new(Weak::new());
        let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = last.upgrade() {
            if l.contexts().iter().any(|&c| wanted(c)) {
                return Ok(l);
            }
        }
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed by CmDevices' Drop.
        let list = check_ptr(unsafe { ffi::rdma_get_devices(&mut n) }, "rdma_get_devices")?;
        let l = Arc::new(CmDevices { list, len: n.max(0) as usize, addrs: Mutex::new(Vec::new()) });
        *last = Arc::downgrade(&l);
        Ok(l)
    }

    /// Remembers `addr` as an address of one of the list's devices (see the module docs).
    fn note(&self, addr: Option<IpAddr>) {
        let Some(a) = addr.filter(|a| !a.is_unspecified()) else { return };
        let mut addrs = self.addrs.lock().unwrap_or_else(|e| e.into_inner());
        if !addrs.contains(&a) && addrs.len() < 16 {
            addrs.push(a);
        }
    }

    fn contexts(&self) -> &[*mut ffi::ibv_context] {
        // SAFETY: rdma_get_devices returned `len` valid context pointers (and a NULL after
        // them), which stay valid until rdma_free_devices.
        unsafe { std::slice::from_raw_parts(self.list.as_ptr(), self.len) }
    }
}

impl Drop for CmDevices {
    fn drop(&mut self) {
        // SAFETY: the list came from rdma_get_devices and is freed once, here. Every object
        // made on its contexts holds a VerbsContext, which holds this value, so none is alive.
        unsafe { ffi::rdma_free_devices(self.list.as_ptr()) };
        // librdmacm releases its own PD of a device only when an id's destruction brings the
        // device's count to zero: give it one such destruction per device served.
        for &a in self.addrs.get_mut().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = cycle_id(a);
        }
    }
}

/// Creates an id, binds it to `addr` (port 0) and destroys it: librdmacm takes a reference of
/// the address's device and gives it back, releasing its PD of the device if that was the last.
fn cycle_id(addr: IpAddr) -> Result<()> {
    let id = CmId::new(&EventChannel::new()?)?;
    id.bind(SocketAddr::new(addr, 0))
}

/// librdmacm's context `raw`, kept open by a device list (not by an id); `None` when
/// librdmacm no longer lists it.
/// `addr` is the local address the context was found by (an id's), if any.
pub(crate) fn context_of_raw(raw: NonNull<ffi::ibv_context>, addr: Option<IpAddr>) -> Result<Option<VerbsContext>> {
    let list = CmDevices::holding(|c| c == raw.as_ptr())?;
    if !list.contexts().contains(&raw.as_ptr()) {
        return Ok(None);
    }
    list.note(addr);
    Ok(Some(VerbsContext::kept_by(raw, list)))
}

impl VerbsContext {
    /// librdmacm's context of the RDMA device named `name` (`rdma_get_devices`): the one it
    /// gives every connection-manager id on that device, so PDs, CQs and SRQs made on it serve
    /// the QPs of any connection there. It holds no id (see [`crate::cm::cm_id`]).
    /// [`VerbsContext::open`] opens a context of its own instead, which `rdma_create_qp`
    /// refuses.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when librdmacm has no device of that name (the message lists
    /// the ones it has); [`Error::NoDevice`] or [`Error::Call`] when `rdma_get_devices` fails
    /// (`/dev/infiniband/rdma_cm` missing: `modprobe rdma_ucm`).
    pub fn cm_open(name: &str) -> Result<VerbsContext> {
        let named = |c: *mut ffi::ibv_context| {
            // SAFETY: `c` is an open context of a live list; its device is set for its life.
            crate::verbs::device::device_name(unsafe { (*c).device }) == name
        };
        let list = CmDevices::holding(named)?;
        let Some(&raw) = list.contexts().iter().find(|&&c| named(c)) else {
            let names: Vec<String> =
                // SAFETY: as in `named`.
                list.contexts().iter().map(|&c| crate::verbs::device::device_name(unsafe { (*c).device })).collect();
            return Err(Error::InvalidArgument(format!(
                "librdmacm has no RDMA device named {name:?}; it has {}",
                if names.is_empty() { "none (see `rdma link`)".into() } else { names.join(", ") }
            )));
        };
        let raw = NonNull::new(raw).ok_or_else(|| Error::call("rdma_get_devices", libc::EIO, None))?;
        let ctx = VerbsContext::kept_by(raw, Arc::clone(&list) as Arc<dyn std::any::Any + Send + Sync>);
        list.note(ipv4_of_device(&ctx));
        Ok(ctx)
    }

    /// librdmacm's context of the device that the local address `addr` is on: binds a
    /// throw-away id to it (port 0) to ask librdmacm, then destroys the id. As
    /// [`VerbsContext::cm_open`], it holds no id.
    ///
    /// # Errors
    /// [`Error::Call`] naming `rdma_bind_addr` with `EADDRNOTAVAIL` (no local interface has
    /// the address) or [`Error::NoDevice`] (no RDMA device serves it, e.g. `127.0.0.1`);
    /// [`Error::WildcardAddress`] for `0.0.0.0` or `::`, which is on no device; as for
    /// [`VerbsContext::cm_open`].
    pub fn cm_for_addr(addr: IpAddr) -> Result<VerbsContext> {
        let sa = SocketAddr::new(addr, 0);
        let id = CmId::new(&EventChannel::new()?)?;
        id.bind(sa)?;
        let raw = id.verbs().ok_or_else(|| no_device("rdma_bind_addr", Some(sa)))?;
        context_of_raw(raw, Some(addr))?.ok_or(Error::NoDevice { op: "rdma_get_devices", addr: Some(sa) })
    }
}

/// An IPv4 address of the device, from the IPv4-mapped GIDs of its ports (RoCE), if it has one.
fn ipv4_of_device(ctx: &VerbsContext) -> Option<IpAddr> {
    let ports = ctx.port_count().ok()?;
    (1..=ports).find_map(|p| ctx.gid_table(p).ok()?.iter().find_map(|g| g.gid.ipv4()).map(IpAddr::V4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_round_trip() {
        for s in ["10.77.0.1:7471", "0.0.0.0:0", "[fe80::1]:9", "[::1]:65535"] {
            let a: SocketAddr = s.parse().unwrap();
            let (ss, len) = std_to_sockaddr(a);
            assert!(len > 0);
            // SAFETY: `ss` was just initialised by std_to_sockaddr.
            assert_eq!(unsafe { sockaddr_to_std(&ss) }, Some(a), "{s}");
        }
        // SAFETY: all-zero sockaddr_storage is valid and means "unset".
        let zero: libc::sockaddr_storage = unsafe { mem::zeroed() };
        // SAFETY: `zero` is initialised.
        assert_eq!(unsafe { sockaddr_to_std(&zero) }, None);
    }

    /// An id without a device bound to `0.0.0.0` or `[::]` gets the wildcard's own error, which
    /// says why and what to do; any other address keeps "no RDMA device found" and its hint.
    #[test]
    fn a_wildcard_address_without_a_device_is_named_as_such() {
        for s in ["0.0.0.0:7471", "[::]:0"] {
            let a: SocketAddr = s.parse().unwrap();
            let e = no_device("rdma_cm_id.verbs", Some(a));
            assert!(matches!(e, Error::WildcardAddress { addr, .. } if addr == a), "{e:?}");
            let m = e.to_string();
            for part in ["is a wildcard address", "until a connection request arrives", "bind to the device's address"]
            {
                assert!(m.contains(part), "{m}");
            }
            assert!(m.contains("ConnectRequest::context") && m.contains("VerbsContext::cm_open"), "{m}");
            assert!(!m.contains("rdma_rxe"), "no driver hint for a wildcard: {m}");
            assert_eq!(e.errno(), Some(libc::ENODEV));
        }
        for addr in [Some("10.77.0.1:7471".parse().unwrap()), Some("[fd77::1]:9".parse().unwrap()), None] {
            let e = no_device("rdma_cm_id.verbs", addr);
            assert!(matches!(e, Error::NoDevice { .. }), "{e:?}");
            assert!(e.to_string().contains("no RDMA device found"), "{e}");
        }
    }
}
