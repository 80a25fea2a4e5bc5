//! The CPU emulator's execution model, tested with host-only kernels launched straight
//! through `emulator::launch` (no PTX involved): failures are reported, not hung or lost.

use ferrolink_device::arch::{FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
use ferrolink_device::emulator::{self, EmuError, LaunchSpec};
use ferrolink_device::{arch, kernel};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

fn spec(name: &'static str, grid: u32, block: u32) -> LaunchSpec {
    LaunchSpec { name, grid: [grid, 1, 1], block: [block, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(20) }
}

kernel! {
    /// Thread `bad` panics (an out-of-bounds index); the others count themselves.
    pub unsafe fn panics_in_one_thread(bad: usize, done: *const AtomicU32) {
        let t = arch::global_thread_idx_x();
        let table = [1u32, 2, 3];
        let i = if t == bad { 7 } else { 1 };
        let _ = std::hint::black_box(table[std::hint::black_box(i)]);
        // SAFETY: `done` points to a live counter (test contract).
        unsafe { (*done).fetch_add(1, Ordering::Relaxed) };
    }
}

#[test]
fn a_panicking_thread_fails_the_launch_with_its_message_and_coordinates() {
    let done = AtomicU32::new(0);
    // SAFETY: `done` outlives the launch.
    let r = unsafe {
        emulator::launch(&spec("panics_in_one_thread", 2, 8), panics_in_one_thread.host_entry(), (9, &raw const done))
    };
    match r {
        Err(EmuError::Panicked { kernel, thread, message }) => {
            assert_eq!(kernel, "panics_in_one_thread");
            assert!(thread.contains("block [1, 0, 0]") && thread.contains("thread [1, 0, 0]"), "{thread}");
            assert!(message.contains("index out of bounds"), "{message}");
        }
        other => panic!("expected a panic report, got {other:?}"),
    }
}

kernel! {
    /// Thread 3 traps.
    pub unsafe fn traps_in_thread_three() {
        if arch::thread_idx_x() == 3 {
            arch::trap();
        }
    }
}

#[test]
fn trap_fails_the_launch_naming_the_thread() {
    // SAFETY: no pointers.
    let r = unsafe { emulator::launch(&spec("traps_in_thread_three", 1, 16), traps_in_thread_three.host_entry(), ()) };
    assert!(
        matches!(&r, Err(EmuError::Trapped { kernel: "traps_in_thread_three", thread }) if thread.contains("thread [3, 0, 0]")),
        "{r:?}"
    );
}

kernel! {
    /// Odd threads exit at once; even threads meet at the CTA barrier twice and count.
    pub unsafe fn half_exit_then_barrier(done: *const AtomicU32) {
        if arch::thread_idx_x() % 2 == 1 {
            return;
        }
        arch::sync_threads();
        arch::sync_threads();
        // SAFETY: `done` points to a live counter (test contract).
        unsafe { (*done).fetch_add(1, Ordering::Relaxed) };
    }
}

#[test]
fn exited_threads_count_as_arrived_at_the_cta_barrier() {
    let done = AtomicU32::new(0);
    // SAFETY: `done` outlives the launch.
    unsafe {
        emulator::launch(
            &spec("half_exit_then_barrier", 3, 40),
            half_exit_then_barrier.host_entry(),
            (&raw const done,),
        )
    }
    .unwrap();
    assert_eq!(done.load(Ordering::Relaxed), 3 * 20);
}

kernel! {
    /// Thread 0 never reaches the barrier (it spins on a flag nobody sets); the others wait.
    pub unsafe fn barrier_missing_one_thread(flag: *const AtomicU32) {
        if arch::thread_idx_x() == 0 {
            // SAFETY: `flag` points to a live word (test contract).
            while unsafe { (*flag).load(Ordering::Acquire) } == 0 {
                arch::spin_wait_hint(100);
            }
        }
        arch::sync_threads();
    }
}

#[test]
fn a_barrier_some_thread_never_reaches_times_out() {
    let flag = AtomicU32::new(0);
    let mut s = spec("barrier_missing_one_thread", 1, 64);
    s.timeout = Duration::from_millis(300);
    let start = Instant::now();
    // SAFETY: `flag` outlives the launch.
    let r = unsafe { emulator::launch(&s, barrier_missing_one_thread.host_entry(), (&raw const flag,)) };
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    match r {
        Err(EmuError::Timeout { kernel: "barrier_missing_one_thread", after, .. }) => assert_eq!(after, s.timeout),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

kernel! {
    /// Every thread adds its CTA index + 1 into word 0 of the CTA's shared memory; thread 0
    /// reports the word after a barrier.
    pub unsafe fn shared_memory_is_per_cta(out: *mut u32) {
        let shared = arch::dynamic_shared_mem::<u32>();
        // SAFETY: the launch gives 4 bytes of shared memory, used atomically.
        unsafe { arch::atomic::fetch_add(shared, arch::block_idx_x() as u32 + 1, arch::RmwOrder::Relaxed, arch::Scope::Cta) };
        arch::sync_threads();
        if arch::thread_idx_x() == 0 {
            // SAFETY: `out` holds one word per CTA; shared word 0 is valid.
            unsafe { out.add(arch::block_idx_x()).write(shared.read()) };
        }
    }
}

#[test]
fn each_cta_has_its_own_zeroed_shared_memory() {
    let mut out = [0u32; 4];
    let mut s = spec("shared_memory_is_per_cta", 4, 32);
    s.shared_mem_bytes = 4;
    // SAFETY: `out` holds 4 words and outlives the launch.
    unsafe { emulator::launch(&s, shared_memory_is_per_cta.host_entry(), (out.as_mut_ptr(),)) }.unwrap();
    assert_eq!(out, [32, 64, 96, 128]);
}

#[test]
fn launches_outside_the_limits_are_rejected_before_running() {
    for (grid, block, shared) in
        [(0u32, 32u32, 0usize), (1, 0, 0), (1, 2048, 0), (1, 32, 300 * 1024), (100_000, 1024, 0)]
    {
        let mut s = spec("traps_in_thread_three", grid, block);
        s.shared_mem_bytes = shared;
        // SAFETY: nothing runs: the shape is rejected first (and the kernel takes no pointers).
        let r = unsafe { emulator::launch(&s, traps_in_thread_three.host_entry(), ()) };
        assert!(matches!(r, Err(EmuError::InvalidLaunch { .. })), "{grid}x{block} shared {shared}: {r:?}");
    }
}

#[test]
fn atomics_and_timers_work_outside_a_launch() {
    let mut w = 1u64;
    // SAFETY: `w` is a live, aligned word touched only here.
    unsafe {
        assert_eq!(arch::atomic::fetch_max(&raw mut w, 5, arch::RmwOrder::AcqRel, arch::Scope::Sys), 1);
        assert_eq!(arch::atomic::swap(&raw mut w, 9, arch::RmwOrder::Relaxed, arch::Scope::Gpu), 5);
        assert_eq!(arch::atomic::compare_swap(&raw mut w, 9, 11, arch::RmwOrder::AcqRel, arch::Scope::Cta), 9);
        assert_eq!(arch::atomic::compare_swap(&raw mut w, 9, 13, arch::RmwOrder::AcqRel, arch::Scope::Cta), 11);
    }
    let t0 = arch::global_timer_ns();
    std::thread::sleep(Duration::from_millis(2));
    assert!(arch::global_timer_ns() - t0 >= 2_000_000);
}

kernel! {
    /// Lanes 16..32 of each warp exit; the rest run a full-mask ballot and shuffle, which on the
    /// GPU involve only the lanes that have not exited.
    pub unsafe fn warp_ops_after_some_lanes_exit(out: *mut u32) {
        let lane = arch::lane_id();
        if lane >= 16 {
            return;
        }
        let ballot = arch::ballot_sync(arch::FULL_MASK, lane.is_multiple_of(2));
        let from_lane_3 = arch::shfl_sync(arch::FULL_MASK, lane + 100, 3);
        arch::sync_warp(arch::FULL_MASK);
        // SAFETY: `out` holds two words per thread (test contract).
        unsafe {
            out.add(2 * arch::global_thread_idx_x()).write(ballot);
            out.add(2 * arch::global_thread_idx_x() + 1).write(from_lane_3);
        }
    }
}

#[test]
fn lanes_that_exited_do_not_take_part_in_warp_operations() {
    let mut out = vec![0u32; 2 * 64];
    let mut s = spec("warp_ops_after_some_lanes_exit", 1, 64);
    s.timeout = Duration::from_secs(10);
    // SAFETY: `out` holds two words per thread and outlives the launch.
    unsafe { emulator::launch(&s, warp_ops_after_some_lanes_exit.host_entry(), (out.as_mut_ptr(),)) }.unwrap();
    for t in 0..64 {
        if t % 32 < 16 {
            assert_eq!(out[2 * t], 0x5555, "thread {t} ballot");
            assert_eq!(out[2 * t + 1], 103, "thread {t} shuffle");
        }
    }
}

// ---- a failed launch makes no further effects visible ------------------------------------

/// Stores `1` to a word with `arch::atomic::store` when dropped: a destructor that signals,
/// like `LsaBarrierSession`'s.
struct ArchStoreOnDrop(*mut u32);

impl Drop for ArchStoreOnDrop {
    fn drop(&mut self) {
        // SAFETY: the word is live for the launch (test contract).
        unsafe { arch::atomic::store(self.0, 1, StoreOrder::Release, Scope::Sys) };
    }
}

kernel! {
    /// Thread 0 panics (after `delay_us`, so that the others are usually waiting at the
    /// barrier by then, or at once); the others pass the CTA barrier and raise `*flag`. Thread
    /// 0 also holds a guard that would raise the flag from its destructor while it unwinds.
    pub unsafe fn panics_before_barrier_then_signals(flag: *mut u32, delay_us: u32) {
        if arch::thread_idx_x() == 0 {
            let _guard = ArchStoreOnDrop(flag);
            std::thread::sleep(Duration::from_micros(u64::from(delay_us)));
            panic!("thread 0 fails before the barrier");
        }
        arch::sync_threads();
        // SAFETY: `flag` is a live word (test contract).
        unsafe { arch::atomic::store(flag, 1, StoreOrder::Release, Scope::Sys) };
    }
}

kernel! {
    /// Another rank: polls `*flag` until it is set, until `*stop` is set (the other launch has
    /// finished; then one last look), or for 2 s, and writes to `*saw` whether it saw the flag.
    pub unsafe fn watches_flag(flag: *const u32, stop: *const u32, saw: *mut u32) {
        let deadline = arch::global_timer_ns() + 2_000_000_000;
        // SAFETY: live words (test contract); `flag` and `stop` are only accessed atomically.
        let seen = unsafe {
            loop {
                if arch::atomic::load(flag, LoadOrder::Acquire, Scope::Sys) != 0 {
                    break 1;
                }
                if arch::atomic::load(stop, LoadOrder::Acquire, Scope::Sys) != 0 {
                    break arch::atomic::load(flag, LoadOrder::Acquire, Scope::Sys);
                }
                if arch::global_timer_ns() > deadline {
                    break 0;
                }
                arch::spin_wait_hint(100);
            }
        };
        // SAFETY: as above.
        unsafe { arch::atomic::store(saw, seen, StoreOrder::Release, Scope::Sys) };
    }
}

#[test]
fn threads_released_by_a_panicked_thread_do_not_signal_another_launch() {
    for iteration in 0..20 {
        let (flag, stop, saw) = (AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(u32::MAX));
        let (ra, rb) = std::thread::scope(|s| {
            // Rank A, in its own host thread like a stream's worker.
            let a = s.spawn(|| {
                let args = (flag.as_ptr().cast_const(), stop.as_ptr().cast_const(), saw.as_ptr());
                // SAFETY: the three words outlive the launch.
                unsafe { emulator::launch(&spec("watches_flag", 1, 1), watches_flag.host_entry(), args) }
            });
            // Rank B: a CTA of 4 threads, thread 0 panics.
            let delay_us = if iteration % 2 == 0 { 2000 } else { 0 };
            // SAFETY: `flag` outlives the launch.
            let rb = unsafe {
                emulator::launch(
                    &spec("panics_before_barrier_then_signals", 1, 4),
                    panics_before_barrier_then_signals.host_entry(),
                    (flag.as_ptr(), delay_us),
                )
            };
            stop.store(1, Ordering::Release);
            (a.join().unwrap(), rb)
        });
        assert_eq!(ra, Ok(()), "iteration {iteration}");
        assert_eq!(saw.load(Ordering::Acquire), 0, "iteration {iteration}: the other launch saw the flag");
        assert_eq!(flag.load(Ordering::Acquire), 0, "iteration {iteration}");
        match rb {
            Err(EmuError::Panicked { kernel: "panics_before_barrier_then_signals", thread, message }) => {
                assert!(thread.contains("thread [0, 0, 0]"), "iteration {iteration}: {thread}");
                assert!(message.contains("fails before the barrier"), "iteration {iteration}: {message}");
            }
            other => panic!("iteration {iteration}: expected thread 0's panic, got {other:?}"),
        }
    }
}

/// Sets a host word with a plain std atomic when dropped (not an emulator primitive, so never
/// suppressed): tells the other threads that this thread's failure has been recorded.
struct SignalOnDrop(*const AtomicU32);

impl Drop for SignalOnDrop {
    fn drop(&mut self) {
        // SAFETY: the word is live for the launch (test contract).
        unsafe { (*self.0).store(1, Ordering::Release) };
    }
}

/// Threads of `trap_then_effects`; thread `t` in 1..EFFECT_THREADS tries effect `t`.
const EFFECT_THREADS: u32 = 13;
/// Where in `trap_then_effects`'s `words` the two 16-byte vector targets start (aligned).
const VECTOR_WORDS: usize = 28;

kernel! {
    /// Thread 0 traps. Its unwinding then sets `*recorded` (the trap is recorded before the
    /// thread unwinds). Every other thread waits for that without any emulator checkpoint,
    /// then tries one effect on its own word of `words` (or a barrier / warp operation), and
    /// counts itself in `*passed` (std atomic) if it got past it. Threads also hold guards
    /// that store from their destructors as they unwind.
    pub unsafe fn trap_then_effects(recorded: *const AtomicU32, words: *mut u32, wide: *mut u64, passed: *const AtomicU32) {
        let t = arch::thread_idx_x();
        // SAFETY: `words` holds VECTOR_WORDS + 8 words, 16-byte aligned, `wide` 2 words, `passed` and
        // `recorded` are live counters (test contract); each thread touches its own words.
        unsafe {
            let _store_on_unwind = ArchStoreOnDrop(words.add(EFFECT_THREADS as usize + t));
            if t == 0 {
                let _signal = SignalOnDrop(recorded);
                arch::trap();
            }
            while (*recorded).load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
                std::thread::yield_now();
            }
            let w = words.add(t);
            match t {
                1 => arch::atomic::store(w, 1, StoreOrder::Relaxed, Scope::Cta),
                2 => {
                    let _ = arch::atomic::fetch_add(w, 1, RmwOrder::Relaxed, Scope::Gpu);
                }
                3 => {
                    let _ = arch::atomic::swap(w, 1, RmwOrder::AcqRel, Scope::Gpu);
                }
                4 => {
                    let _ = arch::atomic::compare_swap(w, 0, 1, RmwOrder::AcqRel, Scope::Sys);
                }
                5 => {
                    let _ = arch::atomic::fetch_max(w, 1, RmwOrder::Relaxed, Scope::Gpu);
                }
                6 => arch::atomic::red_add(w, 1, StoreOrder::Release, Scope::Gpu),
                7 => arch::atomic::fence(FenceOrder::SeqCst, Scope::Sys),
                8 => arch::atomic::store(wide, 1u64, StoreOrder::Release, Scope::Sys),
                9 => arch::atomic::red_add(wide, 1u64, StoreOrder::Relaxed, Scope::Gpu),
                10 => arch::sync_threads(),
                11 => arch::sync_warp(1 << t),
                12 => {
                    let _ = arch::atomic::fetch_add(wide, 1, RmwOrder::Relaxed, Scope::Gpu);
                }
                _ => {}
            }
            (*passed).fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[test]
fn a_trap_stops_the_other_threads_effects() {
    for iteration in 0..20 {
        let recorded = AtomicU32::new(0);
        let passed = AtomicU32::new(0);
        // Per-thread words, per-thread unwind words, then 8 words for the vector stores.
        #[repr(C, align(16))]
        struct Words([u32; VECTOR_WORDS + 8]);
        const _: () = assert!(2 * EFFECT_THREADS as usize <= VECTOR_WORDS && VECTOR_WORDS.is_multiple_of(4));
        let mut words = Words([0; VECTOR_WORDS + 8]);
        let mut wide = [0u64; 2];
        // SAFETY: the words outlive the launch and are as the kernel requires.
        let r = unsafe {
            emulator::launch(
                &spec("trap_then_effects", 1, EFFECT_THREADS),
                trap_then_effects.host_entry(),
                (&raw const recorded, words.0.as_mut_ptr(), wide.as_mut_ptr(), &raw const passed),
            )
        };
        assert!(
            matches!(&r, Err(EmuError::Trapped { kernel: "trap_then_effects", thread }) if thread.contains("thread [0, 0, 0]")),
            "iteration {iteration}: {r:?}"
        );
        assert_eq!(passed.load(Ordering::Relaxed), 0, "iteration {iteration}: threads went past their effect");
        assert!(words.0.iter().all(|&w| w == 0), "iteration {iteration}: {:?}", words.0);
        assert_eq!(wide, [0, 0], "iteration {iteration}");
    }
}
