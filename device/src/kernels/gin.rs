//! Built-in kernels over the GIN device API ([`crate::gin`]): the exchanges the test suite
//! checks on every backend and transport, the put-with-signal ping-pong and the all-to-alls
//! that the examples and `ferrolink-perf` run. Each is one rank's kernel: launch it once per
//! rank with that rank's `DevComm`, every rank with the same grid and arguments.

use crate::arch::{self, RmwOrder, Scope};
use crate::barrier::LsaBarrierSession;
use crate::comm::DevComm;
use crate::coop::{Coop, CoopCta, CoopThread};
use crate::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
use crate::kernel;
use crate::window::DevWindow;

/// The word `i` that rank `rank`'s CTA `cta` sends in round `round` of [`gin_exchange`].
///
/// ```
/// use ferrolink_device::kernels::gin::exchange_word;
/// use ferrolink_device::kernels::lsa::mix;
/// // Word 4 of rank 1's CTA 2 in round 3:
/// assert_eq!(exchange_word(1, 2, 3, 4), mix(1 + (2 << 16), 3, 4));
/// ```
pub const fn exchange_word(rank: u32, cta: u32, round: u32, i: u32) -> u32 {
    crate::kernels::lsa::mix(rank.wrapping_add(cta << 16), round, i)
}

/// Adds `bad` to `*errors` (one atomic per coop, not per word).
#[inline(always)]
fn count_errors(errors: *mut u32, bad: u32) {
    if bad != 0 {
        // SAFETY: `errors` is a valid word (every kernel's contract).
        unsafe { arch::atomic::fetch_add(errors, bad, RmwOrder::Relaxed, Scope::Sys) };
    }
}

/// Sums `v` over the coop's threads into the result of thread 0 (others return 0): a
/// per-thread tally folded with one atomic.
#[inline(always)]
fn tally<C: Coop>(coop: C, errors: *mut u32, v: u32) {
    coop.sync();
    count_errors(errors, v);
}

kernel! {
    /// Every rank puts a block to every other rank, `rounds` times, on context `block_idx`
    /// (CTA `b` uses context `b`, signal `signal + b`, counter `counter + b` and GIN barrier
    /// `b`): fills its block `b` of `src` (`bytes` bytes at `b * bytes`, [`exchange_word`]),
    /// puts it into every peer's `dst` at `(b * nranks + me) * bytes` with SignalInc and
    /// CounterInc, flushes, checks its counter (every put complete locally after the flush),
    /// waits for its signal to reach `round * (nranks - 1)`, checks every peer's block (data
    /// visible when its signal is), and meets the others at the GIN barrier before the next
    /// round. After the last round it resets its signal and counter and checks they read 0.
    /// Mismatches are added to `*errors`.
    ///
    /// Needs `grid` contexts, signals from `signal`, counters from `counter`, GIN barriers;
    /// `bytes` a multiple of 4; `src` ≥ `grid * bytes` bytes, `dst` ≥ `grid * nranks * bytes`.
    ///
    /// # Safety
    /// `comm`, `dst` and `src` come from live handles of one communicator; `errors` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::gin::gin_exchange;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, u32, u32, u32, u32, *mut u32)> = &gin_exchange;
    /// assert_eq!(k.name(), "gin_exchange");
    /// ```
    pub unsafe fn gin_exchange(comm: DevComm, dst: DevWindow, src: DevWindow, bytes: u32, rounds: u32, signal: u32, counter: u32, errors: *mut u32) {
        let coop = CoopCta;
        let b = arch::block_idx_x() as u32;
        let gin = Gin::new(&comm, b);
        let (me, n) = (comm.rank, comm.nranks);
        let (sig, ctr) = (signal + b, counter + b);
        let words = bytes as usize / 4;
        let world = comm.world();
        let mut barrier = GinBarrierSession::new(coop, gin, world, b);
        let mut bad = 0u32;
        for round in 1..=rounds {
            let mut i = coop.thread_rank();
            while i < words {
                // SAFETY: block `b` of `src` holds `words` words (contract).
                unsafe { src.local_ptr::<u32>(b as usize * bytes as usize + i * 4).write_volatile(exchange_word(me, b, round, i as u32)) };
                i += coop.size();
            }
            coop.sync();
            for p in 0..n {
                if p == me {
                    continue;
                }
                // SAFETY: the ranges are inside the windows (contract, and checked); the
                // source is not written until the flush below, and each destination block has
                // one writer, read only after its signal.
                unsafe {
                    gin.put(
                        coop,
                        world,
                        p,
                        dst,
                        (b * n + me) as usize * bytes as usize,
                        src,
                        b as usize * bytes as usize,
                        bytes as usize,
                        RemoteAction::SignalInc(sig),
                        LocalAction::CounterInc(ctr),
                    )
                };
            }
            gin.flush(coop);
            let sent = u64::from(round) * u64::from(n - 1);
            if coop.thread_rank() == 0 && gin.read_counter(ctr) != sent {
                bad += 1;
            }
            if gin.wait_signal(coop, sig, sent).is_err() {
                bad += 1;
                break;
            }
            for p in 0..n {
                if p == me {
                    continue;
                }
                let base = (b * n + p) as usize * bytes as usize;
                let mut i = coop.thread_rank();
                while i < words {
                    // SAFETY: inside this rank's `dst` (contract); written before the signal.
                    let v = unsafe { dst.local_ptr::<u32>(base + i * 4).read_volatile() };
                    bad += u32::from(v != exchange_word(p, b, round, i as u32));
                    i += coop.size();
                }
            }
            if barrier.sync().is_err() {
                bad += 1;
                break;
            }
        }
        if coop.thread_rank() == 0 {
            gin.reset_signal(sig);
            gin.reset_counter(ctr);
            bad += u32::from(gin.read_signal(sig) != 0) + u32::from(gin.read_counter(ctr) != 0);
        }
        drop(barrier);
        tally(coop, errors, bad);
    }
}

