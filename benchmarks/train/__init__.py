"""Train small real Nemotron-H models on the machine's own Python sources (``python -m benchmarks.train``).

A target (Mamba2, attention, MLP and MoE blocks plus one MTP step in the published ``mtp.layers.*``
layout) and a small hybrid draft sharing a byte-level BPE tokenizer, trained together on the Python
source and docs of the interpreter's standard library and installed packages; files are split into
train and held-out by a hash of their path. Modules: ``corpus`` (files, split, cap), ``tokenizer``
(BPE), ``models`` (presets, the MTP head, saving), ``evaluate`` (held-out losses by transformers and
by our engine), ``train`` (the run). Output layout, read by benchmarks/spec_real.py:

    <out>/target/             HF folder: config.json, model.safetensors (with mtp.* tensors), tokenizer
    <out>/draft/              HF folder, same tokenizer
    <out>/heldout_files.json  absolute paths of the held-out files (never trained on)
    <out>/train_report.json   params, tokens seen, timings, train and held-out losses, loss history
    <out>/loss.png            loss curves (only when matplotlib is installed)

Presets: ``tiny`` (tests, seconds on CPU), ``default`` (the shipped embedded model: ~5M target +
~1M MTP step + ~1.3M draft, vocab 4096, bf16 files, 100 s of training), ``bench`` (~90M target
incl. MTP, vocab 16384, 210 s) and ``bench-large`` (175M target + 24M MTP step + 9M draft, vocab
16384, bf16 autocast, float32 files, 420 s with half of each batch copy windows: the GPU
speculative-decoding benchmark's target, ~63 k tokens/s on an H100, a whole run ~8.5 minutes
with ``--eval-windows 4``).
While training, transformers' Mamba2 scan is replaced by ``fast_scan`` (the same function as
matmuls; evaluation runs transformers' own). The time budget covers the training loop only;
corpus, tokenizer, saving and evaluation come on top (on an H100 about 1-1.5 min per preset). On
one H100, both in one call (about 8 minutes):

    PYTHONPATH=$PWD python -m benchmarks.train --preset default --device cuda --out $OUT/default --no-progress
    PYTHONPATH=$PWD python -m benchmarks.train --preset bench --device cuda --out $OUT/bench --no-progress

then ``python -m benchmarks.train.ship <the fetched $OUT>/default`` installs the default run into
hybrid_engine/data (benchmarks/train/ship.py).
"""
