//! Copy kernel vs the driver's device-to-device copy, at 256 MiB and 1 GiB on a GPU (64 MiB
//! on the emulator). `cargo bench -p ferrolink-benches --bench copy`.

use ferrolink::{Backend, Device};
use ferrolink_benches::perf;

fn main() -> Result<(), ferrolink::Error> {
    // `cargo test --benches` runs bench targets with `--test`: keep that a quick smoke run.
    let smoke = std::env::args().any(|a| a == "--test");
    let dev = Device::open(0)?;
    let sizes: &[usize] = match (dev.backend(), smoke) {
        (_, true) => &[1 << 20],
        (Backend::Cuda, false) => &[256 << 20, 1 << 30],
        (Backend::Cpu, false) => &[64 << 20],
    };
    println!("copy bench on {} ({} backend)", dev.name(), dev.backend());
    for &bytes in sizes {
        let r = perf::copy_bench(&dev, bytes, if smoke { 1 } else { 20 }, if smoke { 1 } else { 5 }, false)?;
        println!(
            "{bytes:>11} bytes: baseline {:8.1} GB/s, {} {:8.1} GB/s, ratio {:.3}",
            r.baseline.gbps,
            r.kernel.method,
            r.kernel.gbps,
            r.ratio()
        );
    }
    Ok(())
}
