//! MoE dispatch and combine (issue 13), against a host model: random, skewed and
//! own-rank routing, empty experts, entries without an expert (-1), ranks without tokens,
//! overflow at a small capacity (drops counted), several rounds in a row, across LSA domains
//! through the GIN proxy, one process per rank, fp8 tokens with scales, the fused combine
//! (experts adding into the tokens' ranks), and the errors of bad calls, on every backend.

use ferrolink::LaunchConfig;
use ferrolink::moe::{Moe, MoeConfig, MoeLowLatency, Tokens, bf16, fp8_row_bytes};
use ferrolink::{CommConfig, Communicator, Device, LsaMode};
use ferrolink_device::kernels::moe::moe_expert_mlp_fused;
use ferrolink_tests::jobs::{child, fits, job_passes, job_passes_with, scenario};
use ferrolink_tests::{check, domain_configs};

/// How tokens are routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Routing {
    /// `top_k` distinct experts, uniformly.
    Random,
    /// Expert 0 for nearly every token, then distinct others.
    Skewed,
    /// Only experts of the token's own rank.
    OwnRank,
    /// Only even experts (the odd ones receive nothing), with some entries -1.
    EvenWithHoles,
}

// A splitmix64 step: deterministic, so every rank can build every rank's inputs.
use ferrolink::testing::splitmix64 as mix;

/// One round's inputs for every rank.
struct Round {
    cfg: MoeConfig,
    nranks: usize,
    /// Per rank: tokens, rows (`tokens * hidden`), routing (`tokens * top_k`), weights.
    tokens: Vec<usize>,
    x: Vec<Vec<bf16>>,
    idx: Vec<Vec<i32>>,
    weights: Vec<Vec<f32>>,
    /// fp8 tokens instead: per rank the rows' bytes (e4m3) and their scales (one per 128
    /// channels); `x` then holds their values (exact in bf16), the model of the experts' input.
    fp8: Option<Fp8Rows>,
}

/// Every rank's fp8 tokens: the rows' bytes and their scales.
struct Fp8Rows {
    bytes: Vec<Vec<u8>>,
    scales: Vec<Vec<f32>>,
}

