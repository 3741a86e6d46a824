//! The SRQ's tags and table, without a device.

use super::{is_srq, Table, SRQ_TAG};
use crate::verbs::lane::tag;

/// Posts one receive (its "region" `r`) as `post_srq_recv` does: its sequence number.
fn post(t: &mut Table<u32>, r: u32) -> u64 {
    assert!(t.outstanding < t.depth);
    let seq = t.free_from(t.next);
    t.put(seq, r, r as u64);
    t.next = seq.wrapping_add(1);
    seq
}

#[test]
fn a_completion_retires_only_the_posting_it_names_in_any_order() {
    let mut t = Table::<u32>::new(3, 0);
    assert_eq!(t.slots.len(), 8, "twice the depth, a power of two");
    let (a, b, c) = (post(&mut t, 10), post(&mut t, 11), post(&mut t, 12));
    assert_eq!((a, b, c), (0, 1, 2));
    // Out of order: the middle one first (another QP's message came first).
    assert_eq!(t.retire(b), Some((11, 11)));
    assert_eq!(t.retire(b), None, "handed out twice: the second retires nothing");
    assert_eq!(t.retire(c + 1), None, "a number never posted");
    let d = post(&mut t, 13);
    assert_eq!(d, 3, "numbers go on; the slot of b stays free until its number comes round");
    assert_eq!(t.retire(a), Some((10, 10)));
    assert_eq!(t.retire(c), Some((12, 12)));
    assert_eq!(t.retire(d), Some((13, 13)));
    assert_eq!(t.outstanding, 0);
}

#[test]
fn a_stale_completion_of_an_earlier_posting_of_a_slot_retires_nothing() {
    let mut t = Table::<u32>::new(1, 0);
    let len = t.slots.len() as u64;
    let first = post(&mut t, 1);
    assert_eq!(t.retire(first), Some((1, 1)));
    // Postings go round the table until one sits in the first one's slot again.
    let mut seq = first;
    while seq != first + len {
        let _ = t.retire(seq);
        seq = post(&mut t, 2);
    }
    assert_eq!(t.retire(first), None, "the slot holds a later posting: the earlier tag retires nothing");
    assert_eq!(t.outstanding, 1);
    assert_eq!(t.retire(seq), Some((2, 2)));
}

#[test]
fn a_post_skips_slots_still_held_and_numbers_stay_distinct_across_the_45_bit_wrap() {
    // Start just before the tags' 45 bits wrap.
    let mut t = Table::<u32>::new(4, tag::SEQ_MASK - 2);
    let held = post(&mut t, 0); // never completes (a slow QP's)
    let mut last = held;
    for k in 1..100u32 {
        let seq = post(&mut t, k);
        assert_ne!(seq & t.mask, held & t.mask, "the held slot is skipped");
        assert!(seq > last, "numbers only grow");
        assert_ne!(seq & tag::SEQ_MASK, held & tag::SEQ_MASK, "no tag of a current posting repeats another's");
        assert_eq!(t.retire(seq & tag::SEQ_MASK), Some((k, k as u64)), "retired by the tag's 45 bits");
        last = seq;
    }
    assert!(last > tag::SEQ_MASK, "the numbers went past the tags' wrap");
    assert_eq!(t.retire(held & tag::SEQ_MASK), Some((0, 0)));
    // Full: `depth` held; every free slot is still found.
    let seqs: Vec<u64> = (0..4).map(|k| post(&mut t, k)).collect();
    assert_eq!(t.outstanding, 4);
    for s in seqs {
        assert!(t.retire(s).is_some());
    }
}

#[test]
fn srq_tags_are_told_apart_from_every_other_tag_of_the_lane() {
    for place in [0u16, 7, 65535] {
        for seq in [0u64, 1, tag::SEQ_MASK] {
            assert!(!is_srq(tag::encode(place, seq, true)), "a QP's receive");
            assert!(!is_srq(tag::encode(place, seq, false)), "a QP's send");
            assert!(!is_srq(tag::interior(place, seq, 3)), "a batch's interior send");
            let t = SRQ_TAG | (place as u64) << tag::SHIFT | seq & tag::SEQ_MASK;
            assert!(is_srq(t));
            assert!(!is_srq(t | tag::FOREIGN), "a foreign tag");
            assert_ne!(tag::hi_of(t), tag::queue_hi(place, true), "never a QP's receive queue");
            assert_ne!(tag::hi_of(t), tag::queue_hi(place, false), "never a QP's send queue");
        }
    }
}
