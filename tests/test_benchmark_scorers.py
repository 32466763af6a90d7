"""T2IS-Bench's optional local scorers (issue 27): the official VQAScore prompt alignment through
t2v_metrics (paco.benchmark.vqascore; t2v_metrics is not installed here: a stand-in module in
sys.modules records what the adapter hands it and answers known scores) and the LAION aesthetic
predictor (paco.benchmark.aesthetics: the MLP against numpy, the normalisation, named errors), wired
through plan_t2is / score_local / score_t2is into metrics and table; the default scores neither."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from paco.benchmark.aesthetics import (
    SCORE_SCALE,
    AestheticMLP,
    AestheticsError,
    AestheticWeightsError,
    EmbeddingDimensionError,
    LaionAesthetics,
    aggregate_aesthetics,
    l2_normalise,
    load_mlp,
)
from paco.benchmark.t2is_bench import PA_QUESTION
from paco.benchmark.vqascore import (
    OFFICIAL_MODEL,
    VQAScoreError,
    VQAScoreUnavailableError,
    check_t2v_metrics,
    load_vqascore,
    vqascore_panels,
)
from paco.core.io import ArtifactError, encode_image

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY_CLIP = ROOT / "data/raw/pretrained/clip"
#: the official Sequential's Linear layers and their (out, in) shapes (simple_inference.py MLP(768))
LINEARS = ((0, 1024, None), (2, 128, 1024), (4, 64, 128), (6, 16, 64), (7, 1, 16))


def _state(input_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, n_out, n_in in LINEARS:
        n_in = input_size if n_in is None else n_in
        out[f"layers.{i}.weight"] = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
        out[f"layers.{i}.bias"] = torch.randn(n_out, generator=g)
    return out


def _numpy_mlp(state: dict[str, torch.Tensor], x: np.ndarray) -> np.ndarray:
    h = np.asarray(x, dtype=np.float64)
    for i, _, _ in LINEARS:  # no activation between the layers; dropout is off in eval mode
        h = h @ state[f"layers.{i}.weight"].double().numpy().T + state[f"layers.{i}.bias"].double().numpy()
    return h[:, 0]


# --------------------------------------------------------------------------------------------
# the aesthetic predictor
# --------------------------------------------------------------------------------------------


def test_mlp_with_official_keys_equals_numpy(tmp_path):
    state = _state(768)
    torch.save(state, tmp_path / "w.pth")
    mlp = load_mlp(tmp_path / "w.pth")
    assert isinstance(mlp, AestheticMLP) and not mlp.training and mlp.input_size == 768
    assert set(mlp.state_dict()) == set(state)
    x = np.random.default_rng(0).normal(size=(5, 768))
    got = mlp(torch.from_numpy(x).float())[:, 0].double().detach().numpy()
    np.testing.assert_allclose(got, _numpy_mlp(state, x.astype(np.float32)), rtol=1e-5, atol=1e-5)
    # the same from a directory holding the official file name
    (tmp_path / "role").mkdir()
    torch.save(state, tmp_path / "role" / "sac+logos+ava1-l14-linearMSE.pth")
    again = load_mlp(tmp_path / "role")
    assert all(torch.equal(again.state_dict()[k], state[k]) for k in state)


def test_l2_normalisation_as_the_official_normalized():
    a = np.array([[3.0, 4.0], [0.0, 0.0], [-1.0, 1.0]])
    got = l2_normalise(torch.tensor(a))
    np.testing.assert_array_equal(got[0], [0.6, 0.8])
    np.testing.assert_array_equal(got[1], [0.0, 0.0])  # a zero row stays (l2[l2 == 0] = 1)
    np.testing.assert_allclose(got[2], [-2 ** -0.5, 2 ** -0.5], rtol=1e-15)


@pytest.mark.parametrize("bad", ["missing", "dir", "not_tensors", "keys", "shape"])
def test_bad_weights_are_named_errors(tmp_path, bad):
    path = tmp_path / "w.pth"
    if bad == "dir":
        path = tmp_path
    elif bad == "not_tensors":
        path.write_bytes(b"not a torch file")
    elif bad == "keys":
        torch.save({("model." + k): v for k, v in _state(768).items()}, path)
    elif bad == "shape":
        state = _state(768)
        state["layers.2.weight"] = torch.zeros(128, 512)
        torch.save(state, path)
    with pytest.raises(AestheticWeightsError, match="not found|cannot be loaded|keys|official MLP"):
        load_mlp(path)


def test_tiny_clip_with_official_mlp_is_a_dimension_error(tmp_path):
    torch.save(_state(768), tmp_path / "w.pth")
    with pytest.raises(EmbeddingDimensionError, match="64 dimensions.*768"):
        LaionAesthetics(TINY_CLIP, tmp_path / "w.pth")


def test_laion_scores_are_the_mlp_of_the_normalised_clip_embedding(tmp_path):
    """Independent path: transformers' CLIPModel.get_image_features, normalised in numpy, the MLP in numpy."""
    from paco.models.loading import load_clip

    model, processor = load_clip(TINY_CLIP)
    dim = int(model.config.projection_dim)
    state = _state(dim, seed=3)
    torch.save(state, tmp_path / "w.pth")
    images = [Image.new("RGB", (40, 24), (20 * k, 200 - 30 * k, 90)) for k in range(3)]
    got = LaionAesthetics(TINY_CLIP, tmp_path / "w.pth").scores(images)
    with torch.no_grad():
        out = model.get_image_features(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"])
    emb = (out if isinstance(out, torch.Tensor) else out.pooler_output).double().numpy()
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    np.testing.assert_allclose(got, _numpy_mlp(state, emb.astype(np.float32)), rtol=1e-4, atol=1e-4)
    assert got.dtype == np.float64 and got.shape == (3,)


def test_aesthetics_aggregation_per_case_then_over_cases():
    got = aggregate_aesthetics({"a": [5.0, 6.0, 7.0], "b": [4.0], "c": []})
    assert got["cases"] == {"a": 6.0, "b": 4.0} and got["skipped_cases"] == ["c"]
    assert got["mean_raw"] == 5.0 and got["aesthetics"] == 5.0 / SCORE_SCALE == 0.5
    assert got["n_cases"] == 2 and got["n_panels"] == 4
    assert aggregate_aesthetics({})["aesthetics"] is None
    with pytest.raises(AestheticsError):
        aggregate_aesthetics({"a": [float("nan")]})


def test_the_default_scores_no_aesthetics_and_the_params_are_checked():
    from paco.core.params import load_params
    from paco.core.params.benchmark import T2ISProtocolParams

    params = load_params(ROOT / "params.yaml")
    for cfg in params.benchmark.values():
        assert cfg.t2is.aesthetics == "none" and cfg.t2is.prompt_alignment != "t2v_metrics"
    assert T2ISProtocolParams().aesthetics == "none"
    ok = T2ISProtocolParams(aesthetics="laion", aesthetics_clip="data/models/clip", aesthetics_weights="w.pth")
    assert ok.aesthetics_weights == "w.pth"
    for bad in ({"aesthetics": "laion", "aesthetics_clip": "data/models/clip"},
                {"aesthetics": "laion", "aesthetics_clip": "openai/clip-vit-large-patch14", "aesthetics_weights": "w"},
                {"aesthetics": "none", "aesthetics_weights": "w.pth"}):
        with pytest.raises(ValueError, match="aesthetics"):
            T2ISProtocolParams(**bad)


def test_paper_preset_scores_both_with_a_models_role():
    from paco.core.params import load_params

    t2is = load_params(ROOT / "workflow/presets/paper.yaml").benchmark["t2is_bench"].t2is
    assert (t2is.prompt_alignment, t2is.aesthetics, t2is.aesthetics_clip) == ("t2v_metrics", "laion", "data/models/clip")
    assert t2is.aesthetics_weights.endswith("sac+logos+ava1-l14-linearMSE.pth")


# --------------------------------------------------------------------------------------------
# VQAScore through a stand-in t2v_metrics
# --------------------------------------------------------------------------------------------


def _vqa_rule(path: str, text: str) -> float:
    """The stand-in's score: the panel's red level and the text's length, in [0, 1)."""
    red = np.asarray(Image.open(path).convert("RGB"))[..., 0].mean() / 255
    return float(red / 2 + (len(text) % 10) / 20)


@pytest.fixture
def fake_t2v(monkeypatch):
    """A ``t2v_metrics`` module whose VQAScore records its construction and calls (the PNG read
    at call time) and returns a ``[1, n_texts]`` tensor of :func:`_vqa_rule`."""
    record = {"init": [], "calls": []}

    class VQAScore:
        def __init__(self, model, device="cuda", **kwargs):
            record["init"].append({"model": model, "device": device, **kwargs})

        def __call__(self, images, texts):
            assert isinstance(images, list) and isinstance(texts, list)
            sizes = [Image.open(p).size for p in images]
            record["calls"].append({"paths": list(images), "texts": list(texts), "sizes": sizes,
                                    "exists": [Path(p).is_file() for p in images]})
            return torch.tensor([[_vqa_rule(p, t) for t in texts] for p in images], dtype=torch.float64)

    module = types.ModuleType("t2v_metrics")
    module.VQAScore = VQAScore
    monkeypatch.setitem(sys.modules, "t2v_metrics", module)
    return record


def test_missing_t2v_metrics_is_a_named_error_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "t2v_metrics", None)  # as if not installed
    with pytest.raises(VQAScoreUnavailableError, match=r"paco-pipeline\[t2v\]"):
        check_t2v_metrics()
    with pytest.raises(VQAScoreUnavailableError, match=r"pip install"):
        load_vqascore()


