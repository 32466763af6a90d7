"""The judge client against misbehaving servers (issue 29, client part): a reply dripped byte by
byte ends at the request's deadline, invalid log-probs are errors and never scores, redirects are
refused (nothing is sent elsewhere), and retry messages count the attempts made. Every server is
a tiny fake on 127.0.0.1 (tests/fake_openai.py); nothing is computed."""

from __future__ import annotations

import json
import math
import time

import pytest
from fake_openai import DripServer, FakeOpenAIServer
from PIL import Image

from paco.serving.judge_client import JudgeClient, JudgeError

from paco.judge.model import AnswerLogprobsError, yes_probability

NAME = "judge-under-test"


def pair() -> tuple[Image.Image, Image.Image, str]:
    return Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue"), "same?"


def completion(top: list[tuple[str, object]]) -> str:
    """A chat completion whose first token's ``top_logprobs`` are ``top`` (JSON as Python's
    ``json.dumps`` writes it: ``Infinity`` and ``NaN`` included)."""
    entries = [{"token": t, "logprob": lp, "bytes": None} for t, lp in top]
    return json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": NAME, "choices": [
        {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Yes"},
         "logprobs": {"content": [{"token": "Yes", "logprob": -0.1, "bytes": None, "top_logprobs": entries}]}}]})


GOOD = completion([("Yes", -0.1), ("No", -2.4)])

# ---------------------------------------------------------------- 1. a total deadline per request

_HEADER_DRIP = (b"", b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 10_000)
_BODY_DRIP = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n", b" " * 100_000)


@pytest.mark.parametrize("prefix,drip", [_HEADER_DRIP, _BODY_DRIP], ids=["headers", "body"])
def test_a_dripping_reply_ends_at_the_request_deadline(prefix, drip):
    """One byte every 0.2 s never trips a 2 s read timeout; the request still ends at 2 s (the
    tester's server held the client 40 s and more)."""
    with DripServer(prefix, drip) as srv:
        client = JudgeClient(srv.base_url, NAME, timeout_s=2, retries=0)
        start = time.monotonic()
        with pytest.raises(JudgeError, match="timed out") as err:
            client.score([pair()])
        elapsed = time.monotonic() - start
        client.close()
    assert elapsed < 4.5, f"held {elapsed:.1f} s by a dripping server under timeout_s=2"
    msg = str(err.value)
    assert srv.base_url in msg and NAME in msg and "1 attempt(s)" in msg and "2 s" in msg


def test_each_retry_has_its_own_deadline_and_is_counted():
    with DripServer(*_BODY_DRIP) as srv:
        client = JudgeClient(srv.base_url, NAME, timeout_s=1.5, retries=1)
        start = time.monotonic()
        with pytest.raises(JudgeError, match="timed out") as err:
            client.score([pair()])
        elapsed = time.monotonic() - start
        client.close()
    assert elapsed < 6.0 and "2 attempt(s)" in str(err.value) and srv.connections == 2


@pytest.mark.parametrize("prefix,drip", [_HEADER_DRIP, _BODY_DRIP], ids=["headers", "body"])
def test_a_dripping_health_check_ends_at_its_deadline(prefix, drip):
    with DripServer(prefix, drip) as srv:
        client = JudgeClient(srv.base_url, NAME, timeout_s=1.5, retries=0)
        start = time.monotonic()
        with pytest.raises(JudgeError, match="health") as err:
            client.health()
        elapsed = time.monotonic() - start
        client.close()
    assert elapsed < 4.0, f"health() held {elapsed:.1f} s under a 1.5 s deadline"
    assert "1.5 s" in str(err.value)


# ---------------------------------------------------------------- 2. invalid log-probs


@pytest.mark.parametrize("top", [
    [("Yes", math.inf), ("No", -1.0)],
    [("Yes", -math.inf), ("No", -1.0)],
    [("Yes", math.nan), ("No", -1.0)],
    [("Yes", 5.0), ("No", 3.0)],
    [("Yes", 1e-6), ("No", -3.0)],
    [("Yes", True), ("No", -1.0)],
    [("Yes", False), ("No", -1.0)],
    [("Yes", "-0.5"), ("No", -1.0)],
    [("Yes", None), ("No", -1.0)],
    [(None, -0.5), ("No", -1.0)],
], ids=["+inf", "-inf", "nan", "above-zero", "tiny-positive", "true", "false", "string", "null", "token-null"])
def test_an_invalid_logprob_is_a_named_error_not_a_score(top):
    with FakeOpenAIServer(lambda body, n: (200, completion(top), 0)) as srv:
        client = JudgeClient(srv.base_url, NAME, retries=0)
        with pytest.raises(JudgeError) as err:
            client.score([pair()])
        client.close()
    msg = str(err.value)
    assert srv.base_url in msg and f"'{NAME}'" in msg and "logprob" in msg


