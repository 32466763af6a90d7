"""The judge server a stage starts for itself (:mod:`paco.serving.local`), engine vLLM: the exact
command built from ``judge_endpoint.server`` (the reference's ``vllm_server/launch.sh`` flags), the
server's environment (its own GPUs, no inherited key), and the wiring from the params through
``paco.serving.endpoint`` to the process started. No vLLM is needed: a fake interpreter records
what it was started with and exits, and the start-up error quotes its log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from paco.core.io import ArtifactError
from paco.core.params import validate_params
from paco.core.params.base import read_params_yaml
from paco.serving.client import ServedModelError
from paco.serving.judge_client import JudgeError
from paco.serving.local import LocalServer, server_env, vllm_command

ROOT = Path(__file__).resolve().parents[1]
PAPER_SERVER = {"engine": "vllm", "gpus": 1, "dtype": "bfloat16", "max_model_len": 8192,
                "gpu_memory_utilization": 0.85, "max_logprobs": 20, "startup_timeout_s": 900}


def _raw(**server) -> dict:
    """The committed params with ``judge_endpoint.server`` = the paper's updated by ``server``, and
    resources that fit it (8 GPUs per grpo job, 1 process per final_samples job)."""
    raw = read_params_yaml(ROOT / "params.yaml")
    raw["judge_endpoint"]["server"].update({**PAPER_SERVER, **server})
    n = raw["judge_endpoint"]["server"]["gpus"]
    for section, res in (("grpo", {"gpus": 8, "processes": 8 - n}), ("final_samples", {"gpus": n + 1, "processes": 1}),
                         ("benchmark", {"gpus": max(n, 1)})):  # the benchmark serves its evaluators with vLLM too
        for item in raw[section].values():
            item["resources"].update(res)
    return raw


def _server_params(**server):
    return validate_params(_raw(**server)).judge_endpoint


def test_vllm_command_is_launch_sh_from_params():
    """The paper preset's server keys give launch.sh's flags (l.138-146: --gpu-memory-utilization
    0.85, --max-model-len 8192, tensor parallel over the judge's GPUs), on loopback, in this order."""
    s = _server_params().server
    cmd = vllm_command("data/reward_merge/model", "paco-reward", 8123, python=s.python, dtype=s.dtype,
                       max_model_len=s.max_model_len, max_logprobs=s.max_logprobs,
                       gpu_memory_utilization=s.gpu_memory_utilization, tensor_parallel_size=s.gpus,
                       extra_args=s.extra_args)
    assert cmd == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "data/reward_merge/model",
                   "--served-model-name", "paco-reward", "--host", "127.0.0.1", "--port", "8123",
                   "--dtype", "bfloat16", "--max-logprobs", "20", "--seed", "0",
                   "--mm-processor-kwargs", '{"use_fast": false}', "--no-mm-device-do-normalize",
                   "--limit-mm-per-prompt", '{"video": 0}',
                   "--gpu-memory-utilization", "0.85", "--tensor-parallel-size", "1", "--max-model-len", "8192"]


def test_vllm_command_python_extra_args_and_no_max_model_len():
    s = _server_params(python="/opt/vllm/bin/python", extra_args=["--enable-prefix-caching"],
                       max_model_len=None, gpus=2, dtype="auto").server
    cmd = vllm_command(Path("m"), "j", 9000, python=s.python, dtype=s.dtype, max_model_len=s.max_model_len,
                       max_logprobs=s.max_logprobs, gpu_memory_utilization=s.gpu_memory_utilization,
                       tensor_parallel_size=s.gpus, extra_args=s.extra_args)
    assert cmd[0] == "/opt/vllm/bin/python"
    assert "--max-model-len" not in cmd
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd[cmd.index("--dtype") + 1] == "auto"
    assert cmd[-1] == "--enable-prefix-caching"
    for bad in ({"port": 0}, {"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5},
                {"tensor_parallel_size": 0}):
        kwargs = {"port": 9000, **bad}
        port = kwargs.pop("port")
        with pytest.raises(ValueError):
            vllm_command("m", "j", port, **kwargs)


def test_server_env_gives_the_judge_its_gpus_and_no_key():
    base = {"CUDA_VISIBLE_DEVICES": "5,6,7", "PACO_JUDGE_API_KEY": "secret", "PATH": "/bin",
            "OMP_DYNAMIC": "true"}
    env = server_env(base, "4")
    assert env["CUDA_VISIBLE_DEVICES"] == "4" and "PACO_JUDGE_API_KEY" not in env
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_DYNAMIC"] == "false" and env["PATH"] == "/bin"
    assert base["CUDA_VISIBLE_DEVICES"] == "5,6,7" and "PACO_JUDGE_API_KEY" in base  # a copy
    assert server_env(base, None)["CUDA_VISIBLE_DEVICES"] == "5,6,7"  # no devices given: the caller's
    assert server_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"


def test_server_env_drops_the_stages_launch_variables():
    """The judge server, started by the stage's rank-0 process under torchrun / accelerate, gets
    none of their rank, world and rendezvous variables (vLLM's workers would read them and join the
    stage's process group); other variables, ``PACO_*`` and ``NCCL_*`` included, are kept."""
    launch = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "7", "LOCAL_WORLD_SIZE": "7", "GROUP_RANK": "0",
              "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "7", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "n01",
              "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
              "TORCHELASTIC_USE_AGENT_STORE": "True", "ACCELERATE_MIXED_PRECISION": "bf16",
              "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    kept = {"PATH": "/bin", "PACO_JUDGE_DEVICES": "0", "NCCL_DEBUG": "WARN", "HF_HUB_OFFLINE": "1",
            "MY_RANK": "3", "RANKING": "x"}
    env = server_env({**launch, **kept}, "0")
    assert not set(launch) & set(env)
    assert {k: env[k] for k in kept} == kept


