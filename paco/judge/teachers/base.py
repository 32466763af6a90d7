"""The teacher interface: the pair to explain (:class:`PairItem`), the result
(:class:`TeacherResult`), answer validation against the known label, and the :class:`Teacher`
base class every backend subclasses (``explain(batch) -> list[TeacherResult]``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from PIL import Image

from paco.core.templates import judge_instruction, teacher_instruction
from paco.judge.response import NO, YES, _as_bool, format_response, parse_response, sanitize_reason

__all__ = ["PairItem", "TeacherResult", "TeacherConfigError", "Teacher", "validate_answer"]


@dataclass(frozen=True)
class PairItem:
    """One pair to explain.

    Attributes:
        pair_id: stable id (``pairs.parquet``).
        image_a, image_b: the two panels (PIL, any mode/size).
        label: ``True`` = consistent ("Yes"), ``False`` = not ("No").
        theme: the set's theme (main prompt) or ``None`` (selects the judge question, see
            :func:`paco.core.templates.judge_instruction`).
        question: the judge question itself, for pairs that do not ask the T2IS question (an
            editing pair's ``edit_pf`` / ``edit_sc``, :mod:`paco.data.edit_pairs`).
    """

    pair_id: str
    image_a: Image.Image
    image_b: Image.Image
    label: bool
    theme: str | None = None
    question: str | None = None  # the judge question when it is not the T2IS one (an editing pair's)


@dataclass
class TeacherResult:
    """The teacher's output for one :class:`PairItem`.

    Attributes:
        pair_id: the item's id.
        ok: ``True`` when ``response`` is a valid, label-consistent target.
        reasons: the reasons (``[]`` for the fast variant and for failures).
        response: the canonical target (:func:`paco.judge.response.format_response`); ``""`` when
            ``ok`` is ``False``.
        error: why the item failed (contains the endpoint URL / model directory), else ``None``.
        attempts: teacher calls made for this item (``fast``: 0; ``template``: 1).
        raw: the last raw teacher text (``openai``/``local``), for audit.
    """

    pair_id: str
    ok: bool
    reasons: list[str]
    response: str
    error: str | None = None
    attempts: int = 0
    raw: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TeacherConfigError(ValueError):
    """The teacher params section is invalid (unknown key, bad value, missing env var)."""


def _check_batch(batch: Sequence[PairItem]) -> list[PairItem]:
    items = list(batch)
    for i, it in enumerate(items):
        if not isinstance(it, PairItem):
            raise TypeError(f"batch[{i}] is {type(it).__name__}, expected PairItem")
        if not isinstance(it.image_a, Image.Image) or not isinstance(it.image_b, Image.Image):
            raise TypeError(f"batch[{i}] ({it.pair_id}): image_a and image_b must be PIL images")
        _as_bool(it.label)
    return items


def validate_answer(text: str, label: bool, max_reasons: int) -> tuple[list[str], str | None]:
    """Check a teacher response against the known label.

    Returns:
        ``(reasons, None)`` for a response that starts with the expected answer and has at least
        one reason (kept: the first ``max_reasons``, sanitised), else ``([], error message)``.
    """
    got, reasons = parse_response(text)
    snippet = repr(text[:120]) if isinstance(text, str) else repr(text)
    if got is None:
        return [], f"response does not start with 'Yes' or 'No': {snippet}"
    if got != bool(label):
        want = YES if label else NO
        return [], f"response answers {YES if got else NO!r} but the label is {want!r}: {snippet}"
    reasons = [r for r in (sanitize_reason(r) for r in reasons) if r][:max_reasons]
    if not reasons:
        return [], f"response gives no reasons: {snippet}"
    return reasons, None


class Teacher(ABC):
    """Base class: ``explain(batch) -> list[TeacherResult]`` (one per item, same order).

    Args:
        fast: return bare ``"Yes."``/``"No."`` targets without calling the backend.
        max_reasons: the most reasons kept per pair (>= 1).
        retries: extra attempts after the first (>= 0).
    """

    backend: str = "base"

    def __init__(self, *, fast: bool = False, max_reasons: int = 3, retries: int = 2) -> None:
        if int(max_reasons) < 1:
            raise TeacherConfigError(f"max_reasons must be >= 1, got {max_reasons}")
        if int(retries) < 0:
            raise TeacherConfigError(f"retries must be >= 0, got {retries}")
        self.fast = bool(fast)
        self.max_reasons = int(max_reasons)
        self.retries = int(retries)

    def explain(self, batch: Sequence[PairItem]) -> list[TeacherResult]:
        """Explain each pair's known label.

        Args:
            batch: :class:`PairItem` list (may be empty).

        Returns:
            One :class:`TeacherResult` per item, in input order. Failures are results with
            ``ok=False``; nothing is dropped and no label is changed.

        Raises:
            TypeError: an item is not a :class:`PairItem` with PIL images and a bool label.
        """
        items = _check_batch(batch)
        if self.fast:
            return [
                TeacherResult(it.pair_id, True, [], format_response(_as_bool(it.label), None), None, 0)
                for it in items
            ]
        if not items:
            return []
        results = self._explain(items)
        assert len(results) == len(items)
        return results

    @abstractmethod
    def _explain(self, items: list[PairItem]) -> list[TeacherResult]: ...

    def question(self, item: PairItem) -> str:
        """The judge question for ``item``: its own ``question`` (an editing pair's), else the
        T2IS question with the item's theme."""
        return item.question if item.question else judge_instruction(item.theme)

    def prompt(self, item: PairItem) -> str:
        """The teacher's instruction for ``item``: the question plus the known answer."""
        return teacher_instruction(self.question(item), _as_bool(item.label), self.max_reasons)

    def describe(self) -> dict[str, Any]:
        """Provenance for metrics / the ``teacher`` column (no secrets)."""
        return {"backend": self.backend, "fast": self.fast, "max_reasons": self.max_reasons}

    def _ok(self, item: PairItem, reasons: list[str], attempts: int, raw: str | None = None) -> TeacherResult:
        return TeacherResult(item.pair_id, True, reasons, format_response(_as_bool(item.label), reasons),
                             None, attempts, raw)

    @staticmethod
    def _fail(item: PairItem, error: str, attempts: int, raw: str | None = None) -> TeacherResult:
        return TeacherResult(item.pair_id, False, [], "", error, attempts, raw)
