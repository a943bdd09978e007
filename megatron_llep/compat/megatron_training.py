"""Megatron-LM's training loop (``megatron.training``) across the megatron-core wheels that ship it.

``megatron.training`` is inside the megatron-core wheel from 0.17 on; 0.16 wheels have none
(:func:`missing_reason`). What differs between the releases, and between them and this project's
Python 3.11 CI (which runs 0.19's Python sources over a 0.16 install), lives here:

* ``pretrain()``: 0.17 parses the command line itself, inside ``initialize_megatron``, from an
  ``extra_args_provider`` and ``args_defaults``; the checks of the parsed arguments then run there,
  right before Megatron-LM sets its global arguments and starts the process group. 0.18 takes a
  ``PretrainConfigContainer`` (built from the arguments parsed beforehand) first and the model
  provider positionally; 0.19 takes the model provider as a keyword (or a model config inside the
  container). :func:`run_pretrain` calls each the way it expects, told apart by ``pretrain``'s own
  signature. Either way a check runs on the parsed arguments before Megatron-LM validates them (its
  ``validate_args``, looked up in ``initialize`` on 0.17 and in ``arguments`` on 0.18+, is wrapped),
  and Megatron-LM's own assertions there become :class:`ArgumentsRefused`.
* The tokenizer is built while parsing on 0.18+, after the checks on 0.17 (:func:`tokenizer_vocab_size`).
* ``get_batch_on_this_cp_rank``: 0.18+ require ``is_hybrid_cp``, 0.17 has no such parameter
  (:func:`batch_on_this_cp_rank`).
* ``typing.override`` (Python 3.12) is used by 0.18+'s ``megatron.training``: aliased to
  ``typing_extensions.override`` on 3.11.
* The wheels ship the dataset index helper (``megatron/core/datasets/helpers_cpp``) compiled for one
  Python (cp312) but not the Makefile Megatron-LM's ``compile_helpers()`` runs, so rank 0 exits
  inside ``initialize_megatron`` on every machine. :func:`use_dataset_helpers` keeps the shipped
  build when it imports, and otherwise compiles ``helpers.cpp`` (shipped too) once with pybind11 into
  a cache directory, as the Makefile would; :func:`check_dataset_helpers` says beforehand when it
  could not.
* Megatron-LM's loop offers no callbacks for what a supervisor needs to know: :func:`hook_checkpoint_saves`
  wraps every checkpoint save (``save_checkpoint_and_time``), and :func:`record_signal_stops` remembers
  when ``--exit-signal-handler`` stopped the run (it then exits with status 0, as after its last
  iteration).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import sysconfig
import traceback
import typing
import warnings
from typing import Any, Callable, ContextManager, Iterator, Optional

_HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


def alias_typing_override() -> None:
    """``typing.override`` (3.12) as ``typing_extensions.override`` on older Pythons."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


def missing_reason() -> Optional[str]:
    """Why Megatron-LM's loop cannot be used here (``None`` when it can); imports nothing heavy
    when the answer is no."""
    alias_typing_override()
    if importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed"
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        version = "(unknown version)"
    if importlib.util.find_spec("megatron.training") is None:
        return (f"megatron-core {version} has no megatron.training (Megatron-LM's training loop, in the megatron-core "
                "wheel from 0.17 on)")
    with warnings.catch_warnings():  # Megatron-Core's import-time notes about missing GPU extensions
        warnings.simplefilter("ignore")
        try:
            importlib.import_module("megatron.training.training")
        except ImportError as err:
            return f"megatron.training of megatron-core {version} cannot be imported: {err}"
    return None


def helpers_cache_dir() -> str:
    """Where a dataset helper compiled for this Python is kept: ``$MEGATRON_LLEP_CACHE`` or
    ``~/.cache/megatron_llep``, one subdirectory per ``helpers.cpp`` content and Python ABI."""
    from megatron.core import datasets

    source = os.path.join(os.path.dirname(datasets.__file__), "helpers.cpp")
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read() + sysconfig.get_config_var("EXT_SUFFIX").encode()).hexdigest()[:16]
    root = os.environ.get("MEGATRON_LLEP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatron_llep")
    return os.path.join(root, f"dataset_helpers_{digest}")


def _helpers_import() -> bool:
    importlib.invalidate_caches()  # a helper just compiled into a directory already searched
    try:
        importlib.import_module(_HELPERS_MODULE)
        return True
    except ImportError:
        sys.modules.pop(_HELPERS_MODULE, None)
        return False


