//! No RDMA device at all: every entry point says so in one line, with the fix.
//!
//! cargo's runner (harness/runner) runs this binary directly on a host without RDMA, which is
//! the case it checks. On a host with a device it runs it in the guest, where the test first
//! deletes the guest's only device (rxe0).

use std::process::Command;

#[path = "common/examples.rs"]
mod examples;

#[test]
fn no_device_is_reported_with_the_fix_by_library_and_examples() {
    let has_device = std::fs::read_dir("/sys/class/infiniband").map(|mut d| d.next().is_some()).unwrap_or(false);
    if has_device {
        assert!(
            std::env::var_os("RDMA_VM").is_some(),
            "this machine has an RDMA device, so this test must run in the harness guest (cargo test does that)"
        );
        let st = Command::new("rdma").args(["link", "delete", "rxe0"]).status().expect("rdma (iproute2)");
        assert!(st.success(), "could not delete rxe0 in the guest");
    }
    let e = rdma_cm::Client::new().expect_err("no device: creating a client must fail");
    assert!(matches!(e, rdma_cm::Error::NoDevice { .. }), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("no RDMA device found") && m.contains("rdma link") && m.contains("rdma_rxe"), "{m}");
    assert!(matches!(rdma_cm::Server::new(), Err(rdma_cm::Error::NoDevice { .. })));

    for (bin, args) in [
        ("client", vec!["-a", "10.77.0.1"]),
        ("server", vec!["-p", "7471"]),
        ("perf_client", vec!["-a", "10.77.0.1"]),
        ("perf_server", vec!["-p", "7471"]),
    ] {
        let out = Command::new(examples::example(bin)).args(&args).output().expect("run the example");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bin}: {err}");
        assert_eq!(err.lines().count(), 1, "{bin}: one line: {err}");
        assert!(err.contains("no RDMA device found") && err.contains("Soft-RoCE"), "{bin}: {err}");
    }

    // The doctor says exactly that, and how to get Soft-RoCE.
    let out = Command::new(examples::example("doctor")).output().expect("the doctor example");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("[FAIL] RDMA devices: none") && text.contains("rdma_rxe"), "{text}");
    assert!(text.contains("verdict:") && !text.contains("verdict: healthy"), "{text}");
}
