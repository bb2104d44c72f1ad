"""spec_real's report: the markdown table of its cells and the speed-up-vs-K plot."""
from __future__ import annotations

from pathlib import Path


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(real: list[dict], forced: list[dict], meta: dict) -> str:
    lines = [f"# spec_real ({meta['device']}, {meta['target']})", "",
             f"adaptive={meta['adaptive']}, prompt {meta['prompt_tokens']} tokens, {meta['max_tokens']} new tokens, "
             f"median of {meta['repeats']} after a warm-up; batch 1 decodes {meta.get('b1_prompts', 1)} prompts one "
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
        tpot = "-" if r.get("tpot_s") is None else f"{r['tpot_s'] * 1e3:.3f}"
        ttft = "-" if r.get("ttft_s") is None else f"{r['ttft_s'] * 1e3:.2f}"
        lines.append(f"| {r['workload']} | {r['method']} | {r['k']} | {r['batch']} | {r['tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {dec} | {tpot} | {ttft} | {r['acceptance_length']:.2f} | {per} | {eq} | {plans} |")
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
