//! Skipping by capability: a device test that needs what not every RDMA device offers (atomics,
//! UD, multicast, immediate data, a scattered READ, RNR retries, InfiniBand transport QP attributes,
//! many CQs in one process, an RC connection made without the CM) asks the device first, and when the device
//! says no, prints one line saying what is missing and why, then returns.
//!
//! It asks the device, never its name: the same suite runs on rxe, siw and hardware (as
//! pyverbs' `requires_*` checks do). A missing device still fails: `DeviceTest::start` panics
//! before any of this is reached, and so does a device that cannot be opened or queried.
//! harness/test counts the `skipped: ` lines and lists them in its summary.

use std::io::Write;

use rdma_cm::ffi;

/// What a device test may need that not every device has.
#[derive(Debug, Clone, Copy)]
pub enum Cap {
    /// Fetch-and-add and compare-and-swap (`atomic_cap` is not `ATOMIC_NONE`).
    Atomics,
    /// Unreliable datagram QPs (not on iWARP, whose transport is TCP).
    Ud,
    /// Multicast groups (UD only, so not on iWARP).
    Multicast,
    /// Send and RDMA WRITE with immediate data (iWARP has no immediate data).
    ImmediateData,
    /// An RDMA READ scattered into this many pieces (`max_sge_rd`).
    ReadScatter(u32),
    /// Receiver-not-ready retries: a send that finds no receive posted is retried, then fails
    /// at the sender with RNR_RETRY_EXC_ERR (InfiniBand and RoCE; iWARP has no RNR NAK, and its
    /// send completes once the data is handed to TCP).
    RnrRetry,
    /// The InfiniBand transport's QP attributes, as `ibv_query_qp` reports them on a connected
    /// QP: ACK timeout, retry count, traffic class, the peer's QP number (InfiniBand and RoCE;
    /// iWARP's transport is TCP, which has none of them).
    IbQpAttributes,
    /// This many completion queues (of one entry) held at once in one device context, as a
    /// process's connections share librdmacm's: a lower bound of what a test of that many
    /// connections holds. No device attribute says it (`max_cq` is the kernel's limit, not the
    /// provider library's): it is found by making them, and they are all destroyed again.
    CompletionQueues(usize),
    /// An RC QP connected without the connection manager: moved to RTR and RTS by hand from the
    /// peer's QP number, PSN and GID (`UnconnectedQp::connect`, as `ibv_rc_pingpong` does).
    /// InfiniBand and RoCE; an iWARP QP is connected only through the CM, which hands it the
    /// TCP connection its stream runs on.
    ConnectWithoutCm,
    /// An RDMA WRITE through an rkey the peer does not have fails at the requester, in its own
    /// completion (`REM_ACCESS_ERR`: InfiniBand and RoCE, whose responder NAKs it). On iWARP
    /// the WRITE completes once TCP has it, and the peer's TERMINATE moves the QP to the error
    /// state later, with no completion of its own (measured on siw/6.1).
    RemoteWriteError,
    /// A CM that speaks MADs on the port's QP1 (InfiniBand and RoCE; iWARP's CM speaks TCP):
    /// what a disconnect sent while the link is down breaks, and so what the crate holds a
    /// disconnect back for (`rdma_cm::cm::hold`).
    CmMads,
    /// Resizing a CQ (`ibv_resize_cq`), which a lane does to grow its CQ as QPs are attached.
    /// No device attribute says it (siw has no `resize_cq`): it is found by resizing a CQ of
    /// one entry to two.
    CqResize,
}

/// What the device says about itself: the answers `require` needs.
struct Answers {
    name: String,
    transport: ffi::ibv_transport_type::Type,
    atomic_cap: ffi::ibv_atomic_cap::Type,
    max_sge_rd: u32,
}

/// The device under test: `RDMA_VM_DEVICE` (the guest's) or `RDMA_CM_TEST_DEVICE` if set, else
/// the first one listed.
fn answers() -> Answers {
    let name = device_under_test();
    let ctx = rdma_cm::VerbsContext::open(&name).unwrap_or_else(|e| panic!("open {name}: {e}"));
    // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
    let mut a: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the context is open while `ctx` lives; `a` is a valid out-pointer of its type.
    let ret = unsafe { ffi::ibv_query_device(ctx.as_raw(), &mut a) };
    assert_eq!(ret, 0, "ibv_query_device on {name}: errno {ret}");
    // SAFETY: an open context's device pointer is set, and valid, for the context's life.
    let transport = unsafe { (*(*ctx.as_raw()).device).transport_type };
    Answers { name, transport, atomic_cap: a.atomic_cap, max_sge_rd: a.max_sge_rd.max(0) as u32 }
}

/// The name of the device under test: `RDMA_VM_DEVICE` (the guest's) or `RDMA_CM_TEST_DEVICE`
/// if set, else the first one listed. Panics when there is none.
pub fn device_under_test() -> String {
    std::env::var("RDMA_VM_DEVICE")
        .or_else(|_| std::env::var("RDMA_CM_TEST_DEVICE"))
        .ok()
        .or_else(|| rdma_cm::devices().ok().and_then(|d| d.into_iter().next()).map(|d| d.name))
        .expect("no RDMA device under test (see `rdma link`)")
}

