"""Benchmark the judge: scoring throughput batched versus one pair at a time, in process and
through the served judge (per ``--batching`` mode), and the LoRA training time per optimizer step.

    python benchmarks/bench_judge.py [--judge data/reward_merge/model] [--pairs 64] [--batch 16]
        [--modes dynamic,same_shape,single] [--threads 0] [--skip-train]

Uses a judge directory (default: the embedded default's merged judge; ``--build`` builds the
untrained tiny one in a temp dir, whose first tokens need not rank Yes/No in the top 20, so the
server then returns every token's log-prob and the HTTP figures include that much larger JSON)
and pairs of 128 px panels cut from ``photos`` composites, with the embedded default's
instruction. Prints pairs per second for: in-process ``Judge.score`` with batch 1 and
with ``--batch``; the HTTP server (``python -m paco.serving.server``) hit one request at a time and with
``--batch`` concurrent requests, once per server ``--batching`` mode, with whether the
concurrent run's scores are bit-identical to the one-at-a-time run's (the batch invariance that
GRPO's reproducibility needs; ``dynamic`` is not invariant); and seconds per training step of
``reward_train`` (LoRA from params, first-token-weighted loss, AdamW) at its batch size.
``--mixed`` alternates three instructions of different lengths over the pairs (as GRPO's
concurrent requests of different prompts would), so the ``same_shape`` mode cannot batch them
all; ``--square`` resizes every panel to 128x128 px (the panels of one evenly divided GRPO
grid share a size), so with one instruction every request has the same shape. Figures only:
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

import torch  # noqa: E402

from paco.core.params import load_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def panels(n_pairs: int) -> list[tuple]:
    """``n_pairs`` (panel, panel) pairs from photo composites of the embedded prompt set."""
    from paco.core.io import decode_image
    from paco.data.photos import render_composites
    from paco.data.prompts import read_t2is_jsonl
    from paco.data.subfigures import crop_panels, split_grid

    params = load_params(ROOT / "params.yaml")
    prompts = read_t2is_jsonl(ROOT / "data/raw/t2is_prompts.jsonl")
    comps = render_composites(prompts.head(max(2, n_pairs // 8)), params.composites.photos, 4, 0)
    cut = []
    layout = prompts.set_index("prompt_id")[["rows", "cols"]]
    for row in comps.to_dict("records"):
        im = decode_image(row["image"])
        r, c = layout.loc[row["prompt_id"]]
        cut.append(crop_panels(im, split_grid(im, int(r), int(c))))
    pairs = []
    for ps in cut:
        for k in range(1, len(ps)):
            pairs.append((ps[0], ps[k]))
    return (pairs * (n_pairs // max(len(pairs), 1) + 1))[:n_pairs]


def rate(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", type=Path, default=ROOT / "data/reward_merge/model")
    ap.add_argument("--build", action="store_true", help="build the tiny judge in a temp dir")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="dynamic,same_shape,single", help="server --batching modes to time")
    ap.add_argument("--threads", type=int, default=0, help="the server's torch threads (0: torch's default)")
    ap.add_argument("--mixed", action="store_true", help="three instructions of different lengths")
    ap.add_argument("--skip-train", action="store_true", help="skip the reward_train step timing")
    ap.add_argument("--square", action="store_true", help="resize every panel to 128x128 px")
    args = ap.parse_args()
    from paco.judge.model import Judge
    from paco.serving.judge_client import JudgeClient
    from paco.serving.local import LocalServer
    from paco.core.templates import judge_instruction

    params = load_params(ROOT / "params.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        top = 20
        if args.build:
            from paco.models.fetch import materialise

            args.judge = materialise("judge_base", "tiny:qwen2_5_vl", Path(tmp) / "judge", seed=0)
            top = 100_000
        text = judge_instruction(None) if params.reasons.instruction == "rank" else judge_instruction("a set of photos")
        texts = [text, judge_instruction("a red fox"), judge_instruction("a long street of houses at dusk in rain")]
        pairs = panels(args.pairs)
        if args.square:
            pairs = [(a.resize((128, 128)), b.resize((128, 128))) for a, b in pairs]
        triples = [(a, b, texts[i % 3] if args.mixed else text) for i, (a, b) in enumerate(pairs)]
        judge = Judge.from_pretrained(args.judge, batch_size=1)
        judge.score(triples[:2])  # warm-up
        one = rate(lambda: judge.score(triples), len(triples))
        judge.batch_size = args.batch
        batched = rate(lambda: judge.score(triples), len(triples))
        print(f"in process   batch 1: {one:7.1f} pairs/s   batch {args.batch}: {batched:7.1f} pairs/s "
              f"({batched / one:.1f}x)")
        for mode in args.modes.split(","):
            with LocalServer(args.judge, "bench", max_batch_size=args.batch, max_logprobs=top,
                                  batching=mode, threads=args.threads) as url:
                serial = JudgeClient(url, "bench", concurrency=1, top_logprobs=top)
                serial.score(triples[:2])
                alone: list[float] = []
                s1 = rate(lambda: alone.extend(serial.score(triples)), len(triples))
                conc = JudgeClient(url, "bench", concurrency=args.batch, top_logprobs=top)
                h0 = conc.health()  # the server's counters are lifetime totals: report this run's share
                together: list[float] = []
                s2 = rate(lambda: together.extend(conc.score(triples)), len(triples))
                h1 = conc.health()
                diff = max(abs(x - y) for x, y in zip(alone, together, strict=True))
                print(f"served {mode:10s} 1 in flight: {s1:7.1f} pairs/s   {args.batch} in flight: {s2:7.1f} "
                      f"pairs/s ({s2 / s1:.1f}x one in flight, {s2 / batched:.2f}x in process batch {args.batch}; "
                      f"{h1['requests'] - h0['requests']} requests in "
                      f"{h1['forward_passes'] - h0['forward_passes']} forward passes, largest {h1['max_batch']}); "
                      f"scores {'bit-identical' if alone == together else f'differ by up to {diff:.2e}'} "
                      f"batched vs alone")
        if args.skip_train:
            return

        # training step time of reward_train (LoRA, first-token-weighted loss, AdamW)
        from paco.judge.model import check_answer_tokens, encode_sft
        from paco.judge.losses import first_token_weighted_loss
        from paco.models.loading import load_judge
        from paco.judge.lora import apply_lora
        from paco.judge.response import format_response

        cfg = params.reward_train
        model, processor = load_judge(args.judge)
        check_answer_tokens(processor.tokenizer)
        model = apply_lora(model, cfg.lora)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
        rows = [(a, b, t, format_response(i % 2 == 0, None if params.reasons.teacher.fast else ["The two panels match."]))
                for i, (a, b, t) in enumerate(triples[:cfg.batch_size])]
        batch = encode_sft(processor, rows)
        times = []
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            loss = first_token_weighted_loss(logits[:, :-1], batch["labels"][:, 1:], cfg.first_token_weight,
                                             cfg.loss_variant)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        times = sorted(times[1:])
        print(f"reward_train step (batch {cfg.batch_size}, LoRA r{cfg.lora.rank}): median {times[len(times) // 2]:.3f} s"
              f" (min {times[0]:.3f}, max {times[-1]:.3f}; torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
