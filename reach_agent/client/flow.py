"""Flows: steps and fan-outs over a :class:`~reach_agent.client.client.Client`, recorded under one
parent request id.

A :class:`Flow` is one run. Its parent request id is the task's when it runs inside a
handler (:mod:`~reach_agent.trace`), else the one given, else a new UUID4. Each step — a
:meth:`Flow.step` or one branch of a :meth:`Flow.fan_out` — is a call with request id
``<parent>-<n>`` (n = 1, 2, … in the order steps start) and the header ``Reach-Parent-Id``,
which agents copy into their ack records (``parent_request_id``): ``reach ack PARENT
--steps`` lists a run. The ids being derived, a flow run again under the same parent (a
retried task) finds the steps that already ran in the claims and gets their stored results
instead of running them twice.

* :meth:`Flow.step`: a critical step's failure aborts the flow (:class:`FlowFailed`); a
  non-critical one falls back — ``"previous"`` (the previous step's result), ``"skip"``
  (``None``), or ``"abort"``.
* :meth:`Flow.fan_out`: calls at once, to several capabilities with one payload, or to one
  capability with several payloads; it returns the successes and failures, and fails only
  when fewer than ``partial`` of them succeeded. ``max_wait`` bounds the wait: calls still
  running then are cancelled and count as failures (``TIMEOUT``).

The module-level :func:`fan_out` is a one-off flow's fan-out.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from jetstream.acks import check_request_id
from reach_agent import trace
from reach_agent.wire import schema
from reach_agent.wire.errors import FlowFailed, ReachError, Timeout

if TYPE_CHECKING:
    from .client import Client

Fallback = Literal["previous", "skip", "abort"]
FALLBACKS: tuple[Fallback, ...] = ("previous", "skip", "abort")
Targets = Sequence[str] | tuple[str, Sequence[Any]]
"""A fan-out's calls: capabilities (each gets the one payload), or ``(capability, payloads)``
(one call per payload)."""

_MAX_ID = 128  # a request id is one subject token of at most 128 characters


class Step:
    """One step of a run: what was called, under which request id, and how it ended."""

    __slots__ = ("capability", "error", "index", "request_id", "result", "status")

    def __init__(self, index: int, capability: str, request_id: str) -> None:
        self.index = index
        """The step's number in the run (1, 2, …): its request id is ``<parent>-<index>``."""
        self.capability = capability
        self.request_id = request_id
        self.status: Literal["running", "ok", "failed", "fallback"] = "running"
        """``fallback``: it failed and the flow went on with its fallback."""
        self.result: Any = None
        self.error: ReachError | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __repr__(self) -> str:
        return (f"Step({self.index}, {self.capability!r}, status={self.status!r}"
                + (f", error={self.error.code!r})" if self.error else ")"))  # fmt: skip


class FanOut:
    """What a fan-out got: every branch (:class:`Step`) in the order given."""

    __slots__ = ("branches", "partial")

    def __init__(self, branches: list[Step], partial: float) -> None:
        self.branches = branches
        self.partial = partial

    @property
    def successes(self) -> list[Step]:
        return [b for b in self.branches if b.ok]

    @property
    def failures(self) -> list[Step]:
        return [b for b in self.branches if not b.ok]

    @property
    def results(self) -> list[Any]:
        """The successes' results, in the order given."""
        return [b.result for b in self.branches if b.ok]

    @property
    def ratio(self) -> float:
        return len(self.successes) / len(self.branches)

    def __repr__(self) -> str:
        return f"FanOut({len(self.successes)}/{len(self.branches)} ok, partial={self.partial})"


