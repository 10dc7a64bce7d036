"""Request errors, raised at submit / load time so that nothing else in the engine is touched.

Each class carries the HTTP status and the OpenAI-style error `code` the server answers with.
"""


class RequestError(ValueError):
    """A request the engine refuses; `status` is the HTTP status the server maps it to."""
    status = 400
    code = "invalid_request"


class UnknownAdapterError(RequestError):
    """The requested model / adapter name is not loaded."""
    status = 404
    code = "model_not_found"


class PromptTooLongError(RequestError):
    """prompt (+ max_tokens) does not fit the per-slot KV cache."""
    code = "context_length_exceeded"


class AdapterInUseError(RequestError):
    """Unloading an adapter that running or queued requests still use."""
    status = 409
    code = "adapter_in_use"


class AdapterExistsError(RequestError):
    """Loading under a name that is already loaded."""
    status = 409
    code = "adapter_exists"


class AdapterCapacityError(RequestError):
    """Every adapter slot of the bank is taken."""
    status = 409
    code = "adapter_capacity_exhausted"


class AdapterLoadError(RequestError):
    """An adapter folder is missing, malformed, or does not fit the bank (targets, rank, kind)."""
    code = "adapter_load_failed"
