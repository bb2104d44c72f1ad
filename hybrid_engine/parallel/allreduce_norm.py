"""The tensor-parallel all-reduce fused into the next block's residual add + RMSNorm (CUDA).

Unfused, every mixer ends with an NCCL all-reduce of its partial output and the next block starts
with the fused add + RMSNorm kernel: two launches, and at batch 1 on the 8B shape the NCCL kernel,
the norm and the launch gaps around them cost ~12 us per layer, ~0.6 ms of a 3.1 ms TP=2 step.
Here one Triton kernel does it all for decode-sized steps (at most ``max_rows`` tokens):

1. each program (one token row) writes its row of this rank's partial into every rank's staging
   buffer (torch symmetric memory: a peer's buffer is written over NVLink), at ``[slot, row, rank]``;
2. it raises flag ``[slot, row, rank]`` on every peer (release, system scope), waits for the
   peers' flags ``[slot, row, peer]`` on this rank (acquire) and resets them to 0: the flags start
   at 0 and end at 0, so the same launch replays from a CUDA graph;
3. it sums the ranks' rows, now all in its own buffer, in rank order (float32, one rounding to the model dtype: the same sum on
   every rank, so the replicated residual streams stay identical), adds the residual, normalises.

Why one barrier per call is enough: a staging slot belongs to one norm of the model (``slot`` =
the block's index), so the next write to it comes a whole forward later, and a rank can only get
there after every peer has passed a later norm's barrier, which they reach only after they finished
reading this slot. Larger steps (prefill chunks) keep NCCL + the norm kernel.

A peer that never arrives (a dead worker) would spin the GPU forever; the wait gives up after
~2^31 polls (minutes) and writes NaN rows instead, and the host's worker watch reports the dead
peer. A wait that gave up leaves the flags out of step (a late peer's flag would let the next call
pass early), so it also sets a ``broken`` word, and every later call writes NaN rows. ``HYBRID_ENGINE_TP_FUSED_NORM=0`` turns the fused path off (for comparisons).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from hybrid_engine.mamba_cache.ops.triton_common import next_pow2, triton_available

logger = logging.getLogger("hybrid_engine")

MAX_ROWS = 64               # decode steps up to batch 64, verify steps up to 16 x (K = 3 + 1)
MAX_SPINS = 2 ** 31 - 1


def allreduce_add_norm_ref(partials: list[torch.Tensor], residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """partials: every rank's [T, D] in rank order -> (rmsnorm(r), r) with r = residual + h and
    h = the float32 sum of the partials in rank order rounded once to the model dtype."""
    h = torch.stack([p.float() for p in partials]).sum(0).to(partials[0].dtype)      # [T, D]
    r = residual + h
    x = r.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(r.dtype), r


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _allreduce_add_norm_kernel(
            x_ptr, sx,                  # this rank's partial [T, D]
            res_ptr, sr,                # residual [T, D]
            w_ptr,                      # norm weight [D]
            out_ptr, so,                # normed output [T, D]
            res_out_ptr, sro,           # new residual [T, D]
            buf_ptrs,                   # int64 [N]: each rank's staging buffer [slots, max_rows, N, D]
            flag_ptrs,                  # int64 [N]: each rank's flags int32 [slots, max_rows, N]
            broken_ptr,                 # int32 [1]: set when a wait gave up; every later call is NaN
            rank, slot, max_rows, D, eps, max_spins,
            N: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        dt = x_ptr.dtype.element_ty
        cell = row + slot * max_rows                               # (slot, row) in both tables
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
        # push this rank's row into every rank's staging buffer (the peers' over NVLink: stores
        # are posted, so nobody waits on a remote read's round trip), at [slot, row, rank]
        for p in tl.static_range(N):
            buf = tl.load(buf_ptrs + p).to(tl.pointer_type(dt))
            tl.store(buf + (cell * N + rank) * D + offs, x, mask=m)
        tl.debug_barrier()                 # the whole row is stored before a peer hears of it
        # Every step below is correct whether one thread or all threads of the program run the
        # scalar operations: raising a flag twice raises it once, every thread polls until it
        # sees its flags raised, and the reset to 0 comes after a barrier that all of them passed.
        for p in tl.static_range(N):
            if p != rank:
                peer_flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer_flags + cell * N + rank, 1, sem="release", scope="sys")
        my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
        broken = tl.load(broken_ptr, volatile=True)
        arrived = broken == 0
        for p in tl.static_range(N):
            if p != rank:
                # poll with plain volatile loads (atomics from every thread would contend with the
                # peer's writes), then one acquire to order the reads of its rows after the flag
                got = tl.load(my_flags + cell * N + p, volatile=True)
                spins = tl.full([], 0, tl.int32)
                while (got != 1) & (spins < max_spins) & (broken == 0):
                    got = tl.load(my_flags + cell * N + p, volatile=True)
                    spins += 1
                got = tl.atomic_add(my_flags + cell * N + p, 0, sem="acquire", scope="sys")
                arrived = arrived & (got == 1)
        if arrived == 0:
            # a peer's flag may still come after this reset: the flags are out of step from now
            # on, so every later call gives NaN rows too instead of silently reading stale rows
            tl.store(broken_ptr, 1)
        tl.debug_barrier()
        for p in tl.static_range(N):
            if p != rank:
                tl.atomic_xchg(my_flags + cell * N + p, 0, sem="relaxed", scope="sys")
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(dt))
        for p in tl.static_range(N):       # rank order: the same sum on every rank
            acc += tl.load(mine + (cell * N + p) * D + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
        h = acc.to(dt)                                             # the all-reduced row
        r0 = tl.load(res_ptr + row * sr + offs, mask=m, other=0.0)
        h = (r0.to(tl.float32) + h.to(tl.float32)).to(dt)         # torch's add: one rounding
        tl.store(res_out_ptr + row * sro + offs, h, mask=m)
        hf = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = w * (hf * inv)
        y = tl.where(arrived, y, float("nan"))                     # a peer never came: loud rows
        tl.store(out_ptr + row * so + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def launch_allreduce_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              *, rank: int, world: int, slot: int, max_rows: int, buf_ptrs: torch.Tensor,
                              flag_ptrs: torch.Tensor, broken: torch.Tensor, max_spins: int = MAX_SPINS,
                              out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the kernel (module docstring). x (this rank's partial), residual [T, D] of one
    dtype, T <= max_rows, unit inner strides; buf_ptrs / flag_ptrs: int64 [world] on x's device,
    the addresses of every rank's staging buffer [slots, max_rows, world, D] (x's dtype) and flags int32
    [slots, max_rows, world]; broken: int32 [1] on x's device, 0 until a wait gives up (then 1, and
    every call writes NaN rows). -> (rmsnorm(r) [T, D], r [T, D]), r = residual + sum of partials,
    written into ``out`` / ``residual_out`` when given (tests pass poisoned ones).
    (No residual-free form: the first block's input is the embedding, which reduces itself.)"""
    t, d = x.shape
    if t > max_rows:
        raise ValueError(f"fused all-reduce + norm takes at most {max_rows} rows, got {t}")
    if out is None:
        out = torch.empty_like(residual, memory_format=torch.contiguous_format)        # [T, D]
    res_out = residual_out
    if res_out is None:
        res_out = torch.empty_like(residual, memory_format=torch.contiguous_format)    # [T, D]
    if t == 0:
        return out, res_out
    block = next_pow2(d)
    _allreduce_add_norm_kernel[(t,)](
        x, x.stride(0), residual, residual.stride(0), weight, out, out.stride(0), res_out, res_out.stride(0),
        buf_ptrs, flag_ptrs, broken, rank, slot, max_rows, d, float(eps), max_spins,
        N=world, BLOCK_D=block, num_warps=min(16, max(1, block // 512)))
    return out, res_out


class AllReduceNorm:
    """The staging buffers and flags (torch symmetric memory) of one tensor-parallel model's fused
    all-reduce + add + RMSNorm, one slot per norm that follows a mixer; made by ``create`` (or, for
    a group that is already known to work, ``allocate`` then ``connect`` on every rank)."""

    def __init__(self, *, rank: int, world: int, slots: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, group_name: str, max_rows: int = MAX_ROWS):
        self.allocate(rank=rank, world=world, slots=slots, hidden=hidden, dtype=dtype, device=device,
                      max_rows=max_rows)
        self.connect(group_name)

    def allocate(self, *, rank: int, world: int, slots: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, max_rows: int = MAX_ROWS) -> None:
        """This rank's buffers (not yet known to the peers)."""
        from torch.distributed import _symmetric_memory as symm_mem
        self.rank, self.world, self.slots, self.max_rows, self.hidden = rank, world, slots, max_rows, hidden
        self.staging = symm_mem.empty(slots * max_rows * world * hidden, dtype=dtype, device=device)  # [slots*rows*N*D]
        self.flags = symm_mem.empty(slots * max_rows * world, dtype=torch.int32, device=device)
        self.flags.zero_()
        self.broken = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)          # the flags are 0 before any peer can see them

    def connect(self, group_name: str) -> None:
        """Exchange the buffers' addresses with the peers (collective)."""
        from torch.distributed import _symmetric_memory as symm_mem
        device = self.staging.device
        staging = symm_mem.rendezvous(self.staging, group_name)
        flags = symm_mem.rendezvous(self.flags, group_name)
        self.buf_ptrs = torch.tensor(list(staging.buffer_ptrs), dtype=torch.int64, device=device)    # [N]
        self.flag_ptrs = torch.tensor(list(flags.buffer_ptrs), dtype=torch.int64, device=device)     # [N]
        self._handles = (staging, flags)          # keep the peers' mappings alive

    @classmethod
    def create(cls, group, *, slots: int, hidden: int, dtype: torch.dtype) -> "AllReduceNorm | None":
        """For ``group`` (a TPGroup) on CUDA with N >= 2 ranks on one host, each GPU able to reach
        the others' memory: the fused path, else None (NCCL + the norm kernel; the reason is logged).
        Every rank takes the same path: each step's outcome is agreed before the next collective."""
        if group.device.type != "cuda" or group.size < 2:
            return None
        devices = group.all_gather_object(group.device.index)      # every rank's GPU
        reason = _first(group.all_gather_object(cls._local_reason(group, devices)))
        made = None
        if reason is None:
            made = cls.__new__(cls)
            try:
                made.allocate(rank=group.rank, world=group.size, slots=slots, hidden=hidden, dtype=dtype,
                              device=group.device)
            except Exception as e:      # noqa: BLE001 - e.g. out of memory; every rank falls back
                reason = f"symmetric memory allocation failed: {type(e).__name__}: {e}"
            reason = _first(group.all_gather_object(reason))
        if reason is None:
            try:
                made.connect(dist.group.WORLD.group_name)
            except Exception as e:      # noqa: BLE001 - reported below; every rank falls back
                reason = f"symmetric memory rendezvous failed: {type(e).__name__}: {e}"
            reason = _first(group.all_gather_object(reason))
        if reason is not None:
            made = None
        if group.rank == 0:
            if made is None:
                logger.warning("tensor parallel: all-reduce + norm unfused (NCCL, then the norm kernel): %s", reason)
            else:
                logger.info("tensor parallel: all-reduce fused into the residual add + RMSNorm for steps of "
                            "<= %d tokens (symmetric memory, %d slots)", made.max_rows, slots)
        return made

    @staticmethod
    def _local_reason(group, devices: list[int]) -> str | None:
        """Why this rank cannot take the fused path, or None (no collective: ranks may return at
        different points)."""
        if os.environ.get("HYBRID_ENGINE_TP_FUSED_NORM", "1") == "0":
            return "HYBRID_ENGINE_TP_FUSED_NORM=0"
        if not triton_available():
            return "Triton is missing"
        if int(os.environ.get("LOCAL_WORLD_SIZE", group.size)) != group.size:
            return "the ranks span several hosts"
        try:
            from torch.distributed import _symmetric_memory  # noqa: F401
            # NVLink peers are what it was measured on; PCIe peer access may lack the system-scope
            # atomics the flags need (untested)
            if not all(torch.cuda.can_device_access_peer(group.device, d) for d in devices if d != group.device.index):
                return "a GPU of the group cannot access its peers' memory"
        except Exception as e:          # noqa: BLE001 - any failure here only means: unfused
            return f"no peer access check ({type(e).__name__}: {e})"
        return None

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden
                and x.dtype == self.staging.dtype and x.stride(-1) == 1)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_allreduce_add_norm(x, residual, weight, eps, rank=self.rank, world=self.world, slot=slot,
                                         max_rows=self.max_rows, buf_ptrs=self.buf_ptrs, flag_ptrs=self.flag_ptrs,
                                         broken=self.broken)


def _first(reasons: list) -> str | None:
    return next((r for r in reasons if r), None)
