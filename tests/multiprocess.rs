//! One process per rank (issue 10): the examples' per-rank programs, splits, and failures at
//! init, with every rank a child process of this test binary that finds the others through
//! the TCP bootstrap and maps their memory through file descriptors. On the emulator in CI;
//! on CUDA where present (the child processes then need one GPU each, or MPS).

use ferrolink::{Backend, Communicator, Device, UniqueId};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Set in a child: which scenario it runs.
const SCENARIO: &str = "FERROLINK_TEST_SCENARIO";

/// The backend the children use: the emulator unless the suite runs on CUDA only.
fn backend() -> Backend {
    match std::env::var("FERROLINK_TEST_BACKENDS").as_deref() {
        Ok("cuda") => Backend::Cuda,
        _ => Backend::Cpu,
    }
}

/// Starts `nranks` children running `scenario` (one test of this binary, `test`), ranks
/// `ranks` only (the others never start), with a fresh unique id; returns each started rank's
/// output.
fn spawn_job(
    test: &str,
    scenario: &str,
    nranks: usize,
    ranks: &[usize],
    extra: &[(&str, &str)],
) -> Vec<(usize, Output)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let id = UniqueId::new(format!("127.0.0.1:{port}").parse().unwrap()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let devices = ferrolink::runtime::device_count(backend()).unwrap().max(1);
    let children: Vec<_> = ranks
        .iter()
        .map(|&r| {
            let mut cmd = Command::new(&exe);
            cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(SCENARIO, scenario)
                .env("FERROLINK_RANK", r.to_string())
                .env("FERROLINK_NRANKS", nranks.to_string())
                .env("FERROLINK_LOCAL_RANK", r.to_string())
                .env("FERROLINK_UNIQUE_ID", id.to_string())
                .env("FERROLINK_BACKEND", backend().to_string())
                .env(
                    "FERROLINK_DEVICE",
                    if backend() == Backend::Cuda { (r % devices).to_string() } else { "0".into() },
                )
                .env("FERROLINK_LOG", "warn")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            for (k, v) in extra {
                cmd.env(k, v);
            }
            (r, cmd.spawn().expect("starting a rank process"))
        })
        .collect();
    children.into_iter().map(|(r, c)| (r, c.wait_with_output().expect("a rank process"))).collect()
}

