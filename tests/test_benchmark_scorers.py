"""T2IS-Bench's optional local scorers (issue 27): the official VQAScore prompt alignment through
t2v_metrics in its own environment (paco.benchmark.vqascore runs paco/benchmark/vqascore_worker.py
as a subprocess; here with this interpreter and a stand-in t2v_metrics package on PYTHONPATH that
records what the worker hands it and answers known scores) and the LAION aesthetic
predictor (paco.benchmark.aesthetics: the MLP against numpy, the normalisation, named errors), wired
through plan_t2is / score_local / score_t2is into metrics and table; the default scores neither."""

from __future__ import annotations

import json
import shutil
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
    WEIGHT_REPOS,
    WORKER,
    VQAScoreError,
    VQAScoreUnavailableError,
    preflight,
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
    vqa = T2ISProtocolParams(prompt_alignment="t2v_metrics", vqascore_python="/opt/t2v/bin/python",
                             vqascore_cache_dir="data/raw/vqascore_cache")
    assert (vqa.vqascore_python, vqa.vqascore_cache_dir) == ("/opt/t2v/bin/python", "data/raw/vqascore_cache")
    for bad in ({"prompt_alignment": "t2v_metrics"}, {"prompt_alignment": "t2v_metrics", "vqascore_python": "p"},
                {"prompt_alignment": "t2v_metrics", "vqascore_python": " ", "vqascore_cache_dir": "c"},
                {"prompt_alignment": "yes_no", "vqascore_cache_dir": "c"}):
        with pytest.raises(ValueError, match="vqascore_python"):
            T2ISProtocolParams(**bad)
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
    assert (t2is.vqascore_python, t2is.vqascore_cache_dir) == ("/opt/t2v/bin/python", "data/raw/vqascore_cache")


# --------------------------------------------------------------------------------------------
# VQAScore: the real worker, in a subprocess, over a stand-in t2v_metrics package
# --------------------------------------------------------------------------------------------

#: the stand-in ``t2v_metrics`` (the worker imports it from PYTHONPATH): records its import's
#: cache variables, its construction and calls in FAKE_T2V_RECORD; FAKE_T2V_MODE picks a failure
STAND_IN = '''
import json, os, time
import numpy as np
from PIL import Image

__version__ = "stand-in"
MODE = os.environ.get("FAKE_T2V_MODE", "ok")


def _record(**kw):
    with open(os.environ["FAKE_T2V_RECORD"], "a") as f:
        f.write(json.dumps(kw) + "\\n")


_record(event="import", hf_hub_cache=os.environ.get("HF_HUB_CACHE"), offline=os.environ.get("HF_HUB_OFFLINE"))


def list_all_vqascore_models():
    return ["clip-flant5-xl"] if MODE == "unlisted" else ["clip-flant5-xxl", "clip-flant5-xl"]


class _Tensor:  # what the worker uses of a torch tensor
    def __init__(self, rows):
        self.rows = rows

    def detach(self):
        return self

    def cpu(self):
        return self

    def tolist(self):
        return self.rows


def rule(path, text):
    red = np.asarray(Image.open(path).convert("RGB"))[..., 0].mean() / 255
    return float(red / 2 + (len(text) % 10) / 20)


class VQAScore:
    def __init__(self, model, device="cuda", cache_dir="./hf_cache/"):
        _record(event="init", model=model, device=device, cache_dir=cache_dir)
        if MODE == "init_raises":
            raise OSError("stand-in: zhiqiulin/clip-flant5-xxl is not in the cached files")

    def __call__(self, images, texts):
        _record(event="call", images=images, texts=texts, sizes=[Image.open(p).size for p in images])
        if MODE == "call_raises":
            raise RuntimeError("stand-in: CUDA out of memory")
        if MODE == "hang":
            time.sleep(60)
        if MODE == "two_rows":
            return _Tensor([[0.5] * len(texts)] * 2)
        if MODE == "out_of_range":
            return _Tensor([[1.5] * len(texts)])
        return _Tensor([[rule(p, t) for t in texts] for p in images])
'''


