//! Measurements behind the `ferrolink-perf` tool and the benches. Every figure is taken
//! side by side with its baseline in the same run and reported as a ratio.

use ferrolink::{Backend, Device, DeviceBuffer, LaunchConfig, Result, ops};

/// The name of the driver's device-to-device copy on `dev`'s backend (the baseline of the
/// copy, put and ring figures): `cuMemcpyDtoD` on CUDA, a host `memcpy` on the emulator.
pub fn driver_copy_name(dev: &Device) -> &'static str {
    match dev.backend() {
        Backend::Cuda => "cuMemcpyDtoD",
        Backend::Cpu => "host memcpy (emulator)",
    }
}

/// Median of a non-empty list of samples.
pub fn median(samples: &mut [f64]) -> f64 {
    assert!(!samples.is_empty(), "median of no samples");
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 { samples[n / 2] } else { (samples[n / 2 - 1] + samples[n / 2]) / 2.0 }
}

/// One copy method's result.
#[derive(Clone, Debug)]
pub struct CopyFigure {
    /// What was measured (`cuMemcpyDtoD`, `copy kernel 528x512`, …).
    pub method: String,
    /// Median bandwidth in GB/s (10^9 bytes copied per second, one direction).
    pub gbps: f64,
}

/// The copy benchmark's result for one size.
#[derive(Clone, Debug)]
pub struct CopyReport {
    /// Bytes per copy.
    pub bytes: usize,
    /// The driver's device-to-device copy (baseline).
    pub baseline: CopyFigure,
    /// The copy kernel with the default launch shape.
    pub kernel: CopyFigure,
    /// Other launch shapes tried (with `sweep`).
    pub sweep: Vec<CopyFigure>,
}

impl CopyReport {
    /// Kernel bandwidth over the baseline's.
    pub fn ratio(&self) -> f64 {
        self.kernel.gbps / self.baseline.gbps
    }
}

/// Times `op` `iters` times back to back between two events; returns GB/s.
fn time_gbps(
    dev: &Device,
    bytes: usize,
    iters: usize,
    mut op: impl FnMut(&ferrolink::Stream) -> Result<()>,
) -> Result<f64> {
    let stream = dev.create_stream()?;
    op(&stream)?; // warm-up (module load, first-touch)
    stream.synchronize()?;
    let start = stream.record_event()?;
    for _ in 0..iters {
        op(&stream)?;
    }
    let end = stream.record_event()?;
    let ms = f64::from(end.elapsed_ms_since(&start)?);
    Ok((bytes * iters) as f64 / (ms * 1e-3) / 1e9)
}

/// Copy kernel vs `cuMemcpyDtoD` on `bytes` bytes: `trials` alternating trials of `iters`
/// copies each, medians reported. With `sweep`, also the copy kernel's variants
/// ([`ferrolink_device::kernels::copy::variants`]) across launch shapes.
pub fn copy_bench(dev: &Device, bytes: usize, iters: usize, trials: usize, sweep: bool) -> Result<CopyReport> {
    use ferrolink_device::kernels::copy::ferrolink_copy;
    let src: DeviceBuffer<u8> = dev.alloc_from(&(0..bytes).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>())?;
    let mut dst: DeviceBuffer<u8> = dev.alloc(bytes)?;
    let (dst_addr, src_addr) = (dst.addr(), src.addr());
    let default_cfg = ops::copy_launch_config(dev, bytes);
    let (mut base, mut kern) = (Vec::new(), Vec::new());
    for _ in 0..trials.max(1) {
        // SAFETY: both buffers hold `bytes` bytes, live until the end of this function, after
        // `time_gbps` has waited for its copies; only these copies touch them.
        base.push(time_gbps(dev, bytes, iters, |s| unsafe { s.copy_raw(dst_addr, src_addr, bytes) })?);
        kern.push(time_gbps(dev, bytes, iters, |s| {
            ops::copy_with_kernel(s, &ferrolink_copy, &mut dst, &src, default_cfg)
        })?);
    }
    let mut figures = Vec::new();
    if sweep {
        let sms = dev.sm_count();
        for (name, kernel) in ops::builtin_copy_kernels() {
            for (per_sm, threads) in [(2u32, 512u32), (8, 256), (32, 256), (64, 256)] {
                let cfg = LaunchConfig::linear(sms * per_sm, threads);
                let mut v = Vec::new();
                for _ in 0..trials.max(1) {
                    match time_gbps(dev, bytes, iters, |s| ops::copy_with_kernel(s, kernel, &mut dst, &src, cfg)) {
                        Ok(g) => v.push(g),
                        // A shape this variant cannot run (too many registers for the block).
                        Err(ferrolink::Error::InvalidArgument(_)) => break,
                        Err(e) => return Err(e),
                    }
                }
                if v.is_empty() {
                    continue;
                }
                figures.push(CopyFigure {
                    method: format!("{name} {}x{}", cfg.grid.0, cfg.block.0),
                    gbps: median(&mut v),
                });
            }
        }
    }
    Ok(CopyReport {
        bytes,
        baseline: CopyFigure { method: driver_copy_name(dev).into(), gbps: median(&mut base) },
        kernel: CopyFigure {
            method: format!("ferrolink_copy {}x{}", default_cfg.grid.0, default_cfg.block.0),
            gbps: median(&mut kern),
        },
        sweep: figures,
    })
}

