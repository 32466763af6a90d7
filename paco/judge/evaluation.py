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

from paco.core.io import ArtifactError, decode_image
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


def read_edit_benchmark(path: str | Path) -> pd.DataFrame:
    """Read an editing preference benchmark in one of two layouts, by what ``path`` is.

    * **EditReward-Bench** (paper Table 1; ``EditScore/EditReward-Bench`` on the hub, read by the
      authors' ``PaCo-Reward/evaluation/Edit-Bench/evaluation.py`` with
      ``load_dataset(dir, split="train")``): a Parquet file or a directory of Parquet shards
      (searched recursively, read in sorted order) with the columns :data:`EDITREWARD_COLUMNS`:
      ``key`` (two output ids), ``instruction``, ``input_image`` (an image cell),
      ``output_images`` (two image cells, the first the human-preferred one), ``task_type``,
      ``dimension``. An output id names one image: rows that share it share one decoded image.
    * **jsonl** (any other file; the project's own small layout): one object per line with
      ``instruction``, ``input_image``, ``output_a``, ``output_b`` (image paths relative to the
      file, ``output_a`` preferred), ``dimension`` and optionally ``task_type`` and ``id``.

    ``dimension`` is one of :data:`EDIT_DIMENSIONS`.

    Returns:
        The layout of :func:`photo_edit_benchmark`: ``instance_id`` (Parquet: ``<key a>|<key b>|
        <dimension>``; jsonl: the ``id`` or ``line-<n>``), ``item_id`` (the same), ``task_type``,
        ``instruction``, ``input_image``, ``output_a``, ``output_b`` (PIL RGB), ``dimension``.

    Raises:
        ArtifactError: a missing file or column, a row without two keys or two output images, an
            unknown dimension, a duplicate instance, an image that does not decode (each names
            the file and the line or row).
    """
    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        return _read_editreward_parquet(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no EditReward benchmark file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path}:{n}: invalid JSON ({exc})") from exc
        missing = {"instruction", "input_image", "output_a", "output_b", "dimension"} - rec.keys()
        if missing:
            raise ArtifactError(f"{path}:{n}: missing key(s) {sorted(missing)}")
        for key in ("input_image", "output_a", "output_b"):
            file = path.parent / rec[key]
            rec[key] = decode_image(file.read_bytes() if file.is_file() else None, what=f"{path}:{n} {key}")
        _check_dimension(rec["dimension"], f"{path}:{n}")
        ident = str(rec.get("id") or f"line-{n}")
        rows.append({"instance_id": ident, "item_id": ident, "task_type": str(rec.get("task_type") or ""),
                     "instruction": str(rec["instruction"]), "input_image": rec["input_image"],
                     "output_a": rec["output_a"], "output_b": rec["output_b"], "dimension": rec["dimension"]})
    return _bench_frame(rows, path)


#: columns of the EditReward-Bench Parquet export (``datasets`` Image cells: ``{bytes, path}``)
EDITREWARD_COLUMNS = ("key", "instruction", "input_image", "output_images", "task_type", "dimension")


def _check_dimension(dimension: Any, where: str) -> None:
    if dimension not in EDIT_DIMENSIONS:
        raise ArtifactError(f"{where}: dimension {dimension!r} is not one of {EDIT_DIMENSIONS}")


def _bench_frame(rows: list[dict[str, Any]], path: Path) -> pd.DataFrame:
    cols = ["instance_id", "item_id", "task_type", "instruction", "input_image", "output_a", "output_b", "dimension"]
    table = pd.DataFrame.from_records(rows, columns=cols)
    dup = table["instance_id"].duplicated()
    if dup.any():
        raise ArtifactError(f"{path}: duplicate instance {table.loc[dup, 'instance_id'].iloc[0]!r}")
    return table