def build_dataset_helpers() -> None:
    """Megatron-LM's ``compile_helpers()`` without its Makefile: nothing when the shipped helper
    imports; otherwise ``g++ helpers.cpp`` with pybind11 into :func:`helpers_cache_dir` (written
    atomically). Raises ``RuntimeError`` with a one-line reason when it cannot be built."""
    if _helpers_import():
        return
    from megatron.core import datasets

    target_dir = helpers_cache_dir()
    target = os.path.join(target_dir, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not os.path.exists(target):
        check_dataset_helpers()
        import pybind11

        os.makedirs(target_dir, exist_ok=True)
        partial = f"{target}.{os.getpid()}.tmp"
        source = os.path.join(os.path.dirname(datasets.__file__), "helpers.cpp")
        command = ["g++", "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                   f"-I{pybind11.get_include()}", source, "-o", partial]
        print(f"[megatron-llep] compiling megatron-core's dataset helper for this Python into {target_dir} (once)",
              flush=True)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"compiling {source} failed: {last}")
        os.replace(partial, target)
    _add_helpers_dir()
    if not _helpers_import():
        raise RuntimeError(f"{target} was built but does not import; delete {target_dir} and retry")


def check_dataset_helpers() -> None:
    """Before anything starts: ``RuntimeError`` (one line) when the dataset helper neither imports
    (shipped or built before) nor can be built here."""
    _add_helpers_dir()
    if _helpers_import():
        return
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if importlib.util.find_spec("pybind11") is None:
        raise RuntimeError(f"megatron-core's dataset helper is not built for Python {python}, and building it needs "
                           "pybind11: pip install pybind11")
    if shutil.which("g++") is None:
        raise RuntimeError(f"megatron-core's dataset helper is not built for Python {python}, and building it needs "
                           "a C++ compiler (g++) on PATH")


def _add_helpers_dir() -> None:
    from megatron.core import datasets

    directory = helpers_cache_dir()
    # created now, so the import system's finder for it exists and notices a helper that rank 0
    # compiles into it later (a finder cached for a missing directory never looks again)
    os.makedirs(directory, exist_ok=True)
    sys.path_importer_cache.pop(directory, None)
    if directory not in datasets.__path__:
        datasets.__path__.append(directory)


def use_dataset_helpers() -> None:
    """Replace ``compile_helpers()`` (rank 0 runs it inside ``initialize_megatron``, the others wait
    at the barrier after it) by :func:`build_dataset_helpers`, and let every rank import a helper
    built into the cache."""
    from megatron.core.datasets import utils as dataset_utils

    _add_helpers_dir()

    def compile_helpers() -> None:
        try:
            build_dataset_helpers()
        except RuntimeError as err:
            print(f"[megatron-llep] error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    dataset_utils.compile_helpers = compile_helpers


class ArgumentsRefused(Exception):
    """Megatron-LM's own checks refused the arguments: an ``AssertionError`` while it validated them or
    set up its global state from them. The message is the assertion's, or the asserting source line
    when it has none (Megatron-LM asserts many flags bare)."""


def _assertion_message(err: AssertionError) -> str:
    message = " ".join(str(err).split())
    if message:
        return message
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{(frame.line or 'assert').strip()} ({os.path.basename(frame.filename)}:{frame.lineno})"


@contextlib.contextmanager
def _assertions_refuse() -> Iterator[None]:
    """An ``AssertionError`` raised inside becomes :class:`ArgumentsRefused`."""
    try:
        yield
    except AssertionError as err:
        raise ArgumentsRefused(_assertion_message(err)) from err


def run_pretrain(extra_args_provider: Callable, args_defaults: dict, precheck_args: Callable[[Any], None],
                 check_args: Callable[[Any], None], dataset_provider: Callable, model_provider: Callable,
                 forward_step: Callable) -> None:
    """``megatron.training.pretrain`` for a GPT model built by ``model_provider``, on Megatron-LM's
    command line with ``extra_args_provider``'s flags and ``args_defaults``. ``precheck_args`` gets the
    parsed arguments before Megatron-LM validates them (to name the flags its bare assertions would
    refuse), ``check_args`` the validated ones, before the process group starts and before any model is
    built. Raises :class:`ArgumentsRefused` when Megatron-LM's validation asserts."""
    from megatron.core.enums import ModelType
    from megatron.training import arguments, training

    parameters = list(inspect.signature(training.pretrain).parameters)
    if "cfg_container" not in parameters:
        # 0.17: (train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, ...,
        # extra_args_provider, args_defaults, ...): it parses the command line itself
        with _checked_while_initializing(precheck_args, check_args):
            training.pretrain(dataset_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                              extra_args_provider=extra_args_provider, args_defaults=args_defaults)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    with _checked_call(arguments, "validate_args", precheck_args), _assertions_refuse():
        args = arguments.parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    check_args(args)
    with warnings.catch_warnings():  # "a ModelConfig is recommended": this model comes from model_provider
        warnings.simplefilter("ignore")
        container = pretrain_cfg_container_from_args(args, None)
    if parameters[2] == "model_provider":
        # 0.18: (cfg_container, datasets_provider, model_provider, model_type, forward_step_func, ...)
        training.pretrain(container, dataset_provider, model_provider, ModelType.encoder_or_decoder, forward_step)
    else:  # 0.19: (cfg_container, datasets_provider, model_type, forward_step_func, model_provider=None, ...)
        training.pretrain(container, dataset_provider, ModelType.encoder_or_decoder, forward_step,
                          model_provider=model_provider)


@contextlib.contextmanager
def _checked_call(module: Any, name: str, check: Callable[[Any], None]) -> Iterator[None]:
    """``module.<name>(args, ...)`` (looked up by name by its caller) runs ``check(args)`` first, and
    its assertions are refusals."""
    original = getattr(module, name)

    @functools.wraps(original)
    def checked(args: Any, *rest: Any, **kwargs: Any) -> Any:
        check(args)
        with _assertions_refuse():
            return original(args, *rest, **kwargs)

    setattr(module, name, checked)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _checked_while_initializing(precheck_args: Callable[[Any], None],
                                check_args: Callable[[Any], None]) -> Iterator[None]:
    """0.17's ``initialize_megatron`` parses and validates the arguments (``validate_args``), then hands
    them to ``set_global_variables`` before starting the process group: ``precheck_args`` runs before the
    validation, ``check_args`` before ``set_global_variables``; the assertions of both are refusals."""
    from megatron.training import initialize

    with _checked_call(initialize, "set_global_variables", check_args), \
            _checked_call(initialize, "validate_args", precheck_args):
        yield


def tokenizer_vocab_size(args: Any) -> int:
    """The vocabulary size of the tokenizer Megatron-LM trains with (before padding): 0.18+ built it
    while parsing, before the checks run; 0.17 builds it later (``set_global_variables``), so it is
    built here for the checks."""
    from megatron.training import global_vars

    if global_vars._GLOBAL_TOKENIZER is not None:
        return global_vars._GLOBAL_TOKENIZER.vocab_size
    return global_vars.build_tokenizer(args).vocab_size


def batch_on_this_cp_rank(batch: dict, cp_group: Any) -> dict:
    """Megatron's ``get_batch_on_this_cp_rank`` (plain, not hybrid, context parallelism)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:  # 0.18+
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


_around_saves: Optional[Callable[[int, bool], ContextManager]] = None  # hook_checkpoint_saves's
_signal_stop = {"signum": 0}


def hook_checkpoint_saves(around: Callable[[int, bool], ContextManager]) -> None:
    """Run every checkpoint save of Megatron-LM's loop (the interval, signal, exit and final ones: its
    ``save_checkpoint_and_time``) inside ``around(iteration, async_save)``. A second call replaces
    ``around``."""
    global _around_saves
    from megatron.training import get_args, training

    if _around_saves is None:
        original = training.save_checkpoint_and_time
        signature = inspect.signature(original)

        @functools.wraps(original)
        def save_checkpoint_and_time(*call_args: Any, **call_kwargs: Any) -> Any:
            iteration = signature.bind(*call_args, **call_kwargs).arguments["iteration"]
            with _around_saves(iteration, bool(get_args().async_save)):
                return original(*call_args, **call_kwargs)

        training.save_checkpoint_and_time = save_checkpoint_and_time
    _around_saves = around


def record_signal_stops() -> None:
    """From now on, :func:`signal_stop` tells whether ``--exit-signal-handler`` stopped the run: its
    handler's collective check (every rank sees every rank's flag) is recorded when it finds a signal."""
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    _signal_stop["signum"] = 0
    original = DistributedSignalHandler.signals_received
    if getattr(original, "llep_recorded", False):
        return

    @functools.wraps(original)
    def signals_received(self: Any) -> Any:
        received = original(self)
        if any(received):
            _signal_stop["signum"] = int(self.sig)
        return received

    signals_received.llep_recorded = True  # type: ignore[attr-defined]
    DistributedSignalHandler.signals_received = signals_received


def signal_stop() -> Optional[tuple[int, int]]:
    """The signal that stopped Megatron-LM's training (after :func:`record_signal_stops`) and the last
    iteration it ran (and saved, with ``--save``); None if none stopped it."""
    if not _signal_stop["signum"]:
        return None
    from megatron.training import get_args

    # the loop sets curr_iteration before a step, then counts the step and checks the signal
    return _signal_stop["signum"], get_args().curr_iteration + 1
