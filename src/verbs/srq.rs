//! [`SharedReceiveQueue`]: receives posted once, consumed by whichever attached QP a message
//! arrives on (`ibv_create_srq`). A lane makes one and posts to it
//! ([`Lane::create_srq`](crate::verbs::lane::Lane::create_srq),
//! [`Lane::post_srq_recv`](crate::verbs::lane::Lane::post_srq_recv)); each QP made with
//! [`Lane::srq_qp_init`](crate::verbs::lane::Lane::srq_qp_init) takes its receives from it. The
//! lane holds the region of every receive posted there until its completion, and hands what is
//! still posted when the lane goes to the SRQ, which releases it only once it is destroyed
//! (until then the device may still write it). Every QP attached to an SRQ holds it, so it is
//! destroyed after them.
//!
//! # The limit event
//!
//! [`SharedReceiveQueue::arm_limit`] asks the device for an `IBV_EVENT_SRQ_LIMIT_REACHED`
//! asynchronous event when fewer than the given number of receives remain posted. It fires once
//! per arming, and is delivered to the SRQ: [`SharedReceiveQueue::limit_reached`] says whether
//! it came since the last arming. It also arrives on the context's event sources
//! ([`crate::VerbsContext::async_events`]), where [`SharedReceiveQueue::is_limit_event`] tells
//! whether an event is this SRQ's.

use std::fmt;
use std::mem;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rdma_sys as ffi;

use crate::error::{check_ibv, errno, Error, Result};
use crate::status::Subject;
use crate::verbs::device::AsyncEvent;
use crate::verbs::hold::Hold;
use crate::verbs::pd::ProtectionDomain;

/// One slot of an SRQ.
pub(crate) struct SrqShared {
    raw: NonNull<ffi::ibv_srq>,
    depth: u32,
    /// The most pieces a receive may name.
    max_sge: u32,
    /// Regions of receives still posted when their lane went, released once the SRQ is
    /// destroyed (the device may write them until then).
    parked: Mutex<Vec<Hold>>,
    /// Its place in the context's registry of async events (left before the SRQ is destroyed).
    async_reg: crate::verbs::hub::Registration,
    // Dropped after the SRQ is destroyed (Drop::drop runs first).
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the SRQ's verbs (post, modify, destroy) are thread-safe in libibverbs; the slots are
// behind a mutex; destruction happens once, in Drop, when no QP or CQ refers to it.
unsafe impl Send for SrqShared {}
// SAFETY: see the Send impl.
unsafe impl Sync for SrqShared {}

impl SrqShared {
    pub(crate) fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.raw.as_ptr()
    }
    pub(crate) fn depth(&self) -> u32 {
        self.depth
    }
}

impl Drop for SrqShared {
    fn drop(&mut self) {
        // Out of the registry before the destroy (see crate::verbs::async_event).
        self.async_reg.leave();
        // SAFETY: every QP attached holds this value, so none exists; destroyed exactly once.
        let ret = unsafe { ffi::ibv_destroy_srq(self.raw.as_ptr()) };
        if ret != 0 {
            // The device may still write posted receives: leak their regions, then report.
            mem::forget(mem::take(self.parked.get_mut().unwrap_or_else(|e| e.into_inner())));
            crate::error::report_leak("ibv_destroy_srq", ret);
        }
        // Destroyed: the parked regions drop with the struct.
    }
}

/// A shared receive queue (`ibv_srq`). Cloning is cheap and yields another handle to the same
/// SRQ; attach QPs with [`crate::QpInit::srq`].
#[derive(Clone)]
pub struct SharedReceiveQueue {
    inner: Arc<SrqShared>,
}

impl SharedReceiveQueue {
    /// Creates an SRQ on `pd` that holds up to `depth` receives of one scatter entry each.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero depth; [`Error::Call`] when `ibv_create_srq`
    /// fails (e.g. `EINVAL` beyond the device's `max_srq_wr`, `ENOSYS` without SRQ support).
    pub fn new(pd: &Arc<ProtectionDomain>, depth: u32) -> Result<SharedReceiveQueue> {
        Self::with_sge(pd, depth, 1)
    }

