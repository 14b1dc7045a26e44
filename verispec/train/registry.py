"""Registered drafts: the target a trained draft belongs to, and where `make draft` puts it.

    <VERISPEC_CACHE, default ~/.cache/verispec>/drafts/<draft name>/
        config.json, model.safetensors, tokenizer.json, ...   (Hugging Face format)
        verispec_draft.json                                    written last: marks completion

`registered_draft(target)` is what `--spec draft` without `--draft-model` resolves to.
"""
from __future__ import annotations

from pathlib import Path

from verispec.model.fetch import cache_root
from verispec.model.registry import ModelNotFound

# target registry name -> draft name (its folder under <cache>/drafts/)
DRAFTS = {"smollm2-135m-instruct": "smollm2-135m-instruct-draft"}
MARKER = "verispec_draft.json"


def drafts_root() -> Path:
    return cache_root() / "drafts"


def draft_dir(target: str) -> Path:
    """Where the registered draft of `target` lives (whether or not it is trained yet)."""
    if target not in DRAFTS:
        raise ModelNotFound(f"no registered draft for {target!r}; registered targets: "
                            f"{', '.join(DRAFTS)} (or pass --draft-model DIR)")
    return drafts_root() / DRAFTS[target]


def registered_draft(target: str) -> str:
    """The trained draft directory of `target`, or ModelNotFound saying how to make it."""
    directory = draft_dir(target)
    if not (directory / MARKER).is_file():
        raise ModelNotFound(f"the draft of {target!r} is not trained yet ({directory} missing); "
                            "run `make draft` (or `verispec train-draft all`), or pass --draft-model")
    return str(directory)
