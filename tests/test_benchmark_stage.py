"""The ``benchmark@<subtask>`` stage (issue 27): it writes scores.parquet, metrics.json and
table.md; GEdit-Bench's figures from scripted evaluator replies equal a hand computation of the
official formulas; a rerun asks nothing; changed evaluator weights clear the answer cache; an
evaluator answering 500 is a named error with nothing written. The evaluators are a stand-in
OpenAI server (tests/fake_openai.py) or, in the slow test, the tiny judge served by the stage."""

from __future__ import annotations

import base64
import hashlib
import io
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

import paco.serving.client as judge_client
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


#: SC score list per instruction before the bump (``edit e``: no score, ever); PQ [9, PQ_BASE]
SC_BASE = {"a": 6, "b": 4, "c": 5, "d": 3}
PQ_BASE = 5
MODEL_BUMP = {"qwen": 0, "gemma": 1}
#: GEdit items of _workdir: (task type, language, intersection_exist)
ITEMS = {"a": ("color_alter", "en", True), "b": ("color_alter", "en", False), "c": ("style_change", "en", True),
         "d": ("subject-add", "cn", True)}


def _bump(pixels: bytes, model: str) -> int:
    """The fake evaluator's rule: 0..3 from a hash of the edited image's RGB pixel bytes, plus 1 for
    the ``gemma`` model: answers depend on the image asked about and on the model asking."""
    return hashlib.sha256(pixels).digest()[0] % 4 + MODEL_BUMP[model]


def _reply(body: dict, n: int) -> tuple:
    """SC: ``[9, SC_BASE + bump]`` per instruction (``edit e``: no score, ever); PQ:
    ``[9, PQ_BASE + bump]``; the bump of the last image sent (the edited one)."""
    content = body["messages"][0]["content"]
    text = content[-1]["text"]
    url = [c for c in content if c["type"] == "image_url"][-1]["image_url"]["url"]
    edited = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    bump = _bump(edited.tobytes(), body["model"])
    if "Editing instruction:" in text:
        key = text.rsplit("Editing instruction: edit ", 1)[1].strip()
        content = ("I would rather not say." if key == "e"
                   else f'{{"score": [9, {SC_BASE[key] + bump}], "reasoning": "ok"}}')
    else:
        content = f'{{"score" : [9, {PQ_BASE + bump}], "reasoning": "natural"}}'
    return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": content}}]}, 0


def _gedit_by_hand(root: Path, variant: str, model: str) -> tuple[dict, dict]:
    """The figures of the rule of :func:`_reply`, computed from the stored images: the edited image
    resized to the input's size (RGB, bicubic: test_gedit_score.py:34), SC = min(list), PQ =
    min(list), Overall = sqrt(SC * PQ) per item; per cell the mean per task type, then the plain
    mean over the task types scored (calculate_statistics.py). Returns (cells, per-case overall)."""
    per_item = {}
    for key in ITEMS:
        b = _bump_of(root, key, variant, model)
        sc, pq = min(9, SC_BASE[key] + b), min(9, PQ_BASE + b)
        per_item[key] = (sc, pq, math.sqrt(sc * pq))
    cells = {}
    for cell, lang, only_i in (("en", "en", False), ("en_i", "en", True), ("cn", "cn", False), ("cn_i", "cn", True)):
        keys = [k for k, (_, la, inter) in ITEMS.items() if la == lang and (inter or not only_i)]
        types = sorted({ITEMS[k][0] for k in keys})
        means = [[np.mean([per_item[k][i] for k in keys if ITEMS[k][0] == t]) for i in range(3)] for t in types]
        cells[cell] = tuple(float(np.mean([m[i] for m in means])) for i in range(3)) + (types,)
    return cells, {f"{k}-s0": v[2] for k, v in per_item.items()}


