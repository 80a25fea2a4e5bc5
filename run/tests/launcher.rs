//! `ferrolink-run` end to end, with `/bin/sh -c` programs as the ranks.

use ferrolink::comm::bootstrap::UniqueId;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Output, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolink-run");

/// Variables of an outer launcher, which would make `ferrolink-run` refuse to start.
const OUTER: [&str; 4] = ["RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"];

/// `ferrolink-run` with `args`, with no outer launcher's variables.
fn launcher(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for var in OUTER {
        cmd.env_remove(var);
    }
    cmd
}

/// Runs `ferrolink-run ARGS /bin/sh -c SCRIPT`.
fn run_sh(args: &[&str], script: &str) -> Output {
    launcher(args).args(["/bin/sh", "-c", script]).output().expect("ferrolink-run starts")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The lines of `out` that rank `rank` wrote, without their prefix.
fn rank_lines(out: &str, rank: usize) -> Vec<String> {
    let prefix = format!("[rank {rank}] ");
    out.lines().filter_map(|l| l.strip_prefix(&prefix)).map(str::to_string).collect()
}

/// `KEY=value` words of a line.
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A fresh empty folder for a test's ranks to meet in (`touch $D/$RANK`, then count).
fn meeting_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrolink-run-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Shell text that waits until `n` ranks have touched their file in `dir`.
fn wait_for(dir: &std::path::Path, n: usize) -> String {
    format!(r#"while [ "$(ls {} | wc -l)" -lt {n} ]; do sleep 0.02; done"#, dir.display())
}

/// Whether process `pid` is gone (or a zombie that nothing will run again).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

#[test]
fn every_rank_gets_its_environment_and_the_same_unique_id() {
    let out = run_sh(
        &["-n", "3", "--backend", "cpu"],
        r#"echo "R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE D=$FERROLINK_DEVICE B=$FERROLINK_BACKEND MA=$MASTER_ADDR MP=$MASTER_PORT ID=$FERROLINK_UNIQUE_ID""#,
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "status {:?}\n{stdout}\n{}", out.status, text(&out.stderr));
    let mut ids = Vec::new();
    let mut master_ports = Vec::new();
    for rank in 0..3 {
        let lines = rank_lines(&stdout, rank);
        assert_eq!(lines.len(), 1, "rank {rank}: {stdout}");
        let f = fields(&lines[0]);
        let r = rank.to_string();
        assert_eq!((f["R"].as_str(), f["L"].as_str(), f["D"].as_str()), (r.as_str(), r.as_str(), r.as_str()));
        assert_eq!((f["W"].as_str(), f["LW"].as_str(), f["B"].as_str()), ("3", "3", "cpu"));
        assert_eq!(f["MA"], "127.0.0.1");
        master_ports.push(f["MP"].parse::<u16>().expect("MASTER_PORT is a port"));
        ids.push(f["ID"].clone());
    }
    assert!(ids.iter().all(|id| *id == ids[0]), "one unique id for the job: {ids:?}");
    assert!(master_ports.iter().all(|p| *p == master_ports[0] && *p != 0));
    let id = UniqueId::from_str(&ids[0]).expect("FERROLINK_UNIQUE_ID parses");
    assert_eq!(id.root().ip().to_string(), "127.0.0.1");
    assert_ne!(id.root().port(), master_ports[0], "the id's root and MASTER_PORT are different ports");
    assert_ne!(id.root().port(), 0);

    // A second job gets a fresh id.
    let again = text(&run_sh(&["-n", "1"], "echo ID=$FERROLINK_UNIQUE_ID").stdout);
    assert_ne!(fields(&rank_lines(&again, 0)[0])["ID"], ids[0]);
}

#[test]
fn ferrolinks_own_rank_overrides_are_not_inherited() {
    let out = launcher(&[
        "-n",
        "2",
        "/bin/sh",
        "-c",
        r#"echo "R=$RANK FR=${FERROLINK_RANK-unset} FN=${FERROLINK_NRANKS-unset}""#,
    ])
    .env("FERROLINK_RANK", "1")
    .env("FERROLINK_NRANKS", "7")
    .output()
    .unwrap();
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    for rank in 0..2 {
        assert_eq!(rank_lines(&stdout, rank), [format!("R={rank} FR=unset FN=unset")]);
    }
    assert!(text(&out.stderr).contains("ignoring FERROLINK_RANK=1"));
}

/// The ranks get the most CUDA stream queues unless the launcher's environment says how many.
#[test]
fn cuda_stream_queues_default_to_the_most_and_a_set_value_is_kept() {
    let script = r#"echo "Q=${CUDA_DEVICE_MAX_CONNECTIONS-unset}""#;
    let out =
        launcher(&["-n", "2", "/bin/sh", "-c", script]).env_remove("CUDA_DEVICE_MAX_CONNECTIONS").output().unwrap();
    assert!(out.status.success());
    for rank in 0..2 {
        assert_eq!(rank_lines(&text(&out.stdout), rank), ["Q=32"]);
    }
    let out = launcher(&["-n", "2", "/bin/sh", "-c", script]).env("CUDA_DEVICE_MAX_CONNECTIONS", "4").output().unwrap();
    assert!(out.status.success());
    for rank in 0..2 {
        assert_eq!(rank_lines(&text(&out.stdout), rank), ["Q=4"]);
    }
}

#[test]
fn devices_are_mapped_from_the_list_cyclically() {
    let out = run_sh(&["-n", "4", "--devices", "0,1"], "echo D=$FERROLINK_DEVICE");
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    let devices: Vec<String> = (0..4).map(|r| fields(&rank_lines(&stdout, r)[0])["D"].clone()).collect();
    assert_eq!(devices, ["0", "1", "0", "1"]);

    let out = run_sh(&["-n", "3", "--devices", "5,3,1,0"], "echo D=$FERROLINK_DEVICE");
    let stdout = text(&out.stdout);
    let devices: Vec<String> = (0..3).map(|r| fields(&rank_lines(&stdout, r)[0])["D"].clone()).collect();
    assert_eq!(devices, ["5", "3", "1"]);
}

#[test]
fn output_lines_are_prefixed_on_stdout_and_stderr() {
    let out = run_sh(&["-n", "2"], r#"printf 'one\ntwo\n'; echo "err $RANK" >&2; printf 'no newline'"#);
    assert!(out.status.success());
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    for line in stdout.lines().chain(stderr.lines()) {
        assert!(line.starts_with("[rank 0] ") || line.starts_with("[rank 1] "), "unprefixed line {line:?}");
    }
    for rank in 0..2 {
        assert_eq!(rank_lines(&stdout, rank), ["one", "two", "no newline"]);
        assert_eq!(rank_lines(&stderr, rank), [format!("err {rank}")]);
    }
    assert!(stdout.ends_with('\n'));
}

#[test]
fn lines_of_ranks_writing_at_once_never_mix() {
    // Each rank writes 200 long lines as fast as it can; every line must come out whole.
    let script = r#"i=0; while [ $i -lt 200 ]; do echo "$RANK-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx-end"; i=$((i+1)); done"#;
    let out = run_sh(&["-n", "4"], script);
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    for rank in 0..4 {
        let lines = rank_lines(&stdout, rank);
        assert_eq!(lines.len(), 200);
        for (i, l) in lines.iter().enumerate() {
            assert!(l.starts_with(&format!("{rank}-{i}-x")) && l.ends_with("x-end"), "mixed line {l:?}");
        }
    }
}

#[test]
fn arguments_reach_the_program_unchanged() {
    let out = launcher(&["-n", "1", "/bin/sh", "-c", r#"echo "$#:$1:$2:$3""#, "sh", "-n", "--timeout", "a b"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(rank_lines(&text(&out.stdout), 0), ["3:-n:--timeout:a b"]);
}

#[test]
fn all_ranks_succeeding_is_success() {
    let out = run_sh(&["-n", "4"], "exit 0");
    assert_eq!(out.status.code(), Some(0));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}

#[test]
fn a_failing_rank_ends_the_job_with_its_status_and_the_others_are_terminated() {
    // Rank 2 fails; the others would sleep forever (in a child process, so the whole group must
    // be signalled). They report their sleeper's pid first, and rank 2 waits for that.
    let dir = meeting_dir("failing");
    let script = format!(
        r#"if [ "$RANK" = 2 ]; then {}; echo bye; exit 3; fi; sleep 1000 & echo "pid=$!"; touch {}/$RANK; wait"#,
        wait_for(&dir, 3),
        dir.display()
    );
    let start = Instant::now();
    let out = run_sh(&["-n", "4", "--grace", "2"], &script);
    let elapsed = start.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(stderr.contains("ferrolink-run: rank 2 exited with status 3"), "{stderr}");
    assert!(elapsed < Duration::from_secs(2), "the others end at SIGTERM, not after the grace: {elapsed:?}");
    // The rank's own last line comes before the launcher's message about it.
    assert!(stdout.contains("[rank 2] bye"));
    for rank in [0, 1, 3] {
        let pid: i32 = fields(&rank_lines(&stdout, rank)[0])["pid"].parse().unwrap();
        let until = Instant::now() + Duration::from_secs(2);
        while !gone(pid) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(gone(pid), "rank {rank}'s sleeper {pid} still runs");
    }
}

#[test]
fn ranks_that_ignore_sigterm_are_killed_after_the_grace_period() {
    let dir = meeting_dir("ignoring");
    let script = format!(
        r#"if [ "$RANK" = 0 ]; then {}; exit 7; fi; trap '' TERM; touch {}/$RANK; sleep 1000"#,
        wait_for(&dir, 2),
        dir.display()
    );
    let start = Instant::now();
    let out = run_sh(&["-n", "3", "--grace", "1"], &script);
    let elapsed = start.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("rank 0 exited with status 7"), "{stderr}");
    assert!(stderr.contains("rank(s) 1, 2 still running 1 s after SIGTERM; sending SIGKILL"), "{stderr}");
    assert!(elapsed >= Duration::from_secs(1), "the grace period is kept: {elapsed:?}");
    assert!(elapsed < Duration::from_secs(4), "SIGKILL within the grace period: {elapsed:?}");
}

#[test]
fn a_rank_killed_by_a_signal_fails_the_job_with_status_1() {
    let out = run_sh(&["-n", "2", "--grace", "1"], r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; sleep 1000"#);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("ferrolink-run: rank 1 was killed by signal 9"), "{stderr}");
}

#[test]
fn the_timeout_ends_the_job_with_124_naming_the_ranks_still_running() {
    let start = Instant::now();
    let out =
        run_sh(&["-n", "3", "--timeout", "0.5", "--grace", "1"], r#"if [ "$RANK" = 1 ]; then exit 0; fi; sleep 1000"#);
    let elapsed = start.elapsed();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "{stderr}");
    assert!(stderr.contains("timed out after 0.5 s; rank(s) still running: 0, 2"), "{stderr}");
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");

    // A job that ends in time is not affected.
    let out = run_sh(&["-n", "2", "--timeout", "30"], "exit 0");
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn sigterm_to_the_launcher_is_forwarded_to_the_ranks() {
    let mut child = launcher(&["-n", "2", "--grace", "5"])
        .args(["/bin/sh", "-c", r#"trap 'echo got-term; exit 0' TERM; echo ready; sleep 1000 & wait"#])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    let mut ready = 0;
    while ready < 2 {
        let mut line = String::new();
        assert_ne!(stdout.read_line(&mut line).unwrap(), 0, "ranks print ready first: {seen}");
        ready += usize::from(line.ends_with("] ready\n"));
        seen.push_str(&line);
    }
    let start = Instant::now();
    // SAFETY: kill(2) on the launcher this test started; no memory is involved.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    stdout.read_to_string(&mut seen).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{seen}\n{stderr}");
    assert!(start.elapsed() < Duration::from_secs(3), "the ranks end at SIGTERM, not after the grace");
    assert!(stderr.contains("got SIGTERM"), "{stderr}");
    for rank in 0..2 {
        assert!(rank_lines(&seen, rank).contains(&"got-term".to_string()), "rank {rank}: {seen}");
    }
}

#[test]
fn under_another_launcher_it_refuses_with_status_2() {
    for (var, value) in [("RANK", "0"), ("WORLD_SIZE", "2"), ("SLURM_PROCID", "1"), ("OMPI_COMM_WORLD_RANK", "0")] {
        let out = launcher(&["-n", "2", "/bin/echo", "hi"]).env(var, value).output().unwrap();
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}: {stderr}");
        assert!(stderr.contains(var) && stderr.contains("directly under that launcher"), "{stderr}");
        assert!(out.stdout.is_empty(), "no rank started");
    }
}

#[test]
fn a_program_that_does_not_exist_fails_with_127() {
    let out = launcher(&["-n", "2", "/nonexistent/ferrolink-run-test-program"]).output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "{stderr}");
    assert!(stderr.contains("cannot start rank 0"), "{stderr}");
}
