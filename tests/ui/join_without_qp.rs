// The QP comes before the join: joining from an id without a QP does not compile.
fn f(r: rdma_cm::cm::multicast::McastResolved) -> rdma_cm::Result<()> {
    let _m = r.join(rdma_cm::cm::multicast::JoinKind::FullMember, std::time::Duration::from_secs(1))?;
    Ok(())
}
fn main() {}
