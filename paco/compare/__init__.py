"""Compare DVC experiments of the pipeline: the paper's ablations and a report on them.

Two commands (console script ``paco-compare``, or ``python -m paco.compare``):

``paco-compare queue ABLATION... [--dry-run]``
    queues one ``dvc exp run --queue -n <name> -S <param>=<value> ... <stage>`` per named ablation
    (:data:`~paco.compare.ablations.ABLATIONS`; the stage: ``final_samples@<subtask>`` or
    ``reward_eval``); run them with ``dvc queue start -j 1`` (one worker: the stages use every
    core) and follow them with ``dvc queue status`` / ``dvc queue logs <name>``.

``paco-compare report [--exp NAME ...] [--out DIR] [--log NAME=PATH ...] [--commits N]``
    lists the experiments as ``dvc exp show --json`` does (DVC 3 schema, read in-process:
    :func:`paco.compare.experiments.exp_show`), takes the baseline commit (``HEAD``) and the
    chosen experiments (default: every finished one of ``HEAD``; ``--commits N``: also those run
    on the N-1 commits before it, compared with ``HEAD``), reads each one's plot CSVs and final samples
    from the DVC cache at its revision (``dvc.api.open``) and writes ``DIR/report.md`` (headline
    metrics, differences to the baseline, their significance) and PNG figures.

The ablations (paper sections as in docs/running.md, "The paper's ablations"):

=====================  ============================================================  =========
name                   what differs from the baseline                                question
=====================  ============================================================  =========
``resolution``         ``grpo.<subtask>.train.resolution`` = the subtask's eval       Fig. 4 /
                       resolution (full-resolution training; the default trains at     Table 5
                       a lower one: resolution-decoupled)
``aggregation``        ``grpo.<subtask>.aggregation.method=weighted_sum`` (the         Table 5 /
                       default: log-tame, eq. 2-4)                                    Fig. 6
``first_token_weight`` ``reward_train.first_token_weight=0.1`` (paper §3.1 alpha;     Table 2
                       the default weighs the first token like the others)
``cot``                ``reasons.teacher.fast=false`` (CoT reasons in the targets; the   Table 2
                       default trains on bare "Yes."/"No.")
=====================  ============================================================  =========

Statistics (all from ``scipy.stats``):

* final samples (``final_samples@<subtask>``: the same prompts and seeds in every experiment, so
  the LoRA samples pair up by ``(prompt_id, seed)``): per sample the weighted reward
  ``sum_k w_k r_k`` with the experiment's ``grpo.<subtask>.rewards`` weights (the definition of
  the trainer's ``reward`` column), experiment minus baseline: a paired t-test (``ttest_rel``)
  and a Wilcoxon signed-rank test (``wilcoxon``), both two-sided;
* training reward: the per-epoch mean training reward of the last ``window`` epochs of
  ``plots/train.csv``, experiment vs baseline: Welch's t-test (``ttest_ind``, ``equal_var=False``,
  two-sided); no pairing exists between epochs of two runs;
* the judge (``reward_eval``): per ranking instance the accuracy of the ``paco_reward`` scorer
  (:func:`paco.judge.metrics.rank_metrics`), paired by ``instance_id``: ``ttest_rel`` and
  ``wilcoxon``.

Reward ratio (our reading of the paper's Fig. 6 "reward ratio", made precise): for each reward
``k`` of ``plots/train.csv``, its standardised growth
``g_k = (mean(k_mean over the last W epochs) - mean(k_mean over the first W epochs)) / k_std(epoch 1)``
(the change of the per-epoch mean, in units of the reward's spread over the first epoch's
samples; scale-free, defined for rewards with negative means such as CLIP-T), and
``ratio = max_k |g_k| / min_k |g_k|``: 1 when every reward grows alike, large when one reward
dominates the optimisation (the imbalance log-tame aggregation is meant to reduce).

Wall time: the plot CSVs hold no timings (they are deterministic outputs), so the seconds per
training epoch come from the trainer's log lines (``epoch e/E: ... | 9.1 s``) of the
``grpo@<subtask>`` stage: ``dvc queue logs <name>`` for queued experiments, or files given with
``--log NAME=PATH`` (e.g. the output of ``dvc repro`` for the baseline). They are absent
(``n/a``) otherwise, and depend on the machine's load (:mod:`paco.compare.timings`).

Modules: :mod:`~paco.compare.ablations` (the ablations, the queue commands),
:mod:`~paco.compare.experiments` (``dvc exp show`` rows), :mod:`~paco.compare.artifacts` (outputs at a
revision), :mod:`~paco.compare.growth` (the reward ratio), :mod:`~paco.compare.timings` (epoch
seconds from logs), :mod:`~paco.compare.report` (tables, ``report.md``), :mod:`~paco.compare.plots`
(figures), :mod:`~paco.compare.cli` (``main``), :mod:`~paco.compare.errors`.
"""
