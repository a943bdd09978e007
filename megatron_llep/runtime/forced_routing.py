"""Forcing a routing onto a real Megatron router (a test and benchmark tool: forced routing is
never evidence), through Megatron's own RouterReplay."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction


def force_routing(router: TopKRouter, expert_ids: Optional[np.ndarray]) -> None:
    """Make ``router``'s next forwards choose ``expert_ids`` (``[tokens, K]``); ``None`` clears it.

    Uses Megatron's own RouterReplay (the router needs ``moe_enable_routing_replay=True``), so the
    probabilities are the router's real scores gathered at the forced experts, with their gradients.
    """
    replay = router.router_replay
    if replay is None:
        raise ValueError("force_routing needs a router built with moe_enable_routing_replay=True")
    replay.clear_indices()
    if expert_ids is None:
        replay.clear_router_replay_action()
        return
    replay.set_target_indices(torch.as_tensor(expert_ids, dtype=torch.long))
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
