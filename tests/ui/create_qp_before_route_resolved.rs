// A QP cannot be created before the route is resolved.
fn f(a: rdma_cm::AddrResolved, pd: std::sync::Arc<rdma_cm::ProtectionDomain>) -> rdma_cm::Result<()> {
    let _qp = a.create_qp(&pd, rdma_cm::QpInit::new())?;
    Ok(())
}
fn main() {}
