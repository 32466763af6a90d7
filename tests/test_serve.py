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

from paco.judge.model import Judge, JudgeContextError
from paco.judge.client import JudgeClient, JudgeContextLengthError, JudgeError, LocalJudgeServer, yes_probability
from paco.judge.serve import BatchingJudge, make_server
from paco.judge.templates import build_openai_messages, judge_instruction, png_bytes

NAME = "paco-reward-test"
VOCAB = 100_000


def _images(n: int, seed: int = 0, size: tuple[int, int] = (64, 64)) -> list[Image.Image]:
    """``n`` random RGB images of ``size`` (height, width)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)) for _ in range(n)]


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


def test_yes_probability_answer_variants_is_the_reference_canonicalize():
    """answer_variants = the reference's canonicalize=True (get_yes_cond_prob_from_completion,
    PaCo-GRPO/paco_grpo/utils.py): every token whose strip().lower() is yes/no, summed in
    probability space; written out here independently."""
    lps = {"Yes": -0.7, " yes": -2.1, "YES\n": -3.3, "\tyes ": -4.0, "Yes.": -1.5, "yes!": -2.5,
           "Yesterday": -2.2, "No": -1.9, " no": -2.8, "NO": -3.9, "Nope": -1.2, "no.": -2.6, "n": -3.0}
    top = [{"token": t, "logprob": v} for t, v in lps.items()]
    yes = sum(np.exp(np.float64(lps[t])) for t in ("Yes", " yes", "YES\n", "\tyes "))
    no = sum(np.exp(np.float64(lps[t])) for t in ("No", " no", "NO"))
    assert yes_probability(top, answer_variants=True) == pytest.approx(yes / (yes + no), rel=1e-12)
    # off: the exact tokens only (reference canonicalize=False)
    assert yes_probability(top) == pytest.approx(1 / (1 + math.exp(lps["No"] - lps["Yes"])), rel=1e-12)
    # only a lower-case variant of No among the top tokens: the other side is impossible
    assert yes_probability([{"token": " no", "logprob": -0.1}, {"token": "Yes.", "logprob": -0.2}],
                           answer_variants=True) == 0.0


def _batch_rows(judge, triples: list, batching: str, top_k: int) -> tuple[list, list[int]]:
    """Submit ``triples`` at once to a fresh batcher that collects exactly that many, return
    the results in order and the batch sizes of the forward passes."""
    sizes: list[int] = []

    class Recording:  # the judge, recording how many rows each forward pass had
        processor = judge.processor
        device = judge.device
        encode = staticmethod(judge.encode)

        def logits(self, inputs):
            sizes.append(int(inputs["input_ids"].shape[0]))
            return judge.logits(inputs)

    batcher = BatchingJudge(Recording(), max_batch_size=len(triples), max_wait_ms=20_000, batching=batching)
    try:
        futures = [batcher.submit(t, top_k) for t in triples]
        return [f.result(timeout=120) for f in futures], sizes
    finally:
        batcher.close()


@pytest.mark.parametrize("batching", ["auto", "single"])
def test_logprobs_do_not_depend_on_the_batch(judge, batching):
    """The same request, alone and inside batches of 4, 8 and 16 of other contents, prompt lengths
    and image sizes, gets bit-identical log-probs of every vocabulary token (the old server
    left-padded mixed batches into one pass: rows differed by ~3e-6)."""
    ims = _images(4, seed=1, size=(100, 128)) + _images(2, seed=2, size=(128, 70)) + _images(2, seed=3)
    target = (ims[0], ims[1], judge_instruction("a cat"))
    same_shape = [(ims[2], ims[3], target[2]), (ims[1], ims[0], target[2]), (ims[3], ims[2], target[2])]
    texts = [judge_instruction(t) for t in (None, "a red fox in the snow", "robots")]
    mixed = [(ims[4 + i % 4], ims[(i * 3) % 8], texts[i % 3]) for i in range(12)]
    assert len({judge.encode([t])["input_ids"].shape[1] for t in [target] + mixed}) >= 3
    n_vocab = len(judge.processor.tokenizer)
    (alone,), sizes = _batch_rows(judge, [target], batching, n_vocab)
    assert sizes == [1] and len(alone[2]) == n_vocab
    for others, pos in ((same_shape, 0), (same_shape[:1] + mixed[:6], 7), (same_shape + mixed, 9)):
        triples = list(others)
        triples.insert(pos, target)
        results, sizes = _batch_rows(judge, triples, batching, n_vocab)
        assert results[pos] == alone  # (token id, logprob, [(id, logprob), ...]) exactly
        assert sum(sizes) == len(triples)
        if batching == "auto":  # same_shape on CPU: the target shared its pass with its shape
            assert max(sizes) >= 2 and len(sizes) < len(triples)
        else:
            assert sizes == [1] * len(triples)


def test_too_long_prompt_is_a_named_error_everywhere(server, judge):
    """A prompt that does not fit the judge's context (max_position_embeddings 4096) is refused
    with the token count and the limit: a 400 from the server (vLLM's wording), a
    JudgeContextLengthError from the client, a JudgeContextError in process; no score."""
    srv, url = server
    a, b = _images(2)
    theme = " ".join(["a tall lighthouse on a rocky coast at dusk"] * 600)
    text = judge_instruction(theme)
    n = int(judge.processor(text=[judge.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)], images=[a, b], return_tensors="pt")["input_ids"].shape[1])
    limit = judge.model.config.text_config.max_position_embeddings
    assert limit == judge.max_model_len == 4096 and n > limit
    body = {"model": NAME, "messages": build_openai_messages(png_bytes(a), png_bytes(b), text),
            "max_tokens": 1, "logprobs": True, "top_logprobs": 5}
    status, obj = _post(f"{url}/chat/completions", body)
    assert status == 400
    assert obj["message"].startswith(f"This model's maximum context length is {limit} tokens. However, you "
                                     f"requested {n + 1} tokens ({n} in the messages, 1 in the completion).")
    assert srv.batcher.forward_passes == 0 and srv.batcher.refused == 1
    with pytest.raises(JudgeContextLengthError, match=f"{n} tokens.*context is {limit} positions") as err:
        JudgeClient(url, NAME, retries=3).score([(a, b, text), (b, a, judge_instruction("a cat"))])
    assert (err.value.n_tokens, err.value.limit) == (n, limit)
    assert JudgeClient(url, NAME, retries=0).served_models() == [NAME]
    with pytest.raises(JudgeContextError) as err:
        judge.score([(a, b, judge_instruction("a cat")), (a, b, text)])
    assert (err.value.n_tokens, err.value.limit) == (n, limit)


def test_context_bound_is_prompt_plus_one_answer_token(judge):
    """vLLM's rule: prompt tokens + max_tokens (1) <= max_model_len."""
    a, b = _images(2)
    triple = (a, b, "same?")
    n = int(judge.encode([triple])["input_ids"].shape[1])
    fits = Judge(judge.model, judge.processor, max_model_len=n + 1)
    assert 0.0 <= fits.score([triple])[0] <= 1.0
    with pytest.raises(JudgeContextError, match=f"requested {n + 1} tokens \\({n} in the messages"):
        Judge(judge.model, judge.processor, max_model_len=n).score([triple])
    with pytest.raises(ValueError, match="max_model_len"):
        Judge(judge.model, judge.processor, max_model_len=4097)


def test_client_recognises_vllm_context_refusals():
    from paco.judge.client import _context_refusal

    old = ("HTTP 400 from http://h/v1/chat/completions: {\"object\":\"error\",\"message\":\"This model's maximum "
           "context length is 4096 tokens. However, you requested 9688 tokens (9687 in the messages, 1 in the "
           "completion). Please reduce the length of the messages or completion.\"")
    new = ("HTTP 400 from http://h/v1/chat/completions: {\"error\": {\"message\": \"The decoder prompt (length "
           "9687) is longer than the maximum model length of 4096. Make sure that `max_model_len` is no smaller")
    assert _context_refusal(old) == (9687, 4096)
    assert _context_refusal(new) == (9687, 4096)
    assert _context_refusal("HTTP 400 from x: image 1: invalid base64") is None


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
    health = client.health()
    assert health["status"] == "ok" and health["batching"] == "same_shape" and health["max_model_len"] == 4096
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


@pytest.mark.parametrize("batching", ["auto", "dynamic"])
def test_one_bad_input_fails_only_its_own_request(judge, batching):
    """The request the processor refuses (aspect ratio > 200) gets a non-retryable 400, the
    others their scores: refused at its own encoding (auto), or by rescoring the failed padded
    batch one request at a time (dynamic)."""
    srv = make_server(judge, NAME, "127.0.0.1", 0, max_batch_size=8, max_wait_ms=200, max_logprobs=VOCAB,
                      batching=batching)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = "http://%s:%d/v1" % srv.server_address[:2]
    try:
        _check_one_bad_input(srv, url, judge, batching)
    finally:
        srv.shutdown()
        srv.batcher.close()
        srv.server_close()


def _check_one_bad_input(srv, url, judge, batching):
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
    assert srv.batcher.refused == 1
    if batching == "dynamic":
        assert srv.batcher.isolated_batches >= 1, "no failing batch was isolated (the requests were not batched)"
    else:
        assert srv.batcher.isolated_batches == 0 and srv.batcher.max_batch >= 2
    good = [yes_probability(r[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) for i, r in
            enumerate(results) if i != 1]
    np.testing.assert_allclose(good, judge.score([(a, b, "same?"), (b, b, "same?"), (a, b, "same?")]), atol=1e-5)


def test_cancelled_requests_are_not_computed(judge):
    from paco.judge.serve import BatchingJudge

    calls: list[int] = []

    class Counting:
        processor = judge.processor
        encode = staticmethod(judge.encode)

        def logits(self, inputs):
            calls.append(int(inputs["input_ids"].shape[0]))
            return judge.logits(inputs)

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
