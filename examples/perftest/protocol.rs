//! The perf tool's protocol, shared by `perf_client` and `perf_server`: the request the client
//! sends in the CM private data (its `QpInfo`, then mode, size, iterations and doorbell), and the
//! payload pattern both sides check.
#![allow(dead_code)] // each side uses part of this module

use std::fmt;

use rdma_cm::QpInfo;
/// Largest payload the server accepts (it allocates this much for a client).
pub const MAX_SIZE: u32 = 64 << 20;
/// Most iterations one client may ask for.
pub const MAX_ITERS: u32 = 10_000_000;
/// Payload size of rdma-core's reference pair.
pub const LEGACY_SIZE: u32 = 16;

/// How the payload travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Two-sided send/recv; the server echoes each message.
    Send,
    /// RDMA WRITE into the peer's region, rung by its immediate data (or, where the device
    /// has none, by a SEND after it: see [`Doorbell`]); the server writes it back.
    Write,
    /// The server RDMA-READs the client's region, then the client RDMA-READs it back.
    Read,
    /// RDMA fetch-and-add of 1 on the server's 8-byte counter per iteration; each returned
    /// value is checked, and the server checks the final count.
    FetchAdd,
    /// RDMA compare-and-swap of the server's counter from i to i + 1 per iteration; each
    /// returned value is checked, and the server checks the final count.
    CmpSwap,
    /// Sends in one direction only (the client's `--bw --mode send`): the server keeps
    /// receives posted for `iters` messages, checks them, and answers with one message that
    /// carries the count it received and whether the content matched.
    #[value(skip)]
    SendStream,
}

impl Mode {
    fn code(self) -> u8 {
        match self {
            Mode::Send => 0,
            Mode::Write => 1,
            Mode::Read => 2,
            Mode::FetchAdd => 3,
            Mode::CmpSwap => 4,
            Mode::SendStream => 5,
        }
    }

    /// An atomic mode: the client operates on the server's 8-byte counter.
    pub fn is_atomic(self) -> bool {
        matches!(self, Mode::FetchAdd | Mode::CmpSwap)
    }
    fn from_code(c: u8) -> Option<Mode> {
        Some(match c {
            0 => Mode::Send,
            1 => Mode::Write,
            2 => Mode::Read,
            3 => Mode::FetchAdd,
            4 => Mode::CmpSwap,
            5 => Mode::SendStream,
            _ => return None,
        })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Send => "send",
            Mode::Write => "write",
            Mode::Read => "read",
            Mode::FetchAdd => "fetch-add",
            Mode::CmpSwap => "cmp-swap",
            Mode::SendStream => "send-stream",
        })
    }
}

/// How write mode tells the peer that an RDMA WRITE has landed: a WRITE lands silently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Doorbell {
    /// Immediate data where the device has it, else a send (decided by the device's transport:
    /// iWARP has no immediate data).
    Auto,
    /// The WRITE carries the iteration number as immediate data, which completes a receive at
    /// the peer (InfiniBand and RoCE).
    Imm,
    /// A 4-byte SEND of the iteration number right after the WRITE: on a reliable connection
    /// it arrives after the WRITE's data, on every transport (iWARP included).
    Send,
}

impl Doorbell {
    /// `Imm` or `Send`: `Auto` becomes what the device of `ctx` can do.
    pub fn resolve(self, ctx: &rdma_cm::VerbsContext) -> Doorbell {
        match self {
            Doorbell::Auto if ctx.transport().has_immediate_data() => Doorbell::Imm,
            Doorbell::Auto => Doorbell::Send,
            d => d,
        }
    }
}

impl fmt::Display for Doorbell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Doorbell::Auto => "auto",
            Doorbell::Imm => "immediate data",
            Doorbell::Send => "a send after the WRITE",
        })
    }
}

/// What the client asks for, after its `QpInfo` in the connect private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub info: QpInfo,
    pub mode: Mode,
    pub size: u32,
    pub iters: u32,
    /// Write mode's doorbell, both ways: a SEND after each WRITE instead of immediate data.
    pub send_doorbell: bool,
}

