"""Request errors, raised at submit / load time so that nothing else in the engine is touched.

Each class carries the HTTP status and the OpenAI-style error `code` the server answers with, and
`public_message`: what a client is told. It is the message itself, except where the message holds
details only the server's operator may see (an adapter load error's server paths and file contents:
`AdapterLoadError`).
"""


class RequestError(ValueError):
    """A request the engine refuses; `status` is the HTTP status the server maps it to."""
    status = 400
    code = "invalid_request"

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param

    @property
    def public_message(self) -> str:
        """The message a client gets (the server's error handlers and streams send only this)."""
        return str(self)


class UnknownAdapterError(RequestError):
    """The requested model / adapter name is not loaded."""
    status = 404
    code = "model_not_found"


class PromptTooLongError(RequestError):
    """prompt (+ max_tokens) does not fit the context length (max_model_len)."""
    code = "context_length_exceeded"


class InvocationMissingError(RequestError):
    """The prompt of a request for an activated (aLoRA) adapter lacks the adapter's invocation sequence."""
    code = "invocation_missing"


class AdapterInUseError(RequestError):
    """Unloading an adapter that running or queued requests still use (without draining), or loading
    a name whose previous registration is still draining."""
    status = 409
    code = "adapter_in_use"


class AdapterExistsError(RequestError):
    """Loading under a name that is already loaded."""
    status = 409
    code = "adapter_exists"


class AdapterCapacityError(RequestError):
    """No room for another adapter: every registration (max_registered) is in use, or the engine
    has no adapter slots at all."""
    status = 409
    code = "adapter_capacity_exhausted"


class AdapterDirError(RequestError):
    """Loading or unloading, over the API, a name that a folder in the adapter directory
    (`--adapter-dir`) provides: such adapters are managed on disk (add, replace or remove the folder)."""
    status = 409
    code = "adapter_in_adapter_dir"


class AdapterLoadError(RequestError):
    """An adapter folder is missing, malformed, or does not fit the bank (targets, rank, kind).

    `str(e)` is the full detail (server paths, the loader's message, which may quote the files'
    contents) for the operator and library callers; `public_message` names the adapter and the
    problem without either, for clients."""
    code = "adapter_load_failed"

    def __init__(self, message: str = "", param: str | None = None, public: str | None = None):
        super().__init__(message, param)
        self._public = public

    @property
    def public_message(self) -> str:
        return str(self) if self._public is None else self._public


class AdapterFitError(AdapterLoadError):
    """A valid adapter that does not fit the server's adapter bank (its rank above the bank's, a
    target or kind the bank has no slots for): the server's --lora-rank / --reft-rank decide."""


class QueueFullError(RequestError):
    """The engine's wait queue is at its limit; retry later (the server adds Retry-After)."""
    status = 429
    code = "queue_full"


class UnavailableError(RequestError):
    """The engine is shutting down or is not running."""
    status = 503
    code = "unavailable"


class AuthenticationError(RequestError):
    """Missing or wrong API key."""
    status = 401
    code = "invalid_api_key"


class PermissionDeniedError(RequestError):
    """A valid caller asking for something it may not do (e.g. adapter admin without the admin key)."""
    status = 403
    code = "permission_denied"


class PayloadTooLargeError(RequestError):
    status = 413
    code = "payload_too_large"


class EngineError(RuntimeError):
    """The engine failed a request after it was accepted (not the request's fault, or a step failure
    that could not be attributed). `status` / `code` say how the server reports it."""
    status = 500
    code = "engine_error"

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class DeadlineExceededError(EngineError):
    """The request ran past its total deadline (queue wait + generation)."""
    status = 504
    code = "deadline_exceeded"
