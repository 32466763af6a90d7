"""PaCo-Reward, the pairwise consistency judge (paper §3): prompt templates (``templates``), the
CoT teacher and its labels (``teacher``, ``labels``), the judge model and its score P(Yes)
(``model``), the first-token-weighted loss (``losses``), LoRA training (``training``),
ConsistencyRank evaluation and its metrics (``evaluation``, ``metrics``), and the judge served
over the OpenAI API with its client (``serve``, ``client``)."""
