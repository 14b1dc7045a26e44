"""Run the benchmark protocol against one server and write the evidence directory.

  out_dir/records.jsonl        one verispec.bench.request/v1 record per measured request
  out_dir/run.json             config, versions, git, machine, selection, counts, acceptance
  out_dir/metrics_before.prom  raw /metrics text before the measured passes (after warm-up)
  out_dir/metrics_after.prom   ... and after them; *.json beside them: parsed, labels kept

Protocol: warm-up requests on prompts disjoint from the measured ones (never recorded), then
`passes` passes over the measured prompts, each in its own seeded random order, with at most
`concurrency` conversations in flight. The run is complete only if every expected (pass, prompt,
turn) has an "ok" record; otherwise it is marked incomplete and the missing ones are listed.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from verispec.bench import metrics_scrape
from verispec.bench.client import ChatBackend, ChatRequest, OpenAIHTTPBackend, RequestError, StreamResult
from verispec.bench.datasets import BenchPrompt, Selection, load_datasets, select_prompts
from verispec.bench.measure import RequestContext, build_record
from verispec.bench.protocol.config import BenchConfig
from verispec.bench.provenance import git_info, machine_info, software_versions
from verispec.bench.records import RUN_SCHEMA, RecordWriter, validate_run_manifest

RECORDS_FILE = "records.jsonl"
RUN_FILE = "run.json"


class ProtocolError(RuntimeError):
    """The run cannot start (bad output dir, no model, ...)."""


@dataclass
class RunOutcome:
    """What a finished run produced and whether it is complete."""

    run_dir: Path
    manifest: dict
    missing: list[dict]

    @property
    def complete(self) -> bool:
        return self.manifest["status"] == "complete"


def _request_seed(seed: int, prompt: BenchPrompt, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{prompt.dataset}:{prompt.prompt_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def pass_order(measured: tuple[BenchPrompt, ...], seed: int, pass_index: int) -> list[BenchPrompt]:
    """The seeded random order of one pass (a different order per pass, same for every run)."""
    order = list(measured)
    random.Random(f"{seed}:order:{pass_index}").shuffle(order)
    return order


class _Run:
    """State of one run while its passes execute."""

    def __init__(self, config: BenchConfig, backend: ChatBackend, model: str, run_id: str,
                 writer: RecordWriter, progress: tqdm):
        self.config, self.backend, self.model, self.run_id = config, backend, model, run_id
        self.writer, self.progress = writer, progress
        self.ok_keys: set[tuple] = set()
        self.errors: list[dict] = []
        self.semaphore = asyncio.Semaphore(config.concurrency)

    def _request(self, prompt: BenchPrompt, messages: list[dict], turn: int) -> ChatRequest:
        seed = _request_seed(self.config.seed, prompt, turn) if self.config.request_seeds else None
        return ChatRequest(messages=tuple(messages), model=self.model,
                           max_tokens=self.config.max_tokens,
                           temperature=self.config.temperature, seed=seed,
                           extra_body=self.config.extra_body)

    async def conversation(self, prompt: BenchPrompt, pass_index: int, order_index: int) -> None:
        """Send every turn of `prompt`; turn i+1 includes the model's answer to turn i."""
        async with self.semaphore:
            messages = list(prompt.messages)
            failed = False
            for turn in range(prompt.num_turns):
                if turn > 0:
                    messages.append({"role": "user", "content": prompt.followups[turn - 1]})
                request = self._request(prompt, messages, turn)
                if failed:
                    result = StreamResult(start_unix=time.time(), error=RequestError(
                        "previous_turn_failed", f"turn {turn - 1} failed; turn {turn} not sent"))
                else:
                    result = await self.backend.chat(request)
                self._write(prompt, pass_index, order_index, turn, request, result)
                failed = failed or result.error is not None
                messages.append({"role": "assistant", "content": result.text})

    def _write(self, prompt, pass_index, order_index, turn, request, result) -> None:
        ctx = RequestContext(
            run_id=self.run_id, config_name=self.config.config_name, pass_index=pass_index,
            order_index=order_index, dataset=prompt.dataset, prompt_id=prompt.prompt_id,
            source_id=prompt.source_id, task=prompt.task, turn=turn, num_turns=prompt.num_turns,
            model=self.model, temperature=self.config.temperature,
            max_tokens=self.config.max_tokens, request_seed=request.seed)
        record = build_record(ctx, result)
        self.writer.write(record)  # SchemaError propagates: an invalid record fails the run
        key = (pass_index, prompt.dataset, prompt.prompt_id, turn)
        if record["status"] == "ok":
            self.ok_keys.add(key)
        else:
            self.errors.append({"pass_index": pass_index, "dataset": prompt.dataset,
                                "prompt_id": prompt.prompt_id, "turn": turn, **record["error"]})
        self.progress.update(1)
        self.progress.set_postfix(errors=len(self.errors))


