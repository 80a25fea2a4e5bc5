//! `ferrolink-perf`: ferrolink's performance tool. Every figure is printed next to a
//! baseline measured in the same run, with the ratio.
//!
//! ```text
//! ferrolink-perf info
//! ferrolink-perf copy --sizes 256M,1G [--iters 20] [--trials 5] [--sweep]
//! ferrolink-perf all_reduce -b 8 -e 256M -f 2 -d bf16 -o sum -n 20 -w 5 -c 1 [-g 2] [--json]
//! ferrolink-perf moe --tokens 4096 --hidden 7168 --experts 64 --top-k 8 -n 20 -w 5 [-g 2] [--json]
//! ferrolink-perf moe --low-latency --tokens 128 --hidden 7168 --experts 64 --top-k 8 [-g 2] [--json]
//! ```
//! `--backend cpu|cuda` (or `FERROLINK_BACKEND`) picks the backend; the default is CUDA when
//! a GPU is present, else the CPU emulator (whose figures are not GPU figures).

use clap::{Parser, Subcommand};
use ferrolink::{Backend, Device};
use ferrolink_benches::perf;

#[derive(Parser)]
#[command(name = "ferrolink-perf", about = "ferrolink benchmarks, each beside its baseline")]
struct Cli {
    /// Backend: cuda or cpu (default: CUDA when a GPU is present, else cpu).
    #[arg(long, global = true)]
    backend: Option<Backend>,
    /// Device ordinal.
    #[arg(long, global = true, default_value_t = 0)]
    device: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the device and backend.
    Info,
    /// Copy kernel vs the driver's device-to-device copy.
    Copy {
        /// Comma-separated sizes (e.g. 256M,1G). Default: 256M,1G on a GPU, 64M on the CPU.
        #[arg(long, value_delimiter = ',', value_parser = perf::parse_size)]
        sizes: Vec<usize>,
        /// Copies per timed trial.
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Trials per method (median reported).
        #[arg(long, default_value_t = 5)]
        trials: usize,
        /// Also time other launch shapes.
        #[arg(long)]
        sweep: bool,
    },
    /// LSA barrier latency at 2/4/8 virtual ranks x 1/8/32 CTAs, chosen scope vs `.sys`,
    /// with 32- and 256-thread CTAs, warp coops and relaxed sessions.
    Barrier {
        /// Timed rounds per measurement.
        #[arg(long, default_value_t = 20_000)]
        rounds: u32,
        /// Trials per figure (the median is shown).
        #[arg(long, default_value_t = 5)]
        trials: usize,
    },
    /// Device put into a peer's window slot vs the driver's copy to the same address.
    Put {
        /// Comma-separated sizes. Default: 256M on a GPU, 16M on the CPU.
        #[arg(long, value_delimiter = ',', value_parser = perf::parse_size)]
        sizes: Vec<usize>,
    },
    /// Ring pattern throughput (every rank puts to the next, then a barrier) vs driver copies.
    Ring {
        /// Bytes each rank sends. Default: 64M on a GPU, 1M on the CPU.
        #[arg(long, value_parser = perf::parse_size)]
        bytes: Option<usize>,
    },
    /// Latency of single primitives (fences, release stores, dependent loads, barriers),
    /// nanoseconds and SM cycles per instance.
    Latency,
    /// Host-side scale: create and drop N virtual ranks (communicator, a window, device
    /// communicators), each phase timed; init and teardown should grow linearly with N.
    Scale {
        /// Comma-separated rank counts.
        #[arg(long, value_delimiter = ',', default_value = "100,300,1000")]
        ranks: Vec<usize>,
    },
    /// Bootstrap over TCP loopback: N ranks (threads of this process) find each other,
    /// then one all-gather and one barrier; wall time of the whole.
    Bootstrap {
        /// Comma-separated rank counts.
        #[arg(long, value_delimiter = ',', default_value = "8,64")]
        ranks: Vec<usize>,
    },
    /// Two ranks on two devices: LSA barrier latency and put bandwidth between them. Alone it
    /// runs both ranks in this process (init_all over devices 0 and 1); under a launcher
    /// (`ferrolink-run -n 2 --devices 0,1 ferrolink-perf pair`) each process is one rank.
    Pair {
        /// Timed barrier rounds per trial.
        #[arg(long, default_value_t = 20_000)]
        rounds: u32,
        /// Bytes per put. Default: 256M on a GPU, 16M on the CPU.
        #[arg(long, value_parser = perf::parse_size)]
        bytes: Option<usize>,
        /// Trials (medians reported).
        #[arg(long, default_value_t = 5)]
        trials: usize,
    },
    /// GIN between ranks 0 and 1: put-with-signal ping-pong latency (8 bytes) and put
    /// bandwidth per path (direct, proxy + copy engine, proxy + TCP), beside the driver's copy
    /// into the peer's memory and a plain TCP copy of host data between the same two ranks.
    /// Alone it runs two ranks on devices 0 and 1 of this process (both on device 0, as
    /// virtual ranks, where there is no device 1); under a launcher
    /// (`ferrolink-run -n 2 --devices 0,1 ferrolink-perf gin`) each process is one rank.
    Gin {
        /// Comma-separated sizes. Default: 4K,64K,1M,16M,64M,256M on a GPU, 4K,64K,1M on the CPU.
        #[arg(long, value_delimiter = ',', value_parser = perf::parse_size)]
        sizes: Vec<usize>,
        /// Trials per figure (the median is shown).
        #[arg(long, default_value_t = 3)]
        trials: usize,
        /// Paths to measure (direct, ce, tcp). Default: all three.
        #[arg(long, value_delimiter = ',')]
        paths: Vec<String>,
        /// Threads of the bandwidth kernel's one CTA per rank.
        #[arg(long, default_value_t = 256)]
        threads: u32,
    },
    /// all_reduce in nccl-tests form (sizes, time, algbw, busbw, #wrong; out of place and in
    /// place; then the host's queuing time per call). Alone: one process over `-g` GPUs (all
    /// by default); under `ferrolink-run`: one process per rank.
    #[command(name = "all_reduce")]
    AllReduce(CollCli),
    /// all_gather in nccl-tests form.
    #[command(name = "all_gather")]
    AllGather(CollCli),
    /// reduce_scatter in nccl-tests form.
    #[command(name = "reduce_scatter")]
    ReduceScatter(CollCli),
    /// broadcast (root 0) in nccl-tests form.
    Broadcast(CollCli),
    /// reduce (root 0) in nccl-tests form.
    Reduce(CollCli),
    /// all_to_all in nccl-tests form.
    #[command(name = "all_to_all")]
    AllToAll(CollCli),
    /// sendrecv in nccl-tests form: each rank sends to the next and receives from the
    /// previous one in one group (busbw = algbw; -o is ignored).
    #[command(name = "sendrecv")]
    SendRecv(CollCli),
    /// MoE dispatch and combine (`ferrolink::moe`, identity experts) on every rank: microseconds
    /// per dispatch, per combine and per both, the bytes each sends to other ranks and GB/s,
    /// beside the driver's copy of the same bytes into the next rank's mapped memory (as
    /// `cudaMemcpyPeer`); one dispatch and combine checked (#wrong). Alone: one process over
    /// `-g` GPUs (all on CUDA, 2 on the emulator); under `ferrolink-run`: one process per rank.
    /// `--low-latency`: the same by `ferrolink::moe::MoeLowLatency`, plus the receive hook's
    /// halves (`dispatch_send` + `dispatch_recv`, `combine_send` + `combine_recv`) timed.
    Moe(MoeCli),
    /// Everything above with default settings (scale, bootstrap, pair and moe only by name).
    All,
}

