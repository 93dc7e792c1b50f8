"""Data parallelism: M engine replicas on disjoint device groups (rows of the ("dp", "tp") mesh)
behind one front end with LLMEngine's interface, so `LLM`, `AsyncEngine` and the server drive it
unchanged.

Each replica is a whole `LLMEngine` (scheduler, KV pool, runner) on its own sub-mesh; nothing is
shared on the devices, so replicas never synchronise. A new request goes to the least-loaded
replica: unfinished requests over its sequence capacity plus its KV-cache usage (queue depth and
memory pressure), ties to the lowest index. `step()` steps every busy replica on its own thread: a
replica's step spends most of its time waiting for its devices (the GIL is released), so replicas'
device work overlaps.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.protocol import EngineClient
from jaxinfer.core.outputs import RequestOutput
from jaxinfer.errors import InvalidRequestError, RequestFailedError
from jaxinfer.frontends.lora_fan_out import LoRAFanOut
from jaxinfer.frontends.merged_metrics import MergedMetrics
from jaxinfer.sampling_params import SamplingParams


class DataParallelEngine(LoRAFanOut, EngineClient):
    def __init__(self, replicas: list[LLMEngine]):
        self.replicas = replicas
        first = replicas[0]
        self.config, self.cfg, self.tokenizer = first.config, first.cfg, first.tokenizer
        self.max_model_len, self.model_name = first.max_model_len, first.model_name
        self.num_total_blocks = sum(r.num_total_blocks for r in replicas)
        self.startup = first.startup
        self.metrics = MergedMetrics([r.metrics for r in replicas])
        self.grammars = first.grammars  # (from_engine_args gives every replica this one)
        self._owner: dict[str, LLMEngine] = {}
        self._pool = ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="jaxinfer-dp")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> DataParallelEngine:
        from jaxinfer.parallel.sharding import build_mesh, replica_meshes
        mesh = build_mesh(args.tensor_parallel_size, args.data_parallel_size)
        first, *rest = replica_meshes(mesh)
        replicas = [LLMEngine.from_engine_args(args, mesh=first)]
        # one compiled-grammar cache for every replica
        replicas += [LLMEngine.from_engine_args(args, mesh=m, grammars=replicas[0].grammars)
                     for m in rest]
        return cls(replicas)

    def warmup(self, progress: bool = True) -> float:
        return max(self._pool.map(lambda r: r.warmup(progress), self.replicas))

    # ---- requests -----------------------------------------------------------------------------
    def _load(self, replica: LLMEngine) -> float:
        most = replica.config.scheduler.max_num_seqs
        return len(replica.requests) / most + replica.scheduler.kv_cache_stats()[0]

    def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, *, final_output_only: bool = False,
                    lora_request=None):
        if request_id in self._owner:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      param="request_id")
        replica = min(self.replicas, key=self._load)
        req = replica.add_request(request_id, prompt, params, priority, arrival_time,
                                  final_output_only=final_output_only, lora_request=lora_request)
        self._owner[request_id] = replica
        return req

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        replica = self._owner.pop(request_id, None)
        return None if replica is None else replica.abort(request_id, reason)

    def take_failed(self) -> list[tuple[str, RequestFailedError]]:
        """The requests any replica failed since the previous call (each already aborted)."""
        failed = [f for r in self.replicas for f in r.take_failed()]
        for rid, _ in failed:
            self._owner.pop(rid, None)
        return failed

    # ---- the research loop: every replica alike --------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.replicas[0].weight_version

    def update_weights(self, params) -> list[RequestOutput]:
        """Each replica places `params` like its own weights (see LLMEngine.update_weights)."""
        outs = [o for r in self.replicas for o in r.update_weights(params)]
        self._owner.clear()  # every request in flight was aborted
        return outs

    def sleep(self) -> list[RequestOutput]:
        outs = [o for r in self.replicas for o in r.sleep()]
        self._owner.clear()
        return outs

    def wake(self) -> None:
        for r in self.replicas:
            r.wake()

    @property
    def lora_engines(self) -> list[LLMEngine]:
        return self.replicas

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def requests(self) -> dict:
        return {rid: req for r in self.replicas for rid, req in r.requests.items()}

    # ---- steps --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        outs = [o for part in self._pool.map(lambda r: r.step(), busy) for o in part]
        for out in outs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outs
