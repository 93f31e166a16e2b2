"""`assistgen bench`: latency tables for any model pair and prompt set, side by side with transformers.

Contract: `dataset` reads prompt sets (Spec-Bench / MT-bench JSONL); `runner` runs methods
interleaved per prompt through the one generation loop (and transformers' `generate()` for the
reference methods) and appends one record per prompt and method to a results file, skipping what
is already there; `report` turns records into figures, tables, one JSON line and plots.
"""
