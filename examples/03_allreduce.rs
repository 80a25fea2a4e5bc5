//! 03_allreduce — see the `allreduce` module of this package (examples/lib.rs) for the code and the
//! kernel it launches. `cargo run --release -p ferrolink-examples --example 03_allreduce`.

fn main() -> Result<(), ferrolink::Error> {
    let dev = ferrolink::Device::open(0)?;
    println!("device: {} ({} backend)", dev.name(), dev.backend());
    println!("{}", ferrolink_examples::allreduce::run(&dev, 8, 1 << 20)?);
    Ok(())
}
