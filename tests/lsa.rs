//! Tests of communicators, symmetric windows and the LSA device API, on the CPU emulator
//! and (where present) CUDA, with several virtual ranks per device.

use ferrolink::testing::for_each_backend;
use ferrolink::{
    Backend, Communicator, DevCommRequirements, Device, Error, LaunchConfig, create_dev_comms, register_window,
};
use ferrolink_device::DevWindow;
use ferrolink_device::emulator::EmuError;
use ferrolink_device::kernels::lsa;
use ferrolink_examples::virtual_job as job;
use ferrolink_tests::{check, run_child};
use std::time::Duration;

/// Threads per CTA for LSA kernels: realistic on a GPU, small on the emulator.
fn block(dev: &Device) -> u32 {
    if dev.backend() == Backend::Cuda { 256 } else { 32 }
}

fn sync_all(comms: &[Communicator]) -> ferrolink::Result<()> {
    comms.iter().try_for_each(|c| c.stream().synchronize())
}

#[test]
fn ranks_know_their_teams() {
    for_each_backend("ranks_know_their_teams", |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 4])?;
        for (r, c) in comms.iter().enumerate() {
            check(c.rank() == r && c.nranks() == 4 && c.lsa_size() == 4 && c.lsa_rank() == r, || format!("{c:?}"))?;
            check(c.rail_team().size == 1 && c.world_team().rank == r as u32, || format!("{c:?}"))?;
            check(c.lsa_scope() == ferrolink_device::arch::Scope::Gpu, || "virtual ranks must use .gpu scope".into())?;
        }
        Ok(())
    });
}

/// The examples (examples/lib.rs) check their own results; run them at several rank counts.
#[test]
fn example_ring_pattern_moves_each_buffer_to_the_next_rank() {
    for_each_backend("example_ring_pattern", |dev| {
        for n in [2, 3, 8] {
            ferrolink_examples::ring::run(dev, n, 1_000_003)?;
        }
        Ok(())
    });
}

#[test]
fn example_one_shot_allreduce_matches_the_host_sum_on_every_rank() {
    for_each_backend("example_one_shot_allreduce", |dev| {
        for (n, count) in [(2, 100_003), (4, 4096), (8, 1 << 18)] {
            ferrolink_examples::allreduce::run(dev, n, count)?;
        }
        Ok(())
    });
}

#[test]
fn example_fused_kernel_writes_computed_tiles_into_the_next_rank() {
    for_each_backend("example_fused_kernel", |dev| ferrolink_examples::fused::run(dev, 4, 50_001).map(drop));
}

#[test]
fn example_work_queue_processes_every_item_exactly_once() {
    for_each_backend("example_work_queue", |dev| ferrolink_examples::work_queue::run(dev, 20_000).map(drop));
}

/// Runs `lsa_barrier_stress` on every rank (`ctas` CTAs of `threads` threads, `rounds`
/// rounds, random delays up to `delay` ns, the given coop: 0 CTA, 1 warp, 2 thread) and checks
/// that no rank saw a stale word.
#[allow(clippy::too_many_arguments)]
fn stress(
    comms: &[Communicator],
    windows: &[ferrolink::Window],
    handles: &[ferrolink::DevCommHandle],
    ctas: u32,
    threads: u32,
    rounds: u32,
    delay: u32,
    coop: u32,
) -> ferrolink::Result<()> {
    // Allocate before launching: host-side work between the ranks' launches could wait on a
    // rank that already spins for one not yet launched.
    let mut errors = comms.iter().map(|c| c.device().alloc::<u32>(1)).collect::<ferrolink::Result<Vec<_>>>()?;
    let ptrs: Vec<*mut u32> = errors.iter_mut().map(|e| e.as_kernel_mut_ptr()).collect();
    ferrolink::launch_all(comms, |c| {
        let r = c.rank();
        // SAFETY: the window holds ctas * n words (callers size it); `ctas` <= 32 barriers;
        // buffers outlive the kernels (synchronized below).
        unsafe {
            c.stream().launch(
                c.device().builtin_module()?,
                &lsa::lsa_barrier_stress,
                LaunchConfig::linear(ctas, threads),
                (handles[r].dev_comm(), windows[r].dev_window(), rounds, delay, coop, ptrs[r]),
            )
        }
    })?;
    sync_all(comms)?;
    for (r, e) in errors.iter().enumerate() {
        let bad = e.to_vec()?[0];
        check(bad == 0, || {
            format!("{} ranks, coop {coop}, {threads} threads: rank {r} saw {bad} stale words", comms.len())
        })?;
    }
    Ok(())
}

