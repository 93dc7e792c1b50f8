"""Shared test setup: CPU, float32 matmuls at full precision, a tiny tokenizer built in-process, and
the test server that test_server_api.py and test_server_faults.py share."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The tiny-llama server (tests/server_harness.py), started once per test process."""
    from server_harness import start_shared_server
    st = start_shared_server(tmp_path_factory.mktemp("tiny-llama"))
    yield st
    st.stop()


@pytest.fixture(scope="session")
def client(server):
    """The official openai client on the server's "main" app."""
    import openai
    return openai.OpenAI(base_url=server.urls["main"] + "/v1", api_key="unused", max_retries=0, timeout=60)
