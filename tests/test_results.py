"""paco.results: docs/results.md is the run's own figures, formatted; a missing figure is named."""

import json

import pandas as pd
import pytest

from paco import results


def _write(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _judge(acc, tau, p):
    vs = {"p_value": p, "mean": acc, "n": 408}
    return {"accuracy": acc, "kendall_tau": tau, "spearman_rho": tau + 0.01, "top1_bottom1": acc + 0.1,
            "accuracy_vs_chance": vs, "accuracy_vs_chance_per_prompt": {**vs, "p_value": 0.011, "n": 8}}


def _run(wall, rss_mb, torch=2):
    return {"wall_seconds": wall, "peak_rss_mb": rss_mb, "processes": 1, "threads": {"torch": torch}}


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    _write(d / "params_check" / "params.json", {"grpo": {"t2is": {"seed": 3}}, "reward_train": {"seed": 0}})
    edit = {q: {"accuracy": a, "n": n, "p_value": 0.07} for q, a, n in
            (("consistency", 0.75, 12), ("prompt_following", 0.357, 28), ("overall", 0.475, 40))}
    _write(d / "reward_eval" / "report.json", {
        "instances": 408, "prompts": 8, "run": _run(49.4, 778.7),
        "judges": {"paco_reward": _judge(0.43014, 0.2549, 5.45e-27), "base_zero_shot": _judge(0.31985, 0.1046, 3e-7)},
        "paco_reward_vs": {"base_zero_shot": {"mean": 0.11029, "p_value": 7.85e-8, "n": 408,
                                              "per_prompt": {"p_value": 0.0606, "n": 8}}},
        "editing": {"benchmark": "photos", "instances": 80, "items": 14, "judges": {"paco_reward": edit}}})
    _write(d / "reward_train" / "report.json", {
        "total_steps": 1008, "train_pairs": 2688, "run": _run(295.2, 1374.4),
        "eval_final": {"first_token_accuracy": 0.6593, "p_yes_accuracy": 0.663, "pairs": 1080,
                       "p_yes_mean_yes": 0.695, "p_yes_mean_no": 0.46}})
    _write(d / "grpo" / "t2is" / "report.json", {
        "epochs": 16, "seconds_per_epoch": 10.98, "run": _run(192.55, 755.7),
        "learning_signal": {"first_epochs_reward": 0.14563, "last_epochs_reward": 0.16778, "improvement": 0.022155,
                            "prompts_improved": 22, "prompts_paired": 22, "p_value": 5.59e-10},
        "eval_first": {"reward": 0.20448}, "eval_final": {"reward": 0.22727}})
    (d / "grpo" / "t2is" / "plots").mkdir()
    pd.DataFrame({"epoch": [1, 2], "reward": [0.14, 0.15]}).to_csv(d / "grpo" / "t2is" / "plots" / "train.csv", index=False)
    _write(d / "final_samples" / "t2is" / "report.json", {
        "samples": 64, "resolution": 256, "run": _run(32.8, 774.1),
        "rewards": {"consistency": {"base_mean": 0.83132, "lora_mean": 0.95884, "lora_minus_base": 0.12753,
                                    "improved_fraction": 1.0, "paired_t_p_value": 6.4e-14},
                    "clip_t": {"base_mean": 0.01705, "lora_mean": 0.01841, "lora_minus_base": 0.00136,
                               "improved_fraction": 0.4375}}})
    _write(d / "prompts" / "report.json", {"run": _run(0.4, 140.0, torch=None)})
    return d


def test_the_page_holds_the_runs_figures(data, tmp_path):
    out = tmp_path / "docs" / "results.md"
    assert results.main(["--data", str(data), "--out", str(out), "--figures", str(tmp_path / "docs" / "fig")]) == 0
    page = out.read_text()
    assert "| PaCo-Reward (trained) | 0.430 | 0.255 | 0.265 | 0.530 | 5e-27 (0.011) |" in page
    assert "+0.110 (paired p 8e-08 over 408 instances, 0.061 over 8 prompt means)" in page
    assert "| PaCo-Reward (trained) | 0.75 (n 12, p 0.07) | 0.36 (n 28, p 0.07) | 0.47 (n 40, p 0.07) |" in page
    assert "1008 steps over 2688 training pairs; held-out first-token accuracy 0.659" in page
    assert "| t2is | 16 | 0.146 -> 0.168 | +0.022 (22 of 22, p 6e-10) | 0.204 -> 0.227 | 11.0 | 193 | 0.74 |" in page
    assert "| t2is (32 pairs, 256 px) | consistency | 0.831 | 0.959 | +0.128 | 100% | 6e-14 |" in page
    assert "| t2is (32 pairs, 256 px) | clip_t | 0.017 | 0.018 | +0.001 | 44% | - |" in page  # no test: no p
    assert "| prompts | 0 | 0.14 | 1 x - |" in page and "| grpo@t2is | 193 | 0.74 | 1 x 2 |" in page
    assert "GRPO seeds: t2is 3; reward_train seed 0." in page
    assert "![GRPO training reward per epoch](fig/grpo_reward_curves.png)" in page
    assert (tmp_path / "docs" / "fig" / "grpo_reward_curves.png").stat().st_size > 1000
    # the stages' wall times add up: 0.4 + 295.2 + 49.4 + 192.55 + 32.8 s
    assert f"{(0.4 + 295.2 + 49.4 + 192.55 + 32.8) / 60:.1f} min" in page


def test_a_missing_figure_is_named(data, tmp_path, capsys):
    (data / "reward_train" / "report.json").unlink()
    assert results.main(["--data", str(data), "--out", str(tmp_path / "r.md"), "--figures", ""]) == 2
    assert "reward_train/report.json: missing" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()
    _write(data / "reward_train" / "report.json", {"total_steps": 1})
    with pytest.raises(results.ResultsError, match="report.json: no 'eval_final'"):
        results.render(data, None, tmp_path / "r.md")


def test_p_values_and_gains_are_formatted_as_the_page_prints_them():
    assert results.fmt_p(5.45e-27) == "5e-27" and results.fmt_p(0.0606) == "0.061" and results.fmt_p(None) == "-"
    assert results.fmt_gain(0.0221) == "+0.022" and results.fmt_gain(-0.119) == "-0.119"
    assert results.fmt(0.43014) == "0.430" and results.fmt(7) == "7" and results.fmt(None) == "-"
