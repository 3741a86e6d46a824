//! The rsocket-compatible stream (`rdma_cm::stream`, feature `stream`) against the other
//! programs of rdma-core 44 that speak rsockets: `rcopy` (rdmacm-utils) both ways, with a
//! minimal rcopy server and client of our own, and a plain TCP program run under
//! `LD_PRELOAD=librspreload.so` both ways.
//!
//! **rcopy** (`librdmacm/examples/rcopy.c`) uses blocking `rsend`/`rrecv` only: its client
//! `mmap`s the source file and sends it with one `rsend`; its server `mmap`s the destination
//! and `rrecv`s straight into the mapping. Neither calls `riomap` or `riowrite`, so our stream's
//! lack of iomap needs no option to avoid. Its messages (`docs/rsocket-protocol.md` §9.2) are a
//! 16-byte header in host byte order (`version` 0, `command`, `len`, `data`, `id`): OPEN with the
//! path NUL-padded to a multiple of 8, WRITE with the size as a u64 and then the raw bytes,
//! CLOSE; each answered by a header of `command | 0x80` carrying 0 or an errno.
//!
//! **librspreload** turns `socket(AF_INET, SOCK_STREAM, 0)` into an rsocket, and falls back to
//! TCP when `rconnect` fails. The TCP program is `tests/data/tcp_peer.c`, compiled with the
//! system's `cc` (python3 and perl will not do: their sockets ask for `SOCK_CLOEXEC`, which
//! `rsocket()` refuses, so the preload library silently hands them TCP sockets, and their
//! `accept4` is not intercepted). A fallback cannot pass for RDMA: our listener takes only RDMA
//! CM connections, and nothing listens on TCP at the port, so a client that fell back fails;
//! against the preloaded server, our client connects through the RDMA CM, which only a
//! preloaded listener answers, and the kernel's resource tracking shows its listening CM id.

mod common;

use std::fs;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use common::{Cap, DeviceTest, T};
use rdma_cm::stream::{Stream, StreamListener};

/// Prints how long the test took when it ends (the guest's speed varies with the machine).
struct Took(&'static str, Instant);

impl Drop for Took {
    fn drop(&mut self) {
        println!("{} took {:?}", self.0, self.1.elapsed());
    }
}

/// The bound of a whole transfer (or a compile) under the emulator.
const LONG: Duration = Duration::from_secs(180);

/// The preload library of rdma-core (Debian's path).
const RSPRELOAD: &str = "/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so";

/// `len` random bytes (from the kernel).
fn random_bytes(len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).expect("read /dev/urandom");
    b
}

/// A fresh path in the temporary directory (the guest's own tmpfs), named for `what`.
fn temp_path(what: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("rdma-cm-interop-{}-{what}", std::process::id()));
    let _ = fs::remove_file(&p);
    p
}

/// What a child process wrote to stdout and stderr, collected as it comes (rcopy prints its
/// progress without line ends, so this is read in chunks, not lines).
struct Output {
    rx: mpsc::Receiver<Vec<u8>>,
    text: String,
    /// Where the next [`Output::wait_for`] starts looking.
    from: usize,
}

impl Output {
    fn of(child: &mut Child) -> Output {
        let (tx, rx) = mpsc::channel();
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("the child's stdout is piped"));
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().expect("the child's stderr is piped"));
        for mut r in [out, err] {
            let tx = tx.clone();
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = r.read(&mut buf) {
                    if tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            });
        }
        Output { rx, text: String::new(), from: 0 }
    }

    /// Waits (bounded) until the output after the previous match contains `needle`.
    fn wait_for(&mut self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(at) = self.text[self.from..].find(needle) {
                self.from += at + needle.len();
                return;
            }
            match self.rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(chunk) => self.text.push_str(&String::from_utf8_lossy(&chunk)),
                Err(_) => panic!("no {needle:?} from the child within {within:?}; its output:\n{}", self.text),
            }
        }
    }

    /// Everything the child wrote (once it has exited: both pipes are at their end).
    fn rest(mut self) -> String {
        while let Ok(chunk) = self.rx.recv_timeout(T) {
            self.text.push_str(&String::from_utf8_lossy(&chunk));
        }
        self.text
    }
}

