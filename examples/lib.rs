//! ferrolink's examples. Each `NN_name.rs` beside this file is a small program
//! (`cargo run --release -p ferrolink-examples --example 02_ring`); the LSA ones call the
//! `run` function of a module here, which does the work and checks its own result, so the
//! test suite (tests/lsa.rs) runs exactly what the examples run, on every backend.
//!
//! All of them use several *virtual ranks* on one device: [`virtual_job`].

use ferrolink::{Communicator, DevCommHandle, DevCommRequirements, Device, Error, LaunchConfig, Result, Window};

/// `nranks` ranks on `dev`, each with a `window_bytes` window and a device communicator
/// (default requirements).
pub fn virtual_job(
    dev: &Device,
    nranks: usize,
    window_bytes: usize,
) -> Result<(Vec<Communicator>, Vec<Window>, Vec<DevCommHandle>)> {
    ferrolink::testing::virtual_job(dev, nranks, window_bytes, &DevCommRequirements::default())
}

/// Threads per CTA for the LSA examples: 256 on a GPU, 32 on the emulator (OS threads).
pub fn block_threads(dev: &Device) -> u32 {
    if dev.backend() == ferrolink::Backend::Cuda { 256 } else { 32 }
}

/// CTAs per rank for the LSA examples: `gpu` on a GPU, at most 4 on the emulator, where
/// every thread is an OS thread and all ranks' threads run at once.
pub fn grid_ctas(dev: &Device, gpu: u32) -> u32 {
    if dev.backend() == ferrolink::Backend::Cuda { gpu } else { gpu.min(4) }
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond { Ok(()) } else { Err(Error::InvalidArgument(format!("example check failed: {}", what()))) }
}

fn sync_all(comms: &[Communicator]) -> Result<()> {
    comms.iter().try_for_each(Communicator::synchronize)
}

/// Deterministic bytes for rank `r`.
fn rank_bytes(r: usize, n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 131 + r * 17 + (i >> 9)) % 251) as u8).collect()
}

pub mod ring {
    //! The ring pattern: every rank puts its buffer into the next rank's window slot, then
    //! all meet at an LSA barrier; each rank then holds the previous rank's buffer.
    use super::*;
    use ferrolink_device::kernels::lsa::lsa_ring_exchange;

    /// Runs the ring on `nranks` virtual ranks of `dev` with `bytes` per rank and checks every
    /// rank's window. Returns a one-line summary.
    pub fn run(dev: &Device, nranks: usize, bytes: usize) -> Result<String> {
        let (comms, windows, handles) = virtual_job(dev, nranks, bytes)?;
        let srcs: Vec<Vec<u8>> = (0..nranks).map(|r| rank_bytes(r, bytes)).collect();
        let bufs = comms.iter().zip(&srcs).map(|(c, s)| c.device().alloc_from(s)).collect::<Result<Vec<_>>>()?;
        ferrolink::launch_all(&comms, |c| {
            let r = c.rank();
            // SAFETY: the kernel's contract: the source and the window slots hold `bytes` bytes;
            // at most 8 CTAs use 8 of the 32 barriers; every rank launches the same grid. The
            // handles are tracked: they outlive the kernels whatever is dropped.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa_ring_exchange,
                    LaunchConfig::linear(grid_ctas(dev, 8), block_threads(dev)),
                    (&handles[r], &windows[r], &bufs[r], bytes),
                )?;
            }
            Ok(())
        })?;
        sync_all(&comms)?;
        for r in 0..nranks {
            let got: Vec<u8> = windows[r].read(0, bytes)?;
            let from = (r + nranks - 1) % nranks;
            check(got == srcs[from], || format!("rank {r} does not hold rank {from}'s buffer"))?;
        }
        Ok(format!("ring: {nranks} ranks each received {bytes} bytes from the previous rank, verified"))
    }
}

pub mod allreduce {
    //! One-shot all-reduce over LSA: every rank reads all peers' inputs straight from their
    //! window slots and sums them into its output.
    use super::*;
    use ferrolink_device::kernels::lsa::lsa_allreduce_sum_f32;

    /// Sums `count` floats over `nranks` virtual ranks and checks every rank's result against
    /// the host (inputs are small integers, so the sums are exact).
    pub fn run(dev: &Device, nranks: usize, count: usize) -> Result<String> {
        let (comms, windows, handles) = virtual_job(dev, nranks, count * 4)?;
        let inputs: Vec<Vec<f32>> =
            (0..nranks).map(|r| rank_bytes(r, count).into_iter().map(|b| f32::from(b) - 125.0).collect()).collect();
        let want: Vec<f32> = (0..count).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
        let mut outs = Vec::new();
        for r in 0..nranks {
            windows[r].copy_from_host(0, &inputs[r])?;
            outs.push(comms[r].device().alloc::<f32>(count)?);
        }
        let mut out_refs: Vec<Option<&mut ferrolink::DeviceBuffer<f32>>> = outs.iter_mut().map(Some).collect();
        ferrolink::launch_all(&comms, |c| {
            let r = c.rank();
            let out = out_refs[r].take().expect("one launch per rank");
            // SAFETY: the kernel's contract: every slot holds `count` floats, `out` too; at most
            // 16 CTAs <= 32 barriers. All arguments are tracked handles.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa_allreduce_sum_f32,
                    LaunchConfig::linear(grid_ctas(dev, 16), block_threads(dev)),
                    (&handles[r], &windows[r], out, count),
                )
            }
        })?;
        sync_all(&comms)?;
        for (r, out) in outs.iter().enumerate() {
            let got = out.to_vec()?;
            let bad = got.iter().zip(&want).position(|(a, b)| a != b);
            check(bad.is_none(), || format!("rank {r}: wrong sum at element {bad:?}"))?;
        }
        Ok(format!("allreduce: {nranks} ranks summed {count} floats, every rank matches the host sum"))
    }
}

