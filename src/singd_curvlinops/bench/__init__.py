"""Benchmarks that compare this package with the reference release `singd`.

- Training steps (`optimizer`, with `workloads`, `configurations`, `memory` and
  `report`): run with `singd-curvlinops bench`.
- Structured-matrix operations: run with
  `python -m singd_curvlinops.bench.structures`.
"""
