//! The example programs, for the tests that run them as processes.
//!
//! Only a plain `cargo test` builds the examples: `cargo test --test NAME` builds that one binary,
//! which then finds no example, or one left from an older build. [`example`] therefore builds the
//! example first wherever cargo can run (`RDMA_VM` unset: this machine, with or without a device)
//! with this test binary's own profile, features and target directory, once per example and
//! process, within [`BUILD_BOUND`]. Inside the guest there is no toolchain (and compiling under
//! TCG would take minutes): there `harness/runner` has built the examples on the host before the
//! guest booted, and [`example`] refuses one older than the sources it is built from.
//! [`test_binary`] does the same for another integration-test binary (`cargo test --no-run`).
#![allow(dead_code)] // each test binary uses part of this module

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{mpsc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

/// How long building one example may take (a fresh target directory on a loaded machine builds
/// the library and its dependencies first).
pub const BUILD_BOUND: Duration = Duration::from_secs(1200);

/// The targets built by this process so far (held while building, so that tests running in
/// parallel build each one once).
static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// This test binary's profile directory: TARGET_DIR[/TRIPLE]/PROFILE (it lives in its deps/).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent().and_then(Path::parent).expect("a test binary lives in PROFILE/deps").to_path_buf()
}

/// Builds `what` (`--example NAME` or `--test NAME`) once per process, where cargo can run.
fn build_once(kind: Kind, name: &str, profile_dir: &Path) {
    if std::env::var_os("RDMA_VM").is_some() {
        return;
    }
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let key = format!("{kind:?} {name}");
    if !built.contains(&key) {
        build(kind, name, profile_dir);
        built.push(key);
    }
}

/// What to build: an example, or an integration-test binary.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Example,
    Test,
}

/// The path of the example program `name`, built and up to date.
pub fn example(name: &str) -> PathBuf {
    let profile_dir = profile_dir();
    let path = profile_dir.join("examples").join(name);
    build_once(Kind::Example, name, &profile_dir);
    if std::env::var_os("RDMA_VM").is_some() {
        assert!(
            path.exists(),
            "{} is missing: harness/runner builds the examples before the guest boots; run this binary through cargo \
             (`cargo test --all-features --test NAME`)",
            path.display()
        );
        refuse_stale(&path);
    }
    assert!(path.exists(), "{} is missing after `cargo build --example {name}`", path.display());
    path
}

/// The path of the integration-test binary `name` (tests/NAME.rs), built: the newest
/// `deps/NAME-HASH` (builds with other features leave older ones beside it).
pub fn test_binary(name: &str) -> PathBuf {
    let profile_dir = profile_dir();
    build_once(Kind::Test, name, &profile_dir);
    let deps = profile_dir.join("deps");
    let prefix = format!("{name}-");
    std::fs::read_dir(&deps)
        .expect("the deps directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with(&prefix) && !n.contains('.') && n[prefix.len()..].chars().all(|c| c.is_ascii_hexdigit())
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .unwrap_or_else(|| {
            panic!("no {name} test binary in {}: harness/runner builds it before the guest boots", deps.display())
        })
}

/// The features this test binary was built with, to build the example with the same ones (a
/// feature added to Cargo.toml is added here).
fn features() -> Vec<&'static str> {
    let mut f = vec![];
    if cfg!(feature = "tokio") {
        f.push("tokio");
    }
    if cfg!(feature = "bytemuck") {
        f.push("bytemuck");
    }
    if cfg!(feature = "memmap2") {
        f.push("memmap2");
    }
    f
}

/// `cargo build --example NAME` or `cargo test --no-run --test NAME` into this binary's target
/// directory and profile, with its features, bounded.
fn build(kind: Kind, name: &str, profile_dir: &Path) {
    let profile = match (profile_dir.file_name().and_then(|p| p.to_str()), kind) {
        (Some("debug"), Kind::Example) => "dev",
        (Some("debug"), Kind::Test) => "test",
        (Some(p), _) => p,
        (None, _) => panic!("no profile directory above {}", profile_dir.display()),
    };
    // TARGET_DIR/PROFILE, or TARGET_DIR/TRIPLE/PROFILE when built with --target (cargo marks
    // its target directory with CACHEDIR.TAG).
    let above = profile_dir.parent().expect("a target directory");
    let (target_dir, triple) = if above.join("CACHEDIR.TAG").exists() {
        (above, None)
    } else {
        (above.parent().expect("a target directory"), above.file_name())
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    match kind {
        Kind::Example => cmd.args(["build", "--example", name]),
        Kind::Test => cmd.args(["test", "--no-run", "--test", name]),
    };
    cmd.args(["--profile", profile])
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir);
    if let Some(t) = triple {
        cmd.arg("--target").arg(t);
    }
    let features = features();
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    let what = format!("{cmd:?}");
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("{what}: {e}"));
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(BUILD_BOUND) {
        Ok(Ok(out)) => assert!(
            out.status.success(),
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Ok(Err(e)) => panic!("{what}: {e}"),
        Err(_) => {
            // SAFETY: kill(2) on the child's own pid; it has not been reaped (its waiter is
            // still blocked in wait), so the pid is still its own.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("{what} did not finish within {BUILD_BOUND:?}: killed");
        }
    }
}