/// Parses sizes like `256M`, `1G`, `4096`, `64K` (binary units).
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("`{s}` is not a size (examples: 4096, 64K, 256M, 1G)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("17"), Ok(17));
        assert!(parse_size("abc").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    /// The routing as `benches/torch/moe_all_to_all.py` computes it (its `moe_routing`, run
    /// with Python 3): the two must move the same bytes.
    #[test]
    fn moe_routing_matches_the_torch_script() {
        let (idx, w) = moe_routing(0, 2, 64, 8);
        assert_eq!(idx, [54, 33, 20, 49, 61, 2, 56, 28, 24, 26, 36, 35, 27, 14, 18, 7]);
        assert_eq!(w[..4], [0.71875, 0.578125, 1.0, 0.90625]);
        let (idx, w) = moe_routing(1, 2, 64, 8);
        assert_eq!(idx, [10, 34, 22, 52, 35, 57, 55, 58, 2, 24, 59, 54, 13, 17, 35, 28]);
        assert_eq!(w[..4], [0.75, 0.140625, 0.078125, 0.78125]);
        let (idx, _) = moe_routing(1, 4096, 64, 8);
        assert_eq!(idx.len(), 32768);
        assert_eq!(idx.iter().filter(|&&e| e / 32 != 1).count(), 16381);
        assert_eq!(idx.iter().map(|&e| i64::from(e)).sum::<i64>(), 1_033_240);
        for t in idx.chunks(8) {
            assert!((1..8).all(|i| !t[..i].contains(&t[i])), "distinct experts per token: {t:?}");
        }
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}

/// Virtual ranks on one device with `barriers` LSA barriers (see [`ferrolink::testing::virtual_job`]).
fn virtual_job(
    dev: &Device,
    nranks: usize,
    window_bytes: usize,
    barriers: u32,
) -> Result<(Vec<ferrolink::Communicator>, Vec<ferrolink::Window>, Vec<ferrolink::DevCommHandle>)> {
    let reqs = ferrolink::DevCommRequirements { lsa_barrier_count: barriers, window_capacity: 1, ..Default::default() };
    ferrolink::testing::virtual_job(dev, nranks, window_bytes, &reqs)
}

/// LSA barrier latency for one shape: medians over trials of the slowest CTA's average round.
#[derive(Clone, Debug)]
pub struct BarrierFigure {
    /// Ranks (virtual, on one device).
    pub nranks: usize,
    /// CTAs per rank, each on its own barrier.
    pub ctas: u32,
    /// Microseconds per round at the scope the communicator chose (`.gpu` for virtual ranks),
    /// acquire-release sessions of a CTA coop, CTAs of 32 threads.
    pub us_per_round: f64,
    /// Microseconds per round with the same kernel forced to `.sys` scope (the baseline:
    /// what peers on other GPUs need).
    pub us_per_round_sys: f64,
    /// As `us_per_round` with CTAs of 256 threads (8 warps meet at the CTA barrier).
    pub us_per_round_256: f64,
    /// Microseconds per round at the chosen scope with a warp as the coop (`CoopWarp`).
    pub us_per_round_warp: f64,
    /// Microseconds per round at the chosen scope with [`BarrierOrder::Relaxed`] sessions
    /// (control only, no fences): the cost of the acquire-release ordering is the difference.
    ///
    /// [`BarrierOrder::Relaxed`]: ferrolink_device::BarrierOrder::Relaxed
    pub us_per_round_relaxed: f64,
}

/// Times `rounds` LSA barrier rounds (after `rounds / 10` warm-up rounds) on `nranks` virtual
/// ranks with `ctas` CTAs each: acquire-release sessions of a CTA coop at the chosen scope
/// and at `.sys` (32-thread CTAs), the same with 256-thread CTAs, a warp coop, and relaxed
/// sessions. Each figure is the median over `trials` (the variants take turns within a
/// trial) of the slowest CTA's average round.
pub fn barrier_bench(dev: &Device, nranks: usize, ctas: u32, rounds: u32, trials: usize) -> Result<BarrierFigure> {
    use ferrolink_device::BarrierOrder;
    use ferrolink_device::arch::Scope;
    use ferrolink_device::kernels::lsa::lsa_barrier_bench;
    let (comms, _windows, handles) = virtual_job(dev, nranks, 4096, ctas)?;
    let run = |scope: Option<Scope>, threads: u32, warp_coop: u32, order: BarrierOrder| -> Result<f64> {
        // Allocate first: host work between the ranks' launches could wait on spinning ranks.
        let mut outs = comms.iter().map(|c| c.device().alloc::<u64>(ctas as usize)).collect::<Result<Vec<_>>>()?;
        let ptrs: Vec<*mut u64> = outs.iter_mut().map(|o| o.as_kernel_mut_ptr()).collect();
        ferrolink::launch_all(&comms, |c| {
            let mut dc = handles[c.rank()].dev_comm();
            if let Some(s) = scope {
                dc.lsa_scope_code = s.code();
            }
            // SAFETY: `out` holds one word per CTA; `ctas` barriers exist; all ranks launch
            // the same grid; synchronized below before `out` is read or dropped.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa_barrier_bench,
                    LaunchConfig::linear(ctas, threads),
                    (dc, rounds / 10, rounds, warp_coop, order.code(), ptrs[c.rank()]),
                )
            }
        })?;
        let mut worst = 0u64;
        for out in &outs {
            worst = worst.max(out.to_vec()?.into_iter().max().unwrap_or(0));
        }
        Ok(worst as f64 / f64::from(rounds) / 1e3)
    };
    let wide = if dev.backend() == Backend::Cuda { 256 } else { 64 };
    let mut samples: [Vec<f64>; 5] = Default::default();
    for _ in 0..trials.max(1) {
        samples[0].push(run(None, 32, 0, BarrierOrder::AcqRel)?);
        samples[1].push(run(Some(Scope::Sys), 32, 0, BarrierOrder::AcqRel)?);
        samples[2].push(run(None, wide, 0, BarrierOrder::AcqRel)?);
        samples[3].push(run(None, 32, 1, BarrierOrder::AcqRel)?);
        samples[4].push(run(None, 32, 0, BarrierOrder::Relaxed)?);
    }
    let [a, b, c, d, e] = &mut samples;
    Ok(BarrierFigure {
        nranks,
        ctas,
        us_per_round: median(a),
        us_per_round_sys: median(b),
        us_per_round_256: median(c),
        us_per_round_warp: median(d),
        us_per_round_relaxed: median(e),
    })
}

/// The SM clock in MHz while a probe kernel spins for about a millisecond (`%clock64`
/// cycles over `%globaltimer` nanoseconds), or `None` on the CPU emulator. Printed next to
/// latency figures: GPUs of one model run at different clocks, and latencies in cycles are
/// what carries over.
pub fn sm_clock_mhz(dev: &Device) -> Result<Option<f64>> {
    use ferrolink_device::kernels::probe::sm_clock_probe;
    if dev.backend() != Backend::Cuda {
        return Ok(None);
    }
    let mut out = dev.alloc::<u64>(2)?;
    let stream = dev.create_stream()?;
    // SAFETY: `out` holds two words and outlives the kernel (synchronized below).
    unsafe {
        stream.launch(
            dev.builtin_module()?,
            &sm_clock_probe,
            LaunchConfig::linear(1, 32),
            (1_000_000u64, out.as_kernel_mut_ptr()),
        )?
    };
    stream.synchronize()?;
    let v = out.to_vec()?;
    Ok((v[1] > 0).then(|| v[0] as f64 / v[1] as f64 * 1e3))
}

/// Nanoseconds per instance of each [`Primitive`], timed by one warp over `iters` back-to-back
/// instances (medians of `trials`).
///
/// [`Primitive`]: ferrolink_device::kernels::probe::Primitive
pub fn primitive_latencies(
    dev: &Device,
    iters: u32,
    trials: usize,
) -> Result<Vec<(ferrolink_device::kernels::probe::Primitive, f64)>> {
    use ferrolink_device::kernels::probe::{Primitive, primitive_latency};
    let mut words = dev.alloc::<u32>(2)?;
    let mut out = dev.alloc::<u64>(1)?;
    let stream = dev.create_stream()?;
    let mut figures = Vec::new();
    for p in Primitive::ALL {
        let mut samples = Vec::new();
        for _ in 0..trials.max(1) {
            // SAFETY: `words` holds two zeroed words only this kernel touches (the stores
            // write word 1; the chained loads read word 0, which stays 0); `out` one word;
            // both outlive the kernel (synchronized below).
            unsafe {
                stream.launch(
                    dev.builtin_module()?,
                    &primitive_latency,
                    LaunchConfig::linear(1, 32),
                    (words.as_kernel_mut_ptr(), p.code(), iters, out.as_kernel_mut_ptr()),
                )?
            };
            stream.synchronize()?;
            samples.push(out.to_vec()?[0] as f64 / f64::from(iters.max(1)));
        }
        figures.push((p, median(&mut samples)));
    }
    Ok(figures)
}

/// Put bandwidth: `lsa_put` of `bytes` from rank 0 into rank 1's window slot vs the driver's
/// copy between the same addresses, on `nranks` (≥ 2) virtual ranks. Medians of `trials` x
/// `iters`.
pub fn put_bench(dev: &Device, nranks: usize, bytes: usize, iters: usize, trials: usize) -> Result<CopyReport> {
    use ferrolink_device::kernels::lsa::lsa_put;
    if nranks < 2 {
        return Err(ferrolink::Error::InvalidArgument(format!("put_bench needs at least 2 ranks, got {nranks}")));
    }
    let (comms, windows, _handles) = virtual_job(dev, nranks, bytes, 1)?;
    let src: DeviceBuffer<u8> = dev.alloc_from(&(0..bytes).map(|i| (i * 31 % 253) as u8).collect::<Vec<u8>>())?;
    let win = windows[0].dev_window();
    let peer_addr = win.lsa_ptr::<u8>(0, 1) as u64;
    let cfg = ops::copy_launch_config(dev, bytes);
    let module = dev.builtin_module()?;
    let (mut base, mut kern) = (Vec::new(), Vec::new());
    for _ in 0..trials.max(1) {
        // SAFETY: `src` and rank 1's slot hold `bytes` bytes and live until the end of this
        // function, after `time_gbps` has waited for its copies.
        base.push(time_gbps(dev, bytes, iters, |s| unsafe { s.copy_raw(peer_addr, src.addr(), bytes) })?);
        kern.push(time_gbps(dev, bytes, iters, |s| {
            // SAFETY: `src` holds `bytes` bytes; rank 1's slot holds `bytes` bytes; both live
            // until synchronized (time_gbps waits for its events).
            unsafe { s.launch(module, &lsa_put, cfg, (win, 1u32, 0usize, src.as_kernel_ptr(), bytes)) }
        })?);
    }
    drop(comms);
    Ok(CopyReport {
        bytes,
        baseline: CopyFigure { method: format!("{} to the peer slot", driver_copy_name(dev)), gbps: median(&mut base) },
        kernel: CopyFigure { method: format!("lsa_put {}x{}", cfg.grid.0, cfg.block.0), gbps: median(&mut kern) },
        sweep: Vec::new(),
    })
}

