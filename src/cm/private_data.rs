//! [`QpInfo`]: the seed program's `qp_info` (qp_num, psn, rkey, vaddr) in a fixed wire layout.
//!
//! Peers exchange it through the CM private data. The layout is fixed and big-endian:
//!
//! | bytes  | field                               |
//! |--------|-------------------------------------|
//! | 0..2   | magic `b"RC"`                       |
//! | 2      | version (1)                         |
//! | 3      | reserved, 0                         |
//! | 4..8   | qp_num (24 bits used)               |
//! | 8..12  | psn (24 bits used)                  |
//! | 12..16 | rkey                                |
//! | 16..24 | vaddr                               |
//! | 24..28 | length of the advertised region     |
//!
//! Whatever follows the 28 bytes is the application's. The decoder treats its input as
//! untrusted: it checks length, magic, version and field ranges, and never indexes or
//! allocates by a value the peer chose. Note that the CM pads private data with zeros to the
//! transport maximum, so trailing zeros are normal.

use crate::error::{Error, Result};
use crate::verbs::mr::RemoteRegion;

/// What one side tells the other about its queue pair and its remotely accessible region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpInfo {
    /// The sender's QP number.
    pub qp_num: u32,
    /// The sender's starting PSN (informational: the CM negotiates the PSNs it uses).
    pub psn: u32,
    /// The rkey of the advertised region (0 when none).
    pub rkey: u32,
    /// The address of the advertised region (0 when none).
    pub vaddr: u64,
    /// The length of the advertised region (0 when none).
    pub len: u32,
}

const MAGIC: [u8; 2] = *b"RC";
const VERSION: u8 = 1;

impl QpInfo {
    /// Size of the encoded form.
    pub const ENCODED_LEN: usize = 28;

    /// The advertised region, if any.
    pub fn region(&self) -> Option<RemoteRegion> {
        (self.len > 0).then_some(RemoteRegion { addr: self.vaddr, rkey: self.rkey, len: self.len as u64 })
    }

