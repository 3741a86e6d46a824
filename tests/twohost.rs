//! Two hosts on one wire: the examples and the crate's API between two Soft-RoCE guests, with
//! the wire shaped (loss, reordering, duplication, corruption) or cut, and processes killed.
//!
//! cargo's runner (harness/runner) runs this binary on host B of `harness/two-host`; host A runs
//! `harness/peer-agent`, and the tests start, watch and kill host A's processes through the
//! control directory both guests share ([`Peer`]), which does not depend on the wire. Host A is
//! 10.77.0.1, host B 10.77.0.2; each has its own rxe0 on its own eth0. Every test fails loudly
//! without the second host, waits on log lines, exit codes or `rdma res` rather than on fixed
//! sleeps, puts the wire back as it found it (even when it fails), and ends with the kernel's
//! resource accounting back where it started on both hosts.
//!
//! Bounds stated here are checked by the tests; the measured figures are printed (`measured:`).

mod common;
#[path = "common/peer.rs"]
mod peer;

// The examples' request encoding, for the tests that drive the example server with the API.
#[path = "../examples/perftest/protocol.rs"]
mod example_protocol;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::DeviceTest;
use example_protocol::{fill_pattern, Mode, Request};
use peer::{
    counters, delta, example, peer, run_local, sh_local, streaming_client, text, wait_until, Wire, NOTICE, SLACK,
};
use rdma_cm::verbs::lane::{Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Client, ConnParam, Error, MemoryRegion, QpInfo, QpInit, WcStatus, WorkQueue};

// ---------------------------------------------------------------------------------------------
// A client built on the API, against the example server (send mode), for the retry bounds.

struct ApiClient {
    /// The connection's QP is on it, from before the connect.
    lane: Lane,
    qp: LaneQp,
    /// The message and the echo's buffer, while in our hands (not posted).
    data: Option<MemoryRegion>,
    back: Option<MemoryRegion>,
    next: u64,
}

impl ApiClient {
    /// Connects to the example server at `dst` (send mode, `size`-byte messages) with the given
    /// retry count and, when given, the ACK timeout exponent (`CmId::set_ack_timeout`). The
    /// first echo's receive is posted on the lane before the connect.
    fn connect(dst: SocketAddr, size: usize, retry: u8, ack_timeout: Option<u8>) -> ApiClient {
        let t = Duration::from_secs(20);
        let route = Client::new().unwrap().resolve_addr(None, dst, t).unwrap().resolve_route(t).unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut lane = Lane::new(&route.context().unwrap(), 64).unwrap();
        let data = MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE).unwrap();
        let back = MemoryRegion::new(&pd, size, AccessFlags::LOCAL_WRITE).unwrap();
        if let Some(exp) = ack_timeout {
            route.id().set_ack_timeout(exp).unwrap();
        }
        let pending = route.lane_qp(&mut lane, &pd, QpInit::new()).unwrap();
        let qp = pending.qp();
        lane.post_recv(qp, RecvWr::range(back, 0..size).wr_id(0)).unwrap();
        let req = Request {
            info: QpInfo { qp_num: lane.qp_num(qp).unwrap(), ..QpInfo::default() },
            mode: Mode::Send,
            size: size as u32,
            iters: 1_000_000,
            send_doorbell: false,
        };
        let param = ConnParam::new().retry_count(retry).private_data(&req.encode()).unwrap();
        pending.connect(&mut lane, &param, t).unwrap();
        ApiClient { lane, qp, data: Some(data), back: None, next: 0 }
    }

    /// One verified echo.
    fn round_trip(&mut self) {
        let t = Duration::from_secs(20);
        let i = self.next;
        let mut data = self.data.take().unwrap();
        let size = data.len();
        fill_pattern(data.as_mut_slice().unwrap(), i as u32);
        if i > 0 {
            self.lane.post_recv(self.qp, RecvWr::range(self.back.take().unwrap(), 0..size).wr_id(i)).unwrap();
        }
        self.lane.post_send(self.qp, SendWr::send(data, 0..size).wr_id(i)).unwrap();
        // The send's completion and the echo's, in either order.
        for _ in 0..2 {
            let mut c = self.lane.wait(t).unwrap().ok().unwrap();
            assert_eq!(c.wr_id(), i, "echo {i}: {c:?}");
            let region = c.take_region();
            match c.queue() {
                WorkQueue::Send => self.data = region,
                WorkQueue::Recv => self.back = region,
            }
        }
        let back = self.back.as_mut().expect("the echo's buffer is back");
        let (mut got, mut want) = (vec![0u8; size], vec![0u8; size]);
        back.read_at(0, &mut got).unwrap();
        fill_pattern(&mut want, i as u32);
        assert!(got == want, "echo {i} differs");
        assert!(self.data.is_some(), "echo {i}: the message is back");
        self.next += 1;
    }

    /// Posts one send and waits for its completion: the status and how long it took.
    fn send_until_failure(&mut self, within: Duration) -> (Error, Duration) {
        let id = 1 << 40;
        let data = self.data.take().unwrap();
        let size = data.len();
        let start = Instant::now();
        self.lane.post_send(self.qp, SendWr::send(data, 0..size).wr_id(id)).unwrap();
        let c = self.lane.wait(within).expect("the send on a cut wire completes, failed");
        let took = start.elapsed();
        assert_eq!((c.wr_id(), c.queue()), (id, WorkQueue::Send), "{c:?}");
        (c.ok().expect_err("a send on a cut wire completed"), took)
    }
}

