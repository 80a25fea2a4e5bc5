//! Scoped atomics and fences.
//!
//! Rust's `core::sync::atomic` cannot express a scope, and this nightly's LLVM drops the
//! ordering of read-modify-write atomics on nvptx (a `fetch_add(AcqRel)` becomes a relaxed
//! `atom.add`). So every operation here is written in PTX with an explicit `.sem` and
//! `.scope`: `ld.acquire.gpu.u32`, `atom.acq_rel.sys.add.u64`, `fence.sc.cta`, …
//!
//! All pointers are generic addresses (global or shared memory), naturally aligned.
//! On the emulator each maps to the std atomic of the same or stronger ordering.
//!
//! ```
//! use ferrolink_device::arch::atomic::{self, LoadOrder, RmwOrder, Scope, StoreOrder};
//! let mut word = 0u32;
//! let p = &raw mut word;
//! // SAFETY: `p` points to a live, aligned u32 that only atomics touch here.
//! unsafe {
//!     atomic::store(p, 5, StoreOrder::Release, Scope::Gpu);
//!     assert_eq!(atomic::fetch_add(p, 2, RmwOrder::AcqRel, Scope::Gpu), 5);
//!     assert_eq!(atomic::load(p, LoadOrder::Acquire, Scope::Gpu), 7);
//! }
//! ```

use super::imp;

/// The set of threads an atomic or fence orders memory with (PTX `.scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// `.cta`: threads of the same CTA.
    Cta,
    /// `.gpu`: all threads on the same GPU (other ranks' kernels on this GPU included).
    Gpu,
    /// `.sys`: all threads in the system: other GPUs over NVLink, and the host.
    Sys,
}

impl Scope {
    /// The scope as a `u32` for kernel arguments and `#[repr(C)]` structs: `0` CTA, `1` GPU,
    /// `2` system.
    pub const fn code(self) -> u32 {
        match self {
            Scope::Cta => 0,
            Scope::Gpu => 1,
            Scope::Sys => 2,
        }
    }

    /// Decodes [`Scope::code`]; unknown codes mean [`Scope::Sys`], the strongest.
    pub const fn from_code(code: u32) -> Scope {
        match code {
            0 => Scope::Cta,
            1 => Scope::Gpu,
            _ => Scope::Sys,
        }
    }
}

/// Ordering of an atomic load (PTX `ld.{relaxed,acquire}.scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadOrder {
    /// `.relaxed`: atomic, no ordering.
    Relaxed,
    /// `.acquire`: later memory operations of this thread are not performed before it; pairs
    /// with a release at a scope that includes this thread.
    Acquire,
}

/// Ordering of an atomic store (PTX `st.{relaxed,release}.scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOrder {
    /// `.relaxed`: atomic, no ordering.
    Relaxed,
    /// `.release`: earlier memory operations of this thread are performed (at the scope)
    /// before the store is.
    Release,
}

/// Ordering of a read-modify-write atomic (PTX `atom.{relaxed,acquire,release,acq_rel}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmwOrder {
    /// `.relaxed`
    Relaxed,
    /// `.acquire`
    Acquire,
    /// `.release`
    Release,
    /// `.acq_rel`
    AcqRel,
}

/// Ordering of a fence (PTX `fence.{acq_rel,sc}.scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceOrder {
    /// `fence.acquire` (PTX 8.6, sm_90): after a relaxed load that observed a release, forms
    /// an acquire pattern. Much cheaper than `AcqRel` on Hopper: it only invalidates the
    /// SM's L1 (`CCTL.IVALL`), where `AcqRel` waits for outstanding memory operations.
    Acquire,
    /// `fence.release` (PTX 8.6, sm_90): before a relaxed store, forms a release pattern
    /// (the same cost as a release store).
    Release,
    /// `fence.acq_rel`: a lightweight fence; with relaxed atomics around it, forms
    /// release/acquire patterns.
    AcqRel,
    /// `fence.sc`: sequentially consistent fence (slower; needed for store→load ordering).
    SeqCst,
}

