//! The rsocket wire format: connection data, messages and buffer grants.
//!
//! Three things cross the wire besides the payload itself (`docs/rsocket-protocol.md` has the
//! whole protocol):
//!
//! - [`ConnData`], 40 bytes of private data in the connect request and in the reply, always
//!   big-endian: the sender's receive queue size (its initial credits), where the peer may
//!   write buffer grants (the *target SGL*), and the first half of its receive buffer.
//! - [`Msg`], a 32-bit value: 3 bits of operation and 29 bits of argument. On InfiniBand and
//!   RoCE it is the immediate data of an RDMA WRITE WITH IMMEDIATE ([`Msg::to_imm`], in host
//!   order; the verbs layer puts it on the wire big-endian). iWARP has no immediate data, so
//!   there it is the 4-byte payload of a SEND ([`Msg::to_payload`]).
//! - [`Sge`], 16 bytes written into one slot of the peer's target SGL to grant it the next
//!   half of a receive buffer, in the byte order the slot's owner declared ([`ByteOrder`]).
//!
//! Decoding refuses what a peer could send to mislead the stream: see [`WireError`]. Nothing
//! here allocates or touches a device.
//!
//! ```
//! use rdma_cm::stream::wire::{ByteOrder, ConnData, Msg, Sge};
//!
//! // What an rsocket on an x86 host with default settings sends.
//! let sgl = Sge { addr: 0x7f12_3456_7000, key: 0x1234, length: 2 };
//! let rbuf = Sge { addr: 0x7f12_3458_0000, key: 0x5678, length: 64 * 1024 };
//! let mine = ConnData::new(384, sgl, rbuf);
//! let bytes = mine.encode();
//! assert_eq!(ConnData::decode(&bytes), Ok(mine));
//!
//! assert_eq!(Msg::Data { len: 1000 }.to_imm(), 0x0000_03e8);
//! assert_eq!(Msg::from_imm(0x8000_0180), Ok(Msg::Sgl { limit: 384 }));
//! assert_eq!(Msg::Sgl { limit: 384 }.to_payload(ByteOrder::Little), [0x80, 0x01, 0x00, 0x80]);
//! ```

use thiserror::Error;

/// Size of [`ConnData`] on the wire (`sizeof(struct rs_conn_data)`).
pub const CONN_DATA_LEN: usize = 40;

/// The only connection-data version there is; both rsocket sides refuse any other.
pub const CONN_DATA_VERSION: u8 = 1;

/// Connection-data flag: the sender's host is big-endian, so grants written into its target
/// SGL must be big-endian (`RS_CONN_FLAG_NET`).
pub const FLAG_NET: u8 = 1 << 0;

/// Connection-data flag: the iomap fields are meaningful (`RS_CONN_FLAG_IOMAP`). rsocket always
/// sets it, even with no iomap entries.
pub const FLAG_IOMAP: u8 = 1 << 1;

/// Size of one [`Sge`] (`struct rs_sge`) in a target-SGL slot.
pub const SGE_LEN: usize = 16;

/// Size of one iomap table entry (`struct rs_iomap`: a 64-bit offset, then an [`Sge`]).
pub const IOMAP_ENTRY_LEN: usize = 32;

/// Number of target-SGL slots rsocket advertises (`RS_SGL_SIZE`), and the fewest a peer may
/// advertise: one slot is written into while the other is in use.
pub const SGL_SLOTS: u32 = 2;

/// Size of a message sent as a SEND on iWARP (`RS_MSG_SIZE`).
pub const MSG_PAYLOAD_LEN: usize = 4;

/// Largest argument a message can carry (29 bits).
pub const MAX_MSG_DATA: u32 = (1 << 29) - 1;

/// Largest single data WRITE rsocket posts (`RS_MAX_TRANSFER`).
pub const MAX_TRANSFER: u32 = 65536;

/// Size of the first data WRITE of a large send; each next one may be twice the previous, up
/// to [`MAX_TRANSFER`] (`RS_OLAP_START_SIZE`).
pub const OLAP_START_SIZE: u32 = 2048;

/// Free send-buffer space rsocket needs before it starts a WRITE (`RS_SNDLOWAT`).
pub const SNDLOWAT: u32 = 2048;

/// Send-queue entries rsocket reserves for control messages (`RS_QP_CTRL_SIZE`).
pub const QP_CTRL_SIZE: u16 = 4;

