//! The host core's guarantees, each with the failure that once broke it (issue 9): memory
//! freed under a running kernel, unchecked barrier indices, aborts, diagnosis of hangs,
//! recovery, a failing rank letting others pass a barrier, context hygiene and launch-shape
//! checks. On the emulator and, where present, CUDA.

use ferrolink::testing::for_each_backend;
use ferrolink::{
    Backend, CommConfig, Communicator, DevCommRequirements, Device, Error, LaunchConfig, ResourceRequest, ops, recover,
};
use ferrolink_device::kernels::lsa;
use ferrolink_tests::{check, dev_in_child, run_child};
use std::time::{Duration, Instant};

fn block(dev: &Device) -> u32 {
    if dev.backend() == Backend::Cuda { 256 } else { 32 }
}

/// A watchdog that never fires during a test unless the test asks for it.
fn quiet() -> CommConfig {
    CommConfig { timeout: None, progress_interval: Duration::from_secs(3600), lsa: ferrolink::LsaMode::Node }
}

fn job(
    dev: &Device,
    n: usize,
    reqs: &DevCommRequirements,
    config: CommConfig,
) -> ferrolink::Result<(Vec<Communicator>, Vec<ferrolink::Window>, Vec<ferrolink::DevCommHandle>)> {
    ferrolink::testing::virtual_job_with(dev, n, 4096, reqs, config)
}

/// Dropping a window and a device communicator while a kernel that uses them still runs
/// (here: inside `launch_all`, where waiting would deadlock) neither faults nor waits; the
/// memory is freed once the kernel has finished. Before the rebuild this freed the memory
/// under the kernel (SIGSEGV on the emulator).
#[test]
fn dropping_handles_under_a_running_kernel_frees_after_it() {
    for_each_backend("dropping_handles_under_a_running_kernel_frees_after_it", |dev| {
        let (comms, windows, handles) = job(dev, 2, &DevCommRequirements::default(), quiet())?;
        let mut status = comms.iter().map(|c| c.device().alloc::<u32>(1)).collect::<ferrolink::Result<Vec<_>>>()?;
        let mut handles: Vec<Option<ferrolink::DevCommHandle>> = handles.into_iter().map(Some).collect();
        let mut windows: Vec<Option<ferrolink::Window>> = windows.into_iter().map(Some).collect();
        let launch = |c: &Communicator, h: &ferrolink::DevCommHandle, s: &mut ferrolink::DeviceBuffer<u32>| {
            // SAFETY: one CTA, one barrier; `s` holds one word.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa::lsa_barrier_try_sync,
                    LaunchConfig::linear(1, block(dev)),
                    (h, 30_000_000_000u64, s),
                )
            }
        };
        // Rank 0 waits at the barrier for rank 1, which is not launched yet.
        launch(&comms[0], handles[0].as_ref().expect("present"), &mut status[0])?;
        let retired_before = ferrolink::runtime::retired_total();
        ferrolink::launch_all(&comms, |c| {
            if c.rank() == 0 {
                drop(handles[0].take());
                drop(windows[0].take());
            }
            Ok(())
        })?;
        check(ferrolink::runtime::pending_retirements() >= 1, || "rank 0's memory must wait for its kernel".into())?;
        let (s0, s1) = status.split_at_mut(1);
        launch(&comms[1], handles[1].as_ref().expect("present"), &mut s1[0])?;
        for c in &comms {
            c.synchronize()?;
        }
        check(s0[0].to_vec()?[0] == lsa::TRY_SYNC_OK, || "rank 0 passed the barrier".into())?;
        // The reaper frees within milliseconds once the kernel is done.
        let deadline = Instant::now() + Duration::from_secs(5);
        while ferrolink::runtime::retired_total() == retired_before || ferrolink::runtime::pending_retirements() > 0 {
            check(Instant::now() < deadline, || "the dropped memory was never freed".into())?;
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    });
}

