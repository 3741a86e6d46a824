// RDMA WRITE does not exist on UD: a UdQp posts UdSendWrs only.
fn f(qp: &mut rdma_cm::UdQp, mr: &rdma_cm::MemoryRegion, r: &rdma_cm::RemoteRegion) -> rdma_cm::Result<()> {
    qp.post_send(&[rdma_cm::SendWr::write(mr, 0..8, r, 0)?])?;
    Ok(())
}
fn main() {}
