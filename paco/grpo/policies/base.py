"""The policy interface of PaCo-GRPO: what the trainer, evaluation and final sampling need of a
flow-matching image model, and the parts every family shares.

A *policy family* wraps one diffusers pipeline class (``FluxPipeline``, ``FluxKontextPipeline``,
``QwenImageEditPipeline``) and says five things about it: how a batch is *conditioned*
(:meth:`Policy.condition`: text, and for editing the reference image's latents), the transformer's
*velocity* at a noise level (:meth:`Policy.velocity`: guidance embedding or true CFG, extra
sequence parts and their removal), the *initial noise* (:meth:`Policy.initial_latents`), the
sigma *schedule* (:meth:`Policy.schedule`) and how latents are *decoded* to images
(:meth:`Policy.decode`). Everything else is shared here:

* two PEFT LoRA adapters on the transformer, added through diffusers' PEFT integration
  (``add_adapter``), as the reference trainers do with ``get_peft_model``
  (X-GenGroup/PaCo-RL ``train_flux.py``, ``train_flux_kontext.py``, ``train_qwenimage_edit.py``):
  ``default`` is the trained policy ``pi_theta``, ``old`` the sampling policy ``pi_old`` (a copy of
  ``default`` refreshed every epoch), and disabling both gives the reference policy ``pi_ref`` of
  the KL term. LoRA ``B`` starts at zero (``init_lora_weights="gaussian"`` draws ``A`` only), so at
  step 0 all three coincide;
* trajectory sampling (:meth:`Policy.generate`): at the step indices in ``sde_indices`` the update
  is the Flow-GRPO SDE step (:func:`paco.grpo.sde.sde_step`) with noise level ``a``, elsewhere the
  deterministic Euler step (the same function with ``a = 0``, exactly
  ``FlowMatchEulerDiscreteScheduler.step``); the latents before and after each SDE step are kept
  with the step's log-prob;
* re-scoring kept transitions under the active adapter (:meth:`Policy.transition_log_prob`), with
  the SDE settings recorded when they were sampled (:class:`Transitions`);
* the LoRA in diffusers' layout, saved with the pipeline class's own ``save_lora_weights``.

A new diffusers pipeline family is one subclass (see :mod:`paco.grpo.policies.flux`) and one
entry in :data:`paco.grpo.policies.FAMILIES`.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

from paco.grpo.sde import SdeSettings, flux_sigmas, sde_step

TRAINED_ADAPTER = "default"
OLD_ADAPTER = "old"


@dataclass
class Conditioning:
    """Everything a policy's velocity needs besides the latents and the timestep, for a batch.

    Attributes:
        rows: tensors with the batch first (one row per sample): e.g. FLUX's T5 ``prompt_embeds``
            ``(B, L, D)`` and CLIP ``pooled`` ``(B, D_pool)``, Kontext's packed reference
            ``image_latents`` ``(B, seq_ref, C)``.
        shared: tensors the same for every row, e.g. FLUX's position ids ``text_ids`` ``(L, 3)``
            and ``img_ids`` ``(seq [+ seq_ref], 3)``.
        pad: row tensors of variable length (dim 1) and their pad value, e.g. Qwen-Image's text
            embeddings and their attention mask: :meth:`cat` right-pads them to the longest.
    """

    rows: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    pad: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.rows[name] if name in self.rows else self.shared[name]

    def __contains__(self, name: str) -> bool:
        return name in self.rows or name in self.shared

    @property
    def batch(self) -> int:
        return next(iter(self.rows.values())).shape[0]

    def select(self, index: Sequence[int] | torch.Tensor) -> Conditioning:
        """The rows ``index`` (repeats allowed: ``select([0] * G)`` gives a group)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return Conditioning({k: v[idx.to(v.device)] for k, v in self.rows.items()}, dict(self.shared), dict(self.pad))

    def to_device(self, device: torch.device | str) -> Conditioning:
        return Conditioning({k: v.to(device) for k, v in self.rows.items()},
                            {k: v.to(device) for k, v in self.shared.items()}, dict(self.pad))

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        """Rows of ``parts`` concatenated (the :attr:`pad` tensors right-padded along dim 1 to
        the longest); the shared tensors must be equal (same size).

        Raises:
            ValueError: the parts have different keys or shared tensors (e.g. two image sizes).
        """
        first = parts[0]
        for p in parts[1:]:
            if p.rows.keys() != first.rows.keys() or p.shared.keys() != first.shared.keys() or any(
                    p.shared[k].shape != v.shape or not torch.equal(p.shared[k], v) for k, v in first.shared.items()):
                raise ValueError("cannot concatenate conditionings of different layouts or sizes")

        def rows(k: str) -> list[torch.Tensor]:
            ts = [p.rows[k] for p in parts]
            if k not in first.pad:
                return ts
            n = max(t.shape[1] for t in ts)
            return [torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [0, n - t.shape[1]], value=first.pad[k])
                    for t in ts]

        return Conditioning({k: torch.cat(rows(k)) for k in first.rows}, dict(first.shared), dict(first.pad))


