"""Shared test setup: CPU, float32 matmuls at full precision, a tiny tokenizer built in-process."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
