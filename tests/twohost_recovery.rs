//! Where recovery after a cut wire breaks, between two hosts (see tests/twohost.rs for the
//! harness). A binary of its own: its test re-creates host B's RDMA device, which the kernel
//! allows only while no process holds the device open, and so this test process never opens it
//! (it drives the examples as processes).

mod common;
#[path = "common/peer.rs"]
mod peer;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::DeviceTest;
use peer::{example, peer, port_active_script, run_local, sh_local, streaming_client, text, Wire, NETDEV};

/// Where recovery after a cut breaks (the issue: "after the wire is back, no new connection
/// completes"). Our side is ruled out: the same example server process accepts again as soon as
/// host B's RDMA device is re-created. The cause is host B's kernel: a connection torn down
/// while B's own link is down makes the CM send its DREQ on QP1, that send fails locally
/// (LOC_QP_OP_ERR), rxe moves QP1 to the error state (flushing its receives), ib_mad puts QP1
/// back to RTS for sending but never reposts the flushed receives: host B's CM sends but hears
/// nothing any more (a REP on the wire is never delivered), until rxe0 is deleted and added
/// again. If a kernel without that bug runs this, the connection after the flap simply works.
#[test]
fn recovery_after_own_link_flap_mid_transfer_breaks_in_the_kernel_not_in_the_server() {
    let t = DeviceTest::start();
    let p = peer();
    let base = p.resources();
    let wire = Wire::new(&p);
    let a = p.addr.to_string();
    // ib_mad's tracepoints show what QP1 did (tracefs, mounted if it is not).
    let trace = "/sys/kernel/tracing";
    sh_local(&format!(
        "[ -e {trace}/events/ib_mad ] || mount -t tracefs nodev {trace}; echo 1 > {trace}/events/ib_mad/enable; : > {trace}/trace"
    ));
    let srv = p.start("flap-server", &[&example("server"), "-a", &a, "-p", "7806", "--timeout", "5"]);
    srv.wait_line("Listening on port 7806", Duration::from_secs(60));
    let (busy, _lines) = streaming_client(&p, "7806", "65536", "5");
    sh_local(&format!("ip link set {NETDEV} down"));
    // The client fails at once (its own link is down: a local error), exits, and so tears down
    // its connection while the link is still down.
    let out = peer::wait_output(busy, Duration::from_secs(60), "the client");
    assert_eq!(out.status.code(), Some(1), "the busy client survived its own link going down");
    sh_local(&format!("ip link set {NETDEV} up && {}", port_active_script()));
    let trace_text = sh_local(&format!("cat {trace}/trace"));
    let qp1_send_failed = trace_text
        .lines()
        .any(|l| l.contains("ib_mad_send_done_handler") && l.contains("QP1") && l.contains("SEND WC Status 2 "));
    sh_local(&format!("echo 0 > {trace}/events/ib_mad/enable"));

    let client = |timeout: &str| {
        run_local(&[&example("client"), "-a", &a, "-p", "7806", "--timeout", timeout], Duration::from_secs(90))
    };
    let after = client("6");
    if after.status.success() {
        eprintln!("measured: a new connection works right after the flap (this kernel does not lose QP1's receives)");
    } else {
        eprintln!(
            "measured: after the flap, host B's new connection fails: {}",
            text(&after).lines().last().unwrap_or("")
        );
        assert!(
            qp1_send_failed,
            "recovery failed, but not for the known reason (a QP1 send failing with LOC_QP_OP_ERR on host B):\n{trace_text}"
        );
        // Our server heard the request and answered it...
        assert!(srv.out().matches("Received CONNECT_REQUEST").count() >= 2, "{}", srv.out());
        // ...and serves a client on its own host right away: its listener and state are fine.
        let (rc, out) = p
            .start("local-client", &[&example("client"), "-a", &a, "-p", "7806", "--timeout", "20"])
            .wait(Duration::from_secs(90));
        assert_eq!(rc, 0, "a client on host A, to the same server, after the flap: {out}");
        // Host B's CM is deaf: a fresh listener on B never hears host A's request.
        let b = peer::own_addr();
        let mut fresh = Command::new(example("server"))
            .args(["-a", &b, "-p", "7816", "--count", "1", "--timeout", "5"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = common::lines_of(&mut fresh);
        common::wait_for_line(&lines, "Listening on port 7816", Duration::from_secs(30));
        let (rc, out) = p
            .start("reverse-client", &[&example("client"), "-a", &b, "-p", "7816", "--timeout", "6"])
            .wait(Duration::from_secs(90));
        assert_ne!(rc, 0, "host A connected to a fresh listener on host B: B's CM is not deaf: {out}");
        let heard = lines.try_iter().any(|l| l.contains("CONNECT_REQUEST"));
        assert!(!heard, "the fresh listener on host B heard the request, yet the connection failed");
        fresh.kill().unwrap();
        fresh.wait().unwrap();
        eprintln!("measured: after the flap, host A's server serves host A; host B's fresh listener hears nothing");
        // Re-create host B's device: a new QP1 with its receives posted.
        sh_local(&format!(
            "rdma link delete rxe0 && rdma link add rxe0 type rxe netdev {NETDEV} && {}",
            port_active_script()
        ));
        let repaired = client("20");
        assert!(repaired.status.success(), "after re-adding rxe0, the same server: {}", text(&repaired));
        eprintln!("measured: after `rdma link delete/add rxe0` on host B, the same server process accepts again");
    }
    srv.kill("TERM");
    let (_, sout) = srv.wait(Duration::from_secs(30));
    assert!(sout.contains("Server exiting"), "{sout}");
    drop(wire);
    p.wait_resources(&base, "after the flap");
    t.finish();
}