def test_server_params_are_checked_by_name():
    from paco.core.params import ParamsError

    cases = {
        "judge_endpoint.server.gpus is 0 with engine vllm": _raw(gpus=0),
        "judge_endpoint.server.batching": _raw(batching="single"),
        "extra_args repeat ['--port', '--tensor-parallel-size']": _raw(extra_args=["--port=1", "--tensor_parallel_size",
                                                                                   "2"]),
        "judge_endpoint.server.dtype auto": _raw(engine="paco", dtype="auto"),
        "python / kv_cache_gib / extra_args are for engine vllm": _raw(engine="paco", python="/x/python"),
    }
    for message, raw in cases.items():
        with pytest.raises(ParamsError, match=message.replace("[", r"\[").replace("]", r"\]")):
            validate_params(raw)
    # an external server: no GPUs needed
    raw = _raw(gpus=0)
    raw["judge_endpoint"]["url"] = "http://h:8000/v1"
    assert validate_params(raw)


FAKE_VLLM = """#!/bin/sh
# the vLLM look-up (paco.serving.vllm.check_vllm_python) finds one
[ "$1" = "-c" ] && exit 0
echo "argv: $*"
echo "devices: $CUDA_VISIBLE_DEVICES"
echo "key: ${PACO_JUDGE_API_KEY:-none}"
exit 3
"""


def _fake_python(tmp_path: Path) -> Path:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_VLLM)
    fake.chmod(0o755)
    return fake


def test_a_vllm_server_runs_the_command_on_its_devices(tmp_path, monkeypatch):
    """LocalServer(engine="vllm") runs :func:`vllm_command` with ``python`` on
    ``visible_devices`` (tensor parallel over them), and a server that exits is a JudgeError quoting
    its log."""
    monkeypatch.setenv("PACO_JUDGE_API_KEY", "secret")
    server = LocalServer(tmp_path / "judge", "paco-reward", engine="vllm", python=str(_fake_python(tmp_path)),
                              visible_devices="4,5", dtype="bfloat16", max_model_len=8192, startup_timeout_s=60,
                              log_path=tmp_path / "judge.log", extra_args=["--enforce-eager"])
    with pytest.raises(ServedModelError, match="exited with code 3") as err:
        server.__enter__()
    assert server.cmd[0] == str(tmp_path / "fake-python") and server.cmd[-1] == "--enforce-eager"
    assert server.cmd[server.cmd.index("--tensor-parallel-size") + 1] == "2"
    assert server.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    log = (tmp_path / "judge.log").read_text()
    assert "devices: 4,5" in log and "key: none" in log and "--max-model-len 8192" in log
    assert "devices: 4,5" in str(err.value)


class _Accelerator:
    is_main_process = is_local_main_process = True
    num_processes, process_index, local_process_index = 1, 0, 0

    def wait_for_everyone(self) -> None:
        pass


def _params(tmp_path: Path, **server):
    return validate_params(_raw(python=str(_fake_python(tmp_path)), **server))


def test_judge_endpoint_starts_the_server_the_params_describe(tmp_path, monkeypatch):
    """``judge_endpoint`` passes the engine and the vLLM keys on, runs the server on
    ``PACO_JUDGE_DEVICES`` and logs to ``log_dir/log_name``; with ``server.gpus`` > 0 and no
    ``PACO_JUDGE_DEVICES`` (not started by ``paco.core.launch --serves_judge``) it is a named
    ArtifactError before any server starts."""
    from paco.serving.endpoint import judge_endpoint

    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text("{}")
    params = _params(tmp_path, max_model_len=4096, gpu_memory_utilization=0.5)
    monkeypatch.delenv("PACO_JUDGE_DEVICES", raising=False)
    with pytest.raises(ArtifactError, match="judge_endpoint.server.gpus 1 but .*--serves_judge"):
        with judge_endpoint(params, judge, _Accelerator(), tmp_path / "logs"):
            pass
    assert not (tmp_path / "logs").exists()
    monkeypatch.setenv("PACO_JUDGE_DEVICES", "4")
    with pytest.raises(JudgeError, match="exited with code 3"):
        with judge_endpoint(params, judge, _Accelerator(), tmp_path / "logs",
                            log_name="final_samples_t2is.judge_server.log") as endpoint:
            endpoint.url()
    log = (tmp_path / "logs" / "final_samples_t2is.judge_server.log").read_text()
    assert f"--model {judge} --served-model-name paco-reward" in log and "devices: 4" in log
    assert "--gpu-memory-utilization 0.5 --tensor-parallel-size 1 --max-model-len 4096" in log
