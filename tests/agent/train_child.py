"""A tiny training with the agent attached, run as a child process by the exit, spool and sync tests.

argv: url spool_dir steps mode [run name, "child-run" by default], where mode is
- "no-close": train ``steps`` steps and end without ``agent.close()``;
- "forever": train until killed (a short sleep per step);
- "own-handler": as "forever", with a SIGTERM handler of the program's own (installed before the agent) that ends
  the loop: the process then ends normally, printing "stopped";
- "spooled": train ``steps`` steps, flush (the monitor is down: all of it is in the spool), print "spooled", sleep;
- "full-disk": after 5 steps the process may write no file byte any more (RLIMIT_FSIZE 0: the spool disk is
  "full"), then close and print the delivery status as JSON.
Every logged step is printed on its own line once ``agent.log`` returned.
"""

import dataclasses
import json
import resource
import signal
import sys
import time

import torch

from fp8mon import Agent

url, spool_dir, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
run_name = sys.argv[5] if len(sys.argv) > 5 else "child-run"
stop = []
if mode == "own-handler":
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
agent = Agent(url, run=run_name, every=1, spool_dir=spool_dir, flush_interval=0.05, backoff=(0.05, 0.2),
              timeout=2.0).watch(model)
step = 0
while (mode in ("forever", "own-handler") and not stop) or step < steps:
    if mode == "full-disk" and step == 5:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write raises EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    agent.log(step, loss=loss.item())
    print(step, flush=True)
    step += 1
    if mode in ("forever", "own-handler"):
        time.sleep(0.01)
if stop:
    print("stopped", flush=True)
if mode == "spooled":
    agent.flush(timeout=5)
    print("spooled", flush=True)
    time.sleep(600)
if mode == "full-disk":
    closed = agent.close(timeout=20)
    print(json.dumps({"closed": closed, "errors": agent.errors, **dataclasses.asdict(agent.status())}), flush=True)
