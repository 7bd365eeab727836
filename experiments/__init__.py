"""Long training experiments (hours on a CPU), apart from the benchmarks, run from the repository root as
``python -m experiments.NAME``: ``compare`` (geometric model vs CLIP baseline, each at its best recipe, several seeds;
``compare_report`` writes its report, ``compare_table`` tabulates finished runs) and ``sweep_da`` (the attention-space
size). They use ``benchmarks.harness``; nothing in ``benchmarks`` imports them. Not installed with the package."""
