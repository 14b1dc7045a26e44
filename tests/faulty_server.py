"""`verispec serve` on the real engine with a fault injected from outside the product:
the target forward raises whenever a row of a request whose prompt contains POISON is in
the batch (prefill chunk or decode row). The HTTP tests start it as a subprocess:

    python tests/faulty_server.py --port 8123 [verispec serve flags]
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

if __name__ == "__main__":  # running as a script: make `verispec` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MARKER = "POISON"


def build_faulty_engine(config):
    """The engine for `config`, with its target forward poisoned (module level: it pickles)."""
    from verispec.engine.core import build_engine
    engine = build_engine(config)
    poisoned: set[str] = set()
    add_request, forward = engine.add_request, engine.target.forward

    def add(request_id, prompt_token_ids, *args, **kwargs):
        if MARKER in engine.tokenizer.decode(prompt_token_ids):
            poisoned.add(request_id)
        return add_request(request_id, prompt_token_ids, *args, **kwargs)

    def poisoned_forward(rows):
        tables = [engine.kv.block_table(rid) for rid in poisoned if rid in engine.kv]
        if any(row.block_table in tables for row in rows):
            raise RuntimeError(f"injected fault: a {MARKER} row is in the batch")
        return forward(rows)
    engine.add_request, engine.target.forward = add, poisoned_forward
    return engine


def main(argv: list[str] | None = None) -> int:
    from verispec.cli import main as cli_main
    from verispec.server import app

    real_serve = app.serve

    def serve(factory, args):  # the CLI's factory is partial(build_engine, config)
        return real_serve(functools.partial(build_faulty_engine, *factory.args), args)
    app.serve = serve
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
