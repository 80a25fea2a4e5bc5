//! 02_ring — see the `ring` module of this package (examples/lib.rs) for the code and the
//! kernel it launches. `cargo run --release -p ferrolink-examples --example 02_ring`.

fn main() -> Result<(), ferrolink::Error> {
    let dev = ferrolink::Device::open(0)?;
    println!("device: {} ({} backend)", dev.name(), dev.backend());
    println!("{}", ferrolink_examples::ring::run(&dev, 4, 16 << 20)?);
    Ok(())
}