#[test]
fn barrier_stress_orders_window_writes_across_ranks() {
    for_each_backend("barrier_stress_orders_window_writes_across_ranks", |dev| {
        let (ctas, rounds, delay) = match dev.backend() {
            Backend::Cuda => (32u32, 2000u32, 2000u32),
            Backend::Cpu => (2, 40, 20_000),
        };
        for n in [2usize, 4, 8] {
            let (comms, windows, handles) = job(dev, n, (ctas as usize) * n * 4)?;
            stress(&comms, &windows, &handles, ctas, block(dev), rounds, delay, 0)?;
        }
        Ok(())
    });
}

/// Runs the barrier stress at 2 and 8 ranks, 8 CTAs on a GPU (2 on the emulator), for each
/// `(threads per CTA, coop)` of `shapes`, with random delays.
fn stress_shapes(dev: &Device, shapes: &[(u32, u32)]) -> ferrolink::Result<()> {
    let (ctas, rounds, delay) = match dev.backend() {
        Backend::Cuda => (8u32, 1000u32, 2000u32),
        Backend::Cpu => (2, 20, 20_000),
    };
    for n in [2usize, 8] {
        let (comms, windows, handles) = job(dev, n, (ctas as usize) * n * 4)?;
        for &(threads, coop) in shapes {
            stress(&comms, &windows, &handles, ctas, threads, rounds, delay, coop)?;
        }
    }
    Ok(())
}

/// CTA coops in CTAs of one full warp (the session runs the warp-level code), of a partial
/// second warp (run-time vote masks), and of fewer threads than ranks (threads stride over
/// the peers).
#[test]
fn barrier_stress_with_small_and_partial_ctas() {
    for_each_backend("barrier_stress_with_small_and_partial_ctas", |dev| {
        stress_shapes(dev, &[(32, 0), (48, 0), (4, 0)])
    });
}

/// Warp and single-thread sessions: a thread coop serves every peer itself (the striding
/// path of the barrier), a warp coop one peer per lane.
#[test]
fn barrier_stress_with_warp_and_thread_coops() {
    for_each_backend("barrier_stress_with_warp_and_thread_coops", |dev| {
        stress_shapes(dev, &[(block(dev), 1), (block(dev), 2)])
    });
}

#[test]
fn window_table_in_dev_comm_lists_added_windows() {
    for_each_backend("window_table_in_dev_comm_lists_added_windows", |dev| {
        let (comms, windows, mut handles) = job(dev, 2, 4096)?;
        let more = register_window(&comms, comms.iter().map(|c| c.mem_alloc(100)).collect::<ferrolink::Result<_>>()?)?;
        for r in 0..2 {
            check(handles[r].add_window(&windows[r])? == 0, || "first index".into())?;
            check(handles[r].add_window(&more[r])? == 1, || "second index".into())?;
            let c = &comms[r];
            let mut out = c.device().alloc::<DevWindow>(2)?;
            let mut count = c.device().alloc::<u32>(1)?;
            // SAFETY: `out` holds 2 DevWindows, `count` one word.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa::lsa_window_table_probe,
                    LaunchConfig::linear(1, 32),
                    (handles[r].dev_comm(), out.as_kernel_mut_ptr(), count.as_kernel_mut_ptr()),
                )?;
            }
            let seen = out.to_vec()?;
            check(count.to_vec()?[0] == 2, || "count".into())?;
            check(seen[0] == windows[r].dev_window() && seen[1] == more[r].dev_window(), || format!("{seen:?}"))?;
        }
        // A window of another rank is refused.
        check(matches!(handles[0].add_window(&windows[1]), Err(Error::InvalidArgument(_))), || {
            "foreign window accepted".into()
        })
    });
}

