//! Exposes the PTX of ferrolink's built-in kernels (the `ferrolink-device` crate) as
//! `FERROLINK_DEVICE_PTX`, for `include_str!` in `src/lib.rs`.
//!
//! By default that is the PTX committed at `ptx/ferrolink_device.ptx`, so that crates using
//! ferrolink build on stable Rust with no nightly toolchain and no ptxas. With
//! `FERROLINK_BUILD_PTX=1` the PTX is built fresh from `../device` by `ferrolink-builder`
//! (nightly, `rust-src`, and ptxas when found) into the target directory. When ptxas assembled it,
//! `FERROLINK_DEVICE_PTX_CUBIN` names the sm_90 cubin (else an empty file; the committed PTX
//! comes without one), which the runtime loads instead of having the driver compile the PTX.
//! The committed file is never written from here (`scripts/update-ptx.sh` refreshes it, `scripts/check-ptx.sh` checks it).
//! docs/build-pipeline.md, "Built-in kernels on stable Rust", has the details.
use std::path::Path;

const ENV_VAR: &str = "FERROLINK_DEVICE_PTX";

/// Points `FERROLINK_DEVICE_PTX_CUBIN` at an empty file: no cubin, the PTX is compiled by the
/// driver on first use.
fn no_cubin() {
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let empty = out_dir.join("no.cubin");
    std::fs::write(&empty, []).expect("writing an empty file in OUT_DIR");
    println!("cargo:rustc-env={ENV_VAR}_CUBIN={}", empty.display());
}

fn main() {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    println!("cargo:rerun-if-env-changed=FERROLINK_BUILD_PTX");
    println!("cargo:rerun-if-env-changed=FERROLINK_PRINT_PTX_RESOURCES");
    let print_resources = std::env::var_os("FERROLINK_PRINT_PTX_RESOURCES").is_some();

    if std::env::var("FERROLINK_BUILD_PTX").is_ok_and(|v| v == "1") {
        let device = manifest_dir.join("../device");
        let out = ferrolink_builder::PtxBuilder::new(device).arch("sm_90").build_in_build_script(ENV_VAR);
        if out.cubin_path.is_none() {
            no_cubin();
        }
        if print_resources {
            for line in ferrolink_builder::resources_table(&out.resources).lines() {
                println!("cargo:warning={line}");
            }
        }
        return;
    }

    let committed = manifest_dir.join("ptx").join("ferrolink_device.ptx");
    println!("cargo:rerun-if-changed={}", committed.display());
    if !committed.is_file() {
        eprintln!(
            "error: the built-in PTX {} is missing: run scripts/update-ptx.sh in the ferrolink \
             checkout, or build it fresh with FERROLINK_BUILD_PTX=1 (needs the nightly toolchain)",
            committed.display()
        );
        println!("cargo:warning=ferrolink: the built-in PTX {} is missing", committed.display());
        std::process::exit(1);
    }
    if print_resources {
        println!(
            "cargo:warning=FERROLINK_PRINT_PTX_RESOURCES: no resource table, the committed PTX was used; \
             set FERROLINK_BUILD_PTX=1 to build it fresh and assemble it with ptxas"
        );
    }
    println!("cargo:rustc-env={ENV_VAR}={}", committed.display());
    no_cubin();
}
