//! Room on the lane's CQ: it grows when a QP is attached that it has no room for.
//!
//! A lane's CQ must hold every completion its QPs may have outstanding: the sum of their queue
//! depths, counted as each QP is created on it ([`Lane::qp_init`]). A QP created beyond what
//! the CQ holds is fenced until it is attached (its own posts are refused: they could overrun
//! the CQ, and a CQ that overruns loses completions). [`Lane::attach`] then grows the CQ
//! (`ibv_resize_cq`), to twice its depth or what is needed, within the device's `max_cqe`.
//! The resize happens through `&mut Lane`, so none of the lane's polls runs meanwhile, and the
//! provider keeps the completions the CQ holds, in order: nothing is lost and nothing handed
//! out twice (the lane's own poll buffer holds copies, which the resize does not touch).
//!
//! Where the device cannot resize a CQ (siw has no `resize_cq`: `EOPNOTSUPP`), the attach is
//! refused, saying so and what depth the lane needs, and the owner is handed back.

use super::Lane;
use crate::error::Error;
use crate::error::Result;

impl Lane {
    /// Grows the CQ when its QPs (the one being attached included) may have more completions
    /// outstanding than it holds.
    pub(super) fn make_room(&mut self) -> Result<()> {
        let need = self.cq.reserved();
        let depth = self.cq.depth();
        if need <= depth as u64 {
            return Ok(());
        }
        self.grow(need, depth)
    }

    #[cold]
    #[inline(never)]
    fn grow(&mut self, need: u64, depth: u32) -> Result<()> {
        let ctx = self.cq.context();
        let device = ctx.device_name();
        let max = ctx.limits()?.max_cqe as u64;
        if need > max {
            return Err(Error::InvalidArgument(format!(
                "attach: the lane's QPs, this one included, may have {need} completions outstanding, beyond device \
                 {device}'s max_cqe of {max}: attach this QP to another lane"
            )));
        }
        let want = need.max(depth as u64 * 2).min(max).min(i32::MAX as u64) as u32;
        // SAFETY: `&mut self`: none of the lane's polls runs, and nothing else polls its CQ
        // (every other path refuses it). The lane's cached `cq_raw` and `poll_cq` stay valid
        // across a resize (same `ibv_cq`, same context); its poll buffer and kept completions
        // are copies, untouched.
        match unsafe { self.cq.resize_for_lane(want) } {
            Ok(()) => Ok(()),
            Err(Error::Call { source, .. }) => Err(cannot_grow(&device, depth, need, source)),
            Err(e) => Err(e),
        }
    }
}

#[cold]
fn cannot_grow(device: &str, depth: u32, need: u64, source: std::io::Error) -> Error {
    let why = if source.raw_os_error() == Some(libc::EOPNOTSUPP) {
        format!("device {device} cannot resize a CQ (ibv_resize_cq: {source})")
    } else {
        format!("growing it on device {device} failed (ibv_resize_cq: {source})")
    };
    Error::InvalidArgument(format!(
        "attach: the lane's CQ holds {depth} completions, and its QPs, this one included, may have {need} \
         outstanding; {why}: create the lane with Lane::new(ctx, {need}) or more, or attach this QP to another lane"
    ))
}
