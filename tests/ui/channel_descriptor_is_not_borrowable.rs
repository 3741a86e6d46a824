// An event channel's descriptor is AsRawFd only, as a CQ's is.
use std::os::fd::AsFd;
fn f(ch: &rdma_cm::EventChannel) {
    let _owned = ch.as_fd().try_clone_to_owned();
}
fn main() {}
