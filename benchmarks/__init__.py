"""Speed, memory and GPU benchmarks of mmgeo, each run from the repository root as ``python -m benchmarks.NAME``
(``--help`` for its options); what they share lives in ``benchmarks.harness``. Not installed with the package."""
