//! ferrolink's examples. Each `NN_name.rs` beside this file is a small program
//! (`cargo run --release -p ferrolink-examples --example 02_ring`); the communicating ones
//! call a module here, whose `rank` function is one rank's whole program, written as for one
//! process per rank, and which checks its own result. [`job`] runs it:
//! * under a launcher (`ferrolink-run -n 4 target/release/examples/02_ring`, torchrun,
//!   mpirun, srun) the process is one rank: `Communicator::from_env` on its device;
//! * started alone, the process runs every rank: `Communicator::init_all` on virtual ranks of
//!   device 0, each rank's program on a thread.
//!
//! The test suite (tests/lsa.rs, tests/multiprocess.rs) runs exactly these functions, on
//! every backend, both ways.

use ferrolink::{Communicator, DevCommHandle, DevCommRequirements, Device, Error, LaunchConfig, Result, Window};

/// Runs `rank` as a job of `nranks` ranks (see the [crate docs](self)): one rank in this
/// process under a launcher, else all of them on virtual ranks of device 0. Returns this
/// process's ranks' results, in rank order.
pub fn job<T: Send>(nranks: usize, rank: impl Fn(&Communicator) -> Result<T> + Sync) -> Result<Vec<T>> {
    match ferrolink::comm::launch::LaunchEnv::detect()? {
        Some(env) => {
            let dev = open_device(env.device_ordinal())?;
            let comm = Communicator::from_env(&dev)?;
            Ok(vec![rank(&comm)?])
        }
        None => {
            let dev = Device::open(0)?;
            all_ranks(&dev, nranks, rank)
        }
    }
}

/// Every rank of an `nranks`-rank job as virtual ranks of `dev`, each rank's program on a thread.
pub fn all_ranks<T: Send>(
    dev: &Device,
    nranks: usize,
    rank: impl Fn(&Communicator) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let comms = Communicator::init_all(&vec![dev.clone(); nranks])?;
    ferrolink::run_ranks(&comms, rank)
}

/// Opens the device a launched rank should use: GPU `ordinal` on CUDA; on the emulator any
/// ordinal is a fresh emulated device.
fn open_device(ordinal: usize) -> Result<Device> {
    Device::open(ordinal)
}

/// Prints the device and the job's shape, then the results of this process's ranks (rank 0's
/// line, or every line when this process runs all ranks), for the example programs.
pub fn report(lines: Result<Vec<String>>) -> Result<()> {
    for l in lines? {
        println!("{l}");
    }
    Ok(())
}

/// This rank's window of `bytes` bytes and device communicator (default requirements): the
/// set-up of most examples (collective). Do host work (allocations, module loads) before it:
/// when it returns, other ranks may already run kernels that wait for this one, and some
/// driver calls wait for the device's running kernels.
pub fn window_and_dev_comm(comm: &Communicator, bytes: usize) -> Result<(Window, DevCommHandle)> {
    let window = comm.register_window(comm.mem_alloc(bytes)?)?;
    let handle = comm.create_dev_comm(&DevCommRequirements::default())?;
    Ok((window, handle))
}

/// `nranks` ranks on `dev`, each with a `window_bytes` window and a device communicator
/// (default requirements), all handles at once: for tests and benches that drive every rank
/// from one thread.
pub fn virtual_job(
    dev: &Device,
    nranks: usize,
    window_bytes: usize,
) -> Result<(Vec<Communicator>, Vec<Window>, Vec<DevCommHandle>)> {
    ferrolink::testing::virtual_job(dev, nranks, window_bytes, &DevCommRequirements::default())
}

/// Threads per CTA for the LSA examples: 256 on a GPU, 32 on the emulator (OS threads).
pub fn block_threads(dev: &Device) -> u32 {
    if dev.backend() == ferrolink::Backend::Cuda { 256 } else { 32 }
}

