//! The crate's one error type.

use cudarc::driver::DriverError;
use ferrolink_device::emulator::EmuError;

/// Everything that can go wrong in ferrolink's host API.
///
/// ```
/// use ferrolink::Error;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let mut buf = dev.alloc::<u32>(4)?;
/// let err = buf.copy_from_host(&[1, 2]).unwrap_err();
/// assert!(matches!(err, Error::InvalidArgument(_)));
/// assert!(err.to_string().contains("buffer has 4"));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// CUDA was asked for (or needed) but no usable driver or GPU is present.
    #[error(
        "CUDA backend unavailable: {0}. Use the CPU emulator (FERROLINK_BACKEND=cpu), or run on a \
         machine with an NVIDIA driver and GPU"
    )]
    CudaUnavailable(String),
    /// A CUDA driver call returned an error.
    #[error("CUDA driver call {call} failed: {source:?}")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The driver's error code.
        source: DriverError,
    },
    /// A kernel failed on the CPU emulator (timeout, panic, trap, invalid launch).
    #[error(transparent)]
    Emulator(#[from] EmuError),
    /// An argument was invalid; the message says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A kernel's entry was not found in the module it was launched from.
    #[error(
        "kernel `{0}` is not in this module: launch it from the module built from the device \
         crate that declares it"
    )]
    KernelNotFound(String),
    /// An earlier operation on this stream failed; the stream stays failed.
    #[error("an earlier operation on this stream failed: {0}")]
    StreamFailed(String),
    /// The communicator was aborted: by `Communicator::abort`, because a rank's stream
    /// failed, or because a kernel reported a fault. The message says which.
    #[error("the communicator was aborted: {0}")]
    Aborted(String),
    /// The watchdog found a device wait that did not finish within the communicator's
    /// timeout, and aborted the communicator. The message says who waits on whom.
    #[error("the watchdog aborted the communicator: {0}")]
    WaitTimeout(String),
    /// A kernel reported a fault through its device communicator before it stopped (on the
    /// GPU it then trapped, which breaks the device's context).
    #[error("{report} (the kernel stopped: {cause})")]
    DeviceFault {
        /// The fault, decoded: where, what, and how to fix it.
        report: String,
        /// The stream's own error.
        cause: String,
    },
    /// The bootstrap (how ranks find each other and exchange host messages) failed: a rank
    /// never came, a connection broke, a message was malformed. The message names the ranks.
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// Objects from different devices were mixed.
    #[error("{0} belongs to a different device than the stream or buffer it was used with")]
    WrongDevice(&'static str),
}

/// `Result` with [`Error`].
///
/// ```
/// fn sum_on_device(dev: &ferrolink::Device, data: &[u32]) -> ferrolink::Result<u32> {
///     Ok(dev.alloc_from(data)?.to_vec()?.iter().sum())
/// }
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// assert_eq!(sum_on_device(&dev, &[1, 2, 3])?, 6);
/// # Ok(()) }
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn cuda_err(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |source| Error::Cuda { call, source }
}
