//! `ferrolink-run`: a launcher for one machine, like `mpirun -np` or nvshmrun.
//!
//! `ferrolink-run -n N [--devices LIST] [--backend cuda|cpu] [--timeout SECS] PROGRAM [ARGS...]`
//! starts N copies of PROGRAM, one per rank, each with the environment a launcher sets
//! (torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, and ferrolink's `FERROLINK_UNIQUE_ID`, `FERROLINK_DEVICE`; and
//! `CUDA_DEVICE_MAX_CONNECTIONS=32` unless set), prefixes every line
//! of their output with `[rank i] `, and ends the job when a rank fails. See
//! `docs/ferrolink-run.md`.

mod output;
mod signals;

use clap::{Parser, ValueEnum};
use ferrolink::comm::bootstrap::UniqueId;
use std::ffi::OsString;
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Variables that say the launcher itself is one rank of a job started by another launcher.
const OUTER_LAUNCHER_VARS: [(&str, &str); 4] =
    [("RANK", "torchrun"), ("WORLD_SIZE", "torchrun"), ("SLURM_PROCID", "srun"), ("OMPI_COMM_WORLD_RANK", "mpirun")];

/// ferrolink's own rank overrides, which `Communicator::from_env` reads before any launcher's:
/// one left in the launcher's environment would give every rank the same rank, so the ranks do
/// not inherit them.
const RANK_OVERRIDES: [&str; 4] =
    ["FERROLINK_RANK", "FERROLINK_NRANKS", "FERROLINK_LOCAL_RANK", "FERROLINK_LOCAL_NRANKS"];

/// Set for the ranks where the launcher's environment does not set it: the most hardware
/// queues the CUDA driver gives a context's streams (8 unless set). With fewer, the GIN
/// proxy's stream copies may share a queue with a kernel that waits for them, and never run
/// (host/src/gin/copy_watch.rs).
const STREAM_QUEUES: (&str, &str) = (ferrolink::runtime::CUDA_STREAM_QUEUES_VAR, "32");

/// Exit status when `--timeout` ran out (as timeout(1)).
const EXIT_TIMEOUT: i32 = 124;
/// Exit status for a usage error (clap's too).
const EXIT_USAGE: i32 = 2;
/// How often the supervisor looks at signals and deadlines while no rank exits.
const POLL: Duration = Duration::from_millis(20);
/// How long a rank's exit waits for the rest of its output (pipes that a process it left
/// behind still holds open must not hold up the job).
const OUTPUT_DRAIN: Duration = Duration::from_millis(500);

/// Starts one process per rank on this machine and supervises them.
#[derive(Parser, Debug)]
#[command(
    name = "ferrolink-run",
    version,
    override_usage = "ferrolink-run -n N [OPTIONS] PROGRAM [ARGS]...",
    about = "Starts N copies of PROGRAM on this machine, one per rank, with the variables a launcher sets; \
             prefixes their output with the rank and ends the job when a rank fails.",
    after_help = "Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, \
                  FERROLINK_UNIQUE_ID, FERROLINK_DEVICE (and FERROLINK_BACKEND with --backend). \
                  Exit status: 0 when every rank exits 0; the first failing rank's status (1 if it was \
                  killed by a signal); 124 on --timeout; 128+N when the launcher got signal N."
)]
struct Cli {
    /// Number of ranks (processes) to start.
    #[arg(short = 'n', long = "nprocs", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65536))]
    nprocs: u32,

    /// Device ordinals, comma-separated: rank i gets entry i mod the list's length
    /// (default: rank i gets device i).
    #[arg(long, value_name = "LIST", value_delimiter = ',', num_args = 1)]
    devices: Vec<usize>,

    /// Backend for the ranks (sets FERROLINK_BACKEND; default: what the environment says, else
    /// CUDA when a GPU is present, else the CPU emulator).
    #[arg(long, value_enum, value_name = "BACKEND")]
    backend: Option<BackendArg>,

    /// Ends the job after SECS seconds (exit status 124).
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    timeout: Option<Duration>,

    /// Seconds between SIGTERM and SIGKILL when the job is ended.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "5")]
    grace: Duration,

    /// The program to run, and its arguments.
    #[arg(value_name = "PROGRAM", required = true, num_args = 1.., trailing_var_arg = true)]
    command: Vec<OsString>,
}

/// `--backend`'s values.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum BackendArg {
    /// NVIDIA GPUs through the CUDA driver.
    Cuda,
    /// The CPU emulator.
    Cpu,
}

impl BackendArg {
    fn env_value(self) -> &'static str {
        match self {
            BackendArg::Cuda => "cuda",
            BackendArg::Cpu => "cpu",
        }
    }
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("`{s}` is not a number of seconds ≥ 0"))
}

