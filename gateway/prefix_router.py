"""Which worker a request goes to: the one that would compute least of its prompt,
given what each worker's KV cache holds and how busy it is.

The cost of a worker, in KV blocks (as Dynamo's KV router states it):

    cost = overlap_weight x (prefill_blocks + HOST_BLOCK_WEIGHT x host_blocks) + decode_blocks

- prefill_blocks: the prompt's blocks minus the leading ones its cache holds (the
  longest prefix of the prompt's block-hash chain in the worker's index, either tier);
- host_blocks: of those held, the ones in its host tier (--host-kv-cache-gb): the
  worker copies them back into device memory before the prompt runs, a transfer of
  their K and V rather than a forward over their tokens. HOST_BLOCK_WEIGHT = 0.25
  prices that copy at a quarter of computing the block: cheaper than a miss, dearer
  than a block already on the device (for an 8B model's 32-token block, 4 MiB over
  PCIe against a forward of 32 tokens through every layer; long prompts, whose
  attention grows with their length, make a miss dearer still, so this is a floor);
- decode_blocks: the blocks its running requests hold (from its latest load
  report), its queued requests counted at its running requests' mean, and the
  prompt blocks of the requests this gateway sent it since that report.

`overlap_weight` is 4 by default, not Dynamo's 1: a prompt block to compute is a
forward pass over its tokens, while a block a decoding request holds costs a read
per step; at 1, two or three requests decoding on the worker holding a
conversation outweigh its whole system prompt, and follow-up turns leave home.
The cheapest wins, ties at random. Where no worker holds any of the prompt (or
the prompt is not token ids yet, or runs under a LoRA adapter or prompt table,
whose blocks are salted by the worker), the least-loaded one wins. A worker whose
request count is more than `spill_requests` above the least busy one's has no
room: it is passed over whatever it holds, and its conversations spill over.
"""

from __future__ import annotations

import random
from typing import Literal

import protocol
from gateway.workers import WorkerLink, eligible, least_loaded
from ops.metrics import GatewayMetrics
from protocol.block_hash import prompt_hashes

RouterName = Literal["prefix", "least-loaded"]
ROUTERS: tuple[RouterName, ...] = ("prefix", "least-loaded")


HOST_BLOCK_WEIGHT = 0.25  # a prompt block held in a worker's host tier, against one to compute


def cost(prefill_blocks: int, decode_blocks: float, overlap_weight: float, host_blocks: int = 0) -> float:
    return overlap_weight * (prefill_blocks + HOST_BLOCK_WEIGHT * host_blocks) + decode_blocks


def decode_blocks(link: WorkerLink, prompt_blocks: int) -> float:
    """The KV blocks the worker's requests hold or will soon, as far as this gateway knows."""
    load = link.load or protocol.WorkerLoad()
    used = load.max_num_blocks - load.free_num_blocks
    per_request = used / load.num_active_requests if load.num_active_requests else prompt_blocks
    return used + load.num_queued_requests * per_request + link.sent_blocks_since_load


def busy(link: WorkerLink) -> int:
    return link.score()[0]


class PrefixRouter:
    def __init__(self, sender_id: str, metrics: GatewayMetrics, policy: RouterName = "prefix",
                 overlap_weight: float = 4.0, spill_requests: int = 8) -> None:  # fmt: skip
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; choose one of {', '.join(ROUTERS)}")
        self.sender_id = sender_id
        self.metrics = metrics
        self.policy = policy
        self.overlap_weight = overlap_weight
        self.spill_requests = spill_requests

    def pick(self, workers: list[WorkerLink], model: str | None, submit: protocol.Submit) -> WorkerLink | None:
        """The worker for `submit` (None: no ready worker serves it); counts what its cache holds of the prompt."""
        ids = submit.input_token_ids
        if ids is None or submit.lora is not None or submit.prompt_tuning_config is not None:
            return least_loaded(workers, model, submit.lora)
        candidates = eligible(workers, model, None)
        if not candidates:
            return None
        chains: dict[int, list[int]] = {}  # block size -> the prompt's chain
        matched: dict[WorkerLink, tuple[int, int]] = {}  # (blocks held, of which in the host tier)
        for w in candidates:
            size = w.kv.block_size
            if size is not None:
                chain = chains.get(size) or chains.setdefault(size, prompt_hashes(ids, size))
                matched[w] = w.kv.matched(chain)
        if self.policy == "prefix" and any(held for held, _ in matched.values()):
            least = min(busy(w) for w in candidates)
            roomy = [w for w in candidates if busy(w) <= least + self.spill_requests]
            costs = {w: self._cost(w, len(ids), *matched.get(w, (0, 0))) for w in roomy}
            best = min(costs.values())
            choice = random.choice([w for w, c in costs.items() if c == best])
        else:
            choice = random.choice([w for w in candidates if w.score() == min(c.score() for c in candidates)])
        size = choice.kv.block_size
        if size is not None:
            self.metrics.prefix_routed(choice.worker_id, len(chains[size]), matched[choice][0])
            choice.sent_blocks_since_load += -(-len(ids) // size)
        return choice

    def _cost(self, link: WorkerLink, num_tokens: int, matched: int, on_host: int) -> float:
        size = link.kv.block_size or 1
        prompt_blocks = -(-num_tokens // size)
        return cost(prompt_blocks - matched, decode_blocks(link, prompt_blocks), self.overlap_weight, on_host)

    def kv_message(self, link: WorkerLink, msg: protocol.KvEvents | protocol.KvSnapshot) -> None:
        """Bring the worker's index up to date; ask for a snapshot where events are missing."""
        if isinstance(msg, protocol.KvSnapshot):
            link.kv.apply_snapshot(msg)
        elif link.kv.apply_events(msg):
            link.send(protocol.encode(protocol.KvSnapshotRequest(sender_id=self.sender_id)))
        self.metrics.prefix_indexed(link.worker_id, len(link.kv.hashes) + len(link.kv.host_hashes))

    def forget(self, link: WorkerLink) -> None:
        """The worker is lost: its index goes with its link."""
        self.metrics.prefix_indexed(link.worker_id, None)
