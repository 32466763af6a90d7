"""The comparison's figures (PNG, matplotlib's Agg backend): reward curves, standardised growth
per reward (the paper's Fig. 6 view) and eval reward against training wall time."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from paco.compare.artifacts import GrpoData
from paco.compare.growth import reward_names


def plot_grpo(data: Sequence[GrpoData], window: int, out: Path, subtask: str) -> list[str]:
    """Write ``reward_curves.png`` (training and eval reward per epoch), ``reward_growth.png``
    (standardised growth of each reward per epoch: the Fig. 6 view) and, when any experiment has
    timings, ``eval_vs_wall_time.png``. Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2), dpi=100)
    for d in data:
        ax[0].plot(d.train["epoch"], d.train["reward"], label=d.exp.name)
        ax[1].plot(d.eval["epoch"], d.eval["reward"], marker="o", label=d.exp.name)
    ax[0].set(title=f"{subtask}: training reward (train resolution)", xlabel="epoch", ylabel="weighted reward")
    ax[1].set(title=f"{subtask}: eval reward (eval resolution)", xlabel="epoch", ylabel="weighted reward")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward_curves.png")
    plt.close(fig)
    written.append("reward_curves.png")

    names = reward_names(data[0].train)
    fig, ax = plt.subplots(1, len(names), figsize=(3 * len(names), 3), dpi=100, squeeze=False)
    for i, k in enumerate(names):
        for d in data:
            t = d.train
            g = (t[f"{k}_mean"] - t[f"{k}_mean"].iloc[:window].mean()) / float(t[f"{k}_std"].iloc[0])
            ax[0, i].plot(t["epoch"], g, label=d.exp.name)
        ax[0, i].axhline(0, color="grey", lw=0.5)
        ax[0, i].set(title=k, xlabel="epoch", ylabel="growth (first-epoch std)" if i == 0 else None)
    ax[0, -1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward_growth.png")
    plt.close(fig)
    written.append("reward_growth.png")

    timed = [d for d in data if d.seconds]
    if timed:
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        for d in timed:
            cum = np.cumsum([d.seconds.get(e, np.nan) for e in range(1, int(d.eval["epoch"].max()) + 1)])
            x = [0.0 if e == 0 else cum[int(e) - 1] for e in d.eval["epoch"]]
            ax.plot(x, d.eval["reward"], marker="o", label=d.exp.name)
        ax.set(title=f"{subtask}: eval reward vs training wall time", xlabel="training seconds (logged epochs)",
               ylabel="weighted reward")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "eval_vs_wall_time.png")
        plt.close(fig)
        written.append("eval_vs_wall_time.png")
    return written
