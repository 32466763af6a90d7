"""PaCo-GRPO (paper §4): the Flow-GRPO SDE step (``sde``), the LoRA policies (``policies``), the
rewards and their context (``rewards``; the judge is reached through ``judge_endpoint``), group
advantages and multi-reward aggregation (``advantages``), the trainer (``trainer``: the loop, with
``run``, ``plan``, ``rollout``, ``losses``, ``ema``, ``evaluation``, ``checkpointing``, ``report``)
and the final samples with and without the LoRA (``final_samples``)."""
