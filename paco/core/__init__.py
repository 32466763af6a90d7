"""The pipeline's glue, shared by both halves and importing nothing of the project: the params
schema (``params``), artifact I/O (``io``), the stage runner and launcher (``stage``,
``launch``), a stage's processes (``distributed``), run identity and checkpoints
(``run_identity``, ``checkpoints``), the fixed CPU code paths (``numerics``), the statistical
tests the stages report (``statistics``), the judge's prompt templates (``templates``) and named
seeds (``seeding``)."""