@dataclass(frozen=True)
class Transitions:
    """A batch of kept SDE transitions ``x -> x_next`` of one step, with the settings they were
    sampled with (what :meth:`Policy.transition_log_prob` re-scores them under).

    Attributes:
        x, x_next: ``(B, seq, C)`` float32 latents before and after the step.
        sigma, sigma_next: the step's noise levels, 0-d float32 (one step of one schedule).
        timestep: 0-d float32, the conditioning value of the step (the scheduler's 0-1000 scale).
        sde: the :class:`paco.grpo.sde.SdeSettings` the transitions were sampled with.
    """

    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    timestep: torch.Tensor
    sde: SdeSettings


@dataclass
class TrajectoryBatch:
    """A batch of sampled trajectories (one resolution), what :meth:`Policy.generate` returns.

    Attributes:
        final_latents: ``(B, seq, C)`` packed clean latents (decode with :meth:`Policy.decode`).
        sde_indices: the step indices ``j`` that were SDE steps, ascending.
        latents: ``(B, n_sde, 2, seq, C)`` float32: ``x_j`` and ``x_{j+1}`` of each SDE step.
        log_probs: ``(B, n_sde)`` float32 log-prob of each SDE transition under the sampling
            policy (at sampling time).
        sigmas: ``(N + 1,)`` float32 noise levels, ``timesteps``: ``(N,)`` conditioning values.
        height, width: image size in pixels.
        sde: the SDE settings the batch was sampled with (its transitions are re-scored with them).
    """

    final_latents: torch.Tensor
    sde_indices: tuple[int, ...]
    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    height: int
    width: int
    sde: SdeSettings

    def transitions(self, j: int) -> Transitions:
        """The batch's ``j``-th kept SDE step (``0 <= j < n_sde``, step ``sde_indices[j]``) as
        :class:`Transitions`, on the latents' device."""
        step = self.sde_indices[j]
        return Transitions(self.latents[:, j, 0], self.latents[:, j, 1], self.sigmas[step], self.sigmas[step + 1],
                           self.timesteps[step], self.sde)


