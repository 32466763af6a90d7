"""The judge server as an untrusted network meets it (GitHub issue 29): weights that do not
match are never served, ``--api-key``, the Host and Content-Type checks, only the image formats
a data URL declares, the bounds on content parts and pixels per request checked before any
work, and the process's signals and start-up errors. Only 127.0.0.1 is used."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from paco.judge.chat import png_bytes
from paco.serving.client import ServedModelError
from paco.serving.judge_client import JudgeClient, JudgeError
from paco.serving.local import LocalServer
from paco.judge.model import Judge
from paco.serving.server.app import JudgeServer
from paco.serving.server.limits import ServerLimits

from judge_server_helpers import NAME, images, request_body

REPO = Path(__file__).resolve().parents[1]
VOCAB = 100_000  # the untrained tiny judge need not rank Yes/No among its top 20 first tokens


@pytest.fixture(scope="module")
def judge(tiny_model_dirs) -> Judge:
    return Judge.from_pretrained(tiny_model_dirs["judge_base"])


def _http(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post_json(url: str, body: dict, **headers: str) -> tuple[int, dict]:
    return _http(f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **headers})


def _raw(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


# ---------------------------------------------------------------------------------------------
# case 1: a checkpoint whose tensors do not match the model is refused, by name
# ---------------------------------------------------------------------------------------------


def _judge_without(src: Path, dst: Path, drop: int = 1, extra: bool = False) -> list[str]:
    """Copy the judge at ``src`` to ``dst`` without its first ``drop`` MLP tensors (and with an
    extra tensor); the names dropped."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    gone = sorted(k for k in weights if ".mlp." in k)[:drop]
    for k in gone:
        del weights[k]
    if extra:
        weights["model.not_a_layer.weight"] = torch.zeros(3)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return gone


def test_a_judge_with_missing_tensors_is_never_served(tiny_model_dirs, tmp_path):
    """The tester's checkpoint: one tensor missing. The old server random-initialised it, said
    'ok' on /health and answered ordinary-looking scores; now the server exits naming it."""
    gone = _judge_without(tiny_model_dirs["judge_base"], tmp_path / "judge", extra=True)
    log = tmp_path / "server.log"
    with pytest.raises(ServedModelError, match="exited with code") as err:
        with LocalServer(tmp_path / "judge", NAME, threads=1, log_path=log, startup_timeout_s=120):
            pass
    msg = str(err.value)
    assert gone[0].split("model.", 1)[1] in msg and "not_a_layer" in msg and "missing" in msg
    assert "Traceback" not in log.read_text()


# ---------------------------------------------------------------------------------------------
# case 2: --api-key, Host and Content-Type
# ---------------------------------------------------------------------------------------------


