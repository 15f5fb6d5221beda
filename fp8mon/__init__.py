"""fp8mon: training-health monitoring for FP8 LLM training.

    from fp8mon import Agent

The parts install as subpackages: ``fp8mon.agent`` (the in-trainer agent), ``fp8mon.monitor`` (the server),
``fp8mon.trainer`` (the reference FP8 trainer), ``fp8mon.migrations`` (the server's schema). Importing ``fp8mon``
imports none of them; ``Agent`` is loaded (with torch) on first use.
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# In a source checkout used without installing it (`PYTHONPATH=. python3 bench/...` on a GPU machine), the
# subpackages are the checkout's top-level folders beside this one; an install maps them (pyproject.toml).
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "agent" / "__init__.py").is_file():
    __path__.append(str(_checkout))

try:
    __version__ = version("fp8mon")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Agent", "__version__"]


def __getattr__(name):
    if name == "Agent":
        from fp8mon.agent import Agent

        return Agent
    raise AttributeError(f"module 'fp8mon' has no attribute {name!r}")
