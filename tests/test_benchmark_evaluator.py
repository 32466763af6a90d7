"""The benchmarks' evaluator client (issue 27, "Evaluator backends") against a stand-in
OpenAI-compatible server on 127.0.0.1 (tests/fake_openai.py): the yes/no score from crafted
top log-probs, the reply text, the score-token log-probs, the images sent, the answer cache (a
second ask, a new client over the same directory: no request; another image or question: one),
and failures as named errors with nothing cached. No network, nothing computed by a model."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math

import numpy as np
import pytest
from fake_openai import FakeOpenAIServer
from PIL import Image

import paco.serving.client as judge_client
from paco.benchmark.answer_cache import AnswerCache, request_key
from paco.benchmark.evaluator import (
    Evaluator,
    EvaluatorContextLengthError,
    EvaluatorError,
    EvaluatorReplyError,
    build_chat,
)
from paco.judge.chat import build_openai_messages, png_bytes
from paco.serving.client import ContextLengthError

MODEL = "evaluator-under-test"
QUESTION = ("Do images meet the following criteria? The same red fox appears in every image. "
            "Please answer Yes or No.")


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    """Retries without their 0.5-8 s waits (the schedule is the judge client's, tested there)."""
    monkeypatch.setattr(judge_client, "backoff_s", lambda attempts: 0.0)


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)) for _ in range(n)]


def completion(content: str | None, top: list[tuple[str, float]] | None = None, finish: str = "stop") -> dict:
    """A chat completion with ``content`` and, if given, first-token ``top_logprobs`` ``top``."""
    choice = {"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": content}}
    if top is not None:
        entries = [{"token": t, "logprob": lp, "bytes": None} for t, lp in top]
        choice["logprobs"] = {"content": [{"token": top[0][0] if top else "", "logprob": top[0][1] if top else 0.0,
                                           "bytes": None, "top_logprobs": entries}]}
    return {"id": "c", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [choice]}


def serve(reply):
    """A stand-in server answering every request with ``reply`` (a completion dict) and 200."""
    return FakeOpenAIServer(lambda body, n: (200, reply, 0))


def sent_images(body: dict) -> list[bytes]:
    """The decoded bytes of each image item of the request's one user turn, in order."""
    (turn,) = body["messages"]
    prefix = "data:image/png;base64,"
    return [base64.b64decode(item["image_url"]["url"].removeprefix(prefix))
            for item in turn["content"] if item["type"] == "image_url"]


def cache_lines(directory) -> list[dict]:
    return [json.loads(line) for p in sorted(directory.glob("*.jsonl")) for line in p.read_text().splitlines()]


# ---------------------------------------------------------------- the three kinds


def test_yes_probability_is_the_two_answer_softmax_of_the_top_logprobs(tmp_path):
    """The official T2IS code soft-maxes the logits of ``No`` and ``Yes`` (test_prompt_consistency.py
    lines 152-158): ``exp(y) / (exp(y) + exp(n))``, here from log-probs -0.3 and -1.5."""
    top = [("Yes", -0.3), ("No", -1.5), ("yes", -2.0), ("Maybe", -4.0)]
    with serve(completion("Yes", top)) as srv:
        ev = Evaluator("qwen", srv.base_url, MODEL, top_logprobs=5, cache=tmp_path / "a")
        got = ev.yes_probability(images(2), QUESTION)
        loose = Evaluator("qwen", srv.base_url, MODEL, top_logprobs=5, answer_variants=True, cache=tmp_path / "b")
        got_variants = loose.yes_probability(images(2), QUESTION)
    assert got == pytest.approx(math.exp(-0.3) / (math.exp(-0.3) + math.exp(-1.5)), rel=1e-12, abs=0)
    p_yes = math.exp(-0.3) + math.exp(-2.0)
    assert got_variants == pytest.approx(p_yes / (p_yes + math.exp(-1.5)), rel=1e-12, abs=0)
    body = srv.requests[0]
    assert body["model"] == MODEL and body["max_tokens"] == 1 and body["temperature"] == 0
    assert body["logprobs"] is True and body["top_logprobs"] == 5
    assert body["messages"][0]["content"][-1] == {"type": "text", "text": QUESTION}


