//! Probe kernels for the perf tool: the SM clock and the latency of single primitives
//! (fences, release stores, dependent loads, CTA and warp barriers), which explain where the
//! time of a barrier round goes.

use crate::arch::{self, FenceOrder, LoadOrder, Scope, StoreOrder, atomic};
use crate::kernel;

kernel! {
    /// SM clock probe: thread 0 of CTA 0 spins for `ns` nanoseconds of `%globaltimer` and
    /// writes the `%clock64` cycles and the nanoseconds that passed to `out[0]` and `out[1]`
    /// (their ratio is the SM clock while it ran; figures in cycles depend on it).
    ///
    /// # Safety
    /// `out` holds two words.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::probe::sm_clock_probe;
    /// # use std::time::Duration;
    /// let mut out = [0u64; 2]; // cycles, nanoseconds
    /// # let spec = LaunchSpec { name: sm_clock_probe.name(),
    /// #     grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
    /// // SAFETY: `out` holds two words and outlives the launch.
    /// unsafe { emulator::launch(&spec, sm_clock_probe.host_entry(), (10_000, out.as_mut_ptr())) }.unwrap();
    /// assert!(out[1] >= 10_000); // at least the 10 µs asked for
    /// ```
    pub unsafe fn sm_clock_probe(ns: u64, out: *mut u64) {
        if arch::global_thread_idx_x() != 0 {
            return;
        }
        let (t0, c0) = (arch::global_timer_ns(), arch::clock64());
        let mut t = t0;
        while t.wrapping_sub(t0) < ns {
            t = arch::global_timer_ns();
        }
        let c = arch::clock64();
        // SAFETY: `out` holds two words (kernel contract).
        unsafe {
            out.write(c.wrapping_sub(c0));
            out.add(1).write(t.wrapping_sub(t0));
        }
    }
}

/// The primitives [`primitive_latency`] times, by code.
///
/// ```
/// use ferrolink_device::kernels::probe::Primitive;
/// for (i, p) in Primitive::ALL.into_iter().enumerate() {
///     assert_eq!(p.code() as usize, i);
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Primitive {
    /// `fence.acq_rel.gpu`.
    FenceAcqRelGpu,
    /// `fence.acquire.gpu`.
    FenceAcquireGpu,
    /// `fence.sc.gpu`.
    FenceScGpu,
    /// `fence.acq_rel.sys`.
    FenceAcqRelSys,
    /// `st.release.gpu` to one word, back to back.
    StoreReleaseGpu,
    /// `st.relaxed.gpu` to one word, back to back.
    StoreRelaxedGpu,
    /// `ld.relaxed.gpu`, each load's address depending on the previous value.
    LoadRelaxedGpuChain,
    /// `ld.acquire.gpu`, dependent as above.
    LoadAcquireGpuChain,
    /// The CTA barrier (`barrier.sync 0`), in a CTA of one warp.
    CtaBarrier,
    /// The warp barrier (`bar.warp.sync` with the full mask).
    WarpBarrier,
}

impl Primitive {
    /// Every primitive, in code order.
    pub const ALL: [Primitive; 10] = [
        Primitive::FenceAcqRelGpu,
        Primitive::FenceAcquireGpu,
        Primitive::FenceScGpu,
        Primitive::FenceAcqRelSys,
        Primitive::StoreReleaseGpu,
        Primitive::StoreRelaxedGpu,
        Primitive::LoadRelaxedGpuChain,
        Primitive::LoadAcquireGpuChain,
        Primitive::CtaBarrier,
        Primitive::WarpBarrier,
    ];

    /// The kernel argument for this primitive.
    ///
    /// ```
    /// use ferrolink_device::kernels::probe::Primitive;
    /// assert_eq!(Primitive::FenceAcqRelGpu.code(), 0);
    /// assert_eq!(Primitive::WarpBarrier.code(), 9);
    /// ```
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// What the PTX is, for reports.
    ///
    /// ```
    /// use ferrolink_device::kernels::probe::Primitive;
    /// assert_eq!(Primitive::StoreReleaseGpu.ptx(), "st.release.gpu");
    /// ```
    pub const fn ptx(self) -> &'static str {
        match self {
            Primitive::FenceAcqRelGpu => "fence.acq_rel.gpu",
            Primitive::FenceAcquireGpu => "fence.acquire.gpu",
            Primitive::FenceScGpu => "fence.sc.gpu",
            Primitive::FenceAcqRelSys => "fence.acq_rel.sys",
            Primitive::StoreReleaseGpu => "st.release.gpu",
            Primitive::StoreRelaxedGpu => "st.relaxed.gpu",
            Primitive::LoadRelaxedGpuChain => "ld.relaxed.gpu (dependent)",
            Primitive::LoadAcquireGpuChain => "ld.acquire.gpu (dependent)",
            Primitive::CtaBarrier => "barrier.sync (1-warp CTA)",
            Primitive::WarpBarrier => "bar.warp.sync",
        }
    }
}

