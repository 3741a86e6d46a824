//! Devices and their contexts: [`devices`] lists the RDMA devices, [`VerbsContext`] is an open
//! one (`ibv_context`). What the device reports on its own (port changes, QP and CQ errors, SRQ
//! limits) comes from [`VerbsContext::async_events`]: see [`crate::verbs::async_event`].
//!
//! ```no_run
//! use rdma_cm::{devices, VerbsContext};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! for d in devices()? {
//!     let ctx = VerbsContext::open(&d.name)?;
//!     let limits = ctx.limits()?;
//!     println!("{}: {:?}, queues up to {} work requests", d.name, ctx.transport(), limits.max_qp_wr);
//! }
//! # Ok(()) }
//! ```
//!
//! This is the bottom of the verbs layer: protection domains, memory regions, completion
//! queues, shared receive queues and queue pairs are built on a context and know nothing of
//! connection management. A context comes from [`VerbsContext::open`] (by device name, from
//! `ibv_get_device_list`: a context of its own), or is the one librdmacm opened for a device
//! ([`VerbsContext::cm_open`] by name, [`VerbsContext::cm_for_addr`] by local address,
//! [`crate::RouteResolved::context`], [`crate::ConnectRequest::context`],
//! [`crate::Listener::context`]): objects of a QP that librdmacm drives must come from
//! librdmacm's context of the id's device.
//!
//! # What keeps a context open
//!
//! A context opened here is closed (`ibv_close_device`) when its last handle goes; one that
//! librdmacm opened is kept open by a librdmacm device list (`rdma_get_devices`) that its
//! handles share, not by any id (see [`crate::cm::cm_id`]). Either way every PD and CQ holds a
//! `VerbsContext`, so the context outlives them.

use std::any::Any;
use std::ffi::CStr;
use std::fmt;
use std::mem;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{check_ibv, errno, Error, Result};
pub use crate::status::AsyncEventKind;
use crate::verbs::hub::Hub;
pub use crate::verbs::hub::{AsyncElement, AsyncEvent};
use crate::verbs::odp_caps::OdpCaps;

/// An RDMA device found by `ibv_get_device_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Device {
    /// Its name, e.g. `rxe0` or `mlx5_0`.
    pub name: String,
    /// Its node GUID, in host order.
    pub guid: u64,
}

/// The RDMA devices of this machine (`ibv_get_device_list`).
///
/// # Errors
/// [`Error::NoDevice`] when the list cannot be read at all (no RDMA support, or
/// `ib_uverbs` not loaded); an empty list is `Ok`.
pub fn devices() -> Result<Vec<Device>> {
    with_device_list(|list| {
        Ok(list
            .iter()
            .map(|&d| Device {
                name: device_name(d),
                // SAFETY: `d` is a device of the live list.
                guid: u64::from_be(unsafe { ffi::ibv_get_device_guid(d) }),
            })
            .collect())
    })
}

pub(crate) fn device_name(d: *mut ffi::ibv_device) -> String {
    // SAFETY: `d` is a valid device; the name is a NUL-terminated string owned by it.
    let name = unsafe { ffi::ibv_get_device_name(d) };
    if name.is_null() {
        return String::from("?");
    }
    // SAFETY: non-NULL, NUL-terminated, alive while the device is.
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

/// Runs `f` over the device list, freeing the list afterwards.
fn with_device_list<T>(f: impl FnOnce(&[*mut ffi::ibv_device]) -> Result<T>) -> Result<T> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = errno();
        return Err(if e == libc::ENOSYS || e == libc::ENOENT || e == 0 {
            Error::NoDevice { op: "ibv_get_device_list", addr: None }
        } else {
            Error::call("ibv_get_device_list", e, None)
        });
    }
    // SAFETY: the list holds `n` valid device pointers until ibv_free_device_list.
    let devs = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
    let r = f(devs);
    // SAFETY: freed once; contexts opened from it stay valid (libibverbs refcounts devices).
    unsafe { ffi::ibv_free_device_list(list) };
    r
}

/// A context this crate opened with `ibv_open_device`; closed when the last handle goes.
struct Opened(NonNull<ffi::ibv_context>);

// SAFETY: an ibv_context may be used from any thread; this only closes it, once.
unsafe impl Send for Opened {}
// SAFETY: see the Send impl; &Opened gives nothing but the pointer.
unsafe impl Sync for Opened {}