/// `ferrolink-perf moe`'s options.
#[derive(clap::Args, Clone, Debug)]
struct MoeCli {
    /// Tokens per rank.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// bf16 elements per token (a multiple of 8).
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Experts in all (a multiple of the ranks).
    #[arg(long, default_value_t = 64)]
    experts: usize,
    /// Experts per token (distinct).
    #[arg(long = "top-k", default_value_t = 8)]
    top_k: usize,
    /// Timed iterations.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// GPUs in one process when not launched (default: every GPU on CUDA, 2 devices on the
    /// emulator).
    #[arg(short = 'g', long = "ngpus")]
    ngpus: Option<usize>,
    /// Ranks per GPU in one process (virtual ranks sharing each GPU; default 1).
    #[arg(long = "ranks-per-gpu", default_value_t = 1)]
    ranks_per_gpu: usize,
    /// The low-latency mode (`Communicator::moe_low_latency`, `max_tokens` = `--tokens`):
    /// adds the rows `dispatch_hook` and `combine_hook` (each call's send and receive halves
    /// back to back).
    #[arg(long = "low-latency")]
    low_latency: bool,
    /// Print one JSON line instead of the table.
    #[arg(long)]
    json: bool,
}

/// nccl-tests' options.
#[derive(clap::Args, Clone, Debug)]
struct CollCli {
    /// Smallest size (bytes; K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = perf::parse_size)]
    min_bytes: usize,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = perf::parse_size)]
    max_bytes: usize,
    /// Factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Element type: float, half, bfloat16, double, int32, int64, uint8, uint32 (or f32, f16, bf16,
    /// f64, i32, i64, u8, u32).
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    dtype: String,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: String,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u32,
    /// GPUs in one process (default: every device of the backend) when not launched.
    #[arg(short = 'g', long = "ngpus")]
    ngpus: Option<usize>,
    /// Ranks per GPU in one process (virtual ranks sharing each GPU; default 1).
    #[arg(long = "ranks-per-gpu", default_value_t = 1)]
    ranks_per_gpu: usize,
    /// Algorithm, where it applies: one_shot, two_shot (all-reduce inside one LSA domain),
    /// ring or hierarchical (all-reduce, reduce-scatter, all-gather across domains), tree
    /// (all-reduce across domains); default: the tuner's.
    #[arg(long)]
    algo: Option<String>,
    /// Protocol, where it applies: simple, or ll (one-shot inside one LSA domain, small
    /// messages; in persistent mode within the kernel's CTAs); default: the tuner's.
    #[arg(long)]
    proto: Option<String>,
    /// Print JSON lines instead of the table.
    #[arg(long)]
    json: bool,
    /// Run the collectives in persistent mode (each rank's persistent kernel takes them from
    /// its stream: no launch per call).
    #[arg(long)]
    persistent: bool,
    /// Inputs and outputs in plain device buffers instead of registered windows (the
    /// kernel stages the input into the communicator's window; in place: from the output).
    #[arg(long)]
    buffers: bool,
}

