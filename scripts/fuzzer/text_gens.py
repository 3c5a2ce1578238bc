"""Generators of regex, grammar (Lark and GBNF) and choice constraints: small sane ones, nested
counted repetitions, huge alternations, chained and recursive grammars, and garbage. Each takes a
Draw and returns (what it drew, Constraint); a regex is marked ``python_regex`` only where
Python's re reads it as the engine's Rust regex does."""

from __future__ import annotations

import string

from scripts.fuzzer.constraints import Constraint, counted_regex, lark_chain
from scripts.fuzzer.draw import Draw

Generated = tuple[str, Constraint]

_PIECES = [
    "[0-9]{1,3}", "(yes|no)", "[a-z]{2,5}", r"\d{4}-\d{2}-\d{2}", "(red|green|blue)",
    "[A-F0-9]{4}", " ", "-", "(a|b)*c", "x?y+", "[^,]{0,5}", "[a-z0-9_]{1,3}", "(?i:ok)", "é{1,2}",
]  # fmt: skip


def _regex(detail: str, pattern: str, python: bool = True) -> Generated:
    return detail, Constraint("regex", pattern, python_regex=python)


def regex_simple(d: Draw) -> Generated:
    pattern = "".join(d.rng.choices(_PIECES, k=d.rng.randint(1, 4)))
    return _regex("simple", pattern)


def regex_counted(d: Draw) -> Generated:
    """Nested counted repetition: tiny text, an automaton up to inner x outer states."""
    inner, outer = d.size((2, 8, 50, 300, 1000)), d.size((2, 8, 50, 300, 1000))
    shape = d.rng.choice(["ab", "ab suffix", "range", "triple", "groups"])
    pattern = {
        "ab": counted_regex(inner, outer),
        "ab suffix": counted_regex(inner, outer, f"c{d.rng.randint(0, 10**6)}"),
        "range": f"(a{{1,{inner}}}b){{{outer}}}",
        "triple": f"((ab{{{inner}}}){{{outer}}}c){{2}}",
        "groups": "(" * min(inner, 200) + "a" + ")" * min(inner, 200) + f"{{{outer}}}",
    }[shape]
    return _regex(f"{shape} inner={inner} outer={outer}", pattern)


def regex_alternation(d: Draw) -> Generated:
    n = d.size((3, 50, 1000, 10000, 50000))
    shape = d.rng.choice(["words", "numbers", "shared prefixes"])
    words = {
        "words": [f"w{i}x" for i in range(n)],
        "numbers": [str(i * 37) for i in range(n)],
        "shared prefixes": ["p" * (i % 30) + f"q{i}" for i in range(n)],
    }[shape]
    return _regex(f"{shape} n={n}", "(" + "|".join(words) + ")")


def regex_unicode(d: Draw) -> Generated:
    pattern, python = d.rng.choice(
        [
            (r"\p{L}{1,5}", False),  # Python's re has no \p
            ("[äöü]{1,3}", True),
            ("(😀|👍🏽){1,2}", True),
            (r"[\u4e00-\u9fff]{1,4}", True),
            (r"[^\x00-\x7f]{1,3}", True),
        ]
    )
    return _regex("unicode", pattern, python)


def regex_garbage(d: Draw) -> Generated:
    """Invalid for Rust's regex (lookaround, backreferences, bad ranges and repeats), empty, NUL,
    noise, or nested deeper than its parser allows."""
    fixed = [
        "((", "[a-", "a{5,2}", "(?<=a)b", "(a)\\1", "\\", "a**", "x{100000}", "(?P<n>a)(?P=n)",
        "\x00", "[z-a]", "", ")(", "a{,}", "(?", "\\p{Nope}",
    ]  # fmt: skip
    roll = d.rng.random()
    if roll < 0.2:
        depth = d.size((10, 100, 1000, 10000, 50000))
        return _regex(f"nested groups {depth}", "(" * depth + "a" + ")" * depth, False)
    if roll < 0.4:
        noise = "".join(d.rng.choices(string.printable, k=d.rng.randint(1, 60)))
        return _regex("noise", noise, False)
    return _regex("fixed", d.rng.choice(fixed), False)


