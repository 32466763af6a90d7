"""The judge server (OpenAI-compatible subset over HTTP, limits, lifetime) and its client; the
worker's batching and the request preparation are tests/test_serve_batching.py."""

from __future__ import annotations

import base64
import json
import math
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from paco.core.templates import judge_instruction
from paco.judge.chat import build_openai_messages, png_bytes
from paco.serving.client import ServedModelError
from paco.serving.judge_client import JudgeClient, JudgeContextLengthError, JudgeError
from paco.serving.local import LocalServer
from paco.judge.model import AnswerLogprobsError, yes_probability
from paco.judge.model import Judge, JudgeContextError
from paco.serving.server.app import JudgeServer
from paco.serving.server.limits import ServerLimits

from judge_server_helpers import NAME, images, request_body

VOCAB = 100_000


@pytest.fixture(scope="module")
def judge(tiny_model_dirs) -> Judge:
    return Judge.from_pretrained(tiny_model_dirs["judge_base"])


@pytest.fixture()
def server(judge):
    # the untrained tiny judge need not rank Yes/No among its top 20 first tokens: serve the whole
    # vocabulary (vLLM's --max-logprobs does the same)
    with JudgeServer(judge, NAME, max_batch_size=8, max_wait_ms=200, max_logprobs=VOCAB) as srv:
        yield srv, srv.url


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
    with pytest.raises(AnswerLogprobsError, match="neither"):
        yes_probability([{"token": "Maybe", "logprob": -0.1}])
    with pytest.raises(AnswerLogprobsError, match="invalid logprob"):
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


