//! 01 — the pipeline end to end: Rust device code (the built-in `ferrolink_copy` kernel,
//! compiled to PTX by ferrolink-builder) launched on a stream, checked on the host.
//!
//! `cargo run --release -p ferrolink-examples --example 01_copy`
//! (`FERROLINK_BACKEND=cpu` forces the emulator.)

use ferrolink::{Device, LaunchConfig};
use ferrolink_device::kernels::copy::ferrolink_copy;

fn main() -> Result<(), ferrolink::Error> {
    let dev = Device::open(0)?;
    println!("device: {} ({} backend)", dev.name(), dev.backend());
    let stream = dev.create_stream()?;

    let n = 1 << 20;
    let data: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    let src = dev.alloc_from(&data)?;
    let mut dst = dev.alloc::<u8>(n)?;

    // The typed launch: the argument tuple must match the kernel's declared parameters.
    // SAFETY: both buffers hold `n` bytes and outlive the kernel (we synchronize below).
    unsafe {
        stream.launch(
            dev.builtin_module()?,
            &ferrolink_copy,
            LaunchConfig::linear(8, 256),
            (dst.as_kernel_mut_ptr(), src.as_kernel_ptr(), n),
        )?;
    }
    stream.synchronize()?;
    assert_eq!(dst.to_vec()?, data, "copy mismatch");

    // The same through the safe wrapper, which picks the launch shape and checks bounds.
    let mut again = dev.alloc::<u8>(n)?;
    ferrolink::ops::copy(&stream, &mut again, &src)?;
    assert_eq!(again.to_vec()?, data, "copy mismatch");
    println!("01_copy: copied {n} bytes twice and verified them on the {} backend", dev.backend());
    Ok(())
}
