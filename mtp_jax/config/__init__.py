"""The configuration, by job: `base` (every field, documented once, in sections), `kinds`
(the table of block and MTP-head kinds with their facts), `validation` (`validate`, one
check per section), `schema`, `mesh`, `kernel_limits` and `readers` (values read off a
config). Nothing here imports JAX. `mtp_jax.config_lib` is the face that config files and
callers import.
"""
