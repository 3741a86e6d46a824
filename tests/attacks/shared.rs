//! What several of the lane's attack modules set up the same way.

use std::sync::Arc;

use crate::common::{resources, PairSpec};
use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain};

pub(crate) const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

/// Both sides' region 0: 4 KiB the peer may write and read.
pub(crate) fn spec() -> PairSpec {
    PairSpec {
        mr_sizes: vec![4096],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ..PairSpec::default()
    }
}

/// A region of `len` bytes on `pd` the device may write.
pub(crate) fn region(pd: &Arc<ProtectionDomain>, len: usize) -> MemoryRegion {
    MemoryRegion::new(pd, len, LW).unwrap()
}

/// How many RDMA objects of `kind` the kernel lists (`rdma res`).
pub(crate) fn count(kind: &str) -> usize {
    resources().into_iter().find(|(k, _)| *k == kind).map_or(0, |(_, n)| n)
}
