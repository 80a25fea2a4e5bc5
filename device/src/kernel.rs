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

use core::ffi::c_void;
use core::marker::PhantomData;

/// A kernel declared with [`kernel!`](crate::kernel!): its PTX entry name and, on the host,
/// the function the CPU emulator runs per thread. `A` is the tuple of its argument types.
///
/// ```
/// use ferrolink_device::emulator::{self, LaunchSpec};
/// use ferrolink_device::kernel::Kernel;
/// use ferrolink_device::kernels::copy::ferrolink_copy;
/// # use std::time::Duration;
/// let k: &Kernel<(*mut u8, *const u8, usize)> = &ferrolink_copy;
/// let src: Vec<u8> = (0..100).collect();
/// let mut dst = vec![0u8; 100];
/// let spec = LaunchSpec { name: k.name(), grid: [2, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// // SAFETY: both buffers hold 100 bytes and outlive the launch (the kernel's contract).
/// unsafe { emulator::launch(&spec, k.host_entry(), (dst.as_mut_ptr(), src.as_ptr(), 100)) }.unwrap();
/// assert_eq!(dst, src);
/// ```
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
    pub const fn new(name: &'static str, host_entry: unsafe fn(A)) -> Self
    where
        A: KernelArgs,
    {
        Kernel { name, host_entry, _args: PhantomData }
    }

    /// The PTX entry point's name.
    ///
    /// ```
    /// assert_eq!(ferrolink_device::kernels::copy::ferrolink_copy.name(), "ferrolink_copy");
    /// ```
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The per-thread function the CPU emulator runs. Calling it is the kernel body itself,
    /// so it is `unsafe` with the kernel's contract (and needs an emulator thread context).
    ///
    /// ```
    /// use ferrolink_device::{arch, kernel};
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// # use std::time::Duration;
    /// kernel! {
    ///     /// Writes each thread's index in the grid.
    ///     pub unsafe fn ids(out: *mut u32) {
    ///         let i = arch::global_thread_idx_x();
    ///         // SAFETY: the launcher passes a word per thread.
    ///         unsafe { *out.add(i) = i as u32 };
    ///     }
    /// }
    /// let spec = LaunchSpec { name: ids.name(), grid: [2, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
    ///     timeout: Duration::from_secs(10) };
    /// let mut out = vec![0u32; 8];
    /// // SAFETY: `out` has a word per thread and outlives the launch.
    /// unsafe { emulator::launch(&spec, ids.host_entry(), (out.as_mut_ptr(),)) }.unwrap();
    /// assert_eq!(out, (0..8).collect::<Vec<u32>>());
    /// ```
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
///
/// ```
/// use ferrolink_device::kernel::ptx_entry_names;
/// let ptx = ".version 8.6\n.visible .entry add_one(\n\t.param .u64 add_one_param_0\n)\n{\n\tret;\n}\n\
///            .entry helper (\n)\n{\n\tret;\n}\n";
/// assert_eq!(ptx_entry_names(ptx).collect::<Vec<_>>(), ["add_one", "helper"]);
/// ```
pub fn ptx_entry_names(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines().filter_map(|line| {
        let rest = line.trim_start();
        let rest = rest.strip_prefix(".visible ").unwrap_or(rest);
        let name = rest.strip_prefix(".entry ")?.split(['(', ' ']).next()?.trim();
        (!name.is_empty()).then_some(name)
    })
}

/// A type that can be passed to a kernel by value.
///
/// ```
/// use ferrolink_device::{arch, kernel};
/// use ferrolink_device::kernel::KernelParam;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// /// A range of words, passed by value.
/// #[repr(C)]
/// #[derive(Clone, Copy)]
/// pub struct Range {
///     pub start: u64,
///     pub len: u64,
/// }
/// // SAFETY: `#[repr(C)]` of two `u64`s, no padding; plain numbers, no addresses.
/// unsafe impl KernelParam for Range {
///     const HOLDS_ADDRESS: bool = false;
/// }
/// kernel! {
///     /// Writes `range.start + i` into word `i` of `out`, for `i < range.len`.
///     pub unsafe fn iota(range: Range, out: *mut u64) {
///         let i = arch::global_thread_idx_x();
///         if (i as u64) < range.len {
///             // SAFETY: the launcher passes `range.len` words.
///             unsafe { *out.add(i) = range.start + i as u64 };
///         }
///     }
/// }
/// assert!(!<u32 as KernelParam>::HOLDS_ADDRESS && <*mut u64 as KernelParam>::HOLDS_ADDRESS);
/// # let spec = LaunchSpec { name: "iota", grid: [1, 1, 1], block: [8, 1, 1], shared_mem_bytes: 0,
/// #     timeout: Duration::from_secs(10) };
/// let mut out = vec![0u64; 5];
/// // SAFETY: `out` holds `len` words and outlives the launch.
/// unsafe { emulator::launch(&spec, iota.host_entry(), (Range { start: 10, len: 5 }, out.as_mut_ptr())) }
///     .unwrap();
/// assert_eq!(out, [10, 11, 12, 13, 14]);
/// ```
///
/// # Safety
/// The type's size and layout must match the PTX parameter rustc's nvptx backend emits for
/// it (true for primitive integers, floats, raw pointers, and `#[repr(C)]` structs of them
/// without padding that matters); its values must be meaningful on the device (no host
/// pointers on CUDA); and it must be plain data that every thread of a launch may copy at
/// once (no interior mutability, no thread-bound state): the CPU emulator hands one copy of
/// the arguments to all its threads.
pub unsafe trait KernelParam: Copy + 'static {
    /// Whether values of this type carry device addresses (pointers, or structs holding
    /// them). A launch whose arguments hold addresses the host cannot track (raw pointers
    /// rather than borrowed buffers) is handled conservatively by the host runtime: memory
    /// freed after such a launch is kept until the launch has finished.
    const HOLDS_ADDRESS: bool;
}

