//! Device tests of the foundation and the emulator: copy kernel, atomics litmus tests,
//! warp operations, shared memory, launch validation and hang safety. Each runs on the CPU
//! emulator and, where a GPU is present, on CUDA (see `ferrolink::testing`).

use ferrolink::testing::for_each_backend;
use ferrolink::{Backend, Device, DeviceBuffer, Error, LaunchConfig, ops};
use ferrolink_device::arch::Scope;
use ferrolink_device::emulator::EmuError;
use ferrolink_device::kernels::selftest::{self, WAIT_SEEN, WAIT_TIMED_OUT, WARP_TEST_WORDS};
use ferrolink_tests::{check, first_mismatch, random_bytes};
use std::time::{Duration, Instant};

/// Copies `bytes` bytes between the given offsets and checks the destination, including
/// that nothing outside the copied range was written.
fn check_copy(dev: &Device, bytes: usize, dst_off: usize, src_off: usize, seed: u64) -> ferrolink::Result<()> {
    let stream = dev.create_stream()?;
    let src_host = random_bytes(seed, bytes + src_off + 32);
    let poison = vec![0xA5u8; bytes + dst_off + 32];
    let src = dev.alloc_from(&src_host)?;
    let mut dst = dev.alloc_from(&poison)?;
    ops::copy_bytes(&stream, &mut dst, dst_off, &src, src_off, bytes)?;
    stream.synchronize()?;
    let got = dst.to_vec()?;
    let mut want = poison;
    want[dst_off..dst_off + bytes].copy_from_slice(&src_host[src_off..src_off + bytes]);
    check(got == want, || {
        format!(
            "copy of {bytes} bytes (dst offset {dst_off}, src offset {src_off}): first wrong byte at {:?}",
            first_mismatch(&got, &want)
        )
    })
}

#[test]
fn copy_kernel_copies_every_size_and_alignment() {
    for_each_backend("copy_kernel_copies_every_size_and_alignment", |dev| {
        let sizes = [0usize, 1, 3, 15, 16, 17, 255, 4096, 4097, 65_537, 1_000_003];
        let offsets = [(0usize, 0usize), (1, 1), (3, 7), (16, 5), (8, 8), (4, 12), (9, 1)];
        for (i, &bytes) in sizes.iter().enumerate() {
            for (j, &(d, s)) in offsets.iter().enumerate() {
                check_copy(dev, bytes, d, s, (i * 16 + j) as u64)?;
            }
        }
        Ok(())
    });
}

#[test]
fn copy_kernel_copies_one_gib() {
    for_each_backend("copy_kernel_copies_one_gib", |dev| {
        const N: usize = 1 << 30;
        let words: Vec<u64> = (0..N as u64 / 8).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i >> 7)).collect();
        let src = dev.alloc_from(&words)?;
        let mut dst: DeviceBuffer<u64> = dev.alloc(words.len())?;
        let stream = dev.create_stream()?;
        ops::copy(&stream, &mut dst, &src)?;
        stream.synchronize()?;
        drop(src);
        let got = dst.to_vec()?;
        check(got == words, || format!("1 GiB copy: first wrong word at {:?}", first_mismatch(&got, &words)))
    });
}

#[test]
fn copy_rejects_out_of_bounds_ranges() {
    for_each_backend("copy_rejects_out_of_bounds_ranges", |dev| {
        let stream = dev.create_stream()?;
        let src = dev.alloc::<u8>(100)?;
        let mut dst = dev.alloc::<u8>(100)?;
        for (d, s, n) in [(1usize, 0usize, 100usize), (0, 1, 100), (usize::MAX, 0, 2), (0, 0, 101)] {
            let r = ops::copy_bytes(&stream, &mut dst, d, &src, s, n);
            check(matches!(r, Err(Error::InvalidArgument(_))), || format!("({d},{s},{n}) gave {r:?}"))?;
        }
        Ok(())
    });
}