pub mod fused {
    //! Fused compute and communication: a kernel computes `x * scale + rank` and stores each
    //! tile straight into the next rank's window, with no staging buffer or separate copy.
    use super::*;
    use ferrolink_device::kernels::lsa::{fused_value, lsa_fused_scale_put};

    /// Runs the fused kernel on `nranks` virtual ranks and checks each rank's window.
    pub fn run(dev: &Device, nranks: usize, count: usize) -> Result<String> {
        let scale = 0.5f32;
        let (comms, windows, handles) = virtual_job(dev, nranks, count * 4)?;
        let inputs: Vec<Vec<f32>> =
            (0..nranks).map(|r| (0..count).map(|i| (i % 1000) as f32 + r as f32).collect()).collect();
        let bufs = comms.iter().zip(&inputs).map(|(c, v)| c.device().alloc_from(v)).collect::<Result<Vec<_>>>()?;
        ferrolink::launch_all(&comms, |c| {
            let r = c.rank();
            // SAFETY: the kernel's contract: input and window slots hold `count` floats; at most
            // 8 CTAs <= 32 barriers. All arguments are tracked handles.
            unsafe {
                c.stream().launch(
                    c.device().builtin_module()?,
                    &lsa_fused_scale_put,
                    LaunchConfig::linear(grid_ctas(dev, 8), block_threads(dev)),
                    (&handles[r], &windows[r], &bufs[r], count, scale),
                )?;
            }
            Ok(())
        })?;
        sync_all(&comms)?;
        for r in 0..nranks {
            let prev = (r + nranks - 1) % nranks;
            let want: Vec<f32> = inputs[prev].iter().map(|&x| fused_value(x, scale, prev as u32)).collect();
            check(windows[r].read::<f32>(0, count)? == want, || format!("rank {r} holds wrong tiles"))?;
        }
        Ok(format!("fused: {nranks} ranks computed {count} values each straight into the next rank's window, verified"))
    }
}

pub mod work_queue {
    //! A persistent kernel with a batched atomic work queue, against a static split of the
    //! same skewed work. Reports how evenly each spreads busy time over CTAs.
    use super::*;
    use ferrolink_device::kernels::workqueue::{item_cost, item_work, persistent_work_queue};

    /// Busy-time spread of one run: the slowest CTA's time over the mean.
    #[derive(Clone, Copy, Debug)]
    pub struct Balance {
        /// Slowest CTA's busy nanoseconds over the mean.
        pub max_over_mean: f64,
        /// Kernel time in milliseconds (slowest CTA).
        pub max_ms: f64,
    }

    fn launch(dev: &Device, items: u32, static_split: u32) -> Result<Balance> {
        let (grid, threads) =
            if dev.backend() == ferrolink::Backend::Cuda { (dev.sm_count() * 2, 256) } else { (2, 64) };
        let stream = dev.create_stream()?;
        let mut next = dev.alloc::<u32>(1)?;
        let mut hits = dev.alloc::<u32>(items as usize)?;
        let mut sum = dev.alloc::<u32>(1)?;
        let mut cta_ns = dev.alloc::<u64>(grid as usize)?;
        // SAFETY: buffers sized per the kernel's contract; read (device-synchronously) below.
        unsafe {
            stream.launch(
                dev.builtin_module()?,
                &persistent_work_queue,
                LaunchConfig::linear(grid, threads),
                (
                    next.as_kernel_mut_ptr(),
                    items,
                    64,
                    static_split,
                    hits.as_kernel_mut_ptr(),
                    sum.as_kernel_mut_ptr(),
                    cta_ns.as_kernel_mut_ptr(),
                ),
            )?;
        }
        let h = hits.to_vec()?;
        let wrong = h.iter().position(|&x| x != 1);
        check(wrong.is_none(), || format!("item {wrong:?} was processed {} times", wrong.map_or(0, |i| h[i])))?;
        let want = (0..items).fold(0u32, |s, i| s.wrapping_add(item_work(i, item_cost(i))));
        check(sum.to_vec()?[0] == want, || "checksum differs from the host's".into())?;
        let ns = cta_ns.to_vec()?;
        let max = ns.iter().copied().max().unwrap_or(0) as f64;
        let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64;
        Ok(Balance { max_over_mean: max / mean.max(1.0), max_ms: max / 1e6 })
    }

    /// Runs `items` skewed items with the dynamic queue and with the static split; both are
    /// checked (every item exactly once, checksum). Returns (dynamic, static) balance.
    pub fn run(dev: &Device, items: u32) -> Result<(Balance, Balance)> {
        Ok((launch(dev, items, 0)?, launch(dev, items, 1)?))
    }
}
