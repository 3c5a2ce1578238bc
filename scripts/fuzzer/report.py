"""What a run found: each finding with the seed and index that rebuild its case, grouped by cause,
and the run's figures (statuses, verdicts, RSS, restarts) as JSON and as a summary."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from scripts.fuzzer.servers import MIB


@dataclass
class Finding:
    seed: int
    index: int
    label: str
    verdict: str
    status: int | None
    detail: str
    request: str
    log: list[str]
    probe: str  # the valid request right after: "ok", or what went wrong

    def cause(self) -> str:
        """What findings are grouped by: the server's traceback when it logged one, else what was
        fuzzed without the values (``field n`` for ``field n <- int 2**64``)."""
        if self.log:
            return self.log[0]
        return "; ".join(part.split(" <- ")[0] for part in self.label.split("; "))


@dataclass
class Report:
    server: str
    seed: int
    planned: int
    run: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    verdicts: collections.Counter[str] = field(default_factory=collections.Counter)
    findings: list[Finding] = field(default_factory=list)
    logged_without_finding: list[str] = field(default_factory=list)
    rss_before: int = 0
    rss_after: int = 0
    rss_peak: int = 0
    rss_cap: int | None = None
    restarts: int = 0
    wall_s: float = 0.0
    stopped_early: str | None = None

    @property
    def rss_growth(self) -> int:
        return self.rss_after - self.rss_before

    def groups(self) -> list[dict[str, Any]]:
        """Findings by (verdict, status, cause), largest group first."""
        grouped: dict[tuple[str, str, str], list[Finding]] = collections.defaultdict(list)
        for f in self.findings:
            grouped[(f.verdict, str(f.status), f.cause())].append(f)
        out = []
        for (verdict, status, cause), items in sorted(grouped.items(), key=lambda kv: -len(kv[1])):
            first = items[0]
            labels = collections.Counter(f.label for f in items)
            out.append(
                {
                    "verdict": verdict,
                    "status": status,
                    "cause": cause,
                    "count": len(items),
                    "labels": dict(labels.most_common(6)),
                    "reproduce": {"seed": first.seed, "index": first.index, "server": self.server},
                    "indices": [f.index for f in items[:20]],
                    "request": first.request,
                    "detail": first.detail,
                    "probe_after": first.probe,
                }
            )
        return out

    def figures(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "seed": self.seed,
            "cases_planned": self.planned,
            "cases": self.run,
            "statuses": dict(sorted(self.statuses.items())),
            "verdicts": dict(sorted(self.verdicts.items())),
            "findings": len(self.findings),
            "5xx": self.verdicts["5xx"],
            "non_json_errors": self.verdicts["non-JSON error body"],
            "hangs": self.verdicts["hang"],
            "rss_mib": {
                "before": round(self.rss_before / MIB, 1),
                "after": round(self.rss_after / MIB, 1),
                "growth": round(self.rss_growth / MIB, 1),
                "peak": round(self.rss_peak / MIB, 1),
                "cap": round(self.rss_cap / MIB, 1) if self.rss_cap else None,
            },
            "restarts": self.restarts,
            "wall_s": round(self.wall_s, 2),
            "stopped_early": self.stopped_early,
            "groups": self.groups(),
            "errors_logged_without_finding": self.logged_without_finding[:20],
        }

    def summary(self, examples: int = 12) -> str:
        f = self.figures()
        lines = [
            f"{self.server}: {self.run}/{self.planned} cases (seed {self.seed}) in {f['wall_s']} s,"
            f" {len(self.findings)} findings; restarts {self.restarts}"
            + (f"; stopped early: {self.stopped_early}" if self.stopped_early else ""),
            "  statuses: " + ", ".join(f"{k}: {v}" for k, v in f["statuses"].items()),
            "  verdicts: " + ", ".join(f"{k}: {v}" for k, v in f["verdicts"].items()),
            "  RSS MiB: before {before}, after {after} (growth {growth}), peak {peak}".format(
                **f["rss_mib"]
            ),
        ]
        groups = f["groups"]
        if groups:
            lines.append(f"  findings by cause ({len(groups)} groups):")
        for g in groups[:examples]:
            labels = "; ".join(f"{k} x{v}" for k, v in g["labels"].items())
            r = g["reproduce"]
            lines += [
                f"  - {g['count']} x {g['verdict']} {g['status']}: {g['cause']}",
                f"      fuzzed: {labels}"[:400],
                f"      reproduce: make_case({r['server']}, seed={r['seed']}, index={r['index']})"
                f" -> {g['request'][:200]}",
                f"      answer: {g['detail'][:200]}; valid request after: {g['probe_after']}",
                f"      indices: {g['indices']}",
            ]
        if len(groups) > examples:
            lines.append(f"  ... and {len(groups) - examples} more groups")
        return "\n".join(lines)
