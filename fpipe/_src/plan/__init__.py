"""Planning: `fpipe.plan`, dp x pp layouts, microbatches and schedules chosen from measurements.

The top layer (nothing in the data path imports it: `pipeline(f, plan=p)` calls `p.settings`).
`plan` (`Plan`; `fpipe.plan` is `plan.plan`, not re-exported here so that the module keeps its
name), `plan_cost` (what is measured, per-rank memory), `plan_measure` (measuring within a
budget, cached), `plan_tp` (tensor parallelism from the parameters' layout), `plan_table` (the
printed table) and `plan_verify` (the best candidates timed as real steps).
"""

from .plan import Plan

__all__ = ["Plan"]
