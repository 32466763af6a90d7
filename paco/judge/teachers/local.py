"""The ``local`` teacher: a transformers VLM (Qwen2.5-VL) loaded from a directory, generating
in-process (greedy first try, seeded sampling on retries), with the same prompt layout and
answer validation as the other backends."""

from __future__ import annotations

from typing import Any

from paco.judge.chat import build_messages
from paco.judge.teachers.base import PairItem, Teacher, TeacherConfigError, TeacherResult, validate_answer

__all__ = ["LocalTeacher"]


class LocalTeacher(Teacher):
    """A transformers VLM (Qwen2.5-VL) generating in-process, same layout and validation.

    Args:
        model_dir: HF directory, loaded with :func:`paco.models.loading.load_judge` on first use.
        model, processor: already-loaded objects (instead of ``model_dir``; tests, reuse).
        batch_size: pairs per ``generate`` call.
        max_new_tokens: generation length.
        temperature: sampling temperature of retries; the first try is greedy.
        seed: seeds the retries' sampling (``seed + attempt``; the global RNG is restored).
        device: torch device for the model and inputs.
        fast, max_reasons, retries: see :class:`Teacher`.

    Raises:
        TeacherConfigError: neither ``model_dir`` nor ``model`` + ``processor`` given.
    """

    backend = "local"

    def __init__(self, *, model_dir: str | None = None, model: Any = None, processor: Any = None,
                 batch_size: int = 4, max_new_tokens: int = 256, temperature: float = 0.7, seed: int = 0,
                 device: str = "cpu", **kw: Any) -> None:
        super().__init__(**kw)
        if model is None or processor is None:
            if not model_dir and not self.fast:
                raise TeacherConfigError("local.model_dir is required (or pass model and processor)")
        self.model_dir = str(model_dir) if model_dir else None
        self._model, self._processor = model, processor
        self.batch_size = max(1, int(batch_size))
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.device = device

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model_dir": self.model_dir, "max_new_tokens": self.max_new_tokens}

    def _load(self) -> tuple[Any, Any]:
        if self._model is None or self._processor is None:
            from paco.models.loading import load_judge

            self._model, self._processor = load_judge(self.model_dir)
            self._model.to(self.device)
        return self._model, self._processor

    def _generate(self, items: list[PairItem], attempt: int) -> list[str]:
        import torch

        model, processor = self._load()
        tok = getattr(processor, "tokenizer", processor)
        old_side = getattr(tok, "padding_side", "right")
        tok.padding_side = "left"
        try:
            texts = [
                processor.apply_chat_template(build_messages(it.image_a, it.image_b, self.prompt(it)),
                                              tokenize=False, add_generation_prompt=True)
                for it in items
            ]
            images = [[it.image_a.convert("RGB"), it.image_b.convert("RGB")] for it in items]
            inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
        finally:
            tok.padding_side = old_side
        inputs = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in inputs.items()}
        gen: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        if attempt > 0 and self.temperature > 0:
            gen.update(do_sample=True, temperature=self.temperature)
        else:
            gen.update(do_sample=False)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.seed + attempt)
            out = model.generate(**inputs, **gen)
        new = out[:, inputs["input_ids"].shape[1]:]
        return list(processor.batch_decode(new, skip_special_tokens=True))

    def _explain(self, items: list[PairItem]) -> list[TeacherResult]:
        results: dict[int, TeacherResult] = {}
        errors: dict[int, str] = {}
        raws: dict[int, str] = {}
        pending = list(range(len(items)))
        where = self.model_dir or "the given model"
        for attempt in range(self.retries + 1):
            if not pending:
                break
            still: list[int] = []
            for s in range(0, len(pending), self.batch_size):
                chunk = pending[s:s + self.batch_size]
                try:
                    texts = self._generate([items[i] for i in chunk], attempt)
                except Exception as e:  # noqa: BLE001 - a model error fails the chunk, recorded
                    for i in chunk:
                        results[i] = self._fail(items[i], f"local teacher {where}: {type(e).__name__}: {e}",
                                                attempt + 1)
                    continue
                for i, text in zip(chunk, texts):
                    raws[i] = text
                    reasons, err = validate_answer(text, items[i].label, self.max_reasons)
                    if err is None:
                        results[i] = self._ok(items[i], reasons, attempt + 1, text)
                    else:
                        errors[i] = f"{err} (local teacher {where})"
                        still.append(i)
            pending = still
        for i in pending:
            results[i] = self._fail(items[i], f"{errors[i]}; gave up after {self.retries + 1} attempt(s)",
                                    self.retries + 1, raws.get(i))
        return [results[i] for i in range(len(items))]
