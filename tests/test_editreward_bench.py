"""Reading EditReward-Bench (its Parquet export and the project's jsonl layout) defensively: files
stay inside the benchmark's folder, an output id names one image, identical outputs are counted,
bad cells are named before any scoring, images are bounded; and stage ``reward_eval`` reads every
input before it computes or writes anything (GitHub issue 29, part C)."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from paco.core.io import ArtifactError, ImageTooLargeError, OutsideDatasetError
from paco.judge import evaluation as E

sys.path.insert(0, str(Path(__file__).parent))
from test_evaluation import _bench_scorer, _png, _write_editreward_parquet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _row(keys=("m1", "m2"), outs=((1, 0, 0), (2, 0, 0)), dimension="overall", **kw) -> dict:
    row = {"key": list(keys), "instruction": "make it red", "input_image": _png((0, 0, 0)),
           "output_images": [_png(c) for c in outs], "task_type": "t", "dimension": dimension}
    row.update(kw)
    return row


def _jsonl_bench(folder: Path, **override) -> Path:
    """A one-line jsonl benchmark in ``folder`` with three images there; ``override`` replaces keys."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, colour in (("in", (0, 0, 0)), ("a", (200, 0, 0)), ("b", (50, 0, 0))):
        Image.new("RGB", (8, 8), colour).save(folder / f"{name}.png")
    rec = {"id": "e0", "instruction": "make it red", "input_image": "in.png", "output_a": "a.png",
           "output_b": "b.png", "dimension": "consistency", "task_type": "colour", **override}
    path = folder / "bench.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    return path


# -- case 1: nothing outside the benchmark's folder ----------------------------------------------


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_jsonl_images_outside_the_benchmark_folder_are_refused(tmp_path, where):
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8), (9, 9, 9)).save(outside)
    bench = tmp_path / "bench"
    bench.mkdir()
    name = {"parent": "../secret.png", "absolute": str(outside), "symlink": "link.png"}[where]
    if where == "symlink":
        (bench / "link.png").symlink_to(outside)
    path = _jsonl_bench(bench, output_b=name)
    with pytest.raises(OutsideDatasetError, match=re.escape(f"{path}:1 output_b")):
        E.read_edit_benchmark(path)
    # a path through a subfolder that stays inside is fine
    (bench / "sub").mkdir()
    path = _jsonl_bench(bench, output_b="sub/../b.png")
    assert E.read_edit_benchmark(path)["output_b"][0].getpixel((0, 0)) == (50, 0, 0)


def test_parquet_shard_linked_from_outside_the_benchmark_folder_is_refused(tmp_path):
    _write_editreward_parquet(tmp_path / "bench/data/train-00000-of-00002.parquet", [_row()])
    _write_editreward_parquet(tmp_path / "elsewhere/x.parquet", [_row(keys=("m3", "m4"))])
    (tmp_path / "bench/data/train-00001-of-00002.parquet").symlink_to(tmp_path / "elsewhere/x.parquet")
    with pytest.raises(OutsideDatasetError, match="train-00001-of-00002.parquet"):
        E.read_edit_benchmark(tmp_path / "bench")
    # a shard linked within the folder is read
    (tmp_path / "bench/data/train-00001-of-00002.parquet").unlink()
    _write_editreward_parquet(tmp_path / "bench/raw/x.bin", [_row(keys=("m3", "m4"))])
    (tmp_path / "bench/data/train-00001-of-00002.parquet").symlink_to(tmp_path / "bench/raw/x.bin")
    assert len(E.read_edit_benchmark(tmp_path / "bench")) == 2


# -- case 2: an output id names one image --------------------------------------------------------


