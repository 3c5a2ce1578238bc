"""The generic reader: walks a YAML mapping, converting values and collecting every problem with
its key path, as ``file: key.path: problem``, so that ``modelyard check`` lists them all and a
reload refuses a bad edit with a precise reason. A value with a problem reads as its default,
so reading goes on; ``finish`` reports keys nobody read (typos are errors, never defaults)."""

from __future__ import annotations

import os
import re
from typing import Any

from common.sizes import parse_size

_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(Exception):
    """One or more problems in a models.yaml; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class Reader:
    def __init__(self, data: Any, path: str, problems: list[str], file: str) -> None:
        self.path = path
        self.problems = problems
        self.file = file
        self.seen: set[str] = set()
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.error(None, f"must be a mapping, got {type(data).__name__}")
            data = {}
        self.data = data

    def key_path(self, key: str | None) -> str:
        if key is None:
            return self.path or "(top level)"
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str | None, problem: str) -> None:
        self.problems.append(f"{self.file}: {self.key_path(key)}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        self.seen.add(key)
        return self.data.get(key)

    def section(self, key: str) -> Reader:
        return Reader(self.raw(key), self.key_path(key), self.problems, self.file)

    def item(self, key: str, index: int, data: Any) -> Reader:
        """A reader of one mapping in the list at ``key``."""
        return Reader(data, f"{self.key_path(key)}[{index}]", self.problems, self.file)

    def number(
        self,
        key: str,
        default: Any,
        *,
        kind: type = float,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_min: bool = False,
    ) -> Any:
        value = self.raw(key)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not isinstance(value, int))
        ):
            self.error(key, f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            return default
        too_low = minimum is not None and (value <= minimum if exclusive_min else value < minimum)
        if too_low or (maximum is not None and value > maximum):
            low = f"> {minimum}" if exclusive_min else f">= {minimum}"
            bounds = " and ".join(
                b
                for b in (
                    low if minimum is not None else "",
                    f"<= {maximum}" if maximum is not None else "",
                )
                if b
            )
            self.error(key, f"must be {bounds}, got {value!r}")
            return default
        return kind(value)

    def duration(self, key: str, default: Any) -> Any:
        """A duration in seconds, more than 0."""
        return self.number(key, default, minimum=0, exclusive_min=True)

    def integer(
        self, key: str, default: Any, *, minimum: int = 1, maximum: int | None = None
    ) -> Any:
        return self.number(key, default, kind=int, minimum=minimum, maximum=maximum)

    def string(
        self, key: str, default: str | None = None, *, choices: tuple[str, ...] | None = None
    ) -> str | None:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            self.error(key, f"must be a non-empty string, got {value!r}")
            return default
        if choices and value not in choices:
            self.error(key, f"must be one of {', '.join(choices)}, got {value!r}")
            return default
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.error(key, f"must be true or false, got {value!r}")
            return default
        return value

    def string_list(self, key: str) -> tuple[str, ...]:
        value = self.raw(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.error(key, f"must be a list of non-empty strings, got {value!r}")
            return ()
        return tuple(value)

    def size(self, key: str, default: int | None) -> int | None:
        """A byte count, or a size with a unit (512MiB, 2GiB, 4MB)."""
        value = self.raw(key)
        if value is None:
            return default
        try:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"invalid size {value!r}: expected e.g. 512MiB or a byte count")
            size = parse_size(value)
        except ValueError as exc:
            self.error(key, str(exc))
            return default
        if size <= 0:
            self.error(key, "must be positive")
            return default
        return size

    def env_secret(
        self, key: str, required: bool, must_be_set: bool = True
    ) -> tuple[str | None, str | None]:
        """Reads the name of an environment variable and that variable's value."""
        env = self.string(key)
        if env is None:
            if required:
                self.error(key, "is required (the name of an environment variable)")
            return None, None
        if not _ENV_RE.match(env):
            self.error(key, f"{env!r} is not a valid environment variable name")
            return None, None
        secret = os.environ.get(env)
        if not secret and must_be_set:
            self.error(key, f"environment variable {env} is not set or empty")
            return env, None
        return env, secret

    def finish(self) -> None:
        for key in self.data:
            if key not in self.seen:
                self.error(str(key), "unknown key")