def test_adapter_passes_paths_and_raw_criteria(fake_t2v, tmp_path):
    scorer = load_vqascore(device="cpu")
    assert fake_t2v["init"] == [{"model": OFFICIAL_MODEL, "device": "cpu"}] and OFFICIAL_MODEL == "clip-flant5-xxl"
    panels = [("c-s0_0000.png", Image.new("RGB", (16, 8), (255, 0, 0)), ["a red cat", "on a mat"]),
              ("c-s0_0001.png", Image.new("L", (8, 8), 0), ["a cat"])]
    got = vqascore_panels(scorer, panels, tmp_dir=tmp_path)
    calls = fake_t2v["calls"]
    assert [Path(c["paths"][0]).name for c in calls] == ["c-s0_0000.png", "c-s0_0001.png"]
    assert all(c["exists"] == [True] for c in calls) and [c["sizes"] for c in calls] == [[(16, 8)], [(8, 8)]]
    assert [c["texts"] for c in calls] == [["a red cat", "on a mat"], ["a cat"]]  # t2v_metrics adds the question
    assert got == [[pytest.approx(0.5 + 9 / 20), pytest.approx(0.5 + 8 / 20)], [pytest.approx(5 / 20)]]
    assert list(tmp_path.iterdir()) == []  # the temporary files are gone


