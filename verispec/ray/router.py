"""PrefixAffinityRouter: Ray Serve's RequestRouter that sends a request where its prompt's
prefix probably is cached.

Ray Serve runs one router per DeploymentHandle owner, here the front door
(`verispec/ray/app.py`), and asks it for each request `choose_replicas(candidates,
pending_request)`: a list of ranks, tried in order; within a rank Ray takes the replica
with the shortest queue that is not full (`max_ongoing_requests`). The candidates are
Ray's running replicas: a replica that failed its health check (`ReplicaServer.
check_health`: the engine process died or stalled) or whose actor died is never among
them. So this router only orders them:

- rank 1: the replica whose prefix index holds the longest prefix of the request's text
  (`PrefixIndex.decide`), when that match is at least `min_match_chars` and that replica
  runs at most `max_imbalance` more requests than the least loaded one;
- otherwise, and for the ranks after: the rest, least loaded first (ties: fewest cached
  chunks, then fewest requests routed, so unrelated traffic spreads).

A request's text is recorded against the replica it was sent to (`on_request_routed`).
Load is Ray's own queue length per replica (its cache, updated as requests are sent,
finish and are probed), or, when that entry is stale, the requests this router has in
flight there; plus the requests this router has just chosen it for and not yet sent.
Ray routes concurrent requests in concurrent tasks, so without that last term a burst is
decided against the same loads and lands on one replica.

Ray Serve LLM's PrefixCacheAffinityRouter has the same idea; this one keeps its index in
the router's process (no tree actor, no blocking ray.get on the event loop): with one
front door replica it sees every request; with several, each indexes its own share.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from verispec.ray.prefix_index import PrefixIndex, RoutingRule

log = logging.getLogger("verispec.ray")

CHOSEN_TTL_S = 5.0   # a choice not followed by a send (the request was cancelled) stops counting


def routing_text(pending_request: Optional[PendingRequest]) -> str:
    """The text the front door extracted for routing (the first argument's `routing_text`)."""
    if pending_request is None or not pending_request.args:
        return ""
    return getattr(pending_request.args[0], "routing_text", "") or ""


class PrefixAffinityRouter(RequestRouter):
    """See the module docstring; configured through RequestRouterConfig.request_router_kwargs."""

    def initialize_state(self, min_match_chars: int = 256, max_imbalance: int = 4,
                         chunk_chars: int = 64, max_chunks: int = 1 << 16, **unknown):
        if unknown:
            raise ValueError(f"unknown PrefixAffinityRouter settings: {sorted(unknown)}")
        self.rule = RoutingRule(min_match_chars, max_imbalance)
        self.index = PrefixIndex(chunk_chars, max_chunks)
        self.in_flight: Counter = Counter()   # replica -> requests this router sent, not done
        self.chosen: dict[str, tuple[ReplicaID, float]] = {}   # request -> (replica, when), not yet sent

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        keys = self.index.keys_of(routing_text(pending_request))
        decision = self.index.decide(keys, self._loads(by_id, pending_request), self.rule)
        log.debug("routing %s: %s, %d chars matched", pending_request and pending_request.metadata.request_id,
                  decision.reason, decision.matched_chars)
        if pending_request is not None:
            self.chosen[pending_request.metadata.internal_request_id] = (decision.ranked[0], time.monotonic())
            # every replica is in the ranks below: when all are full, back off before retrying
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid]] for rid in decision.ranked]

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
        self.index.insert(replica_id, self.index.keys_of(routing_text(pending_request)))

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
