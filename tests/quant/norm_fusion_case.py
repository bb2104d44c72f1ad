"""Run in a subprocess under TRITON_INTERPRET=1 by test_fp8_norm_fusion.py: an FP8 model on the CPU
with the W8A8 path forced for bf16 steps of more than 8 rows (``fp8._path``; ``torch._scaled_mm``
runs on the CPU) and the Triton norm kernels on (the interpreter), so the block norms hand
``Fp8Rows`` to in_proj / up_proj / q, k, v. Prints one JSON line: the fused norm calls in a
generate with the fusion, in one with a forward pre-hook on every FP8 projection (which turns it
off), and whether the two gave the same tokens and logprobs."""
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hybrid_engine.models.layers as layers  # noqa: E402
import hybrid_engine.models.rmsnorm as rmsnorm  # noqa: E402
import hybrid_engine.quantization.fp8 as fp8  # noqa: E402
from hybrid_engine import LLM, SamplingParams  # noqa: E402
from hybrid_engine.models.synthetic import make_hf_model  # noqa: E402
from hybrid_engine.quantization.linear import Fp8Linear  # noqa: E402

real_path = fp8._path


def cuda_like_path(rows, K, N, dtype, device):
    if dtype == torch.bfloat16 and rows > fp8.MAX_SKINNY_ROWS and K % 16 == 0 and N % 16 == 0:
        return "w8a8"
    return real_path(rows, K, N, dtype, device)


fp8._path = cuda_like_path
logged = []
log_handler = logging.Handler()
log_handler.emit = lambda record: logged.append(record.getMessage())
logging.getLogger("hybrid_engine.quantization.fp8").addHandler(log_handler)
logging.getLogger("hybrid_engine.quantization.fp8").setLevel(logging.INFO)
layers.kernel_backend = rmsnorm.kernel_backend = lambda *a: "triton"
calls = []
real_norm = layers.add_rmsnorm_fp8
layers.add_rmsnorm_fp8 = lambda *a: calls.append(1) or real_norm(*a)

d = make_hf_model(Path(tempfile.mkdtemp()) / "m", pattern="M-M*-M-", seed=4, hidden_size=256,
                  intermediate_size=512, mamba_num_heads=16, mamba_head_dim=16)    # widths multiples of 16
# prefix caching off: a second run would hit the cache and take other paths on steps of <= 8 rows
llm = LLM(d, dtype="bfloat16", device="cpu", quantization="fp8", enforce_eager=True, max_num_seqs=4,
          max_num_batched_tokens=64, enable_prefix_caching=False)
prompts = [list(range(3, 3 + n)) for n in (70, 9, 130)]
sp = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)


def run():
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp, use_tqdm=False)]


fused = run()
fused_calls = len(calls)
for m in llm.engine.runner.model.modules():
    if isinstance(m, Fp8Linear):
        m.register_forward_pre_hook(lambda mod, args: None)
calls.clear()
plain = run()
print(json.dumps(dict(fused_calls=fused_calls, plain_calls=len(calls), equal=fused == plain,
                      logged=[m for m in logged if "W8A8 prefill" in m])))