/// The local ACK timeout that exponent `t` means: 4.096 µs × 2^t.
fn ack_timeout(t: u8) -> Duration {
    Duration::from_nanos(4096u64 << t)
}

struct RetryRun {
    /// When host A's egress was cut.
    cut: Instant,
    timeout_exp: u8,
    retry: u8,
    measured: Duration,
    bound: Duration,
}

/// Connects to `server` (the example, send mode), echoes 3 messages, cuts the wire at host A's
/// egress (its ACKs are lost: the peer seems gone), and measures how long one send takes to fail.
/// With rxe, a retry count of 7 never gives up (rxe reads 7 as "retry forever"), so callers
/// pass less.
fn retry_exhaustion(wire: &Wire, dst: SocketAddr, retry: u8, ack: Option<u8>) -> (RetryRun, ApiClient) {
    assert!(retry < 7, "rxe retries forever with retry_count 7");
    let mut c = ApiClient::connect(dst, 64, retry, ack);
    // The ACK timeout exponent and retry count, as the device holds them (`ibv_query_qp`).
    let attrs = c.lane.attributes(c.qp).unwrap();
    let timeout_exp = attrs.ack_timeout;
    assert_eq!(attrs.retry_count, retry, "the retry count set through ConnParam reaches the QP");
    if let Some(a) = ack {
        assert_eq!(timeout_exp, a, "the ACK timeout set on the id reaches the QP");
    }
    for _ in 0..3 {
        c.round_trip();
    }
    wire.netem("a", "loss 100%");
    let cut = Instant::now();
    // The first try and `retry` retries, each given up after one ACK timeout.
    let expected = ack_timeout(timeout_exp) * (retry as u32 + 1);
    let bound = expected + expected / 2 + SLACK;
    let (e, measured) = c.send_until_failure(bound + Duration::from_secs(30));
    assert!(
        matches!(e, Error::WorkCompletion { status: WcStatus::RetryExcErr, .. }),
        "the send on a cut wire failed with {e:?}, not RETRY_EXC_ERR"
    );
    eprintln!(
        "measured: retry_count {retry}, ACK timeout 2^{timeout_exp} x 4.096 us = {:?}: RETRY_EXC_ERR after {measured:?} \
         (expected {expected:?}, bound {bound:?})",
        ack_timeout(timeout_exp)
    );
    assert!(measured <= bound, "RETRY_EXC_ERR after {measured:?}, beyond the bound {bound:?}");
    // It went through the retries: at least `retry` ACK timeouts passed (not a local error).
    let least = ack_timeout(timeout_exp) * retry as u32;
    assert!(measured >= least, "RETRY_EXC_ERR after {measured:?}, sooner than {retry} ACK timeouts ({least:?})");
    (RetryRun { cut, timeout_exp, retry, measured, bound }, c)
}

// ---------------------------------------------------------------------------------------------
// The tests.

