//! Launch shapes and launch arguments: what a launch uses, so that the runtime can track it.
//!
//! A kernel declared with [`ferrolink_device::kernel!`] takes a tuple of [`KernelParam`]s.
//! A launch passes a tuple of [`LaunchArg`]s instead, each of which becomes one parameter:
//! plain values pass as themselves, and borrowed handles pass as what the kernel receives
//! while the launch records its use of them:
//!
//! | argument | kernel parameter | the launch records |
//! | --- | --- | --- |
//! | `u32`, `f32`, … | the same | nothing |
//! | `*const T`, `*mut T`, `DevComm`, `DevWindow` values | the same | an *untracked* use: memory of the device freed later waits for this launch |
//! | `&DeviceBuffer<T>` | `*const T` | a read (waits for other streams' writes first) |
//! | `&mut DeviceBuffer<T>` | `*mut T` | a write (waits for other streams' reads and writes first) |
//! | `&Window` | `DevWindow` | a use that keeps the window's memory alive until the kernel ends |
//! | `&DevCommHandle` | `DevComm` | the same, and its fault reports become the stream's errors |

use crate::runtime::lifetime::{Completion, StreamId, Uses};
use crate::runtime::stream::StreamObserver;
use crate::{Device, Error, Result};
pub use ferrolink_device::kernel::{KernelArgs, KernelParam};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Grid and block shape of a launch, its dynamic shared memory, and (emulator only) its
/// timeout.
///
/// ```
/// use ferrolink::LaunchConfig;
/// let cfg = LaunchConfig { grid: (4, 2, 1), ..LaunchConfig::linear(1, 128) };
/// assert_eq!(cfg.block_threads(), 128);
/// assert!(!cfg.is_1d());
/// assert!(cfg.validate("my_kernel").is_ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// CTAs per axis.
    pub grid: (u32, u32, u32),
    /// Threads per CTA per axis.
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory per CTA ([`ferrolink_device::arch::dynamic_shared_mem`]).
    pub shared_mem_bytes: u32,
    /// On the CPU emulator, fail the launch with a timeout error after this long
    /// (default: [`ferrolink_device::emulator::default_timeout`]). Ignored on CUDA.
    pub emulator_timeout: Option<Duration>,
}

impl LaunchConfig {
    /// A 1-D launch of `grid` CTAs of `block` threads.
    ///
    /// ```
    /// let cfg = ferrolink::LaunchConfig::linear(4, 256);
    /// assert_eq!((cfg.grid, cfg.block), ((4, 1, 1), (256, 1, 1)));
    /// ```
    pub const fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig { grid: (grid, 1, 1), block: (block, 1, 1), shared_mem_bytes: 0, emulator_timeout: None }
    }

    /// The same launch with `bytes` of dynamic shared memory per CTA.
    ///
    /// ```
    /// use ferrolink::LaunchConfig;
    /// assert_eq!(LaunchConfig::linear(1, 32).with_shared_mem(4096).shared_mem_bytes, 4096);
    /// assert!(LaunchConfig::linear(1, 32).with_shared_mem(228 * 1024).validate("k").is_err()); // over 227 KiB
    /// ```
    pub const fn with_shared_mem(mut self, bytes: u32) -> LaunchConfig {
        self.shared_mem_bytes = bytes;
        self
    }

    /// The same launch with an emulator timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// let cfg = ferrolink::LaunchConfig::linear(1, 32).with_emulator_timeout(Duration::from_secs(5));
    /// assert_eq!(cfg.emulator_timeout, Some(Duration::from_secs(5)));
    /// ```
    pub const fn with_emulator_timeout(mut self, timeout: Duration) -> LaunchConfig {
        self.emulator_timeout = Some(timeout);
        self
    }

    /// Threads in one CTA.
    ///
    /// ```
    /// use ferrolink::LaunchConfig;
    /// assert_eq!(LaunchConfig { block: (8, 8, 4), ..LaunchConfig::linear(1, 1) }.block_threads(), 256);
    /// ```
    pub fn block_threads(&self) -> u64 {
        u64::from(self.block.0) * u64::from(self.block.1) * u64::from(self.block.2)
    }

    /// Whether the launch is one-dimensional (grid and block `y` and `z` are 1).
    ///
    /// ```
    /// use ferrolink::LaunchConfig;
    /// assert!(LaunchConfig::linear(8, 256).is_1d());
    /// assert!(!LaunchConfig { block: (16, 16, 1), ..LaunchConfig::linear(8, 1) }.is_1d());
    /// ```
    pub fn is_1d(&self) -> bool {
        self.grid.1 == 1 && self.grid.2 == 1 && self.block.1 == 1 && self.block.2 == 1
    }

    /// Rejects shapes no backend can run: empty axes, more than 1024 threads per CTA, more
    /// than 227 KiB of dynamic shared memory, grids beyond CUDA's limits.
    ///
    /// ```
    /// use ferrolink::LaunchConfig;
    /// assert!(LaunchConfig::linear(1, 1024).validate("k").is_ok());
    /// assert!(LaunchConfig::linear(1, 1025).validate("k").is_err()); // too many threads per CTA
    /// assert!(LaunchConfig::linear(0, 32).validate("k").is_err()); // an empty grid
    /// ```
    pub fn validate(&self, kernel: &str) -> Result<()> {
        let (g, b) = (self.grid, self.block);
        let bad = |why: String| Err(Error::InvalidArgument(format!("launch of `{kernel}`: {why}")));
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return bad(format!("every grid and block dimension must be at least 1 (grid {g:?}, block {b:?})"));
        }
        if self.block_threads() > 1024 || b.2 > 64 {
            return bad(format!("block {b:?} exceeds 1024 threads per CTA (or 64 along z)"));
        }
        if g.1 > 65535 || g.2 > 65535 || g.0 > i32::MAX as u32 {
            return bad(format!("grid {g:?} exceeds CUDA's limits (2^31-1, 65535, 65535)"));
        }
        if self.shared_mem_bytes > 227 * 1024 {
            return bad(format!("{} bytes of dynamic shared memory exceed 227 KiB", self.shared_mem_bytes));
        }
        Ok(())
    }
}

