"""Multi-host serving: process 0's request stream replayed on every other process.

A multi-process engine is SPMD: every process runs the same scheduler over the same requests in the
same order and dispatches the same step (parallel/distributed.py). Only process 0 receives HTTP, so
its engine calls are recorded and shipped to the others. `StreamLeader` wraps process 0's engine:
`add_request`, `abort`, `sleep`, `wake` and the LoRA adapter loads and unloads run on the engine
and, when they succeed, are recorded (an adapter is read and checked on process 0 first; the others
register the same LoRARequest, so each must read its path, as each reads the model's files);
`step()` first publishes the events recorded since the previous step under that step's key (an
empty list too: a follower must know that step n adds nothing), then steps. `follow()` is every
other process's loop: read step n's events, apply them to its own engine, step, discard the
outputs; a "stop" event (the server shutting down, or its engine loop dying) ends it. The processes
therefore apply the same calls between the same steps, which is all the determinism needs.

The channel is jax.distributed's coordination-service key-value store (the gRPC service process 0
already runs for `jax.distributed.initialize`), not `multihost_utils.broadcast_one_to_all`:
- no device collective on the step path: a broadcast is an XLA all-reduce that every process must
  enter every step with the same shapes, so each step would pay a padded device round trip, and
  request payloads (prompts, sampling params, grammars) would need fixed-size array encodings;
- idle waits are free: a follower blocks in a key-value get (retried every `POLL_MS`), while a
  broadcast would have every process spin through empty collectives or agree on when to stop;
- arbitrary payloads: events are pickled Python objects of any size.
The cost is one coordinator round trip per engine step on each process, kept off the engine
threads: process 0's key is set by a sender thread, in order (the engine only enqueues it), and a
follower's fetch thread reads step n+1's key while its engine runs step n. Measured on a loaded
2-core CPU host over localhost (fake engines whose steps sleep): a set takes 0.6-1.0 ms; with 2 ms
steps process 0's loop ran 2.16 ms per step and a follower waited 0.03 ms per step for its events
(0.6 ms when set inline, before this); with no step at all the channel carries ~700 steps/s.
A follower cannot fall behind by more than a step or two while steps run collectives, but steps
that dispatch nothing can run ahead, so keys are grouped in directories of `CHUNK` steps that
process 0 deletes whole once every follower's acknowledgement (set every `ACK_EVERY` steps read)
has passed them.

Trust: the payloads are pickles, read only from the coordination service; its port (the
`--coordinator-address`) must be as private as the run's collectives already require.
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading
import time

from jaxinfer.engine.protocol import EngineClient
from jaxinfer.errors import ConfigError, InvalidRequestError

log = logging.getLogger(__name__)

STREAM = "jaxinfer/stream"
ACKS = "jaxinfer/stream_acks"
CHUNK = 64  # steps per key directory, deleted at once
ACK_EVERY = 16  # a follower reports its position every this many steps
POLL_MS = 1000  # a follower's blocking get, retried while the server is idle
STOP_TIMEOUT_S = 30.0  # process 0 waits this long for its "stop" to be sent


def _client():
    from jax._src.distributed import global_state
    if global_state.client is None:
        raise ConfigError("multi-process serving needs jax.distributed initialized "
                          "(--coordinator-address, --num-processes, --process-id)")
    return global_state.client


def step_key(n: int) -> str:
    return f"{STREAM}/{n // CHUNK}/{n}"


def _encode(event: tuple) -> bytes:
    try:
        return pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # a callable in the params, say
        raise InvalidRequestError(f"the request cannot be sent to the other processes of this "
                                  f"multi-process server: {e!r}") from e


def _rng_state(engine):
    rng = getattr(engine, "_rng", None)  # the engine's seed source for requests without a seed
    return None if rng is None else rng.getstate()


def _engine_attr(name: str) -> property:
    return property(lambda self: getattr(self._engine, name), doc=f"the engine's `{name}`")


class StreamLeader(EngineClient):
    """Process 0's front end: its engine, recording the calls that change the request stream."""

    config, cfg, tokenizer = _engine_attr("config"), _engine_attr("cfg"), _engine_attr("tokenizer")
    max_model_len, model_name = _engine_attr("max_model_len"), _engine_attr("model_name")
    grammars, metrics = _engine_attr("grammars"), _engine_attr("metrics")
    num_total_blocks, startup = _engine_attr("num_total_blocks"), _engine_attr("startup")
    num_waiting, weight_version = _engine_attr("num_waiting"), _engine_attr("weight_version")

    def __init__(self, engine, client=None, num_processes: int | None = None):
        import jax
        if client is None and jax.process_index() != 0:
            raise ConfigError(f"process {jax.process_index()} cannot serve: only process 0 "
                              f"receives requests; the others run "
                              f"jaxinfer.frontends.multihost.follow (as `jaxinfer serve` does)")
        self._engine = engine
        self._client = client or _client()
        self._followers = (num_processes or jax.process_count()) - 1
        self._pending: list[bytes] = []
        self._next = 0  # the next step's number
        self._chunks_deleted = 0
        self.stopped = False
        self.set_s = 0.0  # the sender's key-value sets (and clean-ups), over `_next` steps
        # A step's key is set on this thread, in order, so the engine does not wait for the
        # coordinator's reply: the followers wait for the key, process 0's step for theirs.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="jaxinfer-stream",
                                        daemon=True)
        self._sender.start()

    # ---- calls that leave the request stream as it is -------------------------------------------
    def warmup(self, progress: bool = True) -> float:
        return self._engine.warmup(progress)

    def take_failed(self):
        return self._engine.take_failed()

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def check_health(self) -> None:
        self._raise_send_error()

    # ---- recorded calls -----------------------------------------------------------------------
    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None, *,
                    final_output_only: bool = False, lora_request=None):
        # as the engine got them (what is reported, final_output_only, is process 0's alone)
        event = _encode(("add", request_id, prompt, params, priority, lora_request))
        before = _rng_state(self._engine)
        try:
            req = self._engine.add_request(request_id, prompt, params, priority, arrival_time,
                                           final_output_only=final_output_only,
                                           lora_request=lora_request)
        except Exception:
            # A failure after the request's seed was drawn (a grammar that does not compile):
            # followers replay it, and fail it too, so that their seed sources stay in step.
            if before is not None and _rng_state(self._engine) != before:
                self._pending.append(event)
            raise
        self._pending.append(event)
        return req

    def abort(self, request_id, reason: str = "abort"):
        out = self._engine.abort(request_id, reason)
        if out is not None:  # unknown or finished: a no-op everywhere
            self._pending.append(_encode(("abort", request_id, reason)))
        return out

    def sleep(self):
        outs = self._engine.sleep()
        self._pending.append(_encode(("sleep",)))
        return outs

    def wake(self):
        self._engine.wake()
        self._pending.append(_encode(("wake",)))

    def update_weights(self, params):
        raise ConfigError("update_weights is not supported by a multi-process server: the other "
                          "processes would need the new weights too (run the training loop with "
                          "LLM(...) on every process instead)")

    # An adapter is checked and registered on process 0's engine first (raising there, nothing
    # recorded); the other processes then register the same request, under the same id, before
    # the same step, so every process loads it into the same slot when the same step admits it.
    def list_loras(self) -> list:
        return self._engine.list_loras()

    def load_lora_adapter(self, name: str, path: str):
        request = self._engine.load_lora_adapter(name, path)
        self._pending.append(_encode(("add_lora", request)))
        return request

    def remove_lora(self, name: str) -> None:
        self._engine.remove_lora(name)
        self._pending.append(_encode(("remove_lora", name)))

    def update_lora(self, name: str, params: dict) -> None:
        raise ConfigError("update_lora is not supported by a multi-process server: the other "
                          "processes would need the new weights too (run the training loop with "
                          "LLM(...) on every process instead)")

    # ---- publishing ---------------------------------------------------------------------------
    def step(self):
        self._publish()
        return self._engine.step()

    def publish_stop(self, error: BaseException | None = None) -> None:
        """End the followers' loops (exit status 0, or 1 with `error`) and wait until that is sent;
        later calls do nothing."""
        if self.stopped:
            return
        self._pending.append(_encode(("stop", None if error is None else repr(error))))
        self._publish()
        self.stopped = True
        self._outbox.put(None)
        self._sender.join(STOP_TIMEOUT_S)
        if self._send_error is not None or self._sender.is_alive():
            raise RuntimeError("the other processes may not have been told to stop") \
                from self._send_error
        log.info("request stream: %d steps published, %.3f ms per step to set a key",
                 self._next, 1e3 * self.set_s / self._next)

    def flush(self) -> None:
        """Wait until every step published so far is in the store."""
        done = threading.Event()
        self._outbox.put(done)
        while not done.wait(0.1):
            if not self._sender.is_alive():
                break
        self._raise_send_error()

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            raise RuntimeError("publishing the request stream failed") from self._send_error

    def _publish(self) -> None:
        if self.stopped:
            raise RuntimeError("the request stream was stopped: the other processes have left")
        self._raise_send_error()
        self._outbox.put((self._next, pickle.dumps(self._pending)))
        self._pending = []
        self._next += 1

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            n, payload = item
            try:
                t0 = time.perf_counter()
                self._client.key_value_set_bytes(step_key(n), payload)
                if (n + 1) % CHUNK == 0:
                    self._delete_read_chunks(n + 1)
                self.set_s += time.perf_counter() - t0
            except BaseException as e:  # raised by the next publish
                log.exception("could not publish step %d of the request stream", n)
                self._send_error = e
                return

    def _delete_read_chunks(self, published: int) -> None:
        acks = [int(v) for _, v in self._client.key_value_dir_get(ACKS + "/")]
        if len(acks) < self._followers:
            return
        while (self._chunks_deleted + 1) * CHUNK <= min(acks, default=published):
            self._client.key_value_delete(f"{STREAM}/{self._chunks_deleted}")
            self._chunks_deleted += 1