/// CTAs per rank for the LSA examples: `gpu` on a GPU, at most 4 on the emulator, where
/// every thread is an OS thread and all ranks' threads run at once.
pub fn grid_ctas(dev: &Device, gpu: u32) -> u32 {
    if dev.backend() == ferrolink::Backend::Cuda { gpu } else { gpu.min(4) }
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond { Ok(()) } else { Err(Error::InvalidArgument(format!("example check failed: {}", what()))) }
}

/// Deterministic bytes for rank `r`.
fn rank_bytes(r: usize, n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 131 + r * 17 + (i >> 9)) % 251) as u8).collect()
}

pub mod ring {
    //! The ring pattern: every rank puts its buffer into the next rank's window slot, then
    //! all meet at an LSA barrier; each rank then holds the previous rank's buffer.
    use super::*;
    use ferrolink_device::kernels::lsa::lsa_ring_exchange;

    /// One rank's program: puts `bytes` bytes into the next LSA rank's slot and checks that
    /// its own slot holds the previous rank's. Returns a one-line summary.
    pub fn rank(comm: &Communicator, bytes: usize) -> Result<String> {
        let dev = comm.device();
        // Host work first: once the collective below returns, peers may already run kernels
        // that wait for this rank's.
        let src = dev.alloc_from(&rank_bytes(comm.rank(), bytes))?;
        let module = dev.builtin_module()?;
        let (window, handle) = window_and_dev_comm(comm, bytes)?;
        let (r, n) = (comm.lsa_rank(), comm.lsa_size());
        // SAFETY: the kernel's contract: the source and the window slots hold `bytes` bytes;
        // at most 8 CTAs use 8 of the 32 barriers; every rank launches the same grid. The
        // handles are tracked: they outlive the kernel whatever is dropped.
        unsafe {
            comm.stream().launch(
                module,
                &lsa_ring_exchange,
                LaunchConfig::linear(grid_ctas(dev, 8), block_threads(dev)),
                (&handle, &window, &src, bytes),
            )?;
        }
        comm.synchronize()?;
        let from = comm.rank() - r + (r + n - 1) % n;
        let got: Vec<u8> = window.read(0, bytes)?;
        check(got == rank_bytes(from, bytes), || format!("rank {} does not hold rank {from}'s buffer", comm.rank()))?;
        // No rank may free its window while a peer's kernel could still write into it: the
        // kernels have ended, but peers in other processes are ordered only by this barrier.
        comm.barrier()?;
        Ok(format!("ring: rank {} of {} received {bytes} bytes from rank {from}, verified", comm.rank(), comm.nranks()))
    }

    /// Runs the ring on `nranks` virtual ranks of `dev` with `bytes` per rank and checks every
    /// rank's window. Returns a one-line summary.
    pub fn run(dev: &Device, nranks: usize, bytes: usize) -> Result<String> {
        all_ranks(dev, nranks, |c| rank(c, bytes))?;
        Ok(format!("ring: {nranks} ranks each received {bytes} bytes from the previous rank, verified"))
    }
}

pub mod allreduce {
    //! One-shot all-reduce over LSA: every rank reads all peers' inputs straight from their
    //! window slots and sums them into its output.
    use super::*;
    use ferrolink_device::kernels::lsa::lsa_allreduce_sum_f32;

    fn input(r: usize, count: usize) -> Vec<f32> {
        rank_bytes(r, count).into_iter().map(|b| f32::from(b) - 125.0).collect()
    }