fn message_passing(dev: &Device, scope: Scope) -> ferrolink::Result<()> {
    // Offsets of device addresses on the host use `wrapping_add`: on CUDA they are not host
    // allocations, so `add`'s in-bounds rule cannot hold.
    let (rounds, words) = match dev.backend() {
        Backend::Cuda => (2000u32, 8192u32),
        Backend::Cpu => (100, 2048),
    };
    let stream = dev.create_stream()?;
    let mut data = dev.alloc::<u32>(words as usize)?;
    let mut flags = dev.alloc::<u32>(3)?; // flag, ack, errors
    let f = flags.as_kernel_mut_ptr();
    let module = dev.builtin_module()?;
    // SAFETY: `data` holds `words` words and `flags` three, zeroed; both outlive the
    // launch (we synchronize before dropping them).
    unsafe {
        stream.launch(
            module,
            &selftest::selftest_message_passing,
            LaunchConfig::linear(2, 256),
            (data.as_kernel_mut_ptr(), f, f.wrapping_add(1), f.wrapping_add(2), rounds, words, scope.code()),
        )?;
    }
    stream.synchronize()?;
    let got = flags.to_vec()?;
    check(got == [rounds, rounds, 0], || {
        format!("{scope:?}: flag, ack, errors = {got:?}, want [{rounds}, {rounds}, 0]")
    })
}

#[test]
fn message_passing_litmus_at_gpu_scope() {
    for_each_backend("message_passing_litmus_at_gpu_scope", |dev| message_passing(dev, Scope::Gpu));
}

#[test]
fn message_passing_litmus_at_sys_scope() {
    for_each_backend("message_passing_litmus_at_sys_scope", |dev| message_passing(dev, Scope::Sys));
}

#[test]
fn contended_counters_reach_exact_totals() {
    for_each_backend("contended_counters_reach_exact_totals", |dev| {
        let (grid, block, iters) = match dev.backend() {
            Backend::Cuda => (64u32, 256u32, 64u32),
            Backend::Cpu => (4, 64, 50),
        };
        let threads = u64::from(grid * block);
        for scope in [Scope::Gpu, Scope::Sys] {
            let stream = dev.create_stream()?;
            let mut cas = dev.alloc::<u64>(1)?;
            let mut words = dev.alloc::<u32>(2)?;
            let w = words.as_kernel_mut_ptr();
            // SAFETY: three valid zeroed words; synchronized before they drop.
            unsafe {
                stream.launch(
                    dev.builtin_module()?,
                    &selftest::selftest_counters,
                    LaunchConfig::linear(grid, block),
                    (cas.as_kernel_mut_ptr(), w, w.wrapping_add(1), iters, scope.code()),
                )?;
            }
            stream.synchronize()?;
            let c = cas.to_vec()?[0];
            let ws = words.to_vec()?;
            let want = threads * u64::from(iters);
            check(c == want && u64::from(ws[0]) == want && u64::from(ws[1]) == threads - 1, || {
                format!("{scope:?}: cas {c}, add {}, max {} (want {want}, {want}, {})", ws[0], ws[1], threads - 1)
            })?;
        }
        Ok(())
    });
}

/// The words `selftest_warp` must write for `thread`; `None` where PTX leaves it unspecified.
fn expected_warp_words(block: usize, thread: usize) -> [Option<u32>; WARP_TEST_WORDS] {
    let warp = thread / 32;
    let lane = (thread % 32) as u32;
    let lanes = (block - warp * 32).min(32) as u32;
    let present = if lanes == 32 { u32::MAX } else { (1u32 << lanes) - 1 };
    let ballot = (0..lanes).filter(|l| l % 3 == 0).fold(0u32, |m, l| m | (1 << l));
    // A source lane past 31 yields the caller's own value; a source lane that does not exist
    // in a partial warp yields an unspecified value (the H200 returned 0): not checked.
    let down = if lane + 1 < lanes {
        Some(lane + 1)
    } else if lane + 1 > 31 {
        Some(lane)
    } else {
        None
    };
    let up = if lane >= 2 { lane - 2 } else { lane };
    let sum = if lanes == 32 { (0..32).sum() } else { u32::MAX };
    let b64 = if lanes > 3 { 5 + 3 * 256 } else { 5 + (lane << 8) };
    [Some(100), Some(ballot), Some(present), down, Some(up), Some(sum), Some(warp as u32), Some(b64)]
}

