"""Load generator for any OpenAI-compatible server (this engine, the gateway, a peer).

Streams /v1/completions (or /v1/chat/completions) requests built from a seeded prompt set with
mixed lengths, either at fixed concurrencies (closed loop) or at a Poisson request rate (open
loop), and reports requests/s, output tokens/s and TTFT / inter-token / end-to-end latency
percentiles as JSON. Every run is bounded by --num-requests and --max-seconds.

In the same invocation it can also start the engine itself (--serve, with the engine's own flags
after it) and measure baselines on the same prompts: the engine driven offline in-process at the
same concurrency (what HTTP costs), and transformers generate() with static batches (--baseline-hf).

    python scripts/bench_serving.py --serve "--model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --served-model-name smollm2" --concurrency 1,4,16,32 --output-len 128 --offline \\
        --baseline-hf --out bench-results/serving.json
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2 \\
        --request-rate 4 --output-len 32:256 --num-requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from common.net import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a plain script: make `engine` importable
    sys.path.insert(0, str(REPO_ROOT))

from scripts.measure import percentile  # noqa: E402

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they this which be have "
    "are were had not but their there been one all would when will more no who so if out about "
    "up what some into them can only other new time could these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since "
    "against go came right used take three model engine cache block token batch request stream "
    "server latency queue memory kernel attention prefix schedule decode sample output prompt"
)
_WORDS = _WORD_TEXT.split()


# ---- workload --------------------------------------------------------------------------------


@dataclass
class RequestSpec:
    prompt: str
    max_tokens: int


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: expected N or MIN:MAX, 0 < MIN")
    return lo, hi


def build_workload(
    count: int, seed: int, input_words: tuple[int, int], output_len: tuple[int, int]
) -> list[RequestSpec]:
    """Seeded prompts of mixed lengths (uniform word counts) and output lengths."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(*input_words))]
        prompt = f"Request {i}: " + " ".join(words)
        specs.append(RequestSpec(prompt, rng.randint(*output_len)))
    return specs


def tagged(specs: list[RequestSpec], tag: str) -> list[RequestSpec]:
    """The workload with every prompt opened by a run's own tag: runs against one server must not
    reuse each other's prompts from its prefix cache (same lengths, no shared first block)."""
    return [RequestSpec(f"[{tag}] {spec.prompt}", spec.max_tokens) for spec in specs]


# ---- statistics ------------------------------------------------------------------------------


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


# ---- HTTP client -----------------------------------------------------------------------------


class Client:
    def __init__(
        self, base_url: str, model: str, endpoint: str, ignore_eos: bool, api_key: str | None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.ignore_eos = ignore_eos
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, spec: RequestSpec) -> dict:
        body = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM-style extra: fixed output lengths
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    async def send(
        self, session: aiohttp.ClientSession, spec: RequestSpec, result: RequestResult
    ) -> None:
        """Run one streaming request, filling ``result`` as chunks arrive (so a cancelled
        request still tells how far it got)."""
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        result.start = time.perf_counter()
        last = None
        try:
            async with session.post(
                self.base_url + path, json=self.body(spec), headers=self.headers
            ) as reply:
                if reply.status != 200:
                    result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                    return
                async for raw in reply.content:
                    line = raw.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        result.ok = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        result.error = str(chunk["error"].get("message"))[:200]
                        return
                    usage = chunk.get("usage")
                    if any(_choice_text(c) for c in chunk.get("choices") or []):
                        now = time.perf_counter()
                        result.output_tokens += 1  # one chunk per engine step and request
                        if last is None:
                            result.ttft = now - result.start
                        else:
                            result.itls.append(now - last)
                        last = now
                    if usage:
                        result.prompt_tokens = usage["prompt_tokens"]
                        result.output_tokens = usage["completion_tokens"]
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as error:
            result.error = f"{type(error).__name__}: {error}"[:200]
            result.ok = False
        result.end = time.perf_counter()
        if result.ok and result.ttft is None:
            result.ok, result.error = False, "no tokens received"


