//! Point-to-point (issue 12): groups of sends and receives (to the next rank, from the
//! previous one, to itself, several to one peer in order), single sends and receives, a
//! gather into slices of one buffer, and all-to-all-v with uneven and empty blocks — at sizes 0, 1, odd and many chunks, on every
//! backend; across LSA domains through the GIN proxy; and as jobs of one process per rank.

use ferrolink::{Backend, CommConfig, Communicator, Device, LsaMode};
use ferrolink_tests::check;
use ferrolink_tests::jobs::{child, fits, job_passes, scenario};

/// Word `i` of the message from `src` to `dst` (tag `tag`): no two messages alike.
fn word(src: usize, dst: usize, tag: usize, i: usize) -> u32 {
    (src as u32).wrapping_mul(0x9e37_79b9) ^ (dst as u32).wrapping_mul(0x85eb_ca6b) ^ ((tag as u32) << 24) ^ i as u32
}

fn message(src: usize, dst: usize, tag: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| word(src, dst, tag, i)).collect()
}

/// Message lengths (in u32 words): empty, one, odd, and many chunks of the backend's
/// default channels (16 KiB slots on the emulator, 256 KiB on CUDA).
fn sizes(dev: &Device) -> Vec<usize> {
    match dev.backend() {
        Backend::Cuda => vec![0, 1, 37, 70_001, 3 << 20],
        Backend::Cpu => vec![0, 1, 37, 70_001],
    }
}

/// One rank's group: for every size, a send to the next rank and a receive from the previous
/// one, a message to itself, and two messages to the next rank in order (they must match the
/// next rank's two receives in order). Checks every received word. Buffers are made before
/// the first group: making memory while peers' kernels run may wait for them, and they for
/// this rank.
fn ring_group(c: &Communicator) -> ferrolink::Result<()> {
    c.enable_p2p(None)?;
    let dev = c.device();
    let (me, n) = (c.rank(), c.nranks());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    struct Case {
        len: usize,
        out: Vec<ferrolink::DeviceBuffer<u32>>,
        to_self: ferrolink::DeviceBuffer<u32>,
        ins: Vec<ferrolink::DeviceBuffer<u32>>,
        from_self: ferrolink::DeviceBuffer<u32>,
    }
    let mut cases = Vec::new();
    for (tag, &len) in sizes(dev).iter().enumerate() {
        cases.push(Case {
            len,
            out: (0..4).map(|k| dev.alloc_from(&message(me, next, tag * 4 + k, len))).collect::<Result<_, _>>()?,
            to_self: dev.alloc_from(&message(me, me, tag, len))?,
            ins: (0..4).map(|_| dev.alloc::<u32>(len)).collect::<Result<_, _>>()?,
            from_self: dev.alloc::<u32>(len)?,
        });
    }
    c.barrier()?;
    for case in &mut cases {
        let mut g = c.p2p_group();
        // Receives before sends on even ranks, after on odd ones: the order inside a group
        // does not matter.
        if me % 2 == 0 {
            for b in case.ins.iter_mut() {
                g.recv(b, prev)?;
            }
            for b in &case.out {
                g.send(b, next)?;
            }
        } else {
            for b in &case.out {
                g.send(b, next)?;
            }
            for b in case.ins.iter_mut() {
                g.recv(b, prev)?;
            }
        }
        g.send(&case.to_self, me)?;
        g.recv(&mut case.from_self, me)?;
        g.launch()?;
    }
    for (tag, case) in cases.iter().enumerate() {
        let len = case.len;
        for (k, b) in case.ins.iter().enumerate() {
            let got = b.to_vec()?;
            let want = message(prev, me, tag * 4 + k, len);
            check(got == want, || {
                let at = ferrolink_tests::first_mismatch(&got, &want);
                format!("rank {me}: message {k} of {len} words from rank {prev}: first difference at {at:?}")
            })?;
        }
        check(case.from_self.to_vec()? == message(me, me, tag, len), || {
            format!("rank {me}: message to itself of {len}")
        })?;
    }
    quiesce(c)
}

/// Waits until every rank's kernels are done (its stream, then a host barrier): the next
/// case may make memory.
fn quiesce(c: &Communicator) -> ferrolink::Result<()> {
    c.synchronize()?;
    c.barrier()
}

/// Single sends and receives, each a group of one: rank 0 sends then receives, the others
/// receive then send (a ping-pong along the ring).
fn single_calls(c: &Communicator) -> ferrolink::Result<()> {
    c.enable_p2p(None)?;
    let dev = c.device();
    let (me, n) = (c.rank(), c.nranks());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let len = 50_000;
    let mut buf = dev.alloc::<u32>(len)?;
    let first = dev.alloc_from(&message(0, next, 99, len))?;
    c.barrier()?;
    if me == 0 {
        c.send(&first, next)?;
        c.recv(&mut buf, prev)?;
    } else {
        c.recv(&mut buf, prev)?;
        c.send(&buf, next)?;
    }
    // The message went round the ring unchanged.
    check(buf.to_vec()? == message(0, 1 % n, 99, len), || format!("rank {me}: the message that went round"))?;
    quiesce(c)
}