@pytest.mark.parametrize("engine", ["paco", "vllm"])  # evaluators asked at once / one after the other
def test_gedit_scores_are_the_official_formulas_and_a_rerun_asks_nothing(tmp_path, monkeypatch, engine):
    from paco.benchmark.gedit_bench import OFFICIAL_TASK_TYPES

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
    by_hand, overall = {}, {}
    for variant in ("base", "lora"):
        for name in ("qwen", "gemma"):
            by_hand[variant, name], overall[variant, name] = _gedit_by_hand(root, variant, name)
            got = m["scores"][variant][name]
            for cell, (sc, pq, o, types) in by_hand[variant, name].items():
                assert got[cell]["sc"] == pytest.approx(sc, abs=1e-12) and got[cell]["pq"] == pytest.approx(pq)
                assert got[cell]["overall"] == pytest.approx(o, abs=1e-12), (variant, name, cell)
                # subject-remove (item e, unparsed) and the 7 types without an item are left out, listed
                assert got[cell]["missing_task_types"] == [t for t in OFFICIAL_TASK_TYPES if t not in types]
            assert got["en"]["unparsed"] == 1 and m["unparsed"][variant][name] == 1
    # the rule tells the variants and the evaluators apart: swapping either would fail
    assert by_hand["base", "qwen"] != by_hand["lora", "qwen"] and by_hand["base", "qwen"] != by_hand["base", "gemma"]
    assert m["scores"]["base"]["qwen"] != m["scores"]["lora"]["qwen"]
    assert m["scores"]["base"]["qwen"] != m["scores"]["base"]["gemma"]
    for name in ("qwen", "gemma"):
        diffs = [overall["lora", name][c] - overall["base", name][c] for c in overall["base", name]]
        got = m["lora_minus_base"][name]["overall"]
        assert got["n"] == 4 and got["mean_diff"] == pytest.approx(float(np.mean(diffs)), abs=1e-12)
    assert report["official_task_types"] is False and set(report["partial_cells"]) == {"en", "en_i", "cn", "cn_i"}
    scores = pd.read_parquet(out / "scores.parquet")
    assert list(scores.columns) == SCORE_COLUMNS and len(scores) == 2 * (5 * 2 * 2 + 2 * 2)
    again = scores[scores["attempt"] == 1]
    assert set(again["case_id"]) == {"e-s0"} and not again[again["protocol"] == "sc"]["parsed"].any()
    sc_a = scores[(scores["case_id"] == "a-s0") & (scores["protocol"] == "sc") & (scores["variant"] == "base")
                  & (scores["evaluator"] == "qwen")].iloc[0]
    a_sc = min(9, SC_BASE["a"] + _bump_of(root, "a", "base", "qwen"))
    assert list(sc_a["score_list"]) == [9.0, float(a_sc)] and sc_a["score"] == a_sc
    assert sc_a["task_type"] == "color_alter"
    assert "Editing instruction: edit a" in sc_a["question"] and sc_a["reply"].startswith(f'{{"score": [9, {a_sc}]')
    table = (out / "table.md").read_text()
    assert "| FLUX.1-Kontext + PaCo (paper) |  |  |  |  | 7.279 | 7.036 | 6.636 |" in table
    g = by_hand["lora", "gemma"]["en"]
    assert f"| LoRA (this run) | `gemma` | {g[0]:.3f} | {g[1]:.3f} | {g[2]:.3f} |" in table
    assert "EN: a mean over fewer than the 11 task types" in table and "subject-remove" in table
    assert "answers of URL evaluators (`qwen`, `gemma`) are trusted by name" in table


def _bump_of(root: Path, key: str, variant: str, model: str) -> int:
    """:func:`_bump` of item ``key``'s seed-0 ``variant`` image as sent (resized to the input's size)."""
    def png(v) -> Image.Image:
        return Image.open(io.BytesIO(v["bytes"] if isinstance(v, dict) else v))

    samples = pd.read_parquet(root / "data/final_samples/kontext_editing/samples.parquet")
    row = samples[(samples["prompt_id"] == key) & (samples["seed"] == 0) & (samples["variant"] == variant)].iloc[0]
    source = png(pd.read_parquet(root / "data/edits/edits.parquet").set_index("item_id").loc[key, "input_image"])
    edited = png(row["image"]).convert("RGB").resize(source.size, Image.BICUBIC)
    return _bump(edited.tobytes(), model)


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


