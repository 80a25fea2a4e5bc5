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
///
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let mut flag = 0u32;
/// // A flag that a peer GPU or the host polls needs system scope.
/// // SAFETY: `flag` is live and aligned; nothing else accesses it.
/// unsafe { atomic::store(&raw mut flag, 1, StoreOrder::Release, Scope::Sys) };
/// assert_eq!(flag, 1);
/// ```
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
    ///
    /// ```
    /// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
    /// assert_eq!(Scope::Gpu.code(), 1);
    /// assert_eq!(Scope::from_code(Scope::Cta.code()), Scope::Cta);
    /// ```
    pub const fn code(self) -> u32 {
        match self {
            Scope::Cta => 0,
            Scope::Gpu => 1,
            Scope::Sys => 2,
        }
    }

    /// Decodes [`Scope::code`]; unknown codes mean [`Scope::Sys`], the strongest.
    ///
    /// ```
    /// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
    /// assert_eq!(Scope::from_code(1), Scope::Gpu);
    /// assert_eq!(Scope::from_code(9), Scope::Sys); // unknown: the strongest
    /// ```
    pub const fn from_code(code: u32) -> Scope {
        match code {
            0 => Scope::Cta,
            1 => Scope::Gpu,
            _ => Scope::Sys,
        }
    }
}

/// Ordering of an atomic load (PTX `ld.{relaxed,acquire}.scope`).
///
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let ready = 1u32;
/// // Acquire: reads after it see what the releasing thread wrote before its release.
/// // SAFETY: `ready` is live and aligned, accessed only atomically.
/// assert_eq!(unsafe { atomic::load(&raw const ready, LoadOrder::Acquire, Scope::Gpu) }, 1);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadOrder {
    /// `.relaxed`: atomic, no ordering.
    Relaxed,
    /// `.acquire`: later memory operations of this thread are not performed before it; pairs
    /// with a release at a scope that includes this thread.
    Acquire,
}

/// Ordering of an atomic store (PTX `st.{relaxed,release}.scope`).
///
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let data = 42u64; // a plain write, published by the release below
/// let mut flag = 0u32;
/// // SAFETY: `flag` is live and aligned, accessed only atomically.
/// unsafe { atomic::store(&raw mut flag, 1, StoreOrder::Release, Scope::Gpu) };
/// assert_eq!((data, flag), (42, 1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOrder {
    /// `.relaxed`: atomic, no ordering.
    Relaxed,
    /// `.release`: earlier memory operations of this thread are performed (at the scope)
    /// before the store is.
    Release,
}

/// Ordering of a read-modify-write atomic (PTX `atom.{relaxed,acquire,release,acq_rel}`).
///
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let mut tickets = 0u32;
/// // A ticket counter needs atomicity only: relaxed.
/// // SAFETY: `tickets` is live and aligned, accessed only atomically.
/// let mine = unsafe { atomic::fetch_add(&raw mut tickets, 1, RmwOrder::Relaxed, Scope::Gpu) };
/// assert_eq!((mine, tickets), (0, 1));
/// ```
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
///
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let mut flag = 0u32;
/// // Release pattern: a release fence, then a relaxed store.
/// atomic::fence(FenceOrder::Release, Scope::Gpu);
/// // SAFETY: `flag` is live and aligned, accessed only atomically.
/// unsafe { atomic::store(&raw mut flag, 1, StoreOrder::Relaxed, Scope::Gpu) };
/// // Acquire pattern: a relaxed load that sees the flag, then an acquire fence.
/// // SAFETY: as above.
/// if unsafe { atomic::load(&raw const flag, LoadOrder::Relaxed, Scope::Gpu) } == 1 {
///     atomic::fence(FenceOrder::Acquire, Scope::Gpu);
/// }
/// ```
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
///
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// use ferrolink_device::arch::atomic::Word;
/// /// Takes the word at `p`, leaving `zero`.
/// unsafe fn take<T: Word>(p: *mut T, zero: T) -> T {
///     // SAFETY: the caller's contract (as `atomic::swap`).
///     unsafe { atomic::swap(p, zero, RmwOrder::AcqRel, Scope::Gpu) }
/// }
/// let (mut a, mut b) = (5u32, 9u64);
/// // SAFETY: both are live, aligned and accessed only atomically.
/// unsafe { assert_eq!((take(&raw mut a, 0), take(&raw mut b, 0)), (5, 9)) };
/// assert_eq!((a, b), (0, 0));
/// ```
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
    /// The seal of `Word`: only this crate implements it (for `u32` and `u64`), so no other
    /// type is a `Word`.
    ///
    /// ```compile_fail,E0277
    /// use ferrolink_device::arch::atomic::Word;
    /// fn word<T: Word>() {}
    /// word::<u16>(); // only u32 and u64 are words
    /// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let word = 7u64;