/// Block lengths for all-to-all-v: uneven, some empty (rank `s` to rank `d`).
fn block(s: usize, d: usize, scale: usize) -> usize {
    match (s * 5 + d * 3) % 4 {
        0 => 0,
        k => k * scale + s + 2 * d,
    }
}

/// All-to-all-v with uneven blocks at scattered displacements, checked on every rank.
fn all_to_allv(c: &Communicator, scale: usize) -> ferrolink::Result<()> {
    let dev = c.device();
    let (me, n) = (c.rank(), c.nranks());
    let send_counts: Vec<usize> = (0..n).map(|d| block(me, d, scale)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|s| block(s, me, scale)).collect();
    // Blocks in reverse rank order with a gap of 3 elements: displacements are arbitrary.
    let displs = |counts: &[usize]| {
        let mut d = vec![0; n];
        let mut at = 0;
        for p in (0..n).rev() {
            d[p] = at;
            at += counts[p] + 3;
        }
        (d, at)
    };
    let (send_displs, send_len) = displs(&send_counts);
    let (recv_displs, recv_len) = displs(&recv_counts);
    let mut host_send = vec![u32::MAX; send_len];
    for d in 0..n {
        host_send[send_displs[d]..][..send_counts[d]].copy_from_slice(&message(me, d, 7, send_counts[d]));
    }
    let send = dev.alloc_from(&host_send)?;
    let mut recv = dev.alloc_from(&vec![u32::MAX; recv_len])?;
    c.barrier()?;
    c.all_to_allv(&send, &send_counts, &send_displs, &mut recv, &recv_counts, &recv_displs)?;
    let got = recv.to_vec()?;
    let mut want = vec![u32::MAX; recv_len];
    for s in 0..n {
        want[recv_displs[s]..][..recv_counts[s]].copy_from_slice(&message(s, me, 7, recv_counts[s]));
    }
    check(got == want, || {
        format!("rank {me} of {n}: all_to_allv differs at {:?}", ferrolink_tests::first_mismatch(&got, &want))
    })?;
    quiesce(c)
}

/// A gather into one buffer (`recv_slices`): the root receives every other rank's message
/// into its own slice, out of rank order, plus an empty slice; slices of one buffer that
/// overlap are refused.
fn gather(c: &Communicator, len: usize) -> ferrolink::Result<()> {
    let (me, n) = (c.rank(), c.nranks());
    let root = n - 1;
    let mine = c.device().alloc_from(&message(me, root, 9, len))?;
    let mut all = c.device().alloc_from(&vec![u32::MAX; n * len])?;
    c.barrier()?;
    let mut g = c.p2p_group();
    if me == root {
        // Rank s lands at slice (s + 1) % n; the root's own slice stays as it was.
        let mut parts: Vec<(usize, usize, usize)> =
            (0..n).filter(|&s| s != root).map(|s| ((s + 1) % n * len, len, s)).rev().collect();
        parts.push((0, 0, 0)); // an empty receive matches rank 0's empty send below
        if len > 0 {
            let overlapping = [(0, len, 0), (len - 1, 1, 1)];
            let err =
                c.p2p_group().recv_slices(&mut all, &overlapping).err().map(|e| e.to_string()).unwrap_or_default();
            check(err.contains("overlaps"), || format!("overlapping slices accepted: {err:?}"))?;
        }
        g.recv_slices(&mut all, &parts)?;
    } else {
        g.send(&mine, root)?;
        if me == 0 {
            g.send_slice(&mine, 0, 0, root)?;
        }
    }
    g.launch()?;
    if me == root {
        let got = all.to_vec()?;
        let mut want = vec![u32::MAX; n * len];
        for s in (0..n).filter(|&s| s != root) {
            want[(s + 1) % n * len..][..len].copy_from_slice(&message(s, root, 9, len));
        }
        check(got == want, || {
            format!("gather of {len} words differs at {:?}", ferrolink_tests::first_mismatch(&got, &want))
        })?;
    }
    quiesce(c)
}

fn every_case(c: &Communicator) -> ferrolink::Result<()> {
    ring_group(c)?;
    single_calls(c)?;
    for len in [0, 1, 37, 5000] {
        gather(c, len)?;
    }
    let scale = if c.device().backend() == Backend::Cuda { 100_000 } else { 3000 };
    all_to_allv(c, 1)?;
    all_to_allv(c, scale)
}