#[test]
fn warp_operations_in_full_and_partial_warps() {
    for_each_backend("warp_operations_in_full_and_partial_warps", |dev| {
        for block in [64u32, 40, 7] {
            let grid = 2u32;
            let threads = (grid * block) as usize;
            let stream = dev.create_stream()?;
            let mut out = dev.alloc::<u32>(threads * WARP_TEST_WORDS)?;
            // SAFETY: `out` holds WARP_TEST_WORDS words per thread.
            unsafe {
                stream.launch(
                    dev.builtin_module()?,
                    &selftest::selftest_warp,
                    LaunchConfig::linear(grid, block),
                    (out.as_kernel_mut_ptr(),),
                )?;
            }
            let got = out.to_vec()?;
            for t in 0..threads {
                let want = expected_warp_words(block as usize, t % block as usize);
                let have = &got[t * WARP_TEST_WORDS..(t + 1) * WARP_TEST_WORDS];
                let ok = have.iter().zip(&want).all(|(h, w)| w.is_none_or(|w| *h == w));
                check(ok, || format!("block {block}, thread {t}: got {have:?}, want {want:?}"))?;
            }
        }
        Ok(())
    });
}

#[test]
fn dynamic_shared_memory_is_per_cta_and_barrier_ordered() {
    for_each_backend("dynamic_shared_memory_is_per_cta_and_barrier_ordered", |dev| {
        let (grid, block) = (3u32, 96u32);
        let stream = dev.create_stream()?;
        let mut out = dev.alloc::<u32>((grid * block) as usize)?;
        // SAFETY: one word per thread; shared memory sized block * 4 bytes.
        unsafe {
            stream.launch(
                dev.builtin_module()?,
                &selftest::selftest_shared_reverse,
                LaunchConfig::linear(grid, block).with_shared_mem(block * 4),
                (out.as_kernel_mut_ptr(),),
            )?;
        }
        let got = out.to_vec()?;
        for (i, v) in got.iter().enumerate() {
            let (b, t) = (i as u32 / block, i as u32 % block);
            let want = (block - 1 - t) * 7 + b;
            check(*v == want, || format!("block {b} thread {t}: {v}, want {want}"))?;
        }
        Ok(())
    });
}

#[test]
fn launches_with_bad_shapes_are_rejected() {
    for_each_backend("launches_with_bad_shapes_are_rejected", |dev| {
        let stream = dev.create_stream()?;
        let mut out = dev.alloc::<u32>(64)?;
        let bad = [
            LaunchConfig::linear(0, 32),
            LaunchConfig::linear(1, 0),
            LaunchConfig::linear(1, 2048),
            LaunchConfig::linear(1, 32).with_shared_mem(300 * 1024),
        ];
        for cfg in bad {
            // SAFETY: the shape is rejected before anything runs.
            let r = unsafe {
                stream.launch(dev.builtin_module()?, &selftest::selftest_warp, cfg, (out.as_kernel_mut_ptr(),))
            };
            check(matches!(r, Err(Error::InvalidArgument(_))), || format!("{cfg:?} gave {r:?}"))?;
        }
        Ok(())
    });
}

