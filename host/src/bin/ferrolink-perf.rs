//! `ferrolink-perf`: ferrolink's performance tool. Every figure is printed next to a
//! baseline measured in the same run, with the ratio.
//!
//! ```text
//! ferrolink-perf info
//! ferrolink-perf copy --sizes 256M,1G [--iters 20] [--trials 5] [--sweep]
//! ```
//! `--backend cpu|cuda` (or `FERROLINK_BACKEND`) picks the backend; the default is CUDA when
//! a GPU is present, else the CPU emulator (whose figures are not GPU figures).

use clap::{Parser, Subcommand};
use ferrolink::{Backend, Device, perf};

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
}

fn main() {
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
    let dev = Device::open_with(backend, cli.device)?;
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
        Command::Copy { mut sizes, iters, trials, sweep } => {
            if sizes.is_empty() {
                sizes = match dev.backend() {
                    Backend::Cuda => vec![256 << 20, 1 << 30],
                    Backend::Cpu => vec![64 << 20],
                };
            }
            let (iters, trials) =
                if dev.backend() == Backend::Cpu { (iters.min(3), trials.min(3)) } else { (iters, trials) };
            println!("{:>10}  {:>16}  {:>36}  {:>6}", "bytes", "baseline GB/s", "copy kernel GB/s", "ratio");
            for bytes in sizes {
                let r = perf::copy_bench(&dev, bytes, iters, trials, sweep)?;
                println!(
                    "{:>10}  {:>16.1}  {:>36}  {:>6.3}",
                    bytes,
                    r.baseline.gbps,
                    format!("{:.1} ({})", r.kernel.gbps, r.kernel.method),
                    r.ratio()
                );
                for f in &r.sweep {
                    println!(
                        "{:>10}  {:>16}  {:>36}  {:>6.3}",
                        "",
                        "",
                        format!("{:.1} ({})", f.gbps, f.method),
                        f.gbps / r.baseline.gbps
                    );
                }
            }
            println!(
                "(baseline: {}; GB/s = 10^9 bytes copied per second; medians of {trials} trials x {iters} copies)",
                if dev.backend() == Backend::Cuda { "cuMemcpyDtoDAsync" } else { "host memcpy on a CPU stream" }
            );
            Ok(())
        }
    }
}