class Flow:
    """One run of a flow over ``client``; see the module's docstring."""

    def __init__(self, client: Client, *, request_id: str | None = None) -> None:
        ctx = trace.current()
        parent = request_id or (ctx.request_id if ctx is not None else str(uuid.uuid4()))
        check_request_id(parent)
        self.client = client
        self.request_id = parent
        """The parent request id every step is recorded under."""
        # Steps of one task share its counter: two flows in one handler get distinct ids.
        self._ctx = ctx if ctx is not None and ctx.request_id == parent else None
        self._n = 0
        self.steps: list[Step] = []
        """Every step begun, in order (a fan-out's branches included)."""
        self.previous: Any = None
        """The result of the last step that succeeded (what ``fallback="previous"`` gives)."""

    def _begin(self, capability: str) -> Step:
        schema.check_capability(capability)
        if self._ctx is not None:
            self._ctx.steps += 1
            n = self._ctx.steps
        else:
            self._n += 1
            n = self._n
        rid = f"{self.request_id}-{n}"
        if len(rid) > _MAX_ID:  # deep nesting: still unique and valid, no longer readable
            rid = str(uuid.uuid5(uuid.NAMESPACE_URL, rid))
        step = Step(n, capability, rid)
        self.steps.append(step)
        return step

    async def _call(self, step: Step, payload: Any, options: dict[str, Any]) -> None:
        headers = dict(options.pop("headers", None) or {})
        headers[schema.H_PARENT_ID] = self.request_id
        try:
            step.result = await self.client.call(step.capability, payload,
                                                 request_id=step.request_id, headers=headers,
                                                 **options)  # fmt: skip
            step.status = "ok"
        except ReachError as err:
            step.error, step.status = err, "failed"

    async def step(
        self,
        capability: str,
        payload: Any = None,
        *,
        critical: bool = True,
        fallback: Fallback = "previous",
        **options: Any,
    ) -> Any:
        """Call ``capability`` as the run's next step and return its result. A failure of a
        ``critical`` step raises :class:`FlowFailed`; a non-critical one returns its
        ``fallback``: the previous step's result, ``None`` (``skip``), or raises (``abort``).
        ``options`` as for :meth:`Client.call` (``timeout``, ``headers``, ``sticky_key``…)."""
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback {fallback!r} is not one of {', '.join(FALLBACKS)}")
        step = self._begin(capability)
        await self._call(step, payload, options)
        if step.ok:
            self.previous = step.result
            return step.result
        assert step.error is not None
        if critical or fallback == "abort":
            why = "critical" if critical else "fallback abort"
            raise FlowFailed(
                f"flow {self.request_id}: step {step.index} ({capability}, {why}) failed: "
                f"{step.error.code}: {step.error.message}", step=step, cause=step.error,
            ) from step.error  # fmt: skip
        step.status = "fallback"
        return self.previous if fallback == "previous" else None

    async def fan_out(
        self,
        targets: Targets,
        payload: Any = None,
        *,
        partial: float = 0.6,
        max_wait: float | None = None,
        **options: Any,
    ) -> FanOut:
        """Call every target at once; return the :class:`FanOut` when at least ``partial``
        (a share in (0, 1]) of the calls succeeded, else raise :class:`FlowFailed` carrying
        it. ``max_wait`` (seconds): calls still running then are cancelled and fail with
        ``TIMEOUT``. ``options`` as for :meth:`Client.call`."""
        if not (isinstance(partial, (int, float)) and 0 < partial <= 1):
            raise ValueError(f"partial {partial!r} is not a share in (0, 1]")
        if max_wait is not None and not (max_wait > 0 and math.isfinite(max_wait)):
            raise ValueError(f"max_wait {max_wait!r} is not a positive number of seconds")
        calls = _expand(targets, payload)
        branches = [self._begin(cap) for cap, _ in calls]
        tasks = [
            asyncio.ensure_future(self._call(b, p, dict(options)))
            for b, (_, p) in zip(branches, calls, strict=True)
        ]
        _, pending = await asyncio.wait(tasks, timeout=max_wait)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        for t in tasks:  # not a ReachError (a payload that is not JSON...): the caller's bug
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        for b in branches:
            if b.status == "running":
                b.error = Timeout(f"step {b.index} ({b.capability}) still running after "
                                  f"max_wait {max_wait}s")  # fmt: skip
                b.status = "failed"
        out = FanOut(branches, partial)
        ok = len(out.successes)
        if ok < partial * len(branches) - 1e-9:
            codes = ", ".join(f"{b.index}:{b.error.code}" for b in out.failures if b.error)
            raise FlowFailed(
                f"flow {self.request_id}: fan-out {ok} of {len(branches)} succeeded, below "
                f"partial {partial:g} (failed {codes})", fan_out=out,
            )  # fmt: skip
        if out.results:
            self.previous = out.results
        return out


def _expand(targets: Targets, payload: Any) -> list[tuple[str, Any]]:
    """(capability, payload) of each call of a fan-out."""
    calls: list[tuple[str, Any]] | None = None
    if isinstance(targets, tuple) and len(targets) == 2 and isinstance(targets[0], str):
        capability, payloads = targets
        if isinstance(payloads, Sequence) and not isinstance(payloads, (str, bytes)):
            calls = [(capability, p) for p in payloads]
    if calls is None and isinstance(targets, Sequence) and not isinstance(targets, str) \
            and all(isinstance(t, str) for t in targets):  # fmt: skip
        calls = [(str(t), payload) for t in targets]
    if calls is None:
        raise ValueError(f"fan-out targets {targets!r:.200} are neither capabilities nor "
                         "(capability, payloads)")  # fmt: skip
    if not calls:
        raise ValueError("fan-out targets are empty: nothing to call")
    return calls


async def fan_out(
    client: Client,
    targets: Targets,
    payload: Any = None,
    *,
    partial: float = 0.6,
    max_wait: float | None = None,
    request_id: str | None = None,
    **options: Any,
) -> FanOut:
    """A one-off flow's :meth:`Flow.fan_out` (parent request id: the current task's, else
    ``request_id``, else a new one)."""
    flow = Flow(client, request_id=request_id)
    return await flow.fan_out(targets, payload, partial=partial, max_wait=max_wait, **options)
