"""tests/gpu: make the case tables here (kernel_cases, interpret_cases) importable."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