async def _gather_or_cancel(coros) -> None:
    """Run coroutines concurrently; the first exception cancels the rest and propagates."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _warm_up(backend: ChatBackend, config: BenchConfig, model: str,
                   warmup: tuple[BenchPrompt, ...]) -> dict:
    """Send the warm-up prompts (first turn only); results are counted, never recorded."""
    failures = []
    for prompt in warmup:
        result = await backend.chat(ChatRequest(messages=prompt.messages, model=model,
                                                max_tokens=config.max_tokens,
                                                temperature=config.temperature,
                                                extra_body=config.extra_body))
        if result.error is not None:
            failures.append({"dataset": prompt.dataset, "prompt_id": prompt.prompt_id,
                             **result.error.to_dict()})
    return {"prompts": [{"dataset": p.dataset, "prompt_id": p.prompt_id} for p in warmup],
            "failures": failures}


def _prepare_out_dir(out_dir: Path) -> None:
    if (out_dir / RECORDS_FILE).exists() or (out_dir / RUN_FILE).exists():
        raise ProtocolError(f"{out_dir} already holds a run; choose a new --out directory "
                            "(results are never overwritten or appended to)")
    out_dir.mkdir(parents=True, exist_ok=True)


def _save_scrape(out_dir: Path, stem: str, s: metrics_scrape.Scrape | None) -> dict | None:
    if s is None:
        return None
    (out_dir / f"{stem}.prom").write_text(s.text, encoding="utf-8")
    (out_dir / f"{stem}.json").write_text(json.dumps(
        {"url": s.url, "unix_time": s.unix_time, "ok": s.ok, "http_status": s.http_status,
         "error": s.error, "samples": [x.to_dict() for x in s.samples]}, indent=1))
    return {"file": f"{stem}.prom", "parsed": f"{stem}.json", "ok": s.ok, "error": s.error,
            "unix_time": s.unix_time}


async def _scrape(config: BenchConfig) -> metrics_scrape.Scrape | None:
    if not config.scrape_metrics:
        return None
    url = config.metrics_url or metrics_scrape.metrics_url_for(config.base_url)
    async with httpx.AsyncClient() as client:
        return await metrics_scrape.scrape(client, url)


def expected_keys(selection: Selection, passes: int) -> list[tuple]:
    """Every (pass, dataset, prompt_id, turn) the run must complete."""
    return [(p, pr.dataset, pr.prompt_id, t) for p in range(passes)
            for pr in selection.measured for t in range(pr.num_turns)]


async def run_benchmark(config: BenchConfig, backend: ChatBackend | None = None,
                        api_key: str | None = None) -> RunOutcome:
    """Execute the whole protocol and write the evidence directory; see the module docstring."""
    out_dir = Path(config.out_dir)
    by_name, sources = load_datasets(config.dataset)
    selection = select_prompts(by_name, config.num_prompts, config.warmup, config.seed)
    _prepare_out_dir(out_dir)
    own_backend = backend is None
    backend = backend or OpenAIHTTPBackend(config.base_url, api_key, config.request_timeout_s,
                                           config.continuous_usage)
    try:
        return await _run(config, backend, out_dir, selection, sources, api_key is not None)
    finally:
        if own_backend:
            await backend.aclose()


async def _run(config, backend, out_dir, selection, sources, api_key_set) -> RunOutcome:
    server_models = await backend.list_models()
    model = config.model or (server_models[0] if server_models else None)
    if model is None:
        raise ProtocolError("--model not given and the server's /v1/models listed none")
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)
    started = time.time()
    warm = await _warm_up(backend, config, model, selection.warmup)
    before = await _scrape(config)
    expected = expected_keys(selection, config.passes)
    pass_wall = []
    with RecordWriter(out_dir / RECORDS_FILE) as writer, \
            tqdm(total=len(expected), disable=not config.progress, desc="bench", unit="req") as bar:
        run = _Run(config, backend, model, run_id, writer, bar)
        for pass_index in range(config.passes):
            t0 = time.perf_counter()
            order = pass_order(selection.measured, config.seed, pass_index)
            await _gather_or_cancel(run.conversation(p, pass_index, i) for i, p in enumerate(order))
            pass_wall.append(time.perf_counter() - t0)
    after = await _scrape(config)
    missing = [dict(zip(("pass_index", "dataset", "prompt_id", "turn"), k))
               for k in expected if k not in run.ok_keys]
    manifest = {
        "schema": RUN_SCHEMA, "run_id": run_id, "config_name": config.config_name,
        "status": "complete" if not missing else "incomplete",
        "started_unix": started, "finished_unix": time.time(),
        "config": config.to_dict(), "api_key_set": api_key_set,
        "model": model, "server_models": server_models,
        "versions": software_versions(), "git": git_info(), "machine": machine_info(),
        "datasets": [s.__dict__ for s in sources],
        "selection": {"measured": [{"dataset": p.dataset, "prompt_id": p.prompt_id,
                                    "source_id": p.source_id, "num_turns": p.num_turns}
                                   for p in selection.measured]},
        "warmup": warm,
        "counts": {"expected": len(expected), "completed": len(run.ok_keys),
                   "failed": len(run.errors), "records": writer.count},
        "missing": missing, "errors": run.errors, "pass_wall_s": pass_wall,
        "metrics": {"before": _save_scrape(out_dir, "metrics_before", before),
                    "after": _save_scrape(out_dir, "metrics_after", after),
                    "acceptance": (metrics_scrape.acceptance(before, after)
                                   if config.scrape_metrics else None)},
    }
    validate_run_manifest(manifest)
    (out_dir / RUN_FILE).write_text(json.dumps(manifest, indent=1, allow_nan=False))
    return RunOutcome(out_dir, manifest, missing)
