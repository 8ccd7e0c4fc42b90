"""Generation: `fpipe.generate`, a causal LM's decode pipelined with a K/V cache per stage.

Above `runtime`, `stages` and `tracing`; beside the training pipeline (it uses none of it).
`generate` (the API; `fpipe.generate` is `generate.generate`, not re-exported here so that the
module keeps its name), `generate_check` (refusals), `generate_settings` (the settings
allowlist), `decode` (the step traced and cut at decoder blocks), `decode_traces` (traces kept
by key, the K/V layout), `kv_cache` (`SlotCache`; imports transformers, so nothing imports it at
`import fpipe`), `kv_writes` (cache writes in place), `decode_run` (the (step, microbatch) loop)
and `generate_sample` (argmax or seeded draws). Nothing above imports this package.
"""

__all__: list[str] = []
