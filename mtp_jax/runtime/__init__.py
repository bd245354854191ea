"""Where the program runs: the mesh and sharding rules, chips and their peak FLOP/s,
multi-host start-up, the compilation cache, host memory and profiling.

- sharding.py: the mesh, logical-axis rules and the shardings of the state and batches.
- chips.py, peak.py, machine.py: accelerator facts, measured CPU peak, MFU.
- distributed.py: `jax.distributed` start-up (managed clusters, fake CPU devices).
- compile_cache.py, host_memory.py, profiling.py: the persistent compilation cache, the
  host allocator chosen before JAX starts, and step-range profiles.
- signals.py: SIGTERM / SIGINT during start-up, recorded before JAX is imported; SIGUSR1
  stack dumps.

Public names load lazily: `host_memory` is set up before JAX is imported, so importing it
must not import `sharding` through this file.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'Chip': 'chips',
    'StepProfiler': 'profiling',
    'chip': 'chips',
    'make_mesh': 'sharding',
    'mfu': 'peak',
    'peak_flops': 'peak',
    'rules_of': 'sharding',
    'state_shardings': 'sharding',
    'use_mesh': 'sharding',
})
