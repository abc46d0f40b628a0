"""megarl: a Megatron-native, asynchronous RL post-training system for LLMs."""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native asynchronous RL post-training with a sidecar SGLang rollout cluster",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        # 2.13.0 is the CPU build CI uses; GPU users bring the CUDA build they run.
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.17",  # megarl/mcore/ uses 0.16.1 internals (pinned, tested)
        "numpy",
        "pyyaml",
        "sentencepiece",
        "safetensors",
        "psutil",  # the trainer forwards stop signals to torchrun's workers (megarl.trainer.parallel)
        "aiohttp>=3.9",  # rollout client and the CPU rollout server
    ],
    extras_require={
        # everything the test tiers use: the README's one install line brings it all in
        "test": ["pytest>=7", "pytest-xdist>=3.5", "transformers>=4.45", "matplotlib", "tensorboard", "wandb", "pyarrow",
                 "jinja2", "sympy", "mpi4py"],
        # Parquet prompt files, chat templates, symbolic math answers (megarl.common.compat.require)
        "data": ["pyarrow", "jinja2", "sympy"],
        "sglang": ["sglang>=0.5"],
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "mpi": ["mpi4py"],
        "plot": ["matplotlib"],
        # tools/bench/bench_vs_trl.py only: TRL's GRPOTrainer as the baseline (never a core dependency)
        "bench": ["trl>=1.0", "transformers>=4.56", "datasets", "accelerate", "tokenizers", "matplotlib"],
        "log": ["tensorboard", "wandb"],  # logging.tensorboard / logging.wandb_project
    },
    entry_points={
        "console_scripts": [
            "megarl-train=megarl.train:main",
            "megarl-eval=megarl.eval:main",
            "megarl-convert=megarl.commands.convert:main",
            "megarl-logprobs=megarl.commands.logprobs:main",
            "megarl-server=megarl.server.__main__:main",
            "megarl-env=megarl.envs.server:main",
            "megarl-rollout-manager=megarl.rollout.manager:main",
            "megarl-launch=megarl.launch.plan:main",
        ]
    },
)