/// Whether `n` processes can run here: always on the emulator; on CUDA with a GPU each, or
/// with MPS running (several processes per GPU). Says why when not.
fn fits(n: usize) -> bool {
    if backend() == Backend::Cpu {
        return true;
    }
    let gpus = ferrolink::runtime::device_count(Backend::Cuda).unwrap_or(0);
    if gpus >= n {
        return true;
    }
    let dev = Device::open_with(Backend::Cuda, 0).expect("a GPU");
    match dev.check_multi_process() {
        Ok(()) => true,
        Err(e) => {
            println!("skipped: {n} processes on {gpus} GPU(s) need MPS: {e}");
            false
        }
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Runs `scenario` as a job of `n` processes and asserts every rank succeeded.
fn job_passes(test: &str, scenario: &str, n: usize) {
    for (r, out) in spawn_job(test, scenario, n, &(0..n).collect::<Vec<_>>(), &[]) {
        assert!(out.status.success(), "{scenario} on {n} processes: rank {r} failed:\n{}", text(&out));
        assert!(text(&out).contains("child scenario passed"), "rank {r} did not run the scenario:\n{}", text(&out));
    }
}

/// In a child: runs `f` on this process's rank and reports; returns whether this process is
/// a child (then the test function must return).
fn child(f: impl FnOnce(&Communicator) -> ferrolink::Result<()>) -> bool {
    if std::env::var(SCENARIO).is_err() {
        return false;
    }
    let env = ferrolink::comm::launch::LaunchEnv::detect().unwrap().expect("a child has a launcher environment");
    let dev = Device::open_with(backend(), env.device_ordinal()).expect("the child's device");
    let result = Communicator::from_env(&dev).and_then(|c| f(&c));
    match result {
        Ok(()) => println!("child scenario passed"),
        Err(e) => {
            eprintln!("child scenario failed: {e}");
            std::process::exit(3);
        }
    }
    true
}

fn scenario() -> String {
    std::env::var(SCENARIO).unwrap_or_default()
}

#[test]
fn examples_run_as_jobs_of_2_and_4_processes() {
    if child(|c| {
        let small = c.device().backend() == Backend::Cpu;
        match scenario().as_str() {
            "ring" => ferrolink_examples::ring::rank(c, if small { 100_003 } else { 16 << 20 }).map(drop),
            "allreduce" => ferrolink_examples::allreduce::rank(c, if small { 10_001 } else { 1 << 20 }).map(drop),
            "fused" => ferrolink_examples::fused::rank(c, 50_001).map(drop),
            "barrier" => ferrolink_examples::barrier::rank(c, 2, if small { 20 } else { 2000 }).map(drop),
            other => panic!("unknown scenario {other}"),
        }
    }) {
        return;
    }
    for n in [2, 4] {
        if !fits(n) {
            continue;
        }
        for s in ["ring", "allreduce", "fused", "barrier"] {
            job_passes("examples_run_as_jobs_of_2_and_4_processes", s, n);
        }
    }
}

/// Split into halves and into odd and even ranks; each part runs a barrier and a ring on its
/// own communicator, at the same time as the other part.
#[test]
fn split_halves_and_odd_even_ranks_each_run_their_own_barrier_and_ring() {
    if child(|c| {
        let color = match scenario().as_str() {
            "halves" => (c.rank() * 2 / c.nranks()) as u32,
            "parity" => (c.rank() % 2) as u32,
            other => panic!("unknown scenario {other}"),
        };
        let part = c.split(Some(color), c.rank() as i64)?.expect("every rank has a color");
        assert_eq!(part.nranks(), c.nranks() / 2);
        ferrolink_examples::barrier::rank(&part, 2, 10)?;
        ferrolink_examples::ring::rank(&part, 4099)?;
        // A rank passing no color gets nothing but takes part.
        let none = c.split(if c.rank() == 0 { None } else { Some(7) }, 0)?;
        assert_eq!(none.is_none(), c.rank() == 0);
        if let Some(n) = none {
            assert_eq!(n.nranks(), c.nranks() - 1);
            n.barrier()?;
        }
        Ok(())
    }) {
        return;
    }
    if !fits(4) {
        return;
    }
    for s in ["halves", "parity"] {
        job_passes("split_halves_and_odd_even_ranks_each_run_their_own_barrier_and_ring", s, 4);
    }
}

/// A rank that dies during init (here: never starts) makes the others fail within the
/// bootstrap timeout, with an error naming it; a job with a rank outside its range fails at
/// once with a clear error.
#[test]
fn a_rank_missing_at_init_is_named_by_the_others_within_the_timeout() {
    if child(|c| c.barrier()) {
        return;
    }
    let start = Instant::now();
    let outs = spawn_job(
        "a_rank_missing_at_init_is_named_by_the_others_within_the_timeout",
        "init",
        4,
        &[0, 1, 3],
        &[("FERROLINK_BOOTSTRAP_TIMEOUT", "3")],
    );
    let took = start.elapsed();
    for (r, out) in &outs {
        let t = text(out);
        assert!(!out.status.success(), "rank {r} must fail without rank 2:\n{t}");
        assert!(t.contains("rank 2"), "rank {r}'s error must name rank 2:\n{t}");
    }
    assert!(took < Duration::from_secs(20), "the ranks took {took:?} to give up");
    let outs = spawn_job(
        "a_rank_missing_at_init_is_named_by_the_others_within_the_timeout",
        "init",
        2,
        &[0],
        &[("FERROLINK_RANK", "5"), ("FERROLINK_BOOTSTRAP_TIMEOUT", "3")],
    );
    let t = text(&outs[0].1);
    assert!(!outs[0].1.status.success() && t.contains("outside 0..2"), "{t}");
}
