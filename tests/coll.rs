//! Collectives (issue 12): every collective × element type × reduction, in place and out of
//! place, from device buffers (staged) and from windows (zero copy), one-shot and two-shot,
//! at sizes 0, 1, odd and large, against a host reference — on every backend.

use ferrolink::coll::{
    CollElem, CollKind, Collective, Input, Output, ReduceOp, algo, bf16, expected_output, f16, proto, reduce_values,
};
use ferrolink::{Communicator, Device, Window};
use ferrolink_device::coll::ll;
use ferrolink_tests::{check, domain_configs};

/// Element types built from small integers (so that every reduction is exact where it must
/// be, and the same on every rank).
trait Val: CollElem + PartialEq + std::fmt::Debug + Send + Sync {
    fn of(v: u8) -> Self;
}
impl Val for f32 {
    fn of(v: u8) -> Self {
        f32::from(v)
    }
}
impl Val for f64 {
    fn of(v: u8) -> Self {
        f64::from(v)
    }
}
impl Val for i32 {
    fn of(v: u8) -> Self {
        i32::from(v) - 3
    }
}
impl Val for i64 {
    fn of(v: u8) -> Self {
        i64::from(v) - 3
    }
}
impl Val for u32 {
    fn of(v: u8) -> Self {
        u32::from(v)
    }
}
impl Val for u8 {
    fn of(v: u8) -> Self {
        v
    }
}
impl Val for f16 {
    fn of(v: u8) -> Self {
        f16::from_f32(f32::from(v))
    }
}
impl Val for bf16 {
    fn of(v: u8) -> Self {
        bf16::from_f32(f32::from(v))
    }
}

/// Rank `r`'s input element `i`.
fn input<T: Val>(r: usize, i: usize) -> T {
    T::of(((r * 7 + i * 3) % 5 + 1) as u8)
}

/// How a case passes its buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    /// Device buffers, out of place (staged).
    Buffers,
    /// One device buffer, in place.
    InPlace,
    /// Windows, out of place (zero copy), at odd element offsets.
    Windows,
    /// One window, in place.
    WindowInPlace,
}

/// Runs `c` with `form` on every rank and checks every rank's output.
fn run_case<T: Val>(comms: &[Communicator], c: Collective, form: Form) -> ferrolink::Result<()> {
    let n = comms.len();
    run_case_with::<T>(comms, c, form, |me| expected_output::<T>(&c, n, me, input::<T>))
}

/// [`run_case`] against `expected(rank)` (`None`: the output is left as it was).
fn run_case_with<T: Val>(
    comms: &[Communicator],
    c: Collective,
    form: Form,
    expected: impl Fn(usize) -> Option<Vec<T>>,
) -> ferrolink::Result<()> {
    let n = comms.len();
    let (in_len, out_len) = c.lengths(n);
    let size = std::mem::size_of::<T>();
    let sentinel = T::of(200);
    let outs = ferrolink::run_ranks(comms, |comm| {
        let me = comm.rank();
        let dev = comm.device();
        let mut mine: Vec<T> = (0..in_len).map(|i| input(me, i)).collect();
        let in_place_at = if c.kind == CollKind::AllGather { me * c.count } else { 0 };
        let mut out_init = vec![sentinel; out_len];
        let win = |bytes: usize| -> ferrolink::Result<Window> { comm.register_window(comm.mem_alloc(bytes.max(1))?) };
        match form {
            Form::Buffers => {
                let send = dev.alloc_from(&mine)?;
                let mut recv = dev.alloc_from(&out_init)?;
                comm.collective(&c, Input::Buffer(&send), Output::Buffer(&mut recv))?;
                recv.to_vec()
            }
            Form::InPlace => {
                out_init[in_place_at..in_place_at + in_len].copy_from_slice(&mine);
                let mut buf = dev.alloc_from(&out_init)?;
                comm.collective(&c, Input::InPlace, Output::Buffer(&mut buf))?;
                buf.to_vec()
            }
            Form::Windows => {
                // Odd offsets (a whole number of elements): unaligned for the vector path.
                let (so, ro) = (3 * size, 5 * size);
                let send = win(so + in_len * size)?;
                let recv = win(ro + out_len * size)?;
                send.copy_from_host(so, &mine)?;
                recv.copy_from_host(ro, &out_init)?;
                // Host writes wait for this process's kernels on the window (every rank's):
                // no rank launches before all have filled theirs.
                comm.barrier()?;
                comm.collective::<T>(&c, Input::Window(&send, so), Output::Window(&recv, ro))?;
                comm.stream().synchronize()?;
                mine.clear();
                let out = recv.read::<T>(ro, out_len);
                // Nobody drops (frees) a window a peer's kernel may still read.
                comm.barrier()?;
                out
            }
            Form::WindowInPlace => {
                out_init[in_place_at..in_place_at + in_len].copy_from_slice(&mine);
                let buf = win(out_len * size)?;
                buf.copy_from_host(0, &out_init)?;
                comm.barrier()?;
                comm.collective::<T>(&c, Input::InPlace, Output::Window(&buf, 0))?;
                comm.stream().synchronize()?;
                let out = buf.read::<T>(0, out_len);
                comm.barrier()?;
                out
            }
        }
    })?;
    for (me, got) in outs.iter().enumerate() {
        let want = expected(me);
        let untouched = || {
            let mut v = vec![sentinel; out_len];
            if matches!(form, Form::InPlace | Form::WindowInPlace) {
                v[..in_len].copy_from_slice(&(0..in_len).map(|i| input::<T>(me, i)).collect::<Vec<T>>());
            }
            v
        };
        let want = want.unwrap_or_else(untouched);
        if let Some(i) = (0..out_len).find(|&i| got[i] != want[i]) {
            return check(false, || {
                format!(
                    "{c:?} of {:?} on {n} ranks ({form:?}): rank {me} element {i} is {:?}, expected {:?}",
                    T::DTYPE,
                    got[i],
                    want[i]
                )
            });
        }
    }
    Ok(())
}

/// Every form.
const ALL_FORMS: [Form; 4] = [Form::Buffers, Form::InPlace, Form::Windows, Form::WindowInPlace];

fn forms_of<T: Val>(comms: &[Communicator], c: Collective, forms: &[Form]) -> ferrolink::Result<()> {
    for &form in forms {
        if matches!(form, Form::InPlace | Form::WindowInPlace)
            && matches!(c.kind, CollKind::ReduceScatter | CollKind::AllToAll)
        {
            continue;
        }
        run_case::<T>(comms, c, form)?;
    }
    Ok(())
}

/// Every reduction and both all-reduce algorithms for element type `T`.
fn reductions<T: Val>(comms: &[Communicator], sizes: &[usize]) -> ferrolink::Result<()> {
    reductions_in::<T>(comms, sizes, &ALL_FORMS)
}

