"""Ablation studies: ``spec`` (the study YAML), ``plan`` (variants x seeds, resolved and checked),
``runner`` and ``slurm`` (running each variant as its own process or job), ``run_folder_lock`` (one
writer per run folder), ``summary``, ``report`` and ``plots`` (the side-by-side report from run records)."""
