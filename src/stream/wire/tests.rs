use super::*;

/// The target SGL and receive buffer of the examples: page-aligned, as rsocket allocates
/// them, with the default 128 KiB receive buffer (so a 64 KiB half).
const SGL: Sge = Sge { addr: 0x7f12_3456_7000, key: 0x1234, length: SGL_SLOTS };
const RBUF: Sge = Sge { addr: 0x7f12_3458_0000, key: 0x5678, length: DEFAULT_BUFFER_SIZE / 2 };

/// What `rs_format_conn_data` writes on a little-endian host with default settings:
/// version 1, flags IOMAP only, credits 384 big-endian, reserved zero, iomap size 0, then the
/// target SGL and the first buffer half, each as big-endian address, key, length.
const X86_DEFAULT: [u8; CONN_DATA_LEN] = [
    0x01, 0x02, 0x01, 0x80, 0x00, 0x00, 0x00, 0x00, //
    0x00, 0x00, 0x7f, 0x12, 0x34, 0x56, 0x70, 0x00, //
    0x00, 0x00, 0x12, 0x34, 0x00, 0x00, 0x00, 0x02, //
    0x00, 0x00, 0x7f, 0x12, 0x34, 0x58, 0x00, 0x00, //
    0x00, 0x00, 0x56, 0x78, 0x00, 0x01, 0x00, 0x00, //
];

fn x86_default() -> ConnData {
    ConnData {
        order: ByteOrder::Little,
        iomap: true,
        credits: DEFAULT_QUEUE_SIZE,
        target_iomap_size: 0,
        target_sgl: SGL,
        data_buf: RBUF,
    }
}

#[test]
fn native_order_is_the_targets() {
    let expect = if cfg!(target_endian = "big") { ByteOrder::Big } else { ByteOrder::Little };
    assert_eq!(ByteOrder::native(), expect);
    assert_eq!(ConnData::new(384, SGL, RBUF).order, expect);
}

#[test]
fn conn_data_bytes_match_rsocket_on_x86() {
    assert_eq!(x86_default().encode(), X86_DEFAULT);
    if cfg!(target_endian = "little") {
        assert_eq!(ConnData::new(DEFAULT_QUEUE_SIZE, SGL, RBUF).encode(), X86_DEFAULT);
    }
}

#[test]
fn big_endian_host_sets_the_net_flag_and_nothing_else_changes() {
    let mut be = x86_default();
    be.order = ByteOrder::Big;
    let bytes = be.encode();
    assert_eq!(bytes[1], FLAG_NET | FLAG_IOMAP);
    assert_eq!(bytes[..1], X86_DEFAULT[..1]);
    assert_eq!(bytes[2..], X86_DEFAULT[2..]);
    assert_eq!(ConnData::decode(&bytes), Ok(be));
}

#[test]
fn conn_data_round_trips_with_iomap_and_odd_values() {
    let d = ConnData {
        order: ByteOrder::Big,
        iomap: true,
        credits: QP_MAX_SIZE,
        target_iomap_size: iomap_size_to_scale(4096),
        target_sgl: Sge { addr: 0x1000, key: 0xdead_beef, length: 3 },
        data_buf: Sge { addr: u64::MAX - 0xffff, key: 1, length: 0x1_0000 },
    };
    assert_eq!(ConnData::decode(&d.encode()), Ok(d));
    assert_eq!(d.iomap_entries(), 4096);
}

#[test]
fn decode_reads_rsockets_bytes_and_ignores_padding() {
    assert_eq!(ConnData::decode(&X86_DEFAULT), Ok(x86_default()));
    // An InfiniBand connect request delivers 56 bytes, the reply 196, zero-padded.
    let mut padded = [0u8; 196];
    padded[..CONN_DATA_LEN].copy_from_slice(&X86_DEFAULT);
    padded[CONN_DATA_LEN..].fill(0xa5);
    assert_eq!(ConnData::decode(&padded), Ok(x86_default()));
}

