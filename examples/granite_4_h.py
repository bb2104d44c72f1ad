"""IBM Granite-4.0-H (model_type "granitemoehybrid") on hybrid-engine: Mamba2 and attention layers,
each followed by a softmax-routed SwiGLU MoE plus a shared MLP, with Granite's multipliers.

Nothing can be downloaded here, so this script builds a tiny Granite-4.0-H checkpoint with RANDOM
weights (transformers' own GraniteMoeHybridForCausalLM, re-initialised with O(1)-scale values and
saved with save_pretrained), then generates from it: greedy, then with n-gram speculative decoding,
which gives the same tokens, and prints the per-layer expert load. The text is meaningless; the
point is the code path. With a real checkpoint (e.g. ibm-granite/granite-4.0-h-tiny) pass its
folder or Hub id to ``LLM(model=...)``.

    python examples/granite_4_h.py [--out /tmp/tiny-granite]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _family_demo import run_family_demo  # noqa: E402

TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=32, shared_intermediate_size=64, num_hidden_layers=4,
            layer_types=["mamba", "mamba", "mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
            mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16, num_local_experts=8,
            num_experts_per_tok=2, position_embedding_type=None, embedding_multiplier=1.5,
            residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=0.5, tie_word_embeddings=True)


def expert_load(llm) -> list[str]:
    """Tokens routed to each expert, per MoE layer, over the greedy run."""
    load = llm.stats().get("moe_expert_tokens", {})
    return [f"expert load {name}: {counts}" for name, counts in load.items()]


def main(argv=None) -> None:
    run_family_demo("granitemoehybrid", TINY, description=__doc__.splitlines()[0], out_prefix="tiny-granite-",
                    argv=argv, report=expert_load)


if __name__ == "__main__":
    main()