    /// Creates an SRQ on `pd` that holds up to `depth` receives of up to `max_sge` pieces each.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero depth, or `max_sge` outside 1 to
    /// [`MAX_SGE`](crate::MAX_SGE) or beyond the device's `max_srq_sge`; [`Error::Call`] as
    /// for [`SharedReceiveQueue::new`].
    pub fn with_sge(pd: &Arc<ProtectionDomain>, depth: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        if depth == 0 || depth > u16::MAX as u32 + 1 {
            return Err(Error::InvalidArgument(format!("SRQ depth {depth} must be between 1 and 65536")));
        }
        crate::verbs::wr::check_sge_request(max_sge, "SharedReceiveQueue::with_sge")?;
        if max_sge > 1 {
            let ctx = pd.context();
            let max = ctx.limits()?.max_srq_sge;
            crate::verbs::wr::check_sge_device(
                max_sge,
                "SharedReceiveQueue::with_sge",
                max,
                "max_srq_sge",
                &ctx.device_name(),
            )?;
        }
        // SAFETY: ibv_srq_init_attr is plain old data; zero is a valid start.
        let mut attr: ffi::ibv_srq_init_attr = unsafe { mem::zeroed() };
        attr.attr.max_wr = depth;
        attr.attr.max_sge = max_sge;
        // SAFETY: the PD is valid; attr is initialised; the result is checked.
        let raw = unsafe { ffi::ibv_create_srq(pd.as_raw(), &mut attr) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::call("ibv_create_srq", errno(), None))?;
        // What was asked, or less if the provider says so (the side table is sized by it).
        let max_sge = attr.attr.max_sge.clamp(1, max_sge);
        let parked = Mutex::new(Vec::new());
        let async_reg = crate::verbs::hub::Registration::new(pd.context().hub(), Subject::Srq, raw.as_ptr() as usize);
        let pd = Arc::clone(pd);
        Ok(SharedReceiveQueue { inner: Arc::new(SrqShared { raw, depth, max_sge, parked, async_reg, pd }) })
    }

    pub(crate) fn shared(&self) -> &Arc<SrqShared> {
        &self.inner
    }

    /// The raw SRQ. It stays owned by the SRQ; posting to it directly bypasses the slot table.
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.as_raw()
    }

    /// How many receives it holds.
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// The most pieces a receive may name ([`SharedReceiveQueue::with_sge`]; 1 for
    /// [`SharedReceiveQueue::new`]).
    pub fn max_sge(&self) -> u32 {
        self.inner.max_sge
    }

    /// The PD it was created on.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.inner.pd
    }

    /// Asks for the limit event when fewer than `limit` receives remain posted (0 disarms),
    /// and clears [`SharedReceiveQueue::limit_reached`].
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_modify_srq` fails (`EINVAL` when `limit` exceeds the depth).
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        // Read what is pending first, so that an old limit event does not count for this arming.
        self.inner.async_reg.refresh()?;
        self.inner.async_reg.events().clear_limit();
        // SAFETY: ibv_srq_attr is plain old data.
        let mut attr: ffi::ibv_srq_attr = unsafe { mem::zeroed() };
        attr.srq_limit = limit;
        // SAFETY: the SRQ is valid; only srq_limit is read, as the mask says.
        check_ibv(
            unsafe { ffi::ibv_modify_srq(self.as_raw(), &mut attr, ffi::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32) },
            "ibv_modify_srq(limit)",
        )
    }

    /// Whether the limit event arrived since the limit was last armed
    /// ([`SharedReceiveQueue::arm_limit`]), after reading what the device has pending: the SRQ
    /// is running dry. Costs one `poll` when nothing is pending.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn limit_reached(&self) -> Result<bool> {
        self.inner.async_reg.refresh()?;
        Ok(self.inner.async_reg.events().limit())
    }

    /// The last asynchronous event the device reported about this SRQ
    /// ([`AsyncEventKind::SrqLimitReached`](crate::verbs::async_event::AsyncEventKind::SrqLimitReached),
    /// [`AsyncEventKind::SrqError`](crate::verbs::async_event::AsyncEventKind::SrqError)), after reading what is
    /// pending.
    ///
    /// # Errors
    /// [`Error::Call`] when `ibv_get_async_event` fails.
    pub fn last_async_event(&self) -> Result<Option<crate::status::AsyncEventKind>> {
        self.inner.async_reg.refresh()?;
        Ok(self.inner.async_reg.events().last())
    }

    /// Keeps `mr` until the SRQ is destroyed: a region a lane's slot held for a receive posted
    /// to this SRQ ([`crate::verbs::lane::LaneSrq`]), handed over when the lane goes. Released
    /// after `ibv_destroy_srq` succeeds, leaked when it fails.
    pub(crate) fn park(&self, mr: crate::verbs::mr::MemoryRegion) {
        crate::wait::lock(&self.inner.parked).push(Hold::new(mr.inner(), false));
    }

    /// Whether `ev` is this SRQ's limit event.
    pub fn is_limit_event(&self, ev: &AsyncEvent) -> bool {
        ev.is_srq_limit() && ev.element == crate::verbs::device::AsyncElement::Srq(self.as_raw() as usize)
    }
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue").field("depth", &self.inner.depth).finish()
    }
}
