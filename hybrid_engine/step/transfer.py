"""Host<->device transfers that never block the step path.

H2D: each step's numpy arrays are packed into one ring slot of pinned staging memory (CUDA) and
copied with non_blocking=True. ``begin_step()`` moves to the next slot; every ``put`` of the step packs
at a growing offset inside it, so a step never overwrites its own pending copies. A slot is reused
RING steps later: by then the step loop has read back (waited on) a later step, whose device work is
stream-ordered after these copies, so no copy still reads it. D2H: outputs are copied on a side stream into pinned buffers after
``wait_stream(main)``; an event marks completion and nobody waits on it until the next step.
"""
from __future__ import annotations

import asyncio

import numpy as np
import torch

RING = 4  # ring slots (one per step); > steps in flight + 2


class H2D:
    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.cuda = device.type == "cuda"
        self._ring = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda) for _ in range(RING)]
        self._retired: list[list[torch.Tensor]] = [[] for _ in range(RING)]  # outgrown slots, still in use
        self._i = 0
        self._off = 0                    # words used in the current slot by this step's puts
        self._raw_dev: torch.Tensor | None = None        # put_raw's device buffer (CUDA)
        self._np_views: dict[int, np.ndarray] = {}

    def begin_step(self) -> None:
        """Start a new step: its puts go to the next ring slot."""
        self._i = (self._i + 1) % RING
        self._off = 0
        self._retired[self._i].clear()   # buffers retired RING steps ago are no longer read

    def put(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Copy int64/int32/float32/bool arrays to the device in one transfer; returns device tensors.

        The arrays are packed word-aligned into one int64 staging run; the device copy is cut back
        into per-array tensors by views (no kernels), so a put costs one copy plus a few view ops
        an array."""
        flat = [np.ascontiguousarray(a) for a in arrays]
        words = [(a.nbytes + 7) // 8 for a in flat]
        total = sum(words)
        if not self.cuda:
            # a fresh buffer per put: the returned tensors alias it, so it is never reused
            host = np.empty(total, dtype=np.int64)
            self._pack(host.view(np.uint8), 0, flat, words)
            return self._unpack(torch.from_numpy(host), flat, words)
        buf, start = self._reserve(total)
        self._pack(self._np(buf).view(np.uint8), start, flat, words)
        return self._unpack(buf[start:start + total].to(self.device, non_blocking=True), flat, words)

    def put_raw(self, arr: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """One int64 array to the device as one int64 tensor (no unpacking views: the cheapest put).
        ``out``: a caller's int64 device buffer (a CUDA graph holds its address) to copy into."""
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        n = arr.size
        if out is not None and out.numel() < n:
            raise ValueError(f"put_raw: {n} words do not fit the {out.numel()}-word buffer")
        if not self.cuda:
            if out is None:
                return torch.from_numpy(arr.copy())
            out[:n].copy_(torch.from_numpy(arr))
            return out[:n]
        buf, start = self._reserve(n)
        self._np(buf)[start:start + n] = arr
        # into a persistent device buffer: no allocation per step. Its previous contents are read
        # only by kernels of the previous step, which the main stream runs before this copy.
        if out is None and (self._raw_dev is None or self._raw_dev.numel() < n):
            self._raw_dev = torch.empty(max(2 * n, 1024), dtype=torch.int64, device=self.device)
        dev = (self._raw_dev if out is None else out)[:n]
        dev.copy_(buf[start:start + n], non_blocking=True)
        return dev

    def put_image(self, out: torch.Tensor, fill) -> None:
        """``fill(words)`` writes a host image of ``out`` (a persistent int64 device buffer: a
        prefill graph's static arena) into this step's staging words; one copy sends it to ``out``.
        Its previous contents are read only by kernels enqueued earlier on the main stream."""
        n = out.numel()
        if not self.cuda:
            host = np.empty(n, dtype=np.int64)
            fill(host)
            out.copy_(torch.from_numpy(host))
            return
        buf, start = self._reserve(n)
        fill(self._np(buf)[start:start + n])
        out.copy_(buf[start:start + n], non_blocking=True)

    def _reserve(self, words: int) -> tuple[torch.Tensor, int]:
        """``words`` int64 words of this step's ring slot -> (pinned buffer, start word)."""
        buf = self._ring[self._i]
        if buf.numel() < self._off + words:
            # grow: earlier puts of this step may still read the old buffer, so keep it alive
            self._retired[self._i].append(buf)
            buf = self._ring[self._i] = torch.empty(2 * (self._off + words), dtype=torch.int64, pin_memory=True)
            self._off = 0
        start = self._off
        self._off += words
        return buf, start

    def _np(self, buf: torch.Tensor) -> np.ndarray:
        """numpy view of a pinned staging buffer, made once per buffer (``.numpy()`` dispatches ops)."""
        key = buf.data_ptr()
        v = self._np_views.get(key)
        if v is None or v.size != buf.numel():
            v = self._np_views[key] = buf.numpy()
        return v

    @staticmethod
    def _pack(host_u8: np.ndarray, start_word: int, flat: list[np.ndarray], words: list[int]) -> None:
        off = start_word * 8
        for a, w in zip(flat, words):
            host_u8[off: off + a.nbytes] = a.view(np.uint8).reshape(-1)
            off += w * 8

    @staticmethod
    def _unpack(dev: torch.Tensor, flat: list[np.ndarray], words: list[int]) -> list[torch.Tensor]:
        """dev[total] int64 holding the packed arrays -> one tensor per array (views of dev): the
        words split in one op, each part viewed in its array's dtype, cut to its size and shape
        (0-3 view ops an array)."""
        out: list[torch.Tensor] = []
        for a, t in zip(flat, dev.split(words)):                  # one op: a view per array
            dt = _TORCH_DTYPE[a.dtype.str[1:]]
            if dt is not torch.int64:
                t = t.view(dt)
                if t.numel() != a.size:
                    t = t[:a.size]                                 # drop the word padding
            out.append(t if a.ndim == 1 else t.view(a.shape))
        return out


_TORCH_DTYPE = {"i8": torch.int64, "i4": torch.int32, "f4": torch.float32, "b1": torch.bool}


class CurrentStream:
    """``torch.cuda.current_stream()`` for one device, cached: the public call builds a Stream
    object (~5 us per call on the step path), so it is re-read only when the raw current stream
    changes (or every call, where this torch has no raw getter)."""

    def __init__(self, device: torch.device):
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._raw_current = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._stream: torch.cuda.Stream | None = None
        self._raw = -1

    def __call__(self) -> "torch.cuda.Stream":
        if self._raw_current is None:
            return torch.cuda.current_stream(self._index)
        raw = self._raw_current(self._index)
        if raw != self._raw:
            self._stream, self._raw = torch.cuda.current_stream(self._index), raw
        return self._stream


class D2H:
    """Step outputs to the host: a ring of pinned int64 buffers and a side stream (CUDA).

    ``copy(t)`` copies one int64 device tensor into the next ring slot on the side stream, after
    the main stream's work so far, and returns a ``D2HCopy``. A slot is reused RING copies later:
    by then the step loop has waited on a later copy (one step in flight), and ``D2HCopy.wait``
    hands out a numpy *copy*, so nothing still reads the slot."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._ring = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda) for _ in range(RING)]
        # events made once (a fresh Event per copy costs host time on every step): "main stream
        # reached the copy" and "copy done", one pair per ring slot
        self._main_ev = [torch.cuda.Event() for _ in range(RING)] if self.cuda else []
        self._done_ev = [torch.cuda.Event(blocking=True) for _ in range(RING)] if self.cuda else []
        self._views: dict[tuple, torch.Tensor] = {}      # (slot, shape) -> view of the slot's buffer
        self._i = 0
        self._main_stream = CurrentStream(device) if self.cuda else None

    def copy(self, t: torch.Tensor) -> "D2HCopy":
        if not self.cuda:                               # CPU: the values are ready now
            return D2HCopy(t.clone(), None, t)
        i = self._i = (self._i + 1) % RING
        host = self._views.get((i, t.shape))
        if host is None:
            n = t.numel()
            if self._ring[i].numel() < n:
                self._ring[i] = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
                self._views = {k: v for k, v in self._views.items() if k[0] != i}
            host = self._views[(i, t.shape)] = self._ring[i][:n].view(t.shape)
        stream, main = self.stream, self._main_stream()
        self._main_ev[i].record(main)
        stream.wait_event(self._main_ev[i])
        torch.cuda.set_stream(stream)
        try:
            # no record_stream: the D2HCopy holds t until wait() has seen the copy finish, so the
            # allocator cannot hand t's memory to main-stream work while the copy may still read it
            # (a copy dropped unread may read reused memory, but nobody reads its result)
            host.copy_(t, non_blocking=True)
            self._done_ev[i].record(stream)
        finally:
            torch.cuda.set_stream(main)
        return D2HCopy(host, self._done_ev[i], t)


class D2HCopy:
    """One step's output tensor on its way to the host. ``wait()``/``await wait_async()`` to read."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None, src: torch.Tensor):
        self._host, self._event = host, event
        self._src = src                         # keeps the device tensor alive until read

    @property
    def event(self) -> torch.cuda.Event | None:
        """Recorded on the copy stream after the copy (None on CPU): a stream that waits on it
        may overwrite the copied device tensor."""
        return self._event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()           # the one designated wait
        self._src = None
        return self._host.numpy().copy()        # a copy: the ring slot is reused later

    async def wait_async(self, poll_s: float = 5e-5) -> np.ndarray:
        while not self.ready():
            await asyncio.sleep(poll_s)
        return self.wait()
