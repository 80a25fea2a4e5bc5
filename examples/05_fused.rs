//! 05_fused — see the `fused` module of this package (examples/lib.rs) for the code and the
//! kernel it launches. `cargo run --release -p ferrolink-examples --example 05_fused`.

fn main() -> Result<(), ferrolink::Error> {
    let dev = ferrolink::Device::open(0)?;
    println!("device: {} ({} backend)", dev.name(), dev.backend());
    println!("{}", ferrolink_examples::fused::run(&dev, 4, 1 << 20)?);
    Ok(())
}