impl Drop for Opened {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device and closed exactly once; every PD and CQ on it
        // holds a VerbsContext, which holds this value, so none is alive.
        let ret = unsafe { ffi::ibv_close_device(self.0.as_ptr()) };
        if ret != 0 {
            crate::error::report_leak("ibv_close_device", errno());
        }
    }
}

/// An open RDMA device context. Cloning is cheap (the handles share what keeps it open).
#[derive(Clone)]
pub struct VerbsContext {
    raw: NonNull<ffi::ibv_context>,
    /// What keeps `raw` open: an `Opened`, librdmacm's device list, or (for a device librdmacm no
    /// longer lists) the connection-manager id it was opened for.
    keep: Arc<dyn Any + Send + Sync>,
    /// Its objects' registry and its asynchronous events (shared by every handle of `raw`).
    hub: Arc<Hub>,
}

// SAFETY: libibverbs' calls on one context are thread-safe, and what `keep` holds is Send + Sync.
unsafe impl Send for VerbsContext {}
// SAFETY: see the Send impl.
unsafe impl Sync for VerbsContext {}

/// Device limits that matter when sizing queues and buffers, and capabilities that decide what
/// memory may be registered (from `ibv_query_device_ex`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct DeviceLimits {
    /// Largest work queue (`max_qp_wr`).
    pub max_qp_wr: u32,
    /// Largest scatter/gather list (`max_sge`).
    pub max_sge: u32,
    /// Largest CQ (`max_cqe`).
    pub max_cqe: u32,
    /// Largest memory region (`max_mr_size`).
    pub max_mr_size: u64,
    /// Most outstanding RDMA READs as responder (`max_qp_rd_atom`).
    pub max_qp_rd_atom: u32,
    /// Most outstanding RDMA READs as initiator (`max_qp_init_rd_atom`).
    pub max_qp_init_rd_atom: u32,
    /// Most shared receive queues (`max_srq`), 0 without SRQ support.
    pub max_srq: u32,
    /// Largest shared receive queue (`max_srq_wr`).
    pub max_srq_wr: u32,
    /// Largest scatter list of a shared receive queue's receive (`max_srq_sge`).
    pub max_srq_sge: u32,
    /// Largest scatter list of an RDMA READ (`max_sge_rd`; 0 when the device does not say).
    pub max_sge_rd: u32,
    /// On-demand paging: whether regions may be registered without pinning their pages, and
    /// which operations may use them (see [`crate::verbs::odp`]).
    pub odp: OdpCaps,
}

/// The transport a device speaks (its verbs device's `transport_type`): what it can do
/// depends on it, whatever the device is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// InfiniBand's transport, over InfiniBand or Ethernet (RoCE: `rxe`, `mlx5`).
    InfiniBand,
    /// iWARP, over TCP (`siw`, `cxgb4`, `irdma` in iWARP mode): no UD, no multicast, no
    /// immediate data, no receiver-not-ready retries; connections go through the port mapper.
    Iwarp,
    /// Another transport (`usNIC`, unspecified), by its `ibv_transport_type` value.
    Other(i32),
}

impl Transport {
    /// Whether sends and RDMA WRITEs may carry immediate data ([`SendWr::imm`]): iWARP has
    /// none (its post is refused with `EINVAL`). Where it is missing, a SEND after the WRITE
    /// serves as its doorbell: on a reliable connection it arrives after the WRITE's data.
    ///
    /// [`SendWr::imm`]: crate::verbs::lane::SendWr::imm
    pub fn has_immediate_data(self) -> bool {
        self == Transport::InfiniBand
    }
}

impl VerbsContext {
    /// Opens the device named `name` (as [`devices`] lists it).
    ///
    /// # Errors
    /// [`Error::NoDevice`] when no device has that name (the message lists the ones there
    /// are); [`Error::Call`] when `ibv_open_device` fails.
    pub fn open(name: &str) -> Result<VerbsContext> {
        with_device_list(|list| {
            let Some(&d) = list.iter().find(|&&d| device_name(d) == name) else {
                let names: Vec<String> = list.iter().map(|&d| device_name(d)).collect();
                return Err(Error::InvalidArgument(format!(
                    "no RDMA device named {name:?}; this machine has {}",
                    if names.is_empty() { "none (see `rdma link`)".into() } else { names.join(", ") }
                )));
            };
            // SAFETY: `d` is a device of the live list; the context is closed by `Opened`.
            let raw = unsafe { ffi::ibv_open_device(d) };
            let raw = NonNull::new(raw).ok_or_else(|| Error::call("ibv_open_device", errno(), None))?;
            Ok(VerbsContext::kept_by(raw, Arc::new(Opened(raw))))
        })
    }

