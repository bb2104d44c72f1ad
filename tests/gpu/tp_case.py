"""One tensor-parallel case in its own process (a CUDA TP engine per process: parallel/group.py):
``python tp_case.py MODEL_DIR METHOD|none TP DTYPE [sync]`` prints the greedy tokens as JSON; with
``sync`` the decode steps launch under sync debug mode "error" on rank 0 (and on rank 1 through
HYBRID_ENGINE_TP_SYNC_DEBUG)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

NEW = 16


def main() -> None:
    model, method, tp, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    sync = len(sys.argv) > 5 and sys.argv[5] == "sync"
    prompts = json.loads(os.environ["TP_CASE_PROMPTS"])
    spec = None if method == "none" else SpeculativeConfig(method, 2)
    llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, device="cuda", max_num_seqs=8, max_num_batched_tokens=64,
              speculative_config=spec, kv_cache_memory_fraction=0.05)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if sync:
        from engine_steps import launch_steps_without_sync
        eng = llm.engine
        for p in prompts:
            eng.add_requests(eng.make_requests(p, SamplingParams(max_tokens=40, ignore_eos=True)))
        eng.step()                                    # the prefill step
        launch_steps_without_sync(eng, 12)            # decode steps
        while eng.has_work():
            eng.step()
        assert eng.tp is None or eng.tp.lost() is None
    fused = getattr(llm.engine.model.backbone.norm_f, "fused", None) is not None   # the fused all-reduce + norm
    llm.shutdown()
    print(f"FUSED {int(fused)}", flush=True)
    print("TOKENS " + json.dumps(tokens), flush=True)


if __name__ == "__main__":
    main()
