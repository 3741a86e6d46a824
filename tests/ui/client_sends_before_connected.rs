// Before ESTABLISHED a client's QP takes receives only: no mutable QP to post a send on.
fn f(mut q: rdma_cm::ClientQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
    q.qp_mut().post_send(&[rdma_cm::SendWr::send(&mr, 0..8)])?;
    Ok(())
}
fn main() {}