#[test]
fn kernel_missing_from_module_is_a_clear_error() {
    for_each_backend("kernel_missing_from_module_is_a_clear_error", |dev| {
        let ptx = ".version 7.8\n.target sm_90\n.address_size 64\n\n.visible .entry other_kernel()\n{\n\tret;\n}\n";
        let module = dev.load_module(ptx)?;
        check(module.has_kernel("other_kernel"), || "entry not listed".into())?;
        let stream = dev.create_stream()?;
        let mut out = dev.alloc::<u32>(64)?;
        // SAFETY: the kernel is not in the module, so nothing is launched.
        let r = unsafe {
            stream.launch(&module, &selftest::selftest_warp, LaunchConfig::linear(1, 1), (out.as_kernel_mut_ptr(),))
        };
        check(matches!(&r, Err(Error::KernelNotFound(n)) if n == "selftest_warp"), || format!("{r:?}"))
    });
}

/// A signal sent by one stream (rank) is seen by a kernel waiting on another: the two
/// kernels run concurrently on both backends.
#[test]
fn signal_from_another_stream_ends_a_wait() {
    for_each_backend("signal_from_another_stream_ends_a_wait", |dev| {
        let waiter = dev.create_stream()?;
        let signaller = dev.create_stream()?;
        let mut words = dev.alloc::<u32>(2)?; // flag, status
        let w = words.as_kernel_mut_ptr();
        let module = dev.builtin_module()?;
        let timeout_ns = 10_000_000_000u64;
        // SAFETY: two valid words, alive until synchronized below.
        unsafe {
            waiter.launch(
                module,
                &selftest::selftest_wait_flag,
                LaunchConfig::linear(1, 32),
                (w as *const u32, 1, timeout_ns, w.wrapping_add(1)),
            )?;
            signaller.launch(module, &selftest::selftest_signal, LaunchConfig::linear(1, 1), (w, 1))?;
        }
        waiter.synchronize()?;
        signaller.synchronize()?;
        let got = words.to_vec()?;
        check(got == [1, WAIT_SEEN], || format!("flag/status {got:?}"))
    });
}

/// A wait whose signal never comes ends: on the emulator the launch fails with a timeout
/// error naming the kernel, within the configured limit; on the GPU the kernel's own
/// timeout reports it.
#[test]
fn missing_signal_ends_with_a_timeout() {
    for_each_backend("missing_signal_ends_with_a_timeout", |dev| {
        let stream = dev.create_stream()?;
        let mut words = dev.alloc::<u32>(2)?;
        let w = words.as_kernel_mut_ptr();
        let limit = Duration::from_millis(300);
        let device_timeout_ns = match dev.backend() {
            Backend::Cpu => 3_600_000_000_000, // an hour: the emulator's limit must end it
            Backend::Cuda => 20_000_000,
        };
        let start = Instant::now();
        // SAFETY: two valid words, alive until synchronized below.
        unsafe {
            stream.launch(
                dev.builtin_module()?,
                &selftest::selftest_wait_flag,
                LaunchConfig::linear(2, 64).with_emulator_timeout(limit),
                (w as *const u32, 1, device_timeout_ns, w.wrapping_add(1)),
            )?;
        }
        let r = stream.synchronize();
        let took = start.elapsed();
        match dev.backend() {
            Backend::Cpu => {
                check(
                    matches!(&r, Err(Error::Emulator(EmuError::Timeout { kernel: "selftest_wait_flag", .. }))),
                    || format!("got {r:?}"),
                )?;
                // Ended by the emulator's limit, not by the hour-long device timeout: the bound
                // is loose because 128 emulated threads on a loaded machine with two cores
                // took 13 s to stop (a concurrent build).
                check(took < limit + Duration::from_secs(120), || format!("timeout took {took:?}"))?;
                let msg = r.unwrap_err().to_string();
                check(msg.contains("selftest_wait_flag") && msg.contains("did not finish"), || msg.clone())?;
                // The failed stream stays failed; a new stream works.
                let again = stream.synchronize();
                check(again.is_err(), || "a failed stream reported success".into())?;
                Ok(())
            }
            Backend::Cuda => {
                r?;
                let got = words.to_vec()?;
                check(got[1] == WAIT_TIMED_OUT, || format!("status {}", got[1]))
            }
        }
    });
}

