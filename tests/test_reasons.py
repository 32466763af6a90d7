"""reasons: instruction/theme join, resumable chunks, failures kept and counted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from paco.judge import reasons as R
from paco.core.io import ArtifactError, encode_image, write_parquet
from paco.judge.teachers import make_teacher
from paco.judge.teachers.base import TeacherResult
from paco.judge.response import parse_response


def tables(n_pairs=10):
    rng = np.random.default_rng(0)
    panels = pd.DataFrame(
        {
            "panel_id": [f"p{i}" for i in range(4)],
            "image": [encode_image(Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))) for _ in range(4)],
        }
    )
    pairs = pd.DataFrame(
        {
            "pair_id": [f"x{i:02d}" for i in range(n_pairs)],
            "instance_id": [f"i{i // 2}" for i in range(n_pairs)],
            "prompt_id": ["a" if i < 6 else "b" for i in range(n_pairs)],
            "split": ["train" if i < 6 else "test" for i in range(n_pairs)],
            "panel_a": [f"p{i % 4}" for i in range(n_pairs)],
            "panel_b": [f"p{(i + 1) % 4}" for i in range(n_pairs)],
            "label": [i % 2 == 0 for i in range(n_pairs)],
        }
    )
    prompts = pd.DataFrame({"prompt_id": ["a", "b"], "global_prompt": ["A red fox in snow", None]})
    return pairs, panels, prompts


def test_join_uses_theme_template_and_theme_free_fallback():
    pairs, panels, prompts = tables()
    t = R.join_pairs(pairs, panels, prompts)
    assert t["pair_id"].tolist() == sorted(pairs["pair_id"])
    assert '"A red fox in snow"' in t.loc[t.prompt_id == "a", "instruction"].iloc[0]
    assert t.loc[t.prompt_id == "b", "instruction"].iloc[0].startswith("Do the two images")


def test_missing_panel_names_the_pair():
    pairs, panels, prompts = tables()
    with pytest.raises(ArtifactError, match="pair x00: panel 'p0'"):
        R.join_pairs(pairs, panels[panels.panel_id != "p0"], prompts)


class CountingTeacher:
    """Wraps a teacher, counts explained pairs, can fail on a given pair or interrupt."""

    def __init__(self, fail=(), interrupt_after=None):
        self.inner = make_teacher({"backend": "template"})
        self.fail, self.interrupt_after, self.seen = set(fail), interrupt_after, 0

    def describe(self):
        return self.inner.describe()

    def explain(self, items):
        if self.interrupt_after is not None and self.seen >= self.interrupt_after:
            raise KeyboardInterrupt
        self.seen += len(items)
        out = self.inner.explain(items)
        return [TeacherResult(r.pair_id, False, [], "", "teacher said Maybe", 3, None) if r.pair_id in self.fail else r for r in out]


def test_resume_after_interruption_and_failures_are_kept(tmp_path):
    pairs, panels, prompts = tables()
    table = R.join_pairs(pairs, panels, prompts)
    progress = tmp_path / "progress"
    fp = "identity-1"
    assert R.prepare_progress(progress, fp) == 0
    with pytest.raises(KeyboardInterrupt):
        R.explain_pairs(table, CountingTeacher(interrupt_after=8), progress, chunk_size=4)
    assert R.prepare_progress(progress, fp) == 2  # two chunks of 4 were persisted
    teacher = CountingTeacher(fail={"x09"})
    sft = R.explain_pairs(table, teacher, progress, chunk_size=4)
    assert teacher.seen == 2, "a resumed run must only label the missing chunk"
    assert list(sft.columns) == R.SFT_COLUMNS and len(sft) == 10
    ok = sft[sft.status == "ok"]
    for r in ok.itertuples():
        label, reasons = parse_response(r.response)
        assert label == r.label and 1 <= len(reasons) <= 3
    # x09 is in the resumed chunk: its failure is recorded; chunks from before keep their rows
    assert sft.loc[sft.status == "failed", "pair_id"].tolist() == ["x09"]
    summary = R.summarise(sft)
    assert (summary["ok"], summary["failed"]) == (9, 1)


def test_failed_pair_is_recorded_not_relabelled(tmp_path):
    pairs, panels, prompts = tables()
    table = R.join_pairs(pairs, panels, prompts)
    R.prepare_progress(tmp_path, "fp")
    sft = R.explain_pairs(table, CountingTeacher(fail={"x01"}), tmp_path, chunk_size=64)
    row = sft.set_index("pair_id").loc["x01"]
    assert row.status == "failed" and row.error == "teacher said Maybe" and pd.isna(row.response)
    assert bool(row.label) is False  # the known label stays
    assert R.summarise(sft)["failed"] == 1


def test_another_run_identity_starts_over(tmp_path):
    R.prepare_progress(tmp_path, "old")
    (tmp_path / "chunk-00000.parquet").write_bytes(b"stale")
    assert R.prepare_progress(tmp_path, "old") == 1
    assert R.prepare_progress(tmp_path, "new") == 0
    assert not (tmp_path / "chunk-00000.parquet").exists()


def test_rank_instruction_ignores_the_theme():
    pairs, panels, prompts = tables()
    t = R.join_pairs(pairs, panels, prompts, instruction="rank")
    assert t["instruction"].nunique() == 1 and t["instruction"].iloc[0].startswith("Do the two images")


def test_corrupt_progress_chunk_is_discarded_and_redone(tmp_path, caplog):
    pairs, panels, prompts = tables()
    table = R.join_pairs(pairs, panels, prompts)
    R.prepare_progress(tmp_path, "fp")
    first = R.explain_pairs(table, CountingTeacher(), tmp_path, chunk_size=4)
    (tmp_path / "chunk-00001.parquet").write_bytes(b"PAR1 torn write")  # corrupt the middle chunk
    assert R.prepare_progress(tmp_path, "fp") == 3
    teacher = CountingTeacher()
    with caplog.at_level("WARNING", logger="paco"):
        again = R.explain_pairs(table, teacher, tmp_path, chunk_size=4)
    assert teacher.seen == 4, "only the corrupt chunk is explained again"
    assert "chunk-00001.parquet" in caplog.text and "discarding corrupt progress chunk" in caplog.text
    pd.testing.assert_frame_equal(again, first)


def test_chunk_with_other_pairs_or_columns_is_discarded(tmp_path):
    pairs, panels, prompts = tables()
    table = R.join_pairs(pairs, panels, prompts)
    R.prepare_progress(tmp_path, "fp")
    R.explain_pairs(table, CountingTeacher(), tmp_path, chunk_size=4)
    c0, c2 = tmp_path / "chunk-00000.parquet", tmp_path / "chunk-00002.parquet"
    c0.write_bytes(c2.read_bytes())  # a readable chunk holding another chunk's pairs
    pd.DataFrame({"pair_id": ["x08", "x09"]}).to_parquet(c2)  # result columns missing
    found = R.discard_invalid_chunks(table, tmp_path, chunk_size=4)
    assert [d["chunk"] for d in found] == ["chunk-00000.parquet", "chunk-00002.parquet"]
    assert "instead of its chunk's" in found[0]["reason"] and "missing column" in found[1]["reason"]
    assert not c0.exists() and not c2.exists()
    teacher = CountingTeacher()
    sft = R.explain_pairs(table, teacher, tmp_path, chunk_size=4)
    assert teacher.seen == 6 and sft["pair_id"].tolist() == table["pair_id"].tolist()


def test_corrupt_identity_marker_starts_over(tmp_path, caplog):
    R.prepare_progress(tmp_path, "fp")
    (tmp_path / "chunk-00000.parquet").write_bytes(b"x")
    (tmp_path / "run_identity.json").write_bytes(b'{"identity": "fp"')  # torn write
    with caplog.at_level("WARNING", logger="paco"):
        assert R.prepare_progress(tmp_path, "fp") == 0
    assert "run_identity.json is unreadable" in caplog.text
    assert json.loads((tmp_path / "run_identity.json").read_text()) == {"identity": "fp"}


# --------------------------------------------------------------------------------------------
# the stage under accelerate: chunks sharded over processes, one table whatever the count
# --------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _stage_inputs(tmp: Path) -> dict[str, Path]:
    from paco.data.edit_pairs import EDIT_PAIR_COLUMNS

    pairs, panels, prompts = tables(n_pairs=10)
    paths = {name: tmp / f"{name}.parquet" for name in ("pairs", "panels", "prompts", "edit_pairs")}
    write_parquet(paths["pairs"], pairs)
    write_parquet(paths["panels"], panels, image_columns=["image"])
    write_parquet(paths["prompts"], prompts)
    write_parquet(paths["edit_pairs"], pd.DataFrame({c: [] for c in EDIT_PAIR_COLUMNS}))
    # 10 pairs in chunks of 3: chunks 0..3, so 2 processes label 2 chunks each
    (tmp / "params.yaml").write_text("reasons: {chunk_size: 3, teacher: {backend: template, template: {size: 48}}}\n")
    return paths


def _launch_labels(processes: int, tmp: Path, paths: dict[str, Path], out: Path) -> str:
    cmd = ["accelerate", "launch", "--config_file", "workflow/accelerate/cpu.yaml", "--num_processes", str(processes),
           "-m", "stages.reasons", "--params", str(tmp / "params.yaml"), "--pairs", str(paths["pairs"]),
           "--panels", str(paths["panels"]), "--prompts", str(paths["prompts"]),
           "--edit-pairs", str(paths["edit_pairs"]), "--sft-import", str(tmp / "llamafactory"),
           "--progress", str(out / "progress"),
           "--out", str(out / "sft.parquet"), "--metrics", str(out / "metrics.json")]
    env = {**os.environ, "PACO_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stderr


def test_two_processes_write_the_one_process_table_byte_for_byte(tmp_path):
    paths = _stage_inputs(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    _launch_labels(1, tmp_path, paths, one)
    log = _launch_labels(2, tmp_path, paths, two)
    # each process explained its own chunks (n % 2 == rank), and only those
    assert "process 1/2 explained 2 chunks" in log and "process 2/2 explained 2 chunks" in log, log[-2000:]
    assert (one / "sft.parquet").read_bytes() == (two / "sft.parquet").read_bytes()
    assert (one / "metrics.json").read_bytes() == (two / "metrics.json").read_bytes()
    for n in range(4):
        name = f"chunk-{n:05d}.parquet"
        assert (one / "progress" / name).read_bytes() == (two / "progress" / name).read_bytes(), name
    report = json.loads((two / "report.json").read_text())
    assert report["run"]["processes"] == 2 and report["pairs"] == 10 and report["resumed_chunks"] == 0

    # resumed under another process count: 3 chunks kept, the lost one explained by its new owner
    (two / "progress" / "chunk-00001.parquet").unlink()
    (two / "sft.parquet").unlink()
    log = _launch_labels(1, tmp_path, paths, two)
    assert "process 1/1 explained 1 chunks" in log, log[-2000:]
    assert (one / "sft.parquet").read_bytes() == (two / "sft.parquet").read_bytes()
    assert json.loads((two / "report.json").read_text())["resumed_chunks"] == 3
