"""``paco.core.host_independent``: a correctly rounded square root (checked against numpy's, the
SSE2 ``sqrtpd`` instruction, which IEEE 754 makes exact) and the fused AdamW."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paco.core import host_independent


def _inputs(n: int = 1_000_000) -> np.ndarray:
    """float32 values over the whole positive range: random bit patterns (subnormals to the
    largest finite), exact squares, their neighbours, and zeros."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x7F800000, n, dtype=np.uint32)  # every positive finite float32
    squares = (np.arange(1, 4097, dtype=np.float32) ** 2)
    near = np.concatenate([np.nextafter(squares, np.float32(0)), np.nextafter(squares, np.float32(np.inf))])
    return np.concatenate([bits.view(np.float32), squares, near, np.float32([0.0, -0.0])])


def test_sqrt_is_correctly_rounded_in_float32() -> None:
    x = _inputs()
    want = np.sqrt(x.astype(np.float64)).astype(np.float32)  # double rounding innocuous for sqrt
    assert np.array_equal(np.sqrt(x), want)  # numpy's float32 sqrt (sqrtps) agrees: the reference is exact
    got = host_independent.sqrt(torch.from_numpy(x))
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sqrt_is_correctly_rounded_for_every_16_bit_float(dtype: torch.dtype) -> None:
    """Every one of the 65,536 bit patterns: numpy's float32 square root (exact), rounded once to
    ``dtype`` (innocuous: float32 has more than twice the bits plus two)."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    with np.errstate(invalid="ignore"):  # the negative halves: NaN, as torch.sqrt
        want = torch.from_numpy(np.sqrt(x.float().numpy())).to(dtype)
    got = host_independent.sqrt(x)
    assert got.dtype == dtype
    same = (got.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), int((~same).sum())


def test_sqrt_keeps_shape_and_autograd_and_refuses_other_dtypes() -> None:
    x = torch.tensor([[0.25, 2.0], [9.0, 1e-30]], requires_grad=True)
    y = host_independent.sqrt(x)
    assert y.dtype == torch.float32 and y.shape == (2, 2)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 0.5 / np.sqrt(x.detach().double()).float(), rtol=1e-6, atol=0)
    assert torch.isnan(host_independent.sqrt(torch.tensor([-1.0]))).all()
    for bad in (torch.tensor([4]), torch.tensor([4.0], dtype=torch.float64), torch.tensor([4j])):
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            host_independent.sqrt(bad)


def test_adamw_is_torchs_fused_adamw_with_the_given_settings() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(64, 32, generator=g).requires_grad_()
    start = p.detach().double().clone()
    grads = [torch.randn(64, 32, generator=g) for _ in range(3)]
    lr, betas, eps, wd = 1e-2, (0.9, 0.99), 1e-8, 0.05
    opt = host_independent.adamw([p], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    assert opt.defaults["fused"] is True and all(g["fused"] for g in opt.param_groups)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    # AdamW (Loshchilov & Hutter 2019, torch's form: decoupled decay lr * wd) in float64
    w, m, v = start, torch.zeros_like(start), torch.zeros_like(start)
    for t, grad in enumerate(grads, start=1):
        grad = grad.double()
        w = w * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * grad
        v = betas[1] * v + (1 - betas[1]) * grad * grad
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        w = w - lr * m_hat / (v_hat.sqrt() + eps)
    assert torch.allclose(p.detach().double(), w, rtol=0, atol=1e-6)
