"""Plot decode tokens/s vs batch size beside the bandwidth roofline from e2e JSON results.

    python benchmarks/plot_e2e.py benchmarks/results/2026-11-22-e2e-8b-h100.json [more.json ...] -o out.png
(needs matplotlib, which is not an engine dependency)
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, path in enumerate(args.results):
        r = json.loads(path.read_text())
        rows = r["decode"]
        b = [x["batch"] for x in rows]
        label = args.labels[i] if args.labels and i < len(args.labels) else path.stem
        ax.plot(b, [x["ours_tok_s"] for x in rows], "o-", label=f"hybrid-engine ({label})")
        hf = [(x["batch"], x["hf_tok_s"]) for x in rows if x.get("hf_tok_s")]
        if hf:
            ax.plot(*zip(*hf), "s--", label="transformers generate")
        if i == len(args.results) - 1:
            ax.plot(b, [x["roofline_tok_s"] for x in rows], "k:", label=f"roofline ({r['copy_bw_TBps']:.2f} TB/s copy)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Nemotron-H {r['shape']} shape, bf16, {r['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