/// Waits up to `within` for `child` to exit; kills it (this test's own child, by its pid) and
/// fails past that.
fn wait_exit(child: Child, within: Duration, what: &str) -> ExitStatus {
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut child = child;
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(within) {
        Ok(status) => status.expect("wait for the child"),
        Err(_) => {
            // SAFETY: kill(2) on the pid of a child this test started; the thread above has
            // not reaped it (it would have sent its status).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{what} did not exit within {within:?}");
        }
    }
}

/// A child this test started, killed (by its pid) and reaped if the test fails before it is
/// waited for: a server left behind would hold its RDMA resources into the next test.
struct Started(Option<Child>);

impl Started {
    fn new(mut cmd: Command, what: &str) -> (Started, Output) {
        let mut child =
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("run {what}: {e}"));
        let out = Output::of(&mut child);
        (Started(Some(child)), out)
    }

    /// The child, no longer killed at the drop.
    fn take(mut self) -> Child {
        self.0.take().expect("the child")
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// rcopy

const CMD_OPEN: u8 = 1;
const CMD_CLOSE: u8 = 2;
const CMD_WRITE: u8 = 3;
const CMD_RESP: u8 = 0x80;

/// rcopy's `struct msg_hdr`: 16 bytes in host byte order.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Hdr {
    version: u8,
    command: u8,
    len: u16,
    data: u32,
    id: u64,
}

impl Hdr {
    fn new(command: u8, len: usize, data: u32) -> Hdr {
        Hdr { version: 0, command, len: u16::try_from(len).unwrap(), data, id: 0 }
    }

    fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0] = self.version;
        b[1] = self.command;
        b[2..4].copy_from_slice(&self.len.to_ne_bytes());
        b[4..8].copy_from_slice(&self.data.to_ne_bytes());
        b[8..16].copy_from_slice(&self.id.to_ne_bytes());
        b
    }

    fn decode(b: &[u8; 16]) -> Hdr {
        Hdr {
            version: b[0],
            command: b[1],
            len: u16::from_ne_bytes([b[2], b[3]]),
            data: u32::from_ne_bytes(b[4..8].try_into().unwrap()),
            id: u64::from_ne_bytes(b[8..16].try_into().unwrap()),
        }
    }
}

/// Reads one header, or `None` at the end of the stream before its first byte.
fn read_hdr(s: &mut Stream) -> io::Result<Option<Hdr>> {
    let mut b = [0u8; 16];
    let mut got = 0;
    while got < b.len() {
        match s.read(&mut b[got..])? {
            0 if got == 0 => return Ok(None),
            0 => return Err(io::Error::new(ErrorKind::UnexpectedEof, format!("a header cut after {got} bytes"))),
            n => got += n,
        }
    }
    Ok(Some(Hdr::decode(&b)))
}

/// Sends rcopy's reply to `req`: its command with `CMD_RESP`, the status, its id.
fn reply(s: &mut Stream, req: &Hdr, status: u32) -> io::Result<()> {
    let r = Hdr { version: 0, command: req.command | CMD_RESP, len: 16, data: status, id: req.id };
    s.write_all(&r.encode())
}

/// Reads rcopy's reply to `cmd` and returns its status, failing unless it is one.
fn read_reply(s: &mut Stream, cmd: u8) -> u32 {
    let r = read_hdr(s).expect("read rcopy's reply").unwrap_or_else(|| panic!("end of stream, not the reply to {cmd}"));
    assert_eq!((r.version, r.command, r.len), (0, cmd | CMD_RESP, 16), "rcopy's reply to {cmd}: {r:?}");
    r.data
}