fn main() {
    // SAFETY: first thing in main, before this program starts any thread. (The GIN paths
    // measured here need the most stream queues, as ferrolink-run gives its ranks.)
    unsafe { ferrolink::runtime::set_most_cuda_stream_queues() };
    if let Err(e) = run(Cli::parse()) {
        eprintln!("ferrolink-perf: error: {e}");
        std::process::exit(1);
    }
}

fn open(cli: &Cli) -> ferrolink::Result<Device> {
    let backend = match cli.backend {
        Some(b) => b,
        None => Backend::from_env()?,
    };
    // Under a launcher the rank's device is the launcher's (FERROLINK_DEVICE, else the local rank).
    let ordinal = match ferrolink::comm::launch::LaunchEnv::detect()? {
        Some(env) => env.device_ordinal(),
        None => cli.device,
    };
    let dev = Device::open_with(backend, ordinal)?;
    println!("device: {} (backend {}, {} SMs)", dev.name(), dev.backend(), dev.sm_count());
    if dev.backend() == Backend::Cpu {
        println!("note: running on the CPU emulator; figures measure host threads, not a GPU");
    }
    Ok(dev)
}

fn run(cli: Cli) -> ferrolink::Result<()> {
    let dev = open(&cli)?;
    match cli.command {
        Command::Info => Ok(()),
        Command::Copy { sizes, iters, trials, sweep } => copy(&dev, sizes, iters, trials, sweep),
        Command::Barrier { rounds, trials } => barrier(&dev, rounds, trials),
        Command::Put { sizes } => put(&dev, sizes),
        Command::Ring { bytes } => ring(&dev, bytes),
        Command::Latency => latency(&dev),
        Command::Scale { ranks } => scale(&dev, &ranks),
        Command::Pair { rounds, bytes, trials } => pair(&dev, rounds, bytes, trials),
        Command::Gin { sizes, trials, paths, threads } => gin(&dev, sizes, trials, &paths, threads),
        Command::AllReduce(c) => coll(&dev, perf::BenchOp::Coll(ferrolink::coll::CollKind::AllReduce), c),
        Command::AllGather(c) => coll(&dev, perf::BenchOp::Coll(ferrolink::coll::CollKind::AllGather), c),
        Command::ReduceScatter(c) => coll(&dev, perf::BenchOp::Coll(ferrolink::coll::CollKind::ReduceScatter), c),
        Command::Broadcast(c) => coll(&dev, perf::BenchOp::Coll(ferrolink::coll::CollKind::Broadcast), c),
        Command::Reduce(c) => coll(&dev, perf::BenchOp::Coll(ferrolink::coll::CollKind::Reduce), c),
        Command::AllToAll(c) => coll(&dev, perf::BenchOp::Coll(ferrolink::coll::CollKind::AllToAll), c),
        Command::SendRecv(c) => coll(&dev, perf::BenchOp::SendRecv, c),
        Command::Moe(m) => moe(&dev, m),
        Command::Bootstrap { ranks } => {
            println!("\n== TCP bootstrap over loopback: init of N ranks (threads), one all-gather, one barrier");
            for n in ranks {
                let t = ferrolink::comm::bootstrap::tcp::bootstrap_bench(n)?;
                println!("{n:>5} ranks: {:.3} s", t.as_secs_f64());
            }
            println!("(target: 64 ranks in <= 1 s)");
            Ok(())
        }
        Command::All => {
            copy(&dev, Vec::new(), 20, 5, false)?;
            put(&dev, Vec::new())?;
            latency(&dev)?;
            barrier(&dev, if dev.backend() == Backend::Cuda { 20_000 } else { 200 }, 5)?;
            ring(&dev, None)
        }
    }
}

