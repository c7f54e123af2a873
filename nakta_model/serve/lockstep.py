"""Tensor-parallel serving: every rank of the grid runs the same ``Generator`` in lockstep.

Under ``torchrun`` rank 0 serves HTTP and runs the engine thread of :mod:`.bridge`; every other
rank loads its shard and runs ``Generator.generate(feed=FollowerFeed(...))`` on its main thread.
The engine takes every decision that could differ between ranks from its feed: what ``poll``
returns (the requests that arrived, the cancellations, stop), what ``pending`` answers (whether
a pipelined run of chunks ends at the next read), and the model calls the server runs between
steps (prompt logprobs). Rank 0 asks its bridge and broadcasts the answer over a gloo group of
its own (:class:`Lockstep`); the followers return what they receive. The engine's control flow
is then the same on every rank (it reads no clock), and with the same seed so are its sampling
draws, so the model's own collectives always meet. Everything time-based in the bridge (the
idle wait, gathering arrivals, deferring a hand-over) happens on rank 0 before the broadcast,
or touches only rank 0's hand-over to the event loop.

Each message names the Feed call it answers, so ranks that fell out of step fail with a clear
error instead of a hang. A rank that dies closes its gloo connections and the others' next
collective fails at once; a rank that hangs is caught by the group's timeout, which an idle
server never reaches (rank 0 sends an empty poll every :data:`HEARTBEAT_S`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence

import torch.distributed as dist

from nakta_model.generation.requests import GenerationRequest
from nakta_model.generation.streaming import TextStream

__all__ = ["HEARTBEAT_S", "FollowerFeed", "Lockstep", "request_from_wire", "request_to_wire"]

log = logging.getLogger("nakta.serve")

HEARTBEAT_S = 5.0  # an idle rank 0 answers its followers' poll at least this often

# A model call run on every rank between two steps: ``fn(model, *args)``. ``fn`` travels by
# name (a module-level function), ``args`` by value.
ModelCall = tuple[Callable, tuple]


class LockstepError(RuntimeError):
    """The ranks no longer run the same engine steps (a bug, never a user's input)."""


class Lockstep:
    """The control channel of a tensor-parallel server: rank 0 ``send``s, every other rank
    ``receive``s the same message, in the same order. Create it on every rank at once (it
    makes a process group: a collective)."""

    def __init__(self, timeout_s: float):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Lockstep needs torch.distributed's process group (torchrun)")
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.heartbeat_s = min(HEARTBEAT_S, timeout_s / 4)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def send(self, message: tuple) -> None:
        """Rank 0: ``message`` (picklable) to every rank."""
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self, *kinds: str) -> tuple:
        """A follower: the next message, whose kind (its first item) must be one of ``kinds``."""
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        message = box[0]
        if not isinstance(message, tuple) or not message or message[0] not in kinds:
            raise LockstepError(
                f"rank {self.rank} expected a {' or '.join(kinds)} message from rank 0, got "
                f"{message!r:.200}: the ranks no longer run the same engine steps"
            )
        return message


# ------------------------------------------------------------------------------ messages
def request_to_wire(request: GenerationRequest) -> tuple:
    """A request as plain data for the other ranks. Stop strings travel as strings: each rank
    cuts them on a :class:`TextStream` of the prompt with its own tokenizer, as the server's
    requests do (``app._engine_request``)."""
    stops = list(request.stop.stops) if request.stop is not None else None
    return (
        list(request.prompt),
        request.max_new_tokens,
        request.sampling,
        tuple(request.stop_token_ids),
        stops,
    )


def request_from_wire(wire: tuple, tokenizer) -> GenerationRequest:
    """The request :func:`request_to_wire` described, rebuilt on this rank."""
    prompt, max_new, sampling, stop_ids, stops = wire
    if stops is None:
        return GenerationRequest(prompt, max_new, sampling, stop_ids)
    return TextStream(tokenizer, prompt, stops).request(max_new, sampling, stop_ids)


def poll_message(
    new: Sequence[tuple[int, GenerationRequest]], cancel: Sequence[int], calls: list[ModelCall]
) -> tuple:
    """What rank 0's ``poll`` answered, as the followers receive it."""
    return ("poll", [(k, request_to_wire(r)) for k, r in new], list(cancel), calls)


STOP = ("stop",)


def pending_message(value: bool) -> tuple:
    return ("pending", bool(value))


def run_call(model, call: ModelCall):
    fn, args = call
    return fn(model, *args)


# ---------------------------------------------------------------------------- followers
class FollowerFeed:
    """The ``Feed`` of a rank other than 0: every answer is rank 0's (module docstring). The
    model calls rank 0 ran between two steps run here at the same point, their results
    dropped (rank 0 answers the client)."""

    def __init__(self, lockstep: Lockstep, model, tokenizer):
        self.lockstep, self.model, self.tokenizer = lockstep, model, tokenizer
        self.polls = 0

    def poll(self, idle: bool):  # Feed
        message = self.lockstep.receive("poll", "stop")
        if message[0] == "stop":
            return None
        self.polls += 1
        _, new, cancel, calls = message
        for call in calls:
            try:
                run_call(self.model, call)
            except Exception as e:  # noqa: BLE001 -- rank 0 met the same error and answers it
                log.debug("a model call failed on this rank as on rank 0: %s", e)
        return [(k, request_from_wire(w, self.tokenizer)) for k, w in new], cancel

    def pending(self) -> bool:  # Feed
        return self.lockstep.receive("pending")[1]

    def flush(self) -> None:  # Feed: rank 0 hands the tokens out
        pass
