//! Small emulator launches meant for Miri (`scripts/miri.sh`): dynamic shared memory written
//! and read by several threads across a CTA barrier, warp shuffles and ballots, arch atomics
//! on host words passed to the kernel by pointer, and a launch whose failed thread stops the
//! others (unwinding through the emulator). They also run as ordinary tests.
//!
//! The shapes are tiny (a few threads) so that Miri, which interprets every thread, finishes
//! in seconds.

use ferrolink_device::arch::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder, U32x4};
use ferrolink_device::emulator::{self, LaunchSpec};
use ferrolink_device::kernel;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

fn spec(name: &'static str, grid: u32, block: u32, shared_mem_bytes: usize) -> LaunchSpec {
    LaunchSpec { name, grid: [grid, 1, 1], block: [block, 1, 1], shared_mem_bytes, timeout: Duration::from_secs(60) }
}

kernel! {
    /// Each thread writes its slot of the CTA's shared memory with a plain store; after a CTA
    /// barrier it reads its neighbour's slot and word `n` (zeroed, never written), and reports
    /// both to `out` (two words per thread). Then a second round through `sync_threads_or`.
    pub unsafe fn shared_round_trip(out: *mut u32) {
        let t = arch::thread_idx_x();
        let n = arch::block_dim_x();
        let b = arch::block_idx_x();
        let shared = arch::dynamic_shared_mem::<u32>();
        // SAFETY: the launch gives `n + 1` words of shared memory; each thread writes only its
        // own slot before the barrier and only reads after it; `out` holds 3 words per thread.
        unsafe {
            shared.add(t).write((b * 100 + t) as u32);
            arch::sync_threads();
            let neighbour = shared.add((t + 1) % n).read();
            let untouched = shared.add(n).read();
            let g = arch::global_thread_idx_x();
            out.add(3 * g).write(neighbour);
            out.add(3 * g + 1).write(untouched);
            // Second round: everyone has read; thread 0 rewrites slot 0 and raises a predicate.
            let any = arch::sync_threads_or(false);
            if t == 0 {
                shared.write(7);
            }
            let any_after = arch::sync_threads_or(t == 0);
            out.add(3 * g + 2).write(shared.read() + u32::from(any) * 1000 + u32::from(any_after) * 10);
        }
    }
}

#[test]
fn shared_memory_across_a_cta_barrier() {
    let (ctas, threads) = (2u32, 4u32);
    let mut out = vec![0u32; (3 * ctas * threads) as usize];
    let s = spec("shared_round_trip", ctas, threads, 4 * (threads as usize + 1));
    // SAFETY: `out` holds 3 words per thread and outlives the launch.
    unsafe { emulator::launch(&s, shared_round_trip.host_entry(), (out.as_mut_ptr(),)) }.unwrap();
    for b in 0..ctas {
        for t in 0..threads {
            let g = (b * threads + t) as usize;
            assert_eq!(out[3 * g], b * 100 + (t + 1) % threads, "block {b} thread {t}");
            assert_eq!(out[3 * g + 1], 0, "block {b} thread {t}: shared memory starts zeroed");
            assert_eq!(out[3 * g + 2], 17, "block {b} thread {t}");
        }
    }
}

kernel! {
    /// Lanes of a 6-lane (partial) warp exchange values: `shfl_sync` from lane 2, `shfl_xor`
    /// by 1, `shfl_down` by 1, a ballot, and a 64-bit shuffle. Four words per lane in `out`.
    pub unsafe fn warp_round_trip(out: *mut u32) {
        let lane = arch::lane_id();
        let mask = 0b11_1111;
        let from_2 = arch::shfl_sync(mask, lane * 10, 2);
        let xor_1 = arch::shfl_xor_sync(mask, lane * 10, 1);
        let down_1 = arch::shfl_down_sync(mask, lane * 10, 1);
        let ballot = arch::ballot_sync(mask, lane.is_multiple_of(3));
        let wide = arch::shfl_sync_u64(mask, u64::from(lane) << 40, 5);
        arch::sync_warp(mask);
        // SAFETY: `out` holds 5 words per lane (test contract).
        unsafe {
            let o = out.add(5 * lane as usize);
            o.write(from_2);
            o.add(1).write(xor_1);
            o.add(2).write(down_1);
            o.add(3).write(ballot);
            o.add(4).write((wide >> 40) as u32);
        }
    }
}

#[test]
fn warp_shuffles_and_ballots() {
    let mut out = [0u32; 5 * 6];
    // SAFETY: `out` holds 5 words per lane and outlives the launch.
    unsafe { emulator::launch(&spec("warp_round_trip", 1, 6, 0), warp_round_trip.host_entry(), (out.as_mut_ptr(),)) }
        .unwrap();
    for lane in 0..6u32 {
        let o = &out[5 * lane as usize..][..5];
        let down = if lane < 5 { (lane + 1) * 10 } else { lane * 10 };
        assert_eq!(o, [20, (lane ^ 1) * 10, down, 0b00_1001, 5], "lane {lane}");
    }
}

