#!/usr/bin/env python3
"""PyTorch baseline of `ferrolink-perf moe`: MoE dispatch and combine with
`torch.distributed.all_to_all_single`, one process per GPU.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benches/torch/moe_all_to_all.py \
        --tokens 4096 --hidden 7168 --experts 64 --top-k 8 -n 20 -w 5 [--json]

Every rank routes its tokens exactly as `ferrolink-perf moe` does (`moe_routing` and
`moe_token_value` in benches/src/perf.rs: the same splitmix64 generator and seed), so both move
the same bytes. Per iteration, timed with CUDA events on the current stream:

* layout: the expert ids sorted (stable, so entries keep (token, k) order per expert), rows per
  destination rank (bincount), the split sizes exchanged with `all_to_all_single`, and brought
  to the host (`all_to_all_single` takes them as lists);
* permute: the token rows gathered in that order (`index_select`, one row per entry);
* dispatch a2a: `all_to_all_single` with input and output split sizes;
* the experts are the identity (the received rows are their output);
* combine a2a: `all_to_all_single` back;
* un-permute and sum: the rows put back in entry order (`index_copy_`) and
  `out[t] = sum_k w[t, k] * row` in fp32, rounded to bf16;
* end to end: all of the above.

Rank 0 prints the mean microseconds of each step (and GB/s of the bytes sent to other ranks for
the two all-to-alls), and `wrong`: elements of the last output that differ from the same sum
computed directly from the tokens. Needs PyTorch with CUDA and NCCL; not run by CI.
"""

import argparse
import json
import os

MASK = (1 << 64) - 1
# benches/src/perf.rs: MOE_SEED.
MOE_SEED = 0x135EED


def splitmix64(z):
    """One splitmix64 step (benches/src/perf.rs: splitmix64)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def moe_routing(rank, tokens, experts, top_k):
    """Rank `rank`'s routing: `tokens * top_k` distinct-per-token experts and as many weights,
    as benches/src/perf.rs: moe_routing."""
    assert top_k <= experts
    s = splitmix64(MOE_SEED ^ (rank << 32))
    idx = []
    for t in range(tokens):
        z = splitmix64(s ^ 0xABC ^ (t << 20))
        chosen = []
        while len(chosen) < top_k:
            z = splitmix64(z)
            e = z % experts
            if e not in chosen:
                chosen.append(e)
        idx.extend(chosen)
    weights = [((splitmix64(s ^ 0x5EED ^ i) % 64) + 1) / 64.0 for i in range(tokens * top_k)]
    return idx, weights


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168, help="bf16 elements per token")
    p.add_argument("--experts", type=int, default=64, help="experts in all (a multiple of the ranks)")
    p.add_argument("--top-k", dest="top_k", type=int, default=8, help="experts per token")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations")
    p.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=5, help="warm-up iterations")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    return p.parse_args()


def main():
    args = parse_args()
    # NVLink multicast (NVLS) stays off on the GPU machine (its docs); the command sets it too.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    try:
        dist.init_process_group("nccl", device_id=dev)
    except TypeError:  # PyTorch before 2.3
        dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    T, H, E, K = args.tokens, args.hidden, args.experts, args.top_k
    if E % n != 0:
        raise SystemExit(f"{E} experts do not split over {n} ranks")
    per = E // n
    iters = max(args.iters, 1)

    idx_list, w_list = moe_routing(rank, T, E, K)
    remote_rows = sum(1 for e in idx_list if e // per != rank)
    remote_bytes = remote_rows * 2 * H
    idx = torch.tensor(idx_list, dtype=torch.int64, device=dev)  # [T * K], (token, k) order
    w = torch.tensor(w_list, dtype=torch.float32, device=dev).view(T, K)
    # benches/src/perf.rs: moe_token_value.
    t_ = torch.arange(T, dtype=torch.int64, device=dev).view(T, 1)
    i_ = torch.arange(H, dtype=torch.int64, device=dev).view(1, H)
    x = (((t_ * 131 + i_ * 7 + rank * 29) % 15).float() / 8.0 - 7.0 / 8.0).to(torch.bfloat16)
    expected = (x.float().unsqueeze(1) * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)

    def step(events):
        def mark(i):
            if events is not None:
                events[i].record()

        mark(0)
        # Layout.
        order = torch.argsort(idx, stable=True)  # entries by expert, so by destination rank
        send_counts = torch.bincount(idx, minlength=E).view(n, per).sum(1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_rows, recv_rows = send_counts.tolist(), recv_counts.tolist()
        mark(1)
        # Permute: one row per entry, grouped by destination.
        xs = x.index_select(0, order // K)
        mark(2)
        # Dispatch.
        recv = torch.empty(sum(recv_rows), H, dtype=x.dtype, device=dev)
        dist.all_to_all_single(recv, xs, output_split_sizes=recv_rows, input_split_sizes=send_rows)
        mark(3)
        # Identity experts: `recv` is their output. Combine.
        back = torch.empty_like(xs)
        dist.all_to_all_single(back, recv, output_split_sizes=send_rows, input_split_sizes=recv_rows)
        mark(4)
        # Un-permute and the weighted sum.
        rows = torch.empty_like(back)
        rows.index_copy_(0, order, back)
        out = (rows.view(T, K, H).float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)
        mark(5)
        return out

    for _ in range(args.warmup):
        step(None)
    torch.cuda.synchronize()
    dist.barrier()
    marks = []
    out = None
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        out = step(ev)
        marks.append(ev)
    torch.cuda.synchronize()
    wrong = int((out != expected).sum().item())

    def mean_us(a, b):
        return sum(ev[a].elapsed_time(ev[b]) for ev in marks) * 1e3 / iters

    steps = [
        ("layout", mean_us(0, 1), None),
        ("permute", mean_us(1, 2), None),
        ("dispatch_a2a", mean_us(2, 3), remote_bytes),
        ("combine_a2a", mean_us(3, 4), remote_bytes),
        ("unpermute_sum", mean_us(4, 5), None),
        ("end_to_end", mean_us(0, 5), 2 * remote_bytes),
    ]
    dist.barrier()
    if rank == 0:
        if args.json:
            rec = {"bench": "moe_torch", "nranks": n, "tokens": T, "hidden": H, "experts": E, "top_k": K,
                   "iters": iters, "warmup": args.warmup, "bytes_to_others": remote_bytes, "wrong": wrong}
            for name, us, b in steps:
                rec[name] = {"time_us": round(us, 2)}
                if b is not None:
                    rec[name]["bytes"] = b
                    rec[name]["gbps"] = round(b / (us * 1e3), 3)
            print(json.dumps(rec))
        else:
            print(f"# torch moe all_to_all_single: {n} ranks, {torch.cuda.get_device_name(dev)}, torch "
                  f"{torch.__version__}")
            print(f"# {T} tokens x {H} hidden bf16 per rank, top-{K} of {E} experts ({per} per rank), identity "
                  f"experts; rank 0, mean of {iters} iterations after {args.warmup} warm-up; CUDA events")
            print(f"# {'step':>13} {'time':>10} {'bytes to others':>16} {'GB/s':>9}")
            print(f"# {'':>13} {'(us)':>10} {'(B)':>16}")
            for name, us, b in steps:
                bb = "-" if b is None else str(b)
                g = "-" if b is None else f"{b / (us * 1e3):.2f}"
                print(f"  {name:>13} {us:>10.2f} {bb:>16} {g:>9}")
            print(f"# wrong: {wrong} (the last output against the weighted sum of the tokens)")
    dist.destroy_process_group()
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
