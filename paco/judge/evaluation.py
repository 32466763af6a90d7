"""Judge benchmarks: ConsistencyRank (paper Table 2) and EditReward-style pairwise accuracy
(paper Table 1), for the trained judge and the baselines (base judge zero-shot, CLIP-I).

ConsistencyRank: each held-out ranking instance has a reference panel and 4 candidates; a
scorer gives each (reference, candidate) a consistency score, the predicted order sorts
candidates by score (:func:`paco.judge.metrics.order_from_scores`) and is compared with the reference
order by :func:`paco.judge.metrics.consistency_rank_metrics`. Significance: a one-sample t-test of the
per-instance accuracy against chance (0.25 for 4 candidates), on instances and, more
conservatively, on per-prompt means (instances of one prompt share images), and a paired test
of the trained judge against each baseline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from paco.core.io import (ArtifactError, ImageDecodeError, dataset_path, decode_image, image_file_byte_limit,
                          iter_text_lines, read_dataset_file)
from paco.core.statistics import binomial_test_p, chance_summary
from paco.judge.metrics import chance_levels, consistency_rank_metrics, order_from_scores

#: scorer(list of (reference image, candidate image, instruction)) -> scores (higher = more consistent)
PairScorer = Callable[[Sequence[tuple[Image.Image, Image.Image, str]]], list[float]]


def rank_predictions(
    instances: pd.DataFrame,
    panels: dict[str, Image.Image],
    instruction_of: dict[str, str],
    scorer: PairScorer,
    name: str,
    *,
    progress: Callable[[Any], Any] = lambda it: it,
    chunk: int = 64,
) -> pd.DataFrame:
    """Score every (reference, candidate) of every instance and order the candidates.

    Args:
        instances: ``rank_instances.parquet`` rows (instance_id, prompt_id, ref_panel_id,
            candidate_panel_ids, ranking).
        panels: panel_id -> decoded image.
        instruction_of: prompt_id -> judge instruction.
        scorer: batch scorer; must return one finite float per triple.

    Returns:
        One row per instance: instance_id, prompt_id, scorer, scores (per candidate, candidate
        order), predicted_order / reference_order (candidate indices, best first).

    Raises:
        ArtifactError: a scorer returned the wrong count or a non-finite score (never replaced).
    """
    triples, keys = [], []
    for inst in instances.itertuples(index=False):
        for k, cand in enumerate(inst.candidate_panel_ids):
            triples.append((panels[inst.ref_panel_id], panels[cand], instruction_of[inst.prompt_id]))
            keys.append((inst.instance_id, k))
    scores: list[float] = []
    for i in progress(range(0, len(triples), chunk)):
        got = scorer(triples[i : i + chunk])
        if len(got) != len(triples[i : i + chunk]):
            raise ArtifactError(f"scorer {name} returned {len(got)} scores for {len(triples[i:i + chunk])} pairs")
        scores += [float(s) for s in got]
    if not np.all(np.isfinite(scores)):
        bad = keys[int(np.flatnonzero(~np.isfinite(scores))[0])]
        raise ArtifactError(f"scorer {name}: non-finite score for instance {bad[0]} candidate {bad[1]}")
    rows, pos = [], 0
    for inst in instances.itertuples(index=False):
        cands = list(inst.candidate_panel_ids)
        s = scores[pos : pos + len(cands)]
        pos += len(cands)
        rows.append(
            {
                "instance_id": inst.instance_id,
                "prompt_id": inst.prompt_id,
                "scorer": name,
                "scores": s,
                "predicted_order": order_from_scores(s),
                "reference_order": [cands.index(c) for c in inst.ranking],
            }
        )
    return pd.DataFrame.from_records(rows)


def summarise_rankings(pred: pd.DataFrame) -> dict[str, Any]:
    """ConsistencyRank metrics of one scorer, with chance tests on instances and prompts."""
    m = consistency_rank_metrics(
        pred["predicted_order"].map(list).tolist(), pred["reference_order"].map(list).tolist(), per_instance=True
    )
    per = m.pop("per_instance")
    n_cand = len(pred["reference_order"].iloc[0])
    chance = chance_levels(n_cand)
    acc = np.asarray(per["accuracy"])
    by_prompt = pd.Series(acc).groupby(pred["prompt_id"].to_numpy()).mean().to_numpy()
    m["chance"] = {"accuracy": chance["accuracy"], "kendall_tau": 0.0}
    m["accuracy_vs_chance"] = chance_summary(acc, chance["accuracy"])
    m["accuracy_vs_chance_per_prompt"] = chance_summary(by_prompt, chance["accuracy"])
    m["kendall_tau_vs_chance"] = chance_summary(np.asarray(per["kendall_tau"]), 0.0)
    return m


def paired_comparison(a: pd.DataFrame, b: pd.DataFrame, metric: str = "accuracy") -> dict[str, Any]:
    """Paired test of scorer ``a`` minus scorer ``b`` on the same instances.

    Top-level keys (``mean``, ``p_value``, ``ci_low``, ``ci_high``, ``n``): one-sided ``a > b``
    t-test of the per-instance differences of ``metric`` against 0
    (:func:`paco.core.statistics.chance_test`). ``per_prompt``: the same test on the per-prompt means of
    the differences (instances of one prompt share panels and are not independent, so this is
    the conservative statement; ``n`` is the prompt count).
    """
    from paco.judge.metrics import rank_metrics

    merged = a.merge(b, on="instance_id", suffixes=("_a", "_b"), validate="one_to_one")
    diff = np.array(
        [
            rank_metrics(list(r.predicted_order_a), list(r.reference_order_a))[metric]
            - rank_metrics(list(r.predicted_order_b), list(r.reference_order_b))[metric]
            for r in merged.itertuples(index=False)
        ]
    )
    by_prompt = pd.Series(diff).groupby(merged["prompt_id_a"].to_numpy()).mean().to_numpy()
    return {**chance_summary(diff, 0.0), "per_prompt": chance_summary(by_prompt, 0.0)}


# --------------------------------------------------------------------------------------------
# EditReward-style pairwise benchmark
# --------------------------------------------------------------------------------------------


#: the pixel bound of EditReward-Bench images when none is given: the GEdit importer's default
#: (``edits.import.max_pixels``); stage ``reward_eval`` passes ``reward_eval.editreward_max_pixels``
EDITREWARD_MAX_PIXELS = 4096 * 4096


def read_edit_benchmark(path: str | Path, *, max_pixels: int = EDITREWARD_MAX_PIXELS) -> pd.DataFrame:
    """Read an editing preference benchmark in one of two layouts, by what ``path`` is.

    * **EditReward-Bench** (paper Table 1; ``EditScore/EditReward-Bench`` on the hub, read by the
      authors' ``PaCo-Reward/evaluation/Edit-Bench/evaluation.py`` with
      ``load_dataset(dir, split="train")``): a Parquet file or a directory of Parquet shards
      (searched recursively, read in sorted order; a shard must be a regular file inside the
      directory, symlinks followed) with the columns :data:`EDITREWARD_COLUMNS`: ``key`` (two
      output ids), ``instruction``, ``input_image`` (an image cell ``{bytes, path}`` with its
      bytes embedded), ``output_images`` (two image cells, the first the human-preferred one),
      ``task_type`` (a string), ``dimension``. An output id names one image: rows that share it
      share one decoded image, and must hold the same bytes for it.
    * **jsonl** (any other file; the project's own small layout): one object per line with
      ``instruction``, ``input_image``, ``output_a``, ``output_b`` (image paths relative to the
      file's folder, which they must not leave: :func:`paco.core.io.dataset_path`; ``output_a``
      preferred), ``dimension`` and optionally ``task_type`` (a string) and ``id`` (a string or
      an integer; ``line-<n>`` without one).

    ``dimension`` is one of :data:`EDIT_DIMENSIONS`. Every image is decoded with ``max_pixels``
    (checked from its header first); a jsonl image file may have at most
    :func:`paco.core.io.image_file_byte_limit` bytes. Everything is checked here, before any scoring.

    Returns:
        The layout of :func:`photo_edit_benchmark`: ``instance_id`` (Parquet: ``<key a>|<key b>|
        <dimension>``; jsonl: the ``id`` or ``line-<n>``), ``item_id`` (the same), ``task_type``,
        ``instruction``, ``input_image``, ``output_a``, ``output_b`` (PIL RGB), ``dimension``,
        ``identical_outputs`` (the two outputs' encoded bytes are equal).

    Raises:
        OutsideDatasetError: a jsonl image path or a Parquet shard that is absolute or leads
            outside the benchmark's folder (``..``, a symlink).
        ImageTooLargeError: an image of more than ``max_pixels`` pixels.
        ArtifactError: a missing file or column, a line that is no JSON object, a field of the
            wrong type (an image that is no image cell or path, a non-string instruction or task
            type), a row without two keys or two output images, an output id given other bytes
            than in an earlier row (both rows named), an unknown dimension, a duplicate instance,
            an image that does not decode (each names the file, the line or row, and the field).
    """
    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        return _read_editreward_parquet(path, max_pixels)
    if not path.is_file():
        raise ArtifactError(f"{path}: no EditReward benchmark file")
    rows = []
    for n, line, error in iter_text_lines(path):
        where = f"{path}:{n}"
        if error is not None:
            raise ArtifactError(f"{where}: {error}")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{where}: invalid JSON ({exc})") from exc
        rows.append(_jsonl_row(rec, where, n, path.parent, max_pixels))
    return _bench_frame(rows, path)


def _jsonl_row(rec: Any, where: str, n: int, root: Path, max_pixels: int) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise ArtifactError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = {"instruction", "input_image", "output_a", "output_b", "dimension"} - rec.keys()
    if missing:
        raise ArtifactError(f"{where}: missing key(s) {sorted(missing)}")
    if not isinstance(rec["instruction"], str) or not rec["instruction"].strip():
        raise ArtifactError(f"{where}: instruction must be a non-blank string, got {rec['instruction']!r}")
    task_type = rec.get("task_type")
    if task_type is not None and not isinstance(task_type, str):
        raise ArtifactError(f"{where}: task_type must be a string, got {task_type!r}")
    ident = rec.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int)) or ident == ""):
        raise ArtifactError(f"{where}: id must be a string or an integer, got {ident!r}")
    _check_dimension(rec["dimension"], where)
    data, images = {}, {}
    for key in ("input_image", "output_a", "output_b"):
        what = f"{where} {key}"
        data[key] = read_dataset_file(root, rec[key], what=what, max_bytes=image_file_byte_limit(max_pixels))
        images[key] = decode_image(data[key], what=what, max_pixels=max_pixels)
    ident = f"line-{n}" if ident is None else str(ident)
    return {"instance_id": ident, "item_id": ident, "task_type": task_type or "", "instruction": rec["instruction"],
            **images, "dimension": rec["dimension"], "identical_outputs": data["output_a"] == data["output_b"]}


#: columns of the EditReward-Bench Parquet export (``datasets`` Image cells: ``{bytes, path}``)
EDITREWARD_COLUMNS = ("key", "instruction", "input_image", "output_images", "task_type", "dimension")

_BENCH_COLUMNS = ["instance_id", "item_id", "task_type", "instruction", "input_image", "output_a", "output_b",
                  "dimension", "identical_outputs"]


def _check_dimension(dimension: Any, where: str) -> None:
    if dimension not in EDIT_DIMENSIONS:
        raise ArtifactError(f"{where}: dimension {dimension!r} is not one of {EDIT_DIMENSIONS}")


def _bench_frame(rows: list[dict[str, Any]], path: Path) -> pd.DataFrame:
    table = pd.DataFrame.from_records(rows, columns=_BENCH_COLUMNS).astype({"identical_outputs": bool})
    dup = table["instance_id"].duplicated()
    if dup.any():
        raise ArtifactError(f"{path}: duplicate instance {table.loc[dup, 'instance_id'].iloc[0]!r}")
    return table


def _editreward_shards(path: Path) -> list[Path]:
    """The Parquet file ``path``, or the shards under the directory ``path``, each a regular file
    inside it (symlinks followed)."""
    if not path.is_dir():
        if not path.is_file():
            raise ArtifactError(f"{path}: no EditReward-Bench Parquet file")
        return [path]
    files = sorted(path.rglob("*.parquet"))
    if not files:
        raise ArtifactError(f"{path}: no EditReward-Bench Parquet file")
    for f in files:
        dataset_path(path, f.relative_to(path), what=f"{path}: Parquet shard")
    return files


def _image_cell(value: Any, what: str) -> bytes:
    """The encoded bytes of an image cell ``{bytes, path}`` (a ``datasets`` Image cell)."""
    if not isinstance(value, dict):
        got = "nothing" if value is None else type(value).__name__
        raise ArtifactError(f"{what} must be an image cell {{bytes, path}} (a datasets Image), got {got}")
    data = value.get("bytes")
    if not isinstance(data, bytes) or not data:
        where = f" (its path {value.get('path')!r} is not read)" if value.get("path") else ""
        raise ImageDecodeError(f"{what}: image cell has no bytes{where}")
    return data


def _read_editreward_parquet(path: Path, max_pixels: int) -> pd.DataFrame:
    import pyarrow.parquet as pq

    files = _editreward_shards(path)
    inputs: dict[str, Image.Image] = {}  # input bytes digest -> image
    outputs: dict[str, tuple[str, Image.Image, str]] = {}  # output id -> (bytes digest, image, first row)
    rows = []
    for f in files:
        try:
            pfile = pq.ParquetFile(f)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a broken file
            raise ArtifactError(f"{f}: not a readable Parquet file ({exc})") from exc
        missing = sorted(set(EDITREWARD_COLUMNS) - set(pfile.schema_arrow.names))
        if missing:
            raise ArtifactError(f"{f}: missing column(s) {missing} (EditReward-Bench has {list(EDITREWARD_COLUMNS)})")
        n = 0
        for batch in pfile.iter_batches(batch_size=64, columns=list(EDITREWARD_COLUMNS)):
            for rec in batch.to_pylist():
                rows.append(_editreward_row(rec, f"{f}: row {n}", inputs, outputs, max_pixels))
                n += 1
    return _bench_frame(rows, path)


def _editreward_row(rec: dict[str, Any], where: str, inputs: dict[str, Image.Image],
                    outputs: dict[str, tuple[str, Image.Image, str]], max_pixels: int) -> dict[str, Any]:
    """One EditReward-Bench row, checked whole; ``inputs`` / ``outputs``: the images decoded so far."""
    import hashlib

    keys, outs = rec["key"], rec["output_images"]
    if not isinstance(keys, list) or len(keys) != 2 or not all(isinstance(k, str) and k for k in keys):
        raise ArtifactError(f"{where}: key must be two output ids, got {keys!r}")
    if not isinstance(outs, list) or len(outs) != 2:
        got = len(outs) if isinstance(outs, list) else "none" if outs is None else type(outs).__name__
        raise ArtifactError(f"{where}: output_images must hold two images, got {got}")
    if not isinstance(rec["instruction"], str) or not rec["instruction"].strip():
        raise ArtifactError(f"{where}: blank instruction")
    if not isinstance(rec["task_type"], str):
        raise ArtifactError(f"{where}: task_type must be a string, got {rec['task_type']!r}")
    _check_dimension(rec["dimension"], where)
    data = _image_cell(rec["input_image"], f"{where}: input_image")
    digest = hashlib.sha256(data).hexdigest()
    if digest not in inputs:
        inputs[digest] = decode_image(data, what=f"{where} input_image", max_pixels=max_pixels)
    digests = []
    for k, cell in zip(keys, outs):
        data = _image_cell(cell, f"{where} output {k}")
        digests.append(hashlib.sha256(data).hexdigest())
        if k not in outputs:
            outputs[k] = (digests[-1], decode_image(data, what=f"{where} output {k}", max_pixels=max_pixels), where)
        elif outputs[k][0] != digests[-1]:
            raise ArtifactError(f"{where}: output id {k!r} holds other image bytes than in {outputs[k][2]} "
                                "(an output id names one image)")
    ident = f"{keys[0]}|{keys[1]}|{rec['dimension']}"
    return {"instance_id": ident, "item_id": ident, "task_type": rec["task_type"], "instruction": rec["instruction"],
            "input_image": inputs[digest], "output_a": outputs[keys[0]][1], "output_b": outputs[keys[1]][1],
            "dimension": rec["dimension"], "identical_outputs": digests[0] == digests[1]}


#: EditReward-Bench dimensions (paper Table 1; the benchmark's names): prompt following (PF),
#: semantic consistency (SC), overall = sqrt(SC * PF)
EDIT_DIMENSIONS = ("prompt_following", "consistency", "overall")

#: photo-edit benchmark: (preferred, rejected, dimension) candidate triples per item
#: (:mod:`paco.data.edit_pairs` candidates; ``wrong_subject`` absent for ``replace_subject``)
PHOTO_PREFERENCES = (
    ("correct", "unchanged", "prompt_following"), ("correct", "wrong_edit", "prompt_following"),
    ("correct", "wrong_subject", "consistency"),
    ("correct", "unchanged", "overall"), ("correct", "wrong_edit", "overall"), ("correct", "wrong_subject", "overall"),
)


def photo_edit_benchmark(edit_pairs: pd.DataFrame, split: str) -> pd.DataFrame:
    """An EditReward-style benchmark from the editing pairs of ``split`` (the embedded default's
    held-out photographs, whose correct edit is known): per item and :data:`PHOTO_PREFERENCES`
    entry one instance preferring the correct edit (``output_a``) to a wrong candidate
    (``output_b``). Only the first copy of a repeated pair is used.

    Returns:
        Rows with ``instance_id``, ``item_id``, ``task_type``, ``instruction`` (the edit),
        ``input_image``, ``output_a``, ``output_b`` (PIL; one object per distinct image, so a
        scorer sees each once), ``dimension``, ``identical_outputs`` (the two candidates' encoded
        bytes are equal); sorted by ``instance_id``. Empty if ``split`` has no editing pairs.

    Raises:
        ArtifactError: an image cell that does not decode (names the pair).
    """
    sel = edit_pairs[(edit_pairs["split"] == split) & ~edit_pairs["pair_id"].str.contains(r"-r[1-9]\d*$")]
    rows = []
    for item_id, g in sel.groupby("item_id", sort=True):
        first = g.iloc[0]
        original = decode_image(first["image_a"], what=f"edit pair {first['pair_id']} image_a")
        cands, encoded = {}, {}
        for r in g.sort_values("pair_id").to_dict("records"):
            if r["candidate"] not in cands:
                cands[r["candidate"]] = decode_image(r["image_b"], what=f"edit pair {r['pair_id']} image_b")
                encoded[r["candidate"]] = r["image_b"].get("bytes") if isinstance(r["image_b"], dict) else r["image_b"]
        for good, bad, dim in PHOTO_PREFERENCES:
            if good in cands and bad in cands:
                rows.append({"instance_id": f"{item_id}-{dim}-{bad}", "item_id": item_id,
                             "task_type": str(first["task_type"]), "instruction": str(first["edit"]),
                             "input_image": original, "output_a": cands[good], "output_b": cands[bad],
                             "dimension": dim, "identical_outputs": encoded[good] == encoded[bad]})
    table = pd.DataFrame(rows, columns=_BENCH_COLUMNS).astype({"identical_outputs": bool})
    return table.sort_values("instance_id", ignore_index=True)


def edit_scores(bench: pd.DataFrame, scorer: PairScorer, *, templates: str = "bench",
                single: bool = False) -> pd.DataFrame:
    """Per instance, the two outputs' scores on the instance's dimension.

    Scores (paper Table 1; reference ``editscore``): semantic consistency ``SC = P_yes`` of the
    consistency question, prompt following ``PF = P_yes`` of the prompt-following question (the
    original first, the output second), ``overall = sqrt(SC * PF)``. ``templates``: ``bench``
    (``edit_sc_bench`` / ``edit_pf_bench``, the EditReward-Bench evaluation's wording) or
    ``reward`` (``edit_sc`` / ``edit_pf``, the GRPO reward's wording). ``single``: the scorer
    ignores the question (CLIP-I): its one score is used for every dimension. An output whose
    size differs from the input's is resized to it first (``PIL.Image.resize``, bicubic), as the
    reference evaluation does (``Edit-Bench/evaluation.py: process_single_item``).

    Args:
        bench: :func:`read_edit_benchmark` or :func:`photo_edit_benchmark` rows.

    Returns:
        ``bench``'s ``instance_id``, ``item_id``, ``task_type``, ``dimension``,
        ``identical_outputs`` with ``score_a`` and ``score_b`` (float64).

    Raises:
        ValueError: unknown ``templates``.
    """
    from paco.core.templates import get_template

    if templates not in ("bench", "reward"):
        raise ValueError(f"templates must be bench or reward, got {templates!r}")
    suffix = "_bench" if templates == "bench" else ""
    sc_t, pf_t = get_template("edit_sc" + suffix), get_template("edit_pf" + suffix)
    # each distinct (input, output, question) once
    keys: dict[tuple[int, int, str], int] = {}
    triples = []
    for r in bench.itertuples(index=False):
        for out in (r.output_a, r.output_b):
            for q, t in (("sc", sc_t), ("pf", pf_t)):
                if single and q == "pf":
                    continue
                k = (id(r.input_image), id(out), q + r.instruction)
                if k not in keys:
                    keys[k] = len(triples)
                    shown = out if out.size == r.input_image.size else out.resize(r.input_image.size)
                    triples.append((r.input_image, shown, t.format(prompt=r.instruction)))
    values = np.asarray(scorer(triples), dtype=np.float64) if triples else np.zeros(0)

    def score(r: Any, out: Image.Image) -> float:
        sc = values[keys[(id(r.input_image), id(out), "sc" + r.instruction)]]
        if single:
            return float(sc)
        pf = values[keys[(id(r.input_image), id(out), "pf" + r.instruction)]]
        return float({"consistency": sc, "prompt_following": pf}.get(r.dimension, np.sqrt(sc * pf)))

    rows = [{"instance_id": r.instance_id, "item_id": r.item_id, "task_type": r.task_type, "dimension": r.dimension,
             "identical_outputs": bool(r.identical_outputs), "score_a": score(r, r.output_a),
             "score_b": score(r, r.output_b)} for r in bench.itertuples(index=False)]
    return pd.DataFrame(rows, columns=["instance_id", "item_id", "task_type", "dimension", "identical_outputs",
                                       "score_a", "score_b"])


def edit_accuracy(scores: pd.DataFrame) -> dict[str, Any]:
    """Pairwise preference accuracy per dimension (paper Table 1): the preferred output must
    score higher (``accuracy``: strict ``>``; ``accuracy_ge``: ``>=``, ties count), macro-averaged
    over task types (``accuracy_macro``: the mean of the per-task-type strict accuracies, as the
    EditReward-Bench evaluation), ``n``, and a one-sided binomial test of the strict wins against
    chance 0.5 (``p_value``, ``scipy.stats.binomtest``; instances of one item share images).

    Instances whose two outputs are the same bytes (``identical_outputs``) stay in these figures,
    as in the benchmark's own ``calculate_statistics.py``, which counts every row (a deterministic
    scorer ties them: lost with ``>``, won with ``>=``); they are counted apart
    (``identical_outputs``) and the strict accuracy without them is ``accuracy_distinct`` over
    ``n_distinct`` instances (``None`` when there is none).

    Args:
        scores: :func:`edit_scores` rows.
    """
    out: dict[str, Any] = {}
    for dim, g in scores.groupby("dimension", sort=True):
        wins = (g["score_a"] > g["score_b"]).to_numpy()
        per_task = g.assign(win=wins).groupby("task_type")["win"].mean()
        same = g["identical_outputs"].to_numpy(dtype=bool)
        out[str(dim)] = {"accuracy": float(wins.mean()), "accuracy_ge": float((g["score_a"] >= g["score_b"]).mean()),
                         "accuracy_macro": float(per_task.mean()), "n": int(len(g)),
                         "p_value": binomial_test_p(int(wins.sum()), len(wins), 0.5, alternative="greater"),
                         "identical_outputs": int(same.sum()), "n_distinct": int((~same).sum()),
                         "accuracy_distinct": float(wins[~same].mean()) if (~same).any() else None}
    return out


def edit_paired_comparison(a: pd.DataFrame, b: pd.DataFrame) -> dict[str, Any]:
    """Per dimension, judge ``a``'s strict wins minus judge ``b``'s on the same instances: the
    mean difference and a one-sided paired t-test (:func:`paco.core.statistics.chance_test` of the
    per-instance differences against 0)."""
    merged = a.merge(b, on="instance_id", suffixes=("_a", "_b"), validate="one_to_one")
    out = {}
    for dim, g in merged.groupby("dimension_a", sort=True):
        diff = ((g["score_a_a"] > g["score_b_a"]).astype(float) - (g["score_a_b"] > g["score_b_b"]).astype(float))
        out[str(dim)] = chance_summary(diff.to_numpy(), 0.0) if diff.std() > 0 else {"mean": float(diff.mean()),
                                                                               "n": int(len(diff))}
    return out


def decode_panels(panels: pd.DataFrame, needed: set[str]) -> dict[str, Image.Image]:
    """Decode the needed panels once (panel_id -> RGB image)."""
    sub = panels[panels["panel_id"].isin(needed)]
    missing = needed - set(sub["panel_id"])
    if missing:
        raise ArtifactError(f"instances reference panels missing from panels.parquet: {sorted(missing)[:5]}")
    return {pid: decode_image(c, what=f"panel {pid}") for pid, c in zip(sub["panel_id"], sub["image"])}
