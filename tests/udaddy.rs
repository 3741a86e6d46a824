//! `examples/udaddy` on the device: against itself with the bytes checked, and against
//! rdma-core's `udaddy` in both directions, with the output `udaddy` prints; and its refusal of
//! a message over the MTU, beside `udaddy`'s own.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// udaddy's port (it has no flag for it).
const PORT: u16 = 7174;
const WITHIN: Duration = Duration::from_secs(90);

use common::example;

/// One pair at a time: they all use udaddy's port.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn ours() -> String {
    example("udaddy").to_string_lossy().into_owned()
}

fn spawn(prog: &str, args: &[&str]) -> Child {
    Command::new(prog)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {prog}: {e}"))
}

/// Waits (bounded) for `child` to exit; kills it if it does not.
fn finish(mut child: Child, what: &str) -> Output {
    let deadline = Instant::now() + WITHIN;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("{what} did not exit within {WITHIN:?}:\n{}", String::from_utf8_lossy(&out.stdout));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Runs `server` and then `client` (once the server listens) with the same extra flags;
/// returns both outputs after checking both succeeded.
fn run_pair(server: &str, client: &str, flags: &[&str]) -> (String, String) {
    let addr = common::device_addr().to_string();
    let srv = spawn(server, flags);
    common::wait_listening(PORT, Duration::from_secs(60));
    let mut cargs = vec!["-s", addr.as_str()];
    cargs.extend_from_slice(flags);
    let cli = finish(spawn(client, &cargs), "the client");
    let srv = finish(srv, "the server");
    let (c, s) = (text(&cli), text(&srv));
    assert!(cli.status.success(), "{client} as client failed:\n{c}\nserver said:\n{s}");
    assert!(srv.status.success(), "{server} as server failed:\n{s}\nclient said:\n{c}");
    (s, c)
}

fn assert_lines(out: &str, lines: &[&str]) {
    let got: Vec<&str> = out.lines().collect();
    let mut at = 0;
    for want in lines {
        match got[at..].iter().position(|l| l == want) {
            Some(k) => at += k + 1,
            None => panic!("no line {want:?} (in order) in:\n{out}"),
        }
    }
}

const SERVER_LINES: [&str; 6] = [
    "udaddy: starting server",
    "receiving data transfers",
    "sending replies",
    "data transfers complete",
    "test complete",
    "return status 0",
];
const CLIENT_LINES: [&str; 7] = [
    "udaddy: starting client",
    "udaddy: connecting",
    "initiating data transfers",
    "receiving data transfers",
    "data transfers complete",
    "test complete",
    "return status 0",
];

#[test]
fn udaddy_example_against_itself_checks_every_byte() {
    let _t = serial();
    if !common::require(common::Cap::Ud) {
        return;
    }
    let (s, c) = run_pair(&ours(), &ours(), &["-c", "2", "-C", "10", "-S", "100", "--verify"]);
    assert_lines(&s, &SERVER_LINES);
    assert_lines(&c, &CLIENT_LINES);
    assert!(s.contains("udaddy: 20 messages verified"), "{s}");
    assert!(c.contains("udaddy: 20 messages verified"), "{c}");
}

#[test]
fn udaddy_example_client_against_rdma_cores_udaddy_server() {
    let _t = serial();
    if !common::require(common::Cap::Ud) {
        return;
    }
    let (s, c) = run_pair("udaddy", &ours(), &["-C", "10", "-S", "1000"]);
    assert_lines(&s, &SERVER_LINES);
    assert_lines(&c, &CLIENT_LINES);
}

#[test]
fn udaddy_example_server_against_rdma_cores_udaddy_client() {
    let _t = serial();
    if !common::require(common::Cap::Ud) {
        return;
    }
    let (s, c) = run_pair(&ours(), "udaddy", &["-c", "2", "-C", "5", "-S", "64"]);
    assert_lines(&s, &SERVER_LINES);
    assert_lines(&c, &CLIENT_LINES);
}

/// A message over the port's active MTU: `udaddy` prints one line and gives up; so does the
/// example, with the same line, before sending anything.
#[test]
fn udaddy_example_refuses_a_message_over_the_mtu_as_udaddy_does() {
    let _t = serial();
    if !common::require(common::Cap::Ud) {
        return;
    }
    let addr = common::device_addr().to_string();
    let mut lines = vec![];
    for server in [ours(), "udaddy".into()] {
        let srv = spawn(&server, &["-C", "1", "-S", "16"]);
        common::wait_listening(PORT, Duration::from_secs(60));
        for client in [ours(), "udaddy".into()] {
            let out = finish(spawn(&client, &["-s", &addr, "-C", "1", "-S", "100000"]), "the client");
            let o = text(&out);
            assert!(!out.status.success(), "{client} sent a 100000-byte datagram:\n{o}");
            let l =
                o.lines().find(|l| l.contains("is larger than active mtu")).unwrap_or_else(|| panic!("{client}: {o}"));
            lines.push(l.to_string());
            assert!(!o.contains("initiating data transfers"), "{client} went on:\n{o}");
        }
        // The server is still waiting for a client that will not come.
        let mut srv = srv;
        let _ = srv.kill();
        let _ = srv.wait();
    }
    assert!(lines[0].starts_with("udaddy: message_size 100000 is larger than active mtu "), "{lines:?}");
    assert!(lines.iter().all(|l| l == &lines[0]), "the example and udaddy print the same line: {lines:?}");
}