macro_rules! kernel_params {
    ($($t:ty),*) => { $(
        // SAFETY: a primitive passed as the PTX scalar of the same width; plain data.
        unsafe impl KernelParam for $t {
            const HOLDS_ADDRESS: bool = false;
        }
    )* };
}
kernel_params!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, f32, f64);
// SAFETY: pointers are passed as `.u64` device addresses; an address is plain data.
unsafe impl<T: 'static> KernelParam for *const T {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: as above.
unsafe impl<T: 'static> KernelParam for *mut T {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: `#[repr(C)]` Pod structs of u32/u64 fields, passed as `.param .align 8 .b8 [N]`
// (checked in the PTX); device addresses inside.
unsafe impl KernelParam for crate::DevComm {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: as above.
unsafe impl KernelParam for crate::DevWindow {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of u32/u64 words (checked in the PTX), no addresses.
unsafe impl KernelParam for crate::coll::CollArgs {
    const HOLDS_ADDRESS: bool = false;
}
// SAFETY: a `#[repr(C)]` Pod struct of u64 and u32 words, device addresses inside.
unsafe impl KernelParam for crate::coll::group::LocalRanks {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of u32 and u64 words, device addresses inside (the
// entries' communicators and windows).
unsafe impl KernelParam for crate::coll::group::GroupLaunch {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of u32 and u64 words, device addresses inside (its
// communicator and windows).
unsafe impl KernelParam for crate::coll::group::RankOp {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of u32 words (checked in the PTX), no addresses.
unsafe impl KernelParam for crate::p2p::P2pArgs {
    const HOLDS_ADDRESS: bool = false;
}
// SAFETY: a `#[repr(C)]` Pod struct of u32 and u64 words, device addresses inside.
unsafe impl KernelParam for crate::moe::MoeArgs {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of u32 and u64 words, device addresses inside.
unsafe impl KernelParam for crate::moe::low_latency::MoeLowLatencyArgs {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of windows and u32 and u64 words, device addresses inside.
unsafe impl KernelParam for crate::moe::fused::FusedCombineArgs {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of one u64 word, a graph's handle (kept alive as memory is).
unsafe impl KernelParam for crate::graph::DeviceGraph {
    const HOLDS_ADDRESS: bool = true;
}
// SAFETY: a `#[repr(C)]` Pod struct of three u32 words, no addresses.
unsafe impl KernelParam for crate::comm::Team {
    const HOLDS_ADDRESS: bool = false;
}
// SAFETY: a `#[repr(C)]` Pod struct of two u32 words (a barrier set), no addresses.
unsafe impl KernelParam for crate::comm::LsaBarrierHandle {
    const HOLDS_ADDRESS: bool = false;
}

/// A tuple of [`KernelParam`]s: the arguments of one launch, matching a kernel's declared
/// parameter types exactly (the [`Kernel`] type says which).
///
/// ```
/// use ferrolink_device::kernel::KernelArgs;
/// let args = (7u32, 2.5f32);
/// assert!(!<(u32, f32)>::HOLDS_ADDRESS);
/// assert!(<(u32, *mut u8)>::HOLDS_ADDRESS);
/// args.with_param_ptrs(|ptrs| {
///     assert_eq!(ptrs.len(), 2);
///     // SAFETY: each pointer points to the argument of its position, alive during the call.
///     unsafe { assert_eq!((*(ptrs[0] as *const u32), *(ptrs[1] as *const f32)), (7, 2.5)) };
/// });
/// ```
pub trait KernelArgs: Copy + 'static {
    /// Whether any argument holds a device address ([`KernelParam::HOLDS_ADDRESS`]).
    const HOLDS_ADDRESS: bool;
    /// Calls `f` with one pointer per argument, as `cuLaunchKernel` wants them (which reads
    /// through them only: the pointers are mutable in its signature alone).
    fn with_param_ptrs<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
}

macro_rules! kernel_args {
    ($($name:ident : $idx:tt),*) => {
        impl<$($name: KernelParam),*> KernelArgs for ($($name,)*) {
            const HOLDS_ADDRESS: bool = false $(|| $name::HOLDS_ADDRESS)*;
            #[allow(unused_mut)]
            fn with_param_ptrs<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
                let mut ptrs: [*mut c_void; 0 $(+ { let _ = $idx; 1 })*] =
                    [$(&self.$idx as *const $name as *mut c_void),*];
                f(&mut ptrs)
            }
        }
    };
}
kernel_args!();
kernel_args!(A: 0);
kernel_args!(A: 0, B: 1);
kernel_args!(A: 0, B: 1, C: 2);
kernel_args!(A: 0, B: 1, C: 2, D: 3);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11);
