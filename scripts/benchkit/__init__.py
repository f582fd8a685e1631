"""Benchmark instrumentation for `scripts/bench_*.py` and the tests that measure memory (imported as `benchkit`:
scripts/ is on sys.path when a script runs, and on pytest's `pythonpath`). Not part of the `hf_cfp` package."""
