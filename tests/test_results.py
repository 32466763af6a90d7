"""paco.results: docs/results.md is the run's own figures, formatted; a missing figure is named."""

import json

import pandas as pd
import pytest
from PIL import Image

from paco import results
from paco.core.io import encode_image
from paco.grpo.final_samples import contact_sheet


def _write(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _judge(acc, tau, p):
    vs = {"p_value": p, "mean": acc, "n": 408}
    return {"accuracy": acc, "kendall_tau": tau, "spearman_rho": tau + 0.01, "top1_bottom1": acc + 0.1,
            "accuracy_vs_chance": vs, "accuracy_vs_chance_per_prompt": {**vs, "p_value": 0.011, "n": 8}}


def _colour(item, seed, variant):
    """A solid colour per (item index, seed, variant), far apart in every channel."""
    return (30 + 70 * item, 30 + 90 * seed, {"base": 40, "lora": 210, "input": 125}[variant])


def _cell(colour, side=32):
    return encode_image(Image.new("RGB", (side, side), colour))


def _samples(ids_seeds):
    """samples.parquet rows (the columns the excerpt reads, plus one more), in a shuffled order."""
    rows = [{"sample_id": f"{pid}-s{k}-{v}", "prompt_id": pid, "seed": k, "variant": v, "image": _cell(_colour(i, k, v))}
            for i, (pid, seeds) in enumerate(ids_seeds) for k in seeds for v in ("base", "lora")]
    return pd.DataFrame(rows[::-1])


#: the fake T2IS samples: prompt t2is-0002 has no seed 0, so its lowest seed is 1
T2IS_SAMPLES = (("t2is-0001", (0, 2)), ("t2is-0002", (2, 1)), ("t2is-0003", (0, 1)))


def _run(wall, rss_mb, torch=2):
    return {"wall_seconds": wall, "peak_rss_mb": rss_mb, "processes": 1, "threads": {"torch": torch}}


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    _write(d / "params_check" / "params.json", {"grpo": {"t2is": {"seed": 3}}, "reward_train": {"seed": 0},
                                                "final_samples": {"t2is": {"dataset": "prompts", "split": "test"}}})
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
        "eval_first": {"reward": 0.20448, "grid_artifact": 0.0157}, "eval_final": {"reward": 0.22727,
                                                                                   "grid_artifact": 0.0412},
        "lora_epoch": 16})
    (d / "grpo" / "t2is" / "plots").mkdir()
    pd.DataFrame({"epoch": [1, 2], "reward": [0.14, 0.15]}).to_csv(d / "grpo" / "t2is" / "plots" / "train.csv", index=False)
    _write(d / "final_samples" / "t2is" / "report.json", {
        "samples": 64, "resolution": 256, "run": _run(32.8, 774.1),
        "rewards": {"consistency": {"base_mean": 0.83132, "lora_mean": 0.95884, "lora_minus_base": 0.12753,
                                    "improved_fraction": 1.0, "paired_t_p_value": 6.4e-14},
                    "clip_t": {"base_mean": 0.01705, "lora_mean": 0.01841, "lora_minus_base": 0.00136,
                               "improved_fraction": 0.4375}},
        "monitors": {"grid_artifact": {"base_mean": 0.0157, "lora_mean": 0.0282, "lora_minus_base": 0.0125,
                                       "lora_higher_fraction": 0.84375, "paired_t_p_value": 3.2e-5},
                     "panel_similarity": {"base_mean": 0.5365, "lora_mean": 0.5185, "lora_minus_base": -0.018,
                                          "lora_higher_fraction": 0.0625, "paired_t_p_value": 9.1e-8}},
        "hacking_gap": {"consistency": {"optimised_gain": 0.12753, "independent_gain": 0.02, "gap": 0.10753,
                                        "paired_t_p_value": 2.5e-6}}})
    _samples(T2IS_SAMPLES).to_parquet(d / "final_samples" / "t2is" / "samples.parquet")
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
    assert ("| t2is | grid_artifact | 0.0157 | 0.0282 | +0.0125 | 84% | 3e-05 | +0.01 | **past its bound** |"
            in page)
    assert "| t2is | panel_similarity | 0.5365 | 0.5185 | -0.0180 | 6% | 9e-08 | +0.05 | within its bound |" in page
    assert ("| t2is | consistency | the zero-shot base judge | +0.128 | +0.020 | +0.108 | 3e-06 |" in page)
    assert "| t2is | grid_artifact | 0.0157 | 0.0412 | +0.0255 | 16 |" in page
    assert ("- t2is: the LoRA shows signs of reward hacking: grid_artifact +0.013 (p 3e-05); a hacking gap of "
            "+0.108 in consistency (p 3e-06: the run's judge sees +0.128, the zero-shot base judge +0.020)." in page)
    assert "![GRPO training reward per epoch](fig/grpo_reward_curves.png)" in page
    assert (tmp_path / "docs" / "fig" / "grpo_reward_curves.png").stat().st_size > 1000
    assert "![t2is: final samples, base and LoRA](fig/samples_t2is.jpg)" in page
    assert "`data/final_samples/<subtask>/sheets/`" in page and "stay with the run" in page
    assert (tmp_path / "docs" / "fig" / "samples_t2is.jpg").is_file()
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


