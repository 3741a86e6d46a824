// Nor can a server send before it has accepted.
fn f(mut q: rdma_cm::ServerQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
    q.qp_mut().post_send(&[rdma_cm::SendWr::send(&mr, 0..8)])?;
    Ok(())
}
fn main() {}
