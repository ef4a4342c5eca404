"""The simulated fleet: the main ``loadtest.sim`` processes and the two victim groups.

The main sims carry ``agents - 2 x kill share`` agents over shared connections; each victim
group carries a kill share with one connection per agent (named by ``agent_id``, what the
server's disconnect advisory carries) and a capability of its own, so "none routed" can be
asked of it alone. The fleet speaks the sims' stdin protocol (see :mod:`loadtest.sim`) and
remembers the last tally of a victim group it silenced or killed, so the accounting can
count what a dead process sent.
"""

from __future__ import annotations

import argparse
import time

from .children import Child, Children

VICTIM_ADV = "loadtest.victim_adv"
"""Capability of the victims that are SIGKILLed (detected through disconnect advisories)."""
VICTIM_SILENT = "loadtest.victim_silent"
"""Capability of the victims that stop heartbeating and answering probes (connections open)."""


def victims_per_group(args: argparse.Namespace) -> int:
    """Agents in each victim group: the kill share of the fleet, at least one (0: none)."""
    return max(1, round(args.agents * args.kill_share)) if args.kill_share > 0 else 0


class Fleet:
    """The sim processes of one run and what they have told us."""

    def __init__(self, sims: list[Child], counts: list[int], victims: dict[str, Child]) -> None:
        self.sims = sims
        """The main sim processes, in start order."""
        self.counts = counts
        """Agents in each main sim."""
        self.victims = victims
        """``"adv"`` (SIGKILLed) and ``"silent"`` victim groups; empty with no kill share."""
        self._final: dict[str, int] = {}  # victim group → heartbeats sent before it went quiet

    @classmethod
    async def spawn(cls, children: Children, args: argparse.Namespace, url: str) -> Fleet:
        """Start every sim process (they connect and announce on their own)."""
        a = args
        k = victims_per_group(a)
        main_n = a.agents - 2 * k
        if main_n < 1:
            raise SystemExit(f"--agents {a.agents} is too small for --kill-share {a.kill_share}")
        common = ["--server", url, "--prefix", a.prefix, "--interval", str(a.interval),
                  "--max-runtime", str(a.budget),
                  "--capabilities", str(a.capabilities)]  # fmt: skip
        sims: list[Child] = []
        counts: list[int] = []
        per_proc = -(-main_n // a.sim_procs)
        for i in range(a.sim_procs):
            count = min(per_proc, main_n - i * per_proc)
            if count <= 0:
                break
            options = ["--agents", str(count), "--id-prefix", f"sim{i}", "--seed", str(i + 1),
                       "--connections", str(a.connections)]  # fmt: skip
            if a.conn_per_agent:
                options.append("--conn-per-agent")
            sims.append(await children.sim(f"sim{i}", common, *options))
            counts.append(count)
        victims: dict[str, Child] = {}
        if k:
            for tag, cap in (("adv", VICTIM_ADV), ("silent", VICTIM_SILENT)):
                victims[tag] = await children.sim(
                    f"victims-{tag}", common, "--agents", str(k), "--conn-per-agent",
                    "--id-prefix", f"victim-{tag}", "--extra-capability", cap,
                    "--seed", str(100 + len(victims)),
                )  # fmt: skip
        return cls(sims, counts, victims)

    @property
    def processes(self) -> list[Child]:
        return [*self.sims, *self.victims.values()]

    async def ready(self, within: float) -> tuple[int, int]:
        """Wait for every process to have announced its agents: (connections, announce errors)."""
        conns = errors = 0
        for child in self.processes:
            ev = await child.wait_event("ready", within)
            conns += ev["connections"]
            errors += ev["announce_errors"]
        return conns, errors

    async def silence(self, tag: str) -> float:
        """Victim group ``tag`` stops heartbeating and answering probes; returns when it was
        told (``perf_counter``)."""
        t = time.perf_counter()
        ev = await self.victims[tag].command("silence")
        self._final[tag] = ev["sent"]
        return t

    async def kill(self, tag: str) -> float:
        """Victim group ``tag`` is SIGKILLed after its final tally (flushed); returns when
        (``perf_counter``)."""
        child = self.victims[tag]
        ev = await child.command("pause")
        t = time.perf_counter()
        await child.kill()
        self._final[tag] = ev["sent"]
        return t

    async def heartbeats_sent(self) -> int:
        """Heartbeats sent by every process so far, as they count them. Pauses the main sims
        (flushed); :meth:`resume` starts them again."""
        sent = dict(self._final)
        for sim in self.sims:
            sent[sim.name] = (await sim.command("pause"))["sent"]
        for tag, child in self.victims.items():
            if tag not in sent and child.alive():
                sent[tag] = (await child.command("pause"))["sent"]
        return sum(sent.values())

    async def resume(self) -> None:
        """The main sims heartbeat again."""
        for sim in self.sims:
            await sim.command("resume")
