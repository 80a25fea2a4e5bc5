//! A persistent kernel with a batched atomic work queue: the scheduling idiom of persistent
//! kernels. Each warp's leader claims a batch of item indices with one `fetch_add`, broadcasts
//! the batch start with a shuffle, and the warp works through it; warps that draw cheap items
//! come back for more, so uneven work spreads across SMs.

use crate::arch::{self, RmwOrder, Scope, atomic};
use crate::kernel;

/// Work units item `i` costs: every 16th item is 64 times heavier (a skewed load).
///
/// ```
/// use ferrolink_device::kernels::workqueue::item_cost;
/// assert_eq!(item_cost(0), 640); // every 16th item is heavy
/// assert_eq!(item_cost(1), 10);
/// assert_eq!(item_cost(16), 640);
/// ```
#[inline(always)]
pub const fn item_cost(i: u32) -> u32 {
    if i.is_multiple_of(16) { 640 } else { 10 }
}

/// The busy work for one item (a hash chain of `cost` steps); returns its checksum.
///
/// ```
/// use ferrolink_device::kernels::workqueue::{item_cost, item_work};
/// // A pure function: the host checks the kernel's checksum against it.
/// assert_eq!(item_work(5, item_cost(5)), item_work(5, 10));
/// assert_eq!(item_work(5, 0), 5 ^ 0x5bd1_e995);
/// ```
#[inline(always)]
pub fn item_work(i: u32, cost: u32) -> u32 {
    let mut h = i ^ 0x5bd1_e995;
    for k in 0..cost {
        h = (h ^ k).wrapping_mul(0x2710_0001).rotate_left(13);
    }
    h
}

kernel! {
    /// Processes items `0..items`: each warp claims `batch` items at a time from `*next_item`
    /// (dynamic) or, if `static_split != 0`, takes items `warp, warp + warps, …` (the static
    /// baseline). Every item adds 1 to `hits[i]` and its [`item_work`] checksum to
    /// `*checksum`; CTA `b` writes its busy time (`%globaltimer` ns) to `cta_ns[b]`.
    /// Launch with whole warps (block size a multiple of 32).
    ///
    /// # Safety
    /// `next_item` and `checksum` are valid words (`*next_item == 0`); `hits` holds `items`
    /// words; `cta_ns` one word per CTA.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::workqueue::{item_cost, item_work, persistent_work_queue};
    /// # use std::time::Duration;
    /// let (items, grid) = (200u32, 2u32);
    /// let (mut next, mut checksum) = (0u32, 0u32);
    /// let mut hits = vec![0u32; items as usize];
    /// let mut cta_ns = vec![0u64; grid as usize];
    /// // Whole warps per CTA.
    /// let spec = LaunchSpec { name: persistent_work_queue.name(), grid: [grid, 1, 1], block: [64, 1, 1],
    ///     shared_mem_bytes: 0, timeout: Duration::from_secs(30) };
    /// // Dynamic: warps claim 8 items at a time.
    /// let args = (&raw mut next, items, 8, 0, hits.as_mut_ptr(), &raw mut checksum, cta_ns.as_mut_ptr());
    /// // SAFETY: `next` and `checksum` are zeroed words, `hits` holds `items` words and `cta_ns`
    /// // one per CTA; all outlive the launch.
    /// unsafe { emulator::launch(&spec, persistent_work_queue.host_entry(), args) }.unwrap();
    /// assert!(hits.iter().all(|&h| h == 1));
    /// assert_eq!(checksum, (0..items).fold(0u32, |s, i| s.wrapping_add(item_work(i, item_cost(i)))));
    /// ```
    pub unsafe fn persistent_work_queue(
        next_item: *mut u32, items: u32, batch: u32, static_split: u32,
        hits: *mut u32, checksum: *mut u32, cta_ns: *mut u64
    ) {
        let lane = arch::lane_id();
        let warps = (arch::grid_threads_x() / 32) as u32;
        let warp = (arch::global_thread_idx_x() / 32) as u32;
        let start = arch::global_timer_ns();
        let mut sum = 0u32;
        let mut process = |i: u32| {
            sum = sum.wrapping_add(item_work(i, item_cost(i)));
            // SAFETY: i < items (callers below), `hits` holds `items` words.
            unsafe { atomic::fetch_add(hits.add(i as usize), 1, RmwOrder::Relaxed, Scope::Gpu) };
        };
        if static_split != 0 {
            let mut i = warp * 32 + lane;
            while i < items {
                process(i);
                i += warps * 32;
            }
        } else {
            loop {
                let mut base = 0;
                if lane == 0 {
                    // SAFETY: `next_item` is a valid word (kernel contract).
                    base = unsafe { atomic::fetch_add(next_item, batch, RmwOrder::Relaxed, Scope::Gpu) };
                }
                let base = arch::shfl_sync(arch::FULL_MASK, base, 0);
                if base >= items {
                    break;
                }
                let end = base.saturating_add(batch).min(items);
                let mut i = base + lane;
                while i < end {
                    process(i);
                    i += 32;
                }
            }
        }
        // SAFETY: valid word (kernel contract).
        unsafe { atomic::fetch_add(checksum, sum, RmwOrder::Relaxed, Scope::Gpu) };
        arch::sync_threads();
        if arch::thread_rank_in_block() == 0 {
            // SAFETY: `cta_ns` holds one word per CTA.
            unsafe { cta_ns.add(arch::block_idx_x()).write(arch::global_timer_ns() - start) };
        }
    }
}