    /// Encodes into the fixed layout.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..2].copy_from_slice(&MAGIC);
        b[2] = VERSION;
        b[4..8].copy_from_slice(&self.qp_num.to_be_bytes());
        b[8..12].copy_from_slice(&self.psn.to_be_bytes());
        b[12..16].copy_from_slice(&self.rkey.to_be_bytes());
        b[16..24].copy_from_slice(&self.vaddr.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Whether `data` starts with this format's magic (a peer of this crate), as opposed to a
    /// peer that sends no `QpInfo`, such as rdma-core's `rdma_client`.
    pub fn is_present(data: &[u8]) -> bool {
        data.len() >= 2 && data[0..2] == MAGIC
    }

    /// Decodes untrusted bytes; returns the info and the application bytes that follow.
    ///
    /// # Errors
    /// [`Error::PrivateData`] naming what was wrong.
    pub fn decode(data: &[u8]) -> Result<(QpInfo, &[u8])> {
        if data.len() < Self::ENCODED_LEN {
            return Err(Error::PrivateData("shorter than the 28-byte qp_info"));
        }
        if !Self::is_present(data) {
            return Err(Error::PrivateData("no qp_info magic: the peer does not speak this format"));
        }
        if data[2] != VERSION {
            return Err(Error::PrivateData("unsupported qp_info version"));
        }
        if data[3] != 0 {
            return Err(Error::PrivateData("reserved byte is not zero"));
        }
        let u32_at = |i: usize| u32::from_be_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
        let mut v = [0u8; 8];
        v.copy_from_slice(&data[16..24]);
        let info = QpInfo {
            qp_num: u32_at(4),
            psn: u32_at(8),
            rkey: u32_at(12),
            vaddr: u64::from_be_bytes(v),
            len: u32_at(24),
        };
        if info.qp_num > 0xFF_FFFF || info.qp_num == 0 {
            return Err(Error::PrivateData("qp_num is not a valid 24-bit QP number"));
        }
        if info.psn > 0xFF_FFFF {
            return Err(Error::PrivateData("psn exceeds 24 bits"));
        }
        if info.vaddr.checked_add(info.len as u64).is_none() {
            return Err(Error::PrivateData("advertised region wraps around the address space"));
        }
        if info.len == 0 && (info.rkey != 0 || info.vaddr != 0) {
            return Err(Error::PrivateData("rkey/vaddr given for an empty region"));
        }
        Ok((info, &data[Self::ENCODED_LEN..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> QpInfo {
        QpInfo { qp_num: 0x11, psn: 0xabcdef, rkey: 0x1234, vaddr: 0x7f00_0000_1000, len: 4096 }
    }

    #[test]
    fn round_trip_with_trailing_bytes() {
        let mut buf = [0u8; 56];
        buf[..28].copy_from_slice(&sample().encode());
        buf[28] = 9;
        let (info, rest) = QpInfo::decode(&buf).unwrap();
        assert_eq!(info, sample());
        assert_eq!(rest.len(), 28);
        assert_eq!(rest[0], 9);
        assert_eq!(info.region().unwrap().len, 4096);
    }

    #[test]
    fn hostile_inputs_are_rejected() {
        let good = sample().encode();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "shorter"),
            (good[..27].to_vec(), "shorter"),
            (vec![0u8; 56], "magic"),
            (
                {
                    let mut b = good;
                    b[2] = 2;
                    b.to_vec()
                },
                "version",
            ),
            (
                {
                    let mut b = good;
                    b[3] = 1;
                    b.to_vec()
                },
                "reserved",
            ),
            (
                {
                    let mut b = good;
                    b[4] = 1;
                    b.to_vec()
                },
                "qp_num",
            ),
            (
                {
                    let mut b = good;
                    b[4..8].copy_from_slice(&[0; 4]);
                    b.to_vec()
                },
                "qp_num",
            ),
            (
                {
                    let mut b = good;
                    b[8] = 1;
                    b.to_vec()
                },
                "psn",
            ),
            (
                {
                    let mut b = good;
                    b[16..24].copy_from_slice(&u64::MAX.to_be_bytes());
                    b.to_vec()
                },
                "wraps",
            ),
            (
                {
                    let mut b = good;
                    b[24..28].copy_from_slice(&[0; 4]);
                    b.to_vec()
                },
                "empty region",
            ),
        ];
        for (bytes, want) in cases {
            let e = QpInfo::decode(&bytes).unwrap_err().to_string();
            assert!(e.contains(want), "{bytes:?}: got {e}, wanted {want}");
        }
    }

    #[test]
    fn every_prefix_and_byte_flip_is_handled_without_panic() {
        let good = sample().encode();
        for n in 0..=good.len() {
            let _ = QpInfo::decode(&good[..n]);
        }
        for i in 0..good.len() {
            for bit in 0..8 {
                let mut b = good;
                b[i] ^= 1 << bit;
                if let Ok((info, _)) = QpInfo::decode(&b) {
                    assert!(info.qp_num <= 0xFF_FFFF && info.psn <= 0xFF_FFFF);
                    assert!(info.vaddr.checked_add(info.len as u64).is_some());
                }
            }
        }
    }

    /// A bounded fuzz run in the normal suite (the libFuzzer target lives in `fuzz/`): random
    /// inputs, and random mutations of a valid encoding, never panic, and whatever decodes
    /// satisfies every invariant the decoder promises.
    #[test]
    fn random_inputs_never_panic_and_decoded_values_hold_invariants() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let good = sample().encode();
        let mut decoded = 0;
        for round in 0..200_000 {
            let mut buf = [0u8; 80];
            let len = (rnd() % 81) as usize;
            if round % 2 == 0 {
                for b in &mut buf[..len] {
                    *b = rnd() as u8;
                }
                // Give random inputs a valid header often enough to reach the field checks.
                if len >= 3 && rnd() % 2 == 0 {
                    buf[..3].copy_from_slice(&good[..3]);
                }
            } else {
                buf[..good.len()].copy_from_slice(&good);
                for _ in 0..(rnd() % 4) {
                    let i = (rnd() % good.len() as u64) as usize;
                    buf[i] = rnd() as u8;
                }
            }
            if let Ok((info, rest)) = QpInfo::decode(&buf[..len]) {
                decoded += 1;
                assert!(info.qp_num > 0 && info.qp_num <= 0xFF_FFFF);
                assert!(info.psn <= 0xFF_FFFF);
                assert!(info.vaddr.checked_add(info.len as u64).is_some());
                assert!(info.len > 0 || (info.rkey == 0 && info.vaddr == 0));
                assert_eq!(rest.len(), len - QpInfo::ENCODED_LEN);
                assert_eq!(QpInfo::decode(&info.encode()).unwrap().0, info, "re-encoding round-trips");
            }
        }
        assert!(decoded > 1000, "the run must reach successful decodes too ({decoded})");
    }
}