/// A word type the atomics operate on: `u32` or `u64`. Sealed.
pub trait Word: Copy + sealed::Sealed {
    #[doc(hidden)]
    unsafe fn load(p: *const Self, o: LoadOrder, s: Scope) -> Self;
    #[doc(hidden)]
    unsafe fn store(p: *mut Self, v: Self, o: StoreOrder, s: Scope);
    #[doc(hidden)]
    unsafe fn fetch_add(p: *mut Self, v: Self, o: RmwOrder, s: Scope) -> Self;
    #[doc(hidden)]
    unsafe fn swap(p: *mut Self, v: Self, o: RmwOrder, s: Scope) -> Self;
    #[doc(hidden)]
    unsafe fn compare_swap(p: *mut Self, cmp: Self, new: Self, o: RmwOrder, s: Scope) -> Self;
    #[doc(hidden)]
    unsafe fn fetch_max(p: *mut Self, v: Self, o: RmwOrder, s: Scope) -> Self;
    #[doc(hidden)]
    unsafe fn red_add(p: *mut Self, v: Self, o: StoreOrder, s: Scope);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

macro_rules! impl_word {
    ($t:ty, $load:ident, $store:ident, $add:ident, $swap:ident, $cas:ident, $max:ident, $red:ident) => {
        impl Word for $t {
            #[inline(always)]
            unsafe fn load(p: *const Self, o: LoadOrder, s: Scope) -> Self {
                // SAFETY: forwarded contract of `atomic::load`.
                unsafe { imp::$load(p, o, s) }
            }
            #[inline(always)]
            unsafe fn store(p: *mut Self, v: Self, o: StoreOrder, s: Scope) {
                // SAFETY: forwarded contract of `atomic::store`.
                unsafe { imp::$store(p, v, o, s) }
            }
            #[inline(always)]
            unsafe fn fetch_add(p: *mut Self, v: Self, o: RmwOrder, s: Scope) -> Self {
                // SAFETY: forwarded contract of `atomic::fetch_add`.
                unsafe { imp::$add(p, v, o, s) }
            }
            #[inline(always)]
            unsafe fn swap(p: *mut Self, v: Self, o: RmwOrder, s: Scope) -> Self {
                // SAFETY: forwarded contract of `atomic::swap`.
                unsafe { imp::$swap(p, v, o, s) }
            }
            #[inline(always)]
            unsafe fn compare_swap(p: *mut Self, c: Self, n: Self, o: RmwOrder, s: Scope) -> Self {
                // SAFETY: forwarded contract of `atomic::compare_swap`.
                unsafe { imp::$cas(p, c, n, o, s) }
            }
            #[inline(always)]
            unsafe fn fetch_max(p: *mut Self, v: Self, o: RmwOrder, s: Scope) -> Self {
                // SAFETY: forwarded contract of `atomic::fetch_max`.
                unsafe { imp::$max(p, v, o, s) }
            }
            #[inline(always)]
            unsafe fn red_add(p: *mut Self, v: Self, o: StoreOrder, s: Scope) {
                // SAFETY: forwarded contract of `atomic::red_add`.
                unsafe { imp::$red(p, v, o, s) }
            }
        }
    };
}
impl_word!(u32, load_u32, store_u32, add_u32, exch_u32, cas_u32, max_u32, red_u32);
impl_word!(u64, load_u64, store_u64, add_u64, exch_u64, cas_u64, max_u64, red_u64);

/// Atomic load: `ld.{order}.{scope}.u32|u64`.
///
/// # Safety
/// `p` must be valid for reads, aligned to `size_of::<T>()`, and every concurrent access
/// to `*p` must be atomic.
#[inline(always)]
pub unsafe fn load<T: Word>(p: *const T, order: LoadOrder, scope: Scope) -> T {
    // SAFETY: the caller upholds this function's contract.
    unsafe { T::load(p, order, scope) }
}

/// Atomic store: `st.{order}.{scope}.u32|u64`.
///
/// # Safety
/// As [`load`], with `p` valid for writes.
#[inline(always)]
pub unsafe fn store<T: Word>(p: *mut T, value: T, order: StoreOrder, scope: Scope) {
    // SAFETY: the caller upholds this function's contract.
    unsafe { T::store(p, value, order, scope) }
}

/// Atomic wrapping add returning the old value: `atom.{order}.{scope}.add.u32|u64`.
///
/// # Safety
/// As [`store`].
#[inline(always)]
pub unsafe fn fetch_add<T: Word>(p: *mut T, value: T, order: RmwOrder, scope: Scope) -> T {
    // SAFETY: the caller upholds this function's contract.
    unsafe { T::fetch_add(p, value, order, scope) }
}

/// Atomic exchange returning the old value: `atom.{order}.{scope}.exch.b32|b64`.
///
/// # Safety
/// As [`store`].
#[inline(always)]
pub unsafe fn swap<T: Word>(p: *mut T, value: T, order: RmwOrder, scope: Scope) -> T {
    // SAFETY: the caller upholds this function's contract.
    unsafe { T::swap(p, value, order, scope) }
}

/// Atomic compare-and-swap: stores `new` if `*p == expected`; returns the old value either
/// way (success iff the return equals `expected`). `atom.{order}.{scope}.cas.b32|b64`.
///
/// # Safety
/// As [`store`].
#[inline(always)]
pub unsafe fn compare_swap<T: Word>(p: *mut T, expected: T, new: T, order: RmwOrder, scope: Scope) -> T {
    // SAFETY: the caller upholds this function's contract.
    unsafe { T::compare_swap(p, expected, new, order, scope) }
}

/// Atomic unsigned maximum returning the old value: `atom.{order}.{scope}.max.u32|u64`.
///
/// # Safety
/// As [`store`].
#[inline(always)]
pub unsafe fn fetch_max<T: Word>(p: *mut T, value: T, order: RmwOrder, scope: Scope) -> T {
    // SAFETY: the caller upholds this function's contract.
    unsafe { T::fetch_max(p, value, order, scope) }
}

/// Atomic add with no result (a *reduction*): `red.{order}.{scope}.add.u32|u64`. Cheaper
/// than [`fetch_add`] when the old value is not needed — the usual way to raise a signal.
///
/// # Safety
/// As [`store`].
#[inline(always)]
pub unsafe fn red_add<T: Word>(p: *mut T, value: T, order: StoreOrder, scope: Scope) {
    // SAFETY: the caller upholds this function's contract.
    unsafe { T::red_add(p, value, order, scope) }
}

/// Adds `value[i]` to `p[i]` for `i < 4`, relaxed, with no result:
/// `red.relaxed.{scope}.global.add.v4.f32` (sm_90). Each element's add is atomic on its own
/// (the four are not one atomic step); the sum's rounding is `f32` round-to-nearest, so
/// adds in a different order may round differently. A relaxed reduction: order it with a
/// release after it (a signal) and an acquire before the reads.
///
/// # Safety
/// `p` points to four `f32` of global memory (a device allocation, maybe a peer's through
/// the LSA mapping), 16-byte aligned, valid for writes, and every concurrent access to them
/// is atomic.
#[inline(always)]
pub unsafe fn red_add_f32x4(p: *mut f32, value: [f32; 4], scope: Scope) {
    // SAFETY: the caller upholds this function's contract.
    unsafe { imp::red_add_f32x4(p, value, scope) }
}

/// Two adjacent `u64` atomics in one instruction, relaxed: `ld.relaxed.{scope}.v2.u64`.
/// Each word is single-copy atomic on its own, as if loaded by [`load`] (PTX models a
/// vector access as one access per element, in no set order); the pair is not one atomic
/// step. For protocols whose every word carries its own flag (the LL lines): one round trip
/// to memory for two words.
///
/// # Safety
/// `p` must be valid for reads of 16 bytes, 16-byte aligned, and every concurrent access to
/// either word must be atomic.
#[inline(always)]
pub unsafe fn load_u64x2_relaxed(p: *const [u64; 2], scope: Scope) -> [u64; 2] {
    // SAFETY: the caller upholds this function's contract.
    unsafe { imp::load_u64x2_relaxed(p, scope) }
}

/// Stores two adjacent `u64`s in one instruction, each atomically and relaxed:
/// `st.relaxed.{scope}.v2.u64` (as [`load_u64x2_relaxed`]: the pair is not one atomic step).
///
/// # Safety
/// As [`load_u64x2_relaxed`], with `p` valid for writes.
#[inline(always)]
pub unsafe fn store_u64x2_relaxed(p: *mut [u64; 2], value: [u64; 2], scope: Scope) {
    // SAFETY: the caller upholds this function's contract.
    unsafe { imp::store_u64x2_relaxed(p, value, scope) }
}

/// Memory fence: `fence.{acq_rel|sc}.{scope}`.
#[inline(always)]
pub fn fence(order: FenceOrder, scope: Scope) {
    imp::fence(order, scope)
}