#[test]
fn bad_window_input_gets_clear_errors() {
    for_each_backend("bad_window_input_gets_clear_errors", |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        check(matches!(comms[0].mem_alloc(0), Err(Error::InvalidArgument(m)) if m.contains("size 0")), || {
            "size 0".into()
        })?;
        // Mismatched sizes.
        let r = register_window(&comms, vec![comms[0].mem_alloc(4096)?, comms[1].mem_alloc(8192)?]);
        check(matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("same size")), || format!("{r:?}"))?;
        // One buffer for two ranks.
        let r = register_window(&comms, vec![comms[0].mem_alloc(4096)?]);
        check(matches!(&r, Err(Error::InvalidArgument(_))), || format!("{r:?}"))?;
        // Ranks out of order.
        let swapped = [comms[1].clone(), comms[0].clone()];
        let r = register_window(&swapped, vec![comms[1].mem_alloc(64)?, comms[0].mem_alloc(64)?]);
        check(
            matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("rank order") || m.contains("not rank")),
            || format!("{r:?}"),
        )?;
        // Host access out of bounds or misaligned.
        let w = register_window(&comms, vec![comms[0].mem_alloc(100)?, comms[1].mem_alloc(100)?])?;
        check(matches!(w[0].copy_from_host(96, &[0u32; 2]), Err(Error::InvalidArgument(_))), || "overrun".into())?;
        check(matches!(w[0].copy_from_host(2, &[0u32; 1]), Err(Error::InvalidArgument(_))), || "misaligned".into())?;
        check(matches!(w[0].copy_from_host(usize::MAX, &[0u8; 1]), Err(Error::InvalidArgument(_))), || {
            "overflow".into()
        })?;
        w[0].copy_from_host(96, &[7u32])?;
        check(w[0].read::<u32>(96, 1)? == [7], || "in-bounds write".into())?;
        // A window slot written by rank 0 is seen through rank 1's flat mapping (aliasing).
        check(w[1].dev_window().flat_base == w[0].dev_window().flat_base, || "virtual ranks share one mapping".into())?;
        check(
            matches!(
                create_dev_comms(
                    &comms,
                    &DevCommRequirements { lsa_barrier_count: 0, window_capacity: 1, ..Default::default() }
                ),
                Err(Error::InvalidArgument(_))
            ),
            || "0 barriers".into(),
        )
    });
}

#[test]
fn windows_release_their_memory_when_dropped() {
    const NAME: &str = "windows_release_their_memory_when_dropped";
    // The measure is process-wide (the emulator's mappings in /proc/self/maps, the device's
    // free memory): the other tests of this binary, on other threads, would count in it. So
    // the test runs alone, in a child process of this binary.
    if std::env::var("FERROLINK_CHILD_TEST").as_deref() != Ok(NAME) {
        if let Err(e) = run_child(NAME) {
            panic!("{e}");
        }
        return;
    }
    for_each_backend(NAME, |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 4])?;
        let measure = || -> ferrolink::Result<usize> {
            dev.synchronize()?;
            ferrolink::runtime::pending_retirements();
            Ok(match dev.backend() {
                Backend::Cuda => {
                    let free = dev.mem_info()?.0;
                    usize::MAX - free
                }
                Backend::Cpu => {
                    std::fs::read_to_string("/proc/self/maps").unwrap_or_default().matches("ferrolink-vmm").count()
                }
            })
        };
        let round = || -> ferrolink::Result<()> {
            let bufs = comms.iter().map(|c| c.mem_alloc(16 << 20)).collect::<ferrolink::Result<Vec<_>>>()?;
            let w = register_window(&comms, bufs)?;
            let h = create_dev_comms(&comms, &DevCommRequirements::default())?;
            // Drop order the user picks: the window first, the handles after.
            drop(w);
            drop(h);
            Ok(())
        };
        // The first round leaves mappings that live as long as the communicators (8 on the
        // emulator with 4 ranks: made once, not per window; which ones is still to be
        // named); the ten rounds after it must add nothing.
        round()?;
        let before = measure()?;
        for _ in 0..10 {
            round()?;
        }
        let after = measure()?;
        let slack = if dev.backend() == Backend::Cuda { 64 << 20 } else { 0 };
        check(after <= before + slack, || format!("in use before {before}, after {after}"))
    });
}