#[test]
fn demo_in_every_mode_across_hosts() {
    let t = DeviceTest::start();
    let p = peer();
    let base = p.resources();
    let a = p.addr.to_string();
    let srv =
        p.start("demo-server", &[&example("perf_server"), "-a", &a, "-p", "7801", "--count", "3", "--timeout", "20"]);
    srv.wait_line("Listening on port 7801", Duration::from_secs(60));
    for mode in ["send", "write", "read"] {
        let out = run_local(
            &[
                &example("perf_client"),
                "-a",
                &a,
                "-p",
                "7801",
                "--mode",
                mode,
                "--size",
                "65536",
                "--iters",
                "20",
                "--timeout",
                "20",
            ],
            Duration::from_secs(120),
        );
        assert!(out.status.success(), "client --mode {mode}: {}", text(&out));
        assert!(text(&out).contains("Echo verified: 20 x 65536 bytes match"), "{}", text(&out));
    }
    let (rc, out) = srv.wait(Duration::from_secs(60));
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("3 client(s) served, 0 failed"), "{out}");
    p.wait_resources(&base, "after the demo");
    t.finish();
}

/// The examples under loss, reordering and duplication on both directions of the wire: every
/// byte is checked by the client, the server echoed exactly as many messages, and the transport
/// really did retransmit (its counters moved on one host or the other).
#[test]
fn soak_under_loss_reordering_and_duplication() {
    let t = DeviceTest::start();
    let p = peer();
    let base = p.resources();
    let wire = Wire::new(&p);
    let a = p.addr.to_string();
    for (loss, mode, size, iters) in [("1%", "send", "16384", "200"), ("5%", "write", "16384", "100")] {
        wire.netem("ab", &format!("loss {loss} delay 1ms reorder 25% 50% duplicate 2%"));
        let (b0, a0) = (counters(), p.counters());
        let srv = p.start(
            "soak-server",
            &[&example("perf_server"), "-a", &a, "-p", "7802", "--count", "1", "--timeout", "60"],
        );
        srv.wait_line("Listening on port 7802", Duration::from_secs(60));
        let start = Instant::now();
        let out = run_local(
            &[
                &example("perf_client"),
                "-a",
                &a,
                "-p",
                "7802",
                "--mode",
                mode,
                "--size",
                size,
                "--iters",
                iters,
                "--timeout",
                "60",
            ],
            Duration::from_secs(400),
        );
        let took = start.elapsed();
        assert!(out.status.success(), "client under {loss} loss: {}", text(&out));
        assert!(text(&out).contains(&format!("Echo verified: {iters} x {size} bytes match")), "{}", text(&out));
        let (rc, sout) = srv.wait(Duration::from_secs(120));
        assert_eq!(rc, 0, "{sout}");
        assert!(sout.contains("1 client(s) served, 0 failed"), "{sout}");
        if mode == "send" {
            assert!(sout.contains(&format!("Echoed {iters} messages of {size} bytes")), "{sout}");
        }
        let (b1, a1) = (counters(), p.counters());
        let retrans: u64 = ["duplicate_request", "out_of_seq_request", "rcvd_seq_err", "completer_retry_err"]
            .iter()
            .map(|k| delta(&b1, &b0, k) + delta(&a1, &a0, k))
            .sum();
        eprintln!(
            "measured: {loss} loss, {mode}, {iters} x {size} B: {took:?}; retransmission counters (both hosts) {retrans}; \
             packets sent B {} A {}",
            delta(&b1, &b0, "sent_pkts"),
            delta(&a1, &a0, "sent_pkts")
        );
        assert!(retrans > 0, "{loss} loss but no retransmission was counted: was the wire shaped?");
    }
    drop(wire);
    p.wait_resources(&base, "after the soak");
    t.finish();
}