/// Waits (bounded by `within`) until port 1 of the device under test is ACTIVE, as sysfs says;
/// whether it is.
pub fn port_active_within(within: std::time::Duration) -> bool {
    let path = format!("/sys/class/infiniband/{}/ports/1/state", device_under_test());
    let deadline = std::time::Instant::now() + within;
    while !std::fs::read_to_string(&path).unwrap_or_default().contains("ACTIVE") {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    true
}

/// Waits (bounded by `within`) until port 1 of the device under test is ACTIVE again, as sysfs
/// says; panics otherwise.
pub fn wait_port_active(within: std::time::Duration) {
    assert!(port_active_within(within), "port 1 of {} did not come back within {within:?}", device_under_test());
}

/// Why the device lacks `cap`, or `None` when it has it.
fn lacks(cap: Cap, d: &Answers) -> Option<String> {
    let iwarp = d.transport == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP;
    match cap {
        Cap::Atomics if d.atomic_cap == ffi::ibv_atomic_cap::IBV_ATOMIC_NONE => {
            Some(format!("{} says ATOMIC_NONE", d.name))
        }
        Cap::IbQpAttributes if iwarp => Some(format!(
            "{} is an iWARP device: its QPs run over TCP, which has no ACK timeout, retry count or traffic class",
            d.name
        )),
        Cap::ConnectWithoutCm if iwarp => Some(format!(
            "{} is an iWARP device: its QPs are connected only through the CM, which gives them their TCP \
             connection, never by RTR/RTS from exchanged info",
            d.name
        )),
        Cap::Ud | Cap::Multicast | Cap::ImmediateData | Cap::RnrRetry | Cap::RemoteWriteError | Cap::CmMads
            if iwarp =>
        {
            Some(format!("{} is an iWARP device, and iWARP has no {}", d.name, what(cap)))
        }
        Cap::ReadScatter(n) if d.max_sge_rd != 0 && d.max_sge_rd < n => {
            Some(format!("{} says max_sge_rd {}, fewer than {n}", d.name, d.max_sge_rd))
        }
        Cap::CompletionQueues(n) => {
            let ctx = rdma_cm::VerbsContext::open(&d.name).unwrap_or_else(|e| panic!("open {}: {e}", d.name));
            let mut held = Vec::with_capacity(n);
            for _ in 0..n {
                match rdma_cm::CompletionQueue::new(&ctx, 1) {
                    Ok(cq) => held.push(cq),
                    Err(e) => {
                        return Some(format!(
                            "{} holds {} one-entry CQs in one context, then refuses: {e}",
                            d.name,
                            held.len()
                        ))
                    }
                }
            }
            None
        }
        Cap::CqResize => {
            let ctx = rdma_cm::VerbsContext::open(&d.name).unwrap_or_else(|e| panic!("open {}: {e}", d.name));
            let cq = rdma_cm::CompletionQueue::new(&ctx, 1).unwrap_or_else(|e| panic!("a CQ on {}: {e}", d.name));
            // SAFETY: the CQ is alive (held by `cq`) and nothing polls it; a resize changes only
            // its depth.
            let ret = unsafe { rdma_cm::ffi::ibv_resize_cq(cq.as_raw(), 2) };
            (ret != 0).then(|| format!("{} refuses to resize a CQ: ibv_resize_cq returned {ret}", d.name))
        }
        _ => None,
    }
}

fn what(cap: Cap) -> String {
    match cap {
        Cap::Atomics => "atomics".into(),
        Cap::Ud => "UD".into(),
        Cap::Multicast => "multicast".into(),
        Cap::ImmediateData => "immediate data".into(),
        Cap::ReadScatter(n) => format!("an RDMA READ scattered over {n} pieces"),
        Cap::RnrRetry => "receiver-not-ready retries".into(),
        Cap::IbQpAttributes => "InfiniBand transport QP attributes".into(),
        Cap::CompletionQueues(n) => format!("{n} completion queues in one process"),
        Cap::ConnectWithoutCm => "an RC connection made without the CM".into(),
        Cap::RemoteWriteError => "an RDMA WRITE's remote access error in the WRITE's own completion".into(),
        Cap::CmMads => "CM MADs on QP1 (its CM speaks TCP)".into(),
        Cap::CqResize => "resizing a CQ".into(),
    }
}

/// Whether the device under test is an iWARP device (`transport_type` of its verbs device):
/// for the tests whose expected outcome is the transport's own, and differs on iWARP (its
/// connections are TCP's), rather than missing there.
pub fn iwarp() -> bool {
    answers().transport == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP
}

/// Whether `ctx` is a context of an iWARP device.
pub fn iwarp_context(ctx: &rdma_cm::VerbsContext) -> bool {
    // SAFETY: an open context's device pointer is set, and valid, for the context's life.
    unsafe { (*(*ctx.as_raw()).device).transport_type == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP }
}

/// Whether the device under test offers `cap`, saying nothing: for a test that adapts (a READ
/// into fewer pieces, say) where it would otherwise be skipped.
#[allow(dead_code)] // not every test binary adapts
pub fn has(cap: Cap) -> bool {
    lacks(cap, &answers()).is_none()
}

/// Whether the device under test offers `cap`. When it does not, prints exactly one line,
/// `skipped: WHAT (WHY) in TEST`, and returns `false`: the caller then returns at once.
///
/// The line goes straight to the process's stderr, past the test harness's capture, so it
/// shows (and harness/test counts it) although the test passes.
pub fn require(cap: Cap) -> bool {
    let Some(why) = lacks(cap, &answers()) else { return true };
    skipped(&what(cap), &why);
    false
}

/// Prints the one `skipped: WHAT (WHY) in TEST` line, for a test that learnt from the attempt
/// itself (an `Error::Unsupported`, the provider's `EOPNOTSUPP`) that the device lacks `what`.
pub fn skipped(what: &str, why: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    // One write of the whole line, so that it never interleaves with the harness's own output.
    let line = format!("skipped: {what} ({why}) in {test}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
