"""PaCo-Reward, the pairwise consistency judge (paper §3): the chat layout of its requests
(``chat``; the prompt templates are :mod:`paco.core.templates`) and the format of its answers
(``response``), the CoT teachers and the reasons they write (``teachers``, ``reasons``; published SFT sets: ``sft_import``), the judge model and
its score P(Yes) (``model``), the first-token-weighted loss (``losses``), LoRA training
(``training``, with ``run``, ``sft_data``, ``lora``, ``batch_plan``, ``checkpointing``),
ConsistencyRank evaluation and its metrics (``evaluation``, ``metrics``), and the judge served
over the OpenAI API with its client (``serve``, ``client``)."""
