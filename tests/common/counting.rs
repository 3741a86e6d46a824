//! A counting global allocator, for the binaries that prove a path allocates nothing
//! (`alloc.rs`, `lane_srq.rs`, `multicast.rs`). It is installed as the binary's `#[global_allocator]`, so it is
//! not part of `common` (which every binary includes): a binary takes it with
//!
//! ```ignore
//! #[path = "common/counting.rs"]
//! mod counting;
//! ```
//!
//! It counts the allocations (and their bytes) made by a thread while that thread watches
//! ([`watched`], [`watch`]); every call goes to the system allocator unchanged.
#![allow(dead_code)] // each binary uses part of it

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    // const-initialised and without a destructor: reading it never allocates.
    static WATCH: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: every call forwards to the system allocator unchanged; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if WATCH.with(|w| w.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(l.size(), Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded; `p` came from System.alloc with `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if WATCH.with(|w| w.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(n, Ordering::Relaxed);
        }
        // SAFETY: forwarded: `p` came from this allocator with `l`.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Starts (`true`) or stops counting this thread's allocations.
pub fn watch(on: bool) {
    WATCH.with(|w| w.set(on));
}

/// Runs `f` with this thread's allocations counted.
pub fn watched<R>(f: impl FnOnce() -> R) -> R {
    watch(true);
    let r = f();
    watch(false);
    r
}

/// Sets both counts back to zero.
pub fn reset() {
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
}

/// The allocations counted since the last [`reset`], and their bytes.
pub fn counts() -> (usize, usize) {
    (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst))
}

/// Runs `f` with this thread's allocations counted: its result, and how many it made.
pub fn count_allocs<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = ALLOCS.load(Ordering::SeqCst);
    let r = watched(f);
    (r, ALLOCS.load(Ordering::SeqCst) - before)
}

/// Asserts that the counter works: one watched allocation is seen. Leaves the counts at zero.
pub fn assert_it_counts() {
    reset();
    drop(watched(|| std::hint::black_box(Vec::<u8>::with_capacity(10))));
    assert_eq!(counts().0, 1, "the counting allocator must see allocations");
    reset();
}
