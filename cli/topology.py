"""`pdserve serve`'s topology rule: from the hardware it finds, colocate (one worker runs both phases) or
disaggregate (prefill and decode workers apart), and on which devices each worker runs.

The rule (docs/architecture.md, "Which topology `serve` picks"):
  1. `--colocated` or `--disaggregated` forces either; `--num-prefill N` asks for prefill workers, so it means
     disaggregated.
  2. On CPU: colocated. Every worker of a host shares its cores and its memory bandwidth, so a split gives each phase
     a fraction of the same machine and adds the KV transfer: measured on 2 cores (AVX2, fp32), the disaggregated
     default gave 0.63-0.70x the colocated engine's output tok/s at every level of the sweep (the performance table's measurement,
     docs/benchmarks.md), and the AVX512-BF16 host's run is in docs/benchmarks.md too. Disaggregation pays where
     the phases get hardware of their own, as on GPUs.
  3. On CUDA: disaggregated when the visible GPUs give each worker devices of its own (one prefill and one decode
     worker, `tensor_parallel_size` GPUs each), as vLLM's and Dynamo's disaggregated deployments place them;
     otherwise colocated (two workers on one GPU would split one device, which is rule 2's case).
Each worker of the chosen topology gets the next `tensor_parallel_size` GPUs while there are enough; else every
worker shares the device `--device` names (as before this rule).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What the rule looks at.

    Attributes:
        device: the workers' `--device` ("cpu", "cuda", "cuda:k").
        num_cpus: CPUs this process may run on (its affinity mask).
        num_gpus: CUDA devices visible from the `--device` index on (0 on CPU).
    """

    device: str
    num_cpus: int
    num_gpus: int = 0

    @staticmethod
    def detect(device: str) -> Hardware:
        """This host's hardware for `device` (imports torch only for a CUDA device)."""
        import os

        num_gpus = 0
        if device.startswith("cuda"):
            import torch

            num_gpus = max(0, torch.cuda.device_count() - (torch.device(device).index or 0))
        return Hardware(device, len(os.sched_getaffinity(0)), num_gpus)


@dataclass(frozen=True)
class Topology:
    """What `serve` starts.

    Attributes:
        colocated: one worker role runs both phases.
        num_prefill / num_decode: worker processes (num_decode colocated workers when colocated; num_prefill 0).
        devices: each worker's device, prefill workers first, in start order; empty = every worker on the
            device `--device` names.
        why: one line for the start-up message and the log.
    """

    colocated: bool
    num_prefill: int
    num_decode: int
    devices: tuple[str, ...]
    why: str

    @property
    def name(self) -> str:
        return "colocated" if self.colocated else "disaggregated"


def choose_topology(hw: Hardware, forced: str | None = None, num_prefill: int | None = None, num_decode: int = 1,
                    tensor_parallel_size: int = 1) -> Topology:
    """The topology for `hw` by the module's rule.

    Args:
        hw: the hardware found (`Hardware.detect`).
        forced: "colocated" or "disaggregated" (the flags), or None to decide.
        num_prefill: prefill workers asked for (`--num-prefill`); None = not given (1 when disaggregated).
        num_decode: decode workers, or colocated workers when colocated.
        tensor_parallel_size: GPUs (or CPU ranks) per worker.

    Raises:
        ValueError: forced is "colocated" while num_prefill asks for prefill workers, or is another word.
    """
    if forced not in (None, "colocated", "disaggregated"):
        raise ValueError(f"forced must be colocated or disaggregated, got {forced!r}")
    if forced == "colocated" and num_prefill:
        raise ValueError("--colocated runs no prefill workers; leave out --num-prefill (or use --disaggregated)")
    gpu = hw.device.startswith("cuda")
    if forced is not None:
        colocated, why = forced == "colocated", f"--{forced}"
    elif num_prefill is not None:
        colocated, why = False, f"--num-prefill {num_prefill} asks for a disaggregated cluster"
    elif not gpu:
        colocated, why = True, (f"CPU host ({hw.num_cpus} cores): the phases would share the same cores and memory "
                                "bandwidth, so one worker runs both (--disaggregated to split them)")
    elif hw.num_gpus >= 2 * tensor_parallel_size:
        colocated, why = False, (f"{hw.num_gpus} GPUs: prefill and decode workers each get "
                                 f"{tensor_parallel_size} of their own")
    else:
        colocated, why = True, (f"{hw.num_gpus} GPU(s) for {tensor_parallel_size} per worker: splitting one device "
                                "between the phases does not pay, so one worker runs both")
    prefill = 0 if colocated else (1 if num_prefill is None else num_prefill)
    workers = prefill + num_decode
    devices: tuple[str, ...] = ()
    if gpu and hw.num_gpus >= workers * tensor_parallel_size:
        from pdserve_server.engine.parallel.tensor_parallel import rank_device  # torch: only on the GPU path

        # Worker i's ranks come next in line, as one worker's ranks do (rank_device's rule).
        devices = tuple(rank_device(hw.device, i * tensor_parallel_size) for i in range(workers))
    return Topology(colocated, prefill, num_decode, devices, why)
