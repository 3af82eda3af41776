"""The wire format of what the driver sends the other ranks: a step's `StepPlan`, or its `BlockCopies`, as one flat
list of ints carried by one int64 tensor (cbcore/distributed/channel.py broadcasts it).

A plan is `[n, (num_tokens, start, num_blocks, emits, score_from, score_to) * n, tokens and block table of request 0, of request 1, ...]`.
Request ids stay on the driver: a rank that only runs the forward needs the tokens, positions and blocks, not who
they belong to (the driver alone samples and delivers); the prompt-scoring rows travel (every rank's LM head keeps
the same rows), their target tokens do not (the driver alone turns them into logprobs). Copies are `[d2d pairs, d2h pairs, h2d pairs, the pairs
flattened in that order]`. Every int is >= 0 (token ids are checked on entry; positions, counts and block ids are
never negative), which lets the channel carry a payload inside a MAX-reduce.
"""

from __future__ import annotations

from array import array
from itertools import chain

import torch

from ..plan import BlockCopies, PlannedRequest, StepPlan

_FIELDS = 6  # per request: num_tokens, start, num_blocks, emits_token, score_from, score_to


def encode_plan(plan: StepPlan) -> torch.Tensor:
    """The plan's requests (not its copies: they travel on their own, see `encode_copies`) as an int64 tensor."""
    requests = plan.requests
    # array('q') appends ints in C and hands its buffer to torch without a copy: about half the time of a list of
    # ints through torch.tensor (bench/tp_broadcast.py).
    flat = array("q", [len(requests)])
    for request in requests:
        flat.extend((len(request.token_ids), request.start, len(request.block_table), request.emits_token,
                     request.score_from, request.score_to))
    for request in requests:
        flat.extend(request.token_ids)
        flat.extend(request.block_table)
    return torch.frombuffer(flat, dtype=torch.int64)


def decode_plan(data: list[int]) -> StepPlan:
    """The plan `encode_plan` encoded (request ids empty)."""
    count = data[0]
    offset = 1 + _FIELDS * count
    requests = []
    for index in range(count):
        fields = data[1 + _FIELDS * index : 1 + _FIELDS * (index + 1)]
        num_tokens, start, num_blocks, emits, score_from, score_to = fields
        tokens = data[offset : offset + num_tokens]
        offset += num_tokens
        table = data[offset : offset + num_blocks]
        offset += num_blocks
        requests.append(PlannedRequest("", tokens, start, table, bool(emits), score_from=score_from, score_to=score_to))
    return StepPlan(requests)


def encode_copies(copies: BlockCopies) -> torch.Tensor:
    """A step's block copies as an int64 tensor. State-slot copies have no place here: a model with stateful layers
    is refused under tensor parallelism (cbcore/engine/core.py), and a plan carrying them must not lose them."""
    if copies.state_copies:
        raise NotImplementedError("state-slot copies cannot be sent to tensor-parallel ranks: models with stateful "
                                  "layers are not served under tensor parallelism")
    groups = (copies.device_to_device, copies.device_to_host, copies.host_to_device)
    flat = [len(group) for group in groups]
    for group in groups:
        flat += chain.from_iterable(group)
    return torch.tensor(flat, dtype=torch.int64)


def decode_copies(data: list[int]) -> BlockCopies:
    """The copies `encode_copies` encoded."""
    counts, offset, groups = data[:3], 3, []
    for count in counts:
        pairs = data[offset : offset + 2 * count]
        groups.append(list(zip(pairs[0::2], pairs[1::2])))
        offset += 2 * count
    return BlockCopies(device_to_device=groups[0], device_to_host=groups[1], host_to_device=groups[2])