fn pair(dev: &Device, rounds: u32, bytes: Option<usize>, trials: usize) -> ferrolink::Result<()> {
    let bytes = bytes.unwrap_or(if gpu(dev) { 256 << 20 } else { 16 << 20 });
    let rounds = if gpu(dev) { rounds } else { rounds.min(200) };
    let figures = match ferrolink::comm::launch::LaunchEnv::detect()? {
        Some(_) => {
            let comm = ferrolink::Communicator::from_env(dev)?;
            vec![perf::pair_rank(&comm, rounds, bytes, trials)?]
        }
        None => {
            let other = Device::open_with(dev.backend(), dev.ordinal() + 1)?;
            let comms = ferrolink::Communicator::init_all(&[dev.clone(), other])?;
            ferrolink::run_ranks(&comms, |c| perf::pair_rank(c, rounds, bytes, trials))?
        }
    };
    let mode = if ferrolink::comm::launch::LaunchEnv::detect()?.is_some() {
        "one process per rank"
    } else {
        "one process, two devices"
    };
    for f in figures.into_iter().flatten() {
        println!("\n== pair ({mode}): ranks 0 and 1");
        println!(
            "LSA barrier, 1 CTA x 32 threads, acq_rel: {:.3} us per round (median of {trials} x {rounds} rounds)",
            f.barrier_us
        );
        println!(
            "put {} bytes into rank 1's slot: lsa_put {:.1} GB/s | {} to the same address {:.1} GB/s | ratio {:.3}",
            f.bytes,
            f.put_gbps,
            perf::driver_copy_name(dev),
            f.copy_gbps,
            f.put_gbps / f.copy_gbps
        );
    }
    Ok(())
}

fn gin(dev: &Device, sizes: Vec<usize>, trials: usize, paths: &[String], threads: u32) -> ferrolink::Result<()> {
    use perf::GinPath;
    let sizes = if !sizes.is_empty() {
        sizes
    } else if gpu(dev) {
        vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    } else {
        vec![4 << 10, 64 << 10, 1 << 20]
    };
    let paths: Vec<GinPath> = if paths.is_empty() {
        GinPath::ALL.to_vec()
    } else {
        paths
            .iter()
            .map(|p| match p.as_str() {
                "direct" => Ok(GinPath::Direct),
                "ce" => Ok(GinPath::ProxyCopyEngine),
                "tcp" => Ok(GinPath::ProxyTcp),
                other => {
                    Err(ferrolink::Error::InvalidArgument(format!("--paths: unknown path {other:?} (direct, ce, tcp)")))
                }
            })
            .collect::<ferrolink::Result<_>>()?
    };
    let launched = ferrolink::comm::launch::LaunchEnv::detect()?.is_some();
    let (figures, mode) = if launched {
        let comm = ferrolink::Communicator::from_env(dev)?;
        (vec![perf::gin_rank(&comm, &paths, &sizes, trials, threads)?], "one process per rank")
    } else {
        // With one GPU, the two ranks share it (virtual ranks): the proxy paths still go
        // through their transports, so their cost on a busy or idle GPU can be measured.
        let (other, mode) = match Device::open_with(dev.backend(), dev.ordinal() + 1) {
            Ok(other) => (other, "one process, two devices"),
            Err(_) => (dev.clone(), "one process, two virtual ranks on one device"),
        };
        let comms = ferrolink::Communicator::init_all(&[dev.clone(), other])?;
        (ferrolink::run_ranks(&comms, |c| perf::gin_rank(c, &paths, &sizes, trials, threads))?, mode)
    };
    for f in figures.into_iter().flatten() {
        println!("\n== gin ({mode}): rank 0 -> rank 1, median of {trials} trials");
        for (p, us) in &f.latency_us {
            println!("put-with-signal ping-pong, 8 B, {:>9}: {us:.2} us one way", p.name());
        }
        let mut head = format!("{:>10}", "bytes");
        for p in &paths {
            head += &format!("  {:>10}", p.name());
        }
        head += &format!("  {:>12}  {:>8}  {:>10}  {:>8}", "driver copy", "CE/copy", "plain TCP", "TCP/TCP");
        println!("put bandwidth, GB/s (1 CTA per rank):\n{head}");
        for b in &f.bandwidth {
            let (bytes, copy, tcp) = (b.bytes, b.copy_gbps, b.tcp_gbps);
            let get = |p: GinPath| b.by_path.iter().find(|(q, _)| *q == p).map(|(_, v)| *v);
            let mut line = format!("{bytes:>10}");
            for p in &paths {
                line += &format!("  {:>10.2}", get(*p).unwrap_or(f64::NAN));
            }
            let ratio = |v: Option<f64>, base: f64| v.map_or(f64::NAN, |v| v / base);
            line += &format!(
                "  {copy:>12.2}  {:>8.3}  {tcp:>10.2}  {:>8.3}",
                ratio(get(GinPath::ProxyCopyEngine), copy),
                ratio(get(GinPath::ProxyTcp), tcp)
            );
            println!("{line}");
        }
    }
    Ok(())
}

