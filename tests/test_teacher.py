"""paco.judge.teachers: the template teacher, the OpenAI-compatible backend (against a fake server on
127.0.0.1), the local transformers backend (tiny Qwen2.5-VL), fast mode and the factory."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time

import numpy as np
import pytest
from PIL import Image, ImageFilter, ImageOps

from fake_openai import FakeOpenAIServer

from paco.core.params import TeacherParams
from paco.judge.teachers import make_teacher
from paco.judge.teachers.base import PairItem, TeacherConfigError
from paco.judge.teachers.image_features import measure_pair
from paco.judge.teachers.local import LocalTeacher
from paco.judge.teachers.openai_api import OpenAITeacher
from paco.judge.teachers.template import TemplateTeacher, template_reasons
from paco.core.templates import judge_instruction
from paco.judge.response import format_response, parse_response


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------


def _photo(name: str, size: int = 128) -> Image.Image:
    from skimage import data

    arr = getattr(data, name)()
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    return Image.fromarray(arr[..., :3]).resize((size, size), Image.Resampling.BOX)


@pytest.fixture(scope="module")
def photos() -> dict[str, Image.Image]:
    return {n: _photo(n) for n in ("astronaut", "coffee", "chelsea", "rocket")}


def _noise(seed: int, size: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------
# template teacher
# ---------------------------------------------------------------------------------------------


def test_template_teacher_deterministic_and_label_consistent(photos):
    ast, cof, cat, rok = photos["astronaut"], photos["coffee"], photos["chelsea"], photos["rocket"]
    batch = [
        PairItem("p0", ast, ast.copy(), True, "an astronaut"),
        PairItem("p1", ast, cof, False, None),
        PairItem("p2", cat, rok, True),
        PairItem("p3", cat, ImageOps.mirror(cat), False),
        PairItem("p4", ast, ast.filter(ImageFilter.GaussianBlur(3)), np.bool_(True)),
    ]
    r1 = TemplateTeacher().explain(batch)
    r2 = make_teacher({"backend": "template"}).explain(batch)
    assert [r.to_dict() for r in r1] == [r.to_dict() for r in r2]
    assert [r.pair_id for r in r1] == [b.pair_id for b in batch]
    for item, res in zip(batch, r1):
        assert res.ok and res.error is None and res.attempts == 1
        assert 1 <= len(res.reasons) <= 3
        assert res.response == format_response(bool(item.label), res.reasons)
        label, reasons = parse_response(res.response)
        assert label is bool(item.label) and reasons == res.reasons
        for r in res.reasons:
            assert re.match(r"^(Identity|Style|Logic): ", r), r
            assert re.search(r"\d", r), r  # every reason cites a measurement


def test_template_teacher_no_pair_cites_differences(photos):
    reasons = template_reasons(photos["astronaut"], photos["coffee"], False)
    assert 1 <= len(reasons) <= 3
    assert all(r.support > 0.5 and r.similarity < 0.5 for r in reasons)
    text = " ".join(r.text for r in reasons)
    assert re.search(r"differ|disagree|do not correspond|changes|darker|more saturated|smoother|monochrome", text)
    assert not re.search(r"\b(match|consistent|similar)\b", text)


def test_template_teacher_identical_yes_cites_similarity(photos):
    ast = photos["astronaut"]
    reasons = template_reasons(ast, ast.copy(), True)
    assert len(reasons) == 3  # one per dimension, all fully supported
    assert {r.dimension for r in reasons} == {"identity", "style", "logic"}
    assert all(r.similarity == 1.0 and r.support == 1.0 for r in reasons)
    text = " ".join(r.text for r in reasons)
    assert re.search(r"similar|consistent|agree|match|line up", text)
    assert not re.search(r"differ|disagree|changes", text)


def test_template_teacher_reasons_follow_the_measurements(photos):
    ast = photos["astronaut"]
    grey = ImageOps.grayscale(ast).convert("RGB")
    dark = Image.eval(ast, lambda v: v // 3)
    post = ImageOps.posterize(ast, 2)
    t_grey = " ".join(r.text for r in template_reasons(ast, grey, False))
    t_dark = " ".join(r.text for r in template_reasons(ast, dark, False))
    t_post = " ".join(r.text for r in template_reasons(ast, post, False))
    assert "monochrome" in t_grey
    assert "darker" in t_dark
    assert "posterised" in t_post
    assert len({t_grey, t_dark, t_post}) == 3
    # different images -> different reasons; a mirrored copy is recognised as such
    flip = " ".join(r.text for r in template_reasons(ast, ImageOps.mirror(ast), True))
    assert "mirrored" in flip
    yes_a = [r.text for r in template_reasons(ast, photos["coffee"], True)]
    yes_b = [r.text for r in template_reasons(photos["chelsea"], photos["rocket"], True)]
    assert yes_a != yes_b


def test_template_contradictory_label_is_kept_and_hedged(photos):
    ast = photos["astronaut"]
    res = TemplateTeacher().explain([PairItem("x", ast, ast.copy(), False)])[0]
    assert res.ok and res.response.startswith("No. <reason>1. ")
    assert "nearly indistinguishable" in res.reasons[0]


def test_template_measures_in_unit_interval_and_symmetric_keys(photos):
    m = measure_pair(photos["astronaut"], photos["coffee"])
    assert set(m) == {"palette", "saturation", "contrast", "texture", "posterisation", "ssim", "layout",
                      "orientation", "lighting", "scene"}
    assert all(0.0 <= v <= 1.0 + 1e-9 for v in m.values())
    same = measure_pair(photos["coffee"], photos["coffee"].copy())
    assert all(abs(v - 1.0) < 1e-6 for v in same.values())



def test_template_reasons_cite_the_measured_similarities(photos):
    """The phrasing engine (template) reports the similarities image_features measures."""
    m = measure_pair(photos["chelsea"], photos["rocket"])
    for label in (True, False):
        for r in template_reasons(photos["chelsea"], photos["rocket"], label, max_reasons=10):
            assert r.similarity == round(min(max(m[r.measure], 0.0), 1.0), 6)
            assert r.support == pytest.approx(r.similarity if label else 1.0 - r.similarity, abs=2e-6)

def test_template_teacher_max_reasons_and_speed():
    items = [PairItem(f"p{i}", _noise(i, 128), _noise(i + 100, 128), bool(i % 2)) for i in range(20)]
    t = TemplateTeacher(max_reasons=1)
    t0 = time.perf_counter()
    res = t.explain(items)
    per_pair = (time.perf_counter() - t0) / len(items)
    assert all(r.ok and len(r.reasons) == 1 for r in res)
    assert per_pair < 0.1, f"{per_pair * 1000:.1f} ms per pair"


def test_fast_mode_all_backends():
    items = [PairItem("a", _noise(0), _noise(1), True), PairItem("b", _noise(2), _noise(3), False)]
    teachers = [
        make_teacher({"fast": True}),
        make_teacher({"backend": "openai", "fast": True, "openai": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}),
        make_teacher({"backend": "openai", "fast": True}),
        make_teacher({"backend": "local", "fast": True}),
    ]
    for t in teachers:
        res = t.explain(items)
        assert [(r.pair_id, r.ok, r.response, r.reasons, r.attempts) for r in res] == [
            ("a", True, "Yes.", [], 0), ("b", True, "No.", [], 0)]


def test_explain_checks_items():
    t = TemplateTeacher()
    assert t.explain([]) == []
    with pytest.raises(TypeError):
        t.explain([("a", _noise(0), _noise(1), True)])
    with pytest.raises(TypeError):
        t.explain([PairItem("a", np.zeros((4, 4, 3)), _noise(1), True)])
    with pytest.raises(TypeError):
        t.explain([PairItem("a", _noise(0), _noise(1), "yes")])


# ---------------------------------------------------------------------------------------------
# factory
# ---------------------------------------------------------------------------------------------


def test_make_teacher_defaults_and_errors(monkeypatch):
    t = make_teacher(None)
    assert isinstance(t, TemplateTeacher) and t.max_reasons == 3 and not t.fast
    # one schema: the defaults are TeacherParams' (no second defaults table in paco.judge.teachers)
    assert t.max_reasons == TeacherParams().max_reasons and t.size == TeacherParams().template.size
    with pytest.raises(TeacherConfigError, match=r"teacher\.bogus"):
        make_teacher({"bogus": 1})
    with pytest.raises(TeacherConfigError, match=r"teacher\.openai\.key"):
        make_teacher({"backend": "openai", "openai": {"key": "sk-123"}})
    with pytest.raises(TeacherConfigError, match="teacher.backend: Input should be 'template', 'openai' or 'local'"):
        make_teacher({"backend": "gpt"})
    with pytest.raises(TeacherConfigError, match="base_url"):
        make_teacher({"backend": "openai"})
    with pytest.raises(TeacherConfigError, match="http"):
        make_teacher({"backend": "openai", "openai": {"base_url": "file:///etc", "model": "m"}})
    with pytest.raises(TeacherConfigError, match="model_dir"):
        make_teacher({"backend": "local"})
    with pytest.raises(TeacherConfigError, match="max_reasons"):
        make_teacher({"max_reasons": 0})
    monkeypatch.delenv("PACO_TEST_KEY", raising=False)
    cfg = {"backend": "openai", "openai": {"base_url": "http://127.0.0.1:1/v1", "model": "m",
                                           "api_key_env": "PACO_TEST_KEY"}}
    with pytest.raises(TeacherConfigError, match="PACO_TEST_KEY"):
        make_teacher(cfg)
    monkeypatch.setenv("PACO_TEST_KEY", "sk-secret-value")
    t = make_teacher(cfg)
    assert isinstance(t, OpenAITeacher) and t.url == "http://127.0.0.1:1/v1/chat/completions"
    assert "sk-secret-value" not in repr(t) and "sk-secret-value" not in json.dumps(t.describe())


# ---------------------------------------------------------------------------------------------
# openai backend against a fake OpenAI-compatible server on 127.0.0.1
# ---------------------------------------------------------------------------------------------


def _completion(text: str) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "teacher",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


def _expected_answer(body: dict) -> str:
    text = body["messages"][0]["content"][-1]["text"]
    return re.search(r'The correct answer to this question is "(Yes|No)"', text).group(1)


def _correct(body, n):
    ans = _expected_answer(body)
    return 200, _completion(f"{ans}. <reason>1. The subject is the same fox.\n2. The palette is warm.</reason>"), 0


def _wrong(body, n):
    ans = "No" if _expected_answer(body) == "Yes" else "Yes"
    return 200, _completion(f"{ans}. <reason>1. I disagree.</reason>"), 0


def _teacher(url: str, **kw) -> OpenAITeacher:
    opts = dict(base_url=url, model="teacher-model", timeout_s=2.0, retries=2)
    opts.update(kw)
    return OpenAITeacher(**opts)


def test_openai_correct_answer_passes(monkeypatch):
    monkeypatch.setenv("PACO_FAKE_KEY", "sk-fake")
    items = [PairItem("a", _noise(0), _noise(1), True, "a red fox"), PairItem("b", _noise(2), _noise(3), False)]
    with FakeOpenAIServer(_correct) as srv:
        t = _teacher(srv.base_url, api_key_env="PACO_FAKE_KEY", concurrency=2)
        res = t.explain(items)
    assert [r.pair_id for r in res] == ["a", "b"]
    for item, r in zip(items, res):
        assert r.ok and r.error is None and r.attempts == 1
        assert r.reasons == ["The subject is the same fox.", "The palette is warm."]
        assert r.response == format_response(item.label, r.reasons)
        assert r.raw.startswith("Yes." if item.label else "No.")
    assert len(srv.requests) == 2
    by_answer = {_expected_answer(b): b for b in srv.requests}
    assert set(by_answer) == {"Yes", "No"}
    body = by_answer["Yes"]
    assert body["model"] == "teacher-model"
    content = body["messages"][0]["content"]
    assert body["messages"][0]["role"] == "user" and [c["type"] for c in content] == ["image_url", "image_url", "text"]
    png = base64.b64decode(content[0]["image_url"]["url"].removeprefix("data:image/png;base64,"))
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), np.asarray(items[0].image_a))
    assert content[2]["text"].startswith(judge_instruction("a red fox"))
    assert all(h.get("authorization") == "Bearer sk-fake" for h in srv.headers)


def test_openai_wrong_answer_is_retried_then_failed():
    item = PairItem("w", _noise(0), _noise(1), True)
    with FakeOpenAIServer(_wrong) as srv:
        res = _teacher(srv.base_url, retries=2).explain([item])[0]
    assert not res.ok and res.response == "" and res.reasons == []
    assert res.attempts == 3 and len(srv.requests) == 3
    assert "'No'" in res.error and "'Yes'" in res.error and srv.base_url in res.error
    assert res.raw.startswith("No.")
    # retries re-ask at the retry temperature
    assert [r["temperature"] for r in srv.requests] == [0.0, 0.7, 0.7]


def test_openai_unparsable_then_correct():
    def script(body, n):
        return (200, _completion("I think they are consistent."), 0) if n == 0 else _correct(body, n)

    with FakeOpenAIServer(script) as srv:
        res = _teacher(srv.base_url).explain([PairItem("u", _noise(0), _noise(1), True)])[0]
    assert res.ok and res.attempts == 2 and len(srv.requests) == 2


def test_openai_5xx_is_retried():
    """Transport failures are retried by the official client (one ask, two HTTP requests)."""
    def script(body, n):
        return (503, {"error": "overloaded"}, 0) if n == 0 else _correct(body, n)

    with FakeOpenAIServer(script) as srv:
        res = _teacher(srv.base_url).explain([PairItem("s", _noise(0), _noise(1), False)])[0]
    assert res.ok and res.attempts == 1 and len(srv.requests) == 2 and res.response.startswith("No. <reason>")


def test_openai_5xx_forever_fails_with_status_and_url():
    with FakeOpenAIServer(lambda b, n: (500, {"error": {"message": "boom"}}, 0)) as srv:
        res = _teacher(srv.base_url, retries=1).explain([PairItem("s", _noise(0), _noise(1), True)])[0]
    assert not res.ok and res.attempts == 1 and len(srv.requests) == 2
    assert "HTTP 500" in res.error and "boom" in res.error and f"{srv.base_url}/chat/completions" in res.error
    assert "teacher-model" in res.error and "1 retries" in res.error


def test_openai_4xx_is_not_retried():
    with FakeOpenAIServer(lambda b, n: (401, {"error": "bad key"}, 0)) as srv:
        res = _teacher(srv.base_url).explain([PairItem("k", _noise(0), _noise(1), True)])[0]
    assert not res.ok and res.attempts == 1 and len(srv.requests) == 1
    assert "HTTP 401" in res.error and srv.base_url in res.error


def test_openai_timeout_is_bounded():
    with FakeOpenAIServer(lambda b, n: (200, _completion("Yes. <reason>1. late.</reason>"), 1.0)) as srv:
        t0 = time.perf_counter()
        res = _teacher(srv.base_url, timeout_s=0.2, retries=1).explain([PairItem("t", _noise(0), _noise(1), True)])[0]
        elapsed = time.perf_counter() - t0
    assert not res.ok and len(srv.requests) == 2
    assert "timed out" in res.error or "timeout" in res.error
    assert srv.base_url in res.error
    assert elapsed < 4.0


def test_openai_unreachable_fails_fast_with_url():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens on this port now
    url = f"http://127.0.0.1:{port}/v1"
    items = [PairItem(f"c{i}", _noise(i), _noise(i + 1), bool(i % 2)) for i in range(3)]
    t0 = time.perf_counter()
    res = _teacher(url, timeout_s=1.0, retries=2, concurrency=3).explain(items)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0
    for item, r in zip(items, res):
        assert r.pair_id == item.pair_id and not r.ok
        assert f"{url}/chat/completions" in r.error and "cannot reach" in r.error and "2 retries" in r.error


def test_openai_malformed_body_is_retried_then_failed():
    with FakeOpenAIServer(lambda b, n: (200, "not json", 0)) as srv:
        res = _teacher(srv.base_url, retries=1).explain([PairItem("m", _noise(0), _noise(1), True)])[0]
    assert not res.ok and res.attempts == 2 and "malformed" in res.error and srv.base_url in res.error


# ---------------------------------------------------------------------------------------------
# local backend (tiny Qwen2.5-VL built offline)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    from paco.models.loading import load_judge
    from paco.models.tiny import build_tiny

    path = build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("teacher") / "judge", seed=0)
    model, processor = load_judge(path)
    return path, model, processor


def test_local_teacher_random_model_fails_without_relabelling(tiny_judge):
    path, _model, _processor = tiny_judge
    items = [PairItem("l0", _noise(0), _noise(1), True, "a fox"), PairItem("l1", _noise(2, 48), _noise(3, 80), False),
             PairItem("l2", _noise(4), _noise(5), True)]
    t = make_teacher({"backend": "local", "retries": 1,
                      "local": {"model_dir": str(path), "batch_size": 2, "max_new_tokens": 6}})
    res = t.explain(items)
    assert [r.pair_id for r in res] == ["l0", "l1", "l2"]
    for r in res:
        # a random-init model does not answer "Yes"/"No": recorded as failures, never relabelled
        if not r.ok:
            assert r.attempts == 2 and r.response == "" and str(path) in r.error and r.raw is not None
        else:
            assert parse_response(r.response)[0] is next(i.label for i in items if i.pair_id == r.pair_id)


class _Scripted:
    """Wraps the tiny model: ``generate`` appends scripted answers (one per row) to the prompt."""

    def __init__(self, model, tokenizer, answers):
        self.model, self.tok, self.answers, self.calls = model, tokenizer, list(answers), []

    def generate(self, input_ids, **kw):
        import torch

        self.calls.append(kw)
        rows = []
        for _ in range(input_ids.shape[0]):
            ids = self.tok.encode(self.answers.pop(0), add_special_tokens=False)
            rows.append(ids)
        width = max(len(r) for r in rows)
        pad = self.tok.pad_token_id
        new = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=input_ids.dtype)
        return torch.cat([input_ids, new], dim=1)


def test_local_teacher_validates_and_retries(tiny_judge):
    _path, model, processor = tiny_judge
    answers = ["Yes. <reason>1. Same fox. 2. Same light.</reason>",   # l0 (Yes): ok
               "Yes. <reason>1. Looks fine.</reason>",                # l1 (No): wrong -> retried
               "No. <reason>1. The fox differs.</reason>"]            # l1 retry: ok
    scripted = _Scripted(model, processor.tokenizer, answers)
    t = LocalTeacher(model=scripted, processor=processor, batch_size=4, max_new_tokens=16, retries=2, seed=3)
    res = t.explain([PairItem("l0", _noise(0), _noise(1), True), PairItem("l1", _noise(2), _noise(3), False)])
    assert res[0].ok and res[0].attempts == 1 and res[0].reasons == ["Same fox.", "Same light."]
    assert res[1].ok and res[1].attempts == 2 and res[1].response == "No. <reason>1. The fox differs.</reason>"
    assert scripted.calls[0]["do_sample"] is False and scripted.calls[1]["do_sample"] is True
    assert not scripted.answers
