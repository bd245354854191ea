"""Kept for tools that call setup.py; the project's metadata lives in pyproject.toml."""
from setuptools import setup

setup()