/// Ring throughput: every one of `nranks` virtual ranks sends `bytes` to the next rank with
/// `lsa_ring_exchange` (puts plus one barrier), `iters` times, vs every rank's stream doing a
/// driver copy of the same bytes into the same destinations. Aggregate GB/s (bytes moved by
/// all ranks per second, launch costs included), medians of `trials`.
pub fn ring_bench(dev: &Device, nranks: usize, bytes: usize, iters: usize, trials: usize) -> Result<CopyReport> {
    use ferrolink_device::kernels::lsa::lsa_ring_exchange;
    let ctas = (dev.sm_count() * 2 / nranks as u32).clamp(1, 128);
    let (comms, windows, handles) = virtual_job(dev, nranks, bytes, ctas)?;
    let srcs = comms.iter().map(|c| c.device().alloc::<u8>(bytes)).collect::<Result<Vec<_>>>()?;
    let threads = if dev.backend() == Backend::Cuda { 256 } else { 32 };
    let wall = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?; // warm-up
        for c in &comms {
            c.stream().synchronize()?;
        }
        let t = std::time::Instant::now();
        for _ in 0..iters {
            f()?;
        }
        for c in &comms {
            c.stream().synchronize()?;
        }
        Ok((bytes * nranks * iters) as f64 / t.elapsed().as_secs_f64() / 1e9)
    };
    let (mut base, mut kern) = (Vec::new(), Vec::new());
    for _ in 0..trials.max(1) {
        base.push(wall(&mut || {
            for r in 0..nranks {
                let next = windows[r].dev_window().lsa_ptr::<u8>(0, ((r + 1) % nranks) as u32) as u64;
                // SAFETY: the source and the next rank's slot hold `bytes` bytes and live until
                // the end of this function, after `wall` has synchronized every stream.
                unsafe { comms[r].stream().copy_raw(next, srcs[r].addr(), bytes)? };
            }
            Ok(())
        })?);
        kern.push(wall(&mut || {
            ferrolink::launch_all(&comms, |c| {
                let r = c.rank();
                // SAFETY: sources and window slots hold `bytes` bytes and outlive the kernels
                // (synchronized in `wall`); `ctas` barriers exist; every rank launches the same grid.
                unsafe {
                    c.stream().launch(
                        c.device().builtin_module()?,
                        &lsa_ring_exchange,
                        LaunchConfig::linear(ctas, threads),
                        (&handles[r], &windows[r], &srcs[r], bytes),
                    )
                }
            })
        })?);
    }
    Ok(CopyReport {
        bytes,
        baseline: CopyFigure {
            method: format!("{} on {nranks} streams", driver_copy_name(dev)),
            gbps: median(&mut base),
        },
        kernel: CopyFigure {
            method: format!("lsa_ring_exchange {nranks} ranks x {ctas}x{threads}"),
            gbps: median(&mut kern),
        },
        sweep: Vec::new(),
    })
}

/// Seconds each phase of [`scale_bench`] took.
#[derive(Clone, Copy, Debug)]
pub struct ScaleFigure {
    /// `Communicator::init_all` of the ranks.
    pub init_all: f64,
    /// One 4 KiB symmetric buffer per rank, registered as a window.
    pub window: f64,
    /// `create_dev_comms` with the default requirements.
    pub dev_comms: f64,
    /// Dropping everything, until the retired memory has been freed.
    pub drop: f64,
}

impl ScaleFigure {
    /// All phases.
    pub fn total(&self) -> f64 {
        self.init_all + self.window + self.dev_comms + self.drop
    }
}

/// Creates `nranks` virtual ranks on `dev` (communicator, a window, device communicators),
/// then drops them all, timing each phase; the drop phase ends when the memory is freed.
pub fn scale_bench(dev: &Device, nranks: usize) -> Result<ScaleFigure> {
    let t = std::time::Instant::now();
    let comms = ferrolink::Communicator::init_all(&vec![dev.clone(); nranks])?;
    let init_all = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    let bufs = comms.iter().map(|c| c.mem_alloc(4096)).collect::<Result<Vec<_>>>()?;
    let windows = ferrolink::register_window(&comms, bufs)?;
    let window = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    let handles = ferrolink::create_dev_comms(&comms, &ferrolink::DevCommRequirements::default())?;
    let dev_comms = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    drop(handles);
    drop(windows);
    drop(comms);
    while ferrolink::runtime::pending_retirements() > 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(ScaleFigure { init_all, window, dev_comms, drop: t.elapsed().as_secs_f64() })
}

/// What [`pair_rank`] measures between LSA ranks 0 and 1 of a job (rank 0 reports it).
#[derive(Clone, Copy, Debug)]
pub struct PairFigure {
    /// Microseconds per LSA barrier round, 1 CTA of 32 threads per rank (CTA coop,
    /// acquire-release, the scope the communicator chose): median of the trials.
    pub barrier_us: f64,
    /// `lsa_put` from rank 0 into rank 1's window slot, GB/s (median).
    pub put_gbps: f64,
    /// The driver's device-to-device copy from rank 0 to the same address, GB/s (median).
    pub copy_gbps: f64,
    /// Bytes per put.
    pub bytes: usize,
}

/// One rank's part of the two-rank figures: LSA barrier latency and put bandwidth between
/// ranks 0 and 1, the same code whether the ranks are threads of one process
/// (`Communicator::init_all` over two GPUs) or processes (`from_env`), so that the two can be
/// compared in one run. Every rank of the communicator calls it; rank 0 returns the figures.
pub fn pair_rank(
    comm: &ferrolink::Communicator,
    rounds: u32,
    bytes: usize,
    trials: usize,
) -> Result<Option<PairFigure>> {
    use ferrolink_device::kernels::lsa::{lsa_barrier_bench, lsa_put};
    if comm.lsa_size() < 2 {
        return Err(ferrolink::Error::InvalidArgument("pair figures need an LSA domain of 2 ranks or more".into()));
    }
    let dev = comm.device().clone();
    // Host work first: once the collectives below return, the peer may already run kernels.
    let module = dev.builtin_module()?;
    let mut out = dev.alloc::<u64>(1)?;
    let src: DeviceBuffer<u8> = dev.alloc_from(&(0..bytes).map(|i| (i * 31 % 253) as u8).collect::<Vec<u8>>())?;
    let window = comm.register_window(comm.mem_alloc(bytes)?)?;
    let handle =
        comm.create_dev_comm(&ferrolink::DevCommRequirements { lsa_barrier_count: 1, ..Default::default() })?;
    let mut barrier = Vec::new();
    for _ in 0..trials.max(1) {
        comm.barrier()?;
        // SAFETY: the bench kernel's contract: one CTA, one barrier; `out` holds one word.
        unsafe {
            comm.stream().launch(
                module,
                &lsa_barrier_bench,
                LaunchConfig::linear(1, 32),
                (&handle, rounds / 10, rounds, 0u32, ferrolink_device::BarrierOrder::AcqRel.code(), &mut out),
            )?;
        }
        comm.synchronize()?;
        barrier.push(out.to_vec()?[0] as f64 / f64::from(rounds) / 1e3);
    }
    let mut figure = None;
    if comm.rank() == comm.lsa_peers().start {
        let win = window.dev_window();
        let peer_addr = win.lsa_ptr::<u8>(0, 1) as u64;
        let cfg = ops::copy_launch_config(&dev, bytes);
        let iters = if dev.backend() == Backend::Cuda { 20 } else { 2 };
        let (mut put, mut copy) = (Vec::new(), Vec::new());
        for _ in 0..trials.max(1) {
            // SAFETY: `src` and rank 1's slot hold `bytes` bytes and live until the end of this
            // function, after `time_gbps` has waited for its copies; rank 1 touches its slot
            // only after the barrier below.
            copy.push(time_gbps(&dev, bytes, iters, |s| unsafe { s.copy_raw(peer_addr, src.addr(), bytes) })?);
            // SAFETY: as above; the put kernel's contract (the range lies in rank 1's slot).
            put.push(time_gbps(&dev, bytes, iters, |s| unsafe {
                s.launch(module, &lsa_put, cfg, (&window, 1u32, 0usize, &src, bytes))
            })?);
        }
        figure = Some(PairFigure {
            barrier_us: median(&mut barrier),
            put_gbps: median(&mut put),
            copy_gbps: median(&mut copy),
            bytes,
        });
    }
    comm.barrier()?;
    Ok(figure)
}

