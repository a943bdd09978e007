"""Megatron-Core's static-batching text generation, built the same way on 0.16 to 0.19.

The pieces are Megatron's own: ``StaticInferenceEngine`` in its legacy static-batching mode (the
scheduler), ``TextGenerationController`` (the prefill + decode loop, sampling, log-probs, stop at
the end-of-document id), ``GPTInferenceWrapper`` (the forward calls) and ``StaticInferenceContext``
(the KV cache the attention layers fill). What differs between releases:

* 0.16 describes the model to the wrapper and the KV cache with an ``InferenceWrapperConfig``
  (``StaticInferenceContext.from_config``, ``GPTInferenceWrapper(model, config, context)``); from
  0.17 on that class is gone: ``StaticInferenceContext(max_batch_size, max_sequence_length)`` and
  ``GPTInferenceWrapper(model, context)``, the rest read from the model's config;
* ``StaticInferenceEngine(legacy=False)`` means the dynamic engine (paged KV cache) in both; it needs
  flash-attn (0.16: at its CUDA-graph warm-up; 0.19: ``flash attn v2.7.3 and above is required for
  dynamic batching`` in every attention layer), and 0.19's default MoE inference dispatcher needs
  NVLink symmetric memory: ``legacy=True`` is asked for explicitly (0.16 falls back to it with a
  warning anyway).

* 0.19's engine module registers faulthandler stack dumps on SIGTERM and SIGINT; they are removed here.
* 0.19's engine marks the whole process as inferring (``InferenceMode``) from its construction on,
  after which a forward with labels (a loss evaluation beside generation) fails; here the mark is
  held only while :func:`generate` runs (0.16 has no such mark).

Works on CPU with :mod:`megatron_llep.testing.cpu_gloo` enabled (its events time the decode steps).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import warnings
from typing import Any, Iterator, Optional

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.engines import StaticInferenceEngine
from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

try:  # 0.16 only
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
except ImportError:
    InferenceWrapperConfig = None
try:  # 0.19 on
    from megatron.core.inference.utils import InferenceMode
except ImportError:
    InferenceMode = None

# Megatron-Core's data-parallel inference coordinator, imported with the engines (0.19), registers a stack
# dump of every rank on SIGTERM and SIGINT: a run stopped by a signal ends in launch/torchrun.py's one line
for _stop_signal in (signal.SIGTERM, signal.SIGINT):
    faulthandler.unregister(_stop_signal)


@contextlib.contextmanager
def _inference_mode(active: bool) -> Iterator[None]:
    """Megatron's process-wide "an engine is using the model" mark set to ``active`` inside the block."""
    if InferenceMode is None:
        yield
        return
    previous = InferenceMode.is_active()
    (InferenceMode.set_active if active else InferenceMode.unset_active)()
    try:
        yield
    finally:
        (InferenceMode.set_active if previous else InferenceMode.unset_active)()


def generate(engine: StaticInferenceEngine, requests: list[InferenceRequest]) -> list[InferenceRequest]:
    """``engine.generate`` over ``requests`` (finished requests back), the process marked as inferring
    only meanwhile."""
    with _inference_mode(True):
        return engine.generate(inference_requests=requests)


def static_inference_engine(
    model: torch.nn.Module,
    tokenizer: Any,
    max_batch_size: int,
    max_sequence_length: int,
    seed: int,
    wrapper_class: type = GPTInferenceWrapper,
    controller_class: type = TextGenerationController,
) -> StaticInferenceEngine:
    """Megatron's static-batching engine over ``model`` (a bare ``GPTModel``) with a KV cache for
    ``max_batch_size`` sequences of up to ``max_sequence_length`` tokens. ``tokenizer`` needs what
    the controller reads: ``eod``, ``bos``, ``detokenize(ids)``, ``tokenize(text)``. Sampling is seeded
    with ``seed``. ``wrapper_class`` / ``controller_class``: subclasses of ``GPTInferenceWrapper`` /
    ``TextGenerationController`` (their constructors as the base classes')."""
    config = model.config
    if InferenceWrapperConfig is not None:
        wrapper_config = InferenceWrapperConfig(
            hidden_size=config.hidden_size, params_dtype=config.params_dtype,
            inference_batch_times_seqlen_threshold=-1,  # pipeline stages: the whole batch at once
            padded_vocab_size=model.vocab_size, inference_max_requests=max_batch_size,
            inference_max_seq_length=max_sequence_length, fp32_residual_connection=config.fp32_residual_connection,
        )
        wrapper = wrapper_class(model, wrapper_config, StaticInferenceContext.from_config(wrapper_config))
    else:
        wrapper = wrapper_class(model, StaticInferenceContext(max_batch_size, max_sequence_length))
    controller = controller_class(wrapper, tokenizer)
    controller.sampling_rng.manual_seed(seed)
    with warnings.catch_warnings(), _inference_mode(False):  # the mark: only while generate() runs
        warnings.filterwarnings("ignore", message="The static engine will be deprecated")
        return StaticInferenceEngine(controller, max_batch_size=max_batch_size, random_seed=seed, legacy=True)


def inference_request(request_id: int, prompt: str, prompt_tokens: list[int], sampling: SamplingParams) -> InferenceRequest:
    """A request whose prompt is already tokenized (chat templates are rendered by the caller)."""
    return InferenceRequest(request_id=request_id, prompt=prompt, sampling_params=sampling, prompt_tokens=prompt_tokens)


def sampling_params(max_new_tokens: int, temperature: float = 1.0, top_k: int = 1, top_p: float = 0.0,
                    log_probs: bool = True) -> SamplingParams:
    """Megatron's sampling parameters: ``top_k=1`` is greedy; ``top_k`` and ``top_p`` exclude each other."""
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, return_log_probs=log_probs,
                          num_tokens_to_generate=max_new_tokens)


def generated(request: InferenceRequest) -> tuple[list[int], Optional[list[float]]]:
    """A finished request's generated token ids (the end-of-document token excluded) and their
    log-probs (None when not asked for)."""
    tokens = request.generated_tokens
    tokens = tokens.tolist() if torch.is_tensor(tokens) else list(tokens or [])
    log_probs = request.generated_log_probs
    if log_probs is not None:
        log_probs = log_probs.tolist() if torch.is_tensor(log_probs) else list(log_probs)
    return tokens, log_probs
