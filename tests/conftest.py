"""Test-session settings.

One intra-op thread: the tests' tensors are tiny, and with two threads every small op
pays a cross-thread handoff (on a loaded two-core machine, a scheduler quantum each),
which made the statistical gates 5x slower without making anything more correct.
"""
import torch

torch.set_num_threads(1)