@pytest.mark.parametrize("out", [torch.zeros(2, 1), torch.zeros(1, 2), torch.tensor([[1.5]]),
                                 torch.tensor([[float("nan")]]), "text"])
def test_a_bad_vqascore_result_is_a_named_error(out):
    with pytest.raises(VQAScoreError):
        vqascore_panels(lambda images, texts: out, [("x_0000.png", Image.new("RGB", (4, 4)), ["t"])])
    with pytest.raises(VQAScoreError, match="no criteria"):
        vqascore_panels(lambda images, texts: torch.zeros(1, 0), [("x_0000.png", Image.new("RGB", (4, 4)), [])])


# --------------------------------------------------------------------------------------------
# wired into the T2IS run
# --------------------------------------------------------------------------------------------

# p1 has 3 panels, p2 2: panel-weighted (PA) and case-weighted (aesthetics) means differ from the other weighting
ALIGN = {"p1": [{"Entity": ["a fox"], "Attribute": ["red fur", "green eyes"], "Relation": ["fox on a rock"]},
                {"Entity": ["a fox", "a rock"], "Attribute": ["wet"], "Relation": ["next to"]},
                {"Entity": ["a hill"], "Attribute": ["steep", "grassy", "far"], "Relation": ["behind the fox"]}],
         "p2": [{"Entity": ["a tree"], "Attribute": ["tall"], "Relation": ["by the lake"]},
                {"Entity": ["a lake"], "Attribute": ["blue"], "Relation": ["under the sky"]}]}
CRITERIA = {"Style": {"Light": "same light"}, "Identity": {"Face": "same fox"}}
RED = {("p1", "base"): (10, 60, 240), ("p1", "lora"): (110, 160, 20), ("p2", "base"): (200, 30),
       ("p2", "lora"): (90, 250)}


