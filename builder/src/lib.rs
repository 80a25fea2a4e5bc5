//! # ferrolink-builder
//!
//! Turns a `no_std` device crate (ferrolink's own, or yours) into PTX with rustc's own
//! `nvptx64-nvidia-cuda` backend, from a build script:
//!
//! ```no_run
//! // build.rs of a host crate whose kernels live in ../my-kernels:
//! ferrolink_builder::PtxBuilder::new("../my-kernels").arch("sm_90").build_in_build_script("MY_KERNELS_PTX");
//! // in the host crate: const PTX: &str = include_str!(env!("MY_KERNELS_PTX"));
//! ```
//!
//! What it does, in order (docs/build-pipeline.md explains why):
//! 1. checks that the `nightly` toolchain and its `rust-src` component are installed;
//! 2. runs `cargo rustc --lib --release --target nvptx64-nvidia-cuda -Z build-std=core
//!    -- --emit=asm` under `rustup run nightly`, with
//!    `-Zunstable-options -Cpanic=immediate-abort -Ctarget-cpu=<arch>
//!    -Zcross-crate-inline-threshold=always -Ctarget-feature=+ptx86`, in its own target
//!    directory;
//! 3. rejects PTX that references an external function (`.extern .func`), except those in
//!    [`DEVICE_LIBRARY_FUNCTIONS`] (`vprintf`, `cudaGraphLaunch`)
//!    or has no `.entry`;
//! 4. if `ptxas` is found ([`find_ptxas`]: `FERROLINK_PTXAS`, `.tools/cuda/bin` above the
//!    crate, `PATH`, `$CUDA_HOME/bin`), assembles the PTX for the target and reports registers,
//!    stack and spills per kernel, warning on spills. The same text assembled by the same
//!    ptxas for the same arch is not assembled again while its cubin is there (ptxas takes
//!    minutes on a large module).

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why a PTX build failed. Each message names the fix.
///
/// ```
/// use ferrolink_builder::BuildError;
///
/// let e = BuildError::ExternFunctions {
///     crate_name: "my-kernels".into(),
///     names: vec!["_ZN4core9panicking5panic".into()],
/// };
/// assert!(e.to_string().contains("keep -Cpanic=immediate-abort"));
/// ```
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// `rustup` or the nightly toolchain is missing.
    #[error(
        "the nightly Rust toolchain is needed to compile device code to PTX, and `{0}` failed. \
         Install it with `rustup toolchain install nightly --profile minimal` \
         (or run scripts/setup.sh)"
    )]
    NoNightly(String),
    /// The nightly has no `rust-src` (needed by `-Z build-std=core`).
    #[error(
        "the nightly toolchain has no rust-src component (looked for {0}); `-Z build-std=core` \
         needs it. Install it with `rustup component add rust-src --toolchain nightly`"
    )]
    NoRustSrc(PathBuf),
    /// The nested cargo build failed.
    #[error("compiling device crate {crate_dir} for nvptx64 failed:\n{stderr}")]
    Compile {
        /// The device crate.
        crate_dir: PathBuf,
        /// The compiler's output.
        stderr: String,
    },
    /// The build succeeded but no `.s` file was found.
    #[error("the nvptx build of {0} produced no PTX (.s) file in {1}")]
    NoPtx(String, PathBuf),
    /// The PTX references functions the driver cannot resolve.
    #[error(
        "the PTX of {crate_name} references external functions the CUDA driver cannot link: \
         {names:?}. Usually a panic path (bounds check, unwrap, formatting) survived: keep \
         -Cpanic=immediate-abort in the flags, avoid panicking operations in device code, or use \
         unchecked accessors"
    )]
    ExternFunctions {
        /// The device crate's name.
        crate_name: String,
        /// The unresolved functions.
        names: Vec<String>,
    },
    /// A device function (`.func`) loads a parameter through a register: an address a kernel
    /// took of its own parameter (`kernel_param_address!`) used outside the kernel's body.
    #[error(
        "the PTX of {crate_name} loads parameters through a register in device functions {functions:?}: \
         there `ld.param` reads the function's own parameters, not the kernel's (garbage, then \
         faults). Code that reads a kernel parameter by its address (load_param_v2) must be \
         inlined into the kernel: mark every function between the entry and the load \
         #[inline(always)]"
    )]
    ParamLoadInFunction {
        /// The device crate's name.
        crate_name: String,
        /// The functions.
        functions: Vec<String>,
    },
    /// The PTX has no kernel entry point.
    #[error(
        "the PTX of {0} has no kernel entry (.entry): declare kernels with \
         ferrolink_device::kernel! (or `#[no_mangle] pub unsafe extern \"ptx-kernel\" fn`)"
    )]
    NoKernels(String),
    /// `ptxas` rejected the PTX.
    #[error("ptxas ({ptxas}) rejected the PTX for {arch}:\n{stderr}")]
    Ptxas {
        /// The ptxas binary.
        ptxas: PathBuf,
        /// Target architecture.
        arch: String,
        /// Its output.
        stderr: String,
    },
    /// Reading or writing a file, or starting a program, failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BuildError {
    let what = what.into();
    move |source| BuildError::Io { what, source }
}

/// Resource use of one kernel as reported by `ptxas -v`.
///
/// ```
/// use ferrolink_builder::KernelResources;
///
/// let k = KernelResources { name: "copy".into(), registers: 26, spill_store_bytes: 4, ..Default::default() };
/// // The builder warns about a kernel that spills either way.
/// assert!(k.spill_store_bytes > 0 || k.spill_load_bytes > 0);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// Entry name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes per thread.
    pub stack_bytes: u32,
    /// Bytes of register spill stores.
    pub spill_store_bytes: u32,
    /// Bytes of register spill loads.
    pub spill_load_bytes: u32,
}