fn reductions_in<T: Val>(comms: &[Communicator], sizes: &[usize], forms: &[Form]) -> ferrolink::Result<()> {
    let all_forms = |comms: &[Communicator], c: Collective| forms_of::<T>(comms, c, forms);
    for &count in sizes {
        for op in ReduceOp::ALL {
            // Small one-shot calls alternate between the protocols (the tuner would pick LL
            // for all of them; `ll_protocol_every_collective` covers LL throughout).
            let proto = Some(alternate_proto(count + op as usize));
            for a in [algo::ONE_SHOT, algo::TWO_SHOT] {
                let c = Collective { op, algo: Some(a), proto, ..Collective::new(CollKind::AllReduce, count) };
                all_forms(comms, c)?;
            }
            // One-shot forced: across domains the tuner would pick the hierarchical
            // algorithm, which has its own test.
            let rs =
                Collective { op, algo: Some(algo::ONE_SHOT), proto, ..Collective::new(CollKind::ReduceScatter, count) };
            all_forms(comms, rs)?;
            let root = comms.len() - 1;
            all_forms(comms, Collective { op, root, proto, ..Collective::new(CollKind::Reduce, count) })?;
        }
    }
    Ok(())
}

/// The simple protocol or LL, by the parity of `salt`.
fn alternate_proto(salt: usize) -> u32 {
    if salt.is_multiple_of(2) { proto::SIMPLE } else { proto::LL }
}

/// The data-movement collectives for element type `T`.
fn movements<T: Val>(comms: &[Communicator], sizes: &[usize]) -> ferrolink::Result<()> {
    movements_in::<T>(comms, sizes, &ALL_FORMS)
}

fn movements_in<T: Val>(comms: &[Communicator], sizes: &[usize], forms: &[Form]) -> ferrolink::Result<()> {
    for &count in sizes {
        for (i, kind) in [CollKind::AllGather, CollKind::AllToAll].into_iter().enumerate() {
            // One-shot forced (all-gather across domains: see `reductions_in`).
            let proto = Some(alternate_proto(count + i));
            let c = Collective { algo: Some(algo::ONE_SHOT), proto, ..Collective::new(kind, count) };
            forms_of::<T>(comms, c, forms)?;
        }
        for root in [0, comms.len() - 1] {
            let proto = Some(alternate_proto(count + root + 1));
            forms_of::<T>(comms, Collective { root, proto, ..Collective::new(CollKind::Broadcast, count) }, forms)?;
        }
    }
    Ok(())
}

fn comms_of(dev: &Device, n: usize) -> ferrolink::Result<Vec<Communicator>> {
    Communicator::init_all(&vec![dev.clone(); n])
}

/// `n` ranks on `dev` in LSA domains of `domain` ranks (checked).
fn comms_in_domains(dev: &Device, n: usize, domain: usize) -> ferrolink::Result<Vec<Communicator>> {
    let mut config = ferrolink::CommConfig::from_env(dev.backend()).unwrap();
    config.lsa = ferrolink::LsaMode::Size(domain);
    let comms = Communicator::init_all_with(&vec![dev.clone(); n], config)?;
    check(comms[0].lsa_size() == domain, || format!("LSA domains of {domain} asked, {} made", comms[0].lsa_size()))?;
    Ok(comms)
}

#[test]
fn every_reduction_of_every_type_on_two_and_three_ranks() {
    ferrolink::testing::for_each_backend("every_reduction_of_every_type_on_two_and_three_ranks", |dev| {
        let sizes = [0usize, 1, 37, 1029];
        for n in [2, 3] {
            let comms = comms_of(dev, n)?;
            reductions::<f32>(&comms, &sizes)?;
            reductions::<f16>(&comms, &sizes)?;
            reductions::<bf16>(&comms, &sizes)?;
            reductions::<f64>(&comms, &sizes)?;
            reductions::<i32>(&comms, &sizes)?;
            reductions::<i64>(&comms, &sizes)?;
            reductions::<u8>(&comms, &sizes)?;
            reductions::<u32>(&comms, &sizes)?;
        }
        Ok(())
    });
}

#[test]
fn every_movement_of_every_type_on_two_and_three_ranks() {
    ferrolink::testing::for_each_backend("every_movement_of_every_type_on_two_and_three_ranks", |dev| {
        let sizes = [0usize, 1, 37, 1029];
        for n in [2, 3] {
            let comms = comms_of(dev, n)?;
            movements::<f32>(&comms, &sizes)?;
            movements::<f16>(&comms, &sizes)?;
            movements::<bf16>(&comms, &sizes)?;
            movements::<f64>(&comms, &sizes)?;
            movements::<i32>(&comms, &sizes)?;
            movements::<i64>(&comms, &sizes)?;
            movements::<u8>(&comms, &sizes)?;
            movements::<u32>(&comms, &sizes)?;
        }
        Ok(())
    });
}

/// Across LSA domains (one-shot through GIN, `coll_gin`): 4 ranks in domains of 2 (direct
/// puts inside a domain, the GIN proxy across) and 3 ranks each its own domain; every
/// collective and reduction, in every form, at sizes 0, 1, odd and several CTAs' worth.
#[test]
fn every_collective_across_lsa_domains_through_gin() {
    ferrolink::testing::for_each_backend("every_collective_across_lsa_domains_through_gin", |dev| {
        for (n, domain) in domain_configs(&[(4, 2), (3, 1)]) {
            let comms = comms_in_domains(dev, n, domain)?;
            let sizes = [0usize, 1, 37, 1029];
            let start = std::time::Instant::now();
            // Progress (shown with --nocapture): on one GPU every put between LSA domains goes
            // through the GIN proxy, which makes this test the slowest of the file there.
            let done = |what: &str| eprintln!("{n} ranks, LSA {domain}: {what} passed at {:.1?}", start.elapsed());
            reductions::<f32>(&comms, &sizes)?;
            reductions::<bf16>(&comms, &sizes)?;
            reductions::<i64>(&comms, &sizes)?;
            reductions::<u8>(&comms, &sizes)?;
            done("reductions");
            movements::<f32>(&comms, &sizes)?;
            movements::<f16>(&comms, &sizes)?;
            movements::<u8>(&comms, &sizes)?;
            done("movements");
            let large = if dev.backend() == ferrolink::Backend::Cuda { 1 << 20 } else { 300_007 };
            let one_shot = |kind, count| Collective { algo: Some(algo::ONE_SHOT), ..Collective::new(kind, count) };
            run_case::<f32>(&comms, one_shot(CollKind::AllReduce, large), Form::Buffers)?;
            run_case::<f32>(&comms, one_shot(CollKind::AllToAll, large / n), Form::Windows)?;
            done("one-shot, large");
        }
        Ok(())
    });
}