/// What a launch's arguments use; filled by [`LaunchArg::track`]. Opaque: only the runtime
/// reads it.
///
/// ```
/// # use ferrolink::LaunchConfig;
/// # use ferrolink_device::kernels::copy::ferrolink_copy;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let (a, b) = (dev.create_stream()?, dev.create_stream()?);
/// let src = dev.alloc_from(&[2u8; 64])?;
/// let (mut mid, mut out) = (dev.alloc::<u8>(64)?, dev.alloc::<u8>(64)?);
/// let (module, cfg) = (dev.builtin_module()?, LaunchConfig::linear(1, 32));
/// // SAFETY: the copy kernel's contract: 64 bytes each, no overlap.
/// unsafe {
///     a.launch(module, &ferrolink_copy, cfg, (&mut mid, &src, 64usize))?;
///     // Tracked as a read of `mid`: stream `b` runs it after stream `a`'s write.
///     b.launch(module, &ferrolink_copy, cfg, (&mut out, &mid, 64usize))?;
/// }
/// assert_eq!(out.to_vec()?, vec![2u8; 64]);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LaunchTracking {
    device: Device,
    pub(crate) wrong_device: Option<&'static str>,
    pub(crate) reads: Vec<Arc<Uses>>,
    pub(crate) writes: Vec<Arc<Uses>>,
    pub(crate) holds: Vec<Arc<Uses>>,
    /// Kept alive until the work finishes, but never waited for by other work or host
    /// accesses (the persistent kernel keeps its ranks' resources: their own streams use
    /// them meanwhile, and the kernel runs until they stop it).
    pub(crate) keeps: Vec<Arc<Uses>>,
    pub(crate) observers: Vec<Weak<dyn StreamObserver>>,
    pub(crate) untracked: bool,
    /// The work's place in its stream's order, for streams whose completions are noted out
    /// of order (a GPU group's shared launches: the launch's number); 0 elsewhere.
    pub(crate) order: u64,
}

impl LaunchTracking {
    pub(crate) fn new(device: &Device) -> LaunchTracking {
        LaunchTracking {
            device: device.clone(),
            wrong_device: None,
            reads: Vec::new(),
            writes: Vec::new(),
            holds: Vec::new(),
            keeps: Vec::new(),
            observers: Vec::new(),
            untracked: false,
            order: 0,
        }
    }

    /// Notes `what` as an error unless it lives on the launch's device.
    pub(crate) fn expect_device(&mut self, dev: &Device, what: &'static str) {
        if !dev.same_as(&self.device) && self.wrong_device.is_none() {
            self.wrong_device = Some(what);
        }
    }

    /// What work queued on stream `stream` must wait for first: other streams' uses that
    /// may still run, of what it writes (reads and writes) and of what it reads (writes).
    pub(crate) fn foreign_pending(&self, stream: StreamId) -> Vec<Completion> {
        let writes = self.writes.iter().flat_map(|u| u.pending_from_others(stream, false));
        writes.chain(self.reads.iter().flat_map(|u| u.pending_from_others(stream, true))).collect()
    }

