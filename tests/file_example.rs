//! `examples/file_server.rs` and `examples/file_client.rs` as processes: a file in `/dev/shm`
//! (tmpfs, whose shared mappings every kernel lets the device pin) served from its registered
//! mapping by RDMA READ, fetched whole and by range, byte for byte; a range past the file's end
//! refused by the client with the file's length; a file that shrank under its mapping refused
//! by the server's registration, naming the cause.
//!
//! Needs the feature `memmap2`: `cargo test --all-features --test file_example`.

mod common;

use std::process::{Command, Output};

use common::example;
use common::examples::{text, Srv};

/// 3 MiB and a few bytes: not a multiple of the client's chunk (1 MiB) nor of a page.
const LEN: usize = (3 << 20) + 4099;

/// A file of its own in /dev/shm, removed when dropped.
struct ShmFile(String);

impl ShmFile {
    fn new(name: &str, bytes: &[u8]) -> ShmFile {
        let path = format!("/dev/shm/rdma-cm-file-example-{}-{name}", std::process::id());
        std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("{path}: {e}"));
        ShmFile(path)
    }
    fn empty(name: &str) -> ShmFile {
        let path = format!("/dev/shm/rdma-cm-file-example-{}-{name}", std::process::id());
        ShmFile(path)
    }
}

impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn client(port: &str, args: &[&str]) -> Output {
    let addr = common::device_addr().to_string();
    let mut all = vec!["-a", addr.as_str(), "-p", port];
    all.extend_from_slice(args);
    Command::new(example("file_client")).args(&all).output().expect("run file_client")
}

/// 64-bit FNV-1a, as the client prints it.
fn fnv(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("fnv1a64 {h:016x}")
}

#[test]
fn file_is_served_by_rdma_read_whole_and_by_range_and_a_range_past_its_end_is_refused() {
    let data = common::pattern(LEN, 21);
    let src = ShmFile::new("served", &data);
    let (whole, part) = (ShmFile::empty("whole"), ShmFile::empty("part"));
    let addr = common::device_addr().to_string();
    let srv = Srv::start("file_server", &["-a", &addr, "-p", "7641", "--clients", "3", &src.0]);

    // The whole file, in 1 MiB READs (the last one partial).
    let out = client("7641", &["-o", &whole.0]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "whole file:\n{o}\n{e}");
    let copy = std::fs::read(&whole.0).expect("the client's copy");
    assert_eq!(copy.len(), LEN, "{o}");
    assert!(copy == data, "the copy differs from the file");
    assert!(o.contains(&format!("File of {LEN} bytes")) && o.contains(&fnv(&data)), "{o}");

    // A range that starts and ends inside pages, in chunks that are not a power of two.
    let (off, n) = (1_000_003usize, 70_001usize);
    let out =
        client("7641", &["-o", &part.0, "--offset", &off.to_string(), "--length", &n.to_string(), "--chunk", "4000"]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "range:\n{o}\n{e}");
    assert!(std::fs::read(&part.0).unwrap() == data[off..off + n], "the range's copy differs");
    assert!(o.contains(&fnv(&data[off..off + n])), "{o}");

    // One byte past the end: refused before any READ, naming the file's length.
    let out = client("7641", &["--offset", &(LEN - 10).to_string(), "--length", "11"]);
    let (o, e) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{o}\n{e}");
    assert_eq!(e.lines().count(), 1, "one line on stderr: {e}");
    assert!(e.contains("reaches past the end of the file, which has") && e.contains(&LEN.to_string()), "{e}");
    assert!(!o.contains("Read "), "nothing was read: {o}");

    let (code, s) = srv.finish();
    assert_eq!(code, 0, "{s}");
    assert!(s.contains("Client 3 disconnected") && s.contains("Served 3 client(s)"), "{s}");
}

/// The server maps the file when it starts and registers the mapping when a client comes: a
/// file truncated in between leaves the mapping with no pages to pin, which the registration
/// refuses (EFAULT). The server rejects the client and names the cause.
#[test]
fn file_truncated_under_its_mapping_is_refused_at_registration_with_the_cause() {
    let src = ShmFile::new("truncated", &common::pattern(LEN, 22));
    let addr = common::device_addr().to_string();
    let srv = Srv::start("file_server", &["-a", &addr, "-p", "7642", &src.0]);
    std::fs::OpenOptions::new().write(true).open(&src.0).unwrap().set_len(0).unwrap();
    let out = client("7642", &["--timeout", "5"]);
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    let (code, s) = srv.finish();
    assert_eq!(code, 1, "{s}");
    assert!(s.contains("error: registering the mapping of") && s.contains("EFAULT"), "{s}");
    assert!(s.contains("/dev/shm") && s.contains("shrank"), "{s}");
    assert!(text(&out).1.contains("could not register its file"), "the client names the reason: {:?}", text(&out));
}
