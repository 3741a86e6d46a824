//! [`PeerInfo`]: what two sides of a verbs-only connection tell each other before either QP
//! can leave INIT (its LID, QP number, starting PSN and GID), exchanged by any means; and the
//! text form rdma-core's `ibv_rc_pingpong`, `ibv_ud_pingpong` and `ibv_srq_pingpong` send over
//! TCP, so programs of this crate can talk to theirs.
//!
//! ```no_run
//! use rdma_cm::verbs::peer::PeerInfo;
//! use rdma_cm::verbs::ud::UdQp;
//!
//! # fn main() -> rdma_cm::Result<()> {
//! # let qp: UdQp = unimplemented!();
//! let mine = qp.local(Some(1))?; // LID, QP number, PSN and GID (index 1) of this side
//! let wire = mine.to_wire()?; // the text ibv_ud_pingpong sends over TCP
//! // ... send `wire` to the peer over TCP, and read its message into `theirs` ...
//! # let theirs = wire;
//! let peer = PeerInfo::from_wire(&theirs)?;
//! let dest = qp.dest_to(&peer, Some(1), 0, 0x11111111)?; // where this side's sends go
//! # let _ = dest;
//! # Ok(()) }
//! ```
//!
//! # The pingpong wire form
//!
//! Each side sends `LLLL:QQQQQQ:PPPPPP:GGGG…G` and a NUL: the LID as 4 hex digits, the QP
//! number and the PSN as 6, and the GID's 16 bytes in order as 32 hex digits, 52 bytes in all
//! ([`PeerInfo::WIRE_LEN`]). The message comes from the network, so [`PeerInfo::from_wire`]
//! checks every byte: the length, the separators, hex digits only, the NUL at the end, and no
//! value wider than its field.

use std::fmt;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::device::VerbsContext;
use crate::verbs::port::Gid;

/// One side's address for a verbs-only connection: what the peer's QP needs to reach it
/// (and, for RC, the PSN its first packet carries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerInfo {
    /// The port's LID (InfiniBand; 0 on RoCE, where the GID addresses the port).
    pub lid: u16,
    /// The QP number (24 bits).
    pub qp_num: u32,
    /// The first packet sequence number the QP sends (24 bits).
    pub psn: u32,
    /// The GID the QP sends from; all zeros for none (InfiniBand within one subnet).
    pub gid: Gid,
}

/// The most a 24-bit field (QP number, PSN) holds.
pub(crate) const MAX_24: u32 = 0x00ff_ffff;

impl PeerInfo {
    /// Bytes of the pingpong programs' message: `"0000:000000:000000:"`, 32 hex digits of
    /// GID and a NUL.
    pub const WIRE_LEN: usize = 52;

    /// Whether the address carries a GID (a packet to it needs a global route header).
    pub fn has_gid(&self) -> bool {
        !self.gid.is_zero()
    }