def _choice_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def run_concurrency(
    client: Client, specs: list[RequestSpec], concurrency: int, max_seconds: float
) -> dict:
    """Closed loop: ``concurrency`` workers, each sends its next request when one finishes."""
    results: list[RequestResult] = []
    queue = list(reversed(specs))
    deadline = time.perf_counter() + max_seconds
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max(max_seconds, 60))

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue and time.perf_counter() < deadline:
            results.append(RequestResult(ok=False, start=time.perf_counter()))
            await client.send(session, queue.pop(), results[-1])

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        workers = [asyncio.ensure_future(worker(session)) for _ in range(concurrency)]
        remaining = deadline - time.perf_counter()
        _, pending = await asyncio.wait(workers, timeout=max(remaining, 0) + 1)
        for task in pending:  # the time bound ends in-flight requests too
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - started
    extra = {"mode": "concurrency", "concurrency": concurrency, "cut_at_deadline": len(pending)}
    return report(results, duration, extra)


async def run_rate(
    client: Client, specs: list[RequestSpec], rate: float, seed: int, max_seconds: float
) -> dict:
    """Open loop: Poisson arrivals at ``rate`` requests/s, whatever the server's pace."""
    rng = random.Random(seed)
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max(max_seconds, 60))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        deadline = started + max_seconds
        tasks = []

        async def one(spec: RequestSpec) -> None:
            results.append(RequestResult(ok=False, start=time.perf_counter()))
            await client.send(session, spec, results[-1])

        for spec in specs:
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.ensure_future(one(spec)))
            await asyncio.sleep(rng.expovariate(rate))
        remaining = max(deadline - time.perf_counter(), 0) + 1
        _, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - started
    extra = {
        "mode": "poisson",
        "request_rate": rate,
        "sent": len(tasks),
        "cut_at_deadline": len(pending),
    }
    return report(results, duration, extra)


# ---- starting the engine ---------------------------------------------------------------------


