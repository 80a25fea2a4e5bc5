//! The CPU emulator's execution model, tested with host-only kernels launched straight
//! through `emulator::launch` (no PTX involved): failures are reported, not hung or lost.

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
