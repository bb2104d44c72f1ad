"""A drafter that proposes a known continuation (test_logits_processing.py, test_stop_strings.py).

``seqs[request_id]`` is the request's whole token sequence (prompt + the outputs expected without
speculation); the drafts of a row are the K tokens after its ``input_pos``, -1 past the end. With
greedy verification every draft is then accepted (tokens arrive in runs of 1 + K); with seeded
sampling, sample-and-compare sees the one-hot drafts of the no-spec tokens."""
import torch

from hybrid_engine.spec.drafters import Drafter


class ContinuationDrafter(Drafter):
    has_probs = False

    def __init__(self, k, seqs):
        self.num_spec, self.seqs = k, seqs

    def add_request(self, slot, token_ids):
        pass

    def propose(self, ctx):
        pos = ctx.input_pos.tolist()
        out = torch.full((len(ctx.req_ids), self.num_spec), -1, dtype=torch.int64)   # [B, K]
        for i, rid in enumerate(ctx.req_ids):
            seq = self.seqs[rid]
            for j in range(self.num_spec):
                if pos[i] + 1 + j < len(seq):
                    out[i, j] = seq[pos[i] + 1 + j]
        return out.to(ctx.sampled.device), None
