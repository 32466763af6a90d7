"""The benchmarks' in-process transformers evaluator (issue 27, "Evaluator backends": "a local
transformers evaluator for GPU nodes"), on the tiny Qwen2.5-VL judge built offline: each kind's
answer against the model run here by hand on the same chat (P(Yes) as the two-logit soft-max,
the greedy reply of ``generate``, the score tokens' ``log_softmax``), 1 and 3 images, the answer
cache (no second forward pass, no load on a rerun), the backend in the cache key, named errors,
and the benchmark stage asking a ``backend: transformers`` evaluator with no server."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from paco.benchmark.evaluator import Evaluator, EvaluatorContextLengthError, EvaluatorError
from paco.benchmark.local_evaluator import LocalEvaluator
from paco.benchmark.serving import UNSERVED_URL, BenchEvaluator
from paco.core.io import ArtifactError
from paco.models.loading import ModelDirectoryError
from paco.models.tiny import build_tiny

QUESTION = "Do images meet the following criteria? The same red fox appears in every image. Please answer Yes or No."
VOCAB = 1038  # the tiny Qwen2.5-VL's vocabulary: top_logprobs = VOCAB lists every token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "judge", seed=0)


@pytest.fixture(scope="module")
def reference(tiny):
    """The tiny model and processor loaded apart from the evaluator (transformers' own classes)."""
    from transformers import AutoModelForImageTextToText

    from paco.models.loading import load_qwen_vl_processor

    return AutoModelForImageTextToText.from_pretrained(str(tiny)).eval(), load_qwen_vl_processor(tiny)


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (28 + 4 * i, 36, 3), dtype=np.uint8)) for i in range(n)]


def by_hand(reference, ims, text):
    """``(inputs, last-position float32 logits)`` of one user turn [images..., text] through the
    processor's chat template, tokenised by ``apply_chat_template`` itself, computed as the judge
    server computes them: the vision tower on each image alone (transformers'
    ``get_image_features``), the features passed as ``mm_encoder_outputs``, the head on the last
    position only (``logits_to_keep=1``). The plain forward pass agrees to 1e-5 (checked here)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    model, processor = reference
    messages = [{"role": "user", "content": [*({"type": "image", "image": im} for im in ims),
                                             {"type": "text", "text": text}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
        rows = inputs["image_grid_thw"].prod(dim=-1).tolist()
        pixels = torch.split(inputs["pixel_values"], rows)
        feats = tuple(model.get_image_features(p, g[None], return_dict=True).pooler_output[0]
                      for p, g in zip(pixels, inputs["image_grid_thw"], strict=True))
        logits = model(**rest, mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=feats)},
                       logits_to_keep=1).logits[0, -1].float()
        plain = model(**inputs).logits[0, -1].float()
    torch.testing.assert_close(logits, plain, rtol=0, atol=1e-5)
    return inputs, logits


def count_forwards(ev: LocalEvaluator) -> list[int]:
    """Load ``ev`` and count its model's forward passes (``generate`` calls ``forward`` too)."""
    ev.load()
    calls, forward = [0], ev._model.forward

    def counted(*a, **kw):
        calls[0] += 1
        return forward(*a, **kw)

    ev._model.forward = counted
    return calls


@pytest.mark.parametrize("n_images", [1, 3])
def test_yes_probability_is_the_two_logit_softmax_of_the_model(tiny, reference, n_images):
    """T2IS test_prompt_consistency.py lines 152-158: softmax over the Yes / No logits of the
    first generated token, here from the model run by hand; the evaluator's score comes from
    its stored top log-probs (every token listed) through the OpenAI path's formula."""
    ims = images(n_images)
    _, logits = by_hand(reference, ims, QUESTION)
    tok = reference[1].tokenizer
    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))
    expected = float(torch.softmax(logits[[yes, no]].double(), dim=0)[0])
    ev = LocalEvaluator("tiny", tiny, "tiny-judge", top_logprobs=VOCAB)
    assert ev.yes_probability(ims, QUESTION) == pytest.approx(expected, abs=1e-6)
    assert 0.0 < expected < 1.0 and ev.asked == 1
    (record,) = ev.cache._answers.values()
    assert len(record["request"]["images"]) == n_images and len(record["answer"]["top_logprobs"]) == VOCAB
    assert record["answer"]["content"] == tok.decode([int(logits.argmax())], skip_special_tokens=True)