/// The result of a PTX build.
///
/// ```no_run
/// // Runs cargo +nightly for the nvptx64 target (and ptxas when found): a real build.
/// let out = ferrolink_builder::PtxBuilder::new("../my-kernels").build()?;
/// let ptx = std::fs::read_to_string(&out.ptx_path).unwrap();
/// assert!(out.kernels.iter().all(|k| ptx.contains(k.as_str())));
/// if out.cubin_path.is_some() {
///     print!("{}", ferrolink_builder::resources_table(&out.resources));
/// }
/// # Ok::<(), ferrolink_builder::BuildError>(())
/// ```
#[derive(Clone, Debug)]
pub struct PtxOutput {
    /// The PTX file.
    pub ptx_path: PathBuf,
    /// The `.entry` names in it.
    pub kernels: Vec<String>,
    /// The cubin `ptxas` produced, when ptxas was found.
    pub cubin_path: Option<PathBuf>,
    /// Per-kernel resources from `ptxas -v`, when ptxas was found.
    pub resources: Vec<KernelResources>,
    /// Non-fatal findings (spills, no ptxas) to show the user.
    pub warnings: Vec<String>,
}

/// Builds one device crate to PTX. See the [crate docs](crate).
///
/// ```
/// use ferrolink_builder::PtxBuilder;
///
/// // Configuring builds nothing; `build` or `build_in_build_script` does.
/// let builder = PtxBuilder::new("../my-kernels").arch("sm_100").require_ptxas(true);
/// assert!(builder.rustflags().contains("-Ctarget-cpu=sm_100"));
/// ```
#[derive(Clone, Debug)]
pub struct PtxBuilder {
    crate_dir: PathBuf,
    arch: String,
    release: bool,
    target_dir: Option<PathBuf>,
    allowed_externs: Vec<String>,
    require_ptxas: bool,
}

impl PtxBuilder {
    /// A builder for the device crate at `crate_dir` (the folder with its Cargo.toml).
    ///
    /// ```
    /// let builder = ferrolink_builder::PtxBuilder::new("../my-kernels");
    /// assert!(builder.rustflags().contains("-Ctarget-cpu=sm_90"), "sm_90 by default");
    /// ```
    pub fn new(crate_dir: impl Into<PathBuf>) -> Self {
        PtxBuilder {
            crate_dir: crate_dir.into(),
            arch: "sm_90".into(),
            release: true,
            target_dir: None,
            allowed_externs: DEVICE_LIBRARY_FUNCTIONS.iter().map(|f| f.to_string()).collect(),
            require_ptxas: false,
        }
    }

    /// Target architecture (`-Ctarget-cpu`, `ptxas -arch`); default `sm_90`. Crates that use
    /// `ferrolink-device`'s barriers need `sm_90` or later (`fence.acquire`).
    ///
    /// ```
    /// let builder = ferrolink_builder::PtxBuilder::new("../my-kernels").arch("sm_100");
    /// assert!(builder.rustflags().contains("-Ctarget-cpu=sm_100"));
    /// ```
    pub fn arch(mut self, arch: impl Into<String>) -> Self {
        self.arch = arch.into();
        self
    }

    /// Build without `--release` (default is release).
    ///
    /// ```
    /// let builder = ferrolink_builder::PtxBuilder::new("../my-kernels").debug();
    /// assert!(format!("{builder:?}").contains("release: false"));
    /// ```
    pub fn debug(mut self) -> Self {
        self.release = false;
        self
    }

