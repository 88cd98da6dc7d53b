"""Observability for long jobs: a JSON-lines metrics log and the low-acceptance warning.

Each line of the log is one event (`"event": "batch"`, `"canary"`, `"decision"`, `"summary"`)
carrying the same identifying fields (run id, model id, draft id, method, K), so a log shared by
many runs can be filtered and plotted with any JSON tool. The log is only ever appended to, a
whole line at a time (a full disk raises WriteError and leaves no torn line; one that a kill left
is cut when the log is next opened).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from jaxspec.jobs.durable import append_whole, repair_tail
from jaxspec.serving.warnings import low_acceptance_message

log = logging.getLogger("jaxspec")


class AcceptanceWatch:
    """Running acceptance of a job; warns once each time it falls below the threshold.

    Warning on every low batch would bury the message in a long job, so it fires when the
    running rate crosses below `threshold`, and again only after it has recovered by
    `hysteresis` and fallen again (a rate hovering at the threshold warns once).
    """

    hysteresis = 0.05

    def __init__(self, threshold: float, draft_name: str, target_name: str):
        self.threshold = threshold
        self.draft_name, self.target_name = draft_name, target_name
        self.accepted = self.drafted = 0
        self.below = False
        self.warnings = 0
        self.note = ""  # appended to the warning, e.g. what the canary measured

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def update(self, accepted: int, drafted: int) -> bool:
        """Adds a batch; returns True when the running rate is below the threshold."""
        self.accepted += accepted
        self.drafted += drafted
        rate = self.rate
        low = rate is not None and rate < self.threshold
        if low and not self.below:
            log.warning(low_acceptance_message(rate, self.threshold, self.draft_name, self.target_name, self.note))
            self.warnings += 1
            self.below = True
        elif rate is not None and rate >= self.threshold + self.hysteresis:
            self.below = False
        return low


class MetricsLog:
    """Appends one JSON object per event to `path` (None: a log that writes nothing)."""

    def __init__(self, path: str | Path | None, **common):
        self.path = Path(path) if path is not None else None
        self.common = {"run_id": f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", **common}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and repair_tail(self.path):
                log.warning("%s: removed a torn final line left by an interrupted run", self.path)

    def write(self, event: str, **fields) -> dict:
        entry = {"time": round(time.time(), 3), "event": event, **self.common, **fields}
        if self.path is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:  # not fsynced: the output file is the record; this log is for watching
                append_whole(fd, (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"), self.path, sync=False)
            finally:
                os.close(fd)
        return entry


def read_log(path: str | Path) -> list[dict]:
    """Every event of a metrics log, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