    /// One rank's program: sums `count` floats over the LSA domain and checks the result
    /// against the host's sum of every rank's input (small integers: exact).
    pub fn rank(comm: &Communicator, count: usize) -> Result<String> {
        let dev = comm.device();
        let mut out = dev.alloc::<f32>(count)?;
        let module = dev.builtin_module()?;
        let (window, handle) = window_and_dev_comm(comm, count * 4)?;
        window.copy_from_host(0, &input(comm.rank(), count))?;
        // Every rank's input is in place before any kernel reads it (the kernel's first
        // barrier orders device work; the host copies of other processes need this one).
        comm.barrier()?;
        // SAFETY: the kernel's contract: every slot holds `count` floats, `out` too; at most
        // 16 CTAs <= 32 barriers. All arguments are tracked handles.
        unsafe {
            comm.stream().launch(
                module,
                &lsa_allreduce_sum_f32,
                LaunchConfig::linear(grid_ctas(dev, 16), block_threads(dev)),
                (&handle, &window, &mut out, count),
            )?;
        }
        comm.synchronize()?;
        let inputs: Vec<Vec<f32>> = comm.lsa_peers().map(|p| input(p, count)).collect();
        let want: Vec<f32> = (0..count).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
        let got = out.to_vec()?;
        let bad = got.iter().zip(&want).position(|(a, b)| a != b);
        check(bad.is_none(), || format!("rank {}: wrong sum at element {bad:?}", comm.rank()))?;
        comm.barrier()?;
        Ok(format!("allreduce: rank {} of {} summed {count} floats, matches the host sum", comm.rank(), comm.nranks()))
    }

    /// Sums `count` floats over `nranks` virtual ranks and checks every rank's result.
    pub fn run(dev: &Device, nranks: usize, count: usize) -> Result<String> {
        all_ranks(dev, nranks, |c| rank(c, count))?;
        Ok(format!("allreduce: {nranks} ranks summed {count} floats, every rank matches the host sum"))
    }
}

pub mod fused {
    //! Fused compute and communication: a kernel computes `x * scale + rank` and stores each
    //! tile straight into the next rank's window, with no staging buffer or separate copy.
    use super::*;
    use ferrolink_device::kernels::lsa::{fused_value, lsa_fused_scale_put};

    fn input(r: usize, count: usize) -> Vec<f32> {
        (0..count).map(|i| (i % 1000) as f32 + r as f32).collect()
    }

    /// One rank's program: computes its tiles into the next LSA rank's slot and checks its
    /// own slot holds the previous rank's results.
    pub fn rank(comm: &Communicator, count: usize) -> Result<String> {
        let scale = 0.5f32;
        let dev = comm.device();
        let buf = dev.alloc_from(&input(comm.rank(), count))?;
        let module = dev.builtin_module()?;
        let (window, handle) = window_and_dev_comm(comm, count * 4)?;
        // SAFETY: the kernel's contract: input and window slots hold `count` floats; at most
        // 8 CTAs <= 32 barriers. All arguments are tracked handles.
        unsafe {
            comm.stream().launch(
                module,
                &lsa_fused_scale_put,
                LaunchConfig::linear(grid_ctas(dev, 8), block_threads(dev)),
                (&handle, &window, &buf, count, scale),
            )?;
        }
        comm.synchronize()?;
        let (r, n) = (comm.lsa_rank(), comm.lsa_size());
        let prev = comm.rank() - r + (r + n - 1) % n;
        let want: Vec<f32> = input(prev, count).iter().map(|&x| fused_value(x, scale, prev as u32)).collect();
        check(window.read::<f32>(0, count)? == want, || format!("rank {} holds wrong tiles", comm.rank()))?;
        comm.barrier()?;
        Ok(format!(
            "fused: rank {} computed {count} values straight into the next rank's window, verified",
            comm.rank()
        ))
    }

    /// Runs the fused kernel on `nranks` virtual ranks and checks each rank's window.
    pub fn run(dev: &Device, nranks: usize, count: usize) -> Result<String> {
        all_ranks(dev, nranks, |c| rank(c, count))?;
        Ok(format!("fused: {nranks} ranks computed {count} values each straight into the next rank's window, verified"))
    }
}

pub mod barrier {
    //! LSA barriers under stress: every CTA of every rank writes a value for this round into
    //! each peer's slot with plain stores, meets the others at its barrier, checks what the
    //! peers wrote, and meets them again before the next round overwrites, with random delays.
    use super::*;
    use ferrolink_device::kernels::lsa::lsa_barrier_stress;

