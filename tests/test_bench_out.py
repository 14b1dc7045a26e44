"""Every benchmark script (bench/ and bench/experiments/) that takes the shared flags writes its
result where --out says."""
from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_script_with_the_shared_flags_honours_out():
    """`common.add_common_args` gives every script an --out flag; a script that writes to its
    default path regardless leaves the result where nobody looks (a since-deleted script did,
    and its run was lost with the worktree it wrote into). `common.write_result` honours it."""
    scripts = [p for p in sorted(BENCH.rglob("*.py")) if p.name != "common.py" and "add_common_args" in p.read_text()]
    assert len(scripts) >= 6, [p.name for p in scripts]
    ignoring = [p.name for p in scripts if not re.search(r"args\.out\b|common\.write_result\(", p.read_text())]
    assert ignoring == []
