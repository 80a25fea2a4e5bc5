//! Backend selection: CUDA or the CPU emulator (the implementations live in
//! `runtime/backend/`).

use crate::{Error, Result};

/// Where kernels run and device memory lives.
///
/// ```
/// use ferrolink::Backend;
/// # fn main() -> ferrolink::Result<()> {
/// assert_eq!("cpu".parse::<Backend>()?, Backend::Cpu); // as `FERROLINK_BACKEND` is read
/// assert_eq!(Backend::Cuda.to_string(), "cuda");
/// assert!("tpu".parse::<Backend>().is_err());
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// An NVIDIA GPU through the CUDA driver API.
    Cuda,
    /// The CPU emulator: kernels on host threads, device memory in host memory.
    Cpu,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Cuda => "cuda",
            Backend::Cpu => "cpu",
        })
    }
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cuda" | "gpu" => Ok(Backend::Cuda),
            "cpu" | "emu" | "emulator" => Ok(Backend::Cpu),
            other => Err(Error::InvalidArgument(format!(
                "unknown backend `{other}`: use `cuda` or `cpu` (FERROLINK_BACKEND)"
            ))),
        }
    }
}

impl Backend {
    /// The backend to use by default: `FERROLINK_BACKEND` (`cuda`, `cpu` or `auto`) if set,
    /// else [`Backend::Cuda`] when a driver and GPU are present, else [`Backend::Cpu`].
    ///
    /// ```
    /// use ferrolink::Backend;
    /// # fn main() -> ferrolink::Result<()> {
    /// let backend = Backend::from_env()?;
    /// if std::env::var_os("FERROLINK_BACKEND").is_none() {
    ///     // CUDA exactly when this machine has it.
    ///     assert_eq!(backend == Backend::Cuda, Backend::Cuda.check_available().is_ok());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> Result<Backend> {
        match std::env::var("FERROLINK_BACKEND") {
            Ok(v) if !v.is_empty() && v != "auto" => v.parse(),
            _ => Ok(if crate::runtime::backend::availability(Backend::Cuda).is_ok() {
                Backend::Cuda
            } else {
                Backend::Cpu
            }),
        }
    }

    /// The byte that names this backend in a rank's description on the wire.
    pub(crate) fn wire_code(self) -> u8 {
        match self {
            Backend::Cuda => 1,
            Backend::Cpu => 2,
        }
    }

    /// The backend of [`Backend::wire_code`] `code`, or `None`.
    pub(crate) fn from_wire_code(code: u8) -> Option<Backend> {
        [Backend::Cuda, Backend::Cpu].into_iter().find(|b| b.wire_code() == code)
    }

    /// Whether this backend can be used on this machine; the error says why not.
    ///
    /// ```
    /// use ferrolink::{Backend, Error};
    /// assert!(Backend::Cpu.check_available().is_ok()); // always
    /// if let Err(e) = Backend::Cuda.check_available() {
    ///     assert!(matches!(e, Error::CudaUnavailable(_))); // the message says why
    /// }
    /// ```
    pub fn check_available(self) -> Result<()> {
        crate::runtime::backend::availability(self)
    }
}
