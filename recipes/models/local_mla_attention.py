"""Multi-latent attention without Transformer Engine.

Megatron-Core 0.16's local (non-TE) MLA spec builds ``DotProductAttention``, which does not take
MLA's separate query/key and value head widths (``k_channels``/``v_channels``) and so cannot be
built. The math itself needs nothing TE-specific: this subclass accepts the two widths and sizes
its output by the value width, so DeepSeek-V3's architecture runs on CPU (tiny recipes, tests).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` for query/key heads of width ``k_channels`` and value heads of
    width ``v_channels`` (MLA's softmax scale is passed in by MLASelfAttention)."""

    def __init__(self, *args: Any, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def for_each_mla_spec(spec: Any, fn: Callable[[ModuleSpec], None]) -> Any:
    """Call ``fn`` on every ``ModuleSpec`` of an ``MLASelfAttention`` (or subclass) inside a
    (block, layer or MTP) spec; returns the spec."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def visit(node: Any) -> None:
        if isinstance(node, ModuleSpec):
            if isinstance(node.module, type) and issubclass(node.module, MLASelfAttention):
                fn(node)
            visit(node.submodules)
        elif isinstance(node, (list, tuple)):
            for child in node:
                visit(child)
        elif hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                visit(getattr(node, name))

    visit(spec)
    return spec


def use_local_mla_attention(spec: Any) -> Any:
    """Swap ``DotProductAttention`` for :class:`MLADotProductAttention` inside every MLA
    self-attention of a (block or layer) spec, in place; returns the spec."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        # 0.16 sets HAVE_TE from an import that succeeds without TE, then isinstance()s against
        # the None placeholder; without TE the flag must be False.
        multi_latent_attention.HAVE_TE = False

    def swap(node: ModuleSpec) -> None:
        if getattr(node.submodules, "core_attention", None) is DotProductAttention:
            node.submodules.core_attention = MLADotProductAttention

    return for_each_mla_spec(spec, swap)
