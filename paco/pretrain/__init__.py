"""Pretraining of the embedded default's tiny models on the shipped photographs, so that
their samples show their prompt's subject and their rewards carry signal:
``python -m paco.pretrain`` (:mod:`paco.pretrain.__main__`)."""