/// The 8-byte value rank `rank` puts into its peers in round `round` of [`gin_put_values`].
///
/// ```
/// use ferrolink_device::kernels::gin::put_value_of;
/// // The round in the high word, the rank + 1 in the low one (never 0: a word never written reads 0).
/// assert_eq!(put_value_of(2, 5), 5 << 32 | 3);
/// ```
pub const fn put_value_of(rank: u32, round: u32) -> u64 {
    ((round as u64) << 32) | (rank as u64 + 1)
}

kernel! {
    /// `put_value`, small puts and SignalAdd: every round, every rank puts the round's value
    /// into every other rank's `dst` four ways — `put_value` of 4 bytes (at `nranks * 16 + me
    /// * 4`, no signal), `put` of 4 and of 8 bytes from its own `dst` (at `nranks * 20 + me *
    /// 4` and `nranks * 8 + me * 8`; the source words at `nranks * 24`; through the proxy
    /// these travel inline), then `put_value` of 8 bytes (at `me * 8`) with SignalAdd(`signal`,
    /// me + 1) — waits for its signal to grow by the sum of the others' `p + 1`, checks all
    /// four values of every peer (they landed before the signal of the later one: same
    /// context), and meets the others at GIN barrier 0. One CTA.
    ///
    /// # Safety
    /// `comm` and `dst` (≥ `nranks * 24 + 16` bytes) from live handles; `errors` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::gin::gin_put_values;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, u32, u32, *mut u32)> = &gin_put_values;
    /// assert_eq!(k.name(), "gin_put_values");
    /// ```
    pub unsafe fn gin_put_values(comm: DevComm, dst: DevWindow, rounds: u32, signal: u32, errors: *mut u32) {
        let coop = CoopCta;
        let gin = Gin::new(&comm, 0);
        let (me, n) = (comm.rank, comm.nranks);
        let world = comm.world();
        let mut barrier = GinBarrierSession::new(coop, gin, world, 0);
        let others: u64 = (0..n).filter(|&p| p != me).map(|p| u64::from(p) + 1).sum();
        let mut bad = 0u32;
        let n_us = n as usize;
        let (src8, src4) = (n_us * 24, n_us * 24 + 8);
        for round in 1..=rounds {
            let v = put_value_of(me, round);
            // The sources of the small puts: the last round's puts have completed locally.
            gin.flush(coop);
            if coop.thread_rank() == 0 {
                // SAFETY: inside this rank's `dst` (contract), aligned; no put reads them now.
                unsafe {
                    dst.local_ptr::<u64>(src8).write_volatile(v);
                    dst.local_ptr::<u32>(src4).write_volatile(v as u32);
                }
            }
            for p in 0..n {
                if p == me {
                    continue;
                }
                let m = me as usize;
                // SAFETY: offsets inside `dst` (contract, checked), naturally aligned; one writer each.
                unsafe {
                    gin.put_value(coop, world, p, dst, n_us * 16 + m * 4, v as u32 as u64, 4, RemoteAction::None);
                    gin.put(coop, world, p, dst, n_us * 20 + m * 4, dst, src4, 4, RemoteAction::None, LocalAction::None);
                    gin.put(coop, world, p, dst, n_us * 8 + m * 8, dst, src8, 8, RemoteAction::None, LocalAction::None);
                    gin.put_value(coop, world, p, dst, m * 8, v, 8, RemoteAction::SignalAdd(signal, u64::from(me) + 1));
                }
            }
            if gin.wait_signal(coop, signal, u64::from(round) * others).is_err() {
                bad += 1;
                break;
            }
            if coop.thread_rank() == 0 {
                for p in 0..n {
                    if p == me {
                        continue;
                    }
                    let q = p as usize;
                    // SAFETY: inside this rank's `dst`; written before the signal.
                    let (v8, v4, p8, p4) = unsafe {
                        (
                            dst.local_ptr::<u64>(q * 8).read_volatile(),
                            dst.local_ptr::<u32>(n_us * 16 + q * 4).read_volatile(),
                            dst.local_ptr::<u64>(n_us * 8 + q * 8).read_volatile(),
                            dst.local_ptr::<u32>(n_us * 20 + q * 4).read_volatile(),
                        )
                    };
                    let want = put_value_of(p, round);
                    bad += u32::from(v8 != want)
                        + u32::from(v4 != want as u32)
                        + u32::from(p8 != want)
                        + u32::from(p4 != want as u32);
                }
            }
            if barrier.sync().is_err() {
                bad += 1;
                break;
            }
        }
        drop(barrier);
        tally(coop, errors, bad);
    }
}