def _read_editreward_parquet(path: Path) -> pd.DataFrame:
    import hashlib

    import pyarrow.parquet as pq

    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ArtifactError(f"{path}: no EditReward-Bench Parquet file")
    inputs: dict[str, Image.Image] = {}   # input bytes digest -> image
    outputs: dict[str, Image.Image] = {}  # output id -> image
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
                where = f"{f}: row {n}"
                n += 1
                keys, outs = rec["key"], rec["output_images"]
                if not isinstance(keys, list) or len(keys) != 2 or not all(isinstance(k, str) and k for k in keys):
                    raise ArtifactError(f"{where}: key must be two output ids, got {keys!r}")
                if not isinstance(outs, list) or len(outs) != 2:
                    raise ArtifactError(f"{where}: output_images must hold two images, got "
                                        f"{'none' if outs is None else len(outs)}")
                if not isinstance(rec["instruction"], str) or not rec["instruction"].strip():
                    raise ArtifactError(f"{where}: blank instruction")
                _check_dimension(rec["dimension"], where)
                cell = rec["input_image"]
                digest = hashlib.sha256((cell or {}).get("bytes") or b"").hexdigest()
                if digest not in inputs:
                    inputs[digest] = decode_image(cell, what=f"{where} input_image")
                for k, out in zip(keys, outs):
                    if k not in outputs:
                        outputs[k] = decode_image(out, what=f"{where} output {k}")
                ident = f"{keys[0]}|{keys[1]}|{rec['dimension']}"
                rows.append({"instance_id": ident, "item_id": ident, "task_type": str(rec["task_type"] or ""),
                             "instruction": rec["instruction"], "input_image": inputs[digest],
                             "output_a": outputs[keys[0]], "output_b": outputs[keys[1]],
                             "dimension": rec["dimension"]})
    return _bench_frame(rows, path)


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
        scorer sees each once), ``dimension``; sorted by ``instance_id``. Empty if ``split`` has
        no editing pairs.

    Raises:
        ArtifactError: an image cell that does not decode (names the pair).
    """
    sel = edit_pairs[(edit_pairs["split"] == split) & ~edit_pairs["pair_id"].str.contains(r"-r[1-9]\d*$")]
    cols = ["instance_id", "item_id", "task_type", "instruction", "input_image", "output_a", "output_b", "dimension"]
    rows = []
    for item_id, g in sel.groupby("item_id", sort=True):
        first = g.iloc[0]
        original = decode_image(first["image_a"], what=f"edit pair {first['pair_id']} image_a")
        cands = {}
        for r in g.sort_values("pair_id").to_dict("records"):
            if r["candidate"] not in cands:
                cands[r["candidate"]] = decode_image(r["image_b"], what=f"edit pair {r['pair_id']} image_b")
        for good, bad, dim in PHOTO_PREFERENCES:
            if good in cands and bad in cands:
                rows.append({"instance_id": f"{item_id}-{dim}-{bad}", "item_id": item_id,
                             "task_type": str(first["task_type"]), "instruction": str(first["edit"]),
                             "input_image": original, "output_a": cands[good], "output_b": cands[bad],
                             "dimension": dim})
    return pd.DataFrame(rows, columns=cols).sort_values("instance_id", ignore_index=True)


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

    Returns:
        ``bench``'s ``instance_id``, ``item_id``, ``task_type``, ``dimension`` with ``score_a`` and
        ``score_b`` (float64).

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
             "score_a": score(r, r.output_a), "score_b": score(r, r.output_b)} for r in bench.itertuples(index=False)]
    return pd.DataFrame(rows, columns=["instance_id", "item_id", "task_type", "dimension", "score_a", "score_b"])


def edit_accuracy(scores: pd.DataFrame) -> dict[str, Any]:
    """Pairwise preference accuracy per dimension (paper Table 1): the preferred output must
    score higher (``accuracy``: strict ``>``; ``accuracy_ge``: ``>=``, ties count), macro-averaged
    over task types (``accuracy_macro``: the mean of the per-task-type strict accuracies, as the
    EditReward-Bench evaluation), ``n``, and a one-sided binomial test of the strict wins against
    chance 0.5 (``p_value``, ``scipy.stats.binomtest``; instances of one item share images).

    Args:
        scores: :func:`edit_scores` rows.
    """
    out: dict[str, Any] = {}
    for dim, g in scores.groupby("dimension", sort=True):
        wins = (g["score_a"] > g["score_b"]).to_numpy()
        per_task = g.assign(win=wins).groupby("task_type")["win"].mean()
        out[str(dim)] = {"accuracy": float(wins.mean()), "accuracy_ge": float((g["score_a"] >= g["score_b"]).mean()),
                         "accuracy_macro": float(per_task.mean()), "n": int(len(g)),
                         "p_value": binomial_test_p(int(wins.sum()), len(wins), 0.5, alternative="greater")}
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
