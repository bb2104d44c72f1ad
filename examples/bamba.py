"""Bamba (IBM, model_type "bamba") on hybrid-engine: Mamba2 and RoPE attention layers, each
followed by a SwiGLU MLP.

Nothing can be downloaded here, so this script builds a tiny Bamba checkpoint with RANDOM weights
(transformers' own BambaForCausalLM, re-initialised with O(1)-scale values and saved with
save_pretrained), then generates from it: greedy, then with n-gram speculative decoding, which
gives the same tokens. The output is meaningless text-wise; the point is the code path. With a real
checkpoint (e.g. ibm-ai-platform/Bamba-9B-v2) pass its folder or Hub id to ``LLM(model=...)``.

    python examples/bamba.py [--out /tmp/tiny-bamba]
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from hybrid_engine.models.synthetic import make_family_model  # noqa: E402

TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[1, 3],
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
            mamba_chunk_size=16)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the tiny checkpoint (default: a temporary folder)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="tiny-bamba-"))
    make_family_model(out, "bamba", seed=0, with_tokenizer=True, **TINY)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = "Hybrid models mix state spaces with attention"
    llm = LLM(str(out), dtype="float32", device="auto")
    plain = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    spec = LLM(str(out), dtype="float32", device="auto",
               speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    fast = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    print(f"checkpoint: {out}")
    print(f"greedy     : {plain.token_ids}")
    print(f"ngram spec : {fast.token_ids} (same tokens: {fast.token_ids == plain.token_ids})")


if __name__ == "__main__":
    main()
