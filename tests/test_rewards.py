"""Reward registry: panel pairs sent to the judge, CLIP-T and PickScore against direct computation
(PickScore against the reference's formula)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from paco.core.io import ImageDecodeError
from paco.grpo import rewards as R
from paco.models.clip import ClipScorer
from paco.grpo.rewards import REWARDS, RewardContext, RewardError, SubtaskItem, compute_rewards
from paco.core.templates import judge_instruction


class RecordingJudge:
    """Scores a pair by the mean red value of panel A (a deterministic stand-in); records calls."""

    def __init__(self):
        self.calls: list[list[tuple]] = []

    def score(self, triples):
        self.calls.append(list(triples))
        return [float(np.asarray(a)[..., 0].mean() / 255) for a, _, _ in triples]


def _grid(colours: list[tuple[int, int, int]], rows: int, cols: int, cell: int = 32) -> Image.Image:
    im = Image.new("RGB", (cols * cell, rows * cell))
    for k, c in enumerate(colours):
        r, q = divmod(k, cols)
        im.paste(Image.new("RGB", (cell, cell), c), (q * cell, r * cell))
    return im


def _prompt(pid: str, rows: int, cols: int) -> SubtaskItem:
    n = rows * cols
    return SubtaskItem(pid, f"grid {pid}", f"the theme of {pid}", rows, cols, tuple(f"panel {k}" for k in range(n)))


def test_consistency_scores_every_panel_pair_in_order_and_averages():
    reds = [0, 60, 120, 240]
    grid = _grid([(r, 0, 0) for r in reds], 2, 2)
    strip = _grid([(30, 0, 0), (90, 0, 0), (150, 0, 0)], 1, 3)
    judge = RecordingJudge()
    ctx = RewardContext(judge=judge, instruction="theme", split_method="equal")
    out = compute_rewards(["consistency"], [grid, strip], [_prompt("a", 2, 2), _prompt("b", 1, 3)], ctx)
    (triples,) = judge.calls  # one call for all images: the client can batch every pair
    assert len(triples) == 6 + 3
    assert {t[2] for t in triples[:6]} == {judge_instruction("the theme of a")}
    # pairs (i, j), i < j, panel i first: panel A of the 6 pairs of the 2x2 grid is 0,0,0,1,1,2
    first = [round(float(np.asarray(a)[..., 0].mean())) for a, _, _ in triples[:6]]
    assert first == [reds[i] for i in (0, 0, 0, 1, 1, 2)]
    np.testing.assert_allclose(out["consistency"], [np.mean([reds[i] for i in (0, 0, 0, 1, 1, 2)]) / 255,
                                                    np.mean([30, 30, 90]) / 255])
    ctx.instruction = "rank"
    compute_rewards(["consistency"], [grid], [_prompt("a", 2, 2)], ctx)
    assert judge.calls[-1][0][2] == judge_instruction(None)


def test_clip_rewards_match_direct_clip_computation(tiny_model_dirs):
    clip = ClipScorer(tiny_model_dirs["clip"])
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)) for _ in range(2)]
    prompts = [_prompt("a", 2, 2), _prompt("b", 2, 2)]
    ctx = RewardContext(clip=clip, pickscore=clip, split_method="equal")
    out = compute_rewards(["clip_t", "pickscore"], images, prompts, ctx)
    for i, (im, p) in enumerate(zip(images, prompts)):
        panels = ctx.panels(im, p)
        cos = [float(ClipScorer.cosine(clip.image_embeddings([c]), clip.text_embeddings([t]))[0])
               for c, t in zip(panels, p.panel_prompts)]
        assert out["clip_t"][i] == pytest.approx(np.mean(cos), abs=1e-5)
        direct = clip.logit_scale * float(ClipScorer.cosine(clip.image_embeddings([im]), clip.text_embeddings([p.prompt]))[0])
        assert out["pickscore"][i] == pytest.approx(direct / 26.0, abs=1e-5)  # the reference's scale


def test_reward_errors_are_raised_not_defaulted():
    grid = _grid([(0, 0, 0)] * 4, 2, 2)
    with pytest.raises(KeyError, match="registered"):
        compute_rewards(["no_such_reward"], [grid], [_prompt("a", 2, 2)], RewardContext())
    with pytest.raises(RewardError, match="needs a judge"):
        compute_rewards(["consistency"], [grid], [_prompt("a", 2, 2)], RewardContext())
    with pytest.raises(RewardError, match="at least two panels"):
        compute_rewards(["consistency"], [grid], [_prompt("a", 1, 1)], RewardContext(judge=RecordingJudge()))

    class NanJudge:
        def score(self, triples):
            return [float("nan")] * len(triples)

    with pytest.raises(RewardError, match="consistency.*nan.*prompt a"):
        compute_rewards(["consistency"], [grid], [_prompt("a", 2, 2)], RewardContext(judge=NanJudge()))
    assert {"consistency", "clip_t", "pickscore"} <= set(REWARDS)
    assert REWARDS["pickscore"] is R.pickscore
    with pytest.raises(RewardError, match="'pickscore' needs a PickScore model"):  # not CLIP in its place
        compute_rewards(["pickscore"], [grid], [_prompt("a", 2, 2)], RewardContext(clip=object()))


def _reference_pickscore(model_dir, prompts: list[str], images: list[Image.Image]) -> np.ndarray:
    """X-GenGroup/PaCo-RL ``PaCo-GRPO/paco_grpo/rewards/pickscore_scorer.py`` l.12-50, as written
    there (float32; ``get_*_features`` give an output object in transformers 5: its
    ``pooler_output`` is the projected embedding)."""
    import torch
    from transformers import CLIPModel, CLIPProcessor

    def features(out):
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    processor = CLIPProcessor.from_pretrained(str(model_dir))
    model = CLIPModel.from_pretrained(str(model_dir)).eval().to(dtype=torch.float32)
    with torch.no_grad():
        image_inputs = processor(images=images, padding=True, truncation=True, max_length=77, return_tensors="pt")
        text_inputs = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image_embs = features(model.get_image_features(**image_inputs))
        image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
        text_embs = features(model.get_text_features(**text_inputs))
        text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (text_embs @ image_embs.T)
    return (scores.diag() / 26).double().numpy()


def test_pickscore_is_the_reference_formula(tiny_model_dirs, tmp_path):
    """The ``pickscore`` reward is the reference's PickScore on the ``pickscore`` model (whole
    composite, whole prompt, 77-token truncation), not CLIP's: two tiny CLIPs drawn from other
    seeds give different values and the reward follows the one in ``ctx.pickscore``."""
    from paco.models.tiny import build_tiny

    clip_dir = tiny_model_dirs["clip"]
    pick_dir = build_tiny("clip", tmp_path / "pickscore", seed=1)
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 64), (96, 64),
                                                                                            (48, 80))]
    long = " ".join(f"panel {k} shows a red cat on a blue chair beside a window" for k in range(12))
    prompts = [SubtaskItem("a", "a 2x2 grid of a cat", "", 2, 2, ("p",) * 4),
               SubtaskItem("b", "four views of a rocket at dawn", "", 2, 2, ("p",) * 4),
               SubtaskItem("c", long, "", 2, 2, ("p",) * 4)]
    clip = ClipScorer(clip_dir)
    assert len(clip.processor.tokenizer(long)["input_ids"]) > 77  # truncation is exercised
    ctx = RewardContext(clip=clip, pickscore=ClipScorer(pick_dir))
    got = compute_rewards(["pickscore"], images, prompts, ctx)["pickscore"]
    texts = [p.prompt for p in prompts]
    expected = _reference_pickscore(pick_dir, texts, images)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    on_clip = _reference_pickscore(clip_dir, texts, images)
    assert np.abs(got - on_clip).max() > 1e-3  # the clip role's weights would give other values


def test_the_pickscore_model_loads_only_for_the_pickscore_reward(tiny_model_dirs, tmp_path, monkeypatch):
    """``make_reward_context`` loads the ``pickscore`` directory only when a requested reward
    needs it (PickScore_v1 is a 1 B-parameter ViT-H), and then from that directory."""
    import paco.serving.judge_client as client_module
    from paco.core.params import Params
    from paco.models.tiny import build_tiny

    class FakeClient:
        def __init__(self, url, *args, **kwargs):
            self.url = url

        def check_model(self):
            return None

    class Endpoint:
        def url(self):
            return "http://127.0.0.1:9/v1"

        def supervisor(self):
            return None

    monkeypatch.setattr(client_module, "JudgeClient", FakeClient)
    pick_dir = build_tiny("clip", tmp_path / "pickscore", seed=1)
    params = Params()
    ctx = R.make_reward_context(params, Endpoint(), tiny_model_dirs["clip"], tmp_path / "absent",
                                rewards=["consistency", "clip_t"])
    assert ctx.pickscore is None and isinstance(ctx.clip, ClipScorer)
    ctx = R.make_reward_context(params, Endpoint(), tiny_model_dirs["clip"], pick_dir,
                                rewards={"consistency": 0.2, "pickscore": 1.0})
    assert isinstance(ctx.pickscore, ClipScorer)
    weight = "text_projection.weight"
    assert torch.equal(ctx.pickscore.model.state_dict()[weight], ClipScorer(pick_dir).model.state_dict()[weight])
    assert not torch.equal(ctx.pickscore.model.state_dict()[weight], ctx.clip.model.state_dict()[weight])


def test_a_deferred_judge_is_reached_only_on_connect(tiny_model_dirs, monkeypatch):
    """``make_reward_context(connect=False)`` loads the scorers but neither waits for the endpoint
    nor makes the judge client: :meth:`RewardContext.connect` does, once (a second call does
    nothing), and an endpoint that fails raises there. Before it, a judge reward is an error that
    says so, never a default score; ``connect=True`` (the default) reaches the judge at once."""
    import paco.serving.judge_client as client_module
    from paco.core.params import Params
    from paco.serving.judge_client import JudgeError

    calls = []

    class FakeClient:
        def __init__(self, url, *args, **kwargs):
            calls.append(("client", url))

        def check_model(self):
            calls.append(("check",))

    class Endpoint:
        def __init__(self, fail=False):
            self.fail = fail

        def url(self):
            calls.append(("url",))
            if self.fail:
                raise JudgeError("judge server not healthy")
            return "http://127.0.0.1:9/v1"

        def supervisor(self):
            return None

    monkeypatch.setattr(client_module, "JudgeClient", FakeClient)
    ctx = R.make_reward_context(Params(), Endpoint(), tiny_model_dirs["clip"], tiny_model_dirs["clip"],
                                rewards=["consistency", "clip_t"], connect=False)
    assert calls == [] and ctx.judge is None and isinstance(ctx.clip, ClipScorer)
    item = SubtaskItem("p0", "a cat", "", 2, 2, ("p",) * 4)
    with pytest.raises(R.RewardError, match="connect"):
        R.compute_rewards(["consistency"], [Image.new("RGB", (64, 64))], [item], ctx)
    assert ctx.connect() is ctx
    assert calls == [("url",), ("client", "http://127.0.0.1:9/v1"), ("check",)]
    assert isinstance(ctx.judge, FakeClient)
    ctx.connect()
    assert len(calls) == 3
    failing = R.make_reward_context(Params(), Endpoint(fail=True), tiny_model_dirs["clip"], tiny_model_dirs["clip"],
                                    rewards=["consistency"], connect=False)
    for _ in range(2):  # a failed connect stays pending: a retry reaches the endpoint again
        with pytest.raises(JudgeError, match="not healthy"):
            failing.connect()
    assert failing.judge is None
    calls.clear()
    R.make_reward_context(Params(), Endpoint(), tiny_model_dirs["clip"], tiny_model_dirs["clip"], rewards=["consistency"])
    assert calls == [("url",), ("client", "http://127.0.0.1:9/v1"), ("check",)]


def test_editing_reward_from_hand_made_logprobs_through_the_official_client():
    """consistency_for_editing = sqrt(P_SC * P_PF), each P = P(Yes)/(P(Yes)+P(No)) of the first
    token, computed here independently from the log-probs an OpenAI-compatible stub serves for
    the SC and the PF question; the original image is sent first, the edit second."""
    import base64
    import io
    import math

    from fake_openai import FakeOpenAIServer

    from paco.serving.judge_client import JudgeClient

    logprobs = {"sc": {"Yes": -0.3, "No": -1.5, "Maybe": -2.0}, "pf": {"Yes": -1.2, "No": -0.4, "yes": -3.0}}
    original = Image.new("RGB", (24, 24), (200, 10, 10))
    edited = Image.new("RGB", (24, 24), (10, 10, 200))
    seen: list[tuple[str, tuple, tuple]] = []

    def reply(body, n):
        content = body["messages"][0]["content"]
        first, second = (Image.open(io.BytesIO(base64.b64decode(c["image_url"]["url"].split(",", 1)[1])))
                         .convert("RGB").getpixel((0, 0)) for c in content[:2])
        text = content[2]["text"]
        kind = "sc" if "remain consistent" in text else "pf" if "accurately follow" in text else "?"
        seen.append((kind, first, second))
        top = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in logprobs[kind].items()]
        return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "judge",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "Yes"},
                                  "logprobs": {"content": [{"token": "Yes", "logprob": -0.3, "bytes": [89, 101, 115],
                                                            "top_logprobs": top}]},
                                  "finish_reason": "length"}]}, 0

    with FakeOpenAIServer(reply) as srv:
        client = JudgeClient(srv.base_url, "judge", retries=0)
        prompt = SubtaskItem("e1", "make the car blue", "", 1, 1, (), reference=original)
        got = compute_rewards(["consistency_for_editing"], [edited], [prompt], RewardContext(judge=client))

    def p_yes(lp):
        return math.exp(lp["Yes"]) / (math.exp(lp["Yes"]) + math.exp(lp["No"]))

    expected = math.sqrt(p_yes(logprobs["sc"]) * p_yes(logprobs["pf"]))
    assert got["consistency_for_editing"][0] == pytest.approx(expected, rel=1e-12)
    assert sorted(k for k, _, _ in seen) == ["pf", "sc"]
    assert all(first == (200, 10, 10) and second == (10, 10, 200) for _, first, second in seen)


def test_editing_reward_needs_the_input_image():
    prompt = SubtaskItem("e1", "make it blue", "", 1, 1, ())
    with pytest.raises(RewardError, match="no reference"):
        compute_rewards(["consistency_for_editing"], [Image.new("RGB", (8, 8))], [prompt],
                        RewardContext(judge=RecordingJudge()))


def test_subtask_items_read_prompts_and_edits_alike():
    from paco.data.edits import photo_edits

    edits = photo_edits(["cat", "rocket"], ["mirror"], 32, 1, 0)
    items, infos = R.subtask_items(edits, "edits")
    assert list(items.columns) == ["prompt_id", "split", "height", "width"]
    assert list(items["prompt_id"]) == list(edits["item_id"])
    info = infos["cat-mirror"]
    assert info.prompt == edits.set_index("item_id").loc["cat-mirror", "instruction"]
    assert (info.rows, info.cols) == (1, 1) and info.reference.size == (32, 32)
    bad = edits.copy()
    bad.at[0, "input_image"] = {"bytes": b"not a png", "path": None}
    with pytest.raises(ImageDecodeError, match=f"edit {bad.at[0, 'item_id']} input_image"):
        R.subtask_items(bad, "edits")
    with pytest.raises(ValueError, match="unknown dataset"):
        R.subtask_items(edits, "composites")


def test_the_input_fidelity_guard_is_ssim_to_the_input_and_enters_the_aggregation_as_any_reward():
    """``input_fidelity`` is the edit's SSIM to its input (scikit-image's, computed here), and
    log-tame aggregation treats it like the judge reward beside it: a high-variance reward is
    tamed, the weighted sum is group-normalised (PaCo-RL eq. 2-4, written out here)."""
    from skimage.metrics import structural_similarity

    from paco.grpo.advantages import aggregate

    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))
    edits = [source, *(Image.fromarray(np.clip(np.asarray(source, dtype=np.float64) + rng.normal(0, s, (48, 48, 3)),
                                               0, 255).astype(np.uint8)) for s in (10, 30, 60))]
    items = [SubtaskItem(f"e{i // 2}", "edit it", "", 1, 1, ("edit it",), reference=source) for i in range(4)]
    fidelity = compute_rewards(["input_fidelity"], edits, items, RewardContext())["input_fidelity"]
    grey = lambda im: np.asarray(im.convert("L"), dtype=np.float64) / 255  # noqa: E731
    expected = [structural_similarity(grey(e), grey(source), data_range=1.0) for e in edits]
    np.testing.assert_allclose(fidelity, expected, rtol=1e-12)
    assert fidelity[0] == pytest.approx(1.0) and np.all(np.diff(fidelity) < 0)
    judge = np.array([0.2, 0.5, 0.6, 0.9])
    weights = {"consistency_for_editing": 1.0, "input_fidelity": 0.5}
    _, adv, info = aggregate({"consistency_for_editing": judge, "input_fidelity": fidelity}, weights,
                             [it.prompt_id for it in items], method="log_tame", delta=0.2, global_std=True)
    tamed = {k: (np.log1p(v) if v.std() / v.mean() > 0.2 else v)
             for k, v in {"consistency_for_editing": judge, "input_fidelity": fidelity}.items()}
    total = sum(weights[k] * tamed[k] for k in weights)
    groups = total.reshape(2, 2)
    expected_adv = ((groups - groups.mean(axis=1, keepdims=True)) / total.std()).ravel()
    np.testing.assert_allclose(adv, expected_adv, rtol=1e-12)
    assert set(info["tamed"]) == {k for k, v in {"consistency_for_editing": judge, "input_fidelity": fidelity}.items()
                                  if v.std() / v.mean() > 0.2}
    with pytest.raises(RewardError, match="no reference"):
        compute_rewards(["input_fidelity"], edits[:1], [SubtaskItem("x", "p", "", 1, 1, ("p",))], RewardContext())


def test_the_grid_free_guard_is_one_minus_the_grid_score_at_the_latent_period():
    from paco.grpo.monitors import grid_artifact_score, greyscale

    rng = np.random.default_rng(1)
    base = np.clip(np.cumsum(rng.normal(0, 0.02, (64, 64)), axis=1) + 0.5, 0, 1)
    ii, jj = np.indices((64, 64))
    checker = 0.1 * np.where((ii // 8 + jj // 8) % 2 == 0, 1.0, -1.0)
    images = [Image.fromarray(np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)).convert("RGB")
              for x in (base, base + checker)]
    items = [SubtaskItem(f"e{i}", "edit it", "", 1, 1, ("edit it",), reference=images[0]) for i in range(2)]
    ctx = RewardContext(split_method="equal", latent_period=16)
    got = compute_rewards(["grid_free"], images, items, ctx)["grid_free"]
    np.testing.assert_allclose(got, [1 - grid_artifact_score(greyscale(im), 16) for im in images], rtol=1e-12)
    assert got[1] < got[0] - 0.1  # the checkerboard costs reward
    small = [Image.new("RGB", (24, 24))]
    with pytest.raises(RewardError, match="too small"):
        compute_rewards(["grid_free"], small, items[:1], ctx)
