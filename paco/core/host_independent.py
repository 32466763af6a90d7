"""Operations whose bytes do not depend on the CPU: what the trainers use where torch's default
CPU kernel rounds differently on different hosts under the pinned code paths
(:mod:`paco.core.numerics`).

Found with ``benchmarks/numerics_fingerprint.py`` under QEMU's emulated AMD EPYC-Rome on an
Intel Xeon (docs/numerics.md): ``torch.sqrt`` of a float32 CPU tensor goes through MKL's vector
math (VML) and is not correctly rounded on MKL's ``COMPATIBLE`` branch (10,774 of 65,536 random
inputs one unit in the last place off, torch 2.13), and the emulated AMD CPU rounded other
elements (9,952 off, other bytes), as an approximate reciprocal square root refined by Newton's
method would: its first estimate is the CPU's own. ``exp``, ``log``, ``tanh``, ``erf``, ``sin``,
``cos``, ``pow``, ``rsqrt``, the GEMMs and the convolutions gave the same bytes on both.
``torch.optim.AdamW``'s default (for-each) step takes that ``sqrt`` of its second moment; its
fused CPU kernel (ATen's own, vectorised) takes the exact one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of ``x``, elementwise, in ``x``'s dtype and device, with
    autograd: ``sqrt`` in float64, then rounded to float32 / bfloat16 / float16 (a float64 input
    stays float64). IEEE 754 makes a correctly rounded result unique, so it is the same on every
    host; ``torch.sqrt`` of a float32 CPU tensor is not (module docstring).

    Rounding twice is innocuous here: float64 carries more than twice float32's 24 significand
    bits plus two, the condition under which rounding a correctly rounded float64 square root to
    float32 gives the correctly rounded float32 one (Figueroa, "When is double rounding
    innocuous?", 1995). ``tests/test_host_independent.py`` checks it against numpy's (the SSE2
    ``sqrtpd`` instruction) on a million inputs.

    Args:
        x: a floating-point tensor of any shape; negative elements give NaN, as ``torch.sqrt``.

    Raises:
        TypeError: an integer or complex tensor.
    """
    if not x.is_floating_point():
        raise TypeError(f"sqrt takes a real floating-point tensor, got {x.dtype}")
    if x.dtype == torch.float64:
        return torch.sqrt(x)
    return torch.sqrt(x.double()).to(x.dtype)


def adamw(params: Iterable[Any], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, fused=True, **kwargs)``: torch's fused AdamW kernel (CPU and
    CUDA), whose square root of the second moment is exact, where the default for-each step's CPU
    ``sqrt`` depends on the host (module docstring). The update is AdamW's (Loshchilov & Hutter,
    2019) with torch's defaults for what ``kwargs`` leaves out.

    Raises:
        RuntimeError: a parameter on a device or of a dtype the fused kernel does not take (torch's
            own error).
    """
    return torch.optim.AdamW(params, fused=True, **kwargs)
