"""verispec replicas on Ray Serve (verispec/ray/), on a real local Ray cluster started here:
two replicas of the embedded default model, one thread each, behind the front door and
PrefixAffinityRouter; real HTTP, the openai client, /metrics read with prometheus_client.

- streamed and non-streamed answers, chat and completions, equal whichever replica serves;
  a client that leaves a stream aborts its request on the replica;
- requests sharing a long prefix all go to one replica, whose prefix cache then serves
  them (its own metrics say so), routed by the block keys that replica reports from its
  cache, which are the keys the front door computes; unrelated concurrent requests spread;
- /metrics labels every sample with its replica, /metrics/aggregate sums them;
- SIGKILL of a replica's process: its streams end with an error event, the other
  replica's streams finish, later requests succeed, and Ray starts a new replica; SIGKILL
  of a replica's engine process: its stream ends with the engine's error, and the replica
  is replaced too.

One cluster for the module (starting it and the replicas is most of the time). The pure
routing rule is tested without Ray at the end of the file.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from verispec.ray.prefix_index import PrefixIndex, RoutingRule

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'verispec[ray]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'verispec[ray]')")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
SHARED = ("You are a careful assistant who answers questions about the history of science. "
          "Keep every answer short, cite the century, and never invent sources. ") * 8
ROUTED_TTL_S = 1.0   # short, so that a test can wait for routing by the replicas' reports alone
UNRELATED = ["Describe the water cycle in", "List three prime numbers and", "Explain how a bicycle gear",
             "Write a haiku about winter", "What is the capital city of", "Give a recipe for pancakes",
             "Summarize the plot of Hamlet", "How do bees make honey and"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """Ray + Serve with 2 replicas x 1 thread; yields the base URL; shuts everything down."""
    from verispec.config import EngineConfig
    from verispec.ray.app import APP_NAME, ReplicaConfig, build_app, resolve_engine
    from verispec.server.app import ServerConfig

    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = resolve_engine(EngineConfig(model=MODEL, threads=1), replicas=2, cluster_gpus=0)
        server = ServerConfig(port=port, log_level="warning", access_log=False, shutdown_timeout_s=2)
        config = ReplicaConfig(2, router_kwargs={"routed_ttl_s": ROUTED_TTL_S})
        serve.run(build_app(engine, server, config), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


async def complete(c: openai.AsyncOpenAI, prompt: str, max_tokens: int = 8, **kw) -> tuple[str, str]:
    """(replica, text) of a greedy completion."""
    raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0, **kw)
    return raw.headers["x-verispec-replica"], raw.parse().choices[0].text


def per_replica(url: str, name: str) -> Counter:
    """replica -> value of sample `name` summed over its other labels (GET /metrics)."""
    out: Counter = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["replica"]] += s.value
    return out


def replicas_described() -> dict[str, dict]:
    """The live replicas' describe() (a replica that just died may still be asked: skipped)."""
    from verispec.ray.app import APP_NAME
    handle = serve.get_deployment_handle("VerispecReplica", APP_NAME)
    answers = handle.broadcast("describe").results(timeout_s=30, return_exceptions=True)
    return {d["replica"]: d for d in answers if isinstance(d, dict)}


def cached_keys_reported() -> dict[str, set[int]]:
    """replica -> the block keys its routing stats report (what PrefixAffinityRouter reads)."""
    from verispec.ray.app import APP_NAME
    from verispec.ray.prefix_index import STATS_KEY, unpack_keys
    handle = serve.get_deployment_handle("VerispecReplica", APP_NAME)
    reports = [r[STATS_KEY] for r in handle.broadcast("record_routing_stats").results(timeout_s=30) if r]
    return {r["replica"]: set(unpack_keys(r["keys"])) for r in reports}


def front_door_keys(prompt: str) -> tuple[list[int], int]:
    """(the block keys the front door sends with a completion request for `prompt`, the
    replicas' KV block size)."""
    import json

    from verispec.cache.events import block_keys
    from verispec.ray.app import APP_NAME
    from verispec.ray.bridge import routing_token_ids
    handle = serve.get_deployment_handle("VerispecReplica", APP_NAME)
    tokenizer, block_size = handle.routing_info.remote().result(timeout_s=30)
    body = json.dumps({"model": MODEL, "prompt": prompt}).encode()
    return block_keys(routing_token_ids("/v1/completions", body, tokenizer, False), block_size), block_size


