//! Self-test kernels: small kernels whose results the test suite checks exactly, on the
//! CPU emulator and on the GPU, to validate the arch layer on each backend.

use crate::arch::{self, LoadOrder, RmwOrder, Scope, StoreOrder, atomic};
use crate::kernel;

/// The value the message-passing litmus writes into word `i` in round `r`.
///
/// ```
/// use ferrolink_device::kernels::selftest::mp_value;
/// assert_eq!(mp_value(0, 7), 7);
/// assert_ne!(mp_value(1, 7), mp_value(2, 7)); // every round writes new values
/// ```
pub const fn mp_value(round: u32, i: u32) -> u32 {
    round.wrapping_mul(0x9E37_79B9) ^ i
}

/// Spins until `*p >= target` (acquire at `scope`).
///
/// # Safety
/// `p` must be valid and only accessed atomically.
#[inline(always)]
unsafe fn wait_at_least(p: *const u32, target: u32, scope: Scope) {
    // SAFETY: forwarded contract.
    while unsafe { atomic::load(p, LoadOrder::Acquire, scope) } < target {
        arch::spin_wait_hint(32);
    }
}

kernel! {
    /// Message-passing litmus between two CTAs, `rounds` times: CTA 0 writes `words` data
    /// words with plain stores, meets its CTA barrier, and thread 0 publishes the round
    /// with a release store to `flag` at the given scope; CTA 1's thread 0 acquires the flag,
    /// its CTA barrier passes that on, and every thread checks the data, counting wrong
    /// words in `errors`. CTA 1 then releases `ack` so that CTA 0 may overwrite the data.
    ///
    /// Ordering argument: the producer's data stores happen before its `bar.sync`, which
    /// synchronizes them (CTA scope) with thread 0, whose release at `scope` is cumulative;
    /// the consumer's thread 0 acquires at `scope` and its `bar.sync` extends that to its CTA.
    ///
    /// Launch with exactly 2 CTAs. `flag`, `ack` and `errors` start at 0.
    ///
    /// # Safety
    /// `data` holds `words` words; `flag`, `ack` and `errors` are valid words.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::arch::Scope;
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::selftest::selftest_message_passing;
    /// # use std::time::Duration;
    /// let (rounds, words) = (5u32, 64u32);
    /// let mut data = vec![0u32; words as usize];
    /// let mut flags = [0u32; 3]; // flag, ack, errors
    /// let f = flags.as_mut_ptr();
    /// // Exactly two CTAs: the producer and the consumer.
    /// let spec = LaunchSpec { name: selftest_message_passing.name(), grid: [2, 1, 1], block: [32, 1, 1],
    ///     shared_mem_bytes: 0, timeout: Duration::from_secs(30) };
    /// let args = (data.as_mut_ptr(), f, f.wrapping_add(1), f.wrapping_add(2), rounds, words, Scope::Gpu.code());
    /// // SAFETY: `data` holds `words` words and `flags` three zeroed words; both outlive the launch.
    /// unsafe { emulator::launch(&spec, selftest_message_passing.host_entry(), args) }.unwrap();
    /// assert_eq!(flags, [rounds, rounds, 0]);
    /// ```
    pub unsafe fn selftest_message_passing(
        data: *mut u32, flag: *mut u32, ack: *mut u32, errors: *mut u32,
        rounds: u32, words: u32, scope: u32
    ) {
        let scope = Scope::from_code(scope);
        let tid = arch::thread_idx_x();
        let nthreads = arch::block_dim_x();
        let producer = arch::block_idx_x() == 0;
        for round in 1..=rounds {
            if producer {
                if tid == 0 && round > 1 {
                    // SAFETY: `ack` is valid (kernel contract).
                    unsafe { wait_at_least(ack, round - 1, scope) };
                }
                arch::sync_threads();
                let mut i = tid;
                while i < words as usize {
                    // SAFETY: i < words (kernel contract); the consumer does not read
                    // until the flag below publishes the round.
                    unsafe { data.add(i).write_volatile(mp_value(round, i as u32)) };
                    i += nthreads;
                }
                arch::sync_threads();
                if tid == 0 {
                    // SAFETY: `flag` is valid (kernel contract).
                    unsafe { atomic::store(flag, round, StoreOrder::Release, scope) };
                }
            } else {
                if tid == 0 {
                    // SAFETY: `flag` is valid (kernel contract).
                    unsafe { wait_at_least(flag, round, scope) };
                }
                arch::sync_threads();
                let mut bad = 0u32;
                let mut i = tid;
                while i < words as usize {
                    // SAFETY: i < words; the producer does not write until `ack` below.
                    let v = unsafe { data.add(i).read_volatile() };
                    bad += u32::from(v != mp_value(round, i as u32));
                    i += nthreads;
                }
                if bad != 0 {
                    // SAFETY: `errors` is valid (kernel contract).
                    unsafe { atomic::fetch_add(errors, bad, RmwOrder::Relaxed, Scope::Gpu) };
                }
                arch::sync_threads();
                if tid == 0 {
                    // SAFETY: `ack` is valid (kernel contract).
                    unsafe { atomic::store(ack, round, StoreOrder::Release, scope) };
                }
            }
        }
    }
}

