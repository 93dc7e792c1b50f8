"""The multi-host request stream (jaxinfer/frontends/multihost.py) over an in-memory stand-in
for the coordination service's key-value store: what process 0 records, what a follower replays,
and the store's clean-up. The two-process server is tests/test_multihost_serve.py."""

import random

import pytest

from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.frontends import multihost as rs
from jaxinfer.lora_request import LoRARequest


class FakeStore:
    def __init__(self):
        self.kv: dict[str, bytes | str] = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.kv
        self.kv[key] = value

    key_value_set = key_value_set_bytes

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.kv:
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def key_value_delete(self, key):
        for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
            del self.kv[k]


class FakeEngine:
    """Records the calls that reach it; "bad" prompts fail validation, "grammar" ones fail after
    drawing a seed, as a grammar that does not compile does. LoRA adapters at a path "bad" fail
    to load (on whichever process reads them)."""

    def __init__(self, unreadable: str = "bad"):
        self.calls, self.requests, self._rng = [], set(), random.Random(0)
        self.tokenizer = "tok"
        self.loras: dict[str, LoRARequest] = {}
        self.unreadable = unreadable

    def add_request(self, rid, prompt, params, priority=0, arrival_time=None, *,
                    final_output_only=False, lora_request=None):
        if prompt == "bad":
            raise InvalidRequestError("bad prompt", param="prompt")
        seed = self._rng.getrandbits(32)
        if prompt == "grammar":
            raise InvalidRequestError("bad grammar", param="response_format")
        self.requests.add(rid)
        self.calls.append(("add", rid, prompt, params, priority, seed, lora_request))

    def load_lora_adapter(self, name, path):
        request = LoRARequest(name, len(self.loras) + 1, path)
        self.add_lora(request)
        return request

    def add_lora(self, request):
        if request.lora_path == self.unreadable:
            raise InvalidRequestError("no adapter there", param="lora_path")
        self.loras[request.lora_name] = request
        self.calls.append(("add_lora", request))

    def remove_lora(self, name):
        if self.loras.pop(name, None) is None:
            raise InvalidRequestError("unknown adapter", param="lora_name")
        self.calls.append(("remove_lora", name))

    def list_loras(self):
        return list(self.loras.values())

    def abort(self, rid, reason="abort"):
        if rid not in self.requests:
            return None
        self.requests.discard(rid)
        self.calls.append(("abort", rid, reason))
        return f"out-{rid}"

    def step(self):
        self.calls.append(("step",))
        return []

    def take_failed(self):
        return []


def test_follower_replays_what_the_leader_did():
    store, lead_engine, follow_engine = FakeStore(), FakeEngine(), FakeEngine()
    leader = rs.StreamLeader(lead_engine, client=store, num_processes=2)
    assert leader.tokenizer == "tok"  # everything else is the engine's
    leader.add_request("a", [1, 2], {"t": 0})
    leader.step()
    with pytest.raises(InvalidRequestError):
        leader.add_request("b", "bad", {})  # fails before a seed: not sent
    with pytest.raises(InvalidRequestError):
        leader.add_request("c", "grammar", {})  # fails after its seed: replayed, fails there too
    assert leader.abort("nope") is None
    leader.step()
    leader.add_request("d", [3], {}, priority=2)  # its seed: the third draw, on both sides
    assert leader.abort("a") == "out-a"
    leader.step()
    leader.step()
    with pytest.raises(ConfigError, match="update_weights is not supported"):
        leader.update_weights({})
    leader.publish_stop()
    leader.publish_stop()  # once
    assert rs.follow(follow_engine, client=store, process_id=1) == 0
    assert follow_engine.calls == lead_engine.calls
    assert [c[0] for c in lead_engine.calls] == ["add", "step", "step", "add", "abort", "step",
                                                 "step"]


def test_lora_adapters_reach_followers_between_the_same_steps():
    store, lead_engine, follow_engine = FakeStore(), FakeEngine(), FakeEngine()
    leader = rs.StreamLeader(lead_engine, client=store, num_processes=2)
    a = leader.load_lora_adapter("a", "/a")
    leader.add_request("r", [1], {}, lora_request=a)
    leader.step()
    with pytest.raises(InvalidRequestError):
        leader.load_lora_adapter("x", "bad")  # refused on process 0: never sent
    with pytest.raises(InvalidRequestError):
        leader.remove_lora("nope")
    leader.remove_lora("a")
    leader.step()
    with pytest.raises(ConfigError, match="update_lora is not supported"):
        leader.update_lora("a", {})
    assert leader.list_loras() == []
    leader.publish_stop()
    assert rs.follow(follow_engine, client=store, process_id=1) == 0
    assert follow_engine.calls == lead_engine.calls
    assert [c[0] for c in lead_engine.calls] == ["add_lora", "add", "step", "remove_lora", "step"]


def test_a_follower_that_cannot_load_an_adapter_leaves():
    store = FakeStore()
    leader = rs.StreamLeader(FakeEngine(), client=store, num_processes=2)
    leader.load_lora_adapter("a", "/only/on/process0")
    leader.step()
    leader.publish_stop()
    with pytest.raises(RuntimeError, match="every process must read '/only/on/process0'"):
        rs.follow(FakeEngine(unreadable="/only/on/process0"), client=store, process_id=1)


def test_a_dead_leader_stops_followers_with_status_1():
    store = FakeStore()
    leader = rs.StreamLeader(FakeEngine(), client=store, num_processes=2)
    leader.step()
    leader.publish_stop(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="stopped"):
        leader.step()
    engine = FakeEngine()
    assert rs.follow(engine, client=store, process_id=1) == 1
    assert engine.calls == [("step",)]


def test_read_chunks_are_deleted_once_every_follower_passed_them():
    store = FakeStore()
    leader = rs.StreamLeader(FakeEngine(), client=store, num_processes=3)

    def steps():
        leader.flush()
        return sorted(int(k.rsplit("/", 1)[1]) for k in store.kv if k.startswith(rs.STREAM + "/"))
    for _ in range(2 * rs.CHUNK):
        leader.step()
    assert len(steps()) == 2 * rs.CHUNK  # no follower has acknowledged anything
    store.kv[f"{rs.ACKS}/1"] = str(2 * rs.CHUNK)
    store.kv[f"{rs.ACKS}/2"] = str(rs.CHUNK + rs.ACK_EVERY)
    for _ in range(rs.CHUNK):
        leader.step()
    assert steps()[0] == rs.CHUNK  # chunk 0 read by both followers, chunk 1 not by process 2
    store.kv[f"{rs.ACKS}/2"] = str(3 * rs.CHUNK)
    for _ in range(rs.CHUNK):
        leader.step()
    assert steps()[0] == 2 * rs.CHUNK  # process 1 has read up to there only
    store.kv[f"{rs.ACKS}/1"] = str(3 * rs.CHUNK)
    for _ in range(rs.CHUNK):
        leader.step()
    assert steps() == list(range(3 * rs.CHUNK, 5 * rs.CHUNK))


def test_a_follower_acknowledges_its_position():
    store = FakeStore()
    leader = rs.StreamLeader(FakeEngine(), client=store, num_processes=2)
    for _ in range(rs.ACK_EVERY + 1):
        leader.step()
    leader.publish_stop()
    assert rs.follow(FakeEngine(), client=store, process_id=1) == 0
    assert store.kv[f"{rs.ACKS}/1"] == str(rs.ACK_EVERY)
