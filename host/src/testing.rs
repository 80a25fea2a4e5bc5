//! Running one test body on every available backend.
//!
//! Device tests call [`for_each_backend`]: the body always runs on the CPU emulator, and on
//! CUDA when a driver and GPU are present. When CUDA is absent the helper prints why it
//! skipped; with `FERROLINK_REQUIRE_GPU=1` a missing GPU fails the test instead.
//! `FERROLINK_TEST_BACKENDS=cpu|cuda|all` (default `all`) narrows the set.
//!
//! ```
//! ferrolink::testing::for_each_backend("alloc_is_zeroed", |dev| {
//!     let b = dev.alloc::<u32>(8)?;
//!     assert_eq!(b.to_vec()?, vec![0; 8]);
//!     Ok(())
//! });
//! ```

use crate::{
    Backend, CommConfig, Communicator, DevCommHandle, DevCommRequirements, Device, Result, Window, create_dev_comms,
    register_window,
};

/// One step of splitmix64 (a 64-bit mixer with good avalanche): the deterministic
/// generator of the inputs of ferrolink's tests, examples and benchmarks, so that every rank
/// of a job can build every rank's inputs (and a host model) from the same seeds.
/// `benches/torch/moe_all_to_all.py` computes the same sequence.
///
/// ```
/// use ferrolink::testing::splitmix64;
/// assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
/// assert_ne!(splitmix64(1), splitmix64(2));
/// ```
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The backends a test should run on here, with the reason for any that is skipped.
///
/// ```
/// use ferrolink::testing::test_backends;
/// let (run, skipped) = test_backends();
/// // A backend is either run or skipped with a reason, never both.
/// for (backend, why) in &skipped {
///     assert!(!run.contains(backend) && !why.is_empty());
/// }
/// ```
pub fn test_backends() -> (Vec<Backend>, Vec<(Backend, String)>) {
    let wanted = std::env::var("FERROLINK_TEST_BACKENDS").unwrap_or_else(|_| "all".into()).to_ascii_lowercase();
    assert!(
        matches!(wanted.as_str(), "all" | "cpu" | "cuda"),
        "FERROLINK_TEST_BACKENDS={wanted:?}: use `all`, `cpu` or `cuda` (a test must not silently run nowhere)"
    );
    let mut run = Vec::new();
    let mut skipped = Vec::new();
    if wanted == "all" || wanted == "cpu" {
        run.push(Backend::Cpu);
    }
    if wanted == "all" || wanted == "cuda" {
        match Backend::Cuda.check_available() {
            Ok(()) => run.push(Backend::Cuda),
            Err(e) => skipped.push((Backend::Cuda, e.to_string())),
        }
    }
    (run, skipped)
}

/// Whether `FERROLINK_REQUIRE_GPU=1` is set.
///
/// ```
/// let required = ferrolink::testing::gpu_required();
/// assert_eq!(required, std::env::var("FERROLINK_REQUIRE_GPU").as_deref() == Ok("1"));
/// ```
pub fn gpu_required() -> bool {
    std::env::var("FERROLINK_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Runs `body` on device 0 of each backend from [`test_backends`]. Panics (failing the
/// test) if the body returns an error, or if CUDA is missing under `FERROLINK_REQUIRE_GPU=1`.
///
/// ```
/// use ferrolink::testing::{for_each_backend, test_backends};
/// let runs = std::cell::Cell::new(0);
/// for_each_backend("device_zero", |dev| {
///     assert_eq!(dev.ordinal(), 0);
///     runs.set(runs.get() + 1);
///     Ok(())
/// });
/// assert_eq!(runs.get(), test_backends().0.len());
/// ```
pub fn for_each_backend(test: &str, body: impl Fn(&Device) -> Result<()>) {
    let (run, skipped) = test_backends();
    for (backend, why) in skipped {
        if gpu_required() {
            panic!("{test}: FERROLINK_REQUIRE_GPU=1 but the {backend} backend is unavailable: {why}");
        }
        println!("{test}: skipped on {backend}: {why}");
    }
    for backend in run {
        let dev = Device::open_with(backend, 0).unwrap_or_else(|e| panic!("{test}: opening {backend} device: {e}"));
        if let Err(e) = body(&dev) {
            panic!("{test} failed on the {backend} backend: {e}");
        }
        println!("{test}: passed on {backend}");
    }
}

/// `nranks` virtual ranks on `dev`, each with a `window_bytes` window and a device
/// communicator made to `reqs`: the set-up of most multi-rank tests, examples and benches.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::{Backend, DevCommRequirements, Device, testing::virtual_job};
/// let dev = Device::open_with(Backend::Cpu, 0)?;
/// let (comms, windows, handles) = virtual_job(&dev, 2, 4096, &DevCommRequirements::default())?;
/// assert_eq!(comms.len(), 2);
/// assert_eq!((windows[1].rank(), windows[1].size()), (1, 4096));
/// assert_eq!(handles[1].rank(), 1);
/// # Ok(()) }
/// ```
pub fn virtual_job(
    dev: &Device,
    nranks: usize,
    window_bytes: usize,
    reqs: &DevCommRequirements,
) -> Result<(Vec<Communicator>, Vec<Window>, Vec<DevCommHandle>)> {
    virtual_job_with(dev, nranks, window_bytes, reqs, CommConfig::from_env(dev.backend())?)
}

/// [`virtual_job`] with explicit watchdog settings.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::{Backend, CommConfig, DevCommRequirements, Device, testing::virtual_job_with};
/// use std::time::Duration;
/// let dev = Device::open_with(Backend::Cpu, 0)?;
/// let config = CommConfig { timeout: Some(Duration::from_secs(5)), ..CommConfig::from_env(Backend::Cpu)? };
/// let (comms, _windows, _handles) = virtual_job_with(&dev, 2, 4096, &DevCommRequirements::default(), config)?;
/// assert_eq!(comms[0].config().timeout, Some(Duration::from_secs(5)));
/// # Ok(()) }
/// ```
pub fn virtual_job_with(
    dev: &Device,
    nranks: usize,
    window_bytes: usize,
    reqs: &DevCommRequirements,
    config: CommConfig,
) -> Result<(Vec<Communicator>, Vec<Window>, Vec<DevCommHandle>)> {
    let comms = Communicator::init_all_with(&vec![dev.clone(); nranks], config)?;
    let bufs = comms.iter().map(|c| c.mem_alloc(window_bytes)).collect::<Result<Vec<_>>>()?;
    let windows = register_window(&comms, bufs)?;
    let handles = create_dev_comms(&comms, reqs)?;
    Ok((comms, windows, handles))
}