/// `%globaltimer` nanoseconds of `iters` back-to-back calls of `op` (given the index).
#[inline(always)]
fn time_loop(iters: u32, mut op: impl FnMut(u32)) -> u64 {
    let t0 = arch::global_timer_ns();
    for i in 0..iters {
        op(i);
    }
    arch::global_timer_ns() - t0
}

kernel! {
    /// Primitive latency: the first warp of CTA 0 performs `iters` back-to-back instances of
    /// the [`Primitive`] with code `op` (an unknown code times an empty loop) and lane 0 writes
    /// the `%globaltimer` nanoseconds to `out_ns[0]`. Loads and stores use `words[0..2]`. Launch
    /// one CTA of 32 threads.
    ///
    /// # Safety
    /// `words` holds two zeroed `u32`s that nothing else touches; `out_ns` one word.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::probe::{Primitive, primitive_latency};
    /// # use std::time::Duration;
    /// let mut words = [0u32; 2];
    /// let mut ns = u64::MAX;
    /// // One CTA of 32 threads.
    /// let spec = LaunchSpec { name: primitive_latency.name(), grid: [1, 1, 1], block: [32, 1, 1],
    ///     shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
    /// let args = (words.as_mut_ptr(), Primitive::FenceAcqRelGpu.code(), 100, &raw mut ns);
    /// // SAFETY: two zeroed words nothing else touches, and one for the time; all outlive the launch.
    /// unsafe { emulator::launch(&spec, primitive_latency.host_entry(), args) }.unwrap();
    /// assert_ne!(ns, u64::MAX); // written by lane 0
    /// ```
    pub unsafe fn primitive_latency(words: *mut u32, op: u32, iters: u32, out_ns: *mut u64) {
        if arch::global_thread_idx_x() >= arch::WARP_SIZE {
            return;
        }
        // `words` holds two words used only atomically here (kernel contract); `acc` stays 0
        // (both words start 0 and only word 1 is stored to), so the chained address is
        // `words` itself. The primitive is chosen once, outside its timed loop: a dispatch in
        // the loop would add an indirect branch to every instance.
        let mut acc = 0u32;
        let ns = match op {
            0 => time_loop(iters, |_| atomic::fence(FenceOrder::AcqRel, Scope::Gpu)),
            1 => time_loop(iters, |_| atomic::fence(FenceOrder::Acquire, Scope::Gpu)),
            2 => time_loop(iters, |_| atomic::fence(FenceOrder::SeqCst, Scope::Gpu)),
            3 => time_loop(iters, |_| atomic::fence(FenceOrder::AcqRel, Scope::Sys)),
            // SAFETY: word 1 is valid (see above).
            4 => time_loop(iters, |i| unsafe { atomic::store(words.add(1), i, StoreOrder::Release, Scope::Gpu) }),
            // SAFETY: as above.
            5 => time_loop(iters, |i| unsafe { atomic::store(words.add(1), i, StoreOrder::Relaxed, Scope::Gpu) }),
            6 => time_loop(iters, |_| {
                // SAFETY: `acc` is 0, so this is word 0 (see above).
                acc |= unsafe { atomic::load(words.add(acc as usize), LoadOrder::Relaxed, Scope::Gpu) }
            }),
            7 => time_loop(iters, |_| {
                // SAFETY: as above.
                acc |= unsafe { atomic::load(words.add(acc as usize), LoadOrder::Acquire, Scope::Gpu) }
            }),
            8 => time_loop(iters, |_| arch::sync_threads()),
            9 => time_loop(iters, |_| arch::sync_warp(arch::FULL_MASK)),
            _ => time_loop(iters, |_| {}),
        };
        if arch::lane_id() == 0 {
            // SAFETY: `out_ns` holds one word (kernel contract); `acc` is 0, folded in so the
            // chained loads are not dead.
            unsafe { out_ns.write(ns + u64::from(acc)) };
        }
    }
}
