"""Compiles a config's steps for a TPU slice on any machine: `python scripts/aot_compile.py
--config configs/tpu_pod_1b.py --topology v5p-64`. The same command as `mtp-aot-compile`
(mtp_jax/commands/aot_compile.py); `--help` lists the options."""
from mtp_jax.commands.aot_compile import main

raise SystemExit(main())
