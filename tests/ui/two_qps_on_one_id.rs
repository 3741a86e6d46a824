// An id has at most one QP: creating it consumes the state that owns the id.
fn f(route: rdma_cm::RouteResolved, pd: std::sync::Arc<rdma_cm::ProtectionDomain>) -> rdma_cm::Result<()> {
    let _a = route.create_qp(&pd, rdma_cm::QpInit::new())?;
    let _b = route.create_qp(&pd, rdma_cm::QpInit::new())?;
    Ok(())
}
fn main() {}
