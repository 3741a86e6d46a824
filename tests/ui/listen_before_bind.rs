// A server cannot listen before binding.
fn main() -> rdma_cm::Result<()> {
    let _listener = rdma_cm::Server::new()?.listen(8)?;
    Ok(())
}