    /// One rank's program: `rounds` stressed barrier rounds on `ctas` CTAs; checks that no
    /// CTA ever saw a stale value.
    pub fn rank(comm: &Communicator, ctas: u32, rounds: u32) -> Result<String> {
        let dev = comm.device();
        let n = comm.lsa_size();
        let mut errors = dev.alloc::<u32>(1)?;
        let module = dev.builtin_module()?;
        let (window, handle) = window_and_dev_comm(comm, ctas as usize * n * 4)?;
        let delay = if dev.backend() == ferrolink::Backend::Cuda { 2000u32 } else { 20_000 };
        // SAFETY: the kernel's contract: the window holds `ctas * lsa_size` words; `ctas` <= 32
        // barriers (checked on the device anyway); coop 0 (the CTA); `errors` one word.
        unsafe {
            comm.stream().launch(
                module,
                &lsa_barrier_stress,
                LaunchConfig::linear(ctas, block_threads(dev)),
                (&handle, &window, rounds, delay, 0u32, &mut errors),
            )?;
        }
        comm.synchronize()?;
        let bad = errors.to_vec()?[0];
        check(bad == 0, || format!("rank {} saw {bad} stale words", comm.rank()))?;
        comm.barrier()?;
        Ok(format!(
            "barrier: rank {} of {} passed {rounds} stressed rounds on {ctas} CTAs, no stale data",
            comm.rank(),
            comm.nranks()
        ))
    }
}

/// Device communicator requirements for the GIN examples: `contexts` contexts, 4 signals, 4
/// counters, one GIN barrier per context.
pub fn gin_requirements(contexts: u32) -> DevCommRequirements {
    DevCommRequirements {
        gin_context_count: contexts,
        gin_signal_count: 4,
        gin_counter_count: 4,
        gin_barrier_count: contexts,
        ..DevCommRequirements::default()
    }
}

pub mod gin_ping_pong {
    //! Put-with-signal ping-pong over GIN (NCCL's device API example): rank 0 puts a message
    //! into rank 1's window with SignalInc, rank 1 waits for the signal and answers the same
    //! way, `iters` times. GIN picks the path per peer: the direct backend for LSA peers,
    //! the proxy otherwise (`FERROLINK_GIN=proxy` forces it).
    use super::*;
    use ferrolink_device::kernels::gin::gin_ping_pong;

    /// One rank's program (every rank runs it; ranks 0 and 1 play): `iters` round trips of
    /// `bytes`-byte messages. Checks that the last message arrived intact on both sides and
    /// returns rank 0's one-way latency.
    pub fn rank(comm: &Communicator, bytes: usize, iters: u32) -> Result<String> {
        if comm.nranks() < 2 {
            return Err(Error::InvalidArgument("ping-pong needs two ranks or more".into()));
        }
        let dev = comm.device();
        let module = dev.builtin_module()?;
        let mut ns = dev.alloc::<u64>(1)?;
        let message = rank_bytes(comm.rank(), bytes);
        let src = comm.register_window(comm.mem_alloc(bytes)?)?;
        let dst = comm.register_window(comm.mem_alloc(bytes)?)?;
        src.copy_from_host(0, &message)?;
        let handle = comm.create_dev_comm(&gin_requirements(1))?;
        // SAFETY: the kernel's contract: both windows hold `bytes` bytes; signal 0 is the
        // kernel's (fresh device communicator: base 0); `ns` one word. Tracked handles keep
        // everything alive until it ends.
        unsafe {
            comm.stream().launch(
                module,
                &gin_ping_pong,
                LaunchConfig::linear(1, 1),
                (&handle, &dst, &src, 0u32, 1u32, bytes as u32, 10u32, iters, 0u64, &mut ns),
            )?;
        }
        comm.synchronize()?;
        let r = comm.rank();
        if r < 2 {
            let mut got = vec![0u8; bytes];
            dst.copy_to_host(0, &mut got)?;
            check(got == rank_bytes(1 - r, bytes), || format!("rank {r} holds a corrupt message"))?;
        }
        comm.barrier()?;
        let one_way_us = ns.to_vec()?[0] as f64 / f64::from(iters.max(1)) / 2.0 / 1e3;
        Ok(format!(
            "gin ping-pong: rank {r} of {}: {iters} round trips of {bytes} B{}",
            comm.nranks(),
            if r == 0 { format!(", {one_way_us:.2} us one way") } else { String::new() }
        ))
    }
}