/// A rank that never reaches the barrier makes the others fail instead of hanging: on the
/// emulator the launch times out with an error naming the kernel; on the GPU the kernel's
/// own timeout reports it.
#[test]
fn missing_barrier_arrival_ends_with_a_timeout() {
    for_each_backend("missing_barrier_arrival_ends_with_a_timeout", |dev| {
        let (comms, _windows, handles) = job(dev, 2, 4096)?;
        let c = &comms[0];
        let mut status = c.device().alloc::<u32>(1)?;
        let limit = Duration::from_millis(500);
        let device_timeout = if dev.backend() == Backend::Cuda { 50_000_000u64 } else { u64::MAX / 2 };
        // Only rank 0 launches: rank 1's arrival never comes.
        // SAFETY: `status` holds one word; one CTA <= 32 barriers.
        unsafe {
            c.stream().launch(
                c.device().builtin_module()?,
                &lsa::lsa_barrier_try_sync,
                LaunchConfig::linear(1, block(dev)).with_emulator_timeout(limit),
                (handles[0].dev_comm(), device_timeout, status.as_kernel_mut_ptr()),
            )?;
        }
        let r = c.stream().synchronize();
        match dev.backend() {
            Backend::Cpu => check(
                matches!(&r, Err(Error::Emulator(EmuError::Timeout { kernel: "lsa_barrier_try_sync", .. }))),
                || format!("{r:?}"),
            ),
            Backend::Cuda => {
                r?;
                check(status.to_vec()?[0] == lsa::TRY_SYNC_TIMED_OUT, || "status".into())
            }
        }
    });
}

#[test]
fn barrier_with_every_rank_present_does_not_time_out() {
    for_each_backend("barrier_with_every_rank_present_does_not_time_out", |dev| {
        let (comms, _windows, handles) = job(dev, 4, 4096)?;
        let mut statuses: Vec<ferrolink::DeviceBuffer<u32>> =
            comms.iter().map(|c| c.device().alloc::<u32>(4)).collect::<ferrolink::Result<Vec<_>>>()?;
        let ptrs: Vec<*mut u32> = statuses.iter_mut().map(|s| s.as_kernel_mut_ptr()).collect();
        ferrolink::launch_all(&comms, |c| {
            let r = c.rank();
            // SAFETY: `status` holds 4 words; 4 CTAs <= 32 barriers.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa::lsa_barrier_try_sync,
                    LaunchConfig::linear(4, block(dev)),
                    (handles[r].dev_comm(), 10_000_000_000u64, ptrs[r]),
                )
            }
        })?;
        sync_all(&comms)?;
        for s in &statuses {
            let v = s.to_vec()?;
            check(v.iter().all(|&x| x == lsa::TRY_SYNC_OK), || format!("{v:?}"))?;
        }
        Ok(())
    });
}