fn coll(dev: &Device, kind: perf::BenchOp, c: CollCli) -> ferrolink::Result<()> {
    use ferrolink::coll::{DataType as D, ReduceOp as O, algo, proto};
    let bad = |what: &str, v: &str| ferrolink::Error::InvalidArgument(format!("{what} {v:?} is not known"));
    let dtype = match c.dtype.as_str() {
        "float" | "f32" | "float32" => D::F32,
        "half" | "f16" | "float16" => D::F16,
        "bfloat16" | "bf16" => D::Bf16,
        "double" | "f64" | "float64" => D::F64,
        "int32" | "i32" | "int" => D::I32,
        "int64" | "i64" => D::I64,
        "uint8" | "u8" => D::U8,
        "uint32" | "u32" => D::U32,
        other => return Err(bad("-d", other)),
    };
    let op = match c.op.as_str() {
        "sum" => O::Sum,
        "prod" => O::Prod,
        "min" => O::Min,
        "max" => O::Max,
        "avg" => O::Avg,
        other => return Err(bad("-o", other)),
    };
    let forced = match c.algo.as_deref() {
        None => None,
        Some(name) => Some(algo::from_name(name).ok_or_else(|| bad("--algo", name))?),
    };
    let forced_proto = match c.proto.as_deref() {
        None => None,
        Some(name) => Some(proto::from_name(name).ok_or_else(|| bad("--proto", name))?),
    };
    let bench = perf::CollBench {
        kind,
        dtype,
        op,
        min_bytes: c.min_bytes,
        max_bytes: c.max_bytes,
        factor: c.factor,
        iters: c.iters,
        warmup: c.warmup,
        check: c.check != 0,
        algo: forced,
        proto: forced_proto,
        persistent: c.persistent,
        buffers: c.buffers,
    };
    let launched = ferrolink::comm::launch::LaunchEnv::detect()?.is_some();
    let (rows, n) = if launched {
        let comm = ferrolink::Communicator::from_env(dev)?;
        let n = comm.nranks();
        (perf::coll_rank(&comm, &bench)?, n)
    } else {
        let g = c.ngpus.unwrap_or_else(|| ferrolink::runtime::device_count(dev.backend()).unwrap_or(1).max(1));
        let k = c.ranks_per_gpu.max(1);
        // One `Device` per GPU, shared by its ranks (one module load per GPU).
        let gpus = (0..g).map(|i| Device::open_with(dev.backend(), i)).collect::<ferrolink::Result<Vec<_>>>()?;
        let devs: Vec<Device> = (0..g * k).map(|i| gpus[i / k].clone()).collect();
        let comms = ferrolink::Communicator::init_all(&devs)?;
        (ferrolink::run_ranks(&comms, |cm| perf::coll_rank(cm, &bench))?.into_iter().flatten().next(), g * k)
    };
    let Some(rows) = rows else { return Ok(()) };
    use ferrolink::coll::CollKind as K;
    let name = kind.name();
    let redop = match kind {
        perf::BenchOp::Coll(K::AllReduce | K::ReduceScatter | K::Reduce) => op.name(),
        _ => "none",
    };
    let root = if matches!(kind, perf::BenchOp::Coll(K::Broadcast | K::Reduce)) { "0" } else { "-1" };
    if c.json {
        for r in &rows {
            let (t, a, b, w) = r.out_of_place;
            let ip = r.in_place.map_or("null".to_string(), |(t, a, b)| {
                format!("{{\"time_us\":{t:.2},\"algbw\":{a:.2},\"busbw\":{b:.2}}}")
            });
            println!(
                "{{\"collective\":\"{name}\",\"nranks\":{n},\"bytes\":{},\"count\":{},\"type\":\"{}\",\"redop\":\"{redop}\",\"out_of_place\":{{\"time_us\":{t:.2},\"algbw\":{a:.2},\"busbw\":{b:.2},\"wrong\":{}}},\"in_place\":{ip},\"host_us\":{:.2}}}",
                r.bytes,
                r.count,
                dtype.name(),
                w.map_or("null".to_string(), |w| w.to_string()),
                r.host_us
            );
        }
        return Ok(());
    }
    let mode = match (c.persistent, c.buffers) {
        (false, false) => "",
        (true, false) => ", persistent",
        (false, true) => ", device buffers",
        (true, true) => ", persistent, device buffers",
    };
    println!("# ferrolink {name}: {n} ranks, {} ({:?}){mode}", dev.name(), dev.backend());
    println!("#                                                       out-of-place                       in-place");
    println!(
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw     host"
    );
    println!(
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)     (us)"
    );
    for r in &rows {
        let (t, a, b, w) = r.out_of_place;
        let ip =
            r.in_place.map_or("     N/A     N/A     N/A".to_string(), |(t, a, b)| format!("{t:8.2} {a:7.2} {b:7.2}"));
        println!(
            "{:12} {:13} {:>9} {:>7} {:>7} {t:8.2} {a:7.2} {b:7.2} {:>6} {ip} {:8.2}",
            r.bytes,
            r.count,
            dtype.name(),
            redop,
            root,
            w.map_or("N/A".to_string(), |w| w.to_string()),
            r.host_us
        );
    }
    let avg = rows.iter().map(|r| r.out_of_place.2).sum::<f64>() / rows.len().max(1) as f64;
    println!("# Avg bus bandwidth    : {avg:.3}");
    // With FERROLINK_HOST_PHASES=1: where the rank threads' time in the calls went (the
    // last timed loop's: in place, or out of place, at the largest size).
    for p in ferrolink::coll::host_phases().iter().filter(|p| p.calls > 0) {
        println!("# host phase {:>12}: {:9} calls, {:8.2} us per call", p.name, p.calls, p.mean_us());
    }
    if rows.iter().any(|r| r.out_of_place.3.is_some_and(|w| w > 0)) {
        return Err(ferrolink::Error::InvalidArgument(format!("{name}: wrong results (#wrong > 0)")));
    }
    Ok(())
}

