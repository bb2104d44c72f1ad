"""The demo the family examples share (bamba.py, falcon_h1.py, granite_4_h.py): build a tiny
checkpoint of one family with RANDOM weights (transformers' own model class, re-initialised with
O(1)-scale values and saved with save_pretrained), then generate from it greedily and with n-gram
speculative decoding, which gives the same tokens. Each example passes its family's model_type and
tiny config; ``report`` prints what else that family shows (e.g. Granite's expert load)."""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from hybrid_engine.models.synthetic import make_family_model  # noqa: E402

PROMPT = "Hybrid models mix state spaces with attention"


def run_family_demo(model_type: str, tiny_config: dict, *, description: str, out_prefix: str,
                    argv=None, report=None) -> None:
    """``report(llm)``: called after the greedy generation with the plain engine, for extra
    lines of output (None: nothing more)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", help="folder for the tiny checkpoint (default: a temporary folder)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix=out_prefix))
    make_family_model(out, model_type, seed=0, with_tokenizer=True, **tiny_config)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(str(out), dtype="float32", device="auto")
    plain = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    extra = report(llm) if report is not None else []
    spec = LLM(str(out), dtype="float32", device="auto",
               speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    fast = spec.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    print(f"checkpoint: {out}")
    print(f"greedy     : {plain.token_ids}")
    print(f"ngram spec : {fast.token_ids} (same tokens: {fast.token_ids == plain.token_ids})")
    for line in extra:
        print(line)
