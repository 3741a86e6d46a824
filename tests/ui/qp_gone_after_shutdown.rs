// A connection shut down has no QP left to reach.
fn f(c: rdma_cm::Connection) -> rdma_cm::Result<()> {
    let d = c.shutdown()?;
    let _n = d.qp().qp_num();
    Ok(())
}
fn main() {}
