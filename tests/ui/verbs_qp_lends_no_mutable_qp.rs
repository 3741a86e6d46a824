// An UnconnectedQp lends its QueuePair shared only, so a send cannot be posted through it
// before `connect` has moved the QP to RTS.
fn f(q: rdma_cm::UnconnectedQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
    q.qp().post_send(&[rdma_cm::SendWr::send(&mr, 0..8)])?;
    Ok(())
}
fn main() {}