/// A barrier index outside its set is reported with the index and the set's size, and
/// nothing is written past the barrier memory (before: false timeouts at 8 CTAs, heap
/// corruption at 64, SIGSEGV at index 100000). On CUDA the kernel traps, which breaks the
/// device's context, so that case runs in a child process.
#[test]
fn barrier_index_outside_its_set_is_a_reported_error() {
    if dev_in_child("barrier_index_outside_its_set_is_a_reported_error", Backend::Cuda, |dev| {
        let r = barrier_index_case(dev, 64);
        if let Err(e) = &r {
            println!("child saw: {e}");
        }
        check(r.is_err(), || "64 CTAs on 4 barriers must fail".into())
    }) {
        return;
    }
    for_each_backend("barrier_index_outside_its_set_is_a_reported_error", |dev| {
        if dev.backend() == Backend::Cuda {
            let out = run_child("barrier_index_outside_its_set_is_a_reported_error")?;
            check(out.contains("is outside its barrier set of 4 barriers"), || out.clone())?;
            return check(fault_names_its_own_cta(&out), || out);
        }
        for grid in [8u32, 64] {
            let err = barrier_index_case(dev, grid).expect_err("more CTAs than barriers must fail");
            let msg = err.to_string();
            check(matches!(err, Error::DeviceFault { .. }), || format!("{err:?}"))?;
            check(msg.contains("is outside its barrier set of 4") && msg.contains("lsa_barrier_count"), || {
                msg.clone()
            })?;
            check(fault_names_its_own_cta(&msg), || msg)?;
        }
        Ok(())
    });
}