fn main() {
    let cli = Cli::parse();
    let code = run(&cli);
    let _ = io::stdout().flush();
    std::process::exit(code);
}

/// Why the job is being ended early.
#[derive(Clone, Copy, Debug)]
enum Stop {
    /// A rank failed (or could not start): the launcher exits with this status.
    Failure(i32),
    /// `--timeout` ran out.
    Timeout,
    /// The launcher got this signal.
    Signal(i32),
}

impl Stop {
    fn exit_code(self) -> i32 {
        match self {
            Stop::Failure(code) => code,
            Stop::Timeout => EXIT_TIMEOUT,
            Stop::Signal(sig) => 128 + sig,
        }
    }
}

/// One rank's exit, reported by its waiter thread.
struct Exited {
    rank: usize,
    status: io::Result<ExitStatus>,
}

/// A rank while the supervisor knows it as running.
struct Rank {
    /// Its process id, also the id of its process group.
    pid: u32,
    /// Whether it has exited (its waiter reported).
    exited: bool,
    /// Whether the launcher sent its group SIGTERM (then its end is not reported as a failure).
    signalled: bool,
}

fn run(cli: &Cli) -> i32 {
    if let Some((var, launcher)) = OUTER_LAUNCHER_VARS.iter().find(|(var, _)| std::env::var_os(var).is_some()) {
        eprintln!(
            "ferrolink-run: {var} is set: this looks like a rank of a job started by {launcher} (or another launcher). \
             Run {} directly under that launcher instead of under ferrolink-run (or unset {var} if it is stale).",
            cli.command[0].to_string_lossy()
        );
        return EXIT_USAGE;
    }
    let env = match JobEnv::new() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("ferrolink-run: {e}");
            return 1;
        }
    };
    for var in RANK_OVERRIDES {
        if let Some(value) = std::env::var_os(var) {
            eprintln!(
                "ferrolink-run: ignoring {var}={} from the environment: each rank gets its own RANK, WORLD_SIZE, …",
                value.to_string_lossy()
            );
        }
    }
    signals::install();

    let nranks = cli.nprocs as usize;
    let (exit_tx, exit_rx) = mpsc::channel::<Exited>();
    let mut ranks: Vec<Rank> = Vec::with_capacity(nranks);
    let mut stop: Option<Stop> = None;
    for rank in 0..nranks {
        match spawn_rank(cli, &env, rank) {
            Ok((child, done)) => {
                ranks.push(Rank { pid: child.id(), exited: false, signalled: false });
                watch(rank, child, done, exit_tx.clone());
            }
            Err(e) => {
                eprintln!("ferrolink-run: cannot start rank {rank} ({}): {e}", cli.command[0].to_string_lossy());
                stop = Some(Stop::Failure(match e.kind() {
                    io::ErrorKind::NotFound => 127,
                    io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                }));
                break;
            }
        }
    }
    drop(exit_tx);
    supervise(cli, ranks, exit_rx, stop)
}

/// What every rank's environment shares.
struct JobEnv {
    master_port: u16,
    unique_id: String,
}

impl JobEnv {
    fn new() -> Result<JobEnv, String> {
        // Both ports are taken at once, so they differ; they are free again (for the ranks)
        // when the listeners close here. Another process could take one in between: the rank
        // that binds it then reports the address in use.
        let master = bind_outside_ephemeral_range()?;
        let root = bind_outside_ephemeral_range()?;
        let master_port = master.local_addr().map_err(|e| e.to_string())?.port();
        let root_port = root.local_addr().map_err(|e| e.to_string())?.port();
        let id = UniqueId::new(SocketAddr::from((Ipv4Addr::LOCALHOST, root_port)))
            .map_err(|e| format!("cannot make a unique id: {e}"))?;
        Ok(JobEnv { master_port, unique_id: id.to_string() })
    }
}

/// A listener on a free port below the kernel's ephemeral range when one is found there: a
/// port the launcher picks and releases must not be handed out again to an ephemeral bind
/// (a rank's own listener) before rank 0 binds it for the bootstrap's root.
fn bind_outside_ephemeral_range() -> Result<TcpListener, String> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32768);
    if low > 11_000 {
        // A pseudo-random start (the process id and the clock) so that launchers started
        // together do not all try the same ports.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let span = u32::from(low - 10_000);
        let mut port = 10_000 + ((std::process::id() ^ nanos) % span) as u16;
        for _ in 0..200 {
            if let Ok(l) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
                return Ok(l);
            }
            port = if port + 1 >= low { 10_000 } else { port + 1 };
        }
    }
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("no free port: {e}"))
}

