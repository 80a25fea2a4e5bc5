//! Host (CPU emulator) implementation of the arch layer.
//!
//! Atomics map to std atomics of at least the requested ordering; scopes are ignored
//! (all behave as `.sys`). Every atomic load polls the emulator, so spin loops yield and
//! obey the launch timeout.
//!
//! Every atomic effect on memory (atomic store, read-modify-write, reduction, fence) first
//! asks [`emulator::effect_allowed`]: a thread of a launch that has failed unwinds
//! there instead of making its effect visible, and a thread already unwinding skips the
//! effect (a read-modify-write then only reads). Vector stores, and plain loads and stores in
//! kernel code, are data, not signals: they are not intercepted (checking each of a copy's
//! 16-byte stores made a 1 GiB emulated copy 40 % slower).

use super::atomic::{FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
use super::index::Axis;
use super::memory::U32x4;
use crate::emulator;
use core::sync::atomic::{self as std_atomic, AtomicU32, AtomicU64, Ordering};

pub(super) enum Special {
    Tid,
    Ntid,
    Ctaid,
    Nctaid,
}

pub(super) fn special(which: Special, axis: Axis) -> u32 {
    let i = axis as usize;
    emulator::with_ctx(|c| match which {
        Special::Tid => c.tid[i],
        Special::Ntid => c.ntid[i],
        Special::Ctaid => c.ctaid[i],
        Special::Nctaid => c.nctaid[i],
    })
}

pub(super) fn lane_id() -> u32 {
    emulator::with_ctx(|c| c.lane)
}

pub(super) fn sync_threads() {
    emulator::sync_threads()
}

pub(super) fn sync_threads_converged() {
    emulator::sync_threads()
}

pub(super) fn sync_threads_or(pred: bool) -> bool {
    emulator::sync_threads_or(pred)
}

pub(super) fn trap() -> ! {
    emulator::trap()
}

pub(super) fn nanosleep(_ns: u32) {
    emulator::poll("nanosleep / spin_wait_hint");
    std::thread::yield_now();
}

pub(super) unsafe fn launch_graph(exec: u64, stream: u64) -> u32 {
    emulator::launch_graph(exec, stream)
}

pub(super) fn global_timer_ns() -> u64 {
    emulator::now_ns()
}

pub(super) fn clock64() -> u64 {
    emulator::now_ns()
}

fn load_ordering(o: LoadOrder) -> Ordering {
    match o {
        LoadOrder::Relaxed => Ordering::Relaxed,
        LoadOrder::Acquire => Ordering::Acquire,
    }
}
fn store_ordering(o: StoreOrder) -> Ordering {
    match o {
        StoreOrder::Relaxed => Ordering::Relaxed,
        StoreOrder::Release => Ordering::Release,
    }
}
fn rmw_ordering(o: RmwOrder) -> Ordering {
    match o {
        RmwOrder::Relaxed => Ordering::Relaxed,
        RmwOrder::Acquire => Ordering::Acquire,
        RmwOrder::Release => Ordering::Release,
        RmwOrder::AcqRel => Ordering::AcqRel,
    }
}
/// The failure ordering of a compare-exchange may not release.
fn cas_failure_ordering(o: RmwOrder) -> Ordering {
    match o {
        RmwOrder::Relaxed | RmwOrder::Release => Ordering::Relaxed,
        RmwOrder::Acquire | RmwOrder::AcqRel => Ordering::Acquire,
    }
}

macro_rules! host_word {
    ($t:ty, $atomic:ty, $load:ident, $store:ident, $add:ident, $exch:ident, $cas:ident, $max:ident, $red:ident) => {
        pub(super) unsafe fn $load(p: *const $t, o: LoadOrder, _s: Scope) -> $t {
            emulator::poll("an atomic load (spin-wait)");
            // SAFETY: the caller guarantees `p` is valid, aligned, and only accessed
            // atomically while this runs (contract of arch::atomic::load).
            unsafe { <$atomic>::from_ptr(p as *mut $t) }.load(load_ordering(o))
        }
        pub(super) unsafe fn $store(p: *mut $t, v: $t, o: StoreOrder, _s: Scope) {
            if emulator::effect_allowed() {
                // SAFETY: as in the load above.
                unsafe { <$atomic>::from_ptr(p) }.store(v, store_ordering(o))
            }
        }
        pub(super) unsafe fn $add(p: *mut $t, v: $t, o: RmwOrder, _s: Scope) -> $t {
            // SAFETY: as in the load above.
            let a = unsafe { <$atomic>::from_ptr(p) };
            if emulator::effect_allowed() { a.fetch_add(v, rmw_ordering(o)) } else { a.load(cas_failure_ordering(o)) }
        }
        pub(super) unsafe fn $exch(p: *mut $t, v: $t, o: RmwOrder, _s: Scope) -> $t {
            // SAFETY: as in the load above.
            let a = unsafe { <$atomic>::from_ptr(p) };
            if emulator::effect_allowed() { a.swap(v, rmw_ordering(o)) } else { a.load(cas_failure_ordering(o)) }
        }
        pub(super) unsafe fn $cas(p: *mut $t, c: $t, n: $t, o: RmwOrder, _s: Scope) -> $t {
            emulator::poll("a compare-and-swap loop");
            // SAFETY: as in the load above.
            let a = unsafe { <$atomic>::from_ptr(p) };
            if !emulator::effect_allowed() {
                return a.load(cas_failure_ordering(o));
            }
            match a.compare_exchange(c, n, rmw_ordering(o), cas_failure_ordering(o)) {
                Ok(old) | Err(old) => old,
            }
        }
        pub(super) unsafe fn $max(p: *mut $t, v: $t, o: RmwOrder, _s: Scope) -> $t {
            // SAFETY: as in the load above.
            let a = unsafe { <$atomic>::from_ptr(p) };
            if emulator::effect_allowed() { a.fetch_max(v, rmw_ordering(o)) } else { a.load(cas_failure_ordering(o)) }
        }
        pub(super) unsafe fn $red(p: *mut $t, v: $t, o: StoreOrder, _s: Scope) {
            if emulator::effect_allowed() {
                // SAFETY: as in the load above.
                unsafe { <$atomic>::from_ptr(p) }.fetch_add(v, store_ordering(o));
            }
        }
    };
}

host_word!(u32, AtomicU32, load_u32, store_u32, add_u32, exch_u32, cas_u32, max_u32, red_u32);
host_word!(u64, AtomicU64, load_u64, store_u64, add_u64, exch_u64, cas_u64, max_u64, red_u64);

pub(super) unsafe fn load_u64x2_relaxed(p: *const [u64; 2], s: Scope) -> [u64; 2] {
    let p = p as *const u64;
    // SAFETY: the caller guarantees two aligned words only accessed atomically (contract of
    // arch::atomic::load_u64x2_relaxed): each is loaded as `atomic::load` would.
    unsafe { [load_u64(p, LoadOrder::Relaxed, s), load_u64(p.add(1), LoadOrder::Relaxed, s)] }
}

pub(super) unsafe fn store_u64x2_relaxed(p: *mut [u64; 2], v: [u64; 2], s: Scope) {
    let p = p as *mut u64;
    // SAFETY: as above (arch::atomic::store_u64x2_relaxed).
    unsafe {
        store_u64(p, v[0], StoreOrder::Relaxed, s);
        store_u64(p.add(1), v[1], StoreOrder::Relaxed, s);
    }
}

pub(super) unsafe fn red_add_f32x4(p: *mut f32, v: [f32; 4], _s: Scope) {
    if !emulator::effect_allowed() {
        return;
    }
    for (i, add) in v.into_iter().enumerate() {
        // SAFETY: the caller guarantees four aligned `f32` only accessed atomically
        // (contract of arch::atomic::red_add_f32x4); an `f32` has the layout of a `u32`.
        let a = unsafe { AtomicU32::from_ptr(p.add(i) as *mut u32) };
        let mut old = a.load(Ordering::Relaxed);
        loop {
            let new = (f32::from_bits(old) + add).to_bits();
            match a.compare_exchange_weak(old, new, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(seen) => old = seen,
            }
        }
    }
}

pub(super) fn fence(o: FenceOrder, _s: Scope) {
    // A fence orders this thread's effects; of a failed launch there are no more. A thread
    // already unwinding still fences (harmless: its stores are skipped anyway).
    let _ = emulator::effect_allowed();
    match o {
        FenceOrder::Acquire => std_atomic::fence(Ordering::Acquire),
        FenceOrder::Release => std_atomic::fence(Ordering::Release),
        FenceOrder::AcqRel => std_atomic::fence(Ordering::AcqRel),
        FenceOrder::SeqCst => std_atomic::fence(Ordering::SeqCst),
    }
}

pub(super) unsafe fn load_v4(p: *const U32x4) -> U32x4 {
    // SAFETY: the caller guarantees 16 valid, aligned bytes with no concurrent writes.
    unsafe { p.read() }
}

pub(super) unsafe fn load_v4_volatile(p: *const U32x4) -> U32x4 {
    // SAFETY: the caller guarantees 16 valid, aligned bytes.
    unsafe { p.read_volatile() }
}

pub(super) unsafe fn load_param_v2(address: u64) -> [u64; 2] {
    // SAFETY: on the emulator a parameter address is the address of the kernel's argument
    // (alive while its body runs); the caller guarantees 16 bytes there, 8-byte aligned.
    unsafe { (address as *const [u64; 2]).read() }
}

pub(super) unsafe fn load_v4_nc(p: *const U32x4) -> U32x4 {
    // SAFETY: as above.
    unsafe { p.read() }
}

pub(super) unsafe fn load_v4_nc_l2_256(p: *const U32x4) -> U32x4 {
    // SAFETY: as above.
    unsafe { p.read() }
}

pub(super) unsafe fn store_v4(p: *mut U32x4, v: U32x4) {
    // SAFETY: the caller guarantees 16 valid, aligned bytes with no concurrent access.
    unsafe { p.write(v) }
}

pub(super) unsafe fn store_v4_cs(p: *mut U32x4, v: U32x4) {
    // SAFETY: as `store_v4`.
    unsafe { store_v4(p, v) }
}

pub(super) fn dynamic_shared_mem<T>() -> *mut T {
    emulator::dynamic_shared_mem().cast()
}

pub(super) enum ShflMode {
    Idx,
    Down,
    Up,
    Xor,
}

pub(super) fn shfl(mode: ShflMode, mask: u32, v: u32, b: u32) -> u32 {
    let lane = lane_id();
    let (values, members) = emulator::warp_exchange(mask, u64::from(v));
    let src = match mode {
        ShflMode::Idx => b & 31,
        // PTX uses b[4:0] for the lane offset.
        ShflMode::Down => lane + (b & 31),
        ShflMode::Up => lane.wrapping_sub(b & 31),
        ShflMode::Xor => (lane ^ b) & 31,
    };
    if src < 32 && members & (1 << src) != 0 { values[src as usize] as u32 } else { v }
}

pub(super) fn ballot(mask: u32, predicate: bool) -> u32 {
    let (values, members) = emulator::warp_exchange(mask, u64::from(predicate));
    (0..32).filter(|&i| members & (1 << i) != 0 && values[i] != 0).fold(0, |m, i| m | (1 << i))
}

pub(super) fn active_mask() -> u32 {
    emulator::active_mask()
}

pub(super) fn sync_warp(mask: u32) {
    emulator::warp_exchange(mask, 0);
}
