"""Engine glue: the stage registry that renders dvc.yaml and defines the Snakemake rules."""
