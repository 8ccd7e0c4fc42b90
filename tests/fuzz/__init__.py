"""A differential fuzzer for fpipe (issue 24): random programs x random settings, each compared
with the unsplit function under `torch.func` in float64. See docs/FUZZING.md.

`grammar` draws an `Example` from (seed, index); `check` runs it in this process and compares;
`dist` runs a batch of multi-rank examples in one torchrun launch; `shrink` reduces a failing
example; `python -m tests.fuzz` runs campaigns.
"""