    /// The target directory of the nested build (default: `target/<profile>/ferrolink-ptx` of
    /// the outer build in a build script, else `<crate>/target/ferrolink-ptx`).
    ///
    /// ```
    /// let builder = ferrolink_builder::PtxBuilder::new("../my-kernels").target_dir("target/ptx");
    /// assert!(format!("{builder:?}").contains(r#"target_dir: Some("target/ptx")"#));
    /// ```
    pub fn target_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.target_dir = Some(dir.into());
        self
    }

    /// Fail when `ptxas` cannot be found (default: skip the assembly check with a warning).
    /// Also forced by the environment variable `FERROLINK_REQUIRE_PTXAS=1`.
    ///
    /// ```
    /// let builder = ferrolink_builder::PtxBuilder::new("../my-kernels").require_ptxas(true);
    /// assert!(format!("{builder:?}").contains("require_ptxas: true"));
    /// ```
    pub fn require_ptxas(mut self, yes: bool) -> Self {
        self.require_ptxas = yes;
        self
    }

    /// The RUSTFLAGS the nested build uses (they must reach `core` too, hence RUSTFLAGS and
    /// not `cargo rustc -- …`). `+ptx86` raises the PTX ISA version from LLVM's default for
    /// sm_90 (7.8) to 8.6, for `fence.acquire`/`fence.release` (CUDA 12.8; drivers ≥ 570 load it).
    ///
    /// ```
    /// let flags = ferrolink_builder::PtxBuilder::new("../my-kernels").arch("sm_90").rustflags();
    /// assert!(flags.contains("-Cpanic=immediate-abort") && flags.contains("-Ctarget-cpu=sm_90"));
    /// ```
    pub fn rustflags(&self) -> String {
        format!(
            "-Zunstable-options -Cpanic=immediate-abort -Ctarget-cpu={} \
             -Zcross-crate-inline-threshold=always -Ctarget-feature=+ptx86",
            self.arch
        )
    }

    /// Builds and checks the PTX. Returns where it is and what ptxas said.
    ///
    /// ```no_run
    /// // Runs cargo +nightly for the nvptx64 target, then ptxas when found.
    /// use ferrolink_builder::PtxBuilder;
    ///
    /// let out = PtxBuilder::new("device").arch("sm_90").target_dir("target/ptx").build()?;
    /// for w in &out.warnings {
    ///     eprintln!("warning: {w}");
    /// }
    /// println!("{} ({} kernels)", out.ptx_path.display(), out.kernels.len());
    /// # Ok::<(), ferrolink_builder::BuildError>(())
    /// ```
    pub fn build(&self) -> Result<PtxOutput, BuildError> {
        let crate_dir =
            self.crate_dir.canonicalize().map_err(io_err(format!("device crate {}", self.crate_dir.display())))?;
        check_toolchain()?;
        let target_dir = self.target_dir.clone().unwrap_or_else(|| default_target_dir(&crate_dir));
        let crate_name = crate_name(&crate_dir)?;

        let mut cmd = Command::new(rustup());
        cmd.args(["run", "nightly", "cargo", "rustc", "--lib", "--target", "nvptx64-nvidia-cuda"])
            .args(["-Z", "build-std=core"])
            .arg("--manifest-path")
            .arg(crate_dir.join("Cargo.toml"))
            .arg("--target-dir")
            .arg(&target_dir);
        if self.release {
            cmd.arg("--release");
        }
        cmd.args(["--", "--emit=asm"]);
        clean_cargo_env(&mut cmd);
        cmd.env("RUSTFLAGS", self.rustflags());
        let out = cmd.output().map_err(io_err("starting `rustup run nightly cargo`"))?;
        if !out.status.success() {
            return Err(BuildError::Compile { crate_dir, stderr: String::from_utf8_lossy(&out.stderr).into_owned() });
        }

        let profile = if self.release { "release" } else { "debug" };
        let deps = target_dir.join("nvptx64-nvidia-cuda").join(profile).join("deps");
        let ptx_path = newest_asm(&deps, &crate_name.replace('-', "_"))
            .ok_or_else(|| BuildError::NoPtx(crate_name.clone(), deps.clone()))?;
        let ptx = std::fs::read_to_string(&ptx_path).map_err(io_err(format!("reading {}", ptx_path.display())))?;

        let externs: Vec<String> =
            extern_functions(&ptx).into_iter().filter(|n| !self.allowed_externs.contains(n)).collect();
        if !externs.is_empty() {
            return Err(BuildError::ExternFunctions { crate_name, names: externs });
        }
        let functions = param_loads_in_functions(&ptx);
        if !functions.is_empty() {
            return Err(BuildError::ParamLoadInFunction { crate_name, functions });
        }
        let kernels = entries(&ptx);
        if kernels.is_empty() {
            return Err(BuildError::NoKernels(crate_name));
        }

        let mut output = PtxOutput { ptx_path, kernels, cubin_path: None, resources: Vec::new(), warnings: Vec::new() };
        let require = self.require_ptxas || std::env::var("FERROLINK_REQUIRE_PTXAS").is_ok_and(|v| v == "1");
        let search = PtxasSearch::run(&[crate_dir.as_path()]);
        output.warnings.extend(search.notes);
        match search.found {
            Some(ptxas) => {
                let cubin = output.ptx_path.with_extension("cubin");
                let log = assemble_cached(&ptxas, &self.arch, &output.ptx_path, &ptx, &cubin)?;
                output.resources = parse_ptxas_report(&log);
                for k in &output.resources {
                    if k.spill_store_bytes > 0 || k.spill_load_bytes > 0 {
                        output.warnings.push(format!(
                            "kernel {} spills registers: {} bytes stores, {} bytes loads ({} registers)",
                            k.name, k.spill_store_bytes, k.spill_load_bytes, k.registers
                        ));
                    }
                }
                output.cubin_path = Some(cubin);
            }
            None if require => {
                return Err(BuildError::Io {
                    what: "ptxas is required (FERROLINK_REQUIRE_PTXAS=1) but was not found".into(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, PTXAS_HOWTO),
                });
            }
            None => output.warnings.push(format!(
                "ptxas not found ({PTXAS_LOOKED_AT}): the PTX was not assembled for the target. \
                 {PTXAS_HOWTO}"
            )),
        }
        Ok(output)
    }

    /// Builds from a build script: prints `cargo:rerun-if-changed` for the device sources,
    /// `cargo:warning` for spills, a `cargo:rustc-env=<env_var>=<ptx path>` line so that the
    /// crate can `include_str!(env!("<env_var>"))`, and `<env_var>_CUBIN` when a cubin was made.
    /// On failure it prints the error and exits the build script with status 1.
    ///
    /// ```no_run
    /// // In build.rs's main: needs a build script's environment (OUT_DIR) and runs cargo +nightly.
    /// ferrolink_builder::PtxBuilder::new("../my-kernels").build_in_build_script("MY_KERNELS_PTX");
    /// // The crate then has: const PTX: &str = include_str!(env!("MY_KERNELS_PTX"));
    /// ```
    pub fn build_in_build_script(self, env_var: &str) -> PtxOutput {
        let mut builder = self;
        if builder.target_dir.is_none()
            && let Some(out_dir) = std::env::var_os("OUT_DIR")
        {
            // OUT_DIR is target/<profile>/build/<pkg>-<hash>/out: share one nested target
            // dir per profile so rebuilds are incremental.
            builder.target_dir = PathBuf::from(out_dir).ancestors().nth(3).map(|p| p.join("ferrolink-ptx"));
        }
        for dir in std::iter::once(builder.crate_dir.clone()).chain(path_dependencies(&builder.crate_dir)) {
            for path in source_files(&dir) {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
        println!("cargo:rerun-if-env-changed=FERROLINK_PTXAS");
        println!("cargo:rerun-if-env-changed=FERROLINK_REQUIRE_PTXAS");
        match builder.build() {
            Ok(out) => {
                for w in &out.warnings {
                    println!("cargo:warning={w}");
                }
                println!("cargo:rustc-env={env_var}={}", out.ptx_path.display());
                if let Some(cubin) = &out.cubin_path {
                    println!("cargo:rustc-env={env_var}_CUBIN={}", cubin.display());
                }
                out
            }
            Err(e) => {
                eprintln!("error: ferrolink-builder: {e}");
                for line in e.to_string().lines().take(1) {
                    println!("cargo:warning=ferrolink-builder: {line}");
                }
                std::process::exit(1);
            }
        }
    }
}

/// A readable table of per-kernel resources.
///
/// ```
/// use ferrolink_builder::{resources_table, KernelResources};
///
/// let copy = KernelResources { name: "copy".into(), registers: 26, ..Default::default() };
/// let table = resources_table(&[copy]);
/// assert!(table.starts_with("kernel"));
/// assert_eq!(table.lines().nth(1).unwrap().split_whitespace().collect::<Vec<_>>(), ["copy", "26", "0", "0", "0"]);
/// ```
pub fn resources_table(resources: &[KernelResources]) -> String {
    let mut s = String::from("kernel                               regs  stack  spill-st  spill-ld\n");
    for r in resources {
        let _ = writeln!(
            s,
            "{:<36} {:>4}  {:>5}  {:>8}  {:>8}",
            r.name, r.registers, r.stack_bytes, r.spill_store_bytes, r.spill_load_bytes
        );
    }
    s
}

fn rustup() -> PathBuf {
    if let Some(p) = std::env::var_os("RUSTUP") {
        return p.into();
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(p) = home.map(|h| h.join("bin").join("rustup")).filter(|p| p.exists()) {
        return p;
    }
    "rustup".into()
}

fn check_toolchain() -> Result<(), BuildError> {
    let out = Command::new(rustup())
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output()
        .map_err(|e| BuildError::NoNightly(format!("rustup run nightly rustc ({e})")))?;
    if !out.status.success() {
        return Err(BuildError::NoNightly(format!(
            "rustup run nightly rustc: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let core = sysroot.join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if !core.exists() {
        return Err(BuildError::NoRustSrc(core));
    }
    Ok(())
}

/// Removes what the outer cargo set for its build script, so that the nested build is a
/// plain nightly build of the device crate (its own toolchain, flags and target).
fn clean_cargo_env(cmd: &mut Command) {
    const KEEP: &[&str] = &["CARGO_HOME", "RUSTUP_HOME"];
    const DROP: &[&str] = &["OUT_DIR", "TARGET", "HOST", "PROFILE", "OPT_LEVEL", "DEBUG", "NUM_JOBS", "RUSTC_LINKER"];
    for (key, _) in std::env::vars_os() {
        let k = key.to_string_lossy();
        let cargoish = k.starts_with("CARGO")
            || k.starts_with("RUSTC")
            || k.starts_with("RUSTDOC")
            || k == "RUSTFLAGS"
            || k == "RUSTUP_TOOLCHAIN"
            || k.starts_with("DEP_");
        if (cargoish && !KEEP.contains(&k.as_ref())) || DROP.contains(&k.as_ref()) {
            cmd.env_remove::<OsString>(key);
        }
    }
}

fn default_target_dir(crate_dir: &Path) -> PathBuf {
    crate_dir.join("target").join("ferrolink-ptx")
}

fn crate_name(crate_dir: &Path) -> Result<String, BuildError> {
    let manifest = crate_dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).map_err(io_err(format!("reading {}", manifest.display())))?;
    let mut in_package = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package && let Some(v) = line.strip_prefix("name").and_then(|rest| rest.trim().strip_prefix('=')) {
            return Ok(v.trim().trim_matches('"').to_string());
        }
    }
    Err(BuildError::Io {
        what: format!("reading the package name from {}", manifest.display()),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "no `name = \"...\"` in [package]"),
    })
}

fn newest_asm(deps: &Path, stem: &str) -> Option<PathBuf> {
    std::fs::read_dir(deps)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with(&format!("{stem}-")) && n.ends_with(".s")
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

/// Functions of CUDA's device libraries that a device crate may call (declared `.extern
/// .func` in its PTX): `vprintf` (which the driver resolves itself) and the device runtime's
/// `cudaGraphLaunch` (a kernel launching a graph; ferrolink links `libcudadevrt` into such a
/// module when it loads it, and ptxas assembles it as relocatable code, `-c`).
///
/// ```
/// use ferrolink_builder::{extern_functions, DEVICE_LIBRARY_FUNCTIONS};
///
/// let ptx = ".extern .func (.param .b32 func_retval0) vprintf(\n.extern .func _ZN4core9panicking5panic(\n";
/// let unresolved: Vec<String> =
///     extern_functions(ptx).into_iter().filter(|f| !DEVICE_LIBRARY_FUNCTIONS.contains(&f.as_str())).collect();
/// assert_eq!(unresolved, ["_ZN4core9panicking5panic"]);
/// ```
pub const DEVICE_LIBRARY_FUNCTIONS: &[&str] = &["vprintf", "cudaGraphLaunch"];

/// Whether `ptx` calls the CUDA device runtime (`cudaGraphLaunch`): its cubin is then
/// relocatable code, to be linked with `libcudadevrt`.
///
/// ```
/// use ferrolink_builder::calls_device_runtime;
///
/// assert!(calls_device_runtime(".extern .func (.param .b32 func_retval0) cudaGraphLaunch\n(\n"));
/// assert!(!calls_device_runtime(".extern .func (.param .b32 func_retval0) vprintf(\n"));
/// ```
pub fn calls_device_runtime(ptx: &str) -> bool {
    extern_functions(ptx).iter().any(|f| f == "cudaGraphLaunch")
}

/// Names of functions declared `.extern .func` in the PTX.
///
/// ```
/// let ptx = ".extern .func (.param .b32 func_retval0) vprintf(\n\t.param .b64 p0\n);\n\
///            .visible .entry k(\n";
/// assert_eq!(ferrolink_builder::extern_functions(ptx), ["vprintf"]);
/// ```
pub fn extern_functions(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".extern .func"))
        .filter_map(|rest| {
            // `.extern .func (.param .b32 r) name(` or `.extern .func name(`, the parameters
            // perhaps on the next lines: the name follows the return parameter, if any.
            let rest = rest.trim_start();
            let after_ret = if rest.starts_with('(') { &rest[rest.find(')')? + 1..] } else { rest };
            let name = after_ret.trim_start().split(|c: char| c == '(' || c.is_whitespace()).next()?;
            (!name.is_empty()).then(|| name.to_string())
        })
        .collect()
}

/// Names of the device functions (`.func`) in the PTX that load a parameter through a
/// register (`ld.param… [%rd…]`): in a function `ld.param` reads its own parameters, so such
/// an address can only be one a kernel took of its parameter, read in the wrong place. (A
/// function reads its own parameters by name: `[name_param_0]`.)
///
/// ```
/// let ptx = ".func f(\n\t.param .b64 f_param_0\n)\n{\n\tld.param.b64 %rd1, [f_param_0];\n\
///            \tld.param.v2.b64 {%rd2, %rd3}, [%rd1];\n}\n";
/// assert_eq!(ferrolink_builder::param_loads_in_functions(ptx), ["f"]);
/// // In a kernel (`.entry`) the same load is fine.
/// assert!(ferrolink_builder::param_loads_in_functions(&ptx.replace(".func", ".entry")).is_empty());
/// ```
pub fn param_loads_in_functions(ptx: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut current: Option<String> = None;
    for line in ptx.lines() {
        let l = line.trim_start();
        // A function or kernel starts at column 0 (`.func`, `.visible .func`, `.entry`…).
        if !line.starts_with(char::is_whitespace) && (l.contains(".func") || l.contains(".entry")) {
            current = l.contains(".func").then(|| {
                let rest = &l[l.find(".func").expect("checked") + 5..];
                let rest = rest.trim_start();
                let after_ret =
                    if rest.starts_with('(') { rest.find(')').map_or("", |i| &rest[i + 1..]) } else { rest };
                after_ret.trim_start().split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("").to_string()
            });
            continue;
        }
        if let Some(name) = &current
            && l.starts_with("ld.param")
            && l.contains("[%")
            && !found.contains(name)
        {
            found.push(name.clone());
        }
    }
    found
}

/// Names of the kernel entries (`.entry NAME(`) in the PTX.
///
/// ```
/// let ptx = ".visible .entry copy(\n\t.param .u64 copy_param_0\n)\n.func helper(\n";
/// assert_eq!(ferrolink_builder::entries(ptx), ["copy"]);
/// ```
pub fn entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start();
            let rest = rest.strip_prefix(".visible ").unwrap_or(rest);
            let rest = rest.strip_prefix(".entry ")?;
            Some(rest.split(['(', ' ']).next()?.trim().to_string())
        })
        .filter(|n| !n.is_empty())
        .collect()
}