def test_the_vllm_tensor_parallel_size_of_a_served_evaluator_is_in_the_run_identity(tmp_path):
    """judge_endpoint.server.gpus is a launch key, yet it is the tensor-parallel size of the vLLM
    server of a served evaluator (its log-probs change): in the identity then, and only then."""
    from paco.core.params import load_params
    from stages.benchmark import run_identity

    served = {"model": "data/models/judge_base", "url": None, "served_model_name": "m", "api_key_env": None,
              "stand_in_for": None}
    remote = {"model": None, "url": "http://127.0.0.1:9/v1", "served_model_name": "r", "api_key_env": None,
              "stand_in_for": None}
    root = _workdir(tmp_path, {"t2is": _member("t2is", {"served": served}, resources={"gpus": 2}),
                               "kontext_editing": _member("gedit", {"remote": remote})})
    model = root / "data/models/judge_base"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    raw = yaml.safe_load((root / "params.yaml").read_text())

    def identity(subtask: str, engine: str, gpus: int):
        raw["judge_endpoint"].update(url="http://judge:8000/v1", server={**raw["judge_endpoint"]["server"],
                                                                         "engine": engine, "gpus": gpus})
        (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        return run_identity(load_params(root / "params.yaml"), subtask, root / "params.yaml", root=root)

    one, two = identity("t2is", "vllm", 1), identity("t2is", "vllm", 2)
    assert one.digest != two.digest and one.changed(two.parts) == ["extra:vllm_tensor_parallel_size"]
    assert one.parts["extra:vllm_tensor_parallel_size"] == "1" and two.parts["extra:vllm_tensor_parallel_size"] == "2"
    assert identity("t2is", "vllm", 0).parts["extra:vllm_tensor_parallel_size"] == "1"  # max(gpus, 1), as served
    # the project's server, or only URL evaluators: gpus changes nothing asked
    assert identity("t2is", "paco", 1).digest == identity("t2is", "paco", 2).digest
    assert "extra:vllm_tensor_parallel_size" not in identity("t2is", "paco", 2).parts
    assert identity("kontext_editing", "vllm", 1).digest == identity("kontext_editing", "vllm", 2).digest


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


def test_the_t2is_scorers_change_no_evaluators_answers_so_keep_the_answer_cache(tmp_path):
    """The t2is scorers run in the stage after the evaluators (t2v_metrics VQAScore, the LAION
    predictor): switching them, or new LAION weights, keeps the identity the answers are kept
    under (they are the stage's evaluation keys, and their files are left out of it); a changed
    evaluator setting does not."""
    from paco.core.params import load_params
    from stages.benchmark import run_identity

    served = {"model": "data/models/judge_base", "url": None, "served_model_name": "m", "api_key_env": None,
              "stand_in_for": None}
    root = _workdir(tmp_path, {"t2is": _member("t2is", {"served": served})})
    model = root / "data/models/judge_base"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    weights = root / "data/raw/aesthetic/mlp.pth"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"mlp 1")
    (root / "data/models/clip").mkdir(parents=True)
    raw = yaml.safe_load((root / "params.yaml").read_text())

    def identity(t2is: dict, **member):
        raw["benchmark"]["t2is"].update(t2is=t2is, **member)
        (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        return run_identity(load_params(root / "params.yaml"), "t2is", root / "params.yaml", root=root)

    first = identity({"prompt_alignment": "none"})
    laion = {"prompt_alignment": "yes_no", "aesthetics": "laion", "aesthetics_clip": "data/models/clip",
             "aesthetics_weights": "data/raw/aesthetic/mlp.pth"}
    assert identity(laion).digest == first.digest
    weights.write_bytes(b"mlp 2")
    assert identity(laion).digest == first.digest
    assert not any(k.startswith("dep:data/raw/aesthetic") for k in identity(laion).parts)
    assert identity(laion, top_logprobs=20).digest != first.digest  # what the evaluators are asked: a new identity
