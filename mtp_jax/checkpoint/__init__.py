"""Orbax checkpoints of a run: one writer (the trainer's), one read-only reader.

- store.py: `Checkpointer`, the trainer's writer (saves, max_to_keep, quarantine).
- integrity.py: fingerprints of the state and the data-iterator state, checked on restore.
- compat.py: which config changes make a checkpoint unusable.
- reader.py: `CheckpointReader` and the read-only helpers (`load_workdir`, `restore_state`).
- partial.py: `--init_from`, the restore of another run's trunk with MTP-depth surgery.

The names below are the public API (`from mtp_jax import checkpoint as ckpt_lib`).
"""
from mtp_jax.checkpoint.compat import DATA_FIELDS, check_compatible, config_diffs
from mtp_jax.checkpoint.integrity import data_state_hash, fingerprint, integrity_meta, verify
from mtp_jax.checkpoint.partial import check_init_from, init_from, resolve_checkpoint
from mtp_jax.checkpoint.reader import (
                                       CheckpointReader,
                                       load_workdir,
                                       path_names,
                                       read_state_arrays,
                                       restore_state,
                                       warn,
)
from mtp_jax.checkpoint.store import (
                                       QUARANTINE_DIR,
                                       TMP_MARKER,
                                       Checkpointer,
                                       CheckpointError,
                                       Restored,
                                       abstract_like,
                                       is_url,
                                       location,
                                       short,
)

__all__ = [
    'CheckpointError', 'CheckpointReader', 'Checkpointer', 'DATA_FIELDS', 'QUARANTINE_DIR', 'Restored',
    'TMP_MARKER', 'abstract_like', 'check_compatible', 'check_init_from', 'config_diffs',
    'data_state_hash', 'fingerprint', 'init_from', 'integrity_meta', 'load_workdir',
    'read_state_arrays', 'resolve_checkpoint', 'restore_state', 'short', 'verify', 'warn',
    'is_url', 'location', 'path_names',
]
