"""Devices for the command line: --tensor-parallel, and jax.distributed for several hosts.

Multi-controller JAX: one process per host, each started with the same command plus its own
--process-id; together their devices form one mesh (jax.devices() lists all of them), every
process runs the same compiled graphs on its own devices, and process 0 alone prints and writes.
"""

from __future__ import annotations

import jax

from jaxspec.errors import InputError


def add_parallel_args(p) -> None:
    g = p.add_argument_group("devices")
    g.add_argument("--tensor-parallel", type=int, default=1,
                   help="split the target over N devices (all hosts' under --coordinator) (default 1)")
    g.add_argument("--expert-parallel", action="store_true",
                   help="split a mixture-of-experts target's experts by expert over the --tensor-parallel devices "
                        "(E/N whole experts each; attention stays split by heads), not each expert's columns")
    g.add_argument("--draft-tensor-parallel", type=int, default=1,
                   help="split the draft over this many of the target's devices; 1 (default) keeps it whole on "
                        "each of them")
    g.add_argument("--coordinator", help="HOST:PORT of process 0: run as one of several processes under "
                                         "jax.distributed (one per host), with --num-processes and --process-id")
    g.add_argument("--num-processes", type=int, help="processes in all (with --coordinator)")
    g.add_argument("--process-id", type=int, help="this process's rank, 0 .. N-1 (with --coordinator)")


def initialize(args) -> None:
    """Joins the processes named on the command line (nothing without --coordinator); before any
    JAX computation, as jax.distributed requires."""
    if args.coordinator is None:
        if args.num_processes is not None or args.process_id is not None:
            raise InputError("--num-processes and --process-id need --coordinator HOST:PORT")
        return
    if args.num_processes is None or args.process_id is None:
        raise InputError("--coordinator needs --num-processes N and --process-id I")
    if not 0 <= args.process_id < args.num_processes:
        raise InputError(f"--process-id must be in [0, {args.num_processes - 1}]; got {args.process_id}")
    # CPU devices of several processes talk over gloo (GPUs use NCCL whatever this says).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def is_main_process() -> bool:
    return jax.process_index() == 0