/// The device ordinal of `rank`: its entry of `--devices` (cyclically), else the rank.
fn device_of(devices: &[usize], rank: usize) -> usize {
    if devices.is_empty() { rank } else { devices[rank % devices.len()] }
}

/// Starts `rank` with its output forwarded; the receiver disconnects when all of its output
/// has been forwarded.
fn spawn_rank(cli: &Cli, env: &JobEnv, rank: usize) -> io::Result<(Child, mpsc::Receiver<()>)> {
    let n = cli.nprocs.to_string();
    let mut cmd = Command::new(&cli.command[0]);
    cmd.args(&cli.command[1..])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", &n)
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", &n)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", env.master_port.to_string())
        .env("FERROLINK_UNIQUE_ID", &env.unique_id)
        .env("FERROLINK_DEVICE", device_of(&cli.devices, rank).to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: the launcher signals the rank and everything it started,
        // and a Ctrl-C at the terminal reaches the launcher alone (which forwards SIGTERM).
        .process_group(0);
    for var in RANK_OVERRIDES {
        cmd.env_remove(var);
    }
    if std::env::var_os(STREAM_QUEUES.0).is_none() {
        cmd.env(STREAM_QUEUES.0, STREAM_QUEUES.1);
    }
    if let Some(backend) = cli.backend {
        cmd.env("FERROLINK_BACKEND", backend.env_value());
    }
    #[cfg(target_os = "linux")]
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl(2),
    // which is async-signal-safe; it touches no memory of the parent's.
    unsafe {
        cmd.pre_exec(|| {
            // A launcher killed outright (SIGKILL, no chance to clean up) takes its ranks
            // with it. The spawning thread (main) lives as long as the launcher.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    output::forward(rank, stdout, output::Sink::Stdout, done_tx.clone());
    output::forward(rank, stderr, output::Sink::Stderr, done_tx);
    Ok((child, done_rx))
}

/// Starts the thread that waits for `rank` to exit and for its output to be forwarded (a
/// bounded time), then reports to the supervisor.
fn watch(rank: usize, mut child: Child, done: mpsc::Receiver<()>, tx: mpsc::Sender<Exited>) {
    thread::Builder::new()
        .name(format!("rank-{rank}-wait"))
        .spawn(move || {
            let status = child.wait();
            // Both forwarders drop their sender at end of file: wait for that, so the rank's last
            // lines come before the launcher's message about its exit.
            let _ = done.recv_timeout(OUTPUT_DRAIN);
            let _ = tx.send(Exited { rank, status });
        })
        .expect("a thread for the rank's waiter");
}

/// Sends `sig` to the process group of the rank with process id `pid`.
fn signal_group(pid: u32, sig: libc::c_int) {
    let Ok(pgid) = libc::pid_t::try_from(pid) else { return };
    // SAFETY: kill(2) has no memory-safety preconditions; the group is the rank's own (made by
    // `process_group(0)` at spawn), so nothing outside the job is signalled.
    unsafe { libc::kill(-pgid, sig) };
}

/// `ranks` as "0, 2, 3".
fn rank_list<'a>(ranks: impl Iterator<Item = &'a usize>) -> String {
    ranks.map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

/// How a failed rank ended, for the launcher's message, and the status it gives the job;
/// `None` if it succeeded.
fn failure(status: &io::Result<ExitStatus>) -> Option<(String, i32)> {
    match status {
        Ok(s) if s.success() => None,
        Ok(s) => match (s.code(), s.signal()) {
            (Some(code), _) => Some((format!("exited with status {code}"), code)),
            (None, Some(sig)) => {
                let core = if s.core_dumped() { ", core dumped" } else { "" };
                Some((format!("was killed by signal {sig} ({}{core})", signals::name(sig)), 1))
            }
            (None, None) => Some((format!("ended with {s}"), 1)),
        },
        Err(e) => Some((format!("could not be waited for: {e}"), 1)),
    }
}

fn supervise(cli: &Cli, mut ranks: Vec<Rank>, exits: mpsc::Receiver<Exited>, mut stop: Option<Stop>) -> i32 {
    let deadline = cli.timeout.map(|t| Instant::now() + t);
    let mut term_sent: Option<Instant> = None;
    let mut killed = false;

    let running = |ranks: &[Rank]| -> Vec<usize> { (0..ranks.len()).filter(|&r| !ranks[r].exited).collect() };
    let terminate = |ranks: &mut [Rank], term_sent: &mut Option<Instant>| {
        let targets = running(ranks);
        if !targets.is_empty() {
            eprintln!("ferrolink-run: terminating rank(s) {} (SIGTERM)", rank_list(targets.iter()));
        }
        for r in targets {
            ranks[r].signalled = true;
            signal_group(ranks[r].pid, libc::SIGTERM);
        }
        *term_sent = Some(Instant::now());
    };
    if stop.is_some() {
        terminate(&mut ranks, &mut term_sent);
    }

    while ranks.iter().any(|r| !r.exited) {
        match exits.recv_timeout(POLL) {
            Ok(Exited { rank, status }) => {
                ranks[rank].exited = true;
                if let Some((how, code)) = failure(&status)
                    && !ranks[rank].signalled
                {
                    eprintln!("ferrolink-run: rank {rank} {how}");
                    if stop.is_none() {
                        stop = Some(Stop::Failure(code));
                        terminate(&mut ranks, &mut term_sent);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }

        if let Some(sig) = signals::take() {
            if term_sent.is_none() {
                eprintln!("ferrolink-run: got {}; ending the job", signals::name(sig));
                stop = Some(Stop::Signal(sig));
                terminate(&mut ranks, &mut term_sent);
            } else if !killed {
                // A second Ctrl-C: no more grace.
                eprintln!(
                    "ferrolink-run: got {} again; killing rank(s) {}",
                    signals::name(sig),
                    rank_list(running(&ranks).iter())
                );
                kill_signalled(&ranks);
                killed = true;
            }
        }

        if let Some(d) = deadline
            && term_sent.is_none()
            && Instant::now() >= d
        {
            let still = running(&ranks);
            eprintln!(
                "ferrolink-run: timed out after {} s; rank(s) still running: {}",
                cli.timeout.unwrap_or_default().as_secs_f64(),
                rank_list(still.iter())
            );
            stop = Some(Stop::Timeout);
            terminate(&mut ranks, &mut term_sent);
        }

        if let Some(t) = term_sent
            && !killed
            && t.elapsed() >= cli.grace
        {
            let still = running(&ranks);
            if !still.is_empty() {
                eprintln!(
                    "ferrolink-run: rank(s) {} still running {} s after SIGTERM; sending SIGKILL",
                    rank_list(still.iter()),
                    cli.grace.as_secs_f64()
                );
            }
            // Also the groups of signalled ranks that exited: a process they started may
            // ignore SIGTERM (and hold their output open).
            kill_signalled(&ranks);
            killed = true;
        }
    }
    stop.map_or(0, Stop::exit_code)
}

/// SIGKILL to the process group of every rank the launcher sent SIGTERM.
fn kill_signalled(ranks: &[Rank]) {
    for r in ranks.iter().filter(|r| r.signalled) {
        signal_group(r.pid, libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_taken_cyclically_else_the_rank() {
        assert_eq!((0..4).map(|r| device_of(&[0, 1], r)).collect::<Vec<_>>(), [0, 1, 0, 1]);
        assert_eq!((0..3).map(|r| device_of(&[], r)).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!((0..3).map(|r| device_of(&[7], r)).collect::<Vec<_>>(), [7, 7, 7]);
    }

    #[test]
    fn command_lines_parse() {
        let cli =
            Cli::try_parse_from(["ferrolink-run", "-n", "4", "--devices", "0,1", "prog", "-n", "--x", "y"]).unwrap();
        assert_eq!(cli.nprocs, 4);
        assert_eq!(cli.devices, [0, 1]);
        assert_eq!(cli.command, ["prog", "-n", "--x", "y"]);
        assert_eq!(cli.grace, Duration::from_secs(5));
        assert!(cli.timeout.is_none());

        let cli =
            Cli::try_parse_from(["ferrolink-run", "-n2", "--timeout", "1.5", "--backend", "cpu", "--", "p"]).unwrap();
        assert_eq!(cli.timeout, Some(Duration::from_millis(1500)));
        assert!(matches!(cli.backend, Some(BackendArg::Cpu)));
        assert_eq!(cli.command, ["p"]);

        for bad in [
            &["ferrolink-run", "-n", "2"][..],
            &["ferrolink-run", "prog"],
            &["ferrolink-run", "-n", "0", "prog"],
            &["ferrolink-run", "-n", "2", "--backend", "tpu", "prog"],
            &["ferrolink-run", "-n", "2", "--timeout", "-1", "prog"],
            &["ferrolink-run", "-n", "2", "--devices", "a", "prog"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn failures_are_described() {
        assert!(failure(&Ok(ExitStatus::from_raw(0))).is_none());
        assert_eq!(failure(&Ok(ExitStatus::from_raw(3 << 8))).unwrap(), ("exited with status 3".to_string(), 3));
        let (how, code) = failure(&Ok(ExitStatus::from_raw(9))).unwrap();
        assert_eq!(how, "was killed by signal 9 (SIGKILL)");
        assert_eq!(code, 1);
    }
}
