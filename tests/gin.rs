//! GIN (issue 11): put, put_value, signals, counters, flush, queue wrap-around and
//! back-pressure, several contexts, GIN and hybrid barriers, errors — on every backend and
//! every path: the direct backend (LSA peers), the proxy with the copy engine, the proxy with
//! TCP, and a hybrid job (LSA domains of 2 ranks: direct inside, TCP across). Ranks of one
//! process (threads) and one process per rank (children of this binary).

use ferrolink::{
    Backend, CommConfig, Communicator, DevCommRequirements, Device, GinMode, LaunchConfig, LsaMode, TransportKind,
    Window,
};
use ferrolink_device::kernels::gin as k;
use ferrolink_tests::jobs::{child, fits, job_passes, job_passes_with, scenario, spawn_job, text};
use ferrolink_tests::{check, dev_in_child, run_child};
use std::time::{Duration, Instant};

/// A GIN path to test.
#[derive(Clone, Copy, Debug)]
struct Path {
    mode: GinMode,
    transport: Option<TransportKind>,
    /// Ranks per LSA domain (`None`: the natural domains).
    lsa: Option<usize>,
    /// Descriptors per proxy queue.
    depth: u32,
}

const DIRECT: Path = Path { mode: GinMode::Auto, transport: None, lsa: None, depth: 64 };
const PROXY_CE: Path = Path { mode: GinMode::Proxy, transport: Some(TransportKind::CopyEngine), lsa: None, depth: 4 };
const PROXY_TCP: Path = Path { mode: GinMode::Proxy, transport: Some(TransportKind::Tcp), lsa: None, depth: 4 };
const HYBRID: Path = Path { mode: GinMode::Auto, transport: None, lsa: Some(2), depth: 4 };

/// Contexts (and CTAs of the exchange): each CTA uses its own context, signal and counter.
const CONTEXTS: u32 = 3;

fn reqs(path: Path) -> DevCommRequirements {
    DevCommRequirements {
        gin_context_count: CONTEXTS,
        gin_signal_count: 8,
        gin_counter_count: 4,
        gin_barrier_count: CONTEXTS,
        gin_queue_depth: path.depth,
        gin_mode: Some(path.mode),
        gin_transport: path.transport,
        ..DevCommRequirements::default()
    }
}

fn threads(dev: &Device) -> u32 {
    if dev.backend() == Backend::Cuda { 256 } else { 8 }
}

/// Launches a kernel on this rank's stream with `errors` (one word, passed tracked), waits,
/// and checks the word. (Error words are allocated up front: an allocation may wait for the
/// device, whose kernels may wait for a peer that waits for this rank; and a raw pointer
/// would make the launch untracked, so that reading the word waited for every rank's.)
fn run_checked(
    comm: &Communicator,
    errors: &mut ferrolink::DeviceBuffer<u32>,
    what: &str,
    launch: impl FnOnce(&mut ferrolink::DeviceBuffer<u32>) -> ferrolink::Result<()>,
) -> ferrolink::Result<()> {
    launch(errors)?;
    comm.stream().synchronize()?;
    let bad = errors.to_vec()?[0];
    check(bad == 0, || format!("{what}: rank {} of {} counted {bad} errors", comm.rank(), comm.nranks()))
}

