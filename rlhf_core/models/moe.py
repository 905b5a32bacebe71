"""Mixture-of-Experts models: their routers' load-balancing loss (`--aux_loss_coef`).

transformers names the module whose output holds each MoE layer's router logits, per model class
(`_can_record_outputs["router_logits"]`, every MoE family of transformers 5: Mixtral, Qwen-MoE,
...). `RouterBalance` hooks those modules of the trained model and keeps their logits only while a
training micro-step runs (`collecting`, with gradients on: never the no-grad passes of a frozen
reference, an evaluation or a rollout; reentrant gradient checkpointing, which runs the layers
without gradients, is refused with the flag by the configs). Padding is routed too but must not count, and only the
forward helpers (`models/forward.py`) know which tokens are real: each says so after its forward
(`note_tokens`). The micro-step's loss is `algos.losses.load_balancing_loss` over the real tokens
of its forwards, all MoE layers together; `trainers.loop.optimizer_step` adds `coef` x it, weighted
like the micro-batch's loss units, so it does not depend on how the step is split.
"""

from __future__ import annotations

import contextlib

import torch

from rlhf_core.algos.losses import load_balancing_loss

ATTR = "_rlhf_router_balance"


def router_modules(model) -> list[tuple[torch.nn.Module, int]]:
    """The modules whose output (at the index given) is a layer's router logits; [] for a dense model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        return []
    cls, name = getattr(recorder, "target_class", None), getattr(recorder, "class_name", None)
    return [(m, recorder.index) for m in base.modules()
            if (cls is not None and isinstance(m, cls)) or (name and type(m).__name__.endswith(name))]


def experts_per_token(model) -> int:
    """k of the top-k routing: `num_experts_per_tok`, the name every MoE config of transformers uses."""
    k = getattr(model.config, "num_experts_per_tok", None)
    if not isinstance(k, int):
        raise ValueError(f"{type(model).__name__}: its config has no num_experts_per_tok")
    return k


class RouterBalance:
    """The load-balancing loss of one trained MoE model, with its coefficient."""

    def __init__(self, model, coef: float):
        routers = router_modules(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no Mixture-of-Experts router")
        self.coef, self.top_k = coef, experts_per_token(model)
        self._collecting = False
        self._pending: list[torch.Tensor] = []  # router logits of the forward that has not said its tokens yet
        self._rows: list[torch.Tensor] = []  # real tokens' router logits of this micro-step
        for module, index in routers:
            module.register_forward_hook(self._hook(index))
        setattr(model, ATTR, self)

    def _hook(self, index: int):
        def keep(module, inputs, output):
            if self._collecting and torch.is_grad_enabled():
                logits = output[index] if isinstance(output, (tuple, list)) else output
                self._pending.append(logits.reshape(-1, logits.shape[-1]))
        return keep

    @contextlib.contextmanager
    def collecting(self):
        self._pending, self._rows, self._collecting = [], [], True
        try:
            yield self
        finally:
            self._collecting = False

    def note(self, real: torch.Tensor) -> None:
        """The forward just made routed these tokens (`(tokens,)` bool, flattened as the model flattens them)."""
        for logits in self._pending:
            if logits.shape[0] != real.numel():
                raise RuntimeError(f"router logits of {logits.shape[0]} tokens for a batch of {real.numel()}")
            self._rows.append(logits[real.to(logits.device)])
        self._pending = []

    def loss(self) -> torch.Tensor:
        """The micro-step's load-balancing loss (0 without MoE forwards); what was kept is let go."""
        rows, pending, self._rows, self._pending = self._rows, self._pending, [], []
        if pending:
            raise RuntimeError("a forward of the MoE model did not say which of its tokens are real (note_tokens)")
        return load_balancing_loss(rows, self.top_k)


def router_balance(model) -> RouterBalance | None:
    """The balance installed on `model` (or the module a DeepSpeed engine wraps), if any."""
    return getattr(getattr(model, "module", model), ATTR, None)


def note_tokens(model, real: torch.Tensor) -> None:
    """Called by the forward helpers after each forward of `model`: its real tokens, `(rows, T)` bool."""
    balance = router_balance(model)
    if balance is not None and balance._collecting:
        balance.note(real.reshape(-1))
