"""Parallel samples (``SamplingParams.n > 1``) sharing one prefill: the scheduler's part.

A group is a *leader* (the first sample) and ``n - 1`` *siblings*, all with the same prompt of P >= 2
tokens. The leader prefills positions [0, P-1) like any request (its chunks are cut there). The
siblings wait inside the leader (``fork_pending``, not in the waiting queue) until the step that
runs the leader's last prompt token: that step admits every sibling at once with
``num_computed_tokens = P - 1``, a slot and blocks of its own and a ``ForkSource``; the runner
copies the leader's Mamba slot and the KV of its first P-1 tokens into them before the forward
(stream order puts the copy after the leader's earlier chunks and before its last token), and
each sibling runs the one token P-1 itself, sampling its first token with its own seed. So the
prompt is computed once and nothing but the last token is repeated.

If the resources for all siblings (slots, blocks, token budget, max_num_seqs) are not free, the
leader waits at P-1 and no new request is admitted meanwhile (the group is not starved). A
leader that ends before the fork (abort, error) releases its siblings into the waiting queue as
ordinary requests; a preempted leader keeps them and forks when it reaches P-1 again.
"""
from __future__ import annotations

from ..attention import blocks_needed
from .request import Request, Status
from .scheduler_output import ForkSource, NewRequestData, ScheduledRow


class PrefillFork:
    """Mixin of ``Scheduler``: the leader's chunk limit and the siblings' admission."""

    def _fork_cut(self, req: Request, start: int, n: int) -> int:
        """The leader's chunk stops at P-1 (its last prompt token runs in the fork step)."""
        return min(n, len(req.prompt_token_ids) - 1 - start) if start < len(req.prompt_token_ids) - 1 else n

    def _fork_step(self, leader: Request, rows: list[ScheduledRow], budget: int) -> int:
        """At P-1: admit every sibling (rows of one token each) and return the token budget they
        use (``budget``: what is left beside the leader's token); -1 and nothing admitted when they
        do not all fit (the leader waits)."""
        sibs = leader.fork_pending
        m, bs, cut = len(sibs), self.block_size, len(leader.prompt_token_ids) - 1
        need = blocks_needed(cut + 1 + self.num_spec, bs)
        running = len(self.running)
        if (budget < m or self.slots.num_free < m or self.blocks.num_free < m * need
                or running + m > self.cfg.max_num_seqs
                or (running + m) * self.decode_len > self.cfg.max_num_batched_tokens):
            self._fork_blocked = True
            return -1
        src_blocks = tuple(leader.block_ids[:blocks_needed(cut, bs)])
        for sib in sibs:
            sib.fork_leader = None
            sib.slot = self.slots.allocate()
            sib.block_ids = self.blocks.allocate(need)
            sib.status, sib.prefill_target, sib.num_computed_tokens = Status.RUNNING, cut + 1, cut
            self.table.add(sib, self.max_model_len)
            self._forked_new.append(NewRequestData(
                sib.request_id, sib.epoch, tuple(sib.all_token_ids), sib.slot, sib.params, sib.seed,
                num_prompt_tokens=len(sib.prompt_token_ids), processing=sib.processing,
                fork=ForkSource(src_slot=leader.slot, src_blocks=src_blocks, dst_blocks=tuple(sib.block_ids),
                                num_tokens=cut)))
            rows.append(self._row(sib, 1))
        leader.fork_pending = None
        return m

    def _register_group(self, leader: Request) -> None:
        """``add_request`` of a leader: its siblings are known requests that wait inside it."""
        for sib in leader.fork_pending:
            if sib.request_id in self.requests:
                raise ValueError(f"request_id {sib.request_id!r} is already in use")
        for sib in leader.fork_pending:
            self.requests[sib.request_id] = sib
            sib.epoch = self._new_epoch()
            sib.fork_leader = leader

    def _unqueue(self, req: Request) -> None:
        """Take a WAITING request out of the queue, or out of its leader's pending siblings."""
        leader = req.fork_leader
        if leader is not None:
            leader.fork_pending.remove(req)
            req.fork_leader = None
        else:
            self.waiting.remove(req)

    def _release_siblings(self, leader: Request) -> None:
        """A leader ended before the fork: its siblings go on as ordinary requests."""
        for sib in leader.fork_pending or ():
            sib.fork_leader = None
            self.waiting.append(sib)
        leader.fork_pending = None
