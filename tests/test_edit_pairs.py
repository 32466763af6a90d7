"""Editing pairs for the judge: which candidates, which labels, split kept, mirrored repeats."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paco.core.io import decode_image
from paco.data.edit_pairs import EDIT_PAIR_COLUMNS, PAIR_LABELS, make_edit_pairs
from paco.data.edits import photo_edits
from paco.judge.reasons import join_edit_pairs
from paco.core.templates import get_template


@pytest.fixture(scope="module")
def edits() -> pd.DataFrame:
    # 2 photographs per split: candidates come from the item's own split
    return photo_edits(["astronaut", "cat", "coffee", "rocket"], ["greyscale", "mirror", "replace_subject"], 32, 2, 0)


def _pixels(cell) -> np.ndarray:
    return np.asarray(decode_image(cell), dtype=np.int16)


def test_candidates_and_labels_follow_the_table(edits):
    pairs, skipped = make_edit_pairs(edits, seed=0)
    assert skipped == 0 and list(pairs.columns) == EDIT_PAIR_COLUMNS
    by_id = edits.set_index("item_id")
    for r in pairs.to_dict("records"):
        item = by_id.loc[r["item_id"]]
        assert r["label"] == PAIR_LABELS[(r["candidate"], r["question"])]
        assert r["split"] == item["split"]
        assert np.array_equal(_pixels(r["image_a"]), _pixels(item["input_image"]))  # the original first
        template = "edit_pf" if r["question"] == "pf" else "edit_sc"
        assert r["instruction"] == get_template(template).format(prompt=item["instruction"])
        b = _pixels(r["image_b"])
        if r["candidate"] == "correct":
            assert np.array_equal(b, _pixels(item["target_image"]))
        elif r["candidate"] == "unchanged":
            assert np.array_equal(b, _pixels(item["input_image"]))
        elif r["candidate"] == "wrong_edit":  # another operation's result on the same photograph
            same = by_id[(by_id["subject"] == item["subject"]) & (by_id.index != r["item_id"])]
            assert len(same) and (same["split"] == item["split"]).all()
            assert any(np.array_equal(b, _pixels(t)) for t in same["target_image"])
        else:  # wrong_subject: the same operation on another photograph of the split
            other = by_id[(by_id["subject"] != item["subject"]) & (by_id["task_type"] == item["task_type"])
                          & (by_id["split"] == item["split"])]
            assert any(np.array_equal(b, _pixels(t)) for t in other["target_image"])
    # every item asks pf with 3 candidates; sc (2 candidates) except replace_subject
    counts = pairs.groupby(["item_id", "question"]).size()
    for iid, task in zip(edits["item_id"], edits["task_type"]):
        assert counts[(iid, "pf")] == 3
        assert counts.get((iid, "sc"), 0) == (0 if task == "replace_subject" else 2)


def test_repeats_mirror_odd_copies_and_ids_are_unique(edits):
    one, _ = make_edit_pairs(edits, seed=0)
    two, _ = make_edit_pairs(edits, seed=0, repeats=2)
    assert len(two) == 2 * len(one) and two["pair_id"].is_unique
    r0 = two[two["pair_id"].str.endswith("-r0")].iloc[0]
    r1 = two[two["pair_id"] == r0["pair_id"][:-1] + "1"].iloc[0]
    assert np.array_equal(_pixels(r1["image_b"]), _pixels(r0["image_b"])[:, ::-1])
    assert make_edit_pairs(edits, seed=0)[0]["pair_id"].tolist() == one["pair_id"].tolist()  # deterministic
    with pytest.raises(ValueError, match="repeats"):
        make_edit_pairs(edits, repeats=0)


def test_items_without_a_known_result_are_counted_not_paired(edits):
    imported = edits.copy()
    imported["target_image"] = None
    pairs, skipped = make_edit_pairs(imported)
    assert pairs.empty and skipped == len(edits)


def test_editing_pairs_join_the_labels_table_with_their_own_question(edits):
    pairs, _ = make_edit_pairs(edits, seed=0)
    table = join_edit_pairs(pairs)
    assert set(table["task"]) == {"edit_pf", "edit_sc"}
    assert table["theme"].isna().all() and (table["instruction"] == pairs.sort_values("pair_id")["instruction"]).all()


def test_training_pairs_never_show_a_held_out_photograph(edits):
    pairs, _ = make_edit_pairs(edits, seed=0, repeats=2)
    held_out = [_pixels(c) for col in ("input_image", "target_image")
                for c in edits.loc[edits["split"] == "test", col]]
    for cell in pairs.loc[pairs["split"] == "train", "image_b"]:
        b = _pixels(cell)
        assert not any(np.array_equal(b, h) or np.array_equal(b, h[:, ::-1]) for h in held_out)