#[test]
fn decode_ignores_reserved_bytes_and_unknown_flags() {
    let mut b = X86_DEFAULT;
    b[1] |= 0xfc;
    b[4..7].copy_from_slice(&[0xff, 0xee, 0xdd]);
    assert_eq!(ConnData::decode(&b), Ok(x86_default()));
}

#[test]
fn decode_refuses_short_data() {
    assert_eq!(
        ConnData::decode(&X86_DEFAULT[..39]),
        Err(WireError::Short { what: "connection data", len: 39, need: 40 })
    );
    assert_eq!(ConnData::decode(&[]), Err(WireError::Short { what: "connection data", len: 0, need: 40 }));
}

#[test]
fn decode_refuses_other_versions() {
    for v in [0u8, 2, 0xff] {
        let mut b = X86_DEFAULT;
        b[0] = v;
        assert_eq!(ConnData::decode(&b), Err(WireError::Version { version: v }));
    }
}

#[test]
fn decode_refuses_fewer_than_two_slots() {
    for slots in [0u32, 1] {
        let mut b = X86_DEFAULT;
        b[20..24].copy_from_slice(&slots.to_be_bytes());
        assert_eq!(ConnData::decode(&b), Err(WireError::TooFewSlots { slots }));
    }
}

#[test]
fn decode_refuses_an_empty_first_half() {
    let mut b = X86_DEFAULT;
    b[36..40].fill(0);
    assert_eq!(ConnData::decode(&b), Err(WireError::EmptyRegion { region: Region::DataBuf }));
}

#[test]
fn decode_refuses_a_first_half_past_the_address_space() {
    let mut b = X86_DEFAULT;
    b[24..32].copy_from_slice(&(u64::MAX - 0xfffe).to_be_bytes());
    assert_eq!(
        ConnData::decode(&b),
        Err(WireError::RegionWraps { region: Region::DataBuf, addr: u64::MAX - 0xfffe, len: 0x1_0000 })
    );
    // Ending exactly at the top is not a wrap.
    b[24..32].copy_from_slice(&(u64::MAX - 0xffff).to_be_bytes());
    assert!(ConnData::decode(&b).is_ok());
}

#[test]
fn decode_refuses_a_slot_array_or_iomap_table_past_the_address_space() {
    let mut b = X86_DEFAULT;
    b[8..16].copy_from_slice(&(u64::MAX - 30).to_be_bytes());
    assert_eq!(
        ConnData::decode(&b),
        Err(WireError::RegionWraps { region: Region::TargetSgl, addr: u64::MAX - 30, len: 32 })
    );
    // The slots fit, but the 2 iomap entries after them do not.
    b[8..16].copy_from_slice(&(u64::MAX - 31).to_be_bytes());
    assert!(ConnData::decode(&b).is_ok());
    b[7] = 2;
    assert_eq!(
        ConnData::decode(&b),
        Err(WireError::RegionWraps { region: Region::TargetSgl, addr: u64::MAX - 31, len: 32 + 64 })
    );
    // Without the iomap flag the size byte means nothing.
    b[1] &= !FLAG_IOMAP;
    assert!(ConnData::decode(&b).is_ok());
}

#[test]
fn iomap_scale_matches_rsockets_formula() {
    // rs_value_to_scale(v, 8): v <= 128 ? v : 0x80 | v >> 8; rs_scale_to_value is its inverse.
    for (size, scale) in [(0u16, 0u8), (1, 1), (128, 128), (129, 0x80), (256, 0x81), (300, 0x81), (32512, 0xff)] {
        assert_eq!(iomap_size_to_scale(size), scale, "size {size}");
    }
    for (scale, size) in [(0u8, 0u16), (100, 100), (128, 128), (0x81, 256), (0x82, 512), (0xff, 32512)] {
        assert_eq!(iomap_scale_to_size(scale), size, "scale {scale:#x}");
    }
    assert_eq!(iomap_size_to_scale(u16::MAX), 0xff);
    let mut d = x86_default();
    d.target_iomap_size = 0x82;
    assert_eq!(d.iomap_entries(), 512);
    d.iomap = false;
    assert_eq!(d.iomap_entries(), 0);
}

