//! A prepared batch: send-queue work requests over one region, lowered once, posted under one
//! doorbell, and retired whole by one completion.
//!
//! A list of [`PreparedSend`](crate::verbs::lane::PreparedSend)s posted with [`Lane::post_prepared_list`] moves one region per
//! request and hands out one completion per request (the unsignaled ones too, when the last one's
//! completion retires them). When the requests are pieces of one buffer (a stream of WRITEs, a
//! scatter of a message over several remote places), all of that is bookkeeping the device does
//! not need. A [`PreparedBatch`] holds the region once: [`Lane::post_batch`] moves it into the
//! lane, stamps the last request's tag and rings one doorbell; the last request is the batch's
//! only signaled one, and its completion hands the region back with one [`Wc`](crate::verbs::lane::Wc), whose status is
//! the batch's (the first failure among its requests, when one failed).
//!
//! Why it is sound: the batch's requests were each checked against the region when it was
//! prepared (as [`Lane::prepare_send`] checks one), and the region stays in the lane until the
//! last request's completion. A queue completes in order, so the device is then done with every
//! request of the batch. A failure of an earlier request puts the QP in the error state, so the
//! last one still completes (flushed). When the provider took only part of the batch, the
//! region stays held until the flush of the last request it took, or until the QP is destroyed
//! when no completion comes (all of them ran, unsignaled). The earlier requests' own completions (only failures and
//! flushes come) carry `tag::INTERIOR`, which retires nothing.

use super::prepared::{armed_accessors, disarmed, not_armed, rearm};
use super::refused::{post_list_failed, refusal};
use super::{tag, Fault, Lane, LaneQp, Member, Rejected, SendWr};
use crate::error::Error;
use crate::error::Result;
use crate::verbs::mr::MemoryRegion;
use crate::verbs::wr::MAX_SGE;
use rdma_sys as ffi;
use std::fmt;
use std::mem;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

/// One work request of a batch and its scatter list, side by side in the batch's allocation.
struct Entry {
    wr: ffi::ibv_send_wr,
    sge: [MaybeUninit<ffi::ibv_sge>; MAX_SGE],
}

/// Send-queue work requests over one region, lowered once for one QP of a lane
/// ([`Lane::prepare_batch`]) and posted together any number of times ([`Lane::post_batch`]):
/// one `ibv_post_send`, one doorbell, one completion.
///
/// It holds its region while it is armed, as [`PreparedSend`](crate::verbs::lane::PreparedSend) does: a post moves the region
/// into the lane, and the completion of the batch's last request hands it back (beside one
/// [`Wc`](crate::verbs::lane::Wc) for the whole batch), to [`PreparedBatch::rearm`] it with.
pub struct PreparedBatch {
    /// The requests, linked in order, each over its own `sge`: one allocation
    /// (`Box::into_raw`), so the links stay valid wherever the batch moves; freed by Drop.
    entries: NonNull<Entry>,
    len: u32,
    mr: Option<MemoryRegion>,
    /// The number of the region it was checked against (unique in the process).
    of: u64,
    key: LaneQp,
    /// The tag of its QP's send queue without the sequence number (each post stamps the last
    /// request's; the interior ones' are fixed: `tag::interior`).
    tag: u64,
    /// Its number among the batches prepared in this process (`NEXT_BATCH`), in its interior
    /// requests' tags.
    number: u64,
    wr_id: u64,
}

/// The number the next prepared batch gets: never reused (a u64 of prepares).
pub(super) static NEXT_BATCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

// SAFETY: the raw pointers are the batch's own allocation (which it owns alone), the links and
// scatter lists inside it, and UD destinations' address handles, which the lane's member keeps
// alive; only the lane that prepared it hands them to the provider, through `&mut`. Nothing is
// shared between threads.
unsafe impl Send for PreparedBatch {}

