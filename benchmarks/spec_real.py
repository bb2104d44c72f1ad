"""Speculative decoding on real text: speed-up of each method over no speculation, in the same run.

Workloads, built from held-out text files (never trained on):
  (a) completion: the first ``--prompt-tokens`` tokens of a file, greedy continuation;
  (b) edit: a copy-heavy prompt (a piece of a file, a separator, then the start of the same piece
      again), so the continuation largely repeats code present in the prompt; greedy;
  (c) sample: the prompts of (a) sampled at temperature 0.7 (seeded).
Methods none / ngram / draft_model / mtp, K in ``--ks``, batches in ``--batches``. Per cell:
acceptance length (tokens per verify step), per-position acceptance (fraction of verify steps that
accepted draft j), tokens/s (median of ``--repeats`` timed runs after a warm-up) and the speed-up
over ``none`` at the same workload and batch, end to end and decode only (time per output token
after the first, TPOT: prefill is the same work with or without speculation, and at 128 new tokens
it is a large part of a batch-1 run). A batch-1 cell decodes ``--b1-prompts`` files one after the
other (a single file's text decides its acceptance). Greedy outputs must equal ``none``'s (asserted).
Each cell also lists its steps by plan and by drafts verified (width), with the median interval
from one step to the next (``common.StepTimeline``): where adaptive speculation rested or narrowed,
and what those steps cost. ``--rounds R`` repeats the whole sweep R times (engines rebuilt), takes
each speed-up within its round and reports the median over rounds beside each round's value.

Then (``--forced-shapes``) the same speed-up on large random-weight shapes (8B, the Nano-30B-A3B
MoE) at the acceptance each method reached, via forced acceptance
(``SpeculativeConfig.forced_acceptance_rate``: outputs there are NOT the model's).

    # trained run from benchmarks.train (target/, draft/, heldout_files.json); on one H100 the
    # training takes ~8.5 minutes, so the benchmark runs in the next call on the still-warm machine
    # (results/2026-11-27-train-copy-windows-420s-h100.md). Its learning-rate schedule follows the
    # elapsed time, so two time-budgeted runs train different models: to compare calls, train
    # with --max-steps N and a time budget it does not reach:
    python -m benchmarks.train --preset bench-large --device cuda --out /tmp/run --no-progress --eval-windows 4
    python -m benchmarks.spec_real --run /tmp/run --dtype float32 --ks 3 --batches 1,8 --out $OUT
    # anything else: the embedded default model and a folder of text files
    python -m benchmarks.spec_real --device cpu --files /usr/lib/python3.11/json --methods none,ngram \
        --ks 2 --batches 1 --max-tokens 16 --out /tmp/sr

Writes ``spec_real.json``, ``spec_real.md`` and (with matplotlib) ``spec_real.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import StepTimeline  # noqa: E402
from benchmarks.spec_shapes import shape_dirs  # noqa: E402
from benchmarks.spec_report import markdown, merge_rounds, plot  # noqa: E402
from benchmarks.spec_timing import free, time_cell  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

logger = logging.getLogger("spec_real")
# "<method>-general": the same engine with its fused verify-step graphs dropped (every verify step
# on the general path), to measure what the fused plan saves in the same run
METHODS = ("none", "ngram", "draft_model", "mtp", "ngram-general", "mtp-general")
WORKLOADS = ("completion", "edit", "sample")
EDIT_SEPARATOR = "\n\n# ---- the same code, edited ----\n\n"


# ---- inputs ---------------------------------------------------------------------------------------
def heldout_files(args) -> list[Path]:
    if args.run:
        return [Path(p) for p in json.loads((Path(args.run) / "heldout_files.json").read_text())]
    root = Path(args.files) if args.files else Path(json.__file__).resolve().parents[1]
    return sorted(p for p in root.rglob("*") if p.suffix in (".py", ".txt", ".rst", ".md") and p.is_file())


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_prompts(tok, files: list[Path], n: int, prompt_tokens: int, min_continuation: int):
    """-> {workload: [prompt token lists]} with n prompts each (files cycled when there are fewer)."""
    comp, edit = [], []
    for f in files:
        if len(comp) >= n:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) < prompt_tokens + min_continuation:
            continue
        comp.append(ids[:prompt_tokens])
        # edit: a piece of the file, the separator, then its first quarter again: continuing means copying
        piece = ids[:prompt_tokens]
        piece_text = tok.decode(piece)
        sep = tok.encode(EDIT_SEPARATOR, add_special_tokens=False)
        restart = piece[:max(1, len(piece) // 4)]
        edit.append(tok.encode(piece_text, add_special_tokens=False) + sep + restart)
    if not comp:
        raise SystemExit(f"no held-out file has >= {prompt_tokens + min_continuation} tokens")
    while len(comp) < n:                         # too few files: cycle (documented in the output)
        comp.append(comp[len(comp) % max(1, len(comp))])
        edit.append(edit[len(edit) % max(1, len(edit))])
    return {"completion": comp[:n], "edit": edit[:n], "sample": comp[:n]}


def params_for(workload: str, n: int, max_tokens: int) -> list[SamplingParams]:
    if workload == "sample":
        return [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=1000 + i, ignore_eos=True)
                for i in range(n)]
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True) for _ in range(n)]


def spec_config(method: str, k: int, args, draft_dir: str | None, forced: float | None = None):
    if method == "none":
        return None
    kw = dict(adaptive=args.adaptive != "off", adaptive_step_cost=args.adaptive == "cost",
              forced_acceptance_rate=forced)
    if method == "ngram":
        return SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=4, **kw)
    kw["quantization"] = args.draft_quantization
    if method == "draft_model":
        return SpeculativeConfig("draft_model", k, model=draft_dir, **kw)
    return SpeculativeConfig("mtp", k, draft_vocab_size=args.draft_vocab_size, **kw)


# ---- phase 1: the trained (or default) model on real text ------------------------------------------
def run_real(args, target: str, draft_dir: str | None) -> list[dict]:
    batches, ks = sorted(args.batches), args.ks
    methods = [m for m in args.methods if m in METHODS]
    # prefix caching off: each method replays the same prompts, which a cache would serve
    engine_kw = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(batches), seed=0,
                     enable_prefix_caching=False)
    if args.max_model_len:
        engine_kw["max_model_len"] = args.max_model_len
    tok = None
    rows, reference = [], {}
    # none first: its outputs are the reference of every greedy cell
    for method in ["none"] + [m for m in methods if m != "none"]:
        for k in ([0] if method == "none" else ks):
            llm = LLM(target, speculative_config=spec_config(method.removesuffix("-general"), k, args, draft_dir),
                      **engine_kw)
            if method.endswith("-general"):
                llm.engine.runner.drop_fused_plans(proposing_only=True)
            if args.adaptive == "untimed":                  # the acceptance rule alone (no cost gate)
                llm.engine.runner.policy.stop_timing()
            timeline = StepTimeline(llm.engine.runner)      # steps by plan and width, their intervals
            if tok is None:
                tok = llm.tokenizer
                prompts = build_prompts(tok, heldout_files(args), max(*batches, args.b1_prompts), args.prompt_tokens,
                                        args.max_tokens)
            for wl in args.workloads:
                for b in batches:
                    if b == 1:      # one file decides a batch-1 cell's acceptance: several, one at a time
                        groups = [([p], params_for(wl, 1, args.max_tokens)) for p in prompts[wl][:args.b1_prompts]]
                    else:
                        groups = [(prompts[wl][:b], params_for(wl, b, args.max_tokens))]
                    secs, outs, st = time_cell(llm, groups, args, timeline)
                    n_tok = sum(len(o) for o in outs)
                    row = dict(workload=wl, method=method, k=k, batch=b, prompts=sum(len(g[0]) for g in groups),
                               seconds=secs, tokens=n_tok, tok_s=n_tok / secs, **st)
                    if b == 1:          # what the model wrote (acceptance depends on it)
                        row["text"] = tok.decode(outs[0])[:300]
                    key = (wl, b)
                    if method == "none":
                        reference[key] = (outs, row["tok_s"], row["tpot_s"])
                        row["speedup"] = row["decode_speedup"] = 1.0
                    else:
                        ref_outs, ref_tps, ref_tpot = reference[key]
                        row["speedup"] = row["tok_s"] / ref_tps
                        # decode only (time per output token after the first): what speculation changes
                        row["decode_speedup"] = ref_tpot / row["tpot_s"] if ref_tpot and row["tpot_s"] else None
                        if wl != "sample":
                            same = outs == ref_outs
                            row["greedy_equal"] = same
                            # kept going on a mismatch so the table is still written; main() fails
                            # the run at the end. In bf16 on a GPU a verify step (1+K tokens per row)
                            # may round differently from a one-token step and flip a near-tie.
                            row["greedy_equal_requests"] = sum(o == r for o, r in zip(outs, ref_outs)) / len(outs)
                            row["greedy_common_prefix"] = sum(_common(o, r) / max(len(r), 1)
                                                              for o, r in zip(outs, ref_outs)) / len(outs)
                            if not same:
                                logger.error("%s K=%d %s batch %d: greedy output differs from none "
                                             "(%.0f%% of requests equal, common prefix %.0f%%)", method, k, wl, b,
                                             100 * row["greedy_equal_requests"], 100 * row["greedy_common_prefix"])
                        else:                  # n-gram sample-and-compare keeps the no-spec tokens too
                            row["sampled_equal"] = outs == ref_outs
                    rows.append(row)
                    logger.info("%-10s %-11s K=%d B=%-3d %8.1f tok/s  x%.2f  decode x%s  AL %.2f  steps by plan %s",
                                wl, method, k, b, row["tok_s"], row["speedup"],
                                "-" if row["decode_speedup"] is None else f"{row['decode_speedup']:.2f}",
                                row["acceptance_length"], row["steps_by_plan"])
            del llm
            free()
    return rows


# ---- phase 2: large random-weight shapes at the measured acceptance -----------------------------------
def geometric_rate(acceptance_length: float, k: int) -> float:
    """The p in [0, 1] for which forced acceptance (each of k drafts accepted with probability p
    while all before it were: expected acceptance length 1 + p + ... + p^k) reaches
    ``acceptance_length`` (bisection)."""
    target = min(max(acceptance_length, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def forced_rates(rows: list[dict], k: int) -> dict[str, float]:
    """Per method, the rate p of forced acceptance that reproduces the acceptance length the method
    reached: the best greedy workload at the smallest batch and this K (``geometric_rate``). The
    first-draft acceptance used before overstated it: MTP accepted the first draft at every step
    of the edit workload (p = 1.00, forced AL 3.94) but reached AL 3.02."""
    out = {}
    if not rows:
        return out
    b1 = min(x["batch"] for x in rows)
    for r in rows:
        if r["method"] != "none" and r["k"] == k and r["batch"] == b1 and r["workload"] != "sample":
            out[r["method"]] = max(out.get(r["method"], 0.0), geometric_rate(r["acceptance_length"], k))
    return out


def run_forced(args, rates: dict[str, float]) -> list[dict]:
    from benchmarks.common import random_weights
    rows = []
    k = args.forced_k
    with tempfile.TemporaryDirectory() as tmp, random_weights():
        for shape in args.forced_shapes:
            target, draft = shape_dirs(shape, Path(tmp))
            b1_stride = args.forced_max_tokens + k + 2           # batch-1 prompts' length step (below)
            engine_kw = dict(device=args.device, dtype=args.forced_dtype, max_num_seqs=max(args.forced_batches), seed=0,
                             max_model_len=(args.forced_prompt_tokens + (args.b1_prompts - 1) * b1_stride
                                            + args.forced_max_tokens + 64),
                             enable_prefix_caching=False)
            ref = {}
            for method in ["none"] + [m for m in args.forced_methods if m in rates]:
                p = rates.get(method)
                spec = spec_config(method, k, args, str(draft), forced=p) if method != "none" else None
                llm = LLM(str(target), speculative_config=spec, **engine_kw)
                timeline = StepTimeline(llm.engine.runner)
                vocab = llm.engine.cfg.model.vocab_size
                g = torch.Generator().manual_seed(0)
                for b in sorted(args.forced_batches):
                    if b == 1:
                        # the coins are keyed by (slot, position) and a batch-1 run reuses one slot:
                        # prompts whose generated positions do not overlap, one after the other (one
                        # prompt, or overlapping ranges, follow one coin path: MTP at AL 2.03 for an
                        # expected 2.55, 3 runs of one ~124-step path, H200). The expected AL ignores
                        # the max_tokens cut-off of each request's last step (batch-1 ALs 2-6% under it)
                        groups = [(torch.randint(3, vocab, (1, args.forced_prompt_tokens + i * b1_stride),
                                                 generator=g).tolist(),
                                   [SamplingParams(max_tokens=args.forced_max_tokens, ignore_eos=True)])
                                  for i in range(args.b1_prompts)]
                    else:
                        prompts = torch.randint(3, vocab, (b, args.forced_prompt_tokens), generator=g).tolist()
                        groups = [(prompts, [SamplingParams(max_tokens=args.forced_max_tokens, ignore_eos=True)] * b)]
                    secs, outs, st = time_cell(llm, groups, args, timeline)
                    n_tok = sum(len(o) for o in outs)
                    expected_al = None if p is None else sum(p ** j for j in range(k + 1))
                    row = dict(shape=shape, method=method, k=0 if method == "none" else k, batch=b,
                               forced_rate=p, expected_acceptance_length=expected_al, tok_s=n_tok / secs,
                               seconds=secs, **st)
                    if method == "none":
                        ref[b] = row["tok_s"]
                    row["speedup"] = row["tok_s"] / ref[b]
                    rows.append(row)
                    logger.info("%-5s %-11s p=%s B=%-3d %8.1f tok/s  x%.2f  AL %.2f (expected %s)", shape, method,
                                "-" if p is None else f"{p:.2f}", b, row["tok_s"], row["speedup"],
                                row["acceptance_length"], "-" if expected_al is None else f"{expected_al:.2f}")
                del llm
                free()
    return rows


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]          # noqa: E731
    words = lambda s: [x for x in s.split(",") if x]              # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a benchmarks.train run folder (target/, draft/, heldout_files.json)")
    ap.add_argument("--model", help="target folder (default: <run>/target, else the embedded default model)")
    ap.add_argument("--draft-model", help="draft folder (default: <run>/draft, else the target itself)")
    ap.add_argument("--files", help="folder of held-out text files when there is no --run (default: the stdlib)")
    ap.add_argument("--methods", type=words, default=list(METHODS), help="comma list of none,ngram,draft_model,mtp (and ngram-general, mtp-general: fused step graphs off)")
    ap.add_argument("--ks", type=ints, default=[1, 2, 3, 4, 5], help="comma list of K")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32], help="comma list of batch sizes")
    ap.add_argument("--b1-prompts", type=int, default=4,
                    help="prompts (files) a batch-1 cell decodes, one after the other")
    ap.add_argument("--workloads", type=words, default=list(WORKLOADS), help="comma list of completion,edit,sample")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="whole sweeps of the real model, every engine rebuilt; speed-ups within a round, "
                         "medians over rounds (spec_report.merge_rounds)")
    ap.add_argument("--adaptive", choices=("on", "off", "cost", "untimed"), default="on",
                    help="adaptive speculation (cost: also weighing measured step costs, adaptive_step_cost; "
                         "untimed: the acceptance rule alone, without the cost gate)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="MTP drafts over the first N vocabulary ids (SpeculativeConfig.draft_vocab_size)")
    ap.add_argument("--draft-quantization", choices=("fp8",), default=None,
                    help="MTP / draft-model weights in FP8 (SpeculativeConfig.quantization; any dtype)")
    ap.add_argument("--forced-shapes", type=words, default=[], help="comma list of 8b,nano,bench-large (empty: skip)")
    ap.add_argument("--forced-methods", type=words, default=["ngram", "mtp"])
    ap.add_argument("--forced-k", type=int, default=3)
    ap.add_argument("--forced-dtype", default="bfloat16",
                    help="dtype of the forced-acceptance shapes (the real phase's --dtype is often float32 for exact "
                         "greedy equality; the large shapes are served in bf16)")
    ap.add_argument("--forced-batches", type=ints, default=[1, 32])
    ap.add_argument("--forced-prompt-tokens", type=int, default=128)
    ap.add_argument("--forced-max-tokens", type=int, default=64)
    ap.add_argument("--forced-rates", default="",
                    help="method=p,... forced rates instead of the measured ones (e.g. ngram=0.6,mtp=0.7)")
    ap.add_argument("--forced-rates-from", default="",
                    help="a spec_real.json of an earlier run: its measured forced rates (before --forced-rates)")
    ap.add_argument("--skip-real", action="store_true",
                    help="only the forced phase (needs --forced-rates or --forced-rates-from)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    bad = [m for m in args.methods if m not in METHODS] + [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown method/workload {bad}: methods {METHODS}, workloads {WORKLOADS}")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = args.model or (str(Path(args.run) / "target") if args.run else None)
    if target is None:
        from hybrid_engine.default_model import default_model_dir
        target = str(default_model_dir())
    draft = args.draft_model or (str(Path(args.run) / "draft") if args.run else target)
    t0 = time.perf_counter()
    if args.skip_real and not (args.forced_rates or args.forced_rates_from):
        raise SystemExit("--skip-real needs --forced-rates or --forced-rates-from")
    real = [] if args.skip_real else merge_rounds([run_real(args, target, draft) for _ in range(args.rounds)])
    rates = forced_rates(real, args.forced_k)
    if args.forced_rates_from:
        earlier = json.loads(Path(args.forced_rates_from).read_text())["meta"]["forced_rates"]
        rates = {**earlier, **rates}
    for item in filter(None, args.forced_rates.split(",")):
        method, _, p = item.partition("=")
        rates[method] = float(p)
    forced = run_forced(args, rates) if args.forced_shapes and rates else []
    meta = dict(device=args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"),
                target=target, draft=draft, adaptive=args.adaptive, prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens, repeats=args.repeats, rounds=args.rounds, b1_prompts=args.b1_prompts,
                forced_rates=rates,
                forced=dict(k=args.forced_k, prompt_tokens=args.forced_prompt_tokens, max_tokens=args.forced_max_tokens,
                            dtype=args.forced_dtype, draft_vocab_size=args.draft_vocab_size,
                            draft_quantization=args.draft_quantization),
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                seconds=time.perf_counter() - t0)
    (out / "spec_real.json").write_text(json.dumps(dict(meta=meta, real=real, forced=forced), indent=2))
    md = markdown(real, forced, meta)
    (out / "spec_real.md").write_text(md)
    plotted = plot(real, out / "spec_real.png", WORKLOADS)
    print(md)
    print(f"wrote {out / 'spec_real.json'}, spec_real.md{', spec_real.png' if plotted else ''} "
          f"in {meta['seconds']:.0f}s")
    unequal = [r for r in real if r.get("greedy_equal") is False]
    if unequal:
        print(f"FAILED: {len(unequal)} greedy cells differ from none: "
              + ", ".join(f"{r['method']} K={r['k']} {r['workload']} B={r['batch']}" for r in unequal))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
