"""Sampling parameters of a step's rows: staged only when some row samples at random."""
from __future__ import annotations

import numpy as np
import torch

from ...sampling.sampler import SamplingTensors
from ..input_batch import InputBatch
from ..step_constants import StepConstants

SAMPLING_FIELDS = ("temp", "top_k", "top_p", "min_p", "seed")


def stage_sampling(batch: InputBatch, host: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Add the step rows' sampling parameters to the step's staging when any row samples at
    random; returns the host flags ``temperature > 0`` per step row."""
    temp = batch.temperature[rows]
    random_np = temp > 0
    if random_np.any():
        host.update(temp=temp, top_k=batch.top_k[rows], top_p=batch.top_p[rows], min_p=batch.min_p[rows],
                    seed=batch.seed[rows])
    return random_np


def sampling_tensors(batch: InputBatch, consts: StepConstants, staged: dict[str, torch.Tensor] | None,
                     rows: np.ndarray, num_decode: int, sample_rows_p: np.ndarray, random_np: np.ndarray):
    """Sampling parameters -> (all rows, decode rows [:num_decode], sampling prefill rows); the
    subsets are device slices/gathers of the one staged copy, their host flags from numpy. A step
    whose rows are all greedy stages nothing: it gets cached all-greedy tensors (never read by the
    sampler's argmax path, but shaped like real ones for drafters)."""
    if not random_np.any():
        greedy = consts.greedy_sampling
        return (greedy(len(rows)), greedy(num_decode) if num_decode else None,
                greedy(len(sample_rows_p)) if len(sample_rows_p) else None)
    b = batch
    filtered_np = ((b.top_k[rows] > 0) | (b.top_p[rows] < 1) | (b.min_p[rows] > 0)) & random_np
    dev = tuple(staged[f] for f in SAMPLING_FIELDS)

    def subset(host_sel, dev_sel) -> SamplingTensors | None:
        if not random_np[host_sel].size:
            return None
        temperature, top_k, top_p, min_p, seed = (x[dev_sel] for x in dev)
        return SamplingTensors(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                               all_greedy=not random_np[host_sel].any(),
                               any_filter=bool(filtered_np[host_sel].any()))
    return (subset(slice(None), slice(None)), subset(slice(0, num_decode), slice(0, num_decode)),
            subset(sample_rows_p, staged["sample_rows_p"]))
