"""The generators' benchmarks, the paper's own yardstick: T2IS-Bench (paper Table 3:
visual consistency, prompt alignment, aesthetics) and GEdit-Bench (paper Table 4: semantic
consistency, perceptual quality, overall), exact to the benchmarks' official evaluation code,
scored through any OpenAI-compatible evaluator.

* :mod:`paco.benchmark.t2is_bench`: the T2IS-Bench protocol (questions, panel pairs, aggregation).
* :mod:`paco.benchmark.gedit_bench`: the GEdit-Bench / VIEScore protocol (prompts, reply parser,
  SC / PQ / Overall and their aggregation).
* :mod:`paco.benchmark.evaluator`: the evaluator client (yes/no probabilities, text replies,
  expected scores from log-probs) with an answer cache keyed by evaluator, question and images.
* the ``benchmark@<subtask>`` stage's parts: :mod:`paco.benchmark.serving` (evaluators on a URL or
  served by the stage, only on a cache miss; the answer directory under the run identity),
  :mod:`paco.benchmark.t2is_run` and :mod:`paco.benchmark.gedit_run` (each protocol on
  ``final_samples``' samples: questions, answers, ``scores.parquet`` rows, metrics),
  :mod:`paco.benchmark.cases` (the cases, paired comparisons, the scores layout) and
  :mod:`paco.benchmark.tables` (``table.md`` with the paper's rows).
"""