/// Corrupted packets never reach the application: the echo of every message checks, and the
/// stages of the receiving hosts that dropped them are counted: frames the NIC took that IP
/// never saw (a flipped address or type), UDP datagrams that failed their checksum, and datagrams
/// UDP handed to rxe that rxe never counted as received (its ICRC check: a flipped payload bit,
/// or its header checks). The last must be non-zero: the transport itself drops corruption.
#[test]
fn corrupted_packets_are_dropped_never_delivered() {
    let t = DeviceTest::start();
    let p = peer();
    let base = p.resources();
    let wire = Wire::new(&p);
    let a = p.addr.to_string();
    // Received: frames at eth0, UDP datagrams delivered and checksum errors, rxe's packets.
    let stages = "echo eth $(cat /sys/class/net/eth0/statistics/rx_packets); \
                  awk '/^Udp:/{n++} n==2 && /^Udp:/{print \"udp\", $2; print \"udpcsum\", $8; exit}' /proc/net/snmp; \
                  awk '/^Ip:/{n++} n==2 && /^Ip:/{print \"ip\", $4; exit}' /proc/net/snmp; \
                  echo rxe $(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/rcvd_pkts)";
    let parse = |s: String| -> BTreeMap<String, u64> {
        s.lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(k, n)| (k.to_string(), n.trim().parse().unwrap_or(0)))
            .collect()
    };
    let (b0, a0) = (parse(sh_local(stages)), parse(p.sh(stages)));
    wire.netem("ab", "corrupt 5%");
    let srv = p
        .start("corrupt-server", &[&example("perf_server"), "-a", &a, "-p", "7803", "--count", "1", "--timeout", "60"]);
    srv.wait_line("Listening on port 7803", Duration::from_secs(60));
    let out = run_local(
        &[&example("perf_client"), "-a", &a, "-p", "7803", "--size", "4096", "--iters", "150", "--timeout", "60"],
        Duration::from_secs(300),
    );
    assert!(out.status.success(), "client under corruption: {}", text(&out));
    assert!(text(&out).contains("Echo verified: 150 x 4096 bytes match"), "{}", text(&out));
    let (rc, sout) = srv.wait(Duration::from_secs(120));
    assert_eq!(rc, 0, "{sout}");
    assert!(sout.contains("Echoed 150 messages of 4096 bytes"), "{sout}");
    let (b1, a1) = (parse(sh_local(stages)), parse(p.sh(stages)));
    let d = |k: &str| delta(&b1, &b0, k) + delta(&a1, &a0, k);
    let (eth, ip, udp, csum, rxe) = (d("eth"), d("ip"), d("udp"), d("udpcsum"), d("rxe"));
    let by_rxe = udp.saturating_sub(rxe);
    eprintln!(
        "measured: 5% corruption both ways, 150 x 4096 B echoed intact; received {eth} frames: {} dropped before IP, \
         {csum} by UDP's checksum, {by_rxe} by rxe (ICRC or header checks) of {udp} datagrams UDP delivered to it",
        eth.saturating_sub(ip)
    );
    assert!(by_rxe > 0, "5% of packets corrupted, yet rxe accepted every datagram UDP gave it: is the ICRC checked?");
    drop(wire);
    p.wait_resources(&base, "after the corruption run");
    t.finish();
}

/// The wire cut mid-transfer (host A's ACKs are lost from then on, as when a switch dies): the
/// sender's send fails with RETRY_EXC_ERR within (retry_count + 1) ACK timeouts; the example
/// server's wait ends at its --timeout; nothing leaks on either host; and
/// once the wire is back the same server accepts a new client.
#[test]
fn wire_cut_mid_transfer_fails_within_the_retry_bound_and_recovers() {
    let t = DeviceTest::start();
    let p = peer();
    let base = p.resources();
    let wire = Wire::new(&p);
    let a = p.addr.to_string();
    let srv =
        p.start("cut-server", &[&example("perf_server"), "-a", &a, "-p", "7804", "--count", "2", "--timeout", "8"]);
    srv.wait_line("Listening on port 7804", Duration::from_secs(60));
    let dst = SocketAddr::new(p.addr, 7804);
    let (run, client) = retry_exhaustion(&wire, dst, 3, None);
    // The receiver: the last send reached it (only host A's egress is cut), so it is waiting for
    // its echo's send completion. That wait ends at its own --timeout (8 s), or sooner when its
    // QP gives up: the retry count of the client's request applies to both QPs.
    let within = run.bound.max(Duration::from_secs(8)) + SLACK;
    srv.wait_line("[ERROR] client", within);
    let waited = run.cut.elapsed();
    let line = srv.out().lines().find(|l| l.contains("[ERROR] client")).unwrap_or_default().to_string();
    eprintln!("measured: the server's wait ended at most {waited:?} after the cut: {line}");
    assert!(line.contains("timed out after 8s") || line.contains("RETRY_EXC_ERR"), "{line}");
    assert!(waited <= within, "the server waited {waited:?}");
    drop(client);
    wire.clear();
    t.check("after the cut connection was dropped (host B)");
    let out = run_local(&[&example("perf_client"), "-a", &a, "-p", "7804", "--timeout", "20"], Duration::from_secs(60));
    assert!(out.status.success(), "a new client after the wire is back: {}", text(&out));
    let (rc, sout) = srv.wait(Duration::from_secs(60));
    assert_eq!(rc, 0, "{sout}");
    assert!(sout.contains("1 client(s) served, 1 failed"), "{sout}");
    drop(wire);
    p.wait_resources(&base, "after the cut and the new client");
    t.finish();
}

