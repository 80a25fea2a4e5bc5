//! Built-in kernels over the LSA device API: puts into peers' windows, the one-shot
//! all-reduce, a fused compute-and-put, and the barrier stress and latency kernels the test
//! suite and `ferrolink-perf` use. Each is one rank's kernel: launch it once per rank (on
//! the rank's stream) with that rank's `DevComm`, every rank with the same grid.

use crate::arch::{self, U32x4};
use crate::barrier::{BarrierOrder, LsaBarrierSession};
use crate::comm::DevComm;
use crate::coop::{CoopCta, CoopThread, CoopWarp};
use crate::kernel;
use crate::lsa;
use crate::window::DevWindow;

/// Spins for about `ns` nanoseconds of `%globaltimer` (used to skew ranks in stress tests).
#[inline(always)]
fn delay_ns(ns: u64) {
    let start = arch::global_timer_ns();
    while arch::global_timer_ns().wrapping_sub(start) < ns {
        arch::spin_wait_hint(100);
    }
}

/// A cheap, well-mixed hash (for per-rank, per-round pseudo-random delays).
///
/// ```
/// use ferrolink_device::kernels::lsa::mix;
/// assert_eq!(mix(1, 2, 3), mix(1, 2, 3)); // a pure function of its inputs
/// assert_ne!(mix(1, 2, 3), mix(1, 2, 4));
/// // As the stress kernel draws a delay for (rank, round, CTA):
/// assert!(mix(0, 1, 0) % 1000 < 1000);
/// ```
#[inline(always)]
pub const fn mix(a: u32, b: u32, c: u32) -> u32 {
    let mut h = a.wrapping_mul(0x9E37_79B1) ^ b.wrapping_mul(0x85EB_CA77) ^ c.wrapping_mul(0xC2B2_AE3D);
    h ^= h >> 15;
    h = h.wrapping_mul(0x2C1B_3C6D);
    h ^ (h >> 12)
}

/// The value rank `lsa_rank` leaves in its peers' windows in round `round` of
/// [`lsa_barrier_stress`].
///
/// ```
/// use ferrolink_device::kernels::lsa::stress_value;
/// assert_eq!(stress_value(3, 1), 3001); // round 3, LSA rank 1
/// ```
pub const fn stress_value(round: u32, lsa_rank: u32) -> u32 {
    round.wrapping_mul(1000).wrapping_add(lsa_rank)
}

/// The rounds of [`lsa_barrier_stress`] for one coop.
#[inline(always)]
fn stress_rounds<C: crate::coop::Coop>(
    coop: C,
    comm: &DevComm,
    win: &DevWindow,
    rounds: u32,
    max_delay_ns: u32,
) -> u32 {
    let b = arch::block_idx_x() as u32;
    let (me, n) = (comm.lsa_rank, comm.lsa_size as usize);
    let row = (b * comm.lsa_size) as usize;
    // SAFETY: the kernel's contract gives one barrier per CTA, used by this coop alone.
    let mut bar = unsafe { LsaBarrierSession::new(coop, comm, b) };
    let mut bad = 0u32;
    for round in 1..=rounds {
        if max_delay_ns > 0 {
            delay_ns(u64::from(mix(comm.rank, round, b) % max_delay_ns));
        }
        let mut p = coop.thread_rank();
        while p < n {
            // SAFETY: word [b][me] lies in peer p's slot (window sized by the contract).
            unsafe { win.lsa_ptr::<u32>((row + me as usize) * 4, p as u32).write_volatile(stress_value(round, me)) };
            p += coop.size();
        }
        bar.sync();
        let mut p = coop.thread_rank();
        while p < n {
            // SAFETY: word [b][p] lies in this rank's slot.
            let v = unsafe { win.local_ptr::<u32>((row + p) * 4).read_volatile() };
            bad += u32::from(v != stress_value(round, p as u32));
            p += coop.size();
        }
        bar.sync();
    }
    bad
}

