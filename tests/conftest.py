"""The suite's layout: one folder per part of the project it tests (planning, runtime, placement,
integrations, entry_points, hf, benchmarks, docs, launch), the scripts tests launch on several ranks in
workers/. Tests import workers and each other's helpers by module name, and benchmarks' ``common``."""

import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
FOLDERS = [os.path.join(TESTS, name) for name in sorted(os.listdir(TESTS)) if not name.startswith(("_", "."))]
for path in [folder for folder in FOLDERS if os.path.isdir(folder)] + [os.path.join(ROOT, "benchmarks")]:
    sys.path.insert(0, path)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _versions():
    """Which Megatron-Core and torch this run tests (CI runs the suite against more than one Megatron-Core)."""
    import importlib.metadata
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Megatron's "Transformer Engine and Apex are not installed" notes
            import megatron.core

        mcore = f"{megatron.core.__version__} ({os.path.dirname(megatron.core.__file__)})"
    except ImportError as exc:
        try:
            dist = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            dist = "not installed"
        mcore = f"cannot be imported: {exc!r} (distribution: {dist})"
    try:
        import torch

        torch_version = torch.__version__
    except ImportError as exc:
        torch_version = f"cannot be imported: {exc!r}"
    return [f"megatron-core: {mcore}", f"torch: {torch_version}"]


def pytest_report_header(config):
    return _versions()


def pytest_report_collectionfinish(config, start_path, items):
    # `pytest -q` (the README's and CI's command) hides the header above: say it after collection instead.
    return _versions() if config.option.verbose < 0 else []