def test_parquet_output_id_reused_with_other_bytes_names_both_rows(tmp_path):
    rows = [_row(keys=("m1", "m2")), _row(keys=("m1", "m3"), outs=((7, 0, 0), (3, 0, 0)))]
    _write_editreward_parquet(tmp_path / "b.parquet", rows)
    with pytest.raises(ArtifactError, match=r"row 1: output id 'm1' .*row 0"):
        E.read_edit_benchmark(tmp_path / "b.parquet")
    # the same bytes under one id (one output in two rows) are fine: one decoded image
    rows[1]["output_images"][0] = _png((1, 0, 0))
    _write_editreward_parquet(tmp_path / "b.parquet", rows)
    bench = E.read_edit_benchmark(tmp_path / "b.parquet")
    assert bench.loc[0, "output_a"] is bench.loc[1, "output_a"]


def test_parquet_one_id_for_both_outputs_with_other_bytes_is_refused(tmp_path):
    _write_editreward_parquet(tmp_path / "b.parquet", [_row(keys=("m1", "m1"))])
    with pytest.raises(ArtifactError, match=r"row 0: output id 'm1' .*row 0"):
        E.read_edit_benchmark(tmp_path / "b.parquet")


# -- case 3: identical outputs are counted ---------------------------------------------------------


def test_identical_outputs_are_counted_in_the_report(tmp_path):
    rows = [_row(keys=("m1", "m2"), outs=((9, 0, 0), (9, 0, 0)), dimension="consistency"),  # same bytes
            _row(keys=("m3", "m4"), outs=((200, 0, 0), (50, 0, 0)), dimension="consistency"),  # a win
            _row(keys=("m5", "m6"), outs=((10, 0, 0), (20, 0, 0)), dimension="consistency")]  # a loss
    _write_editreward_parquet(tmp_path / "b.parquet", rows)
    bench = E.read_edit_benchmark(tmp_path / "b.parquet")
    assert list(bench["identical_outputs"]) == [True, False, False]
    acc = E.edit_accuracy(E.edit_scores(bench, _bench_scorer, templates="bench"))["consistency"]
    # every row counts, as in the benchmark's own calculate_statistics.py (a tie: lost strictly,
    # won with >=); the identical pairs and the accuracy without them are reported apart
    assert acc["n"] == 3 and acc["accuracy"] == pytest.approx(1 / 3) and acc["accuracy_ge"] == pytest.approx(2 / 3)
    assert acc["identical_outputs"] == 1
    assert acc["n_distinct"] == 2 and acc["accuracy_distinct"] == pytest.approx(1 / 2)


def test_identical_outputs_in_the_jsonl_layout(tmp_path):
    path = _jsonl_bench(tmp_path / "bench", output_b="a.png")
    bench = E.read_edit_benchmark(path)
    assert bench["identical_outputs"].tolist() == [True]
    acc = E.edit_accuracy(E.edit_scores(bench, _bench_scorer, templates="bench"))["consistency"]
    assert acc["identical_outputs"] == 1 and acc["n_distinct"] == 0 and acc["accuracy_distinct"] is None


# -- case 4: bad cells are named, when the benchmark is read ---------------------------------------


def _write_typed(path: Path, row: dict, input_type: pa.DataType) -> None:
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("key", pa.list_(pa.string())), ("instruction", pa.string()), ("input_image", input_type),
                        ("output_images", pa.list_(image)), ("task_type", pa.string()), ("dimension", pa.string())])
    pq.write_table(pa.Table.from_pylist([row], schema=schema), path)


@pytest.mark.parametrize("value, input_type, got", [
    (_png((0, 0, 0))["bytes"], pa.binary(), "bytes"),
    ("in.png", pa.string(), "str"),
    ([1, 2], pa.list_(pa.int64()), "list"),
], ids=["bytes", "string", "list"])
def test_parquet_input_image_that_is_no_image_cell_is_named(tmp_path, value, input_type, got):
    _write_typed(tmp_path / "b.parquet", _row(input_image=value), input_type)
    with pytest.raises(ArtifactError, match=re.escape("row 0: input_image must be an image cell") + f".*{got}"):
        E.read_edit_benchmark(tmp_path / "b.parquet")


