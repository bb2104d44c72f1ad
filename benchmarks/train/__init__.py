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
"""
