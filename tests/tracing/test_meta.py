"""Tracing a ~1B-parameter model built on the meta device allocates none of it.

The trace runs in a fresh subprocess so that `ru_maxrss` (the peak resident set, which never goes
down) measures this trace alone, not whatever the test session did before. It compiles the
pipelined value-and-grad program (`Pipelined._get`: trace, partition, split, schedule; no
execution) for a wide GPT-like stack of Linear layers whose fp32 weights would take ~4.3 GB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    import fpipe

    D, VOCAB, N_BLOCKS, SEQ = 4096, 1024, 8, 16


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(D)
            self.up = nn.Linear(D, 4 * D)
            self.down = nn.Linear(4 * D, D)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.ln(x))))


    class WideLM(nn.Module):
        def __init__(self, stages):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, D)
            self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
            self.head = nn.Linear(D, VOCAB, bias=False)
            self.every = N_BLOCKS // stages if stages else 0

        def forward(self, idx):
            x = self.tok(idx)
            for i, block in enumerate(self.blocks):
                x = block(x)
                if self.every and (i + 1) % self.every == 0 and i + 1 < N_BLOCKS:
                    x = fpipe.stage_boundary(x)
            return self.head(x)


    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


    def trace(marked, stages, microbatches):
        with torch.device("meta"):
            model = WideLM(stages if marked else None)
        fn, params = fpipe.functionalize(model)

        def loss(params, idx, targets):
            return F.cross_entropy(fn(params, idx).flatten(0, 1), targets.flatten())

        idx = torch.randint(0, VOCAB, (8, SEQ))
        piped = fpipe.pipeline(loss, stages=stages, microbatches=microbatches, schedule="1f1b")
        _, _, compiled = piped._get(params, (idx, idx), {}, (0,), False)  # compile only
        return {
            "n_params": sum(p.numel() for p in params.values()),
            "all_meta": all(p.is_meta for p in model.parameters()),
            "n_stages": compiled.staged.n_stages,
            "places": sorted(f"{k}{s}" for k, s in compiled.staged.programs),
        }


    before = peak_mb()
    out = {"marked": trace(True, 4, 4), "auto": trace(False, 4, 2)}
    out["peak_growth_mb"] = peak_mb() - before
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def traced():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr == "", proc.stderr[-4000:]  # no warnings either
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_meta_trace_allocates_no_parameters(traced):
    assert traced["marked"]["n_params"] > 1_000_000_000
    assert traced["marked"]["all_meta"] and traced["auto"]["all_meta"]
    # fp32 weights alone would be 4.3 GB (and their gradients as much again); one up-projection
    # is 256 MiB, so staying below that means not even one weight was allocated (~90 MB measured).
    assert traced["peak_growth_mb"] < 256, traced


@pytest.mark.parametrize("mode", ["marked", "auto"])
def test_meta_trace_has_the_expected_stages(traced, mode):
    assert traced[mode]["n_stages"] == 4
    assert traced[mode]["places"] == ["B0", "B1", "B2", "B3", "F0", "F1", "F2", "F3"]
