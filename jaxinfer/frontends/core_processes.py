"""The engine-core processes of one server: one per data-parallel replica, each on its own
devices, with their sockets (vLLM V1's CoreEngineProcManager, vllm/v1/engine/utils.py).

Each core has its own input socket (PUSH here, PULL there); all push their `CoreOutputs` to one
PULL socket here, tagged with their index. The sockets live in a private temporary directory
(mode 0700): only this user's processes can connect, and the pickled calls come from this process
only. A replica sees its own devices only (`CUDA_VISIBLE_DEVICES`: its --tensor-parallel-size
devices in order), so each core builds a one-replica engine.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import zmq

from jaxinfer.engine.args import EngineArgs
from jaxinfer.errors import ConfigError
from jaxinfer.frontends.core_messages import OUTPUTS_DECODER, Call, CoreOutputs, encode_call

POLL_MS = 200  # how often a waiting reader checks that the cores are still alive


def _core_env(replica: int, tp: int, num_replicas: int) -> dict[str, str]:
    """The server's environment, the jax settings made in code that change numerics, and (with
    several replicas) the replica's own devices."""
    env = dict(os.environ)
    import jax
    precision = jax.config.jax_default_matmul_precision
    if precision is not None:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = str(precision)
    if num_replicas > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(num_replicas * tp)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[replica * tp:(replica + 1) * tp])
    return env


class CoreProcesses:
    def __init__(self, args: EngineArgs):
        """Start one core per replica (each loads the model); `wait_loaded` waits for them."""
        self.num = args.data_parallel_size
        self._dir = tempfile.mkdtemp(prefix="jaxinfer-core-")
        self._zmq = zmq.Context()
        self.outputs = self._zmq.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        self.outputs.bind(f"ipc://{self._dir}/out")
        self._inputs: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        replica_args = dataclasses.replace(args, data_parallel_size=1)
        for i in range(self.num):
            sock = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # a burst of requests queues; never blocks the event loop
            sock.bind(f"ipc://{self._dir}/in{i}")
            self._inputs.append(sock)
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxinfer.frontends.engine_core", f"ipc://{self._dir}/in{i}",
                 f"ipc://{self._dir}/out", str(i)], stdin=subprocess.PIPE,
                env=_core_env(i, args.tensor_parallel_size, self.num))
            proc.stdin.write(pickle.dumps(replica_args))
            proc.stdin.close()
            self.procs.append(proc)

    def wait_loaded(self) -> list[dict]:
        """Each core's description of its engine, in replica order; raises what a core's engine
        raised when it failed to load (ConfigError when that cannot be told)."""
        infos: list[dict | None] = [None] * self.num
        while any(i is None for i in infos):
            if self.outputs.poll(POLL_MS):
                msg = OUTPUTS_DECODER.decode(self.outputs.recv())
                ok, value = pickle.loads(msg.replies[0][1]) if msg.replies else (False, None)
                if not ok:
                    if isinstance(value, Exception):
                        raise value  # the engine's own error (a ConfigError, say)
                    raise ConfigError(f"engine-core process {msg.engine_index} failed: {msg.dead}")
                infos[msg.engine_index] = value
                continue
            if (status := self.exit_status()) is not None:
                raise ConfigError(f"an engine-core process exited with status {status} while "
                                  f"loading the model")
        return infos

    def send(self, core: int, call: Call) -> None:
        self._inputs[core].send(encode_call(call), copy=False)

    def receive(self, timeout_ms: int) -> CoreOutputs | None:
        """The next message of any core, or None after `timeout_ms`."""
        if not self.outputs.poll(timeout_ms):
            return None
        return OUTPUTS_DECODER.decode(self.outputs.recv(copy=False).buffer)

    def exit_status(self) -> str | None:
        """How the first core found gone went (None while all run)."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                return f"{proc.returncode} (engine-core process {i})"
        return None

    def close(self, timeout_s: float = 30) -> None:
        """Wait for the cores to exit (after `shutdown` calls), kill any that do not."""
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in (*self._inputs, self.outputs):
            sock.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)
