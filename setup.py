"""Packaging of megatron-llep: the library, the recipes (entry points and what they share) and their extras."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

# The spill planner's compiled core (the plan is on every MoE layer's critical path). optional: without a C++
# compiler the install still succeeds and megatron_llep.planning plans with its Python reference (same plans).
SPILL_CORE = Pybind11Extension("megatron_llep.planning._spill_core", ["megatron_llep/planning/_spill_core.cpp"],
                               cxx_std=17, extra_compile_args=["-O2"])
SPILL_CORE.optional = True

setup(
    name="megatron-llep",
    version="0.1.0",
    description="Least-Loaded Expert Parallelism and communication-aware expert placement for Megatron-Core MoE",
    # recipes/ (the entry points and what they share) is installed too, so no entry point edits sys.path
    packages=find_packages(include=["megatron_llep", "megatron_llep.*", "recipes", "recipes.*"]),
    package_data={"recipes": ["data/*.json", "data/*.jsonl", "data/routing_traces/*"]},
    ext_modules=[SPILL_CORE],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.10",
    install_requires=[
        # torch 2.13.0's CPU wheel is what the CPU CI uses; any 2.x Megatron-Core 0.16 supports works
        "torch>=2.6,<2.15",
        "megatron-core>=0.16,<0.20",
        # megatron-core 0.18+ imports triton unguarded (megatron/core/transformer/moe/paged_stash.py), and pip
        # picks 0.18+/0.19 on Python >= 3.12. CUDA torch builds already bring triton; CPU torch builds don't.
        'triton>=3.0; python_version >= "3.12" and sys_platform == "linux"',
        "numpy>=1.24",
        "packaging>=24",  # megatron_llep.compat.mcore compares Megatron-Core versions
        # the offline-run reader (megatron_llep.testing.wandb_offline) parses wandb 0.31's file format
        "wandb>=0.31,<0.32",
        "pillow>=9",  # wandb images (expert-load heatmaps)
        "safetensors>=0.4",  # Hugging Face checkpoints in and out (recipes/hf)
        "tokenizers>=0.15",
        "jinja2>=3.1.6",  # chat templates of local Hugging Face tokenizers (recipes/runtime/sft_data.py); sandbox fixes  # local Hugging Face tokenizer.json files for fine-tuning data
        # recipes/pretrain_gpt.py reads Megatron's indexed datasets; where megatron-core 0.17+ runs on Python 3.11
        # (overlaid, as CI does) its cp312 dataset helper does not load and megatron_llep.compat.megatron_training
        # compiles the shipped helpers.cpp with pybind11 (and g++)
        'pybind11>=2.10; python_version < "3.12"',
        "psutil>=5",  # dist_checkpointing's writer processes need it (and hang without it)
    ],
    extras_require={
        # matplotlib: tests/placement/test_placement_cli.py's report test imports it through benchmarks/placement_report.py
        # transformers: the independent gpt-oss / DeepSeek-V3 implementation the parity tests compare against
        # accelerate: transformers refuses to load an FP8 checkpoint without it (tests/hf/test_hf_quant_export.py loads
        # the DeepSeek-V3 FP8 export with FineGrainedFP8Config)
        "test": ["pytest>=8", "hypothesis>=6", "matplotlib>=3.7", "transformers>=5.0,<6", "accelerate>=1.1"],
        "bench": ["matplotlib>=3.7"],
        "gpu": ["transformer-engine[pytorch]>=2.6"],
    },
)
