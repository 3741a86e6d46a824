//! A region held by posted work: what keeps a [`MemoryRegion`](crate::MemoryRegion) alive, and
//! out of Rust's reach while the device may write it, from the post to the completion.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::verbs::mr::MrInner;

/// A region held by a posted work request. Dropping it releases the region (and, for work
/// the device writes, the region's writer count).
pub(crate) struct Hold {
    region: Arc<MrInner>,
    writes: bool,
}

impl Hold {
    /// Takes a handle of `region` for a work request; `writes` when the device writes it
    /// (receives, RDMA READ targets).
    pub(crate) fn new(region: &Arc<MrInner>, writes: bool) -> Hold {
        if writes {
            region.writers.fetch_add(1, Ordering::AcqRel);
        }
        Hold { region: Arc::clone(region), writes }
    }

    /// The region held.
    pub(crate) fn region(&self) -> &Arc<MrInner> {
        &self.region
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.writes {
            self.region.writers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