/// What rank `me` of `n` holds after `c` run as a ring across LSA domains
/// ([`algo::RING`]): as [`expected_output`], but chunk `i` (all-reduce: the `i`-th of `n`
/// cut at 16-byte multiples; reduce-scatter: block `i`) reduced in the ring's order of the
/// ranks, `i + 1, i + 2, …, i` (modulo `n`).
fn expected_ring<T: Val>(c: &Collective, n: usize, me: usize) -> Option<Vec<T>> {
    let size = std::mem::size_of::<T>();
    let reduced = |chunk: usize, i: usize| {
        let order: Vec<T> = (1..=n).map(|k| input::<T>((chunk + k) % n, i)).collect();
        reduce_values(&order, c.op)
    };
    let chunk_of = |i: usize| {
        (0..n)
            .find(|&k| {
                let (first, len) = ferrolink_device::lsa::split_16(c.count * size, k, n);
                (first..first + len).contains(&(i * size))
            })
            .expect("every element lies in a chunk")
    };
    match c.kind {
        CollKind::AllReduce => Some((0..c.count).map(|i| reduced(chunk_of(i), i)).collect()),
        CollKind::ReduceScatter => Some((0..c.count).map(|i| reduced(me, me * c.count + i)).collect()),
        _ => expected_output::<T>(c, n, me, input::<T>),
    }
}

/// The ring across LSA domains (all-reduce, reduce-scatter, all-gather through GIN): 4 ranks
/// in domains of 2 (direct puts inside a domain, the GIN proxy across), 3 and 5 ranks each
/// its own domain; every reduction, in every form, at sizes 0, 1, odd, fewer elements than
/// ranks' chunks and several CTAs' worth, reduced in the ring's order.
#[test]
fn ring_collectives_across_lsa_domains() {
    ferrolink::testing::for_each_backend("ring_collectives_across_lsa_domains", |dev| {
        fn ring<T: Val>(comms: &[Communicator], sizes: &[usize]) -> ferrolink::Result<()> {
            let n = comms.len();
            for &count in sizes {
                for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::AllGather] {
                    let ops: &[ReduceOp] = if kind == CollKind::AllGather { &[ReduceOp::Sum] } else { &ReduceOp::ALL };
                    for &op in ops {
                        let c = Collective { op, algo: Some(algo::RING), ..Collective::new(kind, count) };
                        for form in ALL_FORMS {
                            if matches!(form, Form::InPlace | Form::WindowInPlace) && kind == CollKind::ReduceScatter {
                                continue;
                            }
                            run_case_with::<T>(comms, c, form, |me| expected_ring::<T>(&c, n, me))?;
                        }
                    }
                }
            }
            Ok(())
        }
        for (n, domain) in domain_configs(&[(4, 2), (3, 1), (5, 1)]) {
            let comms = comms_in_domains(dev, n, domain)?;
            let sizes = [0usize, 1, 3, 37, 1029];
            ring::<f32>(&comms, &sizes)?;
            ring::<bf16>(&comms, &sizes)?;
            ring::<i64>(&comms, &sizes)?;
            ring::<u8>(&comms, &sizes)?;
            let large = if dev.backend() == ferrolink::Backend::Cuda { 1 << 20 } else { 300_007 };
            for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::AllGather] {
                let count = if kind == CollKind::AllReduce { large } else { large / n };
                let c = Collective { op: ReduceOp::Avg, algo: Some(algo::RING), ..Collective::new(kind, count) };
                run_case_with::<f32>(&comms, c, Form::Buffers, |me| expected_ring::<f32>(&c, n, me))?;
            }
        }
        Ok(())
    });
}

/// What every rank holds after all-reduce `c` of `n` ranks run as a tree across LSA domains
/// ([`algo::TREE`]): rank `r`'s partial result is its children's (`2r + 1`, `2r + 2`), in
/// that order, then its own input; rank 0's is the result.
fn expected_tree<T: Val>(c: &Collective, n: usize) -> Vec<T> {
    fn partial<T: Val>(op: ReduceOp, n: usize, r: usize, i: usize) -> T {
        let apply = |a: T, b: T| match op {
            ReduceOp::Sum | ReduceOp::Avg => T::sum(a, b),
            ReduceOp::Prod => T::prod(a, b),
            ReduceOp::Min => T::min(a, b),
            ReduceOp::Max => T::max(a, b),
        };
        let own = if op == ReduceOp::Avg { input::<T>(r, i).avg_pre(n as u32) } else { input::<T>(r, i) };
        let children = [2 * r + 1, 2 * r + 2].into_iter().filter(|&k| k < n).map(|k| partial::<T>(op, n, k, i));
        children.reduce(apply).map_or(own, |acc| apply(acc, own))
    }
    (0..c.count)
        .map(|i| {
            let v = partial::<T>(c.op, n, 0, i);
            if c.op == ReduceOp::Avg { v.avg_post(n as u32) } else { v }
        })
        .collect()
}

/// The tree across LSA domains (all-reduce through GIN): 4 ranks in domains of 2, 2, 3 and 6
/// ranks each its own domain (a tree of three levels); every reduction, in every form, at
/// sizes 0, 1, odd and several CTAs' worth, reduced in the tree's order.
#[test]
fn tree_all_reduce_across_lsa_domains() {
    ferrolink::testing::for_each_backend("tree_all_reduce_across_lsa_domains", |dev| {
        fn tree<T: Val>(comms: &[Communicator], sizes: &[usize]) -> ferrolink::Result<()> {
            let n = comms.len();
            for &count in sizes {
                for op in ReduceOp::ALL {
                    let c = Collective { op, algo: Some(algo::TREE), ..Collective::new(CollKind::AllReduce, count) };
                    let want = expected_tree::<T>(&c, n);
                    for form in ALL_FORMS {
                        run_case_with::<T>(comms, c, form, |_| Some(want.clone()))?;
                    }
                }
            }
            Ok(())
        }
        for (n, domain) in domain_configs(&[(4, 2), (2, 1), (3, 1), (6, 1)]) {
            let comms = comms_in_domains(dev, n, domain)?;
            let sizes = [0usize, 1, 3, 37, 1029];
            tree::<f32>(&comms, &sizes)?;
            tree::<bf16>(&comms, &sizes)?;
            tree::<i64>(&comms, &sizes)?;
            tree::<u8>(&comms, &sizes)?;
            let large = if dev.backend() == ferrolink::Backend::Cuda { 1 << 20 } else { 300_007 };
            let c =
                Collective { op: ReduceOp::Avg, algo: Some(algo::TREE), ..Collective::new(CollKind::AllReduce, large) };
            let want = expected_tree::<f32>(&c, n);
            run_case_with::<f32>(&comms, c, Form::Buffers, |_| Some(want.clone()))?;
        }
        Ok(())
    });
}

/// What rank `me` of `n` holds after `c` run hierarchically in LSA domains of `domain`
/// ([`algo::HIERARCHICAL`]): as [`expected_output`], but each element reduced domain by
/// domain (each in LSA rank order), then across the domains in order.
fn expected_hierarchical<T: Val>(c: &Collective, n: usize, domain: usize, me: usize) -> Option<Vec<T>> {
    let apply = |a: T, b: T| match c.op {
        ReduceOp::Sum | ReduceOp::Avg => T::sum(a, b),
        ReduceOp::Prod => T::prod(a, b),
        ReduceOp::Min => T::min(a, b),
        ReduceOp::Max => T::max(a, b),
    };
    let pre = |x: T| if c.op == ReduceOp::Avg { x.avg_pre(n as u32) } else { x };
    let reduced = |i: usize| {
        let partial = |d: usize| (d * domain..(d + 1) * domain).map(|r| pre(input::<T>(r, i))).reduce(apply);
        let v = (0..n / domain).filter_map(partial).reduce(apply).expect("two domains or more");
        if c.op == ReduceOp::Avg { v.avg_post(n as u32) } else { v }
    };
    match c.kind {
        CollKind::AllReduce => Some((0..c.count).map(reduced).collect()),
        CollKind::ReduceScatter => Some((0..c.count).map(|i| reduced(me * c.count + i)).collect()),
        _ => expected_output::<T>(c, n, me, input::<T>),
    }
}