/// A GIN path measured by [`gin_rank`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GinPath {
    /// The direct backend (the peer is an LSA peer: stores through its mapped window).
    Direct,
    /// The proxy with the copy-engine transport.
    ProxyCopyEngine,
    /// The proxy with the TCP transport.
    ProxyTcp,
}

impl GinPath {
    /// Every path, in report order.
    pub const ALL: [GinPath; 3] = [GinPath::Direct, GinPath::ProxyCopyEngine, GinPath::ProxyTcp];

    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            GinPath::Direct => "direct",
            GinPath::ProxyCopyEngine => "proxy+CE",
            GinPath::ProxyTcp => "proxy+TCP",
        }
    }

    fn requirements(self) -> ferrolink::DevCommRequirements {
        let (mode, transport) = match self {
            GinPath::Direct => (ferrolink::GinMode::Auto, None),
            GinPath::ProxyCopyEngine => (ferrolink::GinMode::Proxy, Some(ferrolink::TransportKind::CopyEngine)),
            GinPath::ProxyTcp => (ferrolink::GinMode::Proxy, Some(ferrolink::TransportKind::Tcp)),
        };
        ferrolink::DevCommRequirements {
            gin_context_count: 1,
            gin_signal_count: 4,
            gin_mode: Some(mode),
            gin_transport: transport,
            ..Default::default()
        }
    }
}

/// GIN figures between ranks 0 and 1 (rank 0 reports them), each beside its baseline.
#[derive(Clone, Debug, Default)]
pub struct GinFigures {
    /// Per path: one-way latency of an 8-byte put with signal (half the ping-pong round
    /// trip, median of the trials), microseconds.
    pub latency_us: Vec<(GinPath, f64)>,
    /// Per size, the put bandwidth of each path beside the baselines.
    pub bandwidth: Vec<GinBandwidth>,
}

/// Put bandwidth at one size ([`GinFigures::bandwidth`]), GB/s.
#[derive(Clone, Debug, Default)]
pub struct GinBandwidth {
    /// Bytes per put.
    pub bytes: usize,
    /// Per path measured.
    pub by_path: Vec<(GinPath, f64)>,
    /// The driver's copy into rank 1's mapped memory (0 when rank 1 is not mapped here).
    pub copy_gbps: f64,
    /// A plain TCP copy of host data between the two ranks.
    pub tcp_gbps: f64,
}

/// Iterations for a bandwidth figure of `bytes`: about 1 GiB moved (4 at least, 200 at most).
fn gin_iters(bytes: usize, gpu: bool) -> u32 {
    let budget: usize = if gpu { 1 << 30 } else { 16 << 20 };
    (budget / bytes.max(1)).clamp(4, if gpu { 200 } else { 20 }) as u32
}

/// Plain TCP between ranks 0 and 1: rank 1 listens, rank 0 sends `bytes` of host memory
/// `iters` times and waits for a one-byte answer after the last; GB/s on rank 0 (median of
/// `trials`). The baseline of the TCP transport: the same two processes, host data, no GPU.
fn plain_tcp_gbps(comm: &ferrolink::Communicator, sizes: &[usize], gpu: bool, trials: usize) -> Result<Vec<f64>> {
    use std::io::{Read, Write};
    let io = |e: std::io::Error| ferrolink::Error::InvalidArgument(format!("plain TCP baseline: {e}"));
    let me = comm.rank();
    let listener = if me == 1 { Some(std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?) } else { None };
    let addr = listener.as_ref().map(|l| l.local_addr().map(|a| a.to_string())).transpose().map_err(io)?;
    let all = comm.all_gather_bytes(addr.unwrap_or_default().as_bytes())?;
    let mut out = Vec::new();
    if me == 0 {
        let peer = String::from_utf8_lossy(&all[1]).to_string();
        let mut s = std::net::TcpStream::connect(peer).map_err(io)?;
        s.set_nodelay(true).map_err(io)?;
        for &bytes in sizes {
            let data = vec![7u8; bytes];
            let iters = gin_iters(bytes, gpu);
            let mut samples = Vec::new();
            for _ in 0..trials.max(1) {
                let t = std::time::Instant::now();
                for _ in 0..iters {
                    s.write_all(&data).map_err(io)?;
                }
                let mut ack = [0u8; 1];
                s.read_exact(&mut ack).map_err(io)?;
                samples.push((bytes as f64 * f64::from(iters)) / t.elapsed().as_secs_f64() / 1e9);
            }
            out.push(median(&mut samples));
        }
    } else if let Some(l) = listener {
        let (mut s, _) = l.accept().map_err(io)?;
        s.set_nodelay(true).map_err(io)?;
        let mut buf = vec![0u8; 4 << 20];
        for &bytes in sizes {
            let iters = gin_iters(bytes, gpu);
            for _ in 0..trials.max(1) {
                let mut left = bytes * iters as usize;
                while left > 0 {
                    let n = s.read(&mut buf[..left.min(4 << 20)]).map_err(io)?;
                    if n == 0 {
                        return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
                    }
                    left -= n;
                }
                s.write_all(&[1]).map_err(io)?;
            }
        }
    }
    Ok(out)
}

/// One rank's part of the GIN figures between ranks 0 and 1 (every rank calls it; rank 0
/// returns the figures): for each path of `paths`, the put-with-signal ping-pong latency (8
/// bytes) and the put bandwidth at each size of `sizes`; beside them, in the same run, the
/// driver's copy into rank 1's mapped memory (the copy engine's baseline, what
/// `cudaMemcpyPeer` does) and a plain TCP copy of host data between the two ranks (the TCP
/// transport's baseline). The direct path and the copy-engine baseline need ranks 0 and 1 in
/// one LSA domain; the proxy paths are forced with `GinMode::Proxy`. The bandwidth kernel runs
/// one CTA of `threads` threads per rank (at most 8 on the emulator).
pub fn gin_rank(
    comm: &ferrolink::Communicator,
    paths: &[GinPath],
    sizes: &[usize],
    trials: usize,
    threads: u32,
) -> Result<Option<GinFigures>> {
    use ferrolink_device::kernels::gin::{gin_ping_pong, gin_put_bandwidth};
    if comm.nranks() < 2 {
        return Err(ferrolink::Error::InvalidArgument("GIN figures need two ranks or more".into()));
    }
    let dev = comm.device().clone();
    let gpu = dev.backend() == Backend::Cuda;
    let max = sizes.iter().copied().max().unwrap_or(8).max(8);
    let module = dev.builtin_module()?;
    let mut ns = dev.alloc::<u64>(1)?;
    let mut figures = GinFigures::default();
    let mut bw: Vec<Vec<(GinPath, f64)>> = vec![Vec::new(); sizes.len()];
    // Every window and device communicator of the run is made before the first kernel and
    // dropped after the last: on CUDA, allocating or freeing (pinned) memory may wait for the
    // device's running kernels, here a peer's kernel that waits for this rank.
    let mut made = Vec::new();
    for &path in paths {
        let src = comm.register_window(comm.mem_alloc(max)?)?;
        let dst = comm.register_window(comm.mem_alloc(max)?)?;
        let handle = comm.create_dev_comm(&path.requirements())?;
        made.push((path, src, dst, handle));
    }
    let window = comm.register_window(comm.mem_alloc(max)?)?;
    comm.barrier()?;
    for (path, src, dst, handle) in &made {
        let path = *path;
        let (warmup, iters) = if gpu { (1000u32, 10_000u32) } else { (5, 50) };
        let mut lat = Vec::new();
        for t in 0..trials.max(1) as u64 {
            let base = t * u64::from(warmup + iters);
            comm.barrier()?;
            // SAFETY: the kernel's contract: windows of `max` ≥ 8 bytes; signal 0 is its own
            // and `base` counts the earlier calls' signals; `ns` one word.
            unsafe {
                comm.stream().launch(
                    module,
                    &gin_ping_pong,
                    LaunchConfig::linear(1, 1),
                    (handle, dst, src, 0u32, 1u32, 8u32, warmup, iters, base, &mut ns),
                )?
            };
            comm.synchronize()?;
            lat.push(ns.to_vec()?[0] as f64 / f64::from(iters) / 2.0 / 1e3);
        }
        figures.latency_us.push((path, median(&mut lat)));
        // The bandwidth kernel uses signals 2 and 3, which start at 0.
        let mut round = 0u32;
        for (i, &bytes) in sizes.iter().enumerate() {
            let n = gin_iters(bytes, gpu);
            let mut samples = Vec::new();
            for _ in 0..trials.max(1) {
                round += 1;
                comm.barrier()?;
                // SAFETY: the kernel's contract: both windows hold `max` ≥ `bytes` bytes;
                // signals 2 and 3 are its own, `round` counts the calls; `ns` one word.
                unsafe {
                    comm.stream().launch(
                        module,
                        &gin_put_bandwidth,
                        LaunchConfig::linear(1, if gpu { threads } else { threads.min(8) }),
                        (handle, dst, src, 0u32, 1u32, bytes as u64, n, 2u32, round, &mut ns),
                    )?
                };
                comm.synchronize()?;
                samples.push((bytes as f64 * f64::from(n)) / ns.to_vec()?[0] as f64);
            }
            bw[i].push((path, median(&mut samples)));
        }
        comm.barrier()?;
    }
    // Baselines, in the same run.
    let tcp = plain_tcp_gbps(comm, sizes, gpu, trials)?;
    let mut copy = vec![0.0; sizes.len()];
    if comm.rank() == 0 && comm.lsa_size() >= 2 {
        let src = dev.alloc::<u8>(max)?;
        let peer_addr = window.dev_window().lsa_ptr::<u8>(0, 1) as u64;
        for (i, &bytes) in sizes.iter().enumerate() {
            let mut samples = Vec::new();
            for _ in 0..trials.max(1) {
                // SAFETY: `src` and rank 1's buffer of `window` hold `max` ≥ `bytes` bytes and
                // live until the end of this function, after `time_gbps` waited for its
                // copies; rank 1 does not touch its buffer.
                samples.push(time_gbps(&dev, bytes, gin_iters(bytes, gpu) as usize, |s| unsafe {
                    s.copy_raw(peer_addr, src.addr(), bytes)
                })?);
            }
            copy[i] = median(&mut samples);
        }
    }
    comm.barrier()?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    figures.bandwidth = sizes
        .iter()
        .enumerate()
        .map(|(i, &bytes)| GinBandwidth {
            bytes,
            by_path: std::mem::take(&mut bw[i]),
            copy_gbps: copy[i],
            tcp_gbps: tcp.get(i).copied().unwrap_or(0.0),
        })
        .collect();
    Ok(Some(figures))
}

