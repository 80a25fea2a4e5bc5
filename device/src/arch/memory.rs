//! Vector memory access and dynamic shared memory.

use super::imp;

/// Sixteen bytes as four `u32`s, the unit of a vectorized copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub struct U32x4(pub [u32; 4]);

/// Loads 16 bytes in one instruction: `ld.global.v4.u32`.
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
#[inline(always)]
pub fn dynamic_shared_mem<T>() -> *mut T {
    imp::dynamic_shared_mem::<T>()
}