kernel! {
    /// Every thread works on host atomics passed by pointer: adds, a CAS increment loop, a
    /// maximum, a reduction, a swap, a release/acquire hand-over through `flag`, and a vector
    /// store of its own 16 bytes.
    pub unsafe fn atomics_round_trip(words: *mut u32, wide: *mut u64, flag: *mut u32, data: *mut u32, vecs: *mut U32x4) {
        let t = arch::thread_idx_x() as u32;
        // SAFETY: `words` holds 4 words, `wide` 1, `flag` and `data` 1 each, `vecs` one
        // 16-byte slot per thread; all are only accessed atomically here, except `data`
        // (written before the release, read after the acquire) and each thread's own `vecs` slot.
        unsafe {
            arch::atomic::fetch_add(words, 1, RmwOrder::Relaxed, Scope::Gpu);
            let mut seen = arch::atomic::load(words.add(1), LoadOrder::Relaxed, Scope::Gpu);
            loop {
                let old = arch::atomic::compare_swap(words.add(1), seen, seen + 1, RmwOrder::AcqRel, Scope::Gpu);
                if old == seen {
                    break;
                }
                seen = old;
            }
            arch::atomic::fetch_max(words.add(2), t * 3, RmwOrder::Relaxed, Scope::Sys);
            arch::atomic::red_add(wide, u64::from(t) << 33, StoreOrder::Relaxed, Scope::Gpu);
            arch::atomic::swap(words.add(3), 9, RmwOrder::AcqRel, Scope::Cta);
            arch::store_v4(vecs.add(t as usize), U32x4([t, t + 1, t + 2, t + 3]));
            if t == 0 {
                data.write(42);
                arch::atomic::fence(FenceOrder::Release, Scope::Sys);
                arch::atomic::store(flag, 1, StoreOrder::Release, Scope::Sys);
            } else {
                while arch::atomic::load(flag, LoadOrder::Acquire, Scope::Sys) == 0 {
                    arch::spin_wait_hint(10);
                }
                arch::atomic::fence(FenceOrder::Acquire, Scope::Sys);
                assert_eq!(data.read(), 42);
            }
        }
    }
}

#[test]
fn atomics_on_host_words_passed_by_pointer() {
    let threads = 4u32;
    let words = [AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0)];
    let wide = AtomicU64::new(0);
    let flag = AtomicU32::new(0);
    let mut data = 0u32;
    let mut vecs = vec![U32x4::default(); threads as usize];
    // The four counters are one array: a pointer from the whole array reaches all four.
    let args =
        (words.as_ptr().cast::<u32>().cast_mut(), wide.as_ptr(), flag.as_ptr(), &raw mut data, vecs.as_mut_ptr());
    // SAFETY: every pointer is live and as the kernel requires for the whole launch.
    unsafe { emulator::launch(&spec("atomics_round_trip", 1, threads, 0), atomics_round_trip.host_entry(), args) }
        .unwrap();
    let w: Vec<u32> = words.iter().map(|w| w.load(Ordering::Relaxed)).collect();
    assert_eq!(w, [threads, threads, 3 * (threads - 1), 9]);
    assert_eq!(wide.load(Ordering::Relaxed), (0..u64::from(threads)).sum::<u64>() << 33);
    assert_eq!(flag.load(Ordering::Relaxed), 1);
    for t in 0..threads {
        assert_eq!(vecs[t as usize], U32x4([t, t + 1, t + 2, t + 3]));
    }
}

kernel! {
    /// Thread 0 panics before the CTA barrier; the others, released from it because an exited
    /// thread counts as arrived, must unwind there instead of storing to `*flag`.
    pub unsafe fn panic_then_barrier(flag: *mut u32) {
        if arch::thread_idx_x() == 0 {
            panic!("thread 0 fails");
        }
        arch::sync_threads();
        // SAFETY: `flag` is a live word (test contract).
        unsafe { arch::atomic::store(flag, 1, StoreOrder::Release, Scope::Sys) };
    }
}

#[test]
fn a_failed_thread_stops_the_others_at_the_barrier() {
    let flag = AtomicU32::new(0);
    // SAFETY: `flag` outlives the launch.
    let r = unsafe {
        emulator::launch(&spec("panic_then_barrier", 1, 3, 0), panic_then_barrier.host_entry(), (flag.as_ptr(),))
    };
    assert!(
        matches!(&r, Err(emulator::EmuError::Panicked { thread, .. }) if thread.contains("thread [0, 0, 0]")),
        "{r:?}"
    );
    assert_eq!(flag.load(Ordering::Relaxed), 0);
}
