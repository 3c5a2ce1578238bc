"""What a structured fuzz run found: counts per generator, status and verdict, each finding with
the seed and index that rebuild its case, the victim's latencies and the server's RSS; the
run's problems (what fails it) and its JSON figures."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from scripts.fuzzer.draw import TOP_RUNG
from scripts.fuzzer.exchange import Answer
from scripts.fuzzer.structured_cases import StructuredCase


@dataclass
class Finding:
    seed: int
    index: int
    generator: str
    label: str
    verdict: str
    status: int | None
    detail: str
    log: list[str]
    probe: str  # the plain and tiny-schema requests right after: "ok", or what went wrong

    def figures(self, max_rung: int) -> dict[str, Any]:
        again = f"scripts/fuzz.py --structured --seed {self.seed} --index {self.index}"
        return {
            "reproduce": again + (f" --max-rung {max_rung}" if max_rung != TOP_RUNG else ""),
            **{k: v for k, v in vars(self).items() if k not in ("seed", "index")},
            "log": self.log[:3],
        }


@dataclass
class GeneratorFigures:
    cases: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    verdicts: collections.Counter[str] = field(default_factory=collections.Counter)
    max_s: float = 0.0


@dataclass
class StructuredReport:
    server: str
    seed: int
    planned: int
    victim_p99_bound_ms: float
    max_rung: int  # of the case generator: part of what rebuilds a case
    run: int = 0
    per_generator: dict[str, GeneratorFigures] = field(
        default_factory=lambda: collections.defaultdict(GeneratorFigures)
    )
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    verdicts: collections.Counter[str] = field(default_factory=collections.Counter)
    findings: list[Finding] = field(default_factory=list)
    restarts: int = 0
    victim: dict[str, Any] = field(default_factory=dict)
    rss_mib: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    stopped_early: str | None = None

    def record(self, case: StructuredCase, answer: Answer, verdict: str, seconds: float) -> None:
        status = str(answer.status) if answer.status else f"no answer ({answer.outcome})"
        self.run += 1
        self.statuses[status] += 1
        self.verdicts[verdict] += 1
        g = self.per_generator[case.generator]
        g.cases += 1
        g.statuses[status] += 1
        g.verdicts[verdict] += 1
        g.max_s = max(g.max_s, round(seconds, 2))

    def problems(self) -> list[str]:
        """Why the run fails: crashes, 5xx, other findings, a slow victim, an early stop."""
        found = []
        crashes, fives = self.verdicts["crash"], self.verdicts["5xx"]
        others = len(self.findings) - crashes - fives
        for count, what in ((crashes, "crashes"), (fives, "5xx"), (others, "other findings")):
            if count:
                found.append(f"{count} {what}")
        p99 = self.victim.get("p99_ms")
        if p99 is not None and p99 >= self.victim_p99_bound_ms:
            found.append(f"victim p99 {p99:g} ms, not under {self.victim_p99_bound_ms:g} ms")
        if self.stopped_early:
            found.append(f"stopped early: {self.stopped_early}")
        return found

    def figures(self) -> dict[str, Any]:
        return {
            "cases_run": self.run,
            "cases_planned": self.planned,
            "seed": self.seed,
            "passed": not self.problems(),
            "problems": self.problems(),
            "crashes": self.verdicts["crash"],
            "5xx": self.verdicts["5xx"],
            "broken_outputs": self.verdicts["broken output"],
            "findings": len(self.findings),
            "restarts": self.restarts,
            "statuses": dict(sorted(self.statuses.items())),
            "verdicts": dict(sorted(self.verdicts.items())),
            "victim": self.victim,
            "rss_mib_with_children": self.rss_mib,
            "wall_s": round(self.wall_s, 1),
            "stopped_early": self.stopped_early,
            "per_generator": {
                name: {
                    "cases": g.cases,
                    "statuses": dict(sorted(g.statuses.items())),
                    "verdicts": dict(sorted(g.verdicts.items())),
                    "max_s": g.max_s,
                }
                for name, g in sorted(self.per_generator.items())
            },
            "finding_list": [f.figures(self.max_rung) for f in self.findings[:200]],
        }

    def summary(self, examples: int = 20) -> str:
        f = self.figures()
        verdict = "passed" if f["passed"] else "FAILED " + "; ".join(f["problems"])
        lines = [
            f"{self.server} structured: {self.run}/{self.planned} cases (seed {self.seed}) in"
            f" {f['wall_s']} s: {verdict}",
            "  statuses: " + ", ".join(f"{k}: {v}" for k, v in f["statuses"].items()),
            "  verdicts: " + ", ".join(f"{k}: {v}" for k, v in f["verdicts"].items()),
            f"  victim: {self.victim}",
            f"  RSS MiB with children: {self.rss_mib}; restarts {self.restarts}",
        ]
        for finding in self.findings[:examples]:
            lines.append(
                f"  - #{finding.index} {finding.verdict} {finding.status}: {finding.label[:160]}"
                f" -> {finding.detail[:160]}; after: {finding.probe[:80]}"
            )
        return "\n".join(lines)