/// The hierarchical all-reduce, reduce-scatter and all-gather (LSA inside each domain, GIN
/// across): 4 ranks in domains of 2, 6 in domains of 2 (three domains) and of 3 (pieces of
/// unequal size); every reduction, in every form, at sizes 0, 1, odd and several CTAs'
/// worth, reduced in its order. Over domains of one rank it does not apply and gives way to
/// the tuner's pick (rank order).
#[test]
fn hierarchical_collectives_across_lsa_domains() {
    ferrolink::testing::for_each_backend("hierarchical_collectives_across_lsa_domains", |dev| {
        fn hierarchical<T: Val>(comms: &[Communicator], domain: usize, sizes: &[usize]) -> ferrolink::Result<()> {
            let n = comms.len();
            for &count in sizes {
                for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::AllGather] {
                    let ops: &[ReduceOp] = if kind == CollKind::AllGather { &[ReduceOp::Sum] } else { &ReduceOp::ALL };
                    for &op in ops {
                        let c = Collective { op, algo: Some(algo::HIERARCHICAL), ..Collective::new(kind, count) };
                        if domain == 1 {
                            forms_of::<T>(comms, c, &ALL_FORMS)?;
                            continue;
                        }
                        for form in ALL_FORMS {
                            if matches!(form, Form::InPlace | Form::WindowInPlace) && kind == CollKind::ReduceScatter {
                                continue;
                            }
                            run_case_with::<T>(comms, c, form, |me| expected_hierarchical::<T>(&c, n, domain, me))?;
                        }
                    }
                }
            }
            Ok(())
        }
        for (n, domain) in domain_configs(&[(4, 2), (6, 2), (6, 3), (3, 1)]) {
            let comms = comms_in_domains(dev, n, domain)?;
            let sizes = [0usize, 1, 3, 37, 1029];
            hierarchical::<f32>(&comms, domain, &sizes)?;
            hierarchical::<bf16>(&comms, domain, &sizes)?;
            hierarchical::<i64>(&comms, domain, &sizes)?;
            hierarchical::<u8>(&comms, domain, &sizes)?;
            if domain > 1 {
                let large = if dev.backend() == ferrolink::Backend::Cuda { 1 << 20 } else { 300_007 };
                for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::AllGather] {
                    let count = if kind == CollKind::AllReduce { large } else { large / n };
                    let c = Collective {
                        op: ReduceOp::Avg,
                        algo: Some(algo::HIERARCHICAL),
                        ..Collective::new(kind, count)
                    };
                    run_case_with::<f32>(&comms, c, Form::Buffers, |me| {
                        expected_hierarchical::<f32>(&c, n, domain, me)
                    })?;
                }
            }
        }
        Ok(())
    });
}

#[test]
fn large_all_reduce_both_algorithms() {
    ferrolink::testing::for_each_backend("large_all_reduce_both_algorithms", |dev| {
        let count = if dev.backend() == ferrolink::Backend::Cuda { 3 << 20 } else { 300_007 };
        let comms = comms_of(dev, 4)?;
        for a in [algo::ONE_SHOT, algo::TWO_SHOT] {
            // Every form: in place, each CTA stages the bytes it later overwrites (many CTAs
            // at this size, so a cut that differed between staging and writing would show).
            for form in ALL_FORMS {
                let c = Collective { algo: Some(a), ..Collective::new(CollKind::AllReduce, count) };
                run_case::<f32>(&comms, c, form)?;
            }
        }
        for form in [Form::Buffers, Form::InPlace, Form::WindowInPlace] {
            run_case::<bf16>(&comms, Collective::new(CollKind::AllGather, count / 4), form)?;
        }
        Ok(())
    });
}

#[test]
fn nan_follows_nccl() {
    ferrolink::testing::for_each_backend("nan_follows_nccl", |dev| {
        let comms = comms_of(dev, 2)?;
        let got = ferrolink::run_ranks(&comms, |c| {
            // Rank 0: [NaN, NaN, 1], rank 1: [2, NaN, NaN].
            let v = if c.rank() == 0 { [f32::NAN, f32::NAN, 1.0] } else { [2.0, f32::NAN, f32::NAN] };
            let send = c.device().alloc_from(&v)?;
            let mut out = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                let mut recv = c.device().alloc::<f32>(3)?;
                c.all_reduce(&send, &mut recv, op)?;
                out.push(recv.to_vec()?);
            }
            Ok(out)
        })?;
        let [sum, min, max] = [&got[0][0], &got[0][1], &got[0][2]];
        check(sum.iter().all(|x| x.is_nan()), || format!("sum with a NaN: {sum:?}, all NaN expected"))?;
        // As NCCL (fminf / fmaxf): a NaN beside a number gives the number.
        check(min[0] == 2.0 && min[1].is_nan() && min[2] == 1.0, || format!("min: {min:?}"))?;
        check(max[0] == 2.0 && max[1].is_nan() && max[2] == 1.0, || format!("max: {max:?}"))
    });
}

#[test]
fn bad_calls_are_clear_errors() {
    ferrolink::testing::for_each_backend("bad_calls_are_clear_errors", |dev| {
        let comms = comms_of(dev, 2)?;
        let errs = ferrolink::run_ranks(&comms, |c| {
            let send = c.device().alloc::<f32>(8)?;
            let mut short = c.device().alloc::<f32>(4)?;
            let short_err = c.all_reduce(&send, &mut short, ReduceOp::Sum).expect_err("a short output").to_string();
            let mut recv = c.device().alloc::<f32>(8)?;
            let root_err = c.broadcast(&send, &mut recv, 5).expect_err("root 5 of 2").to_string();
            let unknown = Collective { algo: Some(9), ..Collective::new(CollKind::AllReduce, 8) };
            let algo_err = c
                .collective(&unknown, Input::Buffer(&send), Output::Buffer(&mut recv))
                .expect_err("algorithm 9")
                .to_string();
            let unknown = Collective { proto: Some(7), ..Collective::new(CollKind::AllReduce, 8) };
            let proto_err = c
                .collective(&unknown, Input::Buffer(&send), Output::Buffer(&mut recv))
                .expect_err("protocol 7")
                .to_string();
            // Mismatched counts across ranks: caught by the call check.
            let count = if c.rank() == 0 { 8 } else { 4 };
            let send2 = c.device().alloc::<f32>(count)?;
            let mut recv2 = c.device().alloc::<f32>(count)?;
            let coll = Collective { check: Some(true), ..Collective::new(CollKind::AllReduce, count) };
            let mismatch = c
                .collective(&coll, Input::Buffer(&send2), Output::Buffer(&mut recv2))
                .expect_err("mismatched counts")
                .to_string();
            // The same window at different offsets: peers would read the wrong bytes.
            let win = c.register_window(c.mem_alloc(64)?)?;
            let off = if c.rank() == 0 { 0 } else { 16 };
            let coll = Collective { check: Some(true), ..Collective::new(CollKind::AllReduce, 4) };
            let mut recv3 = c.device().alloc::<f32>(4)?;
            let moved = c
                .collective::<f32>(&coll, Input::Window(&win, off), Output::Buffer(&mut recv3))
                .expect_err("mismatched input offsets")
                .to_string();
            Ok((short_err, root_err, algo_err, mismatch, moved, proto_err))
        })?;
        let (short, root, algo_err, mismatch, moved, proto_err) = &errs[0];
        check(proto_err.contains("unknown protocol 7") && proto_err.contains("simple, ll"), || {
            format!("unknown protocol: {proto_err}")
        })?;
        check(moved.contains("at offset 0") && moved.contains("at offset 16") && moved.contains("rank 1"), || {
            format!("mismatched input offsets: {moved}")
        })?;
        check(algo_err.contains("unknown algorithm 9") && algo_err.contains("tree 3"), || {
            format!("unknown algorithm: {algo_err}")
        })?;
        check(short.contains("output holds 4 elements, 8 needed"), || format!("short output: {short}"))?;
        check(root.contains("root 5 is not a rank of 2"), || format!("bad root: {root}"))?;
        check(mismatch.contains("mismatched collective calls") && mismatch.contains("rank 1"), || {
            format!("mismatch: {mismatch}")
        })
    });
}

