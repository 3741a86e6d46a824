//! Limits that every queue's work requests share: how many pieces (scatter/gather entries) a
//! work request may name, and the checks of a queue's requested capacity against them and
//! against the device. The work requests themselves are the lane's
//! ([`lane::SendWr`](crate::verbs::lane::SendWr), [`lane::RecvWr`](crate::verbs::lane::RecvWr)).

use std::mem;

use crate::error::{Error, Result};

/// The most pieces (scatter/gather entries) one work request may name. A queue takes at most
/// what it was created for, up to this ([`QpInit::max_send_sge`](crate::QpInit::max_send_sge),
/// [`QpInit::max_recv_sge`](crate::QpInit::max_recv_sge),
/// [`SharedReceiveQueue::with_sge`](crate::SharedReceiveQueue::with_sge)). It sizes the
/// scatter/gather arrays a post builds on the stack.
pub const MAX_SGE: usize = 4;

/// Checks a requested number of pieces per work request against the crate's limit; `what`
/// names the setter.
pub(crate) fn check_sge_request(n: u32, what: &str) -> Result<()> {
    if n == 0 || n as usize > MAX_SGE {
        return Err(Error::InvalidArgument(format!(
            "{what}({n}): a work request names 1 to {MAX_SGE} pieces (rdma_cm::MAX_SGE)"
        )));
    }
    Ok(())
}

/// Checks a requested number of pieces against the device's limit `max` (`field` names it).
pub(crate) fn check_sge_device(n: u32, what: &str, max: u32, field: &str, device: &str) -> Result<()> {
    if n > max {
        return Err(Error::InvalidArgument(format!(
            "{what}({n}) exceeds device {device}'s {field} of {max} (see `ibv_devinfo -v`)"
        )));
    }
    Ok(())
}

/// Where a failed post stopped, when the provider said so: the index of `bad` in the list of
/// `n` starting at `first`. Compared as addresses, so nothing is assumed about a pointer we did
/// not give it. `None`: unknown extent.
pub(crate) fn rejected_from<T>(bad: *mut T, first: *const T, n: usize) -> Option<usize> {
    let size = mem::size_of::<T>().max(1);
    let (b, f) = (bad as usize, first as usize);
    (!bad.is_null() && b >= f && b < f + n * size && (b - f) % size == 0).then(|| (b - f) / size)
}
