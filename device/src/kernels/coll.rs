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
    pub unsafe fn coll_lsa(comm: DevComm, send: DevWindow, recv_win: DevWindow, args: CollArgs, recv: *mut u8) {
        // SAFETY: the kernel's contract.
        unsafe {
            coll::run_lsa(&comm, &send, &recv_win, &args, recv, arch::block_idx_x(), arch::grid_dim_x())
        }
    }
}

kernel! {
    /// The persistent collectives kernel (see [`coll::persistent`]): runs the operations its
    /// rank's stream posts into `mailbox` until a shutdown or an abort. CTA `b` uses LSA
    /// barrier `b`.
    ///
    /// # Safety
    /// As [`coll::persistent::run`].
    pub unsafe fn coll_persistent(comm: DevComm, mailbox: *mut coll::persistent::Mailbox) {
        // SAFETY: the kernel's contract.
        unsafe { coll::persistent::run(&comm, mailbox, arch::block_idx_x(), arch::grid_dim_x()) }
    }
}
