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
