// A verbs-only RC QP in INIT (UnconnectedQp) offers receives only: no send before RTS. Sends
// come with the QueuePair that `connect` hands back once the QP is in RTS.
fn f(mut q: rdma_cm::UnconnectedQp, mr: rdma_cm::MemoryRegion) -> rdma_cm::Result<()> {
    q.post_recv(&[rdma_cm::RecvWr::new(&mr, 0..8)])?;
    q.post_send(&[rdma_cm::SendWr::send(&mr, 0..8)])?;
    Ok(())
}
fn main() {}