/// Fails when a source the example is built from (in the library's `src/` or in `examples/`)
/// changed after the example was built: the guest would run an old program. Its sources are
/// those cargo's dep-info beside it lists (`NAME.d`); without one, every file of both folders.
fn refuse_stale(path: &Path) {
    let built = std::fs::metadata(path).and_then(|m| m.modified()).expect("the example's modification time");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let newest = match sources_of(path, root) {
        Some(files) => files.into_iter().filter_map(|f| Some((std::fs::metadata(&f).ok()?.modified().ok()?, f))).max(),
        None => ["src", "examples"].iter().filter_map(|d| newest_in(&root.join(d))).max(),
    };
    if let Some((changed, file)) = newest {
        assert!(
            changed <= built,
            "{} is older than {}: run this binary through cargo (harness/runner rebuilds the examples), or \
             `cargo build --all-features --examples` first",
            path.display(),
            file.display()
        );
    }
}

/// The files under `root`'s `src/` and `examples/` that cargo's dep-info for `path` (`NAME.d`
/// beside it: "TARGET: SOURCE SOURCE ...", a space in a path escaped as `\ `) lists; `None`
/// when there is no dep-info or it lists none of them.
fn sources_of(path: &Path, root: &Path) -> Option<Vec<PathBuf>> {
    let info = std::fs::read_to_string(path.with_extension("d")).ok()?;
    let (_, deps) = info.lines().next()?.split_once(": ")?;
    let (src, examples) = (root.join("src"), root.join("examples"));
    let files: Vec<PathBuf> = deps
        .replace("\\ ", "\0")
        .split(' ')
        .map(|p| PathBuf::from(p.replace('\0', " ")))
        .filter(|p| p.starts_with(&src) || p.starts_with(&examples))
        .collect();
    (!files.is_empty()).then_some(files)
}

/// The newest file under `dir` and its modification time.
fn newest_in(dir: &Path) -> Option<(SystemTime, PathBuf)> {
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        let found =
            if p.is_dir() { newest_in(&p) } else { entry.metadata().and_then(|m| m.modified()).ok().map(|t| (t, p)) };
        if let Some(f) = found {
            if newest.as_ref().is_none_or(|n| f.0 > n.0) {
                newest = Some(f);
            }
        }
    }
    newest
}

/// A running server example whose stdout and stderr are collected; `start` returns once it
/// prints that it listens.
pub struct Srv {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Srv {
    pub fn start(name: &str, args: &[&str]) -> Srv {
        let mut child = Command::new(example(name))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn server");
        let (tx, rx) = mpsc::channel();
        for r in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            thread::spawn(move || {
                for l in BufReader::new(r).lines().map_while(Result::ok) {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            });
        }
        let mut s = Srv { child, lines: rx, seen: vec![] };
        // A bound, not a pause: in a loaded guest (the valgrind test runs alongside) a server
        // has been measured taking over 20 s to listen.
        s.wait_line("Listening on port", Duration::from_secs(120));
        s
    }

    pub fn wait_line(&mut self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.seen.iter().any(|l| l.contains(needle)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!("server never printed {needle:?}; it printed:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// Waits for the server to exit (bounded) and returns its status and whole output.
    pub fn finish(mut self) -> (i32, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("server did not exit; output:\n{}", self.seen.join("\n"));
            }
            thread::sleep(Duration::from_millis(20));
        };
        // The server has exited: its pipe ends, and the reader thread drops the sender after
        // the last line. Read to that end (bounded), not for a fixed short while, which a
        // reader scheduled late would miss the summary lines by.
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(30)) {
            self.seen.push(l);
        }
        (status.code().unwrap_or(-1), self.seen.join("\n"))
    }
}

/// A finished process's stdout and stderr, as text.
pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}