/// CUDA graphs (issue 12): an all-reduce and an all-gather from device buffers captured once
/// on each rank's stream, then replayed 100 times with new inputs each time, every result
/// checked. (Point-to-point groups refuse capture: a clear error, checked too.)
#[test]
fn captured_collectives_replay_100_times_with_changing_inputs() {
    ferrolink::testing::for_each_backend("captured_collectives_replay", |dev| {
        let comms = comms_of(dev, 3)?;
        ferrolink::run_ranks(&comms, |c| {
            let (me, n) = (c.rank(), c.nranks());
            let count = 1000;
            let value = |r: usize, it: usize, i: usize| ((r * 31 + it * 7 + i) % 97) as f32;
            let dev = c.device();
            let mut send = dev.alloc::<f32>(count)?;
            let mut recv = dev.alloc::<f32>(count)?;
            let mut gathered = dev.alloc::<f32>(count * n)?;
            // The first calls make the collectives' resources (windows, device communicator).
            c.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
            c.all_gather(&send, &mut gathered)?;
            c.synchronize()?;
            c.barrier()?;
            let graph = c.stream().capture(|| {
                c.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
                c.all_gather(&send, &mut gathered)
            })?;
            for it in 0..100 {
                let mine: Vec<f32> = (0..count).map(|i| value(me, it, i)).collect();
                send.copy_from_host(&mine)?;
                graph.launch(c.stream())?;
                let sum = recv.to_vec()?;
                let all = gathered.to_vec()?;
                for i in 0..count {
                    let want: f32 = (0..n).map(|r| value(r, it, i)).sum();
                    check(sum[i] == want, || {
                        format!("rank {me}, replay {it}: sum[{i}] = {}, {want} expected", sum[i])
                    })?;
                }
                for r in 0..n {
                    for i in 0..count {
                        let got = all[r * count + i];
                        check(got == value(r, it, i), || {
                            format!("rank {me}, replay {it}: gathered[{r}][{i}] = {got}")
                        })?;
                    }
                }
            }
            drop(graph);
            c.enable_p2p(None)?;
            let err =
                c.stream().capture(|| c.send(&send, (me + 1) % n)).expect_err("a send cannot be captured").to_string();
            check(err.contains("cannot be captured"), || format!("capturing a send: {err}"))
        })
        .map(drop)
    });
}

/// Persistent mode (issue 12): every collective, several types and reductions, every form,
/// run by the GPU's persistent kernel (handed over by stream memory operations, no launch),
/// checked; then stopped (collectives launch again), and a communicator dropped in
/// persistent mode ends its kernel by itself.
#[test]
fn persistent_mode_runs_every_collective() {
    ferrolink::testing::for_each_backend("persistent_mode_runs_every_collective", |dev| {
        let sizes = [0usize, 1, 37, 1029];
        for n in [2, 3] {
            let comms = comms_of(dev, n)?;
            ferrolink::run_ranks(&comms, |c| c.start_persistent(Default::default()))?;
            check(comms.iter().all(Communicator::is_persistent), || "persistent mode is on".into())?;
            // Device buffers only: a window made while the persistent kernel runs could wait
            // for the device to idle (zero-copy windows are made before the start: the perf
            // tool's case).
            let forms = [Form::Buffers, Form::InPlace];
            reductions_in::<f32>(&comms, &sizes, &forms)?;
            reductions_in::<bf16>(&comms, &sizes, &forms)?;
            reductions_in::<i32>(&comms, &sizes, &forms)?;
            movements_in::<f16>(&comms, &sizes, &forms)?;
            movements_in::<u8>(&comms, &sizes, &forms)?;
            for a in [algo::ONE_SHOT, algo::TWO_SHOT] {
                let c = Collective { algo: Some(a), ..Collective::new(CollKind::AllReduce, 5000) };
                run_case::<f32>(&comms, c, Form::Buffers)?;
            }
            let again = ferrolink::run_ranks(&comms, |c| {
                Ok(c.start_persistent(Default::default()).expect_err("started").to_string())
            })?;
            check(again[0].contains("already started"), || format!("a second start: {}", again[0]))?;
            ferrolink::run_ranks(&comms, |c| c.stop_persistent())?;
            check(comms.iter().all(|c| !c.is_persistent()), || "persistent mode is off".into())?;
            reductions::<f32>(&comms, &[37])?;
        }
        // Dropped in persistent mode, after a collective: the kernels end (no hang, no leak
        // of a running kernel: the device's streams finish).
        let comms = comms_of(dev, 2)?;
        ferrolink::run_ranks(&comms, |c| {
            c.start_persistent(ferrolink::coll::PersistentConfig { ctas: Some(2), ..Default::default() })
        })?;
        reductions_in::<f32>(&comms, &[100], &[Form::Buffers])?;
        drop(comms);
        Ok(())
    });
}

/// The device after `dev` on its backend, for tests of ranks on two devices; `None` (with a
/// line saying why the test `name` is skipped) when there is none.
fn second_device(dev: &Device, name: &str) -> Option<Device> {
    match Device::open_with(dev.backend(), 1) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("{name}: skipped on {}: no second device ({e})", dev.backend());
            None
        }
    }
}

