//! The tag in every `wr_id` a lane posts:
//!
//! ```text
//! bit 63   62   61        60..45        44..0
//!     RECV  0    INTERIOR  place (16)    sequence number (45)
//! ```
//!
//! Bit 62 is the convenient path's tag bit (`ring::tag::OURS`); it is clear here, so a
//! completion of the convenient path on a lane's CQ is told apart and routed the usual way.
//!
//! There is no generation: a place's sequence numbers continue across the QPs attached there
//! (the lane keeps, per place and queue, the next one: `Lane::next_seq`), so every tag the lane
//! posts at a place is new until 2^45 postings there, and a completion of an earlier QP at the
//! place, or one the device hands out twice, carries a sequence number outside the queue's
//! window of outstanding work (`Slots::holds`): it retires nothing.
//!
//! `INTERIOR` marks the unsignaled work requests of a [`PreparedBatch`](super::PreparedBatch)
//! before its last. Each carries its own slot's sequence number (stamped at every post), and a
//! completion of one (an error, or a flush) retires nothing: the batch retires whole with its
//! last one's (or, when the provider took only part of it, with the last one's it took:
//! `Member::orphan`).

pub(super) const RECV: u64 = 1 << 63;
pub(super) const CRATE: u64 = crate::verbs::ring::tag::OURS;
pub(super) const INTERIOR: u64 = 1 << 61;
/// Where the place starts; the sequence number is the bits below.
pub(super) const SHIFT: u32 = 45;
/// The sequence number's bits.
pub(super) const SEQ_MASK: u64 = (1 << SHIFT) - 1;

/// Bits 63..45 of the ordinary tags of the queue at `place` (its send queue, or its receive
/// queue: `recv`), as a `u32`: the place, and `RECV` for the receive queue (`Slots::hi`). An
/// interior tag has `INTERIOR` there and a completion of the convenient path `CRATE`, which no
/// queue's `hi` has, so neither ever passes for an ordinary one.
#[inline(always)]
pub(super) fn queue_hi(place: u16, recv: bool) -> u32 {
    place as u32 | if recv { (RECV >> SHIFT) as u32 } else { 0 }
}

/// The tag of the work request with sequence number `seq` (its low 45 bits) at `place`.
#[inline(always)]
pub(super) fn encode(place: u16, seq: u64, recv: bool) -> u64 {
    (queue_hi(place, recv) as u64) << SHIFT | seq & SEQ_MASK
}

/// A tag's high bits, as `queue_hi` gives them for an ordinary tag.
#[inline(always)]
pub(super) fn hi_of(wr_id: u64) -> u32 {
    (wr_id >> SHIFT) as u32
}

/// (recv, place, the low 45 bits of the sequence number).
#[inline(always)]
pub(super) fn decode(wr_id: u64) -> (bool, u16, u64) {
    (wr_id & RECV != 0, (wr_id >> SHIFT) as u16, wr_id & SEQ_MASK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_never_carry_the_convenient_bit() {
        for (place, seq, recv) in [(0, 0, false), (65535, SEQ_MASK, true), (7, 12345, false), (1, 1 << 40, true)] {
            let w = encode(place, seq, recv);
            assert_eq!(w & (CRATE | INTERIOR), 0, "{w:#x}");
            assert_eq!(decode(w), (recv, place, seq));
            // Bits 63..45 whole are the queue's `Slots::hi` (the receive queue's has `RECV`).
            assert_eq!(hi_of(w), queue_hi(place, recv), "{w:#x}");
            assert_ne!(hi_of(w ^ RECV), queue_hi(place, recv), "the other queue's tag: {w:#x}");
            // Neither an interior tag nor the convenient path's bit passes for an ordinary tag
            // of any queue; the place survives the interior bit.
            for other in [w | CRATE, w | INTERIOR] {
                for p in [place, place ^ 1] {
                    assert_ne!(hi_of(other), queue_hi(p, recv), "{other:#x}");
                    assert_ne!(hi_of(other), queue_hi(p, !recv), "{other:#x}");
                }
            }
            assert_eq!(decode(w | INTERIOR).1, place);
        }
    }

    #[test]
    fn sequence_numbers_wider_than_45_bits_never_reach_the_place() {
        // The sequence counters are u64; only their low 45 bits go into a tag.
        let w = encode(3, (1 << 50) | 5, false);
        assert_eq!(decode(w), (false, 3, 5));
        assert_eq!(hi_of(w), queue_hi(3, false));
        // A place's tags are distinct for 2^45 postings: the last before the wrap and the
        // first after it differ, and only then does the first come back.
        assert_ne!(encode(3, SEQ_MASK, true), encode(3, 0, true));
        assert_eq!(encode(3, SEQ_MASK + 1, true), encode(3, 0, true));
    }
}
