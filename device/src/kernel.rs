//! Declaring kernels once for both backends.
//!
//! [`kernel!`](crate::kernel!) takes an `unsafe fn` and produces:
//! * on nvptx64: `#[no_mangle] unsafe extern "ptx-kernel" fn NAME(..)`, a PTX `.entry NAME`;
//! * on the host: `const NAME: Kernel<(A, B, ..)>`, a typed descriptor that carries the
//!   entry's name (to find it in the PTX) and a host function the emulator runs.
//!
//! The host crate launches a descriptor with a tuple of exactly the declared argument types,
//! so a launch with wrong argument types does not compile.
//!
//! A device crate that declares kernels needs `#![cfg_attr(target_arch = "nvptx64",
//! feature(abi_ptx))]` (the PTX kernel ABI is unstable).

use core::marker::PhantomData;

/// A kernel declared with [`kernel!`](crate::kernel!): its PTX entry name and, on the host,
/// the function the CPU emulator runs per thread. `A` is the tuple of its argument types.
pub struct Kernel<A> {
    name: &'static str,
    #[cfg(not(target_arch = "nvptx64"))]
    host_entry: unsafe fn(A),
    _args: PhantomData<fn(A)>,
}

impl<A> Kernel<A> {
    /// Used by [`kernel!`](crate::kernel!); not meant to be called directly.
    #[doc(hidden)]
    #[cfg(not(target_arch = "nvptx64"))]
    pub const fn new(name: &'static str, host_entry: unsafe fn(A)) -> Self {
        Kernel { name, host_entry, _args: PhantomData }
    }

    /// The PTX entry point's name.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The per-thread function the CPU emulator runs. Calling it is the kernel body itself,
    /// so it is `unsafe` with the kernel's contract (and needs an emulator thread context).
    #[cfg(not(target_arch = "nvptx64"))]
    pub fn host_entry(&self) -> unsafe fn(A) {
        self.host_entry
    }
}

/// Declares a kernel for both backends. See the [module docs](mod@crate::kernel).
///
/// ```
/// use ferrolink_device::{arch, kernel};
/// kernel! {
///     /// Adds one to each of `n` words.
///     pub unsafe fn add_one(data: *mut u32, n: usize) {
///         let i = arch::global_thread_idx_x();
///         if i < n {
///             // SAFETY: the launcher passes `n` valid words.
///             unsafe { *data.add(i) += 1 };
///         }
///     }
/// }
/// // On the host, `add_one` is a typed descriptor:
/// let k: &ferrolink_device::kernel::Kernel<(*mut u32, usize)> = &add_one;
/// assert_eq!(k.name(), "add_one");
/// ```
#[macro_export]
macro_rules! kernel {
    ($(#[$meta:meta])* $vis:vis unsafe fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block) => {
        $(#[$meta])*
        #[cfg(target_arch = "nvptx64")]
        #[unsafe(no_mangle)]
        $vis unsafe extern "ptx-kernel" fn $name($($arg: $ty),*) $body

        $(#[$meta])*
        #[cfg(not(target_arch = "nvptx64"))]
        #[allow(non_upper_case_globals)]
        $vis const $name: $crate::kernel::Kernel<($($ty,)*)> = {
            #[allow(clippy::too_many_arguments)]
            unsafe fn body($($arg: $ty),*) $body
            unsafe fn entry(args: ($($ty,)*)) {
                #[allow(unused_variables)]
                let ($($arg,)*) = args;
                // SAFETY: the caller (the emulator, inside an `unsafe` launch) guarantees the
                // kernel's contract.
                unsafe { body($($arg),*) }
            }
            $crate::kernel::Kernel::new(stringify!($name), entry)
        };
    };
}

/// The names of the kernel entries (`.entry NAME(`) declared in a PTX text.
pub fn ptx_entry_names(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines().filter_map(|line| {
        let rest = line.trim_start();
        let rest = rest.strip_prefix(".visible ").unwrap_or(rest);
        let name = rest.strip_prefix(".entry ")?.split(['(', ' ']).next()?.trim();
        (!name.is_empty()).then_some(name)
    })
}
