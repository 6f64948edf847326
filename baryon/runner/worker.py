"""A tensor-parallel worker: one rank > 0 of an engine, in its own process, on its own device.

Started by `baryon.distributed.worker_group` as `python -m baryon.runner.worker RANK WORLD_SIZE
INIT_METHOD STEP_ADDRESS PARENT_PID` with the pickled EngineConfig on stdin. It joins the process
group, builds the same ModelRunner as rank 0 (its shards of the weights, its share of the KV
heads) in step with it, then runs each StepPlan (and, drafting, each ProposePlan) rank 0 pushes
until told to stop. It exits by itself when the engine's process is gone.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys

import torch
import zmq

from baryon.config import EngineConfig
from baryon.distributed.parallel_state import destroy_distributed, init_distributed
from baryon.distributed.worker_group import PROPOSE, STEP, STOP, backend_for, report_failure
from baryon.logger import dump_stacks_on_sigusr1, get_logger
from baryon.runner.model_runner import ModelRunner
from baryon.runner.propose_plan import ProposePlan
from baryon.runner.step_plan import StepPlan

logger = get_logger(__name__)

_IDLE_POLL_MS = 200  # how often an idle worker checks that the engine's process is alive


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of an engine whose rank 0 runs on cuda:i runs on cuda:i+r (CPU: the CPU)."""
    return device if device.type != "cuda" else torch.device("cuda", (device.index or 0) + rank)


def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str, step_address: str,
               parent_pid: int) -> int:
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = dataclasses.replace(config, device=device)
    context = zmq.Context()
    steps = context.socket(zmq.PULL)
    steps.connect(step_address)
    runner = None
    stopped = False  # told to stop: leave the process group in order (else the exit skips it)
    try:
        init_distributed(world_size, rank, init_method, backend_for(device),
                         config.parallel.enable_expert_parallel, config.model.dtype)
        runner = ModelRunner(config)
        while True:
            if not steps.poll(_IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    logger.warning("tensor-parallel worker %d: the engine's process is gone; exiting", rank)
                    return 0
                continue
            kind, payload = steps.recv_multipart(copy=False)
            if kind.bytes == STOP:
                stopped = True
                return 0
            if kind.bytes == PROPOSE:
                runner.run_propose(ProposePlan.decode(payload.buffer))
                continue
            assert kind.bytes == STEP
            runner.run_plan(StepPlan.decode(payload.buffer))
    finally:
        steps.close(linger=0)
        context.term()
        # An orderly exit only when told to stop: after a failure (a device error, the engine's
        # process gone) synchronizing or tearing down NCCL can wait for minutes on a dead peer or
        # context, and the process exits with os._exit either way.
        if stopped:
            try:
                if runner is not None:
                    runner.release_cuda_graphs()  # before the process group goes (see CUDAGraphRunner.release)
                destroy_distributed()
            except Exception:
                pass


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print("usage: python -m baryon.runner.worker RANK WORLD_SIZE INIT_METHOD STEP_ADDRESS PARENT_PID "
              "(pickled EngineConfig on stdin)", file=sys.stderr)
        return 2
    config = pickle.loads(sys.stdin.buffer.read())
    dump_stacks_on_sigusr1()
    try:
        return run_worker(config, int(argv[0]), int(argv[1]), argv[2], argv[3], int(argv[4]))
    except Exception as e:
        logger.exception("tensor-parallel worker %s failed", argv[0])
        report_failure(argv[3], e)
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the slow interpreter teardown (torch, process groups)