fn moe(dev: &Device, m: MoeCli) -> ferrolink::Result<()> {
    let bench = perf::MoeBench {
        tokens: m.tokens,
        hidden: m.hidden,
        experts: m.experts,
        top_k: m.top_k,
        iters: m.iters,
        warmup: m.warmup,
        low_latency: m.low_latency,
    };
    let launched = ferrolink::comm::launch::LaunchEnv::detect()?.is_some();
    let (figures, launch) = if launched {
        let comm = ferrolink::Communicator::from_env(dev)?;
        (perf::moe_rank(&comm, &bench)?, "one process per rank".to_string())
    } else {
        let g = match m.ngpus {
            Some(g) => g.max(1),
            None if gpu(dev) => ferrolink::runtime::device_count(dev.backend()).unwrap_or(1).max(1),
            None => 2,
        };
        let k = m.ranks_per_gpu.max(1);
        // One `Device` per GPU, shared by its ranks (one module load per GPU).
        let gpus = (0..g).map(|i| Device::open_with(dev.backend(), i)).collect::<ferrolink::Result<Vec<_>>>()?;
        let devs: Vec<Device> = (0..g * k).map(|i| gpus[i / k].clone()).collect();
        let comms = ferrolink::Communicator::init_all(&devs)?;
        let f = ferrolink::run_ranks(&comms, |c| perf::moe_rank(c, &bench))?.into_iter().flatten().next();
        (f, format!("one process, {g} device(s) x {k} rank(s)"))
    };
    let Some(f) = figures else { return Ok(()) };
    let n = f.nranks;
    let bytes = f.remote_bytes();
    let mode = f.mode();
    let mut rows = vec![
        ("dispatch", f.dispatch_us, bytes),
        ("combine", f.combine_us, bytes),
        ("end_to_end", f.end_to_end_us, 2 * bytes),
    ];
    if let (Some(d), Some(c)) = (f.dispatch_hook_us, f.combine_hook_us) {
        rows.push(("dispatch_hook", d, bytes));
        rows.push(("combine_hook", c, bytes));
    }
    let copy_name = perf::driver_copy_name(dev);
    if m.json {
        let num = |v: Option<f64>| v.filter(|v| v.is_finite()).map_or("null".to_string(), |v| format!("{v:.3}"));
        let op = |&(_, us, b): &(&str, f64, usize)| {
            let g = perf::MoeFigures::gbps(b, us);
            format!("{{\"time_us\":{us:.2},\"bytes\":{b},\"gbps\":{},\"ratio\":{}}}", num(Some(g)), num(f.ratio(g)))
        };
        let peer = f.peer_copy.map_or("null".to_string(), |p| {
            format!(
                "{{\"method\":\"{copy_name}\",\"peer\":{},\"same_gpu\":{},\"bytes\":{},\"time_us\":{:.2},\"gbps\":{:.3}}}",
                p.peer,
                p.same_gpu,
                p.bytes,
                p.us,
                p.gbps()
            )
        });
        let hook = |i: usize| rows.get(i).map_or("null".to_string(), op);
        println!(
            "{{\"bench\":\"moe\",\"mode\":\"{mode}\",\"nranks\":{n},\"launch\":\"{launch}\",\"tokens\":{},\"hidden\":{},\"experts\":{},\"top_k\":{},\"iters\":{},\"warmup\":{},\"dispatch\":{},\"combine\":{},\"end_to_end\":{},\"dispatch_hook\":{},\"combine_hook\":{},\"peer_copy\":{peer},\"wrong\":{}}}",
            m.tokens,
            m.hidden,
            m.experts,
            m.top_k,
            m.iters,
            m.warmup,
            op(&rows[0]),
            op(&rows[1]),
            op(&rows[2]),
            hook(3),
            hook(4),
            f.wrong
        );
    } else {
        println!("# ferrolink moe: {n} ranks ({launch}), {} ({:?}), mode {mode}", dev.name(), dev.backend());
        println!(
            "# {} tokens x {} hidden bf16 per rank, top-{} of {} experts ({} per rank), identity experts; rank 0, mean \
             of {} iterations after {} warm-up; timed by events on the rank's stream",
            m.tokens,
            m.hidden,
            m.top_k,
            m.experts,
            m.experts / n.max(1),
            m.iters.max(1),
            m.warmup
        );
        match f.peer_copy {
            Some(p) => println!(
                "# peer copy: {copy_name} of {} B (what rank 0 dispatches to rank {}) into rank {}'s window, {}: {:.2} \
                 us, {:.2} GB/s",
                p.bytes,
                p.peer,
                p.peer,
                if p.same_gpu {
                    "on the same GPU (virtual ranks: a device-to-device copy on that GPU, not NVLink)"
                } else {
                    "its memory mapped here (as cudaMemcpyPeer)"
                },
                p.us,
                p.gbps()
            ),
            None => println!(
                "# peer copy: none (one rank, the next rank outside rank 0's LSA domain, or nothing sent to it): ratio N/A"
            ),
        }
        println!(
            "# {:>13} {:>10} {:>16} {:>9} {:>8} {:>7} {:>11}",
            "op", "time", "bytes to others", "GB/s", "ratio", "#wrong", "mode"
        );
        println!("# {:>13} {:>10} {:>16} {:>9} {:>8} {:>7} {:>11}", "", "(us)", "(B)", "", "(/copy)", "", "");
        for (i, &(name, us, b)) in rows.iter().enumerate() {
            let g = perf::MoeFigures::gbps(b, us);
            let ratio = f.ratio(g).map_or("N/A".to_string(), |r| format!("{r:.3}"));
            let wrong = if i == 2 { f.wrong.to_string() } else { "-".to_string() };
            println!("  {name:>13} {us:>10.2} {b:>16} {g:>9.2} {ratio:>8} {wrong:>7} {mode:>11}");
        }
        println!(
            "# bytes to others: rows of rank 0's entries whose expert is on another rank x {} B (combine: as many \
             back; end_to_end: both); #wrong: {} against the host model",
            f.row_bytes,
            if f.low_latency {
                "two dispatches and combines (one-kernel calls, then the halves)"
            } else {
                "one dispatch and combine"
            }
        );
        if f.low_latency {
            println!(
                "# low_latency: MoeLowLatency (max_tokens = tokens); dispatch_hook: dispatch_send + dispatch_recv \
                 back to back, combine_hook: combine_send + combine_recv (nothing queued between the halves)"
            );
        }
    }
    if f.wrong > 0 {
        return Err(ferrolink::Error::InvalidArgument(format!("moe: wrong results (#wrong {} > 0)", f.wrong)));
    }
    Ok(())
}

