"""bench/ncu_table.py reads ncu's text report into RESULTS' table (an excerpt of a real report, trimmed)."""

from bench.ncu_table import full_issue_us, kernels, labels, table

REPORT = """==PROF== Connected to process 491 (/usr/bin/python3.12)
NVIDIA H200
swiglu forward
==PROF== Profiling "_swiglu_fwd_kernel": 0%....50%....100% - 19 passes
swiglu forward + y's row (words)
==PROF== Profiling "_swiglu_fwd_words_kernel": 0%....50%....100% - 19 passes
==PROF== Disconnected from process 491
[491] python3.12@127.0.0.1
  _swiglu_fwd_kernel (528, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    smsp__inst_executed.sum                                            inst   13,231,744
    smsp__issue_active.avg.pct_of_peak_sustained_active                   %        29.46
    Section: GPU Speed Of Light Throughput
    SM Frequency                    Ghz         1.97
    DRAM Throughput                   %        82.14
    Duration                         us        46.62
    Section: Scheduler Statistics
    Active Warps Per Scheduler          warp         7.84
    Eligible Warps Per Scheduler        warp         0.40
    Section: Launch Statistics
    Registers Per Thread             register/thread              32
    # SMs                                         SM             132
  _swiglu_fwd_words_kernel (264, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    smsp__inst_executed.sum                                            inst   46,159,324
    SM Frequency                    Ghz         1.95
    Duration                         us        69.70
    # SMs                                         SM             132
"""


def test_each_kernel_with_its_label_values_and_time_at_full_issue():
    rows = kernels(REPORT)
    assert [(r["name"], r["grid"], r["block"]) for r in rows] == [("_swiglu_fwd_kernel", 528, 256),
                                                                  ("_swiglu_fwd_words_kernel", 264, 256)]
    assert rows[0]["inst"] == 13231744 and rows[0]["regs"] == 32 and rows[0]["eligible"] == 0.40
    assert labels(REPORT) == ["swiglu forward", "swiglu forward + y's row (words)"]  # not the GPU's name
    assert full_issue_us(rows[1]) == 46159324 / (4 * 132 * 1.95e3)  # 44.8 us
    lines = table(REPORT).splitlines()
    assert lines[2].startswith("| swiglu forward | 46.6 | 82 | 29% | 13.2 M | 12.7 | 7.8 (0.40) | 32 |")
    assert lines[3] == "| swiglu forward + y's row (words) | 69.7 | ? | ?% | 46.2 M | 44.8 | ? (?) | ? |"