/// Smallest send or receive queue rsocket uses (`RS_QP_MIN_SIZE`).
pub const QP_MIN_SIZE: u16 = 16;

/// Largest send or receive queue rsocket uses (`RS_QP_MAX_SIZE`); also the largest credit count.
pub const QP_MAX_SIZE: u16 = 0xfffe;

/// rsocket's default send and receive queue sizes, and so its default credits.
pub const DEFAULT_QUEUE_SIZE: u16 = 384;

/// rsocket's default inline size in bytes.
pub const DEFAULT_INLINE: u32 = 64;

/// rsocket's default receive (and send) buffer size: two halves of 64 KiB.
pub const DEFAULT_BUFFER_SIZE: u32 = 1 << 17;

/// Largest credit update an rsocket can send: a 16-bit sequence number plus a queue size of up
/// to [`QP_MAX_SIZE`], not reduced modulo 2^16. Anything wider is refused.
const MAX_CREDIT_VALUE: u32 = 0x1_ffff;

/// The byte order of a host, as the connection data declares it with [`FLAG_NET`].
///
/// Grants ([`Sge`]) written into a peer's target SGL, and on iWARP the 4-byte messages, follow
/// the order of the peer that reads them. The connection data itself is always big-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ByteOrder {
    /// Little-endian (no [`FLAG_NET`]): x86, little-endian ARM and RISC-V.
    Little,
    /// Big-endian ([`FLAG_NET`] set; "network order").
    Big,
}

impl ByteOrder {
    /// This host's byte order: what an rsocket running here declares.
    pub const fn native() -> ByteOrder {
        if cfg!(target_endian = "big") {
            ByteOrder::Big
        } else {
            ByteOrder::Little
        }
    }

    fn u32_bytes(self, v: u32) -> [u8; 4] {
        match self {
            ByteOrder::Little => v.to_le_bytes(),
            ByteOrder::Big => v.to_be_bytes(),
        }
    }

    fn u64_bytes(self, v: u64) -> [u8; 8] {
        match self {
            ByteOrder::Little => v.to_le_bytes(),
            ByteOrder::Big => v.to_be_bytes(),
        }
    }

    fn read_u32(self, b: [u8; 4]) -> u32 {
        match self {
            ByteOrder::Little => u32::from_le_bytes(b),
            ByteOrder::Big => u32::from_be_bytes(b),
        }
    }

    fn read_u64(self, b: [u8; 8]) -> u64 {
        match self {
            ByteOrder::Little => u64::from_le_bytes(b),
            ByteOrder::Big => u64::from_be_bytes(b),
        }
    }
}

/// Which region of the peer's memory a [`WireError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Region {
    /// The first half of the peer's receive buffer, granted in its connection data (`data_buf`).
    DataBuf,
    /// The peer's target-SGL slot array, with its iomap table right after it when it has one.
    TargetSgl,
    /// A later half of the peer's receive buffer, granted by writing an [`Sge`] into one of our
    /// target-SGL slots.
    Grant,
}

impl std::fmt::Display for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Region::DataBuf => "first receive-buffer half (data_buf)",
            Region::TargetSgl => "target SGL array (with its iomap table)",
            Region::Grant => "granted receive-buffer half",
        })
    }
}