fn scale(dev: &Device, ranks: &[usize]) -> ferrolink::Result<()> {
    println!("\n== scale: N virtual ranks on one device, each phase timed (seconds)");
    println!(
        "{:>6}  {:>9}  {:>15}  {:>16}  {:>8}  {:>8}",
        "ranks", "init_all", "window (alloc+reg)", "create_dev_comms", "drop", "total"
    );
    for &n in ranks {
        let s = perf::scale_bench(dev, n)?;
        println!(
            "{n:>6}  {:>9.3}  {:>18.3}  {:>16.3}  {:>8.3}  {:>8.3}",
            s.init_all,
            s.window,
            s.dev_comms,
            s.drop,
            s.total()
        );
    }
    println!("(drop: every handle dropped and the retired memory freed; target: 1000 ranks in <= 5 s on the emulator)");
    Ok(())
}

fn gpu(dev: &Device) -> bool {
    dev.backend() == Backend::Cuda
}

fn barrier(dev: &Device, rounds: u32, trials: usize) -> ferrolink::Result<()> {
    let rounds = if gpu(dev) { rounds } else { rounds.min(200) };
    let trials = if gpu(dev) { trials } else { 1 };
    println!("\n== LSA barrier: microseconds per round (slowest CTA; median of {trials} trials of {rounds} rounds)");
    println!(
        "{:>6} {:>10} {:>14} {:>15} {:>7} {:>14} {:>11} {:>11}",
        "ranks", "CTAs/rank", "chosen scope", "baseline .sys", "ratio", "256-thr CTAs", "warp coop", "relaxed"
    );
    if let Some(mhz) = perf::sm_clock_mhz(dev)? {
        println!("(SM clock before the table: {mhz:.0} MHz)");
    }
    let ctas: &[u32] = if gpu(dev) { &[1, 8, 32] } else { &[1, 2] };
    for n in [2usize, 4, 8] {
        for &c in ctas {
            let f = perf::barrier_bench(dev, n, c, rounds, trials)?;
            println!(
                "{:>6} {:>10} {:>11.3} us {:>12.3} us {:>7.3} {:>11.3} us {:>8.3} us {:>8.3} us",
                f.nranks,
                f.ctas,
                f.us_per_round,
                f.us_per_round_sys,
                f.us_per_round / f.us_per_round_sys,
                f.us_per_round_256,
                f.us_per_round_warp,
                f.us_per_round_relaxed
            );
        }
    }
    println!(
        "(acquire-release sessions of a CTA coop in 32-thread CTAs at the chosen scope, .gpu as all virtual \
         ranks share the GPU; baseline: the same at .sys; ratio < 1 means faster than .sys; 256-thr CTAs: \
         the same with 8 warps per CTA; warp coop: CoopWarp sessions; relaxed: BarrierOrder::Relaxed, control \
         only)"
    );
    Ok(())
}