/// What a collective benchmark runs: a collective, or nccl-tests' `sendrecv` (every rank
/// sends to the next rank and receives from the previous one, in one group).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchOp {
    /// A collective.
    Coll(ferrolink::coll::CollKind),
    /// Send to `rank + 1`, receive from `rank - 1`.
    SendRecv,
}

impl BenchOp {
    /// The name nccl-tests prints.
    pub fn name(&self) -> String {
        match self {
            BenchOp::Coll(k) => format!("{k:?}"),
            BenchOp::SendRecv => "SendRecv".into(),
        }
    }
}

/// Options of a collective benchmark in nccl-tests form (`ferrolink-perf all_reduce -b 8 -e
/// 256M -f 2 -d bf16 -o sum -n 20 -w 5 -c 1`).
#[derive(Clone, Debug)]
pub struct CollBench {
    /// Which collective.
    pub kind: BenchOp,
    /// Element type.
    pub dtype: ferrolink::coll::DataType,
    /// Reduction.
    pub op: ferrolink::coll::ReduceOp,
    /// Smallest and largest size in bytes (nccl-tests' sizes: see [`coll_counts`]), and the
    /// factor between sizes.
    pub min_bytes: usize,
    /// Largest size.
    pub max_bytes: usize,
    /// Factor between sizes.
    pub factor: usize,
    /// Timed calls per size.
    pub iters: usize,
    /// Untimed calls before.
    pub warmup: usize,
    /// Check the results (the last out-of-place call per size).
    pub check: bool,
    /// Force an algorithm where it applies (`None`: the tuner's).
    pub algo: Option<u32>,
    /// Force a protocol where it applies (`None`: the tuner's).
    pub proto: Option<u32>,
    /// Persistent mode (collectives only).
    pub persistent: bool,
    /// Inputs and outputs in plain device buffers (staged by the kernel) instead of windows.
    pub buffers: bool,
}

/// One row of a collective benchmark (nccl-tests' columns).
#[derive(Clone, Debug)]
pub struct CollRow {
    /// Bytes as nccl-tests counts them.
    pub bytes: usize,
    /// Elements per rank as NCCL's count argument.
    pub count: usize,
    /// Out-of-place: microseconds per call, algbw, busbw (GB/s), wrong elements (None: not
    /// checked).
    pub out_of_place: (f64, f64, f64, Option<usize>),
    /// In place, when the collective has it.
    pub in_place: Option<(f64, f64, f64)>,
    /// Out-of-place: microseconds per call that rank 0's thread spent queuing the calls (the
    /// loop without the final synchronize). A rank alone on its GPU: near the time per call,
    /// the host bounds the rate; well under it, the GPU does. Ranks sharing a GPU: the loop
    /// also waits whenever rank 0 is 64 calls ahead of the GPU's shared launches, so this
    /// nears the time per call whatever bounds it (the `run-ahead` phase of
    /// `FERROLINK_HOST_PHASES=1` is that wait: subtract it for the host's own time).
    pub host_us: f64,
}

/// nccl-tests' count for `bytes` of `kind` on `n` ranks (0 when it rounds down to none).
pub fn coll_counts(kind: ferrolink::coll::CollKind, bytes: usize, size: usize, n: usize) -> usize {
    use ferrolink::coll::CollKind as K;
    match kind {
        K::AllReduce | K::Broadcast | K::Reduce => bytes / size,
        K::AllGather | K::ReduceScatter | K::AllToAll => bytes / size / n,
    }
}

/// nccl-tests' bus bandwidth factor.
pub fn bus_factor(kind: ferrolink::coll::CollKind, n: usize) -> f64 {
    use ferrolink::coll::CollKind as K;
    let n = n as f64;
    match kind {
        K::AllReduce => 2.0 * (n - 1.0) / n,
        K::AllGather | K::ReduceScatter | K::AllToAll => (n - 1.0) / n,
        K::Broadcast | K::Reduce => 1.0,
    }
}

/// One rank's part of a collective benchmark (every rank calls it; rank 0 returns the rows).
/// Inputs and outputs live in windows (zero copy), or with [`CollBench::buffers`] in plain
/// device buffers; the in-place column runs from the output. Time: wall clock on rank 0 from a host barrier to the end of `iters` calls on
/// every rank (a second barrier after each rank's stream synchronize), divided by `iters`.
pub fn coll_rank(comm: &ferrolink::Communicator, b: &CollBench) -> Result<Option<Vec<CollRow>>> {
    use ferrolink::coll::DataType as D;
    fn run<T: ferrolink::coll::CollElem + PartialEq>(
        comm: &ferrolink::Communicator,
        b: &CollBench,
    ) -> Result<Option<Vec<CollRow>>> {
        match b.kind {
            BenchOp::Coll(kind) => coll_rank_t::<T>(comm, b, kind),
            BenchOp::SendRecv => sendrecv_rank_t::<T>(comm, b),
        }
    }
    match b.dtype {
        D::F32 => run::<f32>(comm, b),
        D::F16 => run::<ferrolink::coll::f16>(comm, b),
        D::Bf16 => run::<ferrolink::coll::bf16>(comm, b),
        D::F64 => run::<f64>(comm, b),
        D::I32 => run::<i32>(comm, b),
        D::I64 => run::<i64>(comm, b),
        D::U8 => run::<u8>(comm, b),
        D::U32 => run::<u32>(comm, b),
    }
}