def test_too_long_prompt_is_a_named_error_everywhere(server, judge):
    """A prompt that does not fit the judge's context (max_position_embeddings 4096) is refused
    with the token count and the limit: a 400 from the server (vLLM's wording), a
    JudgeContextLengthError from the client, a JudgeContextError in process; no score."""
    srv, url = server
    a, b = images(2)
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
    assert obj["error"]["message"].startswith(f"This model's maximum context length is {limit} tokens. However, you "
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
    a, b = images(2)
    triple = (a, b, "same?")
    n = int(judge.encode([triple])["input_ids"].shape[1])
    fits = Judge(judge.model, judge.processor, max_model_len=n + 1)
    assert 0.0 <= fits.score([triple])[0] <= 1.0
    with pytest.raises(JudgeContextError, match=f"requested {n + 1} tokens \\({n} in the messages"):
        Judge(judge.model, judge.processor, max_model_len=n).score([triple])
    with pytest.raises(ValueError, match="max_model_len"):
        Judge(judge.model, judge.processor, max_model_len=4097)


def test_client_recognises_vllm_context_refusals():
    from paco.serving.client import _context_refusal

    old = ("HTTP 400 from http://h/v1/chat/completions: {\"object\":\"error\",\"message\":\"This model's maximum "
           "context length is 4096 tokens. However, you requested 9688 tokens (9687 in the messages, 1 in the "
           "completion). Please reduce the length of the messages or completion.\"")
    new = ("HTTP 400 from http://h/v1/chat/completions: {\"error\": {\"message\": \"The decoder prompt (length "
           "9687) is longer than the maximum model length of 4096. Make sure that `max_model_len` is no smaller")
    assert _context_refusal(old) == (9687, 4096)
    assert _context_refusal(new) == (9687, 4096)
    assert _context_refusal("HTTP 400 from x: image 1: invalid base64") is None


def test_concurrent_requests_match_local_scores_one_pass_each_or_batched(server, judge):
    """The default (auto = single) gives each of 12 concurrent requests its own forward pass;
    same_shape lets them share passes. Either way the scores are the judge's own."""
    srv, url = server
    ims = images(12)
    text = judge_instruction("a tabby cat")
    triples = [(ims[i], ims[(i + 5) % 12], text) for i in range(12)]
    local = judge.score(triples)
    client = JudgeClient(url, NAME, concurrency=12, retries=0, top_logprobs=VOCAB)
    scores = client.score(triples)
    assert srv.batcher.requests == 12 and srv.batcher.forward_passes == 12 and srv.batcher.max_batch == 1
    np.testing.assert_allclose(scores, local, atol=1e-5)
    with JudgeServer(judge, NAME, max_batch_size=8, max_wait_ms=200, max_logprobs=VOCAB,
                     batching="same_shape") as batched:
        client = JudgeClient(batched.url, NAME, concurrency=12, retries=0, top_logprobs=VOCAB)
        scores = client.score(triples)
        assert batched.batcher.requests == 12
        assert batched.batcher.forward_passes < 12, "concurrent requests were not batched"
        assert batched.batcher.max_batch > 1
    np.testing.assert_allclose(scores, local, atol=1e-5)
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_protocol_endpoints_and_errors(server):
    _, url = server
    client = JudgeClient(url, NAME, retries=0)
    assert client.served_models() == [NAME]
    client.check_model()
    health = client.health()
    assert health["status"] == "ok" and health["batching"] == "single" and health["max_model_len"] == 4096
    with pytest.raises(JudgeError, match="serves"):
        JudgeClient(url, "other-name", retries=0).check_model()
    a, b = images(2)
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
    assert status == 400 and "image 1" in obj["error"]["message"]
    one_image = json.loads(json.dumps(body))
    del one_image["messages"][0]["content"][1]
    assert _post(f"{url}/chat/completions", one_image)[0] == 400
    # a client error is not retried and names the URL, the served model name and the status
    with pytest.raises(JudgeError, match=r"chat/completions at .* \(served model 'nope'\) failed \(HTTP status 404, "
                       r"not retried\): The model `nope` does not exist"):
        JudgeClient(url, "nope", retries=3).score([(a, b, "same?")])


def test_unreachable_judge_fails_after_bounded_retries(dead_url):
    url = dead_url
    client = JudgeClient(url, NAME, retries=2, timeout_s=2)
    a, b = images(2)
    with pytest.raises(JudgeError) as err:
        client.score([(a, b, "same?")])
    msg = str(err.value)
    assert url in msg and NAME in msg and "no HTTP response" in msg and "3 attempt(s)" in msg


def test_local_server_process_lifecycle(tiny_model_dirs, tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    monkeypatch.setenv("OMP_DYNAMIC", "true")  # a user's setting must not reach the server's torch
    monkeypatch.setenv("PACO_JUDGE_API_KEY", "a-key-for-another-judge")  # nor a key for another server
    server = LocalServer(tiny_model_dirs["judge_base"], NAME, log_path=log, threads=1, max_logprobs=VOCAB)
    with pytest.raises(RuntimeError, match="not started"):
        server.wait_ready()
    # start() returns while the server loads (a stage does its own start-up meanwhile) and
    # wait_ready() waits for it, once (`with` is the two together); __exit__ stops it
    server.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
        url = server.wait_ready()
        assert server.wait_ready() == url
        environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{server.proc.pid}/environ").read_text().split("\0") if "=" in kv)
        assert environ["OMP_DYNAMIC"] == "false" and environ["MKL_DYNAMIC"] == "false"
        client = JudgeClient(url, NAME, retries=0, top_logprobs=VOCAB)
        a, b = images(2)
        assert 0.0 <= client.score([(a, b, judge_instruction(None))])[0] <= 1.0
        assert client.health()["forward_passes"] == 1
    finally:
        server.__exit__(None, None, None)
    with pytest.raises(JudgeError):
        JudgeClient(url, NAME, retries=0, timeout_s=2).health()
    assert "serving" in log.read_text()


def test_local_server_that_cannot_start_reports_its_log(tmp_path):
    with pytest.raises(ServedModelError, match="exited with code") as err:
        with LocalServer(tmp_path / "no-such-model", NAME, startup_timeout_s=60):
            pass
    assert "no-such-model" in str(err.value)


@pytest.mark.parametrize("batching", ["auto", "same_shape", "dynamic"])
def test_one_bad_input_fails_only_its_own_request(judge, batching):
    """The request the processor refuses (aspect ratio > 200) gets a non-retryable 400, the
    others their scores: refused at its own encoding (auto = single, same_shape), or by
    rescoring the failed padded batch one request at a time (dynamic)."""
    with JudgeServer(judge, NAME, max_batch_size=8, max_wait_ms=200, max_logprobs=VOCAB, batching=batching) as srv:
        _check_one_bad_input(srv, srv.url, judge, batching)


def _check_one_bad_input(srv, url, judge, batching):
    a, b = images(2)
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
    assert "aspect ratio" in results[1][1]["error"]["message"]
    assert srv.batcher.refused == 1
    if batching == "dynamic":
        assert srv.batcher.isolated_batches >= 1, "no failing batch was isolated (the requests were not batched)"
    elif batching == "same_shape":
        assert srv.batcher.isolated_batches == 0 and srv.batcher.max_batch >= 2
    else:
        assert srv.batcher.isolated_batches == 0 and srv.batcher.max_batch == 1
    good = [yes_probability(r[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) for i, r in
            enumerate(results) if i != 1]
    np.testing.assert_allclose(good, judge.score([(a, b, "same?"), (b, b, "same?"), (a, b, "same?")]), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the server as hostile or careless clients meet it
# ---------------------------------------------------------------------------------------------


def _raw(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    """Send raw bytes on a new connection; return everything the server answers until it closes
    the connection or a complete response with its body has arrived."""
    import socket as _socket

    with _socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except _socket.timeout:
                break
            if not chunk:
                break
            out += chunk
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep:
                length = [int(v) for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:] if b":" in ln)
                          if k.strip().lower() == b"content-length"]
                if length and len(body) >= length[0]:
                    break
        return out


def test_official_client_and_raw_http_give_the_same_score(server, judge):
    """The served score through the official openai client (JudgeClient) equals the one read
    from a raw HTTP/1.1 request, and the in-process judge's within float tolerance."""
    srv, url = server
    a, b = images(2, seed=5)
    text = judge_instruction("two cats")
    body = json.dumps(request_body(a, b, text, VOCAB)).encode()
    reply = _raw(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\nConnection: close\r\n\r\n" + body)
    assert reply.startswith(b"HTTP/1.1 200")
    top = json.loads(reply.partition(b"\r\n\r\n")[2])["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    official = JudgeClient(url, NAME, retries=0, top_logprobs=VOCAB).score([(a, b, text)])[0]
    assert yes_probability(top) == official
    assert official == pytest.approx(judge.score([(a, b, text)])[0], abs=1e-5)


def test_many_concurrent_connections_are_all_answered(server):
    """200 connections at once (the old server's listen backlog of 5 reset about half)."""
    from concurrent.futures import ThreadPoolExecutor

    srv, _ = server
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    with ThreadPoolExecutor(max_workers=200) as pool:
        replies = list(pool.map(lambda _: _raw(srv.port, request), range(200)))
    assert sum(r.startswith(b"HTTP/1.1 200") for r in replies) == 200


def test_body_limits_are_answered_before_reading(judge):
    """An oversized declared body is refused at once (the old server blocked its thread
    forever on a 10 GB Content-Length); a malformed one gets the HTTP parser's 400; a body that
    stops arriving is a 408 after the read timeout; the server keeps serving."""
    limits = ServerLimits(max_body_bytes=1 << 20, read_timeout_s=1.0)
    with JudgeServer(judge, NAME, limits=limits) as srv:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        t0 = time.perf_counter()
        reply = _raw(srv.port, head + b"Content-Length: 10737418240\r\n\r\n{")
        assert reply.startswith(b"HTTP/1.1 400") and b"exceeds the limit of 1048576 bytes" in reply
        assert time.perf_counter() - t0 < 5
        assert _raw(srv.port, head + b"Content-Length: -5\r\n\r\n{}").startswith(b"HTTP/1.1 400")
        t0 = time.perf_counter()
        reply = _raw(srv.port, head + b"Content-Length: 1000\r\n\r\n{\"model\": ")
        assert reply.startswith(b"HTTP/1.1 408") and b"not received within 1 s" in reply
        assert time.perf_counter() - t0 < 10
        # chunked, no Content-Length: counted as it arrives
        chunk = b"x" * 600_000
        body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(2)) + b"0\r\n\r\n"
        reply = _raw(srv.port, head + b"Transfer-Encoding: chunked\r\n\r\n" + body)
        assert reply.startswith(b"HTTP/1.1 400") and b"exceeds the limit" in reply
        a, b = images(2)
        assert _post(f"{srv.url}/chat/completions", request_body(a, b))[0] == 200


def _bomb_png(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width x height`` pixels (a decompression bomb's header)."""
    import io
    import struct
    import zlib

    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4: ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr: ihdr + 17])) & 0xFFFFFFFF
    data[ihdr + 17: ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def test_decompression_bomb_and_huge_text_are_refused_before_any_compute(judge):
    limits = ServerLimits(max_image_pixels=1 << 20)
    with JudgeServer(judge, NAME, limits=limits) as srv:
        a, b = images(2)
        body = request_body(a, b)
        bomb = json.loads(json.dumps(body))
        bomb["messages"][0]["content"][1]["image_url"]["url"] = (
            "data:image/png;base64," + base64.b64encode(_bomb_png(50_000, 50_000)).decode())
        status, obj = _post(f"{srv.url}/chat/completions", bomb)
        assert status == 400 and "image 2" in obj["error"]["message"] and "pixels" in obj["error"]["message"]
        # 1 MB of instruction for a 4,096-position judge: refused at once, the worker never sees it
        t0 = time.perf_counter()
        status, obj = _post(f"{srv.url}/chat/completions", request_body(a, b, "same? " * 170_000))
        assert status == 400 and obj["error"]["message"].startswith("This model's maximum context length is 4096")
        assert time.perf_counter() - t0 < 5
        assert srv.batcher.forward_passes == 0 and srv.batcher.requests == 0
        status, health = _get(srv.url.removesuffix("/v1") + "/health")
        assert status == 200 and health["status"] == "ok"
        assert _post(f"{srv.url}/chat/completions", body)[0] == 200


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class _Gated:
    """The judge, whose forward passes wait for ``gate`` (a model stuck on a request)."""

    def __init__(self, judge):
        self.judge = judge
        self.processor = judge.processor
        self.device = judge.device
        self.max_model_len = judge.max_model_len
        self.encode = judge.encode
        self.gate = threading.Event()

    def logits(self, inputs):
        assert self.gate.wait(60)
        return self.judge.logits(inputs)


def test_overload_and_a_stalled_worker_are_reported(judge):
    """In-flight work is bounded (503 above it, and the official client names the URL, the
    served model and the status after its retries), and /health reports a forward pass that
    runs too long as 'stalled' (503) instead of 'ok'."""
    gated = _Gated(judge)
    limits = ServerLimits(max_in_flight=2, stall_s=0.3)
    with JudgeServer(gated, NAME, limits=limits, max_wait_ms=0) as srv:
        a, b = images(2)
        results: list = []
        waiting = [threading.Thread(target=lambda: results.append(_post(f"{srv.url}/chat/completions",
                                                                        request_body(a, b)))) for _ in range(2)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 30
        while srv.batcher.busy_since is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        status, health = _get(srv.url.removesuffix("/v1") + "/health")
        assert status == 503 and health["status"] == "stalled" and health["busy_s"] > 0.3
        status, obj = _post(f"{srv.url}/chat/completions", request_body(a, b))
        assert status == 503 and "overloaded" in obj["error"]["message"]
        with pytest.raises(JudgeError) as err:
            JudgeClient(srv.url, NAME, retries=1, timeout_s=5).score([(a, b, "same?")])
        msg = str(err.value)
        assert srv.url in msg and NAME in msg and "HTTP status 503" in msg and "2 attempt(s)" in msg
        gated.gate.set()
        for t in waiting:
            t.join(60)
        assert [r[0] for r in results] == [200, 200]
        status, health = _get(srv.url.removesuffix("/v1") + "/health")
        assert status == 200 and health["status"] == "ok" and health["rejected"] >= 3


def test_local_server_exits_when_its_parent_is_killed(tiny_model_dirs, tmp_path):
    """A trainer killed with SIGKILL leaves no judge server behind (--parent-pid)."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from paco.serving.local import LocalServer\n"
        f"srv = LocalServer({str(tiny_model_dirs['judge_base'])!r}, 'x', threads=1)\n"
        "srv.__enter__()\n"
        "print(srv.proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        os.kill(server_pid, 0)  # running
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{server_pid}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        break  # exited; a zombie only waits for init to reap it
            except FileNotFoundError:
                break
            time.sleep(0.2)
        else:
            os.kill(server_pid, signal.SIGKILL)
            pytest.fail("the judge server outlived its killed parent by 30 s")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_request_whose_client_gave_up_is_not_computed(judge):
    """A client that times out (and would retry) disconnects; its queued request is dropped,
    not computed after the request ahead of it (the reviewer's reproduction: 3 copies computed)."""
    gated = _Gated(judge)
    with JudgeServer(gated, NAME, max_wait_ms=0) as srv:
        a, b = images(2)
        first: list = []
        ahead = threading.Thread(target=lambda: first.append(_post(f"{srv.url}/chat/completions", request_body(a, b))))
        ahead.start()
        deadline = time.monotonic() + 30
        while srv.batcher.busy_since is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(JudgeError, match="timed out"):
            JudgeClient(srv.url, NAME, retries=0, timeout_s=1).score([(b, a, "same?")])
        time.sleep(1.0)  # the server notices the disconnect within 0.25 s
        gated.gate.set()
        ahead.join(60)
        assert first[0][0] == 200
        status, health = _get(srv.url.removesuffix("/v1") + "/health")
        assert health["abandoned"] == 1 and health["requests"] == 2 and health["forward_passes"] == 1


def test_a_reply_that_is_not_json_is_a_named_judge_error():
    from fake_openai import FakeOpenAIServer

    with FakeOpenAIServer(lambda body, n: (200, '{"choices": [trunc', 0)) as srv:
        a, b = images(2)
        with pytest.raises(JudgeError, match=r"malformed reply from .*served model 'paco-reward-test'"):
            JudgeClient(srv.base_url, NAME, retries=0).score([(a, b, "x")])


def test_a_server_started_by_hand_runs_the_fixed_cpu_paths(tiny_model_dirs, tmp_path):
    """`python -m paco.serving.server` started without the code-path variables (as a user would, not
    through LocalServer) loads numpy before its main can set them, so it runs itself again
    with them set: the listening process (same pid after the exec) has them in its environment."""
    import os
    import subprocess
    import sys

    from paco.core.numerics import FIXED_CPU_ISA_ENV, cpu_has_avx2, cpu_isa_env

    if not cpu_has_avx2():
        pytest.skip("not an x86-64 CPU with AVX2: the CPU paths are left to the libraries")
    env = {k: v for k, v in os.environ.items() if k not in FIXED_CPU_ISA_ENV}
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "paco.serving.server", "--model", str(tiny_model_dirs["judge_base"]),
                             "--served-model-name", NAME, "--port", "0", "--port-file", str(port_file)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_file.exists(), f"the server did not start (exit code {proc.poll()})"
        environ = dict(line.split("=", 1) for line in
                       Path(f"/proc/{proc.pid}/environ").read_bytes().decode().split("\0") if "=" in line)
        assert {k: environ.get(k) for k in FIXED_CPU_ISA_ENV} == cpu_isa_env()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
