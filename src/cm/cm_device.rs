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
//! # Why the context stays open (rdma-core 44, `librdmacm/cma.c`)
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
//! # librdmacm's own PD
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

use std::net::{IpAddr, SocketAddr};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use rdma_sys as ffi;

use crate::cm::cm_id::CmId;
use crate::cm::event_channel::EventChannel;
use crate::error::{check_ptr, Error, Result};
use crate::verbs::device::VerbsContext;

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
    /// the QPs of any connection there. It holds no id (see [`crate::cm::cm_device`]).
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
    /// as for [`VerbsContext::cm_open`].
    pub fn cm_for_addr(addr: IpAddr) -> Result<VerbsContext> {
        let sa = SocketAddr::new(addr, 0);
        let id = CmId::new(&EventChannel::new()?)?;
        id.bind(sa)?;
        let raw = id.verbs().ok_or(Error::NoDevice { op: "rdma_bind_addr", addr: Some(sa) })?;
        context_of_raw(raw, Some(addr))?.ok_or(Error::NoDevice { op: "rdma_get_devices", addr: Some(sa) })
    }
}

/// An IPv4 address of the device, from the IPv4-mapped GIDs of its ports (RoCE), if it has one.
fn ipv4_of_device(ctx: &VerbsContext) -> Option<IpAddr> {
    let ports = ctx.port_count().ok()?;
    (1..=ports).find_map(|p| ctx.gid_table(p).ok()?.iter().find_map(|g| g.gid.ipv4()).map(IpAddr::V4))
}