/// What a peer sent that the stream refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the structure needs.
    #[error("the peer's {what} is {len} bytes long; it needs at least {need}")]
    Short {
        /// What was being decoded.
        what: &'static str,
        /// How many bytes arrived.
        len: usize,
        /// How many the structure needs.
        need: usize,
    },
    /// A connection-data version other than [`CONN_DATA_VERSION`].
    #[error("the peer's connection data has version {version}; rsocket knows only version 1")]
    Version {
        /// The version the peer sent.
        version: u8,
    },
    /// Fewer target-SGL slots than [`SGL_SLOTS`].
    #[error(
        "the peer advertises {slots} target SGL slot(s); the protocol needs at least 2 \
         (one in use while the next grant is written into another)"
    )]
    TooFewSlots {
        /// The slot count the peer sent (`target_sgl.length`).
        slots: u32,
    },
    /// A region of length zero where data is to be written.
    #[error("the peer's {region} has length 0: nothing could ever be written into it")]
    EmptyRegion {
        /// Which region.
        region: Region,
    },
    /// A region whose end lies beyond the 64-bit address space.
    #[error("the peer's {region} at {addr:#x}, {len} bytes long, runs past the end of the 64-bit address space")]
    RegionWraps {
        /// Which region.
        region: Region,
        /// Its start address, as the peer sent it.
        addr: u64,
        /// Its length in bytes.
        len: u64,
    },
    /// A message with one of the reserved operations (1, 3 or 5), which no rsocket sends.
    #[error("the peer sent message {imm:#010x}, whose operation {op} is reserved")]
    ReservedOp {
        /// The operation (bits 31..29).
        op: u8,
        /// The whole message.
        imm: u32,
    },
    /// A message with operation 2 (`RS_OP_WRITE`), which only tags a local work request.
    #[error(
        "the peer sent message {imm:#010x} with operation 2 (RS_OP_WRITE), which names a plain RDMA \
         WRITE and is never sent as a message"
    )]
    WriteOp {
        /// The whole message.
        imm: u32,
    },
    /// A control message with a value other than disconnect, keepalive or shutdown.
    #[error("the peer sent control message {value}; only 0 (disconnect), 1 (keepalive) and 2 (shutdown) exist")]
    UnknownCtrl {
        /// The control value (bits 28..0).
        value: u32,
    },
    /// A credit update wider than a sequence number plus a queue size can make.
    #[error(
        "the peer sent credit update {value:#x}, larger than any 16-bit sequence number plus \
         queue size (at most 0x1ffff)"
    )]
    CreditOutOfRange {
        /// The update's argument (bits 28..0).
        value: u32,
    },
    /// An iomap update with any of the reserved bits 28..16 set.
    #[error("the peer sent iomap update {imm:#010x}, which sets the reserved bits 28..16")]
    IoMapReservedBits {
        /// The whole message.
        imm: u32,
    },
    /// An iWARP message SEND whose payload is not exactly [`MSG_PAYLOAD_LEN`] bytes.
    #[error("the peer's message SEND carried {len} bytes; a message is exactly 4")]
    PayloadLen {
        /// The payload length received.
        len: usize,
    },
}

/// Checks that `len` bytes from `addr` stay inside the 64-bit address space.
fn check_span(region: Region, addr: u64, len: u64) -> Result<(), WireError> {
    if u128::from(addr) + u128::from(len) > 1u128 << 64 {
        return Err(WireError::RegionWraps { region, addr, len });
    }
    Ok(())
}

/// A remote memory range (`struct rs_sge`): address, rkey, length.
///
/// In the connection data its fields are big-endian; in a target-SGL slot they are in the
/// byte order of the slot's owner. Field order on the wire: `addr` (8 bytes), `key` (4),
/// `length` (4). In [`ConnData::target_sgl`], `length` counts slots, not bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sge {
    /// The remote address.
    pub addr: u64,
    /// The rkey that covers it.
    pub key: u32,
    /// The length in bytes (a slot count in [`ConnData::target_sgl`]).
    pub length: u32,
}

impl Sge {
    /// The 16 bytes of this entry in byte order `order`.
    ///
    /// To grant a peer a receive-buffer half, write this into its target SGL in the order its
    /// connection data declared ([`ConnData::order`]).
    pub fn encode(&self, order: ByteOrder) -> [u8; SGE_LEN] {
        let mut b = [0u8; SGE_LEN];
        b[0..8].copy_from_slice(&order.u64_bytes(self.addr));
        b[8..12].copy_from_slice(&order.u32_bytes(self.key));
        b[12..16].copy_from_slice(&order.u32_bytes(self.length));
        b
    }

    /// Reads an entry in byte order `order`. Any 16 bytes are some entry: use
    /// [`Sge::check_grant`] before writing to what a peer granted.
    pub fn decode(bytes: &[u8; SGE_LEN], order: ByteOrder) -> Sge {
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&bytes[0..8]);
        let mut key = [0u8; 4];
        key.copy_from_slice(&bytes[8..12]);
        let mut length = [0u8; 4];
        length.copy_from_slice(&bytes[12..16]);
        Sge { addr: order.read_u64(addr), key: order.read_u32(key), length: order.read_u32(length) }
    }

    /// Refuses a grant the stream could not honestly write into: one of length 0, or one whose
    /// end lies past the 64-bit address space.
    ///
    /// A grant's rkey and range are otherwise the peer's own business: a write outside what the
    /// rkey covers fails at the peer's device, and the connection ends.
    pub fn check_grant(self) -> Result<Sge, WireError> {
        if self.length == 0 {
            return Err(WireError::EmptyRegion { region: Region::Grant });
        }
        check_span(Region::Grant, self.addr, u64::from(self.length))?;
        Ok(self)
    }
}