/// One rank's GIN checks (collective: every rank runs it with the same `path`).
fn gin_suite(comm: &Communicator, path: Path) -> ferrolink::Result<()> {
    let dev = comm.device();
    let n = comm.nranks();
    let gpu = dev.backend() == Backend::Cuda;
    let (bytes, rounds, ops) = if gpu { (64 << 10, 50u32, 10_000u32) } else { (4100, 4, 10_000) };
    let bytes = bytes & !3usize;
    let module = dev.builtin_module()?;
    // Windows first (collective registrations), then the device communicator.
    let win = |b: usize| -> ferrolink::Result<Window> { comm.register_window(comm.mem_alloc(b)?) };
    let dst = win(CONTEXTS as usize * n * bytes)?;
    let src = win(CONTEXTS as usize * bytes)?;
    let values = win(n * 24 + 16)?;
    let stream = win(512)?;
    let marks = win(n * 4)?;
    let mut errors = (0..5).map(|_| dev.alloc::<u32>(1)).collect::<ferrolink::Result<Vec<_>>>()?;
    let handle = comm.create_dev_comm(&reqs(path))?;
    let s = comm.stream();
    let t = threads(dev);
    // Every launch below: the windows are sized as each kernel's contract asks; signals
    // 1..=3 (exchange), 0 (stream) and 6 (values) and the barriers are used by one kernel at a
    // time; the tracked handles keep everything alive until the kernels end.
    run_checked(comm, &mut errors[0], "exchange (put + SignalInc + CounterInc, flush, reset)", |e| {
        // SAFETY: see above (the kernels' contracts).
        unsafe {
            s.launch(
                module,
                &k::gin_exchange,
                LaunchConfig::linear(CONTEXTS, t),
                (&handle, &dst, &src, bytes as u32, rounds, 1u32, 0u32, e),
            )
        }
    })?;
    run_checked(comm, &mut errors[1], "put_value + SignalAdd", |e| {
        // SAFETY: see above (the kernels' contracts).
        unsafe { s.launch(module, &k::gin_put_values, LaunchConfig::linear(1, t), (&handle, &values, rounds, 6u32, e)) }
    })?;
    // One thread on the emulator: 10 000 coop-wide calls of 8 OS threads would be slow.
    let stream_threads = if gpu { 32 } else { 1 };
    run_checked(comm, &mut errors[2], "queue wrap-around (10 000 values, one context)", |e| {
        // SAFETY: see above (the kernels' contracts).
        unsafe { s.launch(module, &k::gin_stream, LaunchConfig::linear(1, stream_threads), (&handle, &stream, ops, e)) }
    })?;
    let seen = handle.gin_signal(0)?;
    check(seen == u64::from(ops), || format!("rank {}: the host reads signal 0 as {seen}, not {ops}", comm.rank()))?;
    let barrier_rounds = if gpu { 500 } else { 20 };
    for hybrid in [0u32, 1] {
        run_checked(
            comm,
            &mut errors[3 + hybrid as usize],
            if hybrid == 0 { "GIN barrier" } else { "hybrid barrier" },
            |e| {
                // SAFETY: see above (the kernels' contracts).
                unsafe {
                    s.launch(
                        module,
                        &k::gin_barrier_rounds,
                        LaunchConfig::linear(1, t),
                        (&handle, &marks, barrier_rounds, hybrid, e),
                    )
                }
            },
        )?;
    }
    let bad = handle.gin_signal(8).expect_err("signal 8 of 8 is out of range").to_string();
    check(bad.contains("signal 8") && bad.contains("has 8 signals"), || format!("host read of signal 8: {bad}"))?;
    comm.barrier()
}

/// Every rank of an `n`-rank job on virtual ranks of `dev`, with `path`'s LSA domains.
fn in_process(dev: &Device, n: usize, path: Path) -> ferrolink::Result<()> {
    let mut config = CommConfig::from_env(dev.backend()).unwrap();
    if let Some(k) = path.lsa {
        config.lsa = LsaMode::Size(k);
    }
    let comms = Communicator::init_all_with(&vec![dev.clone(); n], config)?;
    if let Some(k) = path.lsa {
        check(comms[0].lsa_size() == k, || format!("LSA domains of {k} asked, {} made", comms[0].lsa_size()))?;
    }
    ferrolink::run_ranks(&comms, |c| {
        gin_suite(c, path).inspect_err(|e| eprintln!("rank {} of {n} ({path:?}): {e}", c.rank()))
    })
    .map(drop)
}

#[test]
fn gin_direct_backend_between_lsa_peers() {
    ferrolink::testing::for_each_backend("gin_direct_backend_between_lsa_peers", |dev| {
        for n in [2, 4] {
            in_process(dev, n, DIRECT)?;
        }
        Ok(())
    });
}

#[test]
fn gin_proxy_with_the_copy_engine() {
    ferrolink::testing::for_each_backend("gin_proxy_with_the_copy_engine", |dev| {
        for n in [2, 3] {
            in_process(dev, n, PROXY_CE)?;
        }
        Ok(())
    });
}

#[test]
fn gin_proxy_with_tcp() {
    ferrolink::testing::for_each_backend("gin_proxy_with_tcp", |dev| {
        for n in [2, 3] {
            in_process(dev, n, PROXY_TCP)?;
        }
        Ok(())
    });
}

#[test]
fn gin_hybrid_job_direct_inside_domains_tcp_across() {
    ferrolink::testing::for_each_backend("gin_hybrid_job", |dev| in_process(dev, 4, HYBRID));
}

/// Launches `gin_put_values` with signal 99 (of 8) on 2 ranks; returns every rank's result.
fn signal_out_of_range(dev: &Device) -> ferrolink::Result<Vec<ferrolink::Result<()>>> {
    let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
    ferrolink::run_ranks(&comms, |c| {
        let values = c.register_window(c.mem_alloc(64)?)?;
        let mut errors = c.device().alloc::<u32>(1)?;
        let handle = c.create_dev_comm(&reqs(DIRECT))?;
        // SAFETY: the window holds 2 * 24 + 16 bytes; the kernel faults at its first signal.
        unsafe {
            c.stream().launch(
                c.device().builtin_module()?,
                &k::gin_put_values,
                LaunchConfig::linear(1, 1),
                (&handle, &values, 1u32, 99u32, &mut errors),
            )?
        };
        Ok(c.stream().synchronize())
    })
}

