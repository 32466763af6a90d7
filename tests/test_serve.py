"""The judge server (OpenAI-compatible subset, dynamic batching) and its client."""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from paco.judge import Judge
from paco.judge_client import JudgeClient, JudgeError, LocalJudgeServer, yes_probability
from paco.serve import make_server
from paco.templates import build_openai_messages, judge_instruction, png_bytes

NAME = "paco-reward-test"
VOCAB = 100_000


def _images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def judge(tiny_model_dirs) -> Judge:
    return Judge.from_pretrained(tiny_model_dirs["judge_base"])


@pytest.fixture()
def server(judge):
    # the untrained tiny judge need not rank Yes/No among its top 20 first tokens: serve the whole
    # vocabulary (vLLM's --max-logprobs does the same)
    srv = make_server(judge, NAME, "127.0.0.1", 0, max_batch_size=8, max_wait_ms=200, max_logprobs=VOCAB)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    host, port = srv.server_address[:2]
    yield srv, f"http://{host}:{port}/v1"
    srv.shutdown()
    srv.batcher.close()
    srv.server_close()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_yes_probability_is_the_two_token_softmax():
    top = [{"token": "Yes", "logprob": math.log(0.6)}, {"token": "No", "logprob": math.log(0.2)},
           {"token": "yes", "logprob": math.log(0.1)}]
    assert yes_probability(top) == pytest.approx(0.6 / 0.8)
    assert yes_probability(top, answer_variants=True) == pytest.approx(0.7 / 0.9)
    assert yes_probability(top[:1]) == 1.0 and yes_probability(top[1:2]) == 0.0  # reference: missing = -inf
    with pytest.raises(JudgeError, match="neither"):
        yes_probability([{"token": "Maybe", "logprob": -0.1}])
    with pytest.raises(JudgeError, match="invalid logprob"):
        yes_probability([{"token": "Yes", "logprob": float("nan")}])


