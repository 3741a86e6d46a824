//! Copies out of and into memory that may change under them (remotely writable regions, which
//! a peer writes at any moment): volatile accesses only, never a reference, so the compiler
//! never assumes the bytes stable. Volatile accesses are not merged or widened by the
//! compiler, so the copies move the widest word the target loads in one instruction (16 bytes
//! on x86_64, 8 elsewhere), four words a step, where the region's side is aligned.

use std::mem::size_of;
use std::ptr::{read_volatile, write_volatile};

#[cfg(target_arch = "x86_64")]
type Word = std::arch::x86_64::__m128i;
#[cfg(not(target_arch = "x86_64"))]
type Word = u64;

const W: usize = size_of::<Word>();

/// Copies `dst.len()` bytes from `src` with volatile reads.
///
/// # Safety
/// `src..src + dst.len()` must be readable (it may change concurrently).
pub(super) unsafe fn volatile_copy_from(src: *const u8, dst: &mut [u8]) {
    let n = dst.len();
    let d = dst.as_mut_ptr();
    let mut i = 0;
    // SAFETY (every block below): reads stay within src..src + n, which the caller guarantees
    // readable, and word reads are made only at W-aligned addresses; writes stay within `dst`,
    // a distinct Rust buffer of n bytes, unaligned where they may be. Every bit pattern is a
    // valid Word and a valid u8.
    while i < n && (src as usize + i) % W != 0 {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe { *d.add(i) = read_volatile(src.add(i)) };
        i += 1;
    }
    while i + 4 * W <= n {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe {
            let s = src.add(i).cast::<Word>();
            let (a, b, c, e) =
                (read_volatile(s), read_volatile(s.add(1)), read_volatile(s.add(2)), read_volatile(s.add(3)));
            let t = d.add(i).cast::<Word>();
            t.write_unaligned(a);
            t.add(1).write_unaligned(b);
            t.add(2).write_unaligned(c);
            t.add(3).write_unaligned(e);
        }
        i += 4 * W;
    }
    while i + W <= n {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe { d.add(i).cast::<Word>().write_unaligned(read_volatile(src.add(i).cast::<Word>())) };
        i += W;
    }
    while i < n {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe { *d.add(i) = read_volatile(src.add(i)) };
        i += 1;
    }
}

/// Copies `src` to `dst` with volatile writes.
///
/// # Safety
/// `dst..dst + src.len()` must be writable and referenced by nothing.
pub(super) unsafe fn volatile_copy_to(src: &[u8], dst: *mut u8) {
    let n = src.len();
    let s = src.as_ptr();
    let mut i = 0;
    // SAFETY (every block below): writes stay within dst..dst + n, which the caller guarantees
    // writable and unreferenced, and word writes are made only at W-aligned addresses; reads
    // stay within `src`, unaligned where they may be.
    while i < n && (dst as usize + i) % W != 0 {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe { write_volatile(dst.add(i), *s.add(i)) };
        i += 1;
    }
    while i + 4 * W <= n {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe {
            let f = s.add(i).cast::<Word>();
            let t = dst.add(i).cast::<Word>();
            write_volatile(t, f.read_unaligned());
            write_volatile(t.add(1), f.add(1).read_unaligned());
            write_volatile(t.add(2), f.add(2).read_unaligned());
            write_volatile(t.add(3), f.add(3).read_unaligned());
        }
        i += 4 * W;
    }
    while i + W <= n {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe { write_volatile(dst.add(i).cast::<Word>(), s.add(i).cast::<Word>().read_unaligned()) };
        i += W;
    }
    while i < n {
        // SAFETY: as argued above: in bounds on both sides, the word access aligned.
        unsafe { write_volatile(dst.add(i), *s.add(i)) };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length and both alignments of either side, against a plain copy.
    #[test]
    fn copies_match_a_plain_copy_at_every_offset_and_length() {
        let src: Vec<u8> = (0..300u32).map(|k| (k * 7 + 3) as u8).collect();
        for off in 0..W + 1 {
            for len in 0..src.len() - off {
                let mut out = vec![0u8; len + 1];
                // SAFETY: src[off..off + len] is in bounds and readable.
                unsafe { volatile_copy_from(src.as_ptr().add(off), &mut out[1..]) };
                assert_eq!(&out[1..], &src[off..off + len], "from, offset {off}, length {len}");
                let mut dst = vec![0u8; len + off];
                // SAFETY: dst[off..off + len] is in bounds, and no reference to it lives.
                unsafe { volatile_copy_to(&src[..len], dst.as_mut_ptr().add(off)) };
                assert_eq!(&dst[off..], &src[..len], "to, offset {off}, length {len}");
            }
        }
    }
}
