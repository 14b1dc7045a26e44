"""Test-session settings.

One intra-op thread: the tests' tensors are tiny, and with two threads every small op
pays a cross-thread handoff (on a loaded two-core machine, a scheduler quantum each),
which made the statistical gates 5x slower without making anything more correct.
OMP_NUM_THREADS=1 carries the same choice to every engine whose threads are not set (the
LLM API, and each server or CLI a test starts: they inherit it): `make test` runs two test
processes on two cores, so a two-thread engine would wait on its own barriers whenever
the other process runs. A test that needs more threads sets them.
"""
import os

import torch

os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