/// The connection data (`struct rs_conn_data`): 40 bytes of private data, in the connect
/// request and in the reply, always big-endian.
///
/// | offset | size | field |
/// |---:|---:|---|
/// | 0 | 1 | version, 1 |
/// | 1 | 1 | flags: [`FLAG_NET`], [`FLAG_IOMAP`] |
/// | 2 | 2 | credits |
/// | 4 | 3 | reserved, 0 |
/// | 7 | 1 | iomap table size, scaled ([`iomap_size_to_scale`]) |
/// | 8 | 16 | target SGL: address, rkey, slot count |
/// | 24 | 16 | first receive-buffer half: address, rkey, length |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnData {
    /// The sender's byte order ([`FLAG_NET`]): grants written into its target SGL, and on
    /// iWARP the messages sent to it, must use it.
    pub order: ByteOrder,
    /// [`FLAG_IOMAP`]: whether `target_iomap_size` means anything.
    pub iomap: bool,
    /// How many data messages the peer may send before the first credit update: the sender's
    /// receive queue size.
    pub credits: u16,
    /// The sender's iomap table size in the 8-bit scale of [`iomap_size_to_scale`]; see
    /// [`ConnData::iomap_entries`].
    pub target_iomap_size: u8,
    /// Where the peer writes buffer grants: the address and rkey of the sender's slot array,
    /// and in `length` the number of slots (always [`SGL_SLOTS`] from rsocket). The peer
    /// writes its first grant into slot 1; slot 0 is `data_buf`.
    pub target_sgl: Sge,
    /// The first half of the sender's receive buffer: where the peer writes its first data.
    pub data_buf: Sge,
}

impl ConnData {
    /// The connection data an rsocket on this host sends (`rs_format_conn_data`): this host's
    /// byte order, [`FLAG_IOMAP`] with no iomap entries, `credits` (the receive queue size),
    /// the target SGL (`length` = number of slots, normally [`SGL_SLOTS`]) and the first half
    /// of the receive buffer.
    pub fn new(credits: u16, target_sgl: Sge, data_buf: Sge) -> ConnData {
        ConnData { order: ByteOrder::native(), iomap: true, credits, target_iomap_size: 0, target_sgl, data_buf }
    }

    /// The 40 bytes on the wire. Reserved bytes and unknown flags are zero.
    pub fn encode(&self) -> [u8; CONN_DATA_LEN] {
        let mut b = [0u8; CONN_DATA_LEN];
        b[0] = CONN_DATA_VERSION;
        b[1] = if self.order == ByteOrder::Big { FLAG_NET } else { 0 } | if self.iomap { FLAG_IOMAP } else { 0 };
        b[2..4].copy_from_slice(&self.credits.to_be_bytes());
        b[7] = self.target_iomap_size;
        b[8..24].copy_from_slice(&self.target_sgl.encode(ByteOrder::Big));
        b[24..40].copy_from_slice(&self.data_buf.encode(ByteOrder::Big));
        b
    }

