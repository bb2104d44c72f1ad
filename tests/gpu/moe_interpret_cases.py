"""MoE kernels on CPU under TRITON_INTERPRET=1 (set by the caller before this process starts).
Tiny float32 cases (bf16 tl.dot is wrong in the interpreter) and one float16 GEMV case.
Prints ``CASE <name> OK|FAIL ...`` per case (see tests/triton_interpret.py)."""
import os
import sys
import time
import traceback

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
torch.set_num_threads(1)

import moe_cases as mc  # noqa: E402
from hybrid_engine.models.triton_moe import route_triton, routed_experts_triton  # noqa: E402

F32, F16 = torch.float32, torch.float16


def grouped(*a, **kw):
    return routed_experts_triton(*a, force_grouped=True, **kw)


CASES = {
    "moe_route": lambda: mc.check_route(route_triton, "cpu", 6, 16, 3),
    "moe_route_groups": lambda: mc.check_route(route_triton, "cpu", 5, 16, 3, n_group=4, topk_group=2,
                                               seed=1),
    "moe_route_no_renorm": lambda: mc.check_route(route_triton, "cpu", 3, 12, 2, renorm=False, scale=1.0,
                                                  seed=2),
    "moe_decode": lambda: mc.check_experts(routed_experts_triton, "cpu", F32, 3, 8, 2, 24, 20),
    "moe_decode_add_f16": lambda: mc.check_experts(routed_experts_triton, "cpu", F16, 2, 8, 3, 16, 24,
                                                   add=True, seed=1),
    "moe_grouped_ragged": lambda: mc.check_experts(grouped, "cpu", F32, 11, 8, 2, 24, 20, load="ragged",
                                                   seed=2),
    "moe_grouped_one_expert_add": lambda: mc.check_experts(grouped, "cpu", F32, 9, 6, 2, 16, 24, load="one",
                                                           add=True, seed=3),
    "moe_grouped_latent_shape": lambda: mc.check_experts(grouped, "cpu", F32, 7, 8, 3, 12, 20, load="few",
                                                         seed=4),
}


def main(names):
    failed = 0
    for name in names or CASES:
        t0 = time.time()
        try:
            errs = CASES[name]()
            print(f"CASE {name} OK {errs} {time.time() - t0:.2f}s", flush=True)
        except Exception as exc:  # report and go on
            failed += 1
            msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
            print(f"CASE {name} FAIL {msg}", flush=True)
            traceback.print_exc(file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