pub mod all_to_all {
    //! All-to-all over GIN (NCCL's device API examples): every rank sends block `p` of its
    //! buffer to rank `p`. Plain: every block by a GIN put with a signal (the direct backend
    //! for LSA peers). Hybrid: LSA peers by plain stores into their mapped windows and an LSA
    //! barrier, the others by GIN, as a job spanning machines does.
    use super::*;
    use ferrolink_device::kernels::gin::gin_all_to_all;

    /// One rank's program: `rounds` all-to-alls of `bytes` bytes per peer, hybrid or not.
    /// Checks every received block.
    pub fn rank(comm: &Communicator, bytes: usize, rounds: u32, hybrid: bool) -> Result<String> {
        let dev = comm.device();
        let n = comm.nranks();
        let me = comm.rank();
        let module = dev.builtin_module()?;
        let block = |from: usize, to: usize| rank_bytes(from * 1000 + to, bytes);
        let send_data: Vec<u8> = (0..n).flat_map(|p| block(me, p)).collect();
        let send = comm.register_window(comm.mem_alloc(n * bytes)?)?;
        let recv = comm.register_window(comm.mem_alloc(n * bytes)?)?;
        send.copy_from_host(0, &send_data)?;
        let ctas = grid_ctas(dev, 4);
        let mut errors = dev.alloc::<u32>(1)?;
        let handle = comm.create_dev_comm(&gin_requirements(ctas))?;
        for round in 1..=rounds {
            // SAFETY: the kernel's contract: both windows hold `nranks * bytes` bytes; signal
            // 0 counts the blocks (`round` sets the target); LSA barrier `b` per CTA; `recv`
            // is read only after every rank's kernel has ended (the barrier below).
            unsafe {
                comm.stream().launch(
                    module,
                    &gin_all_to_all,
                    LaunchConfig::linear(ctas, block_threads(dev)),
                    (&handle, &recv, &send, bytes as u32, 0u32, round, u32::from(hybrid), &mut errors),
                )?;
            }
            comm.synchronize()?;
            check(errors.to_vec()?[0] == 0, || format!("rank {me}: a wait for blocks ended without them (aborted)"))?;
            comm.barrier()?;
        }
        let mut got = vec![0u8; n * bytes];
        recv.copy_to_host(0, &mut got)?;
        for p in 0..n {
            check(got[p * bytes..(p + 1) * bytes] == block(p, me), || {
                format!("rank {me}: block from rank {p} differs")
            })?;
        }
        comm.barrier()?;
        Ok(format!(
            "all-to-all{}: rank {me} of {n} received {rounds} x {n} blocks of {bytes} B, all intact ({} LSA domain(s))",
            if hybrid { " (hybrid: LSA inside the domain, GIN across)" } else { " (GIN)" },
            n / comm.lsa_size()
        ))
    }
}

pub mod work_queue {
    //! A persistent kernel with a batched atomic work queue, against a static split of the
    //! same skewed work. Reports how evenly each spreads busy time over CTAs.
    use super::*;
    use ferrolink_device::kernels::workqueue::{item_cost, item_work, persistent_work_queue};

    /// Busy-time spread of one run: the slowest CTA's time over the mean.
    #[derive(Clone, Copy, Debug)]
    pub struct Balance {
        /// Slowest CTA's busy nanoseconds over the mean.
        pub max_over_mean: f64,
        /// Kernel time in milliseconds (slowest CTA).
        pub max_ms: f64,
    }