kernel! {
    /// Queue wrap-around and back-pressure: one CTA sends `ops` 8-byte values with SignalInc
    /// on signal 0 to the next rank (`(me + 1) % nranks`), value `i + 1` at slot `i % 64` of
    /// its `dst`, then waits until its own signal 0 reaches `ops` and checks that every slot
    /// holds the last value sent to it (order kept on one context), and that signal 0 reads
    /// exactly `ops`. With a queue depth far below `ops` the posting thread waits for credit.
    ///
    /// # Safety
    /// `comm` and `dst` (≥ 512 bytes) from live handles; `errors` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::gin::gin_stream;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, u32, *mut u32)> = &gin_stream;
    /// assert_eq!(k.name(), "gin_stream");
    /// ```
    pub unsafe fn gin_stream(comm: DevComm, dst: DevWindow, ops: u32, errors: *mut u32) {
        let coop = CoopCta;
        let gin = Gin::new(&comm, 0);
        let next = (comm.rank + 1) % comm.nranks;
        let world = comm.world();
        for i in 0..ops {
            // SAFETY: slot `i % 64` lies in `dst` (contract), aligned; the receiver reads after the signal.
            unsafe {
                gin.put_value(coop, world, next, dst, (i % 64) as usize * 8, u64::from(i) + 1, 8, RemoteAction::SignalInc(0))
            };
        }
        gin.flush(coop);
        let mut bad = 0u32;
        if gin.wait_signal(coop, 0, u64::from(ops)).is_err() {
            bad += 1;
        } else if coop.thread_rank() == 0 {
            for k in 0..64u32.min(ops) {
                let last = k + (ops - 1 - k) / 64 * 64;
                // SAFETY: slot `k` lies in this rank's `dst`.
                let v = unsafe { dst.local_ptr::<u64>(k as usize * 8).read_volatile() };
                bad += u32::from(v != u64::from(last) + 1);
            }
            bad += u32::from(gin.read_signal(0) != u64::from(ops));
        }
        tally(coop, errors, bad);
    }
}

