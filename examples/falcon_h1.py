"""Falcon-H1 (TII, model_type "falcon_h1") on hybrid-engine: a Mamba2 mixer and an attention in
parallel in every layer, then a SwiGLU MLP, with Falcon-H1's muP multipliers.

Nothing can be downloaded here, so this script builds a tiny Falcon-H1 checkpoint with RANDOM
weights (transformers' own FalconH1ForCausalLM, re-initialised with O(1)-scale values and saved
with save_pretrained), then generates from it: greedy, then with n-gram speculative decoding, which
gives the same tokens. The text is meaningless; the point is the code path. With a real
checkpoint (e.g. tiiuae/Falcon-H1-0.5B-Instruct) pass its folder or Hub id to ``LLM(model=...)``.

    python examples/falcon_h1.py [--out /tmp/tiny-falcon-h1]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _family_demo import run_family_demo  # noqa: E402

TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=16, mamba_chunk_size=16, mamba_rms_norm=False, embedding_multiplier=1.2,
            lm_head_multiplier=0.8, key_multiplier=0.9, attention_out_multiplier=0.9, ssm_out_multiplier=0.8,
            ssm_multipliers=[1.0, 1.0, 0.9, 1.1, 0.8], mlp_multipliers=[0.9, 1.1])


def main(argv=None) -> None:
    run_family_demo("falcon_h1", TINY, description=__doc__.splitlines()[0], out_prefix="tiny-falcon-h1-",
                    argv=argv)


if __name__ == "__main__":
    main()
