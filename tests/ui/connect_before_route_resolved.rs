// A client cannot connect before resolving the address and route and creating a QP.
fn main() -> rdma_cm::Result<()> {
    let _conn = rdma_cm::Client::new()?.connect(&rdma_cm::ConnParam::new(), std::time::Duration::from_secs(1))?;
    Ok(())
}
