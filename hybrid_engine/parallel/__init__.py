"""Tensor parallelism over torch.distributed: the group (``group.py``), how the model is split
(``sharding.py``) and the worker processes with rank 0's runner proxy (``worker.py``). Design:
docs/design.md, "Tensor parallelism"."""
from .worker import EngineDeadError, start_tensor_parallel

__all__ = ["EngineDeadError", "start_tensor_parallel"]
