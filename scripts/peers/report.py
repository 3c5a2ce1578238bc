"""The comparison's figures from the rounds' raw runs: per (config, concurrency) the medians over
rounds, Modelyard's ratios to llama-server, and each format's bandwidth bound at C=1."""

from __future__ import annotations

from statistics import median

from scripts.peers.configs import CONFIGS, LLAMA_SAME_FILE
from scripts.peers.weights import Tensor, bound_tok_s, bytes_per_token


def _q(run: dict, metric: str, q: str) -> float | None:
    return run[metric].get(q)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(median(present), 6) if present else None


def cell_summary(runs: list[dict]) -> dict:
    """Medians over rounds of speed and latency; the highest RSS; requests summed (those the
    time bound cut are neither completed nor failed)."""
    rss = [r["rss_peak_mb"] for r in runs if r.get("rss_peak_mb") is not None]
    return {
        "rounds": len(runs),
        "output_tok_s": _median([r["output_tokens_per_s"] for r in runs]),
        "ttft_p50_s": _median([_q(r, "ttft_s", "p50") for r in runs]),
        "ttft_p99_s": _median([_q(r, "ttft_s", "p99") for r in runs]),
        "itl_p50_s": _median([_q(r, "itl_s", "p50") for r in runs]),
        "itl_p99_s": _median([_q(r, "itl_s", "p99") for r in runs]),
        "rss_peak_mb": max(rss) if rss else None,
        "completed": sum(r["completed"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "unfinished_at_deadline": sum(r["unfinished_at_deadline"] for r in runs),
    }


def summarize(rounds: list[dict]) -> dict[str, dict[str, dict]]:
    """{config: {"c<N>": cell_summary}} over every round that ran the cell."""
    gathered: dict[str, dict[str, list[dict]]] = {}
    for rnd in rounds:
        for name, cells in rnd["runs"].items():
            for key, run in cells.items():
                gathered.setdefault(name, {}).setdefault(key, []).append(run)
    return {
        name: {key: cell_summary(runs) for key, runs in cells.items()}
        for name, cells in gathered.items()
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(cells: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """Modelyard's output tok/s over llama-server's on the same file (Q4_1), and over
    llama-server's fastest format, at each concurrency."""
    llama = [n for n in cells if CONFIGS[n].server == "llama"]
    out: dict[str, dict[str, dict]] = {}
    for name, by_c in cells.items():
        if CONFIGS[name].server != "modelyard":
            continue
        for key, cell in by_c.items():
            rates = {n: cells[n][key]["output_tok_s"] for n in llama if key in cells[n]}
            rates = {n: v for n, v in rates.items() if v}
            best = max(rates, key=rates.__getitem__) if rates else None
            out.setdefault(name, {})[key] = {
                "vs_llama_q4_1": _ratio(cell["output_tok_s"], rates.get(LLAMA_SAME_FILE)),
                "vs_llama_best": _ratio(cell["output_tok_s"], rates.get(best)) if best else None,
                "llama_best": best,
            }
    return out


def bandwidth_bounds(
    names: list[str], tensors: list[Tensor], bandwidth_gb_s: float, cells: dict
) -> dict[str, dict]:
    """Per config: bytes of weights per decode step, the C=1 bound they set at the measured
    bandwidth, and the measured C=1 rate over it: output tok/s (prefill included) and the
    decode rate 1 / ITL p50."""
    out = {}
    for name in names:
        nbytes = bytes_per_token(tensors, CONFIGS[name].fmt)
        bound = bound_tok_s(bandwidth_gb_s, nbytes)
        c1 = cells.get(name, {}).get("c1", {})
        itl = c1.get("itl_p50_s")
        decode = 1 / itl if itl else None
        out[name] = {
            "format": CONFIGS[name].fmt,
            "bytes_per_token": nbytes,
            "bound_tok_s": round(bound, 1),
            "measured_c1_tok_s": c1.get("output_tok_s"),
            "decode_c1_tok_s": round(decode, 1) if decode else None,
            "measured_over_bound": _ratio(c1.get("output_tok_s"), bound),
            "decode_over_bound": _ratio(decode, bound),
        }
    return out
