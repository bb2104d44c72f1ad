"""tests/mamba_cache: make the shared oracles module and the kernel case tables (tests/gpu/kernel_cases.py,
whose checks take the torch references as well as the kernels) importable."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gpu"))