#[test]
fn emulator_rejects_launches_beyond_its_thread_limit() {
    let dev = Device::open_with(Backend::Cpu, 0).expect("the CPU backend is always available");
    let stream = dev.create_stream().unwrap();
    let mut out = dev.alloc::<u32>(8).unwrap();
    // SAFETY: the shape is rejected before anything runs.
    let r = unsafe {
        stream.launch(
            dev.builtin_module().unwrap(),
            &selftest::selftest_warp,
            LaunchConfig::linear(1_000, 1024),
            (out.as_kernel_mut_ptr(),),
        )
    };
    match r {
        Err(Error::Emulator(EmuError::InvalidLaunch { reason, .. })) => {
            assert!(reason.contains("FERROLINK_EMU_MAX_THREADS"), "{reason}")
        }
        other => panic!("expected an emulator limit error, got {other:?}"),
    }
}

/// The copy variants the perf tool measures (`ferrolink-perf copy --sweep`) copy correctly.
#[test]
fn copy_variants_copy_every_size() {
    use ferrolink_device::kernels::copy::variants;
    for_each_backend("copy_variants_copy_every_size", |dev| {
        let kernels = [
            &variants::copy_variant_grid_stride4,
            &variants::copy_variant_grid_stride8_streaming,
            &variants::copy_variant_warp_contiguous4,
            &variants::copy_variant_warp_contiguous16,
            &variants::copy_variant_warp_contiguous8_streaming,
        ];
        let stream = dev.create_stream()?;
        for (k, kernel) in kernels.into_iter().enumerate() {
            for (s, bytes) in [1usize, 17, 4096, 100_003, 1 << 20].into_iter().enumerate() {
                let host = random_bytes((k * 10 + s) as u64, bytes);
                let src = dev.alloc_from(&host)?;
                let mut dst = dev.alloc::<u8>(bytes)?;
                let cfg = LaunchConfig::linear(3, 64);
                // SAFETY: both buffers hold `bytes` bytes and live until synchronized below.
                unsafe {
                    stream.launch(
                        dev.builtin_module()?,
                        kernel,
                        cfg,
                        (dst.as_kernel_mut_ptr(), src.as_kernel_ptr(), bytes),
                    )?
                };
                let got = dst.to_vec()?;
                check(got == host, || {
                    format!("{} on {bytes} bytes: first wrong byte {:?}", kernel.name(), first_mismatch(&got, &host))
                })?;
            }
        }
        Ok(())
    });
}

/// The clock probe reports a plausible SM clock on a GPU and nothing on the emulator (whose
/// "cycles" are not a clock).
#[test]
fn sm_clock_probe_reports_a_plausible_clock() {
    for_each_backend("sm_clock_probe_reports_a_plausible_clock", |dev| {
        let mhz = ferrolink_benches::perf::sm_clock_mhz(dev)?;
        match dev.backend() {
            Backend::Cpu => check(mhz.is_none(), || format!("emulator reported a clock: {mhz:?}")),
            Backend::Cuda => {
                check(mhz.is_some_and(|m| (100.0..5000.0).contains(&m)), || format!("implausible SM clock {mhz:?}"))
            }
        }
    });
}

/// The latency probe runs every primitive on both backends and reports a finite figure for each.
#[test]
fn primitive_latency_probe_times_every_primitive() {
    for_each_backend("primitive_latency_probe_times_every_primitive", |dev| {
        let figures = ferrolink_benches::perf::primitive_latencies(dev, 20, 1)?;
        let all = ferrolink_device::kernels::probe::Primitive::ALL;
        check(figures.iter().map(|f| f.0).eq(all), || "one figure per primitive, in order".into())?;
        check(figures.iter().all(|f| f.1.is_finite() && f.1 >= 0.0), || format!("bad figures: {figures:?}"))
    });
}