/// Parses `ptxas -v` output into per-kernel resources.
///
/// ```
/// let log = "ptxas info    : Function properties for copy\n\
///            8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
///            ptxas info    : Used 26 registers, used 0 barriers, 368 bytes cmem[0]\n";
/// let k = &ferrolink_builder::parse_ptxas_report(log)[0];
/// assert_eq!((k.name.as_str(), k.registers, k.stack_bytes), ("copy", 26, 8));
/// assert_eq!((k.spill_store_bytes, k.spill_load_bytes), (4, 12));
/// ```
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(i) = line.find("Function properties for ") {
            let name = line[i + "Function properties for ".len()..].trim().to_string();
            out.push(KernelResources { name, ..Default::default() });
        } else if let Some(k) = out.last_mut() {
            let num_before = |key: &str| -> Option<u32> {
                let i = line.find(key)?;
                line[..i].split_whitespace().last()?.parse().ok()
            };
            if line.contains("stack frame") {
                k.stack_bytes = num_before(" bytes stack frame").unwrap_or(0);
                k.spill_store_bytes = num_before(" bytes spill stores").unwrap_or(0);
                k.spill_load_bytes = num_before(" bytes spill loads").unwrap_or(0);
            } else if line.contains("Used ") && line.contains(" registers") {
                k.registers = num_before(" registers").unwrap_or(0);
            }
        }
    }
    out
}