/// Whether a fault report "rank R CTA C thread T: LSA barrier index I ..." names one whole
/// record: `lsa_barrier_try_sync` uses index = CTA, so C == I unless several faulting threads
/// mixed their fields.
fn fault_names_its_own_cta(msg: &str) -> bool {
    let after = |key: &str| -> Option<u64> {
        let rest = &msg[msg.find(key)? + key.len()..];
        rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    matches!((after(" CTA "), after("barrier index ")), (Some(c), Some(i)) if c == i && i >= 4)
}

/// Launches `lsa_barrier_try_sync` (`cfg`'s CTAs, a device timeout of `timeout_ns`) on every
/// rank at once; returns each rank's status words (one per CTA), to read after synchronizing.
fn try_sync_on_every_rank(
    comms: &[Communicator],
    handles: &[ferrolink::DevCommHandle],
    cfg: LaunchConfig,
    timeout_ns: u64,
) -> ferrolink::Result<Vec<ferrolink::DeviceBuffer<u32>>> {
    let ctas = cfg.grid.0 as usize * cfg.grid.1 as usize * cfg.grid.2 as usize;
    let mut status = comms.iter().map(|c| c.device().alloc::<u32>(ctas)).collect::<ferrolink::Result<Vec<_>>>()?;
    let mut ptrs: Vec<_> = status.iter_mut().map(Some).collect();
    ferrolink::launch_all(comms, |c| {
        let s = ptrs[c.rank()].take().expect("once");
        // SAFETY: `s` holds one word per CTA; each CTA uses the barrier of its index, which
        // the device checks against the set.
        unsafe {
            c.stream().launch(
                c.device().builtin_module()?,
                &lsa::lsa_barrier_try_sync,
                cfg,
                (&handles[c.rank()], timeout_ns, s),
            )
        }
    })?;
    Ok(status)
}

/// Launches `lsa_barrier_try_sync` with `grid` CTAs on 2 ranks whose default barrier set has 4
/// barriers; returns the first rank's error. Also checks a library's own set is disjoint.
fn barrier_index_case(dev: &Device, grid: u32) -> ferrolink::Result<()> {
    let mut reqs = DevCommRequirements { lsa_barrier_count: 4, ..Default::default() };
    let lib = reqs.request(ResourceRequest::LsaBarriers { count: 3 });
    let (comms, _w, handles) = job(dev, 2, &reqs, quiet())?;
    let set = handles[0].lsa_barriers(lib)?;
    check(set.first == 4 && set.count == 3, || format!("{set:?}"))?;
    check(handles[0].dev_comm().lsa_barrier_total == 7, || "total barriers".into())?;
    let cfg = LaunchConfig::linear(grid, block(dev)).with_emulator_timeout(Duration::from_secs(20));
    // The barrier index (= CTA) is checked on the device: CTAs past the set fault.
    try_sync_on_every_rank(&comms, &handles, cfg, 1_000_000_000)?;
    let results: Vec<_> = comms.iter().map(|c| c.synchronize()).collect();
    results.into_iter().collect::<ferrolink::Result<Vec<()>>>().map(drop)
}

/// `Communicator::abort` from another thread makes ranks that wait for a missing peer return
/// within a second, with an error saying why.
#[test]
fn abort_unblocks_ranks_waiting_for_a_missing_peer() {
    for_each_backend("abort_unblocks_ranks_waiting_for_a_missing_peer", |dev| {
        let (comms, _w, handles) = job(dev, 3, &DevCommRequirements::default(), quiet())?;
        let mut status = comms.iter().map(|c| c.device().alloc::<u32>(2)).collect::<ferrolink::Result<Vec<_>>>()?;
        // Ranks 0 and 1 wait for rank 2, which never comes; no device or emulator timeout
        // would end it within the test.
        for (c, s) in comms.iter().zip(status.iter_mut()).take(2) {
            // SAFETY: 2 CTAs, 2 barriers; `s` holds 2 words.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa::lsa_barrier_try_sync,
                    LaunchConfig::linear(2, block(dev)).with_emulator_timeout(Duration::from_secs(60)),
                    (&handles[c.rank()], u64::MAX / 2, s),
                )?;
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        let aborter = comms[2].clone();
        let t = std::thread::spawn(move || {
            let at = Instant::now();
            aborter.abort();
            at
        });
        let aborted_at = t.join().expect("the aborting thread");
        for c in &comms[..2] {
            let r = c.synchronize();
            check(matches!(&r, Err(Error::Aborted(m)) if m.contains("abort was called on rank 2")), || {
                format!("{r:?}")
            })?;
        }
        let took = aborted_at.elapsed();
        check(took < Duration::from_secs(1), || format!("the waits returned {took:?} after the abort"))?;
        for s in &status[..2] {
            check(s.to_vec()? == [lsa::TRY_SYNC_ABORTED; 2], || "status".into())?;
        }
        check(comms[1].async_error().is_some(), || "async_error after abort".into())
    });
}

/// The watchdog names who waits on whom, then aborts: "rank 0 CTA 0 waits at LSA barrier 0
/// for epoch 1: ranks 1 and 3 have not arrived". Before, a missing rank cost 120 s of silence
/// on the emulator and a silent hang on the GPU.
#[test]
fn watchdog_report_names_the_missing_ranks() {
    for_each_backend("watchdog_report_names_the_missing_ranks", |dev| {
        let config = CommConfig {
            timeout: Some(Duration::from_secs(1)),
            progress_interval: Duration::from_millis(400),
            lsa: ferrolink::LsaMode::Node,
        };
        let (comms, _w, handles) = job(dev, 4, &DevCommRequirements::default(), config)?;
        let mut status = comms.iter().map(|c| c.device().alloc::<u32>(1)).collect::<ferrolink::Result<Vec<_>>>()?;
        let start = Instant::now();
        for r in [0usize, 2] {
            // SAFETY: one CTA, one barrier; `status[r]` holds one word.
            unsafe {
                comms[r].stream().launch(
                    comms[r].device().builtin_module()?,
                    &lsa::lsa_barrier_try_sync,
                    LaunchConfig::linear(1, block(dev)).with_emulator_timeout(Duration::from_secs(60)),
                    (&handles[r], u64::MAX / 2, &mut status[r]),
                )?;
            }
        }
        let r = comms[0].synchronize();
        let took = start.elapsed();
        let msg = match &r {
            Err(Error::WaitTimeout(m)) => m.clone(),
            other => return check(false, || format!("expected the watchdog's report, got {other:?}")),
        };
        check(msg.contains("waits at LSA barrier 0 for epoch 1: ranks 1 and 3 have not arrived"), || msg.clone())?;
        check(msg.contains("rank 0 CTA 0") || msg.contains("rank 2 CTA 0"), || msg.clone())?;
        check(took < Duration::from_secs(10), || format!("the report took {took:?}"))?;
        check(matches!(comms[2].synchronize(), Err(Error::WaitTimeout(_))), || "rank 2 sees the same error".into())?;
        check(status[0].to_vec()? == [lsa::TRY_SYNC_ABORTED], || "rank 0's wait was aborted".into())
    });
}

/// After a failure (on the emulator a launch timeout, which fails the stream; on CUDA a
/// device-side timeout) `recover` makes the same communicator, windows and device
/// communicators usable again; unrelated buffers work meanwhile. Before, every later call
/// returned the old error until everything was dropped and created again.
#[test]
fn recover_after_a_timeout_makes_the_communicator_usable_again() {
    for_each_backend("recover_after_a_timeout_makes_the_communicator_usable_again", |dev| {
        let (comms, windows, handles) = job(dev, 2, &DevCommRequirements::default(), quiet())?;
        let unrelated = dev.alloc_from(&[1u32, 2, 3])?;
        let mut status = comms[0].device().alloc::<u32>(1)?;
        let (cfg, device_timeout) = match dev.backend() {
            Backend::Cpu => {
                (LaunchConfig::linear(1, 32).with_emulator_timeout(Duration::from_millis(300)), u64::MAX / 2)
            }
            Backend::Cuda => (LaunchConfig::linear(1, 256), 20_000_000u64),
        };
        // Only rank 0 arrives.
        // SAFETY: one CTA, one barrier; `status` holds one word.
        unsafe {
            comms[0].stream().launch(
                comms[0].device().builtin_module()?,
                &lsa::lsa_barrier_try_sync,
                cfg,
                (&handles[0], device_timeout, &mut status),
            )?;
        }
        let first = comms[0].synchronize();
        match dev.backend() {
            Backend::Cpu => check(first.is_err(), || "the emulator's launch timeout fails the stream".into())?,
            Backend::Cuda => {
                first?;
                check(status.to_vec()? == [lsa::TRY_SYNC_TIMED_OUT], || "device timeout".into())?;
            }
        }
        check(unrelated.to_vec()? == [1, 2, 3], || "an unrelated buffer must stay readable".into())?;
        recover(&comms)?;
        check(comms.iter().all(|c| c.async_error().is_none()), || "recover clears the async error".into())?;
        // A full exchange now works on the same objects.
        let words = 64usize;
        for (r, w) in windows.iter().enumerate() {
            w.copy_from_host(0, &vec![r as u32 + 1; words])?;
        }
        let st = try_sync_on_every_rank(&comms, &handles, LaunchConfig::linear(4, block(dev)), 30_000_000_000)?;
        for c in &comms {
            c.synchronize()?;
        }
        for s in &st {
            check(s.to_vec()? == [lsa::TRY_SYNC_OK; 4], || "after recover every rank passes".into())?;
        }
        check(windows[1].read::<u32>(0, words)? == vec![2; words], || "windows keep working".into())
    });
}

/// A rank whose kernel fails before a barrier never lets the others pass it: they end
/// aborted, with an error naming the failed rank (before: 4 ranks, rank 1 panics, rank 0 timed
/// out and ranks 2 and 3 passed). Emulator only: on a GPU the failing kernel's trap breaks the
/// context that every virtual rank shares.
#[test]
fn a_failing_rank_never_lets_the_others_pass_its_barrier() {
    let dev = Device::open_with(Backend::Cpu, 0).expect("the emulator");
    for attempt in 0..3 {
        let (comms, _w, handles) = job(&dev, 4, &DevCommRequirements::default(), quiet()).unwrap();
        let mut status =
            comms.iter().map(|c| c.device().alloc::<u32>(1)).collect::<ferrolink::Result<Vec<_>>>().unwrap();
        let mut ptrs: Vec<_> = status.iter_mut().map(Some).collect();
        ferrolink::launch_all(&comms, |c| {
            let s = ptrs[c.rank()].take().expect("once");
            // SAFETY: one CTA, one barrier; `s` holds one word.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa::lsa_barrier_fail_rank,
                    LaunchConfig::linear(1, 32).with_emulator_timeout(Duration::from_secs(30)),
                    (&handles[c.rank()], 1u32, s),
                )
            }
        })
        .unwrap();
        let results: Vec<_> = comms.iter().map(|c| c.synchronize()).collect();
        assert!(results[1].is_err(), "attempt {attempt}: the failing rank reports its trap");
        for r in [0usize, 2, 3] {
            assert!(
                matches!(&results[r], Err(Error::Aborted(m)) if m.contains("rank 1")),
                "attempt {attempt}: rank {r} must end aborted because of rank 1, got {:?}",
                results[r]
            );
            assert_eq!(status[r].to_vec().unwrap(), [lsa::TRY_SYNC_ABORTED], "attempt {attempt}: rank {r} passed");
        }
    }
}