    fn launch(dev: &Device, items: u32, static_split: u32) -> Result<Balance> {
        let (grid, threads) =
            if dev.backend() == ferrolink::Backend::Cuda { (dev.sm_count() * 2, 256) } else { (2, 64) };
        let stream = dev.create_stream()?;
        let mut next = dev.alloc::<u32>(1)?;
        let mut hits = dev.alloc::<u32>(items as usize)?;
        let mut sum = dev.alloc::<u32>(1)?;
        let mut cta_ns = dev.alloc::<u64>(grid as usize)?;
        // SAFETY: buffers sized per the kernel's contract; read (device-synchronously) below.
        unsafe {
            stream.launch(
                dev.builtin_module()?,
                &persistent_work_queue,
                LaunchConfig::linear(grid, threads),
                (
                    next.as_kernel_mut_ptr(),
                    items,
                    64,
                    static_split,
                    hits.as_kernel_mut_ptr(),
                    sum.as_kernel_mut_ptr(),
                    cta_ns.as_kernel_mut_ptr(),
                ),
            )?;
        }
        let h = hits.to_vec()?;
        let wrong = h.iter().position(|&x| x != 1);
        check(wrong.is_none(), || format!("item {wrong:?} was processed {} times", wrong.map_or(0, |i| h[i])))?;
        let want = (0..items).fold(0u32, |s, i| s.wrapping_add(item_work(i, item_cost(i))));
        check(sum.to_vec()?[0] == want, || "checksum differs from the host's".into())?;
        let ns = cta_ns.to_vec()?;
        let max = ns.iter().copied().max().unwrap_or(0) as f64;
        let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64;
        Ok(Balance { max_over_mean: max / mean.max(1.0), max_ms: max / 1e6 })
    }

    /// Runs `items` skewed items with the dynamic queue and with the static split; both are
    /// checked (every item exactly once, checksum). Returns (dynamic, static) balance.
    pub fn run(dev: &Device, items: u32) -> Result<(Balance, Balance)> {
        Ok((launch(dev, items, 0)?, launch(dev, items, 1)?))
    }
}

pub mod moe_fused {
    //! MoE with the experts' MLP fused into the combine. Every rank dispatches its tokens
    //! with their sources ([`Moe::dispatch_with_sources`](ferrolink::moe::Moe::dispatch_with_sources));
    //! then the expert kernel (`moe_expert_mlp_fused`, written on the public device API)
    //! computes `y = W2_e relu(W1_e x)` for each row an expert received and adds `weight * y`
    //! into the token's `f32` accumulator on the token's rank through the LSA mapping (for a
    //! token rank in another LSA domain, the row of `weight * y` goes back by a GIN put); then
    //! [`Moe::finish_fused`](ferrolink::moe::Moe::finish_fused) waits for every result and
    //! rounds the sums to bf16. Each rank checks its output against a host model, exactly:
    //! the values are chosen so that every `f32` sum is exact in any order.
    use super::*;
    use ferrolink::moe::{MoeConfig, bf16};
    use ferrolink_device::kernels::moe::moe_expert_mlp_fused;

