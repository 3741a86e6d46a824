// A registered mapping belongs to its region: dropping it (which unmaps it) while the device may
// use it does not compile; only the region's own drop, after deregistering, unmaps it.
use std::sync::Arc;
use rdma_cm::{AccessFlags, Mapping, MemoryRegion, ProtectionDomain};

fn f(pd: &Arc<ProtectionDomain>) -> rdma_cm::Result<()> {
    let m = Mapping::huge_pages(2 << 20)?;
    let _mr = MemoryRegion::register(pd, m, AccessFlags::LOCAL_WRITE)?;
    drop(m);
    Ok(())
}
fn main() {}