/// Assembles `ptx_path` (whose text is `ptx`) into `cubin` with `ptxas -arch=<arch> -v` (and
/// `-c`, relocatable, when it calls the device runtime: [`calls_device_runtime`]) and
/// returns ptxas' report, or returns the report of the last run when it assembled the same
/// text with the same ptxas and arch and its cubin is still there: ptxas takes minutes on a
/// large module, and the nested build rewrites an unchanged `.s` only with the same text.
///
/// The last run is kept beside the cubin: `<stem>.ptxas-input` (the text it assembled) and
/// `<stem>.ptxas-log` (the ptxas binary, its size and time, the arch, then the report),
/// written last, after the cubin, and removed before ptxas runs again, so that a run cut
/// short leaves no log to trust.
fn assemble_cached(ptxas: &Path, arch: &str, ptx_path: &Path, ptx: &str, cubin: &Path) -> Result<String, BuildError> {
    let stamp = |p: &Path| {
        std::fs::metadata(p).ok().map(|m| {
            let t = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
            format!("{} {}.{:09}", m.len(), t.as_secs(), t.subsec_nanos())
        })
    };
    let header = format!(
        "ptxas: {} ({})\narch: {arch}\n---\n",
        ptxas.display(),
        stamp(ptxas).unwrap_or_else(|| "unknown".into())
    );
    let input = ptx_path.with_extension("ptxas-input");
    let log_path = ptx_path.with_extension("ptxas-log");
    if let (Ok(log), true) = (std::fs::read_to_string(&log_path), cubin.is_file())
        && let Some(report) = log.strip_prefix(&header)
        && std::fs::read(&input).is_ok_and(|text| text == ptx.as_bytes())
    {
        return Ok(report.to_string());
    }
    // A stale log must not vouch for the cubin this run is about to write.
    let _ = std::fs::remove_file(&log_path);
    let mut cmd = Command::new(ptxas);
    if calls_device_runtime(ptx) {
        cmd.arg("-c");
    }
    let out = cmd
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(ptx_path)
        .arg("-o")
        .arg(cubin)
        .output()
        .map_err(io_err(format!("starting {}", ptxas.display())))?;
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(BuildError::Ptxas { ptxas: ptxas.to_path_buf(), arch: arch.to_string(), stderr: report });
    }
    // The cache is an optimization: failing to write it only costs the next build time.
    if std::fs::write(&input, ptx).is_ok() {
        let _ = std::fs::write(&log_path, format!("{header}{report}"));
    }
    Ok(report)
}

