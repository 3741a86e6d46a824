// A CQ's descriptor is AsRawFd only: safe code cannot borrow it to read events behind the
// library's back, or clear O_NONBLOCK on it.
use std::os::fd::AsFd;
fn f(cq: &rdma_cm::CompletionQueue) {
    let _owned = cq.as_fd().try_clone_to_owned();
}
fn main() {}
