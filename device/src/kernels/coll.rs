//! The collectives' kernel (see [`crate::coll`]).

use crate::arch;
use crate::coll::{self, CollArgs};
use crate::comm::DevComm;
use crate::kernel;
use crate::window::DevWindow;

kernel! {
    /// Runs the collective `args` over the LSA domain (see [`crate::coll`]): every rank's
    /// input at `args.send_offset` of its slot of `send`; the output at `recv` (this rank's,
    /// any device memory), or for two-shot all-reduce in every slot of `recv_win` at
    /// `args.recv_offset`. CTA `b` of the grid uses LSA barrier `args.barrier + b`.
    ///
    /// # Safety
    /// As [`coll::run_lsa`]: every rank launches it with the same `args` and grid; the
    /// windows and `recv` hold what `args` asks for; `args.barrier + grid <=
    /// lsa_barrier_count` (checked: a CTA without a barrier reports the error and traps).
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::coll::coll_lsa;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, coll::CollArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, CollArgs, *mut u8)> = &coll_lsa;
    /// assert_eq!(k.name(), "coll_lsa");
    /// ```
    pub unsafe fn coll_lsa(comm: DevComm, send: DevWindow, recv_win: DevWindow, args: CollArgs, recv: *mut u8) {
        // SAFETY: the kernel's contract.
        unsafe {
            coll::run_lsa(&comm, &send, &recv_win, &args, recv, arch::block_idx_x(), arch::grid_dim_x())
        }
    }
}

kernel! {
    /// Runs one rank's LL call over the LSA domain ([`coll::run_lsa_ll`]: [`coll_lsa`]'s LL
    /// path alone, a much smaller kernel), given as a shared launch's entry is: `entry.op`'s
    /// `args` (every rank's input at `args.input`, any device memory), `recv_win` the
    /// communicator's LL buffer (at `args.recv_offset`) and `recv` the output; `entry.comm`
    /// the rank's device communicator. CTA `b` of the grid uses LSA barrier `b`. Needs
    /// `RANK_OP_STRIDE` bytes of dynamic shared memory per CTA.
    ///
    /// # Safety
    /// As [`coll::run_lsa_ll`], for the entry's call.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::coll::coll_ll;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::coll::group::RankOp;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(RankOp,)> = &coll_ll;
    /// assert_eq!(k.name(), "coll_ll");
    /// ```
    pub unsafe fn coll_ll(entry: coll::group::RankOp) {
        // Read in place from the parameter (see `kernel_param_address!`).
        let param = crate::kernel_param_address!(coll_ll, 0, entry);
        // SAFETY: the kernel's contract; `param` is the entry.
        unsafe { coll::group::serve_own_ll(param, arch::block_idx_x(), arch::grid_dim_x()) }
    }
}

kernel! {
    /// Runs the collective `args` over every rank of the communicator, across LSA domains,
    /// through GIN (see [`coll::run_gin`]): every rank's input at `args.send_offset` of its
    /// slot of `send`; `gather` (`nranks * count` elements per rank) receives the peers'
    /// data; the output at `recv` (this rank's, any device memory). CTA `b` uses signal `b`
    /// and hybrid barrier `b`.
    ///
    /// # Safety
    /// As [`coll::run_gin`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::coll::coll_gin;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, coll::CollArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, CollArgs, *mut u8)> = &coll_gin;
    /// assert_eq!(k.name(), "coll_gin");
    /// ```
    pub unsafe fn coll_gin(comm: DevComm, send: DevWindow, gather: DevWindow, args: CollArgs, recv: *mut u8) {
        // SAFETY: the kernel's contract.
        unsafe { coll::run_gin(&comm, &send, &gather, &args, recv, arch::block_idx_x(), arch::grid_dim_x()) }
    }
}

kernel! {
    /// The GPU group's persistent kernel (see [`coll::group`]): one kernel for the ranks of
    /// `ranks` (those of one communicator on this GPU), CTA `b` serving part `b %
    /// ctas_per_rank` of rank `b / ctas_per_rank`, each reading its rank's operations from
    /// the ring, from operation `first` on until a shutdown or an abort. Needs
    /// `RANK_OP_STRIDE` bytes of dynamic shared memory per CTA.
    ///
    /// # Safety
    /// As [`coll::group::serve`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::coll::coll_gpu_group;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::coll::group::LocalRanks;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(LocalRanks, u64)> = &coll_gpu_group;
    /// assert_eq!(k.name(), "coll_gpu_group");
    /// ```
    pub unsafe fn coll_gpu_group(ranks: coll::group::LocalRanks, first: u64) {
        // SAFETY: the kernel's contract.
        unsafe { coll::group::serve(&ranks, first, arch::block_idx_x()) }
    }
}

/// The body of a shared launch's kernel `$kernel` whose parameter is `$launch`:
/// [`coll::group::serve_launch`] with `LL_ONLY` = `$ll`. Each CTA reads only its rank's
/// entries, through the parameter's address (see `kernel_param_address!`); the parameter is
/// otherwise used at constant offsets only (passed by reference, every thread would copy its
/// 7 KB to local memory). A macro, not a function: the parameter must stay the kernel's.
macro_rules! serve_group_launch {
    ($kernel:ident, $launch:ident, $ll:literal) => {{
        let ops = crate::kernel_param_address!($kernel, 0, $launch) + coll::group::GROUP_LAUNCH_OPS_OFFSET as u64;
        coll::group::serve_launch::<$ll>(
            $launch.count,
            $launch.ctas_per_rank,
            $launch.skip,
            $launch.operations,
            $launch.grid_sync,
            $launch.entries,
            ops,
            arch::block_idx_x(),
            arch::grid_dim_x(),
        )
    }};
}

kernel! {
    /// One collective (or several, one after the other) for the ranks of one communicator
    /// on this GPU, launched once for all of them (see [`coll::group`]): CTA `b` runs part
    /// `b % ctas_per_rank` of rank `b / ctas_per_rank`'s entries in `launch`. Needs
    /// `RANK_OP_STRIDE` bytes of dynamic shared memory per CTA.
    ///
    /// # Safety
    /// As [`coll::group::serve_launch`], for the entries in `launch`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::coll::coll_gpu_group_launch;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::coll::group::GroupLaunch;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(GroupLaunch,)> = &coll_gpu_group_launch;
    /// assert_eq!(k.name(), "coll_gpu_group_launch");
    /// ```
    pub unsafe fn coll_gpu_group_launch(launch: coll::group::GroupLaunch) {
        // SAFETY: the kernel's contract.
        unsafe { serve_group_launch!(coll_gpu_group_launch, launch, false) }
    }
}

kernel! {
    /// [`coll_gpu_group_launch`] for launches whose entries are all LL calls inside one LSA
    /// domain: that path alone ([`coll::run_lsa_ll`]), a much smaller kernel. Needs
    /// `RANK_OP_STRIDE` bytes of dynamic shared memory per CTA.
    ///
    /// # Safety
    /// As [`coll::group::serve_launch`] with `LL_ONLY`, for the entries in `launch`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::coll::coll_ll_group_launch;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::coll::group::GroupLaunch;
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(GroupLaunch,)> = &coll_ll_group_launch;
    /// assert_eq!(k.name(), "coll_ll_group_launch");
    /// ```
    pub unsafe fn coll_ll_group_launch(launch: coll::group::GroupLaunch) {
        // SAFETY: the kernel's contract.
        unsafe { serve_group_launch!(coll_ll_group_launch, launch, true) }
    }
}