def _apply(engine, event: tuple) -> None:
    kind = event[0]
    if kind == "add":
        _, request_id, prompt, params, priority, lora_request = event
        try:
            engine.add_request(request_id, prompt, params, priority, lora_request=lora_request)
        except Exception as e:  # the leader raised it too (to its client)
            log.debug("replayed request %s failed as on process 0: %r", request_id, e)
    elif kind == "add_lora":
        request = event[1]
        try:
            engine.add_lora(request)
        except Exception as e:  # serving on without it would dispatch steps process 0 does not
            raise RuntimeError(f"LoRA adapter '{request.lora_name}' was loaded on process 0 but "
                               f"not here (every process must read {request.lora_path!r})") from e
    elif kind == "remove_lora":
        engine.remove_lora(event[1])
    elif kind == "abort":
        engine.abort(event[1], event[2])
    elif kind == "sleep":
        engine.sleep()
    elif kind == "wake":
        engine.wake()
    else:
        raise ValueError(f"unknown request-stream event {kind!r}")


class FollowStats:
    def __init__(self):
        self.steps = 0
        self.wait_s = 0.0  # waiting for a step's events while process 0 was stepping (not idle)
        self.step_s = 0.0


def _fetch_loop(client, pid: int, out: queue.Queue) -> None:
    """Read the steps' events in order, ahead of the engine, so that a key's round trip overlaps
    the follower's previous step; acknowledge every ACK_EVERY steps read."""
    n = 0
    try:
        while True:
            try:
                raw = client.blocking_key_value_get_bytes(step_key(n), POLL_MS)
            except Exception as e:  # jax raises JaxRuntimeError(DEADLINE_EXCEEDED)
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                continue  # idle
            events = [pickle.loads(item) for item in pickle.loads(raw)]
            out.put(events)
            n += 1
            if n % ACK_EVERY == 0:
                client.key_value_set(f"{ACKS}/{pid}", str(n), allow_overwrite=True)
            if any(e[0] == "stop" for e in events):
                return
    except BaseException as e:  # raised on the engine's thread
        out.put(e)


