//! The MoE kernels (see [`crate::moe`]).

use crate::arch::{self, U32x4};
use crate::comm::DevComm;
use crate::kernel;
use crate::moe::fused::{self, FusedCombineArgs};
use crate::moe::low_latency::{self, MoeLowLatencyArgs};
use crate::moe::{self, MoeArgs, dealt_start};
use crate::window::DevWindow;

kernel! {
    /// MoE dispatch (see [`moe::dispatch`]): this rank's token rows from `send` to the ranks
    /// of their experts, packed per expert into their `recv` windows; `counts` carries the
    /// count matrix; `relay` the rows crossing LSA domains once per token and domain (when
    /// `args.relay_domains` is not 0). Needs [`moe::dispatch_shared_bytes`] of dynamic
    /// shared memory per CTA and a whole number of warps per CTA.
    ///
    /// # Safety
    /// As [`moe::dispatch`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::moe::moe_dispatch;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, moe::MoeArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, DevWindow, DevWindow, MoeArgs)> = &moe_dispatch;
    /// assert_eq!(k.name(), "moe_dispatch");
    /// // Dynamic shared memory per CTA, as the host's `Moe` sizes it (16 experts, no relay, chunk 64):
    /// let shared = ferrolink_device::moe::dispatch_shared_bytes(ferrolink_device::moe::count_columns(16, 0), 64);
    /// assert!(shared <= 48 << 10);
    /// ```
    pub unsafe fn moe_dispatch(
        comm: DevComm,
        send: DevWindow,
        recv: DevWindow,
        counts: DevWindow,
        relay: DevWindow,
        args: MoeArgs,
    ) {
        let (block, grid) = (arch::block_idx_x(), arch::grid_dim_x());
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe { moe::dispatch(&comm, &send, &recv, &counts, &relay, &args, block, grid) };
    }
}

kernel! {
    /// MoE combine (see [`moe::combine`]): the experts' results in `recv` back to their
    /// tokens' ranks (into `ret`; across domains through `relay`, as their sums), then each
    /// token's weighted sum into `args.out`. Needs
    /// [`moe::combine_shared_bytes`] of dynamic shared memory per CTA and a whole number of
    /// warps per CTA.
    ///
    /// # Safety
    /// As [`moe::combine`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::moe::moe_combine;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, moe::MoeArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, DevWindow, DevWindow, MoeArgs)> = &moe_combine;
    /// assert_eq!(k.name(), "moe_combine");
    /// // Dynamic shared memory per CTA for 16 experts:
    /// assert_eq!(ferrolink_device::moe::combine_shared_bytes(16), 192);
    /// ```
    pub unsafe fn moe_combine(
        comm: DevComm,
        recv: DevWindow,
        ret: DevWindow,
        counts: DevWindow,
        relay: DevWindow,
        args: MoeArgs,
    ) {
        let (block, grid) = (arch::block_idx_x(), arch::grid_dim_x());
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe { moe::combine(&comm, &recv, &ret, &counts, &relay, &args, block, grid) };
    }
}

kernel! {
    /// Low-latency MoE dispatch (see [`low_latency::dispatch`]): its send half, its receive
    /// half, or both (`args.phase`). Needs [`low_latency::shared_bytes`] of dynamic shared
    /// memory per CTA and a whole number of warps per CTA.
    ///
    /// # Safety
    /// As [`low_latency::dispatch`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::moe::moe_ll_dispatch;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, moe::low_latency::MoeLowLatencyArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, DevWindow, MoeLowLatencyArgs)> = &moe_ll_dispatch;
    /// assert_eq!(k.name(), "moe_ll_dispatch");
    /// // Dynamic shared memory per CTA for 16 experts:
    /// assert_eq!(ferrolink_device::moe::low_latency::shared_bytes(16), 72);
    /// ```
    pub unsafe fn moe_ll_dispatch(
        comm: DevComm,
        send: DevWindow,
        recv: DevWindow,
        counts: DevWindow,
        args: MoeLowLatencyArgs,
    ) {
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe {
            low_latency::dispatch(&comm, &send, &recv, &counts, &args, arch::block_idx_x(), arch::grid_dim_x())
        };
    }
}

kernel! {
    /// Low-latency MoE combine (see [`low_latency::combine`]): its send half, its receive
    /// half, or both (`args.phase`). Needs [`low_latency::shared_bytes`] of dynamic shared
    /// memory per CTA and a whole number of warps per CTA.
    ///
    /// # Safety
    /// As [`low_latency::combine`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::moe::moe_ll_combine;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, moe::low_latency::MoeLowLatencyArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, DevWindow, MoeLowLatencyArgs)> = &moe_ll_combine;
    /// assert_eq!(k.name(), "moe_ll_combine");
    /// ```
    pub unsafe fn moe_ll_combine(comm: DevComm, recv: DevWindow, ret: DevWindow, counts: DevWindow, args: MoeLowLatencyArgs) {
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe {
            low_latency::combine(&comm, &recv, &ret, &counts, &args, arch::block_idx_x(), arch::grid_dim_x())
        };
    }
}

