//! The perf tool (`examples/perftest`: `perf_server`, `perf_client`) run as processes on the
//! device: every mode's echo verified, perftest's latency and bandwidth tables, the server's
//! many clients (threads, and `--shared`), what it refuses, and no leaks under valgrind.

mod common;

// The perf tool's protocol module; its unit tests (request encoding, hostile requests) run here.
#[path = "../examples/perftest/protocol.rs"]
mod example_protocol;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::example;
use common::examples::{text, Srv};

fn client(args: &[&str]) -> Output {
    Command::new(example("perf_client")).args(args).output().expect("run perf_client")
}

/// perf_server on `port` for one client and, once it listens, perf_client with `client_args`;
/// both must succeed. Their stdouts.
fn demo(port: &str, client_args: &[&str]) -> (String, String) {
    let addr = common::device_addr().to_string();
    let srv = Srv::start("perf_server", &["-a", &addr, "-p", port, "--count", "1"]);
    let mut args = vec!["-a", &addr, "-p", port];
    args.extend_from_slice(client_args);
    let out = client(&args);
    let (cout, cerr) = text(&out);
    let (code, sout) = srv.finish();
    assert!(out.status.success(), "client failed:\n{cout}\n{cerr}\nserver:\n{sout}");
    assert_eq!(code, 0, "server failed:\n{sout}");
    (cout, sout)
}