    /// Checks the fields' ranges: QP number and PSN within 24 bits, the QP number not 0 or 1
    /// (the subnet-management QPs), and some address (a LID or a GID).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field and its value.
    pub fn check(&self) -> Result<()> {
        if self.qp_num > MAX_24 || self.qp_num < 2 {
            return Err(Error::InvalidArgument(format!(
                "the peer's QP number {:#x} is not a QP number of an RC/UD QP (2..=0xffffff): the peer's info is wrong \
                 or was read from the wrong peer",
                self.qp_num
            )));
        }
        if self.psn > MAX_24 {
            return Err(Error::InvalidArgument(format!("the peer's PSN {:#x} is wider than 24 bits", self.psn)));
        }
        if self.lid == 0 && !self.has_gid() {
            return Err(Error::InvalidArgument(
                "the peer gave neither a LID nor a GID: on RoCE each side needs a GID (rdma-core's pingpong tools: \
                 -g GID_INDEX, e.g. -g 1 for the IPv4-mapped GID on rxe; see `ibv_devinfo -v`)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The pingpong programs' message for this address (`"%04x:%06x:%06x:%s"` and a NUL).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the QP number or PSN is wider than 24 bits (it would
    /// not fit its 6 digits).
    pub fn to_wire(&self) -> Result<[u8; Self::WIRE_LEN]> {
        if self.qp_num > MAX_24 || self.psn > MAX_24 {
            return Err(Error::InvalidArgument(format!(
                "QP number {:#x} or PSN {:#x} is wider than the 24 bits the message carries",
                self.qp_num, self.psn
            )));
        }
        let mut s = format!("{:04x}:{:06x}:{:06x}:", self.lid, self.qp_num, self.psn);
        for b in self.gid.0 {
            s.push_str(&format!("{b:02x}"));
        }
        let mut out = [0u8; Self::WIRE_LEN];
        // 4 + 1 + 6 + 1 + 6 + 1 + 32 = 51 characters and the NUL.
        out[..Self::WIRE_LEN - 1].copy_from_slice(s.as_bytes());
        Ok(out)
    }

    /// Parses a pingpong message. The bytes are untrusted: anything but exactly
    /// [`PeerInfo::WIRE_LEN`] bytes of the form `LLLL:QQQQQQ:PPPPPP:` + 32 hex digits + NUL is
    /// refused, with what was wrong. (rdma-core's programs send a NUL-terminated string of
    /// that shape; a zero message is what `ibv_srq_pingpong` sends for its unused QPs, and
    /// parses: [`PeerInfo::check`] refuses it as an address.)
    ///
    /// # Errors
    /// [`Error::PrivateData`] naming the fault.
    pub fn from_wire(msg: &[u8]) -> Result<PeerInfo> {
        if msg.len() != Self::WIRE_LEN {
            return Err(Error::PrivateData(
                "a pingpong address message is 52 bytes (LLLL:QQQQQQ:PPPPPP:GID and a NUL)",
            ));
        }
        if msg[Self::WIRE_LEN - 1] != 0 {
            return Err(Error::PrivateData("the pingpong address message does not end with a NUL"));
        }
        if msg[4] != b':' || msg[11] != b':' || msg[18] != b':' {
            return Err(Error::PrivateData("the pingpong address message has no ':' after its LID, QP number or PSN"));
        }
        let lid = hex(&msg[0..4])? as u16;
        let qp_num = hex(&msg[5..11])?;
        let psn = hex(&msg[12..18])?;
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = hex(&msg[19 + 2 * i..21 + 2 * i])? as u8;
        }
        Ok(PeerInfo { lid, qp_num, psn, gid: Gid(gid) })
    }

    /// This side's address on `ctx`'s port `port`: its LID, and the GID of entry `gid_index`
    /// (all zeros without one), as the pingpong programs send them.
    ///
    /// # Errors
    /// As for [`VerbsContext::port`]; [`Error::InvalidArgument`] for a GID index with no
    /// entry, listing the entries there are.
    pub(crate) fn local_address(ctx: &VerbsContext, port: u8, gid_index: Option<u8>) -> Result<(u16, Gid)> {
        let info = ctx.port(port)?;
        let Some(index) = gid_index else { return Ok((info.lid, Gid::default())) };
        match ctx.gid_entry(port, u32::from(index))? {
            Some(e) => Ok((info.lid, e.gid)),
            None => {
                let valid: Vec<String> = ctx
                    .gid_table(port)?
                    .iter()
                    .map(|e| format!("{} ({}, {})", e.index, e.gid.to_ipv6(), e.gid_type))
                    .collect();
                Err(Error::InvalidArgument(format!(
                    "GID index {index} is empty on {} port {port}: its entries are {} (`ibv_devinfo -v` lists them; \
                     an IPv4 address appears once the netdev has one)",
                    ctx.device_name(),
                    if valid.is_empty() { "none".to_string() } else { valid.join(", ") }
                )))
            }
        }
    }

    /// The address-handle attributes that reach this peer from local `port`: through its GID
    /// from local GID `sgid_index` when it has one, by its LID otherwise (as rdma-core's
    /// pingpong programs address each other, with a hop limit of 64).
    pub(crate) fn ah_attr(&self, port: u8, sgid_index: Option<u8>, sl: u8) -> ffi::ibv_ah_attr {
        // SAFETY: ibv_ah_attr is plain old data; all-zero is a valid value.
        let mut a: ffi::ibv_ah_attr = unsafe { std::mem::zeroed() };
        a.dlid = self.lid;
        a.sl = sl;
        a.port_num = port;
        if let (true, Some(idx)) = (self.has_gid(), sgid_index) {
            a.is_global = 1;
            a.grh.dgid.raw = self.gid.0;
            a.grh.sgid_index = idx;
            a.grh.hop_limit = 64;
        }
        a
    }
}

/// Hex digits only (no sign, no `0x`, no spaces), as many as the field has.
fn hex(digits: &[u8]) -> Result<u32> {
    digits.iter().try_fold(0u32, |n, &c| {
        let d = (c as char)
            .to_digit(16)
            .ok_or(Error::PrivateData("the pingpong address message has a character that is not a hex digit"))?;
        Ok((n << 4) | d)
    })
}

impl fmt::Display for PeerInfo {
    /// As rdma-core's pingpong programs print an address: `LID 0x0000, QPN 0x000011, PSN
    /// 0x8f2a1c, GID ::ffff:10.77.0.1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}", self.lid, self.qp_num, self.psn, self.gid.to_ipv6())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PeerInfo {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 77, 0, 1]);
        PeerInfo { lid: 0, qp_num: 0x11, psn: 0xabcdef, gid: Gid(gid) }
    }

    #[test]
    fn wire_form_is_the_pingpong_programs() {
        let w = sample().to_wire().unwrap();
        assert_eq!(&w[..51], b"0000:000011:abcdef:00000000000000000000ffff0a4d0001");
        assert_eq!(w[51], 0);
        assert_eq!(PeerInfo::from_wire(&w).unwrap(), sample());
        assert_eq!(sample().to_string(), "LID 0x0000, QPN 0x000011, PSN 0xabcdef, GID ::ffff:10.77.0.1");
    }

    #[test]
    fn upper_case_hex_parses_as_scanf_would() {
        let mut w = sample().to_wire().unwrap();
        w[12..18].copy_from_slice(b"ABCDEF");
        assert_eq!(PeerInfo::from_wire(&w).unwrap().psn, 0xabcdef);
    }

    #[test]
    fn hostile_messages_are_refused_without_panicking() {
        let good = sample().to_wire().unwrap();
        assert!(PeerInfo::from_wire(&good[..51]).is_err(), "short");
        assert!(PeerInfo::from_wire(&[good.as_slice(), b"x"].concat()).is_err(), "long");
        assert!(PeerInfo::from_wire(&[]).is_err(), "empty");
        let mut w = good;
        w[51] = b'0';
        assert!(PeerInfo::from_wire(&w).is_err(), "no NUL");
        for (i, c) in [(4, b'-'), (11, b'x'), (18, 0)] {
            let mut w = good;
            w[i] = c;
            assert!(PeerInfo::from_wire(&w).is_err(), "separator {i}");
        }
        for (i, c) in [(0, b'g'), (7, b' '), (13, b'+'), (30, 0), (50, 0xff)] {
            let mut w = good;
            w[i] = c;
            let e = PeerInfo::from_wire(&w).unwrap_err();
            assert!(e.to_string().contains("hex digit"), "{i}: {e}");
        }
        // Every byte value at every position: refused or parsed, never a panic.
        for i in 0..PeerInfo::WIRE_LEN {
            for c in 0..=255u8 {
                let mut w = good;
                w[i] = c;
                let _ = PeerInfo::from_wire(&w);
            }
        }
    }

    #[test]
    fn check_refuses_what_no_qp_can_be() {
        assert!(sample().check().is_ok());
        let zero = PeerInfo::from_wire(&PeerInfo::default().to_wire().unwrap()).unwrap();
        assert!(zero.check().unwrap_err().to_string().contains("QP number"));
        let no_addr = PeerInfo { gid: Gid::default(), ..sample() };
        assert!(no_addr.check().unwrap_err().to_string().contains("-g"));
        let wide = PeerInfo { psn: 1 << 24, ..sample() };
        assert!(wide.check().is_err());
        assert!(wide.to_wire().is_err());
        assert!(PeerInfo { qp_num: 1 << 24, ..sample() }.to_wire().is_err());
    }
}
