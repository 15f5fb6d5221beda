"""A spawned test process joining a process group on 127.0.0.1 as one rank."""

import os

import torch
import torch.distributed as dist


def join_group(rank: int, port: int, world: int, backend: str = "gloo") -> torch.device:
    """Join the group of ``world`` ranks at ``port`` (one CPU thread; under NCCL, GPU ``rank``); the device to use."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    if backend == "nccl":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return dev
