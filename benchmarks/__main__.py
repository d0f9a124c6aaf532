"""`python -m benchmarks [--debug] SCENARIO [args...]`, which `siding bench` execs."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
USAGE = "usage: siding bench [--debug] SCENARIO [args...]   (SCENARIO --help for its options)"
EXTRA = "the benchmarks need the bench extra: pip install 'siding[bench]'"


def scenarios() -> list[str]:
    """Scenario names: this package's modules that define `main`."""
    names = []
    for info in pkgutil.iter_modules([str(HERE)]):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"benchmarks.{info.name}")
        except ImportError:
            continue
        if callable(getattr(module, "main", None)):
            names.append(info.name.replace("_", "-"))
    return names


def scenario(name: str) -> ModuleType:
    module_name = name.replace("-", "_")
    module = None
    if not module_name.startswith("_") and (HERE / f"{module_name}.py").is_file():
        module = importlib.import_module(f"benchmarks.{module_name}")
    if not callable(getattr(module, "main", None)):
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(scenarios())}")
    return module


def main(argv: list[str]) -> None:
    debug = argv[:1] == ["--debug"]
    argv = argv[1:] if debug else argv
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    name, rest = argv[0], argv[1:]
    try:
        scenario(name).main(rest)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as e:
        if debug:
            raise
        hint = f" ({EXTRA})" if isinstance(e, ImportError) else ""
        print(f"siding bench {name}: error: {e}{hint}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