#[test]
fn messages_have_rsockets_values() {
    // rs_msg_set(op, data) = op << 29 | data.
    assert_eq!(Msg::Data { len: 1000 }.to_imm(), 0x0000_03e8);
    assert_eq!(Msg::Data { len: MAX_TRANSFER }.to_imm(), 0x0001_0000);
    assert_eq!(Msg::Sgl { limit: 384 }.to_imm(), 0x8000_0180);
    assert_eq!(Msg::IoMapSgl { index: 3 }.to_imm(), 0xc000_0003);
    assert_eq!(Msg::Ctrl(Ctrl::Disconnect).to_imm(), 0xe000_0000);
    assert_eq!(Msg::Ctrl(Ctrl::Keepalive).to_imm(), 0xe000_0001);
    assert_eq!(Msg::Ctrl(Ctrl::Shutdown).to_imm(), 0xe000_0002);
}

#[test]
fn messages_round_trip() {
    for m in [
        Msg::Data { len: 0 },
        Msg::Data { len: 1 },
        Msg::Data { len: MAX_MSG_DATA },
        Msg::Sgl { limit: 0 },
        Msg::Sgl { limit: u16::MAX },
        Msg::IoMapSgl { index: u16::MAX },
        Msg::Ctrl(Ctrl::Disconnect),
        Msg::Ctrl(Ctrl::Keepalive),
        Msg::Ctrl(Ctrl::Shutdown),
    ] {
        assert_eq!(Msg::from_imm(m.to_imm()), Ok(m));
        for order in [ByteOrder::Little, ByteOrder::Big] {
            assert_eq!(Msg::from_payload(&m.to_payload(order), order), Ok(m));
        }
    }
}

#[test]
fn credit_update_keeps_the_low_16_bits_as_rsocket_does() {
    // rseq_no 0xfff0 + rq_size 384 = 0x10170: rsocket sends it whole, the peer keeps 0x0170.
    assert_eq!(Msg::from_imm(0x8001_0170), Ok(Msg::Sgl { limit: 0x0170 }));
    assert_eq!(Msg::from_imm(0x8001_fffd), Ok(Msg::Sgl { limit: 0xfffd }));
    assert_eq!(Msg::from_imm(0x8002_0000), Err(WireError::CreditOutOfRange { value: 0x2_0000 }));
    assert_eq!(Msg::from_imm(0x9fff_ffff), Err(WireError::CreditOutOfRange { value: MAX_MSG_DATA }));
}

#[test]
fn reserved_and_write_operations_are_refused() {
    for op in [1u32, 3, 5] {
        let imm = op << 29 | 16;
        assert_eq!(Msg::from_imm(imm), Err(WireError::ReservedOp { op: op as u8, imm }));
    }
    assert_eq!(Msg::from_imm(0x4000_0010), Err(WireError::WriteOp { imm: 0x4000_0010 }));
}

#[test]
fn unknown_control_values_are_refused() {
    assert_eq!(Msg::from_imm(0xe000_0003), Err(WireError::UnknownCtrl { value: 3 }));
    assert_eq!(Msg::from_imm(0xffff_ffff), Err(WireError::UnknownCtrl { value: MAX_MSG_DATA }));
}

#[test]
fn iomap_updates_with_reserved_bits_are_refused() {
    assert_eq!(Msg::from_imm(0xc000_ffff), Ok(Msg::IoMapSgl { index: 0xffff }));
    assert_eq!(Msg::from_imm(0xc001_0000), Err(WireError::IoMapReservedBits { imm: 0xc001_0000 }));
}

#[test]
#[should_panic(expected = "at most")]
fn data_longer_than_29_bits_cannot_be_encoded() {
    Msg::Data { len: MAX_MSG_DATA + 1 }.to_imm();
}

