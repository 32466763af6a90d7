"""Data construction (paper §3.1): T2IS prompts (``prompts``, ``panel_prompts``), multi-panel
composites from photographs or a policy (``photos``, ``composites``), grids cut into sub-figures
(``subfigures``: where the cuts go; ``panels``: the panel table), ranking instances and Yes/No
pairs (``pairs``), and the editing items and their judge pairs (``edits``, ``edit_pairs``)."""
