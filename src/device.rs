//! Devices and their contexts: [`devices`] lists the RDMA devices, [`VerbsContext`] is an open
//! one (`ibv_context`), and [`AsyncEvent`] is what the device reports on its own (port changes,
//! QP and CQ errors, SRQ limits).
//!
//! This is the bottom of the verbs layer: protection domains, memory regions, completion
//! queues, shared receive queues and queue pairs are built on a context and know nothing of
//! connection management. A context comes from [`VerbsContext::open`] (by device name, from
//! `ibv_get_device_list`), or from a connection-manager id whose device librdmacm opened
//! ([`crate::RouteResolved::context`], [`crate::ConnectRequest::context`]): objects of a QP
//! that librdmacm drives must come from the id's context.
//!
//! # What keeps a context open
//!
//! A context opened here is closed (`ibv_close_device`) when its last handle goes; one that
//! librdmacm opened is kept open by librdmacm while a bound id exists, so that handle holds the
//! id. Either way every PD and CQ holds a `VerbsContext`, so the context outlives them.

use std::any::Any;
use std::ffi::CStr;
use std::fmt;
use std::mem;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{check_ibv, errno, Error, Result};
use crate::wait::{poll_readable, pollfd, Deadline};

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

fn device_name(d: *mut ffi::ibv_device) -> String {
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
            crate::report_leak("ibv_close_device", errno());
        }
    }
}

/// An open RDMA device context. Cloning is cheap (the handles share what keeps it open).
#[derive(Clone)]
pub struct VerbsContext {
    raw: NonNull<ffi::ibv_context>,
    /// What keeps `raw` open: an `Opened`, or the connection-manager id librdmacm opened it for.
    keep: Arc<dyn Any + Send + Sync>,
    /// Whether the async-event descriptor was made non-blocking.
    async_nonblocking: Arc<AtomicBool>,
}

// SAFETY: libibverbs' calls on one context are thread-safe, and what `keep` holds is Send + Sync.
unsafe impl Send for VerbsContext {}
// SAFETY: see the Send impl.
unsafe impl Sync for VerbsContext {}

/// Device limits that matter when sizing queues and buffers (from `ibv_query_device`).
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

    /// A context kept open by `keep` (e.g. the id librdmacm opened it for).
    pub(crate) fn kept_by(raw: NonNull<ffi::ibv_context>, keep: Arc<dyn Any + Send + Sync>) -> VerbsContext {
        VerbsContext { raw, keep, async_nonblocking: Arc::new(AtomicBool::new(false)) }
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

    /// Queries the device's limits.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_query_device` fails.
    pub fn limits(&self) -> Result<DeviceLimits> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut a: ffi::ibv_device_attr = unsafe { mem::zeroed() };
        // SAFETY: context open; `a` is a valid out-pointer of the right type.
        check_ibv(unsafe { ffi::ibv_query_device(self.as_raw(), &mut a) }, "ibv_query_device")?;
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
        })
    }

    /// Returns the device's next asynchronous event without waiting, acked already.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails with anything but `EAGAIN`.
    pub fn try_async_event(&self) -> Result<Option<AsyncEvent>> {
        if !self.async_nonblocking.load(Ordering::Acquire) {
            crate::wait::set_nonblocking(self.as_raw_fd())?;
            self.async_nonblocking.store(true, Ordering::Release);
        }
        let mut ev = RawAsyncEvent { element: 0, event_type: 0 };
        // SAFETY: context open; `ev` has the layout of struct ibv_async_event (a union of
        // pointers and an int, then the event type read as the raw integer, never as
        // rdma-sys's Rust enum); the descriptor is non-blocking.
        let ret = unsafe { ffi::ibv_get_async_event(self.as_raw(), (&mut ev as *mut RawAsyncEvent).cast()) };
        if ret != 0 {
            let e = errno();
            return if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                Ok(None)
            } else {
                Err(Error::call("ibv_get_async_event", e, None))
            };
        }
        let out = AsyncEvent::from_raw(&ev);
        // SAFETY: the event was returned by ibv_get_async_event and is acked once, after we
        // copied it (destroying the object it names waits for this ack).
        unsafe { ffi::ibv_ack_async_event((&mut ev as *mut RawAsyncEvent).cast()) };
        Ok(Some(out))
    }

    /// Waits up to `timeout` for the device's next asynchronous event.
    ///
    /// # Errors
    /// [`Error::Timeout`]; as for [`VerbsContext::try_async_event`].
    pub fn async_event(&self, timeout: Duration) -> Result<AsyncEvent> {
        let mut deadline = Deadline::new(timeout);
        loop {
            if let Some(ev) = self.try_async_event()? {
                return Ok(ev);
            }
            let left = deadline.left();
            if left.is_zero() || !poll_readable(&mut [pollfd(self.as_raw_fd())], left)? {
                return Err(Error::Timeout { op: "ibv_get_async_event", timeout, addr: None, hint: None });
            }
        }
    }
}

impl AsRawFd for VerbsContext {
    /// The async-event descriptor (readable when [`VerbsContext::try_async_event`] has one).
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

/// `struct ibv_async_event`, with the event type as the raw integer.
#[repr(C)]
struct RawAsyncEvent {
    /// The union of `cq`, `qp`, `srq`, `wq` pointers and `port_num`.
    element: usize,
    event_type: u32,
}

/// What an asynchronous event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncElement {
    /// A QP (its raw handle, compare with `QueuePair::as_raw`).
    Qp(usize),
    /// A CQ (its raw handle).
    Cq(usize),
    /// A shared receive queue (its raw handle).
    Srq(usize),
    /// A port.
    Port(u8),
    /// The whole device.
    Device,
}

/// An asynchronous event of a device (`ibv_get_async_event`), copied and acked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// The raw `enum ibv_event_type` value.
    pub kind: u32,
    /// What it is about.
    pub element: AsyncElement,
}

impl AsyncEvent {
    fn from_raw(ev: &RawAsyncEvent) -> AsyncEvent {
        use ffi::ibv_event_type as t;
        let k = ev.event_type;
        let is = |v: t| k == v as u32;
        let element = if is(t::IBV_EVENT_CQ_ERR) {
            AsyncElement::Cq(ev.element)
        } else if is(t::IBV_EVENT_SRQ_ERR) || is(t::IBV_EVENT_SRQ_LIMIT_REACHED) {
            AsyncElement::Srq(ev.element)
        } else if is(t::IBV_EVENT_PORT_ACTIVE)
            || is(t::IBV_EVENT_PORT_ERR)
            || is(t::IBV_EVENT_LID_CHANGE)
            || is(t::IBV_EVENT_PKEY_CHANGE)
            || is(t::IBV_EVENT_SM_CHANGE)
            || is(t::IBV_EVENT_CLIENT_REREGISTER)
            || is(t::IBV_EVENT_GID_CHANGE)
        {
            AsyncElement::Port(ev.element as u8)
        } else if is(t::IBV_EVENT_DEVICE_FATAL) {
            AsyncElement::Device
        } else {
            AsyncElement::Qp(ev.element)
        };
        AsyncEvent { kind: k, element }
    }

    /// Whether this is an SRQ limit event (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    pub fn is_srq_limit(&self) -> bool {
        self.kind == ffi::ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED as u32
    }
}
