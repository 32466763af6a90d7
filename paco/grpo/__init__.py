"""PaCo-GRPO (paper §4): the Flow-GRPO SDE step (``sde``), the FLUX LoRA policy (``policy``),
the rewards (``rewards``; the judge is reached through ``judge_endpoint``), group advantages and
multi-reward aggregation (``advantages``), the trainer (``trainer``) and the final samples with and
without the LoRA (``final_samples``)."""
