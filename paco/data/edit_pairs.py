"""Yes/No pairs that teach the judge the editing questions (paper §3.1, §7: PaCo-Dataset adds
5,695 verified consistent editing pairs to the T2IS pairs; the embedded default builds its own
from edits whose correct result is known).

For every item of ``edits.parquet`` with a ``target_image`` (the ``photos`` source) the original
(first image) is paired with *candidates* (second image):

=============  =========================================  ==================  ==================
candidate      what it is                                  ``pf`` (follows)    ``sc`` (consistent)
=============  =========================================  ==================  ==================
correct        the item's computed result                  Yes                 Yes
unchanged      the original itself                         No                  --
wrong_edit     another operation's result on the same      No                  --
               photograph
wrong_subject  the same operation on another photograph    --                  No
=============  =========================================  ==================  ==================

Candidates come from the item's own split (a training pair never shows a held-out photograph).

``pf`` pairs carry the prompt-following question (template ``edit_pf``), ``sc`` pairs the
semantic-consistency question (``edit_sc``), both with the item's instruction
(:mod:`paco.core.templates`). ``--`` pairs are not made: a wrong operation keeps the subject's
identity but not its style (ambiguous), and an unchanged image is trivially consistent: as a
Yes it teaches the small judge that identical means Yes, which the prompt-following question
then contradicts (with them, held-out PF accuracy fell below chance). ``sc`` pairs are not made for
``replace_subject`` items (the intended change is the subject itself, so "another photograph"
is not a clean negative). Candidates are drawn with ``stable_seed(seed, ...)``, so the table is
the same in any process. Each pair is repeated ``repeats`` times; odd repeats mirror both images
horizontally (label-preserving for every operation, ``mirror`` included: the mirror of a mirrored
view is the mirrored original). Items keep their split, so test-photo pairs are held out.

Items without a ``target_image`` (a GEdit-Bench import) give no pairs; they are counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
from PIL import ImageOps

from paco.core.io import decode_image, encode_image
from paco.core.seeding import stable_seed
from paco.core.templates import get_template

#: Columns of ``edit_pairs.parquet``.
EDIT_PAIR_COLUMNS = ["pair_id", "item_id", "split", "task_type", "question", "candidate", "instruction", "edit",
                     "image_a", "image_b", "label"]

#: (candidate, question) -> label; the pairs made for every item (module table)
PAIR_LABELS: dict[tuple[str, str], bool] = {
    ("correct", "pf"): True, ("unchanged", "pf"): False, ("wrong_edit", "pf"): False,
    ("correct", "sc"): True, ("wrong_subject", "sc"): False,
}

#: question -> judge template
QUESTION_TEMPLATES = {"pf": "edit_pf", "sc": "edit_sc"}


def _has_target(cell: Any) -> bool:
    return isinstance(cell, Mapping) and bool(cell.get("bytes"))


def edit_candidates(edits: pd.DataFrame, seed: int) -> dict[str, dict[str, Any]]:
    """Per item id with a target: ``{"correct", "unchanged", "wrong_edit", "wrong_subject"}`` ->
    an image cell (``wrong_*`` ``None`` when the item's split has no such item).

    ``wrong_edit``: the target of another operation on the same photograph (``subject``);
    ``wrong_subject``: the target of the same operation on another photograph, else of any
    operation other than ``replace_subject`` on another photograph; both from the item's split.
    """
    known = edits[[_has_target(c) for c in edits["target_image"]]]
    rows = known.to_dict("records")
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        iid = str(r["item_id"])
        same_photo = sorted((o for o in rows if o["subject"] == r["subject"] and o["item_id"] != r["item_id"]),
                            key=lambda o: str(o["item_id"]))
        pool = [o for o in rows if o["split"] == r["split"] and o["subject"] != r["subject"]
                and o["task_type"] != "replace_subject"]
        same_op = sorted((o for o in pool if o["task_type"] == r["task_type"]), key=lambda o: str(o["item_id"]))
        if not same_op:
            same_op = sorted(pool, key=lambda o: str(o["item_id"]))

        def pick(candidates: list[dict[str, Any]], what: str) -> Any:
            if not candidates:
                return None
            return candidates[stable_seed(seed, "edit-pairs", iid, what) % len(candidates)]["target_image"]

        out[iid] = {"correct": r["target_image"], "unchanged": r["input_image"],
                    "wrong_edit": pick(same_photo, "wrong_edit"), "wrong_subject": pick(same_op, "wrong_subject")}
    return out


def _mirror(cell: Mapping[str, Any], what: str) -> dict[str, Any]:
    return encode_image(ImageOps.mirror(decode_image(cell, what=what)))


def make_edit_pairs(edits: pd.DataFrame, *, seed: int = 0, repeats: int = 1) -> tuple[pd.DataFrame, int]:
    """The editing pairs of ``edits`` (module docstring).

    Args:
        edits: ``edits.parquet`` rows (``item_id``, ``split``, ``subject``, ``task_type``,
            ``instruction``, ``input_image``, ``target_image``).
        seed: draws the ``wrong_*`` candidates.
        repeats: copies of each pair (``>= 1``); odd copies are mirrored.

    Returns:
        ``(pairs, skipped)``: :data:`EDIT_PAIR_COLUMNS` rows sorted by ``pair_id`` (``instruction``
        is the filled judge question, ``edit`` the item's instruction, ``image_a`` the original,
        ``image_b`` the candidate); ``skipped`` counts items without a target image.

    Raises:
        ValueError: ``repeats < 1``. paco.core.io.ImageDecodeError: an image cell that does not
            decode (only decoded for mirrored copies).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    candidates = edit_candidates(edits, seed)
    rows = []
    for r in edits.sort_values("item_id").to_dict("records"):
        iid = str(r["item_id"])
        if iid not in candidates:
            continue
        for (cand, question), label in PAIR_LABELS.items():
            if question == "sc" and r["task_type"] == "replace_subject":
                continue
            image_b = candidates[iid][cand]
            if image_b is None:
                continue
            text = get_template(QUESTION_TEMPLATES[question]).format(prompt=str(r["instruction"]))
            for k in range(repeats):
                a, b = r["input_image"], image_b
                if k % 2:
                    a, b = _mirror(a, f"edit {iid} input_image"), _mirror(b, f"edit {iid} {cand}")
                rows.append({
                    "pair_id": f"edit-{iid}-{question}-{cand}" + (f"-r{k}" if repeats > 1 else ""),
                    "item_id": iid, "split": str(r["split"]), "task_type": str(r["task_type"]),
                    "question": question, "candidate": cand, "instruction": text, "edit": str(r["instruction"]),
                    "image_a": a, "image_b": b, "label": label,
                })
    table = pd.DataFrame(rows, columns=EDIT_PAIR_COLUMNS).sort_values("pair_id").reset_index(drop=True)
    return table, int(sum(not _has_target(c) for c in edits["target_image"]))
