"""Structured-output benchmark: JSON extraction with a schema through `verispec serve`,
plain decoding against the server's default speculation (docs/benchmarks.md, "Structured output").

Each prompt is a short profile in prose (generated from a fixed seed: names, ages, cities,
jobs, e-mail addresses and skills) and asks for it as JSON; every request sends the schema
as `response_format` json_schema, greedy, `--max-tokens` at most. The schema bounds every
string (maxLength), as strict schemas should: the small default model otherwise repeats
itself inside a string until `max_tokens` cuts the JSON short. A fresh server per
contender and repeat (`--spec none`, then default settings), one request at a time, the
contenders' order shuffled per repeat; tok/s is completion tokens over the requests' own
seconds. Every output is checked against the schema with `jsonschema`, and the two
contenders' outputs are compared prompt by prompt (greedy: they must be identical).
Prompts split by id: the tuning half warms each server up, the evaluation half is measured.

    .venv/bin/python bench/structured.py --out bench/results/structured-json-<machine>-<commit>.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402
from serving import serve_config  # noqa: E402
from verispec.bench.launch import launched_server  # noqa: E402
from verispec.bench.provenance import machine_info, software_versions  # noqa: E402

DATASET = "json-extraction"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
    },
    "required": ["name", "age", "city", "occupation", "email", "skills"],
    "additionalProperties": False,
}
_FIRST = ["Ada", "Grace", "Alan", "Katherine", "Linus", "Barbara", "Dennis", "Margaret", "Ken", "Frances"]
_LAST = ["Lovelace", "Hopper", "Turing", "Johnson", "Torvalds", "Liskov", "Ritchie", "Hamilton", "Thompson", "Allen"]
_CITIES = ["London", "New York", "Manchester", "Helsinki", "Boston", "Zurich", "Toronto", "Lyon", "Osaka", "Lisbon"]
_JOBS = ["software engineer", "data analyst", "nurse", "architect", "teacher", "pilot", "chemist", "librarian"]
_SKILLS = ["Python", "statistics", "negotiation", "welding", "French", "public speaking", "SQL", "drawing",
           "first aid", "accounting"]


def prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt id, user message) for n generated profiles."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        age, city, job = rng.randint(19, 78), rng.choice(_CITIES), rng.choice(_JOBS)
        skills = rng.sample(_SKILLS, rng.randint(2, 4))
        email = f"{first.lower()}.{last.lower()}@example.{rng.choice(['org', 'com', 'net'])}"
        text = (f"{first} {last} is {age} years old and works as a {job} in {city}. "
                f"{first} can be reached at {email} and is good at {', '.join(skills[:-1])} and {skills[-1]}.")
        out.append((str(i), f"Extract the person described below as JSON with the fields name, age, "
                            f"city, occupation, email and skills.\n\n{text}"))
    return out


def run_contender(mode: str, measured, warm, max_tokens: int) -> list[dict]:
    import jsonschema
    import openai

    args = "--spec none" if mode == "plain" else ""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    with launched_server(args) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        def ask(message: str):
            start = time.perf_counter()
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": message}],
                                               temperature=0, max_tokens=max_tokens, response_format=fmt)
            return r, time.perf_counter() - start
        for _, message in warm:
            ask(message)
        answers = []
        for pid, message in measured:
            r, seconds = ask(message)
            text = r.choices[0].message.content
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            answers.append({"prompt_id": pid, "text": text, "completion_tokens": r.usage.completion_tokens,
                            "seconds": seconds, "valid": valid, "finish_reason": r.choices[0].finish_reason})
    return answers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40, help="profiles generated; half are measured")
    ap.add_argument("--warmup", type=int, default=2, help="tuning-half prompts each server answers first")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    all_prompts = prompts(args.prompts, args.seed)
    measured = [p for p in all_prompts if common.prompt_half(DATASET, p[0]) == "eval"]
    warm = [p for p in all_prompts if common.prompt_half(DATASET, p[0]) == "tuning"][: args.warmup]
    runs: dict[str, list] = {"plain": [], "speculative": []}
    for repeat in range(args.repeats):
        order = list(runs)
        random.Random(f"{args.seed}:{repeat}").shuffle(order)
        for mode in order:
            answers = run_contender(mode, measured, warm, args.max_tokens)
            tps = sum(a["completion_tokens"] for a in answers) / sum(a["seconds"] for a in answers)
            runs[mode].append({"tokens_per_s": tps, "answers": answers})
            print(f"[structured] repeat {repeat} {mode}: {tps:.1f} tok/s, "
                  f"{sum(a['valid'] for a in answers)}/{len(answers)} valid", file=sys.stderr)
    ratios = [s["tokens_per_s"] / p["tokens_per_s"] for s, p in zip(runs["speculative"], runs["plain"])]
    identical = sum(a["text"] == b["text"] for a, b in zip(runs["speculative"][0]["answers"],
                                                          runs["plain"][0]["answers"]))
    summary = {mode: {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in reps),
                      "valid": sum(a["valid"] for r in reps for a in r["answers"]),
                      "answers": sum(len(r["answers"]) for r in reps)} for mode, reps in runs.items()}
    summary["speedup_median"] = statistics.median(ratios)
    summary["speedup_per_repeat"] = ratios
    summary["identical_outputs"] = f"{identical}/{len(measured)}"
    result = {"benchmark": "structured-json", "schema": SCHEMA, "args": vars(args) | {"out": str(args.out)},
              "configs": {"plain": serve_config("none", "").to_dict(), "speculative": serve_config("ngram", "").to_dict()},
              "machine": machine_info(), "software": software_versions(), "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
