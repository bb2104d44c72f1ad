"""spec_real's report: its rounds merged into one row a cell, the markdown table of the cells and the
speed-up-vs-K plot."""
from __future__ import annotations

import statistics
from pathlib import Path

# per-cell numbers whose median over rounds the merged row shows (each round's list beside it)
_MEDIAN_OVER_ROUNDS = ("speedup", "decode_speedup", "tok_s", "tpot_s", "ttft_s", "seconds", "acceptance_length")


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Rows of several whole sweeps (``--rounds``: every engine rebuilt, each speed-up taken against
    its own round's none) -> one row a cell: the first round's row (per-position acceptance, steps,
    text), the median over rounds of ``_MEDIAN_OVER_ROUNDS`` with each round's values in
    ``<name>_by_round``, and ``greedy_equal`` only if every round's outputs equalled none's. Why:
    cells measured minutes apart drift (none's TPOT on one trained model read 0.347 and 0.379 ms in
    two runs, results/2026-11-29-f32-prefill-tf32x3-h200.md); a ratio inside a round and a median
    over rounds is what spec_rest does."""
    if len(rounds) == 1:
        return rounds[0]
    cell = lambda r: (r["workload"], r["method"], r["k"], r["batch"])     # noqa: E731
    order = [cell(r) for r in rounds[0]]
    if any([cell(r) for r in rows] != order for rows in rounds[1:]):
        raise ValueError("merge_rounds: every round must measure the same cells in the same order")
    merged = []
    for cells in zip(*rounds):
        row = dict(cells[0], rounds=len(cells))
        for key in _MEDIAN_OVER_ROUNDS:
            values = [c.get(key) for c in cells]
            row[f"{key}_by_round"] = values
            row[key] = None if None in values else statistics.median(values)
        if any("greedy_equal" in c for c in cells):
            row["greedy_equal"] = all(c.get("greedy_equal") is True for c in cells)
        merged.append(row)
    return merged


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(real: list[dict], forced: list[dict], meta: dict) -> str:
    lines = [f"# spec_real ({meta['device']}, {meta['target']})", "",
             f"adaptive={meta['adaptive']}, prompt {meta['prompt_tokens']} tokens, {meta['max_tokens']} new tokens, "
             f"median of {meta['repeats']} after a warm-up"
             + (f"; {meta['rounds']} rounds (every engine rebuilt; ratios within a round, medians over rounds, "
                "each round's in brackets; per-position acceptance and steps: round 1)" if meta.get("rounds", 1) > 1 else "")
             + f"; batch 1 decodes {meta.get('b1_prompts', 1)} prompts one "
             "after the other. Speed-up: tokens/s end to end (prefill included); decode speed-up: time per "
             "output token after the first (TPOT), against none's; TTFT: mean time to a request's first token", "",
             "| workload | method | K | batch | tok/s | speed-up | decode speed-up | TPOT ms | TTFT ms | AL | per-position "
             "acceptance | greedy == none | steps per run by plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in real:
        per = " ".join(f"{x:.2f}" for x in r["per_position"]) or "-"
        eq = {True: "yes", False: "NO"}.get(r.get("greedy_equal"), "-")
        plans = ", ".join(f"{name} {n:g}" for name, n in r.get("steps_by_plan", {}).items()) or "-"
        dec = "-" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x"
        up = f"{r['speedup']:.2f}x"
        if r.get("rounds", 1) > 1:          # each round's ratio beside the median
            up += " (" + ", ".join(f"{x:.2f}" for x in r["speedup_by_round"]) + ")"
            if r.get("decode_speedup") is not None:
                dec += " (" + ", ".join(f"{x:.2f}" for x in r["decode_speedup_by_round"]) + ")"
        tpot = "-" if r.get("tpot_s") is None else f"{r['tpot_s'] * 1e3:.3f}"
        ttft = "-" if r.get("ttft_s") is None else f"{r['ttft_s'] * 1e3:.2f}"
        lines.append(f"| {r['workload']} | {r['method']} | {r['k']} | {r['batch']} | {r['tok_s']:.1f} | "
                     f"{up} | {dec} | {tpot} | {ttft} | {r['acceptance_length']:.2f} | {per} | {eq} | {plans} |")
    timed = [r for r in real if r.get("steps_by_width")]
    if timed:
        lines += ["", "## Steps per run by plan and drafts verified (width), with the median step interval", "",
                  "| workload | method | K | batch | plan/width: steps per run (interval ms) |", "|---|---|---|---|---|"]
        for r in timed:
            cells = ", ".join(f"{key} {v['steps']:g} ({_ms(v['interval_ms'])})" for key, v in r["steps_by_width"].items())
            lines.append(f"| {r['workload']} | {r['method']} | {r['k']} | {r['batch']} | {cells} |")
    if forced:
        lines += ["", "## Forced acceptance on random-weight shapes (outputs are not the model's)", "",
                  "| shape | method | K | batch | forced p | tok/s | speed-up | AL (expected) "
                  "| steps per run by plan |", "|---|---|---|---|---|---|---|---|---|"]
        for r in forced:
            p = "-" if r["forced_rate"] is None else f"{r['forced_rate']:.2f}"
            exp = r.get("expected_acceptance_length")
            plans = ", ".join(f"{k} {v:g}" for k, v in (r.get("steps_by_plan") or {}).items())
            exp_s = "-" if exp is None else f"{exp:.2f}"
            lines.append(f"| {r['shape']} | {r['method']} | {r['k']} | {r['batch']} | {p} | {r['tok_s']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['acceptance_length']:.2f} ({exp_s}) | {plans} |")
    return "\n".join(lines) + "\n"


def plot(real: list[dict], path: Path, workload_order: tuple[str, ...]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = sorted({r["workload"] for r in real}, key=workload_order.index)
    if not workloads:                   # --skip-real: nothing to plot
        return False
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        for (m, b) in sorted({(r["method"], r["batch"]) for r in real if r["method"] != "none"}):
            pts = sorted((r["k"], r["speedup"]) for r in real if r["workload"] == wl and r["method"] == m
                         and r["batch"] == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{m} B={b}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(title=wl, xlabel="K", ylabel="speed-up over none")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
