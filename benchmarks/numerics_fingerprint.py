"""Where two hosts' bytes part: hashes of the numeric kernels, of a judge training step and a policy
sample module by module, and of a repro's artifacts, recorded on one host and compared on another.

    PACO_NUM_THREADS=2 dvc repro     # for --data: the record's thread count on any number of cores
    python benchmarks/numerics_fingerprint.py --out host.json [--data data] [--compare other.json]
        [--label NAME]

Every stage pins the CPU code paths (:mod:`paco.core.numerics`) so that a run's bytes should not
depend on the host; this script checks that claim piece by piece. It runs in a stage process's
numerics (``import stages`` first) with the stages' 2 torch threads (``--threads``: the same on
both hosts) and writes a
JSON of SHA-256 prefixes (16 hex digits) in four sections:

* ``kernels``: each library kernel the stages run, at the tiny models' sizes, on inputs drawn
  from fixed seeds: MKL's GEMM (``linear`` / ``bmm`` forward and backward, aligned and unaligned
  operands), oneDNN's (the judge's 3-D patch convolution, GELU), torch's own (2-D convolution and
  its transpose, softmax, norms, attention forward and backward, transcendental functions,
  reductions, interpolation, AdamW for-each and fused, the CPU generator), MKL's vector math
  (``torch.sqrt``) beside :func:`paco.core.host_independent.sqrt`, numpy's and OpenBLAS's, scipy's,
  Pillow's and scikit-image's;
* ``judge_step`` (with ``--data``: ``models/judge_base``, ``reasons/sft.parquet`` and
  ``params.yaml``'s ``reward_train``): two LoRA training steps of ``reward_train`` on its first
  training rows (their augmented views of epoch 0): every module's output in forward order, the
  loss, every LoRA gradient and every LoRA weight after each step of the trainers' AdamW
  (:func:`paco.core.host_independent.adamw`). The first entry that
  differs between two hosts is the first kernel whose bytes the host changed;
* ``policy_step`` (with ``--data``: ``models/<grpo.t2is.policy>``, ``prompts/prompts.parquet``):
  the t2is policy as ``grpo@t2is`` runs it, every transformer and VAE module output of a
  sampled trajectory and its decode, the log-probs and one transition's LoRA gradients;
* ``artifacts`` (with ``--data``): every file a repro wrote under ``--data`` except logs,
  ``report.json`` (timings) and ``checkpoints/`` (persisted state; ``rng-*.pt`` holds global
  generator states no draw uses).

``--compare`` prints, per section, how many entries match and the first ones that differ, in
the order they were computed. Nothing here asserts: two hosts that differ are a finding to
report (docs/numerics.md), and the JSON records each host's CPU, its flags and the library
versions, so a difference can be put down to the host or to a library version.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline

import numpy as np  # noqa: E402
import torch  # noqa: E402

from paco.core import host_independent  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "transformers", "diffusers", "peft", "accelerate", "numpy", "scipy", "pillow",
             "scikit-image", "tokenizers", "safetensors", "pandas", "pyarrow")
#: CPU flags that decide which code path a library could pick
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
         "amx_tile", "amx_bf16", "avx_vnni", "sse4a", "fma4")


def digest(x) -> str:
    """SHA-256 prefix of a tensor's, array's or bytes' exact bytes (dtype and shape included)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous().cpu()
        head = f"{x.dtype}{tuple(x.shape)}".encode()
        body = x.reshape(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b""
    elif isinstance(x, np.ndarray):
        head, body = f"{x.dtype}{x.shape}".encode(), np.ascontiguousarray(x).tobytes()
    elif isinstance(x, (bytes, bytearray)):
        head, body = b"bytes", bytes(x)
    else:
        head, body = b"repr", repr(x).encode()
    return hashlib.sha256(head + b"|" + body).hexdigest()[:16]


def _git_commit(where: Path) -> str | None:
    """``git rev-parse --short HEAD`` in ``where``, or ``None`` (no git, not a checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def host(label: str | None = None) -> dict:
    """The CPU (``/proc/cpuinfo``'s first processor, which under ``qemu-user`` is the real host's:
    ``cpuid_features`` are what the process itself sees, as numpy's dispatcher reads them from
    CPUID, so an emulated CPU shows there), its code-path flags, the library versions and the
    numerics variables this process runs with."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:  # numpy >= 2; numpy 1.x keeps it under numpy.core
        from numpy._core._multiarray_umath import __cpu_features__ as cpuid
    except ImportError:
        from numpy.core._multiarray_umath import __cpu_features__ as cpuid

    from paco.core.numerics import FIXED_CPU_ISA_ENV, FIXED_THREAD_ENV

    names = ("AVX2", "FMA3", "F16C", "AVX512F", "AVX512BW", "AVX512_SPR", "AVX512_ICL")
    seen = sorted(k for k in names if cpuid.get(k))
    return {"label": label, "commit": _git_commit(ROOT), "cpuid_features": seen,
            "cpu": info.get("model name", platform.processor()), "vendor": info.get("vendor_id"),
            "family_model_stepping": [info.get("cpu family"), info.get("model"), info.get("stepping")],
            "cache_size": info.get("cache size"), "cores": os.cpu_count(),
            "flags": sorted(f for f in FLAGS if f in flags), "python": platform.python_version(),
            "versions": versions, "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in (*FIXED_CPU_ISA_ENV, *FIXED_THREAD_ENV, "OMP_NUM_THREADS")}}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).requires_grad_(grad)


def kernels() -> dict[str, str]:
    """Each kernel's output hash, keyed ``library.kernel[size]`` (``.i``: its i-th output), in a
    fixed order: torch's (MKL, oneDNN, ATen), then numpy's, OpenBLAS's, scipy's, Pillow's and
    scikit-image's."""
    out: dict[str, str] = {}

    def put(name: str, fn: Callable[[], object]) -> None:
        value = fn()
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                out[f"{name}.{i}"] = digest(v)
        else:
            out[name] = digest(value)

    _torch_kernels(put)
    _array_kernels(put)
    return out


def _torch_kernels(put: Callable[[str, Callable[[], object]], None]) -> None:
    import torch.nn.functional as F

    put("torch.randn[4096]", lambda: _randn(4096, seed=0))
    put("torch.rand[4096]", lambda: torch.rand(4096, generator=_gen(1)))
    put("torch.normal_[17]", lambda: torch.empty(17).normal_(generator=_gen(2)))

    def linear(m: int, k: int, n: int, offset: int = 0):
        x = _randn(m + offset, k, seed=10, grad=True)
        w = _randn(n, k, seed=11, grad=True)
        b = _randn(n, seed=12, grad=True)
        y = F.linear(x[offset:], w, b)
        y.backward(_randn(*y.shape, seed=13))
        return y, x.grad, w.grad, b.grad

    for m, k, n in ((64, 128, 384), (200, 128, 128), (24, 128, 512), (256, 1176, 64), (7, 32, 96)):
        put(f"mkl.linear[{m}x{k}@{k}x{n}]", lambda m=m, k=k, n=n: linear(m, k, n))
    put("mkl.linear_unaligned[63x128@128x384]", lambda: linear(63, 128, 384, offset=1))

    def bmm():
        a, b = _randn(8, 64, 32, seed=20, grad=True), _randn(8, 32, 64, seed=21, grad=True)
        y = torch.bmm(a, b)
        y.backward(_randn(*y.shape, seed=22))
        return y, a.grad, b.grad

    put("mkl.bmm[8x64x32@8x32x64]", bmm)

    def patch_conv():  # Qwen2.5-VL's patch embedding: a Conv3d with kernel == stride (oneDNN)
        x, w = _randn(64, 3, 2, 14, 14, seed=30), _randn(64, 3, 2, 14, 14, seed=31)
        return F.conv3d(x, w, stride=(2, 14, 14))

    put("onednn.conv3d_patch[64x3x2x14x14]", patch_conv)
    put("onednn.gelu_erf[16x256]", lambda: F.gelu(_randn(16, 256, seed=32)))

    def conv2d():
        x, w = _randn(1, 32, 64, 64, seed=40, grad=True), _randn(32, 32, 3, 3, seed=41, grad=True)
        y = F.conv2d(x, w, padding=1)
        y.backward(_randn(*y.shape, seed=42))
        return y, x.grad, w.grad

    put("onednn.conv2d3x3[1x32x64x64]", conv2d)  # oneDNN's brgemm convolution, as the VAEs' (ONEDNN_VERBOSE)
    put("onednn.conv2d1x1[1x64x32x32]", lambda: F.conv2d(_randn(1, 64, 32, 32, seed=43), _randn(16, 64, 1, 1, seed=44)))
    put("onednn.conv_transpose2d[1x16x16x16]",
        lambda: F.conv_transpose2d(_randn(1, 16, 16, 16, seed=45), _randn(16, 8, 4, 4, seed=46), stride=2, padding=1))
    put("torch.softmax[8x4x200x200]", lambda: torch.softmax(_randn(8, 4, 200, 200, seed=50), -1))
    put("torch.log_softmax[24x4096]", lambda: torch.log_softmax(_randn(24, 4096, seed=51), -1))
    put("torch.layer_norm[200x128]",
        lambda: F.layer_norm(_randn(200, 128, seed=52), (128,), _randn(128, seed=53), _randn(128, seed=54)))
    put("torch.rms_norm[200x128]", lambda: F.rms_norm(_randn(200, 128, seed=55), (128,), _randn(128, seed=56), 1e-6))
    put("torch.group_norm[1x32x64x64]", lambda: F.group_norm(_randn(1, 32, 64, 64, seed=57), 8))

    def sdpa(causal: bool):
        q, k, v = (_randn(2, 2, 200, 64, seed=60 + i, grad=True) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        y.backward(_randn(*y.shape, seed=63))
        return y, q.grad, k.grad, v.grad

    put("torch.sdpa[2x2x200x64]", lambda: sdpa(False))
    put("torch.sdpa_causal[2x2x200x64]", lambda: sdpa(True))
    x = _randn(4096, seed=70)
    for name, fn in (("exp", torch.exp), ("log", lambda t: torch.log(t.abs() + 1e-3)), ("tanh", torch.tanh),
                     ("erf", torch.erf), ("sigmoid", torch.sigmoid), ("silu", F.silu), ("sin", torch.sin),
                     ("cos", torch.cos), ("pow", lambda t: t.abs().pow(0.7)),
                     ("rsqrt", lambda t: torch.rsqrt(t.abs() + 1e-3)),
                     ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))):
        put(f"torch.{name}[4096]", lambda fn=fn: fn(x))
    big = _randn(100_000, seed=71)
    put("torch.sum_mean_var[1e5]", lambda: torch.stack([big.sum(), big.mean(), big.var(), big.norm()]))
    put("torch.cumsum[1e5]", lambda: torch.cumsum(big, 0))
    img = torch.rand(1, 3, 96, 128, generator=_gen(72))
    put("torch.interpolate_bilinear_aa[96x128->40x52]",
        lambda: F.interpolate(img, size=(40, 52), mode="bilinear", antialias=True, align_corners=False))
    put("torch.interpolate_bicubic[96x128->200x256]",
        lambda: F.interpolate(img, size=(200, 256), mode="bicubic", align_corners=False))

    def adamw(make: Callable[..., torch.optim.Optimizer]) -> torch.Tensor:
        p = _randn(512, 128, seed=80, grad=True)
        opt = make([p], lr=1e-3, weight_decay=0.01)
        for i in range(3):
            p.grad = _randn(512, 128, seed=81 + i)
            opt.step()
        return p

    put("torch.adamw[512x128x3]", lambda: adamw(torch.optim.AdamW))  # the for-each step
    put("torch.adamw_fused[512x128x3]", lambda: adamw(host_independent.adamw))  # the trainers' optimizer
    y = _randn(512, 128, seed=84).abs() + 0.1
    put("mkl_vml.sqrt[512x128]", lambda: torch.sqrt(y))
    put("host_independent.sqrt[512x128]", lambda: host_independent.sqrt(y))
    put("torch.std_norm[16x64]",
        lambda: torch.stack([y[:16, :64].std(dim=1), torch.linalg.vector_norm(y[:16, :64], dim=1)]))


def _array_kernels(put: Callable[[str, Callable[[], object]], None]) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((200, 128)), rng.standard_normal((128, 64))
    put("numpy.default_rng.normal[200x128]", lambda: a)
    put("openblas.dot[200x128@128x64]", lambda: a @ b)
    put("openblas.dot_f32[200x128@128x64]", lambda: a.astype(np.float32) @ b.astype(np.float32))
    put("numpy.exp_log_tanh", lambda: np.stack([np.exp(a[0]), np.log(np.abs(a[1]) + 1e-3), np.tanh(a[2])]))
    put("numpy.exp_f32", lambda: np.exp(a[:4].astype(np.float32)))
    put("numpy.sum_mean_std", lambda: np.array([a.sum(), a.mean(), a.std(), a.astype(np.float32).sum()]))
    put("numpy.sort_argsort", lambda: (np.sort(a[:, 0]), np.argsort(a[:, 1], kind="stable")))
    put("numpy.svd[32x16]", lambda: np.linalg.svd(a[:32, :16], compute_uv=False))

    from scipy import ndimage, stats

    put("scipy.gaussian_filter[64x64]", lambda: ndimage.gaussian_filter(a[:64, :64], 1.5))
    put("scipy.kendalltau_spearmanr",
        lambda: np.array([stats.kendalltau(a[:24, 0], a[:24, 1]).statistic,
                          stats.spearmanr(a[:24, 0], a[:24, 1]).statistic,
                          stats.ttest_rel(a[:24, 0], a[:24, 1]).pvalue]))

    from PIL import Image, ImageFilter

    pic = Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))
    put("pillow.resize_lanczos[128x96->53x40]", lambda: np.asarray(pic.resize((53, 40), Image.Resampling.LANCZOS)))
    put("pillow.resize_bicubic[128x96->256x192]", lambda: np.asarray(pic.resize((256, 192), Image.Resampling.BICUBIC)))
    put("pillow.gaussian_blur[2]", lambda: np.asarray(pic.filter(ImageFilter.GaussianBlur(2))))
    put("pillow.enhance_color_rotate", lambda: np.asarray(pic.convert("L").rotate(7, Image.Resampling.BICUBIC)))

    def png() -> bytes:
        buf = io.BytesIO()
        pic.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()

    put("pillow.png_level1", png)

    from skimage.metrics import structural_similarity

    g = np.asarray(pic.convert("L"), dtype=np.float64) / 255.0
    put("skimage.ssim[96x128]", lambda: np.array([structural_similarity(g, np.roll(g, 3, axis=1), data_range=1.0)]))


