//! [`QpInfo`]: the seed program's `qp_info` (qp_num, psn, rkey, vaddr, length) in a fixed wire
//! layout.
//!
//! ```no_run
//! use std::sync::Arc;
//! use rdma_cm::{AccessFlags, ConnParam, MemoryRegion, ProtectionDomain, QpInfo};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! # let pd: Arc<ProtectionDomain> = unimplemented!();
//! // The server advertises a region in its accept's private data...
//! let table = MemoryRegion::new(&pd, 1 << 20, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
//! let r = table.remote();
//! let info = QpInfo { rkey: r.rkey, vaddr: r.addr, len: r.len, ..QpInfo::default() };
//! let param = ConnParam::new().private_data(&info.encode())?; // for `server.accept`
//! // ...and the client decodes what `client.connect` returned.
//! # let reply = info.encode();
//! let (info, app_bytes) = QpInfo::decode(&reply)?;
//! let remote = info.region().expect("a region was advertised"); // for SendWr::read / SendWr::write
//! # let _ = (param, app_bytes, remote);
//! # Ok(()) }
//! ```
//!
//! Peers exchange it through the CM private data. The layout is fixed and big-endian; this is
//! version 2, whose length is 64 bits (a table over 4 GiB can be advertised):
//!
//! | bytes  | field                               |
//! |--------|-------------------------------------|
//! | 0..2   | magic `b"RC"`                       |
//! | 2      | version (2)                         |
//! | 3      | reserved, 0                         |
//! | 4..8   | qp_num (24 bits used)               |
//! | 8..12  | psn (24 bits used)                  |
//! | 12..16 | rkey                                |
//! | 16..24 | vaddr                               |
//! | 24..32 | length of the advertised region     |
//!
//! Whatever follows the 32 bytes is the application's: 24 bytes fit beside it in an RC connect
//! request (56 bytes of private data), 164 in an accept (196). Version 1, from earlier releases,
//! is 28 bytes with a 32-bit length at 24..28; it is still decoded (its application bytes
//! start at 28), and [`QpInfo::encode_v1`] writes it for such a peer. The decoder treats its
//! input as untrusted: it checks length, magic, version and field ranges, and never indexes or
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
    pub len: u64,
}

const MAGIC: [u8; 2] = *b"RC";
const VERSION: u8 = 2;
const VERSION_1: u8 = 1;

impl QpInfo {
    /// Size of the encoded form (version 2).
    pub const ENCODED_LEN: usize = 32;
    /// Size of the version 1 form (a 32-bit length), which earlier releases send.
    pub const ENCODED_LEN_V1: usize = 28;

    /// The advertised region, if any.
    pub fn region(&self) -> Option<RemoteRegion> {
        (self.len > 0).then_some(RemoteRegion { addr: self.vaddr, rkey: self.rkey, len: self.len })
    }

    /// The fields both versions share, at 0..24.
    fn encode_head(&self, b: &mut [u8], version: u8) {
        b[0..2].copy_from_slice(&MAGIC);
        b[2] = version;
        b[4..8].copy_from_slice(&self.qp_num.to_be_bytes());
        b[8..12].copy_from_slice(&self.psn.to_be_bytes());
        b[12..16].copy_from_slice(&self.rkey.to_be_bytes());
        b[16..24].copy_from_slice(&self.vaddr.to_be_bytes());
    }

