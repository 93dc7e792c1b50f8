"""Shared test setup: CPU, float32 matmuls at full precision, a tiny tokenizer built in-process, and
the test server that test_server_api.py and test_server_faults.py share."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU's interpreter runs each warpgroup as a thread whose program is a chain of blocking
# callbacks (barrier waits). XLA CPU's concurrency-optimized scheduler deadlocks it: a flash-prefill
# kernel whose consumers synchronise every step hung on a 1-2 core machine (CI has 2), inside a jit
# or even eagerly on one core, and ran with this scheduler off. It only orders CPU programs.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS"), "--xla_cpu_enable_concurrency_optimized_scheduler=false"]))

import jax  # noqa: E402 - after JAX_PLATFORMS and XLA_FLAGS are set

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The tiny-llama server (tests/server_harness.py), started once per test process."""
    from server_harness import start_shared_server
    st = start_shared_server(tmp_path_factory.mktemp("tiny-llama"))
    yield st
    st.stop()


@pytest.fixture(scope="session")
def demo_server():
    """The demo model behind the server (tests/server_harness.py), started once per test process."""
    from server_harness import start_demo_server
    st = start_demo_server()
    yield st
    st.stop()


@pytest.fixture(scope="session")
def client(server):
    """The official openai client on the server's "main" app."""
    import openai
    return openai.OpenAI(base_url=server.urls["main"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (tests/gpu/) run only where jax sees a CUDA GPU (`make test-gpu` on the
    H200); elsewhere they are skipped, so the CPU suite collects them without running them."""
    if jax.devices()[0].platform == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
