"""The ``benchmark@<subtask>`` stage (issue 27): it writes scores.parquet, metrics.json and
table.md; GEdit-Bench's figures from scripted evaluator replies equal a hand computation of the
official formulas; a rerun asks nothing; changed evaluator weights clear the answer cache; an
evaluator answering 500 is a named error with nothing written. The evaluators are a stand-in
OpenAI server (tests/fake_openai.py) or, in the slow test, the tiny judge served by the stage."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from fake_openai import FakeOpenAIServer
from PIL import Image

import paco.judge.client as judge_client
from paco.core.io import encode_image, write_parquet
from paco.data.edits import EDIT_COLUMNS, EDIT_IMAGE_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
#: the scores.parquet columns (issue 27's list, then the protocol details)
SCORE_COLUMNS = ["sample_id", "case_id", "variant", "evaluator", "protocol", "dimension", "criterion", "panels",
                 "question", "score", "score_list", "reply", "parsed", "attempt", "guessed", "task_type", "language"]
OUTS = ("scores.parquet", "metrics.json", "table.md")


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    monkeypatch.setattr(judge_client, "backoff_s", lambda attempts: 0.0)


def _image(seed: int, size: tuple[int, int] = (48, 64)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def _member(protocol: str, evaluators: dict, **kw) -> dict:
    member = {"protocol": protocol, "dataset": "prompts" if protocol == "t2is" else "edits",
              "evaluators": evaluators, "seeds_per_prompt": 1, "max_prompts": None, "concurrency": 4,
              "timeout_s": 30, "retries": 0, "top_logprobs": 2048, "t2is": {"prompt_alignment": "none"},
              "gedit": {"scoring": "reply", "max_tokens": 512, "official_random": False, "seed": 42,
                        "text_first": False}}
    return {**member, **kw}


def _workdir(tmp: Path, benchmark: dict) -> Path:
    """``tmp`` as a repository root: params.yaml (the committed one with ``benchmark``
    replaced) and the samples and items of a t2is and a kontext_editing member."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["benchmark"] = benchmark
    (tmp / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    crit = {"Identity": {"Face": "The same face appears in every panel."},
            "Style": {"Light": "The lighting is the same."}, "Surroundings": {"Bg": "The same background."}}
    prompts = [{"prompt_id": "t2is-0001", "rows": 2, "cols": 2, "criteria": json.dumps(crit)},
               {"prompt_id": "t2is-0002", "rows": 1, "cols": 2, "criteria": json.dumps(crit)},
               {"prompt_id": "t2is-0003", "rows": 1, "cols": 2, "criteria": json.dumps({})}]
    write_parquet(tmp / "data/prompts/prompts.parquet", pd.DataFrame(prompts))
    # GEdit items: official task types, both languages, Intersection_exist; "e" never parses
    edits = [("a", "color_alter", "en", True), ("b", "color_alter", "en", False), ("c", "style_change", "en", True),
             ("d", "subject-add", "cn", True), ("e", "subject-remove", "en", True)]
    rows = [{"item_id": k, "split": "test", "source": "gedit", "subject": "", "task_type": t,
             "instruction": f"edit {k}", "language": lang, "input_image": encode_image(_image(ord(k), (40, 56))),
             "target_image": None, "height": 40, "width": 56, "intersection_exist": inter}
            for k, t, lang, inter in edits]
    write_parquet(tmp / "data/edits/edits.parquet", pd.DataFrame(rows, columns=[*EDIT_COLUMNS, "intersection_exist"]),
                  image_columns=EDIT_IMAGE_COLUMNS)
    for sub, ids in (("t2is", [p["prompt_id"] for p in prompts]), ("kontext_editing", [e[0] for e in edits])):
        samples = [{"sample_id": f"{p}-s{k}-{v}", "prompt_id": p, "seed": k, "variant": v,
                    "image": encode_image(_image(100 * n + 10 * k + (v == "lora")))}
                   for n, p in enumerate(ids) for k in range(2) for v in ("base", "lora")]
        write_parquet(tmp / f"data/final_samples/{sub}/samples.parquet", pd.DataFrame(samples), image_columns=["image"])
    return tmp


def _run(root: Path, subtask: str, monkeypatch) -> int:
    from stages import benchmark as stage

    items = "prompts/prompts" if subtask == "t2is" else "edits/edits"
    out = root / "data/benchmark" / subtask
    monkeypatch.chdir(root)
    return stage.main(["--params", "params.yaml", "--subtask", subtask,
                       "--samples", f"data/final_samples/{subtask}/samples.parquet", "--items", f"data/{items}.parquet",
                       "--answers", str(out / "answers"), "--scores", str(out / "scores.parquet"),
                       "--table", str(out / "table.md"), "--metrics", str(out / "metrics.json")])


def _reply(body: dict, n: int) -> tuple:
    """SC: a score list per instruction (``edit e``: no score, ever); PQ: [9, 8]."""
    text = body["messages"][0]["content"][-1]["text"]
    sc = {"a": "[8, 6]", "b": "[4, 9]", "c": "[10, 7]", "d": "[3, 3]"}
    if "Editing instruction:" in text:
        key = text.rsplit("Editing instruction: edit ", 1)[1].strip()
        content = "I would rather not say." if key == "e" else f'{{"score": {sc[key]}, "reasoning": "ok"}}'
    else:
        content = '{"score" : [9, 8], "reasoning": "natural"}'
    return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": content}}]}, 0


@pytest.mark.parametrize("engine", ["paco", "vllm"])  # evaluators asked at once / one after the other
def test_gedit_scores_are_the_official_formulas_and_a_rerun_asks_nothing(tmp_path, monkeypatch, engine):
    with FakeOpenAIServer(_reply) as fake:
        evaluators = {name: {"model": None, "url": fake.base_url, "served_model_name": name, "api_key_env": None,
                             "stand_in_for": None} for name in ("qwen", "gemma")}
        root = _workdir(tmp_path, {"kontext_editing": _member("gedit", evaluators)})
        if engine == "vllm":  # a judge of its own elsewhere: no GPU asked of grpo / final_samples here
            raw = yaml.safe_load((root / "params.yaml").read_text())
            raw["judge_endpoint"].update(url="http://judge:8000/v1", server={**raw["judge_endpoint"]["server"],
                                                                             "engine": "vllm", "gpus": 0})
            (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        assert _run(root, "kontext_editing", monkeypatch) == 0
        asked = len(fake.requests)
        out = root / "data/benchmark/kontext_editing"
        first = {name: (out / name).read_bytes() for name in OUTS}
        assert _run(root, "kontext_editing", monkeypatch) == 0
        assert len(fake.requests) == asked  # every answer from the cache
    # 5 items x 2 variants x (SC, PQ), plus item e's one re-query per variant, per evaluator
    assert asked == 2 * (5 * 2 * 2 + 2 * 2)
    assert {name: (out / name).read_bytes() for name in OUTS} == first
    report = json.loads((out / "report.json").read_text())
    assert all(ev["asked"] == 0 and ev["cache_hits"] > 0 for ev in report["evaluators"].values())
    m = json.loads((out / "metrics.json").read_text())
    # by hand: SC = min(list), PQ = min([9, 8]) = 8, Overall = sqrt(SC * PQ); per task type the mean,
    # then the plain mean over the task types scored (subject-remove: item e, unparsed, drops out)
    o = {k: math.sqrt(sc * 8) for k, sc in {"a": 6, "b": 4, "c": 7, "d": 3}.items()}
    expected = {"en": (6.0, 8.0, ((o["a"] + o["b"]) / 2 + o["c"]) / 2), "en_i": (6.5, 8.0, (o["a"] + o["c"]) / 2),
                "cn": (3.0, 8.0, o["d"]), "cn_i": (3.0, 8.0, o["d"])}
    for variant in ("base", "lora"):
        for name in ("qwen", "gemma"):
            got = m["scores"][variant][name]
            for cell, (sc, pq, overall) in expected.items():
                assert got[cell]["sc"] == pytest.approx(sc, abs=1e-12) and got[cell]["pq"] == pytest.approx(pq)
                assert got[cell]["overall"] == pytest.approx(overall, abs=1e-12), (variant, name, cell)
            assert got["en"]["unparsed"] == 1 and m["unparsed"][variant][name] == 1
    assert m["lora_minus_base"]["qwen"]["overall"] == {"n": 4, "mean_diff": 0.0, "t_p": None, "wilcoxon_p": None}
    scores = pd.read_parquet(out / "scores.parquet")
    assert list(scores.columns) == SCORE_COLUMNS and len(scores) == 2 * (5 * 2 * 2 + 2 * 2)
    again = scores[scores["attempt"] == 1]
    assert set(again["case_id"]) == {"e-s0"} and not again[again["protocol"] == "sc"]["parsed"].any()
    sc_a = scores[(scores["case_id"] == "a-s0") & (scores["protocol"] == "sc")].iloc[0]
    assert list(sc_a["score_list"]) == [8.0, 6.0] and sc_a["score"] == 6.0 and sc_a["task_type"] == "color_alter"
    assert "Editing instruction: edit a" in sc_a["question"] and sc_a["reply"].startswith('{"score": [8, 6]')
    table = (out / "table.md").read_text()
    assert "| FLUX.1-Kontext + PaCo (paper) |  |  |  |  | 7.279 | 7.036 | 6.636 |" in table
    assert "| LoRA (this run) | `gemma` | 6.000 | 8.000 |" in table


def test_an_evaluator_answering_500_is_a_named_error_with_nothing_written(tmp_path, monkeypatch, caplog):
    with FakeOpenAIServer(lambda body, n: (500, {"error": {"message": "boom"}}, 0)) as fake:
        ev = {"broken": {"model": None, "url": fake.base_url, "served_model_name": "m", "api_key_env": None,
                         "stand_in_for": None}}
        root = _workdir(tmp_path, {"t2is": _member("t2is", ev)})
        assert _run(root, "t2is", monkeypatch) == 2
    assert "evaluator 'broken'" in caplog.text and "HTTP status 500" in caplog.text
    assert "nothing was scored" in caplog.text
    out = root / "data/benchmark/t2is"
    assert not any((out / name).exists() for name in OUTS) and not (out / "report.json").exists()


def test_changed_evaluator_weights_change_the_run_identity_and_clear_the_cache(tmp_path):
    """A served evaluator's model directory is a dependency of every member (rendered from the
    params) and part of its run identity; the answer cache of another identity is cleared."""
    from paco.benchmark.serving import prepare_answers
    from paco.core.params import load_params
    from paco.core.run_identity import stage_identity
    from workflow.registry import member, render_dvc

    ev = {"served": {"model": "data/models/judge_base", "url": None, "served_model_name": "m", "api_key_env": None,
                     "stand_in_for": None},
          "remote": {"model": "data/models/clip", "url": "http://127.0.0.1:9/v1", "served_model_name": "r",
                     "api_key_env": None, "stand_in_for": None}}
    root = _workdir(tmp_path, {"t2is": _member("t2is", ev)})
    config = yaml.safe_load((root / "params.yaml").read_text())
    deps = render_dvc(config)["stages"]["benchmark"]["do"]["deps"]
    assert "data/models/judge_base" in deps and "data/models/clip" not in deps  # a url evaluator reads no weights
    model = root / "data/models/judge_base"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights 1")
    params = load_params(root / "params.yaml")

    def identity() -> str:
        m = member("benchmark@t2is", params.model_dump(mode="json", by_alias=True))
        return stage_identity(m, root / "params.yaml", root=root, params=params).digest

    answers = root / "answers"
    first = identity()
    assert prepare_answers(answers, first) == 0
    (answers / "answers-served.jsonl").write_text("{}\n")
    assert prepare_answers(answers, identity()) == 1  # same identity: kept
    (model / "model.safetensors").write_bytes(b"weights 2")
    assert identity() != first
    assert prepare_answers(answers, identity()) == 0 and not (answers / "answers-served.jsonl").exists()


def _vc_by_hand(scores: pd.DataFrame) -> float:
    """test_prompt_consistency.py's VC from the rows, written out: per criterion the mean over
    pairs, per dimension the mean over criteria (0 where a case lacks it), per dimension the
    mean over the cases scoring > 0, VC the mean of Identity, Style, Logic."""
    dims = {"Identity": [], "Style": [], "Logic": []}
    for _, case in scores[scores["protocol"] == "vc"].groupby("case_id"):
        per_dim = case.groupby(["dimension", "criterion"])["score"].mean().groupby("dimension").mean()
        for d in dims:
            dims[d].append(float(per_dim.get(d, 0.0)))
    means = [np.mean([v for v in vals if v > 0]) if any(v > 0 for v in vals) else 0.0 for vals in dims.values()]
    return float(np.mean(means))


@pytest.mark.slow
def test_t2is_through_the_served_tiny_judge(tmp_path, monkeypatch):
    """The stage serves both evaluators itself (the tiny judge, engine paco): outputs, the
    official VC by hand, a rerun that starts no server, and new weights that are asked again."""
    from paco.models.fetch import materialise

    models = tmp_path / "models"
    ev = {"trained": {"model": "data/reward_merge/model", "url": None, "served_model_name": "trained",
                      "api_key_env": None, "stand_in_for": "Qwen/Qwen2.5-VL-7B-Instruct"},
          "base": {"model": "data/models/judge_base", "url": None, "served_model_name": "base", "api_key_env": None,
                   "stand_in_for": "google/gemma-3-4b-it"}}
    (tmp_path / "repo").mkdir()
    root = _workdir(tmp_path / "repo", {"t2is": _member("t2is", ev)})
    judge = materialise("judge_base", "tiny:qwen2_5_vl", models / "seed0", seed=0)
    shutil.copytree(judge, root / "data/models/judge_base")
    shutil.copytree(judge, root / "data/reward_merge/model")
    out = root / "data/benchmark/t2is"
    assert _run(root, "t2is", monkeypatch) == 0
    first = {name: (out / name).read_bytes() for name in OUTS}
    report = json.loads((out / "report.json").read_text())
    per_eval = 2 * (3 * 6 + 3 * 1)  # 2 variants x 3 criteria x (6 pairs of a 2x2 grid + 1 of a 1x2 one)
    assert {n: e["asked"] for n, e in report["evaluators"].items()} == {"trained": per_eval, "base": per_eval}
    m = json.loads(first["metrics.json"])
    assert m["cases"] == 3 and m["skipped_cases"] == 1 and m["questions"] == {"vc": per_eval // 2, "pa": 0}
    scores = pd.read_parquet(out / "scores.parquet")
    assert list(scores.columns) == SCORE_COLUMNS and len(scores) == 2 * per_eval
    for (variant, name), rows in scores.groupby(["variant", "evaluator"]):
        got = m["scores"][variant][name]
        assert set(got) == {"identity", "style", "logic", "vc", "entity", "attribute", "relation", "pa",
                            "aesthetics", "avg"}
        assert got["vc"] == pytest.approx(_vc_by_hand(rows), abs=1e-12) and got["logic"] == 0.0
        assert got["pa"] is None and got["aesthetics"] is None and got["avg"] is None
    assert "not scored, aesthetics" in first["table.md"].decode() and "stand-in evaluators" in first["table.md"].decode()
    # a rerun: every answer cached, no server started, the same bytes
    assert _run(root, "t2is", monkeypatch) == 0
    report = json.loads((out / "report.json").read_text())
    assert all(e["asked"] == 0 and not e["server_started"] for e in report["evaluators"].values())
    assert {name: (out / name).read_bytes() for name in OUTS} == first
    # the base evaluator's weights change: a new run identity, every question asked again
    shutil.rmtree(root / "data/models/judge_base")
    shutil.copytree(materialise("judge_base", "tiny:qwen2_5_vl", models / "seed1", seed=1),
                    root / "data/models/judge_base")
    assert _run(root, "t2is", monkeypatch) == 0
    report = json.loads((out / "report.json").read_text())
    assert {n: e["asked"] for n, e in report["evaluators"].items()} == {"trained": per_eval, "base": per_eval}
    again = json.loads((out / "metrics.json").read_text())
    assert again["scores"]["base"]["trained"] == m["scores"]["base"]["trained"]  # same weights, same answers
    assert again["scores"]["base"]["base"] != m["scores"]["base"]["base"]


def test_gedit_expected_score_stand_in(tmp_path, monkeypatch):
    """``scoring: expected_score``: sum_k k p_k / sum_k p_k over the first token's score tokens
    (SC: "7" and "9" equally likely -> 8; PQ: "3" at 1/4, "5" at 1/4, "x" at 1/2 -> 4)."""
    def script(body, n):
        text = body["messages"][0]["content"][-1]["text"]
        top = ([("7", math.log(0.5)), ("9", math.log(0.5))] if "Editing instruction:" in text
               else [("x", math.log(0.5)), ("3", math.log(0.25)), ("5", math.log(0.25))])
        entries = [{"token": t, "logprob": lp, "bytes": None} for t, lp in top]
        choice = {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": top[0][0]},
                  "logprobs": {"content": [{"token": top[0][0], "logprob": top[0][1], "top_logprobs": entries}]}}
        return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [choice]}, 0

    with FakeOpenAIServer(script) as fake:
        ev = {"tiny": {"model": None, "url": fake.base_url, "served_model_name": "t", "api_key_env": None,
                       "stand_in_for": "Qwen/Qwen2.5-VL-7B-Instruct"}}
        gedit = {"scoring": "expected_score", "max_tokens": 512, "official_random": False, "seed": 42,
                 "text_first": False}
        root = _workdir(tmp_path, {"kontext_editing": _member("gedit", ev, gedit=gedit, max_prompts=2)})
        assert _run(root, "kontext_editing", monkeypatch) == 0
        assert all(r["max_tokens"] == 1 and r["logprobs"] is True for r in fake.requests) and len(fake.requests) == 8
    out = root / "data/benchmark/kontext_editing"
    m = json.loads((out / "metrics.json").read_text())
    got = m["scores"]["lora"]["tiny"]["en"]
    assert (got["sc"], got["pq"]) == (pytest.approx(8.0), pytest.approx(4.0))
    assert got["overall"] == pytest.approx(math.sqrt(32.0)) and m["unparsed"]["base"]["tiny"] == 0
    table = (out / "table.md").read_text()
    assert "the expected score over the first token's log-probs" in table and "`tiny` for Qwen/Qwen2.5-VL" in table


def test_the_gedit_import_keeps_intersection_exist(tmp_path):
    """GEdit-Bench's ``Intersection_exist`` reaches edits.parquet as ``intersection_exist`` (null
    where a row has none; a non-bool is refused), for the ``-I`` cells; the photos source's table
    keeps its columns (the embedded default's bytes)."""
    import io

    from paco.data.edits import EditsError, import_gedit, photo_edits

    def png() -> bytes:
        buf = io.BytesIO()
        _image(0, (8, 8)).save(buf, format="PNG")
        return buf.getvalue()

    rows = [{"key": f"k{i}", "task_type": "color_alter", "instruction": f"edit {i}", "instruction_language": "en",
             "input_image": {"bytes": png(), "path": f"{i}.png"}, "Intersection_exist": flag}
            for i, flag in enumerate([True, False, None])]
    pd.DataFrame(rows).to_parquet(tmp_path / "g.parquet")
    table = import_gedit(tmp_path / "g.parquet", languages=None, test_items=1, split_seed=42, strict=True,
                         max_pixels=1 << 20).table
    assert list(table["intersection_exist"]) == [True, False, None]
    (tmp_path / "0.png").write_bytes(png())
    bad = {**rows[0], "input_image": "0.png", "Intersection_exist": "yes"}  # a string is truthy officially
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(EditsError, match="Intersection_exist must be a bool"):
        import_gedit(tmp_path / "bad.jsonl", languages=None, test_items=1, split_seed=42, strict=True,
                     max_pixels=1 << 20)
    photos = photo_edits(["cat", "coffee"], ["mirror"], 16, 1, 0)
    assert list(photos.columns) == list(EDIT_COLUMNS)