/// Persistent mode with one rank per GPU (two emulated GPUs; on CUDA when a second GPU is
/// there): the rank's stream hands operations over without waiting for each (its waits trail
/// by `PIPELINE` operations), so consecutive collectives run back to back. Each all-reduce
/// here reads the previous one's output (zero copy, windows in turn), so the kernel must not
/// start one before the previous has ended; a host read, a staged call (a copy kernel on the
/// stream) and the stop each see every operation complete.
#[test]
fn a_rank_alone_on_its_gpu_hands_operations_over_without_waiting() {
    ferrolink::testing::for_each_backend("persistent_pipeline", |dev| {
        let Some(second) = second_device(dev, "persistent_pipeline") else { return Ok(()) };
        let comms = Communicator::init_all(&[dev.clone(), second])?;
        const COUNT: usize = 1000;
        const STEPS: usize = 20;
        let sums = ferrolink::run_ranks(&comms, |c| {
            let bytes = COUNT * std::mem::size_of::<i64>();
            let wins = [c.register_window(c.mem_alloc(bytes)?)?, c.register_window(c.mem_alloc(bytes)?)?];
            let start: Vec<i64> = (0..COUNT).map(|i| (i % 7) as i64 + c.rank() as i64).collect();
            wins[0].copy_from_host(0, &start)?;
            c.start_persistent(Default::default())?;
            let sum = Collective { check: Some(false), ..Collective::new(CollKind::AllReduce, COUNT) };
            for step in 0..STEPS {
                let (from, to) = (&wins[step % 2], &wins[(step + 1) % 2]);
                c.collective::<i64>(&sum, Input::Window(from, 0), Output::Window(to, 0))?;
            }
            let chained = wins[STEPS % 2].read::<i64>(0, COUNT)?;
            // A staged call: the copy kernel before it comes after every deferred operation.
            let send = c.device().alloc_from(&chained)?;
            let mut recv = c.device().alloc::<i64>(COUNT)?;
            c.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
            let staged = recv.to_vec()?;
            c.stop_persistent()?;
            Ok((chained, staged))
        })?;
        for (r, (chained, staged)) in sums.iter().enumerate() {
            for i in 0..COUNT {
                // Step 1 sums the two ranks' values; each later step doubles them.
                let first = 2 * (i % 7) as i64 + 1;
                let want = first << (STEPS - 1);
                check(chained[i] == want, || {
                    format!("rank {r}, element {i}: {} after {STEPS} steps, want {want}", chained[i])
                })?;
                check(staged[i] == 2 * want, || {
                    format!("rank {r}, element {i}: staged {} want {}", staged[i], 2 * want)
                })?;
            }
        }
        Ok(())
    });
}

/// Eight ranks on one GPU in one process: their collectives run as one kernel per call
/// (`coll_gpu_group`, launched by the last rank to call); every collective, both all-reduce
/// algorithms, every form; then in persistent mode (one kernel for the GPU's ranks).
#[test]
fn eight_ranks_on_one_gpu_share_a_launch() {
    ferrolink::testing::for_each_backend("eight_ranks_on_one_gpu_share_a_launch", |dev| {
        let comms = comms_of(dev, 8)?;
        let sizes = [1usize, 37, 1029];
        for &count in &sizes {
            for a in [algo::ONE_SHOT, algo::TWO_SHOT] {
                let c = Collective { algo: Some(a), ..Collective::new(CollKind::AllReduce, count) };
                forms_of::<f32>(&comms, c, &ALL_FORMS)?;
            }
            let c = Collective { op: ReduceOp::Max, ..Collective::new(CollKind::ReduceScatter, count) };
            forms_of::<bf16>(&comms, c, &[Form::Buffers, Form::Windows])?;
        }
        movements_in::<i32>(&comms, &[5], &ALL_FORMS)?;
        ferrolink::run_ranks(&comms, |c| {
            c.start_persistent(ferrolink::coll::PersistentConfig { ctas: Some(2), ..Default::default() })
        })?;
        reductions_in::<f32>(&comms, &[100], &[Form::Buffers, Form::InPlace])?;
        ferrolink::run_ranks(&comms, |c| c.stop_persistent())?;
        reductions_in::<i64>(&comms, &[7], &[Form::Buffers])?;
        Ok(())
    });
}

/// Persistent mode and abort: rank 0 calls an all-reduce that rank 1 (sharing its GPU) never
/// joins, so rank 0 waits on the host for it; aborting the communicator from another thread
/// ends that wait with the abort (no hang); stopping afterwards returns.
#[test]
fn an_abort_ends_a_call_waiting_for_the_other_ranks_of_its_gpu() {
    ferrolink::testing::for_each_backend("persistent_abort", |dev| {
        let comms = comms_of(dev, 2)?;
        ferrolink::run_ranks(&comms, |c| c.start_persistent(Default::default()))?;
        let send = dev.alloc_from(&[1.0f32; 64])?;
        let mut recv = dev.alloc::<f32>(64)?;
        let c0 = &comms[0];
        let single = Collective { check: Some(false), ..Collective::new(CollKind::AllReduce, 64) };
        let result = std::thread::scope(|s| {
            let waiter = s.spawn(|| c0.collective::<f32>(&single, Input::Buffer(&send), Output::Buffer(&mut recv)));
            c0.abort();
            waiter.join().expect("the waiting rank does not panic")
        });
        let err = result.expect_err("the all-reduce cannot run without rank 1");
        check(err.to_string().contains("abort"), || format!("rank 0's call after the abort: {err}"))?;
        for c in &comms {
            // The kernel ends (with the abort, or cleanly): stopping returns.
            let _ = c.stop_persistent();
            check(!c.is_persistent(), || "persistent mode is off after stop".into())?;
        }
        Ok(())
    });
}

/// Ranks sharing a GPU meet on the host: rank 0's call returns before the shared launch is
/// queued (rank 1, the last to call, would queue it), and waiting for its stream waits for
/// rank 1; after the communicator's timeout that wait fails naming rank 1 and saying why (no
/// hang), and the launch never runs; after `recover` both ranks' calls meet again.
#[test]
fn a_rank_whose_gpu_partner_never_calls_times_out_naming_it() {
    ferrolink::testing::for_each_backend("shared_gpu_timeout", |dev| {
        let config = ferrolink::CommConfig {
            timeout: Some(std::time::Duration::from_millis(300)),
            ..ferrolink::CommConfig::from_env(dev.backend()).unwrap()
        };
        let comms = Communicator::init_all_with(&[dev.clone(), dev.clone()], config)?;
        let send = dev.alloc_from(&[1.0f32; 16])?;
        let mut recv = dev.alloc::<f32>(16)?;
        let single = Collective { check: Some(false), ..Collective::new(CollKind::AllReduce, 16) };
        // Both ranks make the collectives' resources (collective), then rank 0 calls alone.
        reductions_in::<f32>(&comms, &[16], &[Form::Buffers])?;
        comms[0].collective::<f32>(&single, Input::Buffer(&send), Output::Buffer(&mut recv))?;
        let err = comms[0].synchronize().expect_err("rank 1 never calls");
        let text = err.to_string();
        check(text.contains("rank 0 waits on the host for ranks [1]") && text.contains("thread of its own"), || {
            format!("the timeout: {text}")
        })?;
        check(comms[0].async_error().is_some(), || "the timeout aborted the communicator".into())?;
        // Rank 0 has made one call more than rank 1: recovering puts them back in step, and
        // their calls meet again (every result checked).
        ferrolink::recover(&comms)?;
        reductions_in::<f32>(&comms, &[16, 37], &[Form::Buffers, Form::InPlace])
    });
}

