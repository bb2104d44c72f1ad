"""Random-weight model shapes of the speculative-decoding benchmarks (``spec_real --forced-shapes``,
``spec_step_cost --shape``, ``spec_rest --shape``): config.json folders of a target (with one MTP
layer) and a draft model; the weights come from ``common.random_weights``."""
from __future__ import annotations

from pathlib import Path


def shape_dirs(shape: str, tmp: Path) -> tuple[Path, Path | None]:
    """(target folder, draft folder) of a random-weight shape: config.json only (weights are random)."""
    from benchmarks.common import SHAPE_8B, SHAPE_SMALL, write_config
    if shape == "8b":
        target = dict(SHAPE_8B, num_nextn_predict_layers=1)
        vocab = 131072
    elif shape == "nano":
        from benchmarks.moe import SHAPE_NANO
        target = dict(SHAPE_NANO, num_nextn_predict_layers=1)
        vocab = SHAPE_NANO.get("vocab_size", 131072)
    elif shape == "bench-large":                # the trained benchmark target's shape (issue 15's step costs)
        from benchmarks.train.models import MTP_PATTERN, PRESETS
        p = PRESETS["bench-large"]
        vocab = p.vocab_size
        target = dict(p.target, vocab_size=vocab, num_nextn_predict_layers=1, mtp_pattern=MTP_PATTERN,
                      tie_word_embeddings=False)
        return (write_config(tmp / f"{shape}-target", target),
                write_config(tmp / f"{shape}-draft", dict(p.draft, vocab_size=vocab)))
    elif shape == "tiny":                       # CPU tests
        target = dict(pattern="M*-", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                      vocab_size=512, num_nextn_predict_layers=1)
        vocab = 512
    else:
        raise SystemExit(f"unknown shape {shape!r}: 8b, nano, bench-large or tiny")
    draft = dict(SHAPE_SMALL, vocab_size=vocab) if shape != "tiny" else dict(target, pattern="M-", num_nextn_predict_layers=0)
    return write_config(tmp / f"{shape}-target", target), write_config(tmp / f"{shape}-draft", draft)