/// Times `iters` calls of `run` after `warmup` (wall clock on this rank from a host barrier
/// to the end of every rank's calls), in microseconds per call, and the part of it this
/// thread spent queuing the calls (before its stream's synchronize).
fn time_calls(
    comm: &ferrolink::Communicator,
    b: &CollBench,
    run: &mut dyn FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    for _ in 0..b.warmup {
        run()?;
    }
    comm.stream().synchronize()?;
    // The host phases (FERROLINK_HOST_PHASES=1) of the timed calls only: every rank resets
    // before the barrier, none times a call before it.
    ferrolink::coll::reset_host_phases();
    comm.barrier()?;
    let t = std::time::Instant::now();
    for _ in 0..b.iters.max(1) {
        run()?;
    }
    let queued = t.elapsed();
    comm.stream().synchronize()?;
    comm.barrier()?;
    let per_call = |d: std::time::Duration| d.as_secs_f64() * 1e6 / b.iters.max(1) as f64;
    Ok((per_call(t.elapsed()), per_call(queued)))
}

/// The sizes of a benchmark: from `min_bytes` (at least one element) by `factor` to
/// `max_bytes`.
fn bench_sizes(b: &CollBench, size: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut bytes = b.min_bytes.max(size);
    loop {
        out.push(bytes);
        if bytes >= b.max_bytes {
            return out;
        }
        bytes = (bytes * b.factor.max(2)).min(b.max_bytes);
    }
}

/// nccl-tests' `sendrecv`: each call is one group (send `count` elements to the next rank,
/// receive as many from the previous one) from device buffers; busbw = algbw.
fn sendrecv_rank_t<T: ferrolink::coll::CollElem + PartialEq>(
    comm: &ferrolink::Communicator,
    b: &CollBench,
) -> Result<Option<Vec<CollRow>>> {
    let (me, n) = (comm.rank(), comm.nranks());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let size = std::mem::size_of::<T>();
    let max_count = (b.max_bytes / size).max(1);
    let dev = comm.device();
    comm.enable_p2p(None)?;
    let input: Vec<T> = (0..max_count).map(|i| coll_value::<T>(me, i)).collect();
    let send = dev.alloc_from(&input)?;
    let mut recv = dev.alloc::<T>(max_count)?;
    comm.barrier()?;
    let mut rows = Vec::new();
    for bytes in bench_sizes(b, size) {
        let count = bytes / size;
        let mut run = || -> Result<()> {
            let mut g = comm.p2p_group();
            g.send_slice(&send, 0, count, next)?;
            g.recv_slice(&mut recv, 0, count, prev)?;
            g.launch()
        };
        let (us, host_us) = time_calls(comm, b, &mut run)?;
        let mut wrong = None;
        if b.check {
            let got = recv.to_vec()?;
            wrong = Some((0..count).filter(|&i| got[i] != coll_value::<T>(prev, i)).count());
            comm.barrier()?;
        }
        let alg = bytes as f64 / (us * 1e3);
        rows.push(CollRow { bytes, count, out_of_place: (us, alg, alg, wrong), in_place: None, host_us });
    }
    comm.barrier()?;
    Ok((me == 0).then_some(rows))
}

/// Small integers that every type holds exactly (`(r * 7 + i * 3) % 5 + 1`).
fn coll_value<T: ferrolink::coll::CollElem>(r: usize, i: usize) -> T {
    let v = ((r * 7 + i * 3) % 5 + 1) as f64;
    // Every supported type reads a little-endian small integer from its own encoding.
    let bytes: Vec<u8> = match T::DTYPE {
        ferrolink::coll::DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        ferrolink::coll::DataType::F64 => v.to_le_bytes().to_vec(),
        ferrolink::coll::DataType::F16 => ferrolink::coll::f16::from_f64(v).to_le_bytes().to_vec(),
        ferrolink::coll::DataType::Bf16 => ferrolink::coll::bf16::from_f64(v).to_le_bytes().to_vec(),
        ferrolink::coll::DataType::I32 => (v as i32).to_le_bytes().to_vec(),
        ferrolink::coll::DataType::I64 => (v as i64).to_le_bytes().to_vec(),
        ferrolink::coll::DataType::U8 => vec![v as u8],
        ferrolink::coll::DataType::U32 => (v as u32).to_le_bytes().to_vec(),
    };
    bytemuck::pod_read_unaligned(&bytes)
}

fn coll_rank_t<T: ferrolink::coll::CollElem + PartialEq>(
    comm: &ferrolink::Communicator,
    b: &CollBench,
    kind: ferrolink::coll::CollKind,
) -> Result<Option<Vec<CollRow>>> {
    use ferrolink::coll::{CollKind as K, Collective, Input, Output};
    let n = comm.nranks();
    let me = comm.rank();
    let size = std::mem::size_of::<T>();
    let max_count = coll_counts(kind, b.max_bytes, size, n).max(1);
    let probe = Collective::new(kind, max_count);
    let (in_max, out_max) = probe.lengths(n);
    // Windows first, then nothing is allocated while collectives run.
    let send = comm.register_window(comm.mem_alloc(in_max * size)?)?;
    let recv = comm.register_window(comm.mem_alloc(out_max * size)?)?;
    let input: Vec<T> = (0..in_max).map(|i| coll_value::<T>(me, i)).collect();
    send.copy_from_host(0, &input)?;
    let dev = comm.device();
    let mut bufs = match b.buffers {
        true => Some((dev.alloc_from(&input)?, dev.alloc::<T>(out_max)?)),
        false => None,
    };
    if b.persistent {
        comm.start_persistent(Default::default())?;
    }
    comm.barrier()?;
    let mut rows = Vec::new();
    let has_in_place = !matches!(kind, K::ReduceScatter | K::AllToAll);
    for bytes in bench_sizes(b, size) {
        let count = coll_counts(kind, bytes, size, n);
        if count > 0 {
            let c = Collective {
                op: b.op,
                root: 0,
                algo: b.algo,
                proto: b.proto,
                check: Some(false),
                ..Collective::new(kind, count)
            };
            let call = |bufs: &mut Option<(ferrolink::DeviceBuffer<T>, ferrolink::DeviceBuffer<T>)>,
                        in_place: bool|
             -> Result<()> {
                match (bufs, in_place) {
                    (None, true) => comm.collective::<T>(&c, Input::InPlace, Output::Window(&recv, 0)),
                    (None, false) => comm.collective::<T>(&c, Input::Window(&send, 0), Output::Window(&recv, 0)),
                    (Some((_, out)), true) => comm.collective::<T>(&c, Input::InPlace, Output::Buffer(out)),
                    (Some((inp, out)), false) => comm.collective::<T>(&c, Input::Buffer(inp), Output::Buffer(out)),
                }
            };
            let (oop, host_us) = time_calls(comm, b, &mut || call(&mut bufs, false))?;
            let mut wrong = None;
            if b.check {
                call(&mut bufs, false)?;
                comm.stream().synchronize()?;
                let (_, out_len) = c.lengths(n);
                let got = match &bufs {
                    None => recv.read::<T>(0, out_len)?,
                    Some((_, out)) => out.to_vec()?[..out_len].to_vec(),
                };
                let want = ferrolink::coll::expected_output::<T>(&c, n, me, coll_value::<T>);
                wrong = Some(match want {
                    Some(w) => got.iter().zip(&w).filter(|(g, w)| g != w).count(),
                    None => 0,
                });
                comm.barrier()?;
            }
            let ip = if has_in_place { Some(time_calls(comm, b, &mut || call(&mut bufs, true))?.0) } else { None };
            let bw = |us: f64| {
                let alg = bytes as f64 / (us * 1e3);
                (us, alg, alg * bus_factor(kind, n))
            };
            let (t, a, bb) = bw(oop);
            rows.push(CollRow { bytes, count, out_of_place: (t, a, bb, wrong), in_place: ip.map(bw), host_us });
        }
    }
    if b.persistent {
        comm.stop_persistent()?;
    }
    comm.barrier()?;
    Ok((me == 0).then_some(rows))
}

pub use ferrolink::testing::splitmix64;

/// The fixed seed of the MoE benchmark's routing (`ferrolink-perf moe` and
/// `benches/torch/moe_all_to_all.py`).
pub const MOE_SEED: u64 = 0x13_5eed;