/// A host-launched collective of ranks sharing a GPU returns before the shared launch is
/// queued (the last rank to call queues it), so one thread may call each rank in turn once
/// the collectives' resources are made; what a call uses stays alive until the launch has
/// run even when dropped at once (each rank's input here, dropped before the next rank
/// calls), and every result is checked, for both protocols, round after round.
#[test]
fn ranks_sharing_a_gpu_called_in_turn_from_one_thread() {
    ferrolink::testing::for_each_backend("shared_gpu_in_turn", |dev| {
        let n = 3;
        let comms = comms_of(dev, n)?;
        for (count, proto) in [(1000usize, proto::LL), (20_000, proto::SIMPLE)] {
            // The resources first (a collective call that may allocate: every rank at once).
            reductions_in::<f32>(&comms, &[count], &[Form::Buffers])?;
            let call =
                Collective { check: Some(false), proto: Some(proto), ..Collective::new(CollKind::AllReduce, count) };
            let mut outs = (0..n).map(|_| dev.alloc::<f32>(count)).collect::<ferrolink::Result<Vec<_>>>()?;
            let input = |rank: usize, round: usize, i: usize| ((rank * 7 + round * 3 + i) % 1024) as f32;
            for round in 0..3 {
                for (rank, (c, out)) in comms.iter().zip(&mut outs).enumerate() {
                    let values: Vec<f32> = (0..count).map(|i| input(rank, round, i)).collect();
                    let send = dev.alloc_from(&values)?;
                    c.collective::<f32>(&call, Input::Buffer(&send), Output::Buffer(out))?;
                    drop(send);
                }
                for (rank, (c, out)) in comms.iter().zip(&outs).enumerate() {
                    c.synchronize()?;
                    let got = out.to_vec()?;
                    let bad = (0..count).find(|&i| got[i] != (0..n).map(|r| input(r, round, i)).sum::<f32>());
                    check(bad.is_none(), || {
                        format!("{proto:?} round {round}: rank {rank}'s element {bad:?} is {:?}", bad.map(|i| got[i]))
                    })?;
                }
            }
        }
        Ok(())
    });
}

/// A shared launch handed to the GPU group's launcher (or launched by the last rank) runs
/// even if the communicators are dropped as soon as the calls return: each rank's output
/// then waits for it (its pending completion) and holds the sum.
#[test]
fn shared_launches_run_after_the_communicators_are_dropped() {
    ferrolink::testing::for_each_backend("shared_launch_outlives_comms", |dev| {
        let n = 4;
        let count = 777;
        let comms = comms_of(dev, n)?;
        // The resources first (a collective call that may allocate: every rank at once).
        reductions_in::<f32>(&comms, &[count], &[Form::Buffers])?;
        let call = Collective { check: Some(false), ..Collective::new(CollKind::AllReduce, count) };
        let input = |rank: usize, i: usize| ((rank * 5 + i) % 512) as f32;
        let mut outs = (0..n).map(|_| dev.alloc::<f32>(count)).collect::<ferrolink::Result<Vec<_>>>()?;
        for (rank, (c, out)) in comms.iter().zip(&mut outs).enumerate() {
            let values: Vec<f32> = (0..count).map(|i| input(rank, i)).collect();
            c.collective::<f32>(&call, Input::Buffer(&dev.alloc_from(&values)?), Output::Buffer(out))?;
        }
        drop(comms);
        for (rank, out) in outs.iter().enumerate() {
            let got = out.to_vec()?;
            let bad = (0..count).find(|&i| got[i] != (0..n).map(|r| input(r, i)).sum::<f32>());
            check(bad.is_none(), || format!("rank {rank}'s element {bad:?} is {:?}", bad.map(|i| got[i])))?;
        }
        Ok(())
    });
}

/// Memory that several ranks sharing a GPU use, in calls that run ahead of each other, lives
/// until the last launch that uses it has run: rank 0 makes calls 1 and 2 (reading `shared` in
/// call 2), then rank 1 makes call 1 reading `shared` (noting call 1's launch after rank 0
/// noted call 2's), and `shared` is dropped before rank 1 makes call 2: call 2's launch has not
/// even been queued, so `shared` must still be waiting to be freed; then every result checked.
#[test]
fn memory_shared_by_ranks_in_turn_lives_until_the_last_launch_using_it() {
    ferrolink::testing::for_each_backend("shared_memory_in_turn", |dev| {
        let comms = comms_of(dev, 2)?;
        let count = 1000;
        reductions_in::<f32>(&comms, &[count], &[Form::Buffers])?;
        let call =
            Collective { check: Some(false), proto: Some(proto::LL), ..Collective::new(CollKind::AllReduce, count) };
        let values = |k: usize| (0..count).map(|i| ((i * 3 + k) % 512) as f32).collect::<Vec<f32>>();
        let (own0, own1) = (dev.alloc_from(&values(1))?, dev.alloc_from(&values(2))?);
        let shared = dev.alloc_from(&values(3))?;
        let mut outs = (0..4).map(|_| dev.alloc::<f32>(count)).collect::<ferrolink::Result<Vec<_>>>()?;
        let [o01, o02, o11, o12] = &mut outs[..] else { unreachable!() };
        comms[0].collective::<f32>(&call, Input::Buffer(&own0), Output::Buffer(o01))?;
        comms[0].collective::<f32>(&call, Input::Buffer(&shared), Output::Buffer(o02))?;
        comms[1].collective::<f32>(&call, Input::Buffer(&shared), Output::Buffer(o11))?;
        drop(shared);
        check(ferrolink::runtime::pending_retirements() >= 1, || {
            "the shared input was freed before call 2's launch (not yet queued) ran".into()
        })?;
        comms[1].collective::<f32>(&call, Input::Buffer(&own1), Output::Buffer(o12))?;
        for c in &comms {
            c.synchronize()?;
        }
        // Call 1: rank 0's own input and the shared one; call 2: the shared one and rank 1's.
        let sum = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<f32>>();
        let (first, second) = (sum(&values(1), &values(3)), sum(&values(3), &values(2)));
        for (name, out, want) in [
            ("o01", &outs[0], &first),
            ("o11", &outs[2], &first),
            ("o02", &outs[1], &second),
            ("o12", &outs[3], &second),
        ] {
            let got = out.to_vec()?;
            check(&got == want, || {
                format!("{name}: first difference at {:?}", got.iter().zip(want.iter()).position(|(a, b)| a != b))
            })?;
        }
        Ok(())
    });
}

