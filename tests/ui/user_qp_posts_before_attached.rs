#![allow(deprecated)] // A UserQp (deprecated) hands out no mutable QP, so nothing is posted to it before it is attached.
fn f(mut q: rdma_cm::UserQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
    q.qp_mut().post_recv(&[rdma_cm::RecvWr::new(&mr, 0..8)])?;
    Ok(())
}
fn main() {}
