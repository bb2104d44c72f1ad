"""Bamba (IBM, model_type "bamba") on hybrid-engine: Mamba2 and RoPE attention layers, each
followed by a SwiGLU MLP.

Nothing can be downloaded here, so this script builds a tiny Bamba checkpoint with RANDOM weights
(transformers' own BambaForCausalLM, re-initialised with O(1)-scale values and saved with
save_pretrained), then generates from it: greedy, then with n-gram speculative decoding, which
gives the same tokens. The output is meaningless text-wise; the point is the code path. With a real
checkpoint (e.g. ibm-ai-platform/Bamba-9B-v2) pass its folder or Hub id to ``LLM(model=...)``.

    python examples/bamba.py [--out /tmp/tiny-bamba]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _family_demo import run_family_demo  # noqa: E402

TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[1, 3],
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
            mamba_chunk_size=16)


def main(argv=None) -> None:
    run_family_demo("bamba", TINY, description=__doc__.splitlines()[0], out_prefix="tiny-bamba-",
                    argv=argv)


if __name__ == "__main__":
    main()
