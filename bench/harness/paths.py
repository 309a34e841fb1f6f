"""Where things are: the repository root (children's working directory) and the results folder."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
