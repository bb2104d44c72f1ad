"""The serving benchmark's report (``benchmarks/serve.py``): per-(configuration, rate) statistics of
its request results, the markdown table and the latency-vs-throughput plot."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else float("nan")


def summarize(results: list, duration: float) -> dict:
    """``results``: serve.Result per request (failed ones included); ``duration``: seconds of the rate."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    # first to last token (not to the end of the stream: the finish chunk, [DONE] and the close
    # differ between the server and --direct)
    tpot = [(r.last - r.start - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_len for r in ok)
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        s[f"mean_{name}_ms"] = float(np.mean(xs)) * 1e3 if xs else float("nan")
        for q in (50, 90, 99):
            s[f"p{q}_{name}_ms"] = pct(xs, q)
    errors = [r.error for r in results if not r.ok]
    if errors:
        s["first_error"] = errors[0]
    return s


def table(rows: list[dict]) -> str:
    cols = ["config", "rate", "ok/fail", "req/s", "out tok/s", "accept", "TTFT mean/p50/p90/p99 ms",
            "TPOT mean/p50/p90/p99 ms", "ITL mean/p50/p90/p99 ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def acc(r):
        a = r.get("spec_acceptance_rate")
        return "-" if a is None else f"{a:.2f}"

    def q(r, n):
        return "/".join(f"{r[f'{k}_{n}_ms']:.1f}" for k in ("mean", "p50", "p90", "p99"))
    for r in rows:
        lines.append(f"| {r['config']} | {r['rate']} | {r['completed']}/{r['failed']} | "
                     f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {acc(r)} | "
                     f"{q(r, 'ttft')} | {q(r, 'tpot')} | {q(r, 'itl')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """Latency against achieved request throughput, one line per configuration: TTFT and TPOT,
    p50 and p99 (needs matplotlib; False without it). Also ``python benchmarks/serve.py --replot
    serve-bench.json``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for config in dict.fromkeys(r["config"] for r in rows):
            pts = sorted((r["request_throughput"], r[f"p50_{metric}_ms"], r[f"p99_{metric}_ms"])
                         for r in rows if r["config"] == config)
            x = [p[0] for p in pts]
            line, = ax.plot(x, [p[1] for p in pts], marker="o", label=f"{config} p50")
            ax.plot(x, [p[2] for p in pts], marker="x", linestyle="--", color=line.get_color(), label=f"{config} p99")
        ax.set_xlabel("request throughput (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
