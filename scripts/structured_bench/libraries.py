"""llguidance against xgrammar on one tokenizer: vocabulary setup, the compile of a typical
schema (cold and cached) and the per-step mask cost (fill the bitmask, apply it to the logits) at
several batch sizes. xgrammar is measured only where it is installed (it is not a dependency)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.core.sampling import MASK_THREADS
from engine.model.cpu.threads import split_threads
from engine.structured.bitmask import BitmaskApplier, allocate_bitmask
from engine.structured.grammars import JSON_OPTIONS
from engine.structured.matcher import BitmaskFiller, GrammarMatcher

SEPARATORS = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])
COLD_SCHEMAS = 5  # distinct schemas (one bound apart), each compiled once


def _us(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e6, 1)


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _variants(schema: dict) -> list[str]:
    """COLD_SCHEMAS texts of `schema`, each new to a cache (a description differs)."""
    return [json.dumps({**schema, "description": f"variant {i}"}) for i in range(COLD_SCHEMAS)]


def _apply_us(
    apply: Callable[[torch.Tensor, torch.Tensor], Any],
    batch: int,
    vocab: int,
    bitmask: torch.Tensor,
    repeats: int = 50,
) -> float:
    logits = torch.randn(batch, vocab)
    apply(logits, bitmask)  # warm-up
    return _us([_timed(lambda: apply(logits, bitmask))[0] for _ in range(repeats)])


def _our_apply(rows: list[int]) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    applier = BitmaskApplier()

    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        with split_threads(torch.get_num_threads()):
            return applier.apply(logits, bitmask, rows)

    return apply


def measure_llguidance(
    tokenizer: Any, vocab: int, eos: list[int], schema: dict, tokens: list[int], batches: list[int]
) -> dict:
    import llguidance
    import llguidance.torch

    setup, ll_tokenizer = _timed(
        lambda: llguidance.LLTokenizer(
            tokenizer.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=eos
        )
    )

    def compile_warm(text: str) -> llguidance.LLMatcher:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, ll_tokenizer
        )
        assert not failed, messages
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        llguidance.torch.fill_next_token_bitmask(matcher, allocate_bitmask(1, vocab), 0)
        return matcher

    cold = [_timed(lambda t=text: compile_warm(t))[0] for text in _variants(schema)]
    prototype = compile_warm(json.dumps(schema))

    def cached() -> None:  # what engine.structured does per sequence: copy the warm matcher
        copy = prototype.deep_copy()
        llguidance.torch.fill_next_token_bitmask(copy, allocate_bitmask(1, vocab), 0)

    hits = [_timed(cached)[0] for _ in range(COLD_SCHEMAS)]
    filler = BitmaskFiller(MASK_THREADS)  # as the sampler fills: threads past one row
    per_batch = {}
    for batch in batches:
        matchers = [GrammarMatcher(prototype.deep_copy()) for _ in range(batch)]
        bitmask = allocate_bitmask(batch, vocab)
        fills = []
        for token in tokens:
            fills.append(_timed(lambda ms=matchers, bm=bitmask: filler.fill(ms, bm))[0])
            for matcher in matchers:
                assert matcher.accept(token), matcher.error
        rows = list(range(batch))
        apply = _apply_us(_our_apply(rows), batch, vocab, bitmask)
        per_batch[str(batch)] = {
            "fill_us": _us(fills),
            "apply_us": apply,
            "step_us": round(_us(fills) + apply, 1),
        }
    return {
        "version": llguidance.get_version() if hasattr(llguidance, "get_version") else None,
        "tokenizer_setup_s": round(setup, 3),
        "compile_cold_ms": _ms(cold),
        "compile_cached_ms": _ms(hits),
        "apply": "engine.structured's BitmaskApplier on one thread, as the sampler runs it "
        "(llguidance's own apply is a torch.compile kernel)",
        "per_batch": per_batch,
    }


def measure_xgrammar(
    tokenizer: Any, vocab: int, schema: dict, tokens: list[int], batches: list[int]
) -> dict | None:
    if importlib.util.find_spec("xgrammar") is None:
        return None
    import xgrammar

    setup, info = _timed(
        lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile_schema(text: str) -> Any:
        return compiler.compile_json_schema(text, any_whitespace=False, separators=SEPARATORS)

    cold = [_timed(lambda t=text: compile_schema(t))[0] for text in _variants(schema)]
    text = json.dumps(schema)
    compiled = compile_schema(text)
    hits = [_timed(lambda: xgrammar.GrammarMatcher(compile_schema(text)))[0] for _ in range(5)]
    per_batch = {}
    for batch in batches:
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgrammar.allocate_token_bitmask(batch, vocab)

        def fill(ms: list = matchers, bm: torch.Tensor = bitmask) -> None:
            for row, matcher in enumerate(ms):
                matcher.fill_next_token_bitmask(bm, row)

        fills = []
        for token in tokens:
            fills.append(_timed(fill)[0])
            for matcher in matchers:
                assert matcher.accept_token(token)
        apply = _apply_us(xgrammar.apply_token_bitmask_inplace, batch, vocab, bitmask)
        ours = _apply_us(_our_apply(list(range(batch))), batch, vocab, bitmask)
        per_batch[str(batch)] = {
            "fill_us": _us(fills),
            "apply_us": apply,
            "apply_ours_us": ours,
            "step_us": round(_us(fills) + apply, 1),
        }
    return {
        "version": getattr(xgrammar, "__version__", None),
        "tokenizer_setup_s": round(setup, 3),
        "compile_cold_ms": _ms(cold),
        "compile_cached_ms": _ms(hits),
        "apply": "xgrammar.apply_token_bitmask_inplace (its CPU kernel)",
        "per_batch": per_batch,
    }


def compare(
    tokenizer: Any, vocab: int, eos: list[int], schema: dict, instance: str, batches: list[int]
) -> dict:
    tokens = tokenizer.encode(instance, add_special_tokens=False)
    return {
        "schema_tokens_walked": len(tokens),
        "llguidance": measure_llguidance(tokenizer, vocab, eos, schema, tokens, batches),
        "xgrammar": measure_xgrammar(tokenizer, vocab, schema, tokens, batches),
    }
