"""paco.compare: real experiments (listed in-process and as `dvc exp show --json` prints them) of a
throwaway git + DVC repository (a one-stage pipeline writing the GRPO / final-sample layout,
experiments run with `dvc exp run`), the statistics against independent scipy computations and the
report's table."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

from paco.compare.ablations import queue_commands
from paco.compare.cli import main
from paco.compare.errors import CompareError, MissingMetricError
from paco.compare.experiments import changed_params, exp_show, parse_exp_show, select
from paco.compare.growth import reward_ratio, standardised_growth
from paco.compare.report import write_report
from paco.compare.timings import epoch_seconds
from paco.core.dotted import set_dotted

pytestmark = pytest.mark.skipif(shutil.which("dvc") is None or shutil.which("git") is None,
                                reason="needs the dvc and git executables")

# the stage: writes what grpo@t2is and final_samples@t2is write, from the params alone
STAGE = r'''
import json, os, sys
import numpy as np, pandas as pd, yaml

def generate(p):
    g = p["grpo"]["t2is"]
    slope = 0.01 * (2.0 if g["aggregation"]["method"] == "weighted_sum" else 1.0) * g["train"]["resolution"] / 32
    rng = np.random.default_rng([g["seed"], g["train"]["resolution"], len(g["aggregation"]["method"])])
    w = g["rewards"]
    rows = []
    for e in range(1, 11):
        a = 0.2 + slope * e + 0.002 * rng.standard_normal()
        b = -0.05 + 0.3 * slope * e + 0.002 * rng.standard_normal()
        rows.append({"epoch": e, "a_mean": a, "a_std": 0.05, "b_mean": b, "b_std": 0.02,
                     "advantage_abs_mean": 0.1, "reward": w["a"] * a + w["b"] * b})
    train = pd.DataFrame(rows)
    ev = pd.DataFrame({"epoch": [0, 5, 10], "reward": [0.1, 0.1 + 5 * slope, 0.1 + 10 * slope]})
    samples = []
    for i in range(4):
        for s in range(2):
            for v in ("base", "lora"):
                up = 0.0 if v == "base" else slope * 5
                samples.append({"prompt_id": f"p{i}", "seed": s, "variant": v,
                                "reward_a": 0.3 + 0.01 * i + up + 0.01 * rng.standard_normal(),
                                "reward_b": 0.1 - 0.01 * s + up / 2 + 0.01 * rng.standard_normal(),
                                "monitor_grid_artifact": 0.02 + up / 4 + 0.005 * rng.standard_normal()})
    return train, ev, pd.DataFrame(samples)

def judge(p):
    rng = np.random.default_rng([7, int(p["reward_train"]["first_token_weight"] * 10)])
    rows = [{"instance_id": f"i{i:02d}", "prompt_id": f"p{i % 3}", "scorer": scorer,
             "predicted_order": rng.permutation(4).tolist(), "reference_order": [0, 1, 2, 3]}
            for i in range(12) for scorer in ("paco_reward", "clip_i")]
    return pd.DataFrame(rows)

if __name__ == "__main__":
    p = yaml.safe_load(open("params.yaml"))
    train, ev, samples = generate(p)
    os.makedirs("data/grpo/t2is/plots", exist_ok=True)
    os.makedirs("data/final_samples/t2is", exist_ok=True)
    train.to_csv("data/grpo/t2is/plots/train.csv", index=False)
    ev.to_csv("data/grpo/t2is/plots/eval.csv", index=False)
    metrics = {"eval_reward": float(ev["reward"].iloc[-1]), "train_gain": float(train["reward"].iloc[-1] - train["reward"].iloc[0])}
    if p.get("drop_eval_reward"):
        del metrics["eval_reward"]
    json.dump(metrics, open("data/grpo/t2is/metrics.json", "w"))
    samples.to_parquet("data/final_samples/t2is/samples.parquet", index=False)
    gap = float(p["grpo"]["t2is"]["train"]["resolution"]) / 1000
    json.dump({"n": len(samples), "hacking_gap": gap, "hacking_gap_p": 0.01},
              open("data/final_samples/t2is/metrics.json", "w"))
    pred = judge(p)
    os.makedirs("data/reward_eval", exist_ok=True)
    pred.to_parquet("data/reward_eval/predictions.parquet", index=False)
    mine = pred[pred["scorer"] == "paco_reward"]
    acc = float(np.mean([np.mean(np.equal(a, b)) for a, b in zip(mine["predicted_order"], mine["reference_order"])]))
    json.dump({"judges": {"paco_reward": {"accuracy": acc, "kendall_tau": 0.125}}}, open("data/reward_eval/metrics.json", "w"))
'''

PARAMS = {
    "grpo": {"t2is": {"seed": 0, "rewards": {"a": 1.0, "b": 0.5}, "aggregation": {"method": "log_tame", "delta": 0.2},
                      "train": {"resolution": 32}, "eval": {"resolution": 64}}},
    "reward_train": {"first_token_weight": 1.0},
    "reasons": {"teacher": {"fast": True}},
    "drop_eval_reward": False,
}

DVC_YAML = {"stages": {"fake": {
    "cmd": f"{sys.executable} stage.py",
    "deps": ["stage.py"],
    "params": ["grpo", "drop_eval_reward", "reward_train"],
    "outs": ["data/grpo/t2is/plots/train.csv", "data/grpo/t2is/plots/eval.csv",
             "data/final_samples/t2is/samples.parquet", "data/reward_eval/predictions.parquet"],
    "metrics": ["data/grpo/t2is/metrics.json", "data/final_samples/t2is/metrics.json",
                "data/reward_eval/metrics.json"],
}}}


def _run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "DVC_NO_ANALYTICS": "1"}
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    assert res.returncode == 0, f"{cmd}: {res.stdout}\n{res.stderr}"
    return res.stdout


def _stage(fn: str, params: dict):
    ns: dict = {"__name__": "stage"}
    exec(STAGE, ns)
    return ns[fn](params)


def _generate(params: dict) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    return _stage("generate", params)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exprepo")
    (root / "stage.py").write_text(STAGE)
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS, sort_keys=False))
    (root / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (root / ".gitignore").write_text("/data/\n")
    _run(["git", "init", "-q", "-b", "main"], root)
    _run(["dvc", "init", "-q"], root)
    _run(["dvc", "config", "core.analytics", "false"], root)
    _run(["dvc", "repro", "-q"], root)
    _run(["git", "add", "-A"], root)
    _run(["git", "commit", "-qm", "baseline"], root)
    cmds = queue_commands(["resolution", "aggregation", "first_token_weight"], PARAMS, targets=["fake"])
    for cmd in cmds:  # the queued commands, run synchronously in temporary directories
        i = cmd.index("--queue")
        _run([*cmd[:i], "--temp", *cmd[i + 1:]], root)
    _run(["dvc", "exp", "run", "--temp", "-n", "nometric", "-S", "drop_eval_reward=true", "-S", "grpo.t2is.seed=1"], root)
    _run(["dvc", "exp", "run", "--queue", "-n", "waiting", "-S", "grpo.t2is.seed=3"], root)
    return root


def test_queue_commands_and_dry_run(tmp_path, capsys):
    assert queue_commands(["resolution", "aggregation", "first_token_weight", "cot"], PARAMS) == [
        ["dvc", "exp", "run", "--queue", "-n", "resolution", "-S", "grpo.t2is.train.resolution=64", "final_samples@t2is"],
        ["dvc", "exp", "run", "--queue", "-n", "aggregation", "-S", "grpo.t2is.aggregation.method=weighted_sum",
         "final_samples@t2is"],
        ["dvc", "exp", "run", "--queue", "-n", "first_token_weight", "-S", "reward_train.first_token_weight=0.1",
         "reward_eval"],
        ["dvc", "exp", "run", "--queue", "-n", "cot", "-S", "reasons.teacher.fast=false", "reward_eval"],
    ]
    assert queue_commands(["cot"], PARAMS, targets=[]) == [
        ["dvc", "exp", "run", "--queue", "-n", "cot", "-S", "reasons.teacher.fast=false"]]
    with pytest.raises(CompareError, match="unknown ablation 'typo'"):
        queue_commands(["typo"], PARAMS)
    with pytest.raises(MissingMetricError, match="grpo.edit.eval.resolution"):
        queue_commands(["resolution"], PARAMS, subtask="edit")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    assert main(["queue", "aggregation", "--params", str(tmp_path / "params.yaml"), "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == \
        "dvc exp run --queue -n aggregation -S grpo.t2is.aggregation.method=weighted_sum final_samples@t2is"


def test_exp_show_reads_real_experiments(repo):
    rows = exp_show(repo)  # in-process (DVC's Repo.experiments.show)
    # the same rows as from the document `dvc exp show --json` prints
    assert rows == parse_exp_show(json.loads(_run(["dvc", "exp", "show", "--json"], repo)))
    by = {r.name: r for r in rows}
    assert rows[0].baseline and rows[0].name == "main"
    assert by["main"].rev == _run(["git", "rev-parse", "HEAD"], repo).strip()  # full revisions
    assert set(by) == {"main", "resolution", "aggregation", "first_token_weight", "nometric", "waiting"}
    assert by["waiting"].state == "queued" and by["resolution"].parent == by["main"].rev == by["main"].parent
    assert by["resolution"].outs["data/grpo/t2is/plots/train.csv"] != by["main"].outs["data/grpo/t2is/plots/train.csv"]
    assert all(by[n].state is None for n in ("main", "resolution", "aggregation", "nometric"))
    assert by["resolution"].params["grpo.t2is.train.resolution"] == 64
    assert by["main"].params["grpo.t2is.train.resolution"] == 32
    assert by["aggregation"].params["grpo.t2is.aggregation.method"] == "weighted_sum"
    assert changed_params(by["aggregation"], by["main"]) == {"grpo.t2is.aggregation.method": "weighted_sum"}
    train, ev, _ = _generate(PARAMS)
    assert by["main"].metric("data/grpo/t2is/metrics.json", "eval_reward") == pytest.approx(ev["reward"].iloc[-1])
    with pytest.raises(MissingMetricError, match=r"'nometric'.*data/grpo/t2is/metrics.json:eval_reward"):
        by["nometric"].metric("data/grpo/t2is/metrics.json", "eval_reward")
    with pytest.raises(CompareError, match="DVC 3"):
        parse_exp_show({"workspace": {}})
    with pytest.raises(CompareError, match="'waiting' is queued"):
        select(rows, ["waiting"])
    with pytest.raises(CompareError, match="no finished experiments"):
        select(rows[:1], None)


def test_exp_show_errors_name_the_repository(repo, tmp_path):
    with pytest.raises(CompareError, match=r"cannot list the experiments of .*NotDvcRepoError"):
        exp_show(tmp_path)
    with pytest.raises(CompareError, match="commits must be >= 1, got 0"):
        exp_show(repo, commits=0)
    # a repository with one commit: -n 2 lists what -n 1 does
    assert [(r.name, r.rev, r.state) for r in exp_show(repo, commits=2)] == \
        [(r.name, r.rev, r.state) for r in exp_show(repo)]


def _params_with(**sets) -> dict:
    p = json.loads(json.dumps(PARAMS))
    for k, v in sets.items():
        set_dotted(p, k, v)
    return p


def test_report_table_and_statistics(repo, tmp_path):
    out = tmp_path / "cmp"
    log = tmp_path / "base.log"
    log.write_text("Running stage 'other':\nINFO epoch 1/10: reward 0.1 | 99.0 s\nRunning stage 'grpo@t2is':\n"
                   + "".join(f"INFO [paco.grpo.trainer] epoch {e}/10: reward 0.1 +- 0 (a 0.1) | 2.0 s\n"
                             for e in range(1, 11)))
    log2 = tmp_path / "resolution.log"  # a bare stage log (no `Running stage` lines): counts entirely
    log2.write_text("".join(f"epoch {e}/10: reward 0.1 +- 0 (a 0.1) | |A| 0.1 | {1.5 * e:.1f} s\n" for e in range(1, 11)))
    assert main(["report", "--repo", str(repo), "--exp", "resolution", "--exp", "aggregation",
                         "--out", str(out), "--window", "3", "--log", f"main={log}", "--log", f"resolution={log2}",
                         "--section", "grpo"]) == 0
    md = (out / "report.md").read_text()
    res = json.loads((out / "report.json").read_text())["grpo"]
    assert {p.name for p in out.glob("*.png")} == {"reward_curves.png", "reward_growth.png", "eval_vs_wall_time.png"}

    # independent computation from the generator
    gen = {"main": _generate(PARAMS),
           "resolution": _generate(_params_with(**{"grpo.t2is.train.resolution": 64})),
           "aggregation": _generate(_params_with(**{"grpo.t2is.aggregation.method": "weighted_sum"}))}

    def lora_reward(s):
        s = s[s["variant"] == "lora"].sort_values(["prompt_id", "seed"])
        return (1.0 * s["reward_a"] + 0.5 * s["reward_b"]).to_numpy()

    b_train, b_eval, b_s = gen["main"]
    for name in ("resolution", "aggregation"):
        train, ev, s = gen[name]
        r = res[name]
        assert r["eval_diff"] == pytest.approx(ev["reward"].iloc[-1] - b_eval["reward"].iloc[-1])
        x, y = lora_reward(s), lora_reward(b_s)
        assert r["final"]["mean_diff"] == pytest.approx((x - y).mean())
        assert r["final"]["t_p"] == pytest.approx(stats.ttest_rel(x, y).pvalue)
        assert r["final"]["wilcoxon_p"] == pytest.approx(stats.wilcoxon(x - y).pvalue)
        last, b_last = train["reward"].iloc[-3:], b_train["reward"].iloc[-3:]
        assert r["train"]["p"] == pytest.approx(stats.ttest_ind(last, b_last, equal_var=False).pvalue)
        g = {k: (train[f"{k}_mean"].iloc[-3:].mean() - train[f"{k}_mean"].iloc[:3].mean()) / train[f"{k}_std"].iloc[0]
             for k in ("a", "b")}
        assert r["growth"] == pytest.approx(g)
        assert r["reward_ratio"] == pytest.approx(max(abs(v) for v in g.values()) / min(abs(v) for v in g.values()))
        # the table row: eval reward, its difference and the p-values as printed
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == ("`grpo.t2is.train.resolution=64`" if name == "resolution"
                            else "`grpo.t2is.aggregation.method=weighted_sum`")
        assert float(cells[2]) == pytest.approx(ev["reward"].iloc[-1], abs=5e-5)
        assert float(cells[3]) == pytest.approx(r["eval_diff"], abs=5e-5)
        assert float(cells[6]) == pytest.approx(r["final"]["t_p"], rel=5e-3)
        # s / epoch: the mean of 1.5 e s, e = 1..10, from its log; none for aggregation (no log, not queued)
        assert cells[11] == ("8.25" if name == "resolution" else "n/a")
        assert float(cells[12]) == pytest.approx(r["reward_ratio"], abs=5e-3)
        # the reward-hacking table: the experiment's own hacking gap, its LoRA samples' monitor against the baseline's
        lora, b_lora = (t[t["variant"] == "lora"].sort_values(["prompt_id", "seed"]) for t in (s, b_s))
        m = r["monitors"]
        assert m["hacking_gap"] == pytest.approx((64 if name == "resolution" else 32) / 1000)
        assert m["grid_artifact"]["t_p"] == pytest.approx(
            stats.ttest_rel(lora["monitor_grid_artifact"], b_lora["monitor_grid_artifact"]).pvalue)
    assert "reward-hacking monitors of the final LoRA samples" in md
    base_row = next(line for line in md.splitlines() if line.startswith("| main |"))
    base_cells = [c.strip() for c in base_row.strip("|").split("|")]
    assert base_cells[1] == "(baseline)" and base_cells[11] == "2.00"  # the --log file, grpo@t2is epochs only
    assert res["aggregation"]["final_per_reward"]["a"]["t_p"] == pytest.approx(
        stats.ttest_rel(gen["aggregation"][2].query("variant == 'lora'").sort_values(["prompt_id", "seed"])["reward_a"],
                        b_s.query("variant == 'lora'").sort_values(["prompt_id", "seed"])["reward_a"]).pvalue)


def test_report_names_the_missing_metric(repo, tmp_path, capsys):
    assert main(["report", "--repo", str(repo), "--exp", "nometric", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'nometric'" in err and "data/grpo/t2is/metrics.json:eval_reward" in err
    assert main(["report", "--repo", str(repo), "--exp", "typo", "--out", str(tmp_path)]) == 2
    assert "no experiment named 'typo'" in capsys.readouterr().err


def test_standardised_growth_and_reward_ratio():
    train = pd.DataFrame({"epoch": [2, 1, 3, 4], "x_mean": [0.2, 0.0, 0.4, 0.6], "x_std": [9, 0.5, 9, 9],
                          "y_mean": [-1.0, -1.0, -0.9, -0.9], "y_std": [1, 0.1, 1, 1], "advantage_abs_mean": 0.0})
    g = standardised_growth(train, 2)  # sorted by epoch; std of epoch 1
    assert g == pytest.approx({"x": (0.5 - 0.1) / 0.5, "y": (-0.9 + 1.0) / 0.1})
    assert reward_ratio(g) == pytest.approx(1.0 / 0.8)
    with pytest.raises(ValueError, match="need >= 2 x window"):
        standardised_growth(train, 3)


def test_epoch_seconds_from_logs():
    text = ("Running stage 'grpo@kontext_editing':\nINFO epoch 1/2: reward 0.1 +- 0 (c 1) | |A| 0.1 | 50.0 s\n"
            "Running stage 'grpo@t2is':\nINFO epoch 1/2: reward 0.1 +- 0 (c 1) | |A| 0.1 | 9.1 s\n"
            "INFO epoch 2/2: reward 0.2 +- 0 (c 1) | |A| 0.1 | 7.25 s\n")
    assert epoch_seconds(text, "grpo@t2is") == {1: 9.1, 2: 7.25}
    assert epoch_seconds("INFO epoch 3/4: reward 1 | 2.5 s\n", "grpo@t2is") == {3: 2.5}
    assert epoch_seconds("nothing here", "grpo@t2is") == {}


def test_report_judge_section(repo, tmp_path):
    out = tmp_path / "judge"
    # default sections: every one whose metrics file the baseline has (grpo and judge here)
    write_report(repo, ["first_token_weight"], out, window=3)
    md = (out / "report.md").read_text()
    # first_token_weight leaves the final samples as they are (same DVC hash): no GRPO table
    assert "Section grpo: left out `first_token_weight`" in md and "### GRPO" not in md and "### Judge" in md
    res = json.loads((out / "report.json").read_text())["judge"]

    def per_instance(p):
        p = p[p["scorer"] == "paco_reward"].sort_values("instance_id")
        return np.array([np.mean(np.asarray(a) == np.asarray(b)) for a, b in zip(p["predicted_order"], p["reference_order"])])

    x = per_instance(_stage("judge", _params_with(**{"reward_train.first_token_weight": 0.1})))
    y = per_instance(_stage("judge", PARAMS))
    t = res["first_token_weight"]["paired"]
    assert t["n"] == 12 and t["mean_diff"] == pytest.approx((x - y).mean())
    assert t["t_p"] == pytest.approx(stats.ttest_rel(x, y).pvalue)
    assert t["wilcoxon_p"] == pytest.approx(stats.wilcoxon(x - y).pvalue)
    judge_md = md[md.index("### Judge"):]
    row = next(line for line in judge_md.splitlines() if line.startswith("| first_token_weight |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "`reward_train.first_token_weight=0.1`"
    assert float(cells[2]) == pytest.approx(x.mean(), abs=5e-5) and cells[3] == "0.1250"
    assert float(cells[4]) == pytest.approx((x - y).mean(), abs=5e-5)
