"""Where the repository is, for tests at any depth of the tree (configs, converters, the package on PYTHONPATH)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
