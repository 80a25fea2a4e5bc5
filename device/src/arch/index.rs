//! Thread, block and grid indices (PTX special registers `%tid`, `%ntid`, `%ctaid`,
//! `%nctaid`, `%laneid`), widened to `usize`.

use super::imp;

/// The three axes of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// `.x`
    X,
    /// `.y`
    Y,
    /// `.z`
    Z,
}

/// Index of this thread in its CTA along `axis` (`%tid.{x,y,z}`).
#[inline(always)]
pub fn thread_idx(axis: Axis) -> usize {
    imp::special(imp::Special::Tid, axis) as usize
}
/// Threads per CTA along `axis` (`%ntid.{x,y,z}`).
#[inline(always)]
pub fn block_dim(axis: Axis) -> usize {
    imp::special(imp::Special::Ntid, axis) as usize
}
/// Index of this CTA in the grid along `axis` (`%ctaid.{x,y,z}`).
#[inline(always)]
pub fn block_idx(axis: Axis) -> usize {
    imp::special(imp::Special::Ctaid, axis) as usize
}
/// CTAs in the grid along `axis` (`%nctaid.{x,y,z}`).
#[inline(always)]
pub fn grid_dim(axis: Axis) -> usize {
    imp::special(imp::Special::Nctaid, axis) as usize
}

/// `%tid.x`.
#[inline(always)]
pub fn thread_idx_x() -> usize {
    thread_idx(Axis::X)
}
/// `%ntid.x`.
#[inline(always)]
pub fn block_dim_x() -> usize {
    block_dim(Axis::X)
}
/// `%ctaid.x`.
#[inline(always)]
pub fn block_idx_x() -> usize {
    block_idx(Axis::X)
}
/// `%nctaid.x`.
#[inline(always)]
pub fn grid_dim_x() -> usize {
    grid_dim(Axis::X)
}

/// Linear index of this thread in its CTA (x fastest, then y, then z).
#[inline(always)]
pub fn thread_rank_in_block() -> usize {
    thread_idx(Axis::X) + block_dim(Axis::X) * (thread_idx(Axis::Y) + block_dim(Axis::Y) * thread_idx(Axis::Z))
}

/// Linear index of this CTA in its grid (x fastest, then y, then z).
#[inline(always)]
pub fn linear_block_idx() -> usize {
    block_idx(Axis::X) + grid_dim(Axis::X) * (block_idx(Axis::Y) + grid_dim(Axis::Y) * block_idx(Axis::Z))
}

/// Threads in this CTA.
#[inline(always)]
pub fn block_size() -> usize {
    block_dim(Axis::X) * block_dim(Axis::Y) * block_dim(Axis::Z)
}

/// Linear index of this thread in a 1-D grid: `ctaid.x * ntid.x + tid.x`, computed in `usize`.
#[inline(always)]
pub fn global_thread_idx_x() -> usize {
    block_idx_x() * block_dim_x() + thread_idx_x()
}

/// Threads in a 1-D grid: `nctaid.x * ntid.x` — the stride of a grid-stride loop.
#[inline(always)]
pub fn grid_threads_x() -> usize {
    grid_dim_x() * block_dim_x()
}

/// Lane of this thread in its warp, 0..32 (`%laneid`).
#[inline(always)]
pub fn lane_id() -> u32 {
    imp::lane_id()
}

/// Warp index of this thread in its CTA: `thread_rank_in_block() / 32`.
#[inline(always)]
pub fn warp_id_in_block() -> usize {
    thread_rank_in_block() / WARP_SIZE
}

/// Threads per warp.
pub const WARP_SIZE: usize = 32;