kernel! {
    /// Barriers across LSA domains: `rounds` times, every rank stores `round` into word `me`
    /// of its peers' `win` and meets them, then checks words of those peers and meets them
    /// again. `hybrid == 0`: every peer, by GIN `put_value` on context 0, and the GIN barrier
    /// 0 over the world team (a barrier is a release/acquire point for earlier GIN puts on its
    /// context). `hybrid == 1`: LSA peers by plain stores, rail peers (other domains) by GIN,
    /// and the hybrid barrier (LSA barrier 0, GIN barrier 0 over the rail). One CTA.
    ///
    /// # Safety
    /// `comm` and `win` (≥ `nranks * 4` bytes) from live handles; LSA barrier 0 and GIN
    /// barrier 0 are this kernel's; `errors` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::gin::gin_barrier_rounds;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, u32, u32, *mut u32)> = &gin_barrier_rounds;
    /// assert_eq!(k.name(), "gin_barrier_rounds");
    /// ```
    pub unsafe fn gin_barrier_rounds(comm: DevComm, win: DevWindow, rounds: u32, hybrid: u32, errors: *mut u32) {
        let coop = CoopCta;
        let gin = Gin::new(&comm, 0);
        let (me, n, lsa) = (comm.rank, comm.nranks, comm.lsa_size);
        let world = comm.world();
        let domain = me / lsa;
        let reached = |p: u32| hybrid == 0 || p / lsa == domain || p % lsa == me % lsa;
        let mut bad = 0u32;
        let mut gin_barrier = if hybrid == 0 { Some(GinBarrierSession::new(coop, gin, world, 0)) } else { None };
        let meet = |gb: &mut Option<GinBarrierSession<'_, CoopCta>>| match gb {
            Some(b) => b.sync(),
            // SAFETY: LSA barrier 0 is this kernel's (contract).
            None => unsafe { hybrid_sync(coop, &comm, 0, 0) },
        };
        for round in 1..=rounds {
            if coop.thread_rank() == 0 {
                for p in 0..n {
                    if p == me || !reached(p) {
                        continue;
                    }
                    if hybrid == 1 && p / lsa == domain {
                        // SAFETY: word `me` of LSA peer `p`'s slot (contract).
                        unsafe { win.lsa_ptr::<u32>(me as usize * 4, p % lsa).write_volatile(round) };
                    } else {
                        // SAFETY: word `me` of `p`'s `win`, aligned; read after the barrier.
                        unsafe {
                            gin.put_value(CoopThread, world, p, win, me as usize * 4, u64::from(round), 4, RemoteAction::None)
                        };
                    }
                }
            }
            if meet(&mut gin_barrier).is_err() {
                bad += 1;
                break;
            }
            if coop.thread_rank() == 0 {
                for p in 0..n {
                    if p != me && reached(p) {
                        // SAFETY: word `p` of this rank's `win`.
                        bad += u32::from(unsafe { win.local_ptr::<u32>(p as usize * 4).read_volatile() } != round);
                    }
                }
            }
            if meet(&mut gin_barrier).is_err() {
                bad += 1;
                break;
            }
        }
        drop(gin_barrier);
        tally(coop, errors, bad);
    }
}