const REQ_VERSION: u8 = 1;
/// The request's bytes: the `QpInfo`, then version, mode, size, iterations and the doorbell
/// byte (0: immediate data, 1: a send). A request of one byte less (this protocol before the
/// doorbell byte) reads as immediate data, and so do the zeros the CM pads it with.
pub const REQUEST_LEN: usize = QpInfo::ENCODED_LEN + 11;

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[..QpInfo::ENCODED_LEN].copy_from_slice(&self.info.encode());
        let r = &mut b[QpInfo::ENCODED_LEN..];
        r[0] = REQ_VERSION;
        r[1] = self.mode.code();
        r[2..6].copy_from_slice(&self.size.to_be_bytes());
        r[6..10].copy_from_slice(&self.iters.to_be_bytes());
        r[10] = self.send_doorbell as u8;
        b
    }

    /// Decodes a client's private data (untrusted). `Ok(None)`: the peer sends no qp_info at
    /// all (rdma-core's rdma_client), so it speaks the 16-byte legacy exchange.
    pub fn decode(data: &[u8]) -> Result<Option<Request>, String> {
        if !QpInfo::is_present(data) {
            return Ok(None);
        }
        let (info, rest) = QpInfo::decode(data).map_err(|e| e.to_string())?;
        if rest.len() < 10 {
            return Err("request is shorter than 38 bytes".into());
        }
        if rest[0] != REQ_VERSION {
            return Err(format!("unknown request version {}", rest[0]));
        }
        let mode = Mode::from_code(rest[1]).ok_or_else(|| format!("unknown mode {}", rest[1]))?;
        let size = u32::from_be_bytes([rest[2], rest[3], rest[4], rest[5]]);
        let iters = u32::from_be_bytes([rest[6], rest[7], rest[8], rest[9]]);
        let send_doorbell = match rest.get(10).copied().unwrap_or(0) {
            0 => false,
            1 => true,
            d => return Err(format!("unknown doorbell {d} (0: immediate data, 1: a send)")),
        };
        if size == 0 || size > MAX_SIZE {
            return Err(format!("size {size} is outside 1..={MAX_SIZE}"));
        }
        if iters == 0 || iters > MAX_ITERS {
            return Err(format!("iterations {iters} outside 1..={MAX_ITERS}"));
        }
        if mode.is_atomic() && size != 8 {
            return Err(format!("{mode} works on one 8-byte counter, not {size} bytes"));
        }
        if matches!(mode, Mode::Write | Mode::Read) {
            let region = info.region().ok_or("write/read mode needs the client to advertise a region")?;
            if region.len < size as u64 {
                return Err(format!("client region of {} bytes is smaller than size {size}", region.len));
            }
        }
        Ok(Some(Request { info, mode, size, iters, send_doorbell }))
    }
}

/// The payload of iteration `iter`: a pattern that differs per byte and per iteration.
pub fn fill_pattern(buf: &mut [u8], iter: u32) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(31).wrapping_add(iter.wrapping_mul(7)).wrapping_add(1) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(mode: Mode) -> Request {
        Request {
            info: QpInfo { qp_num: 5, psn: 1, rkey: 9, vaddr: 4096, len: 1024 },
            mode,
            size: 1024,
            iters: 3,
            send_doorbell: false,
        }
    }

    #[test]
    fn request_round_trip_in_56_bytes() {
        for m in [Mode::Send, Mode::Write, Mode::Read] {
            let mut pd = [0u8; 56];
            pd[..REQUEST_LEN].copy_from_slice(&req(m).encode());
            assert_eq!(Request::decode(&pd).unwrap(), Some(req(m)));
        }
        let r = Request { send_doorbell: true, ..req(Mode::Write) };
        assert_eq!(Request::decode(&r.encode()).unwrap(), Some(r));
        // The request without its doorbell byte (the protocol before it) rings with immediate data.
        assert_eq!(Request::decode(&r.encode()[..REQUEST_LEN - 1]).unwrap(), Some(req(Mode::Write)));
        for m in [Mode::FetchAdd, Mode::CmpSwap] {
            let r = Request { size: 8, ..req(m) };
            assert_eq!(Request::decode(&r.encode()).unwrap(), Some(r));
            let e = Request::decode(&Request { size: 16, ..r }.encode()).unwrap_err();
            assert!(e.contains("8-byte counter"), "{e}");
        }
    }

    #[test]
    fn legacy_and_hostile_requests() {
        assert_eq!(Request::decode(&[0u8; 56]).unwrap(), None, "rdma_client sends zeros");
        // The request's own fields follow the QP's (mode, size, iterations, doorbell).
        let o = QpInfo::ENCODED_LEN;
        let good = req(Mode::Write).encode();
        let mut b = good;
        b[o + 1] = 9;
        assert!(Request::decode(&b).unwrap_err().contains("mode"));
        let mut b = good;
        b[o + 2..o + 6].copy_from_slice(&(MAX_SIZE + 1).to_be_bytes());
        assert!(Request::decode(&b).unwrap_err().contains("size"));
        let mut b = good;
        b[o + 2..o + 6].copy_from_slice(&0u32.to_be_bytes());
        assert!(Request::decode(&b).is_err());
        let mut b = good;
        b[o + 6..o + 10].copy_from_slice(&0u32.to_be_bytes());
        assert!(Request::decode(&b).unwrap_err().contains("iterations"));
        let mut b = good;
        b[o + 2..o + 6].copy_from_slice(&4096u32.to_be_bytes());
        assert!(Request::decode(&b).unwrap_err().contains("smaller"));
        assert!(Request::decode(&good[..o + 2]).is_err());
        let mut b = good;
        b[o + 10] = 2;
        assert!(Request::decode(&b).unwrap_err().contains("doorbell"));
    }
}