/// Rank `rank`'s routing in the MoE benchmark: `tokens * top_k` experts (`topk_idx`, row-major)
/// and as many weights. Each token names `top_k` distinct experts, uniformly: with `s =
/// splitmix64(MOE_SEED ^ (rank << 32))`, token `t` starts from `z = splitmix64(s ^ 0xabc ^ (t
/// << 20))` and takes `e = z % experts` after each `z = splitmix64(z)`, skipping experts it has;
/// entry `i`'s weight is `(splitmix64(s ^ 0x5eed ^ i) % 64 + 1) / 64` (positive, exact in
/// bf16). The same on every run and in the PyTorch script, so both move the same bytes.
pub fn moe_routing(rank: usize, tokens: usize, experts: usize, top_k: usize) -> (Vec<i32>, Vec<f32>) {
    assert!(top_k <= experts, "top_k {top_k} distinct experts of {experts}");
    let s = splitmix64(MOE_SEED ^ ((rank as u64) << 32));
    let mut idx = Vec::with_capacity(tokens * top_k);
    for t in 0..tokens {
        let first = idx.len();
        let mut z = splitmix64(s ^ 0xabc ^ ((t as u64) << 20));
        while idx.len() - first < top_k {
            z = splitmix64(z);
            let e = (z % experts as u64) as i32;
            if !idx[first..].contains(&e) {
                idx.push(e);
            }
        }
    }
    let weights = (0..tokens * top_k).map(|i| ((splitmix64(s ^ 0x5eed ^ i as u64) % 64) as f32 + 1.0) / 64.0).collect();
    (idx, weights)
}

/// Element `i` of token `t` of rank `rank` in the MoE benchmark: `((t * 131 + i * 7 + rank *
/// 29) % 15 - 7) / 8`, a multiple of 1/8 in `-7/8..=7/8`, exact in bf16 (so the weighted sums
/// of the check are exact in `f32`).
pub fn moe_token_value(rank: usize, t: usize, i: usize) -> f32 {
    ((t * 131 + i * 7 + rank * 29) % 15) as f32 / 8.0 - 7.0 / 8.0
}

/// Options of the MoE benchmark (`ferrolink-perf moe`).
#[derive(Clone, Copy, Debug)]
pub struct MoeBench {
    /// Tokens per rank.
    pub tokens: usize,
    /// bf16 elements per token.
    pub hidden: usize,
    /// Experts in all (a multiple of the ranks).
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Untimed iterations before (dispatch and combine each).
    pub warmup: usize,
    /// [`ferrolink::moe::MoeLowLatency`] (`Communicator::moe_low_latency`) instead of
    /// [`ferrolink::moe::Moe`].
    pub low_latency: bool,
}

/// The baseline of the MoE figures: the driver's copy into the next rank's mapped memory.
#[derive(Clone, Copy, Debug)]
pub struct PeerCopyFigure {
    /// The rank copied to (`rank + 1` mod the ranks).
    pub peer: usize,
    /// Whether that rank runs on this rank's GPU (virtual ranks): then the copy is a
    /// device-to-device copy on that GPU, not a copy over NVLink.
    pub same_gpu: bool,
    /// Bytes per copy: what this rank's dispatch sends to that rank.
    pub bytes: usize,
    /// Microseconds per copy (mean).
    pub us: f64,
}

impl PeerCopyFigure {
    /// GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / (self.us * 1e3)
    }
}

/// What one rank measured in the MoE benchmark ([`moe_rank`]).
#[derive(Clone, Copy, Debug)]
pub struct MoeFigures {
    /// Ranks of the communicator.
    pub nranks: usize,
    /// Whether the low-latency mode ran ([`MoeBench::low_latency`]).
    pub low_latency: bool,
    /// Microseconds per dispatch (mean over the iterations, CUDA events on the rank's stream
    /// around each call; in normal mode it includes the copy of the tokens into the send
    /// window, the low-latency mode reads them from `x`).
    pub dispatch_us: f64,
    /// Microseconds per combine (identity experts: the received rows go back as they are).
    pub combine_us: f64,
    /// Microseconds per dispatch and combine back to back (events around all iterations).
    pub end_to_end_us: f64,
    /// Low-latency mode only: microseconds per `dispatch_send` and `dispatch_recv` back to
    /// back (the receive hook with nothing between the halves), events around the pair.
    pub dispatch_hook_us: Option<f64>,
    /// Low-latency mode only: the same for `combine_send` and `combine_recv`.
    pub combine_hook_us: Option<f64>,
    /// Entries (token, expert) of this rank whose expert is on another rank: the rows its
    /// dispatch sends to other ranks and its combine gets back.
    pub remote_entries: usize,
    /// Bytes per row (`2 * hidden`).
    pub row_bytes: usize,
    /// The baseline (`None` with one rank, when the next rank is not in this rank's LSA
    /// domain, or when the dispatch sends it nothing).
    pub peer_copy: Option<PeerCopyFigure>,
    /// Elements of the checked output (`tokens * hidden`) that differ from the host model
    /// by more than one bf16 step (low-latency mode: two checked rounds, one-kernel calls
    /// then the hook halves, summed).
    pub wrong: usize,
}

impl MoeFigures {
    /// The mode that ran, as the tool prints it: `normal` or `low_latency`.
    pub fn mode(&self) -> &'static str {
        if self.low_latency { "low_latency" } else { "normal" }
    }

    /// Bytes the dispatch sends to other ranks (the combine brings as many back).
    pub fn remote_bytes(&self) -> usize {
        self.remote_entries * self.row_bytes
    }

    /// GB/s of `bytes` in `us` microseconds.
    pub fn gbps(bytes: usize, us: f64) -> f64 {
        bytes as f64 / (us * 1e3)
    }

    /// `gbps` over the peer copy's GB/s, if there is one.
    pub fn ratio(&self, gbps: f64) -> Option<f64> {
        self.peer_copy.map(|p| gbps / p.gbps())
    }
}

/// Mean microseconds between the pairs of events.
fn mean_us(pairs: &[(&ferrolink::Event, &ferrolink::Event)]) -> Result<f64> {
    let mut sum = 0.0;
    for (start, end) in pairs {
        sum += f64::from(end.elapsed_ms_since(start)?) * 1e3;
    }
    Ok(sum / pairs.len().max(1) as f64)
}

/// The MoE object the benchmark drives: normal or low-latency mode.
enum MoeEngine {
    Normal(Box<ferrolink::moe::Moe>),
    LowLatency(Box<ferrolink::moe::MoeLowLatency>),
}

impl MoeEngine {
    fn dispatch(&mut self, x: &DeviceBuffer<ferrolink::moe::bf16>, idx: &DeviceBuffer<i32>) -> Result<()> {
        match self {
            MoeEngine::Normal(m) => m.dispatch(x, idx),
            MoeEngine::LowLatency(m) => m.dispatch(x, idx),
        }
    }

    /// The combine with identity experts.
    fn combine(&mut self, w: &DeviceBuffer<f32>, out: &mut DeviceBuffer<ferrolink::moe::bf16>) -> Result<()> {
        match self {
            MoeEngine::Normal(m) => m.combine(None, w, out),
            MoeEngine::LowLatency(m) => m.combine(None, w, out),
        }
    }
}