def test_score_tokens_are_the_log_softmax_at_their_ids(tiny, reference):
    """``score_tokens``: the top ``top_logprobs`` entries are ``topk(log_softmax(logits))`` with
    each token's text, and a score token's log-prob is ``log_softmax`` at its id."""
    ims = images(2, seed=1)
    prompt = "Rate the image from 0 to 10. Reply with one number."
    _, logits = by_hand(reference, ims, prompt)
    lp = torch.log_softmax(logits, dim=-1)
    tok = reference[1].tokenizer
    ev = LocalEvaluator("tiny", tiny, "tiny-judge", top_logprobs=5)
    ev.score_token_logprobs(ims, prompt)
    (record,) = ev.cache._answers.values()
    values, ids = torch.topk(lp, 5)
    assert [e["token"] for e in record["answer"]["top_logprobs"]] == [tok.decode([int(i)]) for i in ids]
    assert [e["logprob"] for e in record["answer"]["top_logprobs"]] == values.tolist()  # bit for bit
    full = LocalEvaluator("tiny", tiny, "tiny-judge", top_logprobs=VOCAB).score_token_logprobs(ims, prompt)
    for digit in map(str, range(10)):
        (i,) = tok.encode(digit, add_special_tokens=False)
        assert full[digit] == float(lp[i])


def test_a_reply_is_the_greedy_generation(tiny, reference):
    """``reply`` with ``max_tokens`` N: ``generate(max_new_tokens=N, do_sample=False)`` decoded
    without special tokens; ``finish_reason`` ``length`` when no EOS ended it."""
    ims, prompt, n = images(2, seed=2), "Describe the two images.", 6
    inputs, _ = by_hand(reference, ims, prompt)
    model, processor = reference
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    ev = LocalEvaluator("tiny", tiny, "tiny-judge")
    text = ev.reply(ims, prompt, n)
    assert text == processor.tokenizer.decode(new, skip_special_tokens=True) and text
    (record,) = ev.cache._answers.values()
    eos = model.generation_config.eos_token_id
    assert record["answer"]["finish_reason"] == ("stop" if new[-1] in eos else "length")
    assert record["request"]["max_tokens"] == n and record["request"]["top_logprobs"] is None


def test_the_cache_answers_without_a_forward_pass_and_keys_on_the_backend(tiny, tmp_path):
    ims = images(1, seed=3)
    ev = LocalEvaluator("tiny", tiny, "tiny-judge", top_logprobs=VOCAB, cache=tmp_path / "answers",
                        cache_part="tiny")
    calls = count_forwards(ev)
    first = ev.yes_probabilities([(ims, QUESTION)])
    assert calls == [1]
    assert ev.yes_probabilities([(ims, QUESTION), (ims, QUESTION)]) == first * 2 and calls == [1]
    assert (ev.asked, ev.hits) == (1, 2)
    # a new evaluator over the same directory: the answer without loading the model
    again = LocalEvaluator("tiny", tiny, "tiny-judge", top_logprobs=VOCAB, cache=tmp_path / "answers",
                        cache_part="tiny")
    assert again.yes_probabilities([(ims, QUESTION)]) == first and not again.loaded and again.asked == 0
    # the backend (and dtype) are in the key: a served evaluator of the same name and model asks anew
    (line,) = (tmp_path / "answers" / "answers-tiny.jsonl").read_text().splitlines()
    request = json.loads(line)["request"]
    assert (request["backend"], request["dtype"]) == ("transformers", "float32")
    served = Evaluator("tiny", UNSERVED_URL, "tiny-judge", top_logprobs=VOCAB, cache=tmp_path / "answers")
    assert served.pending("yes_no", [(ims, QUESTION)]) == 1
    bf16 = LocalEvaluator("tiny", tiny, "tiny-judge", top_logprobs=VOCAB, dtype="bfloat16",
                          cache=tmp_path / "answers")
    assert bf16.pending("yes_no", [(ims, QUESTION)]) == 1