/// The value of an fp8 e4m3 byte (no infinities; `0x7f` and `0xff` are NaN, never made here).
fn e4m3(b: u8) -> f32 {
    let (exp, man) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    let mag = if exp == 0 { man / 8.0 * 2f32.powi(-6) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
    if b & 0x80 != 0 { -mag } else { mag }
}

impl Round {
    fn new(cfg: MoeConfig, nranks: usize, seed: u64, routing: Routing) -> Round {
        let (ne, k, h) = (cfg.num_experts, cfg.top_k, cfg.hidden);
        let per = ne / nranks;
        let mut r = Round { cfg, nranks, tokens: vec![], x: vec![], idx: vec![], weights: vec![], fp8: None };
        for rank in 0..nranks {
            let s = mix(seed ^ (rank as u64) << 32);
            // Rank 1 has no tokens in odd rounds; others a varying number.
            let t = if rank == 1 && seed % 2 == 1 { 0 } else { cfg.max_tokens - (s % 3) as usize };
            let x = (0..t * h).map(|i| bf16::from_f32(((mix(s ^ i as u64) % 255) as f32 - 127.0) / 16.0)).collect();
            let mut idx = Vec::with_capacity(t * k);
            for tok in 0..t {
                let mut chosen: Vec<i32> = Vec::new();
                let mut z = mix(s ^ 0xabc ^ (tok as u64) << 20);
                while chosen.len() < k {
                    z = mix(z);
                    let e = match routing {
                        Routing::Random => (z % ne as u64) as i32,
                        Routing::Skewed if chosen.is_empty() && !z.is_multiple_of(8) => 0,
                        Routing::Skewed => (z % ne as u64) as i32,
                        Routing::OwnRank => (rank * per) as i32 + (z % per as u64) as i32,
                        Routing::EvenWithHoles if z.is_multiple_of(5) => -1,
                        Routing::EvenWithHoles => 2 * (z % (ne as u64 / 2)) as i32,
                    };
                    if e < 0 || !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                idx.extend(chosen);
            }
            let weights = (0..t * k).map(|i| ((mix(s ^ 0x5eed ^ i as u64) % 64) as f32 + 1.0) / 64.0).collect();
            r.tokens.push(t);
            r.x.push(x);
            r.idx.push(idx);
            r.weights.push(weights);
        }
        r
    }

    /// The same routing with fp8 tokens: random bytes (no NaN) and power-of-two scales, so
    /// that each value times its scale is exact in bf16.
    fn with_fp8(mut self, seed: u64) -> Round {
        let h = self.cfg.hidden;
        let (mut bytes, mut scales) = (Vec::new(), Vec::new());
        for rank in 0..self.nranks {
            let t = self.tokens[rank];
            let b: Vec<u8> = (0..t * h)
                .map(|i| {
                    let b = mix(seed ^ 0xf8 ^ (rank as u64) << 40 ^ i as u64) as u8;
                    if b & 0x7f == 0x7f { b ^ 1 } else { b }
                })
                .collect();
            let sc: Vec<f32> =
                (0..t * h / 128).map(|i| 2f32.powi((mix(seed ^ 0x5c ^ i as u64) % 5) as i32 - 2)).collect();
            self.x[rank] = (0..t * h).map(|i| bf16::from_f32(e4m3(b[i]) * sc[i / 128])).collect();
            bytes.push(b);
            scales.push(sc);
        }
        self.fp8 = Some(Fp8Rows { bytes, scales });
        self
    }

    /// The bytes a dispatch puts for token `t` of rank `src`: its bf16 row, or its fp8 row
    /// and scales.
    fn wire_row(&self, src: usize, t: usize) -> Vec<u8> {
        let h = self.cfg.hidden;
        match &self.fp8 {
            None => self.x[src][t * h..][..h].iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
            Some(Fp8Rows { bytes, scales }) => {
                let mut row = bytes[src][t * h..][..h].to_vec();
                row.extend(scales[src][t * h / 128..][..h / 128].iter().flat_map(|s| s.to_le_bytes()));
                row
            }
        }
    }

    /// The leading bytes of receive slot `slot` (`2 * hidden` bytes each) that a row fills.
    fn slot_bytes(&self, received: &[bf16], slot: usize) -> Vec<u8> {
        let h = self.cfg.hidden;
        let used = if self.fp8.is_some() { fp8_row_bytes(h) } else { 2 * h };
        let mut b: Vec<u8> = received[slot * h..][..h].iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
        b.truncate(used);
        b
    }

    /// Dispatches this round's tokens of rank `me` through `dispatch` (bf16 or fp8).
    fn dispatch_with(
        &self,
        dev: &Device,
        me: usize,
        dispatch: impl FnOnce(Tokens<'_>) -> ferrolink::Result<()>,
    ) -> ferrolink::Result<()> {
        match &self.fp8 {
            None => dispatch(Tokens::Bf16(&dev.alloc_from(&self.x[me])?)),
            Some(Fp8Rows { bytes, scales }) => {
                let (x, s) = (dev.alloc_from(&bytes[me])?, dev.alloc_from(&scales[me])?);
                dispatch(Tokens::fp8(&x, &s))
            }
        }
    }

    /// Whether the combine takes the received rows as the experts' results (identity
    /// experts, zero copy): half the bf16 rounds; never fp8 rows (they are not results).
    fn identity(&self) -> bool {
        self.fp8.is_none() && self.tokens.iter().sum::<usize>() % 2 == 0
    }

    fn capacity(&self) -> usize {
        self.cfg.capacity.unwrap_or(self.cfg.max_tokens * self.nranks)
    }

    /// Per expert, the entries routed to it in (rank, token, k) order: `(rank, token, k)`.
    fn queue(&self, e: usize) -> Vec<(usize, usize, usize)> {
        let k = self.cfg.top_k;
        let mut q = Vec::new();
        for rank in 0..self.nranks {
            for (j, &x) in self.idx[rank].iter().enumerate() {
                if x == e as i32 {
                    q.push((rank, j / k, j % k));
                }
            }
        }
        q
    }

    /// The expert's result for a row (the expert computes `x * (e + 1) / 4`, in bf16).
    fn expert(e: usize, v: bf16) -> bf16 {
        bf16::from_f32(v.to_f32() * (e as f32 + 1.0) / 4.0)
    }
}

/// One rank's dispatch and combine of `round`, checked against the model: the rows received
/// (each local expert's, in order), the counts, the drops, and the combined output.
fn run_round(c: &Communicator, moe: &mut Moe, round: &Round) -> ferrolink::Result<()> {
    let dev = c.device();
    let me = c.rank();
    let (h, k) = (round.cfg.hidden, round.cfg.top_k);
    let per = moe.experts_per_rank();
    let cap = moe.capacity();
    check(cap == round.capacity(), || format!("capacity {cap}, expected {}", round.capacity()))?;
    let idx = dev.alloc_from(&round.idx[me])?;
    let w = dev.alloc_from(&round.weights[me])?;
    round.dispatch_with(dev, me, |x| moe.dispatch(x, &idx))?;
    // The dispatch's error, if any (a buffer's host read waits for the kernel, but does not
    // report the communicator's errors).
    c.synchronize()?;
    // Received rows and counts.
    let counts = moe.recv_counts().to_vec()?;
    // In stream order: a host read of the window would wait for the peers' kernels too.
    let mut received = dev.alloc::<bf16>(per * cap * h)?;
    moe.copy_received(&mut received)?;
    let got = received.to_vec()?;
    let mut expert_out = vec![bf16::ZERO; per * cap * h];
    let mut expected_rows = 0;
    for l in 0..per {
        let e = me * per + l;
        let q = round.queue(e);
        let kept = q.len().min(cap);
        expected_rows += kept;
        check(counts[l] as usize == kept, || {
            format!("rank {me} expert {e}: {} rows counted, {kept} expected", counts[l])
        })?;
        for (i, &(src, t, _)) in q.iter().take(kept).enumerate() {
            let row = round.slot_bytes(&got, l * cap + i);
            let want = round.wire_row(src, t);
            check(row == want, || {
                let at = row.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(row.len().min(want.len()));
                format!(
                    "rank {me} expert {e} row {i}: byte {at} of {} differs: {:?}…, expected token {t} of rank {src} \
                     {:?}…",
                    want.len(),
                    &row[at..(at + 8).min(row.len())],
                    &want[at..(at + 8).min(want.len())]
                )
            })?;
            // The expert's input is the token's value (for fp8 rows, times its scale).
            for (o, v) in expert_out[(l * cap + i) * h..][..h].iter_mut().zip(&round.x[src][t * h..][..h]) {
                *o = Round::expert(e, *v);
            }
        }
    }
    check(moe.received_rows()? == expected_rows as u64, || {
        format!("rank {me}: {} rows received, {expected_rows} expected", moe.received_rows().unwrap_or(0))
    })?;
    // Drops: this rank's entries whose place in their expert's queue is past the capacity.
    let mut dropped = vec![false; round.tokens[me] * k];
    for e in 0..round.cfg.num_experts {
        for (i, &(src, t, kk)) in round.queue(e).iter().enumerate() {
            if src == me && i >= cap {
                dropped[t * k + kk] = true;
            }
        }
    }
    let want_dropped = dropped.iter().filter(|d| **d).count() as u64;
    check(moe.dropped()? == want_dropped, || {
        format!("rank {me}: {:?} dropped, {want_dropped} expected", moe.dropped())
    })?;
    // Half the rounds combine the received rows as they are (zero copy: the experts are the
    // identity), half pass the experts' results as a buffer.
    let mut out = dev.alloc::<bf16>(round.tokens[me] * h)?;
    let identity = round.identity();
    if identity {
        moe.combine(None, &w, &mut out)?;
    } else {
        moe.combine(Some(&dev.alloc_from(&expert_out)?), &w, &mut out)?;
    }
    check_combined(me, round, &dropped, identity, &out.to_vec()?)
}

/// Checks rank `me`'s combined output against the model: per token, the weighted sum of its
/// kept entries' results (the experts' `x * (e + 1) / 4`, or `x` itself for `identity`).
fn check_combined(me: usize, round: &Round, dropped: &[bool], identity: bool, out: &[bf16]) -> ferrolink::Result<()> {
    let (h, k) = (round.cfg.hidden, round.cfg.top_k);
    for t in 0..round.tokens[me] {
        for i in 0..h {
            let mut acc = 0f32;
            for kk in 0..k {
                let e = round.idx[me][t * k + kk];
                if e < 0 || dropped[t * k + kk] {
                    continue;
                }
                let v = round.x[me][t * h + i];
                let result = if identity { v } else { Round::expert(e as usize, v) };
                acc += round.weights[me][t * k + kk] * result.to_f32();
            }
            let want = bf16::from_f32(acc);
            let g = out[t * h + i];
            // One bf16 step of slack: the GPU may fuse the multiply and the add.
            let ulp = bf16::from_bits(want.to_bits() | 1).to_f32() - bf16::from_bits(want.to_bits() & !1).to_f32();
            check((g.to_f32() - want.to_f32()).abs() <= ulp.abs().max(1e-30), || {
                format!("rank {me} token {t} element {i}: {g}, expected {want}")
            })?;
        }
    }
    Ok(())
}

/// One rank's low-latency dispatch and combine of `round` (split into send and receive
/// halves when `hook`), checked against the model: each (expert, source) region holds that
/// source's rows for the expert (in any order), the counts, and the combined output.
fn run_low_latency_round(c: &Communicator, ll: &mut MoeLowLatency, round: &Round, hook: bool) -> ferrolink::Result<()> {
    let dev = c.device();
    let (me, n) = (c.rank(), c.nranks());
    let (h, k, max) = (round.cfg.hidden, round.cfg.top_k, round.cfg.max_tokens);
    let per = ll.experts_per_rank();
    let idx = dev.alloc_from(&round.idx[me])?;
    let w = dev.alloc_from(&round.weights[me])?;
    if hook {
        round.dispatch_with(dev, me, |x| ll.dispatch_send(x, &idx))?;
        ll.dispatch_recv()?;
    } else {
        round.dispatch_with(dev, me, |x| ll.dispatch(x, &idx))?;
    }
    c.synchronize()?;
    let counts = ll.recv_counts().to_vec()?;
    let mut received = dev.alloc::<bf16>(per * n * max * h)?;
    ll.copy_received(&mut received)?;
    let got = received.to_vec()?;
    let mut expert_out = vec![bf16::ZERO; per * n * max * h];
    let mut total = 0;
    for l in 0..per {
        let e = me * per + l;
        for src in 0..n {
            let mine: Vec<usize> = round.queue(e).iter().filter(|q| q.0 == src).map(|q| q.1).collect();
            let mut want: Vec<Vec<u8>> = mine.iter().map(|&t| round.wire_row(src, t)).collect();
            let region = (l * n + src) * max;
            let half = per * n * max * 2 * h;
            check(ll.region(l, src)? % half == region * 2 * h, || format!("rank {me}: region ({l}, {src})"))?;
            check(counts[l * n + src] as usize == want.len(), || {
                format!(
                    "rank {me} expert {e} from rank {src}: {} rows counted, {} expected",
                    counts[l * n + src],
                    want.len()
                )
            })?;
            let mut rows: Vec<Vec<u8>> = (0..want.len()).map(|i| round.slot_bytes(&got, region + i)).collect();
            // Each row is some token's of `src` (in any order): its result is that token's.
            for (i, row) in rows.iter().enumerate() {
                if let Some(&t) = mine.iter().find(|&&t| round.wire_row(src, t) == *row) {
                    for (o, v) in expert_out[(region + i) * h..][..h].iter_mut().zip(&round.x[src][t * h..][..h]) {
                        *o = Round::expert(e, *v);
                    }
                }
            }
            want.sort();
            rows.sort();
            check(rows == want, || format!("rank {me} expert {e}: the rows from rank {src} are not its tokens'"))?;
            total += want.len();
        }
    }
    check(ll.received_rows()? == total as u64, || {
        format!("rank {me}: {:?} rows received, {total} expected", ll.received_rows())
    })?;
    let mut out = dev.alloc::<bf16>(round.tokens[me] * h)?;
    let identity = round.identity();
    let expert_out = if identity { None } else { Some(dev.alloc_from(&expert_out)?) };
    if hook {
        ll.combine_send(expert_out.as_ref())?;
        ll.combine_recv(&w, &mut out)?;
    } else {
        ll.combine(expert_out.as_ref(), &w, &mut out)?;
    }
    check_combined(me, round, &vec![false; round.tokens[me] * k], identity, &out.to_vec()?)
}

/// Every routing, several rounds on one [`MoeLowLatency`] (both parities, hook and not).
fn every_low_latency_round(c: &Communicator) -> ferrolink::Result<()> {
    let n = c.nranks();
    for cfg in shapes(c.device(), n) {
        let mut ll = c.moe_low_latency(cfg)?;
        for (seed, routing) in [
            Routing::Random,
            Routing::Skewed,
            Routing::OwnRank,
            Routing::EvenWithHoles,
            Routing::Random,
            Routing::Skewed,
        ]
        .into_iter()
        .enumerate()
        {
            let round = Round::new(cfg, n, seed as u64 + 31 * cfg.hidden as u64, routing);
            run_low_latency_round(c, &mut ll, &round, seed % 3 != 1).map_err(|e| {
                let e = format!("rank {}: low latency {routing:?} round {seed} of {cfg:?} on {n} ranks: {e}", c.rank());
                eprintln!("{e}");
                ferrolink::Error::InvalidArgument(e)
            })?;
        }
        // A rank without tokens does not wait for its last combine (nothing comes back to
        // it), but its kernel still sends the others their results: wait before going on
        // (and before a process ends).
        c.synchronize()?;
    }
    Ok(())
}

/// The shapes tried: (experts, hidden, top_k, max_tokens) on `n` ranks.
fn shapes(dev: &Device, n: usize) -> Vec<MoeConfig> {
    let big = dev.backend() == ferrolink::Backend::Cuda;
    let mut v = vec![
        MoeConfig { num_experts: 2 * n, hidden: 16, top_k: 2, max_tokens: 9, capacity: None },
        MoeConfig { num_experts: 4 * n, hidden: 24, top_k: 3, max_tokens: 17, capacity: None },
    ];
    if big {
        v.push(MoeConfig { num_experts: 8 * n, hidden: 7168, top_k: 8, max_tokens: 128, capacity: None });
    }
    v
}

/// Every routing, several rounds each on one [`Moe`], on one rank.
fn every_routing(c: &Communicator) -> ferrolink::Result<()> {
    let n = c.nranks();
    for cfg in shapes(c.device(), n) {
        let mut moe = c.moe(cfg)?;
        for (seed, routing) in
            [Routing::Random, Routing::Skewed, Routing::OwnRank, Routing::EvenWithHoles, Routing::Random]
                .into_iter()
                .enumerate()
        {
            let round = Round::new(cfg, n, seed as u64 + 17 * cfg.hidden as u64, routing);
            run_round(c, &mut moe, &round).map_err(|e| {
                // Every rank's failure (run_ranks returns the first rank's, which may be the
                // consequence of another's: a failing rank aborts the communicator).
                let e = format!("rank {}: {routing:?} round {seed} of {cfg:?} on {n} ranks: {e}", c.rank());
                eprintln!("{e}");
                ferrolink::Error::InvalidArgument(e)
            })?;
        }
    }
    Ok(())
}

/// Overflow: a capacity of 3 rows per expert with skewed routing; the drops are counted and
/// the combine leaves them out.
fn overflow(c: &Communicator) -> ferrolink::Result<()> {
    let n = c.nranks();
    let cfg = MoeConfig { num_experts: 2 * n, hidden: 8, top_k: 2, max_tokens: 8, capacity: Some(3) };
    let mut moe = c.moe(cfg)?;
    for seed in 0..3 {
        let round = Round::new(cfg, n, 100 + seed, if seed == 1 { Routing::Random } else { Routing::Skewed });
        run_round(c, &mut moe, &round)?;
    }
    Ok(())
}

/// fp8 tokens with their scales, in both modes: the received slots start with the token's
/// bytes and scales, and the combine sums the experts' bf16 results over them.
fn fp8_tokens(c: &Communicator) -> ferrolink::Result<()> {
    let n = c.nranks();
    let mut shapes = vec![MoeConfig { num_experts: 2 * n, hidden: 512, top_k: 2, max_tokens: 5, capacity: None }];
    if c.device().backend() == ferrolink::Backend::Cuda {
        shapes.push(MoeConfig { num_experts: 8 * n, hidden: 7168, top_k: 8, max_tokens: 128, capacity: None });
    }
    for cfg in shapes {
        let mut moe = c.moe(cfg)?;
        let mut ll = c.moe_low_latency(cfg)?;
        for (seed, routing) in [Routing::Random, Routing::EvenWithHoles, Routing::Skewed].into_iter().enumerate() {
            let round = Round::new(cfg, n, 900 + seed as u64, routing).with_fp8(seed as u64);
            let what = |e: ferrolink::Error, mode: &str| {
                let e = format!("rank {}: fp8 {mode} {routing:?} round {seed} of {cfg:?} on {n} ranks: {e}", c.rank());
                eprintln!("{e}");
                ferrolink::Error::InvalidArgument(e)
            };
            run_round(c, &mut moe, &round).map_err(|e| what(e, "normal"))?;
            run_low_latency_round(c, &mut ll, &round, seed % 2 == 0).map_err(|e| what(e, "low latency"))?;
        }
        c.synchronize()?;
    }
    Ok(())
}

/// The fused combine (the experts' MLP adds its results into the tokens' ranks: the
/// `moe_fused` example, which checks every output exactly): random and skewed routing, ranks
/// without tokens, overflow at a capacity of 3, several rounds; on CUDA also a GPU-sized
/// shape; rounds of the plain combine between fused ones on one `Moe`. In one LSA domain,
/// across domains (results of other domains come back as return rows through the GIN
/// proxy) and with every peer forced through the proxy (`FERROLINK_GIN=proxy`).
/// Launches the built-in fused expert kernel (`moe_expert_mlp_fused`) for `moe`'s call
/// `target` on `c`'s stream: one hidden unit, every weight of W1 and W2 taken from `ones`
/// (16 ones: 2 experts of 1 x 8, for `hidden` 8), one warp: each row `x` gives `y = W2
/// relu(W1 x)`, every channel `relu(sum of x)`, added times its weight into its token.
fn launch_unit_expert(
    c: &Communicator,
    moe: &Moe,
    target: ferrolink::moe::FusedTarget<'_>,
    ones: &ferrolink::DeviceBuffer<f32>,
) -> ferrolink::Result<()> {
    // SAFETY: the kernel's contract: this call's target and the Moe's device communicator,
    // weights for 2 experts of 1 x 8 (tracked), a warp with 4 bytes of shared memory.
    unsafe {
        c.stream().launch(
            c.device().builtin_module()?,
            &moe_expert_mlp_fused,
            LaunchConfig::linear(1, 32).with_shared_mem(4),
            (moe.dev_comm(), target, ones, ones, 1u32),
        )
    }
}

fn fused_combine(c: &Communicator) -> ferrolink::Result<()> {
    use ferrolink_examples::moe_fused::{Shape, rank};
    let small = Shape::small();
    let mut shapes = vec![
        small,
        Shape { mixed: true, rounds: 4, ..small },
        Shape { skewed: true, capacity: Some(3), hidden: 64, top_k: 3, ..small },
        Shape { skewed: true, experts_per_rank: 1, top_k: 1, max_tokens: 9, ..small },
    ];
    if c.device().backend() == ferrolink::Backend::Cuda {
        shapes.push(Shape::gpu());
    }
    for shape in shapes {
        rank(c, shape).map_err(|e| {
            let e = format!("rank {}: fused combine of {shape:?} on {} ranks: {e}", c.rank(), c.nranks());
            eprintln!("{e}");
            ferrolink::Error::InvalidArgument(e)
        })?;
    }
    Ok(())
}

/// Whether `c`'s `Moe` relays across domains exactly when it should: domains of more than
/// one rank, several of them, GIN not forced through the proxy, `FERROLINK_MOE_RELAY` not 0.
fn relays_as_expected(c: &Communicator) -> ferrolink::Result<()> {
    let (n, lsa) = (c.nranks(), c.lsa_size());
    let relaying = std::env::var("FERROLINK_MOE_RELAY").as_deref() != Ok("0")
        && std::env::var("FERROLINK_GIN").as_deref() != Ok("proxy");
    let want = if relaying && lsa > 1 && lsa < n && n.is_multiple_of(lsa) { n / lsa } else { 0 };
    let cfg = MoeConfig { num_experts: 2 * n, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    let got = c.moe(cfg)?.relay_domains();
    check(got == want, || {
        format!("{n} ranks in LSA domains of {lsa}: the Moe relays across {got} domains, {want} expected")
    })
}

fn every_case(c: &Communicator) -> ferrolink::Result<()> {
    type Case = fn(&Communicator) -> ferrolink::Result<()>;
    let cases: [(&str, Case); 6] = [
        ("relays", relays_as_expected),
        ("routings", every_routing),
        ("overflow", overflow),
        ("low latency", every_low_latency_round),
        ("fp8", fp8_tokens),
        ("fused", fused_combine),
    ];
    for (what, case) in cases {
        let start = std::time::Instant::now();
        case(c)?;
        // Progress (shown with --nocapture): on one GPU every put between LSA domains goes
        // through the GIN proxy, and these cases take minutes there.
        if c.rank() == 0 {
            eprintln!("moe {} ranks, LSA {}: {what} passed in {:.1?}", c.nranks(), c.lsa_size(), start.elapsed());
        }
    }
    Ok(())
}

#[test]
fn dispatch_and_combine_on_two_three_and_four_ranks() {
    ferrolink::testing::for_each_backend("moe_dispatch_and_combine", |dev| {
        for n in [2, 3, 4] {
            let comms = Communicator::init_all(&vec![dev.clone(); n])?;
            ferrolink::run_ranks(&comms, every_case)?;
        }
        Ok(())
    });
}

/// LSA domains of one and two ranks (two and three domains): rows to other domains go
/// through the GIN proxy, straight to the expert's rank with domains of one, through the
/// relay (once per token and domain, then copied inside the domain) with larger ones; the
/// results are the same.
#[test]
fn dispatch_and_combine_across_lsa_domains() {
    ferrolink::testing::for_each_backend("moe_across_lsa_domains", |dev| {
        for (n, domain) in domain_configs(&[(3, 1), (4, 2), (6, 2)]) {
            let mut config = CommConfig::from_env(dev.backend()).unwrap();
            config.lsa = LsaMode::Size(domain);
            let comms = Communicator::init_all_with(&vec![dev.clone(); n], config)?;
            check(comms[0].lsa_size() == domain, || format!("LSA domains of {domain} asked, {}", comms[0].lsa_size()))?;
            ferrolink::run_ranks(&comms, every_case)?;
        }
        Ok(())
    });
}

#[test]
fn bad_moe_calls_are_clear_errors() {
    ferrolink::testing::for_each_backend("bad_moe_calls_are_clear_errors", |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        let good = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 4, capacity: None };
        let errs = ferrolink::run_ranks(&comms, |c| {
            let odd = c.moe(MoeConfig { num_experts: 3, ..good }).err().map(|e| e.to_string()).unwrap_or_default();
            let hidden = c.moe(MoeConfig { hidden: 12, ..good }).err().map(|e| e.to_string()).unwrap_or_default();
            let mut moe = c.moe(good)?;
            let dev = c.device();
            let x = dev.alloc::<bf16>(2 * 8)?;
            let idx = dev.alloc_from(&[0i32, 1, 2, 3])?;
            let w = dev.alloc::<f32>(4)?;
            let mut out = dev.alloc::<bf16>(2 * 8)?;
            let early = moe.combine(None, &w, &mut out).expect_err("combine before dispatch").to_string();
            let short = moe.dispatch(&x, &dev.alloc::<i32>(3)?).expect_err("3 entries for 2 tokens").to_string();
            let many =
                moe.dispatch(&dev.alloc::<bf16>(5 * 8)?, &dev.alloc::<i32>(10)?).expect_err("5 tokens").to_string();
            let (x8, no_scales) = (dev.alloc::<u8>(16)?, dev.alloc::<f32>(0)?);
            let fp8_hidden = moe.dispatch(Tokens::fp8(&x8, &no_scales), &idx).expect_err("fp8, hidden 8").to_string();
            let mut wide = c.moe(MoeConfig { hidden: 512, ..good })?;
            let (x8, scales) = (dev.alloc::<u8>(2 * 512)?, dev.alloc::<f32>(3)?);
            let fp8_scales = wide.dispatch(Tokens::fp8(&x8, &scales), &idx).expect_err("3 scales").to_string();
            moe.dispatch(&x, &idx)?;
            let twice = moe.dispatch(&x, &idx).expect_err("two dispatches").to_string();
            let wrong_out = moe.combine(None, &w, &mut dev.alloc::<bf16>(8)?).expect_err("a short output").to_string();
            moe.combine(None, &w, &mut out)?;
            // The fused combine: set up first, only after a dispatch with sources, the
            // weights and the output sized for the tokens; the combine may still follow.
            let mut fz = c.moe(good)?;
            let unset = fz.fused_target().err().map(|e| e.to_string()).unwrap_or_default();
            fz.enable_fused()?;
            let idle = fz.fused_target().err().map(|e| e.to_string()).unwrap_or_default();
            fz.dispatch(&x, &idx)?;
            let plain = fz.finish_fused(&mut out).expect_err("fused after a plain dispatch").to_string();
            let between = fz.enable_fused().expect_err("enable_fused while pending").to_string();
            fz.combine(None, &w, &mut out)?;
            let short_w = fz.dispatch_with_sources(&x, &idx, &dev.alloc::<f32>(3)?).expect_err("3 weights").to_string();
            let (x8, scales) = (dev.alloc::<u8>(2 * 512)?, dev.alloc::<f32>(8)?);
            let mut wide_fz = c.moe(MoeConfig { hidden: 512, ..good })?;
            let fp8_fused =
                wide_fz.dispatch_with_sources(Tokens::fp8(&x8, &scales), &idx, &w).expect_err("fp8 fused").to_string();
            fz.dispatch_with_sources(&x, &idx, &w)?;
            let no_expert = fz.finish_fused(&mut out).expect_err("finish before the expert").to_string();
            let target = fz.fused_target()?;
            let again = fz.fused_target().err().map(|e| e.to_string()).unwrap_or_default();
            let ones = dev.alloc_from(&[1f32; 16])?;
            launch_unit_expert(c, &fz, target, &ones)?;
            let after_expert = fz.combine(None, &w, &mut out).expect_err("combine after the expert").to_string();
            let fused_out = fz.finish_fused(&mut dev.alloc::<bf16>(8)?).expect_err("a short output").to_string();
            fz.finish_fused(&mut out)?;
            c.synchronize()?;
            // (what, the text expected in the error, the error) for each bad call.
            Ok(vec![
                ("fused before set-up", "call enable_fused first", unset),
                ("fused after dispatch", "the last dispatch was a plain dispatch", plain),
                ("fused with nothing pending", "no dispatch is waiting", idle),
                ("enable_fused", "a dispatch is waiting for its combine", between),
                ("fp8 fused", "experts read bf16 rows", fp8_fused),
                ("no expert", "no expert kernel for this dispatch", no_expert),
                ("a second target", "one expert launch per call", again),
                ("combine after expert", "end it with finish_fused", after_expert),
                ("short weights", "topk_weights holds 3 weights, 2 tokens x top_k 2 = 4 needed", short_w),
                ("fused output", "out must hold 16 (it holds 8)", fused_out),
                ("3 experts", "multiple of the 2 ranks", odd),
                ("hidden 12", "multiple of 8", hidden),
                ("early combine", "no dispatch to combine", early),
                ("short routing", "3 entries, 2 tokens x top_k 2 = 4 needed", short),
                ("5 tokens", "more than max_tokens 4", many),
                ("two dispatches", "has not been combined", twice),
                ("short output", "out 16 (it holds 8)", wrong_out),
                ("fp8, hidden 8", "multiple of 512", fp8_hidden),
                ("fp8 scales", "scales hold 3 values, 2 tokens x 4 scales", fp8_scales),
            ])
        })?;
        for (what, expected, got) in &errs[0] {
            check(got.contains(expected), || format!("{what}: {got:?} does not say {expected:?}"))?;
        }
        // Ranks with different shapes: an error naming the other rank's.
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        let errs = ferrolink::run_ranks(&comms, |c| {
            let k = if c.rank() == 0 { 2 } else { 1 };
            Ok(c.moe(MoeConfig { top_k: k, ..good }).err().map(|e| e.to_string()).unwrap_or_default())
        })?;
        check(errs[0].contains("rank 1 has num_experts 4, hidden 8, top_k 1"), || format!("shapes: {}", errs[0]))?;
        Ok(())
    });
}

/// Rank 0 routes an entry to expert 9 of 4: the dispatch kernel reports the entry, and the
/// stream fails. On CUDA the kernel traps, which breaks the process's context: that case runs
/// in a child process.
fn expert_out_of_range(dev: &Device) -> ferrolink::Result<String> {
    let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
    let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 4, capacity: None };
    let errs = ferrolink::run_ranks(&comms, |c| {
        let mut moe = c.moe(cfg)?;
        let dev = c.device();
        let idx = if c.rank() == 0 { [0i32, 9, 1, 2] } else { [0, 1, 2, 3] };
        moe.dispatch(&dev.alloc::<bf16>(16)?, &dev.alloc_from(&idx)?)?;
        Ok(c.synchronize().err().map(|e| e.to_string()).unwrap_or_default())
    });
    // Rank 0 faults; rank 1 is aborted with it (or reports the fault too).
    Ok(match errs {
        Ok(v) => v[0].clone(),
        Err(e) => e.to_string(),
    })
}

#[test]
fn experts_out_of_range_are_reported_faults() {
    const NAME: &str = "experts_out_of_range_are_reported_faults";
    if ferrolink_tests::dev_in_child(NAME, ferrolink::Backend::Cuda, |dev| {
        println!("child saw: {}", expert_out_of_range(dev)?);
        Ok(())
    }) {
        return;
    }
    ferrolink::testing::for_each_backend(NAME, |dev| {
        let msg = match dev.backend() {
            ferrolink::Backend::Cuda => ferrolink_tests::run_child(NAME)?,
            ferrolink::Backend::Cpu => expert_out_of_range(dev)?,
        };
        check(msg.contains("names expert 9 at entry 1"), || format!("expert 9: {msg}"))
    });
}

/// Low-latency mode: rank 0 names expert 0 twice per token, 4 entries for 2 rows.
fn low_latency_overflow(dev: &Device) -> ferrolink::Result<String> {
    let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
    let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    let errs = ferrolink::run_ranks(&comms, |c| {
        let mut ll = c.moe_low_latency(cfg)?;
        let dev = c.device();
        let idx = if c.rank() == 0 { [0i32, 0, 0, 0] } else { [0, 1, 2, 3] };
        ll.dispatch(&dev.alloc::<bf16>(16)?, &dev.alloc_from(&idx)?)?;
        Ok(c.synchronize().err().map(|e| e.to_string()).unwrap_or_default())
    });
    Ok(match errs {
        Ok(v) => v[0].clone(),
        Err(e) => e.to_string(),
    })
}

#[test]
fn low_latency_overflow_is_a_reported_fault() {
    const NAME: &str = "low_latency_overflow_is_a_reported_fault";
    if ferrolink_tests::dev_in_child(NAME, ferrolink::Backend::Cuda, |dev| {
        println!("child saw: {}", low_latency_overflow(dev)?);
        Ok(())
    }) {
        return;
    }
    ferrolink::testing::for_each_backend(NAME, |dev| {
        let msg = match dev.backend() {
            ferrolink::Backend::Cuda => ferrolink_tests::run_child(NAME)?,
            ferrolink::Backend::Cpu => low_latency_overflow(dev)?,
        };
        check(msg.contains("more than max_tokens (2) entries of this rank to expert 0"), || format!("overflow: {msg}"))
    });
}

/// After `Communicator::recover`, MoE objects made before refuse every call with an error
/// that says why (a failed call may have left rows and signal adds in flight), in the middle
/// of a call too; objects made after it work, their results checked.
#[test]
fn moe_objects_made_before_a_recover_refuse_calls() {
    ferrolink::testing::for_each_backend("moe_objects_made_before_a_recover_refuse_calls", |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 1, max_tokens: 2, capacity: None };
        let outs = ferrolink::run_ranks(&comms, |c| {
            let dev = c.device();
            // Each token to expert 2 (rank 1) with weight 1: the output is the input.
            let x = dev.alloc_from(&(0..16).map(|i| bf16::from_f32(i as f32 + 1.0)).collect::<Vec<_>>())?;
            let (idx, w) = (dev.alloc_from(&[2i32, 2])?, dev.alloc_from(&[1f32; 2])?);
            let mut out = dev.alloc::<bf16>(16)?;
            let mut plain = c.moe(cfg)?;
            let mut fused = c.moe(cfg)?;
            fused.enable_fused()?;
            let mut ll = c.moe_low_latency(cfg)?;
            plain.dispatch(&x, &idx)?; // left pending across the recover
            c.synchronize()?;
            c.recover()?;
            let refused = [
                plain.combine(None, &w, &mut out).err(),
                fused.dispatch_with_sources(&x, &idx, &w).err(),
                fused.fused_target().err(),
                ll.dispatch(&x, &idx).err(),
            ];
            let mut fresh = c.moe(cfg)?;
            fresh.dispatch(&x, &idx)?;
            fresh.combine(None, &w, &mut out)?;
            c.synchronize()?;
            Ok((refused.map(|e| e.map(|e| e.to_string()).unwrap_or_default()), out.to_vec()?))
        })?;
        for (rank, (refused, out)) in outs.iter().enumerate() {
            for (i, e) in refused.iter().enumerate() {
                check(e.contains("was recovered (Communicator::recover)") && e.contains("make a new one"), || {
                    format!("rank {rank}, call {i} after recover: {e:?}")
                })?;
            }
            let want: Vec<f32> = (0..16).map(|i| i as f32 + 1.0).collect();
            let got: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
            check(got == want, || format!("rank {rank}: a new Moe after recover gave {got:?}"))?;
        }
        Ok(())
    });
}