kernel! {
    /// The fused combine's last step on a token's rank (see [`fused::finish`]): waits for
    /// every kept entry's report, then rounds the accumulators (plus the return rows of
    /// results from other domains) into `args.out` and zeroes them.
    ///
    /// # Safety
    /// As [`fused::finish`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::moe::moe_fused_finish;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, moe::MoeArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, MoeArgs)> = &moe_fused_finish;
    /// assert_eq!(k.name(), "moe_fused_finish");
    /// ```
    pub unsafe fn moe_fused_finish(comm: DevComm, acc: DevWindow, ret: DevWindow, args: MoeArgs) {
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe { fused::finish(&comm, &acc, &ret, &args, arch::block_idx_x(), arch::grid_dim_x()) };
    }
}

kernel! {
    /// The fused MoE example's expert kernel (examples/11_moe_fused.rs): local expert `l`
    /// computes `y = W2_l relu(W1_l x)` for each of its rows, with `W1_l` of `ffn x hidden`
    /// (`w1`: `f32 [experts_per_rank][ffn][hidden]`) and `W2_l` of `hidden x ffn`, given
    /// transposed (`w2`: `f32 [experts_per_rank][ffn][hidden]`, `w2[l][j][c] = W2_l[c][j]`,
    /// so that a warp reads a row of it at once), in `f32`.
    ///
    /// A warp per received row (every local expert's rows dealt to the grid's warps in turn)
    /// computes `h = relu(W1_l x)` (a warp-wide dot
    /// product per hidden unit, kept in shared memory), then `y = W2_l h`, four channels per
    /// lane at a time, and adds `weight * y` straight into the token's accumulator on its
    /// rank ([`FusedCombineArgs::add`]; for a token rank in another domain, into a staging
    /// row); then reports the row ([`FusedCombineArgs::row_added`]: a signal, or the staging
    /// row's put).
    /// One launch per call, between the dispatch and `Moe::finish_fused`.
    ///
    /// # Safety
    /// `target` is what `Moe::fused_target` gave for this call (after a dispatch given the
    /// weights, on this rank's stream; this kernel is the call's only expert launch), `comm`
    /// that `Moe`'s device communicator; `w1` and `w2` hold what is said above for
    /// `target.experts_per_rank` experts. The launch has a whole number of warps per CTA (a
    /// row's warp meets in `row_added`) and `4 * ffn * warps` bytes of dynamic shared memory
    /// per CTA (each warp's hidden layer).
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::moe::moe_expert_mlp_fused;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, moe::fused::FusedCombineArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, FusedCombineArgs, *const f32, *const f32, u32)> = &moe_expert_mlp_fused;
    /// assert_eq!(k.name(), "moe_expert_mlp_fused");
    /// ```
    pub unsafe fn moe_expert_mlp_fused(comm: DevComm, target: FusedCombineArgs, w1: *const f32, w2: *const f32, ffn: u32) {
        let (warps, warp, lane) = (arch::block_dim_x() / arch::WARP_SIZE, arch::warp_id_in_block(), arch::lane_id());
        let (first, stride) = (arch::block_idx_x() * warps + warp, arch::grid_dim_x() * warps);
        let (h, f) = (target.hidden as usize, ffn as usize);
        let hidden_units = arch::dynamic_shared_mem::<f32>().wrapping_add(warp * f);
        let mut before = 0;
        for l in 0..target.experts_per_rank as usize {
            // SAFETY: the kernel's contract: every index below lies in the buffers it sizes
            // (`l < experts_per_rank`, `i < rows(l)`, `j < ffn`, channels below `hidden`);
            // the whole warp reports each of its rows once, with the source it read.
            unsafe {
                let rows = target.rows(l);
                let (w1, w2) = (w1.add(l * f * h), w2.add(l * f * h));
                let mut i = dealt_start(first, stride, before);
                before += rows;
                while i < rows {
                    let x = target.row(l, i);
                    for j in 0..f {
                        let mut s = 0f32;
                        let mut v = lane as usize;
                        while v < h / 8 {
                            let xs = arch::load_v4(x.add(v));
                            let wa = arch::load_v4(w1.add(j * h + 8 * v) as *const U32x4);
                            let wb = arch::load_v4(w1.add(j * h + 8 * v + 4) as *const U32x4);
                            for q in 0..8 {
                                let xq = half::bf16::from_bits((xs.0[q / 2] >> (16 * (q % 2))) as u16).to_f32();
                                let wq = f32::from_bits(if q < 4 { wa.0[q] } else { wb.0[q - 4] });
                                s += wq * xq;
                            }
                            v += arch::WARP_SIZE;
                        }
                        for d in [16, 8, 4, 2, 1] {
                            s += f32::from_bits(arch::shfl_xor_sync(u32::MAX, s.to_bits(), d));
                        }
                        if lane == 0 {
                            hidden_units.add(j).write(s.max(0.0));
                        }
                    }
                    arch::sync_warp(u32::MAX);
                    let source = target.source(l, i);
                    let mut c = 4 * lane as usize;
                    while c < h {
                        let mut y = [0f32; 4];
                        for j in 0..f {
                            let hj = hidden_units.add(j).read();
                            let w = arch::load_v4(w2.add(j * h + c) as *const U32x4);
                            for (q, yq) in y.iter_mut().enumerate() {
                                *yq += hj * f32::from_bits(w.0[q]);
                            }
                        }
                        target.add(&source, c, y);
                        c += 4 * arch::WARP_SIZE;
                    }
                    target.row_added(&comm, &source);
                    i += stride;
                }
            }
        }
    }
}