def test_more_top_entries_than_asked_for_is_an_error():
    """20 asked for: 21 are accepted (the sampled token, which some servers add to the top 20),
    22 or 300k are not."""
    filler = [(f"t{i}", -9.0) for i in range(300_000)]
    replies = {21: completion([("Yes", -0.1), ("No", -2.4)] + filler[:19]),
               22: completion([("Yes", -0.1), ("No", -2.4)] + filler[:20]),
               300_002: completion([("Yes", -0.1), ("No", -2.4)] + filler)}
    order = [21, 22, 300_002]
    with FakeOpenAIServer(lambda body, n: (200, replies[order[n]], 0)) as srv:
        client = JudgeClient(srv.base_url, NAME, retries=0, top_logprobs=20)
        assert 0.0 < client.score([pair()])[0] < 1.0
        for n in (22, 300_002):
            with pytest.raises(JudgeError, match=rf"{n} top_logprobs .* 20 were asked for") as err:
                client.score([pair()])
            assert srv.base_url in str(err.value) and f"'{NAME}'" in str(err.value)
        client.close()


def test_yes_probability_refuses_what_is_not_a_log_probability():
    assert yes_probability([{"token": "Yes", "logprob": -0.0}, {"token": "No", "logprob": 0}]) == 0.5
    for bad in (True, 0.5, math.inf, -math.inf, math.nan, "-1", None):
        with pytest.raises(AnswerLogprobsError, match="invalid logprob"):
            yes_probability([{"token": "Yes", "logprob": bad}, {"token": "No", "logprob": -1.0}])


# ---------------------------------------------------------------- 3. redirects


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_nothing_goes_to_its_target(status):
    """The images and the prompt go to the configured URL only: a 307/308 would re-POST them
    elsewhere, a 301/302/303 would turn into a GET whose answer would be scored; health() and
    /models are not followed either."""
    with FakeOpenAIServer(lambda body, n: (200, GOOD, 0), get_script=lambda path, n: (200, GOOD, 0)) as other:
        target_root = other.base_url.removesuffix("/v1")
        moved = {"Location": f"{other.base_url}/chat/completions"}
        with FakeOpenAIServer(lambda body, n: (status, {"error": "moved"}, 0, moved),
                              get_script=lambda path, n: (status, "", 0, {"Location": target_root + path})) as srv:
            client = JudgeClient(srv.base_url, NAME, retries=3)
            with pytest.raises(JudgeError, match=rf"redirect.*{status}.*{other.base_url}/chat/completions") as err:
                client.score([pair()])
            assert srv.base_url in str(err.value) and f"'{NAME}'" in str(err.value)
            with pytest.raises(JudgeError, match=rf"redirect.*{status}.*{target_root}/health"):
                client.health()
            with pytest.raises(JudgeError, match=rf"redirect.*{status}.*{target_root}/v1/models"):
                client.served_models()
            client.close()
        assert len(srv.requests) == 1, "a redirect is not retried"
    assert other.requests == [] and other.gets == [], "the redirect was followed"


# ---------------------------------------------------------------- 4. attempts counted, Retry-After


def test_retry_after_is_honoured_within_the_timeout_and_ends_the_retries_beyond_it():
    # 429 with Retry-After: 100000 (more than timeout_s): one request, and the message says so
    far = lambda body, n: (429, {"error": {"message": "slow down"}}, 0, {"Retry-After": "100000"})  # noqa: E731
    with FakeOpenAIServer(far) as srv:
        client = JudgeClient(srv.base_url, NAME, retries=3, timeout_s=5)
        start = time.monotonic()
        with pytest.raises(JudgeError) as err:
            client.score([pair()])
        assert time.monotonic() - start < 3
        client.close()
    msg = str(err.value)
    assert len(srv.requests) == 1
    assert "HTTP status 429" in msg and "1 attempt(s)" in msg and "4 attempt" not in msg
    assert "Retry-After" in msg and "100000 s" in msg and "timeout_s" in msg
    # a short Retry-After is waited for, and every attempt made is counted
    near = lambda body, n: (503, {"error": {"message": "busy"}}, 0, {"Retry-After": "0.2"})  # noqa: E731
    with FakeOpenAIServer(near) as srv:
        client = JudgeClient(srv.base_url, NAME, retries=2, timeout_s=5)
        start = time.monotonic()
        with pytest.raises(JudgeError, match=r"HTTP status 503, after 3 attempt\(s\)"):
            client.score([pair()])
        assert time.monotonic() - start >= 0.4
        client.close()
    assert len(srv.requests) == 3