def test_api_key_is_required_on_the_v1_routes(judge):
    with JudgeServer(judge, NAME, api_key="s3cret-key", max_logprobs=VOCAB) as srv:
        root = srv.url.removesuffix("/v1")
        assert _http(f"{root}/health")[0] == 200  # open, as vLLM's
        status, obj = _http(f"{srv.url}/models")
        assert status == 401 and obj["error"]["message"].startswith("Unauthorized")
        assert _http(f"{srv.url}/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert _http(f"{srv.url}/models", headers={"Authorization": "s3cret-key"})[0] == 401
        assert _http(f"{srv.url}/models", headers={"Authorization": "Bearer s3cret-key"})[0] == 200
        a, b = images(2)
        assert _post_json(srv.url, request_body(a, b))[0] == 401
        assert srv.batcher.requests == 0
        assert _post_json(srv.url, request_body(a, b), Authorization="Bearer s3cret-key")[0] == 200
        client = JudgeClient(srv.url, NAME, retries=0, api_key="s3cret-key", top_logprobs=VOCAB)
        assert 0.0 <= client.score([(a, b, "same?")])[0] <= 1
        with pytest.raises(JudgeError, match="HTTP status 401"):
            JudgeClient(srv.url, NAME, retries=0).score([(a, b, "same?")])


def test_only_json_posts_are_accepted(judge):
    """A browser's cross-site form POST (text/plain, form-urlencoded, multipart: no preflight)
    is refused before the body is read."""
    with JudgeServer(judge, NAME) as srv:
        a, b = images(2)
        body = json.dumps(request_body(a, b)).encode()
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            status, obj = _http(f"{srv.url}/chat/completions", body, {"Content-Type": ctype} if ctype else {})
            assert status == 415 and "application/json" in obj["error"]["message"], ctype
        assert srv.batcher.requests == 0
        assert _http(f"{srv.url}/chat/completions", body, {"Content-Type": "application/json; charset=utf-8"})[0] == 200


def test_a_loopback_server_answers_only_loopback_host_names(judge):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends
    ``Host: evil.example``; refused on every route. Loopback names are served."""
    with JudgeServer(judge, NAME) as srv:
        def get(host: bytes) -> bytes:
            return _raw(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")

        for bad in (b"evil.example", b"evil.example:%d" % srv.port, b"127.0.0.1.evil.example", b"10.0.0.1"):
            reply = get(bad)
            assert reply.startswith(b"HTTP/1.1 421") and b"Host" in reply, bad
        for good in (b"127.0.0.1:%d" % srv.port, b"localhost:%d" % srv.port, b"localhost", b"127.0.0.1"):
            assert get(good).startswith(b"HTTP/1.1 200"), good
        health = _raw(srv.port, b"GET /health HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 421")


def _cli(args: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paco.serving.server", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def test_a_non_loopback_host_without_a_key_is_refused(tmp_path):
    """Listening beyond this machine without --api-key / PACO_JUDGE_API_KEY is refused before
    the model is loaded (unless --allow-unauthenticated says so); the key's variable is named
    in --help, its value never printed."""
    env = {k: v for k, v in os.environ.items() if k != "PACO_JUDGE_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "paco.serving.server", "--model", str(tmp_path / "no-model"),
                           "--served-model-name", NAME, "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "--api-key" in proc.stderr and "PACO_JUDGE_API_KEY" in proc.stderr and "no-model" not in proc.stderr
    # with the key in the environment the host is allowed: it fails later, at the model
    proc = _cli(["--model", str(tmp_path / "no-model"), "--served-model-name", NAME, "--host", "0.0.0.0",
                 "--port", "0"], env={"PACO_JUDGE_API_KEY": "k3y-value"})
    assert proc.returncode == 1 and "no-model" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = _cli(["--help"], env={"PACO_JUDGE_API_KEY": "k3y-value"})
    assert proc.returncode == 0 and "PACO_JUDGE_API_KEY" in proc.stdout and "k3y-value" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# case 3: only PNG, JPEG, WebP and GIF, and only the format the data URL declares
# ---------------------------------------------------------------------------------------------


def _encoded(fmt: str, size: tuple[int, int] = (32, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 40, 90)).save(buf, format=fmt)
    return buf.getvalue()


def _with_image(body: dict, url: str, index: int = 0) -> dict:
    out = json.loads(json.dumps(body))
    out["messages"][0]["content"][index]["image_url"]["url"] = url
    return out


def test_only_the_declared_served_image_formats_are_decoded(judge, monkeypatch):
    from PIL import EpsImagePlugin

    opened: list[str] = []
    real_open = EpsImagePlugin.EpsImageFile._open

    def spy(self):
        opened.append("EPS")
        return real_open(self)

    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", spy)
    with JudgeServer(judge, NAME) as srv:
        a, b = images(2)
        body = request_body(a, b)
        for fmt in ("TGA", "PCX", "JPEG2000", "EPS", "BMP", "TIFF"):
            url = "data:image/png;base64," + base64.b64encode(_encoded(fmt)).decode()
            status, obj = _post_json(srv.url, _with_image(body, url))
            msg = obj["error"]["message"]
            assert status == 400 and "image 1" in msg and "not a PNG image" in msg, (fmt, msg)
            assert " at 0x" not in msg and "BytesIO" not in msg, msg
        # a served format under another name: the declared one decides
        url = "data:image/jpeg;base64," + base64.b64encode(png_bytes(a)).decode()
        status, obj = _post_json(srv.url, _with_image(body, url))
        assert status == 400 and "not a JPEG image" in obj["error"]["message"]
        for mime in ("image/x-tga", "image/tiff", "image/svg+xml"):
            url = f"data:{mime};base64," + base64.b64encode(_encoded("TGA")).decode()
            status, obj = _post_json(srv.url, _with_image(body, url, 1))
            assert status == 400 and "image 2" in obj["error"]["message"] and "image/png" in obj["error"]["message"]
        assert opened == [], "Pillow's EPS plugin (Ghostscript) was reached from the network"
        for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif"),
                          ("JPEG", "IMAGE/JPG")):
            url = f"data:{mime};base64," + base64.b64encode(_encoded(fmt)).decode()
            assert _post_json(srv.url, _with_image(body, url))[0] == 200, fmt
        assert srv.batcher.requests == 5


def test_a_broken_image_is_named_without_a_memory_address(judge):
    with JudgeServer(judge, NAME) as srv:
        a, b = images(2)
        for payload in (b"not an image at all", png_bytes(a)[:60]):
            url = "data:image/png;base64," + base64.b64encode(payload).decode()
            status, obj = _post_json(srv.url, _with_image(request_body(a, b), url, 1))
            msg = obj["error"]["message"]
            assert status == 400 and msg.startswith("image 2: ") and " at 0x" not in msg and "object" not in msg, msg
        # image 1 was decoded (and cached) before image 2 failed: still whole for the next request
        assert _post_json(srv.url, request_body(a, b))[0] == 200


# ---------------------------------------------------------------------------------------------
# case 4: content parts and pixels per request, bounded before any work
# ---------------------------------------------------------------------------------------------


class _SchemaSpy:
    """Stands in for the request schema: records that a body reached validation."""

    calls = 0

    @classmethod
    def model_validate_json(cls, *args, **kwargs):
        cls.calls += 1
        raise AssertionError("the body reached the schema")

    model_validate = model_validate_json


def test_many_content_parts_are_refused_before_the_body_is_parsed(judge, monkeypatch):
    """The tester's 700,000 text parts (18 MB): refused before pydantic builds anything."""
    from paco.serving.server import protocol

    monkeypatch.setattr(protocol, "ChatCompletionRequest", _SchemaSpy)
    limits = ServerLimits(max_content_parts=6)
    with JudgeServer(judge, NAME, limits=limits) as srv:
        parts = [{"type": "text", "text": "a"}] * 700_000
        status, obj = _post_json(srv.url, {"model": NAME, "messages": [{"role": "user", "content": parts}]})
        assert status == 400 and "--max-content-parts 6" in obj["error"]["message"], obj
        seven = [{"type": "text", "text": "a"}] * 7
        status, obj = _post_json(srv.url, {"model": NAME, "messages": [{"role": "user", "content": seven}]})
        assert status == 400 and "more than 6 content parts" in obj["error"]["message"]
        # and the same bulk anywhere else in the body (fields the schema ignores)
        for junk in ([[]] * 200_000, [0.5] * 200_000, [{}] * 200_000, "[" * 100 + "]" * 100):
            body = {"model": NAME, "messages": [], "stop": "JUNK"}
            data = json.dumps(body).replace('"JUNK"', junk if isinstance(junk, str) else json.dumps(junk)).encode()
            status, obj = _http(f"{srv.url}/chat/completions", data, {"Content-Type": "application/json"})
            msg = obj["error"]["message"]
            assert status == 400 and ("--max-json-values" in msg or "nested deeper" in msg), msg
    assert _SchemaSpy.calls == 0
    assert limits.max_content_parts == 6 and ServerLimits().max_content_parts >= 3


def test_pixels_per_request_are_bounded_from_the_headers(judge, monkeypatch):
    """The tester's two 4096x4096 solid PNGs (156 KB): refused by the default bound on the
    request's pixels, read from both headers, before either image is decoded."""
    from PIL import ImageFile

    loads: list[int] = []
    real_load = ImageFile.ImageFile.load

    def spy(self):
        loads.append(self.size[0] * self.size[1])
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    with JudgeServer(judge, NAME) as srv:
        big = Image.new("RGB", (4096, 4096), (10, 20, 30))
        status, obj = _post_json(srv.url, request_body(big, big))
        msg = obj["error"]["message"]
        assert status == 400 and "33554432 pixels" in msg and "--max-request-pixels" in msg, msg
        assert loads == [] and srv.batcher.requests == 0
    limits = ServerLimits(max_request_pixels=64 * 64 + 32 * 32)
    with JudgeServer(judge, NAME, limits=limits) as srv:
        a, b = images(2)
        assert _post_json(srv.url, request_body(a, b))[0] == 400
        small = images(1, size=(32, 32))[0]
        assert _post_json(srv.url, request_body(a, small))[0] == 200


def test_the_new_limits_are_server_flags():
    from paco.serving.server.cli import argument_parser

    args = argument_parser().parse_args(["--model", "m", "--served-model-name", "n", "--max-content-parts", "5",
                                         "--max-request-pixels", "1000", "--max-json-values", "300"])
    assert (args.max_content_parts, args.max_request_pixels, args.max_json_values) == (5, 1000, 300)


# ---------------------------------------------------------------------------------------------
# case 5: signals, a taken port, unreadable weights
# ---------------------------------------------------------------------------------------------


def _start(model: Path, tmp_path: Path, env: dict | None = None) -> tuple[subprocess.Popen, int, Path]:
    port_file, log = tmp_path / "port", tmp_path / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "paco.serving.server", "--model", str(model), "--served-model-name",
                                 NAME, "--port", "0", "--port-file", str(port_file), "--threads", "1"],
                                stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 120
    while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert port_file.exists(), log.read_text()
    return proc, int(port_file.read_text()), log


