//! One process per rank (issue 10): the examples' per-rank programs, splits, and failures at
//! init, with every rank a child process of this test binary that finds the others through
//! the TCP bootstrap and maps their memory through file descriptors. On the emulator in CI;
//! on CUDA where present (the child processes then need one GPU each, or MPS).

use ferrolink::Backend;
use ferrolink_tests::jobs::{child, fits, job_passes, scenario, spawn_job, spawn_job_within, text};
use std::time::{Duration, Instant};

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
/// A job that runs past its limit is killed, and its ranks' output says so: a test of jobs
/// fails with what the ranks printed instead of holding the suite (here rank 1 of 2 never
/// starts and the bootstrap would wait 60 s for it).
#[test]
fn a_job_past_its_limit_is_killed_with_its_output() {
    if child(|c| c.barrier()) {
        return;
    }
    let start = Instant::now();
    let outs = spawn_job_within(
        "a_job_past_its_limit_is_killed_with_its_output",
        "init",
        2,
        &[0],
        &[("FERROLINK_BOOTSTRAP_TIMEOUT", "60")],
        Duration::from_secs(2),
    );
    let took = start.elapsed();
    let t = text(&outs[0].1);
    assert!(!outs[0].1.status.success(), "rank 0 cannot pass without rank 1:\n{t}");
    assert!(t.contains("killed: the job ran past 2s"), "{t}");
    assert!(took < Duration::from_secs(30), "the kill took {took:?}");
}

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