def test_one_answer_missing_from_the_top_tokens_is_certain_and_neither_is_an_error(tmp_path):
    with serve(completion("No", [("No", -0.01), ("The", -5.0)])) as srv:
        assert Evaluator("e", srv.base_url, MODEL).yes_probability(images(2), QUESTION) == 0.0
    with serve(completion("The", [("The", -0.1), ("A", -3.0)])) as srv:
        ev = Evaluator("e", srv.base_url, MODEL, cache=tmp_path)
        with pytest.raises(EvaluatorReplyError, match="neither 'Yes' nor 'No'") as err:
            ev.yes_probability(images(2), QUESTION)
        assert srv.base_url in str(err.value) and MODEL in str(err.value)
        # the server answered: its answer is kept, and interpreted (and refused) again without a new ask
        with pytest.raises(EvaluatorReplyError, match="cached reply"):
            Evaluator("e", srv.base_url, MODEL, cache=tmp_path).yes_probability(images(2), QUESTION)
    assert len(srv.requests) == 1


def test_reply_text_round_trips_exactly(tmp_path):
    text = 'Reasoning: the edit is done.\n||V^=^V||\n{"score": [7, 8], "reasoning": "fine"}\n||V^=^V|| 中文'
    with serve(completion(text, finish="length")) as srv:
        ev = Evaluator("gpt", srv.base_url, MODEL, cache=tmp_path)
        assert ev.reply(images(2), "Rate the edit.", max_tokens=512) == text
    body = srv.requests[0]
    assert body["max_tokens"] == 512 and body["temperature"] == 0 and "logprobs" not in body
    assert cache_lines(tmp_path)[0]["answer"] == {"content": text, "finish_reason": "length"}


def test_a_reply_without_text_is_a_named_error_and_not_cached(tmp_path):
    with serve(completion(None)) as srv:
        ev = Evaluator("gpt", srv.base_url, MODEL, cache=tmp_path)
        with pytest.raises(EvaluatorReplyError, match="no text"):
            ev.reply(images(1), "Rate it.", max_tokens=8)
    assert cache_lines(tmp_path) == [] and len(ev.cache) == 0


def test_score_token_logprobs_merges_tokens_of_the_same_text(tmp_path):
    top = [("7", -0.5), ("8", -1.2), ("7", -3.0), ("10", -2.5)]
    with serve(completion("7", top)) as srv:
        got = Evaluator("e", srv.base_url, MODEL, top_logprobs=4).score_token_logprobs(images(1), "Score 0-10.")
    assert got == {"7": pytest.approx(math.log(math.exp(-0.5) + math.exp(-3.0)), rel=1e-12, abs=0),
                   "8": -1.2, "10": -2.5}
    assert srv.requests[0]["max_tokens"] == 1 and srv.requests[0]["top_logprobs"] == 4


@pytest.mark.parametrize("top", [[("Yes", 0.5), ("No", -1.0)], [("Yes", float("nan"))], [("Yes", True)],
                                 [(3, -1.0)]], ids=["positive", "nan", "bool", "token-not-str"])
def test_an_invalid_logprob_is_a_named_error_and_not_cached(tmp_path, top):
    body = json.dumps(completion("Yes", [("x", -1.0)])).replace('[{"token": "x", "logprob": -1.0, "bytes": null}]',
                                                               json.dumps([{"token": t, "logprob": lp}
                                                                           for t, lp in top]))
    with FakeOpenAIServer(lambda b, n: (200, body, 0)) as srv:
        ev = Evaluator("e", srv.base_url, MODEL, cache=tmp_path)
        with pytest.raises(EvaluatorReplyError, match="invalid top_logprobs entry"):
            ev.yes_probability(images(2), QUESTION)
    assert cache_lines(tmp_path) == []


