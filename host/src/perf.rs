//! Measurements behind the `ferrolink-perf` tool and the benches. Every figure is taken
//! side by side with its baseline in the same run and reported as a ratio.

use crate::launch::LaunchConfig;
use crate::{Device, DeviceBuffer, Result, ops};

/// Median of a non-empty list of samples.
pub fn median(samples: &mut [f64]) -> f64 {
    assert!(!samples.is_empty(), "median of no samples");
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 { samples[n / 2] } else { (samples[n / 2 - 1] + samples[n / 2]) / 2.0 }
}

/// One copy method's result.
#[derive(Clone, Debug)]
pub struct CopyFigure {
    /// What was measured (`cuMemcpyDtoD`, `copy kernel 528x512`, …).
    pub method: String,
    /// Median bandwidth in GB/s (10^9 bytes copied per second, one direction).
    pub gbps: f64,
}

/// The copy benchmark's result for one size.
#[derive(Clone, Debug)]
pub struct CopyReport {
    /// Bytes per copy.
    pub bytes: usize,
    /// The driver's device-to-device copy (baseline).
    pub baseline: CopyFigure,
    /// The copy kernel with the default launch shape.
    pub kernel: CopyFigure,
    /// Other launch shapes tried (with `sweep`).
    pub sweep: Vec<CopyFigure>,
}

impl CopyReport {
    /// Kernel bandwidth over the baseline's.
    pub fn ratio(&self) -> f64 {
        self.kernel.gbps / self.baseline.gbps
    }
}

/// Times `op` `iters` times back to back between two events; returns GB/s.
fn time_gbps(
    dev: &Device,
    bytes: usize,
    iters: usize,
    mut op: impl FnMut(&crate::Stream) -> Result<()>,
) -> Result<f64> {
    let stream = dev.create_stream()?;
    op(&stream)?; // warm-up (module load, first-touch)
    stream.synchronize()?;
    let start = stream.record_event()?;
    for _ in 0..iters {
        op(&stream)?;
    }
    let end = stream.record_event()?;
    let ms = f64::from(end.elapsed_ms_since(&start)?);
    Ok((bytes * iters) as f64 / (ms * 1e-3) / 1e9)
}

/// Copy kernel vs `cuMemcpyDtoD` on `bytes` bytes: `trials` alternating trials of `iters`
/// copies each, medians reported. With `sweep`, also the copy kernel's variants
/// ([`ferrolink_device::kernels::copy::variants`]) across launch shapes.
pub fn copy_bench(dev: &Device, bytes: usize, iters: usize, trials: usize, sweep: bool) -> Result<CopyReport> {
    use ferrolink_device::kernels::copy::{ferrolink_copy, variants};
    let src: DeviceBuffer<u8> = dev.alloc_from(&(0..bytes).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>())?;
    let dst: DeviceBuffer<u8> = dev.alloc(bytes)?;
    let run = |s: &crate::Stream, k: &ops::CopyKernel, cfg: LaunchConfig| {
        ops::copy_raw(s, k, dst.addr(), dst.device(), src.addr(), src.device(), bytes, cfg)
    };
    let default_cfg = ops::copy_launch_config(dev, bytes);
    let (mut base, mut kern) = (Vec::new(), Vec::new());
    for _ in 0..trials.max(1) {
        // The driver copy gets its own buffers' addresses through the same raw path.
        base.push(time_gbps(dev, bytes, iters, |s| s.copy_raw_dtod(dst.addr(), src.addr(), bytes))?);
        kern.push(time_gbps(dev, bytes, iters, |s| run(s, &ferrolink_copy, default_cfg))?);
    }
    let mut figures = Vec::new();
    if sweep {
        let sms = dev.sm_count();
        let kernels: [(&str, &ops::CopyKernel); 6] = [
            ("ferrolink_copy", &ferrolink_copy),
            ("grid_stride4", &variants::copy_variant_grid_stride4),
            ("grid_stride8_streaming", &variants::copy_variant_grid_stride8_streaming),
            ("warp_contiguous4", &variants::copy_variant_warp_contiguous4),
            ("warp_contiguous16", &variants::copy_variant_warp_contiguous16),
            ("warp_contiguous8_streaming", &variants::copy_variant_warp_contiguous8_streaming),
        ];
        for (name, kernel) in kernels {
            for (per_sm, threads) in [(2u32, 512u32), (8, 256), (32, 256), (64, 256)] {
                let cfg = LaunchConfig::linear(sms * per_sm, threads);
                let mut v = Vec::new();
                for _ in 0..trials.max(1) {
                    match time_gbps(dev, bytes, iters, |s| run(s, kernel, cfg)) {
                        Ok(g) => v.push(g),
                        // A shape this variant cannot run (too many registers for the block).
                        Err(crate::Error::InvalidArgument(_)) => break,
                        Err(e) => return Err(e),
                    }
                }
                if v.is_empty() {
                    continue;
                }
                figures.push(CopyFigure {
                    method: format!("{name} {}x{}", cfg.grid.0, cfg.block.0),
                    gbps: median(&mut v),
                });
            }
        }
    }
    Ok(CopyReport {
        bytes,
        baseline: CopyFigure { method: "cuMemcpyDtoD".into(), gbps: median(&mut base) },
        kernel: CopyFigure {
            method: format!("ferrolink_copy {}x{}", default_cfg.grid.0, default_cfg.block.0),
            gbps: median(&mut kern),
        },
        sweep: figures,
    })
}

/// Parses sizes like `256M`, `1G`, `4096`, `64K` (binary units).
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("`{s}` is not a size (examples: 4096, 64K, 256M, 1G)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("17"), Ok(17));
        assert!(parse_size("abc").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