/// A fused call whose expert kernel reports no rows: the token ranks' `finish_fused` cannot
/// finish; after the communicator's timeout it fails naming the `FUSED` wait (no hang), and
/// after `recover` a new `Moe` works.
#[test]
fn a_fused_call_whose_expert_skips_rows_times_out() {
    ferrolink::testing::for_each_backend("a_fused_call_whose_expert_skips_rows_times_out", |dev| {
        let config = ferrolink::CommConfig {
            timeout: Some(std::time::Duration::from_millis(500)),
            ..ferrolink::CommConfig::from_env(dev.backend()).unwrap()
        };
        let comms = Communicator::init_all_with(&[dev.clone(), dev.clone()], config)?;
        let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 1, max_tokens: 2, capacity: None };
        let errs = ferrolink::run_ranks(&comms, |c| {
            let dev = c.device();
            let x = dev.alloc_from(&[bf16::from_f32(1.0); 16])?;
            let (idx, w) = (dev.alloc_from(&[2i32, 3])?, dev.alloc_from(&[1f32; 2])?);
            let mut out = dev.alloc::<bf16>(16)?;
            let mut moe = c.moe(cfg)?;
            moe.enable_fused()?;
            moe.dispatch_with_sources(&x, &idx, &w)?;
            // The expert "launch" that adds and reports nothing.
            let _target = moe.fused_target()?;
            let finished = moe.finish_fused(&mut out).and_then(|()| c.synchronize());
            Ok(finished.err().map(|e| e.to_string()).unwrap_or_default())
        })?;
        let fused = ferrolink_device::moe::signal::FUSED;
        for (rank, e) in errs.iter().enumerate() {
            check(
                e.contains(&format!("waits for GIN signal {fused} to reach 2: it is 0")) && e.contains("timeout"),
                || format!("rank {rank}: finish_fused without adds: {e:?}"),
            )?;
        }
        // Back in step: a new Moe's fused call, with its expert kernel, is exact.
        ferrolink::recover(&comms)?;
        let outs = ferrolink::run_ranks(&comms, |c| {
            let dev = c.device();
            let x = dev.alloc_from(&[bf16::from_f32(1.0); 16])?;
            let (idx, w) = (dev.alloc_from(&[2i32, 3])?, dev.alloc_from(&[0.5f32; 2])?);
            let mut out = dev.alloc::<bf16>(16)?;
            let mut moe = c.moe(cfg)?;
            moe.enable_fused()?;
            moe.dispatch_with_sources(&x, &idx, &w)?;
            let ones = dev.alloc_from(&[1f32; 16])?;
            launch_unit_expert(c, &moe, moe.fused_target()?, &ones)?;
            moe.finish_fused(&mut out)?;
            c.synchronize()?;
            out.to_vec()
        })?;
        for (rank, out) in outs.iter().enumerate() {
            // y = W2 relu(W1 x) = 8 in every channel, times the weight 0.5.
            check(out.iter().all(|v| v.to_f32() == 4.0), || format!("rank {rank} after recover: {out:?}"))?;
        }
        Ok(())
    });
}