def follow(engine, client=None, process_id: int | None = None,
           stats: FollowStats | None = None) -> int:
    """Replay process 0's request stream on `engine` until it stops: returns 0 when the server
    shut down, 1 when its engine loop died."""
    import jax
    client = client or _client()
    pid = jax.process_index() if process_id is None else process_id
    stats = stats if stats is not None else FollowStats()
    steps: queue.Queue = queue.Queue(maxsize=CHUNK)
    threading.Thread(target=_fetch_loop, args=(client, pid, steps), name="jaxinfer-stream",
                     daemon=True).start()
    while True:
        t0 = time.perf_counter()
        try:
            events = steps.get(timeout=POLL_MS / 1e3)  # (a signal handler runs in between)
        except queue.Empty:
            continue  # idle
        t1 = time.perf_counter()
        if isinstance(events, BaseException):
            raise events
        if stats.steps:
            stats.wait_s += t1 - t0
        for event in events:
            if event[0] == "stop":
                if event[1] is not None:
                    log.error("process 0's engine loop died (%s): leaving", event[1])
                return 0 if event[1] is None else 1
            _apply(engine, event)
        engine.step()  # the outputs are process 0's to send
        engine.take_failed()
        stats.steps += 1
        stats.step_s += time.perf_counter() - t1


def serve_as_follower(args) -> int:
    """`jaxinfer serve` on a process other than 0: build the same engine (and compile it, as the
    server does), bind no port, replay process 0's request stream until it stops. A signal does
    not stop a follower (process 0 would hang in its next collective): it waits for process 0's
    stop, and a second signal exits at once with status 1."""
    import jax

    from jaxinfer.frontends.factory import create_engine
    engine = create_engine(args)
    pid = jax.process_index()

    def on_signal(signum, frame):
        signal.signal(signal.SIGINT, _exit_now)
        signal.signal(signal.SIGTERM, _exit_now)
        log.warning("process %d got signal %d: it stops when process 0 (the server) does; "
                    "a second signal exits now", pid, signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    log.warning("process %d of %d: following process 0's request stream (no HTTP here)", pid,
                jax.process_count())
    stats = FollowStats()
    status = follow(engine, stats=stats, process_id=pid)
    per = max(stats.steps, 1) / 1e3
    log.warning("process %d: process 0 stopped; %d steps replayed (per step: %.3f ms waiting for "
                "its events, %.3f ms stepping)", pid, stats.steps, stats.wait_s / per,
                stats.step_s / per)
    return status


def _exit_now(signum, frame):
    raise SystemExit(1)