kernel! {
    /// Put-with-signal ping-pong between world ranks `a` and `b` (other ranks return): `iters`
    /// times, `a` puts `bytes` of `src` into `b`'s `dst` with SignalInc(0) and waits for `b`'s
    /// answer, `b` waits and answers the same way. One thread of one CTA does it all. Writes
    /// the `%globaltimer` nanoseconds of all `iters` round trips to `*ns` (on rank `a`), after
    /// `warmup` untimed ones. `base` is signal 0's value before the call (0 on a fresh device
    /// communicator; `warmup + iters` per earlier call): read in the kernel, it could already
    /// include the peer's first put.
    ///
    /// # Safety
    /// `comm`, `dst`, `src` (≥ `bytes` bytes each) from live handles; signal 0 is this
    /// kernel's; `ns` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::gin::gin_ping_pong;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, u32, u32, u32, u32, u32, u64, *mut u64)> = &gin_ping_pong;
    /// assert_eq!(k.name(), "gin_ping_pong");
    /// ```
    pub unsafe fn gin_ping_pong(comm: DevComm, dst: DevWindow, src: DevWindow, a: u32, b: u32, bytes: u32, warmup: u32, iters: u32, base: u64, ns: *mut u64) {
        if arch::thread_rank_in_block() != 0 || arch::block_idx_x() != 0 || (comm.rank != a && comm.rank != b) {
            return;
        }
        let coop = CoopThread;
        let gin = Gin::new(&comm, 0);
        let world = comm.world();
        let (peer, first) = if comm.rank == a { (b, true) } else { (a, false) };
        let mut start = 0;
        for i in 0..warmup + iters {
            if i == warmup {
                start = arch::global_timer_ns();
            }
            let k = u64::from(i) + 1;
            if !first && gin.wait_signal(coop, 0, base + k).is_err() {
                return;
            }
            // SAFETY: ranges inside the windows (contract, checked); the answer comes only
            // after the peer has seen this put, so the source is not rewritten under it.
            unsafe { gin.put(coop, world, peer, dst, 0, src, 0, bytes as usize, RemoteAction::SignalInc(0), LocalAction::None) };
            if first && gin.wait_signal(coop, 0, base + k).is_err() {
                return;
            }
        }
        if first {
            // SAFETY: `ns` is valid (contract).
            unsafe { ns.write(arch::global_timer_ns() - start) };
        }
        gin.flush(coop);
    }
}

kernel! {
    /// All-to-all: every rank sends block `p` of `send` (`bytes` each) to every rank `p`
    /// (itself too), into block `me` of `p`'s `recv`, then waits for all `nranks` blocks.
    /// `hybrid == 0`: every block by GIN put with SignalInc(`signal`) (the direct backend for
    /// LSA peers). `hybrid == 1`: LSA peers by a plain copy into their mapped `recv`, then the
    /// LSA barrier `block_idx`; other peers by GIN. CTA `b` of `grid` serves peers `p` with
    /// `p % grid == b` on context `b`; signal `signal` counts every CTA's blocks, and
    /// `round` (1, 2, …: the number of this call) sets the target `round * remote blocks`.
    /// A wait that ends without its blocks (the communicator was aborted) adds 1 to `*errors`.
    ///
    /// # Safety
    /// `comm`, `send` and `recv` (≥ `nranks * bytes` bytes each) from live handles; nothing
    /// else writes `recv` until every rank's call has ended; LSA barrier `b` is this CTA's;
    /// `errors` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::gin::gin_all_to_all;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, u32, u32, u32, u32, *mut u32)> = &gin_all_to_all;
    /// assert_eq!(k.name(), "gin_all_to_all");
    /// ```
    pub unsafe fn gin_all_to_all(comm: DevComm, recv: DevWindow, send: DevWindow, bytes: u32, signal: u32, round: u32, hybrid: u32, errors: *mut u32) {
        let coop = CoopCta;
        let b = arch::block_idx_x() as u32;
        let grid = arch::grid_dim_x() as u32;
        let gin = Gin::new(&comm, b);
        let (me, n, lsa) = (comm.rank, comm.nranks, comm.lsa_size);
        let world = comm.world();
        let local = |p: u32| hybrid == 1 && p / lsa == me / lsa;
        let bytes = bytes as usize;
        let mut p = b;
        while p < n {
            if local(p) {
                // SAFETY: block `me` of LSA peer `p`'s `recv`, block `p` of `send` (contract).
                unsafe {
                    crate::kernels::copy::copy_bytes(
                        recv.lsa_ptr(me as usize * bytes, p % lsa),
                        send.local_ptr(p as usize * bytes),
                        bytes,
                        coop.thread_rank(),
                        coop.size(),
                    )
                };
            } else {
                // SAFETY: as above; the send buffer is not written during the call.
                unsafe {
                    gin.put(coop, world, p, recv, me as usize * bytes, send, p as usize * bytes, bytes, RemoteAction::SignalInc(signal), LocalAction::None)
                };
            }
            p += grid;
        }
        let remote = (0..n).filter(|&p| !local(p)).count() as u64;
        if hybrid == 1 {
            // SAFETY: LSA barrier `b` is this CTA's (contract).
            let mut bar = unsafe { LsaBarrierSession::new(coop, &comm, b) };
            bar.sync();
        }
        if remote > 0 && gin.wait_signal(coop, signal, u64::from(round) * remote).is_err() && coop.thread_rank() == 0 {
            count_errors(errors, 1);
        }
        gin.flush(coop);
    }
}

