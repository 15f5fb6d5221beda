"""bench/external.py in its CPU form (--tiny): the table it prints, with the agent's and the naive hooks' rows per
reporting step complete, and a configuration that cannot run reported as such while the run goes on."""

import importlib.util

import pytest
import torch

from bench import external

TINY = ["--tiny", "--no-record", "--steps", "2", "--rounds", "1", "--warmup", "1", "--every", "1"]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's ops gain nothing from intra-op threads, which spin against the other workers on a shared
    machine (a step of 40 ms takes a second)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def table(out: str, key: str) -> dict[str, str]:
    """mode -> its row of the table, for the configuration ``key``."""
    return {line.split()[2]: line for line in out.splitlines() if line.startswith(key + " ")}


def test_tiny_gpt2_eager_prints_every_mode_with_complete_rows(capsys):
    assert external.main([*TINY, "--model", "gpt2", "--precision", "bf16", "--no-compile"]) == 0
    out, err = capsys.readouterr()
    assert external.HEADER in out
    rows = table(out, "gpt2-tiny/bf16/eager")
    assert set(rows) == {"off", "on", "naive"}, out
    # 2 layers x 4 linears + lm_head: 9 linears, x 5 sites for the agent, x 3 for the naive hooks
    assert "45, got 45..45 complete" in rows["on"], out
    assert "27, got 27..27 complete" in rows["naive"], out
    for mode in ("on", "naive"):
        ms, overhead = rows[mode].split()[3:5]
        assert float(ms) > 0 and overhead.startswith(("+", "-")), rows[mode]
    assert "rows appended" not in err  # --no-record


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao is installed here")
def test_float8_without_torchao_fails_clearly_and_the_table_still_prints(capsys):
    assert external.main([*TINY, "--model", "gpt2", "--precision", "float8", "--modes", "off,on"]) == 0
    out = capsys.readouterr().out
    rows = table(out, "gpt2-tiny/float8-tensorwise/eager")
    assert set(rows) == {"off", "on"}, out
    assert all("FAILED: RuntimeError: --precision float8 needs torchao" in r for r in rows.values()), out


def test_tiny_llama_from_transformers_delivers_every_row(capsys):
    pytest.importorskip("transformers")
    assert external.main([*TINY, "--model", "llama", "--precision", "bf16", "--modes", "off,on"]) == 0
    rows = table(capsys.readouterr().out, "llama-tiny/bf16/eager")
    assert set(rows) == {"off", "on"}, rows
    # 2 layers x 7 linears (q, k, v, o, gate, up, down) + lm_head: 15 linears x 5 sites
    assert "75, got 75..75 complete" in rows["on"], rows["on"]
