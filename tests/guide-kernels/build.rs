//! Extracts the device code of docs/device-api.md into `$OUT_DIR/guide_kernels.rs`.
#[path = "../guide_extract.rs"]
mod guide_extract;

fn main() {
    let guide = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/device-api.md");
    println!("cargo:rerun-if-changed={}", guide.display());
    let markdown = std::fs::read_to_string(&guide).expect("docs/device-api.md is readable");
    let code = guide_extract::split(&markdown).device;
    let out = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("guide_kernels.rs");
    std::fs::write(out, code).expect("OUT_DIR is writable");
}