#[test]
fn iwarp_payload_is_in_the_given_order() {
    // An x86 rsocket sends the host-order u32 0x80000180 as bytes 80 01 00 80.
    assert_eq!(Msg::Sgl { limit: 384 }.to_payload(ByteOrder::Little), [0x80, 0x01, 0x00, 0x80]);
    assert_eq!(Msg::Sgl { limit: 384 }.to_payload(ByteOrder::Big), [0x80, 0x00, 0x01, 0x80]);
    assert_eq!(Msg::from_payload(&[0x02, 0x00, 0x00, 0xe0], ByteOrder::Little), Ok(Msg::Ctrl(Ctrl::Shutdown)));
    // Read in the wrong order, the same bytes are a different message.
    assert_eq!(Msg::from_payload(&[0x02, 0x00, 0x00, 0xe0], ByteOrder::Big), Ok(Msg::Data { len: 0x0200_00e0 }));
}

#[test]
fn iwarp_payload_must_be_four_bytes() {
    assert_eq!(Msg::from_payload(&[0; 3], ByteOrder::Little), Err(WireError::PayloadLen { len: 3 }));
    assert_eq!(Msg::from_payload(&[0; 5], ByteOrder::Little), Err(WireError::PayloadLen { len: 5 }));
    assert_eq!(Msg::from_payload(&[], ByteOrder::Big), Err(WireError::PayloadLen { len: 0 }));
}

#[test]
fn grant_bytes_follow_the_owners_order() {
    // rs_send_credits on an x86 host granting the second 64 KiB half to an x86 peer.
    let grant = Sge { addr: 0x7f12_3459_0000, key: 0x5678, length: 0x1_0000 };
    let le = [
        0x00, 0x00, 0x59, 0x34, 0x12, 0x7f, 0x00, 0x00, //
        0x78, 0x56, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, //
    ];
    let be = [
        0x00, 0x00, 0x7f, 0x12, 0x34, 0x59, 0x00, 0x00, //
        0x00, 0x00, 0x56, 0x78, 0x00, 0x01, 0x00, 0x00, //
    ];
    assert_eq!(grant.encode(ByteOrder::Little), le);
    assert_eq!(grant.encode(ByteOrder::Big), be);
    assert_eq!(Sge::decode(&le, ByteOrder::Little), grant);
    assert_eq!(Sge::decode(&be, ByteOrder::Big), grant);
    assert_ne!(Sge::decode(&le, ByteOrder::Big), grant);
    assert_eq!(grant.check_grant(), Ok(grant));
}

#[test]
fn empty_or_wrapping_grants_are_refused() {
    let empty = Sge { addr: 0x1000, key: 1, length: 0 };
    assert_eq!(empty.check_grant(), Err(WireError::EmptyRegion { region: Region::Grant }));
    let wraps = Sge { addr: u64::MAX - 10, key: 1, length: 12 };
    assert_eq!(
        wraps.check_grant(),
        Err(WireError::RegionWraps { region: Region::Grant, addr: u64::MAX - 10, len: 12 })
    );
    let top = Sge { addr: u64::MAX - 11, key: 1, length: 12 };
    assert_eq!(top.check_grant(), Ok(top));
}

#[test]
fn errors_name_what_the_peer_sent() {
    let msg = |e: WireError| e.to_string();
    assert!(msg(WireError::Version { version: 7 }).contains("version 7"));
    assert!(msg(WireError::TooFewSlots { slots: 1 }).contains("1 target SGL slot"));
    assert!(msg(WireError::ReservedOp { op: 3, imm: 0x6000_0001 }).contains("0x60000001"));
    assert!(msg(WireError::UnknownCtrl { value: 9 }).contains("control message 9"));
    assert!(msg(WireError::RegionWraps { region: Region::DataBuf, addr: 0xff, len: 2 }).contains("data_buf"));
    assert!(msg(WireError::Short { what: "connection data", len: 3, need: 40 }).contains("3 bytes"));
}
