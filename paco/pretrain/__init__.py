"""Pretraining of the embedded default's tiny models on the shipped photographs (issue 30):
``python -m paco.pretrain`` (:mod:`paco.pretrain.__main__`)."""
