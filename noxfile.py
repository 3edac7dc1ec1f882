"""Test and lint sessions: one test session per package, each in its own uv-synced venv.

`uv run nox` runs them all; `uv run nox -s cp-core` runs one. Each session installs only the package
under test and its workspace dependencies, exactly as pinned in uv.lock (never GPU-only extras).
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True

PACKAGES = ("cp-core", "cp-models", "cp-vlm", "sft-trainer")


def _sync(session: nox.Session, package: str) -> None:
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--package",
        package,
        "--group",
        "test",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _make_test_session(package: str) -> None:
    @nox.session(name=package)  # the interpreter running nox (uv run nox: the workspace venv's)
    def _tests(session: nox.Session) -> None:
        _sync(session, package)
        session.run("pytest", f"packages/{package}/tests", *session.posargs)


for _package in PACKAGES:
    _make_test_session(_package)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
