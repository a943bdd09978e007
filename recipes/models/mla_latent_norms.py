"""Multi-latent attention's latent norms as DeepSeek (and transformers' DeepseekV3) build them.

* eps: Megatron-Core (0.16-0.19) builds ``q_layernorm`` and ``kv_layernorm`` with
  ``config.layernorm_epsilon``; DeepSeek's ``q_a_layernorm`` / ``kv_a_layernorm`` always use 1e-6,
  whatever ``rms_norm_eps`` the other norms use. :func:`exact_mla_latent_norms` builds the two
  latent norms with their own eps (an unfused norm where Transformer Engine would fuse it into the
  up-projection with the config's eps).
* no query LoRA (``q_lora_rank`` None, DeepSeek-V2-Lite style): queries are one plain ``q_proj``
  with no norm. The layer spec still names a ``q_layernorm``; 0.16 ignores it, 0.19's
  ``QKNormConfigResolver`` refuses it and, without it, wants a fused norm + linear ``q_proj`` (a
  norm DeepSeek does not have). The spec gets no q norm and, on 0.19, an ``MLASelfAttention`` whose
  ``q_proj`` is the spec's plain linear.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from recipes.models.local_mla_attention import for_each_mla_spec

# DeepSeek-V3 / transformers' DeepseekV3RMSNorm default, used by q_a_layernorm and kv_a_layernorm
DEEPSEEK_LATENT_NORM_EPS = 1e-6

HAS_QK_NORM_RESOLVER = hasattr(MLASelfAttention, "_resolve_qk_norm_config")  # Megatron-Core 0.19+


class _FixedEpsNorm:
    """A norm builder ignoring the eps Megatron passes (``norm`` built with ``eps`` instead)."""

    norm: Any = None
    eps: float = DEEPSEEK_LATENT_NORM_EPS

    def __new__(cls, *args: Any, eps: Optional[float] = None, **kwargs: Any):
        return build_module(cls.norm, *args, eps=cls.eps, **kwargs)


def fixed_eps_norm(norm: Any, eps: float) -> type:
    """A norm class (Megatron ``build_module``-able, any version) that builds ``norm`` with ``eps``."""
    if isinstance(norm, type) and issubclass(norm, _FixedEpsNorm):
        norm = norm.norm
    name = getattr(norm, "__name__", None) or getattr(getattr(norm, "module", None), "__name__", "Norm")
    return type(f"{name}Eps{eps:g}", (_FixedEpsNorm,), dict(norm=norm, eps=eps))


if HAS_QK_NORM_RESOLVER:

    class NoQLoRAMLASelfAttention(MLASelfAttention):
        """Megatron-Core 0.19+: MLA without a query LoRA builds ``linear_q_proj`` as the spec's
        plain linear (no norm), as DeepSeek's ``q_proj``; the key/value side resolves as usual."""

        def _resolve_qk_norm_config(self, submodules):
            from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

            resolver = QKNormConfigResolver(self.config, submodules)
            resolver.has_q_lora = True  # resolve the kv side (the q side's answer is replaced below)
            resolved = resolver.resolve()
            linear = submodules.linear_q_proj or resolver.linear_impl
            if resolver._is_fused_norm_linear(linear):
                raise ValueError(f"linear_q_proj={linear} fuses a norm DeepSeek's q_proj does not have")
            resolved.update(linear_q_proj=linear, linear_q_up_proj=IdentityOp, q_layernorm=IdentityOp)
            return resolved
else:
    NoQLoRAMLASelfAttention = None


def _te_unfused(eps: float):
    """(norm, plain column-parallel linear) of Transformer Engine, to unfuse a latent norm."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    return fixed_eps_norm(TENorm, eps), TEColumnParallelLinear


def _is_fused(linear: Any) -> bool:
    module = linear.module if isinstance(linear, ModuleSpec) else linear
    return getattr(module, "__name__", "") == "TELayerNormColumnParallelLinear"


def exact_mla_latent_norms(spec: Any, config: Any, eps: float = DEEPSEEK_LATENT_NORM_EPS) -> Any:
    """Every ``MLASelfAttention`` of a (block, layer or MTP) spec, in place: latent norms built with
    ``eps`` where ``config.layernorm_epsilon`` differs, and no query norm without a query LoRA
    (module docstring). Returns the spec."""
    other_eps = float(config.layernorm_epsilon) != float(eps)
    no_q_lora = config.q_lora_rank is None

    def fix(submodules: Any) -> None:
        pairs = [("kv_layernorm", "linear_kv_up_proj")]
        if no_q_lora:
            submodules.q_layernorm = IdentityOp
        else:
            pairs.append(("q_layernorm", "linear_q_up_proj"))
        if not other_eps:
            return
        for norm_name, linear_name in pairs:
            norm = getattr(submodules, norm_name)
            if norm not in (None, IdentityOp):
                setattr(submodules, norm_name, fixed_eps_norm(norm, eps))
            elif _is_fused(getattr(submodules, linear_name)):
                te_norm, te_linear = _te_unfused(eps)
                setattr(submodules, norm_name, te_norm)
                setattr(submodules, linear_name, te_linear)
            else:
                raise ValueError(f"MLA spec: {norm_name}={norm} with {linear_name}={getattr(submodules, linear_name)}: "
                                 f"no latent norm to build with eps {eps:g}")

    def visit(node: ModuleSpec) -> None:
        fix(node.submodules)
        if no_q_lora and NoQLoRAMLASelfAttention is not None and node.module is MLASelfAttention:
            node.module = NoQLoRAMLASelfAttention

    return for_each_mla_spec(spec, visit)