def test_more_top_entries_than_asked_for_is_an_error(tmp_path):
    top = [("Yes", -0.1), ("No", -2.0), ("A", -3.0), ("B", -4.0)]
    with serve(completion("Yes", top)) as srv:
        with pytest.raises(EvaluatorReplyError, match="4 entries"):
            Evaluator("e", srv.base_url, MODEL, top_logprobs=2, cache=tmp_path).yes_probability(images(2), QUESTION)
    assert cache_lines(tmp_path) == []


# ---------------------------------------------------------------- the images sent


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_the_images_sent_are_the_images_given_in_order(n):
    given = images(n, seed=n)
    with serve(completion("Yes", [("Yes", -0.1)])) as srv:
        Evaluator("e", srv.base_url, MODEL).yes_probability(given, QUESTION)
        Evaluator("e", srv.base_url, MODEL).reply(given, "Rate.", max_tokens=4, text_first=True)
    first, second = srv.requests
    assert sent_images(first) == [png_bytes(im) for im in given]
    assert sent_images(second) == [png_bytes(im) for im in given]
    assert [i["type"] for i in first["messages"][0]["content"]] == ["image_url"] * n + ["text"]
    assert [i["type"] for i in second["messages"][0]["content"]] == ["text"] + ["image_url"] * n


def test_build_chat_of_two_images_is_the_judge_layout():
    a, b = (png_bytes(im) for im in images(2))
    assert build_chat([a, b], QUESTION) == build_openai_messages(a, b, QUESTION)
    with pytest.raises(ValueError):
        build_chat([a], "  ")
    with pytest.raises(ValueError):
        build_chat([b"GIF89a..."], QUESTION)


def test_bad_inputs_are_named_errors_before_any_request(tmp_path):
    with serve(completion("Yes", [("Yes", -0.1)])) as srv:
        ev = Evaluator("e", srv.base_url, MODEL)
        with pytest.raises(TypeError, match="sequence of images"):
            ev.yes_probability(images(1)[0], QUESTION)
        with pytest.raises(TypeError, match="PIL image or PNG/JPEG bytes"):
            ev.yes_probability(["panel.png"], QUESTION)
        with pytest.raises(ValueError, match="max_tokens"):
            ev.reply(images(1), "Rate.", max_tokens=0)
    assert srv.requests == []
    with pytest.raises(ValueError, match="name"):
        Evaluator("", "http://127.0.0.1:1/v1", MODEL)


# ---------------------------------------------------------------- the answer cache


def test_a_cached_answer_is_not_asked_again_even_by_a_new_client(tmp_path):
    top = [("Yes", -0.7), ("No", -0.9)]
    a, b, c = images(3)
    with serve(completion("Yes", top)) as srv:
        ev = Evaluator("qwen", srv.base_url, MODEL, cache=tmp_path)
        first = ev.yes_probability([a, b], QUESTION)
        assert ev.yes_probability([a, b], QUESTION) == first and len(srv.requests) == 1
        assert (ev.asked, ev.hits) == (1, 1)
        # a new client over the same directory (a rerun) asks nothing and gives the identical value
        again = Evaluator("qwen", srv.base_url, MODEL, cache=tmp_path)
        assert again.yes_probability([a.copy(), b.copy()], QUESTION) == first and len(srv.requests) == 1
        # another image, order, question, evaluator, layout: each asks once
        again.yes_probability([a, c], QUESTION)
        again.yes_probability([b, a], QUESTION)
        again.yes_probability([a, b], QUESTION + " ")
        Evaluator("gemma", srv.base_url, MODEL, cache=tmp_path).yes_probability([a, b], QUESTION)
        again.yes_probability([a, b], QUESTION, text_first=True)
        assert len(srv.requests) == 6
        # a reply is another kind; a re-ask (attempt 1) is a request of its own, then cached too
        again.reply([a, b], QUESTION, max_tokens=4)
        again.reply([a, b], QUESTION, max_tokens=4, attempt=1)
        again.reply([a, b], QUESTION, max_tokens=4, attempt=1)
        again.reply([a, b], QUESTION, max_tokens=5)
        assert len(srv.requests) == 9
    assert first == pytest.approx(1 / (1 + math.exp(-0.2)), rel=1e-12, abs=0)
    lines = cache_lines(tmp_path)
    assert len(lines) == 9 and all(line["key"] == request_key(line["request"]) for line in lines)
    assert lines[0]["request"] == {
        "evaluator": "qwen", "model": MODEL, "kind": "yes_no", "text": QUESTION, "max_tokens": 1,
        "images": [hashlib.sha256(png_bytes(im)).hexdigest() for im in (a, b)],
        "top_logprobs": 20, "layout": "images_first", "attempt": 0}
    assert lines[0]["answer"]["top_logprobs"] == [{"token": "Yes", "logprob": -0.7}, {"token": "No", "logprob": -0.9}]