/// A minimal rcopy server on one accepted stream: OPEN, WRITE and CLOSE as `rcopy.c` serves
/// them, until the client's end of stream. Returns what it did, one entry per command.
fn serve_rcopy(s: &mut Stream) -> io::Result<Vec<String>> {
    let mut done = Vec::new();
    let mut file: Option<fs::File> = None;
    let mut buf = vec![0u8; 64 * 1024];
    while let Some(h) = read_hdr(s)? {
        if h.version != 0 || h.len < 16 {
            return Err(io::Error::new(ErrorKind::InvalidData, format!("not an rcopy header: {h:?}")));
        }
        match h.command {
            CMD_OPEN => {
                let mut path = vec![0u8; usize::from(h.len) - 16];
                s.read_exact(&mut path)?;
                let end = path.iter().position(|b| *b == 0).unwrap_or(path.len());
                let path = String::from_utf8_lossy(&path[..end]).into_owned();
                let opened = fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(h.data & 0o7777)
                    .open(&path);
                let status = match opened {
                    Ok(f) => {
                        file = Some(f);
                        0
                    }
                    Err(e) => e.raw_os_error().unwrap_or(libc::EIO) as u32,
                };
                reply(s, &h, status)?;
                done.push(format!("open {path} mode {:o}: {status}", h.data & 0o7777));
            }
            CMD_WRITE => {
                let mut size = [0u8; 8];
                s.read_exact(&mut size)?;
                let size = u64::from_ne_bytes(size);
                assert_eq!(h.len, 24, "rcopy's WRITE is a header and a u64");
                let f = file.as_mut().expect("rcopy writes after its OPEN");
                let mut left = size;
                while left > 0 {
                    let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    let n = s.read(&mut buf[..want])?;
                    if n == 0 {
                        return Err(io::Error::new(
                            ErrorKind::UnexpectedEof,
                            format!("{left} bytes of {size} missing"),
                        ));
                    }
                    f.write_all(&buf[..n])?;
                    left -= n as u64;
                }
                reply(s, &h, 0)?;
                done.push(format!("write {size}"));
            }
            CMD_CLOSE => {
                reply(s, &h, 0)?;
                file = None;
                done.push("close".to_string());
            }
            _ => {
                reply(s, &h, libc::EINVAL as u32)?;
                return Err(io::Error::new(ErrorKind::InvalidData, format!("an unknown rcopy command: {h:?}")));
            }
        }
    }
    Ok(done)
}