impl Drop for PreparedBatch {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.entries.as_ptr(), self.len as usize);
        // SAFETY: `entries` came from `Box::into_raw` of a boxed slice of `len` entries
        // (`prepare_batch`), and is freed only here. The provider holds no pointer into it:
        // `ibv_post_send` copies the requests into the queue before it returns.
        drop(unsafe { Box::from_raw(slice) });
    }
}

impl fmt::Debug for PreparedBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedBatch")
            .field("qp", &self.key)
            .field("len", &self.len)
            .field("wr_id", &self.wr_id)
            .field("armed", &self.mr.is_some())
            .finish()
    }
}

armed_accessors!(PreparedBatch);

impl PreparedBatch {
    /// How many work requests it posts.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Never true: a batch has at least one work request. (For `len`'s sake.)
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Lane {
    /// Prepares a batch of `len` send-queue work requests over `mr` for `qp`: `wr(k, mr)` builds
    /// the `k`-th from the region (a [`SendWr`] of it, any operation the QP has) and the region
    /// comes back out of it. Each is checked as [`Lane::prepare_send`] checks one. The last one
    /// is signaled and the others are not, whatever `wr` asked; the batch's completions carry
    /// the last one's `wr_id` ([`PreparedBatch::set_wr_id`] changes it).
    ///
    /// ```no_run
    /// # use rdma_cm::verbs::lane::{Lane, LaneQp, SendWr};
    /// # use rdma_cm::{MemoryRegion, RemoteRegion};
    /// # fn f(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion, remote: &RemoteRegion) -> rdma_cm::Result<()> {
    /// // 16 WRITEs of 64 bytes, each to its own place in the peer's region.
    /// let mut batch = lane.prepare_batch(qp, mr, 16, |k, mr| {
    ///     SendWr::write(mr, k * 64..(k + 1) * 64, remote, (k * 64) as u64)
    /// })?;
    /// loop {
    ///     lane.post_batch(&mut batch)?;                  // one doorbell
    ///     let mut back = None;
    ///     while lane.poll_with(1, |wc, mr| back = Some((wc.is_ok(), mr)))? == 0 {}
    ///     let (ok, mr) = back.unwrap();
    ///     assert!(ok);
    ///     batch.rearm(mr.unwrap())?;                     // the region, for the next post
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    /// With a region: [`Error::InvalidArgument`] for an unknown `qp`, a `len` of 0 or more than
    /// the QP's send queue holds, or a request `wr` built over another region than `mr` (that
    /// region comes back; `mr` stays with whatever `wr` did with it); the error
    /// [`Lane::post_send`] would give for a request's checks; on an iWARP device, for an
    /// RDMA READ or atomic that is not the batch's last request (iWARP can complete a later
    /// request before the READ's data lands, and the batch retires with its last completion).
    pub fn prepare_batch(
        &mut self,
        qp: LaneQp,
        mr: MemoryRegion,
        len: usize,
        mut wr: impl FnMut(usize, MemoryRegion) -> SendWr,
    ) -> std::result::Result<PreparedBatch, Rejected<MemoryRegion>> {
        let m = match self.member(qp) {
            Ok(m) => m,
            Err(e) => return Err(Rejected::new(e, mr)),
        };
        if len == 0 || len > m.send.depth as usize || len > 1 << tag::INDEX_BITS {
            let e = format!(
                "prepare_batch of {len} work requests: between 1 and the send queue's depth, {} (and at most {})",
                m.send.depth,
                1u32 << tag::INDEX_BITS
            );
            return Err(Rejected::new(Error::InvalidArgument(e), mr));
        }
        let number = NEXT_BATCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let entry = || Entry {
            // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of those):
            // all-zero is a valid value. (The scatter lists are written before they are read.)
            wr: unsafe { mem::zeroed() },
            sge: [const { MaybeUninit::uninit() }; MAX_SGE],
        };
        let entries: Box<[Entry]> = (0..len).map(|_| entry()).collect();
        let base = Box::into_raw(entries).cast::<Entry>();
        let tag = tag::encode(qp.place, 0, false);
        let mut b = PreparedBatch {
            // SAFETY: `Box::into_raw` never returns null.
            entries: unsafe { NonNull::new_unchecked(base) },
            len: len as u32,
            mr: None,
            of: mr.inner().serial(),
            key: qp,
            tag,
            number,
            wr_id: 0,
        };
        // From here on, `b` frees the allocation however this returns (a panic of `wr` too).
        let mut mr = mr;
        for k in 0..len {
            let w = wr(k, mr);
            if w.mr.inner().serial() != b.of {
                return Err(Rejected::new(other_region(k), w.mr));
            }
            let last = k + 1 == len;
            if !last && m.in_order() && w.is_fetch() {
                return Err(Rejected::new(fetch_before_last(k), w.mr));
            }
            if m.in_order() && w.has_imm() {
                return Err(Rejected::new(no_immediate_data(k), w.mr));
            }
            // An interior one's tag, fixed; each post stamps the last one's sequence number.
            let id = if last { 0 } else { tag::interior(qp.place, number, k as u32) };
            // SAFETY: k < len: an entry of the allocation, which `b` owns and nothing else
            // points into yet; the reference lives for this block only.
            let lowered = unsafe {
                let e = &mut *base.add(k);
                let lowered = w.lower(m, id, last, &mut e.wr, &mut e.sge);
                if !last {
                    // Unsignaled even on iWARP (`Member::always_flags`): the batch retires with
                    // its last request, and no READ or atomic comes before that one there.
                    e.wr.send_flags &= !ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                lowered
            };
            if let Err(e) = lowered {
                return Err(Rejected::new(e, w.mr));
            }
            // SAFETY: k < len (and k + 1 < len where the next entry is named): within the
            // allocation. The list's pointers are taken from `base` itself, so they stay valid
            // for as long as the allocation does: the scatter list of each entry, and the link
            // to the next.
            unsafe {
                let e = base.add(k);
                std::ptr::addr_of_mut!((*e).wr.sg_list).write(std::ptr::addr_of_mut!((*e).sge).cast());
                let next = if last { std::ptr::null_mut() } else { std::ptr::addr_of_mut!((*base.add(k + 1)).wr) };
                std::ptr::addr_of_mut!((*e).wr.next).write(next);
            }
            if last {
                b.wr_id = w.wr_id;
            }
            mr = w.mr;
        }
        b.mr = Some(mr);
        Ok(b)
    }

    /// Posts the batch `b` in one `ibv_post_send` (one doorbell): its region moves into the lane
    /// until the completion of its last request hands it back, with one [`Wc`](crate::verbs::lane::Wc) for the batch
    /// (its status is the first failure among the batch's requests, when one failed).
    ///
    /// # Errors
    /// The region stays in `b` when nothing was posted: [`Error::InvalidArgument`] when `b` is
    /// not armed or its QP is no longer attached; [`Error::QueueFull`] when the batch does not
    /// fit in the queue's free slots; [`Error::QpInError`]; [`Error::Call`] when
    /// `ibv_post_send` refuses its first request. When the provider takes part of the batch, or
    /// does not say how much it took, the region stays held, the QP is moved to the error
    /// state, and [`Error::Call`] says so: the region is handed back by the flush of the last
    /// request posted, when one comes (a request that had already run, unsignaled, leaves no
    /// completion), and released when the QP is destroyed ([`Lane::remove`]) otherwise.
    #[inline(always)]
    pub fn post_batch(&mut self, b: &mut PreparedBatch) -> Result<()> {
        let m = self.member(b.key)?;
        let len = b.len;
        if len > m.send.free() || m.failed.is_some() {
            return Err(refusal(m, "ibv_post_send"));
        }
        let Some(mr) = b.mr.take() else { return Err(not_armed()) };
        let first = m.send.tail;
        let base = b.entries.as_ptr();
        // SAFETY: len >= 1 (`prepare_batch`): the last entry is within the allocation; one
        // field is written through the allocation's own pointer.
        unsafe {
            std::ptr::addr_of_mut!((*base.add(len as usize - 1)).wr.wr_id)
                .write(b.tag | first.wrapping_add(len as u64 - 1) & tag::SEQ_MASK)
        };
        // The region into the batch's first slot, uncommitted, as in `post_prepared`; the
        // batch's other slots stay empty, and the mark says the first one stands for them.
        m.send.put_batch(len, mr, b.wr_id);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (its owner is in `m`, which `b.key` names: its attach
        // number, never reused, names one QP of one lane). The list is the batch's `len` entries,
        // linked in order and NULL-terminated, each over its own scatter list in the same
        // allocation, alive for the call; `prepare_batch` lowered each for this very QP against
        // the region now in the slot (`rearm` takes back no other), where it is out of Rust's
        // reach until the last request's completion retires the batch.
        let ret = unsafe { m.provider_post_send(std::ptr::addr_of_mut!((*base).wr), &mut bad) };
        if ret == 0 {
            m.send.commit(len);
            return Ok(());
        }
        Err(batch_refused(m, b, ret, bad))
    }
}

/// A batch the provider refused. Named at its first request: nothing was posted, and the
/// region goes back into the batch. Otherwise part of it (or all) may run: every slot of the
/// batch is committed, the region stays in the first, and the QP is moved to the error state.
#[cold]
#[inline(never)]
fn batch_refused(m: &mut Member, b: &mut PreparedBatch, ret: i32, bad: *mut ffi::ibv_send_wr) -> Error {
    let base = b.entries.as_ptr();
    // SAFETY: only the address of the first entry's request is taken.
    let first = unsafe { std::ptr::addr_of_mut!((*base).wr) };
    if std::ptr::eq(bad, first) {
        b.mr = m.send.unput();
        return Error::call("ibv_post_send", ret, None);
    }
    if bad.is_null() {
        m.send.commit(b.len);
        return post_list_failed(m, ret, false, "ibv_post_send");
    }
    // Named at entry `posted` (> 0): the ones before it were posted. The batch takes their
    // slots only; its last posted request, an interior one, retires it when it completes
    // (`Member::orphan`), flushed once the QP is in the error state.
    let posted = (0..b.len as usize)
        // SAFETY: k < len: only addresses within the allocation are computed and compared.
        .position(|k| std::ptr::eq(bad, unsafe { std::ptr::addr_of_mut!((*base.add(k)).wr) }))
        .map_or(b.len, |k| k as u32);
    let first = m.send.tail;
    m.send.mark_batch(posted);
    m.send.commit(posted);
    m.orphan = Some((first, posted, b.number));
    let flushed = m.set_error().is_ok();
    // Nothing posted from now on can run, whether or not the QP could be moved there.
    m.failed.get_or_insert(Fault::Moved);
    Error::Call {
        op: "ibv_post_send",
        addr: None,
        hint: Some(if flushed {
            "the provider took only part of the batch: the QP was moved to the error state; the batch's region comes back with the flush of the last request it took if that one had not run yet, and is released when the QP is destroyed otherwise (an unsignaled request that ran leaves no completion)"
        } else {
            "the provider took only part of the batch, and the QP could not be moved to the error state: the batch's region stays held until the QP is destroyed"
        }),
        source: std::io::Error::from_raw_os_error(ret.saturating_abs()),
    }
}

#[cold]
fn other_region(k: usize) -> Error {
    Error::InvalidArgument(format!(
        "prepare_batch: work request {k} is over another region than the batch's (build each one from the region it is given)"
    ))
}

#[cold]
fn fetch_before_last(k: usize) -> Error {
    Error::InvalidArgument(format!(
        "prepare_batch: work request {k} is an RDMA READ or atomic before the batch's last: on an iWARP \
         device a later request can complete before the READ's data has landed, and the batch retires \
         with its last completion (make the READ or atomic the last request, or post it on its own)"
    ))
}

#[cold]
fn no_immediate_data(k: usize) -> Error {
    Error::InvalidArgument(format!(
        "prepare_batch: work request {k} carries immediate data, which an iWARP device does not have \
         (send the value in the message instead)"
    ))
}
