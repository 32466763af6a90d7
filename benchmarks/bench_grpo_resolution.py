"""Benchmark resolution-decoupled training: wall-clock cost of a PaCo-GRPO epoch at two train
resolutions (paper §4.2: sample and train the 2x2 grid at 512, evaluate at 1024).

    python benchmarks/bench_grpo_resolution.py [--resolutions 128 256] [--epochs 3] \\
        [--models data/models] [--judge data/reward_merge/model] [--prompts data/prompts/prompts.parquet]

Uses the embedded default's ``grpo.t2is`` params with only ``train.resolution`` changed (eval
only at the start and the end, outside the per-epoch figures), the real rewards and the judge served by ``python -m paco.serving.server``. The models and
prompts default to a finished ``dvc repro``'s outputs; ``--build`` builds the tiny models and a
prompt table in a temp dir instead (the base judge then stands in for the merged one). Prints
seconds per epoch split into sampling, rewards and the policy update, and the ratio between the
two resolutions, each with the served rewards scored after sampling and overlapped with it
(``rollout.overlap_rewards``), and whether the two give the same LoRA bytes. Figures only:
nothing here asserts on speed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline

import yaml  # noqa: E402

from paco.models.clip import ClipScorer  # noqa: E402
from paco.core.run_identity import params_identity  # noqa: E402
from workflow.registry import member  # noqa: E402
from paco.grpo.trainer import train_grpo  # noqa: E402
from paco.core.io import read_parquet  # noqa: E402
from paco.serving.judge_client import JudgeClient  # noqa: E402
from paco.serving.local import LocalServer
from paco.core.params import GrpoSubtaskParams  # noqa: E402
from paco.grpo.rewards import RewardContext  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build(tmp: Path) -> tuple[Path, Path, Path]:
    """Run the ``models`` and ``prompts`` stages of the embedded default into ``tmp``."""
    from stages import models as models_stage
    from stages import prompts as prompts_stage

    params = str(ROOT / "params.yaml")
    if models_stage.main(["--params", params, "--out", str(tmp / "models"), "--metrics", str(tmp / "m.json")]):
        sys.exit("models stage failed")
    if prompts_stage.main(["--params", params, "--jsonl", str(ROOT / "data/raw/t2is_prompts.jsonl"),
                           "--out", str(tmp / "prompts.parquet"), "--metrics", str(tmp / "p.json")]):
        sys.exit("prompts stage failed")
    return tmp / "models", tmp / "models" / "judge_base", tmp / "prompts.parquet"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolutions", type=int, nargs=2, default=[128, 256])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--models", type=Path, default=ROOT / "data/models")
    ap.add_argument("--judge", type=Path, default=ROOT / "data/reward_merge/model")
    ap.add_argument("--prompts", type=Path, default=ROOT / "data/prompts/prompts.parquet")
    ap.add_argument("--build", action="store_true", help="build tiny models and prompts in a temp dir")
    args = ap.parse_args()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        if args.build:
            args.models, args.judge, args.prompts = build(Path(tmp))
        prompts = read_parquet(args.prompts)
        judge = params["judge_endpoint"]
        results = {}
        # the untrained base judge (--build) need not rank Yes/No in its top 20 first tokens
        top = 100_000 if args.build else judge["top_logprobs"]
        with LocalServer(args.judge, judge["served_model_name"], max_logprobs=top) as url:
            client = JudgeClient(url, judge["served_model_name"], concurrency=judge["concurrency"], top_logprobs=top)
            # as the stage's reward_context: the pickscore role's own model (paper: PickScore_v1)
            ctx = RewardContext(judge=client, clip=ClipScorer(args.models / "clip"),
                                pickscore=ClipScorer(args.models / "pickscore"),
                                instruction=judge["instruction"], split_method=params["subfigures"]["method"],
                                tolerance=params["subfigures"]["tolerance"])
            for res in args.resolutions:
                loras = []
                for overlap in (False, True):
                    raw = params["grpo"]["t2is"]
                    raw = {**raw, "epochs": args.epochs, "train": {**raw["train"], "resolution": res},
                           "eval": {**raw["eval"], "every": 10_000},
                           "rollout": {**raw["rollout"], "overlap_rewards": overlap}}
                    cfg = GrpoSubtaskParams.model_validate(raw)
                    h0 = client.health()
                    t0 = time.perf_counter()
                    identity = params_identity(member("grpo@t2is"), {"grpo.t2is": cfg.model_dump(mode="json"),
                                                             "judge_endpoint": judge,
                                                             "subfigures": params["subfigures"]})
                    lora = Path(tmp) / f"lora{res}-{overlap}"
                    m = train_grpo(cfg, prompts, args.models / "policy_t2is", ctx, identity=identity, lora_dir=lora,
                                   checkpoints_dir=Path(tmp) / f"ck{res}-{overlap}")["report"]
                    wall = time.perf_counter() - t0
                    h1 = client.health()
                    loras.append((lora / "pytorch_lora_weights.safetensors").read_bytes())
                    s = m["seconds"]
                    per = {k: s[k] / args.epochs for k in ("rollout", "reward", "train")}
                    results[res, overlap] = sum(per.values())
                    print(f"train resolution {res:5d}px, overlap {'on ' if overlap else 'off'}: "
                          f"{results[res, overlap]:6.2f} s/epoch  (rollouts {per['rollout']:.2f}, waiting for rewards "
                          f"{per['reward']:.2f} = {per['reward'] / results[res, overlap]:.0%}, update "
                          f"{per['train']:.2f}; {m['trajectories_per_epoch']} trajectories/epoch; wall {wall:.1f} s "
                          f"incl. setup and the first and final eval; judge: {h1['requests'] - h0['requests']} requests "
                          f"in {h1['forward_passes'] - h0['forward_passes']} forward passes)", flush=True)
                print(f"  LoRA with and without overlap: {'bit-identical' if loras[0] == loras[1] else 'DIFFERENT'}")
        lo, hi = args.resolutions
        for overlap in (False, True):
            print(f"epoch cost {hi}px / {lo}px, overlap {'on' if overlap else 'off'}: "
                  f"{results[hi, overlap] / results[lo, overlap]:.2f}x")


if __name__ == "__main__":
    main()