/// rcopy as the client (`rcopy SRC ADDR:DST -p PORT`), our minimal rcopy server on our
/// listener: a file of 3 MiB and an odd number of bytes, random, arrives byte-identical, and
/// rcopy reports the whole size.
#[test]
fn rcopy_client_to_our_server() {
    let t = DeviceTest::start();
    let _took = Took("rcopy_client_to_our_server", Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7731u16;
    // rcopy splits its `ADDR:DST` argument at the first colon.
    assert!(t.addr.is_ipv4(), "the device's address is IPv4: {}", t.addr);
    let data = random_bytes((3 << 20) + 12_345);
    let (src, dst) = (temp_path("rcopy-src"), temp_path("rcopy-dst"));
    fs::write(&src, &data).unwrap();
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let mut rcopy = Command::new("rcopy");
    rcopy.arg(&src).arg(format!("{}:{}", t.addr, dst.display())).args(["-p", &port.to_string()]);
    let (child, out) = Started::new(rcopy, "rcopy (rdmacm-utils)");
    let mut s = listener.accept(T).expect("accept rcopy's connect");
    s.set_read_timeout(LONG);
    s.set_write_timeout(LONG);
    let done = serve_rcopy(&mut s).expect("serve rcopy");
    drop(s);
    let status = wait_exit(child.take(), LONG, "rcopy (client)");
    let text = out.rest();
    assert!(status.success(), "rcopy exited with {status}:\n{text}");
    let mode = fs::metadata(&src).map(|m| m.permissions().mode()).unwrap();
    assert_eq!(
        done,
        [
            format!("open {} mode {:o}: 0", dst.display(), mode & 0o7777),
            format!("write {}", data.len()),
            "close".into()
        ],
        "the commands rcopy sent"
    );
    assert!(text.contains(&format!("{} bytes in", data.len())), "rcopy's result line:\n{text}");
    let copied = fs::read(&dst).unwrap();
    assert!(copied == data, "the copy ({} bytes) differs from the {} bytes sent", copied.len(), data.len());
    println!("rcopy (client): {}", text.lines().last().unwrap_or(""));
    let _ = (fs::remove_file(&src), fs::remove_file(&dst));
    drop(listener);
    t.finish();
}

/// Our client doing what rcopy's client does against `rcopy -p PORT` (its server mode): OPEN,
/// WRITE with 3 MiB and an odd number of random bytes, CLOSE, each answered with status 0;
/// the file rcopy wrote is byte-identical.
#[test]
fn our_client_to_rcopy_server() {
    let t = DeviceTest::start();
    let _took = Took("our_client_to_rcopy_server", Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7732u16;
    let data = random_bytes((3 << 20) + 54_321);
    let dst = temp_path("rcopy-served");
    let mut rcopy = Command::new("rcopy");
    rcopy.args(["-p", &port.to_string()]);
    let (child, mut out) = Started::new(rcopy, "rcopy (rdmacm-utils)");
    // Printed (and flushed) once it listens, before it waits in raccept.
    out.wait_for("waiting for connection", LONG);
    let session = || -> io::Result<()> {
        let mut s = Stream::connect(SocketAddr::new(t.addr, port), T).map_err(io::Error::other)?;
        s.set_read_timeout(LONG);
        s.set_write_timeout(LONG);
        let path = dst.to_str().unwrap().as_bytes();
        let padded = (path.len() + 8) & !7;
        let mut open = Hdr::new(CMD_OPEN, 16 + padded, 0o100600).encode().to_vec();
        open.extend_from_slice(path);
        open.resize(16 + padded, 0);
        s.write_all(&open)?;
        assert_eq!(read_reply(&mut s, CMD_OPEN), 0, "rcopy's status for OPEN");
        let mut write = Hdr::new(CMD_WRITE, 24, 0).encode().to_vec();
        write.extend_from_slice(&(data.len() as u64).to_ne_bytes());
        s.write_all(&write)?;
        s.write_all(&data)?;
        assert_eq!(read_reply(&mut s, CMD_WRITE), 0, "rcopy's status for WRITE");
        s.write_all(&Hdr::new(CMD_CLOSE, 16, 0).encode())?;
        assert_eq!(read_reply(&mut s, CMD_CLOSE), 0, "rcopy's status for CLOSE");
        s.shutdown(Shutdown::Both)
    };
    session().expect("the session with rcopy's server");
    // It closes the file after its answer to CLOSE, then goes back to accepting.
    out.wait_for(&format!("{} bytes", data.len()), LONG);
    out.wait_for("done", LONG);
    out.wait_for("waiting for connection", LONG);
    let copied = fs::read(&dst).unwrap();
    assert!(copied == data, "rcopy's copy ({} bytes) differs from the {} bytes sent", copied.len(), data.len());
    let mode = fs::metadata(&dst).map(|m| m.permissions().mode()).unwrap();
    assert_eq!(mode & 0o777, 0o600, "the mode sent with OPEN");
    // rcopy's server never exits by itself: this test's own child, killed by its pid.
    let mut child = child.take();
    child.kill().expect("kill rcopy's server");
    let status = wait_exit(child, T, "the killed rcopy server");
    assert_eq!(ExitStatusExt::signal(&status), Some(libc::SIGKILL), "rcopy's server ran until killed");
    println!("rcopy (server): {}", out.text.lines().find(|l| l.contains("bytes")).unwrap_or(""));
    let _ = fs::remove_file(&dst);
    t.finish();
}

// ---------------------------------------------------------------------------------------------
// librspreload

/// `tests/data/tcp_peer.c` compiled with the system's C compiler, once per process.
fn tcp_peer() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tcp_peer.c");
            let exe = temp_path("tcp_peer");
            let mut cc = Command::new("cc");
            cc.args(["-O2", "-Wall", "-o"]).arg(&exe).arg(&src);
            let (cc, out) = Started::new(cc, "cc, the C compiler (build-essential), for tests/data/tcp_peer.c");
            let status = wait_exit(cc.take(), LONG, "cc tests/data/tcp_peer.c");
            assert!(status.success(), "cc tests/data/tcp_peer.c: {status}\n{}", out.rest());
            exe
        })
        .clone()
}

/// `tcp_peer ARGS` with the preload library, nothing of rsocket's fork mode.
fn preloaded(args: &[&str]) -> (Started, Output) {
    assert!(Path::new(RSPRELOAD).exists(), "{RSPRELOAD} is missing (librdmacm1)");
    let mut cmd = Command::new(tcp_peer());
    cmd.args(args).env("LD_PRELOAD", RSPRELOAD).env_remove("RDMAV_FORK_SAFE");
    Started::new(cmd, "tests/data/tcp_peer")
}

