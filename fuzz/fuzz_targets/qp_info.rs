//! Fuzzes the decoder of the peer's private data (untrusted input).
//!
//! ```text
//! cargo install cargo-fuzz && cargo +nightly fuzz run qp_info     # from the crate's root
//! ```
//! The normal test suite runs a bounded version of this (src/cm/private_data.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdma_cm::QpInfo;

fuzz_target!(|data: &[u8]| {
    if let Ok((info, rest)) = QpInfo::decode(data) {
        assert!(info.qp_num > 0 && info.qp_num <= 0xFF_FFFF);
        assert!(info.psn <= 0xFF_FFFF);
        assert!(info.vaddr.checked_add(info.len).is_some());
        // Version 2, or version 1 of earlier releases, whose application bytes start sooner.
        let encoded = if data[2] == 1 { QpInfo::ENCODED_LEN_V1 } else { QpInfo::ENCODED_LEN };
        assert_eq!(rest.len(), data.len() - encoded);
        assert_eq!(QpInfo::decode(&info.encode()).unwrap().0, info);
    }
});
