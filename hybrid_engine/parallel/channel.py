"""The step messages' transport on one host: a shared-memory mailbox (one writer, rank 0; one
reader per worker), instead of a collective per message.

Why: a pickled ``broadcast_object_list`` over gloo costs two collectives over loopback TCP, ~0.9 ms
a message on our 2-core dev host, and a tensor-parallel step cannot start on a worker before its
message arrived: small models and MoE decode steps were bound by it on the H100 pair (TP=2 slower
than TP=1). Here a message is one ``memcpy`` into shared memory and a few integer stores.

Layout (int64 words, then the payload): [seq, length, crc32, reserved x5, ack of reader 0, ...].
The writer waits until every reader acknowledged the previous message, writes the payload, its
length and CRC, then the new ``seq``. A reader spins (5 ms, then sleeps, backing off to 0.2 ms, and to 5 ms once idle for a second) until
``seq`` moves, copies the payload, checks its CRC (on hosts that reorder stores, a ``seq`` seen
before its payload fails the check and is read again) and writes its ack. ``alive()`` callbacks,
called every few ms while waiting, turn a dead peer into an error instead of a hang.
"""
from __future__ import annotations

import time
import zlib
from multiprocessing import resource_tracker, shared_memory

import numpy as np

_HEADER = 8
_SEQ, _LEN, _CRC = 0, 1, 2
_SPIN_S = 5e-3            # busy-wait this long before sleeping (a step message is due within a step)
_MAX_SLEEP_S = 2e-4       # then poll every 0.2 ms at most while steps are due
_IDLE_S, _IDLE_SLEEP_S = 1.0, 5e-3   # after 1 s without a message (an idle engine): every 5 ms
_CHECK_EVERY_S = 5e-3


class ShmChannel:
    def __init__(self, name: str | None, readers: int, size: int = 32 << 20, reader: int | None = None):
        """``name`` None: create (the writer); else attach as reader index ``reader``."""
        create = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=size if create else 0)
        if not create:          # the writer owns (and unlinks) the segment, not this process's tracker
            try:
                resource_tracker.unregister(self.shm._name, "shared_memory")
            except Exception:   # noqa: BLE001 - tracker internals differ across Python versions
                pass
        words = _HEADER + readers
        self._words = np.ndarray((words,), dtype=np.int64, buffer=self.shm.buf)
        self._payload = self.shm.buf[8 * words:]
        if create:
            self._words[:] = 0
        self.name, self.readers, self.reader, self._seq = self.shm.name, readers, reader, 0

    @property
    def capacity(self) -> int:
        return len(self._payload)

    def send(self, data: bytes, alive=None) -> None:
        if len(data) > self.capacity:
            raise ValueError(f"a step message of {len(data)} bytes exceeds the channel's {self.capacity}")
        acks = self._words[_HEADER:]
        _wait(lambda: bool((acks >= self._seq).all()), alive)
        self._payload[:len(data)] = data
        self._words[_LEN] = len(data)
        self._words[_CRC] = zlib.crc32(data)
        self._seq += 1
        self._words[_SEQ] = self._seq

    def recv(self, alive=None) -> bytes:
        want = self._seq + 1
        box = []

        def arrived() -> bool:
            if self._words[_SEQ] < want:
                return False
            n = int(self._words[_LEN])
            data = bytes(self._payload[:n])
            if zlib.crc32(data) != int(self._words[_CRC]):      # seen before its payload: read again
                return False
            box.append(data)
            return True
        _wait(arrived, alive)
        self._seq = want
        self._words[_HEADER + self.reader] = want
        return box[0]

    def close(self, unlink: bool = False) -> None:
        self._words = self._payload = None
        try:
            self.shm.close()
            if unlink:
                self.shm.unlink()
        except (FileNotFoundError, BufferError):
            pass


def _wait(ready, alive) -> None:
    if ready():
        return
    start = now = time.monotonic()
    next_check = start + _CHECK_EVERY_S
    sleep = 1e-5
    while not ready():
        now = time.monotonic()
        if now - start > _SPIN_S:
            time.sleep(sleep)
            sleep = min(sleep * 2, _IDLE_SLEEP_S if now - start > _IDLE_S else _MAX_SLEEP_S)
        if alive is not None and now >= next_check:
            alive()
            next_check = now + _CHECK_EVERY_S
