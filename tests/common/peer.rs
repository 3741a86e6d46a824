//! Host A of harness/two-host, seen from host B: its processes (started, watched and killed
//! through the control directory both guests share; the protocol is harness/peer-agent's), this
//! host's processes, both hosts' rxe counters and resources, and the wire between them.
#![allow(dead_code)] // each two-host test binary uses part of this module

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::Receiver;
use std::thread;
use std::time::{Duration, Instant};

/// Within this a survivor must notice that its peer's process died (the kernel disconnects it).
pub const NOTICE: Duration = Duration::from_secs(5);
/// Slack for a guest under TCG on a loaded machine, on top of every computed bound.
pub const SLACK: Duration = Duration::from_secs(3);
pub const NETDEV: &str = "eth0";

// ---------------------------------------------------------------------------------------------
// Host A, through the control directory (the protocol is harness/peer-agent's).

/// Host A of harness/two-host.
pub struct Peer {
    jobs: PathBuf,
    pub addr: IpAddr,
}

pub static JOBS: AtomicU32 = AtomicU32::new(0);

pub fn peer() -> Peer {
    let ctl = std::env::var("RDMA_TWOHOST_CTL").unwrap_or_else(|_| {
        panic!(
            "the two-host tests need a second host: run them through `cargo test --test twohost` (cargo's runner \
             starts two guests with harness/two-host) or inside `harness/two-host -- ...`"
        )
    });
    let addr = std::env::var("RDMA_PEER_ADDR").expect("RDMA_PEER_ADDR (set by harness/two-host)").parse().unwrap();
    let ready = Path::new(&ctl).join("ready");
    wait_until(Duration::from_secs(180), "host A's agent to come up", || ready.exists());
    Peer { jobs: Path::new(&ctl).join("jobs"), addr }
}

/// A process on host A.
pub struct Job {
    dir: PathBuf,
    peer_jobs: PathBuf,
}

/// POSIX sh quoting, as harness/peer does.
pub fn shquote(words: &[&str]) -> String {
    words.iter().map(|w| format!("'{}'", w.replace('\'', "'\\''"))).collect::<Vec<_>>().join(" ")
}

pub fn wait_until(within: Duration, what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "waited {within:?} for {what}");
        thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

impl Peer {
    pub fn start(&self, name: &str, argv: &[&str]) -> Job {
        let dir = self.jobs.join(format!("{name}.{}.{}", std::process::id(), JOBS.fetch_add(1, Ordering::SeqCst)));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cmd.tmp"), format!("exec {}\n", shquote(argv))).unwrap();
        std::fs::rename(dir.join("cmd.tmp"), dir.join("cmd")).unwrap();
        let pid = dir.join("pid");
        wait_until(Duration::from_secs(30), &format!("host A to start {argv:?}"), || pid.exists());
        Job { dir, peer_jobs: self.jobs.clone() }
    }

    /// Powers host A off at once, as a power failure would: harness/two-host, told through the
    /// control directory, kills host A's QEMU within about 50 ms (no process there is told, and
    /// harness/two-host does not report host A's end as a failure). Nothing runs there after.
    pub fn poweroff(&self) {
        let ctl = self.jobs.parent().unwrap();
        std::fs::write(ctl.join("host-a-powered-off"), b"").unwrap();
    }

    /// Whether host A's QEMU is gone (harness/two-host says so once it killed it).
    pub fn is_gone(&self) -> bool {
        self.jobs.parent().unwrap().join("host-a-gone").exists()
    }

    /// Runs `script` with sh on host A; panics unless it exits 0. Returns its output.
    pub fn sh(&self, script: &str) -> String {
        let (rc, out) = self.start("sh", &["sh", "-c", script]).wait(Duration::from_secs(60));
        assert_eq!(rc, 0, "on host A: {script}\n{out}");
        out
    }

    /// User-space RDMA objects on host A (as `common::resources` counts them here).
    pub fn resources(&self) -> Vec<(String, usize)> {
        let out = self.sh(
            "for k in qp cq mr pd cm_id; do echo \"$k $(rdma res show $k | grep -v 'comm \\[' | grep -c .)\"; done",
        );
        out.lines().filter_map(|l| l.split_once(' ')).map(|(k, n)| (k.to_string(), n.trim().parse().unwrap())).collect()
    }

    /// Waits (bounded) until host A's counts are back to `base`.
    pub fn wait_resources(&self, base: &[(String, usize)], when: &str) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let now = self.resources();
            if now.iter().zip(base).all(|((_, n), (_, b))| n <= b) {
                return;
            }
            assert!(Instant::now() < deadline, "host A leaked RDMA resources {when}: {now:?}, baseline {base:?}");
            thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn counters(&self) -> BTreeMap<String, u64> {
        parse_counters(&self.sh("cd /sys/class/infiniband/rxe0/ports/1/hw_counters && grep . *"))
    }
}