/// The LL protocol (`proto::LL` forced): all-reduce, reduce-scatter, all-gather and
/// all-to-all with every reduction for several element types, from one element to the
/// protocol's largest call (several CTAs, a partial last unit, unaligned windows), in place
/// and out of place, back to back and with simple-protocol calls between them (both advance
/// the barrier epochs the LL flags come from); reduce and broadcast forced to LL, and calls
/// past the largest, where LL does not apply and the simple protocol runs; on three ranks of
/// one GPU (a shared launch) and on one rank (a launch of its own).
#[test]
fn ll_protocol_every_collective() {
    ferrolink::testing::for_each_backend("ll_protocol_every_collective", |dev| {
        let comms = comms_of(dev, 3)?;
        ll_cases::<f32>(&comms, &ALL_FORMS)?;
        ll_cases::<bf16>(&comms, &[Form::Buffers, Form::InPlace])?;
        ll_cases::<f64>(&comms, &[Form::Windows])?;
        ll_cases::<u8>(&comms, &[Form::Buffers])?;
        ll_cases::<i64>(&comms, &[Form::WindowInPlace])?;
        // A rank alone on its GPU launches its own LL kernel (`coll_ll`), the others share one.
        ll_cases::<f32>(&comms_of(dev, 1)?, &[Form::Buffers, Form::InPlace])
    });
}

fn ll_cases<T: Val>(comms: &[Communicator], forms: &[Form]) -> ferrolink::Result<()> {
    let size = std::mem::size_of::<T>();
    let largest = ll::MAX_BYTES / size;
    // One element; an odd count (a partial unit); just over one CTA's share; the largest.
    let sizes = [1, 3, ll::UNITS_PER_CTA * ll::UNIT_BYTES / size + 1, largest];
    let root = comms.len() - 1;
    for (i, &count) in sizes.iter().enumerate() {
        let ll = |kind, op, root| Collective { op, root, proto: Some(proto::LL), ..Collective::new(kind, count) };
        for op in ReduceOp::ALL {
            for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::Reduce] {
                forms_of::<T>(comms, ll(kind, op, root), forms)?;
            }
        }
        for kind in [CollKind::AllGather, CollKind::AllToAll, CollKind::Broadcast] {
            forms_of::<T>(comms, ll(kind, ReduceOp::Sum, root.min(1)), forms)?;
        }
        if i.is_multiple_of(2) {
            let simple = Collective { proto: Some(proto::SIMPLE), ..Collective::new(CollKind::AllReduce, count) };
            run_case::<T>(comms, simple, Form::Buffers)?;
        }
    }
    let past = Collective { proto: Some(proto::LL), ..Collective::new(CollKind::AllReduce, largest + 1) };
    run_case::<T>(comms, past, Form::Buffers)
}

/// An LL call that a peer never joins: the waiting rank's watchdog names the peer (its
/// arrival, made after its data, is missing), aborts, and after `recover` LL calls run
/// again (with a new, zeroed buffer: the flags restart). Ranks on two devices, so that each
/// launches its own kernel (ranks sharing a GPU would wait for each other on the host).
#[test]
fn an_ll_call_a_peer_never_joins_times_out_naming_it() {
    ferrolink::testing::for_each_backend("ll_timeout", |dev| {
        let Some(second) = second_device(dev, "ll_timeout") else { return Ok(()) };
        let config = ferrolink::CommConfig {
            timeout: Some(std::time::Duration::from_millis(500)),
            ..ferrolink::CommConfig::from_env(dev.backend()).unwrap()
        };
        let comms = Communicator::init_all_with(&[dev.clone(), second], config)?;
        let ll_sum = Collective { proto: Some(proto::LL), ..Collective::new(CollKind::AllReduce, 16) };
        // Both ranks make the LL buffer (collective), then rank 0 calls alone.
        run_case::<f32>(&comms, ll_sum, Form::Buffers)?;
        let send = comms[0].device().alloc_from(&[1.0f32; 16])?;
        let mut recv = comms[0].device().alloc::<f32>(16)?;
        let alone = Collective { check: Some(false), ..ll_sum };
        comms[0].collective::<f32>(&alone, Input::Buffer(&send), Output::Buffer(&mut recv))?;
        let text = match comms[0].synchronize() {
            Err(ferrolink::Error::WaitTimeout(m)) => m,
            other => return check(false, || format!("expected the watchdog's report, got {other:?}")),
        };
        check(text.contains("rank 0 CTA 0 waits at LSA barrier 0") && text.contains("rank 1 has not arrived"), || {
            format!("the timeout: {text}")
        })?;
        ferrolink::recover(&comms)?;
        reductions_in::<f32>(&comms, &[16, 37], &[Form::Buffers])?;
        run_case::<f32>(&comms, ll_sum, Form::InPlace)
    });
}

/// A CUDA graph holding an LL call, replayed after `recover` (which resets the barrier
/// epochs the flags come from): the LL buffer was zeroed, so a replay by one rank alone waits
/// for its peer's new lines (and times out naming it) instead of taking the lines that peer
/// wrote before the recovery with the same flag. Ranks on two devices (each launches its
/// own kernel).
#[test]
fn an_ll_graph_replayed_after_recover_takes_no_stale_lines() {
    ferrolink::testing::for_each_backend("ll_graph_after_recover", |dev| {
        let Some(second) = second_device(dev, "ll_graph_after_recover") else { return Ok(()) };
        let config = ferrolink::CommConfig {
            timeout: Some(std::time::Duration::from_millis(500)),
            ..ferrolink::CommConfig::from_env(dev.backend()).unwrap()
        };
        let comms = Communicator::init_all_with(&[dev.clone(), second], config)?;
        let ll_sum =
            Collective { proto: Some(proto::LL), check: Some(false), ..Collective::new(CollKind::AllReduce, 16) };
        let outcomes = ferrolink::run_ranks(&comms, |c| {
            let me = c.rank();
            let mut send = c.device().alloc_from(&[(me + 1) as f32; 16])?;
            let mut recv = c.device().alloc::<f32>(16)?;
            c.collective::<f32>(&ll_sum, Input::Buffer(&send), Output::Buffer(&mut recv))?;
            c.synchronize()?;
            let first = recv.to_vec()?;
            c.barrier()?;
            let graph =
                c.stream().capture(|| c.collective::<f32>(&ll_sum, Input::Buffer(&send), Output::Buffer(&mut recv)))?;
            // One rank aborts (the abort reaches every rank), then all recover: an abort
            // after a rank's reset would leave its flag raised.
            if me == 0 {
                c.abort();
            }
            c.barrier()?;
            c.recover()?;
            send.copy_from_host(&[(10 * (me + 1)) as f32; 16])?;
            c.synchronize()?;
            c.barrier()?;
            if me == 0 {
                return Ok((first, None));
            }
            graph.launch(c.stream())?;
            let replay = c.synchronize();
            Ok((first, Some((replay.map_err(|e| e.to_string()), recv.to_vec().unwrap_or_default()))))
        })?;
        check(outcomes.iter().all(|(first, _)| first == &vec![3.0f32; 16]), || "the first LL call".into())?;
        match &outcomes[1].1 {
            Some((Err(text), _)) => check(text.contains("rank 0 has not arrived"), || format!("the replay: {text}")),
            Some((Ok(()), got)) => check(false, || format!("rank 1 alone finished its replay with {:?}", &got[..1])),
            None => check(false, || "rank 1 replayed nothing".into()),
        }
    });
}
