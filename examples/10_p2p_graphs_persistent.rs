//! 10_p2p_graphs_persistent — point-to-point groups, all-to-all-v, CUDA graphs and persistent
//! mode (docs/collectives.md): every rank sends a message to the next rank and receives one
//! from the previous in one group; all-to-all-v with uneven blocks; an all-reduce captured once
//! and replayed with new inputs; and an all-reduce run by the persistent kernel. Every result is
//! checked. Alone it runs 4 virtual ranks on device 0; as a job it is one rank:
//! `ferrolink-run -n 2 target/release/examples/10_p2p_graphs_persistent`.

use ferrolink::coll::{PersistentConfig, ReduceOp};

fn fail(what: String) -> ferrolink::Error {
    ferrolink::Error::InvalidArgument(what)
}

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(4, |c| {
        let (me, n) = (c.rank(), c.nranks());
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let dev = c.device();
        c.enable_p2p(None)?; // collective, once
        // Memory first: making memory while peers' kernels run may wait for them.
        let count = 100_000;
        let msg = |from: usize| (0..count).map(|i| (from * 1_000_000 + i) as u32).collect::<Vec<_>>();
        let out = dev.alloc_from(&msg(me))?;
        let mut inbox = dev.alloc::<u32>(count)?;
        // all_to_allv: rank s sends s + d + 1 elements to rank d, all equal to 100 s + d.
        let send_counts: Vec<usize> = (0..n).map(|d| me + d + 1).collect();
        let recv_counts: Vec<usize> = (0..n).map(|s| s + me + 1).collect();
        let displs = |c: &[usize]| c.iter().scan(0, |at, &k| Some(std::mem::replace(at, *at + k))).collect::<Vec<_>>();
        let (send_displs, recv_displs) = (displs(&send_counts), displs(&recv_counts));
        let host_send: Vec<i32> = (0..n).flat_map(|d| vec![(100 * me + d) as i32; me + d + 1]).collect();
        let a2a_send = dev.alloc_from(&host_send)?;
        let mut a2a_recv = dev.alloc::<i32>(recv_counts.iter().sum())?;
        let mut x = dev.alloc::<f32>(1024)?;
        let mut sum = dev.alloc::<f32>(1024)?;
        c.barrier()?;

        // One group: a send to the next rank and a receive from the previous, together.
        let mut g = c.p2p_group();
        g.send(&out, next)?;
        g.recv(&mut inbox, prev)?;
        g.launch()?;
        if inbox.to_vec()? != msg(prev) {
            return Err(fail(format!("rank {me}: the message from rank {prev} differs")));
        }
        c.all_to_allv(&a2a_send, &send_counts, &send_displs, &mut a2a_recv, &recv_counts, &recv_displs)?;
        let got = a2a_recv.to_vec()?;
        let want: Vec<i32> = (0..n).flat_map(|s| vec![(100 * s + me) as i32; s + me + 1]).collect();
        if got != want {
            return Err(fail(format!("rank {me}: all_to_allv differs")));
        }

        // A graph: the all-reduce captured once (after a first call, which sets up), replayed.
        c.all_reduce(&x, &mut sum, ReduceOp::Sum)?;
        let graph = c.stream().capture(|| c.all_reduce(&x, &mut sum, ReduceOp::Sum))?;
        for step in 0..10 {
            x.copy_from_host(&vec![(me + step) as f32; 1024])?;
            graph.launch(c.stream())?;
            let want = (0..n).map(|r| (r + step) as f32).sum::<f32>();
            if sum.to_vec()?.iter().any(|&v| v != want) {
                return Err(fail(format!("rank {me}: replay {step} of the captured all_reduce differs")));
            }
        }
        drop(graph);
        c.synchronize()?;
        c.barrier()?;

        // Persistent mode: the same all-reduce, queued to the rank's persistent kernel.
        c.start_persistent(PersistentConfig::default())?;
        c.all_reduce(&x, &mut sum, ReduceOp::Sum)?;
        let persistent = sum.to_vec()?;
        c.stop_persistent()?;
        let want = (0..n).map(|r| (r + 9) as f32).sum::<f32>();
        if persistent.iter().any(|&v| v != want) {
            return Err(fail(format!("rank {me}: the persistent all_reduce differs")));
        }
        Ok(format!(
            "p2p/graphs/persistent: rank {me} of {n}: group send/recv, all_to_allv, 10 graph replays and a \
             persistent all_reduce verified"
        ))
    }))
}
