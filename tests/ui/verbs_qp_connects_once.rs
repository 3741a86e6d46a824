// `UnconnectedQp::connect` consumes the QP in INIT: it cannot be connected twice, nor receive
// through the old value once it is the QueuePair in RTS.
fn f(q: rdma_cm::verbs::qp::UnconnectedQp, peer: rdma_cm::verbs::peer::PeerInfo) -> rdma_cm::Result<()> {
    let _qp = q.connect(&peer)?;
    let _again = q.connect(&peer)?;
    Ok(())
}
fn main() {}
