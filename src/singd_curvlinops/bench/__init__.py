"""Benchmarks that compare this package with the reference release `singd`.

Run the structured-matrix micro-benchmark with
`python -m singd_curvlinops.bench.structures`.
"""
