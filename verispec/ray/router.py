"""PrefixAffinityRouter: Ray Serve's RequestRouter that sends a request where its prompt's
prefix probably is cached.

Ray Serve runs one router per DeploymentHandle owner, here the front door
(`verispec/ray/app.py`), and asks it for each request `choose_replicas(candidates,
pending_request)`: a list of ranks, tried in order; within a rank Ray takes the replica
with the shortest queue that is not full (`max_ongoing_requests`). The candidates are
Ray's running replicas: a replica that failed its health check (`ReplicaServer.
check_health`: the engine process died or stalled) or whose actor died is never among
them. So this router only orders them:

- rank 1: the replica whose cache holds the longest prefix of the request's prompt
  (`PrefixIndex.decide`, over the block keys the front door computed), when that match is
  at least `min_match_tokens` and that replica runs at most `max_imbalance` more requests
  than the least loaded one;
- otherwise, and for the ranks after: the rest, least loaded first (ties: fewest cached
  blocks, then fewest requests routed, so unrelated traffic spreads).

What a replica holds comes from the replica itself: its routing stats
(`ReplicaServer.record_routing_stats`, polled by Ray every `ROUTING_STATS_PERIOD_S`) carry
the block keys of its prefix cache, kept from the cache's own store and evict events.
Until the next report, a request's keys count for the replica it was sent to
(`on_request_routed`, `PrefixIndex.note_routed`).
Load is Ray's own queue length per replica (its cache, updated as requests are sent,
finish and are probed), or, when that entry is stale, the requests this router has in
flight there; plus the requests this router has just chosen it for and not yet sent.
Ray routes concurrent requests in concurrent tasks, so without that last term a burst is
decided against the same loads and lands on one replica.

Ray Serve LLM's PrefixCacheAffinityRouter has the same idea but indexes the text it
routed; this one indexes what the replicas' caches hold (evictions included), in the
router's process (no tree actor, no blocking ray.get on the event loop).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from verispec.ray.prefix_index import STATS_KEY, PrefixIndex, RoutingRule, unpack_keys

log = logging.getLogger("verispec.ray")

CHOSEN_TTL_S = 5.0   # a choice not followed by a send (the request was cancelled) stops counting


def routing_keys(pending_request: Optional[PendingRequest]) -> tuple[tuple[int, ...], int]:
    """(block keys, block size) the front door computed for the request's prompt."""
    if pending_request is None or not pending_request.args:
        return (), 1
    call = pending_request.args[0]
    return getattr(call, "routing_keys", ()), getattr(call, "routing_block_size", 1)


class PrefixAffinityRouter(RequestRouter):
    """See the module docstring; configured through RequestRouterConfig.request_router_kwargs."""

    def initialize_state(self, min_match_tokens: int = 64, max_imbalance: int = 4,
                         routed_ttl_s: float = 10.0, **unknown):
        if unknown:
            raise ValueError(f"unknown PrefixAffinityRouter settings: {sorted(unknown)}")
        self.rule = RoutingRule(min_match_tokens, max_imbalance)
        self.index = PrefixIndex(routed_ttl_s)
        self.in_flight: Counter = Counter()   # replica -> requests this router sent, not done
        self.chosen: dict[str, tuple[ReplicaID, float]] = {}   # request -> (replica, when), not yet sent

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        for replica in candidate_replicas:
            self._apply_report(replica)
        keys, block_size = routing_keys(pending_request)
        decision = self.index.decide(keys, block_size, self._loads(by_id, pending_request), self.rule)
        log.debug("routing %s: %s, %d tokens matched", pending_request and pending_request.metadata.request_id,
                  decision.reason, decision.matched_tokens)
        if pending_request is not None:
            self.chosen[pending_request.metadata.internal_request_id] = (decision.ranked[0], time.monotonic())
            # every replica is in the ranks below: when all are full, back off before retrying
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid]] for rid in decision.ranked]

    def _apply_report(self, replica: RunningReplica) -> None:
        """Take in the replica's latest report of its cached block keys, once per version."""
        report = (getattr(replica, "routing_stats", None) or {}).get(STATS_KEY)
        if report and report["version"] != self.index.version(replica.replica_id):
            self.index.update_cached(replica.replica_id, report["version"], unpack_keys(report["keys"]))
    def _loads(self, replica_ids, pending_request: Optional[PendingRequest]) -> dict:
        """replica -> requests it runs or is about to get (see the module docstring)."""
        now, mine = time.monotonic(), pending_request and pending_request.metadata.internal_request_id
        for rid in [r for r, (_, t) in self.chosen.items() if now - t > CHOSEN_TTL_S]:
            del self.chosen[rid]
        about_to = Counter(replica for rid, (replica, _) in self.chosen.items() if rid != mine)
        loads = {}
        for replica in replica_ids:
            cached = self.replica_queue_len_cache.get(replica)
            loads[replica] = (cached if cached is not None else self.in_flight[replica]) + about_to[replica]
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.chosen.pop(pending_request.metadata.internal_request_id, None)
        self.in_flight[replica_id] += 1
        self.index.note_routed(replica_id, routing_keys(pending_request)[0])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        self.index.retain(live)
        for gone in set(self.in_flight) - live:
            del self.in_flight[gone]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)
        self.in_flight.pop(replica_id, None)
