"""The FLUX.1 policy of PaCo-GRPO: LoRA adapters, trajectory sampling with SDE steps, and the
log-prob of a sampled transition under the current, old or reference policy.

The policy is a diffusers ``FluxPipeline`` loaded from a ``models`` directory. The transformer
gets two PEFT LoRA adapters through diffusers' PEFT integration (``add_adapter``), as the
reference trainer does with ``get_peft_model`` (X-GenGroup/PaCo-RL ``train_flux.py``):

* ``default`` -- the trained policy ``pi_theta``;
* ``old`` -- the sampling policy ``pi_old``, a copy of ``default`` refreshed every epoch;

and disabling both gives the reference policy ``pi_ref`` (the base model) of the KL term.
LoRA ``B`` starts at zero (``init_lora_weights="gaussian"`` draws ``A`` only), so at step 0 all
three policies coincide. The VAE and text encoders are frozen.

Sampling follows FluxPipeline (prompt encoding, packed latents, FLUX's shifted sigmas,
guidance embedding, ``timestep / 1000`` conditioning) with one difference: at the step indices
in ``sde_indices`` the update is the Flow-GRPO SDE step (:func:`paco.grpo.sde.sde_step`) with noise
level ``a``, elsewhere the deterministic Euler step (the same function with ``a = 0``, which is
exactly ``FlowMatchEulerDiscreteScheduler.step``). The latents before and after each SDE step
are kept, with the step's log-prob, so the transition can be re-scored during training.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from paco.grpo.sde import flux_sigmas, sde_step

log = logging.getLogger("paco.grpo.policy")

TRAINED_ADAPTER = "default"
OLD_ADAPTER = "old"


@dataclass
class PromptEmbeds:
    """Text conditioning of a batch: T5 ``prompt_embeds`` ``(B, L, D)``, CLIP ``pooled``
    ``(B, D_pool)`` and ``text_ids`` ``(L, 3)`` (zeros, FLUX's text positions)."""

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    text_ids: torch.Tensor

    def select(self, index: Sequence[int] | torch.Tensor) -> PromptEmbeds:
        idx = torch.as_tensor(index, dtype=torch.long)
        return PromptEmbeds(self.prompt_embeds[idx], self.pooled[idx], self.text_ids)

    def to_device(self, device: torch.device | str) -> PromptEmbeds:
        return PromptEmbeds(self.prompt_embeds.to(device), self.pooled.to(device), self.text_ids.to(device))

    @staticmethod
    def cat(parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
        return PromptEmbeds(torch.cat([p.prompt_embeds for p in parts]), torch.cat([p.pooled for p in parts]),
                            parts[0].text_ids)


@dataclass
class Rollout:
    """A batch of sampled trajectories (one resolution).

    Attributes:
        final_latents: ``(B, seq, C)`` packed clean latents (decode with :meth:`FluxPolicy.decode`).
        sde_indices: the step indices ``j`` that were SDE steps, ascending.
        latents: ``(B, n_sde, 2, seq, C)`` float32: ``x_j`` and ``x_{j+1}`` of each SDE step.
        log_probs: ``(B, n_sde)`` float32 log-prob of each SDE transition under the sampling
            policy (at sampling time).
        sigmas: ``(N + 1,)`` float32 noise levels, ``timesteps``: ``(N,)`` conditioning values.
        height, width: image size in pixels.
        noise_level: the SDE noise level ``a`` used.
    """

    final_latents: torch.Tensor
    sde_indices: tuple[int, ...]
    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    height: int
    width: int
    noise_level: float


class FluxPolicy:
    """A FLUX.1 pipeline wrapped as a GRPO policy.

    Args:
        pipe: a loaded ``diffusers.FluxPipeline`` (:func:`paco.models.loading.load_flux_pipeline`).
        lora: ``rank``, ``alpha``, ``dropout``, ``target_modules`` (transformer module name
            suffixes); ``None``: no adapters (a frozen policy for plain sampling).
        max_sequence_length: T5 tokens (FLUX.1-dev: 512).
        guidance_scale: the guidance embedding value (FLUX.1-dev is guidance-distilled: 3.5).
        seed: seeds the LoRA ``A`` init (drawn under ``torch.random.fork_rng``, so the global RNG
            is untouched and the same seed gives the same adapter in any process).

    Raises:
        ValueError: a LoRA target matches no module of the transformer.
    """

    def __init__(self, pipe: Any, lora: Any | None, *, max_sequence_length: int = 512,
                 guidance_scale: float = 3.5, seed: int = 0):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.max_sequence_length = int(max_sequence_length)
        self.guidance_scale = float(guidance_scale)
        for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.transformer):
            module.requires_grad_(False)
            module.eval()
        self.has_lora = lora is not None
        if lora is not None:
            from peft import LoraConfig

            names = [n for n, _ in self.transformer.named_modules()]
            unmatched = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
            if unmatched:
                raise ValueError(f"LoRA target modules {unmatched} match no module of the FLUX transformer")
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
        """``dst`` := ``src`` (in place, no grad)."""
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
        for name, p in self.transformer.named_parameters():
            if ".lora_" in name:
                p.requires_grad_(adapter == TRAINED_ADAPTER and f".{TRAINED_ADAPTER}." in name)

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
        what ``FluxPipeline.save_lora_weights`` / ``load_lora_weights`` use), float32 CPU."""
        from peft.utils import get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.transformer, adapter_name=adapter)
        return {k: v.detach().float().cpu().contiguous() for k, v in sd.items()}

    # ---------------------------------------------------------------------------- model calls

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """T5 + CLIP text conditioning for ``prompts`` (frozen encoders, no grad).

        As in FluxPipeline, CLIP reads the first 77 tokens and T5 the first
        ``max_sequence_length``; the per-call truncation warnings of diffusers and transformers
        are silenced (the reference trainer does the same), the truncation itself is the model's.
        """
        with _quiet_truncation_warnings():
            prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
                prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(prompt_embeds, pooled, text_ids)

    def latent_ids(self, batch: int, height: int, width: int) -> torch.Tensor:
        """FLUX image position ids ``(seq, 3)`` for an image of ``height x width`` px."""
        vsf = self.pipe.vae_scale_factor
        h, w = 2 * (int(height) // (vsf * 2)), 2 * (int(width) // (vsf * 2))
        return self.pipe._prepare_latent_image_ids(batch, h // 2, w // 2, self.device, torch.float32)

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, embeds: PromptEmbeds,
                 img_ids: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity ``(B, seq, C)`` at ``timestep`` (``(B,)``, FLUX's 0-1000
        scale, divided by 1000 here as FluxPipeline does)."""
        dtype = self.transformer.dtype
        guidance = torch.full([latents.shape[0]], self.guidance_scale, device=latents.device, dtype=torch.float32)
        if not self.transformer.config.guidance_embeds:
            guidance = None
        return self.transformer(
            hidden_states=latents.to(dtype),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=guidance,
            pooled_projections=embeds.pooled.to(dtype),
            encoder_hidden_states=embeds.prompt_embeds.to(dtype),
            txt_ids=embeds.text_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def schedule(self, height: int, width: int, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas (N+1,), timesteps (N,))`` for this image size (:func:`paco.grpo.sde.flux_sigmas`)."""
        vsf = self.pipe.vae_scale_factor
        seq = (int(height) // (vsf * 2)) * (int(width) // (vsf * 2))
        return flux_sigmas(self.pipe.scheduler, num_steps, seq)

    @torch.no_grad()
    def generate(self, embeds: PromptEmbeds, *, height: int, width: int, num_steps: int, noise_level: float,
                 sde_indices: Sequence[int], noise_generators: Sequence[torch.Generator],
                 sde_generators: Sequence[torch.Generator] | None = None,
                 sigma_max: float | str = "schedule") -> Rollout:
        """Denoise one trajectory per row of ``embeds`` with the active adapter: ODE steps, and SDE
        steps at ``sde_indices`` (a GRPO rollout; with ``noise_level`` 0 or no SDE step, an ODE
        sample).

        Args:
            embeds: conditioning of ``B`` rows.
            height, width: pixels, multiples of 16.
            num_steps: ``N`` denoising steps.
            noise_level: ``a`` of the SDE steps (0: every step is the ODE step).
            sde_indices: step indices in ``[0, N)`` that take the SDE step.
            noise_generators: ``B`` CPU generators for the initial noise (one per row, so a row's
                sample does not depend on its batch).
            sde_generators: ``B`` generators for the SDE noise (default: ``noise_generators``,
                continuing their streams).
            sigma_max: ``"schedule"`` (the released code: the schedule's second sigma) or a
                number in ``(0, 1)``; used only by an SDE step at index 0 (see
                :func:`paco.grpo.sde.sde_step`).

        Returns:
            A :class:`Rollout`.

        Raises:
            ValueError: a size that is not a multiple of 16, an SDE index outside ``[0, N)``,
                a generator count that is not ``B``.
        """
        B = embeds.prompt_embeds.shape[0]
        vsf = self.pipe.vae_scale_factor
        if height % (2 * vsf) or width % (2 * vsf):
            raise ValueError(f"height and width must be multiples of {2 * vsf}, got {height}x{width}")
        sde = tuple(sorted(set(int(i) for i in sde_indices)))
        if any(not 0 <= i < num_steps for i in sde):
            raise ValueError(f"sde_indices {sde} outside [0, {num_steps})")
        if len(noise_generators) != B or (sde_generators is not None and len(sde_generators) != B):
            raise ValueError(f"need {B} generators per stream")
        sde_generators = list(sde_generators) if sde_generators is not None else list(noise_generators)
        channels = self.transformer.config.in_channels // 4
        latents, img_ids = self.pipe.prepare_latents(B, channels, height, width, torch.float32, self.device,
                                                     list(noise_generators))
        sigmas, timesteps = self.schedule(height, width, num_steps)
        kept, logps = [], []
        for i in range(num_steps):
            t = timesteps[i].expand(B).to(self.device)
            v = self.velocity(latents, t, embeds, img_ids)
            a = noise_level if i in sde else 0.0
            nxt, logp, _, _ = sde_step(v, latents, sigmas[i], sigmas[i + 1], a, generator=sde_generators,
                                       sigma_max=sigma_max)
            if i in sde:
                kept.append(torch.stack([latents.float(), nxt], dim=1))
                logps.append(logp)
            latents = nxt
        seq, c = latents.shape[1], latents.shape[2]
        return Rollout(
            final_latents=latents,
            sde_indices=sde,
            latents=torch.stack(kept, dim=1) if kept else torch.zeros(B, 0, 2, seq, c),
            log_probs=torch.stack(logps, dim=1) if logps else torch.zeros(B, 0),
            sigmas=sigmas, timesteps=timesteps, height=int(height), width=int(width), noise_level=float(noise_level),
        )

    def transition_log_prob(self, x: torch.Tensor, x_next: torch.Tensor, sigma: torch.Tensor,
                            sigma_next: torch.Tensor, timestep: torch.Tensor, embeds: PromptEmbeds,
                            height: int, width: int, noise_level: float, sigma_max: float | str = "schedule"
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-prob of the transitions ``x -> x_next`` under the active adapter (with grad if
        enabled): ``(log_prob (B,), mean (B, seq, C), std (B, 1, 1))``, all float32.
        ``sigma_max`` must be the value the transition was sampled with (``"schedule"`` needs no
        schedule here: a step from ``sigma = 1`` uses its ``sigma_next``, :func:`paco.grpo.sde.sde_step`)."""
        B = x.shape[0]
        img_ids = self.latent_ids(B, height, width)
        v = self.velocity(x, timestep.expand(B).to(self.device), embeds, img_ids)
        _, logp, mean, std = sde_step(v, x, sigma, sigma_next, noise_level, next_latents=x_next, sigma_max=sigma_max)
        return logp, mean, std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> list[Image.Image]:
        """Packed latents ``(B, seq, C)`` -> ``B`` RGB PIL images of ``height x width``."""
        pipe = self.pipe
        x = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        x = (x / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        images = pipe.vae.decode(x.to(pipe.vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(images, output_type="pil")


@contextlib.contextmanager
def _quiet_truncation_warnings() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("diffusers.pipelines.flux.pipeline_flux",
                                               "transformers.tokenization_utils_base")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def grid_size(height: int, width: int, resolution: int, multiple: int = 16) -> tuple[int, int]:
    """The ``(height, width)`` at which a ``height x width`` composite is sampled at
    ``resolution``: the same aspect ratio with area ``resolution**2``, each side rounded to a
    multiple of ``multiple`` (at least one multiple). A 1024x1024 2x2 grid at 512 is 512x512; a
    512x1536 1x3 strip at 512 is 288x880."""
    scale = float(resolution) / float((height * width) ** 0.5)
    h = max(multiple, int(round(height * scale / multiple)) * multiple)
    w = max(multiple, int(round(width * scale / multiple)) * multiple)
    return h, w
