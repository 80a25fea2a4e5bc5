//! Builds the guide's device crate (`guide-kernels`, the kernels of docs/device-api.md) to PTX
//! as `MY_KERNELS_PTX`, the name the guide uses, and extracts the guide's host code into
//! `$OUT_DIR/guide_host.rs` with one test per host function, for `tests/guide.rs`.
#[path = "guide_extract.rs"]
mod guide_extract;

use std::fmt::Write as _;

fn main() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    ferrolink_builder::PtxBuilder::new(here.join("guide-kernels"))
        .arch("sm_90")
        .build_in_build_script("MY_KERNELS_PTX");
    let guide = here.join("../docs/device-api.md");
    println!("cargo:rerun-if-changed={}", guide.display());
    let markdown = std::fs::read_to_string(&guide).expect("docs/device-api.md is readable");
    let split = guide_extract::split(&markdown);
    // The guide's host program names its device crate `my_kernels`.
    let mut code = split.host.replace("use my_kernels::*;", "use ferrolink_guide_kernels::*;");
    for name in &split.host_fns {
        writeln!(
            code,
            "#[test]\nfn guide_{name}() {{\n    ferrolink::testing::for_each_backend(\"guide {name}\", |dev| {{\n        \
             let module = dev.load_module(PTX)?;\n        {name}(dev, &module)\n    }});\n}}\n"
        )
        .expect("writing to a String");
    }
    for name in &split.deadlocking_fns {
        writeln!(
            code,
            "#[test]\nfn guide_{name}_ends_with_the_emulator_timeout() {{\n    \
             let dev = Device::open_with(ferrolink::Backend::Cpu, 0).expect(\"the CPU emulator\");\n    \
             let module = dev.load_module(PTX).expect(\"the guide's PTX loads\");\n    \
             let err = {name}(&dev, &module).expect_err(\"{name} deadlocks, so the emulator must stop it\");\n    \
             assert!(err.to_string().contains(\"did not finish within\"), \"unexpected error: {{err}}\");\n}}\n"
        )
        .expect("writing to a String");
    }
    let out = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("guide_host.rs");
    std::fs::write(out, code).expect("OUT_DIR is writable");
}