def _tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    prompts = pd.DataFrame([{"prompt_id": p, "rows": 1, "cols": len(a), "criteria": json.dumps(CRITERIA),
                             "alignment": json.dumps(a)} for p, a in ALIGN.items()])
    samples = []
    for (p, v), reds in RED.items():
        grid = Image.new("RGB", (32 * len(reds), 32))
        for k, r in enumerate(reds):
            grid.paste(Image.new("RGB", (32, 32), (r, 5, 5)), (32 * k, 0))
        samples.append({"sample_id": f"{p}-s0-{v}", "prompt_id": p, "seed": 0, "variant": v,
                        "image": encode_image(grid)})
    return pd.DataFrame(samples), prompts


def _cfg(**kw):
    from paco.core.params.benchmark import T2ISProtocolParams

    return T2ISProtocolParams(**kw)


def _official_pa(variant: str) -> dict[str, float]:
    """vqa_alignment.py's figures by hand: per panel and dimension the mean over its criteria, then
    the sum over panels / the panels scored."""
    totals = {"Entity": 0.0, "Attribute": 0.0, "Relation": 0.0}
    n = 0
    for p, panels in ALIGN.items():
        for k, crit in enumerate(panels):
            red = RED[p, variant][k] / 255
            for dim, texts in crit.items():
                totals[dim] += float(np.mean([red / 2 + (len(t) % 10) / 20 for t in texts]))
            n += 1
    return {d.lower(): v / n for d, v in totals.items()}


def test_t2v_metrics_pa_through_plan_score_local_and_score_t2is(fake_t2v):
    from paco.benchmark.t2is_local import VQASCORE_EVALUATOR, check_local, score_local
    from paco.benchmark.t2is_run import plan_t2is, score_t2is
    from paco.benchmark.tables import stand_in_notes, t2is_table

    samples, prompts = _tables()
    plan = plan_t2is(samples, prompts, seeds_per_prompt=None, max_prompts=None, prompt_alignment="t2v_metrics")
    assert all(q["protocol"] == "vc" for q in plan.questions) and len(plan.requests) == len(plan.questions)
    assert len(plan.local_pa) == 2 * sum(len(t) for panels in ALIGN.values() for c in panels for t in c.values())
    cfg = _cfg(prompt_alignment="t2v_metrics")
    check_local(plan, cfg)
    local = score_local(plan, cfg, device="cpu")
    # one call per panel (10 = (3 + 2) panels x 2 variants), its criteria in Entity, Attribute, Relation order
    calls = fake_t2v["calls"]
    assert len(calls) == 10 and fake_t2v["init"] == [{"model": "clip-flant5-xxl", "device": "cpu"}]
    assert [Path(c["paths"][0]).name for c in calls[:2]] == ["p1-s0_0000.png", "p1-s0_0001.png"]
    assert calls[0]["texts"] == ["a fox", "red fur", "green eyes", "fox on a rock"]
    answers = {"ev1": [0.5] * len(plan.questions), "ev2": [0.25] * len(plan.questions)}
    frame, metrics, report = score_t2is(plan, answers, prompt_alignment="t2v_metrics", local=local)
    for variant in ("base", "lora"):
        want = _official_pa(variant)
        for ev in ("ev1", "ev2"):
            got = metrics["scores"][variant][ev]
            assert {k: got[k] for k in want} == pytest.approx(want, abs=1e-12)
            assert got["pa"] == pytest.approx(sum(want.values()) / 3, abs=1e-12)
            assert got["aesthetics"] is None and got["avg"] is None
    assert metrics["questions"]["pa"] == len(plan.local_pa) // 2 and metrics["aesthetics_laion"] is None
    rows = frame[frame["evaluator"] == VQASCORE_EVALUATOR]
    assert len(rows) == len(plan.local_pa) and set(rows["protocol"]) == {"pa"}
    first = rows.iloc[0]
    assert first["criterion"] == "a fox" and first["question"] == PA_QUESTION.format("a fox")
    assert "pa" not in report["not_scored"] and "aesthetics" in report["not_scored"]
    notes = stand_in_notes("t2is", types.SimpleNamespace(t2is=cfg, seeds_per_prompt=None, max_prompts=None),
                           {}, report["not_scored"])
    assert any("official VQAScore" in n for n in notes)
    assert "official VQAScore" in t2is_table("t2is", metrics, {}, notes)


