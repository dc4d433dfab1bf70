"""The layout's contracts: imports point down through the packages by process (import-linter's
contracts in pyproject.toml), the API process's modules never start jax, and the README's
configuration tables name every EngineConfig field and command-line flag, and no other."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys

from importlinter.cli import lint_imports

from jaxserve.config import EngineConfig
from jaxserve.entrypoints.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_keep_the_contracts_of_pyproject():
    """Layers bench > entrypoints > engine > distributed : worker > model > pallas_kernels, the
    scheduler without jax, and the model without kernels."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert lint_imports(no_cache=True, no_logo=True) == 0
    finally:
        os.chdir(cwd)


def test_what_the_api_process_imports_starts_no_jax():
    """Every module of the API process (the CLI's serve path, the server, Ray Serve's replicas),
    with what they reach into the engine package for: imported together, jax stays out."""
    code = """
import importlib, pkgutil, sys
import jaxserve.entrypoints as api
names = [m.name for m in pkgutil.walk_packages(api.__path__, 'jaxserve.entrypoints.')]
for name in names + ['jaxserve', 'jaxserve.config', 'jaxserve.tokenizer', 'jaxserve.engine.batching',
                     'jaxserve.engine.core_process', 'jaxserve.engine.state', 'jaxserve.engine.output_processor',
                     'jaxserve.distributed.multihost']:
    importlib.import_module(name)
print(len(names), sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert int(out[0]) >= 14 and out[1].strip() == "[]", out


def _readme_section(title: str) -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for sub in subparsers.choices.values() for action in sub._actions
            for flag in action.option_strings if flag.startswith("--") and flag != "--help"}


def test_the_readme_names_every_engine_config_field_and_flag_and_no_other():
    config = _readme_section("Configuration")
    fields = set(re.findall(r"^\|(?:[^|\\]|\\\|)*\| `(\w+)` \|", config, flags=re.M))
    assert fields == {f.name for f in dataclasses.fields(EngineConfig)}
    # Every flag of `jaxserve generate` and `jaxserve serve`, in the tables or the CLI's line.
    written = set(re.findall(r"(--[a-z][a-z0-9-]*)", config + _readme_section("Python API")))
    assert written == _flags(build_parser())