/// A signal id out of range in a kernel is a fault whose report names the id and the limit.
/// On CUDA the kernel traps, which breaks the context: that case runs in a child process.
#[test]
fn a_signal_id_out_of_range_is_an_error_naming_it() {
    const NAME: &str = "a_signal_id_out_of_range_is_an_error_naming_it";
    if dev_in_child(NAME, Backend::Cuda, |dev| {
        for (r, res) in signal_out_of_range(dev)?.into_iter().enumerate() {
            println!("child rank {r} saw: {}", res.expect_err("the kernel must fail"));
        }
        Ok(())
    }) {
        return;
    }
    ferrolink::testing::for_each_backend(NAME, |dev| {
        let errors: Vec<String> = if dev.backend() == Backend::Cuda {
            vec![run_child(NAME)?]
        } else {
            signal_out_of_range(dev)?
                .into_iter()
                .map(|res| res.expect_err("the kernel must fail").to_string())
                .collect()
        };
        for err in errors {
            check(err.contains("signal id 99") && err.contains("has 8 signals"), || err.clone())?;
        }
        Ok(())
    });
}

/// One process per rank: the whole suite through the proxy over TCP and the copy engine
/// (memory of other processes mapped through file descriptors), and with every process its
/// own LSA domain (`FERROLINK_LSA=process`: TCP between them, the hybrid barrier's GIN part).
#[test]
fn gin_jobs_of_one_process_per_rank() {
    if child(|c| {
        let path = match scenario().as_str() {
            "tcp" => PROXY_TCP,
            "ce" => PROXY_CE,
            "domains" => Path { lsa: None, ..HYBRID },
            other => panic!("unknown scenario {other}"),
        };
        gin_suite(c, path)
    }) {
        return;
    }
    for n in [2, 3] {
        if !fits(n) {
            continue;
        }
        for s in ["tcp", "ce"] {
            job_passes("gin_jobs_of_one_process_per_rank", s, n);
        }
        job_passes_with("gin_jobs_of_one_process_per_rank", "domains", n, &[("FERROLINK_LSA", "process")]);
    }
}

/// A rank whose process dies while peers send to it over TCP: the others' kernels end and
/// their streams report an error naming the failure, in bounded time.
#[test]
fn a_tcp_peer_dying_mid_transfer_is_an_error_in_bounded_time() {
    if child(|c| {
        let path = PROXY_TCP;
        let dev = c.device();
        let n = c.nranks();
        let bytes = 1 << 20;
        let dst = c.register_window(c.mem_alloc(CONTEXTS as usize * n * bytes)?)?;
        let src = c.register_window(c.mem_alloc(CONTEXTS as usize * bytes)?)?;
        let handle = c.create_dev_comm(&reqs(path))?;
        let mut errors = dev.alloc::<u32>(1)?;
        let e = errors.as_kernel_mut_ptr();
        // SAFETY: windows sized for the exchange's contract; tracked handles.
        unsafe {
            c.stream().launch(
                dev.builtin_module()?,
                &k::gin_exchange,
                LaunchConfig::linear(CONTEXTS, threads(dev)),
                (&handle, &dst, &src, bytes as u32, 1_000_000u32, 1u32, 0u32, e),
            )?
        };
        if c.rank() == n - 1 {
            // Die in the middle of the exchange, without any goodbye.
            std::thread::sleep(Duration::from_millis(500));
            std::process::exit(0);
        }
        let err = c.stream().synchronize().expect_err("the exchange cannot finish without the dead rank");
        println!("survivor's error: {err}");
        Ok(())
    }) {
        return;
    }
    if !fits(2) {
        return;
    }
    let start = Instant::now();
    let outs = spawn_job(
        "a_tcp_peer_dying_mid_transfer_is_an_error_in_bounded_time",
        "die",
        2,
        &[0, 1],
        &[("FERROLINK_TIMEOUT", "60")],
    );
    let took = start.elapsed();
    let t = text(&outs[0].1);
    assert!(outs[0].1.status.success() && t.contains("survivor's error"), "rank 0:\n{t}");
    assert!(t.contains("rank 1"), "the survivor's error must name rank 1:\n{t}");
    assert!(took < Duration::from_secs(45), "the survivor took {took:?}");
}

/// `ferrolink-perf gin`'s measurement (ping-pong and put bandwidth on every path, with its
/// baselines) runs to the end between two ranks and gives finite, positive figures.
#[test]
fn the_gin_figures_are_measured_on_every_path() {
    ferrolink::testing::for_each_backend("the_gin_figures_are_measured_on_every_path", |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        let paths = ferrolink_benches::perf::GinPath::ALL;
        let figures =
            ferrolink::run_ranks(&comms, |c| ferrolink_benches::perf::gin_rank(c, &paths, &[4096, 65536], 1, 256))?;
        let f = figures[0].clone().expect("rank 0 reports");
        check(figures[1].is_none(), || "only rank 0 reports".into())?;
        for (p, us) in &f.latency_us {
            check(us.is_finite() && *us > 0.0, || format!("{p:?} latency {us}"))?;
        }
        for b in &f.bandwidth {
            check(b.by_path.len() == 3 && b.copy_gbps > 0.0 && b.tcp_gbps > 0.0, || format!("{b:?}"))?;
            for (p, g) in &b.by_path {
                check(g.is_finite() && *g > 0.0, || format!("{p:?} at {} B: {g} GB/s", b.bytes))?;
            }
        }
        Ok(())
    });
}
