"""CLIP embeddings for the CLIP-based metrics: CLIP-I, CLIP-T and a PickScore-style score.

* CLIP-I (image-image consistency baseline, paper Table 2): ``cosine(image_embeddings(a),
  image_embeddings(b))``;
* CLIP-T (prompt alignment): ``cosine(image_embeddings(images), text_embeddings(prompts))``;
* PickScore-style: ``logit_scale * cosine`` (:meth:`ClipScorer.image_text_scores`), softmaxed
  over candidates by the caller.

The model is any CLIP dual encoder directory of the ``models`` stage (tiny build or e.g.
``openai/clip-vit-large-patch14``), loaded with :func:`paco.models.loading.load_clip`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from paco.models.loading import load_clip


def _features(out) -> torch.Tensor:
    """``get_*_features`` returns a tensor (transformers 4) or an output whose
    ``pooler_output`` is the projected embedding (transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class ClipScorer:
    """Embeds images and texts with a CLIP model; every embedding is L2-normalised float32.

    Args:
        path: CLIP model directory (``config.json``, weights, tokenizer, image processor).
        device: torch device for the forward passes (embeddings are returned on CPU).
        dtype: model dtype (float32 on CPU; bfloat16/float16 on GPU). Outputs are float32.

    Raises:
        paco.models.loading.ModelDirectoryError: ``path`` is missing or incomplete.
    """

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.model, self.processor = load_clip(path)
        self.device = torch.device(device)
        self.model.to(device=self.device, dtype=dtype)
        self.dtype = dtype
        self.max_text_length = int(self.model.config.text_config.max_position_embeddings)

    @property
    def dim(self) -> int:
        """Embedding dimension ``d`` (the projection dim)."""
        return int(self.model.config.projection_dim)

    @property
    def logit_scale(self) -> float:
        """CLIP's learned temperature ``exp(logit_scale)`` (100 for trained CLIP; 2.6592 ->
        ~14.3 for a random init)."""
        return float(self.model.logit_scale.detach().exp().item())

    @torch.no_grad()
    def image_embeddings(self, images: Sequence[Image.Image], batch_size: int = 32) -> torch.Tensor:
        """Embed images.

        Args:
            images: PIL images of any size and mode (converted to RGB, resized and centre-cropped
                by the CLIP image processor).
            batch_size: images per forward pass.

        Returns:
            ``(n, d)`` float32 CPU tensor, each row with L2 norm 1; ``(0, d)`` for no images.
        """
        chunks = []
        for start in range(0, len(images), batch_size):
            batch = [im.convert("RGB") for im in images[start:start + batch_size]]
            pixels = self.processor(images=batch, return_tensors="pt")["pixel_values"]
            out = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
            chunks.append(_features(out).float().cpu())
        if not chunks:
            return torch.zeros(0, self.dim)
        return torch.nn.functional.normalize(torch.cat(chunks), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        """Embed texts (truncated to the text model's context, 77 tokens for CLIP).

        Returns:
            ``(n, d)`` float32 CPU tensor, each row with L2 norm 1; ``(0, d)`` for no texts.
        """
        chunks = []
        for start in range(0, len(texts), batch_size):
            enc = self.processor.tokenizer(
                list(texts[start:start + batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_text_length,
                return_tensors="pt",
            )
            out = self.model.get_text_features(
                input_ids=enc["input_ids"].to(self.device),
                attention_mask=enc["attention_mask"].to(self.device),
            )
            chunks.append(_features(out).float().cpu())
        if not chunks:
            return torch.zeros(0, self.dim)
        return torch.nn.functional.normalize(torch.cat(chunks), dim=-1)

    @staticmethod
    def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Row-wise cosine similarity.

        Args:
            a, b: ``(n, d)`` embeddings (normalised or not; they are normalised here), or one of
                them ``(1, d)`` / ``(d,)`` to broadcast against the other.

        Returns:
            ``(n,)`` float32 tensor in ``[-1, 1]``.
        """
        a = torch.nn.functional.normalize(torch.as_tensor(a, dtype=torch.float32).reshape(-1, a.shape[-1]), dim=-1)
        b = torch.nn.functional.normalize(torch.as_tensor(b, dtype=torch.float32).reshape(-1, b.shape[-1]), dim=-1)
        return (a * b).sum(-1).clamp(-1.0, 1.0)

    @staticmethod
    def similarity_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """All-pairs cosine: ``(n, d) x (m, d) -> (n, m)`` float32 in ``[-1, 1]``."""
        a = torch.nn.functional.normalize(torch.as_tensor(a, dtype=torch.float32), dim=-1)
        b = torch.nn.functional.normalize(torch.as_tensor(b, dtype=torch.float32), dim=-1)
        return (a @ b.T).clamp(-1.0, 1.0)

    def image_text_scores(self, images: Sequence[Image.Image], texts: Sequence[str]) -> torch.Tensor:
        """PickScore-style score of each image against its text: ``logit_scale * cosine``.

        Args:
            images: ``n`` images; texts: ``n`` texts (or one text for all images).

        Returns:
            ``(n,)`` float32, in ``[-logit_scale, logit_scale]``.

        Raises:
            ValueError: ``len(texts)`` is neither ``len(images)`` nor 1.
        """
        if len(texts) not in (1, len(images)):
            raise ValueError(f"got {len(images)} images but {len(texts)} texts")
        return self.logit_scale * self.cosine(self.image_embeddings(images), self.text_embeddings(texts))
