//! Helpers shared by ferrolink's integration tests.

/// Deterministic pseudo-random bytes (splitmix64), different for each `seed`: tests never
/// check copies on zeros or on patterns a wrong index could reproduce.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    // splitmix64's stream: state advances by the golden gamma, each output is its mix.
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        out.extend_from_slice(&ferrolink::testing::splitmix64(state).to_le_bytes());
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    }
    out.truncate(n);
    out
}

/// Index of the first difference between two slices, for readable failures.
pub fn first_mismatch<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// `Ok(())` if `cond`, else an error carrying `what()`: device tests return errors from inside
/// `for_each_backend` bodies, which then fail naming the backend.
pub fn check(cond: bool, what: impl FnOnce() -> String) -> ferrolink::Result<()> {
    if cond { Ok(()) } else { Err(ferrolink::Error::InvalidArgument(format!("check failed: {}", what()))) }
}

/// The (ranks, LSA domain size) configurations a test across LSA domains runs: `default`, or
/// those of `FERROLINK_TEST_DOMAINS` (`4:2,3:1`): a focused run on the GPU takes one of them
/// alone. A value that does not parse is a test failure, not a silent default.
pub fn domain_configs(default: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let Ok(v) = std::env::var("FERROLINK_TEST_DOMAINS") else { return default.to_vec() };
    v.split(',')
        .map(|p| {
            let (n, d) = p.trim().split_once(':').unwrap_or_else(|| panic!("FERROLINK_TEST_DOMAINS: {p:?} is not N:D"));
            let parse = |x: &str| x.trim().parse::<usize>().unwrap_or_else(|_| panic!("FERROLINK_TEST_DOMAINS: {p:?}"));
            (parse(n), parse(d))
        })
        .collect()
}

pub mod jobs {
    //! Jobs of one process per rank for tests: every rank is a child process of the test
    //! binary running one test function (a "scenario"), finding the others through the TCP
    //! bootstrap. On the emulator in CI; on CUDA where present.

    use ferrolink::{Backend, Communicator, Device, UniqueId};
    use std::process::{Command, Output};

    /// Set in a child: which scenario it runs.
    pub const SCENARIO: &str = "FERROLINK_TEST_SCENARIO";

    /// The backend the children use: the emulator unless the suite runs on CUDA only.
    pub fn backend() -> Backend {
        match std::env::var("FERROLINK_TEST_BACKENDS").as_deref() {
            Ok("cuda") => Backend::Cuda,
            _ => Backend::Cpu,
        }
    }

    /// Starts `nranks` children running `scenario` (one test of this binary, `test`), ranks
    /// `ranks` only (the others never start), with a fresh unique id; returns each started rank's
    /// output.
    pub fn spawn_job(
        test: &str,
        scenario: &str,
        nranks: usize,
        ranks: &[usize],
        extra: &[(&str, &str)],
    ) -> Vec<(usize, Output)> {
        spawn_job_within(test, scenario, nranks, ranks, extra, job_limit())
    }

