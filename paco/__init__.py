"""PaCo-RL pipeline library: ``core`` (the shared glue), ``data``, ``models``, ``judge``
(PaCo-Reward), ``grpo`` (PaCo-GRPO), ``compare`` and ``results`` (reporting)."""