/// One rank's part of the MoE benchmark (every rank calls it; rank 0 returns its figures):
/// `ferrolink::moe` dispatch and combine of `b.tokens` tokens routed by [`moe_routing`], with
/// identity experts (`combine(None, ..)`), by [`ferrolink::moe::Moe`] or, with
/// `b.low_latency`, by [`ferrolink::moe::MoeLowLatency`] (`max_tokens` = `b.tokens`). Timed
/// with events on the rank's stream: each dispatch and each combine alone (the calls
/// alternate), then `b.iters` of both back to back; in low-latency mode also the hook halves
/// (`dispatch_send` then `dispatch_recv`, `combine_send` then `combine_recv`, each pair
/// timed); then the baseline in the same run: the driver's copy of the bytes this rank's
/// dispatch sends to the next rank into that rank's mapped window (as `cudaMemcpyPeer`;
/// every rank copies at once, as every rank dispatches at once); last, one more dispatch and
/// combine (low-latency mode: one by the one-kernel calls and one by the halves) checked
/// against the host model `out[t] = sum_k w[t, k] * x[t]` rounded to bf16, the output zeroed
/// before each.
pub fn moe_rank(comm: &ferrolink::Communicator, b: &MoeBench) -> Result<Option<MoeFigures>> {
    use ferrolink::moe::{MoeConfig, bf16};
    let (me, n) = (comm.rank(), comm.nranks());
    let bad = |why: String| Err(ferrolink::Error::InvalidArgument(format!("moe bench: {why}")));
    if b.tokens == 0 || b.hidden == 0 || b.top_k == 0 || b.top_k > b.experts {
        return bad(format!("need tokens >= 1, hidden >= 1 and 1 <= top_k <= experts (got {b:?})"));
    }
    if !b.experts.is_multiple_of(n) {
        return bad(format!("{} experts do not split over {n} ranks", b.experts));
    }
    let (t_n, h, k) = (b.tokens, b.hidden, b.top_k);
    let per = b.experts / n;
    let (idx, weights) = moe_routing(me, t_n, b.experts, k);
    let x: Vec<bf16> = (0..t_n * h).map(|j| bf16::from_f32(moe_token_value(me, j / h, j % h))).collect();
    let remote_entries = idx.iter().filter(|&&e| e as usize / per != me).count();
    let peer = (me + 1) % n;
    let peer_bytes = if n > 1 { idx.iter().filter(|&&e| e as usize / per == peer).count() * 2 * h } else { 0 };
    // One window size on every rank: the most any rank sends to its next rank.
    let window_bytes = comm
        .all_gather_bytes(&(peer_bytes as u64).to_le_bytes())?
        .iter()
        .map(|v| u64::from_le_bytes(v[..8].try_into().expect("8 bytes")) as usize)
        .max()
        .unwrap_or(0)
        .max(16);
    let dev = comm.device().clone();
    // Everything is allocated before the first kernel and dropped after the last (see
    // `gin_rank`: on CUDA an allocation or a free may wait for a peer's kernel waiting here).
    let cfg = MoeConfig { num_experts: b.experts, hidden: h, top_k: k, max_tokens: t_n, capacity: None };
    let mut moe = if b.low_latency {
        MoeEngine::LowLatency(Box::new(comm.moe_low_latency(cfg)?))
    } else {
        MoeEngine::Normal(Box::new(comm.moe(cfg)?))
    };
    let window = comm.register_window(comm.mem_alloc(window_bytes)?)?;
    let src = dev.alloc::<u8>(window_bytes)?;
    let xb = dev.alloc_from(&x)?;
    let idxb = dev.alloc_from(&idx)?;
    let wb = dev.alloc_from(&weights)?;
    let mut out = dev.alloc::<bf16>(t_n * h)?;
    let zeros = dev.alloc::<bf16>(t_n * h)?;
    let stream = comm.stream();
    let iters = b.iters.max(1);
    comm.barrier()?;
    for _ in 0..b.warmup {
        moe.dispatch(&xb, &idxb)?;
        moe.combine(&wb, &mut out)?;
    }
    comm.synchronize()?;
    comm.barrier()?;
    // Each call alone.
    let mut marks = Vec::with_capacity(iters);
    for _ in 0..iters {
        let e0 = stream.record_event()?;
        moe.dispatch(&xb, &idxb)?;
        let e1 = stream.record_event()?;
        moe.combine(&wb, &mut out)?;
        let e2 = stream.record_event()?;
        marks.push((e0, e1, e2));
    }
    comm.synchronize()?;
    let dispatch_us = mean_us(&marks.iter().map(|(a, b, _)| (a, b)).collect::<Vec<_>>())?;
    let combine_us = mean_us(&marks.iter().map(|(_, b, c)| (b, c)).collect::<Vec<_>>())?;
    comm.barrier()?;
    // Back to back.
    let start = stream.record_event()?;
    for _ in 0..iters {
        moe.dispatch(&xb, &idxb)?;
        moe.combine(&wb, &mut out)?;
    }
    let end = stream.record_event()?;
    comm.synchronize()?;
    let end_to_end_us = f64::from(end.elapsed_ms_since(&start)?) * 1e3 / iters as f64;
    comm.barrier()?;
    // The hook halves back to back (low-latency mode).
    let (mut dispatch_hook_us, mut combine_hook_us) = (None, None);
    if let MoeEngine::LowLatency(ll) = &mut moe {
        let mut marks = Vec::with_capacity(iters);
        for _ in 0..iters {
            let e0 = stream.record_event()?;
            ll.dispatch_send(&xb, &idxb)?;
            ll.dispatch_recv()?;
            let e1 = stream.record_event()?;
            ll.combine_send(None)?;
            ll.combine_recv(&wb, &mut out)?;
            let e2 = stream.record_event()?;
            marks.push((e0, e1, e2));
        }
        comm.synchronize()?;
        dispatch_hook_us = Some(mean_us(&marks.iter().map(|(a, b, _)| (a, b)).collect::<Vec<_>>())?);
        combine_hook_us = Some(mean_us(&marks.iter().map(|(_, b, c)| (b, c)).collect::<Vec<_>>())?);
        comm.barrier()?;
    }
    // The baseline: every rank copies what it dispatches to the next rank into its window.
    let mapped = n > 1 && comm.lsa_peers().contains(&peer) && peer_bytes > 0;
    let mut peer_copy = None;
    if mapped {
        let peer_addr = window.dev_window().lsa_ptr::<u8>(0, (peer - comm.lsa_peers().start) as u32) as u64;
        // SAFETY: `src` and the next rank's buffer of `window` hold `window_bytes` >=
        // `peer_bytes` bytes and live until the end of this function, after the synchronize
        // below; only this rank writes that buffer, and nothing reads it.
        let copy = || unsafe { stream.copy_raw(peer_addr, src.addr(), peer_bytes) };
        for _ in 0..b.warmup {
            copy()?;
        }
        comm.synchronize()?;
        let mut marks = Vec::with_capacity(iters);
        for _ in 0..iters {
            let e0 = stream.record_event()?;
            copy()?;
            marks.push((e0, stream.record_event()?));
        }
        comm.synchronize()?;
        let us = mean_us(&marks.iter().map(|(a, b)| (a, b)).collect::<Vec<_>>())?;
        let (mine, theirs) = (&comm.peers()[me], &comm.peers()[peer]);
        let same_gpu = mine.node == theirs.node && mine.uuid == theirs.uuid;
        peer_copy = Some(PeerCopyFigure { peer, same_gpu, bytes: peer_bytes, us });
    }
    comm.barrier()?;
    // The check (low-latency mode: the one-kernel calls, then the hook halves).
    let mut wrong = 0;
    for round in 0..if b.low_latency { 2 } else { 1 } {
        stream.copy_buffer(&mut out, &zeros)?;
        match (&mut moe, round) {
            (MoeEngine::LowLatency(ll), 1) => {
                ll.dispatch_send(&xb, &idxb)?;
                ll.dispatch_recv()?;
                ll.combine_send(None)?;
                ll.combine_recv(&wb, &mut out)?;
            }
            (moe, _) => {
                moe.dispatch(&xb, &idxb)?;
                moe.combine(&wb, &mut out)?;
            }
        }
        comm.synchronize()?;
        wrong += count_wrong(&out.to_vec()?, &x, &weights, h, k);
    }
    // Every rank's kernels have ended before anything is dropped.
    comm.barrier()?;
    let figures = MoeFigures {
        nranks: n,
        low_latency: b.low_latency,
        dispatch_us,
        combine_us,
        end_to_end_us,
        dispatch_hook_us,
        combine_hook_us,
        remote_entries,
        row_bytes: 2 * h,
        peer_copy,
        wrong,
    };
    Ok((me == 0).then_some(figures))
}

/// Elements of `got` (`tokens * h`) that differ by more than one bf16 step from the host
/// model `sum_k weights[t, k] * x[t]` (identity experts), rounded to bf16.
fn count_wrong(got: &[ferrolink::moe::bf16], x: &[ferrolink::moe::bf16], weights: &[f32], h: usize, k: usize) -> usize {
    use ferrolink::moe::bf16;
    let mut wrong = 0;
    for t in 0..x.len() / h {
        let w = &weights[t * k..][..k];
        for i in 0..h {
            let v = x[t * h + i].to_f32();
            let mut acc = 0f32;
            for wk in w {
                acc += wk * v;
            }
            let want = bf16::from_f32(acc);
            let g = got[t * h + i];
            // One bf16 step of slack, as tests/moe.rs allows (the inputs make every sum exact).
            let ulp = bf16::from_bits(want.to_bits() | 1).to_f32() - bf16::from_bits(want.to_bits() & !1).to_f32();
            if (g.to_f32() - want.to_f32()).abs() > ulp.abs().max(1e-30) {
                wrong += 1;
            }
        }
    }
    wrong
}
