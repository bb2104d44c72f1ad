"""tests/mamba_cache: make the shared oracles module importable."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
