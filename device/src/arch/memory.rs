//! Vector memory access and dynamic shared memory.

use super::imp;

/// Sixteen bytes as four `u32`s, the unit of a vectorized copy.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// let v = U32x4([1, 2, 3, 4]);
/// assert_eq!((size_of::<U32x4>(), align_of::<U32x4>()), (16, 16));
/// assert_eq!(v.0[2], 3);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub struct U32x4(pub [u32; 4]);

/// Loads 16 bytes in one instruction: `ld.global.v4.u32`.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn copy((dst, src, n): (*mut U32x4, *const U32x4, usize)) {
///     let mut i = arch::global_thread_idx_x();
///     while i < n {
///         // SAFETY: `src` and `dst` hold `n` aligned vectors; no thread writes `src`, and
///         // each `i` is copied by one thread.
///         unsafe { arch::store_v4(dst.add(i), arch::load_v4(src.add(i))) };
///         i += arch::grid_threads_x();
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let src: Vec<U32x4> = (0..20).map(|i| U32x4([i; 4])).collect();
/// let mut dst = vec![U32x4::default(); 20];
/// // SAFETY: both buffers hold 20 vectors and outlive the launch.
/// unsafe { emulator::launch(&spec, copy, (dst.as_mut_ptr(), src.as_ptr(), 20)) }.unwrap();
/// assert_eq!(dst, src);
/// ```
///
/// # Safety
/// `p` must be a global-memory address valid for 16 bytes of reads and 16-byte aligned,
/// with no concurrent writes to those bytes.
#[inline(always)]
pub unsafe fn load_v4(p: *const U32x4) -> U32x4 {
    // SAFETY: forwarded contract.
    unsafe { imp::load_v4(p) }
}

/// Loads 16 bytes in one volatile instruction: `ld.volatile.global.v4.u32` (never from a
/// cache line that may be stale: for memory another agent writes, such as host memory the
/// host rewrites between operations; as a relaxed load at system scope, ordered by fences).
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// // A 16-byte entry that the host may rewrite between reads (here it does not).
/// let entry = U32x4([9, 8, 7, 6]);
/// // SAFETY: 16 live, aligned bytes.
/// assert_eq!(unsafe { arch::load_v4_volatile(&raw const entry) }.0, [9, 8, 7, 6]);
/// ```
///
/// # Safety
/// As [`load_v4`], except that other agents may write the bytes between such loads (each
/// load reads them whole only if the writer wrote them before the reader's acquire).
#[inline(always)]
pub unsafe fn load_v4_volatile(p: *const U32x4) -> U32x4 {
    // SAFETY: forwarded contract.
    unsafe { imp::load_v4_volatile(p) }
}

/// The address of a kernel's by-value parameter in the kernel parameter space, for
/// [`load_param_v2`]: `kernel_param_address!(kernel, index, argument)` inside the body of
/// `kernel`, whose parameter `index` (from 0) is `argument`.
///
/// Why: rustc's nvptx backend copies a by-value parameter that is indexed with a run-time
/// offset into local memory, every thread all of it (a GPU group's launch carries every
/// rank's operation, and each CTA reads its rank's). Taking the parameter's address with
/// `mov` (PTX: "the address of a kernel parameter may be moved into a register … accessed
/// using ld.param") reads only what each thread needs. The name `{kernel}_param_{index}` is
/// how rustc names the parameters of an `extern "ptx-kernel"` entry; a wrong name fails
/// when ptxas assembles the PTX (the build checks it), never at run time. Use the argument
/// only through this address or through fields at constant offsets, or the copy comes back.
/// On the emulator it is the argument's own address.
#[macro_export]
#[doc(hidden)]
macro_rules! kernel_param_address {
    ($kernel:ident, $index:literal, $argument:ident) => {{
        #[cfg(target_arch = "nvptx64")]
        let address: u64 = {
            let address: u64;
            // SAFETY: `mov` of a parameter's name reads no memory; it yields the address
            // of the running kernel's parameter (the macro's contract names it).
            unsafe {
                ::core::arch::asm!(
                    concat!("mov.b64 {0}, ", stringify!($kernel), "_param_", stringify!($index), ";"),
                    out(reg64) address,
                    options(nomem, nostack, pure),
                )
            };
            address
        };
        #[cfg(not(target_arch = "nvptx64"))]
        let address: u64 = ::core::ptr::addr_of!($argument) as u64;
        address
    }};
}

/// Loads 16 bytes of the kernel's parameters: `ld.param.v2.b64` from an address made by
/// [`kernel_param_address!`](crate::kernel_param_address) plus an offset.
///
/// It must run in the kernel's own body: code that calls it is `#[inline(always)]` from the
/// kernel's entry down. In a called PTX function (`.func`) `ld.param` reads that function's
/// parameters, not the kernel's: on an H200 such a read returned garbage and the kernel then
/// faulted (illegal address). `ferrolink-builder` rejects PTX whose functions load parameters
/// through a register.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// use ferrolink_device::{coll::CollArgs, kernel};
/// kernel! {
///     /// Writes the first 16 bytes of `args` to `out`, read in place from the parameter.
///     pub unsafe fn head(args: CollArgs, out: *mut [u64; 2]) {
///         let param = ferrolink_device::kernel_param_address!(head, 0, args);
///         // SAFETY: 16 bytes at offset 0 of the 64-byte `args`, 8-byte aligned, read in
///         // `head`'s own body; one thread writes `out`.
///         unsafe {
///             let words = arch::load_param_v2(param);
///             if arch::thread_idx_x() == 0 {
///                 out.write(words);
///             }
///         }
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let args = CollArgs { kind: 1, algo: 2, dtype: 3, op: 4, ..CollArgs::default() };
/// let mut out = [0u64; 2];
/// // SAFETY: `out` outlives the launch.
/// unsafe { emulator::launch(&spec, head.host_entry(), (args, &raw mut out)) }.unwrap();
/// assert_eq!(out, [1 | (2 << 32), 3 | (4 << 32)]);
/// ```
///
/// # Safety
/// `address` lies 16 bytes inside one of the running kernel's parameters, 8-byte aligned,
/// and the call is inlined into that kernel's body (above).
#[inline(always)]
pub unsafe fn load_param_v2(address: u64) -> [u64; 2] {
    // SAFETY: forwarded contract.
    unsafe { imp::load_param_v2(address) }
}