def wait_for_replacement(gone: str, timeout_s: float = 90) -> dict[str, dict]:
    """Wait until Ray runs two replicas again, `gone` not among them."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = replicas_described()
        if (len(now) == 2 and gone not in now) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def test_streamed_and_plain_answers_are_equal_through_the_front_door(cluster):
    async def scenario():
        c = client(cluster)
        messages = [{"role": "user", "content": "Name a color."}]
        plain = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == plain.choices[0].message.content and streamed
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
        completion = await c.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0,
                                                stream=True)
        assert "".join([ch.choices[0].text async for ch in completion])
        models = await c.models.list()
        assert [m.id for m in models.data] == [MODEL]
    asyncio.run(scenario())
    health = httpx.get(f"{cluster}/health", timeout=30).json()
    assert health["status"] == "ok" and health["replicas_ok"] == 2


def test_a_client_that_leaves_a_stream_aborts_its_request_on_the_replica(cluster):
    aborted = per_replica(cluster, "verispec:request_aborted_total")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        replica = response.headers["x-verispec-replica"]
        next(response.iter_lines())   # the stream has begun; then the client goes away
    deadline = time.monotonic() + 20   # far less than the 400 tokens would take
    while per_replica(cluster, "verispec:request_aborted_total")[replica] == aborted[replica]:
        assert time.monotonic() < deadline, "the replica did not abort the request"
        time.sleep(0.1)


def test_unrelated_concurrent_requests_spread_over_both_replicas(cluster):
    async def scenario():
        c = client(cluster)
        return await asyncio.gather(*(complete(c, p, max_tokens=24, extra_body={"ignore_eos": True})
                                      for p in UNRELATED))
    before = per_replica(cluster, "vllm:request_success_total")
    served = Counter(replica for replica, _ in asyncio.run(scenario()))
    after = per_replica(cluster, "vllm:request_success_total")
    assert len(served) == 2 and min(served.values()) >= 2, served
    assert {r: after[r] - before[r] for r in after} == served   # each replica's metrics agree


def test_requests_sharing_a_long_prefix_land_on_the_replica_that_caches_it(cluster):
    """The first request goes where load says; once its routed-prompt note has expired, the
    others follow it only because that replica's own cache report holds the prefix (without
    the report they would go to the other replica, which holds less). The front door names
    the prefix by the keys that replica's cache reports."""
    from verispec.ray.app import ROUTING_STATS_PERIOD_S
    hits_before = per_replica(cluster, "vllm:prefix_cache_hits_total")
    done_before = per_replica(cluster, "vllm:request_success_total")
    shared = httpx.post(f"{cluster}/tokenize", json={"prompt": SHARED}, timeout=30).json()["count"]
    keys, block = front_door_keys(SHARED + "Question 9: who?")
    keys = keys[:shared // block - 1]   # whole blocks of SHARED
    home, _ = asyncio.run(complete(client(cluster), SHARED + "Question 0: who first measured the speed of light?"))
    deadline = time.monotonic() + 30
    while not set(keys) <= cached_keys_reported().get(home, set()):   # the cache has reported it
        assert time.monotonic() < deadline, "the home replica never reported the prefix's keys"
        time.sleep(0.2)
    time.sleep(ROUTED_TTL_S + 3 * ROUTING_STATS_PERIOD_S)   # the note expired; the report reached the router

    async def rest():
        c = client(cluster)
        return [await complete(c, SHARED + f"Question {i}: who discovered element {i}?") for i in range(1, 5)]
    assert {replica for replica, _ in asyncio.run(rest())} == {home}
    hits = per_replica(cluster, "vllm:prefix_cache_hits_total")
    done = per_replica(cluster, "vllm:request_success_total")
    # hits are whole blocks; the last shared token may merge with the question's first
    assert hits[home] - hits_before[home] >= 4 * (shared - 2 * block)
    assert {r: done[r] - done_before[r] for r in done} == {**{r: 0 for r in done}, home: 5}
    reported = cached_keys_reported()
    assert len(keys) >= 4 and not set(keys) & set().union(*(v for r, v in reported.items() if r != home))


def test_metrics_are_labelled_per_replica_and_aggregate_to_the_single_server_format(cluster):
    asyncio.run(complete(client(cluster), SHARED + "Warm the prefix cache's counters."))   # queries > 0
    labelled = per_replica(cluster, "vllm:prompt_tokens_total")
    assert len(labelled) == 2
    aggregate = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(f"{cluster}/metrics/aggregate", timeout=30).text) for s in f.samples if "replica" not in s.labels}
    assert aggregate["vllm:prompt_tokens_total"] == sum(labelled.values())
    hits, queries = aggregate["vllm:prefix_cache_hits_total"], aggregate["vllm:prefix_cache_queries_total"]
    assert aggregate["verispec:prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    assert set(per_replica(cluster, "vllm:num_requests_waiting")) == set(labelled)


async def _stream(url: str, prompt: str, log: dict) -> None:
    """Stream a long completion, recording its replica, its chunks and how it ended."""
    c = client(url)
    raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=96,
                                                        temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True})
    log["replica"] = raw.headers["x-verispec-replica"]
    log["chunks"] = 0
    try:
        async for chunk in raw.parse():
            log["chunks"] += 1
            log["finish"] = chunk.choices[0].finish_reason if chunk.choices else log.get("finish")
    except openai.APIError as exc:
        log["error"] = str(exc)