#[test]
fn bad_low_latency_calls_are_clear_errors() {
    ferrolink::testing::for_each_backend("bad_low_latency_calls_are_clear_errors", |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        let good = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
        let errs = ferrolink::run_ranks(&comms, |c| {
            let cap = c.moe_low_latency(MoeConfig { capacity: Some(3), ..good }).err().map(|e| e.to_string());
            let mut ll = c.moe_low_latency(good)?;
            let dev = c.device();
            let (x, idx) = (dev.alloc::<bf16>(16)?, dev.alloc_from(&[0i32, 1, 2, 3])?);
            let (w, mut out) = (dev.alloc::<f32>(4)?, dev.alloc::<bf16>(16)?);
            let early_recv = ll.dispatch_recv().expect_err("a receive before its send").to_string();
            let early_combine = ll.combine(None, &w, &mut out).expect_err("combine before dispatch").to_string();
            let many = ll.dispatch(&dev.alloc::<bf16>(24)?, &dev.alloc::<i32>(6)?).expect_err("3 tokens").to_string();
            ll.dispatch_send(&x, &idx)?;
            let skipped = ll.combine_send(None).expect_err("combine before the receive").to_string();
            ll.dispatch_recv()?;
            let short = ll.combine(None, &w, &mut dev.alloc::<bf16>(8)?).expect_err("a short output").to_string();
            ll.combine(None, &w, &mut out)?;
            c.synchronize()?;
            Ok([cap.unwrap_or_default(), early_recv, early_combine, many, skipped, short])
        })?;
        let [cap, early_recv, early_combine, many, skipped, short] = &errs[0];
        check(cap.contains("capacity must be None"), || format!("capacity: {cap}"))?;
        check(early_recv.contains("dispatch_recv: only after dispatch_send"), || {
            format!("early receive: {early_recv}")
        })?;
        check(early_combine.contains("combine: only after the dispatch's receive"), || {
            format!("early: {early_combine}")
        })?;
        check(many.contains("more than max_tokens 2"), || format!("3 tokens: {many}"))?;
        check(skipped.contains("combine_send: only after the dispatch's receive"), || format!("skipped: {skipped}"))?;
        check(short.contains("out 16 (it holds 8)"), || format!("short output: {short}"))?;
        Ok(())
    });
}

/// One process per rank: every case with the ranks in one LSA domain, with each process its
/// own domain (the GIN proxy between them), and in two domains of two processes (relayed);
/// the fused combine with every peer forced through the proxy.
#[test]
fn moe_jobs_of_one_process_per_rank() {
    if child(|c| if scenario() == "proxy" { fused_combine(c) } else { every_case(c) }) {
        return;
    }
    for n in [2, 3] {
        if !fits(n) {
            continue;
        }
        job_passes("moe_jobs_of_one_process_per_rank", "lsa", n);
        job_passes_with("moe_jobs_of_one_process_per_rank", "gin", n, &[("FERROLINK_LSA", "process")]);
    }
    // Two domains of two processes: the dispatch relays rows across domains, and the relay
    // copies them to the other process of its domain.
    if fits(4) {
        job_passes_with("moe_jobs_of_one_process_per_rank", "relay", 4, &[("FERROLINK_LSA", "2")]);
    }
    // Every peer through the proxy, the own rank too: the fused combine's results all travel
    // as return rows.
    if fits(2) {
        job_passes_with("moe_jobs_of_one_process_per_rank", "proxy", 2, &[("FERROLINK_GIN", "proxy")]);
    }
}