def test_concurrent_requests_are_batched_and_match_local_scores(server, judge):
    srv, url = server
    ims = _images(12)
    text = judge_instruction("a tabby cat")
    triples = [(ims[i], ims[(i + 5) % 12], text) for i in range(12)]
    client = JudgeClient(url, NAME, concurrency=12, retries=0, top_logprobs=VOCAB)
    scores = client.score(triples)
    assert srv.batcher.requests == 12
    assert srv.batcher.forward_passes < 12, "concurrent requests were not batched"
    assert srv.batcher.max_batch > 1
    np.testing.assert_allclose(scores, judge.score(triples), atol=1e-5)
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_protocol_endpoints_and_errors(server):
    _, url = server
    client = JudgeClient(url, NAME, retries=0)
    assert client.served_models() == [NAME]
    client.check_model()
    assert client.health()["status"] == "ok"
    with pytest.raises(JudgeError, match="serves"):
        JudgeClient(url, "other-name", retries=0).check_model()
    a, b = _images(2)
    body = {"model": NAME, "messages": build_openai_messages(png_bytes(a), png_bytes(b), "same?"),
            "max_tokens": 1, "logprobs": True, "top_logprobs": 5}
    status, obj = _post(f"{url}/chat/completions", body)
    assert status == 200
    entry = obj["choices"][0]["logprobs"]["content"][0]
    assert len(entry["top_logprobs"]) == 5 and entry["token"] == entry["top_logprobs"][0]["token"]
    assert obj["choices"][0]["message"]["content"] == entry["token"]
    lps = [t["logprob"] for t in entry["top_logprobs"]]
    assert lps == sorted(lps, reverse=True) and lps[0] <= 0
    assert _post(f"{url}/chat/completions", {**body, "model": "nope"})[0] == 404
    assert _post(f"{url}/chat/completions", {**body, "max_tokens": 4})[0] == 400
    bad = json.loads(json.dumps(body))
    bad["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64,iVBORw0KGgoAAAA"
    status, obj = _post(f"{url}/chat/completions", bad)
    assert status == 400 and "image 1" in obj["message"]
    one_image = json.loads(json.dumps(body))
    del one_image["messages"][0]["content"][1]
    assert _post(f"{url}/chat/completions", one_image)[0] == 400
    # a client error is not retried and names the URL and status
    with pytest.raises(JudgeError, match=r"chat/completions failed \(HTTP status 404\)"):
        JudgeClient(url, "nope", retries=3).score([(a, b, "same?")])



def test_unreachable_judge_fails_after_bounded_retries(dead_url):
    url = dead_url
    client = JudgeClient(url, NAME, retries=2, backoff_s=0.01, timeout_s=2)
    a, b = _images(2)
    with pytest.raises(JudgeError) as err:
        client.score([(a, b, "same?")])
    msg = str(err.value)
    assert url in msg and "no HTTP response" in msg and "3 attempt(s)" in msg


def test_local_server_process_lifecycle(tiny_model_dirs, tmp_path):
    log = tmp_path / "server.log"
    with LocalJudgeServer(tiny_model_dirs["judge_base"], NAME, log_path=log, threads=1, max_logprobs=VOCAB) as url:
        client = JudgeClient(url, NAME, retries=0, top_logprobs=VOCAB)
        a, b = _images(2)
        assert 0.0 <= client.score([(a, b, judge_instruction(None))])[0] <= 1.0
        assert client.health()["forward_passes"] == 1
    with pytest.raises(JudgeError):
        JudgeClient(url, NAME, retries=0, timeout_s=2).health()
    assert "serving" in log.read_text()


def test_local_server_that_cannot_start_reports_its_log(tmp_path):
    with pytest.raises(JudgeError, match="exited with code") as err:
        with LocalJudgeServer(tmp_path / "no-such-model", NAME, startup_timeout_s=60):
            pass
    assert "no-such-model" in str(err.value)


def test_one_bad_input_fails_only_its_own_request(server, judge):
    """A batch whose forward pass fails is rescored one request at a time: the request the
    processor refuses (aspect ratio > 200) gets a non-retryable 400, the others their scores."""
    srv, url = server
    a, b = _images(2)
    sliver = Image.new("RGB", (300, 1), (200, 30, 30))
    bodies = [{"model": NAME, "messages": build_openai_messages(png_bytes(x), png_bytes(b), "same?"),
               "max_tokens": 1, "logprobs": True, "top_logprobs": VOCAB} for x in (a, sliver, b, a)]
    results: list = [None] * len(bodies)

    def post(i: int) -> None:
        results[i] = _post(f"{url}/chat/completions", bodies[i])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = [r[0] for r in results]
    assert statuses == [200, 400, 200, 200], results[1]
    assert "aspect ratio" in results[1][1]["message"]
    assert srv.batcher.isolated_batches >= 1, "no failing batch was isolated (the requests were not batched)"
    good = [yes_probability(r[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) for i, r in
            enumerate(results) if i != 1]
    np.testing.assert_allclose(good, judge.score([(a, b, "same?"), (b, b, "same?"), (a, b, "same?")]), atol=1e-5)


def test_cancelled_requests_are_not_computed(judge):
    from paco.serve import BatchingJudge

    calls: list[int] = []

    class Counting:
        processor = judge.processor

        def first_token_logits(self, triples):
            calls.append(len(triples))
            return judge.first_token_logits(triples)

    batcher = BatchingJudge(Counting(), max_batch_size=8, max_wait_ms=300)
    try:
        a, b = _images(2)
        kept = batcher.submit((a, b, "same?"), 5)
        dropped = batcher.submit((b, a, "same?"), 5)
        assert dropped.cancel()  # still queued (the batcher waits up to 300 ms for more)
        assert kept.result(timeout=60)[2] and len(kept.result()[2]) == 5
        assert calls == [1]
    finally:
        batcher.close()
