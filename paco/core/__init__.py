"""The pipeline's glue, shared by both halves: the params schema (``params``), artifact I/O
(``io``), the stage runner (``stage``), run identity and checkpoints (``run_identity``,
``checkpoints``), named seeds (``seeding``) and HTTP retries (``http``)."""
