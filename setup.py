"""mtp_jax: Multi-Token Prediction pretraining and self-speculative decoding in JAX/Flax."""
from setuptools import find_packages, setup

# Ranges tested on CPU (Python 3.11); upper bounds because flax/orbax/grain APIs move fast.
INSTALL_REQUIRES = [
    'jax>=0.10.2,<0.11',
    'jaxlib>=0.10.2,<0.11',
    'flax>=0.12.8,<0.13',
    'optax>=0.2.8,<0.3',
    'orbax-checkpoint>=0.12.8,<0.13',
    'etils[epath]>=1.12,<2',  # checkpoint.CheckpointReader hands orbax's handlers epath paths
    'grain>=0.2.18,<0.3',
    'tensorflow-datasets>=4.9.10,<4.10',
    'array-record>=0.8.6,<0.9',
    'importlib_resources>=6',  # tfds needs it for builders defined inside a package
    'ml-collections>=1.1.0,<1.2',
    'absl-py>=2.1,<3',
    'sentencepiece>=0.2.3,<0.3',
    'tensorboardX>=2.6.5,<2.7',
    'matplotlib>=3.9,<4',
    'numpy>=2.0,<3',
    # Interop (issues 11/13): Hugging Face-layout checkpoints and tokenizers, read from local
    # directories only (nothing is fetched from a hub).
    'safetensors>=0.8,<0.9',
    'tokenizers>=0.23,<0.24',
]

EXTRAS = {
    'test': ['pytest>=9.0,<10', 'scipy>=1.14,<2', 'nbclient>=0.10,<0.12', 'nbformat>=5.10,<6',
             'ipykernel>=6.29,<8',
             # Reference outputs for the Hugging Face trunk tests; 2.13.0 is the CPU wheel on
             # this machine's disk (a looser range pulls a multi-GB CUDA build from PyPI).
             'torch==2.13.0', 'transformers>=5.24,<5.25', 'datasets>=5.2,<5.3',
             'pyarrow>=26,<27'],  # tests/test_data.py writes parquet files itself
    # User data (mtp_jax/data/user_data.py): data.source=parquet needs pyarrow, hf_disk datasets.
    'data': ['pyarrow>=26,<27', 'datasets>=5.2,<5.3'],
    'notebooks': ['jupyterlab>=4', 'nbclient>=0.10,<0.12', 'nbformat>=5.10,<6',
                  'ipykernel>=6.29,<8'],
}

setup(
    name='mtp_jax',
    version='0.1.0',
    description=__doc__,
    packages=find_packages(include=['mtp_jax', 'mtp_jax.*']),
    python_requires='>=3.10',
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