/// Where the builder looks for ptxas, for messages.
const PTXAS_LOOKED_AT: &str = "looked at FERROLINK_PTXAS, .tools/cuda/bin/ptxas in the crate's folder and its \
                               parents, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin";

/// How to get ptxas without a CUDA toolkit: the recipe of scripts/setup.sh, for a user of any
/// device crate.
const PTXAS_HOWTO: &str = "To get ptxas without a CUDA toolkit, run in your workspace root: \
     `python3 -m pip download --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
     \"nvidia-cuda-nvcc==13.0.*\" -d .tools/wheels && mkdir -p .tools/cuda/bin && unzip -o -j \
     .tools/wheels/nvidia_cuda_nvcc-*.whl nvidia/cu13/bin/ptxas -d .tools/cuda/bin` (the builder finds .tools/cuda/bin/ptxas above the \
     crate by itself; in a ferrolink checkout scripts/setup.sh does this), or set FERROLINK_PTXAS \
     to the path of an existing ptxas";

/// The outcome of a ptxas search: the binary, and notes worth a warning (a `FERROLINK_PTXAS`
/// that points at nothing).
struct PtxasSearch {
    found: Option<PathBuf>,
    notes: Vec<String>,
}

impl PtxasSearch {
    /// Looks in the order documented at [`find_ptxas`]; `.tools/cuda/bin/ptxas` is searched
    /// for in and above each of `start_dirs`, then `CARGO_MANIFEST_DIR`, then the current folder.
    fn run(start_dirs: &[&Path]) -> PtxasSearch {
        let mut notes = Vec::new();
        let mut candidates: Vec<(PathBuf, &str)> = Vec::new();
        if let Some(p) = std::env::var_os("FERROLINK_PTXAS").filter(|p| !p.is_empty()).map(PathBuf::from) {
            if p.is_file() {
                return PtxasSearch { found: Some(p), notes };
            }
            notes.push(format!(
                "FERROLINK_PTXAS is set to {}, which does not exist (scripts/setup.sh puts ptxas \
                 there in a ferrolink checkout); looking elsewhere",
                p.display()
            ));
        }
        // `.tools/cuda/bin/ptxas` in the first start folder that has one in itself or a parent.
        let starts = start_dirs
            .iter()
            .map(|d| d.to_path_buf())
            .chain(std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from))
            .chain(std::env::current_dir().ok());
        let tools = starts
            .flat_map(|start| start.ancestors().map(|d| d.join(".tools/cuda/bin/ptxas")).collect::<Vec<_>>())
            .find(|p| p.is_file());
        candidates.extend(tools.map(|p| (p, ".tools/cuda/bin")));
        if let Some(path) = std::env::var_os("PATH") {
            candidates.extend(std::env::split_paths(&path).map(|d| (d.join("ptxas"), "PATH")));
        }
        if let Some(cuda) = std::env::var_os("CUDA_HOME") {
            candidates.push((PathBuf::from(cuda).join("bin/ptxas"), "$CUDA_HOME/bin"));
        }
        candidates.push(("/usr/local/cuda/bin/ptxas".into(), "/usr/local/cuda/bin"));
        let found = candidates.into_iter().find(|(p, _)| p.is_file());
        if !notes.is_empty()
            && let Some((p, from)) = &found
        {
            notes.push(format!("using ptxas {} (from {from}) instead", p.display()));
        }
        PtxasSearch { found: found.map(|(p, _)| p), notes }
    }
}

