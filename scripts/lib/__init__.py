"""Shared pieces of the scripts in `scripts/`: the results file format, the `--model` option, the daemon as a child
process, and the corpora and workloads the benchmarks measure on."""