    /// [`spawn_job`], with the ranks still running after `limit` killed (their output says so).
    pub fn spawn_job_within(
        test: &str,
        scenario: &str,
        nranks: usize,
        ranks: &[usize],
        extra: &[(&str, &str)],
        limit: std::time::Duration,
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
                // As ferrolink-run sets for its ranks: the GIN proxy's copies then share no
                // hardware queue with a kernel waiting for them (host/src/gin/copy_watch.rs).
                if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
                    cmd.env("CUDA_DEVICE_MAX_CONNECTIONS", "32");
                }
                for (k, v) in extra {
                    cmd.env(k, v);
                }
                (r, cmd.spawn().expect("starting a rank process"))
            })
            .collect();
        let start = std::time::Instant::now();
        let outs = wait_for_ranks(children, limit);
        // Progress (shown with --nocapture): jobs on one GPU under MPS can take minutes.
        println!(
            "job {scenario} of {nranks} processes ({test}) ended in {:.1?}{}",
            start.elapsed(),
            if outs.iter().any(|(_, o)| o.status.code().is_none()) { ": some ranks were killed" } else { "" }
        );
        outs
    }

    /// How long a job may run before its ranks are killed: `FERROLINK_TEST_JOB_SECS`, else
    /// 600 s (a job that hangs must fail with its ranks' output, not hold the suite).
    fn job_limit() -> std::time::Duration {
        let secs = std::env::var("FERROLINK_TEST_JOB_SECS").ok().and_then(|v| v.trim().parse::<f64>().ok());
        std::time::Duration::from_secs_f64(secs.unwrap_or(600.0).max(1.0))
    }

    /// Waits for every child until `limit` has passed since the call, then kills those still
    /// running; each rank's output (read by threads as it comes, so that no child blocks on a
    /// full pipe), a note appended to the stderr of a killed one.
    fn wait_for_ranks(children: Vec<(usize, std::process::Child)>, limit: std::time::Duration) -> Vec<(usize, Output)> {
        use std::io::Read;
        fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut buf);
                }
                buf
            })
        }
        let deadline = std::time::Instant::now() + limit;
        let mut running: Vec<_> = children
            .into_iter()
            .map(|(r, mut c)| {
                let (out, err) = (drain(c.stdout.take()), drain(c.stderr.take()));
                (r, c, out, err)
            })
            .collect();
        let mut statuses: Vec<Option<std::process::ExitStatus>> = vec![None; running.len()];
        loop {
            for (i, (_, c, _, _)) in running.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    statuses[i] = c.try_wait().expect("a rank process");
                }
            }
            if statuses.iter().all(Option::is_some) || std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        running
            .drain(..)
            .zip(statuses)
            .map(|((r, mut c, out, err), status)| {
                let killed = status.is_none();
                let status = status.unwrap_or_else(|| {
                    let _ = c.kill();
                    c.wait().expect("a killed rank process")
                });
                let stdout = out.join().unwrap_or_default();
                let mut stderr = err.join().unwrap_or_default();
                if killed {
                    stderr.extend_from_slice(
                        format!("\n(killed: the job ran past {limit:?}; FERROLINK_TEST_JOB_SECS sets the limit)\n")
                            .as_bytes(),
                    );
                }
                (r, Output { status, stdout, stderr })
            })
            .collect()
    }

    /// Whether `n` processes can run here: always on the emulator; on CUDA with a GPU each, or
    /// with MPS running (several processes per GPU). Says why when not.
    pub fn fits(n: usize) -> bool {
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

    /// A child's stdout and stderr, for assertion messages.
    pub fn text(o: &Output) -> String {
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    }

    /// Runs `scenario` as a job of `n` processes and asserts every rank succeeded.
    pub fn job_passes(test: &str, scenario: &str, n: usize) {
        job_passes_with(test, scenario, n, &[]);
    }

    /// [`job_passes`] with `extra` variables set in every rank. On a failure the message holds
    /// the output of every rank that failed (the first to fail is often not rank 0: the
    /// others then time out waiting for it).
    pub fn job_passes_with(test: &str, scenario: &str, n: usize, extra: &[(&str, &str)]) {
        let outs = spawn_job(test, scenario, n, &(0..n).collect::<Vec<_>>(), extra);
        let failed: Vec<String> = outs
            .iter()
            .filter(|(_, out)| !out.status.success() || !text(out).contains("child scenario passed"))
            .map(|(r, out)| format!("--- rank {r} ({}):\n{}", out.status, text(out)))
            .collect();
        assert!(
            failed.is_empty(),
            "{scenario} on {n} processes {extra:?}: {} of {n} ranks failed:\n{}",
            failed.len(),
            failed.join("\n")
        );
    }

    /// In a child: runs `f` on this process's rank and reports; returns whether this process is
    /// a child (then the test function must return).
    pub fn child(f: impl FnOnce(&Communicator) -> ferrolink::Result<()>) -> bool {
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

    /// The scenario this child runs (empty in the parent).
    pub fn scenario() -> String {
        std::env::var(SCENARIO).unwrap_or_default()
    }
}

/// Runs `body` on `backend` when this process is the child started by [`run_child`] for
/// `test`; returns whether it did (the test then ends).
pub fn dev_in_child(
    test: &str,
    backend: ferrolink::Backend,
    body: impl Fn(&ferrolink::Device) -> ferrolink::Result<()>,
) -> bool {
    if std::env::var("FERROLINK_CHILD_TEST").as_deref() != Ok(test) {
        return false;
    }
    let dev = ferrolink::Device::open_with(backend, 0).expect("the child's device");
    if let Err(e) = body(&dev) {
        panic!("child failed: {e}");
    }
    true
}

/// Runs test `name` of this binary in a child process (for cases that break the CUDA
/// context) and returns its output; an error if the child failed.
pub fn run_child(name: &str) -> ferrolink::Result<String> {
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("FERROLINK_CHILD_TEST", name)
        .env("FERROLINK_LOG", "warn")
        .output()
        .expect("starting the child test process");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        Ok(text)
    } else {
        Err(ferrolink::Error::InvalidArgument(format!("child test {name} failed:\n{text}")))
    }
}
