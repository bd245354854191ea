"""The user commands, one module each with `main(argv=None) -> int`.

Installed as console entry points (pyproject.toml: mtp-train, mtp-decode, ...); the files
in scripts/ call the same functions. Each parses its flags with argparse before JAX
starts, and bad input exits 2 with one `error: ...` line before anything compiles.
"""