def test_t2v_metrics_missing_fails_before_asking_and_unscored_pa_is_an_error(monkeypatch):
    from paco.benchmark.t2is_local import LocalScores, check_local
    from paco.benchmark.t2is_run import plan_t2is, score_t2is

    monkeypatch.setitem(sys.modules, "t2v_metrics", None)
    samples, prompts = _tables()
    plan = plan_t2is(samples, prompts, seeds_per_prompt=None, max_prompts=None, prompt_alignment="t2v_metrics")
    with pytest.raises(VQAScoreUnavailableError):
        check_local(plan, _cfg(prompt_alignment="t2v_metrics"))
    with pytest.raises(ArtifactError, match="VQAScore questions planned"):
        score_t2is(plan, {"ev": [0.5] * len(plan.questions)}, prompt_alignment="t2v_metrics", local=LocalScores())
    with pytest.raises(ArtifactError, match="prompt_alignment"):
        plan_t2is(samples, prompts, seeds_per_prompt=None, max_prompts=None, prompt_alignment="vqa")
    # without alignment criteria nothing needs t2v_metrics
    plan = plan_t2is(samples, prompts.drop(columns="alignment"), seeds_per_prompt=None, max_prompts=None,
                     prompt_alignment="t2v_metrics")
    check_local(plan, _cfg(prompt_alignment="t2v_metrics"))


def test_laion_aesthetics_fill_the_column_and_avg(tmp_path):
    from paco.benchmark.t2is_local import AESTHETICS_EVALUATOR, check_local, score_local
    from paco.benchmark.t2is_run import plan_t2is, score_t2is
    from paco.benchmark.t2is_bench import t2is_avg
    from paco.benchmark.tables import stand_in_notes, t2is_table

    samples, prompts = _tables()
    plan = plan_t2is(samples, prompts, seeds_per_prompt=None, max_prompts=None, prompt_alignment="yes_no")
    cfg = _cfg(aesthetics="laion", aesthetics_clip="data/models/clip", aesthetics_weights=str(tmp_path / "w.pth"))
    with pytest.raises(AestheticWeightsError, match="download"):
        check_local(plan, cfg)

    class Stub:  # a known score per panel: its red level / 40 + 1 (the AVA scale)
        def scores(self, images):
            return np.array([np.asarray(im)[..., 0].mean() / 40 + 1 for im in images])

    local = score_local(plan, cfg, device="cpu", aesthetics=Stub())
    answers = {"ev": [0.6 if q["protocol"] == "vc" else 0.8 for q in plan.questions]}
    frame, metrics, report = score_t2is(plan, answers, prompt_alignment="yes_no", local=local)
    for variant in ("base", "lora"):
        per_case = [np.mean([r / 40 + 1 for r in RED[p, variant]]) for p in ("p1", "p2")]
        aes = float(np.mean(per_case)) / 10
        got = metrics["scores"][variant]["ev"]
        assert got["aesthetics"] == pytest.approx(aes, abs=1e-12)
        assert got["avg"] == pytest.approx(0.2 * aes + 0.3 * 0.8 + 0.5 * got["vc"], abs=1e-12)
        assert got["avg"] == t2is_avg(got["aesthetics"], **{k: got[k] for k in (
            "entity", "attribute", "relation", "identity", "style", "logic")})
        assert metrics["aesthetics_laion"][variant]["mean_raw"] == pytest.approx(aes * 10, abs=1e-12)
    diff = metrics["aesthetics_laion"]["lora_minus_base"]
    assert diff["n"] == 2 and diff["mean_diff"] == pytest.approx(
        np.mean([np.mean([r / 40 for r in RED[p, "lora"]]) - np.mean([r / 40 for r in RED[p, "base"]])
                 for p in ("p1", "p2")]), abs=1e-12)
    rows = frame[frame["evaluator"] == AESTHETICS_EVALUATOR]
    assert len(rows) == 10 and set(rows["protocol"]) == {"aesthetics"} and rows["question"].isna().all()
    assert "aesthetics" not in report["not_scored"]
    # table.md: the Aesthetics and Avg cells of the LoRA row, and a note naming the scorer
    notes = stand_in_notes("t2is", types.SimpleNamespace(t2is=cfg, seeds_per_prompt=None, max_prompts=None),
                           {}, report["not_scored"])
    table = t2is_table("t2is", metrics, {}, notes)
    lora = metrics["scores"]["lora"]["ev"]
    row = next(line for line in table.splitlines() if line.startswith("| LoRA (this run)"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == f"{lora['aesthetics']:.3f}" and cells[-1] == f"{lora['avg']:.3f}"
    assert "LAION aesthetic predictor" in table and "stand-in" in table