def _grammar(detail: str, text: str) -> Generated:
    return detail, Constraint("grammar", text)


_LARK_SIMPLE = [
    'start: NUM ("+" NUM)*\nNUM: /[0-9]+/',
    'start: "yes" | "no"',
    'start: item ("," item)*\nitem: /[a-z]{1,5}/',
    'start: "(" start ")" | "x"',
    'start: e\ne: e "+" t | t\nt: /[0-9]/',  # left recursion
    'start: %json {"type": "integer", "minimum": 0, "maximum": 99}',
    'root ::= "a" | "b"',  # GBNF
    'root ::= [0-9]+ ("," [0-9]+)*',
]


def lark_simple(d: Draw) -> Generated:
    i = d.rng.randrange(len(_LARK_SIMPLE))
    return _grammar(f"#{i}", _LARK_SIMPLE[i])


def lark_chain_gen(d: Draw) -> Generated:
    rules = d.size((3, 50, 500, 3000, 8000))
    style = d.rng.choice(["plain", "prefix", "either"])
    return _grammar(f"{style} rules={rules}", lark_chain(rules, style))


def lark_recursive(d: Draw) -> Generated:
    n = d.size((2, 20, 300, 3000, 20000))
    shape = d.rng.choice(["ring", "wide", "nested parens", "counted terminal", "long sequence"])
    if shape == "ring":  # mutual recursion, each with a way out
        lines = [f'r{i}: "(" r{(i + 1) % n} ")" | "x"' for i in range(n)]
        text = "start: r0\n" + "\n".join(lines)
    elif shape == "wide":
        text = "start: " + " | ".join(f'"w{i}"' for i in range(n))
    elif shape == "nested parens":
        text = "start: " + "(" * n + '"a"' + ")" * n
    elif shape == "counted terminal":
        text = f"start: /{counted_regex(min(n, 1000), min(n, 1000))}/"
    else:
        text = "start: " + " ".join(f'"t{i}"' for i in range(n))
    return _grammar(f"{shape} n={n}", text)


def gbnf(d: Draw) -> Generated:
    n = d.size((2, 20, 300, 3000, 8000))
    shape = d.rng.choice(["chain", "recursive", "alternation"])
    if shape == "chain":
        text = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"'
    elif shape == "recursive":
        text = 'root ::= "(" root ")" | "x"'
    else:
        text = "root ::= " + " | ".join(f'"g{i}"' for i in range(n))
    return _grammar(f"{shape} n={n}", text)


def grammar_garbage(d: Draw) -> Generated:
    fixed = [
        "", "start:", "start: undefined_rule", 'start: "unterminated', "root ::= ", "%%%",
        "start: start", "start: /(/", "root ::= root", 'start: "a"\nstart: "b"', "\x00",
        "start: %json {not json}", "start: @@@",
    ]  # fmt: skip
    if d.rng.random() < 0.3:
        noise = "".join(d.rng.choices(string.printable, k=d.rng.randint(1, 80)))
        return _grammar("noise", noise)
    i = d.rng.randrange(len(fixed))
    return _grammar(f"#{i}", fixed[i])


def choice(d: Draw) -> Generated:
    n = d.size((1, 5, 100, 5000, 50000))
    shape = d.rng.choice(["words", "words", "unicode", "long", "with empty", "duplicates"])
    options: list[str] = {
        "words": [f"opt{i}" for i in range(n)],
        "unicode": [f"é{i}😀" for i in range(n)],
        "long": ["L" * d.size((3, 50, 1000, 20000, 100000)) + str(i) for i in range(min(n, 5))],
        "with empty": ["", *(f"o{i}" for i in range(n))],
        "duplicates": ["same"] * n,
    }[shape]
    return f"{shape} n={len(options)}", Constraint("choice", options)