    /// Reads a peer's connection data from the start of `bytes`, and refuses what the stream
    /// must not rely on.
    ///
    /// Bytes past the first 40 are ignored: on InfiniBand the CM hands over the private data
    /// zero-padded to its full size. Unknown flags and the reserved bytes are ignored, as
    /// rsocket ignores them. Refused: fewer than 40 bytes, a version other than 1, fewer than 2
    /// target-SGL slots, an empty first buffer half, and a slot array (with its iomap table) or
    /// buffer half that runs past the end of the address space. Credits are taken as sent: a
    /// lie there only stalls the sender or makes the peer's own receive queue overflow.
    pub fn decode(bytes: &[u8]) -> Result<ConnData, WireError> {
        let Some(b) = bytes.first_chunk::<CONN_DATA_LEN>() else {
            return Err(WireError::Short { what: "connection data", len: bytes.len(), need: CONN_DATA_LEN });
        };
        if b[0] != CONN_DATA_VERSION {
            return Err(WireError::Version { version: b[0] });
        }
        let sge = |at: usize| {
            let mut s = [0u8; SGE_LEN];
            s.copy_from_slice(&b[at..at + SGE_LEN]);
            Sge::decode(&s, ByteOrder::Big)
        };
        let data = ConnData {
            order: if b[1] & FLAG_NET != 0 { ByteOrder::Big } else { ByteOrder::Little },
            iomap: b[1] & FLAG_IOMAP != 0,
            credits: u16::from_be_bytes([b[2], b[3]]),
            target_iomap_size: b[7],
            target_sgl: sge(8),
            data_buf: sge(24),
        };
        if data.target_sgl.length < SGL_SLOTS {
            return Err(WireError::TooFewSlots { slots: data.target_sgl.length });
        }
        let table = u64::from(data.target_sgl.length) * SGE_LEN as u64
            + u64::from(data.iomap_entries()) * IOMAP_ENTRY_LEN as u64;
        check_span(Region::TargetSgl, data.target_sgl.addr, table)?;
        if data.data_buf.length == 0 {
            return Err(WireError::EmptyRegion { region: Region::DataBuf });
        }
        check_span(Region::DataBuf, data.data_buf.addr, u64::from(data.data_buf.length))?;
        Ok(data)
    }

    /// How many iomap entries the sender accepts: 0 without [`FLAG_IOMAP`], otherwise
    /// `target_iomap_size` unscaled ([`iomap_scale_to_size`]).
    pub fn iomap_entries(&self) -> u16 {
        if self.iomap {
            iomap_scale_to_size(self.target_iomap_size)
        } else {
            0
        }
    }
}

/// Encodes an iomap table size in the connection data's 8-bit scale (`rs_value_to_scale`):
/// sizes up to 128 are exact; larger ones are stored as `0x80 | size >> 8`, so they round down
/// to a multiple of 256, and anything from 32768 up does not fit (rsocket truncates; this
/// saturates at 32512).
pub fn iomap_size_to_scale(size: u16) -> u8 {
    if size <= 128 {
        size as u8
    } else {
        0x80 | (size >> 8).min(0x7f) as u8
    }
}

/// Decodes an iomap table size from the connection data's 8-bit scale (`rs_scale_to_value`):
/// 0..=128 mean themselves, 129..=255 mean 256, 512, ..., 32512.
pub fn iomap_scale_to_size(scale: u8) -> u16 {
    if scale <= 128 {
        u16::from(scale)
    } else {
        u16::from(scale & 0x7f) << 8
    }
}

/// A control message's value (`RS_CTRL_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ctrl {
    /// 0: the sender stops sending and receiving; the receiver reads what is queued, then end
    /// of file, and its sends fail.
    Disconnect,
    /// 1: defined, but never sent as a message by rdma-core 44: its keepalive is a zero-length
    /// plain RDMA WRITE that the peer's software never sees.
    Keepalive,
    /// 2: the sender stops sending (half-close). A receiver that can still send stops only
    /// receiving; one that had already stopped sending is disconnected.
    Shutdown,
}

impl Ctrl {
    const fn value(self) -> u32 {
        match self {
            Ctrl::Disconnect => 0,
            Ctrl::Keepalive => 1,
            Ctrl::Shutdown => 2,
        }
    }
}

/// Operation numbers (bits 31..29 of a message).
const OP_DATA: u32 = 0;
const OP_WRITE: u32 = 2;
const OP_SGL: u32 = 4;
const OP_IOMAP_SGL: u32 = 6;
const OP_CTRL: u32 = 7;