class EngineServer:
    """``python -m engine`` with the given flags on a free loopback port."""

    def __init__(self, engine_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 (open for the process lifetime)
        cmd = [
            sys.executable,
            "-m",
            "engine",
            *engine_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"engine not ready after {timeout} s")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


# ---- in-process baselines --------------------------------------------------------------------


def run_offline(
    engine_args: list[str],
    specs: list[RequestSpec],
    concurrency: int,
    max_seconds: float,
    core=None,
):
    """The engine's own throughput without HTTP: EngineCore driven in this process, closed loop
    with ``concurrency`` requests in flight, the same prompts and output lengths."""
    from engine.core.engine_core import EngineCore
    from engine.core.sampling_params import SamplingParams
    from engine.errors import InvalidRequestError
    from engine.serving.cli import parse_args

    if core is None:
        config, _ = parse_args(engine_args)
        core = EngineCore(config)
    queue = list(reversed(specs))
    in_flight: dict[str, RequestResult] = {}
    results: list[RequestResult] = []
    counter = 0
    started = time.perf_counter()
    deadline = started + max_seconds
    while (queue or in_flight) and time.perf_counter() < deadline:
        while queue and len(in_flight) < concurrency:
            spec = queue.pop()
            request_id = f"offline-{counter}"
            counter += 1
            ids = list(core.tokenizer(spec.prompt)["input_ids"])
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            result = RequestResult(ok=False, start=time.perf_counter(), prompt_tokens=len(ids))
            results.append(result)
            try:
                core.add_request(request_id, ids, params)
            except InvalidRequestError as error:  # what the server answers with a 400
                result.error = error.message
                continue
            in_flight[request_id] = result
        for out in core.step():
            now = time.perf_counter()
            result = in_flight[out.request_id]
            result.output_tokens += sum(len(c.token_ids) for c in out.outputs)
            if result.ttft is None:
                result.ttft = now - result.start
            if out.finished:
                result.ok, result.end = True, now
                del in_flight[out.request_id]
    for request_id in in_flight:  # cut by the time bound: their tokens so far still count
        core.abort(request_id)
    duration = time.perf_counter() - started
    extra = {
        "mode": "offline-engine",
        "concurrency": concurrency,
        "cut_at_deadline": len(in_flight),
    }
    return report(results, duration, extra), core


def hf_model(engine_args: list[str]) -> tuple[Path, str]:
    """The engine's model as transformers loads it: folder (a GGUF's converted copy) and dtype."""
    from engine.model.loader import converted_gguf_dir, resolve_device, resolve_dtype, split_source
    from engine.serving.cli import parse_args

    config, _ = parse_args(engine_args)
    path, gguf = split_source(config.model, config.gguf_file)
    dtype = resolve_dtype(config.dtype, resolve_device(config.device))
    return (converted_gguf_dir(path / gguf) if gguf else path), str(dtype).removeprefix("torch.")


def run_hf_static(
    model: tuple[Path, str], specs: list[RequestSpec], batch: int, max_seconds: float
) -> dict:
    """transformers generate() with static batches of ``batch`` prompts, one after another (left
    padded, greedy). A static batch runs until its longest request is done, so only the tokens
    each request asked for count as output (the rest is static batching's waste)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, dtype = model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():  # warm-up: first calls pay one-off allocation costs
        warm = tokenizer(["warm up"], return_tensors="pt")
        hf.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    results: list[RequestResult] = []
    started = time.perf_counter()
    deadline = started + max_seconds
    for i in range(0, len(specs), batch):
        group = specs[i : i + batch]
        if time.perf_counter() >= deadline:
            break
        new_tokens = max(s.max_tokens for s in group)
        inputs = tokenizer([s.prompt for s in group], return_tensors="pt", padding=True)
        begin = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        end = time.perf_counter()
        for spec, mask in zip(group, inputs["attention_mask"], strict=True):
            results.append(
                RequestResult(
                    ok=True,
                    start=begin,
                    end=end,
                    ttft=None,
                    prompt_tokens=int(mask.sum()),
                    output_tokens=spec.max_tokens,
                )
            )
    duration = time.perf_counter() - started
    return report(results, duration, {"mode": "hf-static-batch", "batch": batch, "dtype": dtype})


# ---- main ------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--base-url", help="server to load (e.g. http://127.0.0.1:8000); or use --serve")
    add("--serve", metavar="ENGINE_FLAGS", help="start `python -m engine` with these flags")
    add("--model", help="model name to request (default: the first --served-model-name)")
    add("--endpoint", choices=["completions", "chat"], default="completions", help="API used")
    add("--api-key-env", help="env var holding a bearer key (never printed)")
    add("--concurrency", default="", help="comma-separated fixed concurrencies, e.g. 1,4,16,32")
    add("--request-rate", default="", help="comma-separated Poisson rates in requests/s")
    add("--num-requests", type=int, default=64, help="requests per run (upper bound)")
    add("--max-seconds", type=float, default=180.0, help="time bound of each run")
    add("--input-words", type=parse_range, default=(16, 256), help="prompt words N or MIN:MAX")
    add("--output-len", type=parse_range, default=(128, 128), help="max_tokens N or MIN:MAX")
    add("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    add("--seed", type=int, default=0, help="workload and arrival seed")
    add("--offline", action="store_true", help="also run the engine in-process (needs --serve)")
    add("--baseline-hf", action="store_true", help="also run transformers generate() batches")
    add("--hf-max-batch", type=int, default=32, help="largest static batch for --baseline-hf")
    add("--hf-batch", type=int, default=16, help="static batch size of the rate runs' baseline")
    add("--warmup", type=int, default=2, help="untimed requests before the first run")
    add("--out", type=Path, help="write the JSON report here too")
    args = p.parse_args(argv)
    if bool(args.base_url) == bool(args.serve):
        p.error("give exactly one of --base-url or --serve")
    if (args.offline or args.baseline_hf) and not args.serve:
        p.error("--offline and --baseline-hf need --serve (they load the same model)")
    if not args.concurrency and not args.request_rate:
        p.error("give --concurrency and/or --request-rate")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    rates = [float(r) for r in args.request_rate.split(",") if r]
    engine_args = shlex.split(args.serve) if args.serve else []
    served = None
    if "--served-model-name" in engine_args:
        served = engine_args[engine_args.index("--served-model-name") + 1]
    model = (
        args.model
        or served
        or (engine_args[engine_args.index("--model") + 1] if "--model" in engine_args else None)
    )
    if model is None:
        raise SystemExit("--model is required with --base-url")
    specs = build_workload(args.num_requests, args.seed, args.input_words, args.output_len)
    out: dict = {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k != "api_key_env"
        },
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
        "runs": [],
    }
    server = None
    base_url = args.base_url
    if args.serve:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-engine.log"
        server = EngineServer(engine_args, log_path)
        print(f"starting engine (log: {log_path})", file=sys.stderr)
        server.wait_ready(timeout=900)
        base_url = server.url
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    client = Client(base_url, model, args.endpoint, not args.no_ignore_eos, api_key)
    try:
        warm = build_workload(args.warmup, args.seed + 1, (8, 16), (8, 8))
        if warm:
            asyncio.run(run_concurrency(client, warm, len(warm), 120))
        for c in concurrencies:
            run = asyncio.run(run_concurrency(client, tagged(specs, f"c{c}"), c, args.max_seconds))
            out["runs"].append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
        for rate in rates:
            run_specs = tagged(specs, f"r{rate}")
            run = asyncio.run(run_rate(client, run_specs, rate, args.seed, args.max_seconds))
            out["runs"].append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
    finally:
        if server is not None:
            out["engine_exit_code"] = server.stop()
    rate_runs = [run for run in out["runs"] if run["mode"] == "poisson"]
    baselines = _baselines(args, engine_args, specs, concurrencies, rate_runs)
    out["baselines"] = baselines
    out["ratios"] = _ratios(out["runs"], baselines)
    out["host"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def _baselines(
    args: argparse.Namespace,
    engine_args: list[str],
    specs: list[RequestSpec],
    concurrencies: list[int],
    rate_runs: list[dict],
) -> list[dict]:
    baselines: list[dict] = []
    if args.offline:
        core = None
        warm = build_workload(args.warmup, args.seed + 1, (8, 16), (8, 8))
        if warm:
            _, core = run_offline(engine_args, warm, len(warm), 120)
        for c in concurrencies:
            run_specs = tagged(specs, f"c{c}")
            run, core = run_offline(engine_args, run_specs, c, args.max_seconds, core)
            baselines.append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
    if args.baseline_hf:
        model = hf_model(engine_args)
        for c in concurrencies:  # one static batch of the same first c prompts
            if c <= args.hf_max_batch and c <= len(specs):
                run_specs = tagged(specs[:c], f"c{c}")
                baselines.append(run_hf_static(model, run_specs, c, args.max_seconds))
                print(json.dumps(_brief(baselines[-1])), file=sys.stderr)
        if rate_runs:  # the whole request set the rate runs sent, in static batches
            sent = max(run["sent"] for run in rate_runs)
            run_specs = tagged(specs[:sent], "rate")
            run = run_hf_static(model, run_specs, args.hf_batch, args.max_seconds)
            run["for"] = "request-rate runs"
            baselines.append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
    return baselines


def _ratios(runs: list[dict], baselines: list[dict]) -> dict:
    ratios = {}
    for run in runs:
        if run["mode"] != "concurrency":
            continue
        c = run["concurrency"]
        entry = {}
        for base in baselines:
            if "for" in base or base.get("concurrency", base.get("batch")) != c:
                continue
            key = (
                "http_over_offline_engine"
                if base["mode"] == "offline-engine"
                else ("http_over_hf_static_batch")
            )
            entry[key] = ratio(run["output_tokens_per_s"], base["output_tokens_per_s"])
        if entry:
            ratios[f"c{c}"] = entry
    return ratios


def _brief(run: dict) -> dict:
    keys = ("mode", "concurrency", "request_rate", "batch", "completed", "errors")
    brief = {k: run[k] for k in keys if k in run}
    brief["out_tok_s"] = round(run["output_tokens_per_s"], 1)
    for name in ("ttft_s", "itl_s"):
        brief[name] = {
            q: round(v, 4) for q, v in run[name].items() if v is not None and q != "mean"
        }
    return brief


if __name__ == "__main__":
    sys.exit(main())
