//! The global allocator of every binary that links this crate: every service, the lab,
//! `trellisctl`, the benchmarks and the tests.
//!
//! mimalloc rather than glibc's malloc: in a profile of the 255-cluster in-process mesh,
//! glibc's allocator (free-list consolidation and chunk unlinking above all) took about a
//! quarter of the CPU; the services allocate and free many small, short-lived buffers per RPC
//! (prost messages, HTTP/2 frames, store records) from many threads. ADR 0015 has the
//! measurements.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