/// The plain TCP client under librspreload against our listener: it sends 2 MiB and an odd
/// number of random bytes, half-closes (rsocket's SHUTDOWN), and reads our echo to its end.
/// That our RDMA listener accepted it at all proves it connected through rsockets.
#[test]
fn rspreload_client_to_our_server() {
    let t = DeviceTest::start();
    let _took = Took("rspreload_client_to_our_server", Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7733u16;
    let data = random_bytes((2 << 20) + 777);
    let (input, output) = (temp_path("preload-in"), temp_path("preload-out"));
    fs::write(&input, &data).unwrap();
    tcp_peer();
    let listener = StreamListener::bind(SocketAddr::new(t.addr, port)).unwrap();
    let addr = t.addr.to_string();
    let (child, out) =
        preloaded(&["client", &addr, &port.to_string(), input.to_str().unwrap(), output.to_str().unwrap()]);
    let mut s = match listener.accept(Duration::from_secs(60)) {
        Ok(s) => s,
        Err(e) => {
            drop(child);
            panic!(
                "no rsocket connect from the preloaded client ({e}): a client that fell back to TCP cannot \
                 reach this RDMA listener; its output:\n{}",
                out.rest()
            );
        }
    };
    assert_eq!(s.peer_addr().map(|a| a.ip()), Some(t.addr), "the preloaded client's address");
    s.set_read_timeout(LONG);
    s.set_write_timeout(LONG);
    let mut got = Vec::new();
    s.read_to_end(&mut got).expect("read to the client's half-close");
    assert!(got == data, "read {} bytes from the client, not the {} it sent", got.len(), data.len());
    s.write_all(&got).expect("echo after the client's half-close");
    s.shutdown(Shutdown::Both).expect("shutdown");
    drop(s);
    let status = wait_exit(child.take(), LONG, "the preloaded client");
    let text = out.rest();
    assert!(status.success(), "the preloaded client exited with {status}:\n{text}");
    assert!(text.contains(&format!("sent {0} received {0}", data.len())), "its result line:\n{text}");
    let back = fs::read(&output).unwrap();
    assert!(back == data, "the client received {} bytes, not its {} echoed", back.len(), data.len());
    println!("rspreload (client): {}", text.lines().last().unwrap_or(""));
    let _ = (fs::remove_file(&input), fs::remove_file(&output));
    drop(listener);
    t.finish();
}

/// The plain TCP server under librspreload, our client connecting through the RDMA CM: 2 MiB
/// and an odd number of random bytes sent, a half-close, the same bytes read back to the
/// server's close. Its listening CM id shows in the kernel's resource tracking, and our
/// connect reaches only an RDMA CM listener: a server that fell back to TCP would refuse it.
#[test]
fn our_client_to_rspreload_server() {
    let t = DeviceTest::start();
    let _took = Took("our_client_to_rspreload_server", Instant::now());
    if !common::require(Cap::ImmediateData) {
        return;
    }
    let port = 7734u16;
    let data = random_bytes((2 << 20) + 999);
    let addr = t.addr.to_string();
    tcp_peer();
    let (child, mut out) = preloaded(&["server", &addr, &port.to_string()]);
    out.wait_for(&format!("listening on {addr}:{port}"), LONG);
    common::wait_listening(port, T);
    let session = || -> io::Result<Vec<u8>> {
        let mut s = Stream::connect(SocketAddr::new(t.addr, port), T).map_err(io::Error::other)?;
        s.set_read_timeout(LONG);
        s.set_write_timeout(LONG);
        s.write_all(&data)?;
        s.shutdown(Shutdown::Write)?;
        let mut back = Vec::new();
        s.read_to_end(&mut back)?;
        Ok(back)
    };
    let back = session().expect("the session with the preloaded server");
    assert!(back == data, "{} bytes came back, not the {} sent", back.len(), data.len());
    let status = wait_exit(child.take(), LONG, "the preloaded server");
    let text = out.rest();
    assert!(status.success(), "the preloaded server exited with {status}:\n{text}");
    assert!(text.contains(&format!("echoed {} bytes", data.len())), "its result line:\n{text}");
    println!("rspreload (server): {}", text.lines().last().unwrap_or(""));
    t.finish();
}
