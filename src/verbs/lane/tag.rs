//! The tag in every `wr_id` a lane posts:
//!
//! ```text
//! bit 63   62   61        60..48            47..32       31..0
//!     RECV  0    INTERIOR  generation (13)   place (16)   sequence number
//! ```
//!
//! Bit 62 is the convenient path's tag bit (`ring::tag::OURS`); it is clear here, so a
//! completion of the convenient path on a lane's CQ is told apart and routed the usual way.
//! `INTERIOR` marks the unsignaled work requests of a [`PreparedBatch`](super::PreparedBatch) before its last: their
//! tag is fixed when the batch is prepared (their index in the batch where the sequence number
//! goes), and a completion of one (an error, or a flush) retires nothing: the batch retires
//! whole with its last one's (or, when the provider took only part of it, with the last one's
//! it took: `Member::orphan`).

pub(super) const RECV: u64 = 1 << 63;
pub(super) const CRATE: u64 = crate::verbs::ring::tag::OURS;
pub(super) const INTERIOR: u64 = 1 << 61;
const GEN_SHIFT: u32 = 48;
pub(super) const GEN_MASK: u16 = (1 << 13) - 1;
const PLACE_SHIFT: u32 = 32;
/// Bits 62..32 of a tag, as a `u32`: its generation and place (`hi`), `INTERIOR` and the
/// convenient path's bit (which no member's `hi` has, so neither an interior tag nor a
/// completion of the convenient path ever passes for an ordinary one).
pub(super) const HI_MASK: u32 = (1 << 31) - 1;

/// Bits 60..32 of the tags of a QP at `place` with generation `gen`, as a `u32`.
#[inline(always)]
pub(super) fn hi(place: u16, gen: u16) -> u32 {
    ((gen & GEN_MASK) as u32) << (GEN_SHIFT - PLACE_SHIFT) | place as u32
}

/// Bits 63..32 of the ordinary tags of that QP's send queue, or its receive queue (`recv`):
/// `hi`, with `RECV` for the receive queue (`Slots::hi`).
#[inline(always)]
pub(super) fn queue_hi(place: u16, gen: u16, recv: bool) -> u32 {
    hi(place, gen) | if recv { (RECV >> 32) as u32 } else { 0 }
}

#[inline(always)]
pub(super) fn encode(place: u16, gen: u16, seq: u32, recv: bool) -> u64 {
    (if recv { RECV } else { 0 }) | ((gen & GEN_MASK) as u64) << GEN_SHIFT | (place as u64) << PLACE_SHIFT | seq as u64
}

/// (recv, generation, place, sequence number).
#[inline(always)]
pub(super) fn decode(wr_id: u64) -> (bool, u16, u16, u32) {
    (wr_id & RECV != 0, (wr_id >> GEN_SHIFT) as u16 & GEN_MASK, (wr_id >> PLACE_SHIFT) as u16, wr_id as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_never_carry_the_convenient_bit() {
        for (place, gen, seq, recv) in [(0, 0, 0, false), (65535, GEN_MASK, u32::MAX, true), (7, 3, 12345, false)] {
            let w = encode(place, gen, seq, recv);
            assert_eq!(w & (CRATE | INTERIOR), 0, "{w:#x}");
            assert_eq!(decode(w), (recv, gen, place, seq));
            assert_eq!((w >> 32) as u32 & HI_MASK, hi(place, gen), "{w:#x}");
            // Bits 63..32 whole are the queue's `Slots::hi` (the receive queue's has `RECV`).
            let queue_hi = queue_hi(place, gen, recv);
            assert_eq!((w >> 32) as u32, queue_hi, "{w:#x}");
            assert_ne!(((w ^ RECV) >> 32) as u32, queue_hi, "the other queue's tag: {w:#x}");
            // A batch's interior tag never compares equal to a member's `hi`.
            // The convenient path's bit fails the match as well.
            let crate_tagged = w | CRATE;
            assert_ne!((crate_tagged >> 32) as u32 & HI_MASK, hi(place, gen), "{crate_tagged:#x}");
            let interior = (w | INTERIOR) & !0xffff_ffff;
            assert_ne!((interior >> 32) as u32 & HI_MASK, hi(place, gen), "{interior:#x}");
            assert_eq!(decode(interior).1, gen, "the generation survives the interior bit");
            assert_ne!((crate_tagged >> 32) as u32, queue_hi, "{crate_tagged:#x}");
            assert_ne!((interior >> 32) as u32, queue_hi, "{interior:#x}");
        }
    }
}