class Policy(abc.ABC):
    """A diffusers flow-matching pipeline wrapped as a GRPO policy (see the module docstring).

    Subclasses set :attr:`family`, :attr:`pipeline_class`, :attr:`components` and
    :attr:`edits` and implement ``condition``, ``velocity``, ``initial_latents`` and ``decode``
    (``schedule`` is the packed-latent one unless overridden).

    Args:
        pipe: a loaded pipeline of :attr:`pipeline_class` (:func:`paco.grpo.policies.load_policy`).
        lora: ``rank``, ``alpha``, ``dropout``, ``target_modules`` (transformer module name
            suffixes); ``None``: no adapters (a frozen policy for plain sampling).
        seed: seeds the LoRA ``A`` init (drawn under ``torch.random.fork_rng``, so the global RNG
            is untouched and the same seed gives the same adapter in any process).

    Raises:
        ValueError: a LoRA target matches no module of the transformer.
    """

    #: name in ``grpo.<subtask>.family`` / ``final_samples.<subtask>.family``
    family: ClassVar[str]
    #: the diffusers class the model directory is loaded as (its ``save_lora_weights`` writes the LoRA)
    pipeline_class: ClassVar[str]
    #: sub-folders a model directory of this family must have
    components: ClassVar[tuple[str, ...]]
    #: True: every prompt has a reference (input) image, the policy edits it
    edits: ClassVar[bool] = False
    #: the constructor's keyword options that come from the params (:func:`paco.grpo.policies.load_policy`)
    option_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def component_overrides(cls, model_dir: str | Path) -> dict[str, Any]:
        """Components loaded by the family itself and passed to ``from_pretrained`` (default none)."""
        return {}

    def __init__(self, pipe: Any, lora: Any | None, *, seed: int = 0):
        self.pipe = pipe
        self.transformer = pipe.transformer
        #: the transformer's dtype, read once (diffusers' ``ModelMixin.dtype`` walks the parameters)
        self.transformer_dtype: torch.dtype = self.transformer.dtype
        self._lora_params: list[tuple[str, torch.nn.Parameter]] | None = None
        for name in self.components:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)
                module.eval()
        self.has_lora = lora is not None
        if lora is not None:
            from peft import LoraConfig

            names = [n for n, _ in self.transformer.named_modules()]
            unmatched = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
            if unmatched:
                raise ValueError(f"LoRA target modules {unmatched} match no module of the "
                                 f"{type(self.transformer).__name__}")
            config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                init_lora_weights="gaussian", target_modules=list(lora.target_modules))
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                # peft warns that a second adapter joins the first: that is the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                torch.manual_seed(int(seed))
                self.transformer.add_adapter(config, adapter_name=TRAINED_ADAPTER)
                self.transformer.add_adapter(config, adapter_name=OLD_ADAPTER)
            self.transformer.eval()  # the injected LoRA modules start in training mode
            self.copy_adapter(TRAINED_ADAPTER, OLD_ADAPTER)
            self.set_adapter(TRAINED_ADAPTER)

    # ---------------------------------------------------------------------------- the family's part

    @abc.abstractmethod
    def condition(self, prompts: Sequence[Any], height: int, width: int) -> Conditioning:
        """The conditioning of ``prompts`` (:class:`paco.grpo.rewards.SubtaskItem`: ``prompt``, and
        ``reference`` for an editing family) for samples of ``height x width`` px (frozen
        encoders, no grad).

        Raises:
            ValueError: an editing family given a prompt without a reference image.
        """

    @abc.abstractmethod
    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The predicted velocity ``(B, seq, C)`` of ``latents`` ``(B, seq, C)`` at ``timestep``
        (``(B,)``, the scheduler's 0-1000 scale) under the active adapter (with grad if enabled)."""

    @abc.abstractmethod
    def initial_latents(self, batch: int, height: int, width: int,
                        generators: Sequence[torch.Generator]) -> torch.Tensor:
        """Packed initial noise ``(batch, seq, C)`` float32, row ``i`` drawn from ``generators[i]``."""

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> list[Image.Image]:
        """Packed latents ``(B, seq, C)`` -> ``B`` RGB PIL images of ``height x width``."""

    #: height and width must be multiples of this (VAE factor x packing)
    size_multiple: int = 16

    # ---------------------------------------------------------------------------- packed latents

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """``(h, w)`` of the VAE latent of a ``height x width`` px image, each even (the 2x2
        packing of FLUX and Qwen-Image): ``2 * (side // (2 * vae_scale_factor))``."""
        f = 2 * self.pipe.vae_scale_factor
        return 2 * (int(height) // f), 2 * (int(width) // f)

    def schedule(self, height: int, width: int, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas (N+1,), timesteps (N,))`` float32: the pipeline scheduler's shifted schedule
        for this image's packed sequence length ``(h / 2) * (w / 2)``
        (:func:`paco.grpo.sde.flux_sigmas`; FLUX and Qwen-Image compute it alike)."""
        h, w = self.latent_grid(height, width)
        return flux_sigmas(self.pipe.scheduler, num_steps, (h // 2) * (w // 2))

    # ---------------------------------------------------------------------------- editing families

    #: editing families: ``keep`` (the reference is resized to the output size, keeping its
    #: aspect; the paper) or ``square`` (squashed to a ``min(h, w)`` square; the released trainers)
    reference_aspect: str = "keep"

    def set_reference_aspect(self, aspect: str) -> None:
        """Raises ValueError unless ``aspect`` is ``keep`` or ``square``."""
        if aspect not in ("keep", "square"):
            raise ValueError(f"reference_aspect must be keep or square, got {aspect!r}")
        self.reference_aspect = aspect

    def reference_size(self, height: int, width: int) -> tuple[int, int]:
        """``(h, w)`` px the reference is encoded at for an output of ``height x width``."""
        if self.reference_aspect == "square":
            side = min(int(height), int(width))
            return side, side
        return int(height), int(width)

    def references(self, prompts: Sequence[Any]) -> list[Image.Image]:
        """The prompts' reference (input) images.

        Raises:
            ValueError: a prompt without one (names up to five).
        """
        missing = [p.prompt_id for p in prompts if getattr(p, "reference", None) is None]
        if missing:
            raise ValueError(f"{self.family}: prompts {missing[:5]} have no reference (input) image")
        return [p.reference for p in prompts]

    # ---------------------------------------------------------------------------- adapters

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def adapter_parameters(self, adapter: str = TRAINED_ADAPTER) -> dict[str, torch.nn.Parameter]:
        """The LoRA parameters of ``adapter``, by name (``...lora_A.<adapter>.weight``), in module
        order (the same order for every adapter)."""
        tag = f".{adapter}."
        return {n: p for n, p in self.transformer.named_parameters() if ".lora_" in n and tag in n}

    def copy_adapter(self, src: str, dst: str) -> None:
        """``dst`` := ``src`` (in place, no grad).

        Raises:
            RuntimeError: the two adapters' parameters are not in the same module order."""
        a, b = self.adapter_parameters(src), self.adapter_parameters(dst)
        with torch.no_grad():
            for (na, pa), (nb, pb) in zip(a.items(), b.items(), strict=True):
                if na.replace(f".{src}.", ".") != nb.replace(f".{dst}.", "."):
                    raise RuntimeError(f"adapter parameter order differs: {na} vs {nb}")
                pb.copy_(pa)

    def set_adapter(self, adapter: str) -> None:
        """Activate ``adapter``; only its LoRA weights require grad (and only if it is the
        trained one)."""
        self.transformer.set_adapter(adapter)
        if self._lora_params is None:  # the adapters are all added in __init__
            self._lora_params = [(n, p) for n, p in self.transformer.named_parameters() if ".lora_" in n]
        for name, p in self._lora_params:
            p.requires_grad_(adapter == TRAINED_ADAPTER and f".{TRAINED_ADAPTER}." in name)

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the transformer blocks' activations in the backward instead of keeping them:
        diffusers' ``ModelMixin.enable_gradient_checkpointing`` (``torch.utils.checkpoint`` with
        ``use_reentrant=False`` around every block, and only in forwards with gradients enabled, so
        sampling is unchanged), as the reference trainers do with ``enable_gradient_checkpointing``
        (X-GenGroup/PaCo-RL ``train_flux.py`` l.844-845). The same loss and gradients for about one
        more forward of compute; the transformer's ``gradient_checkpointing`` flag is then true.

        Raises:
            ValueError: the transformer class does not support it (diffusers' message).
        """
        self.transformer.enable_gradient_checkpointing()

    @contextlib.contextmanager
    def using(self, adapter: str | None) -> Iterator[None]:
        """Run the block with ``adapter`` active (``None``: adapters disabled, the reference
        policy); the trained adapter is active again afterwards."""
        if not self.has_lora:
            yield
            return
        if adapter is None:
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()
                self.set_adapter(TRAINED_ADAPTER)
            return
        self.set_adapter(adapter)
        try:
            yield
        finally:
            self.set_adapter(TRAINED_ADAPTER)

    def lora_state_dict(self, adapter: str = TRAINED_ADAPTER) -> dict[str, torch.Tensor]:
        """``adapter``'s weights in diffusers' LoRA layout (``transformer.<module>.lora_A.weight``,
        what the pipeline's ``save_lora_weights`` / ``load_lora_weights`` use), float32 CPU."""
        from peft.utils import get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.transformer, adapter_name=adapter)
        return {k: v.detach().float().cpu().contiguous() for k, v in sd.items()}

    def save_lora(self, directory: str | Path, weights: Mapping[str, torch.Tensor], *,
                  metadata: Mapping[str, Any] | None = None) -> None:
        """Write ``weights`` (diffusers' layout) into ``directory`` with the pipeline class's own
        ``save_lora_weights`` (``pytorch_lora_weights.safetensors``), so ``load_lora_weights``
        of the same class reads it back."""
        import diffusers

        kwargs: dict[str, Any] = {"transformer_lora_layers": dict(weights), "safe_serialization": True}
        if metadata is not None:
            kwargs["transformer_lora_adapter_metadata"] = dict(metadata)
        getattr(diffusers, self.pipeline_class).save_lora_weights(str(directory), **kwargs)

    # ---------------------------------------------------------------------------- shared sampling

    def check_size(self, height: int, width: int) -> None:
        """Raises ValueError unless both sides are multiples of :attr:`size_multiple`."""
        m = self.size_multiple
        if height % m or width % m or height <= 0 or width <= 0:
            raise ValueError(f"height and width must be positive multiples of {m}, got {height}x{width}")

    @torch.no_grad()
    def generate(self, cond: Conditioning, *, height: int, width: int, num_steps: int, sde: SdeSettings,
                 sde_indices: Sequence[int], noise_generators: Sequence[torch.Generator],
                 sde_generators: Sequence[torch.Generator] | None = None) -> TrajectoryBatch:
        """Denoise one trajectory per row of ``cond`` with the active adapter: ODE steps, and SDE
        steps at ``sde_indices`` (a GRPO rollout; with :data:`paco.grpo.sde.ODE` or no SDE step,
        an ODE sample).

        Args:
            cond: conditioning of ``B`` rows made for ``height x width``.
            height, width: pixels, multiples of :attr:`size_multiple`.
            num_steps: ``N`` denoising steps.
            sde: the SDE steps' noise level ``a`` and ``sigma_max`` (``sigma_max`` is used only by
                an SDE step at index 0, see :func:`paco.grpo.sde.sde_step`); recorded on the result.
            sde_indices: step indices in ``[0, N)`` that take the SDE step.
            noise_generators: ``B`` CPU generators for the initial noise (one per row, so a row's
                sample does not depend on its batch).
            sde_generators: ``B`` generators for the SDE noise (default: ``noise_generators``,
                continuing their streams).

        Returns:
            A :class:`TrajectoryBatch` (its ``sde`` is ``sde``).

        Raises:
            ValueError: a size that is not a multiple of :attr:`size_multiple`, an SDE index
                outside ``[0, N)``, a generator count that is not ``B``.
        """
        B = cond.batch
        self.check_size(height, width)
        sde_steps = tuple(sorted(set(int(i) for i in sde_indices)))
        if any(not 0 <= i < num_steps for i in sde_steps):
            raise ValueError(f"sde_indices {sde_steps} outside [0, {num_steps})")
        if len(noise_generators) != B or (sde_generators is not None and len(sde_generators) != B):
            raise ValueError(f"need {B} generators per stream")
        sde_generators = list(sde_generators) if sde_generators is not None else list(noise_generators)
        latents = self.initial_latents(B, height, width, list(noise_generators))
        sigmas, timesteps = self.schedule(height, width, num_steps)
        kept, logps = [], []
        for i in range(num_steps):
            t = timesteps[i].expand(B).to(self.device)
            v = self.velocity(latents, t, cond)
            a = sde.noise_level if i in sde_steps else 0.0
            nxt, logp, _, _ = sde_step(v, latents, sigmas[i], sigmas[i + 1], a, generator=sde_generators,
                                       sigma_max=sde.sigma_max)
            if i in sde_steps:
                kept.append(torch.stack([latents.float(), nxt], dim=1))
                logps.append(logp)
            latents = nxt
        seq, c = latents.shape[1], latents.shape[2]
        return TrajectoryBatch(
            final_latents=latents,
            sde_indices=sde_steps,
            latents=torch.stack(kept, dim=1) if kept else torch.zeros(B, 0, 2, seq, c),
            log_probs=torch.stack(logps, dim=1) if logps else torch.zeros(B, 0),
            sigmas=sigmas, timesteps=timesteps, height=int(height), width=int(width), sde=sde,
        )

    def transition_log_prob(self, steps: Transitions, cond: Conditioning
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-prob of the transitions ``steps.x -> steps.x_next`` (``(B, seq, C)``) under the
        active adapter (with grad if enabled), with the SDE settings they were sampled with
        (``steps.sde``; there is no other way to pass them): ``(log_prob (B,), mean (B, seq, C),
        std (B, 1, 1))``, all float32. ``cond`` must be made for the transitions' image size.

        Raises:
            ValueError: a transition whose std is 0 (sampled at noise level 0,
                :func:`paco.grpo.sde.sde_step`).
        """
        B = steps.x.shape[0]
        v = self.velocity(steps.x, steps.timestep.expand(B).to(self.device), cond)
        _, logp, mean, std = sde_step(v, steps.x, steps.sigma, steps.sigma_next, steps.sde.noise_level,
                                      next_latents=steps.x_next, sigma_max=steps.sde.sigma_max)
        return logp, mean, std


def grid_size(height: int, width: int, resolution: int, multiple: int = 16) -> tuple[int, int]:
    """The ``(height, width)`` at which a ``height x width`` composite (or an edit's input image)
    is sampled at ``resolution``: the same aspect ratio with area ``resolution**2``, each side
    rounded to a multiple of ``multiple`` (at least one multiple). A 1024x1024 2x2 grid at 512 is
    512x512; a 512x1536 1x3 strip at 512 is 288x880."""
    scale = float(resolution) / float((height * width) ** 0.5)
    h = max(multiple, int(round(height * scale / multiple)) * multiple)
    w = max(multiple, int(round(width * scale / multiple)) * multiple)
    return h, w