def judge_step(data: Path, params_file: Path, steps: int = 2) -> dict[str, str]:
    """Hashes of ``steps`` LoRA training steps of the judge with ``reward_train``'s params (LoRA,
    first-token-weighted loss, gradient clipping, the trainers' AdamW) on the first training rows
    in file order and their epoch-0 views, at the configured rate from the first step (no warm-up,
    whose first rate is 0 and would leave the weights as they were): every module's output
    (forward hooks, in call order), the loss, each LoRA gradient before and after clipping, the
    gradient norm and each LoRA weight."""
    from paco.core.params import load_params
    from paco.judge.lora import apply_lora
    from paco.judge.losses import first_token_weighted_loss
    from paco.judge.model import check_answer_tokens
    from paco.judge.sft_data import encode_rows, load_sft_rows, row_images
    from paco.judge.training import _forward
    from paco.models.loading import load_judge

    cfg = load_params(params_file).reward_train
    torch.manual_seed(cfg.seed)
    model, processor = load_judge(data / "models" / "judge_base")
    answer = check_answer_tokens(processor.tokenizer)
    model = apply_lora(model, cfg.lora)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = host_independent.adamw([p for _, p in params], lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    rows = load_sft_rows(data / "reasons" / "sft.parquet", "train")
    out: dict[str, str] = {}
    step = [0]
    handles = _hook_outputs(model, out, lambda: f"step{step[0]}.fwd")
    try:
        for s in range(steps):
            step[0] = s
            idx = list(range(s * cfg.batch_size, (s + 1) * cfg.batch_size))
            views = [row_images(rows[j], cfg.augment, seed=cfg.seed, epoch=0, index=j) for j in idx]
            batch = encode_rows(processor, [rows[j] for j in idx], answer, views)
            out[f"step{s}.inputs"] = digest(torch.cat([batch["pixel_values"].flatten(),
                                                       batch["input_ids"].flatten().float()]))
            logits, labels = _forward(model, batch, torch.device("cpu"))
            loss = first_token_weighted_loss(logits, labels, cfg.first_token_weight, cfg.loss_variant)
            out[f"step{s}.loss"] = digest(loss)
            out[f"step{s}.loss_value"] = f"{float(loss.detach()):.9g}"
            loss.backward()
            for n, p in params:
                out[f"step{s}.grad.{n}"] = digest(p.grad)
            norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.max_grad_norm)
            out[f"step{s}.grad_norm"] = digest(norm)
            for n, p in params:
                out[f"step{s}.clipped.{n}"] = digest(p.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for n, p in params:
                out[f"step{s}.weight.{n}"] = digest(p)
    finally:
        for h in handles:
            h.remove()
    return out


def _hook_outputs(model: torch.nn.Module, out: dict[str, str], prefix: Callable[[], str]) -> list:
    """Forward hooks recording every module's first output tensor under ``prefix()`` + its name
    (``#k``: its k-th call in that prefix), in call order; returns the handles."""
    calls: dict[str, int] = {}

    def hook(name: str):
        def fn(_module, _inputs, output):
            first = output
            while not isinstance(first, torch.Tensor):
                if isinstance(first, (tuple, list)) and first:
                    first = first[0]
                elif hasattr(first, "to_tuple") and first.to_tuple():
                    first = first.to_tuple()[0]
                elif hasattr(first, "sample"):
                    first = first.sample
                else:
                    return
            key = f"{prefix()}.{name or 'model'}"
            calls[key] = calls.get(key, 0) + 1
            out[f"{key}#{calls[key]}"] = digest(first)
        return fn

    return [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]


def policy_step(data: Path, params_file: Path) -> dict[str, str]:
    """Hashes of the t2is policy as ``grpo@t2is`` runs it (``params.yaml``'s ``grpo.t2is``: its
    LoRA, rollout settings and training resolution; the first two train prompts, one trajectory
    each from fixed generators): every transformer and VAE module output of a sampled trajectory
    (its SDE steps as the rollout takes them) and of its decode, the log-probs, then one
    transition's log-prob with gradients: each LoRA gradient."""
    import pandas as pd

    from paco.core.params import load_params
    from paco.grpo.policies import TRAINED_ADAPTER, load_policy
    from paco.grpo.rewards import subtask_items
    from paco.grpo.sde import SdeSettings

    cfg = load_params(params_file).grpo["t2is"]
    policy = load_policy(cfg.family, data / "models" / cfg.policy, cfg.lora, cfg.rollout, seed=0)
    _, items = subtask_items(pd.read_parquet(data / "prompts" / "prompts.parquet"), cfg.dataset)
    prompts = [items[k] for k in sorted(items)[:2]]
    side = int(cfg.train.resolution)
    out: dict[str, str] = {}
    phase = ["sample"]
    handles = [*_hook_outputs(policy.pipe.transformer, out, lambda: f"{phase[0]}.transformer"),
               *_hook_outputs(policy.pipe.vae, out, lambda: f"{phase[0]}.vae")]
    try:
        with torch.no_grad():
            cond = policy.condition(prompts, side, side)
            gens = [torch.Generator().manual_seed(7 + i) for i in range(len(prompts))]
            roll = policy.generate(cond, height=side, width=side, num_steps=cfg.rollout.num_steps,
                                   sde=SdeSettings(cfg.rollout.noise_level, cfg.rollout.sigma_max),
                                   sde_indices=cfg.rollout.sde_indices, noise_generators=gens)
            out["sample.log_probs"] = digest(roll.log_probs)
            phase[0] = "decode"
            images = policy.decode(roll.final_latents, side, side)
            out["decode.images"] = digest(b"".join(im.tobytes() for im in images))
        phase[0] = "train"
        with policy.using(TRAINED_ADAPTER):
            logp, _, _ = policy.transition_log_prob(roll.transitions(0), cond)  # the sampled SDE settings
        out["train.log_prob"] = digest(logp)
        logp.sum().backward()
        for name, p in policy.adapter_parameters(TRAINED_ADAPTER).items():
            out[f"train.grad.{name}"] = digest(p.grad)
    finally:
        for h in handles:
            h.remove()
    return out


def repro_threads(data: Path) -> dict[str, object]:
    """Each stage's torch threads per process, from its ``report.json`` (``run.threads.torch``):
    a repro's bytes depend on them (``PACO_NUM_THREADS``, else cores / processes)."""
    out: dict[str, object] = {}
    for path in sorted(data.rglob("report.json")):
        try:
            run = json.loads(path.read_text()).get("run") or {}
        except (OSError, ValueError) as exc:  # recorded, not skipped: a stage whose threads are unknown
            out[str(path.parent.relative_to(data))] = f"unreadable report.json: {type(exc).__name__}"
            continue
        out[str(path.parent.relative_to(data))] = (run.get("threads") or {}).get("torch")
    return out


def artifacts(data: Path) -> dict[str, str]:
    """SHA-256 prefix of every file under ``data`` a repro wrote, except logs, timings and
    persisted state, keyed by its path under ``data``."""
    skip_dirs = {"checkpoints", "logs", "raw"}
    out = {}
    for path in sorted(data.rglob("*")):
        rel = path.relative_to(data)
        if not path.is_file() or skip_dirs & set(rel.parts[:-1]) or rel.parts[0] == "raw":
            continue
        if path.name == "report.json" or path.suffix == ".log":
            continue
        out[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return out


def compare(mine: dict, theirs: dict, show: int = 8) -> None:
    """Print, per section, how many shared entries match and the first ``show`` that differ."""
    for who, rec in (("this host: ", mine), ("other host:", theirs)):
        h = rec["host"]
        print(f"{who} {h.get('label') or h['cpu']}; CPUID {h.get('cpuid_features')}; /proc/cpuinfo {h['flags']}")
    threads = {k: (v, theirs.get("repro_threads", {}).get(k)) for k, v in (mine.get("repro_threads") or {}).items()
               if k in (theirs.get("repro_threads") or {}) and v != theirs["repro_threads"][k]}
    if threads:
        print(f"WARNING: the repros ran other torch thread counts, so every artifact after them differs: {threads}")
    versions = {k: (v, theirs["host"]["versions"].get(k)) for k, v in mine["host"]["versions"].items()
                if v != theirs["host"]["versions"].get(k)}
    print(f"library versions that differ: {versions or 'none'}")
    for section in ("kernels", "judge_step", "policy_step", "artifacts"):
        a, b = mine.get(section) or {}, theirs.get(section) or {}
        shared = [k for k in a if k in b]
        differ = [k for k in shared if a[k] != b[k]]
        only = f" ({len(a) - len(shared)} here only, {len(b) - len(shared)} there only)"
        print(f"{section}: {len(shared) - len(differ)} of {len(shared)} shared entries match"
              + (only if len(shared) != max(len(a), len(b)) else ""))
        for k in differ[:show]:
            print(f"  differs: {k}")
        if len(differ) > show:
            print(f"  ... and {len(differ) - show} more")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON to write (this host's fingerprint)")
    p.add_argument("--data", type=Path, default=None, help="a repro's data directory: judge_step and artifacts")
    p.add_argument("--compare", type=Path, default=None, help="another host's JSON to compare with")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the stages' 2 on 2 cores)")
    p.add_argument("--label", default=None, help="a name for this host in the record (e.g. 'emulated EPYC-Rome')")
    args = p.parse_args(argv)
    if args.data is not None:
        tree = args.data.resolve().parent  # the checkout whose repro wrote --data, and its params
        params_file = tree / "params.yaml" if (tree / "params.yaml").is_file() else ROOT / "params.yaml"
        from paco.core.params import load_params

        policy = load_params(params_file).grpo["t2is"].policy
        needed = [args.data / "models" / "judge_base", args.data / "reasons" / "sft.parquet",
                  args.data / "models" / policy, args.data / "prompts" / "prompts.parquet"]
        missing = [str(n) for n in needed if not n.exists()]
        if missing:
            p.error(f"--data {args.data} lacks {missing}: run dvc repro first (or leave --data out for the kernels)")
    torch.set_num_threads(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(record: dict) -> None:  # after every section: an emulated run is slow
        args.out.write_text(json.dumps(record, indent=1) + "\n")

    record = {"host": host(args.label), "kernels": kernels()}
    save(record)
    if args.data is not None:
        record["host"]["data_commit"] = _git_commit(tree)
        record["host"]["params_file"] = "the data's checkout" if params_file.parent == tree else "this checkout's"
        record["judge_step"] = judge_step(args.data, params_file)
        save(record)
        record["policy_step"] = policy_step(args.data, params_file)
        save(record)
        record["repro_threads"] = repro_threads(args.data)
        record["artifacts"] = artifacts(args.data)
        save(record)
    print(f"{args.out}: {len(record['kernels'])} kernels, {len(record.get('judge_step', {}))} judge-step and "
          f"{len(record.get('policy_step', {}))} policy-step entries, "
          f"{len(record.get('artifacts', {}))} artifacts; {record['host']['cpu']}")
    if args.compare is not None:
        compare(record, json.loads(args.compare.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