kernel! {
    /// Barrier stress: `rounds` times, CTA `b` of every rank waits a pseudo-random
    /// `0..max_delay_ns`, writes [`stress_value`] into word `[b][me]` of every peer's slot of
    /// `win` with plain stores, meets the other ranks at LSA barrier `b`, checks that word
    /// `[b][p]` of its own slot holds peer `p`'s value for this round (counting mismatches
    /// in `*errors`), and meets them again before the next round may overwrite.
    ///
    /// The coop that does all this is the whole CTA (`coop == 0`), the CTA's first warp
    /// (`1`; launch at least 32 threads per CTA; the other warps leave at once) or its first
    /// thread (`2`; one thread serving every peer). Other codes trap.
    ///
    /// Needs `grid` barriers and `grid * lsa_size * 4` bytes of `win`.
    ///
    /// # Safety
    /// `comm` and `win` come from live handles; `errors` is a valid word; with `coop == 1`
    /// CTAs have at least 32 threads.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_barrier_stress;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, u32, u32, u32, *mut u32)> = &lsa_barrier_stress;
    /// assert_eq!(k.name(), "lsa_barrier_stress");
    /// ```
    pub unsafe fn lsa_barrier_stress(comm: DevComm, win: DevWindow, rounds: u32, max_delay_ns: u32, coop: u32, errors: *mut u32) {
        let bad = match coop {
            0 => stress_rounds(CoopCta, &comm, &win, rounds, max_delay_ns),
            1 if arch::warp_id_in_block() == 0 => stress_rounds(CoopWarp, &comm, &win, rounds, max_delay_ns),
            2 if arch::thread_rank_in_block() == 0 => stress_rounds(CoopThread, &comm, &win, rounds, max_delay_ns),
            1 | 2 => 0,
            _ => arch::trap(),
        };
        if bad != 0 {
            // SAFETY: `errors` is valid (kernel contract).
            unsafe { arch::atomic::fetch_add(errors, bad, arch::RmwOrder::Relaxed, arch::Scope::Sys) };
        }
    }
}

/// Times `warmup` then `rounds` barrier rounds of one session with `order`; returns the
/// timed nanoseconds.
#[inline(always)]
fn time_rounds<C: crate::coop::Coop>(
    coop: C,
    comm: &DevComm,
    index: u32,
    warmup: u32,
    rounds: u32,
    order: BarrierOrder,
) -> u64 {
    // SAFETY: the caller's kernel contract gives this coop barrier `index`.
    let mut bar = unsafe { LsaBarrierSession::new(coop, comm, index) };
    for _ in 0..warmup {
        bar.sync_with(order);
    }
    let t0 = arch::global_timer_ns();
    for _ in 0..rounds {
        bar.sync_with(order);
    }
    arch::global_timer_ns() - t0
}

/// [`time_rounds`] with the order as a constant (one specialized loop per order).
#[inline(always)]
fn time_rounds_with<C: crate::coop::Coop>(
    coop: C,
    comm: &DevComm,
    index: u32,
    warmup: u32,
    rounds: u32,
    order: u32,
) -> u64 {
    match BarrierOrder::from_code(order) {
        BarrierOrder::Relaxed => time_rounds(coop, comm, index, warmup, rounds, BarrierOrder::Relaxed),
        BarrierOrder::Acquire => time_rounds(coop, comm, index, warmup, rounds, BarrierOrder::Acquire),
        BarrierOrder::Release => time_rounds(coop, comm, index, warmup, rounds, BarrierOrder::Release),
        BarrierOrder::AcqRel => time_rounds(coop, comm, index, warmup, rounds, BarrierOrder::AcqRel),
    }
}

kernel! {
    /// Barrier latency: CTA `b` runs `warmup` then `rounds` LSA barrier rounds on barrier `b`
    /// with the [`BarrierOrder`] of code `order`, and writes the `%globaltimer` nanoseconds of
    /// the timed rounds to `out_ns[b]`. With `warp_coop != 0` the session's coop is the CTA's
    /// first warp ([`CoopWarp`]; launch 32-thread CTAs), else the whole CTA.
    ///
    /// # Safety
    /// `comm` comes from a live handle with at least `grid` barriers; `out_ns` holds `grid` words.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_barrier_bench;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::DevComm;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, u32, u32, u32, u32, *mut u64)> = &lsa_barrier_bench;
    /// assert_eq!(k.name(), "lsa_barrier_bench");
    /// ```
    pub unsafe fn lsa_barrier_bench(comm: DevComm, warmup: u32, rounds: u32, warp_coop: u32, order: u32, out_ns: *mut u64) {
        let b = arch::block_idx_x();
        let ns = if warp_coop != 0 {
            if arch::warp_id_in_block() != 0 {
                return;
            }
            time_rounds_with(CoopWarp, &comm, b as u32, warmup, rounds, order)
        } else {
            time_rounds_with(CoopCta, &comm, b as u32, warmup, rounds, order)
        };
        if arch::thread_rank_in_block() == 0 {
            // SAFETY: `out_ns` holds one word per CTA.
            unsafe { out_ns.add(b).write(ns) };
        }
    }
}

