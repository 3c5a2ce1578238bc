"""The comparison's figures on one GGUF from the rounds' raw runs: per (config, concurrency) the
medians over rounds; per server its spawn-to-ready time and resident memory after load and under
load; Modelyard's ratios to llama-server on the same file; each format's bandwidth bound at C=1."""

from __future__ import annotations

from statistics import median

from scripts.peers.configs import CONFIGS, same_file_llama
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


def servers_summary(rounds: list[dict]) -> dict[str, dict]:
    """Per config over the rounds: the median spawn-to-ready time and RSS after load (each
    round starts the server afresh), and the highest RSS sampled under load and VmHWM."""
    out: dict[str, dict] = {}
    names = {n for rnd in rounds for n in (*rnd["runs"], *rnd.get("startup", {}))}
    for name in sorted(names):
        starts = [rnd["startup"][name] for rnd in rounds if name in rnd.get("startup", {})]
        runs = [run for rnd in rounds for run in rnd["runs"].get(name, {}).values()]
        peaks = [r["rss_peak_mb"] for r in runs if r.get("rss_peak_mb") is not None]
        hwm = [r["vm_hwm_mb"] for r in runs if r.get("vm_hwm_mb") is not None]
        out[name] = {
            "ready_s": _median([s["ready_s"] for s in starts]),
            "ready_s_rounds": [s["ready_s"] for s in starts],
            "rss_after_load_mb": _median([s["rss_after_load_mb"] for s in starts]),
            "rss_peak_mb": max(peaks) if peaks else None,
            "vm_hwm_mb": max(hwm) if hwm else None,
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(cells: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """Per Modelyard config and concurrency: its output tok/s over llama-server's on the same
    file and over llama-server's fastest format; its TTFT and ITL p50 over llama-server's on the
    same file (below 1: Modelyard answers sooner)."""
    llama = [n for n in cells if CONFIGS[n].server == "llama"]
    same = same_file_llama(llama)
    out: dict[str, dict[str, dict]] = {}
    for name, by_c in cells.items():
        if CONFIGS[name].server != "modelyard":
            continue
        for key, cell in by_c.items():
            rates = {n: cells[n][key]["output_tok_s"] for n in llama if key in cells[n]}
            rates = {n: v for n, v in rates.items() if v}
            best = max(rates, key=rates.__getitem__) if rates else None
            peer = cells[same].get(key, {}) if same else {}
            out.setdefault(name, {})[key] = {
                "vs_llama_same_file": _ratio(cell["output_tok_s"], peer.get("output_tok_s")),
                "vs_llama_best": _ratio(cell["output_tok_s"], rates.get(best)) if best else None,
                "llama_best": best,
                "ttft_p50_vs_llama_same_file": _ratio(cell["ttft_p50_s"], peer.get("ttft_p50_s")),
                "itl_p50_vs_llama_same_file": _ratio(cell["itl_p50_s"], peer.get("itl_p50_s")),
            }
    return out


SERVER_FIGURES = ("ready_s", "rss_after_load_mb", "rss_peak_mb")


def server_ratios(servers: dict[str, dict]) -> dict[str, dict]:
    """Per Modelyard config: its start-to-ready time and RSS (after load, peak under load) over
    llama-server's on the same file (below 1: Modelyard is quicker or smaller)."""
    same = same_file_llama(list(servers))
    if same is None:
        return {}
    return {
        name: {"versus": same} | {k: _ratio(figures[k], servers[same][k]) for k in SERVER_FIGURES}
        for name, figures in servers.items()
        if CONFIGS[name].server == "modelyard"
    }


def summary_table(name: str, cells: dict, servers: dict, concurrencies: list[int]) -> str:
    """One model's figures as text: tok/s at each concurrency, TTFT and ITL p50 at the lowest,
    start-to-ready time and RSS."""
    low = f"c{concurrencies[0]}"
    head = [f"{'config':<16}", *(f"{'tok/s C=' + str(c):>12}" for c in concurrencies)]
    head += [f"{'TTFT ' + low:>10}", f"{'ITL ' + low:>9}", f"{'ready s':>8}"]
    head += [f"{'RSS load':>9}", f"{'RSS peak':>9}"]
    lines = [name, "".join(head)]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for config in dict.fromkeys([*servers, *cells]):
        by_c, srv = cells.get(config, {}), servers.get(config, {})
        row = [f"{config:<16}"]
        row += [
            f"{num(by_c.get(f'c{c}', {}).get('output_tok_s'), '.1f'):>12}" for c in concurrencies
        ]
        row += [f"{num(by_c.get(low, {}).get('ttft_p50_s'), '.3f'):>10}"]
        row += [f"{num(by_c.get(low, {}).get('itl_p50_s'), '.4f'):>9}"]
        row += [f"{num(srv.get('ready_s'), '.2f'):>8}"]
        row += [f"{num(srv.get('rss_after_load_mb'), '.0f'):>9}"]
        row += [f"{num(srv.get('rss_peak_mb'), '.0f'):>9}"]
        lines.append("".join(row))
    return "\n".join(lines)


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
