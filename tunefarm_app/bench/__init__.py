"""Benchmarks of tunefarm against its peers (`tunefarm bench ops`).

`ops` tunes the benchmark's operator set with tunefarm and TVM MetaSchedule at the same
trial budget, times the vendor libraries on the same inputs and prints the comparison;
see `tunefarm_app.bench.ops` for what is compared and how.
"""
