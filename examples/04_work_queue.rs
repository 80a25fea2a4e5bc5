//! 04_work_queue — a persistent kernel whose warps claim batches of skewed work items from
//! an atomic queue, against a static split of the same items (see the `work_queue` module of
//! examples/lib.rs). `cargo run --release -p ferrolink-examples --example 04_work_queue`.

fn main() -> Result<(), ferrolink::Error> {
    let dev = ferrolink::Device::open(0)?;
    println!("device: {} ({} backend)", dev.name(), dev.backend());
    let items = if dev.backend() == ferrolink::Backend::Cuda { 2_000_000 } else { 20_000 };
    let (dynamic, fixed) = ferrolink_examples::work_queue::run(&dev, items)?;
    println!(
        "work_queue: {items} items, each processed exactly once; slowest CTA / mean: dynamic {:.2} \
         ({:.3} ms), static {:.2} ({:.3} ms)",
        dynamic.max_over_mean, dynamic.max_ms, fixed.max_over_mean, fixed.max_ms
    );
    Ok(())
}