def _vqa_rule(red: int, text: str) -> float:
    """The stand-in's score of a panel of uniform red level ``red`` (the same float operations)."""
    return float(np.float64(red) / 255 / 2 + (len(text) % 10) / 20)


class FakeT2V:
    """The stand-in's environment: ``python`` (this interpreter), ``cache_dir`` (a snapshot of
    each WEIGHT_REPOS repository), ``mode(name)`` and ``record()``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        (root / "site" / "t2v_metrics").mkdir(parents=True)
        (root / "site" / "t2v_metrics" / "__init__.py").write_text(STAND_IN)
        self.python, self.cache_dir, self.log = sys.executable, root / "cache", root / "record.jsonl"
        for repo in WEIGHT_REPOS[OFFICIAL_MODEL]:
            (self.cache_dir / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123").mkdir(parents=True)
        self.monkeypatch = monkeypatch
        monkeypatch.setenv("PYTHONPATH", str(root / "site"))
        monkeypatch.setenv("FAKE_T2V_RECORD", str(self.log))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the adapter sets it for the worker
        self.mode("ok")

    def mode(self, name: str) -> None:
        self.monkeypatch.setenv("FAKE_T2V_MODE", name)

    def record(self, event: str | None = None) -> list[dict]:
        rows = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.is_file() else []
        return [r for r in rows if event is None or r["event"] == event]

    def kwargs(self) -> dict:
        return {"python": self.python, "cache_dir": self.cache_dir}


@pytest.fixture
def fake_t2v(tmp_path, monkeypatch) -> FakeT2V:
    return FakeT2V(tmp_path / "t2v", monkeypatch)


def test_worker_gets_paths_texts_and_cache_dir_and_scores_come_back_exactly(fake_t2v, tmp_path):
    panels = [("base/c-s0_0000.png", Image.new("RGB", (16, 8), (255, 0, 0)), ["a red cat", "on a mat"]),
              ("base/c-s0_0001.png", Image.new("L", (8, 8), 0), ["a cat"]),
              ("lora/c-s0_0000.png", Image.new("RGB", (8, 4), (77, 1, 2)), ["twelve chars", "x"])]
    (tmp_path / "work").mkdir()
    got = vqascore_panels(iter(panels), **fake_t2v.kwargs(), device="cpu", tmp_dir=tmp_path / "work")
    assert got == [[_vqa_rule(255, "a red cat"), _vqa_rule(255, "on a mat")], [_vqa_rule(0, "a cat")],
                   [_vqa_rule(77, "twelve chars"), _vqa_rule(77, "x")]]  # exact: JSON keeps every digit
    cache = str(fake_t2v.cache_dir.resolve())
    assert fake_t2v.record("import") == [{"event": "import", "hf_hub_cache": cache, "offline": "1"}]
    assert fake_t2v.record("init") == [{"event": "init", "model": "clip-flant5-xxl", "device": "cpu",
                                        "cache_dir": cache}]  # one model for all panels
    calls = fake_t2v.record("call")
    assert [Path(c["images"][0]).parts[-2:] for c in calls] == [("base", "c-s0_0000.png"), ("base", "c-s0_0001.png"),
                                                                 ("lora", "c-s0_0000.png")]
    assert [len(c["images"]) for c in calls] == [1, 1, 1] and [c["sizes"] for c in calls] == [[[16, 8]], [[8, 8]],
                                                                                               [[8, 4]]]
    assert [c["texts"] for c in calls] == [["a red cat", "on a mat"], ["a cat"], ["twelve chars", "x"]]
    assert list((tmp_path / "work").iterdir()) == []  # the temporary files are gone
    assert vqascore_panels([], **fake_t2v.kwargs()) == [] and len(fake_t2v.record("init")) == 1


def test_preflight_checks_the_environment_without_loading_the_model(fake_t2v, tmp_path, monkeypatch):
    preflight(fake_t2v.python, fake_t2v.cache_dir)
    assert len(fake_t2v.record("import")) == 1 and fake_t2v.record("init") == []
    fake_t2v.mode("unlisted")
    with pytest.raises(VQAScoreUnavailableError, match=r"'clip-flant5-xxl' is not in t2v_metrics.list_all_vqascore_"
                                                        r"models\(\).*t2v-metrics==3.0.*\['clip-flant5-xl'\]"):
        preflight(fake_t2v.python, fake_t2v.cache_dir)
    fake_t2v.mode("ok")
    with pytest.raises(VQAScoreUnavailableError, match="is not a directory"):
        preflight(fake_t2v.python, tmp_path / "nowhere")
    shutil.rmtree(fake_t2v.cache_dir / "models--openai--clip-vit-large-patch14-336")
    with pytest.raises(VQAScoreUnavailableError, match=r"no snapshot of \['openai/clip-vit-large-patch14-336'\]"):
        preflight(fake_t2v.python, fake_t2v.cache_dir)
    for python, message in ((None, "vqascore_python is not set"), (tmp_path / "no/python", "not an executable")):
        with pytest.raises(VQAScoreUnavailableError, match=message):
            preflight(python, fake_t2v.cache_dir)
    with pytest.raises(VQAScoreUnavailableError, match="vqascore_cache_dir is not set"):
        preflight(fake_t2v.python, None)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # an interpreter without t2v_metrics
    with pytest.raises(VQAScoreUnavailableError, match="(?s)status 2.*cannot import t2v_metrics"):
        preflight(fake_t2v.python, fake_t2v.cache_dir)
    assert fake_t2v.record("init") == []


@pytest.mark.parametrize("mode, error, message", [
    ("unlisted", VQAScoreUnavailableError, r"'clip-flant5-xxl' is not in t2v_metrics.list_all_vqascore_models"),
    ("init_raises", VQAScoreUnavailableError, r"VQAScore\(model='clip-flant5-xxl'.*failed \(OSError: stand-in: "
                                              r"zhiqiulin/clip-flant5-xxl is not in the cached files\)"),
    ("call_raises", VQAScoreError,
     r"(?s)status 3.*c_0000.png: VQAScore raised RuntimeError: stand-in: CUDA out of memory"),
    ("two_rows", VQAScoreError, r"(?s)status 3.*returned \[\[0.5, 0.5\], \[0.5, 0.5\]\], not a \[1, 2\] score matrix"),
    ("out_of_range", VQAScoreError, r"panel c_0000.png: VQAScore 1.5 is not a probability in \[0, 1\]"),
    ("hang", VQAScoreError, r"ran past 3 s"),
])
def test_worker_failures_are_named_errors_with_the_workers_message(fake_t2v, mode, error, message):
    fake_t2v.mode(mode)
    with pytest.raises(error, match=message) as info:
        vqascore_panels([("c_0000.png", Image.new("RGB", (4, 4)), ["a", "b"])], **fake_t2v.kwargs(), device="cpu",
                        timeout_s=3 if mode == "hang" else 120)
    assert (info.type is VQAScoreUnavailableError) == (error is VQAScoreUnavailableError)


def test_bad_panels_are_named_errors_before_the_worker_runs(fake_t2v):
    for panels, message in (([("x_0000.png", Image.new("RGB", (4, 4)), [])], "no criteria"),
                            ([("x_0000.png", Image.new("RGB", (4, 4)), ["t"])] * 2, "unique"),
                            ([("../x_0000.png", Image.new("RGB", (4, 4)), ["t"])], "relative path")):
        with pytest.raises(VQAScoreError, match=message):
            vqascore_panels(panels, **fake_t2v.kwargs())
    assert fake_t2v.record() == []


def test_the_worker_imports_only_the_standard_library_and_t2v_metrics():
    import ast

    tree = ast.parse(WORKER.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"t2v_metrics"} <= set(sys.stdlib_module_names), names


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
    cfg = _cfg(prompt_alignment="t2v_metrics", vqascore_python=fake_t2v.python,
               vqascore_cache_dir=str(fake_t2v.cache_dir))
    check_local(plan, cfg)
    assert fake_t2v.record("init") == []  # the preflight loads no model
    local = score_local(plan, cfg, device="cpu")
    # one model, one call per panel (10 = (3 + 2) panels x 2 variants), its criteria in Entity, Attribute,
    # Relation order, each panel under its official name in its variant's folder
    calls = fake_t2v.record("call")
    assert len(calls) == 10 and fake_t2v.record("init") == [
        {"event": "init", "model": "clip-flant5-xxl", "device": "cpu", "cache_dir": str(fake_t2v.cache_dir.resolve())}]
    names = sorted(Path(c["images"][0]).parts[-2:] for c in calls)
    assert names == sorted((v, f"{p}-s0_{k:04d}.png") for v in ("base", "lora")
                           for p in ALIGN for k in range(len(ALIGN[p])))
    first = next(c for c in calls if Path(c["images"][0]).name == "p1-s0_0000.png")
    assert first["texts"] == ["a fox", "red fur", "green eyes", "fox on a rock"]
    answers = {"ev1": [0.5] * len(plan.questions), "ev2": [0.25] * len(plan.questions)}
    frame, metrics, report = score_t2is(plan, answers, prompt_alignment="t2v_metrics", local=local)
    for variant in ("base", "lora"):
        want = _official_pa(variant)
        for ev in ("ev1", "ev2"):
            got = metrics["scores"][variant][ev]
            assert {k: got[k] for k in want} == pytest.approx(want, abs=1e-12)
            assert got["pa"] == pytest.approx(sum(want.values()) / 3, abs=1e-12)
            assert got["aesthetics"] is None and got["avg"] is None
    assert metrics["questions"]["pa"] == len(plan.local_pa) // 2
    assert metrics.get("aesthetics_laion") is None  # not scored: absent
    rows = frame[frame["evaluator"] == VQASCORE_EVALUATOR]
    assert len(rows) == len(plan.local_pa) and set(rows["protocol"]) == {"pa"}
    first = rows.iloc[0]
    assert first["criterion"] == "a fox" and first["question"] == PA_QUESTION.format("a fox")
    assert "pa" not in report["not_scored"] and "aesthetics" in report["not_scored"]
    notes = stand_in_notes("t2is", types.SimpleNamespace(t2is=cfg, seeds_per_prompt=None, max_prompts=None),
                           {}, report["not_scored"])
    assert any("official VQAScore" in n for n in notes)
    assert "official VQAScore" in t2is_table("t2is", metrics, {}, notes)


def test_t2v_metrics_unavailable_fails_before_asking_and_unscored_pa_is_an_error(fake_t2v):
    """check_local (the stage calls it before ask_t2is) runs the preflight: a t2v_metrics without
    clip-flant5-xxl (as 2.1 and later) is a named error and no model is built."""
    from paco.benchmark.t2is_local import LocalScores, check_local
    from paco.benchmark.t2is_run import plan_t2is, score_t2is

    fake_t2v.mode("unlisted")
    cfg = _cfg(prompt_alignment="t2v_metrics", vqascore_python=fake_t2v.python,
               vqascore_cache_dir=str(fake_t2v.cache_dir))
    samples, prompts = _tables()
    plan = plan_t2is(samples, prompts, seeds_per_prompt=None, max_prompts=None, prompt_alignment="t2v_metrics")
    with pytest.raises(VQAScoreUnavailableError, match="not in t2v_metrics.list_all_vqascore_models"):
        check_local(plan, cfg)
    assert len(fake_t2v.record("import")) == 1 and fake_t2v.record("init") == []
    with pytest.raises(ArtifactError, match="VQAScore questions planned"):
        score_t2is(plan, {"ev": [0.5] * len(plan.questions)}, prompt_alignment="t2v_metrics", local=LocalScores())
    with pytest.raises(ArtifactError, match="prompt_alignment"):
        plan_t2is(samples, prompts, seeds_per_prompt=None, max_prompts=None, prompt_alignment="vqa")
    # without alignment criteria nothing needs t2v_metrics: no preflight runs
    plan = plan_t2is(samples, prompts.drop(columns="alignment"), seeds_per_prompt=None, max_prompts=None,
                     prompt_alignment="t2v_metrics")
    check_local(plan, cfg)
    assert len(fake_t2v.record("import")) == 1


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