def test_sighup_shuts_down_gracefully_and_answers_the_request_in_flight(tiny_model_dirs, tmp_path):
    """SIGHUP used to kill the server at once, dropping the request being received; now it is
    SIGTERM's graceful shutdown: the request is answered, the log says why, exit code 0. The
    key comes from PACO_JUDGE_API_KEY."""
    proc, port, log = _start(tiny_model_dirs["judge_base"], tmp_path, {"PACO_JUDGE_API_KEY": "env-key"})
    try:
        url = f"http://127.0.0.1:{port}/v1"
        assert _http(f"{url}/models")[0] == 401
        assert _http(f"{url}/models", headers={"Authorization": "Bearer env-key"})[0] == 200
        a, b = images(2)
        body = json.dumps(request_body(a, b)).encode()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer env-key\r\nContent-Length: %d\r\n\r\n" % len(body))
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(head + body[:100])
            time.sleep(0.5)
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            s.sendall(body[100:])
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "SIGHUP" in text and "shutting down" in text and "Traceback" not in text, text


def test_sigint_is_a_clean_exit(tiny_model_dirs, tmp_path):
    proc, _, log = _start(tiny_model_dirs["judge_base"], tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "SIGINT" in text and "Traceback" not in text and "KeyboardInterrupt" not in text, text


def test_a_taken_port_is_reported_before_the_model_is_loaded(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = _cli(["--model", str(tmp_path / "no-model"), "--served-model-name", NAME, "--port", str(port)])
    assert proc.returncode == 1, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr and "--port" in proc.stderr
    assert "Traceback" not in proc.stderr and "no-model" not in proc.stderr  # before the model
    assert time.monotonic() - t0 < 120


def test_unreadable_weights_are_named_with_the_reason(tiny_model_dirs, tmp_path):
    """The weights file is a folder (EISDIR): the old message was 'No such device (os error
    19)', naming no file; now the file and the reason, from the server's command line too."""
    model = tmp_path / "judge"
    shutil.copytree(tiny_model_dirs["judge_base"], model)
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(model / "model-00001-of-00001.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}))
    (model / "model-00001-of-00001.safetensors").unlink()
    (model / "model-00001-of-00001.safetensors").mkdir()
    proc = _cli(["--model", str(model), "--served-model-name", NAME, "--port", "0"])
    assert proc.returncode == 1
    assert "model-00001-of-00001.safetensors" in proc.stderr and "Is a directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
