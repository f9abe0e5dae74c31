//! End-to-end tests across crates live in `tests/tests/`; shared helpers here.
