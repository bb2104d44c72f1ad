"""The tensor-parallel process group of one engine: torch.distributed, NCCL for the model's
collectives on CUDA, gloo for the host messages (and for everything on CPU).

Rank 0 is the engine (scheduler, API); ranks 1..N-1 are workers (``parallel/worker.py``). A group
is joined either through a TCP rendezvous the engine sets up for the workers it starts itself, or
through the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
One engine per process: the group is torch.distributed's default group.
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("hybrid_engine")

# a worker waits for the next step as long as the engine idles: the host-message group never
# times out in practice (a dead peer is a closed socket, reported at once, not a timeout)
IDLE_TIMEOUT = timedelta(days=365)
# collectives of the model (NCCL): a peer that stops answering ends the step after this long
DEVICE_TIMEOUT = timedelta(seconds=float(os.environ.get("HYBRID_ENGINE_TP_TIMEOUT_S", "300")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def check_can_join(size: int) -> None:
    """Raise when this process cannot form a group of ``size`` ranks (before workers start)."""
    if _spent:
        raise RuntimeError("this process already ran a CUDA tensor-parallel engine that was shut down; its "
                           "NCCL communicators live until the process exits, so start the next "
                           "tensor-parallel engine in a new process")
    if dist.is_initialized() and dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size} but this process already belongs to a "
                         f"torch.distributed group of {dist.get_world_size()} ranks")


class TPGroup:
    """This process's place in the group: ``rank`` of ``size`` on ``device``; the model's
    collectives (``all_reduce``, ``all_gather_last``) and the host messages (``broadcast``,
    ``all_gather_object``)."""

    def __init__(self, rank: int, size: int, device: torch.device, store=None):
        """``store``: the engine's TCPStore rendezvous, or None for torchrun's environment."""
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif "OMP_NUM_THREADS" not in os.environ:
            # N processes share the host's cores: without this each takes all of them and the
            # collectives wait on oversubscribed threads (10-30x slower steps on a 2-core host)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            logger.info("tensor parallel on CPU: %d threads per rank (set OMP_NUM_THREADS to choose)",
                        torch.get_num_threads())
        check_can_join(size)
        # torch._dynamo first: imported after the default group exists (building the model on the
        # meta device imports it), it keeps that group's gloo threads alive past
        # destroy_process_group, and they race the interpreter's exit ("terminate called without
        # an active exception", rank 0 aborts after a clean shutdown on a busy host; torch 2.13)
        importlib.import_module("torch._dynamo")
        if not dist.is_initialized():
            kwargs = dict(backend=backend, rank=rank, world_size=size,
                          timeout=DEVICE_TIMEOUT if backend == "nccl" else IDLE_TIMEOUT)
            if backend == "nccl":
                kwargs["device_id"] = device
            if store is not None:
                kwargs["store"] = store
            dist.init_process_group(**kwargs)
        # host messages: a gloo group even when the default one is NCCL
        self.host = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend == "nccl" else None
        logger.info("tensor parallel: rank %d of %d on %s (%s)", rank, size, device, backend)
        self.channel = self._open_channel()

    def _open_channel(self):
        """The shared-memory step channel (``channel.py``) when every rank runs on this host (the
        engine's own workers; torchrun with one node) and every rank could map it, else None
        (messages go over gloo; logged). ``HYBRID_ENGINE_TP_CHANNEL=gloo`` chooses gloo."""
        from .channel import ShmChannel
        if int(os.environ.get("LOCAL_WORLD_SIZE", self.size)) != self.size:
            return None
        if os.environ.get("HYBRID_ENGINE_TP_CHANNEL") == "gloo":      # the workers inherit it
            return None
        channel, error = None, None
        try:
            if self.rank == 0:
                channel = ShmChannel(None, readers=self.size - 1)
                self._gloo_broadcast(channel.name)
            else:
                name = self._gloo_broadcast()
                channel = ShmChannel(name, readers=self.size - 1, reader=self.rank - 1) if name else None
        except Exception as e:      # noqa: BLE001 - no /dev/shm here: gloo carries the messages
            error = f"{type(e).__name__}: {e}"
            if self.rank == 0:
                self._gloo_broadcast(None)
        if all(self.all_gather_object(channel is not None)):
            return channel
        if channel is not None:
            channel.close(unlink=self.rank == 0)
        if self.rank == 0:
            logger.warning("tensor parallel: step messages over gloo (no shared-memory channel: %s)",
                           error or "a worker could not map it")
        return None

    # ---- the model's collectives (inside the forward; captured by CUDA graphs on CUDA) ----
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the ranks, in place (every rank gets the same values)."""
        dist.all_reduce(t)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """[L, C] per rank -> [L, N * C], rank-major along the last dim."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, -1)

    # ---- host messages ----
    def broadcast(self, obj=None, alive=None):
        """Rank 0 sends ``obj`` (any picklable value), every rank returns it; through the
        shared-memory channel when there is one. ``alive()``: called every few ms while waiting,
        raises when the peer is gone."""
        if self.channel is None:
            return self._gloo_broadcast(obj)
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            if len(data) > self.channel.capacity:       # rare (huge prompts): an empty payload says
                self.channel.send(b"", alive)           # "this one comes over gloo"
                return self._gloo_broadcast(obj)
            self.channel.send(data, alive)
            return obj
        data = self.channel.recv(alive)
        return pickle.loads(data) if data else self._gloo_broadcast()

    def _gloo_broadcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host)
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.host)
        return out

    def close(self) -> None:
        """Leave the group: gloo (CPU) groups are destroyed, so a later engine in this process can
        form a new one. NCCL communicators are left to the process's exit: aborting or destroying
        them while the engine's CUDA graphs (which captured their collectives) are alive hung on the
        H100 pair, so on CUDA one tensor-parallel engine per process (``_spent``)."""
        global _spent
        if self.channel is not None:
            self.channel.close(unlink=self.rank == 0)
            self.channel = None
        if not dist.is_initialized():
            return
        if self.device.type == "cuda":
            _spent = True
            return
        dist.destroy_process_group()


_spent = False      # this process's NCCL group served an engine that has shut down (see close)
