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

/// A type that can be passed to a kernel by value.
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
