"""Qwen-Image-Edit policy (``QwenImageEditPipeline``, the ``qwen_editing`` subtask; paper §7).

It follows ``QwenImageEditPipeline.__call__`` step by step: the instruction is encoded by the
Qwen2.5-VL text encoder *with the input image* (the pipeline's system template, its first
``prompt_template_encode_start_idx`` tokens dropped, the last hidden state), the input image is
encoded by the Qwen-Image VAE (its mode, normalised by ``latents_mean`` / ``latents_std``) and
packed 2x2 like the noise, appended to the image sequence (``img_shapes`` gives both grids to
the rotary embedding) and its prediction dropped; the schedule is Qwen-Image's shifted one
(:func:`paco.grpo.sde.flux_sigmas` on the pipeline's scheduler, ``shift_terminal`` included).
There is no guidance embedding: *true* classifier-free guidance runs the transformer twice, on
the instruction and on the negative prompt, combines ``neg + s (cond - neg)`` and rescales the
result to the conditional prediction's norm per token (the pipeline's ``true_cfg_scale``).
Guidance is on only when a negative prompt is given and ``s > 1``, as in the pipeline: the
released trainer passes none, so its true CFG is silently off (a known defect, reproduced by
``negative_prompt: null``). Sources: diffusers ``pipeline_qwenimage_edit.py``; X-GenGroup/PaCo-RL
``train_qwenimage_edit.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from paco.grpo.policies.base import Conditioning, Policy

#: the modules of a Qwen-Image-Edit pipeline directory
QWEN_IMAGE_EDIT_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler")


class QwenImageEditPolicy(Policy):
    """Qwen-Image-Edit (``QwenImageEditPipeline``).

    Args:
        pipe, lora, seed: see :class:`paco.grpo.policies.base.Policy`.
        guidance_scale: the true CFG scale ``s`` (paper 4.0); guidance is on when ``s > 1`` and
            a ``negative_prompt`` is given.
        negative_prompt: the unconditional text (the pipeline's documented default is ``" "``);
            ``None``: no guidance (the released trainer).
        reference_aspect: ``keep`` or ``square``
            (:meth:`paco.grpo.policies.base.Policy.reference_size`).
    """

    family = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    components = QWEN_IMAGE_EDIT_COMPONENTS
    edits = True
    option_keys = ("guidance_scale", "negative_prompt", "reference_aspect")

    def __init__(self, pipe: Any, lora: Any | None, *, guidance_scale: float = 4.0,
                 negative_prompt: str | None = " ", reference_aspect: str = "keep", seed: int = 0):
        super().__init__(pipe, lora, seed=seed)
        self.set_reference_aspect(reference_aspect)
        self.true_cfg_scale = float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.size_multiple = 2 * pipe.vae_scale_factor

    @property
    def true_cfg(self) -> bool:
        """Whether the velocity is the true-CFG combination (scale > 1 and a negative prompt)."""
        return self.true_cfg_scale > 1 and self.negative_prompt is not None

    @classmethod
    def component_overrides(cls, model_dir: str | Path) -> dict[str, Any]:
        """The processor, loaded image-only (``Qwen2VLProcessor`` needs torchvision for its video
        processor; images are all the pipeline gives it)."""
        from paco.models.loading import load_qwen_vl_processor

        return {"processor": load_qwen_vl_processor(Path(model_dir) / "processor")}

    # ---------------------------------------------------------------------------- conditioning

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str], images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_embeds (B, L, D), mask (B, L) int64)`` of each text with its image, right-padded
        to the batch's longest (the pipeline's ``encode_prompt``; an all-ones mask is kept)."""
        embeds, mask = self.pipe.encode_prompt(image=list(images), prompt=list(texts), device=self.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    @torch.no_grad()
    def encode_reference(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """Packed, normalised VAE latents ``(B, seq_ref, C)`` float32 of already-resized images."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

        pipe, vae = self.pipe, self.pipe.vae
        z_dim = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)
        out = []
        for im in images:
            x = pipe.image_processor.preprocess(im, im.height, im.width).unsqueeze(2).to(self.device, dtype=vae.dtype)
            z = retrieve_latents(vae.encode(x), sample_mode="argmax")
            z = (z - mean.to(z)) / std.to(z)
            out.append(pipe._pack_latents(z, 1, z_dim, z.shape[3], z.shape[4]).float())
        return torch.cat(out)

    def condition(self, prompts: Sequence[Any], height: int, width: int) -> Conditioning:
        """The instruction encoded with its input image (and the negative prompt with it, under
        true CFG), the packed reference latents and the grid shapes of output and reference.

        Raises:
            ValueError: a prompt without a reference image, or a bad size.
        """
        self.check_size(height, width)
        rh, rw = self.reference_size(height, width)
        refs = [self.pipe.image_processor.resize(r.convert("RGB"), rh, rw) for r in self.references(prompts)]
        embeds, mask = self.encode_text([p.prompt for p in prompts], refs)
        rows = {"prompt_embeds": embeds, "prompt_mask": mask, "image_latents": self.encode_reference(refs)}
        if self.true_cfg:
            rows["negative_embeds"], rows["negative_mask"] = self.encode_text([self.negative_prompt] * len(prompts), refs)
        p = self.size_multiple
        shapes = torch.tensor([[1, height // p, width // p], [1, rh // p, rw // p]], dtype=torch.long)
        return Conditioning(rows, {"img_shapes": shapes},
                            pad={"prompt_embeds": 0.0, "prompt_mask": 0, "negative_embeds": 0.0, "negative_mask": 0})

    # ---------------------------------------------------------------------------- model calls

    def _transformer(self, hidden: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor,
                     mask: torch.Tensor, img_shapes: list[list[tuple[int, int, int]]]) -> torch.Tensor:
        dtype = self.transformer_dtype
        return self.transformer(
            hidden_states=hidden.to(dtype),
            timestep=timestep.to(hidden.dtype) / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds.to(dtype),
            img_shapes=img_shapes,
            return_dict=False,
        )[0]

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The noise part of the prediction; under true CFG ``neg + s (cond - neg)`` rescaled to
        the conditional prediction's per-token norm (``QwenImageEditPipeline``)."""
        seq = latents.shape[1]
        hidden = torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
        shapes = [[tuple(int(v) for v in s) for s in cond["img_shapes"].tolist()]] * latents.shape[0]
        v = self._transformer(hidden, timestep, cond["prompt_embeds"], cond["prompt_mask"], shapes)[:, :seq]
        if not self.true_cfg:
            return v
        neg = self._transformer(hidden, timestep, cond["negative_embeds"], cond["negative_mask"], shapes)[:, :seq]
        comb = neg + self.true_cfg_scale * (v - neg)
        return comb * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))

    def initial_latents(self, batch: int, height: int, width: int,
                        generators: Sequence[torch.Generator]) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        c = self.transformer.config.in_channels // 4
        h, w = self.latent_grid(height, width)
        noise = randn_tensor((batch, 1, c, h, w), generator=list(generators), device=self.device, dtype=torch.float32)
        return self.pipe._pack_latents(noise, batch, c, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> list[Image.Image]:
        pipe, vae = self.pipe, self.pipe.vae
        x = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(vae.dtype)
        z_dim = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(x)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(x)
        images = vae.decode(x / inv_std + mean, return_dict=False)[0][:, :, 0]  # the pipeline's own arithmetic
        return pipe.image_processor.postprocess(images, output_type="pil")