kernel! {
    /// Put: copies `bytes` bytes from local `src` into LSA peer `peer`'s slot of `win` at
    /// `dst_offset`, with every thread of the grid (plain stores; no completion signal —
    /// follow with a barrier, or let the kernel boundary order it for the host).
    ///
    /// # Safety
    /// `src` holds `bytes` bytes; `dst_offset + bytes <= win.size`; `peer < win.lsa_size`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_put;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::DevWindow;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevWindow, u32, usize, *const u8, usize)> = &lsa_put;
    /// assert_eq!(k.name(), "lsa_put");
    /// ```
    pub unsafe fn lsa_put(win: DevWindow, peer: u32, dst_offset: usize, src: *const u8, bytes: usize) {
        // SAFETY: the destination range lies in the peer's slot (kernel contract).
        unsafe {
            crate::kernels::copy::copy_bytes(
                win.lsa_ptr(dst_offset, peer), src, bytes, arch::global_thread_idx_x(), arch::grid_threads_x(),
            )
        }
    }
}

kernel! {
    /// The ring pattern: every rank copies `bytes` bytes of `src` into offset 0 of the next
    /// rank's (`(lsa_rank + 1) % lsa_size`) slot of `win`, all threads of the grid sharing the
    /// range as the copy kernel does (warp-contiguous chunks), then CTA `b` meets the other
    /// ranks at LSA barrier `b`. After it, each rank's slot holds the previous rank's `src`.
    ///
    /// Why the slot is complete when the kernel ends: a rank's kernel ends only after each of
    /// its CTAs `b` passed barrier `b`, which needs CTA `b` of every rank, the previous rank
    /// included, to have arrived, and an arrival releases that CTA's writes. So every CTA of
    /// the previous rank has published its chunks, whichever chunks the copy gave it. (Within
    /// the kernel, CTA `b` after its barrier may rely only on the previous rank's CTA `b`
    /// chunks, and those match its own only when every rank's `src` has the same alignment
    /// modulo 16.) This split moved 1–4 % more than one contiguous part per CTA on the H200
    /// (docs/PERF.md).
    ///
    /// # Safety
    /// `src` holds `bytes` bytes; `bytes <= win.size`; `grid <= lsa_barrier_count` (checked: a CTA without a barrier reports the error and traps).
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_ring_exchange;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, *const u8, usize)> = &lsa_ring_exchange;
    /// assert_eq!(k.name(), "lsa_ring_exchange");
    /// ```
    pub unsafe fn lsa_ring_exchange(comm: DevComm, win: DevWindow, src: *const u8, bytes: usize) {
        let b = arch::block_idx_x();
        let next = (comm.lsa_rank + 1) % comm.lsa_size;
        // SAFETY: the range lies in the next rank's slot (kernel contract).
        unsafe {
            crate::kernels::copy::copy_bytes(
                win.lsa_ptr(0, next), src, bytes, arch::global_thread_idx_x(), arch::grid_threads_x(),
            )
        };
        // SAFETY: one barrier per CTA (kernel contract).
        let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
        bar.sync();
    }
}