    /// The shape of a run (the same on every rank).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Shape {
        /// The most tokens per rank (ranks have up to two fewer; rank 1 none in odd rounds).
        pub max_tokens: usize,
        /// Elements per token (a multiple of 8).
        pub hidden: usize,
        /// The experts' hidden layer.
        pub ffn: usize,
        /// Experts per rank.
        pub experts_per_rank: usize,
        /// Experts per token.
        pub top_k: usize,
        /// Rows per expert (`None`: room for every token).
        pub capacity: Option<usize>,
        /// Dispatches in a row.
        pub rounds: usize,
        /// Most tokens pick expert 0 first (a hot expert).
        pub skewed: bool,
        /// Odd rounds end with the plain combine instead (after the same dispatch with
        /// sources; each expert's result is then its row itself).
        pub mixed: bool,
    }

    impl Shape {
        /// A shape the emulator runs in a moment.
        pub fn small() -> Shape {
            Shape {
                max_tokens: 6,
                hidden: 32,
                ffn: 8,
                experts_per_rank: 2,
                top_k: 2,
                capacity: None,
                rounds: 3,
                skewed: false,
                mixed: false,
            }
        }

        /// A shape for a GPU.
        pub fn gpu() -> Shape {
            Shape { max_tokens: 256, hidden: 1024, ffn: 64, experts_per_rank: 4, top_k: 4, rounds: 4, ..Shape::small() }
        }
    }

    // Every rank builds every rank's inputs from the same seeds.
    use ferrolink::testing::splitmix64 as mix;

    /// One round's inputs of one rank.
    struct Inputs {
        tokens: usize,
        /// `tokens * hidden`: multiples of 1/2 in [-2, 2] (exact in bf16).
        x: Vec<f32>,
        /// `tokens * top_k` distinct experts.
        idx: Vec<i32>,
        /// `tokens * top_k`: multiples of 1/16 in (0, 1].
        weights: Vec<f32>,
    }

    fn inputs(s: &Shape, nranks: usize, rank: usize, round: usize) -> Inputs {
        let seed = mix((round as u64) << 32 ^ rank as u64);
        let tokens = if rank == 1 && round % 2 == 1 { 0 } else { s.max_tokens - (seed % 3) as usize };
        let experts = s.experts_per_rank * nranks;
        let x = (0..tokens * s.hidden).map(|i| (mix(seed ^ i as u64) % 9) as f32 / 2.0 - 2.0).collect();
        let mut idx = Vec::with_capacity(tokens * s.top_k);
        for t in 0..tokens {
            let mut z = mix(seed ^ 0xe0 ^ (t as u64) << 20);
            let mut chosen: Vec<i32> = Vec::new();
            while chosen.len() < s.top_k.min(experts) {
                z = mix(z);
                let e =
                    if s.skewed && chosen.is_empty() && !z.is_multiple_of(8) { 0 } else { (z % experts as u64) as i32 };
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            chosen.resize(s.top_k, -1);
            idx.extend(chosen);
        }
        let weights = (0..tokens * s.top_k).map(|i| ((mix(seed ^ 0x3e ^ i as u64) % 16) + 1) as f32 / 16.0).collect();
        Inputs { tokens, x, idx, weights }
    }

    /// Expert `e`'s weights: `W1[j][c]` and `W2[c][j]`, each -1, 0 or 1 (mostly 0).
    fn w1(e: usize, j: usize, c: usize) -> f32 {
        [1.0, -1.0, 0.0, 0.0][(mix((e as u64) << 40 ^ (j as u64) << 20 ^ c as u64) % 4) as usize]
    }
    fn w2(e: usize, c: usize, j: usize) -> f32 {
        [1.0, -1.0, 0.0, 0.0][(mix(0xa5 ^ (e as u64) << 40 ^ (c as u64) << 20 ^ j as u64) % 4) as usize]
    }

    /// The host model of expert `e` on one token row.
    fn expert(s: &Shape, e: usize, x: &[f32]) -> Vec<f32> {
        let h: Vec<f32> = (0..s.ffn).map(|j| (0..s.hidden).map(|c| w1(e, j, c) * x[c]).sum::<f32>().max(0.0)).collect();
        (0..s.hidden).map(|c| (0..s.ffn).map(|j| w2(e, c, j) * h[j]).sum()).collect()
    }

    /// One rank's program: `rounds` fused dispatch-expert-combine steps, each checked. Any
    /// LSA domains.
    pub fn rank(comm: &Communicator, s: Shape) -> Result<String> {
        let (n, me) = (comm.nranks(), comm.rank());
        let dev = comm.device();
        let experts = s.experts_per_rank * n;
        let cfg = MoeConfig {
            num_experts: experts,
            hidden: s.hidden,
            top_k: s.top_k,
            max_tokens: s.max_tokens,
            capacity: s.capacity,
        };
        // Host work first: this rank's experts' weights (W2 transposed: a warp reads a row).
        let (h, f) = (s.hidden, s.ffn);
        let mut w1s = Vec::with_capacity(s.experts_per_rank * f * h);
        let mut w2s = Vec::with_capacity(s.experts_per_rank * f * h);
        for l in 0..s.experts_per_rank {
            let e = me * s.experts_per_rank + l;
            for j in 0..f {
                w1s.extend((0..h).map(|c| w1(e, j, c)));
                w2s.extend((0..h).map(|c| w2(e, c, j)));
            }
        }
        let (w1_dev, w2_dev) = (dev.alloc_from(&w1s)?, dev.alloc_from(&w2s)?);
        let module = dev.builtin_module()?;
        let mut moe = comm.moe(cfg)?;
        moe.enable_fused()?;
        let cap = moe.capacity();
        let threads = block_threads(dev);
        let launch = LaunchConfig::linear(grid_ctas(dev, 4 * dev.sm_count().max(1)), threads)
            .with_shared_mem(threads / 32 * f as u32 * 4);
        let mut checked = 0;
        for round in 0..s.rounds {
            let all: Vec<Inputs> = (0..n).map(|r| inputs(&s, n, r, round)).collect();
            let mine = &all[me];
            let x: Vec<bf16> = mine.x.iter().map(|v| bf16::from_f32(*v)).collect();
            let (x, idx, w) = (dev.alloc_from(&x)?, dev.alloc_from(&mine.idx)?, dev.alloc_from(&mine.weights)?);
            let mut out = dev.alloc::<bf16>(mine.tokens * h)?;
            moe.dispatch_with_sources(&x, &idx, &w)?;
            let plain = s.mixed && round % 2 == 1;
            if plain {
                moe.combine(None, &w, &mut out)?;
            } else {
                let target = moe.fused_target()?;
                // SAFETY: the kernel's contract: this call's target and the Moe's device
                // communicator; `w1`/`w2` hold `experts_per_rank * ffn * hidden` f32 (tracked);
                // whole warps with `4 * ffn` bytes of shared memory each.
                unsafe {
                    comm.stream().launch(
                        module,
                        &moe_expert_mlp_fused,
                        launch,
                        (moe.dev_comm(), target, &w1_dev, &w2_dev, f as u32),
                    )?
                };
                moe.finish_fused(&mut out)?;
            }
            comm.synchronize()?;
            let got = out.to_vec()?;
            // The model: each entry's place in its expert's queue, in (rank, token, k) order:
            // past the capacity it is dropped.
            let mut queued = vec![0usize; experts];
            let mut want = vec![0f32; mine.tokens * h];
            for (r, inp) in all.iter().enumerate() {
                for (j, &e) in inp.idx.iter().enumerate() {
                    if e < 0 {
                        continue;
                    }
                    let place = queued[e as usize];
                    queued[e as usize] += 1;
                    if r != me || place >= cap {
                        continue;
                    }
                    let t = j / s.top_k;
                    let row = &inp.x[t * h..][..h];
                    let y = if plain { row.to_vec() } else { expert(&s, e as usize, row) };
                    for (acc, v) in want[t * h..][..h].iter_mut().zip(y) {
                        *acc += inp.weights[j] * v;
                    }
                }
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                check(*g == bf16::from_f32(*w), || {
                    format!(
                        "rank {me} round {round}: token {} channel {}: {g}, expected {}",
                        i / h,
                        i % h,
                        bf16::from_f32(*w)
                    )
                })?;
            }
            checked += mine.tokens;
        }
        // No rank may free its windows while a peer's kernel could still add into them.
        comm.barrier()?;
        Ok(format!(
            "moe_fused: rank {me} of {n}: {} rounds, {checked} tokens through {experts} fused MLP experts (hidden {h}, \
             ffn {f}, top-{}), verified",
            s.rounds, s.top_k
        ))
    }
}
