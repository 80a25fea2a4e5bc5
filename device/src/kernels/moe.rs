//! The MoE kernels (see [`crate::moe`]).

use crate::arch;
use crate::comm::DevComm;
use crate::kernel;
use crate::moe::low_latency::{self, MoeLowLatencyArgs};
use crate::moe::{self, MoeArgs};
use crate::window::DevWindow;

kernel! {
    /// MoE dispatch (see [`moe::dispatch`]): this rank's token rows from `send` to the ranks
    /// of their experts, packed per expert into their `recv` windows; `counts` carries the
    /// count matrix. Needs [`moe::dispatch_shared_bytes`] of dynamic shared memory per CTA
    /// and a whole number of warps per CTA.
    ///
    /// # Safety
    /// As [`moe::dispatch`].
    pub unsafe fn moe_dispatch(comm: DevComm, send: DevWindow, recv: DevWindow, counts: DevWindow, args: MoeArgs) {
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe { moe::dispatch(&comm, &send, &recv, &counts, &args, arch::block_idx_x(), arch::grid_dim_x()) };
    }
}

kernel! {
    /// MoE combine (see [`moe::combine`]): the experts' results in `recv` back to their
    /// tokens' ranks (into `ret`), then each token's weighted sum into `args.out`. Needs
    /// [`moe::combine_shared_bytes`] of dynamic shared memory per CTA and a whole number of
    /// warps per CTA.
    ///
    /// # Safety
    /// As [`moe::combine`].
    pub unsafe fn moe_combine(comm: DevComm, recv: DevWindow, ret: DevWindow, counts: DevWindow, args: MoeArgs) {
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe { moe::combine(&comm, &recv, &ret, &counts, &args, arch::block_idx_x(), arch::grid_dim_x()) };
    }
}

kernel! {
    /// Low-latency MoE dispatch (see [`low_latency::dispatch`]): its send half, its receive
    /// half, or both (`args.phase`). Needs [`low_latency::shared_bytes`] of dynamic shared
    /// memory per CTA and a whole number of warps per CTA.
    ///
    /// # Safety
    /// As [`low_latency::dispatch`].
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
    pub unsafe fn moe_ll_combine(comm: DevComm, recv: DevWindow, ret: DevWindow, counts: DevWindow, args: MoeLowLatencyArgs) {
        // SAFETY: the kernel's contract. An abort ends it early: the host reports it.
        let _ = unsafe {
            low_latency::combine(&comm, &recv, &ret, &counts, &args, arch::block_idx_x(), arch::grid_dim_x())
        };
    }
}
