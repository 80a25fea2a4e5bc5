//! `ferrolink-perf` run as a program on the CPU emulator (the GPU figures come from the GPU
//! machine; here the subcommands must run to the end, check their results and print their
//! columns).

use std::process::{Command, Output};

/// Runs `ferrolink-perf` with `args` outside any launcher's environment (one process over its
/// own devices), on the CPU emulator.
fn perf(args: &[&str]) -> (Output, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrolink-perf"));
    cmd.args(args).env("FERROLINK_BACKEND", "cpu");
    // A launcher's variables would make the tool one rank of a job.
    for v in [
        "FERROLINK_RANK",
        "FERROLINK_NRANKS",
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ] {
        cmd.env_remove(v);
    }
    let out = cmd.output().expect("ferrolink-perf starts");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out, text)
}

const MOE_SMALL: [&str; 15] = [
    "moe",
    "--backend",
    "cpu",
    "--tokens",
    "64",
    "--hidden",
    "256",
    "--experts",
    "8",
    "--top-k",
    "2",
    "-n",
    "2",
    "-w",
    "1",
];

/// Checks the table of `ferrolink-perf moe` in `text` (two ranks): the header's columns, a
/// row per op in `ops` with positive times and bytes, a ratio to the peer copy baseline,
/// `mode` in every row, and #wrong 0.
fn check_moe_table(text: &str, ops: &[&str], mode: &str) {
    assert!(text.contains("# ferrolink moe: 2 ranks"), "two ranks by default on the emulator:\n{text}");
    assert!(text.contains(&format!("mode {mode}")), "the mode in the title:\n{text}");
    let header = text.lines().find(|l| l.contains("#wrong")).unwrap_or_else(|| panic!("no header:\n{text}"));
    for col in ["op", "time", "bytes to others", "GB/s", "ratio", "#wrong", "mode"] {
        assert!(header.contains(col), "column {col:?} missing from {header:?}");
    }
    assert!(text.contains("# peer copy: host memcpy (emulator) of"), "the baseline:\n{text}");
    for &op in ops {
        let row = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(op))
            .unwrap_or_else(|| panic!("no {op} row:\n{text}"));
        let f: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(f.len(), 7, "{op}: op, time, bytes, GB/s, ratio, #wrong, mode: {row:?}");
        assert_eq!(f[6], mode, "{op}: mode: {row:?}");
        let us: f64 = f[1].parse().unwrap_or_else(|_| panic!("{op} time {row:?}"));
        let bytes: usize = f[2].parse().unwrap_or_else(|_| panic!("{op} bytes {row:?}"));
        let ratio: f64 = f[4].parse().unwrap_or_else(|_| panic!("{op} ratio {row:?}"));
        // The emulator's figures are host threads: tiny GB/s, a ratio that rounds to 0.
        assert!(
            us > 0.0 && bytes > 0 && bytes.is_multiple_of(512) && ratio.is_finite() && ratio >= 0.0,
            "{op}: {row:?}"
        );
        if op == "end_to_end" {
            assert_eq!(f[5], "0", "#wrong: {row:?}");
        }
    }
}

/// `ferrolink-perf moe` with small shapes: two ranks (one process, two emulated devices), the
/// header's columns, a row per measurement with positive times and bytes, the peer copy
/// baseline and a ratio, mode `normal`, and #wrong 0.
#[test]
fn moe_subcommand_runs_on_the_cpu_emulator() {
    let (out, text) = perf(&MOE_SMALL);
    assert!(out.status.success(), "ferrolink-perf moe failed:\n{text}");
    check_moe_table(&text, &["dispatch", "combine", "end_to_end"], "normal");
    assert!(!text.contains("dispatch_hook"), "the hook rows are the low-latency mode's:\n{text}");
}

/// `ferrolink-perf moe --low-latency` with small shapes: the same table in mode
/// `low_latency` with the hook rows (`dispatch_send` + `dispatch_recv`, `combine_send` +
/// `combine_recv`), #wrong 0 over both checked rounds; then `--json` says the mode and has the
/// hook figures.
#[test]
fn moe_low_latency_runs_on_the_cpu_emulator() {
    let mut args = MOE_SMALL.to_vec();
    args.push("--low-latency");
    let (out, text) = perf(&args);
    assert!(out.status.success(), "ferrolink-perf moe --low-latency failed:\n{text}");
    check_moe_table(&text, &["dispatch", "combine", "end_to_end", "dispatch_hook", "combine_hook"], "low_latency");
    args.push("--json");
    let (out, text) = perf(&args);
    assert!(out.status.success(), "ferrolink-perf moe --low-latency --json failed:\n{text}");
    let line =
        text.lines().find(|l| l.starts_with("{\"bench\":\"moe\"")).unwrap_or_else(|| panic!("no JSON line:\n{text}"));
    for key in [
        "\"mode\":\"low_latency\"",
        "\"nranks\":2",
        "\"dispatch\":{",
        "\"end_to_end\":{",
        "\"dispatch_hook\":{\"time_us\":",
        "\"combine_hook\":{\"time_us\":",
        "\"peer_copy\":{",
        "\"wrong\":0}",
    ] {
        assert!(line.contains(key), "{key} missing from {line}");
    }
    assert!(!line.contains("NaN") && !line.contains("inf"), "{line}");
}

/// `ferrolink-perf moe --json` (normal mode): one line with the mode, every figure, `null`
/// for the hook rows and `"wrong":0`.
#[test]
fn moe_subcommand_prints_json() {
    let mut args = MOE_SMALL.to_vec();
    args.push("--json");
    let (out, text) = perf(&args);
    assert!(out.status.success(), "ferrolink-perf moe --json failed:\n{text}");
    let line =
        text.lines().find(|l| l.starts_with("{\"bench\":\"moe\"")).unwrap_or_else(|| panic!("no JSON line:\n{text}"));
    for key in [
        "\"mode\":\"normal\"",
        "\"nranks\":2",
        "\"dispatch\":{",
        "\"combine\":{",
        "\"end_to_end\":{",
        "\"dispatch_hook\":null",
        "\"peer_copy\":{",
        "\"wrong\":0}",
    ] {
        assert!(line.contains(key), "{key} missing from {line}");
    }
    assert!(!line.contains("NaN") && !line.contains("inf"), "{line}");
}
