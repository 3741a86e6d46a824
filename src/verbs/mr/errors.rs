//! A refused [`MemoryRegion::into_buffer_as`], the error of a registration that failed, and the
//! refusal of an on-demand-paging registration the device cannot make.

use std::fmt;

use super::{AccessFlags, MemoryRegion};
use crate::error::{Error, Result};
use crate::verbs::odp_caps::{OdpCaps, OdpOps};
use crate::verbs::pd::ProtectionDomain;

/// A refused [`MemoryRegion::into_buffer_as`]: the error, and the region, given back untouched
/// (`None` only when deregistration failed, and the buffer was leaked).
pub struct IntoBufferError {
    pub(super) error: Error,
    pub(super) region: Option<MemoryRegion>,
}

impl IntoBufferError {
    /// The error.
    pub fn error(&self) -> &Error {
        &self.error
    }
    /// The region, still registered and holding its buffer.
    pub fn into_region(self) -> Option<MemoryRegion> {
        self.region
    }
    /// The error and the region.
    pub fn into_parts(self) -> (Error, Option<MemoryRegion>) {
        (self.error, self.region)
    }
}

impl From<IntoBufferError> for Error {
    fn from(e: IntoBufferError) -> Error {
        e.error
    }
}

impl fmt::Debug for IntoBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IntoBufferError").field("error", &self.error).field("region", &self.region).finish()
    }
}

impl fmt::Display for IntoBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for IntoBufferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The error of an `ibv_reg_mr` that failed with `e` for `len` bytes: [`Error::MemLock`] when
/// the locked-memory limit is the likely cause, naming it.
pub(super) fn reg_error(len: usize, e: i32) -> Error {
    if e == libc::ENOMEM || e == libc::EPERM || e == libc::EAGAIN {
        let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: rl is a valid out-pointer for getrlimit.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } == 0;
        if ok && rl.rlim_cur != libc::RLIM_INFINITY && (len as u64) > rl.rlim_cur / 2 {
            return Error::MemLock { len, limit: Some(rl.rlim_cur), source: std::io::Error::from_raw_os_error(e) };
        }
    }
    Error::call("ibv_reg_mr", e, None)
}

/// Why an ODP registration with `access` (implicit or not) cannot be made on this device,
/// or `None` when it can.
fn odp_missing(caps: &OdpCaps, access: AccessFlags, implicit: bool) -> Option<String> {
    if !caps.supported {
        return Some(
            "it reports no on-demand paging (its odp_caps lack IBV_ODP_SUPPORT): the kernel or its driver has \
             none. Usually the kernel is too old for its driver's ODP, or was built without \
             CONFIG_INFINIBAND_ON_DEMAND_PAGING; Soft-RoCE (rxe) has ODP from about Linux 6.14 (Debian 12's 6.1 \
             and Debian 13's 6.12 lack it), mlx5 has it. Register without AccessFlags::ON_DEMAND (pinned) \
             instead"
                .into(),
        );
    }
    if implicit && !caps.implicit {
        return Some(
            "it has on-demand paging for registered ranges, but no implicit ODP (its odp_caps lack \
             IBV_ODP_SUPPORT_IMPLICIT; Soft-RoCE never has it, mlx5 on ConnectX-5 and later does): register \
             the buffers themselves with AccessFlags::ON_DEMAND"
                .into(),
        );
    }
    let any = caps.rc | caps.uc | caps.ud | caps.xrc;
    let rights = [
        (AccessFlags::REMOTE_WRITE, OdpOps::WRITE, "REMOTE_WRITE", "RDMA WRITE"),
        (AccessFlags::REMOTE_READ, OdpOps::READ, "REMOTE_READ", "RDMA READ"),
        (AccessFlags::REMOTE_ATOMIC, OdpOps::ATOMIC, "REMOTE_ATOMIC", "atomics"),
    ];
    let lacking: Vec<String> = rights
        .iter()
        .filter(|(right, op, _, _)| access.contains(*right) && !any.contains(*op))
        .map(|(_, _, right, op)| format!("{right} ({op})"))
        .collect();
    if lacking.is_empty() {
        return None;
    }
    Some(format!(
        "its on-demand paging serves {} on no transport (rc {:?}, uc {:?}, xrc {:?}): register without those \
             rights, or without AccessFlags::ON_DEMAND (pinned)",
        lacking.join(", "),
        caps.rc,
        caps.uc,
        caps.xrc
    ))
}

/// Refuses an ODP registration with `access` (implicit or not) that `pd`'s device cannot make,
/// naming what it lacks.
pub(crate) fn check_odp_registration(pd: &ProtectionDomain, access: AccessFlags, implicit: bool) -> Result<()> {
    let ctx = pd.context();
    let caps = ctx.limits()?.odp;
    match odp_missing(&caps, access, implicit) {
        None => Ok(()),
        Some(why) => Err(Error::Unsupported {
            what: if implicit { "implicit on-demand paging" } else { "on-demand paging (AccessFlags::ON_DEMAND)" },
            why: format!("{} says no: {why}", ctx.device_name()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl OdpCaps {
        fn missing(&self, access: AccessFlags, implicit: bool) -> Option<String> {
            odp_missing(self, access, implicit)
        }
    }

    fn caps(supported: bool, implicit: bool, rc: OdpOps) -> OdpCaps {
        OdpCaps { supported, implicit, rc, ..OdpCaps::default() }
    }

    #[test]
    fn what_is_missing_is_named() {
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let none = caps(false, false, OdpOps::empty()).missing(AccessFlags::LOCAL_WRITE, false).unwrap();
        assert!(none.contains("IBV_ODP_SUPPORT") && none.contains("6.14"), "{none}");
        let rxe = caps(true, false, OdpOps::SEND | OdpOps::RECV | OdpOps::WRITE | OdpOps::READ | OdpOps::ATOMIC);
        assert_eq!(rxe.missing(rw | AccessFlags::REMOTE_ATOMIC, false), None);
        let implicit = rxe.missing(AccessFlags::LOCAL_WRITE, true).unwrap();
        assert!(implicit.contains("IBV_ODP_SUPPORT_IMPLICIT"), "{implicit}");
        let no_atomics = caps(true, true, OdpOps::SEND | OdpOps::WRITE | OdpOps::READ);
        assert_eq!(no_atomics.missing(rw, true), None);
        let why = no_atomics.missing(rw | AccessFlags::REMOTE_ATOMIC, false).unwrap();
        assert!(why.contains("REMOTE_ATOMIC (atomics)") && !why.contains("REMOTE_WRITE"), "{why}");
    }
}