kernel! {
    /// Contended read-modify-write: every thread of the grid performs `iters` compare-and-swap
    /// increments of `cas_counter`, `iters` `fetch_add`s of `add_counter`, and one `fetch_max`
    /// of its global index into `max_word`, all at `scope`. Afterwards
    /// `*cas_counter == *add_counter == threads * iters` and `*max_word == threads - 1`.
    ///
    /// # Safety
    /// The three pointers are valid words, zero at launch.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::arch::Scope;
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::selftest::selftest_counters;
    /// # use std::time::Duration;
    /// let (grid, block, iters) = (2u32, 32u32, 10u32);
    /// let mut cas = 0u64;
    /// let mut words = [0u32; 2]; // add_counter, max_word
    /// let w = words.as_mut_ptr();
    /// # let spec = LaunchSpec { name: selftest_counters.name(),
    /// #     grid: [grid, 1, 1], block: [block, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
    /// let args = (&raw mut cas, w, w.wrapping_add(1), iters, Scope::Gpu.code());
    /// // SAFETY: three zeroed words that outlive the launch.
    /// unsafe { emulator::launch(&spec, selftest_counters.host_entry(), args) }.unwrap();
    /// let threads = grid * block;
    /// assert_eq!(cas, u64::from(threads * iters));
    /// assert_eq!(words, [threads * iters, threads - 1]);
    /// ```
    pub unsafe fn selftest_counters(
        cas_counter: *mut u64, add_counter: *mut u32, max_word: *mut u32, iters: u32, scope: u32
    ) {
        let scope = Scope::from_code(scope);
        for _ in 0..iters {
            // SAFETY: valid words (kernel contract), accessed only atomically.
            unsafe {
                let mut seen = atomic::load(cas_counter, LoadOrder::Relaxed, scope);
                loop {
                    let old = atomic::compare_swap(cas_counter, seen, seen + 1, RmwOrder::AcqRel, scope);
                    if old == seen {
                        break;
                    }
                    seen = old;
                }
                atomic::fetch_add(add_counter, 1, RmwOrder::Relaxed, scope);
            }
        }
        // SAFETY: as above.
        unsafe { atomic::fetch_max(max_word, arch::global_thread_idx_x() as u32, RmwOrder::Relaxed, scope) };
    }
}

/// Words [`selftest_warp`] writes per thread.
///
/// ```
/// use ferrolink_device::kernels::selftest::WARP_TEST_WORDS;
/// // `selftest_warp`'s output for 64 threads; thread `t`'s word `k` is at `t * WARP_TEST_WORDS + k`.
/// let out = vec![0u32; 64 * WARP_TEST_WORDS];
/// assert_eq!(out.len(), 512);
/// ```
pub const WARP_TEST_WORDS: usize = 8;

