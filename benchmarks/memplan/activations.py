"""The memory plan's activations: the bytes per token a transformer block saves for the backward,
measured on the device by :class:`BlockProbe` (the GPU smoke, bf16 at the real widths on CUDA) or
estimated by :func:`analytic_bytes_per_token`, and :func:`bytes_per_token`, which picks one."""

from __future__ import annotations

from typing import Any

from memplan.models import JUDGE_BLOCK, QWEN2_5_VL_7B

#: block classes :class:`BlockProbe` measures in the smoke, and the measured class standing in for each
PROBED = ("FluxTransformerBlock", "FluxSingleTransformerBlock", JUDGE_BLOCK)
PROXY = {"QwenImageTransformerBlock": "FluxTransformerBlock"}


class BlockProbe:
    """Saved-activation bytes per token of the block classes ``names``, measured on the device.

    Global forward hooks (``torch.nn.modules.module.register_module_forward_[pre_]hook``) read
    ``memory_fn()`` (default ``torch.cuda.memory_allocated``) before and after the forward of
    every module whose class name is in ``names`` while gradients are enabled (the training
    forward; rollouts and evaluation run under ``no_grad``); the difference is what the block
    leaves allocated for the backward (saved tensors and its output). Tokens: ``shape[0] *
    shape[1]`` summed over the 3-D tensors the block returns (batch x sequence of each stream).

    ``result()``: ``{class: {"bytes_per_token", "tokens", "calls"}}``, the largest ratio over the
    calls. ``enabled=False`` (no CUDA) registers nothing and gives ``{}``.
    """

    def __init__(self, names: tuple[str, ...] = PROBED, *, enabled: bool = True, memory_fn: Any = None):
        self.names, self.enabled, self.memory_fn = set(names), enabled, memory_fn
        self.found: dict[str, dict[str, float]] = {}
        self._before: dict[int, list[int]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> BlockProbe:
        if not self.enabled:
            return self
        import torch

        if self.memory_fn is None:
            self.memory_fn = torch.cuda.memory_allocated
        mm = torch.nn.modules.module
        self._handles = [mm.register_module_forward_pre_hook(self._pre), mm.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: Any, args: Any) -> None:
        import torch

        if type(module).__name__ in self.names and torch.is_grad_enabled():
            self._before.setdefault(id(module), []).append(self.memory_fn())

    def _post(self, module: Any, args: Any, output: Any) -> None:
        stack = self._before.get(id(module))
        if type(module).__name__ not in self.names or not stack:
            return
        delta = self.memory_fn() - stack.pop()
        outs = output if isinstance(output, (tuple, list)) else (output,)
        tokens = sum(int(o.shape[0] * o.shape[1]) for o in outs if hasattr(o, "shape") and len(o.shape) == 3)
        if tokens <= 0 or delta <= 0:
            return
        row = self.found.setdefault(type(module).__name__, {"bytes_per_token": 0.0, "tokens": 0, "calls": 0})
        row["calls"] += 1
        if delta / tokens > row["bytes_per_token"]:
            row.update(bytes_per_token=delta / tokens, tokens=tokens)

    def result(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self.found.items()}


def block_widths(block: str) -> tuple[int, int, int]:
    """(width, MLP width, MLP input projections: 1 GELU / 2 gated) of a block class."""
    if block == JUDGE_BLOCK:
        t = QWEN2_5_VL_7B["text_config"]
        return t["hidden_size"], t["intermediate_size"], 2
    h = 24 * 128  # FLUX.1 and Qwen-Image: 24 heads x 128
    return h, 4 * h, 1


def analytic_bytes_per_token(block: str) -> float:
    """Estimated saved-activation bytes per token of one block in 16-bit: ``2 * (9 h + (1 + g) f)``
    for width ``h``, MLP width ``f`` and ``g`` gated input projections, i.e. ``34 h`` for a 4x GELU
    MLP (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    §4.1: ``34 s b h`` per layer without the attention-score term, which flash attention does not
    store); FLUX's single block adds its concatenated ``(h + f)`` input of ``proj_out``."""
    h, f, g = block_widths(block)
    extra = 2 * (h + f) if block == "FluxSingleTransformerBlock" else 0
    return 2.0 * (9 * h + (1 + g) * f) + extra


def bytes_per_token(block: str, measured: dict[str, dict[str, float]] | None) -> tuple[float, str]:
    """(bytes per token, source) of ``block``: measured (directly, or through :data:`PROXY`) when
    ``measured`` holds it, else :func:`analytic_bytes_per_token`."""
    key = PROXY.get(block, block)
    if measured and key in measured:
        return float(measured[key]["bytes_per_token"]), "measured" if key == block else f"measured ({key})"
    return analytic_bytes_per_token(block), "analytic"
