//! 09_collectives — the host collectives (`ferrolink::coll`): every rank all-reduces a bf16
//! vector (sum), all-gathers its rank number and reduce-scatters, then checks each result.
//! Alone it runs 4 virtual ranks on device 0; as a job it is one rank:
//! `ferrolink-run -n 2 target/release/examples/09_collectives`.

use ferrolink::coll::{ReduceOp, bf16};

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(4, |c| {
        let (me, n) = (c.rank(), c.nranks());
        let dev = c.device();
        let count = 1 << 16;
        // all_reduce: rank r contributes r + 1 everywhere; the sum is n (n + 1) / 2.
        let send = dev.alloc_from(&vec![bf16::from_f32((me + 1) as f32); count])?;
        let mut sum = dev.alloc::<bf16>(count)?;
        c.all_reduce(&send, &mut sum, ReduceOp::Sum)?;
        // all_gather: every rank's number, in rank order.
        let mine = dev.alloc_from(&[me as i32])?;
        let mut all = dev.alloc::<i32>(n)?;
        c.all_gather(&mine, &mut all)?;
        // reduce_scatter: rank r gets the maximum of block r (every rank writes its number).
        let blocks = dev.alloc_from(&vec![me as f32; 8 * n])?;
        let mut part = dev.alloc::<f32>(8)?;
        c.reduce_scatter(&blocks, &mut part, ReduceOp::Max)?;
        let want = (n * (n + 1) / 2) as f32;
        let sums = sum.to_vec()?;
        let ok = sums.iter().all(|x| x.to_f32() == want)
            && all.to_vec()? == (0..n as i32).collect::<Vec<_>>()
            && part.to_vec()?.iter().all(|&x| x == (n - 1) as f32);
        if !ok {
            return Err(ferrolink::Error::InvalidArgument(format!("rank {me}: a collective gave a wrong result")));
        }
        Ok(format!(
            "collectives: rank {me} of {n}: all_reduce of {count} bf16 = {want}, all_gather, reduce_scatter (max): all correct"
        ))
    }))
}