    /// Encodes into the fixed layout (version 2).
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        self.encode_head(&mut b, VERSION);
        b[24..32].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Encodes into the version 1 layout, for a peer of an earlier release (which refuses
    /// version 2 as an unsupported version).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the length does not fit version 1's 32 bits.
    pub fn encode_v1(&self) -> Result<[u8; Self::ENCODED_LEN_V1]> {
        let len = u32::try_from(self.len).map_err(|_| {
            Error::InvalidArgument(format!(
                "QpInfo::encode_v1: a region of {} bytes does not fit version 1's 32-bit length (use encode)",
                self.len
            ))
        })?;
        let mut b = [0u8; Self::ENCODED_LEN_V1];
        self.encode_head(&mut b, VERSION_1);
        b[24..28].copy_from_slice(&len.to_be_bytes());
        Ok(b)
    }

    /// Whether `data` starts with this format's magic (a peer of this crate), as opposed to a
    /// peer that sends no `QpInfo`, such as rdma-core's `rdma_client`.
    pub fn is_present(data: &[u8]) -> bool {
        data.len() >= 2 && data[0..2] == MAGIC
    }

    /// Decodes untrusted bytes (version 2, or version 1 from a peer of an earlier release);
    /// returns the info and the application bytes that follow it.
    ///
    /// # Errors
    /// [`Error::PrivateData`] naming what was wrong.
    pub fn decode(data: &[u8]) -> Result<(QpInfo, &[u8])> {
        if data.len() < 4 {
            return Err(Error::PrivateData("shorter than the 4-byte qp_info header"));
        }
        if !Self::is_present(data) {
            return Err(Error::PrivateData("no qp_info magic: the peer does not speak this format"));
        }
        let encoded = match data[2] {
            VERSION => Self::ENCODED_LEN,
            VERSION_1 => Self::ENCODED_LEN_V1,
            _ => {
                return Err(Error::PrivateData(
                    "unsupported qp_info version (this side reads versions 1 and 2): the peer runs another release",
                ))
            }
        };
        if data.len() < encoded {
            return Err(Error::PrivateData(if encoded == Self::ENCODED_LEN {
                "shorter than the 32-byte qp_info of version 2"
            } else {
                "shorter than the 28-byte qp_info of version 1"
            }));
        }
        if data[3] != 0 {
            return Err(Error::PrivateData("reserved byte is not zero"));
        }
        let u32_at = |i: usize| u32::from_be_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
        let u64_at = |i: usize| (u32_at(i) as u64) << 32 | u32_at(i + 4) as u64;
        let info = QpInfo {
            qp_num: u32_at(4),
            psn: u32_at(8),
            rkey: u32_at(12),
            vaddr: u64_at(16),
            len: if encoded == Self::ENCODED_LEN { u64_at(24) } else { u32_at(24) as u64 },
        };
        if info.qp_num > 0xFF_FFFF || info.qp_num == 0 {
            return Err(Error::PrivateData("qp_num is not a valid 24-bit QP number"));
        }
        if info.psn > 0xFF_FFFF {
            return Err(Error::PrivateData("psn exceeds 24 bits"));
        }
        if info.vaddr.checked_add(info.len).is_none() {
            return Err(Error::PrivateData("advertised region wraps around the address space"));
        }
        if info.len == 0 && (info.rkey != 0 || info.vaddr != 0) {
            return Err(Error::PrivateData("rkey/vaddr given for an empty region"));
        }
        Ok((info, &data[encoded..]))
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
        buf[..32].copy_from_slice(&sample().encode());
        buf[32] = 9;
        let (info, rest) = QpInfo::decode(&buf).unwrap();
        assert_eq!(info, sample());
        assert_eq!(rest.len(), 24);
        assert_eq!(rest[0], 9);
        assert_eq!(info.region().unwrap().len, 4096);
    }

    #[test]
    fn a_region_over_4_gib_is_advertised_whole() {
        let big = QpInfo { len: (5 << 30) + 7, ..sample() };
        let bytes = big.encode();
        let (info, rest) = QpInfo::decode(&bytes).unwrap();
        assert_eq!((info, rest.len()), (big, 0));
        assert_eq!(info.region().unwrap().len, (5 << 30) + 7);
        let e = big.encode_v1().unwrap_err().to_string();
        assert!(e.contains("32-bit") && e.contains(&big.len.to_string()), "{e}");
    }

    /// A peer of an earlier release sends version 1 (28 bytes, a 32-bit length): it decodes,
    /// its application bytes start at 28, and a short one says which version it was short of.
    #[test]
    fn the_version_1_layout_of_earlier_releases_still_decodes() {
        let v1 = sample().encode_v1().unwrap();
        let v2 = sample().encode();
        assert_eq!((&v1[..2], &v1[3..24]), (&v2[..2], &v2[3..24]), "the versions share all but the version byte");
        assert_eq!((v1[2], &v1[24..28]), (1, &4096u32.to_be_bytes()[..]));
        let mut buf = [0u8; 56];
        buf[..28].copy_from_slice(&v1);
        buf[28] = 9;
        let (info, rest) = QpInfo::decode(&buf).unwrap();
        assert_eq!((info, rest.len(), rest[0]), (sample(), 28, 9));
        let e = QpInfo::decode(&v1[..27]).unwrap_err().to_string();
        assert!(e.contains("28-byte") && e.contains("version 1"), "{e}");
        let e = QpInfo::decode(&sample().encode()[..31]).unwrap_err().to_string();
        assert!(e.contains("32-byte") && e.contains("version 2"), "{e}");
    }

    #[test]
    fn hostile_inputs_are_rejected() {
        let good = sample().encode();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "shorter"),
            (good[..31].to_vec(), "shorter"),
            (good[..3].to_vec(), "shorter"),
            (vec![0u8; 56], "magic"),
            (
                {
                    let mut b = good;
                    b[2] = 3;
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
                    b[24..32].copy_from_slice(&[0; 8]);
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
                    assert!(info.vaddr.checked_add(info.len).is_some());
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
                assert!(info.vaddr.checked_add(info.len).is_some());
                assert!(info.len > 0 || (info.rkey == 0 && info.vaddr == 0));
                let encoded = if buf[2] == 1 { QpInfo::ENCODED_LEN_V1 } else { QpInfo::ENCODED_LEN };
                assert_eq!(rest.len(), len - encoded);
                assert_eq!(QpInfo::decode(&info.encode()).unwrap().0, info, "re-encoding round-trips");
            }
        }
        assert!(decoded > 1000, "the run must reach successful decodes too ({decoded})");
    }
}