/// // SAFETY: `word` is live and aligned, accessed only atomically.
/// assert_eq!(unsafe { atomic::load(&raw const word, LoadOrder::Relaxed, Scope::Gpu) }, 7);
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let mut word = 0u32;
/// // SAFETY: `word` is live and aligned, accessed only atomically.
/// unsafe { atomic::store(&raw mut word, 3, StoreOrder::Relaxed, Scope::Cta) };
/// assert_eq!(word, 3);
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((count, seen): (*mut u32, *mut u32)) {
///     // Every thread takes a distinct ticket.
///     // SAFETY: `count` is a live word accessed only atomically; `seen` holds 64 words.
///     unsafe {
///         let ticket = atomic::fetch_add(count, 1, RmwOrder::Relaxed, Scope::Gpu);
///         *seen.add(ticket as usize) = 1;
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let (mut count, mut seen) = (0u32, vec![0u32; 64]);
/// // SAFETY: both outlive the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut count, seen.as_mut_ptr())) }.unwrap();
/// assert_eq!(count, 64);
/// assert!(seen.iter().all(|&s| s == 1));
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// let mut slot = 11u64;
/// // SAFETY: `slot` is live and aligned, accessed only atomically.
/// let old = unsafe { atomic::swap(&raw mut slot, 0, RmwOrder::AcqRel, Scope::Gpu) };
/// assert_eq!((old, slot), (11, 0));
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((owner, wins): (*mut u32, *mut u32)) {
///     // 64 threads race to claim `owner`: exactly one finds it free (0).
///     let me = arch::global_thread_idx_x() as u32 + 1;
///     // SAFETY: both are live words, accessed only atomically.
///     unsafe {
///         if atomic::compare_swap(owner, 0, me, RmwOrder::AcqRel, Scope::Gpu) == 0 {
///             atomic::red_add(wins, 1, StoreOrder::Relaxed, Scope::Gpu);
///         }
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let (mut owner, mut wins) = (0u32, 0u32);
/// // SAFETY: both outlive the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut owner, &raw mut wins)) }.unwrap();
/// assert_eq!(wins, 1);
/// assert!((1..=64).contains(&owner));
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((high,): (*mut u64,)) {
///     let t = arch::global_thread_idx_x() as u64;
///     // SAFETY: `high` is a live word, accessed only atomically.
///     unsafe { atomic::fetch_max(high, t * t, RmwOrder::Relaxed, Scope::Gpu) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut high = 0u64;
/// // SAFETY: `high` outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut high,)) }.unwrap();
/// assert_eq!(high, 31 * 31);
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((signal,): (*mut u64,)) {
///     // Thread 0 of each CTA raises the signal once its CTA is done.
///     arch::sync_threads();
///     if arch::thread_idx_x() == 0 {
///         // SAFETY: `signal` is a live word, accessed only atomically.
///         unsafe { atomic::red_add(signal, 1, StoreOrder::Release, Scope::Gpu) };
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [4, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut signal = 0u64;
/// // SAFETY: `signal` outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut signal,)) }.unwrap();
/// assert_eq!(signal, 4);
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// #[repr(C, align(16))]
/// struct Acc([f32; 4]);
/// unsafe fn kernel((acc,): (*mut Acc,)) {
///     // SAFETY: `acc` is four live, 16-byte aligned floats, accessed only atomically.
///     unsafe { atomic::red_add_f32x4(acc.cast(), [1.0, 2.0, 0.5, -1.0], Scope::Gpu) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [8, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut acc = Acc([0.0; 4]);
/// // SAFETY: `acc` outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut acc,)) }.unwrap();
/// assert_eq!(acc.0, [8.0, 16.0, 4.0, -8.0]);
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// #[repr(C, align(16))]
/// struct Line([u64; 2]);
/// // Two LL words: the value's halves, each with the flag 5 in its high half.
/// let line = Line([(5 << 32) | 0xdead, (5 << 32) | 0xbeef]);
/// // SAFETY: 16 live, 16-byte aligned bytes, accessed only atomically.
/// let [lo, hi] = unsafe { atomic::load_u64x2_relaxed(&raw const line.0, Scope::Sys) };
/// assert!(lo >> 32 == 5 && hi >> 32 == 5); // both halves have arrived
/// assert_eq!((lo & 0xffff_ffff) | (hi << 32), 0xbeef_0000_dead);
/// ```
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
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// #[repr(C, align(16))]
/// struct Line([u64; 2]);
/// unsafe fn kernel((line, out): (*mut [u64; 2], *mut u64)) {
///     let flag = 1u32;
///     if arch::block_idx_x() == 0 {
///         // Sender: a 64-bit value as two halves, each with the flag, in one instruction.
///         let (v, f) = (0x1234_5678_9abc_def0u64, u64::from(flag) << 32);
///         // SAFETY: `line` is 16 live, 16-byte aligned bytes, accessed only atomically.
///         unsafe { atomic::store_u64x2_relaxed(line, [(v & 0xffff_ffff) | f, (v >> 32) | f], Scope::Sys) };
///     } else {
///         // Receiver: polls until both halves carry the flag (each word is atomic on its own).
///         loop {
///             // SAFETY: as above.
///             let [lo, hi] = unsafe { atomic::load_u64x2_relaxed(line, Scope::Sys) };
///             if (lo >> 32) as u32 == flag && (hi >> 32) as u32 == flag {
///                 // SAFETY: one thread writes the one word.
///                 unsafe { out.write((lo & 0xffff_ffff) | (hi << 32)) };
///                 break;
///             }
///             arch::spin_wait_hint(64);
///         }
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let (mut line, mut out) = (Line([0; 2]), 0u64);
/// // SAFETY: both outlive the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut line.0, &raw mut out)) }.unwrap();
/// assert_eq!(out, 0x1234_5678_9abc_def0);
/// ```
///
/// # Safety
/// As [`load_u64x2_relaxed`], with `p` valid for writes.
#[inline(always)]
pub unsafe fn store_u64x2_relaxed(p: *mut [u64; 2], value: [u64; 2], scope: Scope) {
    // SAFETY: the caller upholds this function's contract.
    unsafe { imp::store_u64x2_relaxed(p, value, scope) }
}

/// Memory fence: `fence.{acq_rel|sc}.{scope}`.
///
/// ```
/// # use ferrolink_device::arch::atomic::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((data, flag): (*mut u32, *mut u32)) {
///     if arch::block_idx_x() == 0 {
///         // SAFETY: `data` is read only after the flag publishes it; `flag` is only accessed
///         // atomically.
///         unsafe {
///             data.write(42);
///             atomic::fence(FenceOrder::Release, Scope::Gpu); // release pattern
///             atomic::store(flag, 1, StoreOrder::Relaxed, Scope::Gpu);
///         }
///     } else {
///         // SAFETY: as above.
///         while unsafe { atomic::load(flag, LoadOrder::Relaxed, Scope::Gpu) } == 0 {
///             arch::spin_wait_hint(32);
///         }
///         atomic::fence(FenceOrder::Acquire, Scope::Gpu); // acquire pattern
///         // SAFETY: the fences order the write before this read.
///         assert_eq!(unsafe { data.read() }, 42);
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let (mut data, mut flag) = (0u32, 0u32);
/// // SAFETY: both words outlive the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut data, &raw mut flag)) }.unwrap();
/// ```
#[inline(always)]
pub fn fence(order: FenceOrder, scope: Scope) {
    imp::fence(order, scope)
}