fn latency(dev: &Device) -> ferrolink::Result<()> {
    let iters = if gpu(dev) { 10_000 } else { 100 };
    let mhz = perf::sm_clock_mhz(dev)?;
    println!("\n== primitive latency: one warp, {iters} back-to-back instances, median of 5 trials");
    if let Some(m) = mhz {
        println!("(SM clock: {m:.0} MHz)");
    }
    for (p, ns) in perf::primitive_latencies(dev, iters, 5)? {
        match mhz {
            Some(m) => println!("{:>28} {ns:>8.1} ns {:>8.0} cycles", p.ptx(), ns * m / 1e3),
            None => println!("{:>28} {ns:>8.1} ns", p.ptx()),
        }
    }
    Ok(())
}

fn put(dev: &Device, mut sizes: Vec<usize>) -> ferrolink::Result<()> {
    if sizes.is_empty() {
        sizes = vec![if gpu(dev) { 256 << 20 } else { 16 << 20 }];
    }
    let nranks = 8;
    println!("\n== device put from rank 0 into rank 1's window slot ({nranks} virtual ranks)");
    for bytes in sizes {
        let r = perf::put_bench(dev, nranks, bytes, if gpu(dev) { 20 } else { 2 }, if gpu(dev) { 7 } else { 2 })?;
        println!(
            "{bytes:>11} bytes: {} {:.1} GB/s | {} {:.1} GB/s | ratio {:.3}",
            r.baseline.method,
            r.baseline.gbps,
            r.kernel.method,
            r.kernel.gbps,
            r.ratio()
        );
    }
    Ok(())
}

fn ring(dev: &Device, bytes: Option<usize>) -> ferrolink::Result<()> {
    let bytes = bytes.unwrap_or(if gpu(dev) { 64 << 20 } else { 1 << 20 });
    println!("\n== ring pattern: each rank puts {bytes} bytes to the next, then an LSA barrier");
    for n in [2usize, 4, 8] {
        let r = perf::ring_bench(dev, n, bytes, if gpu(dev) { 20 } else { 2 }, if gpu(dev) { 5 } else { 1 })?;
        println!(
            "{n} ranks: {} {:.1} GB/s | {} {:.1} GB/s | ratio {:.3}",
            r.baseline.method,
            r.baseline.gbps,
            r.kernel.method,
            r.kernel.gbps,
            r.ratio()
        );
    }
    println!("(aggregate bytes moved by all ranks per second, wall clock, launches included)");
    Ok(())
}

fn copy(dev: &Device, mut sizes: Vec<usize>, iters: usize, trials: usize, sweep: bool) -> ferrolink::Result<()> {
    if sizes.is_empty() {
        sizes = if gpu(dev) { vec![256 << 20, 1 << 30] } else { vec![64 << 20] };
    }
    let (iters, trials) = if gpu(dev) { (iters, trials) } else { (iters.min(3), trials.min(3)) };
    println!("\n== copy kernel vs the driver's device-to-device copy");
    println!("{:>10}  {:>16}  {:>40}  {:>6}", "bytes", "baseline GB/s", "copy kernel GB/s", "ratio");
    for bytes in sizes {
        let r = perf::copy_bench(dev, bytes, iters, trials, sweep)?;
        let row = |gbps: f64, method: &str| format!("{gbps:.1} ({method})");
        println!(
            "{bytes:>10}  {:>16.1}  {:>40}  {:>6.3}",
            r.baseline.gbps,
            row(r.kernel.gbps, &r.kernel.method),
            r.ratio()
        );
        for f in &r.sweep {
            println!("{:>10}  {:>16}  {:>40}  {:>6.3}", "", "", row(f.gbps, &f.method), f.gbps / r.baseline.gbps);
        }
    }
    println!(
        "(baseline: {}; GB/s = 10^9 bytes copied per second; medians of {trials} trials x {iters} copies)",
        if gpu(dev) { "cuMemcpyDtoDAsync" } else { "host memcpy on a CPU stream" }
    );
    Ok(())
}