/// Stores 16 bytes in one instruction: `st.global.v4.u32`.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// let mut dst = [U32x4::default(); 2];
/// // SAFETY: 16 live, aligned bytes that nothing else accesses.
/// unsafe { arch::store_v4(&mut dst[1], U32x4([1, 2, 3, 4])) };
/// assert_eq!(dst, [U32x4([0; 4]), U32x4([1, 2, 3, 4])]);
/// ```
///
/// # Safety
/// `p` must be a global-memory address valid for 16 bytes of writes and 16-byte aligned,
/// with no concurrent access to those bytes.
#[inline(always)]
pub unsafe fn store_v4(p: *mut U32x4, v: U32x4) {
    // SAFETY: forwarded contract.
    unsafe { imp::store_v4(p, v) }
}

/// Stores 16 bytes with the streaming hint (`st.global.cs.v4.u32`: likely accessed once,
/// evict first), which keeps a large copy from flushing useful lines out of L2.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// // A large copy's destination, not read again soon.
/// let mut dst = [U32x4::default(); 2];
/// for (i, d) in dst.iter_mut().enumerate() {
///     // SAFETY: 16 live, aligned bytes that nothing else accesses.
///     unsafe { arch::store_v4_streaming(d, U32x4([i as u32; 4])) };
/// }
/// assert_eq!(dst[1], U32x4([1; 4]));
/// ```
///
/// # Safety
/// As [`store_v4`].
#[inline(always)]
pub unsafe fn store_v4_streaming(p: *mut U32x4, v: U32x4) {
    // SAFETY: forwarded contract.
    unsafe { imp::store_v4_cs(p, v) }
}

/// Loads 16 bytes through the read-only (non-coherent) path with a streaming hint:
/// `ld.global.nc.L1::no_allocate.v4.u32`. Only for data no thread writes during the kernel.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// // Input that nothing writes while the kernel runs.
/// let input = [U32x4([1, 2, 3, 4]), U32x4([5, 6, 7, 8])];
/// // SAFETY: 16 live, aligned bytes, never written meanwhile.
/// let v = unsafe { arch::load_v4_readonly(&input[1]) };
/// assert_eq!(v, U32x4([5, 6, 7, 8]));
/// ```
///
/// # Safety
/// As [`load_v4`], and nothing may write the 16 bytes while the kernel runs.
#[inline(always)]
pub unsafe fn load_v4_readonly(p: *const U32x4) -> U32x4 {
    // SAFETY: forwarded contract.
    unsafe { imp::load_v4_nc(p) }
}

/// Loads 16 bytes read-only, asking L2 to fetch the surrounding 256 bytes from DRAM
/// (`ld.global.nc.L1::no_allocate.L2::256B.v4.u32`): fewer, larger DRAM bursts for
/// sequential streams.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// // A sequential read-only stream: each load asks L2 for its whole 256-byte block.
/// let input: Vec<U32x4> = (0..16).map(|i| U32x4([i; 4])).collect();
/// let mut sum = 0;
/// for v in &input {
///     // SAFETY: 16 live, aligned bytes, never written meanwhile.
///     sum += unsafe { arch::load_v4_readonly_prefetch256(v) }.0[0];
/// }
/// assert_eq!(sum, (0..16u32).sum::<u32>());
/// ```
///
/// # Safety
/// As [`load_v4_readonly`].
#[inline(always)]
pub unsafe fn load_v4_readonly_prefetch256(p: *const U32x4) -> U32x4 {
    // SAFETY: forwarded contract.
    unsafe { imp::load_v4_nc_l2_256(p) }
}

/// The CTA's dynamic shared memory (sized by the launch's `shared_mem_bytes`), as a
/// pointer to `T`. On the GPU it is `.extern .shared .align 16 .b8 []`; on the emulator a
/// per-CTA zeroed host buffer of the same size.
///
/// The pointer is 16-byte aligned; the caller carves it up and must stay within the size
/// given at launch.
///
/// ```
/// # use ferrolink_device::arch::{self, U32x4};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // Each warp stages its lanes' ids in its 32 words, then lane 0 sums them.
///     let sh = arch::dynamic_shared_mem::<u32>();
///     let (t, lane) = (arch::thread_idx_x(), arch::lane_id());
///     // SAFETY: the launch gives 4 bytes per thread; each thread writes its own word.
///     unsafe { sh.add(t).write(lane) };
///     arch::sync_warp(arch::FULL_MASK);
///     if lane == 0 {
///         // SAFETY: this warp's words, written before the warp barrier; one output per warp.
///         unsafe { *out.add(t / 32) = (0..32).map(|i| sh.add(t + i).read()).sum() };
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 64 * 4,
///     timeout: Duration::from_secs(10) };
/// let mut out = [0u32; 2];
/// // SAFETY: `out` has a word per warp and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, [496, 496]);
/// ```
#[inline(always)]
pub fn dynamic_shared_mem<T>() -> *mut T {
    imp::dynamic_shared_mem::<T>()
}