def test_a_batch_asks_each_distinct_request_once_and_keeps_its_order(tmp_path):
    def script(body, n):
        text = body["messages"][0]["content"][-1]["text"]
        return 200, completion(f"reply to {text}"), 0.05

    ims = images(2)
    with FakeOpenAIServer(script) as srv:
        ev = Evaluator("e", srv.base_url, MODEL, concurrency=4, cache=tmp_path)
        texts = [f"q{i % 5}" for i in range(12)]
        assert ev.replies([(ims, t) for t in texts], max_tokens=8) == [f"reply to {t}" for t in texts]
    assert len(srv.requests) == 5 and (ev.asked, ev.hits) == (5, 7)


def test_a_killed_write_loses_only_its_own_line(tmp_path, caplog):
    with serve(completion("Yes", [("Yes", -0.1), ("No", -2.0)])) as srv:
        ev = Evaluator("e", srv.base_url, MODEL, cache=tmp_path)
        ev.yes_probabilities([(images(2), "q1"), (images(2), "q2")])
        path = ev.cache.path
        good = path.read_bytes()
        path.write_bytes(good + good.splitlines(keepends=True)[0][:40])  # a line cut by a kill
        with caplog.at_level(logging.WARNING, logger="paco.benchmark.answer_cache"):
            rerun = Evaluator("e", srv.base_url, MODEL, cache=tmp_path)
        assert len(rerun.cache) == 2 and len(rerun.cache.discarded) == 1 and "without its newline" in caplog.text
        assert path.read_bytes() == good
        rerun.yes_probabilities([(images(2), "q1"), (images(2), "q2"), (images(2), "q3")])
        assert len(srv.requests) == 3
    assert len(cache_lines(tmp_path)) == 3


def test_a_line_whose_key_is_not_its_request_is_dropped(tmp_path):
    cache = AnswerCache(tmp_path)
    cache.put({"text": "a"}, {"content": "x"})
    line = json.loads(cache.path.read_text())
    line["request"]["text"] = "b"
    (tmp_path / "answers-1.jsonl").write_text(json.dumps(line) + "\nnot json\n")
    cache.path.unlink()
    loaded = AnswerCache(tmp_path)
    assert len(loaded) == 0
    assert [(d["where"].rsplit(":", 1)[1], d["reason"].split(" (")[0]) for d in loaded.discarded] == [
        ("1", f"its key {line['key'][:12]}... is not the hash of its request"),
        ("2", "not a JSON line: Expecting value: line 1 column 1")]


# ---------------------------------------------------------------- failures


