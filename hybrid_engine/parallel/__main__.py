"""``python -m hybrid_engine.parallel RANK PORT DEVICE``: a tensor-parallel worker process, started
by rank 0 (``worker.start_tensor_parallel``)."""
import sys

import torch

from .worker import worker_main

worker_main(int(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3]))