kernel! {
    /// One-shot all-reduce (sum of `f32`) over LSA: every rank's input is `count` floats at
    /// offset 0 of its slot of `win`. CTA `b` meets the other ranks at barrier `b` (inputs
    /// complete), sums part `b` of every peer's input directly into `out`, and meets them
    /// again (no rank may overwrite its input while peers still read it). Every rank gets
    /// bitwise the same sums (same order: peer 0, 1, …).
    ///
    /// # Safety
    /// `win.size >= count * 4`; `out` holds `count` floats; `grid <= lsa_barrier_count` (checked: a CTA without a barrier reports the error and traps).
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_allreduce_sum_f32;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, *mut f32, usize)> = &lsa_allreduce_sum_f32;
    /// assert_eq!(k.name(), "lsa_allreduce_sum_f32");
    /// ```
    pub unsafe fn lsa_allreduce_sum_f32(comm: DevComm, win: DevWindow, out: *mut f32, count: usize) {
        let b = arch::block_idx_x();
        // SAFETY: one barrier per CTA (kernel contract).
        let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
        bar.sync();
        // SAFETY: every peer's slot holds `count` floats at offset 0; `out` holds `count`.
        unsafe { lsa::reduce_sum_window(CoopCta, &[out], &win, 0, count, b, arch::grid_dim_x()) };
        bar.sync();
    }
}

/// The value [`lsa_fused_scale_put`] computes from input `x` on world rank `rank`.
///
/// ```
/// use ferrolink_device::kernels::lsa::fused_value;
/// assert_eq!(fused_value(2.0, 0.5, 3), 4.0); // 2 * 0.5 + rank 3
/// ```
#[inline(always)]
pub fn fused_value(x: f32, scale: f32, rank: u32) -> f32 {
    x * scale + rank as f32
}

kernel! {
    /// Fused compute and communication: computes `input[i] * scale + rank` for `count`
    /// floats and stores each 16-byte tile straight into the next rank's slot of `win` (no
    /// local staging buffer), then meets the other ranks at barrier `b`, after which each
    /// rank's slot holds the previous rank's results.
    ///
    /// # Safety
    /// `input` holds `count` floats (16-byte aligned); `win.size >= count * 4`;
    /// `grid <= lsa_barrier_count` (checked: a CTA without a barrier reports the error and traps).
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_fused_scale_put;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, *const f32, usize, f32)> = &lsa_fused_scale_put;
    /// assert_eq!(k.name(), "lsa_fused_scale_put");
    /// ```
    pub unsafe fn lsa_fused_scale_put(comm: DevComm, win: DevWindow, input: *const f32, count: usize, scale: f32) {
        let next = (comm.lsa_rank + 1) % comm.lsa_size;
        let dst = win.lsa_ptr::<f32>(0, next);
        let (i0, stride) = (arch::global_thread_idx_x(), arch::grid_threads_x());
        let vectors = count / 4;
        let mut v = i0;
        while v < vectors {
            // SAFETY: vector v lies in both ranges (kernel contract), 16-byte aligned.
            unsafe {
                let x = arch::load_v4(input.add(4 * v) as *const U32x4);
                let y = U32x4(x.0.map(|w| fused_value(f32::from_bits(w), scale, comm.rank).to_bits()));
                arch::store_v4(dst.add(4 * v) as *mut U32x4, y);
            }
            v += stride;
        }
        let mut i = 4 * vectors + i0;
        while i < count {
            // SAFETY: i < count.
            unsafe { dst.add(i).write(fused_value(input.add(i).read(), scale, comm.rank)) };
            i += stride;
        }
        // SAFETY: one barrier per CTA (kernel contract).
        let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, arch::block_idx_x() as u32) };
        bar.sync();
    }
}

/// [`lsa_barrier_try_sync`] status: every rank arrived.
///
/// ```
/// use ferrolink_device::kernels::lsa::{TRY_SYNC_ABORTED, TRY_SYNC_OK, TRY_SYNC_TIMED_OUT};
/// // Statuses are never 0: a status word still 0 was never written.
/// assert!([TRY_SYNC_OK, TRY_SYNC_TIMED_OUT, TRY_SYNC_ABORTED] == [1, 2, 3]);
/// ```
pub const TRY_SYNC_OK: u32 = 1;
/// [`lsa_barrier_try_sync`] status: the wait timed out.
///
/// ```
/// use ferrolink_device::kernels::lsa::{TRY_SYNC_OK, TRY_SYNC_TIMED_OUT};
/// assert_ne!(TRY_SYNC_TIMED_OUT, TRY_SYNC_OK);
/// ```
pub const TRY_SYNC_TIMED_OUT: u32 = 2;
/// [`lsa_barrier_try_sync`] status: the communicator was aborted.
///
/// ```
/// use ferrolink_device::kernels::lsa::{TRY_SYNC_ABORTED, TRY_SYNC_OK};
/// assert_ne!(TRY_SYNC_ABORTED, TRY_SYNC_OK);
/// ```
pub const TRY_SYNC_ABORTED: u32 = 3;

