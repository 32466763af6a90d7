"""The parts of the GPU smoke run; ``benchmarks/gpu_smoke.py`` is its command and runs them in order.

* :mod:`smoke.run`: the sizes per device, the paper preset scaled to them, the models and the
  state every step shares;
* :mod:`smoke.judge_steps`: judge SFT, merge, the in-process reference scores, the served judges;
* :mod:`smoke.policy_steps`: one GRPO epoch and final sampling;
* :mod:`smoke.budget`: the time budget and the per-stage seconds and CUDA memory;
* :mod:`smoke.report`: the checks the GPU tests assert and the printed table;
* :mod:`smoke.inputs`: the synthetic panel pairs and prompts.
"""