/// Finds `ptxas`, in this order:
/// 1. `FERROLINK_PTXAS`, when it names an existing file (a path that does not exist is
///    skipped, and the builder warns about it);
/// 2. `.tools/cuda/bin/ptxas` in the device crate's folder or one of its parents (when called
///    by the builder), else in `CARGO_MANIFEST_DIR` or one of its parents, else in the current
///    folder or one of its parents: where `scripts/setup.sh`, and the recipe in the builder's
///    "ptxas not found" warning, put it;
/// 3. `ptxas` on `PATH`;
/// 4. `$CUDA_HOME/bin/ptxas`;
/// 5. `/usr/local/cuda/bin/ptxas`.
///
/// ```
/// match ferrolink_builder::find_ptxas() {
///     Some(ptxas) => assert!(ptxas.is_file()),
///     None => eprintln!("no ptxas: the builder will skip the assembly check"),
/// }
/// ```
pub fn find_ptxas() -> Option<PathBuf> {
    PtxasSearch::run(&[]).found
}

/// Local crates the device crate depends on by `path = "..."` (recursively, through
/// `[dependencies]` and `[build-dependencies]`, and through `workspace = true` entries whose
/// workspace declares a path), so that a change in, say, a path dependency on
/// `ferrolink-device` rebuilds the PTX too.
///
/// ```
/// # let root = std::env::temp_dir().join(format!("ferrolink-builder-doc-{}", std::process::id()));
/// # for dir in ["kernels", "shared"] { std::fs::create_dir_all(root.join(dir)).unwrap(); }
/// let kernels = root.join("kernels");
/// let manifest = "[package]\nname = \"kernels\"\n[dependencies]\nshared = { path = \"../shared\" }\n";
/// std::fs::write(kernels.join("Cargo.toml"), manifest).unwrap();
/// std::fs::write(root.join("shared/Cargo.toml"), "[package]\nname = \"shared\"\n").unwrap();
/// let deps = ferrolink_builder::path_dependencies(&kernels);
/// assert_eq!(deps, [root.join("shared").canonicalize().unwrap()]);
/// # std::fs::remove_dir_all(&root).unwrap();
/// ```
pub fn path_dependencies(crate_dir: &Path) -> Vec<PathBuf> {
    let crate_dir = &crate_dir.canonicalize().unwrap_or_else(|_| crate_dir.to_path_buf());
    let mut found: Vec<PathBuf> = Vec::new();
    let mut todo = vec![crate_dir.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for dep in manifest_path_dependencies(&dir) {
            let Ok(dep) = dep.canonicalize() else { continue };
            if dep.join("Cargo.toml").is_file() && !found.contains(&dep) && dep != *crate_dir {
                found.push(dep.clone());
                todo.push(dep);
            }
        }
    }
    found
}

/// The directories of the path dependencies one manifest declares: `path = ".."` entries of
/// its `[dependencies]` (and target-specific ones), and entries inherited from the
/// workspace (`x.workspace = true`) that are path dependencies of `[workspace.dependencies]`
/// in the enclosing workspace's manifest. (A device crate inside a workspace usually takes
/// `ferrolink-device` the second way; missing it left a stale PTX after a change to the
/// device crate.)
fn manifest_path_dependencies(dir: &Path) -> Vec<PathBuf> {
    let Some(manifest) = read_manifest(&dir.join("Cargo.toml")) else { return Vec::new() };
    let mut tables: Vec<&toml::Table> = Vec::new();
    for key in ["dependencies", "build-dependencies"] {
        if let Some(t) = manifest.get(key).and_then(toml::Value::as_table) {
            tables.push(t);
        }
    }
    if let Some(targets) = manifest.get("target").and_then(toml::Value::as_table) {
        for t in targets.values().filter_map(toml::Value::as_table) {
            if let Some(d) = t.get("dependencies").and_then(toml::Value::as_table) {
                tables.push(d);
            }
        }
    }
    let workspace = workspace_root(dir).and_then(|root| {
        let m = read_manifest(&root.join("Cargo.toml"))?;
        let deps = m.get("workspace")?.get("dependencies")?.as_table()?.clone();
        Some((root, deps))
    });
    let mut out = Vec::new();
    for (name, spec) in tables.into_iter().flatten() {
        let Some(spec) = spec.as_table() else { continue };
        if let Some(p) = spec.get("path").and_then(toml::Value::as_str) {
            out.push(dir.join(p));
        } else if spec.get("workspace").and_then(toml::Value::as_bool) == Some(true)
            && let Some((root, deps)) = &workspace
            && let Some(p) = deps.get(name).and_then(|d| d.get("path")).and_then(toml::Value::as_str)
        {
            out.push(root.join(p));
        }
    }
    out
}

fn read_manifest(path: &Path) -> Option<toml::Table> {
    std::fs::read_to_string(path).ok()?.parse::<toml::Table>().ok()
}

/// The nearest directory at or above `dir` whose manifest has a `[workspace]` table.
fn workspace_root(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .find(|d| read_manifest(&d.join("Cargo.toml")).is_some_and(|m| m.contains_key("workspace")))
        .map(Path::to_path_buf)
}