kernel! {
    /// Put bandwidth from world rank `a` to world rank `b` (other ranks return): `a` puts
    /// `bytes` of `src` into `b`'s `dst` `iters` times on context 0, the last with
    /// SignalInc(`signal`); `b` waits for that signal and answers with SignalInc(`signal +
    /// 1`); `a` waits for
    /// the answer and writes the `%globaltimer` nanoseconds from its first put to `*ns`.
    /// `round` is 1 for the first call on a device communicator, then 2, 3, … (the signals'
    /// targets: read before the first put, a signal could already include it). One
    /// CTA per rank; every thread of it copies on the direct backend, thread 0 posts on the
    /// proxy.
    ///
    /// # Safety
    /// `comm`, `dst`, `src` (≥ `bytes` bytes each) from live handles; signals `signal` and
    /// `signal + 1` are this kernel's; `ns` is valid.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::kernels::gin::gin_put_bandwidth;
    /// # use ferrolink_device::kernel::Kernel;
    /// # use ferrolink_device::{DevComm, DevWindow};
    /// // The host crate launches it with arguments of exactly these types:
    /// let k: &Kernel<(DevComm, DevWindow, DevWindow, u32, u32, u64, u32, u32, u32, *mut u64)> = &gin_put_bandwidth;
    /// assert_eq!(k.name(), "gin_put_bandwidth");
    /// ```
    pub unsafe fn gin_put_bandwidth(comm: DevComm, dst: DevWindow, src: DevWindow, a: u32, b: u32, bytes: u64, iters: u32, signal: u32, round: u32, ns: *mut u64) {
        if arch::block_idx_x() != 0 || (comm.rank != a && comm.rank != b) || iters == 0 {
            return;
        }
        let coop = CoopCta;
        let gin = Gin::new(&comm, 0);
        let world = comm.world();
        if comm.rank == b {
            if gin.wait_signal(coop, signal, u64::from(round)).is_ok() {
                gin.signal(coop, world, a, RemoteAction::SignalInc(signal + 1));
            }
            gin.flush(coop);
            return;
        }
        let answer = u64::from(round);
        coop.sync();
        let start = arch::global_timer_ns();
        for i in 0..iters {
            let remote = if i + 1 == iters { RemoteAction::SignalInc(signal) } else { RemoteAction::None };
            // SAFETY: ranges inside the windows (contract, checked); the source is never
            // written, the destination is only read by the host after the kernel.
            unsafe { gin.put(coop, world, b, dst, 0, src, 0, bytes as usize, remote, LocalAction::None) };
        }
        let ok = gin.wait_signal(coop, signal + 1, answer).is_ok();
        if coop.thread_rank() == 0 && ok {
            // SAFETY: `ns` is valid (contract).
            unsafe { ns.write(arch::global_timer_ns() - start) };
        }
        gin.flush(coop);
    }
}
