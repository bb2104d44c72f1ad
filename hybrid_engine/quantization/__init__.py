"""Quantized weights: FP8 (ModelOpt per-tensor checkpoints, or per-channel at load) and NVFP4
weight-only. ``config`` says which, ``linear`` holds the layers and the factory that swaps them in,
``fp8`` / ``nvfp4`` the ops and exact references, ``*_kernels`` the Triton decode kernels.
``python -m hybrid_engine.quantize`` writes a quantized folder in the published layout."""