kernel! {
    /// One LSA barrier round on barrier `block_idx` with a device-side timeout; CTA `b` writes
    /// [`TRY_SYNC_OK`], [`TRY_SYNC_TIMED_OUT`] or, once the communicator is aborted,
    /// [`TRY_SYNC_ABORTED`] to `status[b]`. A rank that never arrives makes the others time
    /// out instead of hanging.
    ///
    /// # Safety
    /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_barrier_try_sync;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::DevComm;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, u64, *mut u32)> = &lsa_barrier_try_sync;
    /// assert_eq!(k.name(), "lsa_barrier_try_sync");
    /// ```
    pub unsafe fn lsa_barrier_try_sync(comm: DevComm, timeout_ns: u64, status: *mut u32) {
        let b = arch::block_idx_x();
        // SAFETY: one barrier per CTA (kernel contract).
        let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
        let result = match bar.sync_timeout(timeout_ns) {
            Ok(()) => TRY_SYNC_OK,
            Err(crate::barrier::BarrierError::Timeout) => TRY_SYNC_TIMED_OUT,
            Err(crate::barrier::BarrierError::Aborted) => TRY_SYNC_ABORTED,
        };
        if arch::thread_rank_in_block() == 0 {
            // SAFETY: `status` holds one word per CTA.
            unsafe { status.add(b).write(result) };
        }
    }
}

kernel! {
    /// Copies the device communicator's window table (`comm.window(i)` for every registered
    /// `i`) to `out` and the count to `*count`: lets the host check what kernels see.
    ///
    /// # Safety
    /// `comm` from a live handle; `out` holds `comm.window_count` entries; `count` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_window_table_probe;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, *mut DevWindow, *mut u32)> = &lsa_window_table_probe;
    /// assert_eq!(k.name(), "lsa_window_table_probe");
    /// ```
    pub unsafe fn lsa_window_table_probe(comm: DevComm, out: *mut DevWindow, count: *mut u32) {
        if arch::global_thread_idx_x() != 0 {
            return;
        }
        let mut i = 0;
        // SAFETY: the handle is alive (kernel contract); `out` has room for every entry.
        while let Some(w) = unsafe { comm.window(i) } {
            // SAFETY: `out` holds `window_count` entries and i < window_count.
            unsafe { out.add(i as usize).write(w) };
            i += 1;
        }
        // SAFETY: `count` is valid.
        unsafe { count.write(i) };
    }
}

kernel! {
    /// One LSA barrier round on barrier `block_idx`, which world rank `fail_rank` never reaches:
    /// its thread 0 traps first (the device's form of a panic; on the emulator the launch fails
    /// with the trap), while its other threads head for the barrier. Every other rank's CTA `b`
    /// writes [`TRY_SYNC_OK`] or [`TRY_SYNC_ABORTED`] to `status[b]`: a failed rank must never
    /// let the others pass, so the test expects `TRY_SYNC_ABORTED` (after the host aborts the
    /// communicator for the failed stream) and never `TRY_SYNC_OK`.
    ///
    /// # Safety
    /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::lsa::lsa_barrier_fail_rank;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::DevComm;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, u32, *mut u32)> = &lsa_barrier_fail_rank;
    /// assert_eq!(k.name(), "lsa_barrier_fail_rank");
    /// ```
    pub unsafe fn lsa_barrier_fail_rank(comm: DevComm, fail_rank: u32, status: *mut u32) {
        let b = arch::block_idx_x();
        if comm.rank == fail_rank && arch::thread_rank_in_block() == 0 {
            arch::trap();
        }
        // SAFETY: one barrier per CTA (kernel contract).
        let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
        let result = match bar.try_sync() {
            Ok(()) => TRY_SYNC_OK,
            Err(_) => TRY_SYNC_ABORTED,
        };
        if arch::thread_rank_in_block() == 0 {
            // SAFETY: `status` holds one word per CTA.
            unsafe { status.add(b).write(result) };
        }
    }
}
