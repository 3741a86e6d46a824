//! Compile-time guarantees, each pinned to the error it was written for: every case in
//! `tests/ui/` must fail to compile with exactly the `.stderr` beside it (trybuild). A
//! `compile_fail` doctest passes on any error, "no such function" included; a snapshot passes
//! only on the intended one. Needs no device: cargo's runner runs it on the host.
//!
//! After a change of wording in rustc's messages, regenerate with `TRYBUILD=overwrite cargo
//! test --test ui` and read every diff: each must still be the guarantee's own error.

#[test]
fn compile_time_guarantees() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
