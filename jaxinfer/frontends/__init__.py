"""The front ends: what the server and the offline `LLM` drive. `factory.create_engine` picks one
from the flags: one `LLMEngine`, `DataParallelEngine` (replicas), `DisaggregatedEngine` (prefill
and decode engines); `multihost.StreamLeader` replays the leader's requests in follower processes.
`LLM` and `AsyncEngine` hold whichever it returns."""
