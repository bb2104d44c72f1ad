"""The training run: corpus -> tokenizer -> target (+MTP) and draft trained together -> saved
folders -> held-out losses by transformers and by our engine -> report and loss plot.

Determinism: the corpus, its split and the tokenizer depend only on the machine's files; the file
order, the training windows (one seeded CPU ``torch.Generator``) and the initial weights
(``torch.manual_seed(seed)`` before each model is built) depend only on ``--seed``. On CPU with
the same thread count a run with ``--max-steps`` and a time budget that does not bind is bitwise
reproducible. On CUDA the data and the initial weights are the same but the trained weights are
not bitwise: backward passes accumulate with atomics (embedding and MoE index_add / scatter
gradients) and TF32 matmuls, so losses agree to a few digits only. When ``--time-budget-s``
binds, the step count (and the learning-rate schedule, which follows the larger of step and
time progress) depends on the machine's speed.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .corpus import HELDOUT_FRAC, build_corpus
from .fast_scan import training_scan
from .evaluate import engine_losses, heldout_windows, hf_loss, training_losses
from .models import (Preset, TargetWithMTP, count_params, draft_loss, draft_model, hf_config_for,
                     mtp_tensors, save_hf, write_json)
from .tokenizer import encode_files, train_bpe

logger = logging.getLogger("benchmarks.train")


def _stream(token_lists, eos: int, order=None) -> torch.Tensor:
    order = range(len(token_lists)) if order is None else order
    flat: list[int] = []
    for i in order:
        flat.extend(token_lists[i])
        flat.append(eos)
    return torch.tensor(flat, dtype=torch.int64)


COPY_MIN_PIECE = 16        # shortest copied piece
COPY_EVAL_WINDOWS = 64     # held-out copy windows scored after training (seed 0: the same for every run)


def copy_windows(stream: torch.Tensor, starts: torch.Tensor, width: int, g: torch.Generator,
                 min_piece: int = COPY_MIN_PIECE) -> tuple[torch.Tensor, list[int]]:
    """[len(starts), width] training windows that repeat a piece of text, and each window's piece
    length L (its copy is the last L tokens): from each start, the stream's next ``width - L``
    tokens (a natural prefix, the piece, the text after it), then the piece again; L uniform in
    [min_piece, width // 2], the prefix's length uniform in [0, width - 2 L] (so the copy starts
    0 .. width - 2 L tokens after the piece ends), both drawn from ``g``. Predicting the second
    copy needs only the context: the in-context copying (induction) that speculation on
    copy-heavy prompts relies on, at the distances an edit prompt has (a piece, other text, the
    piece's start again)."""
    if width < 2 * min_piece:
        raise ValueError(f"copy windows need width >= {2 * min_piece}, got {width}")
    lengths = torch.randint(min_piece, width // 2 + 1, (len(starts),), generator=g).tolist()
    rows = []
    for s, n in zip(starts.tolist(), lengths):
        pre = int(torch.randint(0, width - 2 * n + 1, (1,), generator=g))
        natural = torch.arange(s, s + width - n)                     # prefix, piece, text after it
        rows.append(stream[torch.cat([natural, natural[pre:pre + n]])])     # ... then the piece again
    return torch.stack(rows), lengths


@torch.no_grad()
def heldout_copy_loss(target, stream: torch.Tensor, width: int, n: int, device, seed: int = 0) -> float:
    """The in-memory target's next-token loss on the copies of ``n`` held-out copy windows
    (copy_windows over the held-out stream: evenly spread starts, a seeded generator), each copy's
    first token left out (nothing in the context says a copy starts there): near 0 for a model
    that copies from its context, near its natural loss for one that does not."""
    if stream.numel() < width + 1 or n < 1:
        raise ValueError(f"held-out stream of {stream.numel()} tokens has no {n} windows of {width}")
    starts = torch.linspace(0, stream.numel() - width - 1, n).long()
    rows, lengths = copy_windows(stream, starts, width, torch.Generator().manual_seed(seed))
    target.eval()
    total = count = 0.0
    for row, piece in zip(rows, lengths):
        w = row[None].to(device)
        logits = target.lm(input_ids=w[:, :-1]).logits.float()[0]                  # [width - 1, V]
        ce = F.cross_entropy(logits, w[0, 1:], reduction="none")                   # ce[i]: token i + 1
        total += ce[width - piece:].sum().item()                 # the copy's tokens after its first
        count += piece - 1
    target.train()
    return total / count


def _optimizer(module, lr: float, device: torch.device):
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=device.type == "cuda")


def _lr_factor(step: int, warmup: int, progress: float) -> float:
    """Linear warm-up (over ``warmup`` steps or the first 5% of ``progress``, whichever ends first),
    then cosine from 1 to 0.1 over ``progress`` in [0, 1]."""
    warm = min(1.0, max((step + 1) / warmup, progress / 0.05))
    return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def plot_losses(history: list[dict], path: Path) -> bool:
    """loss.png from the logged history; False (with a warning) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (the curve is in train_report.json 'history')", path)
        return False
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("target", "target next-token"), ("mtp", "target MTP (next-next)"), ("draft", "draft")):
        ax.plot(steps, [h[key] for h in history], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(p: Preset, out: Path, *, seed: int, device: str, log_every: int = 10, progress: bool = True) -> dict:
    """Train, save, evaluate; returns the report (also written to ``out/train_report.json``)."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    # bf16 autocast (CUDA only): matmuls in bf16; weights, optimizer state, norms and the scan
    # (fast_scan turns autocast off inside) in float32. Checked before the corpus and tokenizer.
    if p.bf16_autocast and dev.type != "cuda":
        raise ValueError(f"bf16 autocast (preset {p.name!r} or --bf16-autocast) is for CUDA training only; "
                         "pass --no-bf16-autocast or --device cuda")
    if not 0.0 <= p.copy_frac <= 1.0:
        raise ValueError(f"copy_frac must be in [0, 1], got {p.copy_frac}")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if dev.type == "cuda":                       # training only: evaluation compares in true float32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings = {}

    # ---- corpus and tokenizer
    t0 = time.perf_counter()
    corpus = build_corpus(max_bytes=p.corpus_bytes, max_heldout_bytes=p.heldout_bytes, heldout_frac=HELDOUT_FRAC)
    if not corpus.train or not corpus.heldout:
        raise RuntimeError(f"corpus too small: {corpus.summary()}")
    write_json(out / "heldout_files.json", [f.path for f in corpus.heldout])
    timings["corpus_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok_texts, n = [], 0
    for f in corpus.train:                       # key order: deterministic
        if n >= p.tokenizer_bytes:
            break
        tok_texts.append(f.text)
        n += len(f.text)
    tok = train_bpe(tok_texts, p.vocab_size)
    vocab = len(tok)
    train_tok = encode_files(tok, [f.text for f in corpus.train])
    held_tok = encode_files(tok, [f.text for f in corpus.heldout])
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_tok), generator=g).tolist()
    train_stream = _stream(train_tok, tok.eos_token_id, order)
    held_stream = _stream(held_tok, tok.eos_token_id)
    timings["tokenizer_s"] = time.perf_counter() - t0
    if train_stream.numel() < p.seq_len + 2:
        raise RuntimeError(f"train stream has {train_stream.numel()} tokens, fewer than one window")
    windows = heldout_windows(held_stream, p.seq_len, p.eval_windows)

    # ---- models
    tcfg = hf_config_for(p.target, vocab, mtp=True)
    dcfg = hf_config_for(p.draft, vocab, mtp=False)
    torch.manual_seed(seed)
    target = TargetWithMTP(tcfg).to(dev).train()
    torch.manual_seed(seed + 1)
    draft = draft_model(dcfg).to(dev).train()
    opt_t, opt_d = _optimizer(target, p.lr, dev), _optimizer(draft, p.draft_lr, dev)
    params = {"target": count_params(target.lm), "target_mtp": count_params(target.mtp), "draft": count_params(draft)}
    logger.info("corpus %s; vocab %d; params %s; device %s", corpus.summary(), vocab, params, dev)

    # ---- training
    history, step, tokens = [], 0, 0
    sums = torch.zeros(3, device=dev)          # running loss sums between reads (one host read per log)
    n_in_sum = 0
    t_train = time.perf_counter()
    # the bar counts steps; its total is shown only when the step limit (not the time budget) ends the run
    bar = tqdm(total=p.max_steps if p.max_steps < 100_000 else None, desc=f"train[{p.name}]", unit="step",
               disable=not progress, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    n_max = train_stream.numel() - (p.seq_len + 1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=p.bf16_autocast)
    arange = torch.arange(p.seq_len + 1)
    # the first rows of each batch (at least one when copy_frac > 0), drawn from their own
    # generator so that the natural windows are the same with and without copies; pieces come
    # from the train stream only
    n_copy = math.ceil(p.batch_size * p.copy_frac)
    g_copy = torch.Generator().manual_seed(seed + 2)
    last = {"target": float("nan"), "mtp": float("nan"), "draft": float("nan")}
    next_log = 0.0
    while step < p.max_steps:
        elapsed = time.perf_counter() - t_train
        if elapsed >= p.time_budget_s:
            break
        frac = max(step / p.max_steps, elapsed / p.time_budget_s)
        f = _lr_factor(step, p.warmup_steps, frac)
        for o, lr in ((opt_t, p.lr), (opt_d, p.draft_lr)):
            for group in o.param_groups:
                group["lr"] = lr * f
        starts = torch.randint(0, n_max + 1, (p.batch_size,), generator=g)
        rows = train_stream[starts[:, None] + arange]                                   # [B, T+1]
        if n_copy:
            rows[:n_copy] = copy_windows(train_stream, starts[:n_copy], p.seq_len + 1, g_copy)[0]
        batch = rows.to(dev, non_blocking=True)
        with training_scan(), autocast:
            main, mtp = target.losses(batch)
        loss = main + p.mtp_weight * mtp
        opt_t.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt_t.step()
        with training_scan(), autocast:
            dl = draft_loss(draft, batch)
        opt_d.zero_grad(set_to_none=True)
        dl.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step()
        sums += torch.stack([main.detach(), mtp.detach(), dl.detach()])
        n_in_sum += 1
        step += 1
        tokens += batch.numel() - p.batch_size
        if step % log_every == 0 or step == p.max_steps:
            vals = (sums / n_in_sum).tolist()
            sums.zero_()
            n_in_sum = 0
            last = {"target": vals[0], "mtp": vals[1], "draft": vals[2]}
            history.append({"step": step, "tokens": tokens, "time_s": round(time.perf_counter() - t_train, 2),
                            "lr": p.lr * f, **last})
            tok_s = tokens / (time.perf_counter() - t_train)
            bar.set_postfix(loss=f"{vals[0]:.3f}", mtp=f"{vals[1]:.3f}", draft=f"{vals[2]:.3f}", tok_s=f"{tok_s:.0f}")
            if not progress and time.perf_counter() >= next_log:       # plain log lines for captured runs
                next_log = time.perf_counter() + 15.0
                logger.info("step %d, %d tokens, %.0f tok/s, loss %.3f, mtp %.3f, draft %.3f",
                            step, tokens, tok_s, *vals)
        bar.update(1)
    if n_in_sum:
        vals = (sums / n_in_sum).tolist()
        last = {"target": vals[0], "mtp": vals[1], "draft": vals[2]}
        history.append({"step": step, "tokens": tokens, "time_s": round(time.perf_counter() - t_train, 2),
                        "lr": p.lr * f, **last})
    bar.close()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    timings["train_s"] = time.perf_counter() - t_train

    # ---- save
    t0 = time.perf_counter()
    target_dir = save_hf(target.lm, out / "target", save_dtype=p.save_dtype, config_dtype=p.config_dtype,
                         tokenizer=tok, extra_tensors=mtp_tensors(target.mtp))
    draft_dir = save_hf(draft, out / "draft", save_dtype=p.save_dtype, config_dtype=p.config_dtype, tokenizer=tok)
    timings["save_s"] = time.perf_counter() - t0

    # ---- evaluate (saved folders, float32; the in-memory modules for reference)
    t0 = time.perf_counter()
    in_memory = training_losses(target, draft, windows, dev)
    copy_loss = (heldout_copy_loss(target, held_stream, p.seq_len + 1, COPY_EVAL_WINDOWS, dev)
                 if p.seq_len + 1 >= 2 * COPY_MIN_PIECE else None)
    del target, draft, opt_t, opt_d
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    heldout = {
        "windows": len(windows), "tokens_per_window": p.seq_len + 1,
        "uniform": math.log(vocab),
        "training_modules": in_memory,
        # the same target on held-out text repeated in its context (heldout_copy_loss, 64 windows;
        # None when the windows are too short for a copy)
        "copy_target": copy_loss,
        "transformers": {"target": hf_loss(target_dir, windows, dev), "draft": hf_loss(draft_dir, windows, dev)},
    }
    eng_t = engine_losses(target_dir, windows, dev, mtp=True)
    eng_d = engine_losses(draft_dir, windows, dev, mtp=False)
    heldout["engine"] = {"target": eng_t["next_token"], "mtp": eng_t["mtp"], "draft": eng_d["next_token"]}
    timings["eval_s"] = time.perf_counter() - t0

    plotted = plot_losses(history, out / "loss.png")
    timings["total_s"] = time.perf_counter() - t_start
    report = {
        "preset": p.name, "seed": seed, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": __import__("sys").version.split()[0],
        "corpus": corpus.summary(), "vocab_size": vocab, "params": params,
        "config": {"target": p.target, "draft": p.draft, "mtp_pattern": "*E", "seq_len": p.seq_len,
                   "batch_size": p.batch_size, "lr": p.lr, "draft_lr": p.draft_lr, "mtp_weight": p.mtp_weight,
                   "max_steps": p.max_steps, "time_budget_s": p.time_budget_s, "save_dtype": p.save_dtype,
                   "tokenizer_bytes": p.tokenizer_bytes, "heldout_frac": HELDOUT_FRAC,
                   "bf16_autocast": p.bf16_autocast, "copy_frac": p.copy_frac, "copy_rows_per_batch": n_copy,
                   "training_scan": "benchmarks.train.fast_scan.chunk_scan"},
        "steps": step, "tokens_seen": tokens, "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "final_train_loss": last, "heldout_loss": heldout, "loss_png": plotted, "history": history,
        "folders": {"target": str(target_dir), "draft": str(draft_dir)},
    }
    write_json(out / "train_report.json", report)
    return report