    /// Adds what `other` tracks (another rank's part of one piece of work).
    pub(crate) fn absorb(&mut self, other: LaunchTracking) {
        if !other.device.same_as(&self.device) && self.wrong_device.is_none() {
            self.wrong_device = Some("a part of a shared launch");
        }
        self.wrong_device = self.wrong_device.or(other.wrong_device);
        self.reads.extend(other.reads);
        self.writes.extend(other.writes);
        self.holds.extend(other.holds);
        self.keeps.extend(other.keeps);
        self.observers.extend(other.observers);
        self.untracked |= other.untracked;
    }

    /// Notes `c` as a use of everything tracked (reads, writes, holds; keepers; the device's
    /// untracked work).
    pub(crate) fn note(&self, c: &Completion) {
        for u in &self.reads {
            u.record(c, false);
        }
        for u in &self.writes {
            u.record(c, true);
        }
        for u in &self.holds {
            u.record(c, false);
        }
        for u in &self.keeps {
            u.record_keeper(c);
        }
        if self.untracked {
            self.device.0.untracked.record(c);
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        match self.wrong_device {
            Some(what) => Err(Error::WrongDevice(what)),
            None => Ok(()),
        }
    }
}

pub(crate) mod sealed {
    /// Seals [`super::LaunchArg`]: the crate decides which handles a launch can track.
    ///
    /// ```
    /// // Every launch argument is sealed: plain kernel parameters and the crate's handles.
    /// fn param_of<A: ferrolink::LaunchArg>(arg: A) -> A::Param {
    ///     arg.param()
    /// }
    /// assert_eq!(param_of(7u32), 7);
    /// ```
    pub trait Sealed {}
}

/// One argument of a launch: becomes the kernel parameter [`LaunchArg::Param`] and records
/// what the launch uses (see the [module docs](self)).
///
/// ```
/// use ferrolink::LaunchArg;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// assert_eq!(7u32.param(), 7); // a plain value passes as itself
/// let buf = dev.alloc::<f32>(4)?;
/// assert_eq!((&buf).param(), buf.as_kernel_ptr()); // a borrowed buffer becomes its address
/// # Ok(()) }
/// ```
pub trait LaunchArg: sealed::Sealed {
    /// The kernel parameter type it becomes.
    type Param: KernelParam;
    /// The parameter value.
    fn param(&self) -> Self::Param;
    /// Records what the launch uses through this argument.
    #[doc(hidden)]
    fn track(&self, tracking: &mut LaunchTracking);
}

impl<P: KernelParam> sealed::Sealed for P {}

impl<P: KernelParam> LaunchArg for P {
    type Param = P;
    fn param(&self) -> P {
        *self
    }
    fn track(&self, tracking: &mut LaunchTracking) {
        tracking.untracked |= P::HOLDS_ADDRESS;
    }
}

/// A tuple of [`LaunchArg`]s: the arguments of one launch. Its [`LaunchArgs::Params`] must be
/// the kernel's parameter tuple, so wrong arguments do not compile.
///
/// ```
/// use ferrolink::LaunchArgs;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let buf = dev.alloc::<u8>(16)?;
/// let (ptr, len): (*const u8, usize) = (&buf, 16usize).params();
/// assert_eq!((ptr, len), (buf.as_kernel_ptr(), 16));
/// # Ok(()) }
/// ```
pub trait LaunchArgs {
    /// The kernel parameter tuple.
    type Params: KernelArgs;
    /// The parameter values.
    fn params(&self) -> Self::Params;
    /// Records what the launch uses.
    #[doc(hidden)]
    fn track(&self, tracking: &mut LaunchTracking);
}

macro_rules! launch_args {
    ($($name:ident : $idx:tt),*) => {
        impl<$($name: LaunchArg),*> LaunchArgs for ($($name,)*) {
            type Params = ($($name::Param,)*);
            #[allow(clippy::unused_unit)]
            fn params(&self) -> Self::Params {
                ($(self.$idx.param(),)*)
            }
            #[allow(unused_variables)]
            fn track(&self, tracking: &mut LaunchTracking) {
                $(self.$idx.track(tracking);)*
            }
        }
    };
}
launch_args!();
launch_args!(A: 0);
launch_args!(A: 0, B: 1);
launch_args!(A: 0, B: 1, C: 2);
launch_args!(A: 0, B: 1, C: 2, D: 3);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10);
launch_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11);