/// One rsocket message: 3 bits of operation, 29 bits of argument (`rs_msg_set`).
///
/// Operations 1, 3 and 5 are reserved, and 2 (`RS_OP_WRITE`) never travels as a message (it
/// tags the local work request of a plain RDMA WRITE into an iomap): [`Msg::from_imm`] refuses
/// all four.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Msg {
    /// Operation 0: `len` bytes of stream data were written at the next position of the
    /// current granted half. (rsocket never writes more than [`MAX_TRANSFER`] at once.)
    Data {
        /// The number of bytes written, at most [`MAX_MSG_DATA`].
        len: u32,
    },
    /// Operation 4 (`RS_OP_SGL`): a credit update, possibly after a grant was written into a
    /// target-SGL slot. The receiver may now send data messages until its 16-bit sequence
    /// number reaches `limit`.
    ///
    /// rsocket sends its read count plus its queue size without reducing it modulo 2^16, so
    /// bit 16 can be set on the wire; like rsocket, decoding keeps the low 16 bits.
    Sgl {
        /// The new send limit (`rseq_no + rq_size`, modulo 2^16).
        limit: u16,
    },
    /// Operation 6 (`RS_OP_IOMAP_SGL`): an iomap entry was written at `index` of the receiver's
    /// iomap table. Consumes one credit.
    IoMapSgl {
        /// The entry's index (bits 15..0).
        index: u16,
    },
    /// Operation 7 (`RS_OP_CTRL`): a control message.
    Ctrl(Ctrl),
}

impl Msg {
    /// The 32-bit message in host order: what rsocket passes through `htobe32` as the
    /// immediate data, and so what goes to the verbs layer's `imm`, which does the same.
    ///
    /// # Panics
    ///
    /// If a [`Msg::Data`] length exceeds [`MAX_MSG_DATA`]: such a write cannot be described.
    pub fn to_imm(self) -> u32 {
        let (op, data) = match self {
            Msg::Data { len } => {
                assert!(len <= MAX_MSG_DATA, "a data message describes at most {MAX_MSG_DATA} bytes, not {len}");
                (OP_DATA, len)
            }
            Msg::Sgl { limit } => (OP_SGL, u32::from(limit)),
            Msg::IoMapSgl { index } => (OP_IOMAP_SGL, u32::from(index)),
            Msg::Ctrl(c) => (OP_CTRL, c.value()),
        };
        (op << 29) | data
    }

    /// Reads a message from its 32-bit value in host order (`be32toh` of the immediate data, as
    /// the verbs layer's `imm_data` returns it).
    ///
    /// Refused: the reserved operations 1, 3 and 5; operation 2, which never travels; control
    /// values other than 0, 1 and 2; credit updates above 0x1ffff; iomap updates with bits
    /// 28..16 set.
    pub fn from_imm(imm: u32) -> Result<Msg, WireError> {
        let op = imm >> 29;
        let data = imm & MAX_MSG_DATA;
        match op {
            OP_DATA => Ok(Msg::Data { len: data }),
            OP_SGL if data > MAX_CREDIT_VALUE => Err(WireError::CreditOutOfRange { value: data }),
            OP_SGL => Ok(Msg::Sgl { limit: data as u16 }),
            OP_IOMAP_SGL if data > u32::from(u16::MAX) => Err(WireError::IoMapReservedBits { imm }),
            OP_IOMAP_SGL => Ok(Msg::IoMapSgl { index: data as u16 }),
            OP_CTRL => match data {
                0 => Ok(Msg::Ctrl(Ctrl::Disconnect)),
                1 => Ok(Msg::Ctrl(Ctrl::Keepalive)),
                2 => Ok(Msg::Ctrl(Ctrl::Shutdown)),
                value => Err(WireError::UnknownCtrl { value }),
            },
            OP_WRITE => Err(WireError::WriteOp { imm }),
            _ => Err(WireError::ReservedOp { op: op as u8, imm }),
        }
    }

    /// The 4-byte SEND payload that carries this message on iWARP, in byte order `order`.
    ///
    /// rsocket sends and reads the message in its own host order, so use the order the peer
    /// declared ([`ConnData::order`]).
    ///
    /// # Panics
    ///
    /// As [`Msg::to_imm`].
    pub fn to_payload(self, order: ByteOrder) -> [u8; MSG_PAYLOAD_LEN] {
        order.u32_bytes(self.to_imm())
    }

    /// Reads a message from an iWARP SEND payload in byte order `order` (the peer's, see
    /// [`Msg::to_payload`]). The payload must be exactly 4 bytes; the message is then checked
    /// as by [`Msg::from_imm`].
    pub fn from_payload(payload: &[u8], order: ByteOrder) -> Result<Msg, WireError> {
        let Ok(b) = <[u8; MSG_PAYLOAD_LEN]>::try_from(payload) else {
            return Err(WireError::PayloadLen { len: payload.len() });
        };
        Msg::from_imm(order.read_u32(b))
    }
}

#[cfg(test)]
mod tests;
