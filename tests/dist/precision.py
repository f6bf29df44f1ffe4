"""Run under torchrun (4 ranks): bf16 (FSDP2 mixed precision or autocast) against the fp32 single-process
reference for every world-4 layout, recompute under TP + PP, and the host syncs of one step.

Usage: torchrun --standalone --nproc-per-node 4 tests/dist/precision.py RUN_DIR OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from cona_core.strategy import Strategy
from launch.worker import Worker
from tests.dist.common import start
from tests.dist.layouts import LAYOUTS, reference_losses

STEPS = 2
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python, except of AdamW's step counters (host tensors on every
    device unless the optimizer is capturable: reading them does not wait for the device)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.count = skip, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and id(args[0]) not in self.skip:
            self.count += 1
        return func(*args, **(kwargs or {}))


def run(cfg, run_dir, s: Strategy, dp_impl: str = "ddp", recompute: bool = False) -> dict:
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, dp_impl=dp_impl),
        search=dataclasses.replace(cfg.search, precision="bf16", recompute=recompute),
    )
    t0 = time.perf_counter()
    w = Worker(cfg, run_dir, s, launch=1)
    losses = [w.train_step(False).loss for _ in range(STEPS - 1)]
    steps = {id(st["step"]) for st in w.opt.state.values()}
    with HostReads(steps) as reads:
        out = w.train_step(False)
    seconds = time.perf_counter() - t0
    return {"losses": [*losses, out.loss], "host_reads": reads.count, "memory": out.memory, "seconds": seconds}


def main() -> None:
    run_dir, out, cfg, corpus = start()
    gbs = 16
    results: dict = {"reference": reference_losses(cfg, corpus, gbs, STEPS)[0], "bf16": {}}
    mbs = 4  # the fewest micro-batches every layout allows (pp 4 needs 4): bf16 matmuls are slow on CPUs
    for dp, tp, pp in LAYOUTS:
        results["bf16"][f"{Strategy(dp, tp, pp, mbs, gbs)}"] = run(cfg, run_dir, Strategy(dp, tp, pp, mbs, gbs))
    for dp, tp in ((4, 1), (2, 2)):
        s = Strategy(dp, tp, 1, mbs, gbs)
        results["bf16"][f"{s}-fsdp"] = run(cfg, run_dir, s, "fsdp")
    results["recompute"] = run(cfg, run_dir, Strategy(1, 2, 2, mbs, gbs), recompute=True)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
