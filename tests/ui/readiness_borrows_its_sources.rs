// A Readiness set borrows every source: none can be dropped, and no descriptor closed, while
// it waits.
fn main() {
    let ch = rdma_cm::EventChannel::new().unwrap();
    let mut set = rdma_cm::Readiness::new().channel(&ch, 0);
    drop(ch);
    set.wait(std::time::Duration::ZERO).unwrap();
}
