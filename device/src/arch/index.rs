//! Thread, block and grid indices (PTX special registers `%tid`, `%ntid`, `%ctaid`,
//! `%nctaid`, `%laneid`), widened to `usize`.

use super::imp;

/// The three axes of a launch.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_rank_in_block()) = arch::thread_idx(Axis::Y) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [2, 3, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 6];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 0, 1, 1, 2, 2]);
/// ```
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
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let (x, y) = (arch::thread_idx(Axis::X), arch::thread_idx(Axis::Y));
///     // SAFETY: one word per thread.
///     unsafe { *out.add(y * 4 + x) = 10 * y + x };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [4, 2, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 8];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 1, 2, 3, 10, 11, 12, 13]);
/// ```
#[inline(always)]
pub fn thread_idx(axis: Axis) -> usize {
    imp::special(imp::Special::Tid, axis) as usize
}
/// Threads per CTA along `axis` (`%ntid.{x,y,z}`).
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let dims = arch::block_dim(Axis::X) * 100 + arch::block_dim(Axis::Y) * 10 + arch::block_dim(Axis::Z);
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_rank_in_block()) = dims };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [4, 2, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 8];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&d| d == 421));
/// ```
#[inline(always)]
pub fn block_dim(axis: Axis) -> usize {
    imp::special(imp::Special::Ntid, axis) as usize
}
/// Index of this CTA in the grid along `axis` (`%ctaid.{x,y,z}`).
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let (x, y) = (arch::block_idx(Axis::X), arch::block_idx(Axis::Y));
///     // SAFETY: one word per CTA.
///     unsafe { *out.add(y * 2 + x) = 10 * y + x };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 3, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 6];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 1, 10, 11, 20, 21]);
/// ```
#[inline(always)]
pub fn block_idx(axis: Axis) -> usize {
    imp::special(imp::Special::Ctaid, axis) as usize
}
/// CTAs in the grid along `axis` (`%nctaid.{x,y,z}`).
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let dims = arch::grid_dim(Axis::X) * 100 + arch::grid_dim(Axis::Y) * 10 + arch::grid_dim(Axis::Z);
///     // SAFETY: one word per CTA.
///     unsafe { *out.add(arch::linear_block_idx()) = dims };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 3, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 6];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&d| d == 231));
/// ```
#[inline(always)]
pub fn grid_dim(axis: Axis) -> usize {
    imp::special(imp::Special::Nctaid, axis) as usize
}

/// `%tid.x`.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let t = arch::thread_idx_x();
///     // SAFETY: one word per thread.
///     unsafe { *out.add(t) = t };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 4];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 1, 2, 3]);
/// ```
#[inline(always)]
pub fn thread_idx_x() -> usize {
    thread_idx(Axis::X)
}
/// `%ntid.x`.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = arch::block_dim_x() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 4];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [4, 4, 4, 4]);
/// ```
#[inline(always)]
pub fn block_dim_x() -> usize {
    block_dim(Axis::X)
}
/// `%ctaid.x`.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::global_thread_idx_x()) = arch::block_idx_x() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [3, 1, 1], block: [2, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 6];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 0, 1, 1, 2, 2]);
/// ```
#[inline(always)]
pub fn block_idx_x() -> usize {
    block_idx(Axis::X)
}
/// `%nctaid.x`.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     // SAFETY: one word per CTA.
///     unsafe { *out.add(arch::block_idx_x()) = arch::grid_dim_x() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [3, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 3];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [3, 3, 3]);
/// ```
#[inline(always)]
pub fn grid_dim_x() -> usize {
    grid_dim(Axis::X)
}

/// Linear index of this thread in its CTA (x fastest, then y, then z).
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let (x, y) = (arch::thread_idx(Axis::X), arch::thread_idx(Axis::Y));
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_rank_in_block()) = 10 * y + x };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [2, 2, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 4];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 1, 10, 11]);
/// ```
#[inline(always)]
pub fn thread_rank_in_block() -> usize {
    thread_idx(Axis::X) + block_dim(Axis::X) * (thread_idx(Axis::Y) + block_dim(Axis::Y) * thread_idx(Axis::Z))
}

/// Linear index of this CTA in its grid (x fastest, then y, then z).
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let (x, y) = (arch::block_idx(Axis::X), arch::block_idx(Axis::Y));
///     // SAFETY: one word per CTA.
///     unsafe { *out.add(arch::linear_block_idx()) = 10 * y + x };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 2, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 4];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 1, 10, 11]);
/// ```
#[inline(always)]
pub fn linear_block_idx() -> usize {
    block_idx(Axis::X) + grid_dim(Axis::X) * (block_idx(Axis::Y) + grid_dim(Axis::Y) * block_idx(Axis::Z))
}

/// Threads in this CTA.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_rank_in_block()) = arch::block_size() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [4, 2, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 8];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&n| n == 8));
/// ```
#[inline(always)]
pub fn block_size() -> usize {
    block_dim(Axis::X) * block_dim(Axis::Y) * block_dim(Axis::Z)
}

/// Linear index of this thread in a 1-D grid: `ctaid.x * ntid.x + tid.x`, computed in `usize`.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     let i = arch::global_thread_idx_x();
///     // SAFETY: one word per thread of the grid.
///     unsafe { *out.add(i) = i };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [3, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 6];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [0, 1, 2, 3, 4, 5]);
/// ```
#[inline(always)]
pub fn global_thread_idx_x() -> usize {
    block_idx_x() * block_dim_x() + thread_idx_x()
}

/// Threads in a 1-D grid: `nctaid.x * ntid.x` — the stride of a grid-stride loop.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out, n): (*mut usize, usize)) {
///     let mut i = arch::global_thread_idx_x();
///     while i < n {
///         // SAFETY: `out` holds `n` words; each `i` is visited by one thread.
///         unsafe { *out.add(i) = 2 * i };
///         i += arch::grid_threads_x();
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [2, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 10];
/// // SAFETY: `out` holds 10 words and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(), out.len())) }.unwrap();
/// assert_eq!(out, (0..10).map(|i| 2 * i).collect::<Vec<_>>());
/// ```
#[inline(always)]
pub fn grid_threads_x() -> usize {
    grid_dim_x() * block_dim_x()
}

/// Lane of this thread in its warp, 0..32 (`%laneid`).
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = arch::lane_id() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 64];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().enumerate().all(|(t, &lane)| lane as usize == t % 32));
/// ```
#[inline(always)]
pub fn lane_id() -> u32 {
    imp::lane_id()
}

/// Warp index of this thread in its CTA: `thread_rank_in_block() / 32`.
///
/// ```
/// # use ferrolink_device::arch::{self, Axis};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut usize,)) {
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = arch::warp_id_in_block() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 64];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().enumerate().all(|(t, &warp)| warp == t / 32));
/// ```
#[inline(always)]
pub fn warp_id_in_block() -> usize {
    thread_rank_in_block() / WARP_SIZE
}

/// Threads per warp.
///
/// ```
/// use ferrolink_device::arch::WARP_SIZE;
/// // Warps of a 100-thread CTA: three full ones and a partial one of 4 lanes.
/// assert_eq!(100usize.div_ceil(WARP_SIZE), 4);
/// assert_eq!(100 % WARP_SIZE, 4);
/// ```
pub const WARP_SIZE: usize = 32;
