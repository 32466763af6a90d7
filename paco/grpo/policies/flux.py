"""FLUX.1 policies: text to image (``FluxPipeline``, the T2IS subtask) and image editing
(``FluxKontextPipeline``, the ``kontext_editing`` subtask).

Both follow their diffusers pipeline step by step: T5 + CLIP prompt encoding, packed 2x2
latents, FLUX's resolution-shifted sigmas (:func:`paco.grpo.sde.flux_sigmas`), the distilled
guidance embedding (FLUX.1-dev 3.5, FLUX.1-Kontext-dev 2.5) and ``timestep / 1000`` conditioning.
Kontext additionally encodes the reference image with the VAE (its mode, as the pipeline's
``sample_mode="argmax"``), packs it like the noise, appends it to the image sequence with position
ids whose first axis is 1 (the noise's is 0), and drops the transformer's prediction for it
(``noise_pred[:, :seq]``), exactly ``FluxKontextPipeline.__call__``. Sources: diffusers
``pipeline_flux.py`` / ``pipeline_flux_kontext.py``; X-GenGroup/PaCo-RL ``train_flux.py``,
``train_flux_kontext.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from PIL import Image

from paco.grpo.policies.base import Conditioning, Policy

#: the modules of a FLUX pipeline directory (FluxPipeline and FluxKontextPipeline alike)
FLUX_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


class FluxPolicy(Policy):
    """FLUX.1 text to image (``FluxPipeline``).

    Args:
        pipe, lora, seed: see :class:`paco.grpo.policies.base.Policy`.
        max_sequence_length: T5 tokens (FLUX.1-dev: 512).
        guidance_scale: the guidance embedding value (FLUX.1-dev is guidance-distilled: 3.5);
            ignored by a transformer without a guidance embedding.
    """

    family = "flux"
    pipeline_class = "FluxPipeline"
    components = FLUX_COMPONENTS

    option_keys = ("max_sequence_length", "guidance_scale")

    def __init__(self, pipe: Any, lora: Any | None, *, max_sequence_length: int = 512,
                 guidance_scale: float = 3.5, seed: int = 0):
        super().__init__(pipe, lora, seed=seed)
        self.max_sequence_length = int(max_sequence_length)
        self.guidance_scale = float(guidance_scale)
        self.size_multiple = 2 * pipe.vae_scale_factor

    # ---------------------------------------------------------------------------- conditioning

    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """T5 ``prompt_embeds`` ``(B, L, D)``, CLIP ``pooled`` ``(B, D_pool)`` and ``text_ids``
        ``(L, 3)`` of ``prompts``.

        As in FluxPipeline, CLIP reads the first 77 tokens and T5 the first
        ``max_sequence_length``; the per-call truncation warnings of diffusers and transformers
        are silenced (the reference trainer does the same), the truncation itself is the model's.
        """
        with _quiet_truncation_warnings():
            prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
                prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled": pooled, "text_ids": text_ids}

    def latent_ids(self, height: int, width: int) -> torch.Tensor:
        """FLUX image position ids ``(seq, 3)`` for an image of ``height x width`` px."""
        h, w = self.latent_grid(height, width)
        return self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, torch.float32)

    def condition(self, prompts: Sequence[Any], height: int, width: int) -> Conditioning:
        """Text conditioning of ``prompts`` (``.prompt``) and the position ids of a
        ``height x width`` image."""
        self.check_size(height, width)
        text = self.encode_text([p.prompt for p in prompts])
        return Conditioning({"prompt_embeds": text["prompt_embeds"], "pooled": text["pooled"]},
                            {"text_ids": text["text_ids"], "img_ids": self.latent_ids(height, width)})

    # ---------------------------------------------------------------------------- model calls

    def _transformer(self, hidden: torch.Tensor, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        dtype = self.transformer_dtype
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([hidden.shape[0]], self.guidance_scale, device=hidden.device, dtype=torch.float32)
        return self.transformer(
            hidden_states=hidden.to(dtype),
            timestep=timestep.to(hidden.dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled"].to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            txt_ids=cond["text_ids"],
            img_ids=cond["img_ids"],
            return_dict=False,
        )[0]

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return self._transformer(latents, timestep, cond)

    def initial_latents(self, batch: int, height: int, width: int,
                        generators: Sequence[torch.Generator]) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        channels = self.transformer.config.in_channels // 4
        h, w = self.latent_grid(height, width)

        noise = randn_tensor((batch, channels, h, w), generator=list(generators), device=self.device,
                             dtype=torch.float32)
        return self.pipe._pack_latents(noise, batch, channels, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> list[Image.Image]:
        pipe = self.pipe
        x = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        x = (x / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        images = pipe.vae.decode(x.to(pipe.vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(images, output_type="pil")


class FluxKontextPolicy(FluxPolicy):
    """FLUX.1 Kontext image editing (``FluxKontextPipeline``): the reference (input) image's
    packed VAE latents ``(B, seq_ref, C)`` are appended to the sequence and their prediction is
    dropped (module docstring).

    Args:
        reference_aspect: ``keep`` (the paper's intent: the reference is resized to the output
            size, which keeps its aspect, :func:`paco.grpo.policies.base.grid_size`) or
            ``square`` (the released trainer: squashed to a ``min(h, w)``-sided square;
            :meth:`paco.grpo.policies.base.Policy.reference_size`).
    """

    family = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    edits = True
    option_keys = FluxPolicy.option_keys + ("reference_aspect",)

    def __init__(self, pipe: Any, lora: Any | None, *, reference_aspect: str = "keep", **kwargs: Any):
        super().__init__(pipe, lora, **kwargs)
        self.set_reference_aspect(reference_aspect)

    @torch.no_grad()
    def encode_reference(self, images: Sequence[Image.Image], height: int, width: int) -> torch.Tensor:
        """Packed reference latents ``(B, seq_ref, C)`` float32: each image resized to
        ``height x width`` with the pipeline's image processor (``resize`` + ``preprocess``, as
        ``FluxKontextPipeline`` with ``_auto_resize=False``), encoded by the VAE (the latent
        distribution's mode) and shifted and scaled as the noise latents are."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents

        pipe = self.pipe
        out = []
        for image in images:
            im = pipe.image_processor.resize(image.convert("RGB"), height, width)
            x = pipe.image_processor.preprocess(im, height, width).to(self.device, dtype=pipe.vae.dtype)
            z = retrieve_latents(pipe.vae.encode(x), sample_mode="argmax")
            z = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
            out.append(pipe._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3]).float())
        return torch.cat(out)

    def condition(self, prompts: Sequence[Any], height: int, width: int) -> Conditioning:
        """Text conditioning, the packed reference latents ``image_latents`` and the position
        ids of the output (axis 0 = 0) followed by the reference's (axis 0 = 1).

        Raises:
            ValueError: a prompt without a reference image, or a bad size.
        """
        self.check_size(height, width)
        references = self.references(prompts)
        rh, rw = self.reference_size(height, width)
        text = self.encode_text([p.prompt for p in prompts])
        ref_ids = self.latent_ids(rh, rw).clone()
        ref_ids[..., 0] = 1
        return Conditioning(
            {"prompt_embeds": text["prompt_embeds"], "pooled": text["pooled"],
             "image_latents": self.encode_reference(references, rh, rw)},
            {"text_ids": text["text_ids"], "img_ids": torch.cat([self.latent_ids(height, width), ref_ids])})

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The velocity of the noise part only: ``transformer([latents | image_latents])[:, :seq]``."""
        seq = latents.shape[1]
        hidden = torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
        return self._transformer(hidden, timestep, cond)[:, :seq]


@contextlib.contextmanager
def _quiet_truncation_warnings() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("diffusers.pipelines.flux.pipeline_flux",
                                               "diffusers.pipelines.flux.pipeline_flux_kontext",
                                               "transformers.tokenization_utils_base")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