/// The ACK timeout (set on the id) and the retry count (ConnParam) change the time to
/// RETRY_EXC_ERR as (retry_count + 1) x 4.096 µs x 2^timeout says.
#[test]
fn ack_timeout_and_retry_count_set_the_failure_bound() {
    let t = DeviceTest::start();
    let p = peer();
    let base = p.resources();
    let a = p.addr.to_string();
    let srv =
        p.start("bound-server", &[&example("perf_server"), "-a", &a, "-p", "7805", "--count", "2", "--timeout", "5"]);
    srv.wait_line("Listening on port 7805", Duration::from_secs(60));
    let dst = SocketAddr::new(p.addr, 7805);
    let mut runs = Vec::new();
    for (retry, ack) in [(1u8, 16u8), (5, 16)] {
        let wire = Wire::new(&p);
        let (run, client) = retry_exhaustion(&wire, dst, retry, Some(ack));
        drop(client);
        drop(wire);
        runs.push(run);
    }
    let (short, long) = (&runs[0], &runs[1]);
    eprintln!(
        "measured: ACK timeout 2^16 x 4.096 us: retry_count {} -> {:?} (bound {:?}); retry_count {} -> {:?} (bound {:?})",
        short.retry, short.measured, short.bound, long.retry, long.measured, long.bound
    );
    assert_eq!((short.timeout_exp, long.timeout_exp), (16, 16));
    assert!(long.measured > short.measured, "6 tries took no longer than 2");
    let (rc, sout) = srv.wait(Duration::from_secs(60));
    assert_eq!(rc, 0, "{sout}");
    p.wait_resources(&base, "after the bound runs");
    t.finish();
}

/// A client that stops answering (SIGSTOP) never delays the server's other clients; a client
/// killed mid-transfer is noticed by the server within NOTICE; a server killed mid-transfer is
/// noticed by its client within NOTICE.
#[test]
fn silent_and_killed_peers_are_noticed_and_never_delay_others() {
    let t = DeviceTest::start();
    let p = peer();
    let base = p.resources();
    let a = p.addr.to_string();
    let srv = p.start("many-server", &[&example("perf_server"), "-a", &a, "-p", "7807", "--timeout", "30"]);
    srv.wait_line("Listening on port 7807", Duration::from_secs(60));
    let (mut silent, _lines) = streaming_client(&p, "7807", "4096", "30");
    sh_local(&format!("kill -STOP {}", silent.id()));
    // Another client is served while the silent one holds its connection (the server's --timeout is 30 s).
    let start = Instant::now();
    let other =
        run_local(&[&example("perf_client"), "-a", &a, "-p", "7807", "--timeout", "20"], Duration::from_secs(60));
    let took = start.elapsed();
    assert!(other.status.success(), "{}", text(&other));
    eprintln!("measured: another client served in {took:?} while one was silent");
    assert!(took < Duration::from_secs(20), "the other client waited {took:?}: the silent one delayed it");
    // Kill the silent client: its kernel disconnects it; the server notices within NOTICE.
    let before = srv.out().matches("[ERROR] client").count();
    silent.kill().unwrap();
    let killed = Instant::now();
    silent.wait().unwrap();
    wait_until(NOTICE + SLACK, "the server to notice the killed client", || {
        srv.out().matches("[ERROR] client").count() > before
    });
    eprintln!("measured: the server noticed the killed client after {:?}", killed.elapsed());
    // And the other way round: the server killed mid-transfer.
    let (busy, _lines) = streaming_client(&p, "7807", "4096", "30");
    srv.kill("KILL");
    let killed = Instant::now();
    let (rc, _) = srv.wait(Duration::from_secs(30));
    assert_eq!(rc, 137, "the server was killed");
    let out = peer::wait_output(busy, Duration::from_secs(60), "the client");
    let noticed = killed.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("measured: the client noticed the killed server after {noticed:?}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("peer disconnected"), "{err}");
    assert!(noticed < NOTICE + SLACK, "the client took {noticed:?} to notice");
    p.wait_resources(&base, "after the killed peers");
    t.finish();
}