def test_a_500_after_the_retries_is_a_named_error_and_nothing_is_cached(tmp_path):
    with FakeOpenAIServer(lambda body, n: (500, {"error": {"message": "engine dead"}}, 0)) as srv:
        ev = Evaluator("qwen", srv.base_url, MODEL, retries=2, cache=tmp_path)
        with pytest.raises(EvaluatorError) as err:
            ev.yes_probability(images(2), QUESTION)
    msg = str(err.value)
    assert not isinstance(err.value, EvaluatorReplyError)
    for part in ("evaluator 'qwen'", srv.base_url, MODEL, "HTTP status 500", "after 3 attempt(s)", "engine dead"):
        assert part in msg, (part, msg)
    assert len(srv.requests) == 3 and len(ev.cache) == 0 and cache_lines(tmp_path) == []
    # the rerun, with the server healthy again, asks
    with serve(completion("Yes", [("Yes", -0.1), ("No", -0.2)])) as srv:
        score = Evaluator("qwen", srv.base_url, MODEL, cache=tmp_path).yes_probability(images(2), QUESTION)
    assert len(srv.requests) == 1 and 0.5 < score < 0.6


def test_an_unreachable_evaluator_is_a_named_error():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ev = Evaluator("gemma", f"http://127.0.0.1:{port}/v1", MODEL, retries=1, timeout_s=5)
    with pytest.raises(EvaluatorError, match="cannot connect, after 2 attempt") as err:
        ev.reply(images(1), "Rate.", max_tokens=4)
    assert f"127.0.0.1:{port}" in str(err.value) and MODEL in str(err.value) and len(ev.cache) == 0


def test_a_prompt_too_long_is_a_context_length_error():
    message = ("This model's maximum context length is 4096 tokens. However, you requested 5001 tokens "
               "(5000 in the messages, 1 in the completion).")
    with FakeOpenAIServer(lambda b, n: (400, {"error": {"message": message}}, 0)) as srv:
        with pytest.raises(EvaluatorContextLengthError) as err:
            Evaluator("e", srv.base_url, MODEL).yes_probability(images(2), QUESTION)
    assert isinstance(err.value, ContextLengthError) and (err.value.n_tokens, err.value.limit) == (5000, 4096)
    assert len(srv.requests) == 1


def test_a_failure_in_a_batch_keeps_the_answers_that_arrived(tmp_path):
    def script(body, n):
        text = body["messages"][0]["content"][-1]["text"]
        return (500, {"error": {"message": "no"}}, 0) if text == "bad" else (200, completion("ok"), 0)

    with FakeOpenAIServer(script) as srv:
        ev = Evaluator("e", srv.base_url, MODEL, retries=0, concurrency=1, cache=tmp_path)
        with pytest.raises(EvaluatorError, match="HTTP status 500"):
            ev.replies([(images(1), "good1"), (images(1), "bad"), (images(1), "good2")], max_tokens=4)
    assert [line["request"]["text"] for line in cache_lines(tmp_path)] == ["good1"]


def test_compact_answers_makes_the_folder_independent_of_arrival_order(tmp_path):
    """Two caches holding the same answers written in opposite orders have identical bytes after
    compact_answers, every answer is still found by a new cache, and a torn last line is dropped."""
    from paco.benchmark.answer_cache import AnswerCache, compact_answers

    requests = [{"kind": "reply", "text": f"q{i}"} for i in range(5)]
    dirs = []
    for name, order in (("a", requests), ("b", list(reversed(requests)))):
        cache = AnswerCache(tmp_path / name)
        for r in order:
            cache.put(r, {"content": r["text"].upper()})
        dirs.append(tmp_path / name)
    with (tmp_path / "b" / "answers-0.jsonl").open("ab") as f:
        f.write(b'{"key": "torn')
    assert (tmp_path / "a" / "answers-0.jsonl").read_bytes() != (tmp_path / "b" / "answers-0.jsonl").read_bytes()
    assert compact_answers(dirs[0]) == compact_answers(dirs[1]) == 5
    assert (tmp_path / "a" / "answers-0.jsonl").read_bytes() == (tmp_path / "b" / "answers-0.jsonl").read_bytes()
    again = AnswerCache(tmp_path / "b")
    from paco.benchmark.answer_cache import request_key
    assert [again.get(request_key(r))["answer"]["content"] for r in requests] == ["Q0", "Q1", "Q2", "Q3", "Q4"]