/// Write mode rings the peer after each RDMA WRITE with what the device has: immediate data
/// (InfiniBand, RoCE), or a SEND after the WRITE (iWARP, which has no immediate data); the send
/// doorbell runs on every device when asked for. Read mode needs nothing the devices differ in.
#[test]
fn demo_write_and_read_modes_verify_the_echo() {
    let iwarp = common::caps::iwarp();
    let (c, s) = demo("7602", &["--mode", "write", "--size", "65536"]);
    assert!(c.contains("Echo verified: 1 x 65536 bytes match"), "{c}");
    let auto = if iwarp { "a send after the WRITE" } else { "immediate data" };
    assert!(c.contains(&format!("Write mode rings the peer with {auto}")), "{c}");
    assert!(s.contains(&format!("Each RDMA WRITE is rung with {auto}, as the client asked")), "{s}");
    let (c, s) = demo("7635", &["--mode", "write", "--size", "4096", "--iters", "50", "--doorbell", "send"]);
    assert!(c.contains("Echo verified: 50 x 4096 bytes match"), "{c}");
    assert!(s.contains("Each RDMA WRITE is rung with a send after the WRITE"), "{s}");
    let (c, _) = demo("7603", &["--mode", "read", "--size", "1048576"]);
    assert!(c.contains("Echo verified: 1 x 1048576 bytes match"), "{c}");
    if iwarp {
        // Immediate data asked for where the device has none: one line naming what is missing.
        let addr = common::device_addr().to_string();
        let srv = Srv::start("perf_server", &["-a", &addr, "-p", "7636", "--count", "1"]);
        let out = client(&["-a", &addr, "-p", "7636", "--mode", "write", "--doorbell", "imm"]);
        let err = text(&out).1;
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("ibv_post_send failed: EINVAL") && err.contains("iWARP: immediate data"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        let (code, s) = srv.finish();
        assert_eq!(code, 0, "the server survives the client's failure:\n{s}");
    }
}

/// The atomic modes: every fetch-and-add and compare-and-swap finds the value the client
/// expects on the server's counter, and the server finds the counter at the iteration count.
#[test]
fn demo_atomic_modes_move_the_servers_counter() {
    if !common::require(common::Cap::Atomics) {
        return;
    }
    let (c, s) = demo("7630", &["--mode", "fetch-add", "--iters", "300"]);
    assert!(c.contains("Atomics verified: 300 x fetch-add returned the expected values"), "{c}");
    assert!(c.contains("#bytes #iterations") && s.contains("Counter is 300 after 300 fetch-add(s)"), "{c}\n{s}");
    let (c, s) = demo("7631", &["--mode", "cmp-swap"]);
    assert!(c.contains("cmp-swap: the counter was 0") && c.contains("Atomics verified: 1 x cmp-swap"), "{c}");
    assert!(s.contains("Counter is 1 after 1 cmp-swap(s)"), "{s}");
}

/// `--busy-poll` on both ends: the echo runs and the latency table is printed as without it.
#[test]
fn demo_busy_poll_mode_runs_the_latency_table() {
    let addr = common::device_addr().to_string();
    let srv = Srv::start("perf_server", &["-a", &addr, "-p", "7632", "--count", "1", "--busy-poll"]);
    let out = client(&["-a", &addr, "-p", "7632", "--size", "2", "--iters", "300", "--busy-poll"]);
    let (c, cerr) = text(&out);
    let (code, s) = srv.finish();
    assert!(out.status.success() && code == 0, "{c}{cerr}\n{s}");
    let row = c.lines().skip_while(|l| !l.contains("#bytes")).nth(1).expect("a result row");
    assert!(row.split_whitespace().take(2).eq(["2", "300"]), "{row}");
    assert!(s.contains("Echoed 300 messages of 2 bytes"), "{s}");
}

#[test]
fn demo_iterations_print_a_perftest_latency_table() {
    let (c, s) = demo("7604", &["--size", "2", "--iters", "200"]);
    assert!(c.contains("#bytes #iterations    t_min[usec]"), "{c}");
    let row = c.lines().skip_while(|l| !l.contains("#bytes")).nth(1).expect("a result row");
    let f: Vec<&str> = row.split_whitespace().collect();
    assert_eq!((f[0], f[1]), ("2", "200"), "{row}");
    let nums: Vec<f64> = f[2..].iter().map(|x| x.parse().unwrap()).collect();
    assert_eq!(nums.len(), 7);
    assert!(nums[0] > 0.0 && nums[0] <= nums[2] && nums[2] <= nums[1], "min <= typical <= max: {row}");
    assert!(s.contains("Echoed 200 messages of 2 bytes"), "{s}");
}

/// `--bw`: the client streams sends and RDMA WRITEs, a region per request (post lists of 8
/// with one completion in 16, of 4 with one in 64, of 16 with one in 7 over a ring of 20) and
/// in batches (`--post-list` equal to `--cq-mod`: batches of 8 sends, of 16 WRITEs, one batch
/// as deep as the queue), prints perftest's bandwidth table with one row of the size and
/// iteration count asked for, and the data arrived: the server counted every send and checked its length and content,
/// and the write stream is followed by a verified round trip.
#[test]
fn demo_bw_modes_print_perftests_bandwidth_table_and_the_data_arrives() {
    let row_of = |c: &str| -> Vec<f64> {
        assert!(c.contains(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"), "{c}");
        let row = c.lines().skip_while(|l| !l.contains("#bytes")).nth(1).expect("a result row");
        let f: Vec<f64> = row.split_whitespace().map(|x| x.parse().expect("a number")).collect();
        assert_eq!(f.len(), 5, "{row}");
        // Bandwidth is size x message rate; the peak is at least the average. The rate is the
        // figure checked for being positive: 2-byte messages print a bandwidth of 0.00 MB/s
        // below 2,600 messages per second, which a loaded guest can fall to.
        assert!(f[2] >= f[3] && f[4] > 0.0, "{row}");
        assert!((f[3] - f[0] * f[4] * 1e6 / 1048576.0).abs() <= 0.02 * f[3] + 0.01, "BW = size x rate: {row}");
        f
    };
    // One stream: `batches` is the batch length it is expected to use, `None` for a region per
    // request. A send stream is checked by the server (count, lengths, content), a WRITE
    // stream by the verified round trip after it.
    let stream = |port: &str, args: &str, batches: Option<u32>| {
        let args: Vec<&str> = args.split_whitespace().collect();
        let arg = |flag: &str| args[args.iter().position(|a| *a == flag).expect("the flag") + 1];
        let (size, iters) = (arg("--size"), arg("--iters"));
        let (c, s) = demo(port, &args);
        match batches {
            Some(l) => assert!(c.contains(&format!("Streaming in batches of {l} work requests")), "{c}"),
            None => assert!(!c.contains("Streaming in batches"), "{c}"),
        }
        assert_eq!(row_of(&c)[..2], [size.parse::<f64>().unwrap(), iters.parse().unwrap()], "{c}");
        if arg("--mode") == "send" {
            let sent = format!("Stream verified: the server received {iters} x {size} bytes, content matched");
            assert!(c.contains(&sent), "{c}");
            let got = format!("Received a stream of {iters} messages of {size} bytes (lengths and content checked)");
            assert!(s.contains(&got), "{s}");
        } else {
            assert!(c.contains(&format!("Echo verified: 1 x {size} bytes match")), "{c}");
        }
    };
    // A region per request: lists of 8 with one completion in 16; lists of 4 with one in 64;
    // a ring of 20 requests posted in lists of 16, so lists end at the ring's end and the
    // signaled ones (one in 7) fall anywhere in them.
    stream("7633", "--bw --mode send --size 64 --iters 3000 --post-list 8 --cq-mod 16", None);
    stream("7634", "--bw --mode write --size 2 --iters 2000 --post-list 4 --cq-mod 64", None);
    stream("7639", "--bw --mode send --size 64 --iters 1001 --tx-depth 20 --post-list 16 --cq-mod 7", None);
    // perftest's `-l 8 -Q 8`: each list is one batch over one region, retired by one
    // completion; 16 batches take turns (a depth of 128).
    stream("7640", "--bw --mode send --size 4096 --iters 2000 --post-list 8 --cq-mod 8", Some(8));
    // Batches of 16 WRITEs, 4 of them in flight, then the verified round trip.
    stream("7641", "--bw --mode write --size 64 --iters 1600 --tx-depth 64 --post-list 16 --cq-mod 16", Some(16));
    // One batch of 8 as deep as the queue, posted again as soon as it completes (3 times).
    stream("7642", "--bw --mode send --size 64 --iters 24 --tx-depth 8 --post-list 8 --cq-mod 8", Some(8));
    // A count that lists of 8 do not divide: a region per request, as before.
    stream("7643", "--bw --mode send --size 64 --iters 100 --post-list 8 --cq-mod 8", None);
}

/// The --bw options refuse what would not run: another mode, an empty or too long post list,
/// no signaling at all.
#[test]
fn bw_options_out_of_range_are_refused() {
    let cases: [(&[&str], &str); 4] = [
        (&["--bw", "--mode", "read"], "--bw streams sends or RDMA WRITEs"),
        (&["--bw", "--post-list", "0"], "--post-list 0 is outside 1..=--tx-depth (128)"),
        (&["--bw", "--tx-depth", "4", "--post-list", "8"], "--post-list 8 is outside 1..=--tx-depth (4)"),
        (&["--bw", "--cq-mod", "0"], "--cq-mod must be at least 1"),
    ];
    for (extra, msg) in cases {
        let mut args = vec!["-a", "10.0.0.1"];
        args.extend_from_slice(extra);
        let out = client(&args);
        assert_eq!(out.status.code(), Some(1), "{extra:?}");
        assert!(text(&out).1.contains(msg), "{extra:?}: {:?}", text(&out));
    }
}

#[test]
fn server_survives_a_killed_client_and_serves_the_next() {
    let addr = common::device_addr().to_string();
    let mut srv = Srv::start("perf_server", &["-a", &addr, "-p", "7607", "--count", "2", "--timeout", "5"]);
    let mut victim = Command::new(example("perf_client"))
        .args(["-a", &addr, "-p", "7607", "--iters", "1000000", "--size", "64"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once the server has it connected (on a busy machine that can take a while), so
    // the kill lands mid-transfer rather than before the client connected.
    srv.wait_line("[EVENT] Connection established", Duration::from_secs(120));
    victim.kill().unwrap(); // SIGKILL mid-transfer
    victim.wait().unwrap();
    let out = client(&["-a", &addr, "-p", "7607"]);
    assert!(out.status.success(), "{:?}", text(&out));
    let (code, s) = srv.finish();
    assert_eq!(code, 0, "{s}");
    assert!(s.contains("1 client(s) served, 1 failed"), "{s}");
    assert!(s.contains("peer disconnected"), "the survivor names the cause:\n{s}");
}

#[test]
fn server_exits_cleanly_on_sigterm() {
    let addr = common::device_addr().to_string();
    let srv = Srv::start("perf_server", &["-a", &addr, "-p", "7608"]);
    // SAFETY: kill(2) on our own child's pid with a valid signal.
    assert_eq!(unsafe { libc::kill(srv.child.id() as i32, libc::SIGTERM) }, 0);
    let (code, s) = srv.finish();
    assert_eq!(code, 0, "{s}");
    assert!(s.contains("Server exiting: 0 client(s) served"), "{s}");
}

/// Connects with `private_data` through the library; returns the connect error.
fn connect_with(dst: std::net::SocketAddr, private_data: &[u8]) -> rdma_cm::Error {
    use rdma_cm::{Client, ConnParam, QpInit};
    let t = Duration::from_secs(10);
    let route = Client::new().unwrap().resolve_addr(None, dst, t).unwrap().resolve_route(t).unwrap();
    let pd = route.alloc_pd().unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    q.connect(&ConnParam::new().private_data(private_data).unwrap(), t).expect_err("the server must reject this")
}

#[test]
fn hostile_private_data_is_rejected_with_a_reason_and_the_server_keeps_serving() {
    use example_protocol::{Mode, Request};
    use rdma_cm::{CmEventType, Error, QpInfo};
    let addr = common::device_addr();
    let good = Request {
        info: QpInfo { qp_num: 0x42, psn: 0, rkey: 7, vaddr: 0x10000, len: 4096 },
        mode: Mode::Write,
        size: 4096,
        iters: 1,
        send_doorbell: false,
    };
    let enc = good.encode();
    let mut cases: Vec<(Vec<u8>, &str)> = vec![];
    let mut b = enc;
    b[2] = 9; // QpInfo version
    cases.push((b.to_vec(), "version"));
    // The request's own bytes follow the QpInfo: version, mode, size.
    let req = QpInfo::ENCODED_LEN;
    let mut b = enc;
    b[req + 1] = 7; // mode
    cases.push((b.to_vec(), "mode"));
    let mut b = enc;
    b[req + 2..req + 6].copy_from_slice(&u32::MAX.to_be_bytes()); // absurd size
    cases.push((b.to_vec(), "size"));
    let mut b = enc;
    b[24..32].copy_from_slice(&16u64.to_be_bytes()); // advertised region smaller than the size
    cases.push((b.to_vec(), "smaller"));
    let mut b = enc;
    b[16..24].copy_from_slice(&u64::MAX.to_be_bytes()); // region wrapping the address space
    cases.push((b.to_vec(), "wraps"));
    // Wrong length: InfiniBand's CM pads it with zeros (so the version byte is 0); iWARP's MPA
    // carries the 2 bytes as they are.
    cases.push((b"RC".to_vec(), if common::caps::iwarp() { "shorter" } else { "version" }));
    let srv =
        Srv::start("perf_server", &["-a", &addr.to_string(), "-p", "7611", "--count", &(cases.len() + 1).to_string()]);
    let dst = std::net::SocketAddr::new(addr, 7611);
    // The consumer's reject: IB CM reason 28; iWARP's is an MPA reject, -ECONNRESET.
    let reject = if common::caps::iwarp() { -libc::ECONNRESET } else { 28 };
    for (bytes, reason) in &cases {
        match connect_with(dst, bytes) {
            Error::UnexpectedEvent { got: CmEventType::Rejected, status, private_data, .. } if status == reject => {
                let why = String::from_utf8_lossy(&private_data);
                assert!(why.contains(reason), "rejection should say {reason:?}, said {why:?}");
            }
            e => panic!("expected a consumer reject for {reason}, got {e:?}"),
        }
    }
    let out = client(&["-a", &addr.to_string(), "-p", "7611"]);
    assert!(out.status.success(), "a good client after the hostile ones: {:?}", text(&out));
    let (code, s) = srv.finish();
    assert_eq!(code, 0, "{s}");
    assert!(s.contains(&format!("1 client(s) served, {} failed", cases.len())), "{s}");
}

#[test]
fn sizes_beyond_the_limits_are_refused() {
    let out = client(&["-a", "10.0.0.1", "--size", "100000000"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("outside 1..=67108864"), "{:?}", text(&out));
    let out = client(&["-a", "10.0.0.1", "--size", "4294967296"]);
    assert_eq!(out.status.code(), Some(2), "clap refuses a size that is not a u32");
}

/// The CPU time `pid` has used so far, in clock ticks (`utime` + `stime` of `/proc/PID/stat`),
/// or `None` once it is gone. Valgrind runs the program in its own process (the launcher execs
/// the tool), so this is the program's progress: it grows while valgrind translates code, on a
/// loaded machine too, and stops growing only when the process waits.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces: state is
    // field 3, utime 14 and stime 15.
    let f: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// How long a program under valgrind may go without using any CPU before it counts as stuck,
/// and how long it may run in all however busy it stays. A slow machine (other guests beside
/// this one, all under TCG) only stretches the time valgrind keeps using CPU: the bounds below
/// are about a process that stopped, not about how fast it goes.
struct Watch {
    /// No CPU used for this long: stuck (its own waits are shorter).
    stall: Duration,
    /// In all, busy or not.
    outer: Duration,
}

/// A child under valgrind, whose stdout and stderr lines are collected by threads (so a full
/// pipe never blocks it), killed if the test fails before it exits.
struct Watched {
    child: Child,
    what: &'static str,
    lines: mpsc::Receiver<(bool, String)>,
    out: Vec<String>,
    err: Vec<String>,
    readers: Vec<thread::JoinHandle<()>>,
}

impl Watched {
    fn spawn(what: &'static str, cmd: &mut Command) -> Watched {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn valgrind");
        let (tx, lines) = mpsc::channel();
        let mut readers = vec![];
        for (is_err, r) in [
            (false, Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>),
            (true, Box::new(child.stderr.take().unwrap())),
        ] {
            let tx = tx.clone();
            readers.push(thread::spawn(move || {
                for l in BufReader::new(r).lines().map_while(Result::ok) {
                    if tx.send((is_err, l)).is_err() {
                        break;
                    }
                }
            }));
        }
        Watched { child, what, lines, out: vec![], err: vec![], readers }
    }

    /// Takes the lines the readers have sent so far.
    fn drain(&mut self) {
        while let Ok((is_err, l)) = self.lines.try_recv() {
            if is_err { &mut self.err } else { &mut self.out }.push(l);
        }
    }

    fn log(&self) -> String {
        format!("{}\n{}", self.out.join("\n"), self.err.join("\n"))
    }

    /// Waits until `done` says so (asked after every line and every second), for as long as the
    /// child uses CPU or `done` sees new lines, within `w`. Returns how long it took.
    fn wait(&mut self, w: &Watch, expecting: &str, mut done: impl FnMut(&mut Self) -> bool) -> Duration {
        let start = Instant::now();
        let (mut ticks, mut moved) = (cpu_ticks(self.child.id()), Instant::now());
        while !done(self) {
            match self.lines.recv_timeout(Duration::from_secs(1)) {
                Ok((is_err, l)) => {
                    if is_err { &mut self.err } else { &mut self.out }.push(l);
                    moved = Instant::now();
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Both pipes closed: the child has exited or is about to.
                    thread::sleep(Duration::from_millis(20));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            let exited = self.readers.iter().all(|r| r.is_finished()) && self.child.try_wait().unwrap().is_some();
            if exited {
                self.drain();
            }
            assert!(
                !exited || done(self),
                "{} under valgrind exited before {expecting}; its output:\n{}",
                self.what,
                self.log()
            );
            let now = cpu_ticks(self.child.id());
            if now != ticks {
                (ticks, moved) = (now, Instant::now());
            }
            let waited = start.elapsed();
            assert!(
                moved.elapsed() < w.stall && waited < w.outer,
                "{} under valgrind: {expecting} did not happen: {} (after {waited:?}); its output:\n{}",
                self.what,
                if waited >= w.outer {
                    format!("still running after the outer bound of {:?}", w.outer)
                } else {
                    format!("it used no CPU and printed nothing for {:?}", w.stall)
                },
                self.log()
            );
        }
        start.elapsed()
    }

    /// Waits for a line of the child's stdout containing `needle`.
    fn wait_line(&mut self, w: &Watch, needle: &str) -> Duration {
        let expecting = format!("the line {needle:?}");
        self.wait(w, &expecting, |s| s.out.iter().any(|l| l.contains(needle)))
    }

    /// Waits for the child to exit and for the rest of its output; returns whether it
    /// succeeded, and its stdout and stderr (valgrind's report) as one text.
    fn finish(mut self, w: &Watch) -> (bool, String) {
        let mut status = None;
        self.wait(w, "its exit", |s| {
            status = status.or_else(|| s.child.try_wait().unwrap());
            status.is_some() && s.readers.iter().all(|r| r.is_finished())
        });
        self.drain();
        (status.unwrap().success(), self.log())
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        // Only reached with the child running when the test failed: do not leave it behind.
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The "definitely lost" byte count in valgrind's report (`u64::MAX` when there is none).
fn definitely_lost_in(log: &str) -> u64 {
    let lost = log
        .lines()
        .find(|l| l.contains("definitely lost:"))
        .and_then(|l| l.split("definitely lost:").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .map(|n| n.replace(',', "").parse::<u64>().unwrap());
    let clean = log.contains("All heap blocks were freed") || log.contains("no leaks are possible");
    lost.unwrap_or(if clean { 0 } else { u64::MAX })
}

/// Runs `cmd` under valgrind memcheck, watched (see [`Watch`]); returns whether it succeeded,
/// its "definitely lost" byte count and its output with valgrind's report.
fn definitely_lost(what: &'static str, cmd: &[&str], w: &Watch) -> (bool, u64, String) {
    let mut c = Command::new("valgrind");
    c.args(["--leak-check=full", "--show-leak-kinds=definite", "--error-exitcode=0"])
        .args(cmd)
        // The other tests of this binary use the device meanwhile: a test binary run here must
        // not count their RDMA objects as its own.
        .env(common::SHARED_DEVICE_ENV, "1");
    let (ok, log) = Watched::spawn(what, &mut c).finish(w);
    (ok, definitely_lost_in(&log), log)
}

/// The server, the client and the zero-allocation test binary under valgrind memcheck, which
/// runs them tens of times slower (more with other guests on the machine). No bound here is a
/// guess at valgrind's speed: each process is waited for while it keeps using CPU (see
/// [`Watch`]), and the client's own waits, which depend on the server's pace under valgrind, are
/// scaled by how long the server took to start.
#[test]
fn examples_and_an_integration_test_have_no_definite_leaks_under_valgrind() {
    let addr = common::device_addr().to_string();
    let outer = Duration::from_secs(20 * 60);
    // Nothing the server does before listening waits for anyone: a minute without CPU is stuck.
    let starting = Watch { stall: Duration::from_secs(60), outer };
    let mut srv = Watched::spawn(
        "the server",
        Command::new("valgrind")
            .args(["--leak-check=full", "--show-leak-kinds=definite"])
            .arg(example("perf_server"))
            // Its waits for the client (which starts under valgrind too) are bounded by the
            // watch below; the server exits once it has served its two clients.
            .args(["-a", &addr, "-p", "7615", "--count", "2", "--timeout", "600"]),
    );
    let startup = srv.wait_line(&starting, "Listening on port 7615");
    eprintln!("measured: the server under valgrind listened after {startup:?}");
    // The client's steps wait for the server, whose accept path valgrind translates as slowly
    // as it did the start: give each wait a minute beyond that start.
    let client_timeout = Duration::from_secs(60) + startup;
    let client_watch = Watch { stall: client_timeout + Duration::from_secs(60), outer };
    let secs = client_timeout.as_secs().to_string();
    // A client at full speed first, so that valgrind has translated the server's accept path
    // before the client under valgrind connects: iWARP's handshake does not wait for a slow
    // accept (Soft-iWARP's active side gives the MPA reply 5 s, then UNREACHABLE, ETIMEDOUT;
    // measured with this test on siw, whose first accept under valgrind took longer).
    // On iWARP that first client may itself meet the slow first accept; the server's accept
    // path has run all the same.
    let warm = client(&["-a", &addr, "-p", "7615", "--timeout", &secs]);
    if common::caps::iwarp() {
        eprintln!("measured: the first client (not under valgrind) exited with {}", warm.status);
    } else {
        assert!(warm.status.success(), "the first client, not under valgrind: {:?}", text(&warm));
    }
    let client = example("perf_client");
    let (ok, lost, log) = definitely_lost(
        "the client",
        &[client.to_str().unwrap(), "-a", &addr, "-p", "7615", "--timeout", &secs],
        &client_watch,
    );
    assert!(ok, "client under valgrind failed:\n{log}");
    assert_eq!(lost, 0, "client leaks:\n{log}");
    let (ok, slog) = srv.finish(&client_watch);
    assert!(ok, "server under valgrind failed:\n{slog}");
    let clean = slog.contains("definitely lost: 0 bytes") || slog.contains("All heap blocks were freed");
    assert!(clean, "server leaks:\n{slog}");
    // One integration-test binary: the zero-allocation test, run whole.
    let alloc = common::examples::test_binary("alloc");
    // Its own waits are 10 s at most (and its connects take T): two minutes without CPU is stuck.
    let alloc_watch = Watch { stall: Duration::from_secs(120), outer };
    let (ok, lost, log) =
        definitely_lost("the alloc test", &[alloc.to_str().unwrap(), "--test-threads=1"], &alloc_watch);
    assert!(ok, "alloc test under valgrind failed:\n{log}");
    assert_eq!(lost, 0, "alloc test leaks:\n{log}");
}

/// `perf_server --shared`: one thread, one event channel, one CQ and one SRQ serve ten clients at
/// once (every echo checked by the clients), while an eleventh client connects and stays
/// silent: nobody waits for it, and the server drops it after its --timeout.

#[test]
fn shared_server_serves_clients_at_once_and_a_silent_one_delays_nobody() {
    use rdma_cm::{Client, ConnParam, QpInit};
    let addr = common::device_addr().to_string();
    let mut srv =
        Srv::start("perf_server", &["-a", &addr, "-p", "7620", "--shared", "--count", "11", "--timeout", "30"]);
    // The silent client: connected through the library (legacy protocol), never sends.
    let dst: std::net::SocketAddr = format!("{addr}:7620").parse().unwrap();
    let t = Duration::from_secs(30);
    let route = Client::new().unwrap().resolve_addr(None, dst, t).unwrap().resolve_route(t).unwrap();
    let pd = route.alloc_pd().unwrap();
    let silent = route.create_qp(&pd, QpInit::new()).unwrap().connect(&ConnParam::new(), t).unwrap();
    srv.wait_line("1 connected", Duration::from_secs(60));
    let clients: Vec<_> = (0..10)
        .map(|_| {
            Command::new(example("perf_client"))
                .args(["-a", &addr, "-p", "7620", "--iters", "100", "--size", "512", "--timeout", "30"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = clients.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    if let Some(bad) = outs.iter().find(|o| !o.status.success()) {
        let (o, e) = text(bad);
        let _ = srv.child.kill();
        let (_, s) = srv.finish();
        panic!("a client failed while the silent one was connected:\n{o}\n{e}\nserver:\n{s}");
    }
    for out in &outs {
        let (o, _) = text(out);
        assert!(o.contains("Echo verified: 100 x 512 bytes match"), "{o}");
    }
    // The ten were served while the silent one held its connection.
    srv.wait_line("silent for", Duration::from_secs(120));
    let (code, s) = srv.finish();
    drop((silent, pd));
    assert_eq!(code, 0, "{s}");
    assert!(s.contains("10 client(s) served, 1 failed"), "{s}");
    assert!(s.contains("shared: one thread, one channel, one CQ, one SRQ"), "{s}");
}
