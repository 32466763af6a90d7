"""Operations whose bytes do not depend on the CPU: what the trainers use where torch's default
CPU kernel rounds differently on different hosts under the pinned code paths
(:mod:`paco.core.numerics`).

``torch.sqrt`` of a float32 CPU tensor goes through MKL's vector math (VML), which is not
correctly rounded on MKL's ``COMPATIBLE`` branch and rounds other elements on an Intel and an AMD
CPU: consistent with an approximate reciprocal square root refined by Newton's method, whose
first estimate is each CPU's own (not checked in MKL's code). ``exp``, ``log``, ``tanh``,
``erf``, ``sin``, ``cos``, ``pow``, ``rsqrt``, the GEMMs and the convolutions gave the same bytes
on both (``benchmarks/numerics_fingerprint.py`` finds such kernels; its figures are in
docs/numerics.md). ``torch.optim.AdamW``'s default (for-each) step takes that ``sqrt``
of its second moment; its fused CPU kernel (ATen's own, vectorised) takes the exact one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float32, bfloat16 or float16 tensor, elementwise, in
    its dtype and device, with autograd: ``torch.sqrt`` in float64, rounded once to ``x``'s dtype.
    IEEE 754 makes a correctly rounded result unique, so it is the same on every host;
    ``torch.sqrt`` of a float32 CPU tensor is not (module docstring).

    Why rounding the float64 root is exact although torch's float64 CPU ``sqrt`` is MKL's vector
    math too, and not always correctly rounded itself (about 1.4 % of random float64 inputs are one
    unit in the last place off): the square root of a float32 is never a float32 rounding
    midpoint, and it lies at least about 2**-50 (relative) away from every midpoint, while the
    float64 root is within a few float64 units (2**-52 relative) of the true one, so both round to
    the same float32. ``tests/test_host_independent.py`` checks it against numpy's (the SSE
    ``sqrtps`` / ``sqrtpd`` instructions, which IEEE 754 makes exact) on a million float32 inputs
    and on every float16 and bfloat16.

    Args:
        x: a float32, bfloat16 or float16 tensor of any shape; negative elements give NaN, as
            ``torch.sqrt``.

    Raises:
        TypeError: any other dtype (float64 has no wider type to round from here; integer and
            complex tensors have no such square root).
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"sqrt takes a float32, bfloat16 or float16 tensor, got {x.dtype}")
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
