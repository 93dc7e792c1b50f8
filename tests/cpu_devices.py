"""Start jax on N virtual CPU devices, for the multi-device check scripts that tests run as
subprocesses (jax fixes its device count when it starts, and the rest of the suite runs on one)."""

import os


def start_jax(num_devices: int):
    """Set the CPU platform and device count, import jax, use full-precision float32 matmuls."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    # Optimization level 0: compile-bound tiny programs, as in tests/conftest.py.
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={num_devices} "
                               "--xla_backend_optimization_level=0")
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    return jax