def test_bad_configurations_are_named_errors(tiny, tmp_path):
    from paco.core.params.benchmark import BenchmarkEvaluatorParams

    # the shared checks of paco.models.loading (check_transformers_dir), at construction
    with pytest.raises(ModelDirectoryError, match=r"evaluator 'tiny': model directory .*missing does not exist"):
        LocalEvaluator("tiny", tmp_path / "missing", "m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirectoryError, match=r"incomplete, missing \['config.json'"):
        LocalEvaluator("tiny", tmp_path / "empty", "m")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelDirectoryError, match=r"incomplete, missing \['model.safetensors or .*pytorch_model.bin"):
        LocalEvaluator("tiny", tmp_path / "empty", "m")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(ModelDirectoryError, match="not a safetensors file"):
        LocalEvaluator("tiny", tmp_path / "empty", "m")
    with pytest.raises(ValueError, match="dtype"):
        LocalEvaluator("tiny", tiny, "m", dtype="int8")
    with pytest.raises(ValueError, match="device"):
        LocalEvaluator("tiny", tiny, "m", device="tpu")
    kw = {"served_model_name": "m", "model_dir": tiny, "server_kwargs": {}, "client_kwargs": {}, "cache_dir": None}
    with pytest.raises(ValueError, match="backend 'vllm' is not one of"):
        BenchEvaluator("tiny", url=None, backend="vllm", **kw)
    with pytest.raises(ValueError, match="takes no url"):
        BenchEvaluator("tiny", url="http://127.0.0.1:9/v1", backend="transformers", **kw)
    with pytest.raises(ArtifactError, match="no config.json"):
        BenchEvaluator("tiny", url=None, backend="transformers", **{**kw, "model_dir": tmp_path / "missing"})
    entry = {"model": "data/models/judge_base", "served_model_name": "m"}
    with pytest.raises(ValidationError, match="backend"):
        BenchmarkEvaluatorParams(**entry, backend="torch")
    with pytest.raises(ValidationError, match="url and api_key_env must be null"):
        BenchmarkEvaluatorParams(**entry, url="http://h:8000/v1", backend="transformers")
    assert BenchmarkEvaluatorParams(**entry).backend == "openai"
    # a prompt longer than the context: named, nothing cached
    ev = LocalEvaluator("tiny", tiny, "m", max_model_len=16)
    with pytest.raises(EvaluatorContextLengthError) as info:
        ev.reply(images(1), "Describe.", 4)
    assert info.value.limit == 16 and info.value.n_tokens > 12 and len(ev.cache) == 0


def test_a_bench_evaluator_runs_the_model_in_process_only_when_asked(tiny, tmp_path):
    """``backend: transformers``: no server; one image stays one image; a batch the cache
    answers loads nothing; a load that fails is an EvaluatorError naming the evaluator."""
    kw = {"served_model_name": "m", "url": None, "model_dir": tiny, "client_kwargs": {"top_logprobs": VOCAB},
          "server_kwargs": {"engine": "paco", "device": "cpu", "dtype": "float32"}, "backend": "transformers"}
    ev = BenchEvaluator("tiny", cache_dir=tmp_path / "answers", **kw)
    assert not ev.doubles_single_images and ev.describe()["backend"] == "transformers"
    ev.start()  # no server, and no load before the first uncached batch
    assert not ev.started and ev._server is None and not ev._offline.loaded
    requests = [(images(1, seed=4), QUESTION)]
    first = ev.yes_probabilities(requests)
    assert ev.started and ev.asked == 1 and ev._server is None
    ev.close()
    rerun = BenchEvaluator("tiny", cache_dir=tmp_path / "answers", **kw)
    assert rerun.yes_probabilities(requests) == first and not rerun.started and rerun.asked == 0
    broken = BenchEvaluator("tiny", cache_dir=None, **kw)
    broken._offline.model_dir = tmp_path / "gone"
    with pytest.raises(EvaluatorError, match="evaluator 'tiny': cannot load"):
        broken.yes_probabilities(requests)


def test_the_stage_asks_a_transformers_evaluator_without_a_server(tmp_path, monkeypatch):
    """benchmark@kontext_editing (GEdit, expected score) with one ``backend: transformers``
    evaluator: every SC / PQ request asked in process (PQ with its one image), no server, the
    table without the doubled-image note; a rerun asks nothing and loads nothing."""
    from test_benchmark_stage import _member, _run, _workdir

    import paco.serving.local as local_server

    def no_server(self):
        raise AssertionError("a transformers evaluator started a server")

    monkeypatch.setattr(local_server.LocalServer, "start", no_server)
    ev = {"local": {"model": "data/models/judge_base", "url": None, "served_model_name": "base-judge",
                    "api_key_env": None, "stand_in_for": None, "backend": "transformers"}}
    gedit = {"scoring": "expected_score", "max_tokens": 512, "official_random": False, "seed": 42, "text_first": False}
    root = _workdir(tmp_path, {"kontext_editing": _member("gedit", ev, gedit=gedit, max_prompts=2)})
    build_tiny("qwen2_5_vl", root / "data/models/judge_base", seed=0)
    out = root / "data/benchmark/kontext_editing"
    assert _run(root, "kontext_editing", monkeypatch) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["evaluators"]["local"]["asked"] == 8 and report["evaluators"]["local"]["backend"] == "transformers"
    lines = [json.loads(x) for x in (out / "answers" / "answers-local.jsonl").read_text().splitlines()]
    assert sorted(len(r["request"]["images"]) for r in lines) == [1] * 4 + [2] * 4  # PQ: one image, SC: two
    assert all(r["request"]["backend"] == "transformers" for r in lines)
    assert "twice" not in (out / "table.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    assert math.isfinite(metrics["scores"]["lora"]["local"]["en"]["sc"])
    assert _run(root, "kontext_editing", monkeypatch) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["evaluators"]["local"]["asked"] == 0 and not report["evaluators"]["local"]["server_started"]


def test_params_transformers_evaluators_need_no_vllm_gpus_and_no_url():
    """``backend: transformers`` is not served by vLLM: no ``resources.gpus`` check for it; a url
    with it is refused, naming the key."""
    from pathlib import Path

    import yaml

    from paco.core.params import ParamsError, validate_params

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    raw["judge_endpoint"].update(url="http://judge:8000/v1", server={**raw["judge_endpoint"]["server"],
                                                                  "engine": "vllm", "gpus": 2})
    for member in raw["benchmark"].values():
        for ev in member["evaluators"].values():
            ev["backend"] = "transformers"
    params = validate_params(raw)
    assert {ev.backend for m in params.benchmark.values() for ev in m.evaluators.values()} == {"transformers"}
    raw["benchmark"]["t2is"]["evaluators"]["base"]["url"] = "http://gpu-node:8000/v1"
    with pytest.raises(ParamsError, match=r"benchmark\.t2is\.evaluators\.base.*url and api_key_env must be null"):
        validate_params(raw)


def test_the_shared_loader_gives_the_qwen_model_and_image_only_processor(tiny, tmp_path):
    """paco.models.loading.load_image_text_to_text: the concrete Qwen2.5-VL class in the asked
    dtype, in eval mode, with the torchvision-free processor; a checkpoint with more layers than
    the config is a WeightsMismatchError naming the concrete class."""
    import shutil

    from transformers import Qwen2_5_VLForConditionalGeneration

    from paco.models.loading import Qwen2_5_VLImageOnlyProcessor, WeightsMismatchError, load_image_text_to_text

    model, processor = load_image_text_to_text(tiny, dtype=torch.bfloat16)
    assert type(model) is Qwen2_5_VLForConditionalGeneration and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert type(processor) is Qwen2_5_VLImageOnlyProcessor
    other = shutil.copytree(tiny, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2
    config["text_config"]["num_hidden_layers"] = 1  # the checkpoint's layer 1 is then unexpected
    config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:1]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsMismatchError, match=r"evaluator: the weights in .* do not match "
                                                   r"Qwen2_5_VLForConditionalGeneration: \d+ unexpected tensor"):
        load_image_text_to_text(other, what="evaluator")