def test_parquet_output_that_is_no_image_cell_and_bad_task_type_are_named(tmp_path):
    row = _row()
    row["output_images"][1] = {"bytes": None, "path": "/etc/passwd"}
    _write_editreward_parquet(tmp_path / "b.parquet", [row])
    with pytest.raises(ArtifactError, match=re.escape("row 0 output m2") + ".*no bytes"):
        E.read_edit_benchmark(tmp_path / "b.parquet")
    _write_editreward_parquet(tmp_path / "b.parquet", [_row(task_type=None)])
    with pytest.raises(ArtifactError, match=re.escape("row 0: task_type must be a string")):
        E.read_edit_benchmark(tmp_path / "b.parquet")


@pytest.mark.parametrize("line, message", [
    ("[1, 2]", ":1: expected a JSON object, got list"),
    (None, ":1 output_a: expected a relative file path, got 3"),
    ('"text"', ":1: expected a JSON object, got str"),
], ids=["list-row", "int-path", "string-row"])
def test_jsonl_rows_of_the_wrong_shape_are_named(tmp_path, line, message):
    path = _jsonl_bench(tmp_path / "bench", output_a=3)
    if line is not None:
        path.write_text(line + "\n")
    with pytest.raises(ArtifactError, match=re.escape(f"{path}{message}")):
        E.read_edit_benchmark(path)


@pytest.mark.parametrize("field, value, message", [
    ("instruction", ["make", "it"], "instruction must be a non-blank string"),
    ("task_type", 3, "task_type must be a string"),
    ("id", {"a": 1}, "id must be a string or an integer"),
])
def test_jsonl_fields_of_the_wrong_type_are_named(tmp_path, field, value, message):
    path = _jsonl_bench(tmp_path / "bench", **{field: value})
    with pytest.raises(ArtifactError, match=re.escape(f"{path}:1: {message}")):
        E.read_edit_benchmark(path)


# -- case 6: a pixel bound -------------------------------------------------------------------------


def test_benchmark_images_are_bounded(tmp_path):
    _write_editreward_parquet(tmp_path / "b.parquet", [_row()])
    with pytest.raises(ImageTooLargeError, match=re.escape("row 0 input_image") + ".*max_pixels=63"):
        E.read_edit_benchmark(tmp_path / "b.parquet", max_pixels=63)
    assert len(E.read_edit_benchmark(tmp_path / "b.parquet", max_pixels=64)) == 1
    path = _jsonl_bench(tmp_path / "bench")
    with pytest.raises(ImageTooLargeError, match=re.escape(f"{path}:1 input_image") + ".*max_pixels=63"):
        E.read_edit_benchmark(path, max_pixels=63)


def test_default_pixel_bound_is_the_gedit_importers():
    from paco.core.params import EditImportParams, RewardEvalParams

    assert RewardEvalParams().editreward_max_pixels == EditImportParams().max_pixels == 4096 * 4096
    assert E.EDITREWARD_MAX_PIXELS == EditImportParams().max_pixels


def test_default_bound_refuses_a_larger_image(tmp_path):
    buf = io.BytesIO()
    Image.new("L", (4097, 4096)).save(buf, format="PNG")  # one column more than 4096 x 4096
    row = _row(input_image={"bytes": buf.getvalue(), "path": None})
    _write_editreward_parquet(tmp_path / "b.parquet", [row])
    with pytest.raises(ImageTooLargeError, match="row 0 input_image"):
        E.read_edit_benchmark(tmp_path / "b.parquet")


# -- case 5 (reward_eval): every input read before any work, outputs written last --------------------


class _FakeJudge:
    """Stands in for the judge: scores each candidate by its red channel; counts loads."""

    loads = 0

    @classmethod
    def from_pretrained(cls, *a, **kw):
        cls.loads += 1
        return cls()

    def score(self, triples):
        return [float(b.getpixel((0, 0))[0]) / 255 for _, b, _ in triples]


