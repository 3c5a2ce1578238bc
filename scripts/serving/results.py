"""One request's result as it streams in, and a run's report: requests/s, output tokens/s, and
TTFT / inter-token / end-to-end latency percentiles."""

from __future__ import annotations

from dataclasses import dataclass, field

from scripts.measure import percentile


def summary(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


@dataclass
class RequestResult:
    ok: bool
    start: float
    end: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0  # the server's usage figure once finished, else tokens streamed so far
    error: str | None = None  # None on a request that is unfinished (cut by --max-seconds)


def report(results: list[RequestResult], duration: float, extra: dict) -> dict:
    """Throughput counts every token received within the run, including those of requests the
    time bound cut short (so a slow server still gets a figure); e2e only finished requests."""
    done = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok and r.error is not None]
    cut = [r for r in results if not r.ok and r.error is None]
    output_tokens = sum(r.output_tokens for r in done + cut)
    return {
        **extra,
        "completed": len(done),
        "unfinished_at_deadline": len(cut),
        "errors": len(errors),
        "error_samples": sorted({r.error or "" for r in errors})[:5],
        "duration_s": round(duration, 3),
        "requests_per_s": len(done) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "ttft_s": summary([r.ttft for r in done + cut if r.ttft is not None]),
        "itl_s": summary([gap for r in done + cut for gap in r.itls]),
        "e2e_s": summary([r.end - r.start for r in done]),
    }
