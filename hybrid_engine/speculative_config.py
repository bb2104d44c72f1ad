"""``SpeculativeConfig``: which drafter proposes tokens and how (frozen; validated in
``__post_init__``, every error a ``ValueError`` naming the field). The engine-side checks that need
the model or the device are ``EngineConfig``'s (``config.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._validate import check_int as _check_int

SPEC_METHODS = ("ngram", "draft_model", "mtp")
DRAFT_QUANTIZATIONS = ("fp8",)          # SpeculativeConfig.quantization
MAX_SPEC_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None              # draft model folder (method="draft_model" only)
    prompt_lookup_min: int = 1            # n-gram sizes tried by method="ngram"
    prompt_lookup_max: int = 4
    # Adaptive speculation (spec/adaptive.py): per request, the number of drafts shrinks while its
    # recent acceptance is low (down to none) and grows back when it rises; a step verifies as many
    # drafts as its most confident row wants (0: no drafts verified, though on the GPU such a step
    # still costs more than a step without speculation). On one device the engine also times its steps
    # per width, and a row rests when its expected accepted drafts cannot pay for the measured
    # extra cost of drafting. False: every decode row verifies num_speculative_tokens drafts every step.
    adaptive: bool = True
    # With adaptive: also weigh what a step of each width costs (measured on the host between the
    # reads of consecutive steps), choosing the width with the most expected tokens per second.
    # The widths then depend on timing (tokens do not); refused under tensor parallelism.
    adaptive_step_cost: bool = False
    # BENCHMARK ONLY: accept each draft with this probability instead of verifying it (outputs are
    # not the model's; the engine logs a warning). Measures speed vs acceptance on shapes that have
    # no trained weights. None: normal, lossless verification.
    forced_acceptance_rate: float | None = None
    # method="mtp": the MTP head scores only the first draft_vocab_size vocabulary rows (byte-level
    # BPE ids run roughly from frequent to rare), so each of the K draft tokens reads that share of
    # the lm_head instead of all of it (the 131072-row head is most of an 8B MTP proposal's bytes).
    # Drafts are then ids below it; verification is unchanged, so greedy outputs are identical and
    # sampled outputs keep their distribution (the draft probabilities are zero beyond it; a seeded
    # sampled request may still draw other tokens, as with any change of drafter). None: the whole
    # vocabulary.
    draft_vocab_size: int | None = None
    # The drafter's weights in FP8 (spec/drafters/draft_quant.py): "fp8" gives each linear layer
    # (per-channel scales) and each routed-expert set (a scale an expert) the drafter reads an FP8
    # copy that its calls of at most 8 rows read:
    # method="mtp" the MTP block and the lm_head rows its drafts score (the target's own lm_head
    # stays as it is for verification), method="draft_model" the draft model. Drafts only need to
    # be likely, not exact, so such a draft token reads about half the bytes; verification is
    # unchanged (greedy outputs identical, sampled ones keep their distribution). None: the
    # drafter runs in the engine's dtype (or as its checkpoint stores it).
    quantization: str | None = None

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"method must be one of {', '.join(map(repr, SPEC_METHODS))}, "
                             f"got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPEC_TOKENS)
        if self.method == "draft_model":
            if not self.model or not isinstance(self.model, (str, Path)):
                raise ValueError("model must name the draft model folder when method='draft_model', "
                                 f"got {self.model!r}")
        elif self.model is not None:
            raise ValueError(f"model is only used with method='draft_model', got model={self.model!r} "
                             f"with method={self.method!r}")
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min ({self.prompt_lookup_min}), "
                             f"got {self.prompt_lookup_max}")
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"adaptive must be a bool, got {type(self.adaptive).__name__}")
        if not isinstance(self.adaptive_step_cost, bool):
            raise TypeError(f"adaptive_step_cost must be a bool, got {type(self.adaptive_step_cost).__name__}")
        if self.adaptive_step_cost and not self.adaptive:
            raise ValueError("adaptive_step_cost=True needs adaptive=True (it chooses among the adaptive widths)")
        p = self.forced_acceptance_rate
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0):
            raise ValueError(f"forced_acceptance_rate must be None or a number in [0, 1], got {p!r}")
        if p is not None and self.adaptive_step_cost:
            raise ValueError("adaptive_step_cost=True cannot go with forced_acceptance_rate (forced acceptance "
                             "measures a fixed K)")
        if self.draft_vocab_size is not None:
            _check_int("draft_vocab_size", self.draft_vocab_size, 1)
            if self.method != "mtp":
                raise ValueError(f"draft_vocab_size is used by method='mtp' only, got method={self.method!r}")
        if self.quantization is not None:
            if self.quantization not in DRAFT_QUANTIZATIONS:
                raise ValueError(f"quantization must be None or one of {', '.join(map(repr, DRAFT_QUANTIZATIONS))}, "
                                 f"got {self.quantization!r}")
            if self.method == "ngram":
                raise ValueError("quantization applies to the drafter's weights (method 'mtp' or 'draft_model'); "
                                 "method='ngram' has none")
