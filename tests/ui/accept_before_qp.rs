// A connection request cannot be accepted before its QP exists.
fn f(req: rdma_cm::ConnectRequest) -> rdma_cm::Result<()> {
    let _conn = req.accept(&rdma_cm::ConnParam::new(), std::time::Duration::from_secs(1))?;
    Ok(())
}
fn main() {}