#[test]
fn groups_single_calls_and_all_to_allv_on_two_three_and_four_ranks() {
    ferrolink::testing::for_each_backend("groups_single_calls_and_all_to_allv", |dev| {
        for n in [2, 3, 4] {
            let comms = Communicator::init_all(&vec![dev.clone(); n])?;
            ferrolink::run_ranks(&comms, every_case)?;
        }
        Ok(())
    });
}

/// LSA domains of two ranks: peers in other domains go through the GIN proxy.
#[test]
fn across_lsa_domains_through_the_gin_proxy() {
    ferrolink::testing::for_each_backend("p2p_across_lsa_domains", |dev| {
        let mut config = CommConfig::from_env(dev.backend()).unwrap();
        config.lsa = LsaMode::Size(2);
        let comms = Communicator::init_all_with(&vec![dev.clone(); 4], config)?;
        check(comms[0].lsa_size() == 2, || format!("LSA domains of 2 asked, {} made", comms[0].lsa_size()))?;
        ferrolink::run_ranks(&comms, every_case).map(drop)
    });
}

#[test]
fn bad_p2p_calls_are_clear_errors() {
    ferrolink::testing::for_each_backend("bad_p2p_calls_are_clear_errors", |dev| {
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        let errs = ferrolink::run_ranks(&comms, |c| {
            let buf = c.device().alloc::<u32>(4)?;
            let not_enabled = c.send(&buf, 1 - c.rank()).expect_err("before enable_p2p").to_string();
            c.enable_p2p(None)?;
            let bad_peer = c.send(&buf, 7).expect_err("peer 7 of 2").to_string();
            let other = ferrolink::coll::P2pConfig { channels: 3, slots: 2, chunk_bytes: 48 << 10 };
            let reconfig = c.enable_p2p(Some(other)).expect_err("another configuration").to_string();
            // Rank 0 expects 4 elements from rank 1, which sends it 2.
            let mut recv = c.device().alloc::<u32>(8)?;
            let send_counts = if c.rank() == 1 { [2, 2] } else { [4, 4] };
            let recv_counts = [4, 4];
            // (Checked in debug builds, or with FERROLINK_COLL_CHECK=1.)
            let checked = std::env::var("FERROLINK_COLL_CHECK").map_or(cfg!(debug_assertions), |v| v == "1");
            let mismatch = if checked {
                c.all_to_allv(&c.device().alloc::<u32>(8)?, &send_counts, &[0, 4], &mut recv, &recv_counts, &[0, 4])
                    .expect_err("mismatched counts")
                    .to_string()
            } else {
                "expects 4 elements from rank 1, which sends it 2 (not checked in this build)".to_string()
            };
            let overlap = c
                .all_to_allv(&c.device().alloc::<u32>(8)?, &[4, 4], &[0, 4], &mut recv, &[4, 4], &[0, 2])
                .expect_err("overlapping receive blocks")
                .to_string();
            Ok((not_enabled, bad_peer, reconfig, mismatch, overlap))
        })?;
        let (not_enabled, bad_peer, reconfig, mismatch, overlap) = &errs[0];
        check(not_enabled.contains("enable_p2p"), || format!("before enable_p2p: {not_enabled}"))?;
        check(bad_peer.contains("peer 7 is not a rank of 2"), || format!("bad peer: {bad_peer}"))?;
        check(reconfig.contains("already enabled"), || format!("reconfiguration: {reconfig}"))?;
        check(mismatch.contains("expects 4 elements from rank 1, which sends it 2"), || {
            format!("mismatch: {mismatch}")
        })?;
        check(overlap.contains("overlap"), || format!("overlap: {overlap}"))?;
        // Ranks asking for different channel shapes: an error naming the other rank's.
        let comms = Communicator::init_all(&vec![dev.clone(); 2])?;
        let errs = ferrolink::run_ranks(&comms, |c| {
            let slots = if c.rank() == 0 { 4 } else { 2 };
            let cfg = ferrolink::coll::P2pConfig { channels: 2, slots, chunk_bytes: 16 << 10 };
            Ok(c.enable_p2p(Some(cfg)).expect_err("different shapes").to_string())
        })?;
        check(errs[0].contains("rank 1 has channels 2, slots 2"), || format!("mismatched shapes: {}", errs[0]))
    });
}

/// One process per rank: every case, with peers in the process's LSA domain (memory of other
/// processes mapped through file descriptors) and with each process its own domain (the GIN
/// proxy between them).
#[test]
fn p2p_jobs_of_one_process_per_rank() {
    if child(|c| {
        let _ = scenario();
        every_case(c)
    }) {
        return;
    }
    for n in [2, 3] {
        if !fits(n) {
            continue;
        }
        job_passes("p2p_jobs_of_one_process_per_rank", "lsa", n);
    }
}