def test_compact_answers_leaves_no_temporary_file_when_a_rewrite_fails(tmp_path, monkeypatch):
    """compact_answers writes through paco.core.io.atomic_write_bytes: a failed replace raises the
    named error, keeps the old part as it was and leaves no ``.*.tmp`` sibling for DVC to hash."""
    import os

    from paco.benchmark.answer_cache import AnswerCacheError, compact_answers

    cache = AnswerCache(tmp_path, part="x")
    for k in (3, 1, 2):
        cache.put({"q": k}, {"a": k})
    before = (tmp_path / "answers-x.jsonl").read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(AnswerCacheError, match="cannot rewrite the answer cache file"):
        compact_answers(tmp_path)
    assert (tmp_path / "answers-x.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers-x.jsonl"]
    monkeypatch.undo()
    assert compact_answers(tmp_path) == 3
    assert [json.loads(line)["request"]["q"] for line in (tmp_path / "answers-x.jsonl").read_text().splitlines()] \
        == [r["request"]["q"] for r in sorted(AnswerCache(tmp_path)._answers.values(), key=lambda r: r["key"])]


def test_prepare_answers_removes_the_temporary_files_of_a_killed_write(tmp_path):
    """A kill during compact_answers or the marker's write leaves ``.<name>.<random>.tmp``:
    prepare_answers removes them (same identity: the answers are kept)."""
    from paco.benchmark.serving import prepare_answers

    assert prepare_answers(tmp_path / "a", "id1") == 0
    (tmp_path / "a/answers-x.jsonl").write_text("{}\n")
    (tmp_path / "a/.answers-x.jsonl.k3j9.tmp").write_text("half")
    (tmp_path / "a/.run_identity.json.z1.tmp").write_text("{")
    (tmp_path / "a/.keep").write_text("not a temporary file")
    assert prepare_answers(tmp_path / "a", "id1") == 1
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".keep", "answers-x.jsonl", "run_identity.json"]


def test_evaluators_asked_together_stop_at_the_first_failure(tmp_path):
    """ask_evaluators(together=True): an evaluator answering 500 is raised at once; the slow one is
    cancelled at its next batch instead of asking all its questions."""
    import time

    from paco.benchmark.cases import ask_in_chunks
    from paco.benchmark.serving import BenchEvaluator, ask_evaluators

    def ok(body, n):
        return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "fine"}}]}, 0.2

    reqs = [([png_bytes(Image.new("RGB", (8, 8), (i, 0, 0)))], f"question {i}") for i in range(30)]
    client = {"concurrency": 1, "timeout_s": 10, "retries": 0, "top_logprobs": 5, "api_key": None}
    with FakeOpenAIServer(lambda body, n: (500, {"error": {"message": "boom"}}, 0.3)) as broken, \
            FakeOpenAIServer(ok) as slow:
        evs = [BenchEvaluator(name, "m", url=url, model_dir=None, server_kwargs=None, client_kwargs=client,
                              cache_dir=None) for name, url in (("slow", slow.base_url), ("broken", broken.base_url))]
        t0 = time.perf_counter()
        with pytest.raises(EvaluatorError, match="evaluator 'broken'.*500"):
            ask_evaluators(evs, lambda ev: ask_in_chunks(lambda part: ev.replies(part, 16), reqs, desc=ev.name,
                                                         chunk=1), together=True)
        elapsed = time.perf_counter() - t0
        time.sleep(0.5)  # the slow evaluator's question in flight ends; no other is sent
        assert elapsed < 2.0 and len(slow.requests) <= 4  # not 30 questions x 0.2 s
        with pytest.raises(EvaluatorError, match="cancelled"):
            evs[0].replies(reqs[:1], 16)