kernel! {
    /// Warp operations: each thread writes [`WARP_TEST_WORDS`] words at
    /// `out[global_thread * WARP_TEST_WORDS ..]`:
    /// 0. lane 0's `lane + 100` broadcast with `shfl_sync`;
    /// 1. `ballot_sync(active, lane % 3 == 0)`;
    /// 2. `active_mask()`;
    /// 3. `shfl_down_sync(active, lane, 1)`;
    /// 4. `shfl_up_sync(active, lane, 2)`;
    /// 5. the sum of lanes by `shfl_xor_sync` butterflies in a full warp, else `u32::MAX`;
    /// 6. `warp_id_in_block()`;
    /// 7. the low word of lane 3's `(lane << 40) | 5` broadcast by `shfl_sync_u64`, plus its
    ///    high word (so `3 << 8 | 5` when lane 3 exists).
    ///
    /// # Safety
    /// `out` holds `WARP_TEST_WORDS` words per launched thread.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::selftest::{WARP_TEST_WORDS, selftest_warp};
    /// # use std::time::Duration;
    /// let mut out = vec![0u32; 32 * WARP_TEST_WORDS];
    /// # let spec = LaunchSpec { name: selftest_warp.name(),
    /// #     grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
    /// // SAFETY: `out` holds WARP_TEST_WORDS words per thread and outlives the launch.
    /// unsafe { emulator::launch(&spec, selftest_warp.host_entry(), (out.as_mut_ptr(),)) }.unwrap();
    /// let lane = |l: usize| &out[l * WARP_TEST_WORDS..(l + 1) * WARP_TEST_WORDS];
    /// assert_eq!(lane(7)[0], 100); // lane 0's `lane + 100`, broadcast
    /// assert_eq!(lane(7)[1], 0x4924_9249); // lanes 0, 3, 6, .. voted true
    /// assert_eq!(lane(7)[5], 496); // 0 + 1 + .. + 31
    /// assert_eq!(lane(7)[7], 3 << 8 | 5);
    /// ```
    pub unsafe fn selftest_warp(out: *mut u32) {
        let lane = arch::lane_id();
        let active = arch::active_mask();
        let mut r = [0u32; WARP_TEST_WORDS];
        r[0] = arch::shfl_sync(active, lane + 100, 0);
        r[1] = arch::ballot_sync(active, lane.is_multiple_of(3));
        r[2] = active;
        r[3] = arch::shfl_down_sync(active, lane, 1);
        r[4] = arch::shfl_up_sync(active, lane, 2);
        r[5] = if active == arch::FULL_MASK {
            let mut sum = lane;
            let mut m = 16;
            while m > 0 {
                sum += arch::shfl_xor_sync(active, sum, m);
                m /= 2;
            }
            sum
        } else {
            u32::MAX
        };
        r[6] = arch::warp_id_in_block() as u32;
        let b = arch::shfl_sync_u64(active, (u64::from(lane) << 40) | 5, 3);
        r[7] = (b as u32) + ((b >> 32) as u32);
        let base = arch::global_thread_idx_x() * WARP_TEST_WORDS;
        for (k, v) in r.iter().enumerate() {
            // SAFETY: `out` holds WARP_TEST_WORDS words per thread (kernel contract).
            unsafe { out.add(base + k).write(*v) };
        }
    }
}

kernel! {
    /// Dynamic shared memory and the CTA barrier: thread `t` stores `t * 7 + block` into
    /// shared word `t`, meets the barrier, and writes shared word `block_size - 1 - t` to
    /// `out[global_thread]`. Launch with `block_size * 4` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// `out` holds one word per launched thread.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::selftest::selftest_shared_reverse;
    /// # use std::time::Duration;
    /// let (grid, block) = (2u32, 8u32);
    /// let mut out = vec![0u32; (grid * block) as usize];
    /// // A shared word per thread of the CTA.
    /// let spec = LaunchSpec { name: selftest_shared_reverse.name(), grid: [grid, 1, 1], block: [block, 1, 1],
    ///     shared_mem_bytes: 4 * block as usize, timeout: Duration::from_secs(10) };
    /// // SAFETY: `out` holds a word per thread and outlives the launch.
    /// unsafe { emulator::launch(&spec, selftest_shared_reverse.host_entry(), (out.as_mut_ptr(),)) }.unwrap();
    /// // Thread `t` of CTA `b` reads what thread `block - 1 - t` stored: `(block - 1 - t) * 7 + b`.
    /// assert_eq!(out[0], 7 * 7);
    /// assert_eq!(out[8 + 7], 1);
    /// ```
    pub unsafe fn selftest_shared_reverse(out: *mut u32) {
        let shared = arch::dynamic_shared_mem::<u32>();
        let t = arch::thread_idx_x();
        let n = arch::block_dim_x();
        // SAFETY: the launch provides block_size words of shared memory (kernel contract).
        unsafe { shared.add(t).write_volatile((t * 7 + arch::block_idx_x()) as u32) };
        arch::sync_threads();
        // SAFETY: as above; the barrier ordered the writes before these reads.
        let v = unsafe { shared.add(n - 1 - t).read_volatile() };
        // SAFETY: `out` holds one word per thread.
        unsafe { out.add(arch::global_thread_idx_x()).write(v) };
    }
}

