"""Error types users see. Each message names the bad field, file or value."""


class JaxinferError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class ConfigError(JaxinferError):
    """A model's config.json asks for something jaxinfer does not implement, or is malformed."""


class CheckpointError(JaxinferError):
    """A checkpoint directory or tensor file is missing, incomplete or mis-shaped."""


class TokenizerError(JaxinferError):
    """A tokenizer file or chat template cannot be used."""


class RequestFailedError(JaxinferError):
    """The engine failed one request while building, running or processing its step (a server
    fault, not the client's): the request is aborted and its blocks freed, the engine goes on.
    `request_ids` names the requests at fault; `__cause__` is the original exception."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()):
        super().__init__(message)
        self.request_ids = tuple(request_ids)

    def __reduce__(self):  # pickled whole across the engine-core process boundary
        return type(self), (str(self), self.request_ids)


class InvalidRequestError(JaxinferError, ValueError):
    """A request's parameters or prompt are invalid; `param` names the offending field
    (e.g. "temperature", "prompt", "max_tokens") so the server can report it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole across the engine-core process boundary
        return type(self), (str(self), self.param)
