"""PaCo-RL pipeline library: data construction, judge, policy, rewards, GRPO, metrics."""
