"""Orbax checkpoints of a run: one writer (the trainer's), one read-only reader.

- store.py: `Checkpointer`, the trainer's writer (saves, max_to_keep, quarantine).
- integrity.py: fingerprints of the state and the data-iterator state, checked on restore.
- compat.py: which config changes make a checkpoint unusable.
- reader.py: `CheckpointReader` and the read-only helpers (`load_workdir`, `restore_state`).
- partial.py: `--init_from`, the restore of another run's trunk with MTP-depth surgery.

The names below are the public API (`from mtp_jax import checkpoint as ckpt_lib`); they
load lazily (mtp_jax/exports.py), as in every sub-package.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'CheckpointError': 'store',
    'CheckpointReader': 'reader',
    'Checkpointer': 'store',
    'DATA_FIELDS': 'compat',
    'QUARANTINE_DIR': 'store',
    'Restored': 'store',
    'TMP_MARKER': 'store',
    'abstract_like': 'store',
    'check_compatible': 'compat',
    'check_init_from': 'partial',
    'config_diffs': 'compat',
    'data_state_hash': 'integrity',
    'fingerprint': 'integrity',
    'init_from': 'partial',
    'integrity_meta': 'integrity',
    'load_workdir': 'reader',
    'read_state_arrays': 'reader',
    'resolve_checkpoint': 'partial',
    'restore_state': 'reader',
    'verify': 'integrity',
})
