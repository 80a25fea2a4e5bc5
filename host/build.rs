//! Builds the ferrolink-device crate to PTX and exposes its path as `FERROLINK_DEVICE_PTX`.
fn main() {
    let device = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../device");
    let out = ferrolink_builder::PtxBuilder::new(device).arch("sm_90").build_in_build_script("FERROLINK_DEVICE_PTX");
    println!("cargo:rerun-if-env-changed=FERROLINK_PRINT_PTX_RESOURCES");
    if std::env::var_os("FERROLINK_PRINT_PTX_RESOURCES").is_some() {
        for line in ferrolink_builder::resources_table(&out.resources).lines() {
            println!("cargo:warning={line}");
        }
    }
}
