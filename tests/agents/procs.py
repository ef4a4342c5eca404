"""Start test agent scripts as real processes; stop only the PIDs started here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


class AgentProcess:
    """One agent script running under this interpreter with ``NATS_URL`` set."""

    def __init__(self, script: str, url: str, *args: str, log_path: Path | None = None) -> None:
        env = dict(os.environ, NATS_URL=url, PYTHONUNBUFFERED="1")
        self.stderr_path = log_path
        self._stderr = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
        self.pid = self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Kill our process if it still runs (used in ``finally``)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self._stderr is not subprocess.DEVNULL:
            self._stderr.close()

    def output(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path else ""