impl Job {
    pub fn out(&self) -> String {
        std::fs::read_to_string(self.dir.join("out")).unwrap_or_default()
    }
    pub fn rc(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.join("rc")).ok().and_then(|s| s.trim().parse().ok())
    }
    /// Waits for a line of its output containing `needle`; returns how long that took.
    pub fn wait_line(&self, needle: &str, within: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if self.out().contains(needle) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < within && self.rc().is_none(),
                "host A's job did not print {needle:?} within {within:?} (exit {:?}):\n{}",
                self.rc(),
                self.out()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }
    /// Waits for it to end: its exit status and output. Kills it (and panics) past `within`.
    pub fn wait(&self, within: Duration) -> (i32, String) {
        let start = Instant::now();
        while self.rc().is_none() {
            if start.elapsed() > within {
                self.kill("KILL");
                panic!("host A's job did not end within {within:?}: killed. Its output:\n{}", self.out());
            }
            thread::sleep(Duration::from_millis(50));
        }
        (self.rc().unwrap(), self.out())
    }
    /// Sends `sig` unless it has ended already (a job that may end on its own: no race).
    pub fn end(&self, sig: &str) {
        let pid = std::fs::read_to_string(self.dir.join("pid")).unwrap();
        let p = Peer { jobs: self.peer_jobs.clone(), addr: IpAddr::from([0, 0, 0, 0]) };
        p.sh(&format!("kill -s {sig} {} 2>/dev/null; true", pid.trim()));
    }
    pub fn kill(&self, sig: &str) {
        let pid = std::fs::read_to_string(self.dir.join("pid")).unwrap();
        let p = Peer { jobs: self.peer_jobs.clone(), addr: IpAddr::from([0, 0, 0, 0]) };
        p.sh(&format!("kill -s {sig} {}", pid.trim()));
    }
}

// ---------------------------------------------------------------------------------------------
// This host (B) and the wire.

/// The example program `name`, built (see `common::examples`), as a command-line word.
pub fn example(name: &str) -> String {
    crate::common::example(name).to_string_lossy().into_owned()
}

/// Starts the example client here, streaming RDMA WRITEs of `size` bytes to host A's server on
/// `port` without end (each of its waits bounded by `timeout` seconds), and returns it once it
/// is connected, with stdout and stderr piped; keep the receiver of its lines while it runs.
pub fn streaming_client(peer: &Peer, port: &str, size: &str, timeout: &str) -> (Child, Receiver<String>) {
    streaming_client_with(peer, port, size, timeout, &[])
}

/// [`streaming_client`] with more arguments for the client.
pub fn streaming_client_with(
    peer: &Peer,
    port: &str,
    size: &str,
    timeout: &str,
    more: &[&str],
) -> (Child, Receiver<String>) {
    let a = peer.addr.to_string();
    let args = ["-a", &a, "-p", port, "--mode", "write", "--size", size, "--iters", "10000000", "--timeout", timeout];
    let mut client = Command::new(example("perf_client"))
        .args(args)
        .args(more)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = crate::common::lines_of(&mut client);
    crate::common::wait_for_line(&lines, "[EVENT] Connection established", Duration::from_secs(60));
    (client, lines)
}

/// Runs a command here, bounded; kills it past `within`.
pub fn run_local(argv: &[&str], within: Duration) -> Output {
    let child = Command::new(argv[0])
        .args(&argv[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    wait_output(child, within, &format!("{argv:?}"))
}

/// Waits for a child of this process, bounded; kills it (and panics) past `within`.
pub fn wait_output(child: std::process::Child, within: Duration, what: &str) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{what} did not end within {within:?}: killed");
        }
    }
}

pub fn sh_local(script: &str) -> String {
    let out = run_local(&["sh", "-c", script], Duration::from_secs(60));
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

pub fn parse_counters(s: &str) -> BTreeMap<String, u64> {
    s.lines()
        .filter_map(|l| l.split_once(':'))
        .filter_map(|(k, v)| Some((k.to_string(), v.trim().parse().ok()?)))
        .collect()
}

pub fn counters() -> BTreeMap<String, u64> {
    parse_counters(&sh_local("cd /sys/class/infiniband/rxe0/ports/1/hw_counters && grep . *"))
}

pub fn delta(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>, key: &str) -> u64 {
    after.get(key).copied().unwrap_or(0) - before.get(key).copied().unwrap_or(0)
}

/// A shell script that waits (bounded, polling sysfs) until port 1's state contains `word`.
pub fn port_state_script(word: &str) -> String {
    let dev = crate::common::caps::device_under_test();
    format!(
        "for i in $(seq 1200); do grep -q {word} /sys/class/infiniband/{dev}/ports/1/state && exit 0; sleep 0.05; done; \
         echo \"{dev} port not {word}: $(cat /sys/class/infiniband/{dev}/ports/1/state)\" >&2; exit 1"
    )
}

pub fn port_active_script() -> &'static str {
    "for i in $(seq 200); do grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state && exit 0; sleep 0.05; done; \
     echo 'rxe0 port not ACTIVE'; exit 1"
}

/// The wire as a test shapes it; on drop (a failing test included) both ends are put back:
/// no qdisc, links up, both ports ACTIVE.
pub struct Wire<'a> {
    peer: &'a Peer,
}

impl<'a> Wire<'a> {
    pub fn new(peer: &'a Peer) -> Wire<'a> {
        Wire { peer }
    }
    /// `tc qdisc replace dev eth0 root netem ARGS` on host A's egress ("a"), here ("b") or both.
    pub fn netem(&self, side: &str, args: &str) {
        let cmd = format!("tc qdisc replace dev {NETDEV} root netem {args}");
        if side.contains('a') {
            self.peer.sh(&cmd);
        }
        if side.contains('b') {
            sh_local(&cmd);
        }
    }
    pub fn clear(&self) {
        let reset =
            format!("tc qdisc del dev {NETDEV} root 2>/dev/null; ip link set {NETDEV} up && {}", port_active_script());
        let _ = run_local(&["sh", "-c", &reset], Duration::from_secs(30));
        self.peer.sh(&reset);
    }
}

impl Drop for Wire<'_> {
    fn drop(&mut self) {
        self.clear();
    }
}

/// This host's address on the wire (RDMA_VM_ADDR, set by the guest).
pub fn own_addr() -> String {
    std::env::var("RDMA_VM_ADDR").expect("RDMA_VM_ADDR (set by the harness guest)")
}
