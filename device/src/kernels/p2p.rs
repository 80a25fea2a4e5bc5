//! The point-to-point group kernel (see [`crate::p2p`]).

use crate::arch;
use crate::comm::DevComm;
use crate::kernel;
use crate::p2p::{self, P2pArgs, P2pOp};
use crate::window::DevWindow;

kernel! {
    /// Runs one group of sends and receives (see [`crate::p2p`]): `ops` holds `args.nops`
    /// [`P2pOp`]s (as words), `progress` `args.nops * args.channels` words of scratch.
    ///
    /// # Safety
    /// As [`p2p::run`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::p2p::p2p_group;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow, p2p::P2pArgs};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, P2pArgs, *const u64, *mut u64)> = &p2p_group;
    /// assert_eq!(k.name(), "p2p_group");
    /// ```
    pub unsafe fn p2p_group(comm: DevComm, send_win: DevWindow, recv_win: DevWindow, args: P2pArgs, ops: *const u64, progress: *mut u64) {
        // SAFETY: the kernel's contract.
        unsafe {
            p2p::run(&comm, &send_win, &recv_win, &args, ops as *const P2pOp, progress, arch::block_idx_x(), arch::grid_dim_x())
        }
    }
}
