"""bench/variants.py: the ``--variants`` settings of bench/agent_overhead.py, consumers.py and qt_stats.py."""

import importlib

import pytest

from bench import variants

swiglu = importlib.import_module("fp8mon.trainer.kernels.swiglu")  # the package re-exports a function of that name


def test_parse_all_reads_each_variant_and_its_literals():
    parsed = variants.parse_all("default; trainer.kernels.swiglu.STATS_STAGES=2, trainer.kernels.swiglu.WORDS=False")
    assert [name for name, _ in parsed] == ["default", "fp8mon.trainer.kernels.swiglu.STATS_STAGES=2, "
                                            "fp8mon.trainer.kernels.swiglu.WORDS=False"]
    assert parsed[0][1] == []
    assert parsed[1][1] == [(swiglu, "STATS_STAGES", 2), (swiglu, "WORDS", False)]


@pytest.mark.parametrize("bad, message", [
    ("fp8mon.trainer.kernels.swiglu.STATS_STAGES", "is not module.ATTR=value"),
    ("STATS_STAGES=2", "is not module.ATTR=value"),
    ("fp8mon.trainer.kernels.swiglu.NO_SUCH=1", "has no attribute NO_SUCH"),
    ("fp8mon.trainer.kernels.no_such_module.X=1", "No module named"),
    ("fp8mon.trainer.kernels.swiglu.STATS_STAGES=two", "malformed"),
])
def test_parse_names_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        variants.parse(bad)


def test_applied_sets_for_the_block_and_restores_after_an_error():
    before = swiglu.STATS_STAGES
    with pytest.raises(RuntimeError):
        with variants.applied(variants.parse(f"fp8mon.trainer.kernels.swiglu.STATS_STAGES={before + 5}")):
            assert swiglu.STATS_STAGES == before + 5
            raise RuntimeError("a launch failed")
    assert swiglu.STATS_STAGES == before
