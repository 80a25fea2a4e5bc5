//! Device communicators: the per-rank [`DevComm`] value kernels receive, and the host
//! resources behind it (NCCL's `ncclDevCommCreate`).

use crate::comm::{Communicator, check_all_ranks};
use crate::memory::DeviceBuffer;
use crate::window::{Window, register_window};
use crate::{Error, Result};
use ferrolink_device::barrier::inbox_bytes;
use ferrolink_device::{DevComm, DevWindow};

/// What the kernels using a device communicator need (NCCL's `ncclDevCommRequirements`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevCommRequirements {
    /// LSA barriers (one per CTA that synchronizes at a time; at least 1).
    pub lsa_barrier_count: u32,
    /// Windows the device-side window table can hold ([`DevCommHandle::add_window`]).
    pub window_capacity: u32,
}

impl Default for DevCommRequirements {
    /// 32 barriers (up to 32 synchronizing CTAs per rank) and 16 windows.
    fn default() -> Self {
        DevCommRequirements { lsa_barrier_count: 32, window_capacity: 16 }
    }
}

/// One rank's device communicator: owns the barrier window, the epoch words and the window
/// table that its [`DevComm`] points to. Keep it alive while kernels use the `DevComm`;
/// dropping it waits for the device first.
pub struct DevCommHandle {
    dev_comm: DevComm,
    barrier_window: Window,
    epochs: DeviceBuffer<u32>,
    table: DeviceBuffer<DevWindow>,
    windows: Vec<Window>,
}

impl std::fmt::Debug for DevCommHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevCommHandle").field("dev_comm", &self.dev_comm).finish()
    }
}

/// Creates every rank's device communicator (collective over all ranks, in rank order):
/// allocates and registers the barrier window (`lsa_barrier_count` inbox rows per rank),
/// zeroed epoch words and the window table.
pub fn create_dev_comms(comms: &[Communicator], reqs: DevCommRequirements) -> Result<Vec<DevCommHandle>> {
    check_all_ranks(comms, "create_dev_comms")?;
    if reqs.lsa_barrier_count == 0 {
        return Err(Error::InvalidArgument("create_dev_comms: lsa_barrier_count must be at least 1".into()));
    }
    let lsa = comms[0].lsa_size() as u32;
    let bytes = inbox_bytes(reqs.lsa_barrier_count, lsa);
    let buffers = comms.iter().map(|c| c.mem_alloc(bytes)).collect::<Result<Vec<_>>>()?;
    let barrier_windows = register_window(comms, buffers)?;
    comms
        .iter()
        .zip(barrier_windows)
        .map(|(c, barrier_window)| {
            let epochs = c.device().alloc::<u32>(reqs.lsa_barrier_count as usize)?;
            let table = c.device().alloc::<DevWindow>(reqs.window_capacity.max(1) as usize)?;
            let dev_comm = DevComm {
                rank: c.rank() as u32,
                nranks: c.nranks() as u32,
                lsa_rank: c.lsa_rank() as u32,
                lsa_size: lsa,
                lsa_scope_code: c.lsa_scope().code(),
                lsa_barrier_count: reqs.lsa_barrier_count,
                barrier_window: barrier_window.dev_window(),
                barrier_epochs: epochs.addr(),
                windows: table.addr(),
                window_count: 0,
                _reserved: 0,
            };
            Ok(DevCommHandle { dev_comm, barrier_window, epochs, table, windows: Vec::new() })
        })
        .collect()
}

impl DevCommHandle {
    /// The value to pass to kernels.
    pub fn dev_comm(&self) -> DevComm {
        self.dev_comm
    }

    /// Adds `window` (this rank's handle, same communicator) to the device-side window table,
    /// so kernels can use `DevComm::window(index)`; returns the index. [`dev_comm`](Self::dev_comm)
    /// returns a copy: take it again after adding windows (an older copy's `window_count`
    /// does not include them, and `window(i)` returns `None` for them). Waits for the device
    /// (the table must not change under running kernels). The window stays alive at least
    /// as long as this handle.
    pub fn add_window(&mut self, window: &Window) -> Result<u32> {
        if window.comm_id() != self.barrier_window.comm_id() || window.rank() != self.dev_comm.rank as usize {
            return Err(Error::InvalidArgument(
                "add_window: the window belongs to another communicator or rank".into(),
            ));
        }
        let index = self.dev_comm.window_count;
        if index as usize >= self.table.len() {
            return Err(Error::InvalidArgument(format!(
                "add_window: the window table is full ({} windows; raise DevCommRequirements::window_capacity)",
                self.table.len()
            )));
        }
        let mut table = self.table.to_vec()?;
        table[index as usize] = window.dev_window();
        self.table.copy_from_host(&table)?;
        self.windows.push(window.clone());
        self.dev_comm.window_count += 1;
        Ok(index)
    }
}

/// Returns every rank's LSA barriers to their initial state (zero epochs, empty inboxes), after
/// waiting for all work on the ranks' devices. Collective: pass every rank's handle.
///
/// Needed after a barrier wait timed out (`LsaBarrierSession::wait_timeout`): the ranks that
/// arrived have already signalled the next epoch, so the barrier indices are out of step and
/// later rounds would no longer order memory. Nothing may run on the devices meanwhile.
pub fn reset_barriers(handles: &mut [DevCommHandle]) -> Result<()> {
    let Some(first) = handles.first() else { return Ok(()) };
    let ranks = first.dev_comm.nranks as usize;
    let comm = first.barrier_window.comm_id();
    if handles.len() != ranks
        || handles.iter().enumerate().any(|(r, h)| h.barrier_window.comm_id() != comm || h.dev_comm.rank as usize != r)
    {
        return Err(Error::InvalidArgument(format!(
            "reset_barriers is collective: pass all {ranks} ranks' handles of one communicator, in rank order"
        )));
    }
    for h in handles.iter_mut() {
        h.epochs.copy_from_host(&vec![0u32; h.epochs.len()])?;
        h.barrier_window.copy_from_host(0, &vec![0u8; h.barrier_window.size()])?;
    }
    Ok(())
}
