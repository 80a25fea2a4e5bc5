//! ferrolink's benches (`cargo bench -p ferrolink-benches`). Device timings use CUDA events
//! and print each figure beside its baseline from the same run; the same measurements are
//! in the `ferrolink-perf` tool, which the GPU bundle runs.

pub mod perf;
