//! Launching CUDA graphs from a kernel (the CUDA device runtime's device graph launch).
//!
//! A kernel that runs inside a graph may launch another graph that was instantiated for
//! device launch: the host makes one with `Stream::capture_for_device_launch` and passes
//! `&Graph` as a launch argument, which becomes a [`DeviceGraph`] here. One thread calls
//! [`DeviceGraph::launch`] (each call is a launch):
//!
//! * [`GraphLaunchMode::FireAndForget`]: the graph starts at once, beside the launching
//!   kernel; the launching graph is complete only once it is (and the host's launch of that
//!   graph, with it);
//! * [`GraphLaunchMode::Tail`]: the graph runs once the launching graph and everything it
//!   launched are complete, tail launches in the order they were made;
//! * [`GraphLaunchMode::Sibling`]: as fire-and-forget, but as a child of the launching
//!   graph's parent, so it does not hold back the launching graph's tail launches.
//!
//! What CUDA refuses comes back as [`GraphLaunchError`] with CUDA's code: a launch of a
//! graph whose previous device launch is still running (`cudaErrorInvalidValue`, 1), or of a
//! null graph. A kernel that launches graphs runs only inside a graph: CUDA refuses to launch
//! it otherwise, and so does the host's `Stream::launch`, saying why. A graph may make at most 120 fire-and-forget
//! launches per run and hold 255 tail launches (CUDA's limits; the emulator does not count
//! them).
//!
//! On the GPU this calls `cudaGraphLaunch` of `libcudadevrt`, which the host links into the
//! module when it loads PTX that calls it. On the emulator the host's CPU backend runs the
//! graph's recorded work ([`crate::emulator::DeviceGraphLauncher`]).

use bytemuck::{Pod, Zeroable};

/// An executable graph that kernels may launch ([`DeviceGraph::launch`]): the kernel
/// parameter that `&Graph` of a graph made by `Stream::capture_for_device_launch` becomes.
/// Null for a graph made for host launch only.
///
/// ```
/// use ferrolink_device::kernel::Kernel;
/// use ferrolink_device::{arch, kernel, DeviceGraph, GraphLaunchMode};
/// kernel! {
///     /// Thread 0 launches `graph` as a tail launch (a refusal is dropped here).
///     ///
///     /// # Safety
///     /// `graph` was made for device launch and lives until the launch has finished.
///     pub unsafe fn launch_after(graph: DeviceGraph) {
///         if arch::global_thread_idx_x() == 0 {
///             // SAFETY: the kernel's contract.
///             let _ = unsafe { graph.launch(GraphLaunchMode::Tail) };
///         }
///     }
/// }
/// // The host passes `&Graph`; the kernel gets a DeviceGraph.
/// let _: &Kernel<(DeviceGraph,)> = &launch_after;
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DeviceGraph {
    /// The executable graph's handle (`CUgraphExec`; on the emulator a number of the CPU
    /// backend's); 0: none.
    pub exec: u64,
}

/// How a kernel launches a graph ([`DeviceGraph::launch`]): the device runtime's graph
/// launch streams.
///
/// ```
/// use ferrolink_device::GraphLaunchMode;
/// for mode in [GraphLaunchMode::FireAndForget, GraphLaunchMode::Tail, GraphLaunchMode::Sibling] {
///     assert_eq!(GraphLaunchMode::from_stream(mode.stream()), Some(mode));
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphLaunchMode {
    /// At once, as a child of the launching graph (`cudaStreamGraphFireAndForget`).
    FireAndForget,
    /// Once the launching graph and its children are complete (`cudaStreamGraphTailLaunch`).
    Tail,
    /// At once, as a child of the launching graph's parent
    /// (`cudaStreamGraphFireAndForgetAsSibling`).
    Sibling,
}

impl GraphLaunchMode {
    /// The device runtime's stream handle for this mode.
    ///
    /// ```
    /// # use ferrolink_device::GraphLaunchMode;
    /// // `cudaStreamGraphTailLaunch`:
    /// assert_eq!(GraphLaunchMode::Tail.stream(), 0x0100_0000_0000_0000);
    /// ```
    pub const fn stream(self) -> u64 {
        match self {
            GraphLaunchMode::Tail => 0x0100_0000_0000_0000,
            GraphLaunchMode::FireAndForget => 0x0200_0000_0000_0000,
            GraphLaunchMode::Sibling => 0x0300_0000_0000_0000,
        }
    }