/// ferrolink leaves the calling thread's current CUDA context as it found it (before, it made
/// its own current and left it so).
#[test]
fn cuda_calls_restore_the_callers_context() {
    for_each_backend("cuda_calls_restore_the_callers_context", |dev| {
        if dev.backend() != Backend::Cuda {
            return Ok(());
        }
        let dev = dev.clone();
        std::thread::spawn(move || -> ferrolink::Result<()> {
            let before = ferrolink::runtime::cuda_current_context()?;
            let stream = dev.create_stream()?;
            let src = dev.alloc_from(&[5u8; 100])?;
            let mut dst = dev.alloc::<u8>(100)?;
            ops::copy(&stream, &mut dst, &src)?;
            check(dst.to_vec()? == [5u8; 100], || "copy".into())?;
            let after = ferrolink::runtime::cuda_current_context()?;
            check(before == after, || format!("current context changed from {before:#x} to {after:#x}"))
        })
        .join()
        .expect("the test thread")
    });
}

/// The safe copies reject 2-D and 3-D launch shapes, whose threads would store the same bytes
/// at once (a data race on the emulator).
#[test]
fn safe_copies_reject_multi_dimensional_launch_shapes() {
    for_each_backend("safe_copies_reject_multi_dimensional_launch_shapes", |dev| {
        let stream = dev.create_stream()?;
        let src = dev.alloc::<u8>(1000)?;
        let mut dst = dev.alloc::<u8>(1000)?;
        for cfg in [
            LaunchConfig { grid: (2, 2, 1), ..LaunchConfig::linear(1, 32) },
            LaunchConfig { block: (32, 2, 1), ..LaunchConfig::linear(1, 32) },
            LaunchConfig { block: (32, 1, 2), ..LaunchConfig::linear(1, 32) },
        ] {
            let r = ops::copy_bytes_with(&stream, &mut dst, 0, &src, 0, 1000, cfg);
            check(matches!(r, Err(Error::InvalidArgument(_))), || format!("{cfg:?} gave {r:?}"))?;
        }
        ops::copy_bytes_with(&stream, &mut dst, 0, &src, 0, 1000, LaunchConfig::linear(2, 64))
    });
}

/// Tracked launches order buffer uses across streams: a kernel writing `b` on stream 2 waits
/// for stream 1's kernel that reads it, and host reads wait for the writer only.
#[test]
fn tracked_buffers_are_ordered_across_streams() {
    for_each_backend("tracked_buffers_are_ordered_across_streams", |dev| {
        let n = 1 << 20;
        let (s1, s2) = (dev.create_stream()?, dev.create_stream()?);
        let a = dev.alloc_from(&vec![1u8; n])?;
        let mut b = dev.alloc::<u8>(n)?;
        let mut c = dev.alloc::<u8>(n)?;
        let d = dev.alloc_from(&vec![9u8; n])?;
        for _ in 0..5 {
            ops::copy(&s1, &mut b, &a)?; // b = 1
            ops::copy(&s2, &mut c, &b)?; // c = b, after s1's write of b
            ops::copy(&s1, &mut b, &d)?; // b = 9, after s2's read of b
        }
        check(c.to_vec()? == vec![1u8; n], || "c must see b's first value".into())?;
        check(b.to_vec()? == vec![9u8; n], || "b's last write".into())
    });
}
