// A registered Vec belongs to its region: it cannot be pushed past its capacity (reallocated
// under the device), nor dropped, until `into_buffer_as` gives it back.
use std::sync::Arc;
use rdma_cm::{AccessFlags, MemoryRegion, ProtectionDomain};

fn f(pd: &Arc<ProtectionDomain>) -> rdma_cm::Result<()> {
    let mut v = Vec::with_capacity(4);
    v.extend_from_slice(&[1u8, 2, 3, 4]);
    let _mr = MemoryRegion::register(pd, v, AccessFlags::LOCAL_WRITE)?;
    v.push(5);
    Ok(())
}
fn main() {}