/// Ranks on two different devices (two emulated devices here: the one-GPU machine cannot
/// show it) get one flat mapping per device, each mapping every peer, and synchronize at
/// `.sys` scope. The ring then moves data across devices. CPU backend only: it exercises the
/// multi-device code paths (per-device mappings, scope choice) that a multi-GPU run uses.
#[test]
fn ranks_on_two_devices_map_every_peer_on_each_device() {
    let d0 = Device::open_with(Backend::Cpu, 0).unwrap();
    let d1 = Device::open_with(Backend::Cpu, 1).unwrap();
    let comms = Communicator::init_all(&[d0.clone(), d0.clone(), d1.clone(), d1.clone()]).unwrap();
    assert!(comms.iter().all(|c| c.lsa_size() == 4 && c.lsa_scope() == ferrolink_device::arch::Scope::Sys));
    let bytes = 100_000;
    let bufs = comms.iter().map(|c| c.mem_alloc(bytes)).collect::<ferrolink::Result<Vec<_>>>().unwrap();
    let windows = register_window(&comms, bufs).unwrap();
    let handles = create_dev_comms(&comms, &DevCommRequirements::default()).unwrap();
    let (w0, w2) = (windows[0].dev_window(), windows[2].dev_window());
    assert_eq!(w0.flat_base, windows[1].dev_window().flat_base, "ranks of one device share its mapping");
    assert_ne!(w0.flat_base, w2.flat_base, "each device has its own mapping");
    assert!(handles.iter().all(|h| h.dev_comm().lsa_scope_code == 2), "peers on other devices need .sys");
    let srcs: Vec<Vec<u8>> = (0..4).map(|r| (0..bytes).map(|i| (i * 7 + r * 31) as u8).collect()).collect();
    let src_bufs =
        comms.iter().zip(&srcs).map(|(c, s)| c.device().alloc_from(s)).collect::<ferrolink::Result<Vec<_>>>().unwrap();
    ferrolink::launch_all(&comms, |c| {
        let r = c.rank();
        // SAFETY: sources and window slots hold `bytes` bytes, alive until synchronized.
        unsafe {
            c.stream().launch(
                c.device().builtin_module()?,
                &lsa::lsa_ring_exchange,
                LaunchConfig::linear(2, 32),
                (handles[r].dev_comm(), windows[r].dev_window(), src_bufs[r].as_kernel_ptr(), bytes),
            )
        }
    })
    .unwrap();
    for r in 0..4 {
        comms[r].stream().synchronize().unwrap();
    }
    for r in 0..4 {
        assert_eq!(windows[r].read::<u8>(0, bytes).unwrap(), srcs[(r + 3) % 4], "rank {r}");
    }
}

/// After a timed-out barrier (one rank never arrived), `reset_barriers` puts every rank back in
/// step: a full barrier stress run afterwards sees no stale data.
#[test]
fn barriers_work_again_after_a_timeout_and_reset() {
    for_each_backend("barriers_work_again_after_a_timeout_and_reset", |dev| {
        let (comms, windows, mut handles) = job(dev, 2, 32 * 2 * 4)?;
        let mut status = comms[0].device().alloc::<u32>(1)?;
        let c = &comms[0];
        // Only rank 0 arrives; its device-side timeout ends the wait.
        // SAFETY: `status` holds one word; one CTA <= 32 barriers.
        unsafe {
            c.stream().launch(
                c.device().builtin_module()?,
                &lsa::lsa_barrier_try_sync,
                LaunchConfig::linear(1, block(dev)),
                (handles[0].dev_comm(), 20_000_000u64, status.as_kernel_mut_ptr()),
            )?;
        }
        check(status.to_vec()?[0] == lsa::TRY_SYNC_TIMED_OUT, || "the lone rank should time out".into())?;
        ferrolink::reset_barriers(&mut handles)?;
        let (ctas, rounds) = if dev.backend() == Backend::Cuda { (32, 500) } else { (2, 20) };
        stress(&comms, &windows, &handles, ctas, block(dev), rounds, 0, 0)?;
        check(matches!(ferrolink::reset_barriers(&mut handles[..1]), Err(Error::InvalidArgument(_))), || {
            "a partial reset must be refused".into()
        })
    });
}
