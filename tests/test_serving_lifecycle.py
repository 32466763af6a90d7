"""A server the stage started, over its lifetime (:mod:`paco.serving.local`, engine ``paco`` on the tiny
judge): killed while requests are in flight it is restarted on its port and every request is
answered with the score an uninterrupted server gives; past ``max_restarts`` the next death is an
error quoting its log; its files stay beside its log or in a run directory that is cleaned; and an
interpreter without vLLM is a named error before anything starts."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from paco.core.templates import judge_instruction
from paco.serving.client import ServedModelError
from paco.serving.judge_client import JudgeClient, JudgeError
from paco.serving.local import RUN_DIR_PREFIX, LocalServer, remove_stale_run_dirs
from paco.serving.vllm import VllmMissingError, check_vllm_python

from judge_server_helpers import NAME, images

VOCAB = 100_000


def _triples(n: int) -> list:
    pics = images(n + 1, seed=3)
    return [(pics[i], pics[i + 1], judge_instruction(None)) for i in range(n)]


def _kill_when(server: LocalServer, passes: int, timeout_s: float = 120.0) -> None:
    """SIGKILL the server once it has run ``passes`` forward passes (polled on /health)."""
    client = JudgeClient(server.url, NAME, retries=0, timeout_s=2.0)
    end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < end:
            try:
                if client.health()["forward_passes"] >= passes:
                    break
            except JudgeError:
                pass
            time.sleep(0.01)
    finally:
        client.close()
    os.kill(server.proc.pid, signal.SIGKILL)


def test_a_killed_server_is_restarted_and_answers_every_request_as_before(tiny_model_dirs, tmp_path):
    triples = _triples(24)
    log = tmp_path / "logs" / "judge_server.log"
    server = LocalServer(tiny_model_dirs["judge_base"], NAME, threads=1, max_logprobs=VOCAB, log_path=log,
                         max_restarts=1, error=JudgeError)
    with server as url:
        assert (tmp_path / "logs" / "judge_server.log.port").is_file()  # beside the log, not in /tmp
        client = JudgeClient(url, NAME, concurrency=4, retries=0, top_logprobs=VOCAB, supervisor=server)
        uninterrupted = client.score(triples)
        first_pid, port = server.proc.pid, server.port
        killer = threading.Thread(target=_kill_when, args=(server, 24 + 6))
        killer.start()
        interrupted = client.score(triples)  # retries=0: only the restart can save the requests in flight
        killer.join()
        assert interrupted == uninterrupted  # the same floats, bit for bit (batching auto: single)
        assert server.restarts == 1 and server.proc.pid != first_pid and server.port == port
        assert server.url == url
        # the bound: the next death is the stage's error, with the log's tail
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        with pytest.raises(JudgeError, match=r"exited with code -9 after 1 restart\(s\).*max_restarts 1") as err:
            client.score(triples[:2])
        assert "its log:" in str(err.value)
        client.close()
    text = log.read_text()
    assert "exited with code -9; restart 1 of 1" in text and text.count("serving") >= 2
    assert not (tmp_path / "logs" / "judge_server.log.port").exists()


def test_a_stopped_server_is_not_restarted(tiny_model_dirs):
    server = LocalServer(tiny_model_dirs["judge_base"], NAME, threads=1, max_logprobs=VOCAB)
    with server:
        generation = server.generation
        assert server.recover(generation) is False  # alive: the request's own retries go on
    assert server.recover(generation) is False and server.restarts == 0


def test_run_directories_of_dead_stages_are_removed(tmp_path, monkeypatch):
    dead = tmp_path / f"{RUN_DIR_PREFIX}{2 ** 22 + 12345}-abc"  # above the kernel's default pid_max
    alive = tmp_path / f"{RUN_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "paco-something-else"
    for d in (dead, alive, other):
        d.mkdir()
        (d / "port").write_text("1")
    assert remove_stale_run_dirs(tmp_path) == [dead]
    assert not dead.exists() and alive.is_dir() and other.is_dir()


def test_a_server_without_a_log_path_leaves_no_run_directory(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with LocalServer(tiny_model_dirs["judge_base"], NAME, threads=1, max_logprobs=VOCAB) as url:
        run_dirs = list(tmp_path.glob(RUN_DIR_PREFIX + "*"))
        assert len(run_dirs) == 1 and (run_dirs[0] / "port").is_file() and url.endswith("/v1")
    assert list(tmp_path.glob(RUN_DIR_PREFIX + "*")) == []


def test_an_interpreter_without_vllm_is_a_named_error_before_anything_starts(tmp_path):
    pytest.importorskip("torch")
    if __import__("importlib.util").util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vllm")
    with pytest.raises(VllmMissingError, match=r"has no vllm module .*scripts/vllm_env.sh"):
        check_vllm_python(sys.executable)
    with pytest.raises(VllmMissingError, match="cannot run"):
        check_vllm_python(str(tmp_path / "no-such-python"))
    server = LocalServer(tmp_path / "no-model-either", NAME, engine="vllm", python=sys.executable, device="cpu",
                         log_path=tmp_path / "vllm.log")
    with pytest.raises(ServedModelError, match="has no vllm module"):
        server.start()
    assert server.proc is None and not (tmp_path / "vllm.log").exists()


def test_the_processes_that_share_a_node_s_server_wait_for_its_restart(tiny_model_dirs, dead_url):
    """:class:`paco.serving.endpoint.HealthWait` (the supervisor of the ranks that did not start the
    server): a live server is no outage; a server its owner restarts on the same port is waited for;
    one that never answers is given up after ``timeout_s``."""
    from paco.serving.endpoint import HealthWait

    assert HealthWait(dead_url, NAME, timeout_s=2.0).recover(0) is False
    server = LocalServer(tiny_model_dirs["judge_base"], NAME, threads=1, max_logprobs=VOCAB, max_restarts=1)
    with server as url:
        wait = HealthWait(url, NAME, timeout_s=120.0)
        assert wait.recover(0) is False and wait.generation == 0
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        owner = threading.Thread(target=server.recover, args=(server.generation,))
        owner.start()  # the rank that started it restarts it, on its port
        assert wait.recover(0) is True and wait.generation == 1
        owner.join()
        assert server.restarts == 1 and server.url == url
        assert wait.recover(0) is True  # another thread of that outage: already over
