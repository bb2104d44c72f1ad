"""Under ``torchrun --nproc-per-node 2``: the fused all-reduce + add + RMSNorm kernel between two
real GPUs, eagerly and replayed from a CUDA graph (the flags must come back to 0 every call),
over several slots and row counts, against the torch reference (the new residual bitwise) and
against NCCL's all-reduce followed by the norm kernel; then graph replays back to back with no
host sync, one rank delayed in turn. Prints ``OK`` on rank 0."""
import os

import torch
import torch.distributed as dist

from hybrid_engine.models.rmsnorm import fused_add_rmsnorm
from hybrid_engine.parallel.allreduce_norm import AllReduceNorm, allreduce_add_norm_ref

D, SLOTS, ROWS = 4096, 3, 16


def inputs(step: int, rows: int, dtype):
    """Every rank builds every rank's partial from the same seeds."""
    g = torch.Generator().manual_seed(1000 + step)
    parts = [(torch.randn(rows, D, generator=g) * 2).to(dtype).cuda() for _ in range(2)]
    res = (torch.randn(rows, D, generator=g) * 2).to(dtype).cuda()
    w = torch.randn(D, generator=g).to(dtype).cuda()
    return parts, res, w


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    for dtype in (torch.bfloat16, torch.float32):
        fused = AllReduceNorm(rank=rank, world=2, slots=SLOTS, hidden=D, dtype=dtype, device=torch.device("cuda", rank),
                              group_name=dist.group.WORLD.group_name, max_rows=ROWS)
        for step, rows in enumerate((1, 5, 16, 2, 1, 16, 7)):          # eager, every slot in turn
            parts, res, w = inputs(step, rows, dtype)
            out, r = fused(parts[rank], res, w, 1e-5, slot=step % SLOTS)
            want_out, want_r = allreduce_add_norm_ref(parts, res, w, 1e-5)
            assert torch.equal(r, want_r), f"{dtype} step {step}: new residual differs from the reference"
            torch.testing.assert_close(out, want_out, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
            summed = parts[rank].clone()
            dist.all_reduce(summed)
            nccl_out, nccl_r = fused_add_rmsnorm(summed, res, w, 1e-5)
            torch.testing.assert_close(r, nccl_r, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
            torch.testing.assert_close(out, nccl_out, atol=5e-2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2)
        # a graph of three calls (three slots), replayed with new inputs each time
        rows = 4
        static_x = torch.zeros(SLOTS, rows, D, dtype=dtype, device="cuda")
        static_res = torch.zeros(rows, D, dtype=dtype, device="cuda")
        static_w = torch.zeros(D, dtype=dtype, device="cuda")
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h = static_res
            for s in range(SLOTS):
                o, h = fused(static_x[s], h, static_w, 1e-5, slot=s)
        for rep in range(20):
            parts_by_slot = [inputs(100 + rep * SLOTS + s, rows, dtype)[0] for s in range(SLOTS)]
            _, res, w = inputs(500 + rep, rows, dtype)
            for s in range(SLOTS):
                static_x[s].copy_(parts_by_slot[s][rank])
            static_res.copy_(res)
            static_w.copy_(w)
            graph.replay()
            want = res
            for s in range(SLOTS):
                want_o, want = allreduce_add_norm_ref(parts_by_slot[s], want, w, 1e-5)
            assert torch.equal(h, want), f"{dtype} replay {rep}: residual after 3 slots differs"
            torch.testing.assert_close(o, want_o, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
        # back to back with no host sync, each rank delayed in turn (torch.cuda._sleep), so one rank
        # reaches a slot's next use while the other may still be behind: stale rows or flags left
        # raised would show as wrong sums here
        reps = 12
        sets = [([inputs(900 + rep * SLOTS + s, rows, dtype)[0] for s in range(SLOTS)],) + inputs(950 + rep, rows, dtype)[1:]
                for rep in range(reps)]
        got = []
        for rep, (parts_by_slot, res, w) in enumerate(sets):
            if (rep + rank) % 3 == 0:
                torch.cuda._sleep(2_000_000)          # ~1 ms on this rank only
            for s in range(SLOTS):
                static_x[s].copy_(parts_by_slot[s][rank])
            static_res.copy_(res)
            static_w.copy_(w)
            graph.replay()
            got.append(h.clone())
        torch.cuda.synchronize()
        for rep, (parts_by_slot, res, w) in enumerate(sets):
            want = res
            for s in range(SLOTS):
                _, want = allreduce_add_norm_ref(parts_by_slot[s], want, w, 1e-5)
            assert torch.equal(got[rep], want), f"{dtype} back-to-back replay {rep}: residual after 3 slots differs"
        assert fused.broken.item() == 0, "a wait gave up"
        flags = fused.flags.view(SLOTS, ROWS, 2)
        assert (flags == 0).all(), "flags left raised after the calls"
        dist.barrier()
    if rank == 0:
        print("OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
