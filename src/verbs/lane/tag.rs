//! The tag in every `wr_id` a lane posts:
//!
//! ```text
//! bit 63   62   61        60..45        44..0
//!     RECV  0    INTERIOR  place (16)    sequence number (45)
//! ```
//!
//! A receive of one of the lane's shared receive queues has `RECV` and `INTERIOR` both set (no
//! other tag has: an interior tag is a send's), the SRQ's index in place of the place, and the
//! SRQ's own sequence number (see [`srq`](super::srq)).
//!
//! Bit 62 is never set by the lane: a completion carrying it (work posted by the caller through
//! the raw QP, `as_raw`) is told apart as not the lane's, and retires nothing.
//!
//! There is no generation: a place's sequence numbers continue across the QPs attached there
//! (the lane keeps, per place and queue, the next one: `Lane::next_seq`), so every tag the lane
//! posts at a place is new until 2^45 postings there, and a completion of an earlier QP at the
//! place, or one the device hands out twice, carries a sequence number outside the queue's
//! window of outstanding work (`Slots::holds`): it retires nothing.
//!
//! `INTERIOR` marks the unsignaled work requests of a [`PreparedBatch`](super::PreparedBatch)
//! before its last. Their tags are fixed when the batch is prepared, so a post writes none of
//! them: below the place, the batch's number (`BATCH_BITS` of a process-wide count of prepared
//! batches, never reused) and the request's index in the batch (`INDEX_BITS`). A completion of
//! one (an error, or a flush) retires nothing: the batch retires whole with its last one's (or,
//! when the provider took only part of it, with the last one's it took: `Member::orphan`, found
//! by the batch's number and that index). A QP's batches are all prepared after it was attached,
//! so an interior completion whose batch number is below the QP's first (`Member::batch_floor`)
//! is an earlier QP's at the place and says nothing of this one.

pub(super) const RECV: u64 = 1 << 63;
pub(super) const FOREIGN: u64 = 1 << 62;
pub(super) const INTERIOR: u64 = 1 << 61;
/// Where the place starts; the sequence number is the bits below.
pub(super) const SHIFT: u32 = 45;
/// The sequence number's bits.
pub(super) const SEQ_MASK: u64 = (1 << SHIFT) - 1;
/// An interior tag's index in its batch: the low bits.
pub(super) const INDEX_BITS: u32 = 16;
/// An interior tag's batch number: the bits above the index, below the place.
pub(super) const BATCH_BITS: u32 = SHIFT - INDEX_BITS;
const BATCH_MASK: u64 = (1 << BATCH_BITS) - 1;

/// Batch number `batch` as an interior tag carries it (modulo 2^`BATCH_BITS`).
#[inline(always)]
pub(super) fn carried_batch(batch: u64) -> u64 {
    batch & BATCH_MASK
}

/// The interior tag of request `index` of batch number `batch` at `place`.
#[inline(always)]
pub(super) fn interior(place: u16, batch: u64, index: u32) -> u64 {
    INTERIOR | (place as u64) << SHIFT | carried_batch(batch) << INDEX_BITS | index as u64 & ((1 << INDEX_BITS) - 1)
}

/// An interior tag's (batch number modulo 2^`BATCH_BITS`, index in the batch).
#[inline(always)]
pub(super) fn interior_parts(wr_id: u64) -> (u64, u32) {
    ((wr_id & SEQ_MASK) >> INDEX_BITS, (wr_id & ((1 << INDEX_BITS) - 1)) as u32)
}

/// Whether batch number `batch` (as an interior tag carries it) was prepared at or after the
/// batch number `floor` (whole): that is, for the QP whose first possible batch is `floor`.
#[inline(always)]
pub(super) fn batch_at_or_after(batch: u64, floor: u64) -> bool {
    batch.wrapping_sub(floor) & BATCH_MASK < 1 << (BATCH_BITS - 1)
}

/// Bits 63..45 of the ordinary tags of the queue at `place` (its send queue, or its receive
/// queue: `recv`), as a `u32`: the place, and `RECV` for the receive queue (`Slots::hi`). An
/// interior tag has `INTERIOR` there and a completion that is not the lane's `FOREIGN`, which no
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
    fn interior_tags_name_their_batch_and_index_and_tell_earlier_batches_apart() {
        for (place, batch, index) in [(0u16, 0u64, 0u32), (65535, (1 << BATCH_BITS) - 1, 65535), (7, 12345, 15)] {
            let w = interior(place, batch, index);
            assert_eq!(w & (FOREIGN | RECV), 0, "{w:#x}");
            assert_ne!(w & INTERIOR, 0);
            assert_eq!(decode(w).1, place, "the place survives");
            assert_eq!(interior_parts(w), (batch, index));
        }
        // The batch number wraps in the tag; the floor's test looks half the space ahead.
        let floor = (1u64 << BATCH_BITS) - 3;
        for (batch, mine) in
            [(floor, true), (floor + 2, true), (floor + 5, true), (floor - 1, false), (floor - 1000, false)]
        {
            let carried = interior_parts(interior(1, batch, 0)).0;
            assert_eq!(batch_at_or_after(carried, floor), mine, "batch {batch} against floor {floor}");
        }
    }

    #[test]
    fn tags_round_trip_and_never_carry_the_foreign_bit() {
        for (place, seq, recv) in [(0, 0, false), (65535, SEQ_MASK, true), (7, 12345, false), (1, 1 << 40, true)] {
            let w = encode(place, seq, recv);
            assert_eq!(w & (FOREIGN | INTERIOR), 0, "{w:#x}");
            assert_eq!(decode(w), (recv, place, seq));
            // Bits 63..45 whole are the queue's `Slots::hi` (the receive queue's has `RECV`).
            assert_eq!(hi_of(w), queue_hi(place, recv), "{w:#x}");
            assert_ne!(hi_of(w ^ RECV), queue_hi(place, recv), "the other queue's tag: {w:#x}");
            // Neither an interior tag nor the foreign bit passes for an ordinary tag
            // of any queue; the place survives the interior bit.
            for other in [w | FOREIGN, w | INTERIOR] {
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
