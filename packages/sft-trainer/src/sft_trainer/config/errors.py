"""The error every config problem is reported by."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """An invalid training config; ``problems`` lists every problem found, each as ``field=value: rule``."""

    def __init__(self, problems: str | Sequence[str], source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" ({source})" if source else ""
        if len(self.problems) == 1:
            message = f"invalid config{where}: {self.problems[0]}"
        else:
            listed = "\n".join(f"  - {p}" for p in self.problems)
            message = f"invalid config{where}, {len(self.problems)} problems:\n{listed}"
        super().__init__(message)