def test_a_killed_replica_fails_its_streams_and_the_rest_go_on(cluster):
    described = replicas_described()
    logs = [dict() for _ in range(4)]

    async def scenario():
        tasks = [asyncio.ensure_future(_stream(cluster, f"{p} and why? Tell me more.", log))
                 for p, log in zip(UNRELATED, logs)]
        deadline = time.monotonic() + 60
        while not all(log.get("chunks") for log in logs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        victims = Counter(log["replica"] for log in logs)
        assert len(victims) == 2, victims   # both replicas have streams in flight
        victim = logs[0]["replica"]
        os.kill(described[victim]["pid"], signal.SIGKILL)
        await asyncio.gather(*tasks)
        return victim
    victim = asyncio.run(scenario())
    for log in logs:
        if log["replica"] == victim:
            assert "the replica serving this request failed" in log.get("error", ""), log
        else:
            assert "error" not in log and log["finish"] == "length", log

    async def later():
        c = client(cluster)
        return [await complete(c, p) for p in UNRELATED[:4]]
    assert all(text for _, text in asyncio.run(later()))
    now = wait_for_replacement(victim)
    assert len(now) == 2 and victim not in now, now
    assert httpx.get(f"{cluster}/health", timeout=30).json()["replicas_ok"] == 2


def test_a_replica_whose_engine_process_dies_fails_its_stream_and_is_replaced(cluster):
    described = replicas_described()
    log: dict = {}

    async def scenario():
        task = asyncio.ensure_future(_stream(cluster, "Count slowly from one to one hundred:", log))
        deadline = time.monotonic() + 60
        while not log.get("chunks") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        os.kill(described[log["replica"]]["engine_pid"], signal.SIGKILL)
        await task
    asyncio.run(scenario())
    assert "SIGKILL" in log.get("error", ""), log      # the engine's own cause reaches the client
    now = wait_for_replacement(log["replica"])
    assert len(now) == 2 and log["replica"] not in now, now


# ---------------------------------------------------------------------------- the rule alone
def test_rule_prefers_the_longest_match_within_the_imbalance_and_spreads_otherwise():
    from verispec.cache.events import block_keys
    index, bs = PrefixIndex(), 4
    rule = RoutingRule(min_match_tokens=16, max_imbalance=2)
    prompt = list(range(40))
    index.update_cached("a", 1, block_keys(prompt, bs))                              # a's report
    keys = block_keys(prompt[:20] + [99] * 8, bs)                                     # 5 blocks shared
    assert index.decide(keys, bs, {"a": 2, "b": 0}, rule).ranked == ["a", "b"]       # match wins
    assert index.decide(keys, bs, {"a": 2, "b": 0}, rule).matched_tokens == 20
    assert index.decide(keys, bs, {"a": 3, "b": 0}, rule).reason == "imbalanced"     # too busy
    assert index.decide(keys, bs, {"a": 3, "b": 0}, rule).ranked[0] == "b"
    short = block_keys(prompt[:12], bs)                                               # 12 < 16 tokens
    assert index.decide(short, bs, {"a": 0, "b": 0}, rule).ranked[0] == "b"          # fewer held
    index.remove("a")
    assert index.decide(keys, bs, {"a": 0, "b": 1}, rule).reason == "short_match"    # forgotten


def test_a_replicas_report_replaces_what_it_holds_and_routed_prompts_count_until_they_expire():
    """What a replica reports is the truth (an evicted prefix stops attracting requests);
    a prompt just routed counts for `routed_ttl_s`, until a report can include it."""
    from verispec.cache.events import block_keys
    index, bs, rule = PrefixIndex(routed_ttl_s=10), 4, RoutingRule(min_match_tokens=8)
    old, new = block_keys(list(range(16)), bs), block_keys(list(range(100, 116)), bs)
    index.update_cached("a", 1, old)
    index.note_routed("b", new, now=0.0)
    assert index.decide(old, bs, {"a": 1, "b": 0}, rule, now=1.0).ranked[0] == "a"
    assert index.decide(new, bs, {"a": 0, "b": 1}, rule, now=1.0).ranked[0] == "b"   # routed, not reported yet
    assert index.decide(new, bs, {"a": 0, "b": 1}, rule, now=11.0).reason == "short_match"   # expired
    index.update_cached("a", 2, new)                                                  # a evicted `old`
    assert index.matched_blocks("a", old) == 0 and index.matched_blocks("a", new) == 4
    assert index.version("a") == 2 and index.version("b") is None


def test_routed_prompt_notes_are_bounded_oldest_first():
    index = PrefixIndex(max_routed_keys=3)
    index.note_routed("a", [1, 2, 3], now=0.0)
    index.note_routed("a", [4], now=0.0)
    assert index.matched_blocks("a", [1], now=0.0) == 0 and index.matched_blocks("a", [2, 3, 4], now=0.0) == 3


@pytest.mark.parametrize("broken", [False, True])
def test_a_replica_resyncs_its_keys_after_a_drain_whose_answer_was_lost(broken):
    """The core drained its cache's log but the answer never arrived (a timed-out call):
    the next drain is a snapshot, so the report equals the cache again, evictions included.
    Broken: the lost delta is not noticed, and the report keeps an evicted key."""
    from verispec.cache.kv_pool import BlockPool
    from verispec.cache.radix import RadixCache
    from verispec.ray.prefix_index import CacheReport
    pool = BlockPool(8, 2)
    tree, report = RadixCache(pool), CacheReport()

    def cache(tokens):
        blocks = pool.allocate(len(tokens) // 2)
        tree.insert(tokens, blocks)
        for b in blocks:
            pool.decref(b)
    cache([1, 2, 3, 4])
    report.apply(tree.drain_events(report.resync))
    tree.evict(1)                                   # [3 4] leaves the cache ...
    tree.drain_events(report.resync)                # ... in a delta that is lost on the way
    if not broken:
        report.lost()
    cache([5, 6])
    report.apply(tree.drain_events(report.resync))
    assert (report.keys == set(tree.all_block_keys())) != broken
    assert report.version == 2 and not report.resync


def test_packed_keys_round_trip_every_64_bit_key():
    from verispec.ray.prefix_index import pack_keys, unpack_keys
    keys = [0, -1, 2**63 - 1, -2**63, hash((0, (1, 2, 3)))]
    assert unpack_keys(pack_keys(keys)) == keys


def test_aggregate_sums_counters_and_recomputes_ratios_from_their_parts():
    from verispec.ray.metrics import aggregate, per_replica
    from verispec.server.metrics import ServerMetrics

    def replica(used, queries, hits, prompt_tokens):
        stats = type("Stats", (), {"kv_blocks_used": used, "kv_blocks_total": 10, "num_waiting": 1,
                                   "prefix_query_tokens": queries, "prefix_hit_tokens": hits})
        m = ServerMetrics("m", stats_source=lambda: stats)
        m.prompt_tokens.labels("m").inc(prompt_tokens)
        return m.render()[0].decode()
    texts = {"r1": replica(3, 10, 5, 7), "r2": replica(1, 30, 5, 5)}

    def samples(text: bytes) -> dict:
        return {(s.name, s.labels.get("replica")): s.value
                for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    summed = samples(aggregate(texts))
    assert summed["vllm:prompt_tokens_total", None] == 12 and summed["vllm:num_requests_waiting", None] == 2
    assert summed["vllm:kv_cache_usage_perc", None] == pytest.approx(4 / 20)            # not 0.3 + 0.1
    assert summed["verispec:prefix_cache_hit_rate", None] == pytest.approx(10 / 40)     # not 0.5 + 1/6
    assert not [name for name, _ in summed if name.endswith("_created")]
    labelled = samples(per_replica(texts))
    assert labelled["vllm:prompt_tokens_total", "r1"] == 7 and labelled["vllm:prompt_tokens_total", "r2"] == 5