    /// The mode whose stream handle is `stream`, if any.
    ///
    /// ```
    /// # use ferrolink_device::GraphLaunchMode;
    /// assert_eq!(GraphLaunchMode::from_stream(0x0300_0000_0000_0000), Some(GraphLaunchMode::Sibling));
    /// assert_eq!(GraphLaunchMode::from_stream(0), None); // the legacy stream: no graph launch
    /// ```
    pub const fn from_stream(stream: u64) -> Option<GraphLaunchMode> {
        match stream {
            0x0100_0000_0000_0000 => Some(GraphLaunchMode::Tail),
            0x0200_0000_0000_0000 => Some(GraphLaunchMode::FireAndForget),
            0x0300_0000_0000_0000 => Some(GraphLaunchMode::Sibling),
            _ => None,
        }
    }
}

/// A graph launch that CUDA refused: its `cudaError_t` code.
///
/// ```
/// use ferrolink_device::GraphLaunchError;
/// /// The status word a launching kernel reports: 0, or CUDA's code.
/// fn status(r: Result<(), GraphLaunchError>) -> u32 {
///     match r {
///         Ok(()) => 0,
///         Err(e) => e.code,
///     }
/// }
/// assert_eq!(status(Err(GraphLaunchError { code: GraphLaunchError::INVALID_VALUE })), 1);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphLaunchError {
    /// The CUDA runtime's error code (1: `cudaErrorInvalidValue`, the code for a graph that is
    /// null, not made for device launch, or still running from an earlier device launch).
    pub code: u32,
}

impl GraphLaunchError {
    /// `cudaErrorInvalidValue`.
    ///
    /// ```
    /// # use ferrolink_device::GraphLaunchError;
    /// assert_eq!(GraphLaunchError::INVALID_VALUE, 1);
    /// ```
    pub const INVALID_VALUE: u32 = 1;
}

impl DeviceGraph {
    /// Whether this is no graph (a graph not made for device launch).
    ///
    /// ```
    /// # use ferrolink_device::DeviceGraph;
    /// assert!(DeviceGraph::default().is_null()); // a graph not made for device launch
    /// assert!(!DeviceGraph { exec: 7 }.is_null());
    /// ```
    pub const fn is_null(self) -> bool {
        self.exec == 0
    }

    /// Launches the graph from the calling thread (one launch per call: let one thread
    /// call it). A null graph is refused with [`GraphLaunchError::INVALID_VALUE`], without a
    /// call into the device runtime.
    ///
    /// # Safety
    /// The graph was made for device launch and is alive until the launched work has
    /// finished: passing `&Graph` as a launch argument of a kernel captured into the
    /// launching graph keeps it alive while that graph's launches run.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::arch::{self, atomic, Scope, StoreOrder};
    /// use ferrolink_device::{kernel, DeviceGraph, GraphLaunchError, GraphLaunchMode};
    /// # use ferrolink_device::emulator::{self, LaunchSpec};
    /// # let spec = LaunchSpec { name: "launch_graph", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
    /// #     timeout: std::time::Duration::from_secs(30) };
    /// kernel! {
    ///     /// Thread 0 launches `graph` fire-and-forget and writes 0, or CUDA's code, to `*status`.
    ///     ///
    ///     /// # Safety
    ///     /// `status` is a valid word; `graph` is null or was made for device launch and lives
    ///     /// until the launch has finished.
    ///     pub unsafe fn launch_graph(graph: DeviceGraph, status: *mut u32) {
    ///         if arch::global_thread_idx_x() != 0 {
    ///             return; // each call is a launch: one thread calls
    ///         }
    ///         // SAFETY: the kernel's contract.
    ///         let code = match unsafe { graph.launch(GraphLaunchMode::FireAndForget) } {
    ///             Ok(()) => 0,
    ///             Err(e) => e.code,
    ///         };
    ///         // SAFETY: a valid word (kernel contract).
    ///         unsafe { atomic::store(status, code, StoreOrder::Relaxed, Scope::Sys) };
    ///     }
    /// }
    /// // A null graph is refused (on the emulator here; on the GPU too).
    /// let mut status = u32::MAX;
    /// // SAFETY: `status` outlives the launch; a null graph launches nothing.
    /// unsafe { emulator::launch(&spec, launch_graph.host_entry(), (DeviceGraph::default(), &raw mut status)) }.unwrap();
    /// assert_eq!(status, GraphLaunchError::INVALID_VALUE);
    /// ```
    #[inline]
    pub unsafe fn launch(self, mode: GraphLaunchMode) -> Result<(), GraphLaunchError> {
        if self.is_null() {
            return Err(GraphLaunchError { code: GraphLaunchError::INVALID_VALUE });
        }
        // SAFETY: the caller's contract; `mode.stream()` is a graph launch stream.
        match unsafe { crate::arch::launch_graph(self.exec, mode.stream()) } {
            0 => Ok(()),
            code => Err(GraphLaunchError { code }),
        }
    }
}
