from setuptools import find_packages, setup

setup(
    name="megatron-llep",
    version="0.1.0",
    description="Least-Loaded Expert Parallelism and communication-aware expert placement for Megatron-Core MoE",
    packages=find_packages(include=["megatron_llep", "megatron_llep.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch 2.13.0's CPU wheel is what the CPU CI uses; any 2.x Megatron-Core 0.16 supports works
        "torch>=2.6,<2.15",
        "megatron-core>=0.16.0,<0.17",
        "numpy>=1.24",
        # the offline-run reader (megatron_llep.testing.wandb_offline) parses wandb 0.31's file format
        "wandb>=0.31,<0.32",
        "pillow>=9",  # wandb images (expert-load heatmaps)
        "tokenizers>=0.15",
        "psutil>=5",  # dist_checkpointing's writer processes need it (and hang without it)  # local Hugging Face tokenizer.json files for fine-tuning data
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6"],
        "bench": ["matplotlib>=3.7"],
        "gpu": ["transformer-engine[pytorch]>=2.6"],
    },
)