def _cell_colour(sheet, row, col, thumb=32, pad=6, cap=14, head=18):
    """The colour at the centre of a contact-sheet cell (contact_sheet's layout, computed here)."""
    return sheet.getpixel((pad + col * (thumb + pad) + thumb // 2, head + pad + row * (thumb + cap + pad) + thumb // 2))


def _assert_colours(sheet, expected):
    for (row, col), want in expected.items():
        got = _cell_colour(sheet, row, col)
        assert max(abs(g - w) for g, w in zip(got, want)) <= 12, (row, col, got, want)


def test_the_sample_excerpt_is_the_first_prompts_at_their_lowest_seed(data, tmp_path):
    out = results.sample_excerpts(data, tmp_path / "a", rows=2, thumb=32)
    assert out == {"t2is": tmp_path / "a" / "samples_t2is.jpg"}
    raw = out["t2is"].read_bytes()
    assert raw[:2] == b"\xff\xd8"  # JPEG
    sheet = Image.open(out["t2is"])
    assert "exif" not in sheet.info
    # 2 columns x 2 rows of 32 px cells: cols * (32 + 6) + 6 wide, 18 + rows * (32 + 14 + 6) + 6 high
    assert sheet.size == (2 * 38 + 6, 18 + 2 * 52 + 6)
    same = [Image.new("RGB", (32, 32), _colour(i, k, v)) for i, k in ((0, 0), (1, 1)) for v in ("base", "lora")]
    assert sheet.size == contact_sheet(same, ["x"] * 4, columns=2, thumb=32, title="t").size
    sheet = sheet.convert("RGB")
    # t2is-0001 at seed 0, t2is-0002 at seed 1 (it has no seed 0); never t2is-0003 nor seed 2
    _assert_colours(sheet, {(r, c): _colour(i, k, v) for r, (i, k) in enumerate(((0, 0), (1, 1)))
                            for c, v in enumerate(("base", "lora"))})
    again = results.sample_excerpts(data, tmp_path / "b", rows=2, thumb=32)
    assert again["t2is"].read_bytes() == raw


def test_an_editing_excerpt_shows_input_base_lora_one_edit_type_each(data, tmp_path):
    ids = ("a-blur", "b-blur", "c-zoom")  # distinct edit types first: a-blur, c-zoom (not b-blur)
    params = json.loads((data / "params_check" / "params.json").read_text())
    params["final_samples"]["ed"] = {"dataset": "edits", "split": "test"}
    _write(data / "params_check" / "params.json", params)
    (data / "edits").mkdir()
    pd.DataFrame({"item_id": list(ids), "instruction": ["x"] * 3,
                  "input_image": [_cell(_colour(i, 0, "input")) for i in range(3)]}).to_parquet(
        data / "edits" / "edits.parquet")
    (data / "final_samples" / "ed").mkdir()
    _samples([(pid, (0, 1)) for pid in ids]).to_parquet(data / "final_samples" / "ed" / "samples.parquet")
    out = results.sample_excerpts(data, tmp_path / "fig", rows=2, thumb=32)
    assert sorted(out) == ["ed", "t2is"]
    sheet = Image.open(out["ed"])
    assert sheet.size == (3 * 38 + 6, 18 + 2 * 52 + 6)
    _assert_colours(sheet.convert("RGB"), {(r, c): _colour(i, 0, v) for r, i in enumerate((0, 2))
                                           for c, v in enumerate(("input", "base", "lora"))})
    assert results.choose_items(["b-x", "a-x", "a-y"], 3, distinct_edits=True) == ["a-x", "a-y", "b-x"]
    assert results.choose_items(["b-x", "a-x", "a-y"], 2, distinct_edits=False) == ["a-x", "a-y"]
    (data / "edits" / "edits.parquet").unlink()
    with pytest.raises(results.ResultsError, match="edits.parquet: missing"):
        results.sample_excerpts(data, tmp_path / "fig")


def test_a_samples_file_without_a_variant_or_a_pair_is_named(data, tmp_path):
    path = data / "final_samples" / "t2is" / "samples.parquet"
    table = _samples(T2IS_SAMPLES)
    table.drop(columns="variant").to_parquet(path)
    with pytest.raises(results.ResultsError, match="t2is/samples.parquet: no column 'variant'"):
        results.sample_excerpts(data, tmp_path)
    assert results.main(["--data", str(data), "--out", str(tmp_path / "r.md"), "--figures", str(tmp_path)]) == 2
    table[~((table["prompt_id"] == "t2is-0001") & (table["variant"] == "lora"))].to_parquet(path)
    with pytest.raises(results.ResultsError, match=r"no 'lora' sample of \(t2is-0001, seed 0\)"):
        results.sample_excerpts(data, tmp_path)