    /// A context kept open by `keep` (e.g. librdmacm's device list).
    pub(crate) fn kept_by(raw: NonNull<ffi::ibv_context>, keep: Arc<dyn Any + Send + Sync>) -> VerbsContext {
        let hub = crate::verbs::hub::hub_for(raw, &keep);
        VerbsContext { raw, keep, hub }
    }

    /// What keeps the context open.
    pub(crate) fn keeper(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.keep
    }

    /// The raw context. It stays owned by what keeps it open; do not close it.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.raw.as_ptr()
    }

    /// Whether two handles name the same open context (objects of one may be used together).
    pub fn same_as(&self, other: &VerbsContext) -> bool {
        self.raw == other.raw
    }

    /// The device name, e.g. `rxe0` or `mlx5_0`.
    pub fn device_name(&self) -> String {
        // SAFETY: the context is open; its device is set for the context's life.
        device_name(unsafe { (*self.raw.as_ptr()).device })
    }

    /// The transport the device speaks (InfiniBand's, also over RoCE, or iWARP's).
    pub fn transport(&self) -> Transport {
        // SAFETY: the context is open; its device is set, and valid, for the context's life,
        // and transport_type is plain data.
        let t = unsafe { (*(*self.raw.as_ptr()).device).transport_type };
        match t {
            ffi::ibv_transport_type::IBV_TRANSPORT_IB => Transport::InfiniBand,
            ffi::ibv_transport_type::IBV_TRANSPORT_IWARP => Transport::Iwarp,
            other => Transport::Other(other),
        }
    }

    /// Queries the device's limits and capabilities.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_query_device_ex` fails.
    pub fn limits(&self) -> Result<DeviceLimits> {
        // SAFETY: ibv_device_attr_ex is plain old data; all-zero is a valid value (and what the
        // extended fields stay when the provider answers only the basic query).
        let mut x: ffi::ibv_device_attr_ex = unsafe { mem::zeroed() };
        // SAFETY: context open; no input (NULL, as the header allows); `x` is a valid
        // out-pointer of the type whose size rdma-sys's inline passes to the provider. A
        // provider without the extended query gets the basic one, into `orig_attr`.
        let ret = unsafe { ffi::ibv_query_device_ex(self.as_raw(), std::ptr::null(), &mut x) };
        check_ibv(ret, "ibv_query_device_ex")?;
        let a = &x.orig_attr;
        Ok(DeviceLimits {
            max_qp_wr: a.max_qp_wr.max(0) as u32,
            max_sge: a.max_sge.max(0) as u32,
            max_cqe: a.max_cqe.max(0) as u32,
            max_mr_size: a.max_mr_size,
            max_qp_rd_atom: a.max_qp_rd_atom.max(0) as u32,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom.max(0) as u32,
            max_srq: a.max_srq.max(0) as u32,
            max_srq_wr: a.max_srq_wr.max(0) as u32,
            max_srq_sge: a.max_srq_sge.max(0) as u32,
            max_sge_rd: a.max_sge_rd.max(0) as u32,
            odp: OdpCaps::from_attr(&x),
        })
    }

    /// What the context's handles share: its objects' registry and its events' log.
    pub(crate) fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }
}

/// The device's async-event descriptor, as `AsRawFd` only: reading it directly takes events
/// that libibverbs then never acknowledges, so destroying the objects they name would block
/// for ever. Use [`VerbsContext::async_events`], whose source has a descriptor of its own.
impl AsRawFd for VerbsContext {
    /// The async-event descriptor (for polling only; see above).
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the context is open while `self` lives; async_fd is plain data.
        unsafe { (*self.raw.as_ptr()).async_fd }
    }
}

impl fmt::Debug for VerbsContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsContext").field("device", &self.device_name()).finish()
    }
}