fn source_files(crate_dir: &Path) -> Vec<PathBuf> {
    let mut files = vec![crate_dir.join("Cargo.toml")];
    let mut stack = vec![crate_dir.join("src")];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        files.push(dir.clone());
        for e in rd.filter_map(Result::ok) {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_device_functions_that_load_parameters_through_a_register() {
        let ptx = ".func f(\n\t.param .b64 f_param_0\n)\n{\n\tld.param.b64 %rd1, [f_param_0];\n}\n\
                   .visible .entry k(\n\t.param .align 8 .b8 k_param_0[480]\n)\n{\n\tmov.b64 %rd2, k_param_0;\n\
                   \tld.param.v2.b64 {%rd3, %rd4}, [%rd2];\n}\n\
                   .func (.param .b32 func_retval0) g(\n\t.param .b64 g_param_0\n)\n{\n\
                   \tld.param.b64 %rd5, [g_param_0];\n\tld.param.v2.b64 {%rd6, %rd7}, [%rd5];\n}\n";
        // The kernel's own load through a register is fine; `f` reads its parameter by name.
        assert_eq!(param_loads_in_functions(ptx), vec!["g"]);
        assert!(param_loads_in_functions(&ptx.replace("[%rd5]", "[g_param_0+8]")).is_empty());
    }

    #[test]
    fn finds_extern_functions_but_not_entries() {
        let ptx = ".extern .func (.param .b32 func_retval0) vprintf(\n.param .b64 a\n);\n\
                   .extern .func _ZN4core9panicking5panic17h(\n);\n.visible .entry k1(\n.param .u64 p\n)\n\
                   .entry k2(\n";
        assert_eq!(extern_functions(ptx), vec!["vprintf", "_ZN4core9panicking5panic17h"]);
        assert_eq!(entries(ptx), vec!["k1", "k2"]);
        // rustc's layout: the name after the return parameter, the parameters on later lines.
        let graph = ".extern .func  (.param .b32 func_retval0) cudaGraphLaunch\n(\n\t.param .b64 p0\n)\n;\n";
        assert_eq!(extern_functions(graph), vec!["cudaGraphLaunch"]);
        assert!(calls_device_runtime(graph) && !calls_device_runtime(ptx));
    }

    /// A fake ptxas (a shell script) that counts its runs, writes the cubin and a report.
    #[cfg(unix)]
    #[test]
    fn the_same_text_is_assembled_once_while_its_cubin_is_there() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ferrolink-builder-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ptxas = dir.join("ptxas");
        let runs = dir.join("runs");
        std::fs::write(
            &ptxas,
            format!(
                "#!/bin/sh\necho run >> {}\nfor a; do out=$a; done\necho cubin > \"$out\"\n\
                 echo \"ptxas info    : Function properties for k\" >&2\n",
                runs.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&ptxas, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (ptx_path, cubin) = (dir.join("m.s"), dir.join("m.cubin"));
        let run_count = || std::fs::read_to_string(&runs).map_or(0, |r| r.lines().count());
        let assemble = |text: &str| {
            std::fs::write(&ptx_path, text).unwrap();
            assemble_cached(&ptxas, "sm_90", &ptx_path, text, &cubin).unwrap()
        };
        let report = assemble(".entry k(\n");
        assert!(report.contains("Function properties for k"), "{report}");
        assert_eq!(run_count(), 1);
        assert_eq!(assemble(".entry k(\n"), report, "the cached report");
        assert_eq!(run_count(), 1, "the same text is not assembled again");
        assemble(".entry k2(\n");
        assert_eq!(run_count(), 2, "new text is assembled");
        std::fs::remove_file(&cubin).unwrap();
        assemble(".entry k2(\n");
        assert_eq!(run_count(), 3, "a missing cubin is made again");
        assert_eq!(assemble_cached(&ptxas, "sm_100", &ptx_path, ".entry k2(\n", &cubin).map(drop).ok(), Some(()));
        assert_eq!(run_count(), 4, "another arch is assembled");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn parses_ptxas_verbose_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'copy' for 'sm_90'\n\
ptxas info    : Function properties for copy\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 26 registers, used 0 barriers, 368 bytes cmem[0]\n\
ptxas info    : Function properties for other\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 10 registers, used 1 barriers, 360 bytes cmem[0]\n";
        let r = parse_ptxas_report(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                name: "copy".into(),
                registers: 26,
                stack_bytes: 8,
                spill_store_bytes: 4,
                spill_load_bytes: 12
            }
        );
        assert_eq!(r[1].registers, 10);
        assert_eq!(r[1].spill_load_bytes, 0);
        assert!(resources_table(&r).contains("copy"));
    }

    #[test]
    fn path_dependencies_are_found_recursively() {
        let root = std::env::temp_dir().join(format!("ferrolink-builder-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (name, manifest) in [
            (
                "kernels",
                "[package]\nname = \"kernels\"\n[dependencies]\nmid = { path = \"../mid\" }\nbytemuck = \"1\"\n",
            ),
            ("mid", "[package]\nname = \"mid\"\n[dependencies.leaf]\npath = \"../leaf\"\n"),
            ("leaf", "[package]\nname = \"leaf\"\n[dependencies]\nshared.workspace = true\n"),
            ("shared", "[package]\nname = \"shared\"\n"),
        ] {
            std::fs::create_dir_all(root.join(name).join("src")).unwrap();
            std::fs::write(root.join(name).join("Cargo.toml"), manifest).unwrap();
        }
        std::fs::write(
            root.join("Cargo.toml"),
            "[workspace]\nmembers = [\"kernels\"]\n[workspace.dependencies]\nshared = { path = \"shared\" }\n",
        )
        .unwrap();
        let deps = path_dependencies(&root.join("kernels").canonicalize().unwrap());
        let names: Vec<_> = deps.iter().map(|d| d.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec!["mid", "leaf", "shared"]);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn rustflags_carry_the_arch() {
        let f = PtxBuilder::new(".").arch("sm_80").rustflags();
        assert!(f.contains("-Ctarget-cpu=sm_80"));
        assert!(f.contains("-Cpanic=immediate-abort"));
    }
}