kernel! {
    /// Thread 0 raises `flag` to `value` with a release store at system scope: the signal
    /// [`selftest_wait_flag`] waits for, sent from another stream (another rank).
    ///
    /// # Safety
    /// `flag` is a valid word.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::selftest::selftest_signal;
    /// # use std::time::Duration;
    /// let mut flag = 0u32;
    /// # let spec = LaunchSpec { name: selftest_signal.name(),
    /// #     grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
    /// // SAFETY: `flag` outlives the launch.
    /// unsafe { emulator::launch(&spec, selftest_signal.host_entry(), (&raw mut flag, 7)) }.unwrap();
    /// assert_eq!(flag, 7);
    /// ```
    pub unsafe fn selftest_signal(flag: *mut u32, value: u32) {
        if arch::global_thread_idx_x() == 0 {
            // SAFETY: `flag` is valid (kernel contract).
            unsafe { atomic::store(flag, value, StoreOrder::Release, Scope::Sys) };
        }
    }
}

/// [`selftest_wait_flag`] status: the flag reached the target.
///
/// ```
/// use ferrolink_device::kernels::selftest::{WAIT_SEEN, WAIT_TIMED_OUT};
/// // Neither is 0: a status still 0 after the launch was never written.
/// assert!(WAIT_SEEN != 0 && WAIT_SEEN != WAIT_TIMED_OUT);
/// ```
pub const WAIT_SEEN: u32 = 1;
/// [`selftest_wait_flag`] status: the device-side timeout passed first.
///
/// ```
/// use ferrolink_device::kernels::selftest::{WAIT_SEEN, WAIT_TIMED_OUT};
/// assert!(WAIT_TIMED_OUT != 0 && WAIT_TIMED_OUT != WAIT_SEEN);
/// ```
pub const WAIT_TIMED_OUT: u32 = 2;

kernel! {
    /// Thread 0 waits (acquire, system scope) until `*flag >= target` or `timeout_ns` of
    /// `%globaltimer` pass, and writes [`WAIT_SEEN`] or [`WAIT_TIMED_OUT`] to `status`.
    /// Used to test a wait whose signal never comes.
    ///
    /// # Safety
    /// `flag` and `status` are valid words.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::selftest::{WAIT_SEEN, WAIT_TIMED_OUT, selftest_wait_flag};
    /// # use std::time::Duration;
    /// let (flag, mut status) = (5u32, 0u32);
    /// # let spec = LaunchSpec { name: selftest_wait_flag.name(),
    /// #     grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
    /// let (f, st) = (&raw const flag, &raw mut status);
    /// // The flag is already at least 3.
    /// // SAFETY: `flag` and `status` outlive the launch.
    /// unsafe { emulator::launch(&spec, selftest_wait_flag.host_entry(), (f, 3, 1_000_000_000, st)) }.unwrap();
    /// assert_eq!(status, WAIT_SEEN);
    /// // A signal that never comes: the device-side timeout (1 ms) ends the wait.
    /// // SAFETY: as above.
    /// unsafe { emulator::launch(&spec, selftest_wait_flag.host_entry(), (f, 6, 1_000_000, st)) }.unwrap();
    /// assert_eq!(status, WAIT_TIMED_OUT);
    /// ```
    pub unsafe fn selftest_wait_flag(flag: *const u32, target: u32, timeout_ns: u64, status: *mut u32) {
        if arch::global_thread_idx_x() != 0 {
            return;
        }
        let start = arch::global_timer_ns();
        let result = loop {
            // SAFETY: `flag` is valid (kernel contract).
            if unsafe { atomic::load(flag, LoadOrder::Acquire, Scope::Sys) } >= target {
                break WAIT_SEEN;
            }
            if arch::global_timer_ns().wrapping_sub(start) >= timeout_ns {
                break WAIT_TIMED_OUT;
            }
            arch::spin_wait_hint(1000);
        };
        // SAFETY: `status` is valid (kernel contract).
        unsafe { atomic::store(status, result, StoreOrder::Release, Scope::Sys) };
    }
}