def _stage_inputs(tmp_path: Path, bench_rows: list[dict], **reward_eval) -> list[str]:
    """Tiny ranking inputs, an EditReward-Bench Parquet benchmark, and a params file; the argv."""
    from paco.core.io import encode_image, write_parquet
    from test_evaluation import setup

    inst, panels, _ = setup(3)
    inst = inst.assign(split="test")
    write_parquet(tmp_path / "instances.parquet", inst)
    write_parquet(tmp_path / "panels.parquet",
                  pd.DataFrame({"panel_id": list(panels), "image": [encode_image(im) for im in panels.values()]}),
                  image_columns=["image"])
    write_parquet(tmp_path / "prompts.parquet", pd.DataFrame({"prompt_id": ["p0", "p1", "p2"], "global_prompt": ["x"] * 3}))
    _write_editreward_parquet(tmp_path / "bench/data/train.parquet", bench_rows)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["reward_eval"].update(edit_benchmark="editreward", editreward=str(tmp_path / "bench"), baselines=[],
                                 **reward_eval)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "out"
    out.mkdir()
    return ["--params", str(tmp_path / "params.yaml"), "--judge", "j", "--base", "b", "--clip", "c",
            "--instances", str(tmp_path / "instances.parquet"), "--panels", str(tmp_path / "panels.parquet"),
            "--prompts", str(tmp_path / "prompts.parquet"), "--edit-pairs", "none",
            "--editreward", str(tmp_path / "bench"), "--predictions", str(out / "predictions.parquet"),
            "--metrics", str(out / "metrics.json")]


@pytest.fixture()
def fake_judge(monkeypatch):
    import paco.judge.model

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(paco.judge.model, "Judge", _FakeJudge)
    _FakeJudge.loads = 0
    return _FakeJudge


@pytest.mark.parametrize("bad, reward_eval, message", [
    (lambda r: r.update(input_image="in.png"), {}, "row 0: input_image must be an image cell"),
    (lambda r: None, {"editreward_max_pixels": 63}, "row 0 input_image: image is 8x8 = 64 pixels"),
], ids=["string-input-image", "too-many-pixels"])
def test_reward_eval_refuses_a_bad_benchmark_before_any_work(tmp_path, fake_judge, caplog, bad, reward_eval,
                                                             message):
    from stages import reward_eval as stage

    argv = _stage_inputs(tmp_path, [_row()], **reward_eval)
    row = _row()
    bad(row)
    if isinstance(row["input_image"], str):  # a string column where EditReward-Bench has image cells
        _write_typed(tmp_path / "bench/data/train.parquet", row, pa.string())
    out = tmp_path / "out"
    (out / "predictions.parquet").write_bytes(b"the previous run's")
    (out / "report.json").write_text("{}")
    assert stage.main(argv) == 2
    assert message in caplog.text
    assert fake_judge.loads == 0  # no model loaded, no ranking done
    assert not (out / "report.json").exists() and not (out / "metrics.json").exists()
    assert (out / "predictions.parquet").read_bytes() == b"the previous run's"  # not written


def test_reward_eval_writes_predictions_and_reports_identical_outputs(tmp_path, fake_judge):
    from stages import reward_eval as stage

    rows = [_row(keys=("m1", "m2"), outs=((9, 0, 0), (9, 0, 0)), dimension="consistency"),
            _row(keys=("m3", "m4"), outs=((200, 0, 0), (50, 0, 0)), dimension="consistency")]
    argv = _stage_inputs(tmp_path, rows)
    assert stage.main(argv) == 0
    out = tmp_path / "out"
    assert len(pd.read_parquet(out / "predictions.parquet")) == 3 and fake_judge.loads == 1
    report = json.loads((out / "report.json").read_text())
    consistency = report["editing"]["judges"]["paco_reward"]["consistency"]
    assert consistency["identical_outputs"] == 1 and consistency["n"] == 2
    assert report["editing"]["identical_outputs"] == 1
    assert json.loads((out / "metrics.json").read_text())["editing"]["paco_reward"]["consistency"] == 0.5
